//! The admin listener's status page (`GET /`, drawing `GET /status.json`) while traffic flows:
//! its JSON checked field by field, and the page rendered by a real browser (Debian's headless
//! Chromium, installed by `scripts/ensure-deps`) whose DOM must show what the JSON says.

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;

fn chromium() -> &'static str {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        let found = Command::new("sh").args(["-c", &format!("command -v {name}")]).output();
        if found.is_ok_and(|o| o.status.success()) {
            return name;
        }
    }
    panic!("no Chromium installed: scripts/ensure-deps installs Debian's chromium");
}

/// Runs headless Chromium on `url` with `args`; its stdout.
fn browse(url: &str, args: &[&str]) -> String {
    let dir = TempDir::new();
    let out = Command::new(chromium())
        .args(["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        .arg(format!("--user-data-dir={}", dir.path().display()))
        // Lets the page's fetch and its timers run before the DOM is dumped.
        .arg("--virtual-time-budget=5000")
        .args(args)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_status_page_shows_pools_decisions_and_refusals_in_a_browser() {
    let e0 = Engine::sim("m", &[]);
    let e1 = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(
        "",
        "policy = \"cache_aware\"\n[pools.safety.rules]\ndeny = { launch = 'launch code' }\nactions = { launch = \"block\" }\nstages = [\"input\"]\n",
        &["m"],
        &[("e0", e0.url()), ("e1", e1.url())],
    ));
    for i in 0..6 {
        let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", &format!("question {i}"), 4));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("nope", "hi", 4)).status, 404);
    assert_eq!(post_json(proxy.addr, "/v1/chat/completions", &chat("m", "the launch code?", 4)).status, 400);
    let mut ws = Ws::connect(proxy.addr, &[]);
    ws.send_json(&json!({"type": "response.create", "model": "m", "input": "hi", "max_output_tokens": 4}));
    assert!(!ws.turn().is_empty());
    ws.send_frame(true, 8, &1000u16.to_be_bytes());
    let _ = ws.read_frame();

    // The JSON twin.
    let mut s = Value::Null;
    let closed = eventually(Duration::from_secs(5), || {
        s = get(proxy.admin, "/status.json").json();
        s["websockets"]["closed"]["1000"] == 1.0
    });
    assert!(closed, "{s:#}");
    let pool = &s["pools"][0];
    assert_eq!(
        (pool["name"].as_str(), pool["policy"].as_str()),
        (Some("main"), Some("cache_aware")),
        "{s:#}"
    );
    let names: Vec<&str> =
        pool["backends"].as_array().expect("backends").iter().filter_map(|b| b["name"].as_str()).collect();
    assert_eq!(names, ["e0", "e1"]);
    assert!(pool["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .all(|b| b["state"] == "up" && b["inflight"] == 0));
    let recent = s["recent"].as_array().expect("recent");
    let routed = recent.iter().filter(|e| e["kind"] == "route" && e["pool"] == "main").count();
    // Six chat requests and one WebSocket turn were routed.
    assert_eq!(routed, 7, "{s:#}");
    assert!(recent
        .iter()
        .all(|e| e["kind"] != "route" || e["reason"].as_str().is_some_and(|r| !r.is_empty())));
    assert!(recent.iter().any(|e| e["kind"] == "refused" && e["reason"] == "model_not_found"), "{s:#}");
    assert_eq!(s["refused"]["content_policy"], 1.0, "{s:#}");
    assert_eq!(s["safety"]["checks"]["main / rules / input / block"], 1.0, "{s:#}");
    // Four tokens, the limit: the turn ends incomplete.
    assert_eq!(s["websockets"]["turns"]["websocket / incomplete"], 1.0, "{s:#}");

    // The page, as a browser draws it.
    let url = format!("http://{}/", proxy.admin);
    let dom = browse(&url, &["--dump-dom"]);
    assert!(!dom.contains("loading…"), "the page never drew its data:\n{dom}");
    for want in [
        "main · cache_aware",
        "<td class=\"\">e0</td>",
        "<td class=\"\">e1</td>",
        "<span class=\"up\">up</span>",
        "model_not_found",
        "content_policy",
        "main / rules / input / block",
        "websocket / incomplete",
    ] {
        assert!(dom.contains(want), "the rendered page lacks {want:?}:\n{dom}");
    }
    // A routing reason of the decisions, as the JSON gave it.
    let reason =
        recent.iter().find(|e| e["kind"] == "route").and_then(|e| e["reason"].as_str()).expect("a decision");
    assert!(dom.contains(&format!("<td class=\"\">{reason}</td>")), "{dom}");

    // And a screenshot of it, as a user sees it (docs/status-page.png is one:
    // WARMPATH_STATUS_SCREENSHOT=docs/status-page.png cargo test -p warmpath-tests --test status_page).
    let dir = TempDir::new();
    let png = dir.path().join("status.png");
    browse(&url, &["--window-size=1280,1200", &format!("--screenshot={}", png.display())]);
    let bytes = std::fs::read(&png).expect("screenshot written");
    assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000, "{} bytes", bytes.len());
    if let Ok(keep) = std::env::var("WARMPATH_STATUS_SCREENSHOT") {
        std::fs::copy(&png, std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(keep))
            .expect("copy");
    }
}
