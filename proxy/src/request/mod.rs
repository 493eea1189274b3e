//! The parsed request, at the bottom of the proxy: every stage that reads a request reads these
//! views, and this module imports nothing of the proxy.
//!
//! The LLM routes and their bodies. A body is read into a view that borrows from it: the top
//! level field by field (each value's extent found by [`scan`] without parsing it), `model` and
//! the few fields routing reads typed, every other field kept as its raw text, in order; the
//! body goes to the backend unchanged. The messages and tools are read only for a pool whose
//! stages read the prompt (canonicalization, prefix hashing, safety checks), and a stage that
//! rewrites a part parses just that part. Nothing is copied into owned JSON trees on the way:
//! for a 60 KB agent request with 120 tool schemas that costs more than the rest of the proxy
//! put together.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use warmpath_wire::openai::ApiError;

pub mod head;
pub mod json;
pub mod scan;

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

/// A JSON value's text as the client sent it, borrowed from the body. Its extent is known (its
/// brackets and strings match); what it holds is parsed by the stage that reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raw<'a>(&'a str);

impl<'a> Raw<'a> {
    pub fn get(self) -> &'a str {
        self.0
    }
}

/// A request body, typed where routing reads it.
///
/// [`LlmRequest::parse`] reads the top level (each field's extent, `model` and the few fields
/// warmpath types) and the views of the prompt (each message, each tool); [`LlmRequest::scan`]
/// only the top level, for a pool that reads nothing of the prompt, and
/// [`LlmRequest::read_views`] the rest later, if a stage needs it.
#[derive(Debug)]
pub struct LlmRequest<'a> {
    pub route: LlmRoute,
    pub model: BodyStr<'a>,
    /// Chat only: `messages` as sent.
    messages_raw: Option<Raw<'a>>,
    /// Chat only: each message as read, and its text (after [`LlmRequest::read_views`]).
    messages: Vec<MessageView<'a>>,
    raw_messages: Vec<Raw<'a>>,
    /// `prompt` (completions) or `input` (responses, embeddings).
    pub content: Option<Raw<'a>>,
    /// Responses only: `instructions`.
    pub instructions: Option<Raw<'a>>,
    /// Chat and Responses: `tools` as sent, with the index in `extra` the field had, and (after
    /// [`LlmRequest::read_views`]) each definition's text.
    tools_raw: Option<(usize, Raw<'a>)>,
    tools: Vec<Raw<'a>>,
    /// Every other top-level field, in order, as raw JSON.
    pub extra: Vec<(BodyStr<'a>, Raw<'a>)>,
    /// The caller's tenant salt (API keys kept apart in the prefix cache): joined in front of
    /// the request's own `cache_salt` wherever prefix blocks are hashed, and put into the body
    /// that goes to the backend.
    pub tenant_salt: Option<std::sync::Arc<str>>,
    /// Ask the backend for this stream's usage, which the client did not (the caller's tokens
    /// are limited: the usage settles them).
    pub ask_usage: bool,
    views_read: bool,
}

fn invalid(what: &str, e: impl fmt::Display) -> ApiError {
    ApiError::invalid_request(format!("{what}: {e}"))
}

impl<'a> LlmRequest<'a> {
    /// The whole request as the stages read it: top level and views (400 on what is not valid).
    pub fn parse(route: LlmRoute, body: &'a [u8]) -> Result<LlmRequest<'a>, ApiError> {
        let mut r = LlmRequest::scan(route, body)?;
        r.read_views()?;
        Ok(r)
    }

    /// The top level only: each field's extent, and the fields typed here. Each byte of the
    /// body is looked at once; the messages and tools are not read.
    pub fn scan(route: LlmRoute, body: &'a [u8]) -> Result<LlmRequest<'a>, ApiError> {
        let text = std::str::from_utf8(body).map_err(|e| invalid("invalid JSON", e))?;
        let fields = scan::object_fields(text).map_err(|e| {
            let what = if e.what.starts_with("expected a JSON") { "invalid request" } else { "invalid JSON" };
            invalid(what, e.describe(body))
        })?;
        let content_field = route.content_field();
        let mut r = LlmRequest {
            route,
            model: BodyStr(Cow::Borrowed("")),
            messages_raw: None,
            messages: Vec::new(),
            raw_messages: Vec::new(),
            content: None,
            instructions: None,
            tools_raw: None,
            tools: Vec::new(),
            extra: Vec::with_capacity(fields.len()),
            tenant_salt: None,
            ask_usage: false,
            views_read: false,
        };
        let mut model = None;
        let dup = |name: &str| invalid("invalid request", format!("duplicate field `{name}`"));
        for (k, v) in fields {
            let v = Raw(v);
            let slot = match k.as_ref() {
                "model" => {
                    let m = serde_json::from_str::<BodyStr<'a>>(v.0)
                        .map_err(|e| invalid("invalid request", format!("model: {e}")))?;
                    if model.replace(m).is_some() {
                        return Err(dup("model"));
                    }
                    continue;
                }
                "messages" if route == LlmRoute::Chat => {
                    if !v.0.starts_with('[') {
                        return Err(invalid("invalid request", "messages: expected a list of messages"));
                    }
                    &mut r.messages_raw
                }
                f if f == content_field && route != LlmRoute::Chat => &mut r.content,
                "instructions" if route == LlmRoute::Responses => &mut r.instructions,
                "tools" if matches!(route, LlmRoute::Chat | LlmRoute::Responses) => {
                    if r.tools_raw.replace((r.extra.len(), v)).is_some() {
                        return Err(dup("tools"));
                    }
                    continue;
                }
                _ => {
                    if r.extra.iter().any(|(e, _)| e.0 == k) {
                        return Err(dup(&k));
                    }
                    r.extra.push((BodyStr(k), v));
                    continue;
                }
            };
            if slot.replace(v).is_some() {
                return Err(dup(&k));
            }
        }
        r.model = model.ok_or_else(|| invalid("invalid request", "missing field `model`"))?;
        if route == LlmRoute::Chat && r.messages_raw.is_none() {
            return Err(invalid("invalid request", "missing field `messages`"));
        }
        if matches!(route, LlmRoute::Completions | LlmRoute::Embeddings) && r.content.is_none() {
            return Err(invalid("invalid request", format!("missing field `{content_field}`")));
        }
        Ok(r)
    }

    /// Reads each message (strictly: 400 on a message that is not one) and splits the tool
    /// list, for the stages that read the prompt. Reading twice is a no-op.
    pub fn read_views(&mut self) -> Result<(), ApiError> {
        if self.views_read {
            return Ok(());
        }
        if let Some(raw) = self.messages_raw {
            let list = scan::array_elements(raw.0)
                .map_err(|e| invalid("invalid JSON", format!("messages: {}", e.describe(raw.0.as_bytes()))))?
                .unwrap_or_default();
            self.messages = list
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    MessageView::deserialize(&mut serde_json::Deserializer::from_str(m))
                        .map_err(|e| invalid("invalid request", format!("messages[{i}]: {e}")))
                })
                .collect::<Result<_, _>>()?;
            self.raw_messages = list.into_iter().map(Raw).collect();
        }
        if let Some((_, raw)) = self.tools_raw {
            self.tools = match scan::array_elements(raw.0) {
                Ok(Some(list)) => list.into_iter().map(Raw).collect(),
                Ok(None) => return Err(invalid("invalid request", "tools: expected a list of tools")),
                Err(e) => {
                    return Err(invalid("invalid JSON", format!("tools: {}", e.describe(raw.0.as_bytes()))))
                }
            };
        }
        self.views_read = true;
        Ok(())
    }

    pub fn model(&self) -> &str {
        &self.model.0
    }

    /// Chat: each message as read.
    pub fn messages(&self) -> &[MessageView<'a>] {
        debug_assert!(self.views_read, "messages read before read_views");
        &self.messages
    }

    /// Chat: each message's text as sent.
    pub fn raw_messages(&self) -> &[Raw<'a>] {
        debug_assert!(self.views_read, "messages read before read_views");
        &self.raw_messages
    }

    /// `tools`: each definition's text, if the field was sent.
    pub fn tools(&self) -> Option<&[Raw<'a>]> {
        debug_assert!(self.views_read, "tools read before read_views");
        self.tools_raw.map(|_| self.tools.as_slice())
    }

    /// The index in `extra` the `tools` field had.
    pub fn tools_at(&self) -> Option<usize> {
        self.tools_raw.map(|(at, _)| at)
    }

    /// A top-level field not typed here, as raw JSON.
    pub fn extra_raw(&self, name: &str) -> Option<Raw<'a>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_view_types_what_routing_reads_and_keeps_the_rest_raw() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be \"brief\""},{"role":"assistant","content":null,"tool_calls":[]}],"tools":[{"type":"function"}],"user":"u1","temperature":0.50}"#;
        let r = LlmRequest::parse(LlmRoute::Chat, body).expect("parses");
        assert_eq!(r.model(), "m");
        assert_eq!(r.messages().len(), 2);
        assert_eq!(r.messages()[0].role.0, "system");
        assert!(r.messages()[1].content.is_none());
        let keys: Vec<&str> = r.extra.iter().map(|(k, _)| k.0.as_ref()).collect();
        assert_eq!(keys, ["user", "temperature"]);
        assert_eq!((r.tools_at(), r.tools().map(<[_]>::len)), (Some(0), Some(1)), "tools kept in place");
        assert_eq!(r.extra[1].1.get(), "0.50", "raw slices keep the client's spelling");
        assert_eq!(r.extra_str("user").as_deref(), Some("u1"));
        assert!(matches!(r.model.0, Cow::Borrowed(_)), "no copy of unescaped strings");
    }

    #[test]
    fn a_scan_reads_the_top_level_and_leaves_the_prompt_to_whoever_reads_it() {
        let body = br#"{"messages":[{"content":"no role"}],"tools":[{"x":1},2],"model":"m","stream":true}"#;
        let mut r = LlmRequest::scan(LlmRoute::Chat, body).expect("the top level is fine");
        assert_eq!((r.model(), r.streams(), r.tools_at()), ("m", true, Some(0)));
        let e = r.read_views().expect_err("the message is not one");
        assert!(e.message().contains("messages[0]") && e.message().contains("role"), "{}", e.message());
        let e = LlmRequest::parse(LlmRoute::Chat, br#"{"model":"m","messages":[],"tools":{}}"#)
            .expect_err("not a list");
        assert!(e.message().contains("tools"), "{}", e.message());
        let bad_utf8 = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}";
        assert!(LlmRequest::scan(LlmRoute::Chat, bad_utf8)
            .expect_err("not UTF-8")
            .message()
            .starts_with("invalid JSON"));
        let e = LlmRequest::scan(LlmRoute::Chat, br#"[{"model":"m"}]"#).expect_err("not an object");
        assert!(e.message().starts_with("invalid request"), "{}", e.message());
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
        assert_eq!(ok.content.map(Raw::get), Some("\"hi\""));
    }
}
