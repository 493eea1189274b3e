//! Hostile and odd input at the edge, byte by byte on raw sockets: pipelined requests, malformed
//! chunked bodies, transfer codings warmpath does not read, oversized headers, half-closed
//! sockets, deep or invalid JSON, a client that never reads its stream. Each gets the right
//! status (or the right silence) and leaves the proxy serving.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use warmpath_tests::*;

const CHAT: &str = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";

fn body(max_tokens: u32) -> String {
    chat("m", "hi", max_tokens).to_string()
}

fn chat_request(max_tokens: u32) -> String {
    let b = body(max_tokens);
    format!("{CHAT}content-length: {}\r\n\r\n{b}", b.len())
}

fn connect(proxy: &Proxy) -> TcpStream {
    let s = TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s
}

/// Everything the proxy sends until it closes the connection (or the read times out).
fn read_all(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// The status lines of the responses in `raw`, in order.
fn statuses(raw: &str) -> Vec<u16> {
    raw.match_indices("HTTP/1.1 ").filter_map(|(i, _)| raw.get(i + 9..i + 12)?.parse().ok()).collect()
}

fn raw(proxy: &Proxy, bytes: &[u8]) -> String {
    let mut s = connect(proxy);
    s.write_all(bytes).expect("send");
    read_all(&mut s)
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let e = Engine::sim("m", &["--sim-itl-ms", "2"]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    // The second request 2 ms after the first (it lands while the first is answered), then
    // three back to back in one write; the last asks to close so the read ends.
    let close = chat_request(3).replacen("host: x\r\n", "host: x\r\nconnection: close\r\n", 1);
    let mut s = connect(&proxy);
    s.write_all(chat_request(3).as_bytes()).expect("send");
    std::thread::sleep(Duration::from_millis(2));
    s.write_all(format!("{}{}{}{close}", chat_request(4), chat_request(5), chat_request(6)).as_bytes())
        .expect("send");
    let out = read_all(&mut s);
    assert_eq!(statuses(&out), [200; 5], "{out}");
    let tokens: Vec<&str> =
        out.match_indices("\"completion_tokens\":").map(|(i, _)| &out[i + 20..i + 21]).collect();
    assert_eq!(tokens, ["3", "4", "5", "6", "3"], "in the order sent: {out}");
    // A streamed answer with the next request already queued behind it.
    let mut stream = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": true});
    let b = stream.to_string();
    let mut s = connect(&proxy);
    let first = format!("{CHAT}content-length: {}\r\n\r\n{b}", b.len());
    stream["stream"] = serde_json::json!(false);
    s.write_all(format!("{first}{close}").as_bytes()).expect("send");
    let out = read_all(&mut s);
    assert_eq!(statuses(&out), [200, 200], "{out}");
    assert!(out.contains("data: [DONE]"), "{out}");
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_client_disconnects_total").unwrap_or(0.0), 0.0, "{m}");
}

#[test]
fn malformed_chunked_bodies_get_400_at_once_and_the_connection_closes() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let b = body(3);
    let chunked = format!("{CHAT}transfer-encoding: chunked\r\n\r\n");
    for (what, tail) in [
        ("size zz", format!("zz\r\n{b}\r\n0\r\n\r\n")),
        ("size past u64", format!("fffffffffffffffffffff\r\n{b}\r\n0\r\n\r\n")),
        ("LF-only lines", format!("{:x}\n{b}\n0\n\n", b.len())),
    ] {
        // The body's end is unknowable: the answer comes now, and nothing after it is read
        // as a request (read_all returns because the proxy closes, not by the 10 s timeout).
        let started = std::time::Instant::now();
        let out = raw(&proxy, format!("{chunked}{tail}").as_bytes());
        assert_eq!(statuses(&out), [400], "{what}: {out}");
        assert!(out.contains("\"code\":\"bad_framing\""), "{what}: {out}");
        assert!(started.elapsed() < Duration::from_secs(9), "{what}: closed, not timed out");
    }
    // A well-formed chunked body is read.
    let out = raw(
        &proxy,
        format!("{chunked}{:x}\r\n{b}\r\n0\r\n\r\n", b.len())
            .replace("host: x", "connection: close")
            .as_bytes(),
    );
    assert_eq!(statuses(&out), [200], "{out}");
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_rejections_total{reason="bad_framing"}"#), Some(3.0), "{m}");
}

#[test]
fn framing_and_header_size_are_decided_before_the_body() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let b = body(3);
    let len = b.len();
    // A coding warmpath does not read: 501, not a body read as if it were plain chunked.
    let out = raw(
        &proxy,
        format!("{CHAT}transfer-encoding: gzip, chunked\r\n\r\n{len:x}\r\n{b}\r\n0\r\n\r\n").as_bytes(),
    );
    assert_eq!(statuses(&out), [501], "{out}");
    assert!(out.contains("unsupported_transfer_coding"), "{out}");
    // Both Transfer-Encoding and Content-Length: read as chunked (RFC 9112 §6.1), and the
    // connection closes after the answer, so nothing can be smuggled behind it.
    let smuggled =
        format!("{CHAT}content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n{len:x}\r\n{b}\r\n0\r\n\r\n");
    let out = raw(&proxy, format!("{smuggled}GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes());
    assert_eq!(statuses(&out), [200], "one answer, then the connection closes: {out}");
    // Two different lengths, an unparsable length, obs-fold: pingora's parser refuses them.
    for head in [
        format!("content-length: {len}\r\ncontent-length: 5\r\n"),
        "content-length: abc\r\n".to_owned(),
        format!("x-a: b\r\n  folded\r\ncontent-length: {len}\r\n"),
    ] {
        let out = raw(&proxy, format!("{CHAT}{head}\r\n{b}").as_bytes());
        assert_eq!(statuses(&out), [400], "{head:?}: {out}");
    }
    // A 100 KB header line: 431 (the default limit is 32 KiB); 8 KB is fine.
    let big = |n: usize| {
        format!("{CHAT}connection: close\r\nx-big: {}\r\ncontent-length: {len}\r\n\r\n{b}", "a".repeat(n))
    };
    let out = raw(&proxy, big(100_000).as_bytes());
    assert_eq!(statuses(&out), [431], "{out}");
    assert!(out.contains("header_too_large"), "{out}");
    assert_eq!(statuses(&raw(&proxy, big(8_000).as_bytes())), [200]);
    // A WebSocket upgrade without its key.
    let out = raw(&proxy, b"GET /v1/responses HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\nsec-websocket-version: 13\r\n\r\n");
    assert_eq!(statuses(&out), [400], "{out}");
    // Still serving.
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_rejections_total{reason="header_too_large"}"#), Some(1.0), "{m}");
}

#[test]
fn a_half_closed_client_is_cancelled_or_answered_as_the_policy_says() {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let send_half_closed = |proxy: &Proxy| {
        let mut s = connect(proxy);
        s.write_all(chat_request(10).as_bytes()).expect("send");
        s.shutdown(std::net::Shutdown::Write).expect("half-close");
        read_all(&mut s)
    };
    // The default: a FIN is a client leaving (nginx's 499, vLLM's abort).
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let out = send_half_closed(&proxy);
    assert_eq!(out, "", "cancelled, nothing sent");
    assert!(eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), "warmpath_client_disconnects_total").unwrap_or(0.0) >= 1.0
    }));
    // `client_half_close = "answer"`: the client still reads, and gets its answer.
    let proxy =
        Proxy::start(&policy("[limits]\nclient_half_close = \"answer\"\n", "", &["m"], &[("e", e.url())]));
    let out = send_half_closed(&proxy);
    assert_eq!(statuses(&out), [200], "{out}");
    assert!(out.contains("\"completion_tokens\":10"), "{out}");
    // A client that is really gone is still noticed, by the write that fails.
    let mut s = connect(&proxy);
    let mut stream = chat("m", "hi", 2000);
    stream["stream"] = serde_json::json!(true);
    let b = stream.to_string();
    s.write_all(format!("{CHAT}content-length: {}\r\n\r\n{b}", b.len()).as_bytes()).expect("send");
    let running = || metric(&e.metrics(), "vllm:num_requests_running");
    assert!(eventually(Duration::from_secs(5), || running() == Some(1.0)), "generating");
    drop(s);
    assert!(eventually(Duration::from_secs(5), || running() == Some(0.0)), "cancelled once writes fail");
}

#[test]
fn deep_or_invalid_json_gets_400_and_the_proxy_serves_on() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let deep = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi","x":{}{}}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        deep.as_bytes(),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let mut bad = br#"{"model":"m","messages":[{"role":"user","content":"hi "#.to_vec();
    bad.extend_from_slice(b"\xff\xfe\"}]}");
    let r =
        request(proxy.addr, "POST", "/v1/chat/completions", &[("content-type", "application/json")], &bad);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
}

#[test]
fn a_client_that_never_reads_its_stream_holds_bounded_memory() {
    // 200,000 tokens as fast as the engine makes them: about 40 MB of SSE if anything held it.
    let e = Engine::sim(
        "m",
        &["--sim-itl-ms", "0", "--sim-jitter", "0", "--max-model-len", "250000", "--kv-blocks", "16384"],
    );
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let before = rss_kb(proxy.child.id());
    let mut s = connect(&proxy);
    let mut stream = chat("m", "hi", 200_000);
    stream["stream"] = serde_json::json!(true);
    let b = stream.to_string();
    s.write_all(format!("{CHAT}content-length: {}\r\n\r\n{b}", b.len()).as_bytes()).expect("send");
    let generated = || metric(&e.metrics(), "vllm:generation_tokens_total").unwrap_or(0.0);
    // The engine makes the whole answer (it buffers what its client does not take); the proxy
    // reads from the engine only as fast as its client reads, so it holds no more than a few
    // socket buffers' worth.
    assert!(eventually(Duration::from_secs(30), || generated() == 200_000.0), "generated: {}", generated());
    std::thread::sleep(Duration::from_millis(500));
    let grown = rss_kb(proxy.child.id()).saturating_sub(before);
    assert!(grown < 16 << 10, "the proxy held {grown} KiB for a client that does not read");
    drop(s);
    let running = || metric(&e.metrics(), "vllm:num_requests_running");
    assert!(eventually(Duration::from_secs(5), || running() == Some(0.0)));
}
