//! Responses input items and tools in the Chat Completions form: messages (function calls
//! joined to the assistant message before them), tools, `tool_choice`, `response_format`.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use warmpath_wire::openai::ApiError;

/// What warmpath reads of a tool; the rest stays in its text.
#[derive(Deserialize)]
pub(super) struct ToolView<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub description: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub parameters: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub strict: Option<&'a RawValue>,
}

/// Items as chat messages (JSON texts), function calls joined to the assistant message before
/// them as [`super::request::ResponsesRequest::to_chat`] does.
pub fn messages_of<'a>(items: impl IntoIterator<Item = &'a Value>) -> Result<Vec<String>, ApiError> {
    let mut messages = Vec::new();
    for item in items {
        push_item(&mut messages, item)?;
    }
    Ok(messages.iter().map(Value::to_string).collect())
}

/// What an input item must look like to be translated.
pub(super) fn check_item(item: &Value) -> Result<(), String> {
    let Some(o) = item.as_object() else { return Err("an input item must be an object".into()) };
    let kind = o.get("type").and_then(Value::as_str);
    match kind {
        None | Some("message") => {
            match o.get("role").and_then(Value::as_str) {
                Some("user" | "assistant" | "system" | "developer") => {}
                Some(r) => return Err(format!("unknown role {r:?}")),
                None => return Err("a message needs a `role`".into()),
            }
            match o.get("content") {
                Some(Value::String(_) | Value::Array(_)) => Ok(()),
                _ => Err("a message's `content` must be a string or an array of parts".into()),
            }
        }
        Some("function_call") => {
            for k in ["call_id", "name", "arguments"] {
                if o.get(k).and_then(Value::as_str).is_none() {
                    return Err(format!("a function_call needs `{k}` (a string)"));
                }
            }
            Ok(())
        }
        Some("function_call_output") => {
            if o.get("call_id").and_then(Value::as_str).is_none() {
                return Err("a function_call_output needs `call_id`".into());
            }
            match o.get("output") {
                Some(Value::String(_) | Value::Array(_)) => Ok(()),
                _ => Err("a function_call_output's `output` must be a string or an array of parts".into()),
            }
        }
        // Reasoning carries nothing a chat backend can take back; it is dropped.
        Some("reasoning") => Ok(()),
        Some("compaction") => match o.get("encrypted_content").and_then(Value::as_str).map(summary_of) {
            Some(Some(_)) => Ok(()),
            _ => Err("a compaction item's `encrypted_content` is not one warmpath made".into()),
        },
        Some(k) => Err(format!("input item type {k:?} is not supported")),
    }
}

/// What a compaction item's `encrypted_content` starts with: warmpath's own, version 1.
const COMPACTION_TAG: &str = "wpc1.";

/// How a summary of compacted items is shown to the model.
pub const COMPACTED_HEADER: &str = "Summary of the earlier conversation:";

/// A compaction item's `encrypted_content` for `summary`. Opaque to clients as OpenAI's is;
/// not encrypted: a self-hosted backend's caller owns the conversation it summarizes.
pub fn compaction_content(summary: &str) -> String {
    use base64::Engine as _;
    format!("{COMPACTION_TAG}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(summary))
}

/// The summary in a compaction item's `encrypted_content`, if warmpath made it.
fn summary_of(content: &str) -> Option<String> {
    use base64::Engine as _;
    let b = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(content.strip_prefix(COMPACTION_TAG)?)
        .ok()?;
    String::from_utf8(b).ok()
}

/// The text of a content value: a string, or the text parts of an array joined.
fn content_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| {
                p.get("text").and_then(Value::as_str).or_else(|| p.get("refusal").and_then(Value::as_str))
            })
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// A message's content for chat: a string where it is only text, else chat content parts.
fn chat_content(v: &Value) -> Value {
    let Value::Array(parts) = v else { return Value::String(content_text(v)) };
    let image = |p: &Value| p.get("type").and_then(Value::as_str) == Some("input_image");
    if !parts.iter().any(image) {
        return Value::String(content_text(v));
    }
    let out = parts
        .iter()
        .filter_map(|p| {
            if image(p) {
                let url = p.get("image_url").and_then(Value::as_str)?;
                let mut img = json!({"url": url});
                if let Some(d) = p.get("detail") {
                    img["detail"] = d.clone();
                }
                Some(json!({"type": "image_url", "image_url": img}))
            } else {
                p.get("text").and_then(Value::as_str).map(|t| json!({"type": "text", "text": t}))
            }
        })
        .collect();
    Value::Array(out)
}

/// One item into chat messages: consecutive function calls join the assistant message before
/// them, as a chat model emits them.
pub(super) fn push_item(messages: &mut Vec<Value>, item: &Value) -> Result<(), ApiError> {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    match kind {
        "message" => {
            let role = match item.get("role").and_then(Value::as_str).unwrap_or("user") {
                // Chat templates know `system`; `developer` is its newer name.
                "developer" => "system",
                r => r,
            };
            let content = chat_content(item.get("content").unwrap_or(&Value::Null));
            messages.push(json!({"role": role, "content": content}));
        }
        "function_call" => {
            let s = |k: &str| item.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
            let call = json!({"id": s("call_id"), "type": "function",
                              "function": {"name": s("name"), "arguments": s("arguments")}});
            match messages.last_mut() {
                Some(m) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
                    let obj = m.as_object_mut().expect("a message is an object");
                    match obj.get_mut("tool_calls") {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => {
                            obj.insert("tool_calls".into(), json!([call]));
                        }
                    }
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let id = item.get("call_id").and_then(Value::as_str).unwrap_or("");
            let text = content_text(item.get("output").unwrap_or(&Value::Null));
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
        }
        "reasoning" => {}
        // What compaction left of older items: the model's own summary of them, where the
        // items stood (after the system turn, so instructions and tools stay the cached prefix).
        "compaction" => {
            let raw = item.get("encrypted_content").and_then(Value::as_str).unwrap_or("");
            let summary = summary_of(raw).ok_or_else(|| {
                ApiError::invalid_param(
                    "a compaction item's `encrypted_content` is not one warmpath made",
                    "input",
                )
            })?;
            messages.push(json!({"role": "assistant", "content": format!("{COMPACTED_HEADER}\n{summary}")}));
        }
        k => return Err(ApiError::invalid_param(format!("input item type {k:?} is not supported"), "input")),
    }
    Ok(())
}

/// Appends the chat form of a Responses function tool (`{"type":"function","name",...}` →
/// `{"type":"function","function":{"name",...}}`), its parts copied as text.
pub(super) fn chat_tool(t: &RawValue, out: &mut String) {
    let Ok(v) = serde_json::from_str::<ToolView<'_>>(t.get()) else { return };
    out.push_str(r#"{"type":"function","function":{"name":"#);
    out.push_str(&json!(v.name.as_deref().unwrap_or("")).to_string());
    for (k, raw) in [("description", v.description), ("parameters", v.parameters), ("strict", v.strict)] {
        if let Some(r) = raw.filter(|r| r.get().trim() != "null") {
            out.push_str(",\"");
            out.push_str(k);
            out.push_str("\":");
            out.push_str(r.get());
        }
    }
    out.push_str("}}");
}

pub(super) fn chat_tool_choice(c: &Value) -> Value {
    match c.get("type").and_then(Value::as_str) {
        Some("function") => {
            json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}})
        }
        _ => c.clone(),
    }
}

/// `text.format` → chat's `response_format`; plain text needs none.
pub(super) fn response_format(f: &Value) -> Option<Value> {
    match f.get("type").and_then(Value::as_str)? {
        "json_object" => Some(json!({"type": "json_object"})),
        "json_schema" => {
            let mut s = Map::new();
            for k in ["name", "schema", "description", "strict"] {
                if let Some(v) = f.get(k).filter(|v| !v.is_null()) {
                    s.insert(k.into(), v.clone());
                }
            }
            Some(json!({"type": "json_schema", "json_schema": s}))
        }
        _ => None,
    }
}
