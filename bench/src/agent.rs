//! The `agent` workload: N agent sessions × T turns, generated from a seed alone, shaped like
//! what agent harnesses send:
//! - a long system prompt whose second line is a timestamp that changes every turn;
//! - 100–200 tool schemas per session, serialized in a different order on every request (as
//!   from a hash map);
//! - a history that grows by an assistant tool call and its tool result per turn, after the
//!   first user message.
//!
//! Nothing here depends on what the model answers: the script of each session is fixed, so
//! every target and client mode is sent exactly the same conversations.

use std::time::Duration;

use serde_json::{json, Value};
use warmpath_wire::tokenizer::Tokenizer;

use crate::workload::{Request, SplitMix, Words};

#[derive(Debug, Clone)]
pub struct AgentOpts {
    pub sessions: usize,
    pub turns: usize,
    pub seed: u64,
    /// Tokens of the system prompt's stable part.
    pub system_tokens: usize,
    /// Tool schemas per session: uniform in this range.
    pub tools: (usize, usize),
    /// Tokens of each tool result.
    pub result_tokens: usize,
    pub max_output: usize,
}

const VERBS: [&str; 8] = ["search", "read", "write", "list", "run", "fetch", "update", "delete"];

fn tool(words: &Words, rng: &mut SplitMix, i: usize) -> Value {
    let name = format!("{}_{}_{i}", VERBS[i % VERBS.len()], words.text(rng.next(), 1).trim());
    let mut props = serde_json::Map::new();
    let mut required = Vec::new();
    for p in 0..rng.range(2, 4) {
        let pname = format!("{}_{p}", words.text(rng.next(), 1).trim());
        let kind = ["string", "integer", "boolean"][rng.range(0, 2)];
        props.insert(pname.clone(), json!({"type": kind, "description": words.text(rng.next(), 6).trim()}));
        if p == 0 {
            required.push(pname);
        }
    }
    json!({"type": "function", "function": {
        "name": name,
        "description": words.text(rng.next(), 14).trim(),
        "parameters": {"type": "object", "properties": props, "required": required},
    }})
}

/// One session's fixed script: its system prompt's stable text, tools, and per-turn messages.
struct Script {
    system: String,
    tools: Vec<Value>,
    first_user: String,
}

fn script(words: &Words, o: &AgentOpts, s: usize) -> Script {
    let mut rng = SplitMix::new(o.seed ^ (s as u64).wrapping_mul(0x9E37_79B9));
    let n_tools = rng.range(o.tools.0, o.tools.1);
    let tools = (0..n_tools).map(|i| tool(words, &mut rng, i)).collect();
    Script {
        system: format!("You are a coding agent.{}", words.text(o.seed ^ 0xa11, o.system_tokens)),
        tools,
        first_user: format!("Task {s}:{}", words.text(rng.next(), 40)),
    }
}

/// The requests of every session, turn by turn; `session = (s, t)`. Arrival times are unused
/// (sessions run closed-loop).
pub fn requests(o: &AgentOpts, model: &str, tok: &Tokenizer) -> Vec<Request> {
    let words = Words::new(tok);
    let mut out = Vec::new();
    for s in 0..o.sessions {
        let sc = script(&words, o, s);
        let mut rng = SplitMix::new(o.seed.rotate_left(17) ^ s as u64);
        let mut history = vec![json!({"role": "user", "content": sc.first_user})];
        for t in 0..o.turns {
            if t > 0 {
                // The previous turn's tool call and its result.
                let called = &sc.tools[rng.range(0, sc.tools.len() - 1)]["function"]["name"];
                let id = format!("call_{s}_{t}");
                history.push(json!({"role": "assistant", "content": "", "tool_calls": [{
                    "id": id, "type": "function",
                    "function": {"name": called, "arguments": json!({"path": format!("src/{}.rs", words.text(rng.next(), 1).trim())}).to_string()}
                }]}));
                history.push(json!({"role": "tool", "tool_call_id": id, "content": words.text(rng.next(), o.result_tokens)}));
            }
            let system = {
                let (head, rest) = sc.system.split_at("You are a coding agent.".len());
                format!(
                    "{head}\nCurrent time: 2026-12-03T10:{:02}:{:02}Z\n{rest}",
                    (t * 7 + s) % 60,
                    (t * 13) % 60
                )
            };
            // A different tool order on every request.
            let mut tools = sc.tools.clone();
            let mut shuffle = SplitMix::new(o.seed ^ ((s * 1000 + t) as u64) ^ 0x70015);
            for i in (1..tools.len()).rev() {
                tools.swap(i, shuffle.range(0, i));
            }
            let mut messages = vec![json!({"role": "system", "content": system})];
            messages.extend(history.iter().cloned());
            out.push(Request::chat(
                Duration::ZERO,
                model,
                Value::Array(messages),
                Some(Value::Array(tools)),
                o.max_output,
                tok,
                Some((s, t)),
            ));
        }
    }
    out
}

/// Indices into [`requests`]' output, one list per session, in turn order.
pub fn sessions(reqs: &[Request]) -> Vec<Vec<usize>> {
    let mut v: Vec<Vec<usize>> = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        if let Some((s, _)) = r.session {
            if v.len() <= s {
                v.resize(s + 1, Vec::new());
            }
            v[s].push(i);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> AgentOpts {
        AgentOpts {
            sessions: 2,
            turns: 3,
            seed: 7,
            system_tokens: 200,
            tools: (100, 120),
            result_tokens: 50,
            max_output: 8,
        }
    }

    fn body(r: &Request) -> Value {
        serde_json::from_slice(&r.body).unwrap_or_default()
    }

    #[test]
    fn sessions_grow_by_a_tool_call_and_result_per_turn() {
        let tok = Tokenizer::wp32k();
        let reqs = requests(&opts(), "m", &tok);
        assert_eq!(reqs.len(), 6);
        assert_eq!(sessions(&reqs), vec![vec![0, 1, 2], vec![3, 4, 5]]);
        let lens: Vec<usize> =
            reqs[..3].iter().map(|r| body(r)["messages"].as_array().map_or(0, Vec::len)).collect();
        assert_eq!(lens, [2, 4, 6]);
        let b = body(&reqs[2]);
        assert_eq!(b["messages"][2]["role"], "assistant");
        assert_eq!(b["messages"][3]["role"], "tool");
        let n_tools = b["tools"].as_array().map_or(0, Vec::len);
        assert!((100..=120).contains(&n_tools), "{n_tools}");
        assert!(reqs[2].tokens.len() > reqs[1].tokens.len());
    }

    #[test]
    fn tool_order_and_timestamp_change_every_turn_but_the_set_does_not() {
        let tok = Tokenizer::wp32k();
        let reqs = requests(&opts(), "m", &tok);
        let names = |r: &Request| -> Vec<String> {
            body(r)["tools"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| t["function"]["name"].to_string())
                .collect()
        };
        let (a, b) = (names(&reqs[0]), names(&reqs[1]));
        assert_ne!(a, b, "order differs");
        let (mut sa, mut sb) = (a.clone(), b.clone());
        sa.sort();
        sb.sort();
        assert_eq!(sa, sb, "same tools");
        let sys = |r: &Request| body(r)["messages"][0]["content"].as_str().unwrap_or("").to_owned();
        assert_ne!(sys(&reqs[0]), sys(&reqs[1]));
        assert!(sys(&reqs[0]).lines().nth(1).is_some_and(|l| l.starts_with("Current time:")));
        // Deterministic from the seed.
        assert_eq!(requests(&opts(), "m", &tok)[4].body, reqs[4].body);
    }
}
