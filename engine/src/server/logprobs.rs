//! Log-probabilities in answers: what a request asks for (Chat Completions: `logprobs: true`
//! and `top_logprobs` 0–20; Completions: `logprobs` 0–20 alternatives), and each generated
//! token's entry in the two routes' shapes. Values are the model's raw distribution (before
//! temperature and top-p), as vLLM reports by default.

use serde_json::{json, Map, Value};
use warmpath_wire::openai::ApiError;
use warmpath_wire::tokenizer::Tokenizer;

use crate::sampler::{TokenLogprobs, MAX_TOP_LOGPROBS};

/// One generated token's log-probability and its likeliest alternatives, with their texts.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// (text, bytes, log-probability), most likely first.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

fn text_of(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.decode_bytes(&[id]).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

impl Entry {
    pub fn new(tok: &Tokenizer, id: u32, lp: &TokenLogprobs) -> Entry {
        let (token, bytes) = text_of(tok, id);
        let top = lp
            .top
            .iter()
            .map(|&(t, l)| {
                let (s, b) = text_of(tok, t);
                (s, b, l)
            })
            .collect();
        Entry { token, bytes, logprob: lp.logprob, top }
    }
}

/// A finite log-probability as JSON (−∞, for a token outside the vocabulary, as −9999 as vLLM
/// clamps it).
fn num(l: f32) -> Value {
    json!(if l.is_finite() { l } else { -9999.0 })
}

/// Chat Completions: `logprobs: true` asks for them, `top_logprobs` for alternatives (which
/// needs `logprobs`).
pub fn chat_request(extra: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let on = match extra.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(ApiError::invalid_request(format!("logprobs must be a boolean, got {v}"))
                .with_param("logprobs"))
        }
    };
    let top = match extra.get("top_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => Some(count(v, "top_logprobs")?),
    };
    match (on, top) {
        (false, Some(t)) if t > 0 => {
            Err(ApiError::invalid_request("top_logprobs needs logprobs: true").with_param("top_logprobs"))
        }
        (false, _) => Ok(None),
        (true, t) => Ok(Some(t.unwrap_or(0))),
    }
}

/// Completions: `logprobs: N` asks for them with N alternatives.
pub fn completion_request(extra: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    match extra.get("logprobs") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => count(v, "logprobs").map(Some),
    }
}

fn count(v: &Value, param: &str) -> Result<usize, ApiError> {
    match v.as_u64() {
        Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(n as usize),
        _ => Err(ApiError::invalid_request(format!(
            "{param} must be an integer within 0..={MAX_TOP_LOGPROBS}, got {v}"
        ))
        .with_param(param)),
    }
}

/// Chat Completions' `logprobs` of a choice or chunk: `{"content": [...]}`.
pub fn chat_json(entries: &[Entry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> =
                e.top.iter().map(|(t, b, l)| json!({"token": t, "logprob": num(*l), "bytes": b})).collect();
            json!({"token": e.token, "logprob": num(e.logprob), "bytes": e.bytes, "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs` of a choice or chunk; `offset` is the length (in characters) of the
/// choice's text before the first of `entries`.
pub fn completion_json(entries: &[Entry], offset: usize) -> Value {
    let mut at = offset;
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        offsets.push(at);
        at += e.token.chars().count();
    }
    let top: Vec<Value> = entries
        .iter()
        .map(|e| {
            let m: Map<String, Value> = e.top.iter().map(|(t, _, l)| (t.clone(), num(*l))).collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| num(e.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extra(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn requests_are_read_and_checked() {
        assert_eq!(chat_request(&extra(json!({}))).ok(), Some(None));
        assert_eq!(chat_request(&extra(json!({"logprobs": true}))).ok(), Some(Some(0)));
        assert_eq!(chat_request(&extra(json!({"logprobs": true, "top_logprobs": 3}))).ok(), Some(Some(3)));
        let e = chat_request(&extra(json!({"top_logprobs": 3}))).expect_err("needs logprobs");
        assert_eq!(e.body.error.param.as_deref(), Some("top_logprobs"));
        let e = chat_request(&extra(json!({"logprobs": true, "top_logprobs": 21}))).expect_err("too many");
        assert_eq!(e.body.error.param.as_deref(), Some("top_logprobs"));
        assert!(chat_request(&extra(json!({"logprobs": 2}))).is_err());
        assert_eq!(completion_request(&extra(json!({"logprobs": 5}))).ok(), Some(Some(5)));
        assert!(completion_request(&extra(json!({"logprobs": -1}))).is_err());
        assert!(completion_request(&extra(json!({"logprobs": "x"}))).is_err());
    }

    #[test]
    fn entries_in_both_shapes() {
        let e = |t: &str, l: f32| Entry {
            token: t.into(),
            bytes: t.as_bytes().to_vec(),
            logprob: l,
            top: vec![(t.into(), t.as_bytes().to_vec(), l), ("x".into(), b"x".to_vec(), -3.0)],
        };
        let entries = [e("Pa", -0.5), e("ris", -0.25)];
        let c = completion_json(&entries, 4);
        assert_eq!(c["tokens"], json!(["Pa", "ris"]));
        assert_eq!(c["token_logprobs"], json!([-0.5, -0.25]));
        assert_eq!(c["text_offset"], json!([4, 6]));
        assert_eq!(c["top_logprobs"][1], json!({"ris": -0.25, "x": -3.0}));
        let ch = chat_json(&entries);
        assert_eq!(ch["content"][0]["token"], "Pa");
        assert_eq!(ch["content"][0]["bytes"], json!([80, 97]));
        assert_eq!(ch["content"][1]["top_logprobs"][1]["logprob"], json!(-3.0));
    }
}
