//! The LLM routes and their bodies, parsed once into typed structs that keep unknown fields.
//! The parsed form drives routing; the bytes sent upstream are the client's own unless a later
//! stage rewrites them.

use serde_json::{Map, Value};
use warmpath_wire::openai::{
    parse_body, ApiError, ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ResponsesRequest,
};

use crate::route::{key, Pool, RouteKey};

/// A route that goes to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlmRoute {
    Chat,
    Completions,
    Responses,
    Embeddings,
}

impl LlmRoute {
    pub fn from_path(path: &str) -> Option<LlmRoute> {
        Some(match path {
            "/v1/chat/completions" => LlmRoute::Chat,
            "/v1/completions" => LlmRoute::Completions,
            "/v1/responses" => LlmRoute::Responses,
            "/v1/embeddings" => LlmRoute::Embeddings,
            _ => return None,
        })
    }

    /// The `route` metric label.
    pub fn label(self) -> &'static str {
        match self {
            LlmRoute::Chat => "chat_completions",
            LlmRoute::Completions => "completions",
            LlmRoute::Responses => "responses",
            LlmRoute::Embeddings => "embeddings",
        }
    }

    /// Streams end with `data: [DONE]` on this route.
    pub fn ends_with_done(self) -> bool {
        matches!(self, LlmRoute::Chat | LlmRoute::Completions)
    }
}

/// A parsed body.
#[derive(Debug)]
pub enum LlmRequest {
    Chat(ChatCompletionRequest),
    Completion(CompletionRequest),
    Responses(ResponsesRequest),
    Embeddings(EmbeddingRequest),
}

impl LlmRequest {
    pub fn parse(route: LlmRoute, body: &[u8]) -> Result<LlmRequest, ApiError> {
        Ok(match route {
            LlmRoute::Chat => LlmRequest::Chat(parse_body(body)?),
            LlmRoute::Completions => LlmRequest::Completion(parse_body(body)?),
            LlmRoute::Responses => LlmRequest::Responses(parse_body(body)?),
            LlmRoute::Embeddings => LlmRequest::Embeddings(parse_body(body)?),
        })
    }

    pub fn model(&self) -> &str {
        match self {
            LlmRequest::Chat(r) => &r.model,
            LlmRequest::Completion(r) => &r.model,
            LlmRequest::Responses(r) => &r.model,
            LlmRequest::Embeddings(r) => &r.model,
        }
    }

    /// Unknown fields (`user`, `prompt_cache_key`, vendor extensions).
    pub fn extra(&self) -> &Map<String, Value> {
        match self {
            LlmRequest::Chat(r) => &r.extra,
            LlmRequest::Completion(r) => &r.extra,
            LlmRequest::Responses(r) => &r.extra,
            LlmRequest::Embeddings(r) => &r.extra,
        }
    }

    /// The routing key the pool's policy asks for; nothing is hashed that it does not read.
    pub fn route_key(&self, pool: &Pool, session_header: Option<&str>) -> RouteKey {
        let limit = pool.prefix_bytes;
        let prefix = pool.policy.wants_prefix().then(|| match self {
            LlmRequest::Chat(r) => key::chat_prefix(r, limit),
            LlmRequest::Completion(r) => key::completion_prefix(r, limit),
            LlmRequest::Responses(r) => {
                key::json_prefix(&r.model, r.instructions.as_deref(), r.input.as_ref(), limit)
            }
            LlmRequest::Embeddings(r) => key::json_prefix(&r.model, None, Some(&r.input), limit),
        });
        let session =
            pool.policy.wants_session().then(|| key::session_key(session_header, self.extra())).flatten();
        RouteKey { prefix, session }
    }
}
