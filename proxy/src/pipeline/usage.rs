//! Usage the client did not ask for. A stream of a key whose tokens are limited goes to the
//! backend with `stream_options.include_usage` (vLLM, SGLang, llama.cpp and the bundled engine
//! all honour it), so the stream's real usage settles the key's reservation — without it a
//! stream would be counted at its estimate, and one without `max_tokens` would spend nothing
//! for what it wrote. The usage-only chunk it adds (`"choices": []`) is taken out of what the
//! client gets (`UsageFilter`, in the keyed client's `Stamped`), which stays the stream it
//! asked for.

use bytes::{Bytes, BytesMut};

use crate::request::{LlmRequest, LlmRoute};

/// Whether `req` is a stream that reports no usage unless asked.
pub fn unasked(req: &LlmRequest<'_>) -> bool {
    if !matches!(req.route, LlmRoute::Chat | LlmRoute::Completions) {
        return false;
    }
    let streams = req.streams();
    let asked = req
        .extra_raw("stream_options")
        .and_then(|v| serde_json::from_str::<serde_json::Value>(v.get()).ok())
        .is_some_and(|o| o["include_usage"] == serde_json::Value::Bool(true));
    streams && !asked
}

/// `body` asking for usage at the end of its stream.
pub fn ask(body: Bytes) -> Bytes {
    let on = r#"{"include_usage":true}"#;
    let Ok(mut v) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&body) else {
        return body;
    };
    match v.get_mut("stream_options") {
        // Rare: options of its own (`include_usage: false`, or others) — rewritten whole.
        Some(serde_json::Value::Object(o)) => {
            o.insert("include_usage".into(), serde_json::Value::Bool(true));
            Bytes::from(serde_json::Value::Object(v).to_string())
        }
        _ => Bytes::from(crate::request::json::insert_first(&body, "stream_options", on)),
    }
}

/// What takes the usage-only chunk warmpath asked for out of a client's stream: complete
/// events go on, an event cut between two writes waits for its end.
#[derive(Debug, Default)]
pub struct UsageFilter {
    /// The start of an event not yet complete.
    pending: BytesMut,
}

impl UsageFilter {
    /// What of `body` goes to the client now (`None`: nothing yet).
    pub fn pass(&mut self, body: Option<Bytes>, end: bool) -> Option<Bytes> {
        if let Some(b) = body {
            self.pending.extend_from_slice(&b);
        }
        let cut = match end {
            true => self.pending.len(),
            false => last_boundary(&self.pending)?,
        };
        let done = self.pending.split_to(cut);
        let out = without_usage(&done);
        (!out.is_empty() || end).then(|| Bytes::from(out))
    }
}

/// Where the last complete SSE event of `b` ends (after its blank line), if any.
fn last_boundary(b: &[u8]) -> Option<usize> {
    let lf = b.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = b.windows(4).rposition(|w| w == b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

/// Whether an SSE event is the chunk that carries only usage.
fn usage_only(event: &[u8]) -> bool {
    if !event.windows(7).any(|w| w == b"\"usage\"") {
        return false;
    }
    let text = String::from_utf8_lossy(event);
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n");
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&data) else { return false };
    v["choices"].as_array().is_some_and(Vec::is_empty) && v["usage"].is_object()
}

/// Splits complete events and keeps all but usage-only ones.
fn without_usage(events: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(events.len());
    let mut start = 0;
    while start < events.len() {
        let rest = &events[start..];
        let end = first_boundary(rest).map_or(events.len(), |e| start + e);
        let event = &events[start..end];
        if !usage_only(event) {
            out.extend_from_slice(event);
        }
        start = end;
    }
    out
}

/// Where the first SSE event of `b` ends (after its blank line), if any.
fn first_boundary(b: &[u8]) -> Option<usize> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_usage_chunk_is_taken_out() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\r\n\r\n",
            "data: [DONE]\n\n"
        );
        let out = without_usage(stream.as_bytes());
        let out = String::from_utf8(out).expect("utf-8");
        assert!(!out.contains("prompt_tokens"), "{out}");
        assert!(
            out.contains("\"content\":\"hi\"")
                && out.contains("\"usage\":null")
                && out.ends_with("[DONE]\n\n")
        );
        assert_eq!(last_boundary(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(last_boundary(b"data: a"), None);
    }

    #[test]
    fn a_body_asks_for_usage_keeping_its_bytes() {
        let b = ask(Bytes::from_static(br#"{"model":"m","stream":true}"#));
        assert_eq!(&b[..], br#"{"stream_options":{"include_usage":true},"model":"m","stream":true}"#);
        let b = ask(Bytes::from_static(br#"{"model":"m","stream_options":{"include_usage":false}}"#));
        let v: serde_json::Value = serde_json::from_slice(&b).expect("json");
        assert_eq!(v["stream_options"]["include_usage"], true);
    }
}
