//! Responses run in the background (`background: true`): polled by `GET`, cancelled (the
//! backend's generation stopped), bounded per API key; and streams resumed from a sequence
//! number (`GET ?stream=true&starting_after=N`) after a client lost them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;

fn responses_of(proxy: &Proxy, key: &str, body: &Value) -> Resp {
    keyed(proxy.addr, key, "POST", "/v1/responses", Some(body))
}

fn status_of(proxy: &Proxy, key: &str, id: &str) -> String {
    let r = keyed(proxy.addr, key, "GET", &format!("/v1/responses/{id}"), None).ok();
    r["status"].as_str().unwrap_or("").to_owned()
}

/// The events of an SSE body, as JSON.
fn events(body: &str) -> Vec<Value> {
    sse(body).0.iter().map(|d| serde_json::from_str(d).expect("event JSON")).collect()
}

#[test]
fn a_background_response_is_polled_cancelled_and_bounded_per_key() {
    let e = Engine::sim("m", &["--sim-itl-ms", "40"]);
    let proxy =
        Proxy::start(&policy("[session]\nmax_background_per_key = 2\n", "", &["m"], &[("e0", e.url())]));
    let long = json!({"model": "m", "input": "a long story", "background": true, "max_output_tokens": 400});
    let started = responses_of(&proxy, "k1", &long).ok();
    let id = started["id"].as_str().expect("id").to_owned();
    assert_eq!(
        (started["status"].as_str(), started["background"].as_bool()),
        (Some("queued"), Some(true)),
        "{started}"
    );
    assert!(eventually(Duration::from_secs(10), || status_of(&proxy, "k1", &id) == "in_progress"));
    let running = || metric(&e.metrics(), "vllm:num_requests_running").unwrap_or(-1.0);
    assert!(eventually(Duration::from_secs(10), || running() == 1.0), "the engine generates it");

    // Bounded per key: a second runs, a third is refused; another key has its own.
    let second = responses_of(&proxy, "k1", &long).ok();
    let r = responses_of(&proxy, "k1", &long);
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (429, Some("too_many_background_responses")),
        "{}",
        r.text()
    );
    let theirs = responses_of(&proxy, "k2", &long).ok();

    // Another key cannot see or cancel it; cancelling stops the engine's generation.
    assert_eq!(keyed(proxy.addr, "k2", "POST", &format!("/v1/responses/{id}/cancel"), None).status, 404);
    assert_eq!(keyed(proxy.addr, "k2", "GET", &format!("/v1/responses/{id}"), None).status, 404);
    let cancelled = keyed(proxy.addr, "k1", "POST", &format!("/v1/responses/{id}/cancel"), None).ok();
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert_eq!(status_of(&proxy, "k1", &id), "cancelled");
    let again = keyed(proxy.addr, "k1", "POST", &format!("/v1/responses/{id}/cancel"), None).ok();
    assert_eq!(again["status"], "cancelled", "cancelling again returns it as it ended");
    for r in [&second, &theirs] {
        let rid = r["id"].as_str().expect("id");
        let key = if r == &theirs { "k2" } else { "k1" };
        keyed(proxy.addr, key, "POST", &format!("/v1/responses/{rid}/cancel"), None).ok();
    }
    assert!(
        eventually(Duration::from_secs(10), || running() == 0.0),
        "every generation stopped: {}",
        running()
    );
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_responses_turns_total{outcome=\"cancelled\",transport=\"background\"}"),
        Some(3.0),
        "{m}"
    );

    // A short one runs to its end with nobody waiting, and is continued like any other.
    let short = responses_of(
        &proxy,
        "k1",
        &json!({"model": "m", "input": "hi", "background": true, "max_output_tokens": 3}),
    )
    .ok();
    let sid = short["id"].as_str().expect("id").to_owned();
    assert!(eventually(Duration::from_secs(10), || status_of(&proxy, "k1", &sid) == "incomplete"));
    let done = keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{sid}"), None).ok();
    assert_eq!(done["usage"]["output_tokens"], 3, "{done}");
    let next = responses_of(
        &proxy,
        "k1",
        &json!({"model": "m", "previous_response_id": sid, "input": "more", "max_output_tokens": 2}),
    );
    assert_eq!(next.status, 200, "{}", next.text());
    let r = keyed(
        proxy.addr,
        "k1",
        "POST",
        &format!("/v1/responses/{}/cancel", next.json()["id"].as_str().unwrap_or("")),
        None,
    );
    assert_eq!(r.status, 400, "only background responses are cancelled: {}", r.text());
    // Deleted while it runs: cancelled, and gone for good once its task has ended.
    let doomed = responses_of(&proxy, "k1", &long).ok();
    let did = doomed["id"].as_str().expect("id").to_owned();
    assert!(eventually(Duration::from_secs(10), || running() == 1.0), "it runs");
    keyed(proxy.addr, "k1", "DELETE", &format!("/v1/responses/{did}"), None).ok();
    assert!(eventually(Duration::from_secs(10), || running() == 0.0), "its generation stopped");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{did}"), None).status, 404);
    let r =
        responses_of(&proxy, "k1", &json!({"model": "m", "input": "x", "background": true, "store": false}));
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("background")), "{}", r.text());
}

/// A client streaming a background response leaves after a few events; the response runs on,
/// and the client picks its stream up after the last event it saw.
#[test]
fn a_lost_stream_is_resumed_after_the_last_event_seen() {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let body = json!({"model": "m", "input": "a story", "background": true, "stream": true, "max_output_tokens": 30}).to_string();
    let mut s = TcpStream::connect(proxy.addr).expect("connect");
    write!(s, "POST /v1/responses HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).expect("send");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("response.output_text.delta").count() < 6 {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "{seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(s);
    // The whole events seen before leaving (a partial last one is not counted).
    let body_start = seen.find("\r\n\r\n").expect("head") + 4;
    let complete = &seen[body_start..seen.rfind("\n\n").expect("an event")];
    let first: Vec<Value> = complete
        .split("\n\n")
        .filter_map(|b| b.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    let last_seen = first.last().expect("events")["sequence_number"].as_u64().expect("seq");
    let id = first[0]["response"]["id"].as_str().expect("id").to_owned();

    let rest = keyed(
        proxy.addr,
        "k1",
        "GET",
        &format!("/v1/responses/{id}?stream=true&starting_after={last_seen}"),
        None,
    );
    assert_eq!(rest.status, 200, "{}", rest.text());
    let rest = events(&rest.text());
    assert_eq!(rest[0]["sequence_number"], last_seen + 1, "it picks up where the client left");
    let done = &rest.last().expect("events")["response"];
    assert_eq!(
        (done["status"].as_str(), done["usage"]["output_tokens"].as_u64()),
        (Some("incomplete"), Some(30)),
        "{done}"
    );
    let text: String = first.iter().chain(&rest).filter_map(|e| e["delta"].as_str()).collect();
    assert_eq!(done["output"][0]["content"][0]["text"], text.as_str(), "no delta lost or repeated");
    for (i, ev) in first.iter().chain(&rest).enumerate() {
        assert_eq!(ev["sequence_number"], i as u64);
    }
}

/// Any stored response's stream can be replayed from a sequence number, not only background
/// ones; another key cannot, and an unstored response has nothing to replay.
#[test]
fn a_stored_streams_events_are_replayed_from_a_sequence_number() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let r = responses_of(
        &proxy,
        "k1",
        &json!({"model": "m", "input": "hi", "stream": true, "max_output_tokens": 5}),
    );
    let original = events(&r.text());
    let id = original[0]["response"]["id"].as_str().expect("id").to_owned();
    let replay =
        keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id}?stream=true&starting_after=3"), None);
    assert_eq!(replay.status, 200, "{}", replay.text());
    assert_eq!(events(&replay.text()), original[4..].to_vec());
    let whole = keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id}?stream=true"), None);
    assert_eq!(events(&whole.text()), original);
    assert_eq!(keyed(proxy.addr, "k2", "GET", &format!("/v1/responses/{id}?stream=true"), None).status, 404);
    let bad =
        keyed(proxy.addr, "k1", "GET", &format!("/v1/responses/{id}?stream=true&starting_after=x"), None);
    assert_eq!(bad.status, 400);
    let r = responses_of(
        &proxy,
        "k1",
        &json!({"model": "m", "input": "hi", "store": false, "max_output_tokens": 2}),
    )
    .ok();
    let gone = keyed(
        proxy.addr,
        "k1",
        "GET",
        &format!("/v1/responses/{}?stream=true", r["id"].as_str().unwrap_or("")),
        None,
    );
    assert_eq!(gone.status, 404);
}
