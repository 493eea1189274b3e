//! Responses WebSocket mode against real engines: a conversation over one connection, the event
//! framing, the errors that keep the connection open and the violations that close it (with
//! the code that says why), limits, and the memory idle connections hold.

use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;
use warmpath_wire::websocket::masked;

fn kinds(events: &[Value]) -> Vec<&str> {
    events.iter().filter_map(|e| e["type"].as_str()).collect()
}

fn terminal(events: &[Value]) -> &Value {
    events.last().expect("events")
}

#[test]
fn a_tool_calling_conversation_over_one_connection_sends_only_new_items() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let mut ws = Ws::connect(proxy.addr, &[("authorization", "Bearer k1")]);

    ws.send_json(&json!({"type": "response.create", "model": "m", "instructions": "You are a weather agent.",
                         "input": "What will the weather be in Oslo tomorrow?", "tools": weather_tools(), "store": false}));
    let first = ws.turn();
    let k = kinds(&first);
    assert_eq!(k[..2], ["response.created", "response.in_progress"], "{k:?}");
    assert_eq!(k.last(), Some(&"response.completed"), "{k:?}");
    assert!(
        k.contains(&"response.function_call_arguments.delta") && k.contains(&"response.output_item.done"),
        "{k:?}"
    );
    for (i, ev) in first.iter().enumerate() {
        assert_eq!(ev["sequence_number"], i as u64, "{ev}");
    }
    let done = &terminal(&first)["response"];
    let call = &done["output"][0];
    assert_eq!(
        (call["type"].as_str(), call["name"].as_str()),
        (Some("function_call"), Some("get_weather")),
        "{done}"
    );
    let id = done["id"].as_str().expect("id").to_owned();

    // Only the new item: the connection holds the rest (even unstored).
    ws.send_json(&json!({"type": "response.create", "model": "m", "instructions": "You are a weather agent.",
                         "previous_response_id": id, "tools": weather_tools(), "store": false,
                         "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny in Oslo"}]}));
    let second = ws.turn();
    let done2 = &terminal(&second)["response"];
    assert_eq!(done2["status"], "completed", "{done2}");
    assert_eq!(done2["output"][0]["content"][0]["text"], "It will be sunny.");
    let cached = done2["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached > 0, "the first turn's prefix is reused: {done2}");

    // Unstored, it lives only on that connection: another connection cannot continue it.
    let mut other = Ws::connect(proxy.addr, &[("authorization", "Bearer k1")]);
    other.send_json(&json!({"type": "response.create", "model": "m", "previous_response_id": done2["id"], "input": "and then?"}));
    let err = other.turn();
    assert_eq!(err.len(), 1, "{err:?}");
    assert_eq!((err[0]["type"].as_str(), err[0]["status"].as_u64()), (Some("error"), Some(400)));
    assert_eq!(err[0]["error"]["code"], "previous_response_not_found");
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, "warmpath_responses_turns_total{outcome=\"completed\",transport=\"websocket\"}"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(metric(&m, "warmpath_websocket_connections{listener=\"api\"}"), Some(2.0), "{m}");
}

#[test]
fn bad_events_get_error_events_and_the_connection_stays_open() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let mut ws = Ws::connect(proxy.addr, &[]);
    for (msg, code) in [
        ("{not json".to_owned(), "invalid_json"),
        (json!({"type": "response.cancel"}).to_string(), "unknown_event_type"),
        (json!({"type": "response.create", "input": "x"}).to_string(), "null"),
        (json!({"type": "response.create", "model": "nope", "input": "x"}).to_string(), "model_not_found"),
        (
            json!({"type": "response.create", "model": "m", "input": "x", "previous_response_id": "resp_x"})
                .to_string(),
            "previous_response_not_found",
        ),
    ] {
        ws.send_frame(true, 1, msg.as_bytes());
        let events = ws.turn();
        assert_eq!(events.len(), 1, "{msg}: {events:?}");
        assert_eq!(events[0]["type"], "error", "{msg}");
        assert_eq!(events[0]["error"]["code"].to_string().trim_matches('"'), code, "{msg}: {}", events[0]);
        assert!(events[0]["status"].as_u64().is_some_and(|s| s >= 400), "{}", events[0]);
    }
    // A ping gets its pong; fragments make one message; the connection still serves turns.
    ws.send_frame(true, 9, b"hello?");
    let pong = ws.read_frame().expect("pong");
    assert_eq!((pong.opcode, pong.payload.as_slice()), (10, &b"hello?"[..]));
    let create =
        json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 3}).to_string();
    let (a, b) = create.as_bytes().split_at(10);
    ws.send_frame(false, 1, a);
    ws.send_frame(true, 0, b);
    let events = ws.turn();
    assert_eq!(terminal(&events)["response"]["status"], "incomplete", "{events:?}");

    // Two at once: the second waits for the first, in order.
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "one", "max_output_tokens": 2, "metadata": {"n": "1"}}));
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "two", "max_output_tokens": 2, "metadata": {"n": "2"}}));
    let one = ws.turn();
    let two = ws.turn();
    assert_eq!(terminal(&one)["response"]["metadata"]["n"], "1");
    assert_eq!(terminal(&two)["response"]["metadata"]["n"], "2");
    assert_eq!(two[0]["sequence_number"], 0, "each response numbers its own events");
}

#[test]
fn protocol_violations_close_with_the_code_that_says_why() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("[websocket]\nmax_message_kib = 1\n", "", &["m"], &[("e0", e.url())]));
    let close_code = |send: &dyn Fn(&mut Ws)| {
        let mut ws = Ws::connect(proxy.addr, &[]);
        send(&mut ws);
        loop {
            match ws.read_frame() {
                Some(f) if f.opcode == 8 => return f.close_code(),
                Some(_) => continue,
                None => return None,
            }
        }
    };
    let unmasked = |ws: &mut Ws| {
        use std::io::Write;
        ws.stream.write_all(&[0x81, 0x02, b'h', b'i']).expect("write");
    };
    assert_eq!(close_code(&unmasked), Some(1002), "unmasked client frame");
    assert_eq!(
        close_code(&|ws| ws.send_frame(true, 1, &vec![b'a'; 2048])),
        Some(1009),
        "over max_message_kib"
    );
    assert_eq!(close_code(&|ws| ws.send_frame(true, 2, b"\x00\x01")), Some(1003), "binary");
    assert_eq!(close_code(&|ws| ws.send_frame(true, 1, &[0xff, 0xfe])), Some(1007), "not UTF-8");
    assert_eq!(
        close_code(&|ws| ws.send_frame(true, 8, &[0x03, 0xe8])),
        Some(1000),
        "the client's close, echoed"
    );
    assert_eq!(
        metric(&proxy.metrics(), "warmpath_websocket_closed_total{code=\"1002\"}"),
        Some(1.0),
        "closes are counted by code"
    );

    // A plain GET or a bad handshake is not upgraded.
    let r = get(proxy.addr, "/v1/responses");
    assert_eq!(r.status, 405);
    let refused =
        Ws::try_connect(proxy.addr, &[("sec-websocket-version", "8")]).err().expect("version 8 refused");
    assert_eq!(
        (refused.status, refused.header("sec-websocket-version")),
        (426, Some("13")),
        "{}",
        refused.text()
    );
}

#[test]
fn limits_on_connections_age_and_idleness() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(
        "[websocket]\nmax_connections = 2\nmax_age_s = 2\nidle_timeout_s = 1\n",
        "",
        &["m"],
        &[("e0", e.url())],
    ));
    let mut a = Ws::connect(proxy.addr, &[]);
    let _b = Ws::connect(proxy.addr, &[]);
    let refused = Ws::try_connect(proxy.addr, &[]).err().expect("third refused");
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.json()["error"]["code"], "websocket_connection_limit_reached");

    // Idle past idle_timeout_s: closed with 1000.
    let f = loop {
        let f = a.read_frame().expect("a frame");
        if f.opcode == 8 {
            break f;
        }
    };
    assert_eq!(f.close_code(), Some(1000));
    assert!(String::from_utf8_lossy(&f.payload[2..]).contains("idle"));
    // The place is free once the server has closed the TCP connection (RFC 6455 §7.1.1: the
    // close frame comes first); a client reconnecting on the close frame alone may still race it.
    assert!(a.read_frame().is_none(), "nothing after the close frame");

    // A busy connection reaches max_age_s: an error event says why, then 1001.
    let mut c = Ws::connect(proxy.addr, &[]);
    let started = std::time::Instant::now();
    let mut saw_limit = false;
    while started.elapsed() < Duration::from_secs(10) {
        c.send_json(&json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 1}));
        let events = c.turn();
        if let Some(e) = events.iter().find(|e| e["type"] == "error") {
            assert_eq!(e["error"]["code"], "websocket_connection_limit_reached", "{e}");
            saw_limit = true;
            break;
        }
        if events.is_empty() {
            break;
        }
    }
    assert!(saw_limit, "the age limit was announced");
    let close = loop {
        match c.read_frame() {
            Some(f) if f.opcode == 8 => break f.close_code(),
            Some(_) => continue,
            None => break None,
        }
    };
    assert_eq!(close, Some(1001));
}

#[test]
fn a_client_that_leaves_mid_turn_cancels_the_generation() {
    let e = Engine::sim("m", &["--sim-itl-ms", "50"]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let mut ws = Ws::connect(proxy.addr, &[]);
    ws.send_json(
        &json!({"type": "response.create", "model": "m", "input": "a long answer", "max_output_tokens": 400}),
    );
    // Wait for the first delta, then vanish.
    while let Some(ev) = ws.next_event() {
        if ev["type"] == "response.output_text.delta" {
            break;
        }
    }
    drop(ws);
    let running = || metric(&e.metrics(), "vllm:num_requests_running").unwrap_or(-1.0);
    assert!(
        eventually(Duration::from_secs(5), || running() == 0.0),
        "the engine still runs it: {}",
        running()
    );
}

/// Reports what 1,000 idle connections cost the proxy (resident memory), and bounds it: a
/// constant per connection (measured 60–75 KB, of which about 43 KB is what pingora holds for
/// any open connection that has sent nothing).
#[test]
fn a_thousand_idle_connections_hold_bounded_memory() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let rss = || rss_kb(proxy.child.id());
    // Warm the process first (threads, buffers), then measure the difference.
    let warm: Vec<Ws> = (0..20).map(|_| Ws::connect(proxy.addr, &[])).collect();
    let before = rss();
    let conns: Vec<Ws> = (0..1000).map(|_| Ws::connect(proxy.addr, &[])).collect();
    assert!(eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), "warmpath_websocket_connections{listener=\"api\"}") == Some(1020.0)
    }));
    let after = rss();
    let per = (after.saturating_sub(before) * 1024) / 1000;
    eprintln!("1000 idle WebSocket connections: RSS {before} kB -> {after} kB, {per} bytes each");
    assert!(per < 128 * 1024, "{per} bytes per idle connection");
    drop((warm, conns));
}

#[test]
fn a_ping_flood_gets_one_pong_per_read() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let mut ws = Ws::connect(proxy.addr, &[]);
    // 200 pings in one write: the server answers the latest it read, not all 200.
    let mut burst = Vec::new();
    for i in 0..200u32 {
        let payload = i.to_be_bytes();
        let mask = [1u8, 2, 3, 4];
        burst.extend_from_slice(&[0x89, 0x80 | 4]);
        burst.extend_from_slice(&mask);
        burst.extend(payload.iter().enumerate().map(|(k, b)| b ^ mask[k % 4]));
    }
    use std::io::Write;
    ws.stream.write_all(&burst).expect("write");
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 1}));
    let mut pongs = Vec::new();
    loop {
        let f = ws.read_frame().expect("frame");
        match f.opcode {
            10 => pongs.push(u32::from_be_bytes(f.payload[..4].try_into().expect("4"))),
            1 if f.json()["type"] == "response.incomplete" || f.json()["type"] == "response.completed" => {
                break
            }
            _ => {}
        }
    }
    assert!(!pongs.is_empty() && pongs.len() < 200, "{} pongs", pongs.len());
    assert_eq!(pongs.last(), Some(&199), "the latest ping is answered");
}

#[test]
fn sigterm_lets_the_response_in_flight_finish_then_closes_with_1012() {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let proxy = Proxy::start(&policy("[server]\ngrace_period_secs = 5\n", "", &["m"], &[("e0", e.url())]));
    let mut busy = Ws::connect(proxy.addr, &[]);
    let mut idle = Ws::connect(proxy.addr, &[]);
    busy.send_json(&json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 40}));
    assert_eq!(busy.next_event().expect("created")["type"], "response.created");
    let status = std::process::Command::new("kill").args(["-TERM", &proxy.child.id().to_string()]).status();
    assert!(status.is_ok_and(|s| s.success()));
    let close_of = |ws: &mut Ws| loop {
        match ws.read_frame() {
            Some(f) if f.opcode == 8 => return f.close_code(),
            Some(_) => continue,
            None => return None,
        }
    };
    assert_eq!(close_of(&mut idle), Some(1012), "an idle connection closes at once");
    let rest = busy.turn();
    assert_eq!(terminal(&rest)["type"], "response.incomplete", "the turn in flight ends: {:?}", kinds(&rest));
    assert_eq!(close_of(&mut busy), Some(1012));
}

#[test]
fn a_warm_up_gives_an_id_to_chain_from_and_no_output() {
    // Chat requests, and token ids (where the pool renders prompts as its engines); routed by
    // what each engine holds.
    for pool in ["policy = \"cache_aware\"", "policy = \"cache_aware\"\n[pools.canon]\ntokenizer = \"wp32k\""]
    {
        let (e0, e1) = (Engine::sim("m", &[]), Engine::sim("m", &[]));
        let proxy = Proxy::start(&policy("", pool, &["m"], &[("e0", e0.url()), ("e1", e1.url())]));
        let mut ws = Ws::connect(proxy.addr, &[]);
        let system = "You are terse. ".repeat(40);
        ws.send_json(&json!({"type": "response.create", "model": "m", "generate": false,
                             "instructions": system, "input": "Remember the number 42."}));
        let warm = ws.turn();
        assert_eq!(
            kinds(&warm),
            ["response.created", "response.in_progress", "response.completed"],
            "{warm:?}"
        );
        let done = &terminal(&warm)["response"];
        assert_eq!(done["output"], json!([]), "{done}");
        // The warm-up prefilled its prompt on one engine (one token, thrown away).
        let prompts = |e: &Engine| metric(&e.metrics(), "vllm:prompt_tokens_total").unwrap_or(0.0);
        let warmed = prompts(&e0) + prompts(&e1);
        assert!(warmed > 100.0, "{pool}: the warm-up reached an engine ({warmed} prompt tokens)");
        ws.send_json(&json!({"type": "response.create", "model": "m", "previous_response_id": done["id"],
                             "instructions": system, "input": "Which number?", "max_output_tokens": 4}));
        let next = ws.turn();
        let r = &terminal(&next)["response"];
        assert_eq!(r["status"], "incomplete", "{next:?}");
        // The first real turn went where the warm-up was, and read its prompt from the cache.
        let cached = r["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        assert!(cached as f64 >= warmed * 0.8, "{pool}: {cached} of the warmed {warmed} tokens cached: {r}");
    }
}

/// A client that stops reading while a long answer streams: the proxy stops reading the backend
/// (a bounded channel per turn) instead of buffering the answer, and everything arrives once
/// the client reads again. The answer (about 30 MB of events) is far larger than the sockets'
/// own buffers, so buffering it in the proxy would show in its memory.
#[test]
fn a_slow_reader_gets_backpressure_not_buffers() {
    let e = Engine::sim("m", &["--sim-itl-ms", "0", "--max-model-len", "131072", "--kv-blocks", "8400"]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let rss_kb = || rss_kb(proxy.child.id());
    let mut ws = Ws::connect(proxy.addr, &[]);
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 8}));
    let _ = ws.turn();
    let before = rss_kb();
    ws.send_json(
        &json!({"type": "response.create", "model": "m", "input": "go on", "max_output_tokens": 120000}),
    );
    // The engine produces the whole answer in a few seconds; the client reads none of it.
    let generated = |e: &Engine| metric(&e.metrics(), "vllm:generation_tokens_total").unwrap_or(0.0);
    let done = eventually(Duration::from_secs(60), || generated(&e) >= 120_000.0);
    // Time for the proxy to take in whatever it would take in.
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss_kb().saturating_sub(before);
    eprintln!("a stalled reader of a 120,000-token answer: generated {done}, proxy RSS grew {grown} kB");
    assert!(grown < 8 * 1024, "the proxy buffered {grown} kB for a client that does not read");
    let events = ws.turn();
    let r = &terminal(&events)["response"];
    assert_eq!(r["usage"]["output_tokens"], 120000, "{}", r["status"]);
}

/// The framing fuzz target's corpus (`proxy/fuzz/corpus/ws_frames`), as a regression suite.
#[test]
fn the_framing_fuzz_corpus_runs_clean() {
    run_fuzz_corpus("ws_frames", warmpath_wire::websocket::fuzz_check);
}

/// What one abusive (or well-behaved) client does, and how its connection must end: with a
/// close code, at the end of the stream (a half-closed socket), or not at all (it keeps
/// serving turns).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Abuse {
    FragmentFlood,
    OversizedFrame,
    OversizedControlFrame,
    InvalidUtf8,
    Unmasked,
    ReservedBits,
    UnknownOpcode,
    Binary,
    CloseHandshake,
    HalfClosed,
    PingFlood,
    WellBehaved,
}

impl Abuse {
    const ALL: [Abuse; 12] = [
        Abuse::FragmentFlood,
        Abuse::OversizedFrame,
        Abuse::OversizedControlFrame,
        Abuse::InvalidUtf8,
        Abuse::Unmasked,
        Abuse::ReservedBits,
        Abuse::UnknownOpcode,
        Abuse::Binary,
        Abuse::CloseHandshake,
        Abuse::HalfClosed,
        Abuse::PingFlood,
        Abuse::WellBehaved,
    ];

    /// The close code it must get; `None`: the connection stays open.
    fn expected(self) -> Option<u16> {
        match self {
            Abuse::FragmentFlood | Abuse::OversizedFrame => Some(1009),
            Abuse::OversizedControlFrame | Abuse::Unmasked | Abuse::ReservedBits | Abuse::UnknownOpcode => {
                Some(1002)
            }
            Abuse::InvalidUtf8 => Some(1007),
            Abuse::Binary => Some(1003),
            Abuse::CloseHandshake => Some(1000),
            Abuse::HalfClosed | Abuse::PingFlood | Abuse::WellBehaved => None,
        }
    }

    fn send(self, ws: &mut Ws) {
        use std::io::Write;
        let turn = json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 2});
        let mut raw = Vec::new();
        match self {
            // 80 fragments of 1 KiB, never finished: past max_message_kib (64).
            Abuse::FragmentFlood => {
                raw.extend(masked(false, 1, &[b'a'; 1024], [1, 2, 3, 4]));
                for _ in 0..79 {
                    raw.extend(masked(false, 0, &[b'a'; 1024], [1, 2, 3, 4]));
                }
            }
            // A header that declares 1 GiB: refused before any of it arrives.
            Abuse::OversizedFrame => raw.extend([0x81, 0xFF, 0, 0, 0, 0, 0x40, 0, 0, 0, 1, 2, 3, 4]),
            Abuse::OversizedControlFrame => raw.extend(masked(true, 9, &[0; 126], [1, 2, 3, 4])),
            Abuse::InvalidUtf8 => raw.extend(masked(true, 1, b"\xce\xba\xed\xa0\x80", [1, 2, 3, 4])),
            Abuse::Unmasked => raw.extend([0x81, 0x02, b'h', b'i']),
            Abuse::ReservedBits => {
                let mut f = masked(true, 1, b"{}", [1, 2, 3, 4]);
                f[0] |= 0x40;
                raw.extend(f);
            }
            Abuse::UnknownOpcode => raw.extend(masked(true, 0x3, b"x", [1, 2, 3, 4])),
            Abuse::Binary => raw.extend(masked(true, 2, b"{}", [1, 2, 3, 4])),
            Abuse::CloseHandshake => raw.extend(masked(true, 8, &[0x03, 0xe8], [1, 2, 3, 4])),
            Abuse::HalfClosed => {
                ws.send_json(&turn);
                ws.stream.shutdown(std::net::Shutdown::Write).expect("half-close");
                return;
            }
            Abuse::PingFlood => {
                for i in 0..300u32 {
                    raw.extend(masked(true, 9, &i.to_be_bytes(), [1, 2, 3, 4]));
                }
                raw.extend(masked(true, 1, turn.to_string().as_bytes(), [5, 6, 7, 8]));
            }
            Abuse::WellBehaved => raw.extend(masked(true, 1, turn.to_string().as_bytes(), [5, 6, 7, 8])),
        }
        ws.stream.write_all(&raw).expect("write");
    }
}

/// How a connection came out: its close code, `Ended` without one, or a finished turn.
#[derive(Debug, PartialEq)]
enum End {
    Closed(Option<u16>),
    Ended,
    Turn,
}

fn outcome(ws: &mut Ws) -> End {
    loop {
        match ws.read_frame() {
            Some(f) if f.opcode == 8 => return End::Closed(f.close_code()),
            Some(f) if f.opcode == 1 => {
                let t = f.json()["type"].as_str().unwrap_or("").to_owned();
                if t == "response.completed" || t == "response.incomplete" {
                    return End::Turn;
                }
            }
            Some(_) => continue,
            None => return End::Ended,
        }
    }
}

#[test]
fn abuse_on_a_thousand_connections_closes_each_with_its_code_and_disturbs_none() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("[websocket]\nmax_message_kib = 64\n", "", &["m"], &[("e0", e.url())]));
    let mut conns: Vec<(Abuse, Ws)> =
        (0..1000).map(|i| (Abuse::ALL[i % Abuse::ALL.len()], Ws::connect(proxy.addr, &[]))).collect();
    assert!(eventually(Duration::from_secs(10), || {
        metric(&proxy.metrics(), "warmpath_websocket_connections{listener=\"api\"}") == Some(1000.0)
    }));
    for (abuse, ws) in conns.iter_mut() {
        abuse.send(ws);
    }
    let mut wrong = Vec::new();
    for (i, (abuse, ws)) in conns.iter_mut().enumerate() {
        let got = outcome(ws);
        let ok = match (abuse.expected(), &got) {
            (Some(code), End::Closed(c)) => *c == Some(code),
            // A client's FIN without a close frame ends the connection (RFC 6455 7.1.5: closed
            // abnormally, 1006, which is never sent); its turn is abandoned.
            (None, End::Ended) => abuse == &Abuse::HalfClosed,
            (None, End::Turn) => abuse != &Abuse::HalfClosed,
            _ => false,
        };
        if !ok {
            wrong.push(format!("#{i} {abuse:?}: {got:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} connections ended wrongly: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    // The ping-flooded and well-behaved ones serve another turn, undisturbed by their
    // neighbours.
    for (abuse, ws) in conns.iter_mut() {
        match abuse {
            Abuse::PingFlood | Abuse::WellBehaved => {
                ws.send_json(&json!({"type": "response.create", "model": "m", "input": "again", "max_output_tokens": 2}));
                assert_eq!(outcome(ws), End::Turn);
            }
            _ => {}
        }
    }
    let open = conns.iter().filter(|(a, _)| matches!(a, Abuse::PingFlood | Abuse::WellBehaved)).count();
    assert!(
        eventually(Duration::from_secs(10), || {
            metric(&proxy.metrics(), "warmpath_websocket_connections{listener=\"api\"}") == Some(open as f64)
        }),
        "{}",
        proxy.metrics()
    );
    drop(conns);
    assert!(eventually(Duration::from_secs(10), || {
        metric(&proxy.metrics(), "warmpath_websocket_connections{listener=\"api\"}") == Some(0.0)
    }));
    // Nothing left in flight: the abandoned turns freed their backend slots.
    assert!(
        eventually(Duration::from_secs(10), || {
            metric(&proxy.metrics(), "warmpath_inflight_requests") == Some(0.0)
        }),
        "{}",
        proxy.metrics()
    );
}
