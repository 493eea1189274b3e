//! One LLM request through the stages, in order. Every entry point comes here with a body it
//! has read and the client's head: the LLM routes over HTTP (`http`), and each backend call of
//! a Responses turn over HTTP or WebSocket (`responses`), whose answer goes to a translator
//! instead of the client. [`run`] is the order of the stages; each stage's logic lives in the
//! module that owns its state, and this one only calls them:
//!
//! 1. parse — typed views over the body bytes (`request`);
//! 2. admit — the pool that serves the model (`state::Pools`); its input safety checks
//!    (`safety`);
//! 3. prepare — canonical body, deferred tools, prefix blocks (`canon`, `tools`);
//! 4. response cache — answered from it, or the answer recorded (`cached`, over `cache`);
//! 5. route key — what the pool's policy reads (`route::key`);
//! 6. forward — select a backend, attempt, relay the answer or answer tool searches and call
//!    again, retry elsewhere before the first byte (`forward`, `attempt`, `relay`, `deferred`).
//!
//! New stages go between these (see `docs/ARCHITECTURE.md`): API keys and per-key limits and
//! admission queueing at step 2, input safety checks started beside step 6, the release policy
//! of output checks as a `Downstream` wrapped around the client's.

mod attempt;
pub mod cached;
mod deferred;
mod disagg;
pub mod downstream;
mod forward;
mod gate;
pub mod guard;
mod headers;
mod refusal;
pub mod relay;
mod release;
pub mod respond;
mod usage;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use warmpath_wire::openai::ApiError;

pub use downstream::Downstream;
use downstream::Stamped;

use crate::canon::Prepared;
use crate::config::InputMode;
use crate::observe::trace::Kind;
use crate::request::head::{Head, RequestTemplate};
use crate::request::{LlmRequest, LlmRoute};
use crate::route::key::route_key;
use crate::safety::{Decision, Safety};
use crate::state::{AppState, Pool, RequestCtx};
use crate::tools::search::SearchPlan;
use cached::Lookup;
use gate::InputGate;
use refusal::Refused;
use release::{OutputRelease, Shape};

/// Runs one LLM request whose body is read: its answer, or its error in the OpenAI shape, goes
/// to `down`.
pub async fn run(
    state: &AppState,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    route: LlmRoute,
    body: Bytes,
    head: &Head,
) -> pingora::Result<()> {
    // 1. Parse the top level.
    let mut parsed = match LlmRequest::scan(route, &body) {
        Ok(p) => p,
        Err(e) => return reject(state, down, ctx, &e, "bad_request").await,
    };
    // 2. Admit.
    let route = parsed.route;
    let Some(pool) = state.pools.for_model(parsed.model()) else {
        let e = ApiError::model_not_found(parsed.model());
        return reject(state, down, ctx, &e, "model_not_found").await;
    };
    // 3. The messages and tools, where the pool's stages read them.
    if let Err(e) = read_prompt(pool, &mut parsed) {
        return reject(state, down, ctx, &e, "bad_request").await;
    }
    // The caller's key: may it use this model, and does the request fit its limits?
    let Some(key) = head.key.as_deref() else {
        return admitted(state, pool, down, ctx, parsed, &body, head).await;
    };
    let ticket = match state.auth.admit(key, &pool.name, parsed.model(), estimate(&parsed, &body)).await {
        Ok(t) => t,
        Err(r) => {
            let reason = match r.error.status {
                429 => "rate_limited",
                503 => "limits_unavailable",
                _ => "forbidden",
            };
            state.metrics.refused(reason);
            ctx.status = r.error.status;
            return respond::send_error(down, &r.error, &r.headers).await;
        }
    };
    // A stream of a key whose tokens are limited asks for its usage (which settles them); the
    // client does not see the chunk it did not ask for.
    parsed.ask_usage = ticket.counts_tokens() && usage::unasked(&parsed);
    let mut stamped = Stamped {
        inner: down,
        headers: &ticket.headers,
        hide_routing: !pool.route_headers,
        hide_usage: parsed.ask_usage.then(usage::UsageFilter::default),
    };
    // Tenants apart: the key's salt goes to the backends as `cache_salt`, and the prefix
    // blocks warmpath routes by are salted the same way.
    if route != LlmRoute::Embeddings {
        parsed.tenant_salt = state.auth.salt(key, pool.tenants).map(Into::into);
    }
    let done = admitted(state, pool, &mut stamped, ctx, parsed, &body, head).await;
    ticket.settle(ctx.usage).await;
    done
}

/// The tokens a request may use, as far as is known before it runs: its prompt at about four
/// bytes a token, and the most it may write (`max_tokens`, `max_completion_tokens`,
/// `max_output_tokens`); its answer's usage settles the difference.
fn estimate(req: &LlmRequest<'_>, body: &[u8]) -> u64 {
    (body.len() as u64).div_ceil(4) + req.max_output()
}

/// Runs one LLM request on pool `pool`, whatever model it names (warmpath's own calls: the
/// guard model's).
pub async fn run_on(
    state: &AppState,
    pool: &Arc<Pool>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    route: LlmRoute,
    body: Bytes,
    head: &Head,
) -> pingora::Result<()> {
    let parsed = LlmRequest::scan(route, &body).and_then(|mut p| read_prompt(pool, &mut p).map(|()| p));
    match parsed {
        Ok(parsed) => admitted(state, pool, down, ctx, parsed, &body, head).await,
        Err(e) => reject(state, down, ctx, &e, "bad_request").await,
    }
}

/// Reads the messages and tools of a request for a pool whose stages read the prompt (safety
/// checks, canonicalization, prefix blocks, a length check). Any other pool passes the body on
/// as sent: a malformed message in it is the backend's to refuse.
fn read_prompt(pool: &Pool, req: &mut LlmRequest<'_>) -> Result<(), ApiError> {
    if pool.safety.is_some() || wants_blocks(pool) {
        req.read_views()?;
    }
    Ok(())
}

/// Whether the pool's canonicalization rewrites the prompt or its routing or length check
/// reads the prompt's prefix blocks.
fn wants_blocks(pool: &Pool) -> bool {
    let policy = &pool.route.policy;
    policy.wants_prefix() || policy.wants_blocks() || pool.canon.rewrites() || checks_length(pool)
}

/// An admitted request: its input checks started (the rules decided, redactions made), then
/// the stages, with the client behind the input gate and the output release policy where the
/// pool has checks.
async fn admitted(
    state: &AppState,
    pool: &Arc<Pool>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    parsed: LlmRequest<'_>,
    body: &Bytes,
    head: &Head,
) -> pingora::Result<()> {
    let Some(safety) = pool.safety.as_deref() else {
        return stages(state, pool, down, ctx, parsed, body, head).await;
    };
    let refused = Refused::of(&parsed);
    let checks = Instant::now();
    let mut input = safety.input(&parsed, body, head.texts.as_deref());
    if let Some(d) = input.refused.take() {
        safety_span(ctx, checks, None, &d, "rules");
        return refuse(state, down, ctx, safety, &refused, &d).await;
    }
    // The sequential baseline: the remote checks decide before anything goes out.
    if safety.input.mode == InputMode::Before {
        if let Some(mut p) = input.pending.take() {
            let d = p.decided().await;
            safety_span(ctx, checks, None, &d, "before");
            if d.blocks() {
                return refuse(state, down, ctx, safety, &refused, &d).await;
            }
        }
    }
    let mut gate = InputGate::new(down, input.pending.take(), &safety.names);
    let output = safety.checks_output() && parsed.route != LlmRoute::Embeddings;
    // Where the rules redacted, the stages read the rewritten body.
    let redacted = input.body.take().map(Bytes::from);
    let reparsed = redacted.as_ref().and_then(|b| {
        let mut p = LlmRequest::parse(parsed.route, b).ok()?;
        p.tenant_salt = parsed.tenant_salt.clone();
        p.ask_usage = parsed.ask_usage;
        Some((p, b))
    });
    let (parsed, body) = reparsed.unwrap_or((parsed, body));
    if output {
        let shape = match parsed.route {
            LlmRoute::Completions => Shape::Completion,
            // Only a pool that serves Responses natively is sent Responses requests.
            LlmRoute::Responses => Shape::Responses,
            _ => Shape::Chat,
        };
        let mut release = OutputRelease::new(&mut gate, safety, input.turns.clone(), shape);
        stages(state, pool, &mut release, ctx, parsed, body, head).await?;
        let _ = release.finish().await;
    } else {
        stages(state, pool, &mut gate, ctx, parsed, body, head).await?;
    }
    // TTFT is what the client waited: held text counts from its release.
    ctx.first_byte = gate.first_sent();
    let d = gate.verdict().await;
    if safety.input.mode != InputMode::Before {
        safety_span(ctx, checks, gate.decided_at(), &d, "concurrent");
    }
    if d.blocks() {
        return refuse(state, gate.into_inner(), ctx, safety, &refused, &d).await;
    }
    Ok(())
}

/// The input checks' span: from their start to their verdict.
fn safety_span(
    ctx: &mut RequestCtx,
    start: Instant,
    decided: Option<Instant>,
    d: &Decision,
    mode: &'static str,
) {
    let Some(trace) = &mut ctx.trace else { return };
    let mut attrs = vec![("warmpath.safety.mode", mode.into())];
    let verdict = match d {
        Decision::Pass => "pass".to_owned(),
        Decision::Block { check, category } => {
            attrs.push(("warmpath.safety.check", (*check).into()));
            attrs.push(("warmpath.safety.category", category.as_str().into()));
            "block".to_owned()
        }
    };
    attrs.push(("warmpath.safety.verdict", verdict.into()));
    let end = decided.unwrap_or_else(Instant::now).max(start);
    trace.span("safety input", Kind::Internal, (start, end), attrs, None);
}

/// Answers a request its input checks refused, counted.
async fn refuse(
    state: &AppState,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    safety: &Safety,
    refused: &Refused,
    d: &crate::safety::Decision,
) -> pingora::Result<()> {
    state.metrics.refused("content_policy");
    ctx.client_gone = false;
    ctx.status = refused.answer(down, safety, d).await?;
    Ok(())
}

/// Steps 3 to 6: prepare, the response cache, the route key, forward.
async fn stages(
    state: &AppState,
    pool: &Arc<Pool>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    parsed: LlmRequest<'_>,
    body: &Bytes,
    head: &Head,
) -> pingora::Result<()> {
    let route = parsed.route;
    // 3. Prepare.
    let prepared = match prepare(state, pool, &parsed) {
        Ok(p) => p,
        Err(e) => return reject(state, down, ctx, &e, "bad_request").await,
    };
    let prefix = prepared.blocks.as_ref().map(|b| format!("{:016x}", b.prefix_hash));
    // A prompt that cannot fit the backends' context never leaves (a 21 MB prompt would keep
    // an engine busy tokenizing it before refusing it).
    if let (Some(max), Some(b)) = (pool.max_model_len.filter(|_| checks_length(pool)), &prepared.blocks) {
        if let Some(e) = too_long(&parsed, b.units, max) {
            return reject(state, down, ctx, &e, "context_length_exceeded").await;
        }
    }
    // 4. Response cache.
    let sent: &[u8] = prepared.body.as_deref().unwrap_or(body);
    let cache = match cached::look_up(state, pool, head, &parsed, sent) {
        Lookup::Hit(entry) => return cached::replay(state, down, ctx, &entry, prefix.as_deref()).await,
        Lookup::Miss(rec) => {
            ctx.recording = Some((pool.clone(), rec));
            Some("miss")
        }
        Lookup::Bypass => Some("miss"),
        Lookup::Off => None,
    };
    // 5. Route key.
    let key = route_key(&pool.route, &parsed, head.session_id.as_deref(), prepared.blocks);
    let salt =
        parsed.tenant_salt.clone().map(|t| (t, parsed.extra_str("cache_salt").map(|c| c.into_owned())));
    let ask_usage = parsed.ask_usage;
    let client_params = !pool.disagg.client_params && parsed.extra_raw("kv_transfer_params").is_some();
    drop(parsed);
    // 6. Forward.
    let out = Outgoing {
        state,
        pool,
        route,
        template: &head.template,
        body: {
            let out = prepared.body.map(Bytes::from).unwrap_or_else(|| body.clone());
            let out = match &salt {
                Some((t, theirs)) => crate::auth::salted_body(out, t, theirs.as_deref()),
                None => out,
            };
            let out = match client_params {
                true => disagg::without_client_params(out),
                false => out,
            };
            match ask_usage {
                true => usage::ask(out),
                false => out,
            }
        },
        search: prepared.search.as_ref(),
        prefix: prefix.as_deref(),
        cache,
        counts_usage: head.key.is_some(),
        priority: priority(state, head),
    };
    forward::forward(&out, down, ctx, &key).await
}

/// A request's place in a full pool's queue: its `x-warmpath-priority`, at most its API key's
/// `priority` (a client cannot raise itself above what its key was given).
fn priority(state: &AppState, head: &Head) -> i64 {
    let key = head.key.as_deref().and_then(|k| state.auth.key(k)).map(|k| k.priority);
    match (head.priority, key) {
        (Some(asked), Some(given)) => asked.min(given),
        (asked, given) => asked.or(given).unwrap_or(0),
    }
}

/// The client left (its connection broke or it stopped waiting): counted, unless warmpath
/// itself stopped the answer (a safety verdict), which the pipeline answers instead.
pub(crate) fn client_left(state: &AppState, down: &dyn Downstream, ctx: &mut RequestCtx) {
    if down.stopped() {
        return;
    }
    state.metrics.client_disconnects.inc();
    ctx.client_gone = true;
}

/// A request ready to go to a backend of its pool.
struct Outgoing<'a> {
    pub state: &'a AppState,
    pub pool: &'a Arc<Pool>,
    pub route: LlmRoute,
    pub template: &'a RequestTemplate,
    /// The body as it goes out (canonical, or the client's own bytes).
    pub body: Bytes,
    /// Tools were deferred: how to answer the model's searches.
    pub search: Option<&'a SearchPlan>,
    /// `x-warmpath-prefix-hash` and `x-warmpath-cache`.
    pub prefix: Option<&'a str>,
    pub cache: Option<&'static str>,
    /// The caller has token limits: the answer's usage is read to settle them.
    pub counts_usage: bool,
    /// Its place in a full pool's queue.
    pub priority: i64,
}

/// The canonical body and prefix blocks, where the pool rewrites or its policy reads blocks;
/// counted.
fn prepare(state: &AppState, pool: &Pool, req: &LlmRequest<'_>) -> Result<Prepared, ApiError> {
    let hash = wants_blocks(pool);
    let started = Instant::now();
    let prepared = pool.canon.prepare(req, hash)?;
    pool.canon.record(&state.metrics, &pool.name, &prepared, started.elapsed());
    Ok(prepared)
}

/// Whether the pool checks a request's length before it leaves: it knows the backends' context
/// length and counts tokens exactly (with the backends' own tokenizer).
fn checks_length(pool: &Pool) -> bool {
    pool.max_model_len.is_some() && pool.route.units.exact_tokens
}

/// 400 `context_length_exceeded` (vLLM's and OpenAI's answer) when the prompt's `tokens` and
/// the most the request may write cannot fit `max` tokens.
fn too_long(req: &LlmRequest<'_>, tokens: usize, max: usize) -> Option<ApiError> {
    let most = req.max_output() as usize;
    if tokens + most <= max && tokens < max {
        return None;
    }
    let param = if req.route == LlmRoute::Completions { "prompt" } else { "messages" };
    let e = ApiError::invalid_request(format!(
        "This model's maximum context length is {max} tokens. However, you requested {} tokens ({tokens} in the {param}, {most} in the completion). Please reduce the length of the {param} or completion.",
        tokens + most
    ))
    .with_code("context_length_exceeded")
    .with_param(param);
    Some(e)
}

/// Answers the client's error and counts it under `reason`.
pub async fn reject(
    state: &AppState,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    e: &ApiError,
    reason: &str,
) -> pingora::Result<()> {
    state.metrics.refused(reason);
    ctx.status = e.status;
    respond::send_error(down, e, &[]).await
}
