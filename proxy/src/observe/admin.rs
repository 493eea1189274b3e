//! The admin listener: `/metrics` (Prometheus text format), `/healthz` (the process answers)
//! and `/readyz` (every pool has a backend that takes traffic).

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use super::Metrics;
use crate::route::Router;

pub struct AdminApp {
    pub metrics: Metrics,
    pub router: Arc<Router>,
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
    /// Pools without a backend that takes traffic.
    fn unready_pools(&self) -> Vec<&str> {
        let now = Instant::now();
        self.router
            .pools()
            .iter()
            .filter(|p| !p.backends.iter().any(|b| b.is_up(now)))
            .map(|p| p.name.as_str())
            .collect()
    }
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        match session.req_header().uri.path() {
            "/metrics" => reply(200, "text/plain; version=0.0.4", self.metrics.render()),
            "/healthz" => reply(200, "text/plain", b"ok\n".to_vec()),
            "/readyz" => match self.unready_pools().as_slice() {
                [] => reply(200, "text/plain", b"ready\n".to_vec()),
                pools => {
                    reply(503, "text/plain", format!("no backend up in: {}\n", pools.join(", ")).into_bytes())
                }
            },
            _ => reply(404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n".to_vec()),
        }
    }
}
