//! `POST /v1/completions`: prompts as text or token ids, one or several.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use warmpath_wire::openai::{
    parse_body, ApiError, Completion, CompletionChoice, CompletionRequest, FinishReason, Prompt, Usage,
};

use super::generate::{self, ChunkFormat, ResponseMeta, SamplingFields};
use super::logprobs::{self, Entry};
use super::{check_model, handoff, read_body, AppState, ErrorReply};
use crate::kv_transfer::KvRole;

pub async fn handle(State(state): State<Arc<AppState>>, body: Body) -> Response {
    match run(state, body).await {
        Ok(r) => r,
        Err(e) => ErrorReply(e).into_response(),
    }
}

/// Validates a request and tokenizes its prompts.
pub fn prompts_of(state: &AppState, req: &CompletionRequest) -> Result<Vec<Vec<u32>>, ApiError> {
    check_model(state, &req.model)?;
    let f = &state.format;
    let prompts = match &req.prompt {
        Prompt::Text(s) => vec![f.prompt_ids(s)],
        Prompt::Texts(v) => v.iter().map(|s| f.prompt_ids(s)).collect(),
        Prompt::Tokens(ids) => vec![ids.clone()],
        Prompt::TokenLists(v) => v.clone(),
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::invalid_request("prompt must not be empty").with_param("prompt"));
    }
    Ok(prompts)
}

/// The `--script` reply for a text prompt, as forced output tokens ending the completion.
fn scripted(state: &AppState, req: &CompletionRequest) -> Vec<u32> {
    match &req.prompt {
        Prompt::Text(text) => state.scripted(text),
        _ => Vec::new(),
    }
}

async fn run(state: Arc<AppState>, body: Body) -> Result<Response, ApiError> {
    let bytes = read_body(&state, body).await?;
    let req: CompletionRequest = parse_body(&bytes)?;
    let prompts = prompts_of(&state, &req)?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::invalid_request("echo is not supported").with_param("echo"));
    }
    let faults = generate::pre_faults(&state).await?;
    let fields = SamplingFields {
        n: req.n,
        max_tokens: req.max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
        stop: req.stop.clone(),
        extra: &req.extra,
        forced: scripted(&state, &req),
        logprobs: logprobs::completion_request(&req.extra)?,
    };
    let want_logprobs = fields.logprobs.is_some();
    let salt = req.cache_salt.as_deref();
    let stream = req.stream.unwrap_or(false);
    let first = prompts[0].clone();
    let choices = fields.choices(&state, prompts)?;
    let (role, handoff) = handoff::prepare(&state, &req.extra, stream, choices.len(), &first, salt).await?;
    let running = generate::submit(&state, choices, req.cache_salt.clone(), handoff)?;
    let params =
        (role == Some(KvRole::Prefill)).then(|| handoff::answer(&state, running.first_id(), &first, salt));
    let meta = ResponseMeta::new("cmpl", &running, &req.model, req.stream_options.as_ref());
    if stream {
        let offsets = want_logprobs.then(|| Mutex::new(HashMap::new()));
        return Ok(generate::stream(running, CompletionFormat { meta, offsets }, faults));
    }
    let (results, usage) = generate::collect(running).await;
    let resp = Completion {
        id: meta.id,
        object: "text_completion".into(),
        created: meta.created,
        model: meta.model,
        system_fingerprint: None,
        choices: results
            .into_iter()
            .map(|r| CompletionChoice {
                index: r.index,
                logprobs: want_logprobs.then(|| logprobs::completion_json(&r.logprobs, 0)),
                text: r.text,
                finish_reason: Some(r.finish),
            })
            .collect(),
        usage: Some(Some(usage)),
    };
    generate::json_reply(&handoff::with_params(&resp, params)?, &faults)
}

struct CompletionFormat {
    meta: ResponseMeta,
    /// Per choice, the characters of its text sent so far, where log-probabilities are asked
    /// for (their `text_offset`).
    offsets: Option<Mutex<HashMap<u32, usize>>>,
}

impl CompletionFormat {
    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> String {
        let c = Completion {
            id: self.meta.id.clone(),
            object: "text_completion".into(),
            created: self.meta.created,
            model: self.meta.model.clone(),
            system_fingerprint: None,
            choices,
            usage: self.meta.chunk_usage(usage.as_ref()),
        };
        serde_json::to_string(&c).unwrap_or_default()
    }
}

impl ChunkFormat for CompletionFormat {
    fn meta(&self) -> &ResponseMeta {
        &self.meta
    }

    fn opening(&self, _index: u32) -> Option<String> {
        None
    }

    fn delta(&self, index: u32, text: &str, lp: &[Entry]) -> Option<String> {
        let logprobs = self.offsets.as_ref().map(|o| {
            let mut o = o.lock().unwrap_or_else(|e| e.into_inner());
            let at = o.entry(index).or_insert(0);
            let json = logprobs::completion_json(lp, *at);
            *at += text.chars().count();
            json
        });
        Some(self.chunk(
            vec![CompletionChoice { index, text: text.to_owned(), logprobs, finish_reason: None }],
            None,
        ))
    }

    fn finish(&self, index: u32, reason: FinishReason) -> String {
        self.chunk(
            vec![CompletionChoice {
                index,
                text: String::new(),
                logprobs: None,
                finish_reason: Some(reason),
            }],
            None,
        )
    }

    fn usage(&self, usage: &Usage) -> String {
        self.chunk(Vec::new(), Some(usage.clone()))
    }
}
