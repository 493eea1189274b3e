//! `POST /v1/chat/completions`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use warmpath_wire::openai::{
    parse_body, ApiError, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
    ChatCompletionRequest, ChunkChoice, Delta, FinishReason, FunctionCallDelta, Role, ToolCall,
    ToolCallDelta, Usage,
};

use super::generate::{self, ChunkFormat, ResponseMeta, SamplingFields};
use super::logprobs::{self, Entry};
use super::{check_model, handoff, read_body, AppState, ErrorReply};
use crate::kv_transfer::KvRole;
use warmpath_wire::tool_calls::{self, CallParser, Parsed};

pub async fn handle(State(state): State<Arc<AppState>>, body: Body) -> Response {
    match run(state, body).await {
        Ok(r) => r,
        Err(e) => ErrorReply(e).into_response(),
    }
}

/// Parses and validates a request, returning its prompt's token ids.
pub fn prompt_of(state: &AppState, req: &ChatCompletionRequest) -> Result<Vec<u32>, ApiError> {
    check_model(state, &req.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid_request("messages must not be empty").with_param("messages"));
    }
    let tools = req.tools.as_deref().unwrap_or_default();
    state.format.render_tokens(&req.messages, tools, true).map_err(|e| {
        ApiError::invalid_request(format!("the chat template failed: {e}")).with_param("messages")
    })
}

async fn run(state: Arc<AppState>, body: Body) -> Result<Response, ApiError> {
    let bytes = read_body(&state, body).await?;
    let req: ChatCompletionRequest = parse_body(&bytes)?;
    let prompt = prompt_of(&state, &req)?;
    let faults = generate::pre_faults(&state).await?;
    let forced = scripted(&state, &req);
    let fields = SamplingFields {
        n: req.n,
        max_tokens: req.max_tokens(),
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
        stop: req.stop.clone(),
        extra: &req.extra,
        forced,
        logprobs: logprobs::chat_request(&req.extra)?,
    };
    let want_logprobs = fields.logprobs.is_some();
    let salt = req.cache_salt.as_deref();
    let stream = req.stream.unwrap_or(false);
    let choices = fields.choices(&state, vec![prompt.clone()])?;
    let (role, handoff) = handoff::prepare(&state, &req.extra, stream, choices.len(), &prompt, salt).await?;
    let running = generate::submit(&state, choices, req.cache_salt.clone(), handoff)?;
    let params =
        (role == Some(KvRole::Prefill)).then(|| handoff::answer(&state, running.first_id(), &prompt, salt));
    let meta = ResponseMeta::new("chatcmpl", &running, &req.model, req.stream_options.as_ref());
    // Tool calls are parsed out of the text when the request offers tools (vLLM's
    // `--enable-auto-tool-choice` behaviour).
    let tools = req.tools.as_ref().is_some_and(|t| !t.is_empty());
    let id_prefix = format!("{:x}", running.first_id());
    if stream {
        let parsers = tools.then(|| Mutex::new(HashMap::new()));
        return Ok(generate::stream(running, ChatFormat { meta, parsers, id_prefix }, faults));
    }
    let (results, usage) = generate::collect(running).await;
    let resp = ChatCompletion {
        id: meta.id,
        object: "chat.completion".into(),
        created: meta.created,
        model: meta.model,
        system_fingerprint: None,
        choices: results
            .into_iter()
            .map(|r| {
                let (content, calls, finish) = if tools {
                    let (content, calls) = tool_calls::parse(&r.text, &format!("{id_prefix}_{}", r.index));
                    let finish = if calls.is_empty() { r.finish } else { FinishReason::ToolCalls };
                    (content, Some(calls).filter(|c| !c.is_empty()), finish)
                } else {
                    (Some(r.text), None, r.finish)
                };
                ChatChoice {
                    index: r.index,
                    message: AssistantMessage { role: Role::Assistant, content, tool_calls: calls },
                    logprobs: want_logprobs.then(|| logprobs::chat_json(&r.logprobs)),
                    finish_reason: Some(finish),
                }
            })
            .collect(),
        usage,
    };
    generate::json_reply(&handoff::with_params(&resp, params)?, &faults)
}

/// The `--script` reply for this request, as forced output tokens ending the turn.
fn scripted(state: &AppState, req: &ChatCompletionRequest) -> Vec<u32> {
    if state.script.is_empty() {
        return Vec::new();
    }
    let tools = req.tools.as_deref().unwrap_or_default();
    match state.format.render_text(&req.messages, tools, true) {
        Ok(text) => state.scripted(&text),
        Err(_) => Vec::new(),
    }
}

struct ChatFormat {
    meta: ResponseMeta,
    /// Per choice, when the request offers tools.
    parsers: Option<Mutex<HashMap<u32, CallParser>>>,
    id_prefix: String,
}

impl ChatFormat {
    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> String {
        let c = ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.meta.created,
            model: self.meta.model.clone(),
            system_fingerprint: None,
            choices,
            usage: self.meta.chunk_usage(usage.as_ref()),
        };
        serde_json::to_string(&c).unwrap_or_default()
    }

    /// One choice's chunk, with the log-probabilities of the tokens its text came from.
    fn one(&self, index: u32, delta: Delta, finish: Option<FinishReason>, lp: &[Entry]) -> String {
        let logprobs = (!lp.is_empty()).then(|| logprobs::chat_json(lp));
        self.chunk(vec![ChunkChoice { index, delta, logprobs, finish_reason: finish }], None)
    }

    /// Runs `f` on the choice's parser; `None` without tools.
    fn with_parser<T>(&self, index: u32, f: impl FnOnce(&mut CallParser) -> T) -> Option<T> {
        let parsers = self.parsers.as_ref()?;
        let mut map = parsers.lock().unwrap_or_else(|e| e.into_inner());
        let p = map.entry(index).or_insert_with(|| CallParser::new(&format!("{}_{index}", self.id_prefix)));
        Some(f(p))
    }
}

/// Parsed output as a delta: its text as content, its calls as whole tool-call deltas.
fn delta_of(outs: Vec<Parsed>, first_call: usize) -> Delta {
    let mut delta = Delta::default();
    let mut n = first_call as u32;
    for o in outs {
        match o {
            Parsed::Text(t) => delta.content.get_or_insert_with(String::new).push_str(&t),
            Parsed::Call(ToolCall { id, kind, function }) => {
                delta.tool_calls.get_or_insert_with(Vec::new).push(ToolCallDelta {
                    index: n,
                    id: Some(id),
                    kind: Some(kind),
                    function: FunctionCallDelta {
                        name: Some(function.name),
                        arguments: Some(function.arguments),
                    },
                });
                n += 1;
            }
        }
    }
    delta
}

impl ChunkFormat for ChatFormat {
    fn meta(&self) -> &ResponseMeta {
        &self.meta
    }

    fn opening(&self, index: u32) -> Option<String> {
        let delta = Delta { role: Some(Role::Assistant), content: Some(String::new()), tool_calls: None };
        Some(self.one(index, delta, None, &[]))
    }

    fn delta(&self, index: u32, text: &str, lp: &[Entry]) -> Option<String> {
        let delta = match self.with_parser(index, |p| {
            let before = p.calls();
            delta_of(p.push(text), before)
        }) {
            Some(d) if d.content.is_none() && d.tool_calls.is_none() => return None,
            Some(d) => d,
            None => Delta { content: Some(text.to_owned()), ..Delta::default() },
        };
        Some(self.one(index, delta, None, lp))
    }

    fn finish(&self, index: u32, reason: FinishReason) -> String {
        let (delta, reason) = self
            .with_parser(index, |p| {
                let before = p.calls();
                let delta = delta_of(p.finish(), before);
                let reason = if p.calls() > 0 && reason == FinishReason::Stop {
                    FinishReason::ToolCalls
                } else {
                    reason
                };
                (delta, reason)
            })
            .unwrap_or((Delta::default(), reason));
        self.one(index, delta, Some(reason), &[])
    }

    fn usage(&self, usage: &Usage) -> String {
        self.chunk(Vec::new(), Some(usage.clone()))
    }
}
