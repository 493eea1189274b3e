//! The overhead benchmark's two request bodies: a small chat request, and a ~60 KB agent
//! request (long system prompt, 20 messages with tool calls and results, 120 tool schemas).

use serde_json::{json, Value};

/// A small streamed chat request whose answer is `events` chunks (the bench upstream streams
/// `max_tokens` of them).
pub fn streamed(model: &str, events: usize) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": events, "stream": true})
        .to_string()
        .into_bytes()
}

pub fn small(model: &str) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
        .to_string()
        .into_bytes()
}

fn tool(i: usize) -> Value {
    json!({"type": "function", "function": {
        "name": format!("tool_{i:03}_{}", ["search", "read", "write", "list", "run"][i % 5]),
        "description": format!("Tool number {i}: performs operation {i} on the workspace; returns a JSON summary."),
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Workspace-relative path."},
            "query": {"type": "string", "description": "What to look for."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "recursive": {"type": "boolean"}
        }, "required": ["path"]}
    }})
}

pub fn agent(model: &str) -> Vec<u8> {
    let system = format!(
        "You are a coding agent working in a large repository. {}\nCurrent time: 2026-12-02T10:00:00Z",
        "Follow the repository's conventions, explain each change, run the tests before you finish, and never invent file contents. ".repeat(40)
    );
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..5 {
        messages.push(json!({"role": "user", "content": format!("Step {t}: look at module {t} and fix the failing test there.")}));
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": format!("call_{t}"), "type": "function",
            "function": {"name": "tool_001_read", "arguments": format!("{{\"path\":\"src/module_{t}.rs\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{t}"),
            "content": format!("fn module_{t}() {{ /* {} */ }}", "let x = compute(y); ".repeat(40))}));
        messages.push(json!({"role": "assistant", "content": format!("Module {t} reads fine; the failing assertion is on line {}.", 10 + t)}));
    }
    let tools: Vec<Value> = (0..120).map(tool).collect();
    json!({"model": model, "messages": messages, "tools": tools, "max_tokens": 64, "temperature": 0})
        .to_string()
        .into_bytes()
}

#[cfg(test)]
mod tests {
    #[test]
    fn agent_request_is_about_60_kb_with_20_messages() {
        let body = super::agent("m");
        assert!((55_000..65_000).contains(&body.len()), "{}", body.len());
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["messages"].as_array().map(Vec::len), Some(21), "system + 20");
        assert_eq!(v["tools"].as_array().map(Vec::len), Some(120));
    }
}
