//! Canonicalization end to end: requests that differ only in tool order, JSON key order and a
//! timestamp line meet the engine's prefix cache through warmpath with `[pools.canon]` on, and
//! miss it when warmpath passes them through as sent — side by side, on equal engines.

use serde_json::{json, Value};
use warmpath_tests::*;

const CANON_ON: &str = "policy = \"round_robin\"\n[pools.canon]\nenabled = true\ntokenizer = \"wp32k\"";
const PASSTHROUGH: &str = "policy = \"round_robin\"";

fn tools(order: &[usize]) -> Vec<Value> {
    order
        .iter()
        .map(|&i| {
            json!({"type": "function", "function": {"name": format!("tool_{i:02}"),
                "description": format!("Does task number {i} on the workspace, carefully."),
                "parameters": {"type": "object", "required": ["path"],
                    "properties": {"path": {"type": "string", "description": "file path"},
                                   "depth": {"type": "integer"}}}}})
        })
        .collect()
}

fn turn(order: &[usize], stamp: &str, question: &str) -> Value {
    json!({
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": format!(
                "You are a coding agent.\nCurrent time: {stamp}\n{}", "Follow the house rules. ".repeat(30))},
            {"role": "user", "content": question},
        ],
        "tools": tools(order),
    })
}

/// Sends two turns whose tools and stamps differ; returns the second turn's prompt and cached
/// tokens and both prefix-hash headers.
fn two_turns(proxy: &Proxy) -> (u64, u64, Option<String>, Option<String>) {
    let forward: Vec<usize> = (0..24).collect();
    let backward: Vec<usize> = (0..24).rev().collect();
    let a = post_json(proxy.addr, "/v1/chat/completions", &turn(&forward, "2026-12-03T10:00:00Z", "first?"));
    assert_eq!(a.status, 200, "{}", a.text());
    let b =
        post_json(proxy.addr, "/v1/chat/completions", &turn(&backward, "2026-12-03T10:07:31Z", "second?"));
    assert_eq!(b.status, 200, "{}", b.text());
    let usage = &b.json()["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    let hdr = |r: &Resp| r.header("x-warmpath-prefix-hash").map(str::to_owned);
    (prompt, cached, hdr(&a), hdr(&b))
}

#[test]
fn canonical_requests_meet_the_prefix_cache_that_sent_ones_miss() {
    let (e_on, e_off) = (Engine::sim("m", &[]), Engine::sim("m", &[]));
    let on = Proxy::start(&policy("", CANON_ON, &["m"], &[("e0", e_on.url())]));
    let off = Proxy::start(&policy("", PASSTHROUGH, &["m"], &[("e1", e_off.url())]));

    let (prompt, cached, ha, hb) = two_turns(&on);
    assert!(prompt > 1000, "a prompt with 24 tools: {prompt}");
    // Everything but the new question, the note with the stamp and the generation prompt.
    assert!(cached + 48 >= prompt, "canonical: {cached} of {prompt} cached");
    assert!(ha.is_some() && ha == hb, "{ha:?} {hb:?}");

    let (prompt_off, cached_off, ha, _) = two_turns(&off);
    assert!(
        cached_off < 32,
        "as sent, the stamp on line 2 ends the shared prefix: {cached_off} of {prompt_off}"
    );
    assert_eq!(ha, None, "no blocks are computed for round robin without rewriting");

    let m = on.metrics();
    assert!(
        metric(&m, "warmpath_canon_edits_total{edit=\"tools_reordered\",pool=\"main\"}").unwrap_or(0.0)
            >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "warmpath_canon_moved_bytes_total{pool=\"main\",rule=\"date\"}"),
        Some(2.0 * "Current time: 2026-12-03T10:00:00Z\n".len() as f64),
        "{m}"
    );
    assert!(metric_sum(&m, "warmpath_token_cache_lookups_total{pool=\"main\",result=\"hit\"}") > 0.0, "{m}");
}

#[test]
fn a_malformed_tool_is_the_clients_400() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", CANON_ON, &["m"], &[("e0", e.url())]));
    let r = post_json(
        proxy.addr,
        "/v1/chat/completions",
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": ["not a tool"]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "tools", "{}", r.text());
}

/// A pool that reads nothing of the prompt passes the body on as sent, malformed message and
/// all (the backend refuses what it cannot read); one whose stages read the prompt refuses it
/// itself, naming the message.
#[test]
fn only_a_pool_that_reads_the_prompt_reads_the_messages() {
    let backend = Scripted::start_with(|_| json!({"id": "x", "object": "chat.completion", "choices": []}));
    let lean = Proxy::start(&policy("", PASSTHROUGH, &["m"], &[("b", format!("http://{}", backend.addr))]));
    let reading = Proxy::start(&policy("", CANON_ON, &["m"], &[("b", format!("http://{}", backend.addr))]));
    let body =
        br#"{"model":"m","messages":[{"content":"no role"}],"tools":[{"type":"function"}], "max_tokens":1}"#;
    let r = request(lean.addr, "POST", "/v1/chat/completions", &[("content-type", "application/json")], body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        backend.bodies.lock().expect("lock").last().map(Vec::as_slice),
        Some(&body[..]),
        "byte for byte"
    );
    let r =
        request(reading.addr, "POST", "/v1/chat/completions", &[("content-type", "application/json")], body);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("messages[0]")), "{}", r.text());
    assert_eq!(backend.bodies.lock().expect("lock").len(), 1, "the refused one never left");
    // Both still refuse what is not one JSON object at the top level.
    for proxy in [&lean, &reading] {
        let r =
            request(proxy.addr, "POST", "/v1/chat/completions", &[], br#"{"model":"m","messages":[] "x":1}"#);
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.starts_with("invalid JSON")));
    }
}
