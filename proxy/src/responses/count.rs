//! `POST /v1/responses/input_tokens`: the prompt a turn would send, counted with the pool's
//! own tokenizer and chat template, without calling a backend. The count is the one the
//! backend's `usage.input_tokens` reports for the same turn: the prompt is built by the code
//! that builds the turn's request (token ids where the pool sends ids; else the chat request,
//! canonicalized and rendered as routing renders it, deferred tools and moved lines included).

use serde_json::json;
use warmpath_wire::openai::ApiError;

use super::turn::{by_tokens, conversation_tokens, Turn};
use crate::request::{LlmRequest, LlmRoute};
use crate::state::Pool;

/// The `response.input_tokens` object for `turn` on `pool`.
pub fn input_tokens(pool: &Pool, turn: &Turn) -> Result<serde_json::Value, ApiError> {
    Ok(json!({"object": "response.input_tokens", "input_tokens": prompt_tokens(pool, turn)?}))
}

/// Tokens of the prompt `turn` sends to `pool`'s backends.
pub fn prompt_tokens(pool: &Pool, turn: &Turn) -> Result<usize, ApiError> {
    Ok(if by_tokens(pool, &turn.req) {
        let ids = conversation_tokens(&pool.canon, turn)?;
        pool.canon.token_prompt(turn.req.instructions.as_deref(), &turn.req.chat_tools())?.ids(&ids).len()
    } else {
        if !pool.canon.encoder().exact_tokens() {
            return Err(ApiError::invalid_request(format!(
                "pool {:?} knows no tokenizer for its model, so warmpath cannot count its tokens: name one in [pools.canon] (tokenizer, tokenizer_file)",
                pool.name
            ))
            .with_code("tokenizer_unavailable"));
        }
        let body = turn.req.to_chat(&turn.history())?;
        let req = LlmRequest::parse(LlmRoute::Chat, body.as_bytes())?;
        let prepared = pool.canon.prepare(&req, true)?;
        prepared.blocks.map_or(0, |b| b.units)
    })
}
