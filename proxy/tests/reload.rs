//! Policy reloads while serving: `POST /reload`, SIGHUP and `--watch` swap the policy in whole;
//! requests in flight finish under the old one, a backend new to a pool is probed before it
//! takes traffic, a removed one drains, WebSockets stay open; a bad file is refused with its
//! `file:line:col` and the old policy keeps serving.

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use warmpath_tests::*;

/// Two pools: `main` (model m) over `main_backends`, `other` (model n) over `f`.
fn two_pools(main_backends: &[(&str, String)], f: &Engine, extra: &str) -> String {
    let mut s = format!("[health]\ninterval_ms = 100\n{extra}\n");
    s.push_str("\n[[pools]]\nname = \"main\"\nmodels = [\"m\"]\nroute_headers = true\n");
    for (name, url) in main_backends {
        s.push_str(&format!("[[pools.backends]]\nname = {name:?}\nurl = {url:?}\n"));
    }
    s.push_str(&format!(
        "\n[[pools]]\nname = \"other\"\nmodels = [\"n\"]\n[[pools.backends]]\nname = \"f\"\nurl = {:?}\n",
        f.url()
    ));
    s
}

fn reload(proxy: &Proxy) -> Resp {
    request(proxy.admin, "POST", "/reload", &[], b"")
}

fn backends_seen(proxy: &Proxy, n: usize) -> HashSet<String> {
    (0..n)
        .filter_map(|_| {
            post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1))
                .header("x-warmpath-backend")
                .map(str::to_owned)
        })
        .collect()
}

#[test]
fn a_reload_swaps_the_policy_and_keeps_what_did_not_change() {
    let e0 = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let e1 = Engine::sim("m", &[]);
    let f = Engine::sim("n", &[]);
    let proxy = Proxy::start(&two_pools(&[("e0", e0.url())], &f, ""));
    let before = proxy.metrics();
    let hash = |m: &str| m.lines().find(|l| l.starts_with("warmpath_config_info{")).map(str::to_owned);
    let first_hash = hash(&before).expect("config info");
    assert_eq!(backends_seen(&proxy, 4), HashSet::from(["e0".to_owned()]));
    // A stream in flight across the reload.
    let (s, head) = open_stream(proxy.addr, "m", 60);
    assert!(head.starts_with("http/1.1 200"), "{head}");

    // e1 joins main; `other` is untouched.
    std::fs::write(&proxy.policy_file, two_pools(&[("e0", e0.url()), ("e1", e1.url())], &f, ""))
        .expect("write");
    let r = reload(&proxy);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("routing state kept in other"), "{}", r.text());
    // The stream finishes under the policy it started with (read to its last chunk: the
    // connection stays open).
    let mut s = s;
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    while !text.contains("0\r\n\r\n") {
        let n = std::io::Read::read(&mut s, &mut buf).expect("stream");
        assert!(n > 0, "closed early: {text}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(text.contains("data: [DONE]"), "{text}");
    // New requests reach e1 once its probes pass.
    assert!(
        eventually(Duration::from_secs(5), || backends_seen(&proxy, 4).contains("e1")),
        "{}",
        proxy.log.text()
    );
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("n", "hi", 1)).status, 200);
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_config_reloads_total{result="ok"}"#), Some(1.0), "{m}");
    let now = hash(&m).expect("config info");
    assert_ne!(now, first_hash);
    assert_eq!(m.lines().filter(|l| l.starts_with("warmpath_config_info{")).count(), 1, "{m}");

    // e0 leaves: it drains (nothing new goes there).
    std::fs::write(&proxy.policy_file, two_pools(&[("e1", e1.url())], &f, "")).expect("write");
    assert_eq!(reload(&proxy).status, 200);
    assert_eq!(backends_seen(&proxy, 4), HashSet::from(["e1".to_owned()]));
    // Its gauges go with it (a series left behind would show it up forever).
    let m = proxy.metrics();
    assert!(!m.contains(r#"warmpath_backend_up{backend="e0""#), "{m}");
    assert_eq!(metric(&m, r#"warmpath_backend_up{backend="e1",pool="main"}"#), Some(1.0), "{m}");
}

#[test]
fn a_bad_file_is_refused_with_its_place_and_the_old_policy_keeps_serving() {
    let e0 = Engine::sim("m", &[]);
    let f = Engine::sim("n", &[]);
    let good = two_pools(&[("e0", e0.url())], &f, "");
    let proxy = Proxy::start(&good);
    std::fs::write(&proxy.policy_file, format!("{good}\n[retry]\nmax_atempts = 2\n")).expect("write");
    let r = reload(&proxy);
    assert_eq!(r.status, 400, "{}", r.text());
    let file = proxy.policy_file.display().to_string();
    assert!(
        r.text().contains(&format!("{file}:")) && r.text().contains("unknown field `max_atempts`"),
        "{}",
        r.text()
    );
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    // What a reload cannot change is named.
    let moved = good.replacen("[health]", "[server]\nthreads = 7\n\n[health]", 1);
    std::fs::write(&proxy.policy_file, moved).expect("write");
    let r = reload(&proxy);
    assert!(r.status == 400 && r.text().contains("cannot change by reload"), "{}", r.text());
    // SIGHUP reloads too (here: the same refusal, in the log).
    let pid = proxy.child.id().to_string();
    assert!(Command::new("kill").args(["-HUP", &pid]).status().expect("kill").success());
    assert!(eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), r#"warmpath_config_reloads_total{result="error"}"#) == Some(3.0)
    }));
    assert!(proxy.log.text().contains("policy not reloaded"), "{}", proxy.log.text());
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert_eq!(request(proxy.admin, "GET", "/reload", &[], b"").status, 405);
}

#[test]
fn watch_reloads_on_change_and_a_websocket_stays_open() {
    let e0 = Engine::sim("m", &[]);
    let e1 = Engine::sim("m", &[]);
    let f = Engine::sim("n", &[]);
    let proxy = Proxy::start_args(&two_pools(&[("e0", e0.url())], &f, ""), true, &["--watch"]);
    let mut ws = Ws::connect(proxy.addr, &[]);
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 2}));
    let done = ws.turn();
    // (The simulated engine writes until max_output_tokens: the response ends incomplete.)
    assert_eq!(done.last().expect("events")["type"], "response.incomplete", "{done:?}");
    // The file changes: warmpath notices within a second or two.
    std::thread::sleep(Duration::from_millis(1100));
    std::fs::write(&proxy.policy_file, two_pools(&[("e1", e1.url())], &f, "")).expect("write");
    assert!(eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), r#"warmpath_config_reloads_total{result="ok"}"#) == Some(1.0)
    }));
    // The open connection's next turn runs under the new policy: on e1.
    let served = eventually(Duration::from_secs(5), || {
        ws.send_json(
            &json!({"type": "response.create", "model": "m", "input": "again", "max_output_tokens": 2}),
        );
        let events = ws.turn();
        let last = events.last().cloned().unwrap_or_default();
        last["type"] == "response.incomplete"
            && metric_sum(&e1.metrics(), "vllm:request_success_total") >= 1.0
    });
    assert!(served, "{}", proxy.log.text());
}

#[test]
fn a_host_name_expands_into_backends_and_is_looked_up_again() {
    let e = Engine::sim("m", &[]);
    let url = e.url().replace("127.0.0.1", "localhost");
    let proxy = Proxy::start(&format!(
        "[upstream]\ndns_refresh_s = 1\n[health]\ninterval_ms = 100\n\n[[pools]]\nname = \"main\"\nmodels = [\"m\"]\n\
         route_headers = true\n[[pools.backends]]\nname = \"svc\"\nurl = {url:?}\nexpand = true\n"
    ));
    // One backend per address of the name (`localhost` may also give ::1, where nothing
    // listens: that one is found down and skipped).
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-warmpath-backend"), Some("svc@127.0.0.1"));
    let up = r#"warmpath_backend_up{backend="svc@127.0.0.1",pool="main"}"#;
    assert_eq!(metric(&proxy.metrics(), up), Some(1.0));
    // The name is looked up again every second; the same addresses change nothing.
    let ok = r#"warmpath_dns_lookups_total{result="ok"}"#;
    assert!(
        eventually(Duration::from_secs(10), || metric(&proxy.metrics(), ok).is_some_and(|n| n >= 2.0)),
        "{}",
        proxy.metrics()
    );
    assert_eq!(metric(&proxy.metrics(), "warmpath_dns_updates_total"), Some(0.0));
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
}
