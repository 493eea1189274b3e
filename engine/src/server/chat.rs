//! `POST /v1/chat/completions`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use warmpath_wire::chat_template::render_tokens;
use warmpath_wire::openai::{
    parse_body, ApiError, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
    ChatCompletionRequest, ChunkChoice, Delta, FinishReason, Role, Usage,
};

use super::generate::{self, ChunkFormat, ResponseMeta, SamplingFields};
use super::{check_model, read_body, AppState, ErrorReply};

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
    Ok(render_tokens(&state.tokenizer, &req.messages, tools, true))
}

async fn run(state: Arc<AppState>, body: Body) -> Result<Response, ApiError> {
    let bytes = read_body(&state, body).await?;
    let req: ChatCompletionRequest = parse_body(&bytes)?;
    let prompt = prompt_of(&state, &req)?;
    let faults = generate::pre_faults(&state).await?;
    let fields = SamplingFields {
        n: req.n,
        max_tokens: req.max_tokens(),
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
        stop: req.stop.clone(),
        extra: &req.extra,
    };
    let choices = fields.choices(&state, vec![prompt])?;
    let running = generate::submit(&state, choices, req.cache_salt.clone())?;
    let meta = ResponseMeta::new("chatcmpl", &running, &req.model, req.stream_options.as_ref());
    if req.stream.unwrap_or(false) {
        return Ok(generate::stream(running, ChatFormat(meta), faults));
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
            .map(|r| ChatChoice {
                index: r.index,
                message: AssistantMessage { role: Role::Assistant, content: Some(r.text), tool_calls: None },
                logprobs: None,
                finish_reason: Some(r.finish),
            })
            .collect(),
        usage,
    };
    generate::json_reply(&resp, &faults)
}

struct ChatFormat(ResponseMeta);

impl ChatFormat {
    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> String {
        let c = ChatCompletionChunk {
            id: self.0.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.0.created,
            model: self.0.model.clone(),
            system_fingerprint: None,
            choices,
            usage: self.0.chunk_usage(usage.as_ref()),
        };
        serde_json::to_string(&c).unwrap_or_default()
    }

    fn one(&self, index: u32, delta: Delta, finish: Option<FinishReason>) -> String {
        self.chunk(vec![ChunkChoice { index, delta, logprobs: None, finish_reason: finish }], None)
    }
}

impl ChunkFormat for ChatFormat {
    fn meta(&self) -> &ResponseMeta {
        &self.0
    }

    fn opening(&self, index: u32) -> Option<String> {
        Some(self.one(index, Delta { role: Some(Role::Assistant), content: Some(String::new()) }, None))
    }

    fn delta(&self, index: u32, text: &str) -> String {
        self.one(index, Delta { role: None, content: Some(text.to_owned()) }, None)
    }

    fn finish(&self, index: u32, reason: FinishReason) -> String {
        self.one(index, Delta::default(), Some(reason))
    }

    fn usage(&self, usage: &Usage) -> String {
        self.chunk(Vec::new(), Some(usage.clone()))
    }
}
