//! `cache_aware` in precise mode against real engines publishing KV events over ZMQ: the index
//! follows what each engine stores and evicts, including work that never went through warmpath.

use std::time::Duration;

use serde_json::json;
use warmpath_tests::*;

fn prompt(k: usize) -> serde_json::Value {
    let system = format!("You are agent number {k}. {}", "Obey every rule in the handbook. ".repeat(30));
    json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
}

/// `cached=HELD/PROMPT` of an `x-warmpath-route` header.
fn cached(route: &str) -> (u64, u64) {
    let part = route.split("cached=").nth(1).expect("cached=").split(';').next().expect("value");
    let (a, b) = part.split_once('/').expect("HELD/PROMPT");
    (a.parse().expect("held"), b.parse().expect("prompt"))
}

#[test]
fn the_precise_index_follows_engine_events_through_eviction() {
    let ports: [u16; 2] = free_ports();
    let mut es: Vec<Engine> = ports
        .iter()
        .map(|p| {
            let ep = format!("tcp://127.0.0.1:{p}");
            Engine::sim("m", &["--kv-blocks", "96", "--kv-events-endpoint", &ep])
        })
        .collect();
    let mut text = policy(
        "",
        "policy = \"cache_aware\"\n[pools.cache_aware]\nmode = \"precise\"\n[pools.canon]\ntokenizer = \"wp32k\"",
        &["m"],
        &[],
    );
    for (i, (e, p)) in es.iter().zip(ports).enumerate() {
        text.push_str(&format!(
            "\n[[pools.backends]]\nname = \"e{i}\"\nurl = {:?}\nkv_events = \"tcp://127.0.0.1:{p}\"\n",
            e.url()
        ));
    }
    let proxy = Proxy::start(&text);
    let live = |b: &str| {
        metric(&proxy.metrics(), &format!("warmpath_kv_events_live{{backend=\"{b}\",pool=\"main\"}}"))
    };
    assert!(eventually(Duration::from_secs(10), || live("e0") == Some(1.0) && live("e1") == Some(1.0)));

    // A ZMQ subscription takes a moment to reach the publisher: send the first prompt until
    // its BlockStored has come back.
    let stored = |b: &str| {
        metric(
            &proxy.metrics(),
            &format!("warmpath_kv_events_total{{backend=\"{b}\",kind=\"stored\",pool=\"main\"}}"),
        )
        .unwrap_or(0.0)
    };
    let mut home = String::new();
    assert!(eventually(Duration::from_secs(10), || {
        let r = post_json(proxy.addr, "/v1/chat/completions", &prompt(1));
        assert_eq!(r.status, 200, "{}", r.text());
        home = r.header("x-warmpath-backend").expect("backend").to_owned();
        std::thread::sleep(Duration::from_millis(100));
        stored(&home) > 0.0
    }));
    // The index names the engine that holds the prompt's blocks, and only that one.
    let r = post_json(proxy.addr, "/v1/chat/completions", &prompt(1));
    let route = r.header("x-warmpath-route").expect("route").to_owned();
    assert_eq!(r.header("x-warmpath-backend"), Some(home.as_str()), "{route}");
    let (held, total) = cached(&route);
    assert!(route.contains("reason=cache") && held + 16 >= total && held > 200, "{route}");
    let other = if home == "e0" { "e1" } else { "e0" };
    let blocks = |b: &str| {
        metric(&proxy.metrics(), &format!("warmpath_prefix_index_blocks{{backend=\"{b}\",pool=\"main\"}}"))
            .unwrap_or(0.0)
    };
    assert!(eventually(Duration::from_secs(5), || blocks(&home) > 10.0 && blocks(other) == 0.0));

    // Evict it behind warmpath's back: other prompts sent straight to that engine fill its
    // 96 blocks. Its BlockRemoved events reach the index, which stops naming it.
    let engine = &es[if home == "e0" { 0 } else { 1 }];
    let removed = metric(
        &proxy.metrics(),
        &format!("warmpath_kv_events_total{{backend=\"{home}\",kind=\"removed\",pool=\"main\"}}"),
    );
    for k in 100..112 {
        let r = post_json(engine.addr, "/v1/chat/completions", &prompt(k));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(
        eventually(Duration::from_secs(5), || {
            metric(
                &proxy.metrics(),
                &format!("warmpath_kv_events_total{{backend=\"{home}\",kind=\"removed\",pool=\"main\"}}"),
            ) > removed.or(Some(0.0))
        }),
        "{}",
        proxy
            .metrics()
            .lines()
            .filter(|l| l.contains("kv_event") || l.contains("index_blocks"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let r = post_json(proxy.addr, "/v1/chat/completions", &prompt(1));
    let route = r.header("x-warmpath-route").expect("route").to_owned();
    let (held, _) = cached(&route);
    assert!(held < 200, "its blocks were evicted: {route}");

    // The engine that served it restarts: its events stop (warmpath tracks it approximately
    // meanwhile), then resume from sequence 0, and the index drops what it had for it.
    let h = if home == "e0" { 0 } else { 1 };
    es[h].kill();
    assert!(eventually(Duration::from_secs(10), || live(&home) == Some(0.0)), "disconnect seen");
    es[h].restart();
    assert!(eventually(Duration::from_secs(40), || {
        let r = post_json(es[h].addr, "/v1/chat/completions", &prompt(2));
        std::thread::sleep(Duration::from_millis(100));
        r.status == 200 && live(&home) == Some(1.0)
    }));
    let gaps = format!("warmpath_kv_event_gaps_total{{backend=\"{home}\",pool=\"main\"}}");
    assert!(
        eventually(Duration::from_secs(10), || {
            let _ = post_json(es[h].addr, "/v1/chat/completions", &prompt(3));
            metric(&proxy.metrics(), &gaps) >= Some(1.0)
        }),
        "the restart is seen as lost events"
    );
}

#[test]
fn a_proxy_started_later_learns_from_the_replay_what_the_engines_hold() {
    let [a, b, c, d] = free_ports();
    let ports = [(a, b), (c, d)];
    let es: Vec<Engine> = ports
        .iter()
        .map(|(p, r)| {
            let (ep, rep) = (format!("tcp://127.0.0.1:{p}"), format!("tcp://127.0.0.1:{r}"));
            Engine::sim("m", &["--kv-events-endpoint", &ep, "--kv-events-replay-endpoint", &rep])
        })
        .collect();
    // Served before warmpath runs: only e1's replay buffer tells of it.
    let r = post_json(es[1].addr, "/v1/chat/completions", &prompt(7));
    assert_eq!(r.status, 200, "{}", r.text());

    let mut text = policy(
        "",
        "policy = \"cache_aware\"\n[pools.cache_aware]\nmode = \"precise\"\n[pools.canon]\ntokenizer = \"wp32k\"",
        &["m"],
        &[],
    );
    for (i, (e, (p, r))) in es.iter().zip(&ports).enumerate() {
        text.push_str(&format!(
            "\n[[pools.backends]]\nname = \"e{i}\"\nurl = {:?}\nkv_events = \"tcp://127.0.0.1:{p}\"\nkv_events_replay = \"tcp://127.0.0.1:{r}\"\n",
            e.url()
        ));
    }
    let proxy = Proxy::start(&text);
    let replayed = |b: &str| {
        metric(
            &proxy.metrics(),
            &format!("warmpath_kv_events_replayed_total{{backend=\"{b}\",pool=\"main\"}}"),
        )
    };
    assert!(
        eventually(Duration::from_secs(10), || replayed("e1") >= Some(1.0)),
        "{}",
        proxy.metrics().lines().filter(|l| l.contains("kv_event")).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(replayed("e0"), None, "e0 had published nothing");
    let r = post_json(proxy.addr, "/v1/chat/completions", &prompt(7));
    let route = r.header("x-warmpath-route").expect("route").to_owned();
    assert_eq!(r.header("x-warmpath-backend"), Some("e1"), "{route}");
    let (held, _) = cached(&route);
    assert!(route.contains("reason=cache") && held > 200, "the very first request goes home: {route}");
}
