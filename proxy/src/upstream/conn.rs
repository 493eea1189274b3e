//! One HTTP/1.1 connection to a backend: a request's head and body written in one system call
//! (a vectored write), its response head and body read through one buffer, every read and
//! write under the backend's idle timeout. Plain TCP is a tokio socket; `https://` backends
//! get their TLS stream from pingora's transport connector (certificates, SNI, client keys).
//!
//! Why not pingora's HTTP/1 client: per proxied request it wrote the head and the body in two
//! `sendto`s, asked the kernel for a pooled connection's peer (`getpeername`) on every reuse,
//! and parked each released connection behind a spawned idle-watch task; and it handed a
//! chunked body over one chunk at a time, so the chunks of one read cost one relay step each.
//! Here a read's whole chunks come out together, and an idle connection is checked with
//! tokio's readiness, which costs no system call while the backend has sent nothing.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use pingora::time::fast_timeout::fast_timeout;
use pingora::{Error, ErrorType, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{sleep_until, Instant, Sleep};

use super::wire::{parse_response, BodyDecoder, Framing};

/// Room a read asks of the buffer: an SSE event or a small answer in one read.
const READ_ROOM: usize = 16 * 1024;

/// The transport under a connection.
pub enum Io {
    Tcp(TcpStream),
    /// TLS (pingora's stream: rustls over its TCP stream).
    Tls(pingora::protocols::Stream),
}

/// Which I/O reactor a socket made on this thread is registered with. A tokio socket stays
/// with the reactor that was current when it was made; used from a task on another runtime,
/// each of its readiness events wakes that runtime's thread, which wakes the user's through
/// an eventfd: two system calls and a thread switch more per read. pingora runs each service
/// on its own runtime (the health checks and load scrapes apart from the API), by default one
/// current-thread runtime per thread, so the thread is the reactor; a work-stealing runtime's
/// threads share one, and pingora names them after their service, so their name is.
pub fn home() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static HOME: u64 = {
            let shared = matches!(
                tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
                Ok(tokio::runtime::RuntimeFlavor::MultiThread)
            );
            match std::thread::current().name() {
                // Odd values for names, even for threads: the two never meet.
                Some(name) if shared => xxhash_rust::xxh3::xxh3_64(name.as_bytes()) | 1,
                _ => NEXT.fetch_add(1, Ordering::Relaxed) << 1,
            }
        };
    }
    HOME.with(|h| *h)
}

/// One connection to a backend and where its current exchange stands.
pub struct Conn {
    io: Io,
    /// The reactor its socket is registered with ([`home`]).
    pub(super) home: u64,
    /// A streamed answer is acknowledged at once throughout, not only its head (its backend's
    /// `[upstream] stream_acks = "quick"`, fixed for the connection's life: a changed setting
    /// makes new backends, with new pools): see [`Conn::ack_now`].
    quick_acks: bool,
    /// Bytes read and not yet taken (a partial head, body bytes).
    buf: BytesMut,
    body: Option<BodyDecoder>,
    keep_alive: bool,
    /// A read or write failed, or an exchange was left unfinished: never reused.
    broken: bool,
    timeout: Option<Duration>,
    /// The reads' idle-timeout timer: armed at an exchange's first read and moved only when it
    /// fires before the current read's deadline (a lazy deadline), so a stream's reads do not
    /// each add and remove a timer. Dropped when the connection goes idle.
    timer: Option<Pin<Box<Sleep>>>,
}

impl Conn {
    /// A connection over `io` whose every read and write may wait at most `timeout`, with
    /// `quick_acks` for streamed answers.
    pub fn new(io: Io, timeout: Option<Duration>, quick_acks: bool) -> Conn {
        Conn {
            io,
            home: home(),
            quick_acks,
            buf: BytesMut::new(),
            body: None,
            keep_alive: false,
            broken: false,
            timeout,
            timer: None,
        }
    }

    /// Writes a request: `head` (from [`super::wire::RequestHead`]) and `body` together.
    pub async fn send(&mut self, head: &[u8], body: &[u8]) -> Result<()> {
        self.body = None;
        self.broken = true;
        let write = async {
            let total = head.len() + body.len();
            let mut done = 0;
            while done < total {
                let n = if done < head.len() {
                    let parts = [IoSlice::new(&head[done..]), IoSlice::new(body)];
                    self.io.write_vectored(&parts).await?
                } else {
                    self.io.write(&body[done - head.len()..]).await?
                };
                if n == 0 {
                    return Err(std::io::ErrorKind::WriteZero.into());
                }
                done += n;
            }
            self.io.flush().await
        };
        match self.timeout {
            Some(t) => fast_timeout(t, write).await.map_err(|_| timed_out(ErrorType::WriteTimedout))?,
            None => write.await,
        }
        .map_err(|e| Error::because(ErrorType::WriteError, "writing to the backend", e))?;
        self.broken = false;
        Ok(())
    }

    /// Reads the response head (past any 1xx interim responses); the body follows with
    /// [`Conn::read_response_body`].
    pub async fn read_response_header(&mut self) -> Result<ResponseHeader> {
        self.broken = true;
        loop {
            if let Some(head) = parse_response(&self.buf)? {
                let _ = self.buf.split_to(head.len);
                if head.header.status.is_informational() {
                    continue;
                }
                self.keep_alive = head.keep_alive;
                self.body = Some(BodyDecoder::new(head.framing));
                if !whole(head.framing, &self.buf) {
                    // More is to come (a stream): see `ack_now`.
                    self.ack_now();
                }
                self.broken = false;
                return Ok(head.header);
            }
            if self.read_more().await? == 0 {
                return Err(Error::explain(
                    ErrorType::ConnectionClosed,
                    "the backend closed the connection before a response",
                ));
            }
        }
    }

    /// The next piece of the response body (all that one read brought, framing removed);
    /// `None` once it has ended.
    pub async fn read_response_body(&mut self) -> Result<Option<Bytes>> {
        loop {
            let Some(body) = &mut self.body else { return Ok(None) };
            let piece = match body.decode(&mut self.buf) {
                Ok(p) => p,
                Err(e) => {
                    self.broken = true;
                    return Err(e);
                }
            };
            if !piece.is_empty() {
                return Ok(Some(piece));
            }
            if body.done() {
                return Ok(None);
            }
            if self.read_more().await? == 0 {
                // A body read to the close ends here (the connection with it); any other is cut.
                self.keep_alive = false;
                if let Some(Err(e)) = self.body.as_mut().map(BodyDecoder::eof) {
                    self.broken = true;
                    return Err(e);
                }
            }
        }
    }

    /// Whether the whole response body has been read.
    pub fn response_done(&self) -> bool {
        self.body.as_ref().is_some_and(BodyDecoder::done)
    }

    /// Whether another request may use this connection: its response read to the end, nothing
    /// unread, the backend keeping it open.
    pub fn reusable(&self) -> bool {
        self.keep_alive && !self.broken && self.response_done() && self.buf.is_empty()
    }

    /// Whether an idle connection is still good: the backend has neither closed it nor sent
    /// anything. A plain socket answers from tokio's readiness (no system call unless the
    /// reactor saw it readable); a TLS one is trusted (a stale one fails on use and the
    /// request is sent again on a new connection).
    pub fn idle_ok(&self) -> bool {
        match &self.io {
            Io::Tcp(s) => {
                matches!(s.try_read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            }
            Io::Tls(_) => true,
        }
    }

    /// Acknowledges what came in at once. A kept-alive connection is in the kernel's
    /// interactive mode, which delays an ACK up to 40 ms; a server that writes without
    /// TCP_NODELAY (Nagle's algorithm) holds its first token until the head it wrote is
    /// acknowledged — 40 ms of every streamed answer's time to first token. `TCP_QUICKACK`
    /// on sends the ACK and leaves interactive mode; off again puts the connection back in it
    /// (unless `quick_acks`), so that the rest of the answer's events are acknowledged as the
    /// kernel would, a few together: ACKed one by one they cost a stream 5–18 % more
    /// CPU (measured in `bench/results/overhead-acks-2026-12-07.md`). Only for an answer that
    /// is not whole with its head: the ACK is a packet of its own (about 5 µs of CPU on a
    /// small request), which an answer already in is spared.
    fn ack_now(&self) {
        #[cfg(target_os = "linux")]
        if let Io::Tcp(s) = &self.io {
            let s = socket2::SockRef::from(s);
            let _ = s.set_tcp_quickack(true);
            if !self.quick_acks {
                let _ = s.set_tcp_quickack(false);
            }
        }
    }

    /// Reads more into the buffer: how many bytes (0 at the end of the connection).
    async fn read_more(&mut self) -> Result<usize> {
        if self.buf.capacity() - self.buf.len() < READ_ROOM / 4 {
            self.buf.reserve(READ_ROOM);
        }
        let Some(t) = self.timeout else {
            let r = self.io.read_buf(&mut self.buf).await;
            return r.map_err(|e| self.read_failed(e));
        };
        let due = Instant::now() + t;
        let timer = self.timer.get_or_insert_with(|| Box::pin(sleep_until(due)));
        let r = {
            let read = self.io.read_buf(&mut self.buf);
            tokio::pin!(read);
            loop {
                tokio::select! {
                    biased;
                    r = &mut read => break Some(r),
                    () = timer.as_mut() => {
                        if Instant::now() >= due {
                            break None;
                        }
                        // Armed for an earlier read: moved to this one's deadline.
                        timer.as_mut().reset(due);
                    }
                }
            }
        };
        match r {
            Some(r) => r.map_err(|e| self.read_failed(e)),
            None => {
                self.broken = true;
                Err(timed_out(ErrorType::ReadTimedout))
            }
        }
    }

    fn read_failed(&mut self, e: std::io::Error) -> Box<Error> {
        self.broken = true;
        Error::because(ErrorType::ReadError, "reading from the backend", e)
    }

    /// Readies a connection to idle between exchanges: its timer goes (so that a waker of
    /// the finished request is not kept).
    pub fn park(&mut self) {
        self.timer = None;
    }
}

/// Whether `buf`, what followed a response head, already holds its whole body (by its length,
/// or ending as a chunked body ends).
fn whole(framing: Framing, buf: &[u8]) -> bool {
    match framing {
        Framing::Length(n) => buf.len() as u64 >= n,
        Framing::Chunked => buf.ends_with(b"0\r\n\r\n"),
        Framing::Close => false,
    }
}

fn timed_out(kind: ErrorType) -> Box<Error> {
    Error::explain(kind, "the backend was silent past the idle timeout")
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Tcp(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_whole_with_its_head_only_when_its_body_is_in() {
        assert!(whole(Framing::Length(2), b"hi"));
        assert!(!whole(Framing::Length(3), b"hi"));
        assert!(whole(Framing::Chunked, b"2\r\nhi\r\n0\r\n\r\n"));
        assert!(!whole(Framing::Chunked, b"2\r\nhi\r\n"));
        assert!(!whole(Framing::Close, b"everything"), "a body to the close is never known whole");
    }

    /// A kept-alive connection, its first request answered whole, then a second answered with
    /// a stream's head only: the connection's delayed-ACK mode once that head is read.
    async fn interactive_after_a_streamed_head(quick_acks: bool) -> bool {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await;
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi").await.unwrap();
            let _ = s.read(&mut req).await;
            s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").await.unwrap();
            // Held open, the stream's events never coming.
            let _ = s.read(&mut req).await;
        });
        let mut c = Conn::new(
            Io::Tcp(TcpStream::connect(addr).await.unwrap()),
            Some(Duration::from_secs(5)),
            quick_acks,
        );
        let request = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n";
        c.send(request, b"").await.unwrap();
        c.read_response_header().await.unwrap();
        while c.read_response_body().await.unwrap().is_some() {}
        c.send(request, b"").await.unwrap();
        c.read_response_header().await.unwrap();
        let Io::Tcp(s) = &c.io else { unreachable!() };
        // Linux reads TCP_QUICKACK back as "not in interactive mode".
        let quick = socket2::SockRef::from(s).tcp_quickack().unwrap();
        server.abort();
        quick
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_streamed_heads_ack_leaves_later_acks_delayed_unless_quick() {
        assert!(
            !interactive_after_a_streamed_head(false).await,
            "stream_acks = head: back in delayed-ACK mode"
        );
        assert!(interactive_after_a_streamed_head(true).await, "stream_acks = quick: ACKs at once");
    }
}
