//! A KV tier the pool's engines share (a real `redis-server`): `cache_aware` sends a busy
//! holder's next turn to an engine that loads the prefix from the tier, and an embedded pool's
//! replicas load what each other computed. Real engines on 127.0.0.1.

use std::time::Duration;

use serde_json::json;
use warmpath_tests::*;

fn turn(system: &str, user: &str) -> serde_json::Value {
    json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

fn cached(r: &Resp) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

#[test]
fn a_busy_holders_prefix_is_loaded_from_the_shared_tier_by_another_engine() {
    let redis = RedisServer::start();
    let url = redis.url();
    let slow = ["--sim-prefill-us-per-token", "1000"];
    let es: Vec<Engine> = (0..2)
        .map(|_| Engine::sim("m", &[&["--kv-tier-shared", url.as_str()], &slow[..]].concat()))
        .collect();
    let mut text = String::from(
        "[[pools]]\nname = \"main\"\nmodels = [\"m\"]\npolicy = \"cache_aware\"\n[pools.canon]\ntokenizer = \"wp32k\"\n\
         [pools.cache_aware]\ntier_weight = 1.0\n",
    );
    for (i, e) in es.iter().enumerate() {
        text.push_str(&format!(
            "[[pools.backends]]\nname = \"e{i}\"\nurl = {:?}\nshared_kv_tier = true\n",
            e.url()
        ));
    }
    let proxy = Proxy::start(&text);
    let system = format!("You are the build agent. {}", "Keep every rule of the handbook. ".repeat(40));
    let first = post_json(proxy.addr, "/v1/chat/completions", &turn(&system, "hi"));
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.header("x-warmpath-backend").expect("backend").to_owned();
    let holder = &es[home[1..].parse::<usize>().expect("index")];
    let stored = eventually(Duration::from_secs(10), || {
        series(&holder.metrics(), "warmpath_engine_kv_shared_tier_blocks_total", "\"written\"") >= 16.0
    });
    assert!(stored, "{}", holder.metrics());
    // A long new tail behind the same prefix keeps the holder prefilling for about 1.5 s.
    let long: String = (0..700).map(|i| format!("item{i} ")).collect();
    let (addr, long_turn) = (proxy.addr, turn(&system, &long));
    let busy = std::thread::spawn(move || post_json(addr, "/v1/chat/completions", &long_turn));
    std::thread::sleep(Duration::from_millis(300));
    let next = post_json(proxy.addr, "/v1/chat/completions", &turn(&system, "and now?"));
    assert_eq!(next.status, 200, "{}", next.text());
    let route = next.header("x-warmpath-route").expect("route").to_owned();
    assert!(route.contains("reason=tier") && route.contains("tiered="), "{route}");
    assert_ne!(next.header("x-warmpath-backend"), Some(home.as_str()));
    assert!(cached(&next) >= 256, "the prefix came from the tier: {}", next.text());
    let other = es.iter().find(|e| e.url() != holder.url()).expect("other");
    assert!(series(&other.metrics(), "warmpath_engine_kv_shared_tier_blocks_total", "\"loaded\"") >= 16.0);
    assert_eq!(busy.join().expect("the long turn").status, 200);
}

#[test]
fn an_embedded_pools_replicas_load_what_each_other_computed() {
    let redis = RedisServer::start();
    let text = format!(
        "[[pools]]\nname = \"main\"\nmodels = [\"m\"]\npolicy = \"round_robin\"\n\
         [pools.embedded]\nreplicas = 2\nexecutor = \"sim\"\nkv_tier_shared = {:?}\n",
        redis.url()
    );
    let proxy = Proxy::start(&text);
    let system = format!("You are the build agent. {}", "Keep every rule of the handbook. ".repeat(40));
    let first = post_json(proxy.addr, "/v1/chat/completions", &turn(&system, "hi"));
    assert_eq!(first.status, 200, "{}", first.text());
    // Round robin: the same prompt next goes to the other replica, which finds it in the tier.
    let written =
        eventually(Duration::from_secs(10), || redis.cli(&["DBSIZE"]).parse::<u64>().unwrap_or(0) >= 16);
    assert!(written, "keys: {}", redis.cli(&["DBSIZE"]));
    let second = post_json(proxy.addr, "/v1/chat/completions", &turn(&system, "hi"));
    assert_eq!(second.status, 200, "{}", second.text());
    assert_ne!(second.header("x-warmpath-backend"), first.header("x-warmpath-backend"));
    assert!(cached(&second) >= 256, "{}", second.text());
}
