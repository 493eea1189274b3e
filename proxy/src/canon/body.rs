//! The canonical body as it is written: top-level fields in the order sent, each message or item
//! minified or rewritten, tools in canonical form.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::request::{json, LlmRequest};
use crate::tools::def::CanonTool;

/// A message object with its `content` replaced by `text`; its other fields kept.
pub(super) fn with_content(raw: &str, text: &str) -> String {
    match serde_json::from_str::<Map<String, Value>>(raw) {
        Ok(mut m) => {
            m.insert("content".to_owned(), Value::String(text.to_owned()));
            Value::Object(m).to_string()
        }
        Err(_) => json::minify(raw).into_owned(),
    }
}

/// A string `input` as the one user message item it stands for.
pub(super) fn user_item(content: &str) -> String {
    format!("{{\"role\":\"user\",\"content\":{}}}", json::minify(content))
}

pub(super) fn note_message(role: &str, text: &str) -> String {
    format!("{{\"role\":\"{role}\",\"content\":{}}}", json::string(text))
}

/// A body being written: `{"model":..., ...}`.
pub(super) struct Body {
    pub out: String,
}

impl Body {
    pub fn new(model: &str) -> Body {
        let mut out = String::with_capacity(4096);
        out.push_str("{\"model\":");
        out.push_str(&json::string(model));
        Body { out }
    }

    pub fn key(&mut self, k: &str) {
        self.out.push(',');
        self.out.push_str(&json::string(k));
        self.out.push(':');
    }

    /// Every other top-level field in the order sent, `tools` canonical.
    pub fn extras(&mut self, req: &LlmRequest<'_>, tools: Option<&[Arc<CanonTool>]>) {
        let at = req.tools_at();
        for i in 0..=req.extra.len() {
            if let (Some(tools), true) = (tools, at == Some(i)) {
                self.key("tools");
                self.out.push('[');
                for (i, t) in tools.iter().enumerate() {
                    if i > 0 {
                        self.out.push(',');
                    }
                    self.out.push_str(&t.json);
                }
                self.out.push(']');
            }
            if let Some((k, v)) = req.extra.get(i) {
                self.key(&k.0);
                self.out.push_str(&json::minify(v.get()));
            }
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.out.push('}');
        self.out.into_bytes()
    }
}
