//! Prefill/decode disaggregation. Where a pool has prefill backends (role `prefill`), a
//! request's prefill goes to one of them first, chosen among them by the pool's policy
//! (cache-aware where it is), in vLLM's protocol: the body with `"kv_transfer_params":
//! {"do_remote_decode": true, ...}`, `max_tokens` 1, not streamed. The answer's
//! `kv_transfer_params` go into the request that [`super::forward`] then sends to a decode
//! backend (chosen by load and by what it holds), which fetches the prompt's K/V from the
//! prefill backend and decodes. The same exchange drives vLLM P/D deployments (NIXL and
//! other KV connectors) and the bundled engine.
//!
//! A prefill that fails before its answer is retried on another prefill backend; when none
//! can do it, the request goes whole to a decode backend, which computes the prompt itself —
//! slower, not an error (`warmpath_prefills_total{outcome="failed"}`). A client that leaves
//! during the prefill ends it there (the backend frees what it computed).

use std::time::Instant;

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::attempt::{self, Failure, Reached, Retries};
use super::downstream::Downstream;
use super::Outgoing;
use crate::observe::trace::Kind;
use crate::request::LlmRoute;
use crate::route::RouteKey;
use crate::state::RequestCtx;

/// What the prefill stage made of a request.
pub(super) enum Prefilled {
    /// Prefilled on `backend`: the decode body carries its `kv_transfer_params`.
    Decode { body: Bytes, backend: String },
    /// The request goes as it is (no prefill backends, or no prefill for it).
    Whole,
    /// The client left during the prefill.
    ClientGone,
}

/// Runs the prefill of `out` on the pool's prefill backends, where it has any.
pub(super) async fn prefill(
    out: &Outgoing<'_>,
    down: &mut dyn Downstream,
    ctx: &mut RequestCtx,
    key: &RouteKey,
) -> pingora::Result<Prefilled> {
    let Some(pool) = out.pool.prefill.as_deref() else { return Ok(Prefilled::Whole) };
    // The tool_search rounds call one backend again and again: they stay whole.
    if !matches!(out.route, LlmRoute::Chat | LlmRoute::Completions) || out.search.is_some() {
        return Ok(Prefilled::Whole);
    }
    if prompt_tokens(out, key) < out.pool.disagg.min_prompt_tokens {
        return Ok(Prefilled::Whole);
    }
    let Some(request) = handed_over(&out.body) else { return Ok(Prefilled::Whole) };
    let (state, m) = (out.state, &out.state.metrics);
    let started = Instant::now();
    let body = Bytes::from(prefill_body(&request));
    let mut retries = Retries::new(state, pool);
    let outcome = loop {
        let sel = match retries.next(key, out.priority).await {
            Ok(Some(sel)) => sel,
            Ok(None) | Err(_) => break Err("failed"),
        };
        let backend = sel.backend().clone();
        let mut up = match attempt::reach(state, down, &backend, out.template, &body).await? {
            Reached::Header(up, header) if header.status.as_u16() == 200 => up,
            // The request itself is refused: the decode backend will say why to the client.
            Reached::Header(..) => break Err("refused"),
            Reached::ClientGone => return Ok(Prefilled::ClientGone),
            Reached::Failed(f) => {
                retries.failed(&backend, f);
                continue;
            }
        };
        let answer = match attempt::read_whole(&mut up).await {
            Ok(b) => b,
            Err(kind) => {
                retries.failed(&backend, Failure::Io(kind));
                continue;
            }
        };
        if up.response_done() {
            state.upstream.release(up, &backend.peer);
        }
        backend.record_success(&state.cfg.health, Instant::now());
        match params_of(&answer) {
            Some(params) => break Ok((params, backend.name.clone())),
            None => {
                tracing::warn!(backend = %backend.name, "a prefill backend answered without kv_transfer_params: is it a P/D prefill server?");
                break Err("unsupported");
            }
        }
    };
    let label = outcome.as_ref().map_or_else(|why| *why, |_| "ok");
    m.prefills.with_label_values(&[&out.pool.name, label]).inc();
    if ctx.traced() {
        let mut attrs = vec![("warmpath.pool", pool.name.as_str().into())];
        if let Ok((_, b)) = &outcome {
            attrs.push(("warmpath.backend", b.as_str().into()));
        }
        ctx.span("prefill", Kind::Client, started, attrs, outcome.as_ref().err().map(|w| (*w).to_owned()));
    }
    let Ok((params, backend)) = outcome else { return Ok(Prefilled::Whole) };
    m.prefill_duration.with_label_values(&[&out.pool.name]).observe(started.elapsed().as_secs_f64());
    let mut decode = request;
    decode.insert("kv_transfer_params".into(), params);
    let body = Bytes::from(serde_json::to_vec(&decode).unwrap_or_default());
    Ok(Prefilled::Decode { body, backend })
}

/// The prompt's tokens: counted where the pool counts them, else estimated from its units or,
/// where the policy reads none, from the body (about four bytes a token).
fn prompt_tokens(out: &Outgoing<'_>, key: &RouteKey) -> usize {
    let units = &out.pool.route.units;
    match key.tokens {
        0 => out.body.len() / 4,
        n if units.exact_tokens => n,
        n => (n as f64 / units.per_token_guess.max(1.0)) as usize,
    }
}

/// The request as a JSON object, where it can be handed over: one choice, and no
/// `kv_transfer_params` of the client's own (it runs its own disaggregation).
fn handed_over(body: &[u8]) -> Option<Map<String, Value>> {
    let Ok(Value::Object(o)) = serde_json::from_slice(body) else { return None };
    let one = o.get("n").and_then(Value::as_u64).is_none_or(|n| n == 1);
    (one && !o.contains_key("kv_transfer_params")).then_some(o)
}

/// vLLM's prefill request: the same prompt, one token, answered whole, asking the backend to
/// keep the K/V for a remote decode.
fn prefill_body(request: &Map<String, Value>) -> Vec<u8> {
    let mut p = request.clone();
    p.insert("stream".into(), Value::Bool(false));
    p.remove("stream_options");
    p.insert("max_tokens".into(), json!(1));
    if p.contains_key("max_completion_tokens") {
        p.insert("max_completion_tokens".into(), json!(1));
    }
    p.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    serde_json::to_vec(&p).unwrap_or_default()
}

/// The `kv_transfer_params` of a prefill's answer, where it has them.
fn params_of(answer: &[u8]) -> Option<Value> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice(answer) else { return None };
    o.remove("kv_transfer_params").filter(Value::is_object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_asks_for_one_token_whole_and_a_remote_decode() {
        let req = handed_over(
            br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},
            "max_tokens":50,"max_completion_tokens":50}"#,
        )
        .expect("an object");
        let p: Value = serde_json::from_slice(&prefill_body(&req)).expect("json");
        assert_eq!(p["stream"], false);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(req["max_tokens"], 50, "the decode keeps the client's");
    }

    #[test]
    fn some_requests_are_not_handed_over() {
        assert!(handed_over(br#"{"model":"m","n":2}"#).is_none(), "several choices");
        assert!(handed_over(br#"{"model":"m","kv_transfer_params":{}}"#).is_none(), "the client's own P/D");
        assert!(handed_over(b"[1]").is_none());
        assert!(params_of(br#"{"choices":[]}"#).is_none(), "a backend that is not a P/D prefill server");
        assert_eq!(params_of(br#"{"kv_transfer_params":{"remote_port":1}}"#), Some(json!({"remote_port":1})));
    }
}
