//! Running a request's choices on the engine, for both Chat Completions and Completions:
//! collected into one response, or streamed as SSE with OpenAI's framing
//! (`data: {json}\n\n` … `data: [DONE]\n\n`).
//!
//! A streaming response is fed by a task that ends when the client goes away: dropping the
//! body closes the channel, the task stops and drops its [`RequestStream`]s, and that aborts
//! the requests in the engine and frees their blocks. A choice ended by a stop string is
//! dropped (so aborted) as soon as it ends, whatever its sibling choices still do.

use std::collections::HashMap;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::{self, SelectAll, StreamExt};
use tokio::sync::mpsc;
use warmpath_wire::openai::{unix_now, ApiError, FinishReason, StreamOptions, Usage};
use warmpath_wire::tokenizer::Tokenizer;

use super::logprobs::Entry;
use super::text::TextState;
use super::AppState;
use crate::core::{RequestOutput, RequestStream};
use crate::faults::RequestFaults;
use crate::scheduler::SamplingParams;

/// One choice to generate.
pub struct ChoiceSpec {
    pub index: u32,
    /// Which prompt of the request this choice continues (usage counts each prompt once).
    pub prompt_index: usize,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stops: Vec<String>,
}

/// A finished choice.
#[derive(Debug)]
pub struct ChoiceResult {
    pub index: u32,
    pub text: String,
    pub finish: FinishReason,
    /// Per generated token, where the request asked for log-probabilities.
    pub logprobs: Vec<Entry>,
}

/// What every response and chunk of one request repeats.
pub struct ResponseMeta {
    pub id: String,
    pub model: String,
    pub created: u64,
    /// `stream_options.include_usage`: usage chunk at the end, `usage: null` before it.
    pub include_usage: bool,
}

impl ResponseMeta {
    /// `id` is `prefix-` and 16 hex digits, unique per engine request.
    pub fn new(prefix: &str, running: &Running, model: &str, stream_options: Option<&StreamOptions>) -> Self {
        let created = unix_now();
        ResponseMeta {
            id: format!(
                "{prefix}-{:016x}",
                crate::sampler::Rng::new(created ^ running.first_id()).next_u64()
            ),
            model: model.to_owned(),
            created,
            include_usage: stream_options.is_some_and(|o| o.include_usage),
        }
    }

    /// The `usage` field of a chunk: absent unless `include_usage`, then `null` or the usage.
    pub fn chunk_usage(&self, usage: Option<&Usage>) -> Option<Option<Usage>> {
        self.include_usage.then(|| usage.cloned())
    }
}

/// How a route writes its stream chunks (each a JSON document).
pub trait ChunkFormat: Send + Sync + 'static {
    fn meta(&self) -> &ResponseMeta;
    /// Sent once per choice before its first text (chat: the assistant role).
    fn opening(&self, index: u32) -> Option<String>;
    /// A chunk for new text and the log-probabilities of the tokens it came from (where
    /// asked for); `None` when nothing is to be sent yet (held back by a parser).
    fn delta(&self, index: u32, text: &str, logprobs: &[Entry]) -> Option<String>;
    fn finish(&self, index: u32, reason: FinishReason) -> String;
    fn usage(&self, usage: &Usage) -> String;
}

/// Draws this request's injected faults and applies the ones that act before generation
/// (delay, failure); the rest act on the response.
pub async fn pre_faults(state: &AppState) -> Result<RequestFaults, ApiError> {
    let faults = state.faults.draw();
    if !faults.delay.is_zero() {
        tokio::time::sleep(faults.delay).await;
    }
    if faults.fail {
        return Err(ApiError::internal("fault injection: request failed"));
    }
    Ok(faults)
}

/// A non-streaming JSON response, cut in half when the malformed-JSON fault is on.
pub fn json_reply<T: serde::Serialize>(body: &T, faults: &RequestFaults) -> Result<Response, ApiError> {
    let json = serde_json::to_string(body).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(super::json_response(if faults.malformed { json[..json.len() / 2].to_owned() } else { json }))
}

/// The sampling fields Chat Completions and Completions share, before validation.
pub struct SamplingFields<'a> {
    pub n: Option<u32>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<warmpath_wire::openai::Stop>,
    /// Unknown fields: vLLM's `ignore_eos` and `stop_token_ids` are honoured, and warmpath's
    /// `num_speculative_tokens` (n-gram proposals per step for this request; 0: none).
    pub extra: &'a serde_json::Map<String, serde_json::Value>,
    /// Scripted output tokens (the `--script` test hook); empty to sample.
    pub forced: Vec<u32>,
    /// Log-probabilities with this many alternatives per token (`None`: not asked for).
    pub logprobs: Option<usize>,
}

impl SamplingFields<'_> {
    /// Validates the fields and expands them into `n` choices per prompt.
    pub fn choices(self, state: &AppState, prompts: Vec<Vec<u32>>) -> Result<Vec<ChoiceSpec>, ApiError> {
        let n = self.n.unwrap_or(1);
        if !(1..=128).contains(&n) {
            return Err(
                ApiError::invalid_request(format!("n must be between 1 and 128, got {n}")).with_param("n")
            );
        }
        if let Some(m) = self.max_tokens {
            if m <= 0 {
                return Err(ApiError::invalid_request(format!("max_tokens must be at least 1, got {m}"))
                    .with_param("max_tokens"));
            }
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_request(format!(
                "temperature must be within [0, 2], got {temperature}"
            ))
            .with_param("temperature"));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_request(format!("top_p must be within (0, 1], got {top_p}"))
                .with_param("top_p"));
        }
        let stops = self.stop.map(|s| s.into_vec()).unwrap_or_default();
        if stops.len() > 16 {
            return Err(ApiError::invalid_request("at most 16 stop sequences").with_param("stop"));
        }
        let mut stop_token_ids: Vec<u32> = Vec::new();
        if !self.extra.get("ignore_eos").and_then(|v| v.as_bool()).unwrap_or(false) {
            stop_token_ids.extend(&state.format.stop_ids);
        }
        if let Some(ids) = self.extra.get("stop_token_ids").and_then(|v| v.as_array()) {
            stop_token_ids.extend(ids.iter().filter_map(|v| v.as_u64()).map(|v| v as u32));
        }
        let speculative = match self.extra.get("num_speculative_tokens") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(k) if k as usize <= crate::spec::MAX_SPECULATIVE_TOKENS => Some(k as usize),
                _ => {
                    return Err(ApiError::invalid_request(format!(
                        "num_speculative_tokens must be an integer within 0..={}, got {v}",
                        crate::spec::MAX_SPECULATIVE_TOKENS
                    ))
                    .with_param("num_speculative_tokens"))
                }
            },
        };
        let max_model_len = state.engine.info().max_model_len;
        let mut out = Vec::new();
        for (prompt_index, prompt) in prompts.into_iter().enumerate() {
            // vLLM's default: whatever room the context leaves.
            let max_tokens = self
                .max_tokens
                .map(|m| m as usize)
                .unwrap_or(max_model_len.saturating_sub(prompt.len()).max(1));
            for i in 0..n {
                out.push(ChoiceSpec {
                    index: prompt_index as u32 * n + i,
                    prompt_index,
                    prompt: prompt.clone(),
                    params: SamplingParams {
                        max_tokens,
                        temperature,
                        top_p,
                        // Choices of one seeded request differ from each other but repeat.
                        seed: self.seed.map(|s| (s as u64).wrapping_add(i as u64)),
                        stop_token_ids: stop_token_ids.clone(),
                        forced: self.forced.clone(),
                        speculative,
                        logprobs: self.logprobs,
                    },
                    stops: stops.clone(),
                });
            }
        }
        Ok(out)
    }
}

/// Submitted choices with their prompt sizes, ready to collect or stream.
pub struct Running {
    choices: Vec<Choice>,
    prompt_tokens: Vec<usize>,
}

impl Running {
    /// The engine id of the first choice (unique per request; seeds the response id).
    pub fn first_id(&self) -> u64 {
        self.choices.first().map(|c| c.stream.id()).unwrap_or(0)
    }
}

/// Queues every choice; fails (nothing left queued) if any is rejected.
pub fn submit(
    state: &AppState,
    specs: Vec<ChoiceSpec>,
    cache_salt: Option<String>,
    handoff: crate::core::Handoff,
) -> Result<Running, ApiError> {
    // A handoff has one choice ([`super::handoff::prepare`]).
    let mut handoff = Some(handoff);
    let mut prompt_tokens = Vec::new();
    let mut choices = Vec::with_capacity(specs.len());
    for c in specs {
        if prompt_tokens.len() <= c.prompt_index {
            prompt_tokens.resize(c.prompt_index + 1, 0);
        }
        prompt_tokens[c.prompt_index] = c.prompt.len();
        let h = handoff.take().unwrap_or_default();
        let stream = state.engine.generate_with(c.prompt, c.params, cache_salt.clone(), h)?;
        choices.push(Choice {
            index: c.index,
            prompt_index: c.prompt_index,
            stream,
            text: TextState::new(c.stops),
            tok: state.format.tokenizer.clone(),
            finished: false,
        });
    }
    Ok(Running { choices, prompt_tokens })
}

/// One choice in flight: its engine request and the text made of its tokens. Once it has
/// finished (engine finish or stop string) it yields nothing more; dropping it then aborts the
/// engine request if the engine had not finished it (a stop string ended it).
struct Choice {
    index: u32,
    prompt_index: usize,
    stream: RequestStream,
    text: TextState,
    tok: Tokenizer,
    finished: bool,
}

/// What one engine output means for a choice.
struct ChoiceEvent {
    index: u32,
    prompt_index: usize,
    output: RequestOutput,
    /// Text now safe to send (possibly empty).
    text: String,
    /// The token's log-probabilities, where asked for.
    logprob: Option<Entry>,
    /// Set on the choice's last event.
    finish: Option<FinishReason>,
}

impl Choice {
    async fn next(&mut self) -> Option<ChoiceEvent> {
        if self.finished {
            return None;
        }
        let output = self.stream.next().await?;
        let mut text = self.text.push(&self.tok, output.token);
        let finish = if self.text.stopped() { Some(FinishReason::Stop) } else { output.finish };
        if finish.is_some() {
            text.push_str(&self.text.finish());
            self.finished = true;
        }
        let logprob = output.logprobs.as_ref().map(|lp| Entry::new(&self.tok, output.token, lp));
        Some(ChoiceEvent {
            index: self.index,
            prompt_index: self.prompt_index,
            output,
            text,
            logprob,
            finish,
        })
    }
}

/// Tallies usage across choices.
struct UsageTally {
    prompt_tokens: Vec<usize>,
    cached: Vec<Option<usize>>,
    completion: usize,
}

impl UsageTally {
    fn new(prompt_tokens: Vec<usize>) -> UsageTally {
        let n = prompt_tokens.len();
        UsageTally { prompt_tokens, cached: vec![None; n], completion: 0 }
    }

    fn record(&mut self, ev: &ChoiceEvent) {
        self.completion += 1;
        self.cached[ev.prompt_index].get_or_insert(ev.output.cached_tokens);
    }

    fn usage(&self) -> Usage {
        let p: usize = self.prompt_tokens.iter().sum();
        let c: usize = self.cached.iter().map(|c| c.unwrap_or(0)).sum();
        Usage::new(p as u32, self.completion as u32, c as u32)
    }
}

/// Waits for every choice to finish.
pub async fn collect(running: Running) -> (Vec<ChoiceResult>, Usage) {
    let mut tally = UsageTally::new(running.prompt_tokens);
    let mut results = Vec::new();
    // Choices run concurrently in the engine; awaiting them one after another loses nothing.
    for mut c in running.choices {
        let mut text = String::new();
        let mut finish = FinishReason::Abort;
        let mut logprobs = Vec::new();
        while let Some(ev) = c.next().await {
            tally.record(&ev);
            text.push_str(&ev.text);
            logprobs.extend(ev.logprob);
            finish = ev.finish.unwrap_or(finish);
        }
        results.push(ChoiceResult { index: c.index, text, finish, logprobs });
    }
    (results, tally.usage())
}

type Frame = Result<Bytes, std::io::Error>;

fn sse(json: &str) -> Frame {
    Ok(Bytes::from(format!("data: {json}\n\n")))
}

/// Streams the choices as SSE.
pub fn stream(running: Running, fmt: impl ChunkFormat, faults: RequestFaults) -> Response {
    let (tx, rx) = mpsc::channel::<Frame>(64);
    tokio::spawn(async move {
        tokio::select! {
            _ = pump(running, &fmt, &faults, &tx) => {}
            _ = tx.closed() => {} // client gone: dropping `pump` aborts the requests
        }
    });
    let body =
        Body::from_stream(stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) }));
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

async fn pump(running: Running, fmt: &impl ChunkFormat, faults: &RequestFaults, tx: &mpsc::Sender<Frame>) {
    let mut tally = UsageTally::new(running.prompt_tokens);
    let mut merged: SelectAll<_> = SelectAll::new();
    // Each choice's opening goes out with its first event, after its prefill, as vLLM's does:
    // a router counts a backend's queued prefill work until the first bytes of an answer.
    let mut openings: HashMap<u32, String> = HashMap::new();
    for c in running.choices {
        if let Some(open) = fmt.opening(c.index) {
            openings.insert(c.index, open);
        }
        // A finished choice ends its stream, which drops it at once (see `Choice`).
        merged.push(Box::pin(stream::unfold(c, |mut c| async move { c.next().await.map(|ev| (ev, c)) })));
    }
    let mut sent_tokens = 0usize;
    // Per choice, log-probabilities of tokens whose text has not gone out yet.
    let mut pending: HashMap<u32, Vec<Entry>> = HashMap::new();
    while let Some(mut ev) = merged.next().await {
        tally.record(&ev);
        let mut frames = Vec::new();
        if let Some(open) = openings.remove(&ev.index) {
            frames.push(sse(&open));
        }
        let held = pending.entry(ev.index).or_default();
        held.extend(ev.logprob.take());
        // Text goes out as it comes; log-probabilities with it, or with the last chunk.
        let flush = !ev.text.is_empty() || (ev.finish.is_some() && !held.is_empty());
        if let Some(json) = Some(&ev.text).filter(|_| flush).and_then(|t| fmt.delta(ev.index, t, held)) {
            frames.push(if faults.malformed { sse(&json[..json.len() / 2]) } else { sse(&json) });
            sent_tokens += 1;
            held.clear();
        }
        if let Some(f) = ev.finish {
            frames.push(sse(&fmt.finish(ev.index, f)));
        }
        for f in frames {
            if tx.send(f).await.is_err() {
                return;
            }
        }
        if faults.die_after_tokens.is_some_and(|n| sent_tokens >= n) {
            // Fault: cut the connection without a proper end of stream. Let the frames already
            // queued reach the socket first, so the client sees exactly the promised tokens.
            while tx.capacity() < tx.max_capacity() {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let _ = tx.send(Err(std::io::Error::other("fault injection: died mid-stream"))).await;
            return;
        }
    }
    if fmt.meta().include_usage {
        let _ = tx.send(sse(&fmt.usage(&tally.usage()))).await;
    }
    let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
}
