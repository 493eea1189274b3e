//! The OTLP trace export: finished traces from the [`Tracer`](crate::observe::Tracer)'s queue,
//! batched and posted as OTLP/HTTP JSON to `[tracing] otlp_endpoint` every
//! `export_interval_ms` (and at once when a batch grows large). A collector that is down or
//! slow costs the batch, counted in `warmpath_trace_exports_total{result="error"}`, never a
//! request.

use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::config::OtlpTarget;
use crate::observe::trace::{encode, Span};
use crate::observe::Metrics;

/// Spans sent in one call at most.
const MAX_BATCH: usize = 2048;
/// One export call's whole time.
const TIMEOUT: Duration = Duration::from_secs(5);

pub struct OtlpExport {
    pub target: OtlpTarget,
    pub service_name: String,
    pub every: Duration,
    pub metrics: Metrics,
    pub queue: Mutex<Option<mpsc::Receiver<Vec<Span>>>>,
}

impl OtlpExport {
    async fn send(&self, spans: &[Span]) {
        let body = encode(&self.service_name, spans);
        let ok = matches!(tokio::time::timeout(TIMEOUT, post(&self.target, &body)).await, Ok(Ok(s)) if (200..300).contains(&s));
        if !ok {
            tracing::debug!(spans = spans.len(), "OTLP export failed");
        }
        self.metrics.trace_exports.with_label_values(&[if ok { "ok" } else { "error" }]).inc();
    }
}

/// One POST on its own connection; the status the collector answered.
async fn post(t: &OtlpTarget, body: &[u8]) -> std::io::Result<u16> {
    let mut s =
        tokio::net::TcpStream::connect((t.host.trim_matches(|c| c == '[' || c == ']'), t.port)).await?;
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: {}:{}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        t.path,
        t.host,
        t.port,
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    // The whole answer (the collector closes after it: `connection: close`), at most 64 KiB.
    let mut answer = Vec::new();
    (&mut s).take(64 << 10).read_to_end(&mut answer).await?;
    // `HTTP/1.1 200 OK`
    answer
        .get(9..12)
        .and_then(|c| std::str::from_utf8(c).ok())
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP answer"))
}

#[async_trait]
impl BackgroundService for OtlpExport {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(mut rx) = self.queue.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        let mut batch: Vec<Span> = Vec::new();
        // Asleep while nothing waits: a batch goes `every` after its first trace came.
        let mut due = tokio::time::Instant::now();
        loop {
            let wait = (!batch.is_empty()).then_some(due);
            let flush = async move {
                match wait {
                    None => std::future::pending().await,
                    Some(d) => tokio::time::sleep_until(d).await,
                }
            };
            tokio::select! {
                got = rx.recv() => match got {
                    Some(spans) => {
                        if batch.is_empty() {
                            due = tokio::time::Instant::now() + self.every;
                        }
                        batch.extend(spans);
                        if batch.len() >= MAX_BATCH {
                            self.send(&std::mem::take(&mut batch)).await;
                        }
                    }
                    None => break,
                },
                _ = flush => self.send(&std::mem::take(&mut batch)).await,
                _ = shutdown.changed() => break,
            }
        }
        // What is left goes out before the process ends.
        while let Ok(spans) = rx.try_recv() {
            batch.extend(spans);
        }
        if !batch.is_empty() {
            self.send(&batch).await;
        }
    }
}
