//! A fleet of warmpath replicas sharing one Redis (`[redis]`): API keys every replica reads
//! (`warmpath keys add|remove|list` against Redis), per-key limits counted once for the whole
//! fleet, what each does while Redis is away, and Redis as a Cluster, under Sentinel (a
//! failover followed) and over TLS.

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use warmpath_tests::*;

/// Writes `policy` next to the test and runs `warmpath --config FILE keys ARGS…`.
fn keys(policy_file: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_warmpath"))
        .arg("--config")
        .arg(policy_file)
        .arg("keys")
        .args(args)
        .output()
        .expect("warmpath runs")
}

/// `warmpath keys add NAME` against the policy's Redis: the key it prints.
fn add_key(policy_file: &Path, name: &str) -> String {
    let out = keys(policy_file, &["add", name]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Keys and limits in Redis, read every 100 ms.
fn fleet_auth(redis: &str, limits: &str) -> String {
    format!(
        "[redis]\n{redis}\ntimeout_ms = 500\n\n[auth]\nenabled = true\nkeys_store = \"redis\"\n\
         limits_store = \"redis\"\nreload_interval_ms = 100\n\n[auth.limits]\n{limits}\n"
    )
}

fn remaining(r: &Resp, what: &str) -> u64 {
    let name = format!("x-ratelimit-remaining-{what}");
    r.header(&name).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{name}: {:?}", r.headers))
}

/// An engine that answers "Hello." whatever `max_tokens` asks for (so reservations are
/// settled with much less).
fn hello_engine(dir: &Path, itl_ms: &str) -> Engine {
    let script = dir.join("script.json");
    std::fs::write(&script, json!([{"when": "", "reply": "Hello."}]).to_string()).expect("script");
    Engine::sim("m", &["--sim-itl-ms", itl_ms, "--script", &script.display().to_string()])
}

#[test]
fn two_replicas_share_one_set_of_keys_and_one_count_of_each_limit() {
    let dir = TempDir::new();
    let redis = RedisServer::start();
    let e = hello_engine(dir.path(), "40");
    let limits = "requests_per_minute = 4\ntokens_per_minute = 2000";
    let text =
        policy(&fleet_auth(&format!("url = {:?}", redis.url()), limits), "", &["m"], &[("e", e.url())]);
    let file = dir.path().join("policy.toml");
    std::fs::write(&file, &text).expect("policy");
    // The key goes to Redis, hashed; the key itself is printed once.
    let alice = add_key(&file, "alice");
    let stored = redis.cli(&["hvals", "warmpath:{keys}"]);
    assert!(stored.contains("\"alice\"") && !stored.contains(&alice), "{stored}");
    let a = Proxy::start(&text);
    let b = Proxy::start(&text);

    // Four requests a minute for the fleet, not for each replica: a, b, a, b, then refused.
    let r = post_as(&a, &alice, "/v1/chat/completions", &chat("m", "hi", 400));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(remaining(&r, "requests"), 3);
    let reserved = 2000 - remaining(&r, "tokens");
    let used = r.json()["usage"]["total_tokens"].as_u64().expect("usage");
    assert!(reserved >= 400 && used < 50, "reserved {reserved}, used {used}");
    // The first request's reservation is settled with its usage (sent within 100 ms).
    std::thread::sleep(Duration::from_millis(400));
    let r = post_as(&b, &alice, "/v1/chat/completions", &chat("m", "hi", 400));
    assert_eq!((r.status, remaining(&r, "requests")), (200, 2), "{}", r.text());
    assert!(remaining(&r, "tokens") > 2000 - 2 * reserved + 200, "{} tokens left", remaining(&r, "tokens"));
    assert!(remaining(&r, "tokens") + reserved + used >= 2000, "{} tokens left", remaining(&r, "tokens"));
    assert_eq!(post_as(&a, &alice, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert_eq!(post_as(&b, &alice, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    let r = post_as(&a, &alice, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (429, Some("requests")), "{}", r.text());
    assert_eq!(remaining(&r, "requests"), 0);
    let after: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).expect("retry-after");
    assert!((1..=15).contains(&after), "one request comes back every 15 s: {after}");
    assert_eq!(
        metric(&a.metrics(), r#"warmpath_key_limited_total{key="alice",limit="requests"}"#),
        Some(1.0)
    );

    // A key added while both serve works on both without a restart, with its own limits
    // (edited in Redis as an operator's tooling would).
    let bob = add_key(&file, "bob");
    let all = redis.cli(&["hgetall", "warmpath:{keys}"]);
    let lines: Vec<&str> = all.lines().collect();
    let at = lines.iter().position(|l| l.contains("\"bob\"")).expect("bob's entry");
    let mut entry: Value = serde_json::from_str(lines[at]).expect("json");
    entry["max_concurrent"] = json!(1);
    entry["max_websockets"] = json!(1);
    entry["requests_per_minute"] = json!(100);
    redis.cli(&["hset", "warmpath:{keys}", lines[at - 1], &entry.to_string()]);
    redis.cli(&["incr", "warmpath:{keys}:version"]);
    let auth = format!("Bearer {bob}");
    for p in [&a, &b] {
        let ok = eventually(Duration::from_secs(5), || {
            post_as(p, &bob, "/v1/chat/completions", &chat("m", "hi", 1)).header("x-ratelimit-limit-requests")
                == Some("100")
        });
        assert!(ok, "bob is not known with his limits:\n{}", p.log.text());
    }
    // One request in flight for the fleet: bob's stream open on a, b refuses a second.
    let mut stream = chat("m", "a long answer", 400);
    stream["stream"] = json!(true);
    let body = stream.to_string();
    let mut s = std::net::TcpStream::connect(a.addr).expect("connect");
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {auth}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut first = [0u8; 12];
    s.read_exact(&mut first).expect("answer begins");
    if &first != b"HTTP/1.1 200" {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        panic!("{}{}", String::from_utf8_lossy(&first), String::from_utf8_lossy(&rest));
    }
    let r = post_as(&b, &bob, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!((r.status, r.header("retry-after")), (429, Some("1")), "{}", r.text());
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).expect("stream ends");
    // Freed when the stream ends (the release goes out with the next flush).
    assert!(eventually(Duration::from_secs(3), || post_as(
        &b,
        &bob,
        "/v1/chat/completions",
        &chat("m", "hi", 1)
    )
    .status
        == 200));
    // One WebSocket for the fleet.
    let ws = Ws::connect(a.addr, &[("authorization", &auth)]);
    let refused = Ws::try_connect(b.addr, &[("authorization", &auth)]).err().expect("refused");
    assert_eq!(refused.status, 429, "{}", refused.text());
    drop(ws);
    assert!(
        eventually(Duration::from_secs(3), || Ws::try_connect(b.addr, &[("authorization", &auth)]).is_ok())
    );

    // Listed by name; removed, refused by both.
    let out = keys(&file, &["list"]);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(listed.contains("alice") && listed.contains("bob") && !listed.contains(&bob), "{listed}");
    assert!(keys(&file, &["remove", "bob"]).status.success());
    assert!(!keys(&file, &["remove", "bob"]).status.success(), "removed already");
    for p in [&a, &b] {
        assert!(eventually(Duration::from_secs(5), || {
            post_as(p, &bob, "/v1/chat/completions", &chat("m", "hi", 1)).status == 401
        }));
    }
    assert_eq!(metric(&a.metrics(), "warmpath_auth_keys"), Some(1.0));
}

#[test]
fn without_redis_limits_fail_open_to_local_counts_or_closed_and_keys_wait() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &[]);
    let port = free_port();
    let mut redis = RedisServer::start_on(port, &[]);
    let keys_file = dir.path().join("keys.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_warmpath"))
        .args(["keys", "add", "k", "--file"])
        .arg(&keys_file)
        .output()
        .expect("warmpath runs");
    let key = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // Keys from a file, limits in Redis.
    let local_keys = |on_error: &str| {
        let global = format!(
            "[redis]\nurl = \"redis://127.0.0.1:{port}\"\ntimeout_ms = 300\n\n[auth]\nenabled = true\n\
             keys_file = {:?}\nlimits_store = \"redis\"\nlimits_on_error = {on_error:?}\n\n\
             [auth.limits]\nrequests_per_minute = 2\n",
            keys_file.display().to_string()
        );
        policy(&global, "", &["m"], &[("e", e.url())])
    };
    let open = Proxy::start(&local_keys("open"));
    let closed = Proxy::start(&local_keys("closed"));
    assert_eq!(post_as(&open, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert_eq!(post_as(&closed, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    redis.kill();
    // Open: this replica's own count decides (a fresh 2 a minute), and the metrics say so.
    assert_eq!(post_as(&open, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert_eq!(post_as(&open, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert_eq!(post_as(&open, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 429);
    let m = open.metrics();
    assert_eq!(metric(&m, r#"warmpath_limits_fail_open_total{limit="requests"}"#), Some(3.0), "{m}");
    assert!(metric(&m, r#"warmpath_redis_errors_total{use="limits"}"#).unwrap_or(0.0) >= 3.0, "{m}");
    // Closed: 503 in the OpenAI shape.
    let r = post_as(&closed, &key, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (503, Some("limits_unavailable")),
        "{}",
        r.text()
    );
    // Redis back on its port (empty: the counts went with it): the fleet's count decides again.
    let redis = RedisServer::start_on(port, &[]);
    assert!(eventually(Duration::from_secs(5), || {
        post_as(&closed, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status == 200
    }));
    assert_eq!(post_as(&closed, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
    assert_eq!(post_as(&closed, &key, "/v1/chat/completions", &chat("m", "hi", 1)).status, 429);

    // Keys kept in Redis, Redis away at start: 503 until they are read, then served.
    let mut redis = redis;
    redis.kill();
    let text = policy(
        &fleet_auth(&format!("url = \"redis://127.0.0.1:{port}\""), ""),
        "",
        &["m"],
        &[("e", e.url())],
    );
    let file = dir.path().join("fleet.toml");
    std::fs::write(&file, &text).expect("policy");
    // Not ready (/readyz) until the keys are read: started without waiting for it.
    let waiting = Proxy::start_with(&text, false);
    let r = post_as(&waiting, &key, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (503, Some("keys_unavailable")),
        "{}",
        r.text()
    );
    let _redis = RedisServer::start_on(port, &[]);
    let fresh = add_key(&file, "fresh");
    assert!(eventually(Duration::from_secs(5), || {
        post_as(&waiting, &fresh, "/v1/chat/completions", &chat("m", "hi", 1)).status == 200
    }));
}

/// A turn stored, and the next continuing from it: the conversation went through Redis.
fn two_turns(proxy: &Proxy, key: &str) -> Resp {
    let first =
        post_as(proxy, key, "/v1/responses", &json!({"model": "m", "input": "hi", "max_output_tokens": 2}));
    assert_eq!(first.status, 200, "{}", first.text());
    let next = json!({"model": "m", "input": "more", "previous_response_id": first.json()["id"], "max_output_tokens": 2});
    post_as(proxy, key, "/v1/responses", &next)
}

#[test]
fn a_redis_cluster_holds_conversations_keys_and_limits() {
    let dir = TempDir::new();
    let cluster = RedisCluster::start();
    let e = Engine::sim("m", &[]);
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("{u:?}")).collect();
    let global = fleet_auth(&format!("cluster = [{}]", nodes.join(", ")), "requests_per_minute = 3")
        + "\n[session]\nstore = \"redis\"\n";
    let text = policy(&global, "", &["m"], &[("e", e.url())]);
    let file = dir.path().join("policy.toml");
    std::fs::write(&file, &text).expect("policy");
    // Several keys: their counters land in different slots, each key's in one.
    let keys: Vec<String> = ["alice", "bob", "carol"].iter().map(|n| add_key(&file, n)).collect();
    let proxy = Proxy::start(&text);
    for k in &keys {
        let r = two_turns(&proxy, k);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(remaining(&r, "requests"), 1);
        assert_eq!(post_as(&proxy, k, "/v1/chat/completions", &chat("m", "hi", 1)).status, 200);
        assert_eq!(post_as(&proxy, k, "/v1/chat/completions", &chat("m", "hi", 1)).status, 429);
    }
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_session_store_ops_total{op="put",result="ok"}"#), Some(6.0), "{m}");
    assert_eq!(metric(&m, r#"warmpath_redis_errors_total{use="limits"}"#), None, "{m}");
}

#[test]
fn a_sentinel_failover_is_followed() {
    let e = Engine::sim("m", &[]);
    let mut s = RedisSentinel::start();
    let global = format!(
        "[redis]\nsentinels = [{:?}]\nsentinel_master = {:?}\ntimeout_ms = 500\n\n[session]\nstore = \"redis\"\n",
        s.url(),
        RedisSentinel::MASTER
    );
    let proxy = Proxy::start(&policy(&global, "", &["m"], &[("e0", e.url())]));
    let first =
        post_as(&proxy, "k", "/v1/responses", &json!({"model": "m", "input": "hi", "max_output_tokens": 2}));
    assert_eq!(first.status, 200, "{}", first.text());
    // Replicated, then the master is lost and the Sentinel promotes the replica.
    assert!(eventually(Duration::from_secs(10), || !s
        .replica
        .cli(&["keys", "warmpath:response:*"])
        .is_empty()));
    s.master.kill();
    let promoted = s.replica.port;
    assert!(
        eventually(Duration::from_secs(30), || s.master_port() == promoted),
        "no failover: the sentinel names {}",
        s.master_port()
    );
    let next = json!({"model": "m", "input": "more", "previous_response_id": first.json()["id"], "max_output_tokens": 2});
    let mut last = None;
    let ok = eventually(Duration::from_secs(10), || {
        let r = post_as(&proxy, "k", "/v1/responses", &next);
        let done = r.status == 200;
        last = Some(r);
        done
    });
    assert!(ok, "{}", last.map(|r| r.text()).unwrap_or_default());
    // And new conversations are stored on the new master.
    let r = two_turns(&proxy, "k");
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn redis_over_tls_with_a_ca_bundle_and_a_wrong_one_refused() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "redis-ca");
    let cert = ca.issue("redis", &["localhost"], false);
    let other = TestCa::new(dir.path(), "other-ca");
    let redis = RedisServer::start_tls(&cert.cert, &cert.key, &ca.ca_file());
    let e = Engine::sim("m", &[]);
    let store = |ca: &Path| {
        let global = format!(
            "[redis]\nurl = \"rediss://localhost:{}\"\nca_file = {:?}\ntimeout_ms = 1000\n\n[session]\nstore = \"redis\"\n",
            redis.port,
            ca.display().to_string()
        );
        policy(&global, "", &["m"], &[("e0", e.url())])
    };
    let good = Proxy::start(&store(&ca.ca_file()));
    let r = two_turns(&good, "k");
    assert_eq!(r.status, 200, "{}", r.text());
    // A server whose certificate does not chain to the bundle: never plain text, a 503.
    let bad = Proxy::start(&store(&other.ca_file()));
    let r = two_turns(&bad, "k");
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (503, Some("session_store_unavailable")),
        "{}",
        r.text()
    );
    assert!(metric(&bad.metrics(), r#"warmpath_redis_errors_total{use="sessions"}"#).unwrap_or(0.0) >= 1.0);
}
