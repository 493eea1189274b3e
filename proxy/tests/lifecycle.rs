//! warmpath's life as an operator sees it: SIGTERM drains (at once when idle, streams finishing
//! within the grace period, the rest ended with an error event after it), SIGKILL takes the
//! embedded engines with it, `/health` on the API port, idle kept-alive connections closed, a
//! successor taking the sockets over (`--upgrade`) while requests and a WebSocket turn run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use warmpath_tests::*;

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([&format!("-{sig}"), &child.id().to_string()]).status().expect("kill");
    assert!(ok.success());
}

/// The exit status, once the process has exited within `limit`.
fn exited(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A streamed chat request for `max_tokens`, its answer begun: the connection.
fn stream(addr: SocketAddr, max_tokens: u32) -> TcpStream {
    let (s, head) = open_stream(addr, "m", max_tokens);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    s
}

fn rest(mut s: TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn sigterm_exits_at_once_when_nothing_is_in_flight() {
    let e = Engine::sim("m", &[]);
    let mut proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 2)).status, 200);
    signal(&proxy.child, "TERM");
    // Not the 30 s grace period (nor pingora's 35 s before): nothing is left to wait for.
    let status = exited(&mut proxy.child, Duration::from_secs(5));
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{}", proxy.log.text());
    assert!(proxy.log.text().contains("drained; exiting"), "{}", proxy.log.text());
}

#[test]
fn sigterm_lets_a_stream_finish_and_takes_no_new_connections() {
    let e = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let mut proxy = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let s = stream(proxy.addr, 60);
    signal(&proxy.child, "TERM");
    assert!(
        eventually(Duration::from_secs(3), || TcpStream::connect(proxy.addr).is_err()),
        "the listener still accepts"
    );
    let text = rest(s);
    assert!(text.contains("data: [DONE]") && text.ends_with("0\r\n\r\n"), "a whole stream: {text}");
    assert!(!text.contains("server_shutting_down"), "{text}");
    let status = exited(&mut proxy.child, Duration::from_secs(5));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

#[test]
fn a_stream_past_the_grace_period_ends_with_an_error_event() {
    let e = Engine::sim("m", &["--sim-itl-ms", "50"]);
    let mut proxy =
        Proxy::start(&policy("[server]\ngrace_period_secs = 1\n", "", &["m"], &[("e0", e.url())]));
    // 400 tokens at 50 ms: 20 s, far past the grace period.
    let s = stream(proxy.addr, 400);
    let sent = Instant::now();
    signal(&proxy.child, "TERM");
    let text = rest(s);
    assert!(text.contains("\"code\":\"server_shutting_down\""), "{text}");
    assert!(text.contains("data: [DONE]") && text.ends_with("0\r\n\r\n"), "ended cleanly: {text}");
    assert!(sent.elapsed() < Duration::from_secs(10), "ended after {:?}", sent.elapsed());
    let status = exited(&mut proxy.child, Duration::from_secs(5));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    // The engine's generation was cancelled with it: it takes a new request at once.
    assert_eq!(post_json(e.addr, "/v1/chat/completions", &chat("m", "hi", 2)).status, 200);
}

#[test]
fn sigkill_takes_the_embedded_engines_with_it() {
    let global = "[log]\nlevel = \"info\"\n";
    let pool = "[pools.embedded]\nreplicas = 2\nmodel = \"micro\"\nexecutor = \"sim\"\n";
    let mut proxy = Proxy::start(&format!("{global}\n[[pools]]\nname = \"e\"\nmodels = [\"m\"]\n{pool}"));
    // The log's text without its colours.
    let log: String =
        proxy.log.text().split('\x1b').map(|p| p.split_once('m').map_or(p, |(_, t)| t)).collect();
    let replicas: Vec<SocketAddr> = log
        .lines()
        .filter(|l| l.contains("embedded engine replica listening"))
        .filter_map(|l| l.split("addr=").nth(1)?.split_whitespace().next()?.trim_matches('"').parse().ok())
        .collect();
    assert_eq!(replicas.len(), 2, "{log}");
    assert!(replicas.iter().all(|a| TcpStream::connect(a).is_ok()));
    signal(&proxy.child, "KILL");
    assert!(exited(&mut proxy.child, Duration::from_secs(5)).is_some());
    // In-process replicas: nothing outlives the process.
    assert!(replicas.iter().all(|a| TcpStream::connect(a).is_err()), "a replica outlived warmpath");
}

#[test]
fn health_on_the_api_port_says_whether_a_backend_takes_traffic() {
    let mut e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(
        "[health]\ninterval_ms = 100\nunhealthy_threshold = 1\n",
        "",
        &["m"],
        &[("e0", e.url())],
    ));
    let r = get(proxy.addr, "/health");
    assert_eq!((r.status, r.body.len()), (200, 0), "{}", r.text());
    e.kill();
    assert!(eventually(Duration::from_secs(5), || get(proxy.addr, "/health").status == 503));
    let r = get(proxy.addr, "/health");
    assert_eq!(r.json()["error"]["code"], "not_ready", "{}", r.text());
    assert!(r.text().contains("main"), "names the pool: {}", r.text());
}

#[test]
fn an_idle_kept_alive_connection_is_closed() {
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy("[limits]\nkeepalive_idle_s = 1\n", "", &["m"], &[("e0", e.url())]));
    let mut s = TcpStream::connect(proxy.addr).expect("connect");
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").expect("send");
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).expect("answer");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Idle past the timeout: warmpath closes its side.
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let t = Instant::now();
    let n = s.read(&mut buf).expect("closed, not timed out");
    assert_eq!(n, 0, "{}", String::from_utf8_lossy(&buf[..n]));
    assert!(t.elapsed() < Duration::from_secs(5), "closed after {:?}", t.elapsed());
}

#[test]
fn a_successor_takes_the_sockets_over_without_a_failed_request() {
    let e = Engine::sim("m", &["--sim-itl-ms", "2"]);
    let mut old = Proxy::start(&policy("", "", &["m"], &[("e0", e.url())]));
    let addr = old.addr;
    // A client sending one request after another, a new connection each, the whole time.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut statuses = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                statuses.push(post_json(addr, "/v1/chat/completions", &chat("m", "hi", 4)).status);
            }
            statuses
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // A WebSocket with a turn in flight on the old process: the turn finishes there, then the
    // connection is closed with 1012 (restart) and the client reconnects to the successor.
    let mut ws = Ws::connect(addr, &[]);
    ws.send_json(&serde_json::json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 400}));
    assert_eq!(ws.next_event().expect("the turn started")["type"], "response.created");
    let mut new = old.successor();
    let events = ws.turn();
    let last = events.last().expect("events")["type"].as_str().unwrap_or("").to_owned();
    assert!(
        last == "response.completed" || last == "response.incomplete",
        "the turn in flight finished: {last}"
    );
    let close = std::iter::from_fn(|| ws.read_frame()).find(|f| f.opcode == 8).and_then(|f| f.close_code());
    assert_eq!(close, Some(1012), "then the old process closes it: restart");
    let status = exited(&mut old.child, Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "the old process drains and exits: {status:?}\n{}",
        old.log.text()
    );
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = client.join().expect("client");
    let failed: Vec<&u16> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {failed:?}\n{}",
        failed.len(),
        statuses.len(),
        new.log.text()
    );
    assert!(statuses.len() > 20, "{} requests", statuses.len());
    // The successor serves, WebSockets too, and holds the pid file now.
    assert_eq!(get(addr, "/health").status, 200);
    let mut again = Ws::connect(addr, &[]);
    again.send_json(
        &serde_json::json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 2}),
    );
    let last = again.turn().last().expect("events")["type"].as_str().unwrap_or("").to_owned();
    assert!(last == "response.completed" || last == "response.incomplete", "{last}");
    let pid_file = std::env::temp_dir().join(format!("warmpath-{}.pid", addr.port()));
    assert_eq!(std::fs::read_to_string(pid_file).expect("pid file").trim(), new.child.id().to_string());
    assert!(exited(&mut new.child, Duration::from_millis(10)).is_none(), "the successor runs");
}
