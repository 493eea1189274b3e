//! warmpath's own HTTP/1.1 client (proxy/src/upstream/) against backends that frame their
//! answers every legal way and some illegal ones (a raw backend, tests/src/scripted.rs): what
//! the client gets, what counts against the backend, and when a connection is used again.

use std::sync::atomic::Ordering;

use warmpath_tests::*;

const NO_PROBES: &str = "[health]\nenabled = false\n";

fn completion() -> String {
    serde_json::json!({
        "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    })
    .to_string()
}

fn sized(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

/// One API thread: each keeps its own backend connections (a socket serves the reactor it was
/// made on), so with two, which thread took a request would decide the connections counted.
fn proxy_for(b: &RawBackend) -> Proxy {
    Proxy::start(&policy(&format!("[server]\nthreads = 1\n{NO_PROBES}"), "", &["m"], &[("b", b.url())]))
}

fn ask(proxy: &Proxy) -> Resp {
    post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 4))
}

#[test]
fn sequential_requests_share_one_backend_connection() {
    let b = RawBackend::start(|_| RawReply { pieces: vec![sized(&completion())], close: false });
    let proxy = proxy_for(&b);
    for _ in 0..20 {
        let r = ask(&proxy);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["choices"][0]["message"]["content"], "hello there");
    }
    assert_eq!(b.requests.load(Ordering::SeqCst), 20);
    assert_eq!(b.model_connections.load(Ordering::SeqCst), 1, "kept alive and used again");
}

#[test]
fn a_backend_that_closes_after_each_answer_costs_no_failure() {
    // It closes without saying so: the kept connection is found closed when the next request
    // comes (or fails at once and is dialled again), never a failure the client or the
    // backend's health sees.
    let b = RawBackend::start(|_| RawReply { pieces: vec![sized(&completion())], close: true });
    let proxy = proxy_for(&b);
    for i in 0..10 {
        let r = ask(&proxy);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        std::thread::sleep(std::time::Duration::from_millis(if i % 2 == 0 { 0 } else { 30 }));
    }
    assert_eq!(b.model_connections.load(Ordering::SeqCst), 10);
    let m = proxy.metrics();
    assert_eq!(metric_sum(&m, "warmpath_upstream_errors_total"), 0.0, "{m}");
    assert_eq!(metric_sum(&m, "warmpath_retries_total"), 0.0, "{m}");
}

#[test]
fn chunked_close_delimited_and_interim_answers_arrive_whole() {
    let body = completion();
    let (a, z) = body.split_at(body.len() / 2);
    let chunked = vec![
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec(),
        format!("{:x};ext=1\r\n{a}\r\n", a.len()).into_bytes(),
        format!("{}0\r\nx-trailer: 1\r\n\r\n", chunk(z)).into_bytes(),
    ];
    let to_close = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{body}").into_bytes();
    let b = RawBackend::start(move |n| match n % 2 {
        0 => RawReply { pieces: chunked.clone(), close: false },
        _ => RawReply { pieces: vec![to_close.clone()], close: true },
    });
    let proxy = proxy_for(&b);
    for i in 0..4 {
        let r = ask(&proxy);
        assert_eq!(r.status, 200, "answer {i}: {}", r.text());
        assert_eq!(r.json()["choices"][0]["message"]["content"], "hello there", "answer {i}");
    }
    // A chunked answer leaves its connection to the next request, whose close-delimited
    // answer ends it: four answers over two connections.
    assert_eq!(b.model_connections.load(Ordering::SeqCst), 2);
}

#[test]
fn answers_that_are_not_http_are_a_502_against_the_backend() {
    let huge = format!("HTTP/1.1 200 OK\r\nx-big: {}\r\n\r\n", "a".repeat(70 * 1024)).into_bytes();
    let b = RawBackend::start(move |n| match n % 3 {
        0 => RawReply { pieces: vec![b"SMTP ready\r\n\r\n".to_vec()], close: true },
        1 => RawReply { pieces: vec![huge.clone()], close: true },
        _ => RawReply {
            pieces: vec![b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nx".to_vec()],
            close: true,
        },
    });
    let p = policy(&format!("{NO_PROBES}[retry]\nmax_attempts = 1\n"), "", &["m"], &[("b", b.url())]);
    let proxy = Proxy::start(&p);
    for what in ["not HTTP", "a 70 KiB head", "two lengths"] {
        let r = ask(&proxy);
        assert_eq!(r.status, 502, "{what}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "upstream_error", "{what}: {}", r.text());
    }
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_upstream_errors_total{backend=\"b\",kind=\"io\"}"), Some(3.0), "{m}");
}

fn event(text: &str) -> String {
    let chunk = serde_json::json!({"id": "c", "object": "chat.completion.chunk", "created": 1,
        "model": "m", "choices": [{"index": 0, "delta": {"content": text}}]});
    format!("data: {chunk}\n\n")
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn streamed(proxy: &Proxy) -> Resp {
    let mut body = chat("m", "hi", 4);
    body["stream"] = serde_json::json!(true);
    post_json(proxy.addr, "/v1/chat/completions", &body)
}

#[test]
fn a_stream_that_goes_silent_is_cut_at_the_idle_timeout() {
    // Events 20 ms apart for a while (each read moves the idle deadline), then silence.
    let b = RawBackend::start(|_| {
        let mut pieces = vec![format!("{SSE_HEAD}{}", chunk(&event("0"))).into_bytes()];
        pieces.extend((1..20).map(|i| chunk(&event(&i.to_string())).into_bytes()));
        RawReply { pieces, close: false }
    });
    let p = policy(&format!("{NO_PROBES}[upstream]\nidle_timeout_ms = 150\n"), "", &["m"], &[("b", b.url())]);
    let proxy = Proxy::start(&p);
    let t = std::time::Instant::now();
    let r = streamed(&proxy);
    assert!(t.elapsed() < std::time::Duration::from_secs(3), "cut soon after the silence: {:?}", t.elapsed());
    let (data, events) = sse(&r.text());
    assert_eq!(
        data.iter().filter(|d| d.contains("\"delta\"")).count(),
        20,
        "every event before the silence: {data:?}"
    );
    assert_eq!(events, ["error"], "{}", r.text());
    assert!(r.clean_end);
}

#[test]
fn a_broken_chunk_mid_stream_ends_the_stream_with_an_error_event() {
    let first = format!("{SSE_HEAD}{}{}", chunk(&event("one")), chunk(&event("two")));
    let b = RawBackend::start(move |_| RawReply {
        pieces: vec![first.clone().into_bytes(), b"zz; not hex\r\n".to_vec()],
        close: false,
    });
    let proxy = proxy_for(&b);
    let r = streamed(&proxy);
    assert_eq!(r.status, 200);
    assert!(r.clean_end, "the client's stream is ended properly");
    let (data, events) = sse(&r.text());
    assert!(data[0].contains("\"one\"") && data[1].contains("\"two\""), "{data:?}");
    assert_eq!(events, ["error"], "{}", r.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_upstream_errors_total{backend=\"b\",kind=\"stream_cut\"}"),
        Some(1.0),
        "{m}"
    );
}
