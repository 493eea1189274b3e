//! Each routing policy's distribution over real engines, and the policy files: every file in
//! `policies/` is valid, and `warmpath check-config` reports bad ones with file:line:col.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use warmpath_tests::*;

fn engines(n: usize) -> Vec<Engine> {
    (0..n).map(|_| Engine::sim("m", &[])).collect()
}

fn backends(es: &[Engine]) -> Vec<(&'static str, String)> {
    const NAMES: [&str; 4] = ["e0", "e1", "e2", "e3"];
    es.iter().enumerate().map(|(i, e)| (NAMES[i], e.url())).collect()
}

/// Sends `bodies` one after another; counts requests per backend.
fn spread(
    proxy: &Proxy,
    bodies: impl IntoIterator<Item = (serde_json::Value, Vec<(&'static str, String)>)>,
) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for (body, headers) in bodies {
        let hs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut all = vec![("content-type", "application/json")];
        all.extend(hs);
        let r = request(proxy.addr, "POST", "/v1/chat/completions", &all, body.to_string().as_bytes());
        assert_eq!(r.status, 200, "{}", r.text());
        *counts.entry(r.header("x-warmpath-backend").unwrap_or("?").to_owned()).or_insert(0) += 1;
    }
    counts
}

#[test]
fn round_robin_is_even_and_weighted() {
    let es = engines(3);
    let proxy = Proxy::start(&policy("", "policy = \"round_robin\"", &["m"], &backends(&es)));
    let counts = spread(&proxy, (0..30).map(|_| (chat("m", "hi", 1), vec![])));
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), vec![10, 10, 10], "{counts:?}");
    drop(proxy);
    let mut p = policy("", "", &["m"], &backends(&es[..2]));
    p = p.replacen("name = \"e0\"", "name = \"e0\"\nweight = 3", 1);
    let proxy = Proxy::start(&p);
    let counts = spread(&proxy, (0..40).map(|_| (chat("m", "hi", 1), vec![])));
    assert_eq!((counts["e0"], counts["e1"]), (30, 10), "{counts:?}");
}

#[test]
fn least_load_spreads_concurrent_requests() {
    let es: Vec<Engine> = (0..2).map(|_| Engine::sim("m", &["--sim-itl-ms", "20"])).collect();
    let proxy = Proxy::start(&policy("", "policy = \"least_load\"", &["m"], &backends(&es)));
    // Four long streams held open at once: least load puts two on each engine.
    let mut held = Vec::new();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..4 {
        let (s, head) = open_stream(proxy.addr, "m", 300);
        let backend = head
            .lines()
            .find_map(|l| l.strip_prefix("x-warmpath-backend: "))
            .unwrap_or("?")
            .trim()
            .to_owned();
        *counts.entry(backend).or_insert(0) += 1;
        held.push(s);
    }
    assert_eq!((counts.get("e0"), counts.get("e1")), (Some(&2), Some(&2)), "{counts:?}");
}

#[test]
fn prefix_hash_keeps_a_prefix_on_one_backend_and_spreads_prefixes() {
    let es = engines(3);
    let proxy = Proxy::start(&policy(
        "",
        "policy = \"prefix_hash\"\n[pools.prefix_hash]\nprefix_blocks = 4",
        &["m"],
        &backends(&es),
    ));
    let system = |k: usize| format!("You are agent number {k}. {}", "Follow the rules. ".repeat(20));
    let body = |k: usize, q: usize| {
        json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": system(k)}, {"role": "user", "content": format!("question {q}")}]})
    };
    // One prefix, many different questions: one backend.
    let same = spread(&proxy, (0..12).map(|q| (body(7, q), vec![])));
    assert_eq!(same.len(), 1, "{same:?}");
    let r = post_json(proxy.addr, "/v1/chat/completions", &body(7, 99));
    assert_eq!(r.header("x-warmpath-route"), Some("prefix_hash; reason=hash"));
    // Many prefixes: every backend gets some.
    let many = spread(&proxy, (0..60).map(|k| (body(k, 0), vec![])));
    assert_eq!(many.len(), 3, "{many:?}");
    assert!(many.values().all(|&n| n >= 8), "{many:?}");
    // Its cache pays: the repeated prefix is served from the engine's prefix cache.
    let cached = post_json(proxy.addr, "/v1/chat/completions", &body(7, 100)).json();
    assert!(cached["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) > 50, "{cached}");
}

#[test]
fn cache_aware_sends_a_chained_response_where_its_predecessor_is() {
    // Backends that store responses (vLLM's `store`) can only continue their own: each answer's
    // id names the backend that made it.
    let ups: Vec<Scripted> = (0..3)
        .map(|b| {
            let n = std::sync::atomic::AtomicUsize::new(0);
            Scripted::start_with(move |_| {
                let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                json!({"id": format!("resp_b{b}_{i}"), "object": "response", "status": "completed",
                       "output": [{"id": format!("msg_{i}"), "type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": "ok"}]}]})
            })
        })
        .collect();
    let named: Vec<(&'static str, String)> =
        ups.iter().enumerate().map(|(i, u)| (["b0", "b1", "b2"][i], u.url())).collect();
    let proxy = Proxy::start(&policy(
        "[health]\nenabled = false\n",
        "responses = \"native\"\npolicy = \"cache_aware\"\n[pools.cache_aware]\nscrape_interval_ms = 0",
        &["m"],
        &named,
    ));
    let mut homes = HashMap::new();
    for chain in 0..6 {
        let mut prev: Option<String> = None;
        for hop in 0..4 {
            // Every hop is a new prompt: only the chain says where it belongs.
            let mut body = json!({"model": "m", "input": format!("chain {chain} hop {hop}: {}", "x ".repeat(40 * hop + chain))});
            if let Some(p) = &prev {
                body["previous_response_id"] = json!(p);
            }
            let r = post_json(proxy.addr, "/v1/responses", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let backend = r.header("x-warmpath-backend").expect("backend").to_owned();
            let id = r.json()["id"].as_str().expect("id").to_owned();
            assert!(id.starts_with(&format!("resp_{backend}_")), "{id} from {backend}");
            if let Some(p) = &prev {
                assert!(p.starts_with(&format!("resp_{backend}_")), "{p} continued on {backend}");
                let route = r.header("x-warmpath-route").unwrap_or("");
                assert!(route.contains("reason=affinity"), "{route}");
            }
            *homes.entry(backend).or_insert(0) += 1;
            prev = Some(id);
        }
    }
    assert!(homes.len() >= 2, "chains start on different backends: {homes:?}");
}

#[test]
fn cache_aware_follows_the_cache_and_spreads_new_prefixes() {
    let es = engines(3);
    let proxy = Proxy::start(&policy(
        "",
        "policy = \"cache_aware\"\n[pools.canon]\ntokenizer = \"wp32k\"",
        &["m"],
        &backends(&es),
    ));
    let system = |k: usize| format!("You are agent number {k}. {}", "Follow the rules. ".repeat(40));
    // A conversation growing turn by turn stays where its blocks are.
    let mut messages = vec![json!({"role": "system", "content": system(1)})];
    let mut home = None;
    for turn in 0..6 {
        messages.push(json!({"role": "user", "content": format!("question number {turn} about the task")}));
        let body = json!({"model": "m", "max_tokens": 2, "messages": messages});
        let r = post_json(proxy.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let backend = r.header("x-warmpath-backend").expect("backend").to_owned();
        let route = r.header("x-warmpath-route").expect("route").to_owned();
        if turn == 0 {
            assert!(route.starts_with("cache_aware; reason=new_prefix; cached=0/"), "{route}");
            home = Some(backend);
        } else {
            assert_eq!(Some(&backend), home.as_ref(), "turn {turn}: {route}");
            assert!(route.starts_with("cache_aware; reason=cache; cached="), "{route}");
            // The engine's own prefix cache agrees that most of the prompt was there.
            let j = r.json();
            let cached = j["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            let prompt = j["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            assert!(cached * 10 >= prompt * 8, "turn {turn}: {cached} of {prompt} cached");
        }
        messages.push(j_answer(&r));
    }
    // Different prefixes spread over every backend.
    let many = spread(
        &proxy,
        (0..30).map(|k| {
            let body = json!({"model": "m", "max_tokens": 1, "messages": [
                {"role": "system", "content": system(100 + k)}, {"role": "user", "content": "hi"}]});
            (body, vec![])
        }),
    );
    assert_eq!(many.len(), 3, "{many:?}");
    assert!(many.values().all(|&n| n >= 4), "{many:?}");
    let m = proxy.metrics();
    assert!(
        metric_sum(
            &m,
            "warmpath_routing_decisions_total{policy=\"cache_aware\",pool=\"main\",reason=\"cache\"}"
        ) >= 5.0,
        "{m}"
    );
    // The engines' /metrics size the index (vllm:cache_config_info) and it reports its memory.
    let blocks = kv_blocks(&es[0]);
    assert!(eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), "warmpath_prefix_index_capacity_blocks{backend=\"e0\",pool=\"main\"}")
            == Some(blocks)
    }));
    assert!(metric(&proxy.metrics(), "warmpath_prefix_index_bytes{pool=\"main\"}").unwrap_or(0.0) > 0.0);
    assert!(metric_sum(&proxy.metrics(), "warmpath_prefix_index_blocks{") > 10.0);
}

#[test]
fn a_backends_host_kv_tier_counts_as_held_capacity() {
    // Blocks the engine evicts into its host tier are loaded, not computed: the index keeps
    // them as held, up to the cache and the tier together.
    let e = Engine::sim("m", &["--kv-blocks", "256", "--kv-tier-blocks", "768"]);
    let proxy = Proxy::start(&policy(
        "",
        "policy = \"cache_aware\"\n[pools.canon]\ntokenizer = \"wp32k\"",
        &["m"],
        &[("e0", e.url())],
    ));
    assert!(eventually(Duration::from_secs(5), || {
        metric(&proxy.metrics(), "warmpath_prefix_index_capacity_blocks{backend=\"e0\",pool=\"main\"}")
            == Some(1024.0)
    }));
}

#[test]
fn cache_aware_without_a_tokenizer_learns_the_bytes_per_token() {
    // Without the backends' tokenizer prompts are cut into byte chunks; the engines' KV capacity
    // (in tokens) becomes one in chunks through the bytes per token warmpath learns from their
    // vllm:prompt_tokens_total. These prompts are long words, far from the 4 bytes a token a
    // guess would take.
    let es = engines(2);
    let proxy = Proxy::start(&policy(
        "",
        "policy = \"cache_aware\"\n[pools.cache_aware]\nscrape_interval_ms = 100\n[pools.canon]\ntokenizer = \"none\"",
        &["m"],
        &backends(&es),
    ));
    let guess = |m: &str| metric(m, "warmpath_prefix_index_units_per_token{pool=\"main\"}");
    assert!(eventually(Duration::from_secs(5), || guess(&proxy.metrics()) == Some(4.0)), "the guess first");
    let (mut bytes, mut tokens) = (0usize, 0u64);
    for k in 0..12 {
        let text = format!("{k} {}", " consideration understanding".repeat(200));
        let body = json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]});
        let r = post_json(proxy.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        bytes += text.len();
        tokens += r.json()["usage"]["prompt_tokens"].as_u64().expect("usage");
    }
    let truth = bytes as f64 / tokens as f64;
    assert!(truth > 6.0, "the prompts' own bytes per token: {truth}");
    // The template's few bytes per message aside, warmpath learns what the engines counted.
    assert!(
        eventually(Duration::from_secs(5), || guess(&proxy.metrics())
            .is_some_and(|g| (g - truth).abs() < 0.1 * truth)),
        "learnt {:?}, prompts {truth}",
        guess(&proxy.metrics())
    );
    // The index sizes each engine's share from it: its KV tokens × bytes per token ÷ chunk.
    let m = proxy.metrics();
    let learnt = guess(&m).expect("learnt");
    let kv_tokens = kv_blocks(&es[0]) * 16.0;
    let capacity =
        metric(&m, "warmpath_prefix_index_capacity_blocks{backend=\"e0\",pool=\"main\"}").expect("set");
    let chunk = 64.0;
    assert!(
        (capacity - kv_tokens * learnt / chunk).abs() <= 1.0 + 0.01 * capacity,
        "{capacity} {kv_tokens} {learnt}"
    );
}

/// The KV blocks an engine says it has (`num_gpu_blocks` of its `vllm:cache_config_info`).
fn kv_blocks(e: &Engine) -> f64 {
    e.metrics()
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info"))
        .and_then(|l| l.split("num_gpu_blocks=\"").nth(1))
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse::<f64>().ok())
        .expect("the engine reports its blocks")
}

/// The assistant message of a chat response, to append to the history.
fn j_answer(r: &Resp) -> serde_json::Value {
    let j = r.json();
    json!({"role": "assistant", "content": j["choices"][0]["message"]["content"].as_str().unwrap_or("")})
}

#[test]
fn session_sticks_by_each_key_and_moves_when_the_backend_dies() {
    let mut es = engines(3);
    let proxy = Proxy::start(&policy(FAST_HEALTH, "policy = \"session\"", &["m"], &backends(&es)));
    let by_header = spread(
        &proxy,
        (0..8).map(|i| (chat("m", &format!("turn {i}"), 1), vec![("x-session-id", "conv-a".to_owned())])),
    );
    assert_eq!(by_header.len(), 1, "{by_header:?}");
    let with_field = |k: &str, v: &str, i: usize| {
        let mut b = chat("m", &format!("turn {i}"), 1);
        b[k] = json!(v);
        (b, vec![])
    };
    assert_eq!(spread(&proxy, (0..8).map(|i| with_field("prompt_cache_key", "pck-1", i))).len(), 1);
    assert_eq!(spread(&proxy, (0..8).map(|i| with_field("user", "user-9", i))).len(), 1);
    // Many sessions use every backend.
    let many = spread(&proxy, (0..60).map(|i| (chat("m", "hi", 1), vec![("x-session-id", format!("s{i}"))])));
    assert_eq!(many.len(), 3, "{many:?}");
    // No key: least load.
    let r = post_json(proxy.addr, "/v1/chat/completions", &chat("m", "hi", 1));
    assert_eq!(r.header("x-warmpath-route"), Some("session; reason=no_key"));

    // Kill conv-a's home: it moves (once the probes notice), then stays put again.
    let home = by_header.keys().next().expect("home").clone();
    let idx: usize = home[1..].parse().expect("index");
    es[idx].kill();
    assert!(eventually(Duration::from_secs(5), || get(proxy.admin, "/metrics")
        .text()
        .contains(&format!("warmpath_backend_up{{backend=\"{home}\",pool=\"main\"}} 0"))));
    let moved = spread(
        &proxy,
        (0..6).map(|i| (chat("m", &format!("turn {i}"), 1), vec![("x-session-id", "conv-a".to_owned())])),
    );
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert!(!moved.contains_key(&home));
    let r = request(
        proxy.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-session-id", "conv-a")],
        chat("m", "x", 1).to_string().as_bytes(),
    );
    assert_eq!(r.header("x-warmpath-route"), Some("session; reason=sticky_moved_down"));
}

#[test]
fn every_shipped_policy_file_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("policies/")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    assert!(files.len() >= 2, "{files:?}");
    let out =
        Command::new(env!("CARGO_BIN_EXE_warmpath")).arg("check-config").args(&files).output().expect("runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_config_reports_file_line_and_column() {
    let dir = TempDir::new();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nlisten = \"127.0.0.1:8080\"\nthreds = 2\n").expect("write");
    let out =
        Command::new(env!("CARGO_BIN_EXE_warmpath")).args(["check-config"]).arg(&bad).output().expect("runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with(&format!("{}:3:1: unknown field `threds`", bad.display())), "{err}");

    std::fs::write(&bad, "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"fastest\"\n").expect("write");
    let out =
        Command::new(env!("CARGO_BIN_EXE_warmpath")).args(["check-config"]).arg(&bad).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with(&format!("{}:4:10: unknown variant `fastest`", bad.display())), "{err}");

    // Serving a bad file fails the same way, before listening.
    let out = Command::new(env!("CARGO_BIN_EXE_warmpath")).arg("--config").arg(&bad).output().expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(":4:10: "));
}

#[test]
fn a_taken_port_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let dir = TempDir::new();
    let file = dir.path().join("p.toml");
    std::fs::write(&file, policy("", "", &["m"], &[("e", "http://127.0.0.1:9".to_owned())])).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_warmpath"))
        .arg("--config")
        .arg(&file)
        .args(["--listen", &addr.to_string(), "--admin", &format!("127.0.0.1:{}", free_port())])
        .output()
        .expect("runs");
    assert!(!out.status.success(), "must exit, not linger without a listener");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot bind the listen address {addr}")), "{err}");
}

/// Two of the peers' tracker lessons: a backend's load is counted on the path that reads
/// nothing of the prompt too (`round_robin`, canonicalization off), and a health check does not
/// reset it (a reset makes the busiest replica look the idlest: a hot spot). The third, ties on
/// a miss always broken toward the same replica, is `cache_aware_follows_the_cache_and_spreads_
/// new_prefixes`' sequential spread.
#[test]
fn in_flight_load_is_counted_on_the_passthrough_path_and_survives_health_checks() {
    let e = Engine::sim("m", &["--sim-itl-ms", "100", "--sim-jitter", "0"]);
    let proxy = Proxy::start(&policy(
        "[health]\ninterval_ms = 50\n",
        "policy = \"round_robin\"",
        &["m"],
        &[("e0", e.url())],
    ));
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let addr = proxy.addr;
            std::thread::spawn(move || {
                let mut b = chat("m", "tell me a story", 50);
                b["stream"] = json!(true);
                post_json(addr, "/v1/chat/completions", &b).status
            })
        })
        .collect();
    let gauge = || metric(&proxy.metrics(), "warmpath_backend_inflight{backend=\"e0\",pool=\"main\"}");
    assert!(eventually(Duration::from_secs(5), || gauge() == Some(3.0)), "{}", proxy.metrics());
    // Many probes later (50 ms apart), the three streams still count.
    std::thread::sleep(Duration::from_millis(1000));
    let m = proxy.metrics();
    assert!(metric_sum(&m, "warmpath_health_checks_total{") >= 10.0, "{m}");
    assert_eq!(gauge(), Some(3.0), "{m}");
    for s in streams {
        assert_eq!(s.join().expect("stream"), 200);
    }
    assert!(eventually(Duration::from_secs(5), || gauge() == Some(0.0)));
}
