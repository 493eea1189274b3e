//! The response-cache stage: a repeated deterministic request is answered from the pool's
//! cache (`crate::cache`) without a backend, a stream replayed in the chunks it was relayed in;
//! any other eligible request has its answer recorded as it is relayed, and kept when the
//! request is over ([`finish_recording`]).

use std::sync::Arc;
use std::time::Instant;

use http::header;
use pingora::http::ResponseHeader;

use super::downstream::Downstream;
use crate::cache::{Entry, Recording, Stored, Verdict};
use crate::observe::Metrics;
use crate::request::head::Head;
use crate::request::LlmRequest;
use crate::state::{AppState, Pool, RequestCtx};

/// What the cache has for a request.
pub(super) enum Lookup {
    /// The pool keeps no cache.
    Off,
    Hit(Arc<Entry>),
    /// Eligible and not held: the answer is recorded.
    Miss(Recording),
    /// Not deterministic, or the client said `Cache-Control: no-store`.
    Bypass,
}

/// The response cache's answer for `req`, whose body goes out as `sent`; counted.
pub(super) fn look_up(
    state: &AppState,
    pool: &Pool,
    head: &Head,
    req: &LlmRequest<'_>,
    sent: &[u8],
) -> Lookup {
    let Some(cache) = &pool.response_cache else { return Lookup::Off };
    let lookup = if head.cache_control.no_store {
        Lookup::Bypass
    } else if let Verdict::Bypass(why) = crate::cache::verdict(req) {
        tracing::debug!(why, "response cache bypassed");
        Lookup::Bypass
    } else {
        let key = cache.key(&pool.name, req.route, req.model(), head.owner(), sent);
        match cache.get(key).filter(|_| !head.cache_control.no_lookup) {
            Some(entry) => Lookup::Hit(entry),
            None => Lookup::Miss(cache.record(key)),
        }
    };
    let label = match &lookup {
        Lookup::Hit(_) => "hit",
        Lookup::Miss(_) => "miss",
        Lookup::Bypass | Lookup::Off => "bypass",
    };
    state.metrics.response_cache_requests.with_label_values(&[&pool.name, label]).inc();
    lookup
}

/// Answers from the response cache: the kept body, a stream chunk by chunk as it was relayed.
pub(super) async fn replay(
    state: &AppState,
    down: &mut dyn Downstream,
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
    let mut ok = down.write_response_header(Box::new(resp), entry.is_empty()).await.is_ok();
    for chunk in entry.chunks() {
        if !ok {
            break;
        }
        ok = down.write_response_body(Some(chunk), false).await.is_ok();
        ctx.first_byte.get_or_insert_with(Instant::now);
    }
    if ok && !entry.is_empty() {
        ok = down.write_response_body(None, true).await.is_ok();
    }
    if !ok {
        super::client_left(state, down, ctx);
    }
    Ok(())
}

/// Keeps (or not) the answer recorded for the response cache; called once the request is over.
pub fn finish_recording(metrics: &Metrics, ctx: &mut RequestCtx) {
    let Some((pool, rec)) = ctx.recording.take() else { return };
    let Some(cache) = &pool.response_cache else { return };
    let outcome = cache.store(rec);
    metrics.response_cache_stores.with_label_values(&[&pool.name, outcome.label()]).inc();
    if outcome == Stored::Stored {
        metrics.response_cache_bytes.with_label_values(&[&pool.name]).set(cache.bytes() as i64);
        metrics.response_cache_entries.with_label_values(&[&pool.name]).set(cache.entries() as i64);
    }
}
