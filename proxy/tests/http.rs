//! The proxy's HTTP surface against real engines and a scripted upstream: routes, byte-for-byte
//! fidelity, SSE relay, usage, merged models, and the error shapes warmpath answers itself.

use serde_json::json;
use warmpath_tests::*;

#[test]
fn bodies_pass_through_byte_identical_both_ways() {
    // A body a re-serializing router would change: key order, spacing, escapes, a null content,
    // an unknown field, a float with trailing digits.
    let client_body = br#"{ "messages":[{"content":null,"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]},{"role":"user","content":"caf\u00e9 \ud83d\ude00"}],
  "model":"m", "temperature":0.70000, "vendor_extension":{"z":1,"a":[]}, "stream":true }"#;
    let sse = b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"caf\\u00e9\"}}],  \"usage\":null}\n\ndata: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\ndata: [DONE]\n\n".to_vec();
    let up = Scripted::start("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: identity\r\nconnection: close", sse.clone());
    let proxy = Proxy::start(&policy("", "", &["m"], &[("s", up.url())]));
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions?x=1",
        &[("content-type", "application/json"), ("authorization", "Bearer k")],
        client_body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.body, sse, "client receives the backend's bytes");
    assert!(r.clean_end, "chunked body ends with the zero chunk");
    assert_eq!(r.header("x-warmpath-backend"), Some("s"));
    assert_eq!(r.header("x-warmpath-route"), Some("round_robin; reason=round_robin"));
    let bodies = up.bodies.lock().expect("lock");
    assert_eq!(bodies.len(), 1);
    assert_eq!(bodies[0], client_body.to_vec(), "backend receives the client's bytes");
    let head = &up.heads.lock().expect("lock")[0];
    assert!(head.starts_with("POST /v1/chat/completions?x=1 HTTP/1.1"), "{head}");
    assert!(head.to_ascii_lowercase().contains("authorization: bearer k"), "{head}");
    assert!(!head.to_ascii_lowercase().contains("connection: close"), "hop-by-hop header forwarded: {head}");
}

#[test]
fn engine_stream_is_relayed_with_usage() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let mut body = chat("m", "count to three", 6);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(r.clean_end);
    let (data, events) = sse(&r.text());
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let usage: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).expect("usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
    let content_chunks = data.iter().filter(|d| d.contains("\"content\"")).count();
    assert!(content_chunks >= 6, "one chunk per token: {data:?}");

    // Non-streaming: usage with cached tokens on the second identical request.
    let long = chat("m", &"a shared prefix of some length ".repeat(20), 2);
    let first = post_json(proxy.addr, "/v1/chat/completions", &long).json();
    let second = post_json(proxy.addr, "/v1/chat/completions", &long).json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 0, "{second}");

    // Completions and token-id prompts take the same path.
    let c = post_json(
        proxy.addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}),
    );
    assert_eq!(c.status, 200, "{}", c.text());
    assert_eq!(c.json()["usage"]["completion_tokens"], 2);
}

#[test]
fn models_are_merged_from_every_pool() {
    let a = Engine::sim("alpha", &[]);
    let b = Engine::sim("beta", &[]);
    let policy = format!(
        "[[pools]]\nname = \"a\"\nmodels = [\"alpha\"]\n[[pools.backends]]\nname = \"a0\"\nurl = \"{}\"\n\
         [[pools]]\nname = \"b\"\nmodels = [\"*\"]\n[[pools.backends]]\nname = \"b0\"\nurl = \"{}\"\n",
        a.url(),
        b.url()
    );
    let proxy = Proxy::start(&policy);
    let r = get(proxy.addr, "/v1/models");
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "list");
    let mut ids: Vec<&str> =
        v["data"].as_array().expect("data").iter().filter_map(|m| m["id"].as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["alpha", "beta"]);
    assert!(v["data"][0]["max_model_len"].is_u64(), "backend fields kept: {v}");
    // Each model goes to its own pool.
    let ra = post_json(proxy.addr, "/v1/chat/completions", &chat("alpha", "hi", 1));
    let rb = post_json(proxy.addr, "/v1/chat/completions", &chat("beta", "hi", 1));
    assert_eq!((ra.header("x-warmpath-backend"), rb.header("x-warmpath-backend")), (Some("a0"), Some("b0")));
}

fn assert_openai_error(r: &Resp, status: u16, kind: &str) -> serde_json::Value {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let v = r.json();
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v["error"].get("param").is_some() && v["error"].get("code").is_some(), "{v}");
    v
}

#[test]
fn bad_requests_get_openai_errors() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("[limits]\nmax_body_bytes = 4096\n", "", &["m"], &[("e", e.url())]));
    let big = chat("m", &"x".repeat(5000), 1);
    assert_openai_error(&post_json(proxy.addr, "/v1/chat/completions", &big), 413, "invalid_request_error");
    // Far more than socket buffers hold: the client writes it all before reading, and still
    // gets its 413 (a lingering close), not a broken pipe.
    let huge = chat("m", &"x".repeat(16 << 20), 1);
    assert_openai_error(&post_json(proxy.addr, "/v1/chat/completions", &huge), 413, "invalid_request_error");
    let r = request(proxy.addr, "POST", "/v1/chat/completions", &[], b"{not json");
    let v = assert_openai_error(&r, 400, "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap_or("").starts_with("invalid JSON"), "{v}");
    let r = post_json(proxy.addr, "/v1/chat/completions", &json!({"model": "m", "messages": "nope"}));
    assert_openai_error(&r, 400, "invalid_request_error");
    let r = post_json(proxy.addr, "/v1/chat/completions", &json!({"messages": []}));
    assert_openai_error(&r, 400, "invalid_request_error");
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}",
    );
    assert_openai_error(&r, 400, "invalid_request_error");
    let v = assert_openai_error(
        &post_json(proxy.addr, "/v1/chat/completions", &chat("other", "hi", 1)),
        404,
        "invalid_request_error",
    );
    assert_eq!(v["error"]["code"], "model_not_found");
    let v = assert_openai_error(&get(proxy.addr, "/v2/whatever"), 404, "invalid_request_error");
    assert_eq!(v["error"]["code"], "unknown_url");
    let r = get(proxy.addr, "/v1/chat/completions");
    assert_openai_error(&r, 405, "invalid_request_error");
    assert_eq!(r.header("allow"), Some("POST"));
    // Deeply nested JSON is refused by the parser's depth limit, not by a crash.
    let deep =
        format!("{{\"model\":\"m\",\"messages\":[],\"x\":{}{}}}", "[".repeat(1_500), "]".repeat(1_500));
    assert_openai_error(
        &request(proxy.addr, "POST", "/v1/chat/completions", &[], deep.as_bytes()),
        400,
        "invalid_request_error",
    );
    // The proxy is still serving, and counted every rejection.
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_rejections_total{reason=\"too_large\"}"), Some(2.0), "{m}");
    assert_eq!(metric(&m, "warmpath_rejections_total{reason=\"model_not_found\"}"), Some(1.0));
    assert!(metric(&m, "warmpath_rejections_total{reason=\"bad_request\"}").unwrap_or(0.0) >= 4.0);
    assert_eq!(
        metric(&m, "warmpath_requests_total{backend=\"none\",route=\"other\",status=\"404\"}"),
        Some(1.0),
        "{m}"
    );
}

#[test]
fn large_bodies_and_expect_continue() {
    let e = Engine::sim(
        "m",
        &["--max-model-len", "100000", "--kv-blocks", "8000", "--sim-prefill-us-per-token", "1"],
    );
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    // ~200 KB: far past pingora's 64 KiB retry buffer.
    let body = chat("m", &"lorem ipsum dolor sit amet ".repeat(8000), 1).to_string();
    assert!(body.len() > 200_000 && body.len() < 4096 * 1024);
    let r =
        request(proxy.addr, "POST", "/v1/chat/completions", &[("expect", "100-continue")], body.as_bytes());
    // The 100 Continue interim response comes first, then the real one.
    let text = r.text();
    assert!(r.status == 100 || r.status == 200, "{}", r.status);
    if r.status == 100 {
        assert!(text.contains("HTTP/1.1 200"), "{text}");
    }
}

#[test]
fn admin_endpoints() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    assert_eq!(get(proxy.admin, "/healthz").status, 200);
    assert_eq!(get(proxy.admin, "/readyz").status, 200);
    post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 2));
    let m = get(proxy.admin, "/metrics");
    assert_eq!(m.header("content-type"), Some("text/plain; version=0.0.4"));
    let m = m.text();
    for name in [
        "warmpath_requests_total{backend=\"e\",route=\"chat_completions\",status=\"200\"} 1",
        "warmpath_request_duration_seconds_count{backend=\"e\",pool=\"main\",route=\"chat_completions\"} 1",
        "warmpath_ttft_seconds_count{backend=\"e\",pool=\"main\",route=\"chat_completions\"} 1",
        "warmpath_backend_inflight{backend=\"e\",pool=\"main\"} 0",
        "warmpath_routing_decisions_total{policy=\"round_robin\",pool=\"main\",reason=\"round_robin\"} 1",
        "warmpath_backend_up{backend=\"e\",pool=\"main\"} 1",
    ] {
        assert!(m.contains(name), "missing {name}:\n{m}");
    }
}

#[test]
fn back_to_back_requests_on_one_connection_all_arrive_whole() {
    use std::io::Write;
    // The client sends its next request the moment it has the previous response; the proxy's
    // watch for a departed client must not eat the first byte of that request.
    let e = Engine::sim("m", &["--sim-itl-ms", "0"]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let body = chat("m", "hi", 1).to_string();
    let mut s = std::net::TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
    for i in 0..300 {
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        let r = read_response(&mut s);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
    }
}

#[test]
fn answers_without_a_backend_keep_the_connection() {
    use std::io::Write;
    // A 404 or 405 for a request with a small body reads the body first, so the client's
    // connection stays usable for its next request.
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let mut s = std::net::TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
    let body = chat("m", "hi", 1).to_string();
    for (method, path, status) in [
        ("POST", "/v1/no-such-route", 404),
        ("PUT", "/v1/chat/completions", 405),
        ("POST", "/v1/chat/completions", 200),
    ] {
        write!(s, "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}", body.len())
            .expect("send");
        let r = read_response(&mut s);
        assert_eq!(r.status, status, "{method} {path}: {}", r.text());
        assert_eq!(r.header("connection"), Some("keep-alive"), "{method} {path}");
    }
}

#[test]
fn embeddings_and_native_responses_pass_through() {
    let reply =
        br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}]}"#.to_vec();
    let head =
        format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}", reply.len());
    let up = Scripted::start(Box::leak(head.into_boxed_str()), reply.clone());
    let pool = "responses = \"native\"\npolicy = \"prefix_hash\"";
    let proxy = Proxy::start(&policy("", pool, &["m"], &[("s", up.url())]));
    let emb = br#"{"model":"m","input":["a","b"],"encoding_format":"float"}"#;
    let r = request(proxy.addr, "POST", "/v1/embeddings", &[("content-type", "application/json")], emb);
    assert_eq!((r.status, r.body.clone()), (200, reply.clone()), "{}", r.text());
    assert_eq!(r.header("x-warmpath-route"), Some("prefix_hash; reason=hash"));
    let resp =
        br#"{"model":"m","instructions":"be brief","input":[{"role":"user","content":"hi"}],"store":false}"#;
    let r = request(proxy.addr, "POST", "/v1/responses", &[("content-type", "application/json")], resp);
    assert_eq!(r.status, 200);
    let bodies = up.bodies.lock().expect("lock");
    assert_eq!((bodies[0].as_slice(), bodies[1].as_slice()), (&emb[..], &resp[..]));
    let heads = up.heads.lock().expect("lock");
    assert!(heads[0].starts_with("POST /v1/embeddings ") && heads[1].starts_with("POST /v1/responses "));
    drop((bodies, heads));
    let r = request(proxy.addr, "POST", "/v1/embeddings", &[], br#"{"model":"m"}"#);
    assert_eq!(r.status, 400, "input is required: {}", r.text());
}

#[test]
fn a_slow_body_gets_408_and_json_logs_are_json() {
    use std::io::{Read, Write};
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(
        "[limits]\nbody_read_timeout_ms = 300\n[log]\nformat = \"json\"\n",
        "",
        &["m"],
        &[("e", e.url())],
    ));
    let mut s = std::net::TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(5))).expect("timeout");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\":")
        .expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let r = parse_response(&out);
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "request_timeout");
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert!(eventually(std::time::Duration::from_secs(3), || proxy.log.text().contains("\"status\":200")));
    let access: Vec<serde_json::Value> = proxy
        .log
        .text()
        .lines()
        .filter(|l| l.contains("warmpath::access"))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
        .collect();
    assert!(access.iter().any(|v| v["fields"]["status"] == 408), "{access:?}");
    assert!(
        access.iter().any(|v| v["fields"]["status"] == 200 && v["fields"]["backend"] == "e"),
        "{access:?}"
    );
}

#[test]
fn request_ids_are_kept_or_made_passed_on_logged_and_returned() {
    let up = Scripted::start_with(|_| {
        json!({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
    });
    let proxy = Proxy::start(&policy("[log]\nformat = \"json\"\n", "", &["m"], &[("s", up.url())]));
    let body = chat("m", "hi", 2).to_string();
    let send = |headers: &[(&str, &str)]| {
        let mut h = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        request(proxy.addr, "POST", "/v1/chat/completions", &h, body.as_bytes())
    };
    // The client's own id goes to the backend and comes back.
    let r = send(&[("x-request-id", "client-req-7")]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-request-id"), Some("client-req-7"));
    // None: warmpath makes one, the backend sees the same.
    let r = send(&[]);
    let made = r.header("x-request-id").expect("an id").to_owned();
    assert!(made.len() == 32 && made.bytes().all(|b| b.is_ascii_hexdigit()), "{made}");
    // One that cannot be a header value in logs (a space) is replaced.
    let r = send(&[("x-request-id", "two words")]);
    let replaced = r.header("x-request-id").expect("an id").to_owned();
    assert_ne!(replaced, "two words");
    let heads = up.heads.lock().expect("lock").clone();
    assert_eq!(heads.len(), 3);
    assert!(heads[0].to_ascii_lowercase().contains("x-request-id: client-req-7"), "{}", heads[0]);
    assert!(heads[1].contains(&made), "{}", heads[1]);
    assert!(heads[2].contains(&replaced) && !heads[2].contains("two words"), "{}", heads[2]);
    // Errors warmpath answers itself carry one too, and the access log names each.
    let nope = chat("nope", "hi", 2).to_string();
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "bad-model-1"), ("content-type", "application/json")],
        nope.as_bytes(),
    );
    assert_eq!((r.status, r.header("x-request-id")), (404, Some("bad-model-1")));
    assert_eq!(get(proxy.addr, "/health").header("x-request-id").map(str::len), Some(32));
    assert!(eventually(std::time::Duration::from_secs(3), || proxy.log.text().contains("bad-model-1")));
    let logged: Vec<String> = proxy
        .log
        .text()
        .lines()
        .filter(|l| l.contains("warmpath::access"))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["fields"]["request_id"].as_str().map(str::to_owned))
        .collect();
    for id in ["client-req-7", made.as_str(), replaced.as_str(), "bad-model-1"] {
        assert!(logged.iter().any(|l| l == id), "{id} not in the access log: {logged:?}");
    }
}
