//! The shared KV tier end to end, with a real `redis-server`: what one replica computed another
//! loads (same greedy answer); a damaged block is never loaded (and is written again whole); a Redis that is down or full
//! costs only the tier, and a Redis that comes back is used again.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use warmpath_engine::config::EngineArgs;
use warmpath_tests::{series, RedisServer};

const NS: &str = "wptest";

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 300 + (i * 11 + seed * 17) % 2000).collect()
}

fn args(url: &str) -> EngineArgs {
    let mut a = EngineArgs::for_tests("micro");
    a.kv_tier_shared = Some(url.to_owned());
    a.kv_tier_shared_namespace = Some(NS.to_owned());
    a
}

async fn complete(e: &TestEngine, ids: &[u32]) -> Value {
    let body =
        json!({"model": "micro", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (s, r) = post_json(e.addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    r
}

fn cached(r: &Value) -> u64 {
    r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

async fn shared(e: &TestEngine, event: &str) -> f64 {
    let m = get(e.addr, "/metrics").await.1;
    series(&m, "warmpath_engine_kv_shared_tier_blocks_total", &format!("\"{event}\""))
}

/// Waits until `e` has written at least `n` blocks to the tier.
async fn written(e: &TestEngine, n: f64) {
    let done = eventually(Duration::from_secs(10), || async { shared(e, "written").await >= n }).await;
    assert!(done, "{} blocks written, {n} expected", shared(e, "written").await);
}

#[tokio::test]
async fn what_one_replica_computed_another_loads_with_the_same_answer() {
    let redis = RedisServer::start();
    let (a, b) = (start(args(&redis.url())).await, start(args(&redis.url())).await);
    let p = prompt(100, 1);
    let first = complete(&a, &p).await;
    assert_eq!(cached(&first), 0);
    written(&a, 6.0).await;
    let again = complete(&b, &p).await;
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"], "the loaded K/V is what A computed");
    assert_eq!(cached(&again), 96, "six blocks loaded, the last four tokens computed: {again}");
    assert_eq!(shared(&b, "loaded").await, 6.0);
    // B wrote nothing of it back: what it loaded is in the tier already.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(shared(&b, "written").await, 0.0);
    // A replica under another namespace (another model) shares nothing of it.
    let mut other = args(&redis.url());
    other.kv_tier_shared_namespace = Some("elsewhere".into());
    let c = start(other).await;
    assert_eq!(cached(&complete(&c, &p).await), 0);
}

#[tokio::test]
async fn a_damaged_block_is_deleted_and_computed_never_loaded() {
    let redis = RedisServer::start();
    let (a, b) = (start(args(&redis.url())).await, start(args(&redis.url())).await);
    let p = prompt(100, 2);
    let first = complete(&a, &p).await;
    written(&a, 6.0).await;
    // Bytes of the third block's K/V overwritten, as failing memory or a bad write would.
    let third = warmpath_wire::prefix::block_hashes(&p, 16, None)[2];
    let key = format!("{NS}:{third:016x}");
    assert!(!redis.cli(&["SETRANGE", &key, "40", "\u{1}\u{2}\u{3}\u{4}"]).is_empty());
    let again = complete(&b, &p).await;
    assert_eq!(cached(&again), 32, "the two blocks before it only: {again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    assert_eq!(shared(&b, "corrupt").await, 1.0);
    // B deleted it, computed it and wrote it back whole: a third replica loads all six.
    written(&b, 4.0).await;
    let c = start(args(&redis.url())).await;
    assert_eq!(cached(&complete(&c, &p).await), 96);
}

#[tokio::test]
async fn a_redis_that_is_down_costs_only_the_tier_and_is_used_again_when_back() {
    let port = warmpath_tests::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let a = start(args(&url)).await;
    let p = prompt(100, 3);
    let first = complete(&a, &p).await;
    assert_eq!(cached(&first), 0);
    let m = get(a.addr, "/metrics").await.1;
    assert_eq!(series(&m, "warmpath_engine_kv_shared_tier_up", ""), 0.0, "{m}");
    assert!(shared(&a, "failed").await > 0.0);
    complete(&a, &prompt(100, 4)).await;

    let _redis = RedisServer::start_on(port, &[]);
    let back = eventually(Duration::from_secs(10), || async {
        complete(&a, &prompt(100, 5 + rand_seed())).await;
        shared(&a, "written").await > 0.0
    })
    .await;
    assert!(back, "writes resume once Redis is back");
    let m = get(a.addr, "/metrics").await.1;
    assert_eq!(series(&m, "warmpath_engine_kv_shared_tier_up", ""), 1.0);
}

/// A different prompt each call (the tier's writes dedupe blocks written lately).
fn rand_seed() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[tokio::test]
async fn a_full_redis_rejects_the_writes_and_serving_goes_on() {
    // One byte of memory and no eviction: Redis refuses every write (OOM).
    let redis = RedisServer::start_with(&["--maxmemory", "1", "--maxmemory-policy", "noeviction"]);
    let (a, b) = (start(args(&redis.url())).await, start(args(&redis.url())).await);
    let p = prompt(100, 6);
    let first = complete(&a, &p).await;
    let refused = eventually(Duration::from_secs(10), || async { shared(&a, "rejected").await >= 6.0 }).await;
    assert!(refused, "rejected: {}", shared(&a, "rejected").await);
    let m = get(a.addr, "/metrics").await.1;
    assert_eq!(series(&m, "warmpath_engine_kv_shared_tier_up", ""), 1.0, "full is not down");
    let again = complete(&b, &p).await;
    assert_eq!(cached(&again), 0);
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
}

#[tokio::test]
async fn a_replica_whose_cache_was_reset_writes_its_blocks_again() {
    // The fleet's tier emptied and the replica's cache reset (as between benchmark runs): it
    // must not take the blocks for written still.
    let redis = RedisServer::start();
    let a = start(args(&redis.url())).await;
    let p = prompt(100, 7);
    complete(&a, &p).await;
    written(&a, 6.0).await;
    assert_eq!(redis.cli(&["FLUSHALL"]), "OK");
    assert_eq!(post(a.addr, "/reset_prefix_cache", "").await.0, 200);
    complete(&a, &p).await;
    written(&a, 12.0).await;
    let b = start(args(&redis.url())).await;
    assert_eq!(cached(&complete(&b, &p).await), 96);
}
