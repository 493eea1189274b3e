//! The upstream attempt machinery: one attempt at a backend (connect, send, wait for the
//! response header while watching the client), what counts as its failure, and the retries
//! around it. A backend that fails before anything reached the client (no connection, a
//! broken connection, a 5xx, silence past the idle timeout) is counted against its health and
//! the request tries another one, within `retry.max_attempts` and the pool's retry budget.
//! Once bytes reached the client there is no retry: a broken stream ends with an error event
//! instead (`relay`). The plain forward (`forward`) and the `tool_search` rounds (`deferred`)
//! both come here.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header;
use pingora::http::ResponseHeader;
use warmpath_wire::openai::ApiError;

use super::downstream::Downstream;
use super::headers::{response_header, WarmpathHeaders};
use super::respond::{self, send_error};
use crate::request::head::RequestTemplate;
use crate::route::{self, Backend, Ejection, NoBackend, RouteKey, Selected};
use crate::state::{AppState, RequestCtx};
use crate::upstream::conn::Conn;
use crate::upstream::FailKind;

/// Most bytes of a 5xx body kept to hand to the client if no retry succeeds.
const MAX_ERROR_BODY: usize = 1 << 20;

/// Largest whole (non-streamed) response read to look into it (searches, a prefill's answer).
const MAX_WHOLE_BODY: usize = 64 << 20;

/// Why an attempt did not produce the client's answer.
#[derive(Debug)]
pub(super) enum Failure {
    Io(FailKind),
    Status { header: Box<ResponseHeader>, body: Bytes },
}

impl Failure {
    pub fn label(&self) -> &'static str {
        match self {
            Failure::Io(k) => k.label(),
            Failure::Status { .. } => "status_5xx",
        }
    }
}

/// How answering from a backend whose header is in ended.
pub(super) enum Attempt {
    /// The client has its answer (or is gone): stop.
    Done,
    /// Nothing reached the client; another backend may try.
    Failed(Failure),
}

/// What sending a request to a backend came to. Returned once per attempt and taken apart at
/// once: the large variant is moved, not boxed.
#[allow(clippy::large_enum_variant)]
pub(super) enum Reached {
    /// Its response header is in (a status below 500, from [`reach`]).
    Header(Conn, ResponseHeader),
    /// The client left while the backend had not answered yet.
    ClientGone,
    Failed(Failure),
}

/// How sending a request ended, short of an error. Taken apart at once, like [`Reached`].
#[allow(clippy::large_enum_variant)]
enum Sent {
    /// The response header is in.
    Header(ResponseHeader),
    /// The client left first.
    ClientGone,
}

/// Sends the request and waits for the response header, watching the client meanwhile.
async fn send(up: &mut Conn, head: &[u8], body: &Bytes, down: &mut dyn Downstream) -> pingora::Result<Sent> {
    up.send(head, body).await?;
    tokio::select! {
        biased;
        r = up.read_response_header() => r.map(Sent::Header),
        _ = down.gone() => Ok(Sent::ClientGone),
    }
}

/// Connects to `backend` and sends `body` under `template`'s head; the response header (any
/// status), or why not. A pooled connection the backend closed while idle fails at once: one
/// fresh connection to the same backend does not count as a retry.
pub(super) async fn open(
    state: &AppState,
    down: &mut dyn Downstream,
    backend: &Backend,
    template: &RequestTemplate,
    body: &Bytes,
) -> pingora::Result<Reached> {
    let peer = &backend.peer;
    let mut may_redial = true;
    loop {
        let (mut up, reused) = match state.upstream.connect(peer).await {
            Ok(x) => x,
            Err(e) => return Ok(Reached::Failed(Failure::Io(FailKind::of(&e)))),
        };
        let head = peer.request_head(template, body.len());
        match send(&mut up, &head, body, down).await {
            Ok(Sent::Header(header)) => return Ok(Reached::Header(up, header)),
            Ok(Sent::ClientGone) => return Ok(Reached::ClientGone),
            Err(e) if reused && may_redial && FailKind::of(&e) == FailKind::Io => {
                may_redial = false;
                tracing::debug!(backend = %backend.name, error = %e, "stale pooled connection; redialling");
            }
            Err(e) => return Ok(Reached::Failed(Failure::Io(FailKind::of(&e)))),
        }
    }
}

/// [`open`], with a 5xx read whole and turned into a [`Failure`] (another backend may answer).
pub(super) async fn reach(
    state: &AppState,
    down: &mut dyn Downstream,
    backend: &Backend,
    template: &RequestTemplate,
    body: &Bytes,
) -> pingora::Result<Reached> {
    let (mut up, header) = match open(state, down, backend, template, body).await? {
        Reached::Header(up, header) => (up, header),
        other => return Ok(other),
    };
    if header.status.as_u16() < 500 {
        return Ok(Reached::Header(up, header));
    }
    let mut buf = BytesMut::new();
    loop {
        match up.read_response_body().await {
            Ok(Some(b)) if buf.len() + b.len() <= MAX_ERROR_BODY => buf.extend_from_slice(&b),
            Ok(Some(_)) => break,
            Ok(None) => {
                state.upstream.release(up, &backend.peer);
                break;
            }
            Err(e) => return Ok(Reached::Failed(Failure::Io(FailKind::of(&e)))),
        }
    }
    Ok(Reached::Failed(Failure::Status { header: Box::new(header), body: buf.freeze() }))
}

/// A response body read whole (up to [`MAX_WHOLE_BODY`]), or why not.
pub(super) async fn read_whole(up: &mut Conn) -> Result<Bytes, FailKind> {
    let mut buf = BytesMut::new();
    loop {
        match up.read_response_body().await {
            Ok(Some(b)) if buf.len() + b.len() <= MAX_WHOLE_BODY => buf.extend_from_slice(&b),
            Ok(Some(_)) => return Err(FailKind::Io),
            Ok(None) => return Ok(buf.freeze()),
            Err(e) => return Err(FailKind::of(&e)),
        }
    }
}

/// Counts a backend fault against `backend` (which may eject it).
pub(super) fn note_failure(state: &AppState, pool: &route::Pool, backend: &Arc<Backend>, kind: &str) {
    state.metrics.upstream_errors.with_label_values(&[&backend.name, kind]).inc();
    if let Ejection::Ejected(d) = backend.record_failure(&state.cfg.health, Instant::now()) {
        state.metrics.ejections.with_label_values(&[&pool.name, &backend.name]).inc();
        tracing::warn!(backend = %backend.name, ejected_for = ?d, "backend ejected after consecutive failures");
    }
}

/// The attempts of one request: which backends were tried, the last failure, the budget.
pub(super) struct Retries<'a> {
    state: &'a AppState,
    pool: &'a route::Pool,
    tried: Vec<usize>,
    pub last: Option<Failure>,
    /// The attempt about to be made, from 1.
    pub attempt: u32,
}

impl<'a> Retries<'a> {
    /// Every request earns the pool's budget its share of retries.
    pub fn new(state: &'a AppState, pool: &'a route::Pool) -> Retries<'a> {
        pool.budget.deposit();
        Retries { state, pool, tried: Vec::new(), last: None, attempt: 0 }
    }

    /// The next backend to try, its slot reserved: `Ok(None)` when attempts or the retry budget
    /// are used up (or no untried backend is left after a failure), `Err` when not even the
    /// first attempt finds a backend.
    pub async fn next(&mut self, key: &RouteKey, priority: i64) -> Result<Option<Selected>, NoBackend> {
        let m = &self.state.metrics;
        if self.attempt >= self.state.cfg.retry.max_attempts {
            return Ok(None);
        }
        if let Some(prev) = &self.last {
            if !self.pool.budget.try_withdraw(Instant::now()) {
                m.retry_budget_exhausted.with_label_values(&[&self.pool.name]).inc();
                return Ok(None);
            }
            m.retries.with_label_values(&[&self.pool.name, prev.label()]).inc();
        }
        // The first attempt waits in the pool's queue while every backend is full; a retry
        // takes what is free or gives up.
        let picked = match self.last {
            None => self.pool.acquire(key, m, priority).await,
            Some(_) => self.pool.select(key, &self.tried, m),
        };
        match picked {
            Ok(sel) => {
                self.attempt += 1;
                self.tried.push(sel.index);
                Ok(Some(sel))
            }
            Err(_) if self.last.is_some() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The attempt on `backend` failed before anything reached the client.
    pub fn failed(&mut self, backend: &Arc<Backend>, f: Failure) {
        note_failure(self.state, self.pool, backend, f.label());
        tracing::warn!(backend = %backend.name, attempt = self.attempt, failure = f.label(), "backend attempt failed");
        self.last = Some(f);
    }
}

/// The client's answer when every attempt failed before anything reached it: the last
/// backend's own 5xx as it sent it, else 502 (504 for silence), in the OpenAI error shape.
pub(super) async fn exhausted(
    state: &AppState,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    last: Option<Failure>,
    headers: WarmpathHeaders<'_>,
    pool: &str,
) -> pingora::Result<()> {
    match last {
        Some(Failure::Status { header, body }) => {
            let mut resp = response_header(&header, ctx.backend.as_deref().unwrap_or(""), headers)?;
            resp.insert_header(header::CONTENT_LENGTH, body.len().to_string())?;
            ctx.status = resp.status.as_u16();
            down.write_response_header(Box::new(resp), body.is_empty()).await?;
            if !body.is_empty() {
                down.write_response_body(Some(body), true).await?;
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
            state.metrics.refused("upstream_failed");
            send_error(down, &e, &hdrs).await
        }
        None => super::reject(state, down, ctx, &respond::no_backend(pool), "no_backend").await,
    }
}

/// `ApiError` for a pool none of whose backends could be picked for the first attempt.
pub(super) fn no_backend(why: NoBackend, pool: &str) -> (ApiError, &'static str) {
    match why {
        NoBackend::Saturated | NoBackend::QueueFull => (respond::overloaded(pool), "overloaded"),
        NoBackend::Unavailable => (respond::no_backend(pool), "no_backend"),
    }
}
