//! API keys and per-key limits (`[auth]`) against real engines: keys made by `warmpath keys
//! add`, every route guarded (the WebSocket upgrade too), models a key may not use, backends
//! never shown the caller's key, limits answered as OpenAI answers them (and retried by the
//! official `openai` SDK), the keys file re-read while serving.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use warmpath_tests::*;

/// `warmpath keys add NAME --file FILE [--models M]`: the key it prints.
fn add_key(file: &Path, name: &str, models: Option<&str>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_warmpath"));
    cmd.args(["keys", "add", name, "--file"]).arg(file);
    if let Some(m) = models {
        cmd.args(["--models", m]);
    }
    let out = cmd.output().expect("warmpath runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn auth_policy(keys: &Path, extra: &str) -> String {
    format!(
        "[auth]\nenabled = true\nkeys_file = {:?}\nreload_interval_ms = 100\n{extra}\n",
        keys.display().to_string()
    )
}

fn get_as(proxy: &Proxy, key: &str, path: &str) -> Resp {
    let auth = format!("Bearer {key}");
    request(proxy.addr, "GET", path, &[("authorization", auth.as_str())], b"")
}

#[test]
fn keys_guard_every_route_and_stay_warmpaths() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let alice = add_key(&keys, "alice", None);
    let bob = add_key(&keys, "bob", Some("m"));
    assert!(!std::fs::read_to_string(&keys).expect("read").contains(&alice), "only hashes are stored");
    // A scripted backend records what it is sent: the caller's key must not reach it.
    let up = Scripted::start_with(|_| {
        json!({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    });
    let proxy = Proxy::start(&policy(&auth_policy(&keys, ""), "", &["m", "other"], &[("s", up.url())]));
    let body = chat("m", "hi", 4);

    // No key, a wrong key: 401 in the OpenAI shape, on each route.
    let r = post_json(proxy.addr, "/v1/chat/completions", &body);
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (401, Some("invalid_api_key")),
        "{}",
        r.text()
    );
    let r = post_as(&proxy, "wp-not-a-real-key-at-all", "/v1/chat/completions", &body);
    assert_eq!(r.status, 401);
    assert!(r.json()["error"]["message"].as_str().unwrap_or("").contains("wp-***"), "{}", r.text());
    assert_eq!(get(proxy.addr, "/v1/models").status, 401);
    assert_eq!(post_json(proxy.addr, "/v1/responses", &json!({"model": "m", "input": "hi"})).status, 401);
    let refused = Ws::try_connect(proxy.addr, &[]).err().expect("refused");
    assert_eq!(refused.status, 401);
    assert!(Ws::try_connect(proxy.addr, &[("authorization", &format!("Bearer {alice}"))]).is_ok());

    // The right key: answered, and the backend never sees it.
    let r = post_as(&proxy, &alice, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let heads = up.heads.lock().expect("lock").join("\n").to_ascii_lowercase();
    assert!(!heads.contains("authorization") && !heads.contains(&alice.to_ascii_lowercase()), "{heads}");
    // The tenant's salt went with it (a hash: the backend sees no key name).
    let sent = String::from_utf8_lossy(&up.bodies.lock().expect("lock")[0]).into_owned();
    assert!(sent.starts_with(r#"{"cache_salt":"wp-"#) && !sent.contains("alice"), "{sent}");

    // bob may use `m` only: 403 for the other model.
    let r = post_as(&proxy, &bob, "/v1/chat/completions", &chat("other", "hi", 4));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (403, Some("model_not_allowed")),
        "{}",
        r.text()
    );
    assert_eq!(post_as(&proxy, &bob, "/v1/chat/completions", &body).status, 200);

    // Stored conversations belong to the key that made them (by name).
    let r = post_as(&proxy, &alice, "/v1/responses", &json!({"model": "m", "input": "hi"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let id = r.json()["id"].as_str().expect("id").to_owned();
    let next = json!({"model": "m", "input": "more", "previous_response_id": id});
    assert_eq!(post_as(&proxy, &bob, "/v1/responses", &next).status, 404);
    assert_eq!(post_as(&proxy, &alice, "/v1/responses", &next).status, 200);

    // Names, not keys, in metrics and the access log.
    let m = proxy.metrics();
    assert!(
        metric(&m, r#"warmpath_key_requests_total{key="alice",outcome="admitted"}"#).unwrap_or(0.0) >= 3.0,
        "{m}"
    );
    assert_eq!(metric(&m, r#"warmpath_key_requests_total{key="bob",outcome="forbidden"}"#), Some(1.0), "{m}");
    assert_eq!(metric(&m, r#"warmpath_key_tokens_total{key="bob",kind="prompt"}"#), Some(3.0), "{m}");
    assert_eq!(metric(&m, "warmpath_auth_keys"), Some(2.0));
    let log = proxy.log.text();
    assert!(log.contains("alice") && !log.contains(&alice) && !log.contains(&bob), "{log}");
}

#[test]
fn models_lists_what_a_key_may_use_and_new_keys_work_without_a_restart() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let all = add_key(&keys, "all", None);
    let a = Engine::sim("m", &[]);
    let b = Engine::sim("n", &[]);
    let pools = format!(
        "{}\n[[pools]]\nname = \"second\"\nmodels = [\"n\"]\n[[pools.backends]]\nname = \"b\"\nurl = {:?}\n",
        policy(&auth_policy(&keys, ""), "", &["m"], &[("a", a.url())]),
        b.url()
    );
    let proxy = Proxy::start(&pools);
    let ids = |key: &str| -> Vec<String> {
        let r = get_as(&proxy, key, "/v1/models");
        assert_eq!(r.status, 200, "{}", r.text());
        let mut v: Vec<String> = r.json()["data"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|m| m["id"].as_str().map(str::to_owned))
            .collect();
        v.sort();
        v
    };
    assert_eq!(ids(&all), ["m", "n"]);
    // A key added while serving works once the file is re-read (every 100 ms here).
    let only_n = add_key(&keys, "only-n", Some("n"));
    assert!(eventually(Duration::from_secs(5), || get_as(&proxy, &only_n, "/v1/models").status == 200));
    assert_eq!(ids(&only_n), ["n"]);
    assert_eq!(post_as(&proxy, &only_n, "/v1/chat/completions", &chat("m", "hi", 2)).status, 403);
    assert_eq!(post_as(&proxy, &only_n, "/v1/chat/completions", &chat("n", "hi", 2)).status, 200);
    // A keys file broken while serving keeps the keys as they were.
    std::fs::write(&keys, "[[keys]]\nname = broken").expect("write");
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(get_as(&proxy, &all, "/v1/models").status, 200);
    assert!(proxy.log.text().contains("keys file not re-read"), "{}", proxy.log.text());
}

#[test]
fn ten_thousand_wrong_keys_leave_the_right_one_working() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let right = add_key(&keys, "right", None);
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(&auth_policy(&keys, ""), "", &["m"], &[("e", e.url())]));
    let body = chat("m", "hi", 1).to_string();
    let mut s = std::net::TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut send = |key: &str| -> u16 {
        // One write: `write!` would send each piece on its own (Nagle, delayed ACKs: 40 ms).
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).expect("send");
        read_response(&mut s).status
    };
    // One keep-alive connection: a refused key does not cost the connection either.
    for i in 0..10_000 {
        let wrong = format!("wp-{i:043}");
        assert_eq!(send(&wrong), 401, "wrong key {i}");
    }
    assert_eq!(send(&right), 200);
    let m = proxy.metrics();
    assert_eq!(metric(&m, r#"warmpath_rejections_total{reason="invalid_api_key"}"#), Some(10_000.0));
}

#[test]
fn limits_answer_429_with_openai_headers_and_settle_with_usage() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let key = add_key(&keys, "k", None);
    // The engine answers "Hello." whatever the request's max_tokens: a reservation of 400
    // completion tokens is settled with the few actually used.
    let script = dir.path().join("script.json");
    std::fs::write(&script, json!([{"when": "", "reply": "Hello."}]).to_string()).expect("script");
    let script = script.display().to_string();
    let e = Engine::sim("m", &["--sim-itl-ms", "20", "--script", &script]);
    let limits = "[auth.limits]\nrequests_per_minute = 3\ntokens_per_minute = 1000\nmax_concurrent = 1\nmax_websockets = 1\n";
    let proxy = Proxy::start(&policy(&auth_policy(&keys, limits), "", &["m"], &[("e", e.url())]));
    // Every answer carries the key's standing.
    let r = post_as(&proxy, &key, "/v1/chat/completions", &chat("m", "hi", 400));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("3"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("2"));
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("1000"));
    let remaining =
        |r: &Resp| r.header("x-ratelimit-remaining-tokens").and_then(|v| v.parse::<u64>().ok()).expect("n");
    let reserved = 1000 - remaining(&r);
    let used = r.json()["usage"]["total_tokens"].as_u64().expect("usage");
    assert!(
        reserved >= 400 && used < 50,
        "reserved {reserved} at admission (the prompt's bytes / 4 + max_tokens), used {used}"
    );
    assert!(r.header("x-ratelimit-reset-requests").is_some_and(|v| v.ends_with('s')), "{:?}", r.headers);
    // Settled with the real usage: the second request finds the first's reservation given
    // back (without it, 1000 - 2 x reserved would remain, plus a few tokens' refill).
    let r = post_as(&proxy, &key, "/v1/chat/completions", &chat("m", "hi", 400));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(remaining(&r) + reserved + used >= 1000, "{} left", remaining(&r));
    assert!(remaining(&r) > 1000 - 2 * reserved + 200, "{} left", remaining(&r));
    let m = proxy.metrics();
    assert_eq!(
        metric(&m, r#"warmpath_key_tokens_total{key="k",kind="completion"}"#),
        Some(2.0 * (used - r.json()["usage"]["prompt_tokens"].as_u64().expect("n")) as f64),
        "{m}"
    );
    // The third request this minute is the last; the fourth is refused.
    assert_eq!(post_as(&proxy, &key, "/v1/chat/completions", &chat("m", "hi", 4)).status, 200);
    let r = post_as(&proxy, &key, "/v1/chat/completions", &chat("m", "hi", 4));
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (429, Some("rate_limit_exceeded")),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["error"]["type"], "requests");
    let after: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).expect("retry-after");
    assert!((1..=20).contains(&after), "one request comes back every 20 s: {after}");
    assert!(r.header("retry-after-ms").is_some());
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    // Larger than the minute's tokens: refused, with no wait that would help.
    let dir2 = TempDir::new();
    let keys2 = dir2.path().join("keys.toml");
    let key2 = add_key(&keys2, "k2", None);
    let slow = Engine::sim("m", &["--sim-itl-ms", "20"]);
    let proxy2 = Proxy::start(&policy(&auth_policy(&keys2, limits), "", &["m"], &[("e", slow.url())]));
    let r = post_as(&proxy2, &key2, "/v1/chat/completions", &chat("m", "hi", 5000));
    assert_eq!((r.status, r.header("retry-after")), (429, None), "{}", r.text());
    // One request at a time: a second while a stream is open is refused for a second.
    let mut stream = chat("m", "hi", 100);
    stream["stream"] = json!(true);
    let auth = format!("Bearer {key2}");
    let mut s = std::net::TcpStream::connect(proxy2.addr).expect("connect");
    let b = stream.to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: {auth}\r\ncontent-length: {}\r\n\r\n{b}",
        b.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut first = [0u8; 12];
    s.read_exact(&mut first).expect("answer begins");
    let r = post_as(&proxy2, &key2, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!((r.status, r.header("retry-after")), (429, Some("1")), "{}", r.text());
    // And one WebSocket.
    let _ws = Ws::connect(proxy2.addr, &[("authorization", &auth)]);
    assert_eq!(Ws::try_connect(proxy2.addr, &[("authorization", &auth)]).err().expect("refused").status, 429);
    let m = proxy2.metrics();
    for limit in ["tokens", "concurrent", "websockets"] {
        let name = format!(r#"warmpath_key_limited_total{{key="k2",limit="{limit}"}}"#);
        assert_eq!(metric(&m, &name), Some(1.0), "{limit}: {m}");
    }
}

#[test]
fn the_openai_sdk_backs_off_on_429_and_gets_through() {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(venv.exists(), "{} missing: run scripts/ensure-deps", venv.display());
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let key = add_key(&keys, "sdk", None);
    let limited = add_key(&keys, "limited", Some("m"));
    // 100 tokens 20 ms apart: the first call holds the key's one slot for about two seconds.
    let e = Engine::sim("m", &["--sim-itl-ms", "20", "--sim-jitter", "0"]);
    let e2 = Engine::sim("other", &[]);
    let pools = format!(
        "{}\n[[pools]]\nname = \"second\"\nmodels = [\"other\"]\n[[pools.backends]]\nname = \"o\"\nurl = {:?}\n",
        policy(&auth_policy(&keys, "[auth.limits]\nmax_concurrent = 1\n"), "", &["m"], &[("e", e.url())]),
        e2.url()
    );
    let proxy = Proxy::start(&pools);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_limits.py");
    let out = Command::new(venv)
        .arg(script)
        .args([&format!("http://{}/v1", proxy.addr), "m", &key, &limited])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("{stdout}"));
    let statuses: Vec<u64> =
        v["statuses"].as_array().expect("list").iter().filter_map(|s| s.as_u64()).collect();
    assert_eq!(statuses.first(), Some(&429), "the first try met the open stream: {v}");
    assert_eq!(statuses.last(), Some(&200), "the SDK waited as told and got through: {v}");
    assert!(v["waited_s"].as_f64().unwrap_or(0.0) >= 0.9, "retry-after honoured: {v}");
    assert_eq!(v["remaining_requests_header"], json!(null), "no per-minute limit set: {v}");
    assert_eq!(v["wrong_key"], "AuthenticationError", "{v}");
    assert_eq!(v["forbidden"], "PermissionDeniedError", "{v}");
}

#[test]
fn a_backend_gets_its_own_key_from_the_environment_never_the_clients() {
    // A variable only this test sets; the proxy inherits it.
    std::env::set_var("WARMPATH_TEST_BACKEND_KEY", "backend-secret");
    let up = Scripted::start_with(|_| {
        json!({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
    });
    let with_key = |url: String| {
        format!("[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[[pools.backends]]\nname = \"s\"\nurl = {url:?}\napi_key_env = \"WARMPATH_TEST_BACKEND_KEY\"\n")
    };
    let proxy = Proxy::start(&with_key(up.url()));
    let r = post_as(&proxy, "client-key", "/v1/chat/completions", &chat("m", "hi", 2));
    assert_eq!(r.status, 200, "{}", r.text());
    let heads = up.heads.lock().expect("lock").join("\n").to_ascii_lowercase();
    assert!(heads.contains("authorization: bearer backend-secret"), "{heads}");
    assert!(!heads.contains("client-key"), "{heads}");
    // A variable that is not set is an error at its key, before anything starts.
    let dir = TempDir::new();
    let file = dir.path().join("p.toml");
    std::fs::write(&file, with_key(up.url()).replace("WARMPATH_TEST_BACKEND_KEY", "WARMPATH_TEST_UNSET_KEY"))
        .expect("write");
    let out =
        Command::new(env!("CARGO_BIN_EXE_warmpath")).arg("check-config").arg(&file).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("p.toml:7:") && err.contains("WARMPATH_TEST_UNSET_KEY"),
        "{err}"
    );
}

#[test]
fn tenants_cannot_probe_each_others_cached_prompts_unless_the_pool_shares() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let alice = add_key(&keys, "alice", None);
    let bob = add_key(&keys, "bob", None);
    // alice's secret system prompt, long enough for several 16-token blocks.
    let secret = "You are the assistant of ACME's merger team. The target is Globex at 41 dollars a share. \
                  Never reveal the price or the name of the target to anyone outside the team.";
    let ask = |proxy: &Proxy, key: &str| {
        let body = json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": secret}, {"role": "user", "content": "hello"}]});
        let r = post_as(proxy, key, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let cached =
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
        (cached, r)
    };
    for (pool, shared) in [("", false), ("tenants = \"shared\"\nroute_headers = true", true)] {
        let e = Engine::sim("m", &[]);
        let proxy = Proxy::start(&policy(&auth_policy(&keys, ""), pool, &["m"], &[("e", e.url())]));
        let (first, _) = ask(&proxy, &alice);
        assert_eq!(first, 0);
        // bob guesses the prompt right: with the cache shared, the hit tells him so.
        let (guess, r) = ask(&proxy, &bob);
        if shared {
            assert!(guess >= 32, "shared: bob hits alice's blocks ({guess})");
            assert!(r.header("x-warmpath-route").is_some(), "the pool opted in to routing headers");
        } else {
            assert_eq!(guess, 0, "apart: bob's right guess looks like any miss");
            for h in ["x-warmpath-route", "x-warmpath-prefix-hash", "x-warmpath-backend"] {
                assert_eq!(r.header(h), None, "{h} is not shown to keys unless the pool opts in");
            }
            // Each tenant still hits its own cache.
            let (again, _) = ask(&proxy, &alice);
            assert!(again >= 32, "alice hits her own blocks ({again})");
        }
    }
}

/// A stream that did not ask for usage, from a key whose tokens are limited: warmpath asks the
/// backend for it, settles the reservation with it, and the client's stream stays as asked
/// (no usage chunk); a client that asked still gets its usage.
#[test]
fn a_stream_is_settled_with_usage_the_client_did_not_ask_for() {
    let dir = TempDir::new();
    let keys = dir.path().join("keys.toml");
    let key = add_key(&keys, "s", None);
    let script = dir.path().join("script.json");
    std::fs::write(&script, json!([{"when": "", "reply": "Hello."}]).to_string()).expect("script");
    let e = Engine::sim("m", &["--script", &script.display().to_string()]);
    let limits = "[auth.limits]\ntokens_per_minute = 1000\n";
    let proxy = Proxy::start(&policy(&auth_policy(&keys, limits), "", &["m"], &[("e", e.url())]));
    let remaining =
        |r: &Resp| r.header("x-ratelimit-remaining-tokens").and_then(|v| v.parse::<u64>().ok()).expect("n");
    let mut body = chat("m", "hi", 400);
    body["stream"] = json!(true);
    let r = post_as(&proxy, &key, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let reserved = 1000 - remaining(&r);
    assert!(reserved >= 400, "{reserved}");
    let text = r.text();
    assert!(text.contains("Hello") && text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"usage\":{"), "the client did not ask for usage: {text}");
    // Settled with the real usage: most of the 400 came back.
    let r = post_as(&proxy, &key, "/v1/chat/completions", &chat("m", "hi", 1));
    assert!(
        remaining(&r) > 1000 - reserved + 300,
        "{} left of 1000 after reserving {reserved}",
        remaining(&r)
    );
    let m = proxy.metrics();
    assert!(
        metric(&m, r#"warmpath_key_tokens_total{key="s",kind="completion"}"#).unwrap_or(0.0) >= 2.0,
        "{m}"
    );
    // A client that asks gets its usage chunk as before.
    body["stream_options"] = json!({"include_usage": true});
    let text = post_as(&proxy, &key, "/v1/chat/completions", &body).text();
    assert!(text.contains("\"usage\":{"), "{text}");
}
