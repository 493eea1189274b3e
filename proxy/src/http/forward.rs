//! One LLM request through the proxy: read and parse the body, pick a pool and a backend, send
//! the client's bytes, relay the answer. A backend that fails before anything reached the client
//! (no connection, a broken connection, a 5xx, silence past the idle timeout) is counted against
//! its health and the request tries another one, within `retry.max_attempts` and the retry
//! budget. Once bytes reached the client there is no retry: a broken stream ends with an error
//! event instead.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::client::HttpSession;
use pingora::proxy::Session;
use warmpath_wire::openai::ApiError;

use super::body::{read_body, BodyError};
use super::client::FailKind;
use super::downstream::Downstream;
use super::head::{build_request, Head, Template, HOP_BY_HOP};
use super::relay::{end_stream_with_error, pump, PrefillWatch, Pumped, ResponseId, Tail};
use super::request::{LlmRequest, LlmRoute};
use super::respond::{self, send_error};
use super::{AppState, RequestCtx};
use crate::cache::{Entry, Recording, ResponseCache, Verdict};
use crate::route::{Backend, Ejection, NoBackend, Pool, Selected};

/// Most bytes of a 5xx body kept to hand to the client if no retry succeeds.
const MAX_ERROR_BODY: usize = 1 << 20;

/// Response headers warmpath does not copy: hop-by-hop ones and those framing sets again.
fn skip_response_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n) || matches!(n, "date" | "content-length")
}

/// Why an attempt did not produce the client's answer.
#[derive(Debug)]
pub(super) enum Failure {
    Io(FailKind),
    Status { header: Box<ResponseHeader>, body: Bytes },
}

impl Failure {
    fn label(&self) -> &'static str {
        match self {
            Failure::Io(k) => k.label(),
            Failure::Status { .. } => "status_5xx",
        }
    }
}

pub(super) enum Attempt {
    /// The client has its answer (or is gone): stop.
    Done,
    /// Nothing reached the client; another backend may try.
    Failed(Failure),
}

pub async fn serve(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
    route: LlmRoute,
) -> pingora::Result<()> {
    let Some(body) = read_client_body(state, session, ctx).await? else { return Ok(()) };
    let head = Head::of(session.req_header());
    run(state, session, ctx, route, body, &head).await
}

/// The client's body, or `None` once the client has its error (413, 408) or is gone.
pub async fn read_client_body(
    state: &AppState,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> pingora::Result<Option<Bytes>> {
    let limits = &state.cfg.limits;
    let deadline = std::time::Duration::from_millis(limits.body_read_timeout_ms);
    match read_body(session, limits.max_body_bytes, deadline).await {
        Ok(b) => {
            state.metrics.request_bytes.observe(b.len() as f64);
            Ok(Some(b))
        }
        Err(BodyError::Reject(e)) => {
            let reason = if e.status == 413 { "too_large" } else { "body_timeout" };
            reject(state, session, ctx, &e, reason).await.map(|()| None)
        }
        Err(BodyError::ClientGone) => {
            state.metrics.client_disconnects.inc();
            ctx.status = 499;
            Ok(None)
        }
    }
}

/// Forwards one LLM request whose body is read: canonical form, response cache, pool and
/// backend, retries; the answer goes to `session`.
pub async fn run(
    state: &AppState,
    session: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    route: LlmRoute,
    body: Bytes,
    head: &Head,
) -> pingora::Result<()> {
    let parsed = match LlmRequest::parse(route, &body) {
        Ok(p) => p,
        Err(e) => return reject(state, session, ctx, &e, "bad_request").await,
    };
    let Some(pool) = state.router.pool_for(parsed.model()) else {
        let e = ApiError::model_not_found(parsed.model());
        return reject(state, session, ctx, &e, "model_not_found").await;
    };
    let hash = pool.policy.wants_prefix() || pool.policy.wants_blocks() || pool.canon.rewrites();
    let started = Instant::now();
    let prepared = match pool.canon.prepare(&parsed, hash) {
        Ok(p) => p,
        Err(e) => return reject(state, session, ctx, &e, "bad_request").await,
    };
    state.metrics.record_canon(&pool.name, &pool.canon, &prepared, started.elapsed());
    let prefix_hdr = prepared.blocks.as_ref().map(|b| format!("{:016x}", b.prefix_hash));
    let mut cache_hdr = None;
    if let Some(cache) = &pool.response_cache {
        let sent: &[u8] = prepared.body.as_deref().unwrap_or(&body);
        match look_up(cache, pool, head, &parsed, route, sent) {
            Looked::Hit(entry) => {
                state.metrics.response_cache_requests.with_label_values(&[&pool.name, "hit"]).inc();
                return replay(state, session, ctx, &entry, prefix_hdr.as_deref()).await;
            }
            Looked::Miss(rec) => {
                state.metrics.response_cache_requests.with_label_values(&[&pool.name, "miss"]).inc();
                ctx.recording = Some((pool.clone(), rec));
            }
            Looked::Bypass => {
                state.metrics.response_cache_requests.with_label_values(&[&pool.name, "bypass"]).inc();
            }
        }
        cache_hdr = Some("miss");
    }
    let key = parsed.route_key(pool, head.session_id.as_deref(), prepared.blocks);
    drop(parsed);
    let search = prepared.search;
    let body = prepared.body.map(Bytes::from).unwrap_or(body);
    let template = &head.template;

    pool.budget.deposit();
    let mut tried = Vec::new();
    let mut last: Option<Failure> = None;
    for attempt in 1..=state.cfg.retry.max_attempts {
        if let Some(prev) = &last {
            if !pool.budget.try_withdraw(Instant::now()) {
                state.metrics.retry_budget_exhausted.with_label_values(&[&pool.name]).inc();
                break;
            }
            state.metrics.retries.with_label_values(&[&pool.name, prev.label()]).inc();
        }
        let sel = match pool.select(&key, &tried, &state.metrics) {
            Ok(s) => s,
            Err(_) if last.is_some() => break,
            Err(NoBackend::Saturated) => {
                return reject(state, session, ctx, &respond::overloaded(&pool.name), "overloaded").await
            }
            Err(NoBackend::Unavailable) => {
                return reject(state, session, ctx, &respond::no_backend(&pool.name), "no_backend").await
            }
        };
        tried.push(sel.index);
        let backend = sel.backend().clone();
        ctx.backend = Some(backend.name.clone());
        let mut route_hdr = format!("{}; reason={}", pool.policy.name(), sel.reason);
        if !sel.detail.is_empty() {
            route_hdr.push_str("; ");
            route_hdr.push_str(&sel.detail);
        }
        if attempt > 1 {
            route_hdr.push_str(&format!("; attempt={attempt}"));
        }
        let shown = Shown { route: &route_hdr, prefix: prefix_hdr.as_deref(), cache: cache_hdr };
        match try_backend(state, session, ctx, route, pool, &sel, template, &body, shown, search.as_ref())
            .await?
        {
            Attempt::Done => return Ok(()),
            Attempt::Failed(f) => {
                note_failure(state, pool, &backend, f.label());
                tracing::warn!(backend = %backend.name, attempt, failure = f.label(), "backend attempt failed");
                last = Some(f);
            }
        }
    }
    // Every attempt failed before anything reached the client.
    match last {
        Some(Failure::Status { header, body }) => {
            let shown = Shown { route: "exhausted", prefix: prefix_hdr.as_deref(), cache: cache_hdr };
            let mut resp = copy_response_header(&header, ctx.backend.as_deref().unwrap_or(""), shown)?;
            resp.insert_header(header::CONTENT_LENGTH, body.len().to_string())?;
            ctx.status = resp.status.as_u16();
            session.write_response_header(Box::new(resp), body.is_empty()).await?;
            if !body.is_empty() {
                session.write_response_body(Some(body), true).await?;
            }
            Ok(())
        }
        Some(Failure::Io(kind)) => {
            let (status, what) = match kind {
                FailKind::Timeout => (504, "the backend did not answer within the idle timeout"),
                FailKind::Connect => (502, "could not connect to a backend"),
                FailKind::Io => (502, "the backend connection failed before a response"),
            };
            let e = respond::upstream_failed(status, what);
            let hdrs = [("x-warmpath-backend", ctx.backend.clone().unwrap_or_default())];
            ctx.status = status;
            state.metrics.rejections.with_label_values(&["upstream_failed"]).inc();
            send_error(session, &e, &hdrs).await
        }
        None => reject(state, session, ctx, &respond::no_backend(&pool.name), "no_backend").await,
    }
}

pub(super) fn note_failure(state: &AppState, pool: &Pool, backend: &Arc<Backend>, kind: &str) {
    state.metrics.upstream_errors.with_label_values(&[&backend.name, kind]).inc();
    if let Ejection::Ejected(d) = backend.record_failure(&state.cfg.health, Instant::now()) {
        state.metrics.ejections.with_label_values(&[&pool.name, &backend.name]).inc();
        tracing::warn!(backend = %backend.name, ejected_for = ?d, "backend ejected after consecutive failures");
    }
}

async fn reject(
    state: &AppState,
    session: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    e: &ApiError,
    reason: &str,
) -> pingora::Result<()> {
    state.metrics.rejections.with_label_values(&[reason]).inc();
    ctx.status = e.status;
    send_error(session, e, &[]).await
}

/// warmpath's own response headers beside `x-warmpath-backend`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shown<'a> {
    /// `x-warmpath-route`: policy and reason.
    pub route: &'a str,
    /// `x-warmpath-prefix-hash`, where the prompt was cut into blocks.
    pub prefix: Option<&'a str>,
    /// `x-warmpath-cache`, where the pool has a response cache.
    pub cache: Option<&'a str>,
}

/// What the client sees of the backend's header: everything but hop-by-hop fields, plus
/// warmpath's own; chunked framing where the backend gave no length.
pub(super) fn copy_response_header(
    up: &ResponseHeader,
    backend: &str,
    shown: Shown<'_>,
) -> pingora::Result<ResponseHeader> {
    let mut resp = ResponseHeader::build(up.status, Some(up.headers.len() + 4))?;
    for (n, v) in up.headers.iter().filter(|(n, _)| !skip_response_header(n)) {
        resp.append_header(n.clone(), v.clone())?;
    }
    resp.insert_header("x-warmpath-backend", backend)?;
    resp.insert_header("x-warmpath-route", shown.route)?;
    if let Some(p) = shown.prefix {
        resp.insert_header("x-warmpath-prefix-hash", p)?;
    }
    if let Some(c) = shown.cache {
        resp.insert_header("x-warmpath-cache", c)?;
    }
    Ok(resp)
}

pub(super) enum Sent {
    Header,
    ClientGone,
}

/// Sends the request and waits for the response header, watching the client meanwhile.
pub(super) async fn send(
    up: &mut HttpSession,
    req: RequestHeader,
    body: &Bytes,
    session: &mut dyn Downstream,
) -> pingora::Result<Sent> {
    up.write_request_header(Box::new(req)).await?;
    up.write_request_body(body.clone(), true).await?;
    up.finish_request_body().await?;
    tokio::select! {
        biased;
        r = up.read_response_header() => r.map(|()| Sent::Header),
        _ = session.gone() => Ok(Sent::ClientGone),
    }
}

#[allow(clippy::too_many_arguments)]
async fn try_backend(
    state: &AppState,
    session: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    route: LlmRoute,
    pool: &Pool,
    sel: &Selected,
    template: &Template,
    body: &Bytes,
    shown: Shown<'_>,
    search: Option<&crate::tools::search::SearchPlan>,
) -> pingora::Result<Attempt> {
    let backend = sel.backend();
    // A pooled connection the backend closed while idle fails at once; one fresh connection
    // to the same backend does not count as a retry.
    let mut may_redial = true;
    let mut up = loop {
        let (mut up, reused) = match state.upstream.connect(backend).await {
            Ok(x) => x,
            Err(e) => return Ok(Attempt::Failed(Failure::Io(FailKind::of(&e)))),
        };
        let req = build_request(template, backend, body.len())?;
        match send(&mut up, req, body, session).await {
            Ok(Sent::Header) => break up,
            Ok(Sent::ClientGone) => {
                state.metrics.client_disconnects.inc();
                ctx.status = 499;
                return Ok(Attempt::Done);
            }
            Err(e) if reused && may_redial && FailKind::of(&e) == FailKind::Io => {
                may_redial = false;
                tracing::debug!(backend = %backend.name, error = %e, "stale pooled connection; redialling");
            }
            Err(e) => return Ok(Attempt::Failed(Failure::Io(FailKind::of(&e)))),
        }
    };
    let Some(up_header) = up.response_header().cloned() else {
        return Ok(Attempt::Failed(Failure::Io(FailKind::Io)));
    };
    let status = up_header.status.as_u16();
    if status >= 500 {
        let mut buf = BytesMut::new();
        loop {
            match up.read_response_body().await {
                Ok(Some(b)) if buf.len() + b.len() <= MAX_ERROR_BODY => buf.extend_from_slice(&b),
                Ok(Some(_)) => break,
                Ok(None) => {
                    state.upstream.release(up, backend).await;
                    break;
                }
                Err(e) => return Ok(Attempt::Failed(Failure::Io(FailKind::of(&e)))),
            }
        }
        return Ok(Attempt::Failed(Failure::Status { header: Box::new(up_header), body: buf.freeze() }));
    }

    if let (Some(plan), 200) = (search, status) {
        let rounds = super::deferred::Rounds {
            state,
            pool,
            backend,
            index: sel.index,
            template,
            plan: plan.clone(),
            body: body.clone(),
            done: 0,
            shown: Vec::new(),
        };
        return super::deferred::serve(rounds, session, ctx, route, up, up_header, shown).await;
    }
    if let Some((_, rec)) = &mut ctx.recording {
        rec.header(status, up_header.headers.get(header::CONTENT_TYPE));
    }
    let mut resp = copy_response_header(&up_header, &backend.name, shown)?;
    match up_header.headers.get(header::CONTENT_LENGTH) {
        Some(len) => resp.insert_header(header::CONTENT_LENGTH, len.clone())?,
        None => resp.insert_header(header::TRANSFER_ENCODING, "chunked")?,
    }
    let sse = up_header
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    ctx.status = status;
    if session.write_response_header(Box::new(resp), false).await.is_err() {
        state.metrics.client_disconnects.inc();
        return Ok(Attempt::Done);
    }
    let mut tail = Tail::default();
    // A Responses answer's id: a request chaining on it (`previous_response_id`) is routed here.
    let mut response_id = (route == LlmRoute::Responses && status == 200).then(ResponseId::default);
    let mut rec = ctx.recording.as_mut().map(|(_, r)| r);
    let mut observe = |b: &[u8]| {
        if let Some(r) = rec.as_deref_mut() {
            r.push(b);
        }
        if let Some(id) = &mut response_id {
            id.push(b);
        }
    };
    let mut watch = PrefillWatch::new(sse);
    let prefill = (&sel.prefill, &mut watch);
    let pumped = pump(&mut up, session, &mut ctx.first_byte, prefill, &mut tail, &mut observe).await;
    if let Some(id) = response_id.as_mut().and_then(ResponseId::take) {
        pool.policy.bind(crate::route::key::response_session(&id), sel.index);
    }
    match pumped {
        Pumped::Complete if sse && route.ends_with_done() && status == 200 && !tail.saw_done() => {
            // Complete at the HTTP level but not as a stream: the client could not tell it
            // from a truncated answer, so it gets the error event a cut stream gets.
            note_failure(state, pool, backend, "stream_cut");
            tracing::warn!(backend = %backend.name, "backend ended an SSE stream without data: [DONE]");
            let _ =
                end_stream_with_error(session, route, &tail, "the backend ended the stream without [DONE]")
                    .await;
        }
        Pumped::Complete => {
            backend.record_success(&state.cfg.health, Instant::now());
            if up.response_done() {
                state.upstream.release(up, backend).await;
            }
            if session.write_response_body(None, true).await.is_err() {
                state.metrics.client_disconnects.inc();
                ctx.client_gone = true;
            } else if let Some((_, rec)) = &mut ctx.recording {
                rec.complete();
            }
        }
        Pumped::ClientGone => {
            // Dropping `up` closes the backend connection, which cancels the generation.
            state.metrics.client_disconnects.inc();
            ctx.client_gone = true;
        }
        Pumped::UpstreamCut(kind) => {
            note_failure(state, pool, backend, "stream_cut");
            tracing::warn!(backend = %backend.name, failure = kind.label(), "backend stream broke after the first byte");
            if sse {
                let msg = format!("the backend's stream broke off ({})", kind.label());
                let _ = end_stream_with_error(session, route, &tail, &msg).await;
            } else {
                // A body with a length cannot be ended early honestly: close the connection.
                session.close_after();
                ctx.truncated = true;
            }
        }
    }
    Ok(Attempt::Done)
}

enum Looked {
    Hit(Arc<Entry>),
    /// Eligible and not held: the answer is recorded.
    Miss(Recording),
    /// Not deterministic, or the client said `Cache-Control: no-store`.
    Bypass,
}

/// The response cache's answer for a request: a hit, or a recording for its answer.
fn look_up(
    cache: &ResponseCache,
    pool: &Pool,
    head: &Head,
    parsed: &LlmRequest<'_>,
    route: LlmRoute,
    sent: &[u8],
) -> Looked {
    let directives = head.cache_control;
    if directives.no_store {
        return Looked::Bypass;
    }
    if let Verdict::Bypass(why) = crate::cache::verdict(parsed) {
        tracing::debug!(why, "response cache bypassed");
        return Looked::Bypass;
    }
    let key = cache.key(&pool.name, route, parsed.model(), head.authorization(), sent);
    match cache.get(key).filter(|_| !directives.no_lookup) {
        Some(entry) => Looked::Hit(entry),
        None => Looked::Miss(cache.record(key)),
    }
}

/// Answers from the response cache: the kept body, a stream chunk by chunk as it was relayed.
async fn replay(
    state: &AppState,
    session: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    entry: &Entry,
    prefix: Option<&str>,
) -> pingora::Result<()> {
    let mut resp = ResponseHeader::build(200, Some(6))?;
    if let Some(ct) = &entry.content_type {
        resp.insert_header(header::CONTENT_TYPE, ct.clone())?;
    }
    if entry.stream {
        resp.insert_header(header::TRANSFER_ENCODING, "chunked")?;
    } else {
        resp.insert_header(header::CONTENT_LENGTH, entry.len().to_string())?;
    }
    resp.insert_header("x-warmpath-route", "response_cache; reason=hit")?;
    resp.insert_header("x-warmpath-cache", "hit")?;
    resp.insert_header(header::AGE, entry.age().as_secs().to_string())?;
    if let Some(p) = prefix {
        resp.insert_header("x-warmpath-prefix-hash", p)?;
    }
    ctx.status = 200;
    let mut ok = session.write_response_header(Box::new(resp), entry.is_empty()).await.is_ok();
    for chunk in entry.chunks() {
        if !ok {
            break;
        }
        ok = session.write_response_body(Some(chunk), false).await.is_ok();
        ctx.first_byte.get_or_insert_with(Instant::now);
    }
    if ok && !entry.is_empty() {
        ok = session.write_response_body(None, true).await.is_ok();
    }
    if !ok {
        state.metrics.client_disconnects.inc();
        ctx.client_gone = true;
    }
    Ok(())
}

/// Keeps (or not) the answer recorded for the response cache; called once the request is over.
pub fn finish_recording(metrics: &crate::observe::Metrics, ctx: &mut RequestCtx) {
    let Some((pool, rec)) = ctx.recording.take() else { return };
    let Some(cache) = &pool.response_cache else { return };
    let outcome = cache.store(rec);
    metrics.response_cache_stores.with_label_values(&[&pool.name, outcome.label()]).inc();
    if outcome == crate::cache::Stored::Stored {
        metrics.response_cache_bytes.with_label_values(&[&pool.name]).set(cache.bytes() as i64);
        metrics.response_cache_entries.with_label_values(&[&pool.name]).set(cache.entries() as i64);
    }
}
