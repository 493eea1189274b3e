//! The admin listener: `/metrics` (Prometheus text format), `/healthz` (the process answers)
//! and `/readyz` (the API listener accepts connections, every pool has a backend that takes
//! traffic, and the process is not draining).

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use super::Metrics;

/// The names of the pools that have no backend taking traffic now.
pub type Unready = Box<dyn Fn() -> Vec<String> + Send + Sync>;

pub struct AdminApp {
    pub metrics: Metrics,
    /// What `/readyz` reports besides the API listener.
    pub unready: Unready,
    /// The API listener, checked by `/readyz` (pingora starts its services independently, so the
    /// admin listener can answer before the API one is bound).
    pub api: std::net::SocketAddr,
    /// Draining after SIGTERM: not ready.
    pub lifecycle: std::sync::Arc<super::Lifecycle>,
}

fn reply(status: u16, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, content_type)
        .header(http::header::CONTENT_LENGTH, body.len())
        .body(body)
        .unwrap_or_else(|_| Response::new(Vec::new()))
}

impl AdminApp {
    async fn api_listening(&self) -> bool {
        let mut addr = self.api;
        if addr.ip().is_unspecified() {
            addr.set_ip(if addr.is_ipv4() {
                [127, 0, 0, 1].into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            });
        }
        let connect = tokio::net::TcpStream::connect(addr);
        matches!(tokio::time::timeout(std::time::Duration::from_millis(500), connect).await, Ok(Ok(_)))
    }
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/metrics" => reply(200, "text/plain; version=0.0.4", self.metrics.render()),
            "/healthz" => reply(200, "text/plain", b"ok\n".to_vec()),
            "/readyz" if self.lifecycle.draining() => {
                reply(503, "text/plain", b"draining: shutting down\n".to_vec())
            }
            "/readyz" if !self.api_listening().await => reply(
                503,
                "text/plain",
                format!("API listener {} not accepting yet\n", self.api).into_bytes(),
            ),
            "/readyz" => match (self.unready)().as_slice() {
                [] => reply(200, "text/plain", b"ready\n".to_vec()),
                pools => {
                    reply(503, "text/plain", format!("no backend up in: {}\n", pools.join(", ")).into_bytes())
                }
            },
            _ => reply(404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n".to_vec()),
        }
    }
}
