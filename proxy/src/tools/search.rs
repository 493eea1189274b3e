//! Answering `tool_search` within one client request (Chat Completions): finding the model's
//! search calls in a response — whole, or event by event in a stream, where they are cut out of
//! what the client sees — answering them from the deferred set, and writing the next request:
//! the previous body with the model's search turn and the results appended at the end.
//!
//! The client sees one response: the real tool calls and the answer, its usage the sum of
//! every round's. Calls to deferred tools pass through untouched; the client owns those tools.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{result_text, DeferredSet, Form, SEARCH_TOOL};
use crate::canon::json;

/// What a request needs to answer its searches.
#[derive(Debug, Clone)]
pub struct SearchPlan {
    pub set: Arc<DeferredSet>,
    pub limit: usize,
    pub max_rounds: usize,
    /// Byte offset of the `]` that closes the body's `messages` (Responses: `input`).
    pub messages_end: usize,
    pub form: Form,
    /// Responses API, the client's own `tool_search`: its searches show in the output as
    /// `tool_search_call` / `tool_search_output` items.
    pub native: bool,
}

/// One `tool_search` call of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchCall {
    pub id: String,
    pub arguments: String,
}

#[derive(Debug, Deserialize)]
struct Args {
    #[serde(default)]
    query: String,
    #[serde(default)]
    limit: Option<usize>,
}

/// A search round's answer: the messages to append and how many tools it loaded.
#[derive(Debug, Clone)]
pub struct Answer {
    pub messages: Vec<String>,
    pub loaded: usize,
    pub empty_searches: usize,
    /// Responses native form: the `tool_search_call` and `tool_search_output` items to show.
    pub shown: Vec<Value>,
}

impl SearchPlan {
    /// Answers `calls`: the assistant turn that made them (with `content`), then one tool
    /// result per call.
    pub fn answer(&self, content: Option<&str>, calls: &[SearchCall]) -> Answer {
        let tool_calls: Vec<Value> = calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": SEARCH_TOOL, "arguments": c.arguments}}))
            .collect();
        let messages =
            vec![json!({"role": "assistant", "content": content, "tool_calls": tool_calls}).to_string()];
        self.results(messages, calls)
    }

    /// Responses: the model's output items of the round, then one `function_call_output` per
    /// search call.
    pub fn answer_items(&self, output: &[Value], calls: &[SearchCall]) -> Answer {
        let items = output.iter().map(Value::to_string).collect();
        self.results(items, calls)
    }

    fn results(&self, mut messages: Vec<String>, calls: &[SearchCall]) -> Answer {
        let (mut loaded, mut empty) = (0, 0);
        let mut shown = Vec::new();
        for c in calls {
            let args: Args = serde_json::from_str(&c.arguments)
                .unwrap_or_else(|_| Args { query: c.arguments.clone(), limit: None });
            let limit = args.limit.unwrap_or(self.limit).clamp(1, self.limit);
            let found = self.set.search(&args.query, limit);
            loaded += found.len();
            empty += usize::from(found.is_empty());
            let text = result_text(&args.query, &found);
            messages.push(match self.form {
                Form::Chat => json!({"role": "tool", "tool_call_id": c.id, "content": text}).to_string(),
                Form::Responses => {
                    json!({"type": "function_call_output", "call_id": c.id, "output": text}).to_string()
                }
            });
            if self.native {
                let defs: Vec<Value> =
                    found.iter().filter_map(|t| serde_json::from_str(&t.json).ok()).collect();
                shown
                    .push(json!({"type": "tool_search_call", "id": format!("tsc_{}", c.id), "call_id": c.id,
                    "status": "completed", "arguments": {"query": args.query, "limit": limit}}));
                shown.push(
                    json!({"type": "tool_search_output", "id": format!("tso_{}", c.id), "call_id": c.id,
                    "status": "completed", "tools": defs}),
                );
            }
        }
        Answer { messages, loaded, empty_searches: empty, shown }
    }

    /// The next request: `body` with `messages` appended to its `messages` list; the plan's
    /// offset moves past them.
    pub fn follow_up(&mut self, body: &[u8], messages: &[String]) -> Vec<u8> {
        let end = self.messages_end.min(body.len());
        let empty_list = body[..end].iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'[');
        let mut out = Vec::with_capacity(body.len() + messages.iter().map(|m| m.len() + 1).sum::<usize>());
        out.extend_from_slice(&body[..end]);
        for (i, m) in messages.iter().enumerate() {
            if i > 0 || !empty_list {
                out.push(b',');
            }
            out.extend_from_slice(m.as_bytes());
        }
        self.messages_end = out.len();
        out.extend_from_slice(&body[end..]);
        out
    }
}

/// The search calls of a whole chat completion, with its content, when the model made search
/// calls and no real ones (a turn with real calls goes to the client: it must run them).
pub fn search_calls(resp: &Value) -> Option<(Option<String>, Vec<SearchCall>)> {
    let choices = resp.get("choices")?.as_array()?;
    let [choice] = choices.as_slice() else { return None };
    let msg = choice.get("message")?;
    let calls = msg.get("tool_calls")?.as_array()?;
    let mut search = Vec::new();
    for c in calls {
        let f = c.get("function")?;
        if f.get("name")?.as_str()? != SEARCH_TOOL {
            return None;
        }
        search.push(SearchCall {
            id: c.get("id").and_then(Value::as_str).unwrap_or("").to_owned(),
            arguments: f.get("arguments").and_then(Value::as_str).unwrap_or("{}").to_owned(),
        });
    }
    let content = msg.get("content").and_then(Value::as_str).map(str::to_owned);
    (!search.is_empty()).then_some((content, search))
}

/// Responses: the round's output items and its search calls, when the model made search calls
/// and no other function calls.
pub fn search_items(resp: &Value) -> Option<(Vec<Value>, Vec<SearchCall>)> {
    let output = resp.get("output")?.as_array()?;
    let mut search = Vec::new();
    for item in output {
        if item.get("type").and_then(Value::as_str) != Some("function_call") {
            continue;
        }
        if item.get("name").and_then(Value::as_str) != Some(SEARCH_TOOL) {
            return None;
        }
        search.push(SearchCall {
            id: item.get("call_id").and_then(Value::as_str).unwrap_or("").to_owned(),
            arguments: item.get("arguments").and_then(Value::as_str).unwrap_or("{}").to_owned(),
        });
    }
    (!search.is_empty()).then(|| (output.clone(), search))
}

/// Takes the search calls out of a whole response (search rounds used up); a turn left with no
/// call ends as a plain answer.
pub fn strip_searches(resp: &mut Value) {
    if let Some(output) = resp.get_mut("output").and_then(Value::as_array_mut) {
        output.retain(|i| {
            i.get("type").and_then(Value::as_str) != Some("function_call")
                || i.get("name").and_then(Value::as_str) != Some(SEARCH_TOOL)
        });
        return;
    }
    let Some(choices) = resp.get_mut("choices").and_then(Value::as_array_mut) else { return };
    for c in choices {
        let Some(msg) = c.get_mut("message").and_then(Value::as_object_mut) else { continue };
        if let Some(calls) = msg.get_mut("tool_calls").and_then(Value::as_array_mut) {
            calls.retain(|t| t.pointer("/function/name").and_then(Value::as_str) != Some(SEARCH_TOOL));
            if calls.is_empty() {
                msg.remove("tool_calls");
                c["finish_reason"] = json!("stop");
            }
        }
    }
}

/// Adds `more`'s token counts into `total` (OpenAI usage objects).
pub fn add_usage(total: &mut Option<Value>, more: Option<&Value>) {
    let Some(more) = more.filter(|u| u.is_object()) else { return };
    let Some(t) = total.as_mut() else {
        *total = Some(more.clone());
        return;
    };
    // Chat Completions' names and the Responses API's.
    for key in ["prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens"] {
        if t.get(key).is_none() && more.get(key).is_none() {
            continue;
        }
        let sum = t.get(key).and_then(Value::as_u64).unwrap_or(0)
            + more.get(key).and_then(Value::as_u64).unwrap_or(0);
        t[key] = json!(sum);
    }
    for details in ["prompt_tokens_details", "input_tokens_details"] {
        let cached = |u: &Value| u.get(details).and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64);
        if let Some(c) = cached(more) {
            let sum = cached(t).unwrap_or(0) + c;
            match t.get_mut(details).and_then(Value::as_object_mut) {
                Some(d) => {
                    d.insert("cached_tokens".to_owned(), json!(sum));
                }
                None => t[details] = json!({ "cached_tokens": sum }),
            }
        }
    }
}

/// The last round's response with every round's usage and, first in its `output`, the items
/// the searches show (Responses native form).
pub fn final_value(resp: &mut Value, earlier: Option<Value>, shown: Vec<Value>) {
    if !shown.is_empty() {
        if let Some(out) = resp.get_mut("output").and_then(Value::as_array_mut) {
            out.splice(0..0, shown);
        }
    }
    if earlier.is_some() {
        let mut total = earlier;
        add_usage(&mut total, resp.get("usage"));
        if let Some(u) = total {
            resp["usage"] = u;
        }
    }
}

/// One streamed round's state: which upstream tool-call indexes are searches, which are real
/// (renumbered for the client), and what the search turn said.
#[derive(Debug, Default)]
pub struct StreamRound {
    /// Later rounds drop the opening role chunk (the client has one).
    pub later: bool,
    /// Chunk id the client has seen (later rounds' chunks are relabelled with it).
    pub id: Option<String>,
    searches: HashMap<u64, SearchCall>,
    real: HashMap<u64, u64>,
    content: String,
    /// The round's usage chunk, held back.
    pub usage: Option<Value>,
    /// The last chunk, as a template for a closing chunk warmpath writes itself.
    pub last_chunk: Option<Value>,
    /// The upstream round ended with `data: [DONE]`.
    pub done: bool,
}

impl StreamRound {
    pub fn next_round(&mut self) -> StreamRound {
        StreamRound { later: true, id: self.id.clone(), ..StreamRound::default() }
    }

    /// The round ended in searches only: what to answer.
    pub fn searches(&self) -> Option<(Option<String>, Vec<SearchCall>)> {
        if self.searches.is_empty() || !self.real.is_empty() {
            return None;
        }
        let mut calls: Vec<(u64, SearchCall)> = self.searches.iter().map(|(k, v)| (*k, v.clone())).collect();
        calls.sort_by_key(|(k, _)| *k);
        let content = Some(self.content.clone()).filter(|c| !c.is_empty());
        Some((content, calls.into_iter().map(|(_, c)| c).collect()))
    }

    /// One SSE event's data: what to send the client (`None`: nothing). `[DONE]` and usage
    /// chunks are held back for the caller to send at the very end.
    pub fn event(&mut self, data: &str) -> Option<String> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return None;
        }
        let Ok(mut chunk) = serde_json::from_str::<Value>(data) else {
            return Some(data.to_owned());
        };
        if self.id.is_none() {
            self.id = chunk.get("id").and_then(Value::as_str).map(str::to_owned);
        }
        let choices_empty = chunk.get("choices").and_then(Value::as_array).is_none_or(|c| c.is_empty());
        if choices_empty && chunk.get("usage").is_some_and(Value::is_object) {
            self.usage = chunk.get("usage").cloned();
            return None;
        }
        if chunk.get("usage").is_some_and(Value::is_null) {
            if let Some(m) = chunk.as_object_mut() {
                m.remove("usage");
            }
        }
        let mut changed = self.later;
        let mut keep = false;
        if let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
            for choice in choices.iter_mut() {
                keep |= self.choice(choice, &mut changed);
            }
        }
        self.last_chunk = Some(chunk.clone());
        if !keep {
            return None;
        }
        if let (true, Some(id)) = (self.later, &self.id) {
            chunk["id"] = json!(id);
        }
        Some(if changed { chunk.to_string() } else { data.to_owned() })
    }

    /// Rewrites one choice of a chunk; whether anything of it is left for the client.
    fn choice(&mut self, choice: &mut Value, changed: &mut bool) -> bool {
        let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else { return true };
        if let Some(t) = delta.get("content").and_then(Value::as_str) {
            self.content.push_str(t);
        }
        if self.later && delta.contains_key("role") {
            delta.remove("role");
            if delta.get("content").and_then(Value::as_str) == Some("") {
                delta.remove("content");
            }
            *changed = true;
        }
        if let Some(calls) = delta.get_mut("tool_calls").and_then(Value::as_array_mut) {
            let before = calls.len();
            calls.retain_mut(|tc| self.tool_call(tc));
            *changed |= calls.len() != before || !self.real.is_empty();
            if calls.is_empty() {
                delta.remove("tool_calls");
            }
        }
        let empty_delta = delta.values().all(|v| v.is_null() || v == "");
        let finish = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        if finish && !self.searches.is_empty() && self.real.is_empty() {
            // The turn ended in searches: warmpath goes on; the client sees no end here.
            choice["finish_reason"] = Value::Null;
            *changed = true;
            return !empty_delta;
        }
        !empty_delta || finish
    }

    /// Keeps a real call's delta (renumbered), absorbs a search call's.
    fn tool_call(&mut self, tc: &mut Value) -> bool {
        let Some(index) = tc.get("index").and_then(Value::as_u64) else { return true };
        let name = tc.pointer("/function/name").and_then(Value::as_str);
        if let Some(name) = name {
            if name == SEARCH_TOOL {
                let id = tc.get("id").and_then(Value::as_str).unwrap_or("").to_owned();
                self.searches.insert(index, SearchCall { id, arguments: String::new() });
            } else if !self.searches.contains_key(&index) {
                let n = self.real.len() as u64;
                self.real.entry(index).or_insert(n);
            }
        }
        if let Some(s) = self.searches.get_mut(&index) {
            if let Some(a) = tc.pointer("/function/arguments").and_then(Value::as_str) {
                s.arguments.push_str(a);
            }
            return false;
        }
        if let Some(&n) = self.real.get(&index) {
            tc["index"] = json!(n);
        }
        true
    }

    /// The closing events warmpath writes when no round ends on its own (search rounds used
    /// up): a finish chunk, then usage and `[DONE]` come from [`closing`].
    pub fn stop_chunk(&self) -> Option<String> {
        let mut c = self.last_chunk.clone()?;
        if let Some(id) = &self.id {
            c["id"] = json!(id);
        }
        c["choices"] = json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]);
        if let Some(m) = c.as_object_mut() {
            m.remove("usage");
        }
        Some(c.to_string())
    }
}

/// The end of the client's stream: the usage chunk (every round's usage, when the client asked
/// for it) and `[DONE]`.
pub fn closing(usage: Option<Value>, template: Option<&Value>, id: Option<&str>) -> String {
    let mut out = String::new();
    if let (Some(u), Some(t)) = (usage, template) {
        let mut c: Map<String, Value> = t.as_object().cloned().unwrap_or_default();
        c.insert("choices".to_owned(), json!([]));
        c.insert("usage".to_owned(), u);
        if let Some(id) = id {
            c.insert("id".to_owned(), json!(id));
        }
        out.push_str("data: ");
        out.push_str(&Value::Object(c).to_string());
        out.push_str("\n\n");
    }
    out.push_str("data: [DONE]\n\n");
    out
}

/// Splits SSE bytes into complete events' `data`, keeping an incomplete tail.
#[derive(Debug, Default)]
pub struct SseSplitter {
    buf: Vec<u8>,
}

impl SseSplitter {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let end = find(&self.buf, b"\n\n")
                .map(|i| (i, 2))
                .or_else(|| find(&self.buf, b"\r\n\r\n").map(|i| (i, 4)));
            let Some((i, sep)) = end else { break };
            let event: Vec<u8> = self.buf.drain(..i + sep).collect();
            let text = String::from_utf8_lossy(&event[..i]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A search call's JSON string for the history, from its parts (used by [`super`] when it
/// reinserts a search before a later call to a deferred tool).
pub fn synthetic_call(id: &str, query: &str) -> (String, String) {
    let arguments = json!({ "query": query }).to_string();
    let msg = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": id, "type": "function", "function": {"name": SEARCH_TOOL, "arguments": arguments}}]});
    (msg.to_string(), arguments)
}

/// A tool result message.
pub fn tool_message(id: &str, content: &str) -> String {
    format!(
        "{{\"role\":\"tool\",\"tool_call_id\":{},\"content\":{}}}",
        json::string(id),
        json::string(content)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canon::tools::CanonTool;
    use crate::config::ToolsConfig;
    use crate::tools::Deferrer;

    fn plan() -> SearchPlan {
        let tools: Vec<Arc<CanonTool>> = ["read_file", "write_file", "list_dir", "search_web"]
            .iter()
            .map(|n| {
                let def =
                    json!({"type": "function", "function": {"name": n, "description": format!("{n} tool")}});
                Arc::new(CanonTool::parse(&def.to_string()).expect("tool"))
            })
            .collect();
        let d =
            Deferrer::new(&ToolsConfig { defer: true, threshold: 1, ..ToolsConfig::default() }).expect("on");
        let p = d.plan(&tools, None, crate::tools::Form::Chat, &|_| 0).expect("deferred");
        SearchPlan {
            set: p.set,
            limit: 2,
            max_rounds: 3,
            messages_end: 0,
            form: crate::tools::Form::Chat,
            native: false,
        }
    }

    #[test]
    fn answers_append_the_turn_and_the_definitions() {
        let mut p = plan();
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[]}"#;
        p.messages_end = body.iter().position(|&b| b == b']').expect("end");
        let a = p.answer(
            Some("let me see"),
            &[SearchCall { id: "c1".into(), arguments: r#"{"query":"read a file"}"#.into() }],
        );
        assert_eq!(a.loaded, 2);
        let next = p.follow_up(body, &a.messages);
        let v: Value = serde_json::from_slice(&next).expect("json");
        let msgs = v["messages"].as_array().expect("list");
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[1]["tool_calls"][0]["function"]["name"], "tool_search");
        assert_eq!(msgs[2]["tool_call_id"], "c1");
        let result = msgs[2]["content"].as_str().expect("text");
        assert!(result.lines().nth(1).is_some_and(|l| l.contains("\"read_file\"")), "{result}");
        assert_eq!(next[p.messages_end], b']', "the offset follows the list's end");
    }

    #[test]
    fn whole_responses_with_real_calls_go_to_the_client() {
        let search = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"id": "a", "function": {"name": "tool_search", "arguments": "{\"query\":\"x\"}"}}]}}]});
        assert_eq!(search_calls(&search).map(|(_, c)| c.len()), Some(1));
        let mixed = json!({"choices": [{"message": {"tool_calls": [
            {"id": "a", "function": {"name": "tool_search", "arguments": "{}"}},
            {"id": "b", "function": {"name": "read_file", "arguments": "{}"}}]}}]});
        assert!(search_calls(&mixed).is_none());
        let mut total = Some(json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 4}}));
        add_usage(
            &mut total,
            Some(&json!({"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
            "prompt_tokens_details": {"cached_tokens": 8}})),
        );
        assert_eq!(
            total.expect("usage"),
            json!({"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
            "prompt_tokens_details": {"cached_tokens": 12}})
        );
    }

    #[test]
    fn a_streamed_search_is_cut_out_and_real_calls_are_renumbered() {
        let mut r = StreamRound::default();
        let ev = |r: &mut StreamRound, v: Value| r.event(&v.to_string());
        assert!(ev(
            &mut r,
            json!({"id": "x1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        )
        .is_some());
        assert!(ev(&mut r, json!({"id": "x1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "s1", "type": "function", "function": {"name": "tool_search", "arguments": "{\"query\":"}}]}}]})).is_none());
        assert!(ev(
            &mut r,
            json!({"id": "x1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "\"files\"}"}}]}}]})
        )
        .is_none());
        assert!(ev(
            &mut r,
            json!({"id": "x1", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        )
        .is_none());
        assert!(r.event("[DONE]").is_none() && r.done);
        let (_, calls) = r.searches().expect("a search round");
        assert_eq!(calls, [SearchCall { id: "s1".into(), arguments: "{\"query\":\"files\"}".into() }]);

        let mut r2 = r.next_round();
        assert!(
            ev(
                &mut r2,
                json!({"id": "x2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            )
            .is_none(),
            "a later round's opening is not repeated"
        );
        let out = ev(&mut r2, json!({"id": "x2", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c9", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]}}]}))
            .expect("a real call goes through");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v["id"], "x1", "one id for the whole stream");
        let fin = ev(
            &mut r2,
            json!({"id": "x2", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        );
        assert!(fin.is_some_and(|f| f.contains("tool_calls")));
        assert!(r2.searches().is_none());
    }

    #[test]
    fn sse_events_split_across_reads() {
        let mut s = SseSplitter::default();
        assert!(s.push(b"data: {\"a\"").is_empty());
        assert_eq!(s.push(b":1}\n\ndata: [DONE]\n\n"), ["{\"a\":1}", "[DONE]"]);
        assert_eq!(s.push(b": comment\n\nevent: x\r\ndata: y\r\n\r\n"), ["y"]);
    }
}
