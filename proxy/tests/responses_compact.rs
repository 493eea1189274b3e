//! `POST /v1/responses/compact`: the user's messages kept, the rest replaced by a compaction
//! item whose summary the pool's own model wrote in a turn of the same conversation; a later
//! turn shows the model the summary where the item stands, after the unchanged system turn.

use serde_json::{json, Value};
use warmpath_tests::*;

/// The chat messages of a backend request.
fn messages(body: &[u8]) -> Vec<Value> {
    let v: Value = serde_json::from_slice(body).expect("json");
    v["messages"].as_array().expect("messages").clone()
}

fn said(m: &Value) -> (String, String) {
    (m["role"].as_str().unwrap_or("").to_owned(), m["content"].as_str().unwrap_or("").to_owned())
}

#[test]
fn a_conversation_is_compacted_into_its_user_messages_and_a_summary() {
    let up = Scripted::start_with(|body| {
        let text = if String::from_utf8_lossy(body).contains("Summarize the conversation so far") {
            "The user lives in Oslo and asks about the weather."
        } else {
            "Sure."
        };
        json!({"id": "c1", "object": "chat.completion", "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
    });
    let proxy = Proxy::start(&policy("", "", &["m"], &[("up", up.url())]));
    let create = |body: Value| keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&body)).ok();
    let r1 = create(json!({"model": "m", "instructions": "Be brief.", "input": "I live in Oslo."}));
    let r2 = create(
        json!({"model": "m", "instructions": "Be brief.", "previous_response_id": r1["id"], "input": "What about tomorrow?"}),
    );

    let c = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses/compact",
        Some(&json!({"model": "m", "instructions": "Be brief.", "previous_response_id": r2["id"]})),
    )
    .ok();
    assert_eq!(c["object"], "response.compaction", "{c}");
    let out = c["output"].as_array().expect("output");
    let kinds: Vec<&str> = out.iter().map(|i| i["type"].as_str().unwrap_or("")).collect();
    assert_eq!(kinds, ["message", "message", "compaction"], "{c}");
    assert_eq!(out[1]["content"][0]["text"], "What about tomorrow?");
    assert!(out[2]["encrypted_content"].as_str().is_some_and(|s| !s.contains("Oslo")), "opaque: {c}");
    assert_eq!(c["usage"]["output_tokens"], 5, "{c}");
    // The summary was asked in a turn of the same conversation: same system turn, the history.
    let asked = messages(&up.bodies.lock().expect("lock")[2]);
    let turns: Vec<(String, String)> = asked.iter().map(said).collect();
    assert_eq!(turns[0], ("system".into(), "Be brief.".into()));
    assert_eq!(
        turns[1..4].iter().map(|t| t.1.as_str()).collect::<Vec<_>>(),
        ["I live in Oslo.", "Sure.", "What about tomorrow?"]
    );
    assert!(turns[5].1.starts_with("Summarize the conversation so far"), "{turns:?}");

    // The next turn sends the compacted items and a new question: the model sees the summary
    // where the compaction item stands, after the same system turn.
    let mut input = out.clone();
    input.push(json!({"role": "user", "content": "And next week?"}));
    create(json!({"model": "m", "instructions": "Be brief.", "input": input}));
    let next: Vec<(String, String)> =
        messages(&up.bodies.lock().expect("lock")[3]).iter().map(said).collect();
    assert_eq!(next[0], ("system".into(), "Be brief.".into()));
    assert_eq!(next[1].1, "I live in Oslo.");
    assert_eq!(next[2].1, "What about tomorrow?");
    assert_eq!(
        next[3],
        (
            "assistant".into(),
            "Summary of the earlier conversation:\nThe user lives in Oslo and asks about the weather.".into()
        )
    );
    assert_eq!(next[4], ("user".into(), "And next week?".into()));

    // A compaction item warmpath did not make, and nothing to compact, are 400s; another key
    // cannot compact this conversation.
    let forged = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "input": [{"type": "compaction", "encrypted_content": "gAAAA"}]})),
    );
    assert_eq!(forged.status, 400, "{}", forged.text());
    let empty = keyed(proxy.addr, "k1", "POST", "/v1/responses/compact", Some(&json!({"model": "m"})));
    assert_eq!(empty.status, 400, "{}", empty.text());
    let theirs = keyed(
        proxy.addr,
        "k2",
        "POST",
        "/v1/responses/compact",
        Some(&json!({"model": "m", "previous_response_id": r2["id"]})),
    );
    assert_eq!(theirs.status, 404, "{}", theirs.text());
}

/// Against the engine with token-id turns: the summary turn reads the conversation from the
/// engine's prefix cache.
#[test]
fn the_summary_turn_reads_the_conversation_from_the_prefix_cache() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "[pools.canon]\ntokenizer = \"wp32k\"", &["m"], &[("e0", e.url())]));
    let r1 = keyed(proxy.addr, "k1", "POST", "/v1/responses",
                   Some(&json!({"model": "m", "instructions": "Be brief.", "input": "Tell me about the sea, at length.", "max_output_tokens": 64}))).ok();
    let c = keyed(proxy.addr, "k1", "POST", "/v1/responses/compact",
                  Some(&json!({"model": "m", "instructions": "Be brief.", "previous_response_id": r1["id"], "max_output_tokens": 32}))).ok();
    let cached = c["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    let first = r1["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= first / 2 && first > 0, "{cached} of the first turn's {first} cached: {c}");
}
