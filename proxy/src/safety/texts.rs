//! The text that checks read, and where it sits: a request's turns (chat messages, a
//! completion prompt, a Responses request's instructions and input items), the spans of a
//! request body that input redaction rewrites, and the text pieces of an answer — each streamed
//! event's, or a whole answer's — with the place each came from, so that a masked piece can be
//! written back.

use serde_json::Value;

use super::check::Turn;
use crate::request::{ContentView, LlmRequest};

/// The turns of a request's input, in order.
pub fn input_turns(req: &LlmRequest<'_>) -> Vec<Turn> {
    let mut out = Vec::new();
    for m in req.messages() {
        let text = match &m.content {
            Some(ContentView::Text(t)) => t.0.to_string(),
            // Text parts joined as the template joins them; parts that are not text (an image)
            // do not exempt the text beside them.
            Some(ContentView::Parts(parts)) => {
                parts.iter().filter_map(|p| p.text.as_ref()).map(|t| t.0.as_ref()).collect()
            }
            _ => String::new(),
        };
        let mut text = text;
        if let Some(calls) = m.tool_calls {
            text.push_str(calls.get());
        }
        out.push(Turn { role: m.role.0.to_string(), text });
    }
    if let Some(raw) = req.instructions {
        if let Ok(v) = serde_json::from_str::<Value>(raw.get()) {
            let mut texts = Vec::new();
            strings(&v, &mut texts);
            out.push(Turn { role: "system".into(), text: texts.join("\n") });
        }
    }
    if let Some(raw) = req.content {
        if let Ok(v) = serde_json::from_str::<Value>(raw.get()) {
            match v {
                Value::Array(items) => items.iter().for_each(|i| out.push(item_turn(i))),
                v => out.push(item_turn(&v)),
            }
        }
    }
    out
}

/// The turns of Responses items (stored or new).
pub fn item_turns<'v>(items: impl IntoIterator<Item = &'v Value>) -> Vec<Turn> {
    items.into_iter().map(item_turn).collect()
}

/// A prompt string, a Responses input item, or a list of token ids (no text).
fn item_turn(v: &Value) -> Turn {
    let role = match (v.get("role").and_then(Value::as_str), v.get("type").and_then(Value::as_str)) {
        (Some(r), _) => r.to_owned(),
        (None, Some("function_call_output" | "custom_tool_call_output")) => "tool".to_owned(),
        (None, Some("function_call" | "custom_tool_call" | "reasoning")) => "assistant".to_owned(),
        _ => "user".to_owned(),
    };
    let mut texts = Vec::new();
    strings(v, &mut texts);
    if let Some(args) = v.get("arguments").and_then(Value::as_str) {
        texts.push(args);
    }
    Turn { role, text: texts.join("\n") }
}

/// The strings of a prompt or input value: itself, a list's, and an item's `content`, `text`
/// and `output`.
fn strings<'v>(v: &'v Value, out: &mut Vec<&'v str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => {
            for key in ["content", "text", "output"] {
                if let Some(x) = o.get(key) {
                    strings(x, out);
                }
            }
        }
        _ => {}
    }
}

/// The same strings as [`strings`] reads, each replaced by `f`'s answer where it has one; true
/// when any was.
fn rewrite_strings(v: &mut Value, f: &mut dyn FnMut(&str) -> Option<String>) -> bool {
    match v {
        Value::String(s) => match f(s) {
            Some(new) => {
                *s = new;
                true
            }
            None => false,
        },
        Value::Array(a) => a.iter_mut().fold(false, |acc, x| rewrite_strings(x, f) | acc),
        Value::Object(o) => {
            let mut any = false;
            for key in ["content", "text", "output"] {
                if let Some(x) = o.get_mut(key) {
                    any |= rewrite_strings(x, f);
                }
            }
            any
        }
        _ => false,
    }
}

/// `body` with the texts of `req` (parsed from it) rewritten by `f`, where it rewrites any:
/// only the values that change are re-serialized and spliced in — each chat message on its
/// own — so that every byte before the first change stays as the client sent it (the
/// backend's prefix cache still holds it).
pub fn rewrite_body(
    body: &[u8],
    req: &LlmRequest<'_>,
    f: &mut dyn FnMut(&str) -> Option<String>,
) -> Option<Vec<u8>> {
    let base = body.as_ptr() as usize;
    let mut edits: Vec<(usize, usize, String)> = Vec::new();
    let raws = req.raw_messages().iter().copied().chain(req.instructions).chain(req.content);
    for raw in raws {
        let text = raw.get();
        let at = (text.as_ptr() as usize).checked_sub(base)?;
        if at + text.len() > body.len() {
            return None; // not a view of this body
        }
        let Ok(mut v) = serde_json::from_str::<Value>(text) else { continue };
        if rewrite_strings(&mut v, f) {
            edits.push((at, at + text.len(), v.to_string()));
        }
    }
    if edits.is_empty() {
        return None;
    }
    edits.sort_by_key(|e| e.0);
    let mut out = Vec::with_capacity(body.len() + 64);
    let mut from = 0;
    for (start, end, new) in edits {
        out.extend_from_slice(&body[from..start]);
        out.extend_from_slice(new.as_bytes());
        from = end;
    }
    out.extend_from_slice(&body[from..]);
    Some(out)
}

/// Where an answer's text piece sits in its JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Loc {
    /// A chat chunk's `delta.content`, a whole answer's `message.content`.
    Content,
    /// A completion's `text`.
    Text,
    /// The `arguments` of tool call `k` (by position in the list).
    Args(usize),
    /// Responses: the text of output item `choice`'s content part `k` (an `output_text`; an
    /// `output_text.delta` event's `delta`).
    Part(u32),
    /// Responses: the `arguments` of output item `choice`, a `function_call` (a
    /// `function_call_arguments.delta` event's `delta`).
    Arguments,
}

impl Loc {
    /// The answer's text (not a tool call's arguments).
    pub fn is_text(self) -> bool {
        matches!(self, Loc::Content | Loc::Text | Loc::Part(_))
    }
}

/// One piece of an answer's text: its choice, its place, the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub choice: u32,
    pub loc: Loc,
    pub text: String,
}

/// What one answer event (a streamed chunk, or a whole answer) carries.
#[derive(Debug, Default)]
pub struct Carried {
    pub pieces: Vec<Piece>,
    /// Choices it finishes.
    pub finished: Vec<u32>,
}

/// The text pieces of a chat or completion chunk, or of a whole answer (`message` in place of
/// `delta`); of a Responses stream event, or of a whole response object (`output`), where each
/// output item is a choice.
pub fn pieces(v: &Value) -> Carried {
    if let Some(kind) = v.get("type").and_then(Value::as_str) {
        return event_pieces(kind, v);
    }
    let mut out = Carried::default();
    if let Some(items) = v.get("output").and_then(Value::as_array) {
        for (i, item) in items.iter().enumerate() {
            item_pieces(item, &mut |loc, text| {
                if !text.is_empty() {
                    out.pieces.push(Piece { choice: i as u32, loc, text: text.to_owned() });
                }
            });
        }
        return out;
    }
    let Some(choices) = v.get("choices").and_then(Value::as_array) else { return out };
    for (pos, c) in choices.iter().enumerate() {
        let choice = c.get("index").and_then(Value::as_u64).unwrap_or(pos as u64) as u32;
        if c.get("finish_reason").is_some_and(|f| !f.is_null()) {
            out.finished.push(choice);
        }
        let mut add = |loc: Loc, text: Option<&str>| {
            if let Some(t) = text.filter(|t| !t.is_empty()) {
                out.pieces.push(Piece { choice, loc, text: t.to_owned() });
            }
        };
        add(Loc::Text, c.get("text").and_then(Value::as_str));
        let Some(m) = c.get("delta").or_else(|| c.get("message")) else { continue };
        add(Loc::Content, m.get("content").and_then(Value::as_str));
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            for (k, call) in calls.iter().enumerate() {
                add(Loc::Args(k), call.pointer("/function/arguments").and_then(Value::as_str));
            }
        }
    }
    out
}

/// A Responses stream event's output item (`output_index`) and content part (`content_index`).
fn event_place(v: &Value) -> (u32, u32) {
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0) as u32;
    (n("output_index"), n("content_index"))
}

/// A Responses stream event's text: the deltas of output text and of call arguments; an item
/// done, or the response done, finishes.
fn event_pieces(kind: &str, v: &Value) -> Carried {
    let mut out = Carried::default();
    let (item, part) = event_place(v);
    let loc = match kind {
        "response.output_text.delta" => Loc::Part(part),
        "response.function_call_arguments.delta" => Loc::Arguments,
        "response.output_item.done" | "response.completed" | "response.incomplete" | "response.failed" => {
            out.finished.push(item);
            return out;
        }
        _ => return out,
    };
    if let Some(t) = v.get("delta").and_then(Value::as_str).filter(|t| !t.is_empty()) {
        out.pieces.push(Piece { choice: item, loc, text: t.to_owned() });
    }
    out
}

/// The texts of Responses output item `item` (a message's `output_text` parts, a function
/// call's arguments), each with its place.
fn item_pieces(v: &Value, f: &mut dyn FnMut(Loc, &str)) {
    match v.get("type").and_then(Value::as_str) {
        Some("message") => {
            for (k, part) in v.get("content").and_then(Value::as_array).into_iter().flatten().enumerate() {
                if part.get("type").and_then(Value::as_str) == Some("output_text") {
                    f(Loc::Part(k as u32), part.get("text").and_then(Value::as_str).unwrap_or(""));
                }
            }
        }
        Some("function_call") => f(Loc::Arguments, v.get("arguments").and_then(Value::as_str).unwrap_or("")),
        _ => {}
    }
}

/// Where output item `v` holds text.
fn item_locs(v: &Value) -> Vec<Loc> {
    let mut locs = Vec::new();
    item_pieces(v, &mut |loc, _| locs.push(loc));
    locs
}

/// The slot of `loc` in Responses output item `v`.
fn item_slot(v: &mut Value, loc: Loc) -> Option<&mut Value> {
    match loc {
        Loc::Part(k) => v.get_mut("content")?.get_mut(k as usize)?.get_mut("text"),
        Loc::Arguments => v.get_mut("arguments"),
        _ => None,
    }
}

/// Puts `text` back at `loc` of choice `choice` in a chunk or whole answer (a Responses event's
/// `delta`, a response object's output item).
pub fn put(v: &mut Value, choice: u32, loc: Loc, text: String) {
    if v.get("type").is_some_and(Value::is_string) {
        if let Some(slot) = v.get_mut("delta") {
            *slot = Value::String(text);
        }
        return;
    }
    if let Some(items) = v.get_mut("output").and_then(Value::as_array_mut) {
        if let Some(slot) = items.get_mut(choice as usize).and_then(|i| item_slot(i, loc)) {
            *slot = Value::String(text);
        }
        return;
    }
    let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) else { return };
    for (pos, c) in choices.iter_mut().enumerate() {
        if c.get("index").and_then(Value::as_u64).unwrap_or(pos as u64) as u32 != choice {
            continue;
        }
        let key = if c.get("delta").is_some() { "delta" } else { "message" };
        let slot = match loc {
            Loc::Text => c.get_mut("text"),
            Loc::Content => c.get_mut(key).and_then(|m| m.get_mut("content")),
            Loc::Args(k) => c
                .get_mut(key)
                .and_then(|m| m.get_mut("tool_calls"))
                .and_then(|t| t.get_mut(k))
                .and_then(|t| t.pointer_mut("/function/arguments")),
            Loc::Part(_) | Loc::Arguments => None,
        };
        if let Some(slot) = slot {
            *slot = Value::String(text);
        }
        return;
    }
}

/// What the client was shown of output item `item` at `loc`, where that differs from what the
/// backend wrote (masked).
pub type Shown<'a> = &'a dyn Fn(u32, Loc) -> Option<String>;

/// A Responses event that states whole texts again (a part, an item or the response done) with
/// each text `shown` gives in place of the backend's; true when it changed.
pub fn restate(v: &mut Value, shown: Shown<'_>) -> bool {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("").to_owned();
    let (item, part) = event_place(v);
    let set = |slot: Option<&mut Value>, loc: Loc| match (slot, shown(item, loc)) {
        (Some(slot), Some(text)) => {
            *slot = Value::String(text);
            true
        }
        _ => false,
    };
    match kind.as_str() {
        "response.output_text.done" => set(v.get_mut("text"), Loc::Part(part)),
        "response.content_part.done" => set(v.pointer_mut("/part/text"), Loc::Part(part)),
        "response.function_call_arguments.done" => set(v.get_mut("arguments"), Loc::Arguments),
        "response.output_item.done" => v.get_mut("item").is_some_and(|i| restate_item(i, item, shown)),
        "response.completed" | "response.incomplete" | "response.failed" => {
            let items = v.pointer_mut("/response/output").and_then(Value::as_array_mut);
            items
                .into_iter()
                .flatten()
                .enumerate()
                .fold(false, |acc, (i, it)| restate_item(it, i as u32, shown) | acc)
        }
        _ => false,
    }
}

/// Output item `v` (number `item`) with each text `shown` gives; true when it changed.
fn restate_item(v: &mut Value, item: u32, shown: Shown<'_>) -> bool {
    let mut any = false;
    for loc in item_locs(v) {
        if let (Some(text), Some(slot)) = (shown(item, loc), item_slot(v, loc)) {
            *slot = Value::String(text);
            any = true;
        }
    }
    any
}

/// An output item the client saw only in part, as a cut leaves it: what was `shown` of its text
/// (a message gets its first part), status `incomplete`.
pub fn partial_item(mut v: Value, item: u32, shown: Shown<'_>) -> Value {
    if v.get("type").and_then(Value::as_str) == Some("message")
        && v.get("content").and_then(Value::as_array).is_none_or(Vec::is_empty)
    {
        v["content"] = serde_json::json!([{"type": "output_text", "text": "", "annotations": []}]);
    }
    for loc in item_locs(&v) {
        let text = shown(item, loc).unwrap_or_default();
        if let Some(slot) = item_slot(&mut v, loc) {
            *slot = Value::String(text);
        }
    }
    v["status"] = Value::String("incomplete".into());
    v
}

/// The event that ends a Responses stream cut by an output check: `response.incomplete` with
/// reason `content_filter`, the response object as the stream began it (`response`) with the
/// output items the client saw, numbered after the last event released.
pub fn cut_response(response: Option<&Value>, output: Vec<Value>, seq: Option<u64>) -> Value {
    let mut r = response.cloned().unwrap_or_else(|| serde_json::json!({"object": "response"}));
    r["status"] = Value::String("incomplete".into());
    r["incomplete_details"] = serde_json::json!({"reason": "content_filter"});
    r["output"] = Value::Array(output);
    serde_json::json!({"type": "response.incomplete", "sequence_number": seq.map_or(0, |s| s + 1), "response": r})
}

/// A piece of text that starts at `offset` of its window, with the parts of `spans` (window
/// coordinates, in order, not overlapping) that fall in it removed; each span's `[LABEL]` goes
/// in the first piece it touches (`placed` remembers which were).
pub fn mask(text: &str, offset: usize, spans: &[(usize, usize, String)], placed: &mut [bool]) -> String {
    let end = offset + text.len();
    let mut out = String::with_capacity(text.len());
    let mut at = offset;
    for (k, (a, b, label)) in spans.iter().enumerate() {
        if *a >= end || *b <= offset {
            continue;
        }
        let (a, b) = ((*a).max(offset), (*b).min(end));
        out.push_str(text.get(at - offset..a - offset).unwrap_or(""));
        if !placed[k] {
            out.push('[');
            out.push_str(label);
            out.push(']');
            placed[k] = true;
        }
        at = b;
    }
    out.push_str(text.get(at - offset..).unwrap_or(""));
    out
}

/// A whole answer cut by an output check: each choice's text emptied (tool calls dropped) and
/// its finish reason `content_filter`; a response object `incomplete` for `content_filter`,
/// its messages' texts emptied and its calls dropped.
pub fn filter_whole(v: &mut Value) {
    if let Some(items) = v.get_mut("output").and_then(Value::as_array_mut) {
        items.retain(|i| i.get("type").and_then(Value::as_str) != Some("function_call"));
        for item in items.iter_mut() {
            for loc in item_locs(item) {
                if let Some(slot) = item_slot(item, loc) {
                    *slot = Value::String(String::new());
                }
            }
        }
        v["status"] = Value::String("incomplete".into());
        v["incomplete_details"] = serde_json::json!({"reason": "content_filter"});
        return;
    }
    let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) else { return };
    for c in choices {
        if c.get("text").is_some() {
            c["text"] = Value::String(String::new());
        }
        if let Some(m) = c.get_mut("message").and_then(Value::as_object_mut) {
            m.insert("content".into(), Value::String(String::new()));
            m.remove("tool_calls");
        }
        c["finish_reason"] = Value::String("content_filter".into());
    }
}

/// The closing chunk of a stream cut by an output check: the last chunk's `id`, `object`,
/// `created` and `model`, each choice seen finishing with `content_filter`.
pub fn cut_chunk(last: Option<&Value>, choices: &[u32], completion: bool) -> Value {
    let mut out = serde_json::Map::new();
    if let Some(Value::Object(l)) = last {
        for k in ["id", "object", "created", "model"] {
            if let Some(x) = l.get(k) {
                out.insert(k.into(), x.clone());
            }
        }
    }
    let list = if choices.is_empty() { vec![0] } else { choices.to_vec() };
    let choices: Vec<Value> = list
        .into_iter()
        .map(|i| {
            if completion {
                serde_json::json!({"index": i, "text": "", "logprobs": null, "finish_reason": "content_filter"})
            } else {
                serde_json::json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": "content_filter"})
            }
        })
        .collect();
    out.insert("choices".into(), Value::Array(choices));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::LlmRoute;
    use serde_json::json;

    #[test]
    fn turns_of_each_route() {
        let chat = br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"what is this"}]}]}"#;
        let req = LlmRequest::parse(LlmRoute::Chat, chat).expect("parses");
        let t = input_turns(&req);
        assert_eq!(
            t,
            [
                Turn { role: "system".into(), text: "be brief".into() },
                Turn { role: "user".into(), text: "what is this".into() }
            ]
        );
        let resp = br#"{"model":"m","instructions":"sys","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call_output","call_id":"c","output":"42"}]}"#;
        let req = LlmRequest::parse(LlmRoute::Responses, resp).expect("parses");
        let roles: Vec<(String, String)> = input_turns(&req).into_iter().map(|t| (t.role, t.text)).collect();
        assert_eq!(
            roles,
            [("system".into(), "sys".into()), ("user".into(), "hi".into()), ("tool".into(), "42".into())]
        );
        let req =
            LlmRequest::parse(LlmRoute::Completions, br#"{"model":"m","prompt":["a","b"]}"#).expect("parses");
        assert_eq!(input_turns(&req).len(), 2);
    }

    #[test]
    fn rewriting_touches_only_the_changed_values() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"keep \u00e9 as sent"},{"content":"mail bob@corp.io","role":"user"}],"temperature":0}"#;
        let req = LlmRequest::parse(LlmRoute::Chat, body).expect("parses");
        let out = rewrite_body(body, &req, &mut |s: &str| {
            s.contains('@').then(|| s.replace("bob@corp.io", "[EMAIL]"))
        })
        .expect("rewritten");
        let out = String::from_utf8(out).expect("utf8");
        // The first message's bytes are untouched (escape included); the second is re-serialized.
        assert!(
            out.starts_with(r#"{"model":"m","messages":[{"role":"system","content":"keep \u00e9 as sent"},"#),
            "{out}"
        );
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v["messages"][1]["content"], "mail [EMAIL]");
        assert_eq!(v["temperature"], 0);
        assert!(rewrite_body(body, &req, &mut |_: &str| None).is_none());
    }

    #[test]
    fn masks_span_pieces() {
        // "mail bob@x.io now" cut into pieces "mail b", "ob@x", ".io now"; the span 5..13.
        let spans = vec![(5, 13, "EMAIL".to_owned())];
        let mut placed = vec![false];
        let parts =
            [("mail b", 0), ("ob@x", 6), (".io now", 10)].map(|(t, o)| mask(t, o, &spans, &mut placed));
        assert_eq!(parts.concat(), "mail [EMAIL] now");
        assert_eq!(parts, ["mail [EMAIL]", "", " now"]);
        assert_eq!(mask("untouched", 40, &spans, &mut [false]), "untouched");
    }

    #[test]
    fn pieces_of_chunks_and_whole_answers() {
        let chunk = json!({"choices":[{"index":1,"delta":{"content":"Hi","tool_calls":[{"index":0,"function":{"arguments":"{\"a\""}}]},"finish_reason":null}]});
        let c = pieces(&chunk);
        assert_eq!(
            c.pieces.iter().map(|p| (p.choice, p.loc, p.text.as_str())).collect::<Vec<_>>(),
            [(1, Loc::Content, "Hi"), (1, Loc::Args(0), "{\"a\"")]
        );
        let whole = json!({"choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}]});
        let c = pieces(&whole);
        assert_eq!((c.pieces.len(), c.finished.as_slice()), (1, &[0u32][..]));
        let mut v = chunk.clone();
        put(&mut v, 1, Loc::Content, "[X]".into());
        put(&mut v, 1, Loc::Args(0), "{}".into());
        assert_eq!(v["choices"][0]["delta"]["content"], "[X]");
        assert_eq!(v["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"], "{}");
        let mut w = json!({"choices":[{"index":0,"message":{"content":"bad","tool_calls":[]},"finish_reason":"stop"}]});
        filter_whole(&mut w);
        assert_eq!(
            w["choices"][0],
            json!({"index":0,"message":{"content":""},"finish_reason":"content_filter"})
        );
        let cut = cut_chunk(
            Some(&json!({"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[]})),
            &[0],
            false,
        );
        assert_eq!(cut["id"], "c1");
        assert_eq!(cut["choices"][0]["finish_reason"], "content_filter");
    }
}
