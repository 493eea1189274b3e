//! The bound on the API listener's open connections (`[limits] max_connections`): each
//! accepted connection (after its TLS handshake) holds a slot until it closes; one past the
//! bound is shed at once, with a 503 in the OpenAI error shape and `connection: close`, before
//! anything of it is parsed or routed. A load balancer's `GET /health` is still answered on a
//! shed connection (from the same readiness as always), so a full proxy looks busy, not dead.
//! The admin listener is not bounded: metrics and `/readyz` answer under any load.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::{Stream, ALPN};
use pingora::server::ShutdownWatch;
use prometheus::{IntCounter, IntGauge};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warmpath_wire::openai::ApiError;

/// How long a shed connection may take to send the head of its request (to tell a health
/// probe from the rest) and to take the answer.
const SHED_DEADLINE: Duration = Duration::from_secs(1);
/// The most of a shed connection's request that is read.
const SHED_HEAD: usize = 4096;

/// The count of open API connections, shared by the listener's app and its metrics.
#[derive(Debug)]
pub struct OpenConnections {
    open: AtomicUsize,
    /// `warmpath_connections_open`.
    gauge: IntGauge,
    /// `warmpath_connections_rejected_total`.
    rejected: IntCounter,
}

impl OpenConnections {
    pub fn new(gauge: IntGauge, rejected: IntCounter) -> OpenConnections {
        OpenConnections { open: AtomicUsize::new(0), gauge, rejected }
    }

    /// A slot for one more connection, or `None` when `max` are open.
    fn admit(self: &Arc<Self>, max: usize) -> Option<Slot> {
        if self.open.fetch_add(1, Ordering::AcqRel) >= max {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        self.gauge.inc();
        Some(Slot(self.clone()))
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// One admitted connection; dropping it frees the slot.
struct Slot(Arc<OpenConnections>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
        self.0.gauge.dec();
    }
}

/// What a connection past the bound is told about the process's readiness: `None` when
/// ready, else why not (what `GET /health` answers).
pub type Readiness = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// A pingora app whose connections are bounded in number.
pub struct Admitted<A> {
    pub inner: Arc<A>,
    pub open: Arc<OpenConnections>,
    /// The bound now (the policy's, which a reload may change).
    pub max: Box<dyn Fn() -> usize + Send + Sync>,
    pub readiness: Readiness,
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Admitted<A> {
    async fn process_new(self: &Arc<Self>, stream: Stream, shutdown: &ShutdownWatch) -> Option<Stream> {
        let max = (self.max)();
        let Some(slot) = self.open.admit(max) else {
            self.open.rejected.inc();
            tracing::debug!(max, "connection shed: max_connections are open");
            shed(stream, max, &self.readiness).await;
            return None;
        };
        // The connection's requests (kept alive) are all served here, so the slot is held
        // exactly as long as the connection.
        let mut next = self.inner.process_new(stream, shutdown).await;
        while let Some(stream) = next {
            next = self.inner.process_new(stream, shutdown).await;
        }
        drop(slot);
        None
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await
    }
}

/// Answers a connection past the bound and closes it: `GET /health` from readiness, anything
/// else 503 `too_many_connections` with `retry-after`. An HTTP/2 connection is just closed
/// (its client retries on a new one).
async fn shed(mut stream: Stream, max: usize, readiness: &Readiness) {
    if stream.selected_alpn_proto() == Some(ALPN::H2) {
        return;
    }
    let _ = tokio::time::timeout(SHED_DEADLINE, async {
        let mut head = Vec::with_capacity(256);
        let mut buf = [0u8; 512];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < SHED_HEAD {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let probe = head.starts_with(b"GET /health ") || head.starts_with(b"GET /health?");
        let answer = match probe.then(readiness) {
            Some(None) => "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned(),
            Some(Some(why)) => {
                response(&ApiError::unavailable(why).with_code("not_ready"))
            }
            None => response(
                &ApiError::unavailable(format!(
                    "warmpath has {max} connections open, as many as [limits] max_connections allows; retry shortly"
                ))
                .with_code("too_many_connections"),
            ),
        };
        let _ = stream.write_all(answer.as_bytes()).await;
        let _ = stream.flush().await;
    })
    .await;
}

fn response(e: &ApiError) -> String {
    let body = e.to_json();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_count_open_connections_and_free_on_drop() {
        let open = Arc::new(OpenConnections::new(
            IntGauge::new("g", "g").unwrap(),
            IntCounter::new("c", "c").unwrap(),
        ));
        let a = open.admit(2).expect("first");
        let b = open.admit(2).expect("second");
        assert!(open.admit(2).is_none(), "a third past a bound of 2");
        assert_eq!((open.open(), open.gauge.get()), (2, 2));
        drop(a);
        assert_eq!((open.open(), open.gauge.get()), (1, 1));
        let c = open.admit(2).expect("a freed slot is taken again");
        drop((b, c));
        assert_eq!((open.open(), open.gauge.get()), (0, 0));
    }
}
