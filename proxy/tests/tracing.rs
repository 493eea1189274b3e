//! Request traces over OTLP (`[tracing]`), read back by an OTLP receiver that checks every
//! export against OpenTelemetry's own protobuf definitions (`clients/otlp_receiver.py`, on the
//! `opentelemetry-proto` package `scripts/ensure-deps` installs): the request's span and its
//! children for routing, each upstream attempt, the first token, deferred-tool rounds and the
//! safety stage; a client's `traceparent` joined and passed on to the backend.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;

struct Receiver {
    port: u16,
    out: PathBuf,
    child: Child,
    _dir: TempDir,
}

impl Receiver {
    fn start() -> Receiver {
        let dir = TempDir::new();
        let out = dir.path().join("spans.jsonl");
        let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/otlp_receiver.py");
        let mut child = Command::new(&venv)
            .arg(&script)
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the receiver starts (scripts/ensure-deps makes .venv)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("its port");
        let port = line.trim().trim_start_matches("listening ").parse().expect("a port");
        Receiver { port, out, child, _dir: dir }
    }

    fn lines(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }

    /// Every span of trace `id`, waiting for its request's span.
    fn trace(&self, id: &str) -> Vec<Value> {
        let mut spans = Vec::new();
        let whole = eventually(Duration::from_secs(10), || {
            spans = self.lines().into_iter().filter(|s| s["trace_id"] == id).collect();
            spans.iter().any(|s| s["name"] == "warmpath request")
        });
        assert!(whole, "trace {id} never arrived: {:?}", self.lines());
        spans
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

#[test]
fn a_traced_request_has_its_stages_as_spans_and_joins_the_clients_trace() {
    let rx = Receiver::start();
    let dir = TempDir::new();
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        json!([
            {"when": "", "reply": "<tool_call>\n{\"name\": \"tool_search\", \"arguments\": {\"query\": \"weather forecast\"}}\n</tool_call>"},
            {"when": "forecast_days", "reply": "It will be sunny."},
        ])
        .to_string(),
    )
    .expect("script");
    let e = Engine::sim("m", &["--script", &script.display().to_string()]);
    // e0 answers every request 500 (its probes pass): the first attempt fails and is retried
    // on e1.
    let failing = Engine::sim("m", &["--fault-error-rate", "1.0"]);
    let global = format!(
        "[tracing]\notlp_endpoint = \"http://127.0.0.1:{}\"\nservice_name = \"wp-test\"\nexport_interval_ms = 100\n",
        rx.port
    );
    let pool = "policy = \"round_robin\"\n[pools.canon]\nenabled = true\n[pools.tools]\ndefer = true\nthreshold = 2\n\
        [pools.safety.rules]\ndeny = { launch = 'launch code' }\nactions = { launch = \"block\" }\nstages = [\"input\"]\n";
    let proxy = Proxy::start(&policy(&global, pool, &["m"], &[("e0", failing.url()), ("e1", e.url())]));

    let tools: Vec<Value> = [("get_weather", "Fetch the weather forecast for a city."), ("send_mail", "Send an email."), ("list_files", "List files.")]
        .iter()
        .map(|(n, d)| json!({"type": "function", "function": {"name": n, "description": d,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "forecast_days": {"type": "integer"}}}}}))
        .collect();
    let body = json!({"model": "m", "max_tokens": 32, "tools": tools,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}]});
    let theirs = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json"), ("traceparent", theirs)],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("sunny"), "{}", r.text());

    let spans = rx.trace("4bf92f3577b34da6a3ce929d0e0e4736");
    assert!(
        rx.lines().iter().all(|l| l.get("error").is_none()),
        "the receiver refused an export: {:?}",
        rx.lines()
    );
    let root = named(&spans, "warmpath request");
    assert_eq!(root.len(), 1, "{spans:#?}");
    let root = root[0];
    assert_eq!(root["parent"], "00f067aa0ba902b7", "the client's span is the parent");
    assert_eq!((root["service"].as_str(), root["kind"].as_u64()), (Some("wp-test"), Some(2)));
    assert_eq!(root["attributes"]["http.response.status_code"], 200);
    assert_eq!(root["attributes"]["warmpath.backend"], "e1");
    assert_eq!(root["attributes"]["warmpath.request_id"].as_str().map(str::len), Some(32));
    for s in &spans {
        if s["name"] != "warmpath request" {
            assert_eq!(s["parent"], root["span_id"], "{s}");
        }
        assert!(s["end"].as_u64() >= s["start"].as_u64(), "{s}");
        assert!(s["start"].as_u64() >= root["start"].as_u64(), "{s}");
    }
    // Routing chose e0 first (round robin), its attempt failed with a 500, e1 served.
    let routes = named(&spans, "route");
    assert_eq!(routes.len(), 2, "{spans:#?}");
    assert!(routes.iter().all(|s| s["attributes"]["warmpath.reason"] == "round_robin"));
    let attempts = named(&spans, "upstream attempt");
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    assert_eq!(
        (attempts[0]["attributes"]["warmpath.backend"].as_str(), attempts[0]["status"].as_u64()),
        (Some("e0"), Some(2))
    );
    assert_eq!(attempts[1]["attributes"]["warmpath.backend"], "e1");
    assert_eq!(
        (attempts[1]["attributes"]["http.response.status_code"].as_u64(), attempts[1]["kind"].as_u64()),
        (Some(200), Some(3))
    );
    let rounds = named(&spans, "tool_search round");
    assert_eq!(rounds.len(), 1, "{spans:#?}");
    assert_eq!(rounds[0]["attributes"]["warmpath.searches"], 1);
    assert_eq!(named(&spans, "first token").len(), 1, "{spans:#?}");
    let safety = named(&spans, "safety input");
    assert_eq!(safety.len(), 1, "{spans:#?}");
    assert_eq!(safety[0]["attributes"]["warmpath.safety.verdict"], "pass");

    // A request without a traceparent starts its own trace; a blocked one says why.
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "the launch code please", 4));
    assert_eq!(r.status, 400);
    let mut blocked = Vec::new();
    assert!(eventually(Duration::from_secs(10), || {
        blocked = rx
            .lines()
            .into_iter()
            .filter(|s| s["name"] == "safety input" && s["attributes"]["warmpath.safety.verdict"] == "block")
            .collect();
        !blocked.is_empty()
    }));
    assert_ne!(blocked[0]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(blocked[0]["attributes"]["warmpath.safety.category"], "launch");
    let m = proxy.metrics();
    assert!(metric(&m, "warmpath_trace_exports_total{result=\"ok\"}").is_some_and(|n| n >= 1.0), "{m}");
}

#[test]
fn the_backend_gets_warmpaths_span_as_its_parent_and_untraced_requests_pass_theirs_on() {
    let up = Scripted::start_with(|_| {
        json!({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
    });
    let theirs = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let send = |proxy: &Proxy| {
        let body = chat("m", "hi", 2).to_string();
        request(
            proxy.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json"), ("traceparent", theirs)],
            body.as_bytes(),
        )
    };
    // Tracing off: the client's traceparent goes on untouched.
    let plain = Proxy::start(&policy("", "", &["m"], &[("s", up.url())]));
    assert_eq!(send(&plain).status, 200);
    // On (the collector need not be up for this): the backend's parent is warmpath's span.
    let traced = Proxy::start(&policy(
        &format!("[tracing]\notlp_endpoint = \"http://127.0.0.1:{}\"\n", free_port()),
        "",
        &["m"],
        &[("s", up.url())],
    ));
    assert_eq!(send(&traced).status, 200);
    let heads = up.heads.lock().expect("lock").clone();
    let parent_of = |head: &str| {
        head.lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("traceparent: ").map(str::to_owned))
            .expect("a traceparent")
    };
    assert_eq!(parent_of(&heads[0]), theirs);
    let ours = parent_of(&heads[1]);
    assert!(ours.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && ours.ends_with("-01"), "{ours}");
    assert_ne!(ours, theirs);
    // The collector is down: exports fail, counted, and requests do not notice.
    assert!(eventually(Duration::from_secs(5), || {
        metric(&traced.metrics(), "warmpath_trace_exports_total{result=\"error\"}").is_some_and(|n| n >= 1.0)
    }));
}

#[test]
fn a_websocket_turn_is_a_span_of_its_connections_trace() {
    let rx = Receiver::start();
    let e = Engine::sim("m", &[]);
    let global =
        format!("[tracing]\notlp_endpoint = \"http://127.0.0.1:{}\"\nexport_interval_ms = 100\n", rx.port);
    let proxy = Proxy::start(&policy(&global, "", &["m"], &[("e", e.url())]));
    let theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let mut ws = Ws::connect(proxy.addr, &[("traceparent", theirs)]);
    for _ in 0..2 {
        ws.send_json(
            &json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 4}),
        );
        assert!(!ws.turn().is_empty());
    }
    ws.send_frame(true, 8, &1000u16.to_be_bytes());
    let _ = ws.read_frame();
    let spans = rx.trace("0af7651916cd43dd8448eb211c80319c");
    let conn = named(&spans, "warmpath request");
    assert_eq!(conn.len(), 1, "{spans:#?}");
    assert_eq!(
        (conn[0]["parent"].as_str(), conn[0]["attributes"]["warmpath.route"].as_str()),
        (Some("b7ad6b7169203331"), Some("responses_ws"))
    );
    let turns = named(&spans, "websocket turn");
    assert_eq!(turns.len(), 2, "{spans:#?}");
    for t in &turns {
        assert_eq!(t["parent"], conn[0]["span_id"], "{t}");
        assert_eq!(t["attributes"]["warmpath.backend"], "e");
        // Each turn's routing and attempt are its own children.
        for child in ["route", "upstream attempt"] {
            let n = spans.iter().filter(|s| s["name"] == child && s["parent"] == t["span_id"]).count();
            assert_eq!(n, 1, "{child} of {t}: {spans:#?}");
        }
    }
}
