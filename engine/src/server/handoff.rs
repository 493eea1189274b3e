//! `kv_transfer_params` on the HTTP routes: a prefill for a remote decode holds its blocks and
//! says where they are; a decode after a remote prefill fetches them before it is queued
//! ([`crate::kv_transfer`]).

use serde_json::{Map, Value};
use warmpath_wire::openai::ApiError;
use warmpath_wire::prefix::block_hashes;

use super::AppState;
use crate::core::Handoff;
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
    let Some(role) = params::parse(extra)? else { return Ok((None, Handoff::default())) };
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

/// The `kv_transfer_params` of a prefill's answer: request `id`'s blocks, held here.
pub fn answer(state: &AppState, id: u64, prompt: &[u32], cache_salt: Option<&str>) -> Value {
    let bs = state.engine.info().block_size;
    let mut hashes = block_hashes(prompt, bs, cache_salt);
    hashes.truncate(prompt.len().saturating_sub(1) / bs);
    params::answer(&state.transfer, id, &hashes)
}

/// `body` as JSON with `kv_transfer_params` added where the request was a prefill.
pub fn with_params<T: serde::Serialize>(body: &T, params: Option<Value>) -> Result<Value, ApiError> {
    let mut v = serde_json::to_value(body).map_err(|e| ApiError::internal(e.to_string()))?;
    if let (Some(p), Value::Object(o)) = (params, &mut v) {
        o.insert("kv_transfer_params".into(), p);
    }
    Ok(v)
}
