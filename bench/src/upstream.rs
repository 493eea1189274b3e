//! A fast OpenAI-compatible upstream for overhead benchmarks: answers every chat request with a
//! fixed small completion as soon as the body is in (a stream of `max_tokens` chunks, one a
//! millisecond, for `"stream":true`), and the probe endpoints the routers call (`/health`,
//! `/v1/models`, sglang's `/server_info` and `/model_info`, vLLM's `/render`).

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

/// The chunks of a streamed answer: one SSE event each, spaced by the timer's resolution (about
/// a millisecond: a fast decode), so that each reaches the proxy as its own read, then the
/// last chunk with `finish_reason` and usage, and `[DONE]`.
fn stream(events: usize) -> axum::response::Response {
    use futures_util::stream;
    let chunk = move |content: &str, finish: Option<&str>| {
        let mut c = serde_json::json!({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
            "model": MODEL, "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]});
        if finish.is_some() {
            c["usage"] = serde_json::json!({"prompt_tokens": 10, "completion_tokens": events, "total_tokens": 10 + events});
        }
        Bytes::from(format!("data: {c}\n\n"))
    };
    let body = stream::unfold(0usize, move |i| async move {
        if i > events {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let out = if i < events {
            chunk("tok ", None)
        } else {
            let mut last = chunk("", Some("stop")).to_vec();
            last.extend_from_slice(b"data: [DONE]\n\n");
            Bytes::from(last)
        };
        Some((Ok::<_, std::convert::Infallible>(out), i + 1))
    });
    axum::response::Response::builder()
        .header(axum::http::header::CONTENT_TYPE, "text/event-stream")
        .body(axum::body::Body::from_stream(body))
        .unwrap_or_default()
}

/// `max_tokens` of a `"stream":true` request, which the answer streams as that many chunks.
fn streamed_events(body: &[u8]) -> Option<usize> {
    // Only small bodies are read (the 60 KB one never streams); a router may re-serialize the
    // JSON (`"stream": true`), so only the key is looked for and the body is then parsed.
    const STREAM: &[u8] = b"\"stream\"";
    if body.len() > 4096 || !body.windows(STREAM.len()).any(|w| w == STREAM) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    (v["stream"] == true).then(|| v["max_tokens"].as_u64().unwrap_or(16) as usize)
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
                .route("/v1/chat/completions", post(move |body: Bytes| {
                    let r = reply.clone();
                    async move {
                        match streamed_events(&body) {
                            Some(n) => stream(n),
                            None => axum::response::IntoResponse::into_response(json(r)),
                        }
                    }
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
            // As real model servers do (uvicorn, the bundled engine): each event goes out as
            // it is written, not held by Nagle's algorithm until the last one is acknowledged
            // (which would batch a stream's events for proxies that delay their ACKs, and not
            // for those that do not).
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let _ = axum::serve(listener, app).await;
        });
    })?;
    Ok(addr)
}

pub fn model() -> &'static str {
    MODEL
}
