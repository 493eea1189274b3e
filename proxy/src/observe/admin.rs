//! The admin listener: `/metrics` (Prometheus text format), `/healthz` (the process answers),
//! `/readyz` (the API listener accepts connections, every pool has a backend that takes
//! traffic, and the process is not draining), `POST /reload` (the policy file read again), and
//! the status page: `GET /` (one HTML page, no external assets, drawing `GET /status.json`).

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use super::Metrics;

/// What keeps the process from serving now (pools with no backend up, keys not read).
pub type Unready = Box<dyn Fn() -> Vec<String> + Send + Sync>;

/// What `/status.json` shows, built from the state of the moment.
pub type Status = Box<dyn Fn() -> serde_json::Value + Send + Sync>;

/// The status page: it fetches `/status.json` and draws it, every two seconds.
const STATUS_PAGE: &str = include_str!("status.html");

/// A policy reload (`POST /reload`): what was reloaded, or why not.
#[async_trait]
pub trait Reload: Send + Sync {
    async fn reload(&self, why: &str) -> Result<String, String>;
}

pub struct AdminApp {
    pub metrics: Metrics,
    /// What `/readyz` reports besides the API listener.
    pub unready: Unready,
    /// The API listener, checked by `/readyz` (pingora starts its services independently, so the
    /// admin listener can answer before the API one is bound).
    pub api: std::net::SocketAddr,
    /// Draining after SIGTERM: not ready.
    pub lifecycle: std::sync::Arc<super::Lifecycle>,
    /// `POST /reload`.
    pub reload: std::sync::Arc<dyn Reload>,
    /// `/status.json`.
    pub status: Status,
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
        let post = session.req_header().method == http::Method::POST;
        match session.req_header().uri.path() {
            "/reload" if post => match self.reload.reload("POST /reload").await {
                Ok(done) => reply(200, "text/plain", format!("{done}\n").into_bytes()),
                Err(e) => reply(400, "text/plain", format!("not reloaded: {e}\n").into_bytes()),
            },
            "/reload" => reply(405, "text/plain", b"POST /reload reloads the policy file\n".to_vec()),
            "/metrics" => reply(200, "text/plain; version=0.0.4", self.metrics.render()),
            "/" | "/status" => reply(200, "text/html; charset=utf-8", STATUS_PAGE.as_bytes().to_vec()),
            "/status.json" => reply(
                200,
                "application/json",
                serde_json::to_vec(&(self.status)()).unwrap_or_else(|_| b"{}".to_vec()),
            ),
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
                why => reply(503, "text/plain", format!("not ready: {}\n", why.join("; ")).into_bytes()),
            },
            _ => reply(
                404,
                "text/plain",
                b"not found: try /, /status.json, /metrics, /healthz, /readyz, POST /reload\n".to_vec(),
            ),
        }
    }
}
