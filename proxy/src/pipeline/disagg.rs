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

use std::borrow::Cow;

use bytes::Bytes;

use super::attempt::{self, Failure, Reached, Retries};
use super::downstream::Downstream;
use super::Outgoing;
use crate::observe::trace::Kind;
use crate::request::json::string;
use crate::request::scan::object_fields;
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
    let Some(fields) = fields(&out.body).filter(handed_over) else { return Ok(Prefilled::Whole) };
    let (state, m) = (out.state, &out.state.metrics);
    let started = Instant::now();
    let body = prefill_body(&fields);
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
    m.disagg.prefills.with_label_values(&[&out.pool.name, label]).inc();
    if ctx.traced() {
        let mut attrs = vec![("warmpath.pool", pool.name.as_str().into())];
        if let Ok((_, b)) = &outcome {
            attrs.push(("warmpath.backend", b.as_str().into()));
        }
        ctx.span("prefill", Kind::Client, started, attrs, outcome.as_ref().err().map(|w| (*w).to_owned()));
    }
    let Ok((params, backend)) = outcome else { return Ok(Prefilled::Whole) };
    m.disagg.prefill_duration.with_label_values(&[&out.pool.name]).observe(started.elapsed().as_secs_f64());
    let body = rewrite(&fields, &[("kv_transfer_params", &params)], &[]);
    Ok(Prefilled::Decode { body, backend })
}

/// The body for a backend that `cache_aware` chose to fetch the prompt's prefix from
/// `source`'s cache (`kv_transfer`): the request with `kv_transfer_params` naming where, as a
/// remote prefill's would. `None` where the request cannot carry them (then it goes as it is
/// and the backend computes the prefix).
pub(super) fn fetch_body(out: &Outgoing<'_>, body: &Bytes, source: &crate::route::Backend) -> Option<Bytes> {
    let (host, port) = source.kv_transfer.as_deref()?.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    if !matches!(out.route, LlmRoute::Chat | LlmRoute::Completions) || out.search.is_some() {
        return None;
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let params = format!(
        r#"{{"do_remote_prefill":true,"do_remote_decode":false,"remote_host":{},"remote_port":{port},"remote_request_id":"0","remote_block_ids":[]}}"#,
        string(host)
    );
    let fields = fields(body).filter(handed_over)?;
    Some(rewrite(&fields, &[("kv_transfer_params", &params)], &[]))
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

/// A body's top-level fields: each key and its value's text.
type Fields<'a> = Vec<(Cow<'a, str>, &'a str)>;

/// The top-level fields of `body`, read once for every decision and rewrite of it; `None`
/// where it is not one JSON object.
fn fields(body: &[u8]) -> Option<Fields<'_>> {
    object_fields(std::str::from_utf8(body).ok()?).ok()
}

/// Whether the request can be handed over: it asks for one choice and carries no
/// `kv_transfer_params` of the client's own (it runs its own disaggregation).
fn handed_over(fields: &Fields<'_>) -> bool {
    let one = fields.iter().filter(|(k, _)| k == "n").all(|(_, v)| v.trim() == "1" || v.trim() == "null");
    one && !fields.iter().any(|(k, _)| k == "kv_transfer_params")
}

/// The body of `fields` with the top-level fields of `set` in place of its own (added at the
/// end where it has none) and those of `drop` left out; every other value keeps its bytes — a
/// re-serialized body would reorder the keys of tool schemas, and with them the prompt the
/// backend renders.
fn rewrite(fields: &Fields<'_>, set: &[(&str, &str)], drop: &[&str]) -> Bytes {
    let size: usize = fields.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    let mut out = String::with_capacity(size + 256);
    out.push('{');
    let mut put = |k: &str, v: &str| {
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str(&string(k));
        out.push(':');
        out.push_str(v);
    };
    for (k, v) in fields {
        if drop.contains(&k.as_ref()) {
            continue;
        }
        match set.iter().find(|(s, _)| s == k) {
            Some((_, new)) => put(k, new),
            None => put(k, v),
        }
    }
    for (k, v) in set {
        if !fields.iter().any(|(f, _)| f == k) {
            put(k, v);
        }
    }
    out.push('}');
    Bytes::from(out)
}

/// `body` without the client's own `kv_transfer_params` (`[pools.disagg] client_params` off):
/// a backend acts on them, and with `do_remote_prefill` connects wherever they say.
pub(super) fn without_client_params(body: Bytes) -> Bytes {
    let stripped = fields(&body).map(|f| rewrite(&f, &[], &["kv_transfer_params"]));
    stripped.unwrap_or(body)
}

/// The fields of vLLM's prefill request in place of the client's: the same prompt, one token,
/// answered whole, asking the backend to keep the K/V for a remote decode.
const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

fn prefill_body(fields: &Fields<'_>) -> Bytes {
    let mut set = vec![("stream", "false"), ("max_tokens", "1"), ("kv_transfer_params", PREFILL_PARAMS)];
    if fields.iter().any(|(k, _)| k == "max_completion_tokens") {
        set.push(("max_completion_tokens", "1"));
    }
    rewrite(fields, &set, &["stream_options"])
}

/// The text of the `kv_transfer_params` object of a prefill's answer, where it has one.
fn params_of(answer: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(answer).ok()?;
    let fields = object_fields(text).ok()?;
    let (_, v) = fields.into_iter().find(|(k, _)| k == "kv_transfer_params")?;
    v.trim_start().starts_with('{').then(|| v.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const REQ: &[u8] = br#"{"model":"m","tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}}}}}],"messages":[],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50}"#;

    #[test]
    fn the_prefill_asks_for_one_token_whole_and_a_remote_decode() {
        let req = fields(REQ).expect("an object");
        assert!(handed_over(&req));
        let p: Value = serde_json::from_slice(&prefill_body(&req)).expect("json");
        assert_eq!(p["stream"], false);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
    }

    #[test]
    fn every_other_byte_is_kept_in_both_halves() {
        // The tool schema's keys stay in their order ("z" before "a"): the prompt the backend
        // renders from them is the client's.
        let schema = r#"{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"z":{},"a":{}}}}}"#;
        let req = fields(REQ).expect("an object");
        let p = prefill_body(&req);
        assert!(std::str::from_utf8(&p).expect("utf8").contains(schema));
        let d = rewrite(&req, &[("kv_transfer_params", r#"{"remote_port":1}"#)], &[]);
        let text = std::str::from_utf8(&d).expect("utf8");
        assert!(text.starts_with(std::str::from_utf8(&REQ[..REQ.len() - 1]).expect("utf8")), "{text}");
        assert!(text.ends_with(r#","kv_transfer_params":{"remote_port":1}}"#), "{text}");
    }

    #[test]
    fn some_requests_are_not_handed_over() {
        let handed = |b: &[u8]| fields(b).is_some_and(|f| handed_over(&f));
        assert!(!handed(br#"{"model":"m","n":2}"#), "several choices");
        assert!(handed(br#"{"model":"m","n":1}"#));
        assert!(!handed(br#"{"model":"m","kv_transfer_params":{}}"#), "the client's own P/D");
        assert!(!handed(b"[1]"));
        assert!(params_of(br#"{"choices":[]}"#).is_none(), "a backend that is not a P/D prefill server");
        assert!(params_of(br#"{"kv_transfer_params":null}"#).is_none());
        let p = params_of(br#"{"kv_transfer_params":{"remote_port":1}}"#).expect("params");
        assert_eq!(serde_json::from_str::<Value>(&p).expect("json"), json!({"remote_port": 1}));
    }
}
