//! Routing keys from a parsed request: the hash of its leading content (for `prefix_hash`) and
//! its session key (for `session`). The canonicalization stage will replace the content hash
//! with prefix block hashes; until then the key is xxh3 over the first bytes of what the model
//! reads first: the model name, then each message's role and text (or the prompt, or the input).

use std::borrow::Cow;

use serde_json::value::RawValue;

use crate::http::request::{MessageView, PartView, Str};
use xxhash_rust::xxh3::Xxh3;

/// Feeds at most `limit` bytes in total.
struct Capped {
    h: Xxh3,
    left: usize,
}

impl Capped {
    fn new(limit: usize) -> Capped {
        Capped { h: Xxh3::new(), left: limit }
    }
    fn feed(&mut self, bytes: &[u8]) -> bool {
        let take = bytes.len().min(self.left);
        self.h.update(&bytes[..take]);
        self.left -= take;
        self.left > 0
    }
    fn finish(self) -> u64 {
        self.h.digest()
    }
}

pub fn chat_prefix(model: &str, messages: &[MessageView<'_>], limit: usize) -> u64 {
    let mut h = Capped::new(limit);
    h.feed(model.as_bytes());
    h.feed(b"\0");
    for m in messages {
        if !h.feed(m.role.0.as_bytes()) || !h.feed(b"\0") {
            break;
        }
        if !m.content.is_none_or(|c| feed_text(&mut h, c)) || !h.feed(b"\0") {
            break;
        }
    }
    h.finish()
}

/// Feeds a content value's text: a string as is, the text parts of a list; false when full.
fn feed_text(h: &mut Capped, raw: &RawValue) -> bool {
    let text = raw.get();
    if text.starts_with('"') {
        return serde_json::from_str::<Str<'_>>(text).map_or(true, |s| h.feed(s.0.as_bytes()));
    }
    if text.starts_with('[') {
        let parts: Vec<PartView<'_>> = serde_json::from_str(text).unwrap_or_default();
        return parts.iter().filter_map(|p| p.text.as_ref()).all(|t| h.feed(t.0.as_bytes()));
    }
    true
}

/// Any other body: the model, `instructions` (responses) and the content field — a string's
/// text as is, anything else (token ids, item lists) as its JSON text.
pub fn raw_prefix(
    model: &str,
    instructions: Option<&RawValue>,
    content: Option<&RawValue>,
    limit: usize,
) -> u64 {
    let mut h = Capped::new(limit);
    h.feed(model.as_bytes());
    h.feed(b"\0");
    for raw in [instructions, content].into_iter().flatten() {
        let text = raw.get();
        let go_on = match serde_json::from_str::<Str<'_>>(text) {
            Ok(s) if text.starts_with('"') => h.feed(s.0.as_bytes()),
            _ => h.feed(text.as_bytes()),
        };
        if !go_on || !h.feed(b"\0") {
            break;
        }
    }
    h.finish()
}

/// The sticky key: the `x-session-id` header, else what `from_body` finds (`prompt_cache_key`,
/// then `user`).
pub fn session_key<'a>(
    header: Option<&str>,
    from_body: impl FnOnce() -> Option<Cow<'a, str>>,
) -> Option<String> {
    if let Some(h) = header.filter(|h| !h.is_empty()) {
        return Some(h.to_owned());
    }
    from_body().filter(|s| !s.is_empty()).map(Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::{LlmRequest, LlmRoute};

    fn chat_key(body: &str, limit: usize) -> u64 {
        let r = LlmRequest::parse(LlmRoute::Chat, body.as_bytes()).expect("chat");
        chat_prefix(r.model(), &r.messages, limit)
    }

    #[test]
    fn equal_leading_content_gives_equal_keys() {
        let a = r#"{"model":"m","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"one"}]}"#;
        let b = r#"{"model":"m","temperature":0,"messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"two"}]}"#;
        let c = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"one"}]}"#;
        let limit = "m\0system\0You are helpful.\0".len();
        assert_eq!(chat_key(a, limit), chat_key(b, limit));
        assert_ne!(chat_key(a, limit + 8), chat_key(b, limit + 8));
        assert_ne!(chat_key(a, limit), chat_key(c, limit));
        // The same text as a string, with escapes, or as text parts hashes the same.
        let parts = r#"{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"You are "},{"type":"text","text":"helpful."}]},{"role":"user","content":"one"}]}"#;
        let escaped = r#"{"model":"m","messages":[{"role":"system","content":"You are \u0068elpful."},{"role":"user","content":"one"}]}"#;
        assert_eq!(chat_key(a, 1000), chat_key(parts, 1000));
        assert_eq!(chat_key(a, 1000), chat_key(escaped, 1000));
    }

    #[test]
    fn completion_and_input_keys() {
        let key = |route, body: &str, limit| {
            let r = LlmRequest::parse(route, body.as_bytes()).expect("parses");
            raw_prefix(r.model(), r.instructions, r.content, limit)
        };
        let a = key(LlmRoute::Completions, r#"{"model":"m","prompt":"hello world"}"#, 8);
        assert_eq!(a, key(LlmRoute::Completions, r#"{"model":"m","prompt":"hello there"}"#, 8));
        assert_ne!(
            key(LlmRoute::Completions, r#"{"model":"m","prompt":"hello world"}"#, 64),
            key(LlmRoute::Completions, r#"{"model":"m","prompt":"hello there"}"#, 64)
        );
        assert_eq!(
            key(LlmRoute::Completions, r#"{"model":"m","prompt":[1,2,3]}"#, 6),
            key(LlmRoute::Completions, r#"{"model":"m","prompt":[1,2,4]}"#, 6)
        );
        assert_ne!(
            key(LlmRoute::Responses, r#"{"model":"m","instructions":"a","input":"x"}"#, 64),
            key(LlmRoute::Responses, r#"{"model":"m","instructions":"b","input":"x"}"#, 64)
        );
    }

    #[test]
    fn session_key_order() {
        assert_eq!(session_key(Some("hdr"), || Some("pc".into())).as_deref(), Some("hdr"));
        assert_eq!(session_key(None, || Some("pc".into())).as_deref(), Some("pc"));
        assert_eq!(session_key(Some(""), || Some("u1".into())).as_deref(), Some("u1"));
        assert_eq!(session_key(None, || None), None);
        assert_eq!(session_key(None, || Some("".into())), None);
    }
}
