//! One Responses turn, prepared: the stored conversation it continues (a response's, or a
//! conversation's items) plus its new input items, the routing key, what input checks read,
//! the conversation after it, and the prompt's token ids where the pool sends ids. `run.rs`
//! runs it.

use std::sync::Arc;

use serde_json::Value;
use warmpath_wire::openai::ApiError;

use super::events::{self};
use super::request::{self, ResponsesRequest};
use crate::canon::Canon;
use crate::request::head::TurnTexts;
use crate::safety::texts::item_turns;
use crate::session::{Conversation, ReadAt, StoreError};
use crate::state::{AppState, Pool};

/// Stored items shown to context-dependent checks (the guard model) with a turn's new ones.
const CHECK_CONTEXT: usize = 8;

/// One turn, ready to run.
#[derive(Clone)]
pub struct Turn {
    pub req: ResponsesRequest,
    pub id: String,
    pub tenant: u64,
    /// The conversation it continues: a stored response's, or a conversation's items.
    pub previous: Option<Arc<Conversation>>,
    /// The conversation (`/v1/conversations`) it appends to, as it was read.
    pub thread: Option<(String, ReadAt)>,
    /// Items of the conversation before this turn left out of its prompt (`truncation:
    /// "auto"`); the stored conversation keeps them.
    pub skip: usize,
}

/// `conversation` names nothing this caller can use.
pub fn conversation_not_found(id: &str, status: u16) -> ApiError {
    let mut e = ApiError::invalid_request(format!("Conversation with id '{id}' not found."))
        .with_param("conversation")
        .with_code("conversation_not_found");
    e.status = status;
    e
}

/// `previous_response_id` names nothing this caller can continue.
pub fn previous_not_found(id: &str, status: u16) -> ApiError {
    let mut e = ApiError::invalid_request(format!("Previous response with id '{id}' not found."))
        .with_param("previous_response_id")
        .with_code("previous_response_not_found");
    e.status = status;
    e
}

/// The stored response `id` of `tenant`, counted; a store that fails is a 503.
pub async fn lookup(state: &AppState, tenant: u64, id: &str) -> Result<Option<Arc<Conversation>>, ApiError> {
    let found = state.sessions.responses.get(tenant, id).await;
    store_op(state, "get", found)
}

/// A store operation's result counted (`warmpath_session_store_ops_total`); a failure is a
/// 503 `session_store_unavailable`.
pub fn store_op<T>(state: &AppState, op: &str, r: Result<T, StoreError>) -> Result<T, ApiError> {
    let label = if r.is_ok() { "ok" } else { "error" };
    state.metrics.session_store_ops.with_label_values(&[op, label]).inc();
    r.map_err(|e| {
        tracing::warn!(error = %e, op, "conversation store failed");
        state.metrics.redis_errors.with_label_values(&["sessions"]).inc();
        ApiError::unavailable(format!("the conversation store failed: {e}"))
            .with_code("session_store_unavailable")
    })
}

impl Turn {
    /// Looks the predecessor up: `cached` first (a WebSocket connection's last response), then
    /// the store. `missing_status`: 404 over HTTP, 400 in a WebSocket error event, as OpenAI.
    pub async fn prepare(
        state: &AppState,
        req: ResponsesRequest,
        tenant: u64,
        cached: Option<&Arc<Conversation>>,
        missing_status: u16,
    ) -> Result<Turn, ApiError> {
        let previous = match req.previous_response_id.as_deref() {
            None => None,
            Some(id) => match cached.filter(|c| c.id == id && c.tenant == tenant) {
                Some(c) => Some(c.clone()),
                None => match lookup(state, tenant, id).await? {
                    Some(c) => Some(c),
                    None => return Err(previous_not_found(id, missing_status)),
                },
            },
        };
        let mut thread = None;
        let previous = match (&req.conversation, previous) {
            (Some(id), _) => {
                let found = store_op(state, "get", state.sessions.threads.get(tenant, id).await)?;
                let t = found.ok_or_else(|| conversation_not_found(id, missing_status))?;
                thread = Some((id.clone(), t.read_at()));
                // The conversation's items stand as the predecessor (its id, the routing key).
                let c = Conversation::new(id.clone(), tenant, req.model.clone(), None, t.items);
                Some(Arc::new(match t.tokens {
                    Some(ids) => c.with_tokens(ids),
                    None => c,
                }))
            }
            (None, p) => p,
        };
        Ok(Turn { req, id: events::new_id("resp_"), tenant, previous, thread, skip: 0 })
    }

    /// The conversation before this turn as its prompt shows it, oldest first.
    pub fn history(&self) -> Vec<&Value> {
        let mut items = self.previous.as_ref().map_or_else(Vec::new, |p| p.all_items());
        items.drain(..self.skip.min(items.len()));
        items
    }

    /// The routing session key: the client's `prompt_cache_key`, else the conversation's first
    /// response, so that every turn goes where its KV cache is.
    pub(super) fn session_key(&self) -> String {
        match (&self.req.prompt_cache_key, &self.previous) {
            (Some(k), _) if !k.is_empty() => k.clone(),
            (_, Some(p)) => format!("conversation:{}", p.root),
            _ => format!("conversation:{}", self.id),
        }
    }

    /// What the input checks read of this turn: its instructions and new items, with the
    /// latest stored items as context (they were judged in the turns that added them).
    pub(super) fn texts(&self) -> TurnTexts {
        let history = self.previous.as_ref().map_or_else(Vec::new, |p| p.all_items());
        let context = item_turns(history[history.len().saturating_sub(CHECK_CONTEXT)..].iter().copied());
        let mut new = Vec::with_capacity(self.req.input.len() + 1);
        if let Some(i) = self.req.instructions.as_deref().filter(|i| !i.is_empty()) {
            new.push(crate::request::head::Turn { role: "system".into(), text: i.to_owned() });
        }
        new.extend(item_turns(&self.req.input));
        TurnTexts { context, new }
    }

    /// The conversation after this turn, with its output and the response object. Input items
    /// the client sent without an id get one, as OpenAI's stored items have (listing pages by
    /// them).
    pub(super) fn stored(&self, output: Vec<Value>, response: String) -> Conversation {
        let mut items = self.req.input.clone();
        for item in &mut items {
            events::give_id(item);
        }
        let outputs = output.len();
        items.extend(output);
        Conversation::new(self.id.clone(), self.tenant, self.req.model.clone(), self.previous.clone(), items)
            .with_response(outputs, response)
    }
}

/// Whether `pool` runs this request as token-id completions: where it renders prompts exactly
/// as its backends, and not where input checks may rewrite text (token ids could not be).
pub(super) fn by_tokens(pool: &Pool, req: &ResponsesRequest) -> bool {
    pool.responses_tokens
        && pool.canon.token_turns()
        && req.completion_ok()
        && !pool.safety.as_ref().is_some_and(|s| s.redacts_input())
}

/// The conversation's token ids after this turn's input: the stored ids (or, where the
/// predecessor kept none, its items rendered once) and the new items'.
pub(super) fn conversation_tokens(canon: &Canon, turn: &Turn) -> Result<Vec<u32>, ApiError> {
    let mut ids = match (&turn.previous, turn.skip) {
        (Some(p), 0) => match &p.tokens {
            Some(t) => t.as_ref().clone(),
            None => canon.message_ids(&request::messages_of(p.all_items())?)?,
        },
        (Some(_), _) => canon.message_ids(&request::messages_of(turn.history())?)?,
        (None, _) => Vec::new(),
    };
    ids.extend(canon.message_ids(&request::messages_of(&turn.req.input)?)?);
    Ok(ids)
}
