//! How a request refused by its input checks is answered: an error in the OpenAI shape (400
//! `content_policy_violation`), or — with `input.refusal = "message"` — a normal answer in the
//! route's own shape (streamed when the request streams) whose text is the policy's refusal
//! and whose finish reason is `content_filter`.

use bytes::Bytes;
use serde_json::{json, Value};
use warmpath_wire::openai::ApiError;

use super::downstream::Downstream;
use super::respond;
use crate::config::Refusal;
use crate::request::{LlmRequest, LlmRoute};
use crate::safety::{Decision, Safety};

/// What the refusal of `req` looks like, decided before the request is dropped.
pub(super) struct Refused {
    route: LlmRoute,
    stream: bool,
    model: String,
}

impl Refused {
    pub fn of(req: &LlmRequest<'_>) -> Refused {
        let stream = req.streams();
        Refused { route: req.route, stream, model: req.model().to_owned() }
    }

    /// Answers `down` for `decision` (a block) under `safety`'s policy.
    pub async fn answer(
        &self,
        down: &mut dyn Downstream,
        safety: &Safety,
        decision: &Decision,
    ) -> pingora::Result<u16> {
        let header = ("x-warmpath-safety", format!("{}; input=block", safety.names));
        let Decision::Block { check, category } = decision else { return Ok(200) };
        let message = matches!(self.route, LlmRoute::Chat | LlmRoute::Completions);
        if safety.input.refusal == Refusal::Message && message {
            let text = safety.input.refusal_message.as_str();
            let (content_type, body) = self.message(text);
            respond::send(down, 200, content_type, body, &[header]).await?;
            return Ok(200);
        }
        let e = ApiError::invalid_request(format!(
            "the request was refused by this deployment's content policy ({check}: {category})"
        ))
        .with_code("content_policy_violation");
        respond::send_error(down, &e, &[header]).await?;
        Ok(e.status)
    }

    /// The refusal as an answer of the route: its content type and body.
    fn message(&self, text: &str) -> (&'static str, Bytes) {
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let completion = self.route == LlmRoute::Completions;
        let (id, object) = if completion {
            ("cmpl-warmpath-refusal", "text_completion")
        } else {
            ("chatcmpl-warmpath-refusal", "chat.completion")
        };
        let usage = json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
        let choice = |delta: bool, t: &str, finish: Value| {
            if completion {
                json!({"index": 0, "text": t, "logprobs": null, "finish_reason": finish})
            } else if delta {
                json!({"index": 0, "delta": {"role": "assistant", "content": t}, "logprobs": null, "finish_reason": finish})
            } else {
                json!({"index": 0, "message": {"role": "assistant", "content": t}, "logprobs": null, "finish_reason": finish})
            }
        };
        if !self.stream {
            let body = json!({"id": id, "object": object, "created": created, "model": self.model,
                              "choices": [choice(false, text, json!("content_filter"))], "usage": usage});
            return ("application/json", Bytes::from(body.to_string()));
        }
        let object = if completion { object } else { "chat.completion.chunk" };
        let chunk = |c: Value| json!({"id": id, "object": object, "created": created, "model": self.model, "choices": [c]});
        let body = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            chunk(choice(true, text, Value::Null)),
            chunk(choice(true, "", json!("content_filter")))
        );
        ("text/event-stream", Bytes::from(body))
    }
}
