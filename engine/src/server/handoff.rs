//! `kv_transfer_params` on the HTTP routes: a prefill for a remote decode holds its blocks and
//! says where they are; a decode after a remote prefill fetches them before it is queued
//! ([`crate::kv_transfer`]); any other request first loads what the shared KV tier holds of its
//! prompt past this replica's cache ([`crate::kv_tier::shared`]).

use serde_json::{Map, Value};
use std::time::Instant;
use warmpath_wire::openai::ApiError;

use super::AppState;
use crate::core::{Handoff, Loaded};
use crate::kv_tier::SharedTier;
use crate::kv_transfer::{fetch, params, KvRole};

/// What a request's `kv_transfer_params` make of it, checked before anything is queued.
pub async fn prepare(
    state: &AppState,
    extra: &Map<String, Value>,
    stream: bool,
    choices: usize,
    prompt: &[u32],
    cache_salt: Option<&str>,
) -> Result<(Option<KvRole>, Handoff), ApiError> {
    let Some(role) = params::parse(extra)? else {
        let loaded = match &state.shared {
            Some(tier) => from_shared(state, tier, prompt, cache_salt).await,
            _ => None,
        };
        return Ok((None, Handoff { hold: None, loaded }));
    };
    let bad = |m: &str| Err(ApiError::invalid_request(m).with_param("kv_transfer_params"));
    if choices != 1 {
        return bad("a prefill/decode handoff carries one prompt and one choice (n = 1)");
    }
    let cfg = &state.transfer;
    let handoff = match &role {
        KvRole::Prefill => {
            if stream {
                return bad("a prefill for a remote decode is answered whole: set stream to false");
            }
            if cfg.advertise.is_none() || state.engine.block_bytes() == 0 {
                return bad(
                    "this replica serves no K/V to decode replicas (start it with --kv-transfer-port)",
                );
            }
            Handoff { hold: Some(cfg.hold), loaded: None }
        }
        KvRole::Decode(remote) => {
            let loaded = if state.engine.block_bytes() == 0 {
                None
            } else {
                fetch::fetch(&state.engine, cfg, remote, prompt, cache_salt).await
            };
            Handoff { hold: None, loaded }
        }
    };
    Ok((Some(role), handoff))
}

/// The blocks of `prompt` past this replica's cached prefix that the shared tier holds.
async fn from_shared(
    state: &AppState,
    tier: &SharedTier,
    prompt: &[u32],
    cache_salt: Option<&str>,
) -> Option<Loaded> {
    let started = Instant::now();
    let hashes = state.engine.loadable_hashes(prompt, cache_salt);
    if hashes.is_empty() {
        return None;
    }
    let first = state.engine.cached_prefix(hashes.clone()).await;
    let blocks = match first < hashes.len() {
        true => tier.fetch(&hashes[first..]).await,
        false => Vec::new(),
    };
    tier.metrics.seconds.observe(started.elapsed().as_secs_f64());
    Loaded::arrived(hashes, first, blocks)
}

/// The `kv_transfer_params` of a prefill's answer: request `id`'s blocks, held here.
pub fn answer(state: &AppState, id: u64, prompt: &[u32], cache_salt: Option<&str>) -> Value {
    params::answer(&state.transfer, id, &state.engine.loadable_hashes(prompt, cache_salt))
}

/// `body` as JSON with `kv_transfer_params` added where the request was a prefill.
pub fn with_params<T: serde::Serialize>(body: &T, params: Option<Value>) -> Result<Value, ApiError> {
    let mut v = serde_json::to_value(body).map_err(|e| ApiError::internal(e.to_string()))?;
    if let (Some(p), Value::Object(o)) = (params, &mut v) {
        o.insert("kv_transfer_params".into(), p);
    }
    Ok(v)
}
