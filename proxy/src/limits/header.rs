//! The total header-read deadline. pingora times each socket read on its own (60 s), so a
//! client that trickles one header byte a minute (slowloris) would hold a connection forever.
//! [`HeaderDeadline`] wraps each accepted connection: from accept (or, on a kept-alive
//! connection, from the first byte of the next request) the whole header must arrive within
//! the deadline, or reads fail and pingora drops the connection. `early_request_filter` lifts
//! the deadline once the header is in ([`headers_done`]) and the `logging` phase arms it again
//! for the connection's next request ([`request_done`]); the body has its own deadline.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::tls::SslDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use pingora::proxy::Session;
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A connection whose request header must arrive within a deadline.
pub struct HeaderDeadline {
    inner: Stream,
    limit: Duration,
    /// Running while a header is being read; `None` before the first byte of a reused
    /// connection's next request.
    timer: Option<Pin<Box<Sleep>>>,
    /// Set once the header is in.
    done: Arc<AtomicBool>,
    /// Set when a request finished: the next read starts a new header (timer from its first byte).
    rearm: Arc<AtomicBool>,
    /// An HTTP/2 connection: its requests are streams that overlap, each with its own header
    /// frames, so the one-header-at-a-time deadline does not apply (it would cut a long stream
    /// once a sibling stream ended).
    off: Arc<AtomicBool>,
}

impl fmt::Debug for HeaderDeadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeaderDeadline").field("limit", &self.limit).finish_non_exhaustive()
    }
}

impl HeaderDeadline {
    fn new(inner: Stream, limit: Duration) -> HeaderDeadline {
        let timer = Some(Box::pin(tokio::time::sleep(limit)));
        HeaderDeadline {
            inner,
            limit,
            timer,
            done: Arc::new(AtomicBool::new(false)),
            rearm: Arc::new(AtomicBool::new(false)),
            off: Arc::new(AtomicBool::new(false)),
        }
    }
}

fn deadline_of(session: &Session) -> Option<&HeaderDeadline> {
    session.stream().and_then(|s| s.as_any().downcast_ref::<HeaderDeadline>())
}

/// Lifts the header deadline of the session's connection (called once the header is parsed);
/// for good on an HTTP/2 connection.
pub fn headers_done(session: &Session) {
    if let Some(d) = deadline_of(session) {
        d.done.store(true, Ordering::Release);
        if session.is_http2() {
            d.off.store(true, Ordering::Release);
        }
    }
}

/// Arms the deadline for the next request on the session's kept-alive connection: it starts
/// with that request's first byte, so idle keep-alive time does not count.
pub fn request_done(session: &Session) {
    if let Some(d) = deadline_of(session).filter(|d| !d.off.load(Ordering::Acquire)) {
        d.rearm.store(true, Ordering::Release);
        d.done.store(false, Ordering::Release);
    }
}

impl AsyncRead for HeaderDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.rearm.swap(false, Ordering::AcqRel) {
            this.timer = None;
        }
        if this.done.load(Ordering::Acquire) {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        if let Some(t) = this.timer.as_mut() {
            if t.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("request header not received within {:?}", this.limit),
                )));
            }
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if this.timer.is_none() && buf.filled().len() > before {
            let mut t = Box::pin(tokio::time::sleep_until(Instant::now() + this.limit));
            let _ = t.as_mut().poll(cx); // registers the waker
            this.timer = Some(t);
        }
        r
    }
}

impl AsyncWrite for HeaderDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[async_trait]
impl Shutdown for HeaderDeadline {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await
    }
}

impl UniqueID for HeaderDeadline {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeaderDeadline {
    fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
        self.inner.get_ssl_digest()
    }
    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeaderDeadline {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }
    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }
    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeaderDeadline {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for HeaderDeadline {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

#[async_trait]
impl Peek for HeaderDeadline {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

/// A pingora app whose connections get a header deadline.
pub struct WithHeaderDeadline<A> {
    pub inner: Arc<A>,
    pub limit: Duration,
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for WithHeaderDeadline<A> {
    async fn process_new(self: &Arc<Self>, stream: Stream, shutdown: &ShutdownWatch) -> Option<Stream> {
        // pingora serves a kept-alive HTTP/1 connection's later requests inside this call.
        let stream: Stream = if stream.as_any().is::<HeaderDeadline>() {
            stream
        } else {
            Box::new(HeaderDeadline::new(stream, self.limit))
        };
        self.inner.process_new(stream, shutdown).await
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await
    }
}
