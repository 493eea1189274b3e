//! One Responses turn: the stored conversation it continues, plus its new input items, sent
//! through the pipeline as a Chat Completions request (or, where the pool renders prompts
//! exactly as its backends, as token-id completions), the answer translated into events for an
//! [`EventSink`], and the conversation with its output stored under the new response id.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;
use warmpath_wire::openai::ApiError;

use super::builder::Builder;
use super::events::{self, Outcome};
use super::request::{self, ResponsesRequest};
use super::translate::{EventSink, Translator};
use crate::canon::Canon;
use crate::pipeline;
use crate::pipeline::respond::send_error;
use crate::request::head::{Head, TurnTexts};
use crate::request::LlmRoute;
use crate::safety::texts::item_turns;
use crate::session::{Conversation, ReadAt, StoreError};
use crate::state::{AppState, Pool, RequestCtx};

/// Stored items shown to context-dependent checks (the guard model) with a turn's new ones.
const CHECK_CONTEXT: usize = 8;

/// One turn, ready to run.
pub struct Turn {
    pub req: ResponsesRequest,
    pub id: String,
    pub tenant: u64,
    /// The conversation it continues: a stored response's, or a conversation's items.
    pub previous: Option<Arc<Conversation>>,
    /// The conversation (`/v1/conversations`) it appends to, as it was read.
    pub thread: Option<(String, ReadAt)>,
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
        Ok(Turn { req, id: events::new_id("resp_"), tenant, previous, thread })
    }

    /// The routing session key: the client's `prompt_cache_key`, else the conversation's first
    /// response, so that every turn goes where its KV cache is.
    fn session_key(&self) -> String {
        match (&self.req.prompt_cache_key, &self.previous) {
            (Some(k), _) if !k.is_empty() => k.clone(),
            (_, Some(p)) => format!("conversation:{}", p.root),
            _ => format!("conversation:{}", self.id),
        }
    }

    /// What the input checks read of this turn: its instructions and new items, with the
    /// latest stored items as context (they were judged in the turns that added them).
    fn texts(&self) -> TurnTexts {
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
    fn stored(&self, output: Vec<Value>, response: String) -> Conversation {
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

/// Runs a turn to `sink` and stores the conversation after it (when the response completed,
/// or stopped at its token limit). Returns the stored conversation, for the caller to keep as
/// its latest; `None` when the turn failed.
pub async fn run(
    state: &AppState,
    sink: &mut dyn EventSink,
    ctx: &mut RequestCtx,
    turn: &Turn,
    head: &Head,
    transport: &'static str,
) -> pingora::Result<Option<Arc<Conversation>>> {
    let pool = state.pools.for_model(&turn.req.model).cloned();
    let tokens = pool.filter(|p| by_tokens(p, &turn.req));
    let checked = state.pools.for_model(&turn.req.model).is_some_and(|p| p.safety.is_some());
    let with_texts = |h: Head| if checked { h.with_texts(turn.texts()) } else { h };
    let mut tr = Translator::new(sink, Builder::new(turn.id.clone(), &turn.req));
    let mut conversation_ids: Option<Vec<u32>> = None;
    let failed = match &tokens {
        Some(p) => {
            tr = tr.completion();
            match token_turn(state, &mut tr, ctx, p, turn, &with_texts(head.for_path("/v1/completions")))
                .await?
            {
                Ok(ids) => {
                    conversation_ids = Some(ids);
                    None
                }
                Err(e) => Some(e),
            }
        }
        None if turn.req.generate => {
            let history = turn.previous.as_ref().map_or_else(Vec::new, |p| p.all_items());
            match turn.req.to_chat(&history) {
                Ok(body) => {
                    let head = with_texts(
                        head.for_path("/v1/chat/completions").with_session(Some(turn.session_key())),
                    );
                    pipeline::run(state, &mut tr, ctx, LlmRoute::Chat, Bytes::from(body), &head).await?;
                    None
                }
                Err(e) => Some(e),
            }
        }
        None => {
            warm_up(&mut tr, ctx).await?;
            None
        }
    };
    if let Some(e) = failed {
        ctx.status = e.status;
        send_error(&mut tr, &e, &[]).await?;
        return Ok(None);
    }
    let outcome = tr.outcome().cloned();
    let label = match &outcome {
        Some(Outcome::Completed) => "completed",
        Some(Outcome::Incomplete(_)) => "incomplete",
        Some(Outcome::Failed { .. }) => "failed",
        None => "error",
    };
    state.metrics.responses_turns.with_label_values(&[transport, label]).inc();
    let output = tr.builder.output_items();
    let stored = match outcome {
        Some(Outcome::Completed | Outcome::Incomplete(_)) => {
            let mut c = turn.stored(output.clone(), tr.builder.response_json());
            if let (Some(p), Some(mut ids)) = (&tokens, conversation_ids) {
                // The answer's turn as the template renders it, for the next prompt.
                match request::messages_of(&output).and_then(|m| p.canon.message_ids(&m)) {
                    Ok(out) => {
                        ids.extend(out);
                        c = c.with_tokens(ids);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the answer could not be tokenized; the next turn renders it again")
                    }
                }
            }
            let c = Arc::new(c);
            if let Some((thread, read)) = &turn.thread {
                // The turn's items (input with the ids just given, then output) join the
                // conversation, with the ids of the whole where they were kept.
                let added = &c.items;
                let tokens = c.tokens.as_ref().map(|t| (*read, t.as_ref().clone()));
                let appended = state.sessions.threads.append(turn.tenant, thread, added, tokens).await;
                if let Ok(false) = store_op(state, "append", appended) {
                    tracing::debug!(conversation = %thread, "the conversation was deleted during the turn");
                }
            }
            if turn.req.store {
                let _ = store_op(state, "put", state.sessions.responses.put(c.clone()).await);
                if state.sessions.in_memory() {
                    let (bytes, _) = state.sessions.usage();
                    state.metrics.session_store_bytes.with_label_values(&["memory"]).set(bytes as i64);
                }
            }
            Some(c)
        }
        _ => None,
    };
    if tr.release().await.is_err() {
        state.metrics.client_disconnects.inc();
    }
    Ok(stored)
}

/// Whether `pool` runs this request as token-id completions: where it renders prompts exactly
/// as its backends, and not where input checks may rewrite text (token ids could not be).
pub(super) fn by_tokens(pool: &Pool, req: &ResponsesRequest) -> bool {
    pool.responses_tokens
        && pool.canon.token_turns()
        && req.completion_ok()
        && !pool.safety.as_ref().is_some_and(|s| s.redacts_input())
}

/// A warm-up (`generate: false`): the response completes at once, with no output.
async fn warm_up(tr: &mut Translator<'_>, ctx: &mut RequestCtx) -> pingora::Result<()> {
    ctx.status = 200;
    tr.empty().await
}

/// A turn as token-id completions: the prompt is the system turn, the conversation's ids and
/// the tail; where tools are deferred and the model only searched, warmpath answers, appends
/// the search and its result to the conversation and calls again. Returns the conversation's
/// ids before the answer (the caller appends the answer's), or the client's error.
async fn token_turn(
    state: &AppState,
    tr: &mut Translator<'_>,
    ctx: &mut RequestCtx,
    pool: &Pool,
    turn: &Turn,
    head: &Head,
) -> pingora::Result<Result<Vec<u32>, ApiError>> {
    let mut ids = match conversation_tokens(&pool.canon, turn) {
        Ok(ids) => ids,
        Err(e) => return Ok(Err(e)),
    };
    if !turn.req.generate {
        warm_up(tr, ctx).await?;
        return Ok(Ok(ids));
    }
    let prompt = match pool.canon.token_prompt(turn.req.instructions.as_deref(), &turn.req.chat_tools()) {
        Ok(p) => p,
        Err(e) => return Ok(Err(e)),
    };
    if prompt.search.is_some() {
        tr.hide();
    }
    let head = head.for_path("/v1/completions").with_session(Some(turn.session_key()));
    let mut rounds = 0;
    loop {
        let body = Bytes::from(turn.req.to_completion(&prompt.ids(&ids)));
        pipeline::run(state, tr, ctx, LlmRoute::Completions, body, &head).await?;
        let (text, calls) = tr.take_searches();
        let Some(plan) = prompt.search.as_ref().filter(|_| !calls.is_empty()) else { break };
        if rounds >= plan.max_rounds || tr.outcome().is_some() {
            tr.close().await?;
            break;
        }
        let t = std::time::Instant::now();
        let answer = plan.answer(Some(text.as_str()).filter(|t| !t.is_empty()), &calls);
        answer.record(&state.metrics, &pool.name, t.elapsed());
        match pool.canon.message_ids(&answer.messages) {
            Ok(more) => ids.extend(more),
            Err(e) => {
                tracing::warn!(error = %e, "a tool_search answer could not be tokenized");
                tr.close().await?;
                break;
            }
        }
        rounds += 1;
    }
    Ok(Ok(ids))
}

/// The conversation's token ids after this turn's input: the stored ids (or, where the
/// predecessor kept none, its items rendered once) and the new items'.
pub(super) fn conversation_tokens(canon: &Canon, turn: &Turn) -> Result<Vec<u32>, ApiError> {
    let mut ids = match &turn.previous {
        Some(p) => match &p.tokens {
            Some(t) => t.as_ref().clone(),
            None => canon.message_ids(&request::messages_of(p.all_items())?)?,
        },
        None => Vec::new(),
    };
    ids.extend(canon.message_ids(&request::messages_of(&turn.req.input)?)?);
    Ok(ids)
}
