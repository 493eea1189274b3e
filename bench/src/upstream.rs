//! A fast OpenAI-compatible upstream for overhead benchmarks: answers every chat request with a
//! fixed small completion as soon as the body is in, and the probe endpoints the routers call
//! (`/health`, `/v1/models`, sglang's `/server_info` and `/model_info`, vLLM's `/render`).

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::routing::{get, post};
use axum::Router;

const MODEL: &str = "bench";

fn completion() -> String {
    serde_json::json!({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
    })
    .to_string()
}

fn json(body: String) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], body)
}

/// Starts the upstream on its own runtime thread; returns its address.
pub fn start() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let reply = completion();
    std::thread::Builder::new().name("bench-upstream".into()).spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
            let models = serde_json::json!({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}).to_string();
            let app = Router::new()
                .route("/v1/chat/completions", post(move |_body: Bytes| {
                    let r = reply.clone();
                    async move { json(r) }
                }))
                .route("/v1/chat/completions/render", post(|_b: Bytes| async { json(r#"{"token_ids":[1,2,3,4]}"#.into()) }))
                .route("/v1/completions/render", post(|_b: Bytes| async { json(r#"[{"token_ids":[1,2,3,4]}]"#.into()) }))
                .route("/health", get(|| async { "ok" }))
                .route("/health_generate", get(|| async { "ok" }))
                .route("/v1/models", get(move || {
                    let m = models.clone();
                    async move { json(m) }
                }))
                .route("/server_info", get(|| async { json("{}".into()) }))
                .route("/get_server_info", get(|| async { json("{}".into()) }))
                .route("/model_info", get(|| async { json(format!(r#"{{"model_path":"{MODEL}","is_generation":true}}"#)) }))
                .route("/get_model_info", get(|| async { json(format!(r#"{{"model_path":"{MODEL}","is_generation":true}}"#)) }));
            let _ = axum::serve(listener, app).await;
        });
    })?;
    Ok(addr)
}

pub fn model() -> &'static str {
    MODEL
}
