//! Tokenizer endpoints: vLLM's `/tokenize` and `/detokenize`, and the `/render` routes that
//! routers (vllm-router's `cache_aware`) call to learn a request's prompt token ids.

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

/// `POST /v1/chat/completions/render`: a chat request → `{"token_ids": [...]}`.
pub async fn render_chat(State(state): State<Arc<AppState>>, body: Body) -> Response {
    reply(
        async {
            let req: ChatCompletionRequest = parse_body(&read_body(&state, body).await?)?;
            let ids = chat::prompt_of(&state, &req)?;
            Ok(serde_json::json!({ "token_ids": ids }))
        }
        .await,
    )
}

/// `POST /v1/completions/render`: a completion request → `[{"token_ids": [...]}, ...]`, one per
/// prompt.
pub async fn render_completion(State(state): State<Arc<AppState>>, body: Body) -> Response {
    reply(
        async {
            let req: CompletionRequest = parse_body(&read_body(&state, body).await?)?;
            let prompts = completions::prompts_of(&state, &req)?;
            Ok(serde_json::Value::Array(
                prompts.into_iter().map(|ids| serde_json::json!({ "token_ids": ids })).collect(),
            ))
        }
        .await,
    )
}
