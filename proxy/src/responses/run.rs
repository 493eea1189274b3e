//! Running a turn: its prompt through the pipeline as a Chat Completions request (or, where the
//! pool renders prompts exactly as its backends, as token-id completions), the answer
//! translated into events for an [`EventSink`], and the conversation with its output stored
//! under the new response id (and appended to its conversation, if it names one).

use std::sync::Arc;

use bytes::Bytes;

use super::builder::Builder;
use super::events::Outcome;
use super::request;
use super::translate::{Collect, EventSink, Translator};
use super::turn::{by_tokens, conversation_tokens, store_op, Turn};
use crate::pipeline;
use crate::pipeline::respond::send_error;
use crate::request::head::Head;
use crate::request::LlmRoute;
use crate::session::Conversation;
use crate::state::{AppState, Pool, RequestCtx};
use warmpath_wire::openai::ApiError;

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
    let fitted = match pool.as_ref().filter(|_| turn.req.truncation_auto) {
        Some(p) => super::truncate::fit(p, turn),
        None => Ok(None),
    };
    let (fitted, unfit) = match fitted {
        Ok(f) => (f, None),
        Err(e) => (None, Some(e)),
    };
    let turn = fitted.as_ref().unwrap_or(turn);
    let tokens = pool.filter(|p| by_tokens(p, &turn.req));
    let checked = state.pools.for_model(&turn.req.model).is_some_and(|p| p.safety.is_some());
    let with_texts = |h: Head| if checked { h.with_texts(turn.texts()) } else { h };
    let mut builder = Builder::new(turn.id.clone(), &turn.req);
    if turn.skip > 0 {
        builder.note("warmpath_truncated_items", &turn.skip.to_string());
    }
    let mut tr = Translator::new(sink, builder);
    let mut conversation_ids: Option<Vec<u32>> = None;
    let failed = match &tokens {
        _ if unfit.is_some() => unfit,
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
        None if turn.req.generate => match turn.req.to_chat(&turn.history()) {
            Ok(body) => {
                let head =
                    with_texts(head.for_path("/v1/chat/completions").with_session(Some(turn.session_key())));
                pipeline::run(state, &mut tr, ctx, LlmRoute::Chat, Bytes::from(body), &head).await?;
                None
            }
            Err(e) => Some(e),
        },
        None => {
            match turn.req.warm_up().to_chat(&turn.history()) {
                Ok(body) => {
                    let head = head.for_path("/v1/chat/completions").with_session(Some(turn.session_key()));
                    prefill(state, ctx, LlmRoute::Chat, body, &head, turn).await?;
                }
                Err(e) => tracing::debug!(error = %e, "a warm-up could not be sent; it completes without"),
            }
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
            // (A truncated prompt's ids are not the whole conversation's.)
            if let (Some(p), Some(mut ids), 0) = (&tokens, conversation_ids, turn.skip) {
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

/// A warm-up (`generate: false`): the response completes at once, with no output.
async fn warm_up(tr: &mut Translator<'_>, ctx: &mut RequestCtx) -> pingora::Result<()> {
    ctx.status = 200;
    tr.empty().await
}

/// A warm-up's backend call: its prompt, one token asked for and thrown away, routed as the
/// turns that continue it will be — so the backend that serves them has the prompt's KV
/// cached. Best effort: a failure leaves the warm-up complete, and cold.
async fn prefill(
    state: &AppState,
    ctx: &mut RequestCtx,
    route: LlmRoute,
    body: String,
    head: &Head,
    turn: &Turn,
) -> pingora::Result<()> {
    let mut discard = Collect::default();
    let mut tr = Translator::new(&mut discard, Builder::new(turn.id.clone(), &turn.req));
    if route == LlmRoute::Completions {
        tr = tr.completion();
    }
    pipeline::run(state, &mut tr, ctx, route, Bytes::from(body), head).await?;
    if let Some((status, _)) = discard.error {
        tracing::debug!(status, "a warm-up's prefill failed; it completes cold");
    }
    Ok(())
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
    let prompt = match pool.canon.token_prompt(turn.req.instructions.as_deref(), &turn.req.chat_tools()) {
        Ok(p) => p,
        Err(e) => return Ok(Err(e)),
    };
    if !turn.req.generate {
        let body = turn.req.warm_up().to_completion(&prompt.ids(&ids));
        let head = head.for_path("/v1/completions").with_session(Some(turn.session_key()));
        prefill(state, ctx, LlmRoute::Completions, body, &head, turn).await?;
        warm_up(tr, ctx).await?;
        return Ok(Ok(ids));
    }
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
