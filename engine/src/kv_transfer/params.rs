//! `kv_transfer_params`, as vLLM's KV connectors read and write it.

use serde_json::{json, Map, Value};
use warmpath_wire::openai::ApiError;
use warmpath_wire::prefix::BlockHash;

use super::TransferConfig;

/// A request's part in a prefill/decode handoff.
#[derive(Debug, Clone, PartialEq)]
pub enum KvRole {
    /// `do_remote_decode`: compute the prompt, hold its blocks, say where to fetch them.
    Prefill,
    /// `do_remote_prefill`: fetch the prompt's blocks from there, then decode.
    Decode(Remote),
}

/// Where a prefilled request's blocks are.
#[derive(Debug, Clone, PartialEq)]
pub struct Remote {
    pub host: String,
    pub port: u16,
    pub request_id: u64,
    /// The prefill replica's block hashes (`remote_block_ids`); empty: not given.
    pub hashes: Vec<BlockHash>,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::invalid_request(msg).with_param("kv_transfer_params")
}

/// The role a request's `kv_transfer_params` gives it; `None` for none (absent, null, or
/// neither flag set).
pub fn parse(extra: &Map<String, Value>) -> Result<Option<KvRole>, ApiError> {
    let p = match extra.get("kv_transfer_params") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(p)) => p,
        Some(_) => return Err(bad("kv_transfer_params must be an object")),
    };
    let flag = |k: &str| match p.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("kv_transfer_params.{k} must be a boolean"))),
    };
    match (flag("do_remote_decode")?, flag("do_remote_prefill")?) {
        (false, false) => Ok(None),
        (true, true) => {
            Err(bad("kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill"))
        }
        (true, false) => Ok(Some(KvRole::Prefill)),
        (false, true) => {
            let host = p.get("remote_host").and_then(Value::as_str).filter(|h| !h.is_empty());
            let port = p.get("remote_port").and_then(Value::as_u64).and_then(|v| u16::try_from(v).ok());
            // vLLM's ids are strings; the bundled engine's are its request numbers.
            let id = match p.get("remote_request_id") {
                Some(Value::String(s)) => s.parse().ok(),
                Some(v) => v.as_u64(),
                None => None,
            };
            let (Some(host), Some(port), Some(request_id)) = (host, port, id) else {
                return Err(bad(
                    "do_remote_prefill needs remote_host, remote_port and remote_request_id from a \
                     prefill replica's answer",
                ));
            };
            let hashes = match p.get("remote_block_ids") {
                Some(Value::Array(ids)) => ids.iter().map_while(Value::as_u64).collect(),
                _ => Vec::new(),
            };
            Ok(Some(KvRole::Decode(Remote { host: host.to_owned(), port, request_id, hashes })))
        }
    }
}

/// What a prefill replica answers: where and under what the blocks wait.
pub fn answer(cfg: &TransferConfig, request_id: u64, hashes: &[BlockHash]) -> Value {
    let (host, port) = cfg.advertise.map(|a| (a.ip().to_string(), a.port())).unzip();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": cfg.engine_id,
        "remote_block_ids": hashes,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id.to_string(),
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extra(v: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("kv_transfer_params".into(), v);
        m
    }

    #[test]
    fn vllms_shapes_parse() {
        assert_eq!(parse(&Map::new()).expect("test value"), None);
        let prefill = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        assert_eq!(parse(&extra(prefill)).expect("test value"), Some(KvRole::Prefill));
        let cfg = TransferConfig {
            advertise: Some("127.0.0.1:9000".parse().expect("test value")),
            ..TransferConfig::disabled("p0")
        };
        let decode = answer(&cfg, 42, &[5, 6]);
        assert_eq!(
            parse(&extra(decode)).expect("test value"),
            Some(KvRole::Decode(Remote {
                host: "127.0.0.1".into(),
                port: 9000,
                request_id: 42,
                hashes: vec![5, 6]
            }))
        );
    }

    #[test]
    fn bad_params_are_named() {
        for v in [
            json!("yes"),
            json!({"do_remote_decode": "true"}),
            json!({"do_remote_decode": true, "do_remote_prefill": true}),
            json!({"do_remote_prefill": true, "remote_host": "127.0.0.1"}),
        ] {
            let e = parse(&extra(v.clone())).expect_err(&v.to_string());
            assert_eq!(e.status, 400);
            assert_eq!(e.body.error.param.as_deref(), Some("kv_transfer_params"), "{v}");
        }
    }
}
