//! The output release policy: a [`Downstream`] between the forwarding code and the client that
//! shows the answer to the output checks window by window and releases it as
//! `[pools.safety.output] release` says — `after_check` (a window waits for its verdict),
//! `stream` (text goes at once, checks trail it) or `buffered` (up to `lag_tokens` held back).
//!
//! A stream (chat or completions SSE, or a backend's own Responses events: `responses`) is cut
//! into events; each event with text counts as one token (servers stream one token per event). A window closes after `window_tokens` of them or
//! at a finish; it is judged with the last `overlap_tokens` pieces of the previous window in
//! front, so that a finding split between windows is seen. A block cuts the stream: what is
//! still held is dropped, a closing chunk with `finish_reason: "content_filter"` and
//! `data: [DONE]` end it, and the backend call is dropped (writes fail, `gone` resolves). A
//! whole answer is judged whole before any of it goes out (`whole`): cut, it keeps its shape
//! with empty text and `content_filter`. Redaction masks spans in text still held.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::http::ResponseHeader;
use pingora::{Error, ErrorType};
use serde_json::Value;
use warmpath_wire::sse;

use super::downstream::Downstream;
use super::headers::is_sse;
use crate::config::Release;
use crate::safety::texts::{self, Loc};
use crate::safety::{Decision, Pending, Safety, Turn};

mod responses;
mod whole;

/// Largest whole answer held for its checks.
const MAX_WHOLE: usize = 16 << 20;

enum Mode {
    /// Not yet known (no header yet).
    Start,
    /// Passed through unchecked: an error status, a body that is neither.
    Through,
    Stream,
    /// A whole JSON answer, held with its header until judged.
    Whole(Box<ResponseHeader>, BytesMut),
}

/// What an answer is: the shape of its chunks, its whole form, and how a cut ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Chat,
    Completion,
    /// A backend's own Responses answer (a `responses = "native"` pool): events, or a
    /// response object.
    Responses,
}

/// An event of the stream not yet released.
struct Held {
    bytes: Bytes,
    window: u64,
    tokens: usize,
    pieces: Vec<HeldPiece>,
    /// Responses: the event's `sequence_number`, and the event itself where it is not a delta
    /// (it may state texts again, open or close an item, or carry the response object).
    seq: Option<u64>,
    note: Option<Value>,
}

/// A text piece of a held event: its choice, its place, where it sits in the choice's whole
/// text, and the text.
struct HeldPiece {
    choice: u32,
    loc: Loc,
    start: usize,
    end: usize,
    text: String,
}

/// A span of a choice's text to mask (in the choice's whole text), and whether its label is
/// out yet.
struct Mask {
    start: usize,
    end: usize,
    label: String,
    placed: bool,
}

/// A closed window's judgement.
struct Judging {
    seq: u64,
    pending: Option<Pending>,
    decision: Option<Decision>,
    closed: Instant,
}

/// One choice's text in the open window, each piece with where it starts in the choice's
/// whole text.
#[derive(Default)]
struct ChoiceText {
    /// Pieces of the previous window checked again in front of this one's.
    overlap: Vec<(usize, String)>,
    pieces: Vec<(usize, String)>,
    /// Length of the choice's whole text so far.
    len: usize,
}

pub(super) struct OutputRelease<'d> {
    inner: &'d mut dyn Downstream,
    safety: &'d Safety,
    context: Arc<Vec<Turn>>,
    shape: Shape,
    mode: Mode,
    events: sse::Splitter,
    held: VecDeque<Held>,
    held_tokens: usize,
    /// The open window: its number, its tokens, its text per choice.
    seq: u64,
    tokens: usize,
    choices: BTreeMap<u32, ChoiceText>,
    /// Spans to mask, per choice, as events are released.
    masks: BTreeMap<u32, Vec<Mask>>,
    /// Per choice and place, the text released (remembered as passed once the answer is).
    released: BTreeMap<(u32, Loc), String>,
    /// Responses: the response object as the stream began it, the output items opened (and
    /// whether done) and the last event number, as released.
    response: Option<Value>,
    items: BTreeMap<u32, (Value, bool)>,
    last_seq: Option<u64>,
    /// A window passed only because a check failed open: the answer is not remembered.
    unsure: bool,
    judging: VecDeque<Judging>,
    /// Every window below this one passed.
    passed: u64,
    blocked: bool,
    /// The client's stream is over (ended, or cut).
    closed: bool,
    last_chunk: Option<Value>,
}

impl<'d> OutputRelease<'d> {
    pub fn new(
        inner: &'d mut dyn Downstream,
        safety: &'d Safety,
        context: Arc<Vec<Turn>>,
        shape: Shape,
    ) -> OutputRelease<'d> {
        OutputRelease {
            inner,
            safety,
            context,
            shape,
            mode: Mode::Start,
            events: sse::Splitter::default(),
            held: VecDeque::new(),
            held_tokens: 0,
            seq: 0,
            tokens: 0,
            choices: BTreeMap::new(),
            masks: BTreeMap::new(),
            released: BTreeMap::new(),
            response: None,
            items: BTreeMap::new(),
            last_seq: None,
            unsure: false,
            judging: VecDeque::new(),
            passed: 0,
            blocked: false,
            closed: false,
            last_chunk: None,
        }
    }

    fn release_word(&self) -> &'static str {
        match self.safety.output.release {
            Release::AfterCheck => "after_check",
            Release::Stream => "stream",
            Release::Buffered => "buffered",
        }
    }

    fn stopped_error() -> Box<Error> {
        Error::explain(ErrorType::WriteError, "the answer was cut by an output safety check")
    }

    /// Takes in a stream's bytes: events split off, their text added to the open window,
    /// windows closed and judged as they fill.
    fn take_in(&mut self, bytes: &[u8]) {
        self.events.push(bytes);
        while let Some((raw, data)) = self.events.next_event() {
            let value = serde_json::from_str::<Value>(&data).ok();
            let carried = value.as_ref().map(texts::pieces).unwrap_or_default();
            let mut pieces = Vec::new();
            for p in carried.pieces {
                let c = self.choices.entry(p.choice).or_default();
                let start = c.len;
                c.len += p.text.len();
                c.pieces.push((start, p.text.clone()));
                pieces.push(HeldPiece { choice: p.choice, loc: p.loc, start, end: c.len, text: p.text });
            }
            let (mut seq, mut note) = (None, None);
            if self.shape == Shape::Responses {
                seq = value.as_ref().and_then(|v| v.get("sequence_number")).and_then(Value::as_u64);
                let kind = value.as_ref().and_then(|v| v.get("type")).and_then(Value::as_str);
                if !kind.is_some_and(|k| k.ends_with(".delta")) {
                    note = value;
                }
            } else if value.as_ref().is_some_and(|v| v.get("choices").is_some()) {
                self.last_chunk = value;
            }
            let tokens = usize::from(!pieces.is_empty());
            self.tokens += tokens;
            self.held_tokens += tokens;
            let window = self.seq;
            self.held.push_back(Held { bytes: Bytes::from(raw), window, tokens, pieces, seq, note });
            if self.tokens >= self.safety.output.window_tokens || !carried.finished.is_empty() {
                self.close_window(false);
            }
        }
    }

    /// Judges the open window (if it holds any text) and opens the next. Under `after_check`,
    /// but for the `last` window, its last `overlap_tokens` stay held with the next window: they are judged
    /// again there with what follows them, so a finding split between the two is caught
    /// (blocked or masked) before any of it goes out.
    fn close_window(&mut self, last: bool) {
        let seq = self.seq;
        self.seq += 1;
        self.tokens = 0;
        let keep = self.safety.output.overlap_tokens;
        let mut order = Vec::new();
        let mut judged = Vec::new();
        for (&choice, c) in &mut self.choices {
            if c.pieces.is_empty() {
                continue;
            }
            let origin = c.overlap.first().or(c.pieces.first()).map_or(0, |p| p.0);
            let front: String = c.overlap.iter().map(|p| p.1.as_str()).collect();
            let text: String = front.clone() + &c.pieces.iter().map(|p| p.1.as_str()).collect::<String>();
            order.push((choice, origin));
            judged.push((text, front.len()));
            let mut all = std::mem::take(&mut c.overlap);
            all.append(&mut c.pieces);
            c.overlap = all.split_off(all.len().saturating_sub(keep));
        }
        if self.safety.output.release == Release::AfterCheck && !last {
            self.hold_overlap(seq, keep);
        }
        if judged.is_empty() {
            // Nothing new to judge: it passes as soon as the windows before it do.
            self.judging.push_back(Judging {
                seq,
                pending: None,
                decision: Some(Decision::Pass),
                closed: Instant::now(),
            });
            return;
        }
        let j = self.safety.output(&self.context, &judged);
        for ((choice, origin), spans) in order.iter().zip(&j.redact) {
            let masks = self.masks.entry(*choice).or_default();
            for (a, b, label) in spans {
                let (start, end) = (origin + a, origin + b);
                if !masks.iter().any(|m| m.start == start && m.end == end) {
                    masks.push(Mask { start, end, label: label.clone(), placed: false });
                }
            }
            masks.sort_by_key(|m| m.start);
        }
        let decision = if j.now.blocks() || j.pending.is_none() { Some(j.now) } else { None };
        self.judging.push_back(Judging { seq, pending: j.pending, decision, closed: Instant::now() });
    }

    /// Moves the last `keep` token events of window `seq` (and what follows them) to the next
    /// window.
    fn hold_overlap(&mut self, seq: u64, keep: usize) {
        let mut counted = 0;
        let mut from = self.held.len();
        for (i, h) in self.held.iter().enumerate().rev() {
            if h.window != seq || counted == keep {
                break;
            }
            counted += h.tokens;
            from = i;
        }
        for h in self.held.iter_mut().skip(from) {
            h.window = seq + 1;
        }
    }

    /// An event as it goes out: its pieces masked where spans touch them, their text added to
    /// what the client has of each choice.
    fn masked(&mut self, h: Held) -> Bytes {
        let mut changed: Vec<(&HeldPiece, String)> = Vec::new();
        for p in &h.pieces {
            let masks = self
                .masks
                .get_mut(&p.choice)
                .filter(|ms| ms.iter().any(|m| m.start < p.end && m.end > p.start));
            let new = masks.map(|masks| {
                let spans: Vec<(usize, usize, String)> =
                    masks.iter().map(|m| (m.start, m.end, m.label.clone())).collect();
                let mut placed: Vec<bool> = masks.iter().map(|m| m.placed).collect();
                let text = texts::mask(&p.text, p.start, &spans, &mut placed);
                for (m, now) in masks.iter_mut().zip(placed) {
                    m.placed = now;
                }
                text
            });
            self.released.entry((p.choice, p.loc)).or_default().push_str(new.as_deref().unwrap_or(&p.text));
            if let Some(text) = new {
                changed.push((p, text));
            }
        }
        self.last_seq = h.seq.or(self.last_seq);
        if let Some(v) = h.note {
            return self.noted(h.bytes, v);
        }
        if changed.is_empty() {
            return h.bytes;
        }
        let Some((head, data)) = split_data(&h.bytes) else { return h.bytes };
        let Ok(mut v) = serde_json::from_str::<Value>(data) else { return h.bytes };
        for (p, text) in changed {
            texts::put(&mut v, p.choice, p.loc, text);
        }
        Bytes::from(format!("{head}data: {v}\n\n"))
    }

    /// Takes in the verdicts that are in, in order; true when one blocks.
    fn settle(&mut self) -> bool {
        for j in &mut self.judging {
            if j.decision.is_none() {
                if let Some(p) = &mut j.pending {
                    j.decision = p.ready();
                }
            }
        }
        self.advance()
    }

    /// Moves `passed` over the decided windows at the front; true on a block.
    fn advance(&mut self) -> bool {
        while let Some(front) = self.judging.front() {
            match &front.decision {
                Some(Decision::Pass) => {
                    self.unsure |= front.pending.as_ref().is_some_and(|p| !p.is_verdict());
                    self.safety.held.observe(front.closed.elapsed().as_secs_f64());
                    self.passed = front.seq + 1;
                    self.judging.pop_front();
                }
                Some(Decision::Block { .. }) => {
                    self.blocked = true;
                    return true;
                }
                None => break,
            }
        }
        // A later window may block before an earlier one passes: a block is final.
        self.blocked |= self.judging.iter().any(|j| j.decision.as_ref().is_some_and(Decision::blocks));
        self.blocked
    }

    /// The held events the policy lets go now, joined.
    fn releasable(&mut self) -> Option<Bytes> {
        let mut out = BytesMut::new();
        let lag = self.safety.output.lag_tokens;
        while let Some(front) = self.held.front() {
            let go = match self.safety.output.release {
                // After a block, only what passed before it.
                _ if self.blocked => front.window < self.passed,
                Release::Stream => true,
                Release::AfterCheck => front.window < self.passed,
                Release::Buffered => front.window < self.passed || self.held_tokens > lag,
            };
            if !go {
                break;
            }
            let h = self.held.pop_front().expect("front");
            self.held_tokens -= h.tokens;
            let bytes = self.masked(h);
            out.extend_from_slice(&bytes);
        }
        (!out.is_empty()).then(|| out.freeze())
    }

    /// Ends a cut stream: what is held is dropped; the closing chunk and `[DONE]`.
    async fn write_cut(&mut self) -> pingora::Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.held.clear();
        let out = if self.shape == Shape::Responses {
            self.responses_cut()
        } else {
            let choices: Vec<u32> = self.choices.keys().copied().collect();
            let completion = self.shape == Shape::Completion;
            let chunk = texts::cut_chunk(self.last_chunk.as_ref(), &choices, completion);
            format!("data: {chunk}\n\ndata: [DONE]\n\n")
        };
        self.inner.write_response_body(Some(Bytes::from(out)), true).await
    }

    /// Called once the forwarding is over: a stream stopped by a verdict gets its ending.
    pub async fn finish(&mut self) -> pingora::Result<()> {
        if self.blocked && matches!(self.mode, Mode::Stream) && !self.closed {
            if let Some(out) = self.releasable() {
                self.inner.write_response_body(Some(out), false).await?;
            }
            return self.write_cut().await;
        }
        Ok(())
    }
}

/// The answer's text per choice (its text pieces joined, tool-call arguments left out), as
/// it is remembered once it passed.
fn answer_texts<'t>(pieces: impl Iterator<Item = (u32, Loc, &'t str)>) -> Vec<String> {
    let mut per_choice: BTreeMap<u32, String> = BTreeMap::new();
    for (choice, loc, text) in pieces {
        if loc.is_text() {
            per_choice.entry(choice).or_default().push_str(text);
        }
    }
    per_choice.into_values().collect()
}

/// An event's lines before its data, and its data (one `data:` line).
fn split_data(raw: &[u8]) -> Option<(String, &str)> {
    let text = std::str::from_utf8(raw).ok()?;
    let at = text.find("data:")?;
    let data = text[at + 5..].trim_start_matches(' ');
    let end = data.find('\n').unwrap_or(data.len());
    Some((text[..at].to_owned(), data[..end].trim_end_matches('\r')))
}

#[async_trait]
impl Downstream for OutputRelease<'_> {
    async fn write_response_header(
        &mut self,
        mut header: Box<ResponseHeader>,
        end: bool,
    ) -> pingora::Result<()> {
        let ok = header.status.as_u16() == 200 && !end;
        let json = header
            .headers
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
        if ok && json {
            self.mode = Mode::Whole(header, BytesMut::new());
            return Ok(());
        }
        if ok && is_sse(&header) {
            self.mode = Mode::Stream;
            header.insert_header("x-warmpath-safety", format!("output={}", self.release_word()))?;
        } else {
            self.mode = Mode::Through;
        }
        self.inner.write_response_header(header, end).await
    }

    async fn write_response_body(&mut self, body: Option<Bytes>, end: bool) -> pingora::Result<()> {
        if self.blocked || self.closed {
            return Err(Self::stopped_error());
        }
        match &mut self.mode {
            Mode::Start | Mode::Through => return self.inner.write_response_body(body, end).await,
            Mode::Whole(_, buf) => {
                if let Some(b) = &body {
                    if buf.len() + b.len() > MAX_WHOLE {
                        return Err(Error::explain(ErrorType::WriteError, "answer too large to check"));
                    }
                    buf.extend_from_slice(b);
                }
                if !end {
                    return Ok(());
                }
                let Mode::Whole(header, buf) = std::mem::replace(&mut self.mode, Mode::Through) else {
                    unreachable!("matched above")
                };
                return self.release_whole(header, buf).await;
            }
            Mode::Stream => {}
        }
        if let Some(b) = &body {
            self.take_in(b);
        }
        if end {
            // The stream is over: the last window is judged and every verdict awaited.
            let rest = self.events.take_rest();
            if !rest.is_empty() {
                self.held.push_back(Held {
                    bytes: Bytes::from(rest),
                    window: self.seq,
                    tokens: 0,
                    pieces: Vec::new(),
                    seq: None,
                    note: None,
                });
            }
            self.close_window(true);
            for j in &mut self.judging {
                if let (None, Some(p)) = (&j.decision, &mut j.pending) {
                    j.decision = Some(p.decided().await);
                }
            }
        }
        if self.settle() {
            // What passed before the blocking window (one read may carry several) goes out
            // first.
            if let Some(out) = self.releasable() {
                self.inner.write_response_body(Some(out), false).await?;
            }
            self.write_cut().await?;
            return Err(Self::stopped_error());
        }
        if let Some(out) = self.releasable() {
            self.inner.write_response_body(Some(out), false).await?;
        }
        if end {
            self.closed = true;
            let released = std::mem::take(&mut self.released);
            let texts = answer_texts(released.iter().map(|((c, l), t)| (*c, *l, t.as_str())));
            if !self.unsure {
                self.safety.passed_output(&texts);
            }
            return self.inner.write_response_body(None, true).await;
        }
        Ok(())
    }

    async fn gone(&mut self) {
        while !self.blocked {
            let next = self.judging.iter_mut().find(|j| j.decision.is_none() && j.pending.is_some());
            let Some(j) = next else { break };
            let p = j.pending.as_mut().expect("pending");
            tokio::select! {
                _ = self.inner.gone() => return,
                d = p.decided() => {
                    j.decision = Some(d);
                    self.advance();
                }
            }
        }
        if self.blocked {
            return;
        }
        self.inner.gone().await
    }

    fn close_after(&mut self) {
        self.inner.close_after();
    }

    fn stopped(&self) -> bool {
        self.blocked || self.inner.stopped()
    }
}
