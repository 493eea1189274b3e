//! What every workload produces: timed chat requests with the prompt's token ids as the engines
//! will see them (rendered with the bundled chat template and tokenizer), so hit-rate references
//! can be computed offline on exactly the requests that were sent.

use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use warmpath_engine::sampler::Rng;
use warmpath_wire::chat_template::render_tokens;
use warmpath_wire::openai::{ChatMessage, Tool};
use warmpath_wire::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct Request {
    /// Arrival time from the start of the run (open-loop workloads).
    pub at: Duration,
    /// The JSON body of a streaming `/v1/chat/completions` request.
    pub body: Bytes,
    /// The rendered prompt's token ids.
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    /// Conversation and turn, for workloads that have them.
    pub session: Option<(usize, usize)>,
}

impl Request {
    /// A streaming chat request; `tools` is a JSON array or `None`.
    pub fn chat(
        at: Duration,
        model: &str,
        messages: Value,
        tools: Option<Value>,
        max_tokens: usize,
        tok: &Tokenizer,
        session: Option<(usize, usize)>,
    ) -> Request {
        let msgs: Vec<ChatMessage> = serde_json::from_value(messages.clone()).unwrap_or_default();
        let tool_defs: Vec<Tool> =
            tools.clone().and_then(|t| serde_json::from_value(t).ok()).unwrap_or_default();
        let tokens = render_tokens(tok, &msgs, &tool_defs, true);
        let mut body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(t) = tools {
            body["tools"] = t;
        }
        Request { at, body: Bytes::from(body.to_string()), tokens, max_tokens, session }
    }
}

/// Words that are exactly one token of the tokenizer with their leading space, so text made of
/// them has a known token count and a block boundary never merges with its neighbour.
#[derive(Debug)]
pub struct Words {
    words: Vec<String>,
}

impl Words {
    pub fn new(tok: &Tokenizer) -> Words {
        let mut words = Vec::new();
        for id in 256..31_000u32 {
            let Ok(s) = tok.decode(&[id]) else { continue };
            let w = s.strip_prefix(' ').unwrap_or("");
            if (3..=10).contains(&w.len())
                && w.bytes().all(|b| b.is_ascii_lowercase())
                && tok.encode(&s) == [id]
            {
                words.push(s);
            }
        }
        Words { words }
    }

    #[cfg(test)]
    fn count(&self) -> usize {
        self.words.len()
    }

    /// `n` words (n tokens) determined by `seed` alone.
    pub fn text(&self, seed: u64, n: usize) -> String {
        let mut rng = SplitMix::new(seed ^ 0x005e_ed0f_b10c);
        let mut s = String::with_capacity(n * 8);
        for _ in 0..n {
            s.push_str(&self.words[(rng.next() % self.words.len() as u64) as usize]);
        }
        s
    }
}

/// The engine's seeded generator (SplitMix64), with a range helper: workloads depend on the
/// seed alone.
#[derive(Debug, Clone)]
pub struct SplitMix(Rng);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(Rng::new(seed))
    }

    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_text_has_one_token_per_word() {
        let tok = Tokenizer::wp32k();
        let w = Words::new(&tok);
        assert!(w.count() > 2000, "{}", w.count());
        let a = w.text(7, 50);
        let b = w.text(8, 30);
        assert_eq!(tok.encode(&a).len(), 50);
        assert_eq!(tok.encode(&format!("{a}{b}")), [tok.encode(&a), tok.encode(&b)].concat());
        assert_eq!(w.text(7, 50), a, "deterministic");
    }

    #[test]
    fn request_tokens_follow_the_chat_template() {
        let tok = Tokenizer::wp32k();
        let r = Request::chat(
            Duration::ZERO,
            "m",
            json!([{"role": "user", "content": " hello world"}]),
            None,
            4,
            &tok,
            None,
        );
        let text = tok.decode(&r.tokens).unwrap_or_default();
        assert_eq!(text, "<|im_start|>user\n hello world<|im_end|>\n<|im_start|>assistant\n");
        let body: Value = serde_json::from_slice(&r.body).unwrap_or_default();
        assert_eq!(body["stream"], true);
        assert_eq!(body["max_tokens"], 4);
    }
}
