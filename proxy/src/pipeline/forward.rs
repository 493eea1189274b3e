//! Forwarding a prepared request: pick a backend, attempt it (`attempt`), relay its answer to
//! the client chunk by chunk (`relay`) — or, where tools were deferred, answer the model's
//! searches and call it again (`deferred`) — and on a failure before anything reached the
//! client, try another backend.

use std::time::Instant;

use http::header;
use pingora::http::ResponseHeader;

use super::attempt::{self, Attempt, Reached, Retries};
use super::disagg::Prefilled;
use super::downstream::Downstream;
use super::headers::{is_sse, response_header, WarmpathHeaders};
use super::relay::{
    end_stream, end_stream_with_error, pump, PrefillWatch, Pumped, ResponseId, StreamEnd, Tail, UsageTail,
};
use super::Outgoing;
use crate::observe::trace::Kind;
use crate::request::LlmRoute;
use crate::route::{key, RouteKey, Selected};
use crate::state::RequestCtx;
use crate::upstream::conn::Conn;

/// Forwards `out` to a backend of its pool under `key`, retrying elsewhere on a failure before
/// the first byte; the answer (or the error) goes to `down`.
pub(super) async fn forward(
    out: &Outgoing<'_>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    key: &RouteKey,
) -> pingora::Result<()> {
    let (state, pool) = (out.state, &*out.pool.route);
    // Where the pool has prefill backends, the prefill first; the decode body then carries
    // where its K/V waits.
    let (decode, prefilled_on) = match super::disagg::prefill(out, down, ctx, key).await? {
        Prefilled::Decode { body, backend } => (Some(body), Some(backend)),
        Prefilled::Whole => (None, None),
        Prefilled::ClientGone => {
            super::client_left(state, down, ctx);
            ctx.status = 499;
            return Ok(());
        }
    };
    let body = decode.as_ref().unwrap_or(&out.body);
    let mut retries = Retries::new(state, pool);
    loop {
        let routing = Instant::now();
        let mut sel = match retries.next(key, out.priority).await {
            Ok(Some(sel)) => sel,
            Ok(None) => break,
            Err(why) => {
                let (e, reason) = attempt::no_backend(why, &pool.name);
                let attrs = vec![("warmpath.pool", pool.name.as_str().into())];
                ctx.span("route", Kind::Internal, routing, attrs, Some(reason.to_owned()));
                return super::reject(state, down, ctx, &e, reason).await;
            }
        };
        let backend = sel.backend().clone();
        if ctx.traced() {
            let attrs = vec![
                ("warmpath.pool", pool.name.as_str().into()),
                ("warmpath.policy", pool.policy.name().into()),
                ("warmpath.reason", sel.reason.into()),
                ("warmpath.backend", backend.name.as_str().into()),
                ("warmpath.detail", sel.detail.as_str().into()),
            ];
            ctx.span("route", Kind::Internal, routing, attrs, None);
        }
        ctx.backend = Some(backend.name.clone());
        if ctx.pool.is_none() {
            ctx.pool = Some(out.pool.clone());
        }
        let mut route_hdr = format!("{}; reason={}", pool.policy.name(), sel.reason);
        if !sel.detail.is_empty() {
            route_hdr.push_str("; ");
            route_hdr.push_str(&sel.detail);
        }
        if retries.attempt > 1 {
            route_hdr.push_str(&format!("; attempt={}", retries.attempt));
        }
        if let Some(p) = &prefilled_on {
            route_hdr.push_str("; prefill=");
            route_hdr.push_str(p);
        }
        // The chosen backend fetches the prompt's prefix from another's cache.
        let fetched = match (sel.fetch_from, &prefilled_on) {
            (Some(src), None) => pool.backends.get(src).and_then(|b| {
                let body = super::disagg::fetch_body(out, body, b)?;
                route_hdr.push_str("; fetch_from=");
                route_hdr.push_str(&b.name);
                Some(body)
            }),
            _ => None,
        };
        let body = fetched.as_ref().unwrap_or(body);
        // The detail is in the header now: the status page takes it.
        let detail = std::mem::take(&mut sel.detail);
        state.metrics.recent.push("route", &pool.name, &backend.name, sel.reason, detail);
        let headers = WarmpathHeaders { route: &route_hdr, prefix: out.prefix, cache: out.cache };
        let (sent, attempt_no) = (Instant::now(), retries.attempt);
        let attempt_span = |ctx: &mut RequestCtx, status: Option<u16>, error: Option<&str>| {
            if ctx.traced() {
                let mut attrs = vec![
                    ("warmpath.backend", backend.name.as_str().into()),
                    ("warmpath.attempt", u64::from(attempt_no).into()),
                ];
                if let Some(s) = status {
                    attrs.push(("http.response.status_code", i64::from(s).into()));
                }
                ctx.span("upstream attempt", Kind::Client, sent, attrs, error.map(str::to_owned));
            }
        };
        let (up, header) = match attempt::reach(state, down, &backend, out.template, body).await? {
            Reached::Header(up, header) => (up, header),
            Reached::ClientGone => {
                attempt_span(ctx, None, Some("the client left"));
                super::client_left(state, down, ctx);
                ctx.status = 499;
                return Ok(());
            }
            Reached::Failed(f) => {
                attempt_span(ctx, None, Some(f.label()));
                retries.failed(&backend, f);
                continue;
            }
        };
        let status = header.status.as_u16();
        let answered = match (out.search, status) {
            (Some(plan), 200) => {
                super::deferred::serve(out, &sel, plan, down, ctx, (up, header), headers).await?
            }
            _ => relay_answer(out, &sel, down, ctx, (up, header), headers).await?,
        };
        match answered {
            Attempt::Done => {
                attempt_span(ctx, Some(status), None);
                return Ok(());
            }
            Attempt::Failed(f) => {
                attempt_span(ctx, Some(status), Some(f.label()));
                retries.failed(&backend, f)
            }
        }
    }
    let headers = WarmpathHeaders { route: "exhausted", prefix: out.prefix, cache: out.cache };
    attempt::exhausted(state, down, ctx, retries.last.take(), headers, &pool.name).await
}

/// Relays the backend's answer (its header `up_header` is in, status below 500) to the client
/// chunk by chunk, recording it for the response cache, releasing the request's queued
/// prefill at the first event with output, and ending a broken stream with an error event.
async fn relay_answer(
    out: &Outgoing<'_>,
    sel: &Selected,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    (mut up, up_header): (Conn, ResponseHeader),
    headers: WarmpathHeaders<'_>,
) -> pingora::Result<Attempt> {
    let (state, pool, route) = (out.state, &*out.pool.route, out.route);
    let backend = sel.backend();
    let status = up_header.status.as_u16();
    if let Some((_, rec)) = &mut ctx.recording {
        rec.header(status, up_header.headers.get(header::CONTENT_TYPE));
    }
    let mut resp = response_header(&up_header, &backend.name, headers)?;
    match up_header.headers.get(header::CONTENT_LENGTH) {
        Some(len) => resp.insert_header(header::CONTENT_LENGTH, len.clone())?,
        None => resp.insert_header(header::TRANSFER_ENCODING, "chunked")?,
    }
    let sse = is_sse(&up_header);
    ctx.status = status;
    if down.write_response_header(Box::new(resp), false).await.is_err() {
        super::client_left(state, down, ctx);
        return Ok(Attempt::Done);
    }
    let mut tail = Tail::default();
    // A Responses answer's id: a request chaining on it (`previous_response_id`) is routed here.
    let mut response_id = (route == LlmRoute::Responses && status == 200).then(ResponseId::default);
    let mut rec = ctx.recording.as_mut().map(|(_, r)| r);
    // What the answer used, for the caller's token limits.
    let mut usage = out.counts_usage.then(UsageTail::default);
    let mut observe = |b: &[u8]| {
        if let Some(r) = rec.as_deref_mut() {
            r.push(b);
        }
        if let Some(u) = &mut usage {
            u.push(b);
        }
        if let Some(id) = &mut response_id {
            id.push(b);
        }
    };
    let mut watch = PrefillWatch::new(sse);
    let prefill = (&sel.prefill, &mut watch);
    let mut closing = state.lifecycle.closing();
    let pumped =
        pump(&mut up, down, &mut ctx.first_byte, prefill, &mut tail, &mut observe, &mut closing).await;
    ctx.usage = usage.as_ref().and_then(UsageTail::usage).or(ctx.usage);
    if let Some(id) = response_id.as_mut().and_then(ResponseId::take) {
        pool.policy.bind(key::response_session(&id), sel.index);
    }
    match pumped {
        Pumped::Complete if sse && route.ends_with_done() && status == 200 && !tail.saw_done() => {
            // Complete at the HTTP level but not as a stream: the client could not tell it
            // from a truncated answer, so it gets the error event a cut stream gets.
            attempt::note_failure(state, pool, backend, "stream_cut");
            tracing::warn!(backend = %backend.name, "backend ended an SSE stream without data: [DONE]");
            let _ = end_stream_with_error(down, route, &tail, "the backend ended the stream without [DONE]")
                .await;
        }
        Pumped::Complete => {
            backend.record_success(&state.cfg.health, Instant::now());
            if up.response_done() {
                state.upstream.release(up, &backend.peer);
            }
            if down.write_response_body(None, true).await.is_err() {
                super::client_left(state, down, ctx);
            } else if let Some((_, rec)) = &mut ctx.recording {
                rec.complete();
            }
        }
        Pumped::ClientGone => {
            // Dropping `up` closes the backend connection, which cancels the generation.
            super::client_left(state, down, ctx);
        }
        Pumped::Closing => {
            // Dropping `up` cancels the generation; the client learns why.
            if sse {
                let msg = "warmpath is shutting down: the stream was cut; retry the request";
                let _ = end_stream(down, route, &tail, msg, StreamEnd::Shutdown).await;
            } else {
                down.close_after();
                ctx.truncated = true;
            }
        }
        Pumped::UpstreamCut(kind) => {
            attempt::note_failure(state, pool, backend, "stream_cut");
            tracing::warn!(backend = %backend.name, failure = kind.label(), "backend stream broke after the first byte");
            if sse {
                let msg = format!("the backend's stream broke off ({})", kind.label());
                let _ = end_stream_with_error(down, route, &tail, &msg).await;
            } else {
                // A body with a length cannot be ended honestly: close the connection.
                down.close_after();
                ctx.truncated = true;
            }
        }
    }
    Ok(Attempt::Done)
}
