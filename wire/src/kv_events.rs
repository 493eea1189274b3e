//! KV cache events in vLLM's wire format, so existing routers (llm-d, vllm-router's `kv_aware`,
//! Dynamo) can follow the bundled engine's cache as they follow vLLM's.
//!
//! On a ZMQ PUB socket each message has three frames: `[topic, seq (u64 big-endian),
//! payload]`. The payload is a msgpack array `[ts, [event, ...], dp_rank]`, each event an array
//! whose first element is its tag:
//!
//! - `["BlockStored", block_hashes, parent_block_hash|nil, token_ids, block_size, lora_id|nil, medium|nil, lora_name|nil]`
//! - `["BlockRemoved", block_hashes, medium|nil]`
//! - `["AllBlocksCleared"]`
//!
//! A replay socket (ZMQ ROUTER, vLLM's `replay_endpoint`) answers a request `["", start_seq]`
//! with `["", seq, payload]` for each kept batch from `start_seq` on, then `["", REPLAY_END, ""]`.
//!
//! Hashes are 64-bit unsigned integers. [`decode_batch`] also accepts events sent as maps keyed
//! by `"type"`, as newer vLLM versions may.

use rmpv::Value;

use crate::prefix::BlockHash;

/// The sequence number that ends a replay: -1 as a big-endian 64-bit integer.
pub const REPLAY_END: [u8; 8] = [0xff; 8];

/// One cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// A batch of events published as one message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Seconds since the Unix epoch.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

#[derive(Debug, thiserror::Error)]
pub enum KvEventError {
    #[error("msgpack: {0}")]
    Msgpack(String),
    #[error("malformed event batch: {0}")]
    Shape(&'static str),
}

fn opt_str(s: &Option<String>) -> Value {
    s.as_ref().map(|s| Value::from(s.as_str())).unwrap_or(Value::Nil)
}

fn hashes(h: &[BlockHash]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

impl KvEvent {
    fn to_value(&self) -> Value {
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
            } => {
                Value::Array(vec![
                    Value::from("BlockStored"),
                    hashes(block_hashes),
                    parent_block_hash.map(Value::from).unwrap_or(Value::Nil),
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                    Value::from(*block_size),
                    lora_id.map(Value::from).unwrap_or(Value::Nil),
                    opt_str(medium),
                    Value::Nil, // lora_name
                ])
            }
            KvEvent::BlockRemoved { block_hashes, medium } => {
                Value::Array(vec![Value::from("BlockRemoved"), hashes(block_hashes), opt_str(medium)])
            }
            KvEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
        }
    }

    fn from_value(v: &Value) -> Result<KvEvent, KvEventError> {
        // Map form: {"type": "BlockStored", "block_hashes": ..., ...} → array form.
        if let Value::Map(entries) = v {
            let get =
                |k: &str| entries.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
            let tag = get("type").ok_or(KvEventError::Shape("event map without type"))?;
            let fields: &[&str] = match tag.as_str() {
                Some("BlockStored") => {
                    &["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
                }
                Some("BlockRemoved") => &["block_hashes", "medium"],
                _ => &[],
            };
            let mut arr = vec![tag];
            arr.extend(fields.iter().map(|f| get(f).unwrap_or(Value::Nil)));
            return Self::from_value(&Value::Array(arr));
        }
        let arr = v.as_array().ok_or(KvEventError::Shape("event is not an array"))?;
        let at = |i: usize| arr.get(i).unwrap_or(&Value::Nil);
        let hash_list = |v: &Value| -> Result<Vec<BlockHash>, KvEventError> {
            v.as_array()
                .ok_or(KvEventError::Shape("block_hashes is not an array"))?
                .iter()
                .map(|h| {
                    h.as_u64()
                        .or_else(|| h.as_i64().map(|x| x as u64))
                        .ok_or(KvEventError::Shape("hash is not an integer"))
                })
                .collect()
        };
        let medium = |v: &Value| v.as_str().map(str::to_owned);
        match at(0).as_str() {
            Some("BlockStored") => Ok(KvEvent::BlockStored {
                block_hashes: hash_list(at(1))?,
                parent_block_hash: at(2).as_u64().or_else(|| at(2).as_i64().map(|x| x as u64)),
                token_ids: at(3)
                    .as_array()
                    .ok_or(KvEventError::Shape("token_ids is not an array"))?
                    .iter()
                    .map(|t| t.as_u64().map(|t| t as u32).ok_or(KvEventError::Shape("token id")))
                    .collect::<Result<_, _>>()?,
                block_size: at(4).as_u64().ok_or(KvEventError::Shape("block_size"))? as u32,
                lora_id: at(5).as_i64(),
                medium: medium(at(6)),
            }),
            Some("BlockRemoved") => {
                Ok(KvEvent::BlockRemoved { block_hashes: hash_list(at(1))?, medium: medium(at(2)) })
            }
            Some("AllBlocksCleared") => Ok(KvEvent::AllBlocksCleared),
            _ => Err(KvEventError::Shape("unknown event tag")),
        }
    }
}

/// Encodes a batch as the msgpack payload frame.
pub fn encode_batch(batch: &EventBatch) -> Vec<u8> {
    let v = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(KvEvent::to_value).collect()),
        batch.data_parallel_rank.map(Value::from).unwrap_or(Value::Nil),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}

/// Decodes a msgpack payload frame.
pub fn decode_batch(mut payload: &[u8]) -> Result<EventBatch, KvEventError> {
    let v = rmpv::decode::read_value(&mut payload).map_err(|e| KvEventError::Msgpack(e.to_string()))?;
    let arr = v.as_array().ok_or(KvEventError::Shape("batch is not an array"))?;
    let ts = arr.first().and_then(Value::as_f64).ok_or(KvEventError::Shape("batch ts"))?;
    let events = arr
        .get(1)
        .and_then(Value::as_array)
        .ok_or(KvEventError::Shape("batch events"))?
        .iter()
        .map(KvEvent::from_value)
        .collect::<Result<_, _>>()?;
    Ok(EventBatch { ts, events, data_parallel_rank: arr.get(2).and_then(Value::as_i64) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_round_trip() {
        let b = EventBatch {
            ts: 12.5,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX, 7],
                    parent_block_hash: None,
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    lora_id: None,
                    medium: Some("GPU".into()),
                },
                KvEvent::BlockRemoved { block_hashes: vec![7], medium: Some("GPU".into()) },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(0),
        };
        assert_eq!(decode_batch(&encode_batch(&b)).expect("decodes"), b);
    }

    #[test]
    fn stored_event_has_vllm_array_layout() {
        let b = EventBatch {
            ts: 1.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: vec![1],
                parent_block_hash: Some(9),
                token_ids: vec![5; 16],
                block_size: 16,
                lora_id: None,
                medium: None,
            }],
            data_parallel_rank: None,
        };
        let v = rmpv::decode::read_value(&mut &encode_batch(&b)[..]).expect("msgpack");
        let ev = &v[1][0];
        assert_eq!(ev[0].as_str(), Some("BlockStored"));
        assert_eq!(ev[2].as_u64(), Some(9));
        assert_eq!(ev[4].as_u64(), Some(16));
        assert_eq!(ev.as_array().expect("array").len(), 8);
    }

    #[test]
    fn map_form_is_accepted() {
        let ev = Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (Value::from("block_hashes"), Value::Array(vec![Value::from(3u64)])),
        ]);
        let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev])]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &batch).expect("encode");
        let b = decode_batch(&buf).expect("decodes");
        assert_eq!(b.events, vec![KvEvent::BlockRemoved { block_hashes: vec![3], medium: None }]);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_batch(&[0xc1]).is_err());
        assert!(decode_batch(&[0x90]).is_err());
    }
}
