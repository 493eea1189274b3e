//! The Responses routes on stored responses: retrieve, delete, input items (paged) and input
//! token counts, each scoped to the API key that made the response, from memory or Redis.

use serde_json::{json, Value};
use warmpath_tests::*;

/// One request with an API key (`Bearer key`).
fn conversation(proxy: &Proxy) -> (Value, Value) {
    let first = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "instructions": "You are a weather agent.", "tools": weather_tools(),
                     "input": "What will the weather be in Oslo tomorrow?", "max_output_tokens": 64})),
    )
    .ok();
    let call_id = first["output"][0]["call_id"].clone();
    let second = keyed(proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "previous_response_id": first["id"], "tools": weather_tools(),
                     "input": [{"type": "function_call_output", "call_id": call_id, "output": "sunny, 21 C"}]})),
    ).ok();
    (first, second)
}

fn ids(page: &Value) -> Vec<String> {
    page["data"].as_array().expect("data").iter().map(|i| i["id"].as_str().expect("id").to_owned()).collect()
}

#[test]
fn stored_responses_are_retrieved_listed_and_deleted_by_their_key_only() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let (first, second) = conversation(&proxy);
    let id2 = second["id"].as_str().expect("id");

    // Retrieved as created.
    assert_eq!(keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id2}"), None).ok(), second);
    // Another key, or an unknown id: 404, the same answer.
    for (key, id) in [("k2", id2), ("k1", "resp_nope")] {
        let r = keyed(proxy.addr, key, "GET", &format!("/v1/responses/{id}"), None);
        assert_eq!(r.status, 404, "{key}: {}", r.text());
        assert_eq!(r.json()["error"]["message"], format!("Response with id '{id}' not found."));
        let r = keyed(proxy.addr, key, "GET", &format!("/v1/responses/{id}/input_items"), None);
        assert_eq!(r.status, 404, "{key}: {}", r.text());
    }

    // The second response's input is the whole conversation before its output, newest first:
    // its function_call_output, the first response's call, the first question.
    let items = keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id2}/input_items"), None).ok();
    let kinds: Vec<&str> =
        items["data"].as_array().expect("data").iter().map(|i| i["type"].as_str().unwrap_or("")).collect();
    assert_eq!(kinds, ["function_call_output", "function_call", "message"], "{items}");
    assert_eq!(items["data"][1], first["output"][0], "the call as the first response gave it");
    assert_eq!(
        items["data"][2]["content"],
        json!([{"type": "input_text", "text": "What will the weather be in Oslo tomorrow?"}])
    );
    let all = ids(&items);
    assert!(
        all.iter().all(|i| !i.is_empty()) && all[0].starts_with("fco_") && all[2].starts_with("msg_"),
        "{all:?}"
    );
    assert_eq!(
        (items["first_id"].as_str(), items["last_id"].as_str()),
        (Some(all[0].as_str()), Some(all[2].as_str()))
    );
    // Paged: two at a time, then after the last one seen; oldest first.
    let p1 = keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id2}/input_items?limit=2"), None).ok();
    assert_eq!((ids(&p1), p1["has_more"].as_bool()), (all[..2].to_vec(), Some(true)));
    let p2 = keyed(
        proxy.addr,
        "k1",
        "GET",
        &format!("/v1/responses/{id2}/input_items?limit=2&after={}", all[1]),
        None,
    )
    .ok();
    assert_eq!((ids(&p2), p2["has_more"].as_bool()), (all[2..].to_vec(), Some(false)));
    let asc =
        keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id2}/input_items?order=asc"), None).ok();
    assert_eq!(ids(&asc), all.iter().rev().cloned().collect::<Vec<_>>());
    // The ids stay: listing again gives the same.
    assert_eq!(
        ids(&keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id2}/input_items"), None).ok()),
        all
    );
    for bad in ["limit=0", "limit=101", "order=sideways", "include=everything", "after=msg_nope"] {
        let r = keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id2}/input_items?{bad}"), None);
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }

    // Deleted by its key only; the response after it still continues (it keeps the
    // conversation), the deleted one does not.
    let id1 = first["id"].as_str().expect("id");
    assert_eq!(keyed(proxy.addr, "k2", "DELETE", &format!("/v1/responses/{id1}"), None).status, 404);
    let gone = keyed(proxy.addr, "k1", "DELETE", &format!("/v1/responses/{id1}"), None).ok();
    assert_eq!(gone, json!({"id": id1, "object": "response", "deleted": true}));
    assert_eq!(keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id1}"), None).status, 404);
    assert_eq!(keyed(proxy.addr, "k1", "DELETE", &format!("/v1/responses/{id1}"), None).status, 404);
    let more = |prev: &str| json!({"model": "m", "previous_response_id": prev, "input": "thanks", "max_output_tokens": 4});
    assert_eq!(keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&more(id2))).status, 200);
    assert_eq!(keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&more(id1))).status, 404);

    // Wrong methods say which ones the route takes.
    let r = keyed(proxy.addr, "k1", "POST", &format!("/v1/responses/{id2}"), None);
    assert_eq!((r.status, r.header("allow")), (405, Some("GET, DELETE")), "{}", r.text());
    assert_eq!(keyed(proxy.addr, "k1", "GET", "/v1/responses/input_tokens", None).status, 405);
    let m = proxy.metrics();
    assert!(
        metric(&m, "warmpath_requests_total{backend=\"none\",route=\"responses_retrieve\",status=\"200\"}")
            .is_some(),
        "{m}"
    );
}

/// An unstored response (`store: false`) cannot be retrieved.
#[test]
fn an_unstored_response_is_not_found() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let r = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "input": "hi", "store": false, "max_output_tokens": 4})),
    )
    .ok();
    let id = r["id"].as_str().expect("id");
    assert_eq!(keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id}"), None).status, 404);
}

const WP32K: &str = "[pools.canon]\ntokenizer = \"wp32k\"";

/// `input_tokens` counts what the engine then reports as `usage.input_tokens` for the same
/// turn, whether the pool sends token ids or chat requests (whose first answer, scripted, is a
/// tool call), for a first turn and a continuation with tools and instructions; without a
/// tokenizer it says so.
#[test]
fn input_tokens_is_the_count_the_engine_reports() {
    let dir = TempDir::new();
    for pool in [WP32K.to_owned(), format!("responses_tokens = false\n{WP32K}")] {
        let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
        let proxy = Proxy::start(&policy("", &pool, &["m"], &[("e0", e.url())]));
        let first = json!({"model": "m", "instructions": "You are a weather agent.", "tools": weather_tools(),
                           "input": "What will the weather be in Oslo tomorrow?", "max_output_tokens": 64});
        let counted = keyed(proxy.addr, "k1", "POST", "/v1/responses/input_tokens", Some(&first)).ok();
        assert_eq!(counted["object"], "response.input_tokens", "{counted}");
        let r1 = keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&first)).ok();
        assert_eq!(counted["input_tokens"], r1["usage"]["input_tokens"], "{pool}: first turn");
        let next = json!({"model": "m", "instructions": "You are a weather agent.", "tools": weather_tools(),
                          "previous_response_id": r1["id"], "max_output_tokens": 64,
                          "input": [{"role": "user", "content": "And the day after?"}]});
        let counted = keyed(proxy.addr, "k1", "POST", "/v1/responses/input_tokens", Some(&next)).ok();
        let r2 = keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&next)).ok();
        assert_eq!(counted["input_tokens"], r2["usage"]["input_tokens"], "{pool}: continuation");
        assert!(r2["usage"]["input_tokens"].as_u64() > r1["usage"]["input_tokens"].as_u64());
        // Another key cannot count from this conversation.
        assert_eq!(keyed(proxy.addr, "k2", "POST", "/v1/responses/input_tokens", Some(&next)).status, 404);
    }
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let r = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses/input_tokens",
        Some(&json!({"model": "m", "input": "hi"})),
    );
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (400, Some("tokenizer_unavailable")),
        "{}",
        r.text()
    );
    let r = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses/input_tokens",
        Some(&json!({"model": "nope", "input": "hi"})),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    let r = keyed(proxy.addr, "k1", "POST", "/v1/responses/input_tokens", Some(&json!({"input": 5})));
    assert_eq!(r.status, 400, "{}", r.text());
}

/// Through Redis, a response stored by one replica is retrieved, listed and deleted on another.
#[test]
fn another_replica_serves_the_stored_routes_through_redis() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let redis = RedisServer::start();
    let store = format!("[session]\nstore = \"redis\"\nredis_url = \"{}\"\n", redis.url());
    let a = Proxy::start(&policy(&store, "", &["m"], &[("e0", e.url())]));
    let b = Proxy::start(&policy(&store, "", &["m"], &[("e0", e.url())]));
    let (_, second) = conversation(&a);
    let id = second["id"].as_str().expect("id");
    assert_eq!(keyed(b.addr, "k1", "GET", &format!("/v1/responses/{id}"), None).ok(), second);
    assert_eq!(keyed(b.addr, "k2", "GET", &format!("/v1/responses/{id}"), None).status, 404);
    let on_a = keyed(a.addr, "k1", "GET", &format!("/v1/responses/{id}/input_items"), None).ok();
    let on_b = keyed(b.addr, "k1", "GET", &format!("/v1/responses/{id}/input_items"), None).ok();
    assert_eq!((on_a["data"].as_array().map(Vec::len), &on_a), (Some(3), &on_b));
    keyed(b.addr, "k1", "DELETE", &format!("/v1/responses/{id}"), None).ok();
    assert_eq!(keyed(a.addr, "k1", "GET", &format!("/v1/responses/{id}"), None).status, 404);
}

/// `truncation: "auto"`: a conversation grown past the pool's context leaves its oldest items
/// out of the prompt, as few as it takes (here the first question; the prompt starts at the
/// first answer), and says how many; the store keeps them. Without it, the same turn is a 400
/// `context_length_exceeded`.
#[test]
fn truncation_auto_leaves_the_oldest_turns_out_of_a_prompt_that_does_not_fit() {
    let e = Engine::sim("m", &[]);
    let proxy =
        Proxy::start(&policy("", &format!("max_model_len = 400\n{WP32K}"), &["m"], &[("e0", e.url())]));
    let words = |w: &str| vec![w; 120].join(" ");
    let r1 = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "input": words("apple"), "max_output_tokens": 8})),
    )
    .ok();
    let r2 = keyed(proxy.addr, "k1", "POST", "/v1/responses",
                   Some(&json!({"model": "m", "previous_response_id": r1["id"], "input": words("apple"), "max_output_tokens": 8}))).ok();
    // Each question is some 120 tokens: two turns fit, three do not.
    let (a, b) = (
        r1["usage"]["input_tokens"].as_u64().unwrap_or(0),
        r2["usage"]["input_tokens"].as_u64().unwrap_or(0),
    );
    assert!(a > 100 && b + 8 <= 400 && b + (b - a) + 8 > 400, "{a} then {b}");
    let third = |truncation: &str| json!({"model": "m", "previous_response_id": r2["id"], "input": words("apple"), "max_output_tokens": 8, "truncation": truncation});
    let refused = keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&third("disabled")));
    assert_eq!(
        (refused.status, refused.json()["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{}",
        refused.text()
    );
    let r3 = keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&third("auto"))).ok();
    assert_eq!(
        (r3["truncation"].as_str(), r3["metadata"]["warmpath_truncated_items"].as_str()),
        (Some("auto"), Some("1")),
        "{r3}"
    );
    let used = r3["usage"]["input_tokens"].as_u64().unwrap_or(0);
    assert!(used + 8 <= 400 && used > b - a, "the prompt fits, with the second turn in it: {used}");
    let items = keyed(
        proxy.addr,
        "k1",
        "GET",
        &format!("/v1/responses/{}/input_items", r3["id"].as_str().unwrap_or("")),
        None,
    )
    .ok();
    assert_eq!(items["data"].as_array().map(Vec::len), Some(5), "the store keeps every item: {items}");
    let r = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "input": "x", "truncation": "sometimes"})),
    );
    assert_eq!(r.status, 400);
}

/// `include: ["message.output_text.logprobs"]` with `top_logprobs`: each output token's
/// log-probability and its alternatives, whole and in the stream's deltas, as the backend gave
/// them; an unknown `include` value is a 400.
#[test]
fn output_logprobs_are_included_when_asked() {
    // The llama executor on seeded dummy weights: the sim executor computes no probabilities.
    let args = ["--executor", "llama", "--model", "micro", "--served-model-name", "m"];
    let e = Engine::start_args(args.iter().map(|s| s.to_string()).collect(), 0);
    let proxy = Proxy::start(&policy("", WP32K, &["m"], &[("e0", e.url())]));
    let ask = json!({"model": "m", "input": "hi", "max_output_tokens": 5, "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let r = keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&ask)).ok();
    let part = &r["output"][0]["content"][0];
    let lp = part["logprobs"].as_array().expect("logprobs");
    assert_eq!(lp.len(), 5, "one per token: {r}");
    let joined: String = lp.iter().filter_map(|t| t["token"].as_str()).collect();
    assert_eq!(part["text"].as_str(), Some(joined.as_str()));
    assert!(
        lp.iter().all(|t| t["logprob"].as_f64().is_some_and(|l| l <= 0.0)
            && t["top_logprobs"].as_array().map(Vec::len) == Some(2)),
        "{r}"
    );
    assert_eq!(r["top_logprobs"], 2);
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let text = keyed(proxy.addr, "k1", "POST", "/v1/responses", Some(&streamed)).text();
    let deltas: usize = sse(&text)
        .0
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).expect("json"))
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["logprobs"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(deltas, 5, "{text}");
    // Without asking: none kept.
    let plain = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "input": "hi", "max_output_tokens": 2})),
    )
    .ok();
    assert!(plain["output"][0]["content"][0].get("logprobs").is_none(), "{plain}");
    let bad = keyed(
        proxy.addr,
        "k1",
        "POST",
        "/v1/responses",
        Some(&json!({"model": "m", "input": "hi", "include": ["everything"]})),
    );
    assert_eq!((bad.status, bad.json()["error"]["param"].as_str()), (400, Some("include")));
}
