//! The OpenAI-compatible HTTP front end (axum over hyper).
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `GET /metrics`, `POST /tokenize`, `POST /detokenize`,
//! `POST /v1/chat/completions/render`, `POST /v1/completions/render`, `POST /reset_prefix_cache`.
//! Every error is answered in the OpenAI error shape.

mod chat;
mod completions;
mod generate;
mod handoff;
mod logprobs;
mod text;
mod tokenize;

use axum::serve::ListenerExt;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use warmpath_wire::chat_template::ChatFormat;
use warmpath_wire::openai::{unix_now, ApiError, Model, ModelList};

use crate::core::Engine;
use crate::faults::FaultInjector;

/// What every handler shares.
pub struct AppState {
    pub engine: Arc<Engine>,
    /// The model's tokenizer, chat template and end tokens.
    pub format: ChatFormat,
    pub faults: FaultInjector,
    pub max_body_bytes: usize,
    /// Scripted replies (`--script`, a test hook); empty normally.
    pub script: crate::script::Script,
    /// Prefill/decode handoffs.
    pub transfer: crate::kv_transfer::TransferConfig,
    /// The fleet's shared KV tier, where there is one (`--kv-tier-shared`).
    pub shared: Option<std::sync::Arc<crate::kv_tier::SharedTier>>,
}

impl AppState {
    /// The `--script` reply for a prompt's text, as forced output tokens ending the answer;
    /// empty when no rule matches.
    pub fn scripted(&self, prompt: &str) -> Vec<u32> {
        let Some(reply) = self.script.reply_for(prompt) else { return Vec::new() };
        let mut ids = self.format.tokenizer.encode(reply);
        ids.extend(self.format.stop_ids.last());
        ids
    }
}

/// The router with every route.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions/render", post(tokenize::render_chat))
        .route("/v1/completions/render", post(tokenize::render_completion))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Tokens go out as they are made: without TCP_NODELAY the kernel holds each small write
    // until the last one is acknowledged, and a client that delays its ACKs (a proxy on a
    // kept-alive connection does) would see the first token 40 ms late.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

/// Binds `addr` (port 0 picks one).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// An [`ApiError`] as a response.
pub struct ErrorReply(pub ApiError);

impl IntoResponse for ErrorReply {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, [(header::CONTENT_TYPE, "application/json")], self.0.to_json()).into_response()
    }
}

impl From<ApiError> for ErrorReply {
    fn from(e: ApiError) -> Self {
        ErrorReply(e)
    }
}

/// Reads a whole body up to the configured limit (413 beyond it).
pub async fn read_body(state: &AppState, body: Body) -> Result<bytes::Bytes, ApiError> {
    axum::body::to_bytes(body, state.max_body_bytes).await.map_err(|e| {
        let too_large =
            std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::too_large(state.max_body_bytes)
        } else {
            ApiError::invalid_request(format!("reading the request body failed: {e}"))
        }
    })
}

/// 404 unless `model` is the served model.
pub fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model == state.engine.info().model_name {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model))
    }
}

pub fn json_response(body: String) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let info = state.engine.info();
    let list = ModelList {
        object: "list".into(),
        data: vec![Model {
            id: info.model_name.clone(),
            object: "model".into(),
            created: unix_now(),
            owned_by: "warmpath".into(),
            max_model_len: Some(info.max_model_len as u32),
        }],
    };
    json_response(serde_json::to_string(&list).unwrap_or_default())
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.engine.metrics.render()).into_response()
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> StatusCode {
    state.engine.reset_prefix_cache();
    StatusCode::OK
}

async fn not_found(uri: axum::http::Uri) -> ErrorReply {
    ErrorReply(ApiError::not_found(format!("no route for {}", uri.path())))
}

async fn method_not_allowed() -> Response {
    let mut e = ApiError::invalid_request("method not allowed on this route");
    e.status = 405;
    ErrorReply(e).into_response()
}
