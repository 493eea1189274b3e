//! Tokenizer endpoints: vLLM's `/tokenize` and `/detokenize`, and the `/render` routes that
//! routers (vllm-router's `cache_aware`) call to learn a request's prompt token ids — answered
//! in the shape of vLLM's own render endpoints (`GenerateRequest`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use warmpath_wire::openai::{
    parse_body, ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest, Tool,
};

use super::{chat, check_model, completions, json_response, read_body, AppState, ErrorReply};

fn reply(r: Result<serde_json::Value, ApiError>) -> Response {
    match r {
        Ok(v) => json_response(v.to_string()),
        Err(e) => ErrorReply(e).into_response(),
    }
}

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    tools: Option<Vec<Tool>>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
}

fn yes() -> bool {
    true
}

/// `POST /tokenize`: `{"prompt"}` or `{"messages"}` → `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    reply(
        async {
            let req: TokenizeRequest = parse_body(&read_body(&state, body).await?)?;
            if let Some(m) = &req.model {
                check_model(&state, m)?;
            }
            let tokens = match (&req.prompt, &req.messages) {
                (Some(p), None) => state.format.prompt_ids(p),
                (None, Some(msgs)) => state
                    .format
                    .render_tokens(msgs, req.tools.as_deref().unwrap_or_default(), req.add_generation_prompt)
                    .map_err(|e| ApiError::invalid_request(format!("the chat template failed: {e}")))?,
                _ => return Err(ApiError::invalid_request("give exactly one of prompt or messages")),
            };
            Ok(serde_json::json!({
                "count": tokens.len(),
                "max_model_len": state.engine.info().max_model_len,
                "tokens": tokens,
            }))
        }
        .await,
    )
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /detokenize`: `{"tokens"}` → `{"prompt"}`.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    reply(
        async {
            let req: DetokenizeRequest = parse_body(&read_body(&state, body).await?)?;
            if let Some(m) = &req.model {
                check_model(&state, m)?;
            }
            let text = state
                .format
                .tokenizer
                .decode(&req.tokens)
                .map_err(|e| ApiError::invalid_request(e.to_string()).with_param("tokens"))?;
            Ok(serde_json::json!({ "prompt": text }))
        }
        .await,
    )
}

/// `POST /v1/chat/completions/render`: a chat request → the request as vLLM's render endpoint
/// answers it (its `GenerateRequest`: the prompt's `token_ids`, `sampling_params`, `model`, …).
pub async fn render_chat(State(state): State<Arc<AppState>>, body: Body) -> Response {
    reply(
        async {
            let bytes = read_body(&state, body).await?;
            let req: ChatCompletionRequest = parse_body(&bytes)?;
            let ids = chat::prompt_of(&state, &req)?;
            Ok(generate_request(ids, &serde_json::from_slice(&bytes).unwrap_or_default(), true))
        }
        .await,
    )
}

/// `POST /v1/completions/render`: a completion request → one `GenerateRequest` per prompt.
pub async fn render_completion(State(state): State<Arc<AppState>>, body: Body) -> Response {
    reply(
        async {
            let bytes = read_body(&state, body).await?;
            let req: CompletionRequest = parse_body(&bytes)?;
            let prompts = completions::prompts_of(&state, &req)?;
            let raw: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            Ok(serde_json::Value::Array(
                prompts.into_iter().map(|ids| generate_request(ids, &raw, false)).collect(),
            ))
        }
        .await,
    )
}

/// vLLM's `GenerateRequest` (`vllm/entrypoints/serve/disagg/protocol.py`), what its render
/// endpoints answer: the prompt's token ids and the request's sampling parameters under vLLM's
/// `SamplingParams` names, so that the answer can be sent on as a tokens-in request.
fn generate_request(token_ids: Vec<u32>, req: &serde_json::Value, chat: bool) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let mut sampling = Map::new();
    for key in [
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
    ] {
        if let Some(v) = req.get(key).filter(|v| !v.is_null()) {
            sampling.insert(key.to_owned(), v.clone());
        }
    }
    let max = req.get("max_completion_tokens").filter(|v| !v.is_null()).or_else(|| req.get("max_tokens"));
    if let Some(v) = max.filter(|v| !v.is_null()) {
        sampling.insert("max_tokens".to_owned(), v.clone());
    }
    // Chat asks `logprobs: true, top_logprobs: k`; vLLM's parameter is the count.
    let logprobs = match chat {
        true => req
            .get("logprobs")
            .and_then(Value::as_bool)
            .filter(|b| *b)
            .map(|_| json!(req.get("top_logprobs").and_then(Value::as_u64).unwrap_or(0))),
        false => req.get("logprobs").filter(|v| v.is_u64()).cloned(),
    };
    if let Some(v) = logprobs {
        sampling.insert("logprobs".to_owned(), v);
    }
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let get = |k: &str| req.get(k).cloned().unwrap_or(Value::Null);
    json!({
        "request_id": format!("{:016x}", crate::sampler::Rng::new(nanos as u64).next_u64()),
        "token_ids": token_ids,
        "features": null,
        "sampling_params": sampling,
        "model": get("model"),
        "stream": req.get("stream").and_then(Value::as_bool).unwrap_or(false),
        "stream_options": get("stream_options"),
        "cache_salt": get("cache_salt"),
        "priority": req.get("priority").and_then(Value::as_i64).unwrap_or(0),
        "kv_transfer_params": get("kv_transfer_params"),
    })
}
