//! A pool whose every backend is full: requests wait in its queue for the first free slot —
//! in arrival order, higher priorities first — and get 429 with `retry-after` when the queue
//! is full or they waited `queue_timeout_ms` in vain.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use warmpath_tests::*;

/// A chat request for one token with `x-warmpath-priority` where given: its status and when it
/// was answered.
fn ask(addr: SocketAddr, priority: Option<&str>) -> (u16, Instant) {
    let body = chat("m", "hi", 1).to_string();
    let mut headers = vec![("content-type", "application/json")];
    if let Some(p) = priority {
        headers.push(("x-warmpath-priority", p));
    }
    let r = request(addr, "POST", "/v1/chat/completions", &headers, body.as_bytes());
    (r.status, Instant::now())
}

fn one_slot(queue: &str) -> (Engine, Proxy) {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let pool = format!("max_inflight_per_backend = 1\n{queue}");
    let proxy = Proxy::start(&policy("", &pool, &["m"], &[("e", e.url())]));
    (e, proxy)
}

#[test]
fn a_request_waits_for_the_slot_instead_of_a_429() {
    let (_e, proxy) = one_slot("queue_timeout_ms = 10000");
    // The only slot is held by a stream of about a second.
    let (s, head) = open_stream(proxy.addr, "m", 50);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let addr = proxy.addr;
    let waiting = std::thread::spawn(move || ask(addr, None));
    assert!(eventually(Duration::from_secs(5), || metric(
        &proxy.metrics(),
        r#"warmpath_queue_depth{pool="main"}"#
    ) == Some(1.0)));
    let (status, _) = waiting.join().expect("client");
    assert_eq!(status, 200, "served once the stream ended");
    drop(s);
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_queue_wait_seconds_count{pool="main"}"#), Some(1.0), "{m}");
    assert_eq!(metric(&m, r#"warmpath_queue_depth{pool="main"}"#), Some(0.0), "{m}");
}

#[test]
fn a_full_queue_and_a_wait_past_the_timeout_get_429() {
    let (_e, proxy) = one_slot("queue_timeout_ms = 1000\nmax_queued = 1");
    // 400 tokens at 20 ms: the slot stays taken for 8 s.
    let (_s, head) = open_stream(proxy.addr, "m", 400);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let addr = proxy.addr;
    let queued = std::thread::spawn(move || ask(addr, None));
    assert!(eventually(Duration::from_secs(5), || metric(
        &proxy.metrics(),
        r#"warmpath_queue_depth{pool="main"}"#
    ) == Some(1.0)));
    // The queue holds one: the next is refused at once.
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (429, Some("backends_saturated")),
        "{}",
        r.text()
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    // The queued one waits its second, then gets the same 429.
    assert_eq!(queued.join().expect("client").0, 429);
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_queue_rejected_total{pool="main",reason="full"}"#), Some(1.0), "{m}");
    assert_eq!(
        metric(&m, r#"warmpath_queue_rejected_total{pool="main",reason="timeout"}"#),
        Some(1.0),
        "{m}"
    );
}

#[test]
fn a_higher_priority_goes_first_and_equal_ones_keep_their_order() {
    let (_e, proxy) = one_slot("queue_timeout_ms = 20000");
    let (s, head) = open_stream(proxy.addr, "m", 400);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let depth = |n: f64| {
        eventually(Duration::from_secs(5), || {
            metric(&proxy.metrics(), r#"warmpath_queue_depth{pool="main"}"#) == Some(n)
        })
    };
    let addr = proxy.addr;
    let first = std::thread::spawn(move || ask(addr, None));
    assert!(depth(1.0));
    let second = std::thread::spawn(move || ask(addr, None));
    assert!(depth(2.0));
    let urgent = std::thread::spawn(move || ask(addr, Some("5")));
    assert!(depth(3.0));
    // The slot is freed: the three are served one at a time, the urgent one first.
    drop(s);
    let (first, second, urgent) =
        (first.join().expect("first"), second.join().expect("second"), urgent.join().expect("urgent"));
    assert_eq!((first.0, second.0, urgent.0), (200, 200, 200));
    assert!(urgent.1 < first.1 && first.1 < second.1, "served out of order");
}

#[test]
fn a_prompt_that_cannot_fit_the_context_is_refused_before_it_leaves() {
    let e = Engine::sim("m", &[]);
    let pool = "max_model_len = 64\n[pools.canon]\ntokenizer = \"wp32k\"";
    let proxy = Proxy::start(&policy("", pool, &["m"], &[("e", e.url())]));
    let long = "many words to count ".repeat(40);
    for (body, what) in [(chat("m", &long, 4), "a long prompt"), (chat("m", "hi", 1000), "a long completion")]
    {
        let r = post_json(proxy.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let err = &r.json()["error"];
        assert_eq!(
            (err["code"].as_str(), err["param"].as_str()),
            (Some("context_length_exceeded"), Some("messages"))
        );
        assert!(
            err["message"].as_str().unwrap_or("").contains("maximum context length is 64 tokens"),
            "{err}"
        );
    }
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 8)).status, 200);
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, r#"warmpath_rejections_total{reason="context_length_exceeded"}"#),
        Some(2.0),
        "{m}"
    );
    // The engine never saw the refused ones.
    assert_eq!(metric_sum(&e.metrics(), "vllm:request_success_total"), 1.0);
}

/// A backend busy while it answers a chat (1.5 s each): meanwhile its `/health` takes 1 s, as
/// an engine tokenizing a huge prompt answers late; idle, at once.
fn slow_backend() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let chats = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let served = chats.clone();
    let active = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let (served, active) = (served.clone(), active.clone());
            std::thread::spawn(move || {
                use std::sync::atomic::Ordering::Relaxed;
                let mut buf = vec![0u8; 65536];
                let n = s.read(&mut buf).unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                let body = if req.starts_with("GET /health") {
                    if active.load(Relaxed) > 0 {
                        std::thread::sleep(Duration::from_millis(1000));
                    }
                    String::new()
                } else {
                    active.fetch_add(1, Relaxed);
                    std::thread::sleep(Duration::from_millis(1500));
                    active.fetch_sub(1, Relaxed);
                    served.fetch_add(1, Relaxed);
                    serde_json::json!({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                    .to_string()
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(format!("{head}{body}").as_bytes());
            });
        }
    });
    (addr, chats)
}

#[test]
fn a_busy_backend_that_answers_its_probes_late_is_not_taken_for_dead() {
    let (addr, chats) = slow_backend();
    let global = "[health]\ninterval_ms = 100\ntimeout_ms = 200\nunhealthy_threshold = 1\n";
    let proxy = Proxy::start(&policy(global, "", &["m"], &[("slow", format!("http://{addr}"))]));
    // Requests in flight the whole time (each 1.5 s): the late probes count as busy.
    let a = proxy.addr;
    let clients: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300 * i));
                post_json(a, "/v1/chat/completions", &chat("m", "hi", 1)).status
            })
        })
        .collect();
    let statuses: Vec<u16> = clients.into_iter().map(|c| c.join().expect("client")).collect();
    // None refused as "no healthy backend" while it served.
    assert_eq!(statuses, [200, 200, 200], "{}", proxy.log.text());
    assert_eq!(chats.load(std::sync::atomic::Ordering::Relaxed), 3);
    assert!(
        metric_sum(
            &proxy.metrics(),
            r#"warmpath_health_checks_total{backend="slow",pool="main",result="busy"}"#
        ) >= 1.0
    );
}

#[test]
fn bodies_and_messages_held_at_once_are_bounded_for_the_whole_process() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("[limits]\nmax_buffered_mib = 1\n", "", &["m"], &[("e", e.url())]));
    // A body larger than the whole budget (but under max_body_bytes): 503 with retry-after.
    let mut big = chat("m", "hi", 1);
    big["padding"] = serde_json::json!("x".repeat(2 << 20));
    let r = post_json(proxy.addr, "/v1/chat/completions", &big);
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (503, Some("server_busy")), "{}", r.text());
    assert!(r.header("retry-after").is_some());
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    // WebSockets: one holds most of the budget in an unfinished message; the next one that
    // would go past it is closed with 1013 (try again later), and the first carries on.
    let mut holding = Ws::connect(proxy.addr, &[]);
    holding.send_frame(false, 1, &vec![b'a'; 700 << 10]);
    // (Held in full before the second one sends: which one goes past the budget is then known.)
    assert!(eventually(Duration::from_secs(10), || {
        metric(&proxy.metrics(), "warmpath_buffered_bytes").unwrap_or(0.0) >= (700 << 10) as f64
    }));
    let mut second = Ws::connect(proxy.addr, &[]);
    second.send_frame(false, 1, &vec![b'b'; 700 << 10]);
    let close = loop {
        match second.read_frame() {
            Some(f) if f.opcode == 8 => break f.close_code(),
            Some(_) => continue,
            None => break None,
        }
    };
    assert_eq!(close, Some(1013));
    let m = proxy.metrics();
    assert!(metric(&m, "warmpath_buffered_bytes").unwrap_or(0.0) >= (700 << 10) as f64, "{m}");
    assert!(metric(&m, r#"warmpath_rejections_total{reason="buffers_full"}"#).unwrap_or(0.0) >= 2.0, "{m}");
    drop(holding);
    assert!(eventually(Duration::from_secs(5), || metric(&proxy.metrics(), "warmpath_buffered_bytes")
        == Some(0.0)));
}

#[test]
fn connections_past_the_bound_are_shed_while_probes_and_the_admin_port_answer() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("[limits]\nmax_connections = 2\n", "", &["m"], &[("e", e.url())]));
    // The start-up probe's connection closes first: a shed connection's health check is
    // answered 200 too, so one of the two below could otherwise be shed unseen.
    assert!(eventually(Duration::from_secs(5), || metric(&proxy.metrics(), "warmpath_connections_open")
        == Some(0.0)));
    // Two kept-alive connections, each having served a request, fill the listener.
    let held: Vec<std::net::TcpStream> = (0..2)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(proxy.addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            std::io::Write::write_all(&mut s, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").expect("write");
            let mut buf = [0u8; 512];
            let n = std::io::Read::read(&mut s, &mut buf).expect("read");
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
            s
        })
        .collect();
    assert!(eventually(Duration::from_secs(5), || metric(&proxy.metrics(), "warmpath_connections_open")
        == Some(2.0)));
    // A third: 503 in the OpenAI shape, with retry-after, before anything is routed.
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (503, Some("too_many_connections")),
        "{}",
        r.text()
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    // A load balancer's probe is still answered: the proxy is busy, not dead.
    assert_eq!(request(proxy.addr, "GET", "/health", &[], b"").status, 200);
    let m = proxy.metrics();
    assert_eq!(metric(&m, "warmpath_connections_rejected_total"), Some(2.0), "{m}");
    // A freed slot is taken again.
    drop(held);
    assert!(eventually(Duration::from_secs(5), || metric(&proxy.metrics(), "warmpath_connections_open")
        == Some(0.0)));
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
}
