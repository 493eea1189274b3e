//! Answering `tool_search` within one client request: finding the model's search calls in a
//! response — whole (`whole`), or event by event in a stream (`stream`), where they are cut
//! out of what the client sees — answering them from the deferred set, and writing the next
//! request: the previous body with the model's search turn and the results appended at the end.
//!
//! The client sees one response: the real tool calls and the answer, its usage the sum of
//! every round's. Calls to deferred tools pass through untouched; the client owns those tools.

mod stream;
mod whole;

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

pub use stream::{closing, StreamRound};
pub use whole::{add_usage, final_value, search_calls, search_items, strip_searches};

use super::{result_text, Api, DeferredSet, SEARCH_TOOL};
use crate::observe::Metrics;
use crate::request::json;

/// What a request needs to answer its searches.
#[derive(Debug, Clone)]
pub struct SearchPlan {
    pub set: Arc<DeferredSet>,
    pub limit: usize,
    pub max_rounds: usize,
    /// Byte offset of the `]` that closes the body's `messages` (Responses: `input`).
    pub messages_end: usize,
    pub form: Api,
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
    /// Searches answered, and of those, the ones that found nothing.
    pub searches: usize,
    pub empty_searches: usize,
    /// Responses native form: the `tool_search_call` and `tool_search_output` items to show.
    pub search_items: Vec<Value>,
}

impl Answer {
    /// Counts the round into `pool`'s metrics; `took` is the time it took to answer.
    pub fn record(&self, m: &Metrics, pool: &str, took: Duration) {
        m.tool_search_duration.with_label_values(&[pool]).observe(took.as_secs_f64());
        m.tool_searches
            .with_label_values(&[pool, "found"])
            .inc_by((self.searches - self.empty_searches) as u64);
        m.tool_searches.with_label_values(&[pool, "empty"]).inc_by(self.empty_searches as u64);
        m.tools_loaded.with_label_values(&[pool]).inc_by(self.loaded as u64);
    }
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
        let mut search_items = Vec::new();
        for c in calls {
            let args: Args = serde_json::from_str(&c.arguments)
                .unwrap_or_else(|_| Args { query: c.arguments.clone(), limit: None });
            let limit = args.limit.unwrap_or(self.limit).clamp(1, self.limit);
            let found = self.set.search(&args.query, limit);
            loaded += found.len();
            empty += usize::from(found.is_empty());
            let text = result_text(&args.query, &found);
            messages.push(match self.form {
                Api::Chat => json!({"role": "tool", "tool_call_id": c.id, "content": text}).to_string(),
                Api::Responses => {
                    json!({"type": "function_call_output", "call_id": c.id, "output": text}).to_string()
                }
            });
            if self.native {
                let defs: Vec<Value> =
                    found.iter().filter_map(|t| serde_json::from_str(&t.json).ok()).collect();
                search_items
                    .push(json!({"type": "tool_search_call", "id": format!("tsc_{}", c.id), "call_id": c.id,
                    "status": "completed", "arguments": {"query": args.query, "limit": limit}}));
                search_items.push(
                    json!({"type": "tool_search_output", "id": format!("tso_{}", c.id), "call_id": c.id,
                    "status": "completed", "tools": defs}),
                );
            }
        }
        Answer { messages, loaded, searches: calls.len(), empty_searches: empty, search_items }
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
    use crate::config::ToolsConfig;
    use crate::tools::def::CanonTool;
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
        let p = d.plan(&tools, None, crate::tools::Api::Chat, &|_| 0).expect("deferred");
        SearchPlan {
            set: p.set,
            limit: 2,
            max_rounds: 3,
            messages_end: 0,
            form: crate::tools::Api::Chat,
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
}
