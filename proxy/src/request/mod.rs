//! The parsed request, at the bottom of the proxy: every stage that reads a request reads these
//! views, and this module imports nothing of the proxy.
//!
//! The LLM routes and their bodies. A body is parsed once into a typed view that borrows from
//! it: what routing reads is typed (`model`, the messages' roles, the content to hash), every
//! other top-level field is kept as its raw JSON slice, in order, and everything below that stays
//! in the body bytes, which go to the backend unchanged. Nothing is copied into owned JSON trees
//! on the way — for a 60 KB agent request with 120 tool schemas that costs more than the rest of
//! the proxy put together — and a later stage that rewrites a part parses just that part.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use warmpath_wire::openai::ApiError;

pub mod head;
pub mod json;

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

    /// The field that carries what the model reads.
    fn content_field(self) -> &'static str {
        match self {
            LlmRoute::Chat => "messages",
            LlmRoute::Completions => "prompt",
            LlmRoute::Responses | LlmRoute::Embeddings => "input",
        }
    }
}

/// A string that borrows from the body unless it had escapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyStr<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for BodyStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = BodyStr<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(BodyStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(BodyStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(BodyStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// One chat message as the proxy reads it; its other fields stay in the body.
#[derive(Debug, Deserialize)]
pub struct MessageView<'a> {
    #[serde(borrow)]
    pub role: BodyStr<'a>,
    #[serde(borrow, default)]
    pub content: Option<ContentView<'a>>,
    /// Assistant turns: the calls, read leniently where they are rendered.
    #[serde(borrow, default)]
    pub tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub tool_call_id: Option<BodyStr<'a>>,
}

/// Message content, decoded in the same pass as the message: a string, a list of parts, or
/// something else (kept in the body, not rendered).
#[derive(Debug)]
pub enum ContentView<'a> {
    Text(BodyStr<'a>),
    Parts(Vec<PartView<'a>>),
    Other,
}

/// A content part: its type and, for text parts, the text.
#[derive(Debug, Deserialize)]
pub struct PartView<'a> {
    #[serde(borrow, rename = "type", default)]
    pub kind: Option<BodyStr<'a>>,
    #[serde(borrow, default)]
    pub text: Option<BodyStr<'a>>,
}

impl<'a> ContentView<'a> {
    /// The text as the template renders it: a string, or the text parts joined without a
    /// separator. `None` for a list with parts that are not text (so a prompt with an image
    /// is never rewritten) and for other values.
    pub fn text(&self) -> Option<Cow<'a, str>> {
        match self {
            ContentView::Text(s) => Some(s.0.clone()),
            ContentView::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_ref().map(|k| k.0.as_ref()), &p.text) {
                        (Some("text" | "input_text" | "output_text") | None, Some(t)) => out.push_str(&t.0),
                        _ => return None,
                    }
                }
                Some(Cow::Owned(out))
            }
            ContentView::Other => None,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for ContentView<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ContentView<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ContentView::Text(BodyStr(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ContentView::Text(BodyStr(Cow::Owned(v.to_owned()))))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(ContentView::Text(BodyStr(Cow::Owned(v))))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<PartView<'a>>()? {
                    parts.push(p);
                }
                Ok(ContentView::Parts(parts))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
                Ok(ContentView::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(ContentView::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(ContentView::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(ContentView::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(ContentView::Other)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A request body, typed where routing reads it.
#[derive(Debug)]
pub struct LlmRequest<'a> {
    pub route: LlmRoute,
    pub model: BodyStr<'a>,
    /// Chat only: the messages, and each one's raw JSON.
    pub messages: Vec<MessageView<'a>>,
    pub raw_messages: Vec<&'a RawValue>,
    /// `prompt` (completions) or `input` (responses, embeddings).
    pub content: Option<&'a RawValue>,
    /// Responses only: `instructions`.
    pub instructions: Option<&'a RawValue>,
    /// Chat and Responses: `tools`, each definition's raw JSON, with the index in `extra` the
    /// field had (read once here: a 50 KB tool list must not be scanned twice).
    pub tools: Option<(usize, Vec<&'a RawValue>)>,
    /// Every other top-level field, in order, as raw JSON.
    pub extra: Vec<(BodyStr<'a>, &'a RawValue)>,
    /// The caller's tenant salt (API keys kept apart in the prefix cache): joined in front of
    /// the request's own `cache_salt` wherever prefix blocks are hashed, and put into the body
    /// that goes to the backend.
    pub tenant_salt: Option<std::sync::Arc<str>>,
    /// Ask the backend for this stream's usage, which the client did not (the caller's tokens
    /// are limited: the usage settles them).
    pub ask_usage: bool,
}

impl<'a> LlmRequest<'a> {
    pub fn parse(route: LlmRoute, body: &'a [u8]) -> Result<LlmRequest<'a>, ApiError> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let req =
            RequestSeed(route).deserialize(&mut de).and_then(|r| de.end().map(|()| r)).map_err(|e| {
                let what = if e.is_syntax() || e.is_eof() { "invalid JSON" } else { "invalid request" };
                ApiError::invalid_request(format!("{what}: {e}"))
            })?;
        Ok(req)
    }

    pub fn model(&self) -> &str {
        &self.model.0
    }

    /// A top-level field not typed here, as raw JSON.
    pub fn extra_raw(&self, name: &str) -> Option<&'a RawValue> {
        self.extra.iter().find(|(k, _)| k.0 == name).map(|(_, v)| *v)
    }

    /// A top-level string field not typed here (`user`, `prompt_cache_key`), if it is a string.
    pub fn extra_str(&self, name: &str) -> Option<Cow<'a, str>> {
        serde_json::from_str::<BodyStr<'a>>(self.extra_raw(name)?.get()).ok().map(|s| s.0)
    }

    /// `stream: true`.
    pub fn streams(&self) -> bool {
        self.extra_raw("stream").is_some_and(|v| v.get().trim() == "true")
    }

    /// The most it may write: `max_tokens`, `max_completion_tokens` or `max_output_tokens`,
    /// whichever it sent (0 when none).
    pub fn max_output(&self) -> u64 {
        ["max_tokens", "max_completion_tokens", "max_output_tokens"]
            .iter()
            .find_map(|k| self.extra_raw(k).and_then(|v| v.get().trim().parse::<u64>().ok()))
            .unwrap_or(0)
    }
}

struct RequestSeed(LlmRoute);

impl<'de> de::DeserializeSeed<'de> for RequestSeed {
    type Value = LlmRequest<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RequestSeed {
    type Value = LlmRequest<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let route = self.0;
        let content_field = route.content_field();
        let mut model: Option<BodyStr<'de>> = None;
        let mut messages: Option<Vec<&'de RawValue>> = None;
        let mut content: Option<&'de RawValue> = None;
        let mut instructions: Option<&'de RawValue> = None;
        let mut tools: Option<(usize, Vec<&'de RawValue>)> = None;
        let mut extra = Vec::new();
        while let Some(k) = map.next_key::<BodyStr<'de>>()? {
            let dup = |name: &'static str| de::Error::duplicate_field(name);
            match k.0.as_ref() {
                "model" => {
                    if model.replace(map.next_value()?).is_some() {
                        return Err(dup("model"));
                    }
                }
                "messages" if route == LlmRoute::Chat => {
                    if messages.replace(map.next_value()?).is_some() {
                        return Err(dup("messages"));
                    }
                }
                f if f == content_field && route != LlmRoute::Chat => {
                    if content.replace(map.next_value()?).is_some() {
                        return Err(dup(content_field));
                    }
                }
                "tools" if matches!(route, LlmRoute::Chat | LlmRoute::Responses) => {
                    if tools.replace((extra.len(), map.next_value()?)).is_some() {
                        return Err(dup("tools"));
                    }
                }
                "instructions" if route == LlmRoute::Responses => {
                    if instructions.replace(map.next_value()?).is_some() {
                        return Err(dup("instructions"));
                    }
                }
                _ => {
                    let v: &'de RawValue = map.next_value()?;
                    if extra.iter().any(|(e, _): &(BodyStr<'de>, &RawValue)| e.0 == k.0) {
                        return Err(de::Error::custom(format!("duplicate field `{}`", k.0)));
                    }
                    extra.push((k, v));
                }
            }
        }
        let model = model.ok_or_else(|| de::Error::missing_field("model"))?;
        let raw_messages = match route {
            LlmRoute::Chat => messages.ok_or_else(|| de::Error::missing_field("messages"))?,
            _ => Vec::new(),
        };
        let messages = raw_messages
            .iter()
            .enumerate()
            .map(|(i, raw)| {
                MessageView::deserialize(&mut serde_json::Deserializer::from_str(raw.get()))
                    .map_err(|e| de::Error::custom(format!("messages[{i}]: {e}")))
            })
            .collect::<Result<Vec<_>, A::Error>>()?;
        if matches!(route, LlmRoute::Completions | LlmRoute::Embeddings) && content.is_none() {
            return Err(de::Error::missing_field(content_field));
        }
        Ok(LlmRequest {
            route,
            model,
            messages,
            raw_messages,
            content,
            instructions,
            tools,
            extra,
            tenant_salt: None,
            ask_usage: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_view_types_what_routing_reads_and_keeps_the_rest_raw() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be \"brief\""},{"role":"assistant","content":null,"tool_calls":[]}],"tools":[{"type":"function"}],"user":"u1","temperature":0.50}"#;
        let r = LlmRequest::parse(LlmRoute::Chat, body).expect("parses");
        assert_eq!(r.model(), "m");
        assert_eq!(r.messages.len(), 2);
        assert_eq!(r.messages[0].role.0, "system");
        assert!(r.messages[1].content.is_none());
        let keys: Vec<&str> = r.extra.iter().map(|(k, _)| k.0.as_ref()).collect();
        assert_eq!(keys, ["user", "temperature"]);
        assert_eq!(r.tools.as_ref().map(|(at, t)| (*at, t.len())), Some((0, 1)), "tools read once, in place");
        assert_eq!(r.extra[1].1.get(), "0.50", "raw slices keep the client's spelling");
        assert_eq!(r.extra_str("user").as_deref(), Some("u1"));
        assert!(matches!(r.model.0, Cow::Borrowed(_)), "no copy of unescaped strings");
    }

    #[test]
    fn bad_bodies_are_400s() {
        let bad = |route, body: &[u8]| LlmRequest::parse(route, body).expect_err("rejected");
        assert!(bad(LlmRoute::Chat, b"{not json").message().starts_with("invalid JSON"));
        assert!(bad(LlmRoute::Chat, br#"{"model":"m"}"#).message().contains("missing field `messages`"));
        assert!(bad(LlmRoute::Chat, br#"{"messages":[]}"#).message().contains("missing field `model`"));
        assert!(bad(LlmRoute::Chat, br#"{"model":"m","messages":"x"}"#)
            .message()
            .starts_with("invalid request"));
        assert!(bad(LlmRoute::Chat, br#"{"model":"m","messages":[{"content":"x"}]}"#)
            .message()
            .contains("role"));
        assert!(bad(LlmRoute::Chat, br#"{"model":"m","model":"n","messages":[]}"#)
            .message()
            .contains("duplicate"));
        assert!(bad(LlmRoute::Chat, br#"{"model":"m","messages":[],"user":"a","user":"b"}"#)
            .message()
            .contains("duplicate"));
        assert!(bad(LlmRoute::Chat, br#"{"model":"m","messages":[]} trailing"#)
            .message()
            .starts_with("invalid JSON"));
        assert!(bad(LlmRoute::Completions, br#"{"model":"m"}"#).message().contains("prompt"));
        assert!(bad(LlmRoute::Embeddings, br#"{"model":"m"}"#).message().contains("input"));
        let ok = LlmRequest::parse(LlmRoute::Responses, br#"{"model":"m","input":"hi","instructions":"x"}"#)
            .expect("ok");
        assert_eq!(ok.content.map(RawValue::get), Some("\"hi\""));
    }
}
