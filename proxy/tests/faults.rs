//! Failure handling against real engines misbehaving on purpose (the engine's fault knobs) and
//! against dead ports: retries before the first byte, error events after it, ejection and
//! re-admission, cancellation on client disconnect, timeouts, caps.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use warmpath_tests::*;

fn stream_body(model: &str, max_tokens: u32) -> serde_json::Value {
    let mut b = chat(model, "tell me a story", max_tokens);
    b["stream"] = json!(true);
    b
}

#[test]
fn a_5xx_before_the_first_byte_is_retried_on_another_backend() {
    let bad = Engine::sim("m", &["--fault-error-rate", "1"]);
    let good = Engine::sim("m", &[]);
    let p = policy(
        "[health]\nenabled = false\neject_after_failures = 1000\n",
        "",
        &["m"],
        &[("bad", bad.url()), ("good", good.url())],
    );
    let proxy = Proxy::start(&p);
    let mut retried = 0;
    for _ in 0..10 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 2));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-warmpath-backend"), Some("good"));
        if r.header("x-warmpath-route").is_some_and(|h| h.ends_with("attempt=2")) {
            retried += 1;
        }
    }
    assert_eq!(retried, 5, "round robin sends every other request to the bad one first");
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_retries_total{pool=\"main\",reason=\"status_5xx\"}"), Some(5.0), "{m}");
    assert_eq!(metric(&m, "warmpath_upstream_errors_total{backend=\"bad\",kind=\"status_5xx\"}"), Some(5.0));
}

#[test]
fn when_every_attempt_fails_the_client_gets_the_backend_error() {
    let bad = Engine::sim("m", &["--fault-error-rate", "1"]);
    let p = policy("[health]\nenabled = false\n", "", &["m"], &[("bad", bad.url())]);
    let proxy = Proxy::start(&p);
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 2));
    assert_eq!(r.status, 500, "the backend's own 5xx, not a made-up one: {}", r.text());
    // Its own body too: the engine's message, not one warmpath writes (those say `upstream`).
    assert_eq!(r.json()["error"]["message"], "fault injection: request failed", "{}", r.text());
    assert_eq!(r.header("x-warmpath-route"), Some("exhausted"));
}

#[test]
fn connection_refused_is_retried_and_then_502() {
    let good = Engine::sim("m", &[]);
    let dead = format!("http://127.0.0.1:{}", free_port());
    let p = policy(
        "[health]\nenabled = false\neject_after_failures = 1000\n",
        "",
        &["m"],
        &[("dead", dead.clone()), ("good", good.url())],
    );
    let proxy = Proxy::start(&p);
    for _ in 0..4 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
        assert_eq!((r.status, r.header("x-warmpath-backend")), (200, Some("good")));
    }
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_retries_total{pool=\"main\",reason=\"connect\"}"), Some(2.0), "{m}");
    drop(proxy);

    let only_dead = policy("[health]\nenabled = false\n", "", &["m"], &[("dead", dead)]);
    let proxy = Proxy::start(&only_dead);
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_error");
}

#[test]
fn retries_stay_within_the_budget() {
    let bad = Engine::sim("m", &["--fault-error-rate", "1"]);
    let bad2 = Engine::sim("m", &["--fault-error-rate", "1"]);
    let p = policy(
        "[health]\nenabled = false\neject_after_failures = 100000\n[retry]\nmax_attempts = 2\nbudget_ratio = 0.2\nmin_retries_per_sec = 0\n",
        "",
        &["m"],
        &[("a", bad.url()), ("b", bad2.url())],
    );
    let proxy = Proxy::start(&p);
    for _ in 0..50 {
        assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 500);
    }
    let m = proxy.metrics();
    let retries = metric_sum(&m, "warmpath_retries_total");
    assert!((9.0..=10.0).contains(&retries), "50 requests × 0.2 → at most 10 retries, got {retries}");
    assert!(metric(&m, "warmpath_retry_budget_exhausted_total{pool=\"main\"}").unwrap_or(0.0) >= 40.0, "{m}");
}

#[test]
fn a_stream_cut_after_the_first_byte_ends_with_an_error_event() {
    let dying = Engine::sim("m", &["--fault-die-after-tokens", "3"]);
    let p = policy("[health]\nenabled = false\n", "", &["m"], &[("dying", dying.url())]);
    let proxy = Proxy::start(&p);
    let started = Instant::now();
    let r = post_json(proxy.addr, "/v1/chat/completions", &stream_body("m", 50));
    assert!(started.elapsed() < Duration::from_secs(10), "no hang");
    assert_eq!(r.status, 200);
    assert!(r.clean_end, "the client's chunked body is terminated properly");
    let (data, events) = sse(&r.text());
    assert_eq!(events, ["error"], "{}", r.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let err: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).expect("error JSON");
    assert_eq!(err["error"]["code"], "upstream_stream_error");
    assert!(
        data.iter().filter(|d| d.contains("\"content\"")).count() >= 2,
        "tokens before the cut: {data:?}"
    );
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_upstream_errors_total{backend=\"dying\",kind=\"stream_cut\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(metric(&m, "warmpath_backend_inflight{backend=\"dying\",pool=\"main\"}"), Some(0.0));
}

#[test]
fn a_silent_backend_hits_the_idle_timeout() {
    let slow = Engine::sim("m", &["--fault-delay-ms", "5000"]);
    let p = policy(
        "[health]\nenabled = false\n[upstream]\nidle_timeout_ms = 300\n",
        "",
        &["m"],
        &[("slow", slow.url())],
    );
    let proxy = Proxy::start(&p);
    let t = Instant::now();
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}

#[test]
fn the_idle_timeout_does_not_cut_a_long_healthy_stream() {
    // 40 tokens 100 ms apart: 4 s in all, against a 500 ms idle timeout.
    let e = Engine::sim("m", &["--sim-itl-ms", "100", "--sim-jitter", "0"]);
    let p = policy("[upstream]\nidle_timeout_ms = 500\n", "", &["m"], &[("e", e.url())]);
    let proxy = Proxy::start(&p);
    let r = post_json(proxy.addr, "/v1/chat/completions", &stream_body("m", 40));
    let (data, events) = sse(&r.text());
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert!(r.clean_end);
}

#[test]
fn failing_backends_are_ejected_with_growing_times_and_readmitted() {
    let mut flaky = Engine::sim("m", &[]);
    let good = Engine::sim("m", &[]);
    let p = policy(
        "[health]\nenabled = false\neject_after_failures = 2\nbase_ejection_ms = 400\nmax_ejection_ms = 5000\n",
        "",
        &["m"],
        &[("flaky", flaky.url()), ("good", good.url())],
    );
    let proxy = Proxy::start(&p);
    flaky.kill();
    // Two connect failures eject it; then nothing goes there (no retries needed).
    for _ in 0..4 {
        assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    }
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_backend_ejections_total{backend=\"flaky\",pool=\"main\"}"),
        Some(1.0),
        "{m}"
    );
    let retries_before = metric_sum(&m, "warmpath_retries_total");
    for _ in 0..6 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
        assert_eq!(r.header("x-warmpath-backend"), Some("good"));
    }
    assert_eq!(metric_sum(&proxy.metrics(), "warmpath_retries_total"), retries_before, "ejected: not tried");
    // After the ejection it is tried again; still dead, one failure ejects it for twice as long.
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..2 {
        assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    }
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_backend_ejections_total{backend=\"flaky\",pool=\"main\"}"),
        Some(2.0),
        "{m}"
    );
    // Back on its feet: after the (800 ms) ejection it takes traffic again.
    flaky.restart();
    std::thread::sleep(Duration::from_millis(900));
    let served = (0..10)
        .filter(|_| {
            post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).header("x-warmpath-backend")
                == Some("flaky")
        })
        .count();
    assert!(served >= 4, "re-admitted: {served} of 10");
}

#[test]
fn ejection_never_empties_a_pool_whose_backends_pass_their_probes() {
    // Both answer half their requests with 500: each is soon ejected for a minute, but both
    // pass their probes, so the pool keeps serving (panic routing) instead of a 503 for all.
    let a = Engine::sim("m", &["--fault-error-rate", "0.5"]);
    let b = Engine::sim("m", &["--fault-error-rate", "0.5"]);
    let p = policy(
        "[health]
interval_ms = 100
eject_after_failures = 1
base_ejection_ms = 60000
[retry]
max_attempts = 1
",
        "",
        &["m"],
        &[("a", a.url()), ("b", b.url())],
    );
    let proxy = Proxy::start(&p);
    let statuses: Vec<u16> =
        (0..30).map(|_| post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status).collect();
    let m = proxy.metrics();
    assert_eq!(metric_sum(&m, "warmpath_backend_ejections_total"), 2.0, "both ejected once: {m}");
    assert!(metric_sum(&m, "warmpath_ejection_overrides_total") > 0.0, "{m}");
    assert!(!statuses.contains(&503), "no request refused for want of a backend: {statuses:?}");
    assert!(statuses.iter().filter(|s| **s == 200).count() >= 5, "{statuses:?}");
    assert_eq!(get(proxy.admin, "/readyz").status, 200, "ready: the backends answer their probes");
}

#[test]
fn active_health_checks_take_a_dead_backend_out_and_bring_it_back() {
    let mut a = Engine::sim("m", &[]);
    let b = Engine::sim("m", &[]);
    let p = policy(
        "[health]\ninterval_ms = 100\ntimeout_ms = 300\nunhealthy_threshold = 2\nhealthy_threshold = 1\n",
        "",
        &["m"],
        &[("a", a.url()), ("b", b.url())],
    );
    let proxy = Proxy::start(&p);
    a.kill();
    let down = eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), "warmpath_backend_up{backend=\"a\",pool=\"main\"}") == Some(0.0)
    });
    assert!(down, "probes mark it down");
    for _ in 0..4 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
        assert_eq!(r.header("x-warmpath-route"), Some("round_robin; reason=round_robin"), "no retry needed");
    }
    a.restart();
    let up = eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), "warmpath_backend_up{backend=\"a\",pool=\"main\"}") == Some(1.0)
    });
    assert!(up, "probes bring it back");
    let to_a = (0..4)
        .filter(|_| {
            post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).header("x-warmpath-backend")
                == Some("a")
        })
        .count();
    assert_eq!(to_a, 2);
    a.kill();
    b_is_not_enough(&proxy, b);
}

/// With every backend down, `/readyz` says so and requests get 503.
fn b_is_not_enough(proxy: &Proxy, mut b: Engine) {
    b.kill();
    let unready = eventually(Duration::from_secs(5), || get(proxy.admin, "/readyz").status == 503);
    assert!(unready);
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "no_healthy_backend");
    assert_eq!(r.header("retry-after"), Some("1"));
}

#[test]
fn client_disconnect_cancels_the_engine_request() {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let (s, head) = open_stream(proxy.addr, "m", 2000);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let running = |e: &Engine| metric(&e.metrics(), "vllm:num_requests_running");
    assert!(eventually(Duration::from_secs(5), || running(&e) == Some(1.0)), "generating");
    drop(s);
    assert!(eventually(Duration::from_secs(5), || running(&e) == Some(0.0)), "the engine stopped generating");
    let m = proxy.metrics();
    assert!(eventually(Duration::from_secs(2), || {
        metric(&proxy.metrics(), "warmpath_backend_inflight{backend=\"e\",pool=\"main\"}") == Some(0.0)
    }));
    assert!(metric(&m, "warmpath_client_disconnects_total").unwrap_or(0.0) >= 1.0, "{m}");
    let kv = metric(&e.metrics(), "vllm:kv_cache_usage_perc").unwrap_or(1.0);
    assert_eq!(kv, 0.0, "the engine freed the request's KV blocks");
}

#[test]
fn a_full_backend_answers_429_at_once_without_a_queue() {
    let e = Engine::sim("m", &["--sim-itl-ms", "50"]);
    let pool = "max_inflight_per_backend = 1\nqueue_timeout_ms = 0";
    let proxy = Proxy::start(&policy("", pool, &["m"], &[("e", e.url())]));
    let (s, head) = open_stream(proxy.addr, "m", 200);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "backends_saturated");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(s);
    assert!(eventually(Duration::from_secs(5), || post_json(
        proxy.addr,
        "/v1/chat/completions",
        &chat("m", "hi", 1)
    )
    .status
        == 200));
}

#[test]
fn slow_headers_are_cut_at_the_deadline() {
    let e = Engine::sim("m", &[]);
    let proxy =
        Proxy::start(&policy("[limits]\nheader_read_timeout_ms = 400\n", "", &["m"], &[("e", e.url())]));
    let mut s = TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let t = Instant::now();
    // One header line every 150 ms: each read is quick, the whole header is not.
    for i in 0..20 {
        if s.write_all(
            format!("{}x-slow-{i}: 1\r\n", if i == 0 { "GET /v1/models HTTP/1.1\r\n" } else { "" })
                .as_bytes(),
        )
        .is_err()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(150));
        if t.elapsed() > Duration::from_secs(2) {
            break;
        }
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(t.elapsed() < Duration::from_secs(3), "cut at the deadline, not after {:?}", t.elapsed());
    assert!(!String::from_utf8_lossy(&out).contains("200 OK"), "{}", String::from_utf8_lossy(&out));
    // A normal client on a kept-alive connection is not cut between its requests...
    let mut k = TcpStream::connect(proxy.addr).expect("connect");
    k.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    for _ in 0..2 {
        k.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").expect("send");
        let mut buf = [0u8; 2048];
        let n = k.read(&mut buf).expect("answer");
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        std::thread::sleep(Duration::from_millis(600));
    }
    // ...but its next request's header has the same deadline as the first one's.
    let t = Instant::now();
    for i in 0..20 {
        let line = format!("{}x-slow-{i}: 1\r\n", if i == 0 { "GET /v1/models HTTP/1.1\r\n" } else { "" });
        if k.write_all(line.as_bytes()).is_err() || t.elapsed() > Duration::from_secs(2) {
            break;
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let mut out = Vec::new();
    let _ = k.read_to_end(&mut out);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "second request cut at the deadline, not after {:?}",
        t.elapsed()
    );
    assert!(!String::from_utf8_lossy(&out).contains("200 OK"));
}

#[test]
fn smuggling_and_bad_framing_are_refused() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let raw = |bytes: &[u8]| {
        let mut s = TcpStream::connect(proxy.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        s.write_all(bytes).expect("send");
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    let both = raw(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n");
    assert!(!both.contains(" 200 "), "{both}");
    let garbage = raw(b"\x16\x03\x01 not http\r\n\r\n");
    assert!(garbage.is_empty() || garbage.starts_with("HTTP/1.1 400"), "{garbage}");
    let huge_header = format!("GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(2 << 20));
    assert!(!raw(huge_header.as_bytes()).contains(" 200 "));
    // Still serving.
    assert_eq!(get(proxy.addr, "/v1/models").status, 200);
}

#[test]
fn sigterm_lets_in_flight_streams_finish() {
    // 40 tokens 50 ms apart: 2 s of stream, inside a 4 s grace period.
    let e = Engine::sim("m", &["--sim-itl-ms", "50", "--sim-jitter", "0"]);
    let mut proxy = Proxy::start(&policy("[server]\ngrace_period_secs = 4\n", "", &["m"], &[("e", e.url())]));
    let (mut s, head) = open_stream(proxy.addr, "m", 40);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let pid = proxy.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    s.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("data: [DONE]"), "the stream ran to its end: {text}");
    assert!(!text.contains("event: error"), "{text}");
    // It exits once the stream is done (not before, and without waiting out the grace period).
    let exited = eventually(Duration::from_secs(20), || matches!(proxy.child.try_wait(), Ok(Some(_))));
    assert!(exited, "warmpath exits after SIGTERM");
}
