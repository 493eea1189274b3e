//! The API listener: pingora's `ProxyHttp` with every route answered in `request_filter`
//! (the "self-proxy" pattern: pingora's own upstream phase cannot see the body, and the
//! stages that follow need to await between chunks). `request_filter` dispatches by path;
//! `logging` records each request's metrics and access log line.

pub mod body;
pub mod client;
mod deferred;
pub mod downstream;
pub mod forward;
pub mod head;
pub mod models;
pub mod relay;
pub mod request;
pub mod respond;

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use pingora::proxy::{ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorType, Result};
use warmpath_wire::openai::ApiError;

use crate::config::Config;
use crate::observe::Metrics;
use crate::route::Router;
use client::Upstream;
use request::LlmRoute;

/// What every request handler reads.
pub struct AppState {
    pub cfg: Config,
    pub router: Arc<Router>,
    pub metrics: Metrics,
    pub upstream: Arc<Upstream>,
    /// Stored Responses conversations.
    pub sessions: Arc<crate::session::Store>,
    /// Open WebSocket connections.
    pub ws: crate::ws::Connections,
}

/// Per-request context (pingora's `CTX`).
#[derive(Debug)]
pub struct RequestCtx {
    pub start: Instant,
    /// The `route` label: an LLM route, `models`, or `other`.
    pub route: &'static str,
    pub backend: Option<String>,
    /// The status the client got; 499 when it left first.
    pub status: u16,
    pub first_byte: Option<Instant>,
    pub client_gone: bool,
    /// A body with a length was cut short (the connection was closed).
    pub truncated: bool,
    /// The answer being copied aside for the pool's response cache (kept, or not, in
    /// `logging`).
    pub recording: Option<(Arc<crate::route::Pool>, crate::cache::Recording)>,
}

impl RequestCtx {
    pub fn new() -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            route: "other",
            backend: None,
            status: 0,
            first_byte: None,
            client_gone: false,
            truncated: false,
            recording: None,
        }
    }
}

impl Default for RequestCtx {
    fn default() -> Self {
        RequestCtx::new()
    }
}

pub struct WarmpathProxy {
    pub state: Arc<AppState>,
}

enum Route {
    Llm(LlmRoute),
    /// `GET /v1/responses` with `Upgrade: websocket`.
    WebSocket,
    Models,
    MethodNotAllowed(&'static str),
    NotFound,
}

fn route_of(req: &pingora::http::RequestHeader) -> Route {
    let (method, path) = (&req.method, req.uri.path());
    let post = method == http::Method::POST;
    match (LlmRoute::from_path(path), path) {
        (Some(LlmRoute::Responses), _) if method == http::Method::GET && crate::ws::is_upgrade(req) => {
            Route::WebSocket
        }
        (Some(r), _) if post => Route::Llm(r),
        (Some(_), _) => Route::MethodNotAllowed("POST"),
        (None, "/v1/models") if method == http::Method::GET => Route::Models,
        (None, "/v1/models") => Route::MethodNotAllowed("GET"),
        _ => Route::NotFound,
    }
}

#[async_trait]
impl ProxyHttp for WarmpathProxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::new()
    }

    async fn early_request_filter(&self, session: &mut Session, _ctx: &mut RequestCtx) -> Result<()> {
        crate::limits::headers_done(session);
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let state = &self.state;
        let route = route_of(session.req_header());
        if !matches!(route, Route::Llm(_) | Route::WebSocket) {
            // Only LLM routes read the body; any other answer must not strand one.
            let deadline = std::time::Duration::from_millis(state.cfg.limits.body_read_timeout_ms);
            body::discard_small_body(session, deadline).await;
        }
        let req = session.req_header();
        match route {
            Route::WebSocket => {
                crate::ws::serve(state, session, ctx).await?;
            }
            Route::Llm(LlmRoute::Responses) => {
                ctx.route = LlmRoute::Responses.label();
                crate::responses::serve_http(state, session, ctx).await?;
            }
            Route::Llm(r) => {
                ctx.route = r.label();
                forward::serve(state, session, ctx, r).await?;
            }
            Route::Models => {
                ctx.route = "models";
                models::serve(state, session, ctx).await?;
            }
            Route::MethodNotAllowed(allow) => {
                let mut e = ApiError::invalid_request(format!("method {} is not allowed here", req.method));
                e.status = 405;
                ctx.status = 405;
                respond::send_error(session, &e, &[("allow", allow.to_owned())]).await?;
            }
            Route::NotFound => {
                let e = ApiError::not_found(format!("no route for {} {}", req.method, req.uri.path()))
                    .with_code("unknown_url");
                ctx.status = 404;
                respond::send_error(session, &e, &[]).await?;
            }
        }
        Ok(true)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut RequestCtx) -> Result<Box<HttpPeer>> {
        // Every route is answered in request_filter; reaching here is a bug.
        Error::e_explain(ErrorType::InternalError, "no upstream phase in warmpath")
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        crate::limits::request_done(session);
        let m = &self.state.metrics;
        forward::finish_recording(m, ctx);
        let status = match (ctx.status, e) {
            (0, Some(_)) => 500,
            (0, None) => session.response_written().map(|r| r.status.as_u16()).unwrap_or(0),
            (s, _) => s,
        };
        let backend = ctx.backend.as_deref().unwrap_or("none");
        m.requests.with_label_values(&[ctx.route, backend, &status.to_string()]).inc();
        let elapsed = ctx.start.elapsed();
        m.request_duration.with_label_values(&[ctx.route]).observe(elapsed.as_secs_f64());
        if let Some(t) = ctx.first_byte {
            m.ttft.with_label_values(&[ctx.route]).observe(t.duration_since(ctx.start).as_secs_f64());
        }
        let req = session.req_header();
        tracing::info!(
            target: "warmpath::access",
            method = %req.method,
            path = req.uri.path(),
            status,
            backend,
            ms = elapsed.as_secs_f64() * 1e3,
            client_gone = ctx.client_gone,
            truncated = ctx.truncated,
            error = e.map(|e| e.to_string()),
        );
    }
}
