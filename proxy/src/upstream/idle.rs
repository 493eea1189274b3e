//! A backend's idle connections, kept for the next request: the most recently used is taken
//! first (the one least likely to have been closed by the backend), those idle past the pool's
//! timeout are closed when the pool is next touched, and at most [`MAX_IDLE`] are kept. A
//! connection is handed only to a task on the reactor it was made on ([`home`]): the health
//! checks' connections serve the health checks, the API's the API.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::conn::{home, Conn};

/// Most idle connections kept per backend.
pub const MAX_IDLE: usize = 128;

/// One backend's idle connections, oldest first.
#[derive(Default)]
pub struct IdlePool {
    conns: Mutex<Vec<(Conn, Instant)>>,
}

impl std::fmt::Debug for IdlePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.conns.lock().map_or(0, |c| c.len());
        f.debug_struct("IdlePool").field("idle", &n).finish()
    }
}

impl IdlePool {
    /// An idle connection of this thread's reactor still good to use, if there is one; those
    /// that idled past `max_idle` or that the backend closed meanwhile are closed.
    pub fn take(&self, max_idle: Duration) -> Option<Conn> {
        let now = Instant::now();
        let here = home();
        let mut closing = Vec::new();
        let found = {
            let Ok(mut conns) = self.conns.lock() else { return None };
            let fresh =
                conns.iter().position(|(_, at)| now.duration_since(*at) < max_idle).unwrap_or(conns.len());
            closing.extend(conns.drain(..fresh));
            loop {
                let Some(at) = conns.iter().rposition(|(c, _)| c.home == here) else { break None };
                let (c, since) = conns.remove(at);
                if c.idle_ok() {
                    break Some(c);
                }
                closing.push((c, since));
            }
        };
        // Closed outside the lock: each close is a system call.
        drop(closing);
        found
    }

    /// Keeps a connection whose exchange ended cleanly (the caller checked
    /// [`Conn::reusable`]); past [`MAX_IDLE`] the oldest is closed.
    pub fn put(&self, conn: Conn) {
        let evicted = {
            let Ok(mut conns) = self.conns.lock() else { return };
            let evicted = (conns.len() >= MAX_IDLE).then(|| conns.remove(0));
            conns.push((conn, Instant::now()));
            evicted
        };
        drop(evicted);
    }

    /// How many are idle now.
    #[cfg(test)]
    fn count(&self) -> usize {
        self.conns.lock().map_or(0, |c| c.len())
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::upstream::conn::Io;

    /// A connection to a server that answers one request with `answer`, then (with `close`)
    /// closes its end; the connection's response is read.
    async fn exchanged(answer: &'static [u8], close: bool) -> Conn {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await;
            s.write_all(answer).await.unwrap();
            if !close {
                // Held open until the client closes.
                let _ = s.read(&mut req).await;
            }
        });
        let mut c =
            Conn::new(Io::Tcp(TcpStream::connect(addr).await.unwrap()), Some(Duration::from_secs(5)), false);
        c.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", b"").await.unwrap();
        c.read_response_header().await.unwrap();
        while c.read_response_body().await.unwrap().is_some() {}
        c
    }

    #[tokio::test]
    async fn a_kept_connection_is_taken_again_and_a_closed_or_old_one_is_not() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi";
        let pool = IdlePool::default();
        let c = exchanged(ok, false).await;
        assert!(c.reusable());
        pool.put(c);
        assert!(pool.take(Duration::from_secs(10)).is_some(), "a kept-alive connection is reused");

        // The backend closes it while it idles: the reactor sees the end, take() closes it.
        let c = exchanged(ok, true).await;
        assert!(c.reusable(), "nothing said it would close");
        pool.put(c);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            pool.take(Duration::from_secs(10)).is_none(),
            "a connection its backend closed is not reused"
        );
        assert_eq!(pool.count(), 0);

        // Idle past the pool's timeout.
        pool.put(exchanged(ok, false).await);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(pool.take(Duration::from_millis(10)).is_none());
        assert_eq!(pool.count(), 0, "an expired connection is closed, not kept");
    }

    #[tokio::test]
    async fn a_connection_made_on_another_runtime_is_left_to_it() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi";
        let pool = std::sync::Arc::new(IdlePool::default());
        let (made_tx, made_rx) = tokio::sync::oneshot::channel();
        let (checked_tx, checked_rx) = tokio::sync::oneshot::channel::<()>();
        let theirs = pool.clone();
        // Another runtime (as pingora's health-check service has) makes one and parks it,
        // then takes it back once this runtime has looked.
        let other = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                theirs.put(exchanged(ok, false).await);
                made_tx.send(()).unwrap();
                checked_rx.await.unwrap();
                theirs.take(Duration::from_secs(10)).is_some()
            })
        });
        made_rx.await.unwrap();
        assert!(
            pool.take(Duration::from_secs(10)).is_none(),
            "another reactor's connection is not handed here"
        );
        pool.put(exchanged(ok, false).await);
        assert_eq!(pool.count(), 2);
        checked_tx.send(()).unwrap();
        assert!(other.join().unwrap(), "its own runtime takes it again");
        assert!(pool.take(Duration::from_secs(10)).is_some(), "and this one's is here");
    }

    #[tokio::test]
    async fn responses_that_end_the_connection_are_not_kept() {
        let close =
            exchanged(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi", true).await;
        assert!(close.response_done() && !close.reusable());
        let to_eof = exchanged(b"HTTP/1.1 200 OK\r\n\r\nall until the end", true).await;
        assert!(to_eof.response_done() && !to_eof.reusable());
        let chunked =
            exchanged(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n", false)
                .await;
        assert!(chunked.reusable());
    }
}
