//! The translator: a [`Downstream`] that takes what the forwarding code relays of a backend's
//! chat answer (header, then body chunks) and hands Responses events to an [`EventSink`]: an
//! HTTP client (SSE events, or the final response object) or a WebSocket connection.

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use serde_json::Value;

use warmpath_wire::sse;
use warmpath_wire::tool_calls::{CallParser, Parsed};

use super::builder::Builder;
use super::events::{Event, Outcome};
use crate::pipeline::Downstream;
use crate::tools::search::SearchCall;
use crate::tools::SEARCH_TOOL;

/// Largest whole (non-streamed) chat answer or error body read.
const MAX_WHOLE: usize = 64 << 20;

/// warmpath's own response headers (`x-warmpath-*`), carried to the client where it has
/// headers.
pub type ProxyHeaders = Vec<(String, String)>;

/// Where a translated response goes.
#[async_trait]
pub trait EventSink: Send {
    /// The response begins (the backend said 200).
    async fn begin(&mut self, headers: &ProxyHeaders) -> pingora::Result<()>;
    /// Events in order; `last` with the terminal one.
    async fn events(&mut self, events: Vec<Event>, last: bool) -> pingora::Result<()>;
    /// The request failed before a response began: an HTTP status and an OpenAI error body.
    async fn error(&mut self, status: u16, body: Bytes, headers: &ProxyHeaders) -> pingora::Result<()>;
    /// Resolves when the client stopped waiting for this response; cancel-safe.
    async fn gone(&mut self);
}

/// A client that keeps the final response object.
#[derive(Default)]
pub struct Collect {
    pub response: Option<Value>,
    pub error: Option<(u16, Bytes)>,
}

#[async_trait]
impl EventSink for Collect {
    async fn begin(&mut self, _headers: &ProxyHeaders) -> pingora::Result<()> {
        Ok(())
    }

    async fn events(&mut self, events: Vec<Event>, last: bool) -> pingora::Result<()> {
        if last {
            self.response =
                events.last().and_then(Event::response).and_then(|r| serde_json::from_str(r).ok());
        }
        Ok(())
    }

    async fn error(&mut self, status: u16, body: Bytes, _headers: &ProxyHeaders) -> pingora::Result<()> {
        self.error = Some((status, body));
        Ok(())
    }

    async fn gone(&mut self) {
        std::future::pending().await
    }
}

enum State {
    Waiting,
    Stream(sse::Splitter),
    Whole(BytesMut),
    Error(u16, BytesMut),
    Done,
}

pub struct Translator<'s> {
    sink: &'s mut dyn EventSink,
    pub builder: Builder,
    state: State,
    headers: ProxyHeaders,
    saw_done: bool,
    failure: Option<(String, String)>,
    /// The terminal event, held until [`Translator::release`]: the conversation is stored
    /// first, so that a client that has it can continue anywhere at once.
    terminal: Option<Event>,
    /// The backend answers a token-id completion: its text is read for tool calls.
    completion: Option<(CallParser, u64)>,
    /// Tools were deferred: `tool_search` calls are kept from the client, for warmpath to
    /// answer and call the backend again within the same response.
    hide_searches: bool,
    searches: Vec<SearchCall>,
    /// Text the model wrote in this backend call.
    round_text: String,
    /// The response began (its opening events are out): later backend calls continue it.
    started: bool,
}

impl<'s> Translator<'s> {
    pub fn new(sink: &'s mut dyn EventSink, builder: Builder) -> Translator<'s> {
        Translator {
            sink,
            builder,
            state: State::Waiting,
            headers: Vec::new(),
            saw_done: false,
            failure: None,
            terminal: None,
            completion: None,
            hide_searches: false,
            searches: Vec::new(),
            round_text: String::new(),
            started: false,
        }
    }

    /// `tool_search` calls are warmpath's to answer (see [`Translator::take_searches`]).
    pub fn hide(&mut self) {
        self.hide_searches = true;
    }

    /// The searches of the backend call that just ended, and the text the model wrote in it.
    /// While there are some, the response stays open for the next call.
    pub fn take_searches(&mut self) -> (String, Vec<SearchCall>) {
        (std::mem::take(&mut self.round_text), std::mem::take(&mut self.searches))
    }

    /// A response that completes at once with no output (a warm-up, `generate: false`).
    pub async fn empty(&mut self) -> pingora::Result<()> {
        self.started = true;
        self.sink.begin(&self.headers).await?;
        let mut out = self.builder.start();
        self.builder.finish(None, &mut out);
        self.end(out).await
    }

    /// Ends a response held open for searches that will not be answered (rounds used up).
    pub async fn close(&mut self) -> pingora::Result<()> {
        if self.builder.outcome().is_some() || !self.started {
            return Ok(());
        }
        let mut out = Vec::new();
        self.builder.finish(None, &mut out);
        self.end(out).await
    }

    /// The backend's answer is a completion (`choices[].text`), not a chat stream: tool calls
    /// are read out of the text as the bundled template writes them.
    pub fn completion(mut self) -> Self {
        let prefix = self.builder.id.trim_start_matches("resp_").chars().take(12).collect::<String>();
        self.completion = Some((CallParser::new(&prefix), 0));
        self
    }

    /// One chunk of the backend's answer into events.
    fn chunk(&mut self, v: &Value, out: &mut Vec<Event>) {
        let Some((parser, calls)) = self.completion.as_mut() else {
            self.builder.chunk(v, out);
            return;
        };
        let choice = v.get("choices").and_then(|c| c.get(0));
        let text = choice.and_then(|c| c.get("text")).and_then(Value::as_str).unwrap_or("");
        let parsed = parser.push(text);
        for o in parsed {
            match o {
                Parsed::Call(c) if self.hide_searches && c.function.name == SEARCH_TOOL => {
                    self.searches.push(SearchCall { id: c.id, arguments: c.function.arguments });
                }
                o => parsed_out(&mut self.builder, &mut self.round_text, calls, o, out),
            }
        }
        if let Some(f) = choice.and_then(|c| c.get("finish_reason")).and_then(Value::as_str) {
            self.builder.finish_reason(f);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.builder.add_usage(u);
        }
    }

    /// What a completion's parser still holds, at the end.
    fn flush(&mut self, out: &mut Vec<Event>) {
        let Some((parser, calls)) = self.completion.as_mut() else { return };
        for o in parser.finish() {
            parsed_out(&mut self.builder, &mut self.round_text, calls, o, out);
        }
    }

    /// Sends what [`Downstream`] calls held back: the other events of the last batch are out.
    async fn end(&mut self, mut out: Vec<Event>) -> pingora::Result<()> {
        self.terminal = out.pop();
        if out.is_empty() {
            return Ok(());
        }
        self.sink.events(out, false).await
    }

    /// Sends the terminal event (once the conversation is stored).
    pub async fn release(&mut self) -> pingora::Result<()> {
        match self.terminal.take() {
            Some(t) => self.sink.events(vec![t], true).await,
            None => Ok(()),
        }
    }

    /// How the response ended; `None` when it never began (an error answer, or the client left).
    pub fn outcome(&self) -> Option<&Outcome> {
        self.builder.outcome()
    }

    async fn finish(&mut self) -> pingora::Result<()> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Stream(_) => {
                if !self.saw_done && self.failure.is_none() {
                    let why = "the backend's stream ended before it was complete";
                    self.failure = Some(("upstream_stream_error".into(), why.into()));
                }
                let mut out = Vec::new();
                self.flush(&mut out);
                if !self.searches.is_empty() && self.failure.is_none() {
                    // The model only searched: warmpath answers and calls again.
                    self.state = State::Waiting;
                    return if out.is_empty() { Ok(()) } else { self.sink.events(out, false).await };
                }
                self.builder.finish(self.failure.take(), &mut out);
                self.end(out).await
            }
            State::Whole(buf) => {
                let mut out = Vec::new();
                match serde_json::from_slice::<Value>(&buf) {
                    Ok(v) if v.get("choices").is_some() => {
                        self.chunk(&v, &mut out);
                        self.flush(&mut out);
                        if !self.searches.is_empty() {
                            self.state = State::Waiting;
                            return if out.is_empty() { Ok(()) } else { self.sink.events(out, false).await };
                        }
                        self.builder.finish(None, &mut out);
                    }
                    _ => {
                        let why = "the backend's answer is not a chat completion";
                        self.builder.finish(Some(("upstream_error".into(), why.into())), &mut out);
                    }
                }
                self.end(out).await
            }
            State::Error(status, buf) => self.sink.error(status, buf.freeze(), &self.headers).await,
            State::Waiting | State::Done => Ok(()),
        }
    }
}

/// A piece of a completion's text into the response: text, or a whole tool call.
fn parsed_out(b: &mut Builder, round_text: &mut String, calls: &mut u64, o: Parsed, out: &mut Vec<Event>) {
    match o {
        Parsed::Text(t) if t.is_empty() => {}
        Parsed::Text(t) => {
            round_text.push_str(&t);
            b.text(&t, out);
        }
        Parsed::Call(c) => {
            b.call(*calls, Some(&c.id), Some(&c.function.name), &c.function.arguments, out);
            *calls += 1;
        }
    }
}

/// An error event inside a chat stream (`{"error": {...}}`, as warmpath ends a broken stream).
fn stream_error(v: &Value) -> Option<(String, String)> {
    let e = v.get("error")?;
    let code = e.get("code").and_then(Value::as_str).unwrap_or("upstream_error").to_owned();
    let message = e.get("message").and_then(Value::as_str).unwrap_or("the backend failed").to_owned();
    Some((code, message))
}

#[async_trait]
impl Downstream for Translator<'_> {
    async fn write_response_header(&mut self, header: Box<ResponseHeader>, end: bool) -> pingora::Result<()> {
        self.headers = header
            .headers
            .iter()
            // warmpath's own headers and the key's rate limits (`x-ratelimit-*`) reach the client.
            .filter(|(n, _)| n.as_str().starts_with("x-warmpath-") || n.as_str().starts_with("x-ratelimit-"))
            .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
            .collect();
        let status = header.status.as_u16();
        let sse = header
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        self.saw_done = false;
        self.state = match (status, sse) {
            (200, true) => State::Stream(sse::Splitter::default()),
            (200, false) => State::Whole(BytesMut::new()),
            // A later backend call of a response already under way: it fails as a broken
            // stream does.
            _ if self.started => {
                let why = format!("the backend answered a tool_search round with {status}");
                self.failure = Some(("upstream_error".into(), why));
                State::Stream(sse::Splitter::default())
            }
            _ => State::Error(status, BytesMut::new()),
        };
        if status == 200 && !self.started {
            self.started = true;
            // The checks that ran, in the response itself (a WebSocket has no headers).
            if let Some(v) = header.headers.get("x-warmpath-safety").and_then(|v| v.to_str().ok()) {
                self.builder.note("warmpath_safety", v);
            }
            self.sink.begin(&self.headers).await?;
            let start = self.builder.start();
            self.sink.events(start, false).await?;
        }
        if end {
            self.finish().await?;
        }
        Ok(())
    }

    async fn write_response_body(&mut self, body: Option<Bytes>, end: bool) -> pingora::Result<()> {
        if let Some(b) = body {
            match &mut self.state {
                State::Stream(split) => {
                    let mut out = Vec::new();
                    for data in split.feed(&b) {
                        if data.trim() == "[DONE]" {
                            self.saw_done = true;
                            continue;
                        }
                        let Ok(v) = serde_json::from_str::<Value>(&data) else { continue };
                        match stream_error(&v) {
                            Some(f) => self.failure = Some(f),
                            None => self.chunk(&v, &mut out),
                        }
                    }
                    if !out.is_empty() {
                        self.sink.events(out, false).await?;
                    }
                }
                State::Whole(buf) | State::Error(_, buf) => {
                    if buf.len() + b.len() > MAX_WHOLE {
                        return pingora::Error::e_explain(
                            pingora::ErrorType::InternalError,
                            "answer too large to translate",
                        );
                    }
                    buf.extend_from_slice(&b);
                }
                State::Waiting | State::Done => {}
            }
        }
        if end {
            self.finish().await?;
        }
        Ok(())
    }

    async fn gone(&mut self) {
        self.sink.gone().await
    }

    fn close_after(&mut self) {}
}
