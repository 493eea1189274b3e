//! The API listener's entry: pingora's `ProxyHttp`, with every route answered in
//! `request_filter` (the "self-proxy" pattern: pingora's own upstream phase cannot see the
//! body, and the stages that follow need to await between chunks). `request_filter` decides
//! which route a request is and hands it to its entry point — the HTTP routes (`http`) or
//! WebSocket mode (`ws`), siblings that share the stages below them; `logging` records each
//! request's metrics and access log line.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::proxy::{ProxyHttp, Session};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorType, Result};
use warmpath_wire::openai::ApiError;

use crate::config::HalfClose;
use crate::limits::framing;
use crate::pipeline::cached::finish_recording;
use crate::pipeline::respond::send_error;
use crate::request::LlmRoute;
use crate::state::{Live, RequestCtx};

pub struct WarmpathProxy {
    /// The state new requests get (a policy reload swaps it).
    pub live: Arc<Live>,
}

/// Which entry point answers a request.
enum Route {
    Llm(LlmRoute),
    /// `GET /v1/responses` with `Upgrade: websocket`.
    WebSocket,
    Models,
    /// Routes on stored responses (`/v1/responses/{id}`, ...).
    Stored(crate::http::stored::StoredRoute),
    /// `/v1/conversations` and below.
    Conversations(crate::http::conversations::ConversationRoute),
    /// `GET /health`: ready or not, as vLLM's own `/health` (load balancers and Kubernetes
    /// probes look for it on the API port).
    Health,
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
        (None, "/health") if method == http::Method::GET => Route::Health,
        _ => match crate::http::stored::StoredRoute::of(method, path) {
            Some(Ok(r)) => Route::Stored(r),
            Some(Err(allow)) => Route::MethodNotAllowed(allow),
            None => match crate::http::conversations::ConversationRoute::of(method, path) {
                Some(Ok(r)) => Route::Conversations(r),
                Some(Err(allow)) => Route::MethodNotAllowed(allow),
                None => Route::NotFound,
            },
        },
    }
}

#[async_trait]
impl ProxyHttp for WarmpathProxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::new()
    }

    /// No response modules: pingora's default is a compression module switched off, which
    /// still runs its filter on every chunk written, and warmpath passes the backend's bytes on
    /// as they are.
    fn init_downstream_modules(&self, _modules: &mut pingora::modules::http::HttpModules) {}

    async fn early_request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<()> {
        ctx.request_id = crate::observe::request_id::ensure(session.req_header_mut());
        let state = self.live.load();
        // A sampled request's trace; the backend is told warmpath's span is its parent.
        let theirs = session.req_header().headers.get("traceparent").and_then(|v| v.to_str().ok());
        ctx.trace = state.metrics.tracer.start(theirs, ctx.start);
        if let Some(t) = &ctx.trace {
            let _ = session.req_header_mut().insert_header("traceparent", t.traceparent());
        }
        if state.cfg.limits.client_half_close == HalfClose::Answer {
            session.set_abort_on_close(false);
        }
        crate::limits::headers_done(session);
        // A kept-alive connection waits this long for its next request, then closes (one that
        // is not kept alive — `Connection: close`, a request whose framing was in doubt —
        // stays closed).
        if session.get_keepalive().is_some() {
            session.set_keepalive(Some(state.cfg.limits.keepalive_idle_s));
        }
        // A client may send its next request before it has read this answer (HTTP/1.1
        // pipelining): its bytes are kept for the next request, which is answered after this
        // one, rather than read as a disconnect.
        session.set_pipelining_enabled(true);
        Ok(())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let state = &self.live.load();
        if let Some(e) = framing::refused(session.req_header(), state.cfg.limits.max_header_bytes) {
            // The body's extent is in doubt: nothing after this answer is read as a request.
            session.set_keepalive(None);
            let reason = if e.status == 431 { "header_too_large" } else { "bad_framing" };
            state.metrics.refused(reason);
            ctx.status = e.status;
            send_error(session, &e, &[]).await?;
            return Ok(true);
        }
        let route = route_of(session.req_header());
        let reads_body = match &route {
            Route::Llm(_) | Route::WebSocket => true,
            Route::Stored(r) => r.reads_body(),
            Route::Conversations(r) => r.reads_body(),
            _ => false,
        };
        if !reads_body {
            // Only LLM routes read the body; any other answer must not strand one.
            let deadline = Duration::from_millis(state.cfg.limits.body_read_timeout_ms);
            crate::http::body::discard_small_body(session, deadline).await;
        }
        // API keys, where `[auth]` is on: every API route (a WebSocket on its upgrade).
        if matches!(
            route,
            Route::Llm(_) | Route::WebSocket | Route::Models | Route::Stored(_) | Route::Conversations(_)
        ) {
            let authorization = session.req_header().headers.get(http::header::AUTHORIZATION);
            match state.auth.authenticate(authorization.map(|v| v.as_bytes())) {
                Ok(key) => ctx.key = key,
                Err(e) => {
                    let reason = if e.status == 503 { "keys_unavailable" } else { "invalid_api_key" };
                    state.metrics.refused(reason);
                    ctx.status = e.status;
                    if matches!(route, Route::WebSocket) {
                        // A refused upgrade ends the connection: the client meant to leave HTTP.
                        session.set_keepalive(None);
                    } else {
                        // The body is not needed: read a small one so the connection lives on.
                        let deadline = Duration::from_millis(state.cfg.limits.body_read_timeout_ms);
                        crate::http::body::discard_small_body(session, deadline).await;
                    }
                    send_error(session, &e, &[]).await?;
                    return Ok(true);
                }
            }
        }
        let req = session.req_header();
        match route {
            Route::WebSocket => {
                crate::ws::serve(&self.live, session, ctx).await?;
            }
            Route::Llm(LlmRoute::Responses) => {
                ctx.route = LlmRoute::Responses.label();
                crate::http::responses::serve(state, session, ctx).await?;
            }
            Route::Llm(r) => {
                ctx.route = r.label();
                crate::http::serve_llm(state, session, ctx, r).await?;
            }
            Route::Models => {
                ctx.route = "models";
                crate::http::models::serve(state, session, ctx).await?;
            }
            Route::Stored(r) => {
                ctx.route = r.label();
                crate::http::stored::serve(state, session, ctx, r).await?;
            }
            Route::Conversations(r) => {
                ctx.route = "conversations";
                crate::http::conversations::serve(state, session, ctx, r).await?;
            }
            Route::Health => {
                ctx.route = "health";
                ctx.status = crate::http::health::serve(state, session).await?;
            }
            Route::MethodNotAllowed(allow) => {
                let mut e = ApiError::invalid_request(format!("method {} is not allowed here", req.method));
                e.status = 405;
                ctx.status = 405;
                send_error(session, &e, &[("allow", allow.to_owned())]).await?;
            }
            Route::NotFound => {
                let e = ApiError::not_found(format!("no route for {} {}", req.method, req.uri.path()))
                    .with_code("unknown_url");
                ctx.status = 404;
                send_error(session, &e, &[]).await?;
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
        let state = self.live.load();
        let m = &state.metrics;
        finish_recording(m, ctx);
        let status = match (ctx.status, e) {
            (0, Some(_)) => 500,
            (0, None) => session.response_written().map(|r| r.status.as_u16()).unwrap_or(0),
            (s, _) => s,
        };
        let trace = ctx.trace.take();
        let backend = ctx.backend.as_deref().unwrap_or("none");
        let pool = ctx.pool.as_ref().map_or("none", |p| p.name.as_str());
        let key = ctx.key.as_deref().unwrap_or("-");
        m.requests.with_label_values(&[ctx.route, backend, &status.to_string()]).inc();
        let elapsed = ctx.start.elapsed();
        m.request_duration.with_label_values(&[ctx.route, pool, backend]).observe(elapsed.as_secs_f64());
        if let Some(t) = ctx.first_byte {
            m.ttft
                .with_label_values(&[ctx.route, pool, backend])
                .observe(t.duration_since(ctx.start).as_secs_f64());
        }
        let req = session.req_header();
        if let Some(trace) = trace {
            let attrs = vec![
                ("http.request.method", req.method.as_str().into()),
                ("url.path", req.uri.path().into()),
                ("http.response.status_code", i64::from(status).into()),
            ];
            let error = match (e, status) {
                (Some(e), _) => Some(e.to_string()),
                (None, s) if s >= 500 => Some(format!("status {s}")),
                _ => None,
            };
            m.tracer.submit(ctx.close_trace(trace, "warmpath request", attrs, error));
        }
        tracing::info!(
            target: "warmpath::access",
            method = %req.method,
            path = req.uri.path(),
            status,
            backend,
            key,
            request_id = %ctx.request_id,
            ms = elapsed.as_secs_f64() * 1e3,
            client_gone = ctx.client_gone,
            truncated = ctx.truncated,
            error = e.map(|e| e.to_string()),
        );
    }
}
