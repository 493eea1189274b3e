//! Several responses in flight on one WebSocket connection, told apart by `stream_id` (OpenAI's
//! WebSocket multiplexing): lanes run side by side, each in order; every event carries its
//! lane; a lane may fork a conversation another lane made; too many lanes at once is an error
//! event on the lane that asked, and the connection goes on.

use std::collections::HashMap;

use serde_json::{json, Value};
use warmpath_tests::*;

/// Events until `n` responses ended (completed, incomplete, failed, or an error event).
fn until_ended(ws: &mut Ws, n: usize) -> Vec<Value> {
    let mut events = Vec::new();
    let mut ended = 0;
    while ended < n {
        let e = ws.next_event().expect("an event");
        let t = e["type"].as_str().unwrap_or("");
        if matches!(t, "response.completed" | "response.incomplete" | "response.failed" | "error") {
            ended += 1;
        }
        events.push(e);
    }
    events
}

#[test]
fn lanes_run_side_by_side_each_in_order_and_fork() {
    let e = Engine::sim("m", &["--sim-itl-ms", "15"]);
    let proxy = Proxy::start(&policy("[websocket]\nmax_streams = 2\n", "", &["m"], &[("e0", e.url())]));
    let mut ws = Ws::connect(proxy.addr, &[]);
    let create = |lane: &str, input: &str, tokens: u32| json!({"type": "response.create", "stream_id": lane, "model": "m", "input": input, "max_output_tokens": tokens});
    // Lane a: a long answer, then a short one behind it; lane b: a short one, beside a's.
    ws.send_json(&create("a", "a long answer", 40));
    ws.send_json(&create("a", "then a short one", 2));
    ws.send_json(&create("b", "a short one", 2));
    let events = until_ended(&mut ws, 3);
    let ends: Vec<(String, u64)> = events
        .iter()
        .filter(|e| e["type"] == "response.incomplete")
        .map(|e| {
            (
                e["stream_id"].as_str().unwrap_or("").to_owned(),
                e["response"]["usage"]["output_tokens"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        ends,
        [("b".to_owned(), 2), ("a".to_owned(), 40), ("a".to_owned(), 2)],
        "b ran beside a; a's second waited for its first"
    );
    assert!(
        events.iter().all(|e| e["stream_id"] == "a" || e["stream_id"] == "b"),
        "every event names its lane"
    );
    // Within a lane, one response's events at a time, each numbered from 0.
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    for e in &events {
        let lane = e["stream_id"].as_str().unwrap_or("").to_owned();
        let seq = e["sequence_number"].as_i64().expect("seq");
        let prev = last_seq.insert(lane.clone(), seq);
        assert!(seq == 0 || prev == Some(seq - 1), "lane {lane}: {prev:?} then {seq}");
    }

    // A new lane forks lane a's latest response: its conversation, without a store lookup.
    let a_last =
        events.iter().rev().find(|e| e["stream_id"] == "a" && e["type"] == "response.incomplete").expect("a")
            ["response"]
            .clone();
    ws.send_json(&json!({"type": "response.create", "stream_id": "fork", "model": "m", "store": false,
                         "previous_response_id": a_last["id"], "input": "and then?", "max_output_tokens": 2}));
    let fork = until_ended(&mut ws, 1);
    let done = &fork.last().expect("end")["response"];
    assert_eq!(
        (done["previous_response_id"].as_str(), fork[0]["stream_id"].as_str()),
        (a_last["id"].as_str(), Some("fork"))
    );
    assert!(
        done["usage"]["input_tokens"].as_u64() > a_last["usage"]["input_tokens"].as_u64(),
        "the fork carries a's conversation"
    );

    // Two lanes at work is the most: a third gets an error event on its lane; the others go on.
    ws.send_json(&create("x", "long", 30));
    ws.send_json(&create("y", "long", 30));
    ws.send_json(&create("z", "one too many", 2));
    let events = until_ended(&mut ws, 3);
    let refused = events.iter().find(|e| e["type"] == "error").expect("an error event");
    assert_eq!(
        (refused["stream_id"].as_str(), refused["error"]["code"].as_str()),
        (Some("z"), Some("too_many_streams")),
        "{refused}"
    );
    let finished: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "response.incomplete")
        .filter_map(|e| e["stream_id"].as_str())
        .collect();
    assert_eq!(finished.len(), 2, "{finished:?}");
}
