//! Relaying a backend's response body to the client chunk by chunk, as it arrives, while
//! watching for the client to leave; and ending a broken stream cleanly with an error event.

use std::time::Instant;

use bytes::Bytes;
use warmpath_wire::openai::ApiError;
use warmpath_wire::sse;

use super::downstream::Downstream;
use crate::request::LlmRoute;
use crate::route::PrefillTicket;
use crate::upstream::conn::Conn;
use crate::upstream::FailKind;

/// How a relay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pumped {
    /// The backend's body ended cleanly and all of it was written to the client; the caller
    /// ends the client's body (or appends an error event first).
    Complete,
    /// The client went away (or its connection broke) before the end.
    ClientGone,
    /// The backend's body broke off.
    UpstreamCut(FailKind),
    /// warmpath's grace period ran out (SIGTERM) before the end.
    Closing,
}

/// The last `KEEP` bytes of what went by. Pushing appends, and the front is dropped only once
/// the buffer holds twice what it keeps, so a long stream of small chunks moves each byte a
/// bounded number of times.
#[derive(Debug, Default)]
struct LastBytes<const KEEP: usize>(Vec<u8>);

impl<const KEEP: usize> LastBytes<KEEP> {
    fn push(&mut self, b: &[u8]) {
        self.0.extend_from_slice(&b[b.len().saturating_sub(KEEP)..]);
        if self.0.len() > 2 * KEEP {
            let excess = self.0.len() - KEEP;
            self.0.drain(..excess);
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.0[self.0.len().saturating_sub(KEEP)..]
    }
}

/// The last bytes relayed, to tell where the stream stopped.
#[derive(Debug, Default)]
pub struct Tail(LastBytes<32>);

impl Tail {
    pub fn push(&mut self, b: &[u8]) {
        self.0.push(b);
    }

    /// The stream stopped between two events (or before the first).
    pub fn at_event_boundary(&self) -> bool {
        let buf = self.0.bytes();
        buf.is_empty() || buf.ends_with(b"\n\n") || buf.ends_with(b"\r\n\r\n")
    }

    /// The last event was `data: [DONE]`.
    pub fn saw_done(&self) -> bool {
        let buf = self.0.bytes();
        let t = buf.strip_suffix(b"\n\n").or_else(|| buf.strip_suffix(b"\r\n\r\n")).unwrap_or(&[]);
        t.ends_with(b"data: [DONE]") || t.ends_with(b"data:[DONE]")
    }
}

/// An answer's token usage, read from its last bytes (where a whole answer and a stream's last
/// chunk put `usage`): prompt and completion tokens (`input_tokens` / `output_tokens` in a
/// Responses answer).
#[derive(Debug, Default)]
pub struct UsageTail(LastBytes<4096>);

impl UsageTail {
    pub fn push(&mut self, b: &[u8]) {
        self.0.push(b);
    }

    /// The last `usage` seen, if the answer ended with one.
    pub fn usage(&self) -> Option<(u64, u64)> {
        let text = String::from_utf8_lossy(self.0.bytes());
        let at = text.rfind("\"usage\"")?;
        let rest = &text[at..];
        let rest = &rest[..rest.find('}').unwrap_or(rest.len())];
        let number = |keys: [&str; 2]| {
            keys.iter().find_map(|k| {
                let i = rest.find(&format!("\"{k}\""))? + k.len() + 2;
                let v = rest[i..].trim_start().strip_prefix(':')?.trim_start();
                let end = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
                v[..end].parse::<u64>().ok()
            })
        };
        Some((number(["prompt_tokens", "input_tokens"])?, number(["completion_tokens", "output_tokens"])?))
    }
}

/// The id of a Responses answer, found in its first bytes: the first `"id"` whose value starts
/// with `resp` (the top-level field of a whole answer; `response.id` of the first event of a
/// stream, `response.created`).
#[derive(Debug, Default)]
pub struct ResponseId {
    head: Vec<u8>,
    found: Option<String>,
    done: bool,
}

impl ResponseId {
    /// Bytes looked at before giving up.
    const LOOK: usize = 4096;

    pub fn push(&mut self, b: &[u8]) {
        if self.done {
            return;
        }
        self.head.extend_from_slice(&b[..b.len().min(Self::LOOK - self.head.len().min(Self::LOOK))]);
        self.found = Self::scan(&self.head);
        self.done = self.found.is_some() || self.head.len() >= Self::LOOK;
        if self.done {
            self.head = Vec::new();
        }
    }

    pub fn take(&mut self) -> Option<String> {
        self.found.take()
    }

    fn scan(text: &[u8]) -> Option<String> {
        let mut rest = text;
        while let Some(at) = find(rest, b"\"id\"") {
            rest = &rest[at + 4..];
            let value = trim(rest).strip_prefix(b":").map(trim).and_then(|v| v.strip_prefix(b"\""));
            let Some(value) = value else { continue };
            let end = value.iter().position(|&c| c == b'"' || c == b'\\')?;
            if value[end] == b'"' && value.starts_with(b"resp") {
                return std::str::from_utf8(&value[..end]).ok().map(str::to_owned);
            }
        }
        None
    }
}

/// When a backend's answer shows that its prefill is done, so that the prompt tokens it was
/// sent stop counting as work queued there ([`PrefillTicket`]): a whole answer, at its first
/// byte; a stream, at its first event past the openings some servers send before they have
/// computed anything — a chat chunk with only the assistant's role (vLLM sends it after the
/// prefill, other servers at once), Responses' `response.created` and `response.in_progress`,
/// comments and keep-alives. Released too early, the policy would see no queue at all there.
#[derive(Debug)]
pub struct PrefillWatch {
    sse: bool,
    events: sse::Splitter,
    done: bool,
}

impl PrefillWatch {
    /// Stream bytes looked at before giving up and calling the prefill done.
    const LOOK: usize = 64 << 10;

    pub fn new(sse: bool) -> PrefillWatch {
        PrefillWatch { sse, events: sse::Splitter::default(), done: false }
    }

    /// Feeds the next chunk; true once the prefill is known to be done.
    pub fn push(&mut self, b: &[u8]) -> bool {
        if self.done {
            return true;
        }
        if !self.sse {
            self.done = true;
            return true;
        }
        self.events.push(b);
        while let Some(data) = self.events.next_data() {
            if !is_opening(&data) {
                self.done = true;
                break;
            }
        }
        self.done |= self.events.buffered() > Self::LOOK;
        if self.done {
            self.events = sse::Splitter::default();
        }
        self.done
    }
}

/// An SSE event (its data) that carries no output: see [`PrefillWatch`].
fn is_opening(data: &str) -> bool {
    use serde_json::Value;
    if data.is_empty() {
        return true; // a comment, a keep-alive, an event name alone
    }
    // `[DONE]`, an error, anything unexpected: the answer is under way or over.
    let Ok(v) = serde_json::from_str::<Value>(data) else { return false };
    if let Some(t) = v.get("type").and_then(Value::as_str) {
        return matches!(t, "response.created" | "response.in_progress");
    }
    let empty = |v: &Value| match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    };
    let Some(choices) = v.get("choices").and_then(Value::as_array) else { return false };
    !choices.is_empty()
        && v.get("usage").is_none_or(Value::is_null)
        && choices.iter().all(|c| {
            c.get("finish_reason").is_none_or(Value::is_null)
                && c.get("delta")
                    .and_then(Value::as_object)
                    .is_some_and(|d| d.iter().all(|(k, v)| k == "role" || empty(v)))
        })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    &b[start..]
}

/// Copies the body from `up` to the client, showing each chunk to `observe` (the response
/// cache's recording, the response id). `first_byte` is set when the first chunk is sent, and
/// `prefill` released when `watch` sees the prefill done.
pub async fn pump(
    up: &mut Conn,
    down: &mut dyn Downstream,
    first_byte: &mut Option<Instant>,
    (prefill, watch): (&PrefillTicket, &mut PrefillWatch),
    tail: &mut Tail,
    observe: &mut (dyn FnMut(&[u8]) + Send),
    closing: &mut tokio::sync::watch::Receiver<bool>,
) -> Pumped {
    // One wait for the shutdown signal for the whole stream (not one registered and dropped
    // per chunk).
    let closed = closing.wait_for(|c| *c);
    tokio::pin!(closed);
    loop {
        if up.response_done() {
            // Checked before watching the client again: once it has the whole response it may
            // send its next request, and the watch would swallow that request's first byte.
            return Pumped::Complete;
        }
        let chunk = tokio::select! {
            biased;
            r = up.read_response_body() => r,
            _ = down.gone() => return Pumped::ClientGone,
            _ = &mut closed => return Pumped::Closing,
        };
        match chunk {
            Ok(Some(bytes)) => {
                if bytes.is_empty() {
                    continue;
                }
                tail.push(&bytes);
                observe(&bytes);
                if watch.push(&bytes) {
                    prefill.release();
                }
                if down.write_response_body(Some(bytes), false).await.is_err() {
                    return Pumped::ClientGone;
                }
                first_byte.get_or_insert_with(Instant::now);
            }
            Ok(None) => return Pumped::Complete,
            Err(e) => return Pumped::UpstreamCut(FailKind::of(&e)),
        }
    }
}

/// What ends a stream early: its backend failed, or warmpath is shutting down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    Upstream,
    Shutdown,
}

/// Ends an SSE stream early: a terminal error event the OpenAI SDKs raise as an `APIError`
/// (`upstream_stream_error` 502, or `server_shutting_down` 503), then `data: [DONE]` on routes
/// that use it, then the end of the body.
pub async fn end_stream_with_error(
    down: &mut dyn Downstream,
    route: LlmRoute,
    tail: &Tail,
    message: &str,
) -> pingora::Result<()> {
    end_stream(down, route, tail, message, StreamEnd::Upstream).await
}

pub async fn end_stream(
    down: &mut dyn Downstream,
    route: LlmRoute,
    tail: &Tail,
    message: &str,
    why: StreamEnd,
) -> pingora::Result<()> {
    let (code, status) = match why {
        StreamEnd::Upstream => ("upstream_stream_error", 502),
        StreamEnd::Shutdown => ("server_shutting_down", 503),
    };
    let mut err = ApiError::internal(message.to_owned()).with_code(code);
    err.status = status;
    let mut out = String::new();
    if !tail.at_event_boundary() {
        out.push_str("\n\n");
    }
    let data = match route {
        // Responses streams carry typed events; the SDK reads `type: error`.
        LlmRoute::Responses => serde_json::json!({
            "type": "error",
            "code": code,
            "message": message,
            "param": null,
            "error": err.body.error,
        }),
        _ => serde_json::to_value(&err.body).unwrap_or_default(),
    };
    out.push_str("event: error\ndata: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
    if route.ends_with_done() {
        out.push_str("data: [DONE]\n\n");
    }
    down.write_response_body(Some(Bytes::from(out)), true).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_ids_are_found_in_whole_answers_and_streams() {
        let id = |chunks: &[&str]| {
            let mut r = ResponseId::default();
            for c in chunks {
                r.push(c.as_bytes());
            }
            r.take()
        };
        assert_eq!(
            id(&[r#"{"id":"resp_abc","object":"response","output":[{"id":"msg_1"}]}"#]).as_deref(),
            Some("resp_abc")
        );
        assert_eq!(
            id(&[
                "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,",
                "\"response\":{\"id\" : \"resp_",
                "xyz\",\"status\":\"in_progress\"}}\n\n"
            ])
            .as_deref(),
            Some("resp_xyz"),
            "split over chunks, spaces around the colon"
        );
        assert_eq!(
            id(&[r#"{"output":[{"id":"msg_1"}],"id":"resp_2"}"#]).as_deref(),
            Some("resp_2"),
            "not msg_"
        );
        assert_eq!(id(&[r#"{"object":"chat.completion","id":"chatcmpl-1"}"#]), None);
        let mut late = ResponseId::default();
        late.push(&[b' '; ResponseId::LOOK]);
        late.push(br#"{"id":"resp_late"}"#);
        assert_eq!(late.take(), None, "only the first bytes are looked at");
    }

    #[test]
    fn the_prefill_is_done_at_the_first_event_with_output() {
        let watch = |sse: bool, chunks: &[&str]| {
            let mut w = PrefillWatch::new(sse);
            chunks.iter().map(|c| w.push(c.as_bytes())).collect::<Vec<bool>>()
        };
        let role = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
        let token = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n";
        // A role chunk sent before the prefill does not count; the first token does.
        assert_eq!(watch(true, &[role, ": keep-alive\n\n", token]), [false, false, true]);
        // Split anywhere, CRLF separators.
        let crlf = role.replace("\n\n", "\r\n\r\n");
        let (a, b) = token.split_at(20);
        assert_eq!(watch(true, &[&crlf, a, b]), [false, false, true]);
        // Role and first token in one chunk (as vLLM sends them after the prefill), a tool call,
        // a finish without text, [DONE], an error event: each ends the wait.
        assert_eq!(watch(true, &[&format!("{role}{token}")]), [true]);
        let tool =
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"tool_calls\":[{\"index\":0}]}}]}\n\n";
        assert_eq!(watch(true, &[tool]), [true]);
        let fin = "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}]}\n\n";
        assert_eq!(watch(true, &[role, fin]), [false, true]);
        assert_eq!(watch(true, &[role, "data: [DONE]\n\n"]), [false, true]);
        assert_eq!(watch(true, &["event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\n"]), [true]);
        // Completions stream text in `text`.
        assert_eq!(watch(true, &["data: {\"choices\":[{\"text\":\" a\",\"index\":0}]}\n\n"]), [true]);
        // Responses: the openings OpenAI sends at once, then output.
        let created =
            "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0}\n\n";
        let progress = "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"sequence_number\":1}\n\n";
        let item = "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\"}\n\n";
        assert_eq!(watch(true, &[created, progress, item]), [false, false, true]);
        // A whole answer: its first byte.
        assert_eq!(watch(false, &["{\"id\""]), [true]);
        // Keep-alives alone keep it waiting (the backend is still queued or prefilling); an
        // event that never ends is given up on, called done.
        let mut w = PrefillWatch::new(true);
        assert!((0..10_000).all(|_| !w.push(b": ping\n\n")));
        let mut n = 0;
        while !w.push(b"data: {\"never\": \"ending\"") {
            n += 1;
            assert!(n < 10_000, "gives up");
        }
    }

    #[test]
    fn tail_tracks_the_end() {
        let mut t = Tail::default();
        assert!(t.at_event_boundary() && !t.saw_done());
        t.push(b"data: {\"a\":1}\n\ndata: {\"b\"");
        assert!(!t.at_event_boundary());
        t.push(b":2}\n\n");
        assert!(t.at_event_boundary() && !t.saw_done());
        t.push(b"data: [DO");
        t.push(b"NE]\n\n");
        assert!(t.saw_done());
        let mut long = Tail::default();
        long.push(&[b'x'; 100]);
        long.push(b"\n\n");
        assert_eq!(long.0.bytes().len(), 32);
        assert!(long.0 .0.len() <= 64, "the buffer stays bounded");
        assert!(long.at_event_boundary());
    }

    #[test]
    fn usage_is_read_from_the_end_of_an_answer() {
        let mut u = UsageTail::default();
        for _ in 0..2000 {
            u.push(b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n");
        }
        assert_eq!(u.usage(), None);
        u.push(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2000}}\n\ndata: [DONE]\n\n");
        assert_eq!(u.usage(), Some((12, 2000)));
        let mut r = UsageTail::default();
        r.push(br#"{"object":"response","usage":{"input_tokens":7,"output_tokens":3,"total_tokens":10}}"#);
        assert_eq!(r.usage(), Some((7, 3)));
        assert!(u.0 .0.len() <= 2 * 4096, "the buffer stays bounded");
    }
}
