//! Search calls in a streamed chat answer: each round's events rewritten as they pass, search
//! calls absorbed, real calls renumbered, and the closing events warmpath writes itself.

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use super::SearchCall;
use crate::tools::SEARCH_TOOL;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
