//! Routing keys from a parsed request: the hash of its leading content (for `prefix_hash`) and
//! its session key (for `session`). The canonicalization stage will replace the content hash
//! with prefix block hashes; until then the key is xxh3 over the first bytes of what the model
//! reads first: the model name, then each message's role and text (or the prompt, or the input).

use serde_json::{Map, Value};
use warmpath_wire::openai::{ChatCompletionRequest, CompletionRequest, Prompt};
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

pub fn chat_prefix(req: &ChatCompletionRequest, limit: usize) -> u64 {
    let mut h = Capped::new(limit);
    h.feed(req.model.as_bytes());
    h.feed(b"\0");
    for m in &req.messages {
        if !h.feed(m.role.as_str().as_bytes()) || !h.feed(b"\0") {
            break;
        }
        let go_on = match &m.content {
            Some(warmpath_wire::openai::MessageContent::Text(t)) => h.feed(t.as_bytes()),
            Some(warmpath_wire::openai::MessageContent::Parts(parts)) => {
                parts.iter().filter_map(|p| p.text.as_deref()).all(|t| h.feed(t.as_bytes()))
            }
            None => true,
        };
        if !go_on || !h.feed(b"\0") {
            break;
        }
    }
    h.finish()
}

pub fn completion_prefix(req: &CompletionRequest, limit: usize) -> u64 {
    let mut h = Capped::new(limit);
    h.feed(req.model.as_bytes());
    h.feed(b"\0");
    match &req.prompt {
        Prompt::Text(t) => {
            h.feed(t.as_bytes());
        }
        Prompt::Texts(ts) => {
            ts.first().map(|t| h.feed(t.as_bytes()));
        }
        Prompt::Tokens(ids) => feed_ids(&mut h, ids),
        Prompt::TokenLists(lists) => {
            if let Some(ids) = lists.first() {
                feed_ids(&mut h, ids)
            }
        }
    }
    h.finish()
}

fn feed_ids(h: &mut Capped, ids: &[u32]) {
    for id in ids {
        if !h.feed(&id.to_le_bytes()) {
            break;
        }
    }
}

/// Any other body (embeddings, responses): the model, then `text` (instructions), then the
/// leading bytes of `value` (a string as is, anything else as JSON text).
pub fn json_prefix(model: &str, text: Option<&str>, value: Option<&Value>, limit: usize) -> u64 {
    let mut h = Capped::new(limit);
    h.feed(model.as_bytes());
    h.feed(b"\0");
    let go_on = text.is_none_or(|t| h.feed(t.as_bytes()) && h.feed(b"\0"));
    match value {
        Some(Value::String(s)) if go_on => {
            h.feed(s.as_bytes());
        }
        Some(other) if go_on => {
            h.feed(other.to_string().as_bytes());
        }
        _ => {}
    }
    h.finish()
}

/// The sticky key: the `x-session-id` header, else the body's `prompt_cache_key`, else `user`.
pub fn session_key(header: Option<&str>, extra: &Map<String, Value>) -> Option<String> {
    if let Some(h) = header.filter(|h| !h.is_empty()) {
        return Some(h.to_owned());
    }
    ["prompt_cache_key", "user"]
        .iter()
        .find_map(|k| extra.get(*k).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> ChatCompletionRequest {
        serde_json::from_str(body).expect("chat")
    }

    #[test]
    fn equal_leading_content_gives_equal_keys() {
        let a = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"one"}]}"#,
        );
        let b = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"two"}],"temperature":0}"#,
        );
        let c = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"one"}]}"#,
        );
        let limit = "m\0system\0You are helpful.\0".len();
        assert_eq!(chat_prefix(&a, limit), chat_prefix(&b, limit));
        assert_ne!(chat_prefix(&a, limit + 8), chat_prefix(&b, limit + 8));
        assert_ne!(chat_prefix(&a, limit), chat_prefix(&c, limit));
    }

    #[test]
    fn completion_keys() {
        let p = |s: &str| serde_json::from_str::<CompletionRequest>(s).expect("completion");
        let a = p(r#"{"model":"m","prompt":"hello world"}"#);
        let b = p(r#"{"model":"m","prompt":"hello there"}"#);
        assert_eq!(completion_prefix(&a, 8), completion_prefix(&b, 8));
        assert_ne!(completion_prefix(&a, 64), completion_prefix(&b, 64));
        let t = p(r#"{"model":"m","prompt":[1,2,3]}"#);
        let u = p(r#"{"model":"m","prompt":[[1,2,4]]}"#);
        assert_eq!(completion_prefix(&t, 10), completion_prefix(&u, 10));
    }

    #[test]
    fn session_key_order() {
        let extra: Map<String, Value> =
            serde_json::from_str(r#"{"user":"u1","prompt_cache_key":"pc"}"#).expect("map");
        assert_eq!(session_key(Some("hdr"), &extra).as_deref(), Some("hdr"));
        assert_eq!(session_key(None, &extra).as_deref(), Some("pc"));
        let only_user: Map<String, Value> = serde_json::from_str(r#"{"user":"u1"}"#).expect("map");
        assert_eq!(session_key(Some(""), &only_user).as_deref(), Some("u1"));
        assert_eq!(session_key(None, &Map::new()), None);
    }
}
