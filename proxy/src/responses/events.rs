//! What a Responses turn sends its client: events (their type and JSON text), how the
//! response ended, and the ids warmpath gives responses and their items.

/// A fresh id with a prefix (`resp_`, `msg_`, `fc_`): 24 random bytes in hex, so that an id
/// cannot be guessed.
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 24];
    if getrandom::getrandom(&mut b).is_err() {
        // No OS randomness: unique still (time and a counter), if guessable.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b[..16].copy_from_slice(&t.as_nanos().to_le_bytes());
        b[16..].copy_from_slice(&n.to_le_bytes());
    }
    let mut s = String::with_capacity(prefix.len() + 48);
    s.push_str(prefix);
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Gives an item without an `id` one, by its type (`msg_`, `fc_`, `fco_`, else `item_`).
pub fn give_id(item: &mut serde_json::Value) {
    let Some(o) = item.as_object_mut() else { return };
    if o.get("id").is_some_and(|v| v.as_str().is_some_and(|s| !s.is_empty())) {
        return;
    }
    let prefix = match o.get("type").and_then(serde_json::Value::as_str).unwrap_or("message") {
        "message" => "msg_",
        "function_call" => "fc_",
        "function_call_output" => "fco_",
        _ => "item_",
    };
    o.insert("id".into(), serde_json::Value::String(new_id(prefix)));
}

/// One event as it goes out: its type (the SSE `event:` line) and its JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub kind: &'static str,
    pub json: String,
    /// Where the response object is in `json`, for events that carry one: a client that
    /// wants only the final object gets this slice, not the event parsed again.
    pub response: Option<std::ops::Range<usize>>,
}

impl Event {
    /// An event without a response object.
    pub fn plain(kind: &'static str, json: String) -> Event {
        Event { kind, json, response: None }
    }

    /// The response object it carries, as JSON text.
    pub fn response(&self) -> Option<&str> {
        self.response.clone().and_then(|r| self.json.get(r))
    }
}

/// How the response ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Completed,
    /// `max_output_tokens` or `content_filter`.
    Incomplete(&'static str),
    Failed {
        code: String,
        message: String,
    },
}
