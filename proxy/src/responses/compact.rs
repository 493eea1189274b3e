//! `POST /v1/responses/compact`: a long conversation made short, as OpenAI's API does it — the
//! user's messages kept as they were, everything else replaced by one opaque `compaction` item
//! that stands for it in later requests. The summary in it is written by the pool's own model,
//! in a turn that continues the conversation itself (same instructions and tools, same routing
//! key), so the backend that holds its KV reads it from cache and only the request to summarize
//! is new. A later turn shows the model the summary where the compaction item stands, after the
//! system turn, so the instructions and tools stay the cached prefix.

use std::sync::Arc;

use serde_json::{json, Value};
use warmpath_wire::openai::ApiError;

use super::chat::compaction_content;
use super::events::{give_id, new_id};
use super::list::shown;
use super::request::{self, ResponsesRequest};
use super::translate::Collect;
use super::turn::Turn;
use crate::request::head::Head;
use crate::session::Conversation;
use crate::state::{AppState, RequestCtx};

/// The most the summary may take, unless the request says less (`max_output_tokens`, which
/// OpenAI's compact does not take; warmpath reads it).
const SUMMARY_TOKENS: u64 = 1024;

/// What the model is asked, after the conversation.
const SUMMARIZE: &str = "Summarize the conversation so far for yourself, to continue it later \
without the messages above: the user's goals and constraints, what was done and found (tool \
calls and their results that matter), decisions made, and what is left to do. Write only the \
summary.";

/// Compacts the conversation a request names (`previous_response_id` and/or `input`):
/// the `response.compaction` object.
pub async fn compact(
    state: &AppState,
    ctx: &mut RequestCtx,
    head: &Head,
    tenant: u64,
    body: &[u8],
) -> Result<Value, ApiError> {
    let req = ResponsesRequest::from_fields(request::raw_fields(body)?, false)?;
    if req.conversation.is_some() {
        return Err(ApiError::invalid_param(
            "compact a conversation by its items or a response",
            "conversation",
        ));
    }
    if state.pools.for_model(&req.model).is_none() {
        return Err(ApiError::model_not_found(&req.model));
    }
    let named = Turn::prepare(state, req, tenant, None, 404).await?;
    let mut items: Vec<Value> =
        named.previous.as_ref().map_or_else(Vec::new, |p| p.all_items().into_iter().cloned().collect());
    items.extend(named.req.input.iter().cloned());
    if items.is_empty() {
        return Err(ApiError::invalid_param(
            "there is nothing to compact: give `input` or `previous_response_id`",
            "input",
        ));
    }
    for item in &mut items {
        give_id(item);
    }
    // The summary is one more turn of the same conversation (its routing key too).
    let root = named.previous.as_ref().map_or_else(|| new_id("resp_"), |p| p.root.clone());
    let mut history = Conversation::new(root, tenant, named.req.model.clone(), None, items.clone());
    if named.req.input.is_empty() {
        if let Some(ids) = named.previous.as_ref().and_then(|p| p.tokens.clone()) {
            history = history.with_tokens(ids.as_ref().clone());
        }
    }
    let mut req = named.req.clone();
    req.input = vec![json!({"type": "message", "role": "user", "content": SUMMARIZE})];
    req.previous_response_id = None;
    req.store = false;
    req.stream = false;
    req.background = false;
    req.generate = true;
    // A conversation longer than the context is summarized from what fits of its newest part.
    req.truncation_auto = true;
    req.max_output_tokens = Some(req.max_output_tokens.map_or(SUMMARY_TOKENS, |n| n.min(SUMMARY_TOKENS)));
    let summary_turn =
        Turn { req, id: new_id("resp_"), tenant, previous: Some(Arc::new(history)), thread: None, skip: 0 };
    let mut sink = Collect::default();
    super::run::run(state, &mut sink, ctx, &summary_turn, head, "compact")
        .await
        .map_err(|e| ApiError::internal(format!("compaction failed: {e}")))?;
    if let Some((status, body)) = sink.error {
        let v: Value = serde_json::from_slice(&body).unwrap_or_default();
        let msg = v["error"]["message"].as_str().unwrap_or("the backend failed").to_owned();
        let mut e = ApiError::internal(format!("compaction failed: {msg}")).with_code("compaction_failed");
        e.status = status;
        return Err(e);
    }
    let response = sink.response.unwrap_or_default();
    let summary: String = response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["type"] == "message")
        .flat_map(|o| o["content"].as_array().into_iter().flatten())
        .filter_map(|c| c["text"].as_str())
        .collect();
    if response["status"] == "failed" || summary.trim().is_empty() {
        let mut e = ApiError::internal("the model wrote no summary").with_code("compaction_failed");
        e.status = 502;
        return Err(e);
    }
    let mut output: Vec<Value> = items
        .iter()
        .filter(|i| i["type"].as_str().unwrap_or("message") == "message" && i["role"] == "user")
        .map(shown)
        .collect();
    output.push(json!({"id": new_id("cmp_"), "type": "compaction", "encrypted_content": compaction_content(summary.trim()), "created_by": "warmpath"}));
    let created_at =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(json!({
        "id": new_id("resp_"),
        "object": "response.compaction",
        "created_at": created_at,
        "output": output,
        "usage": response["usage"],
    }))
}
