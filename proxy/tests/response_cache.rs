//! The response cache against real engines: deterministic requests answered again without a
//! backend (whole and streamed), everything else passed through, per-caller scoping,
//! `Cache-Control`, and nothing kept from a failed or cut answer.

use serde_json::json;
use warmpath_tests::*;

const CACHE: &str = "[pools.response_cache]\nenabled = true\nttl_s = 60";

/// Requests the engine finished (a hit never reaches it).
fn served(e: &Engine) -> f64 {
    metric_sum(&e.metrics(), "vllm:request_success_total")
}

fn post(proxy: &Proxy, body: &serde_json::Value, headers: &[(&str, &str)]) -> Resp {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    request(proxy.addr, "POST", "/v1/chat/completions", &all, body.to_string().as_bytes())
}

fn greedy(text: &str) -> serde_json::Value {
    let mut b = chat("m", text, 8);
    b["temperature"] = json!(0);
    b
}

#[test]
fn a_deterministic_request_is_answered_again_without_the_backend() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", CACHE, &["m"], &[("e0", e.url())]));
    let first = post(&proxy, &greedy("hello"), &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-warmpath-cache"), Some("miss"));
    assert_eq!(first.header("x-warmpath-backend"), Some("e0"));
    assert!(eventually(std::time::Duration::from_secs(5), || served(&e) == 1.0));

    let again = post(&proxy, &greedy("hello"), &[]);
    assert_eq!(again.status, 200);
    assert_eq!(again.header("x-warmpath-cache"), Some("hit"));
    assert_eq!(again.header("x-warmpath-route"), Some("response_cache; reason=hit"));
    assert!(again.header("age").is_some_and(|a| a.parse::<u64>().is_ok()));
    assert_eq!(again.header("content-type"), first.header("content-type"));
    assert_eq!(again.body, first.body, "the same answer, id and all");
    assert_eq!(served(&e), 1.0, "the engine saw one request");

    // Another prompt, sampled requests, more than one choice: all go to the engine.
    assert_eq!(post(&proxy, &greedy("bye"), &[]).header("x-warmpath-cache"), Some("miss"));
    let sampled = chat("m", "hello", 8);
    for _ in 0..2 {
        assert_eq!(post(&proxy, &sampled, &[]).header("x-warmpath-cache"), Some("miss"));
    }
    let mut two = greedy("hello");
    two["n"] = json!(2);
    assert_eq!(post(&proxy, &two, &[]).header("x-warmpath-cache"), Some("miss"));
    let mut seeded = chat("m", "hello", 8);
    seeded["seed"] = json!(42);
    seeded["temperature"] = json!(0.8);
    assert_eq!(post(&proxy, &seeded, &[]).header("x-warmpath-cache"), Some("miss"));
    assert_eq!(post(&proxy, &seeded, &[]).header("x-warmpath-cache"), Some("hit"), "a fixed seed is kept");
    // Six requests reached it, the one with n = 2 counted once per choice.
    assert!(eventually(std::time::Duration::from_secs(5), || served(&e) == 7.0), "{}", served(&e));

    let m = proxy.metrics();
    let count = |result: &str| {
        metric(&m, &format!("warmpath_response_cache_requests_total{{pool=\"main\",result=\"{result}\"}}"))
    };
    assert_eq!((count("hit"), count("miss"), count("bypass")), (Some(2.0), Some(3.0), Some(3.0)), "{m}");
    assert_eq!(
        metric(&m, "warmpath_response_cache_stores_total{outcome=\"stored\",pool=\"main\"}"),
        Some(3.0),
        "{m}"
    );
    assert_eq!(metric(&m, "warmpath_response_cache_entries{pool=\"main\"}"), Some(3.0), "{m}");
    assert!(metric(&m, "warmpath_response_cache_bytes{pool=\"main\"}").unwrap_or(0.0) > 0.0, "{m}");
}

#[test]
fn a_stream_is_replayed_event_by_event() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", CACHE, &["m"], &[("e0", e.url())]));
    let mut body = greedy("tell me a story");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(12);
    let first = post(&proxy, &body, &[]);
    assert_eq!(first.header("x-warmpath-cache"), Some("miss"));
    let again = post(&proxy, &body, &[]);
    assert_eq!(again.header("x-warmpath-cache"), Some("hit"));
    assert!(again.clean_end, "a properly ended chunked body");
    assert!(again.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")));
    let (data, events) = sse(&again.text());
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert!(data.len() > 3, "{data:?}");
    assert_eq!(again.body, first.body, "the recorded events, in order");
    assert_eq!(served(&e), 1.0);
    // The stream and the whole answer to the same request are kept apart.
    body["stream"] = json!(false);
    let whole = post(&proxy, &body, &[]);
    assert_eq!(whole.header("x-warmpath-cache"), Some("miss"));
    assert!(whole.json()["choices"][0]["message"].is_object());
}

#[test]
fn callers_do_not_share_answers_unless_the_cache_is_shared() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", CACHE, &["m"], &[("e0", e.url())]));
    let a = [("authorization", "Bearer key-a")];
    let b = [("authorization", "Bearer key-b")];
    assert_eq!(post(&proxy, &greedy("hi"), &a).header("x-warmpath-cache"), Some("miss"));
    assert_eq!(post(&proxy, &greedy("hi"), &b).header("x-warmpath-cache"), Some("miss"), "another key");
    assert_eq!(post(&proxy, &greedy("hi"), &[]).header("x-warmpath-cache"), Some("miss"), "no key");
    assert_eq!(post(&proxy, &greedy("hi"), &a).header("x-warmpath-cache"), Some("hit"));
    assert_eq!(post(&proxy, &greedy("hi"), &b).header("x-warmpath-cache"), Some("hit"));
    drop(proxy);

    let shared = format!("{CACHE}\nshared = true");
    let proxy = Proxy::start(&policy("", &shared, &["m"], &[("e0", e.url())]));
    assert_eq!(post(&proxy, &greedy("hi"), &a).header("x-warmpath-cache"), Some("miss"));
    assert_eq!(post(&proxy, &greedy("hi"), &b).header("x-warmpath-cache"), Some("hit"));
}

#[test]
fn cache_control_from_the_client_is_obeyed() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", CACHE, &["m"], &[("e0", e.url())]));
    let no_store = [("cache-control", "no-store")];
    let no_cache = [("cache-control", "no-cache")];
    assert_eq!(post(&proxy, &greedy("x"), &no_store).header("x-warmpath-cache"), Some("miss"));
    assert_eq!(post(&proxy, &greedy("x"), &no_store).header("x-warmpath-cache"), Some("miss"), "not kept");
    assert_eq!(
        post(&proxy, &greedy("x"), &no_cache).header("x-warmpath-cache"),
        Some("miss"),
        "not looked up"
    );
    assert_eq!(post(&proxy, &greedy("x"), &[]).header("x-warmpath-cache"), Some("hit"), "but kept");
    assert_eq!(post(&proxy, &greedy("x"), &no_cache).header("x-warmpath-cache"), Some("miss"));
    assert!(eventually(std::time::Duration::from_secs(5), || served(&e) == 4.0), "{}", served(&e));
}

#[test]
fn failed_and_cut_answers_are_not_kept() {
    let failing = Engine::sim("m", &["--fault-error-rate", "1"]);
    let p = policy("[health]\nenabled = false\n", CACHE, &["m"], &[("bad", failing.url())]);
    let proxy = Proxy::start(&p);
    for _ in 0..2 {
        let r = post(&proxy, &greedy("hi"), &[]);
        assert_eq!((r.status, r.header("x-warmpath-cache")), (500, Some("miss")), "{}", r.text());
    }
    drop(proxy);

    let dying = Engine::sim("m", &["--fault-die-after-tokens", "3"]);
    let p = policy("[health]\nenabled = false\n", CACHE, &["m"], &[("dying", dying.url())]);
    let proxy = Proxy::start(&p);
    let mut body = greedy("tell me a story");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(30);
    for _ in 0..2 {
        let r = post(&proxy, &body, &[]);
        assert_eq!(r.header("x-warmpath-cache"), Some("miss"), "a cut stream is never replayed");
        assert_eq!(sse(&r.text()).1, ["error"], "{}", r.text());
    }
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_response_cache_stores_total{outcome=\"incomplete\",pool=\"main\"}"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(metric(&m, "warmpath_response_cache_entries{pool=\"main\"}"), None, "nothing stored: {m}");
}

#[test]
fn canonical_requests_meet_and_answers_through_deferred_tools_are_kept() {
    let e = Engine::sim("m", &[]);
    let extra = format!(
        "{CACHE}\n[pools.canon]\nenabled = true\n[pools.tools]\ndefer = true\nthreshold = 2\ncore = [\"a\"]"
    );
    let proxy = Proxy::start(&policy("", &extra, &["m"], &[("e0", e.url())]));
    let tool = |name: &str| {
        json!({"type": "function", "function": {"name": name, "description": format!("tool {name}"),
            "parameters": {"type": "object", "properties": {}}}})
    };
    let mut body = greedy("use a tool");
    body["tools"] = json!([tool("a"), tool("b"), tool("c")]);
    let first = post(&proxy, &body, &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-warmpath-cache"), Some("miss"));
    // Tools in another order: the same canonical request.
    body["tools"] = json!([tool("c"), tool("a"), tool("b")]);
    let again = post(&proxy, &body, &[]);
    assert_eq!(again.header("x-warmpath-cache"), Some("hit"), "{:?}", again.headers);
    assert_eq!(again.body, first.body);
    assert_eq!(served(&e), 1.0);
}

/// A Responses turn at temperature 0 is a deterministic chat request once translated: the
/// second identical turn is answered from the cache (its chat stream replayed and translated
/// again), under a new response id.
#[test]
fn a_deterministic_responses_turn_is_answered_from_the_cache() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", CACHE, &["m"], &[("e0", e.url())]));
    let body = serde_json::json!({"model": "m", "input": "the same question", "temperature": 0, "max_output_tokens": 6});
    let first = post_json(proxy.addr, "/v1/responses", &body);
    assert_eq!((first.status, first.header("x-warmpath-cache")), (200, Some("miss")), "{}", first.text());
    let second = post_json(proxy.addr, "/v1/responses", &body);
    assert_eq!((second.status, second.header("x-warmpath-cache")), (200, Some("hit")), "{}", second.text());
    let (a, b) = (first.json(), second.json());
    assert_eq!(a["output"][0]["content"][0]["text"], b["output"][0]["content"][0]["text"]);
    assert_ne!(a["id"], b["id"], "each turn is its own response");
    assert_eq!(served(&e), 1.0, "the engine answered once");
}
