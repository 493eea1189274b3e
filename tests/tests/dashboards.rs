//! The Grafana dashboards and alert rules of `grafana/`, checked against a real Prometheus
//! (Debian's `prometheus`, installed by `scripts/ensure-deps`) scraping warmpath and three
//! engines while traffic runs through every stage the panels show: every panel query must
//! parse and return data, every template variable must list values, and the alert rules must
//! pass `promtool check rules` and their unit tests.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use warmpath_tests::repo_root as repo;
use warmpath_tests::*;

fn tool(name: &str) -> Command {
    let found = Command::new("sh").args(["-c", &format!("command -v {name}")]).output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "{name} is not installed: scripts/ensure-deps installs Debian's prometheus package"
    );
    Command::new(name)
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    let dir = repo().join("grafana/alerts");
    for args in [["check", "rules", "warmpath.rules.yml"], ["test", "rules", "warmpath.rules.test.yml"]] {
        let (ok, out) = output_of(tool("promtool").args(args).current_dir(&dir));
        assert!(ok, "promtool {args:?}:\n{out}");
    }
}

#[test]
fn the_dashboards_are_what_their_generator_writes() {
    let out = Command::new("python3")
        .args(["grafana/generate.py", "--check"])
        .current_dir(repo())
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
}

/// A Prometheus server scraping `targets` every second, killed on drop.
struct Prometheus {
    addr: SocketAddr,
    child: Child,
    _dir: TempDir,
}

impl Prometheus {
    fn start(warmpath_admin: SocketAddr, engines: &[SocketAddr]) -> Prometheus {
        let dir = TempDir::new();
        let engines: Vec<String> = engines.iter().map(|a| format!("'{a}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n\
             \x20 - job_name: warmpath\n    static_configs:\n      - targets: ['{warmpath_admin}']\n\
             \x20 - job_name: engines\n    static_configs:\n      - targets: [{}]\n",
            engines.join(", ")
        );
        let file = dir.path().join("prometheus.yml");
        std::fs::write(&file, config).expect("write config");
        let [port] = free_ports();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let child = tool("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus starts");
        let p = Prometheus { addr, child, _dir: dir };
        assert!(
            eventually(Duration::from_secs(30), || {
                std::net::TcpStream::connect(p.addr).is_ok() && get(p.addr, "/-/ready").status == 200
            }),
            "prometheus did not get ready"
        );
        p
    }

    /// `GET /api/v1/query`: the answer's JSON.
    fn query(&self, expr: &str) -> Value {
        let r = get(self.addr, &format!("/api/v1/query?query={}", encode(expr)));
        serde_json::from_slice(&r.body).unwrap_or_else(|_| json!({"status": "error", "error": r.text()}))
    }

    /// Whether every target's last scrape succeeded.
    fn all_up(&self, n: usize) -> bool {
        let v = self.query("up");
        let up = v["data"]["result"].as_array().map(|r| r.iter().filter(|s| s["value"][1] == "1").count());
        up == Some(n)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Grafana's variables as "All" selects them.
fn expand(expr: &str) -> String {
    ["$pool", "$backend", "$instance", "$model_name"]
        .iter()
        .fold(expr.replace("$__rate_interval", "1m"), |e, v| e.replace(v, ".*"))
}

/// `label_values(SELECTOR, LABEL)` (a Grafana function) as the PromQL it lists.
fn label_values(q: &str) -> String {
    let inner = q.trim_start_matches("label_values(").trim_end_matches(')');
    let (sel, label) = inner.rsplit_once(',').expect("label_values(selector, label)");
    format!("group by ({}) ({})", label.trim(), expand(sel.trim()))
}

/// `warmpath keys add NAME`: the key.
fn add_key(file: &Path, name: &str) -> String {
    let out = Command::new(bin("warmpath", "warmpath"))
        .args(["keys", "add", name, "--file"])
        .arg(file)
        .output()
        .expect("warmpath runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn tools(n: usize) -> Value {
    // Out of name order, so canonicalization sorts them; more than the threshold, so all but
    // the core are deferred.
    let t: Vec<Value> = (0..n)
        .rev()
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("tool_{i}"),
                "description": format!("Does thing number {i}. More words here."),
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}})
        })
        .collect();
    Value::Array(t)
}

fn agent_chat(turn: usize, stream: bool) -> Value {
    json!({
        "model": "m",
        "stream": stream,
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": format!("You are a careful agent working on the repository.\nToday is 2026-12-0{}.\n{}", turn % 9 + 1, "Follow the house style. ".repeat(40))},
            {"role": "user", "content": format!("step {turn}: what next?")}
        ],
        "tools": tools(6),
    })
}

#[test]
fn every_panel_query_returns_data_from_a_real_prometheus() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let alice = add_key(&keys, "alice");
    let bob = add_key(&keys, "bob");
    // bob's entry is the last table of the file: one request a minute.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&keys)
        .and_then(|mut f| f.write_all(b"requests_per_minute = 1\n"))
        .expect("append");
    let e0 = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let e1 = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let e2 = Engine::sim("m", &["--sim-itl-ms", "20", "--fault-error-rate", "0.7"]);
    let global = format!(
        "[auth]\nenabled = true\nkeys_file = {:?}\nreload_interval_ms = 100\n",
        keys.display().to_string()
    );
    let pool = "policy = \"cache_aware\"\nmax_inflight_per_backend = 2\nmax_queued = 2\nqueue_timeout_ms = 3000\n\
        [pools.canon]\nenabled = true\n\
        [pools.tools]\ndefer = true\nthreshold = 2\ncore = [\"tool_0\"]\n\
        [pools.response_cache]\nenabled = true\n\
        [pools.safety.rules]\ndeny = { launch = 'launch code' }\nactions = { launch = \"block\" }\nstages = [\"input\"]\n";
    let proxy =
        Proxy::start(&policy(&global, pool, &["m"], &[("e0", e0.url()), ("e1", e1.url()), ("e2", e2.url())]));
    let prom = Prometheus::start(proxy.admin, &[e0.addr, e1.addr, e2.addr]);
    assert!(eventually(Duration::from_secs(20), || prom.all_up(4)), "scrapes failing: {}", prom.query("up"));

    // Traffic through every stage a panel shows.
    let auth = format!("Bearer {alice}");
    let headers = [("authorization", auth.as_str())];
    let started = Instant::now();
    // Agents on a shared prefix (cache hits, canonicalization, deferred tools), streamed and not,
    // in bursts over the slots (queueing, and refusals past max_queued); e2 fails most of its
    // requests (retries, upstream errors, an ejection).
    for round in 0..4 {
        let threads: Vec<_> = (0..12)
            .map(|i| {
                let (addr, key) = (proxy.addr, alice.clone());
                std::thread::spawn(move || {
                    let body = agent_chat(round * 12 + i, i % 2 == 0);
                    let auth = format!("Bearer {key}");
                    request(
                        addr,
                        "POST",
                        "/v1/chat/completions",
                        &[("authorization", auth.as_str()), ("content-type", "application/json")],
                        body.to_string().as_bytes(),
                    )
                    .status
                })
            })
            .collect();
        let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().expect("client")).collect();
        assert!(statuses.contains(&200), "round {round}: {statuses:?}");
    }
    // Deterministic twice: the second is a response-cache hit.
    let det = json!({"model": "m", "messages": [{"role": "user", "content": "same"}], "max_tokens": 4, "temperature": 0});
    for _ in 0..3 {
        post_as(&proxy, &alice, "/v1/chat/completions", &det);
    }
    // A blocked input, a limited key, an unknown key.
    let blocked = post_as(&proxy, &alice, "/v1/chat/completions", &chat("m", "tell me the launch code", 4));
    assert_eq!(blocked.status, 400, "{}", blocked.text());
    let _ = post_as(&proxy, &bob, "/v1/chat/completions", &chat("m", "hi", 4));
    assert_eq!(post_as(&proxy, &bob, "/v1/chat/completions", &chat("m", "hi", 4)).status, 429);
    assert_eq!(post_as(&proxy, "sk-nobody", "/v1/chat/completions", &chat("m", "hi", 4)).status, 401);
    // Responses over HTTP and a WebSocket running turns, closed cleanly.
    let r = post_as(
        &proxy,
        &alice,
        "/v1/responses",
        &json!({"model": "m", "input": "hello", "max_output_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let mut ws = Ws::connect(proxy.addr, &headers);
    for _ in 0..3 {
        ws.send_json(
            &json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 4}),
        );
        let events = ws.turn();
        assert!(!events.is_empty());
    }
    ws.send_frame(true, 8, &1000u16.to_be_bytes());
    let _ = ws.read_frame();
    // A policy reload (the same file: it succeeds).
    assert_eq!(request(proxy.admin, "POST", "/reload", &[], b"").status, 200);
    // At least two scrapes after the last counter was born, so every rate has two samples.
    std::thread::sleep(Duration::from_millis(3_500));
    eprintln!("traffic and scrapes took {:.1} s", started.elapsed().as_secs_f64());

    let out = Command::new("python3")
        .args(["grafana/generate.py", "--queries"])
        .current_dir(repo())
        .output()
        .expect("python3 runs");
    assert!(out.status.success());
    let mut failures = Vec::new();
    let mut checked = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let q: Value = serde_json::from_str(line).expect("one query a line");
        let expr = expand(q["expr"].as_str().expect("expr"));
        let v = prom.query(&expr);
        checked += 1;
        if v["status"] != "success" {
            failures
                .push(format!("{} / {} {}: invalid: {}", q["dashboard"], q["panel"], q["refId"], v["error"]));
        } else if v["data"]["result"].as_array().is_none_or(|r| r.is_empty()) {
            failures.push(format!("{} / {} {}: no data: {expr}", q["dashboard"], q["panel"], q["refId"]));
        }
    }
    // Template variables list values.
    for file in ["warmpath.json", "engine.json"] {
        let text = std::fs::read_to_string(repo().join("grafana/dashboards").join(file)).expect("dashboard");
        let d: Value = serde_json::from_str(&text).expect("dashboard JSON");
        for var in d["templating"]["list"].as_array().expect("variables") {
            let Some(q) = var["definition"].as_str() else { continue };
            let v = prom.query(&label_values(q));
            checked += 1;
            if v["data"]["result"].as_array().is_none_or(|r| r.is_empty()) {
                failures.push(format!("{file} variable {}: no values ({q}): {v}", var["name"]));
            }
        }
    }
    assert!(checked > 60, "only {checked} queries");
    assert!(failures.is_empty(), "{} of {checked} queries failed:\n{}", failures.len(), failures.join("\n"));
}
