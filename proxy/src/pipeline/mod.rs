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
pub mod downstream;
mod forward;
mod headers;
pub mod relay;
pub mod respond;

use std::time::Instant;

use bytes::Bytes;
use warmpath_wire::openai::ApiError;

pub use downstream::Downstream;

use crate::canon::Prepared;
use crate::request::head::{Head, RequestTemplate};
use crate::request::{LlmRequest, LlmRoute};
use crate::route::key::route_key;
use crate::state::{AppState, Pool, RequestCtx};
use crate::tools::search::SearchPlan;
use cached::Lookup;

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
    // 1. Parse.
    let parsed = match LlmRequest::parse(route, &body) {
        Ok(p) => p,
        Err(e) => return reject(state, down, ctx, &e, "bad_request").await,
    };
    // 2. Admit.
    let Some(pool) = state.pools.for_model(parsed.model()) else {
        let e = ApiError::model_not_found(parsed.model());
        return reject(state, down, ctx, &e, "model_not_found").await;
    };
    // Input safety checks: in-process rules take microseconds, so they run before anything
    // goes out (a blocked request never reaches a backend).
    let safety = match pool.safety.as_ref().map(|s| s.check_input(&parsed)) {
        None => None,
        Some(Ok(said)) => Some(said),
        Some(Err((said, e))) => {
            state.metrics.rejections.with_label_values(&["content_policy"]).inc();
            ctx.status = e.status;
            return respond::send_error(down, &e, &[("x-warmpath-safety", said.to_owned())]).await;
        }
    };
    // 3. Prepare.
    let prepared = match prepare(state, pool, &parsed) {
        Ok(p) => p,
        Err(e) => return reject(state, down, ctx, &e, "bad_request").await,
    };
    let prefix = prepared.blocks.as_ref().map(|b| format!("{:016x}", b.prefix_hash));
    // 4. Response cache.
    let sent: &[u8] = prepared.body.as_deref().unwrap_or(&body);
    let cache = match cached::look_up(state, pool, head, &parsed, sent) {
        Lookup::Hit(entry) => {
            return cached::replay(state, down, ctx, &entry, prefix.as_deref(), safety).await
        }
        Lookup::Miss(rec) => {
            ctx.recording = Some((pool.clone(), rec));
            Some("miss")
        }
        Lookup::Bypass => Some("miss"),
        Lookup::Off => None,
    };
    // 5. Route key.
    let key = route_key(&pool.route, &parsed, head.session_id.as_deref(), prepared.blocks);
    drop(parsed);
    // 6. Forward.
    let out = Outgoing {
        state,
        pool,
        route,
        template: &head.template,
        body: prepared.body.map(Bytes::from).unwrap_or(body),
        search: prepared.search.as_ref(),
        prefix: prefix.as_deref(),
        cache,
        safety,
    };
    forward::forward(&out, down, ctx, &key).await
}

/// A request ready to go to a backend of its pool.
struct Outgoing<'a> {
    pub state: &'a AppState,
    pub pool: &'a Pool,
    pub route: LlmRoute,
    pub template: &'a RequestTemplate,
    /// The body as it goes out (canonical, or the client's own bytes).
    pub body: Bytes,
    /// Tools were deferred: how to answer the model's searches.
    pub search: Option<&'a SearchPlan>,
    /// `x-warmpath-prefix-hash` and `x-warmpath-cache`.
    pub prefix: Option<&'a str>,
    pub cache: Option<&'static str>,
    /// `x-warmpath-safety`: the checks that ran, where the pool has any.
    pub safety: Option<&'static str>,
}

/// The canonical body and prefix blocks, where the pool rewrites or its policy reads blocks;
/// counted.
fn prepare(state: &AppState, pool: &Pool, req: &LlmRequest<'_>) -> Result<Prepared, ApiError> {
    let policy = &pool.route.policy;
    let hash = policy.wants_prefix() || policy.wants_blocks() || pool.canon.rewrites();
    let started = Instant::now();
    let prepared = pool.canon.prepare(req, hash)?;
    pool.canon.record(&state.metrics, &pool.name, &prepared, started.elapsed());
    Ok(prepared)
}

/// Answers the client's error and counts it under `reason`.
pub async fn reject(
    state: &AppState,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    e: &ApiError,
    reason: &str,
) -> pingora::Result<()> {
    state.metrics.rejections.with_label_values(&[reason]).inc();
    ctx.status = e.status;
    respond::send_error(down, e, &[]).await
}
