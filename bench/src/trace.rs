//! The `trace` workload: a Mooncake-format trace (`timestamp` ms, `input_length`,
//! `output_length`, `hash_ids` — one id per 512-token block, equal ids meaning equal content)
//! turned into chat requests whose prompts share exactly what the trace says they share.
//!
//! Each hash id becomes a deterministic block of words, each word one token of the bundled
//! tokenizer (`wp32k`) with a leading space, so a block of `k` words is `k` tokens however the
//! blocks are concatenated (the tokenizer's pre-split never joins across a leading space).
//! Lengths scale by `scale` (a 512-token block becomes `512 × scale` tokens) and time speeds
//! up by `speedup`.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use serde_json::json;
use warmpath_wire::tokenizer::Tokenizer;

use crate::workload::{Request, Words};

/// Tokens per hash id in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

#[derive(Debug, Clone, Deserialize)]
pub struct Record {
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// How a trace is turned into requests.
#[derive(Debug, Clone)]
pub struct TraceOpts {
    /// Length factor: a 512-token block becomes `round(512 × scale)` tokens (at least 1).
    pub scale: f64,
    /// Time factor: arrivals come `speedup` times faster than recorded.
    pub speedup: f64,
    /// Requests `[start, end)` of the trace (after which `cap` applies).
    pub slice: (usize, Option<usize>),
    /// At most this many requests.
    pub cap: Option<usize>,
    /// Tokens of a system prompt shared by every request (the hot-prefix scenario); 0 for none.
    pub hot_prefix_tokens: usize,
    /// Cap on generated tokens after scaling.
    pub max_output: usize,
}

pub fn load(path: &Path) -> anyhow::Result<Vec<Record>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}:{}: bad record", path.display(), i + 1))
        })
        .collect()
}

/// The slice and cap of `records`, in order.
pub fn select(records: &[Record], o: &TraceOpts) -> Vec<Record> {
    let (start, end) = o.slice;
    let end = end.unwrap_or(records.len()).min(records.len());
    let mut v: Vec<Record> = records.get(start.min(end)..end).unwrap_or_default().to_vec();
    if let Some(c) = o.cap {
        v.truncate(c);
    }
    v
}

/// The requests of `records`: arrival times relative to the first, chat bodies that stream,
/// and the prompt's token ids as the engines will see them.
pub fn requests(records: &[Record], o: &TraceOpts, model: &str, tok: &Tokenizer) -> Vec<Request> {
    let words = Words::new(tok);
    let block = ((TRACE_BLOCK_TOKENS as f64 * o.scale).round() as usize).max(1);
    let t0 = records.first().map_or(0, |r| r.timestamp);
    let hot = (o.hot_prefix_tokens > 0).then(|| {
        format!(
            "You are the assistant of one product; every conversation shares this persona.{}",
            words.text(u64::MAX, o.hot_prefix_tokens)
        )
    });
    records
        .iter()
        .map(|r| {
            let scaled_len = ((r.input_length as f64 * o.scale).round() as usize).max(1);
            let mut text = String::new();
            let n = r.hash_ids.len();
            for (i, id) in r.hash_ids.iter().enumerate() {
                let len = if i + 1 == n {
                    scaled_len.saturating_sub(block * (n - 1)).clamp(1, block)
                } else {
                    block
                };
                text.push_str(&words.text(*id, len));
            }
            let mut messages = Vec::new();
            if let Some(h) = &hot {
                messages.push(json!({"role": "system", "content": h}));
            }
            messages.push(json!({"role": "user", "content": text}));
            let max_tokens = ((r.output_length as f64 * o.scale).round() as usize).clamp(1, o.max_output);
            let at = Duration::from_secs_f64((r.timestamp - t0) as f64 / 1e3 / o.speedup);
            Request::chat(at, model, serde_json::Value::Array(messages), None, max_tokens, tok, None)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: u64, len: usize, ids: &[u64]) -> Record {
        Record { timestamp: ts, input_length: len, output_length: 10, hash_ids: ids.to_vec() }
    }

    fn opts() -> TraceOpts {
        TraceOpts {
            scale: 1.0 / 16.0,
            speedup: 2.0,
            slice: (0, None),
            cap: None,
            hot_prefix_tokens: 0,
            max_output: 64,
        }
    }

    #[test]
    fn equal_hash_ids_share_exactly_their_blocks() {
        let tok = Tokenizer::wp32k();
        let recs = [rec(0, 1024, &[1, 2]), rec(1000, 1100, &[1, 2, 3]), rec(3000, 1024, &[1, 9])];
        let reqs = requests(&recs, &opts(), "m", &tok);
        let (a, b, c) = (&reqs[0].tokens, &reqs[1].tokens, &reqs[2].tokens);
        // Chat template header, then 32-token blocks.
        let common = |x: &[u32], y: &[u32]| x.iter().zip(y).take_while(|(p, q)| p == q).count();
        let head = common(a, c) - 32; // a and c share the header and block 1
        assert!(common(a, b) >= head + 64, "two shared blocks");
        assert_eq!(common(a, c), head + 32, "block 9 differs from block 2 at its first token");
        // Lengths: 1100 × 1/16 = 69 tokens → blocks of 32, 32, 5.
        assert_eq!(b.len() - a.len(), 69 - 64);
        assert_eq!(reqs[1].at, Duration::from_millis(500));
        assert_eq!(reqs[0].max_tokens, 1);
    }

    #[test]
    fn slice_and_cap() {
        let recs: Vec<Record> = (0..10).map(|i| rec(i * 10, 512, &[i])).collect();
        let o = TraceOpts { slice: (2, Some(8)), cap: Some(3), ..opts() };
        let v = select(&recs, &o);
        assert_eq!(v.iter().map(|r| r.hash_ids[0]).collect::<Vec<_>>(), [2, 3, 4]);
        // Arrivals are relative to the first selected record.
        assert_eq!(requests(&v, &o, "m", &Tokenizer::wp32k())[0].at, Duration::ZERO);
    }

    #[test]
    fn hot_prefix_is_shared_by_every_request() {
        let tok = Tokenizer::wp32k();
        let o = TraceOpts { hot_prefix_tokens: 200, ..opts() };
        let reqs = requests(&[rec(0, 512, &[1]), rec(1, 512, &[2])], &o, "m", &tok);
        let common = reqs[0].tokens.iter().zip(&reqs[1].tokens).take_while(|(p, q)| p == q).count();
        assert!(common > 200, "{common}");
    }
}
