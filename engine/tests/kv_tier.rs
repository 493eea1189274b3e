//! The replica's own KV tiers end to end: blocks evicted from a small cache come back from host
//! memory or disk instead of being computed, with the same answer; a full tier keeps only the
//! newest; the disk tier's blocks are found again by a restarted replica.

mod common;

use common::*;
use serde_json::{json, Value};
use warmpath_engine::config::EngineArgs;
use warmpath_tests::series;

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 300 + (i * 11 + seed * 17) % 2000).collect()
}

fn args(kv_blocks: usize, tier: usize) -> EngineArgs {
    let mut a = EngineArgs::for_tests("micro");
    a.kv_blocks = kv_blocks;
    a.kv_tier_blocks = tier;
    a
}

async fn complete(e: &TestEngine, ids: &[u32]) -> Value {
    let body =
        json!({"model": "micro", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (s, r) = post_json(e.addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    r
}

/// Sends `a`, then enough other prompts to push every block of `a` out of a 16-block cache,
/// then `a` again; returns the two answers to `a`.
async fn evict_and_return(e: &TestEngine) -> (Value, Value) {
    let a = prompt(100, 1);
    let first = complete(e, &a).await;
    for k in 2..6 {
        complete(e, &prompt(100, k)).await;
    }
    (first, complete(e, &a).await)
}

#[tokio::test]
async fn blocks_evicted_from_the_cache_come_back_from_the_tier_with_the_same_answer() {
    let tiered = start(args(16, 64)).await;
    let (first, again) = evict_and_return(&tiered).await;
    assert_eq!(
        again["choices"][0]["text"], first["choices"][0]["text"],
        "the loaded K/V is what was computed"
    );
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "{again}");
    let m = get(tiered.addr, "/metrics").await.1;
    assert_eq!(series(&m, "warmpath_engine_kv_tier_hit_tokens_total", ""), 96.0);
    assert!(series(&m, "warmpath_engine_kv_tier_events_total", "\"stored\"") >= 6.0, "{m}");
    assert_eq!(series(&m, "warmpath_engine_kv_tier_events_total", "\"loaded\""), 6.0);

    // The same traffic without the tier computes the prompt again.
    let plain = start(args(16, 0)).await;
    let (_, again) = evict_and_return(&plain).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{again}");
}

#[tokio::test]
async fn a_full_tier_keeps_the_newest_blocks_only() {
    // Four blocks of tier: the first prompt's chain is dropped from it by the later evictions.
    let small = start(args(16, 4)).await;
    let (_, again) = evict_and_return(&small).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{again}");
    let m = get(small.addr, "/metrics").await.1;
    assert!(series(&m, "warmpath_engine_kv_tier_events_total", "\"evicted\"") > 0.0, "{m}");
    assert_eq!(series(&m, "warmpath_engine_kv_tier_blocks", ""), 4.0);
}

#[tokio::test]
async fn resetting_the_prefix_cache_empties_the_tier_too() {
    let e = start(args(16, 64)).await;
    let a = prompt(100, 1);
    complete(&e, &a).await;
    for k in 2..6 {
        complete(&e, &prompt(100, k)).await;
    }
    let (s, _) = post(e.addr, "/reset_prefix_cache", "").await;
    assert_eq!(s, 200);
    let again = complete(&e, &a).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{again}");
}

fn tier_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("wp-kv-disk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn with_disk(kv_blocks: usize, host: usize, dir: &std::path::Path) -> EngineArgs {
    let mut a = args(kv_blocks, host);
    a.kv_tier_disk = Some(dir.to_owned());
    a.kv_tier_disk_blocks = 64;
    a
}

#[tokio::test]
async fn blocks_evicted_to_disk_come_back_with_the_same_answer() {
    // Disk alone, and disk below a host tier of four blocks (what host memory drops goes there).
    for host in [0, 4] {
        let dir = tier_dir(&format!("alone-{host}"));
        let e = start(with_disk(16, host, &dir)).await;
        let (first, again) = evict_and_return(&e).await;
        assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
        assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "host = {host}: {again}");
        let m = get(e.addr, "/metrics").await.1;
        let disk_loads = m
            .lines()
            .filter(|l| l.starts_with("warmpath_engine_kv_tier_events_total{"))
            .filter(|l| l.contains("\"disk\"") && l.contains("\"loaded\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        assert_eq!(disk_loads, 6.0, "host = {host}: {m}");
        assert_eq!(series(&m, "warmpath_engine_kv_tier_capacity_blocks", "\"disk\""), 64.0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[tokio::test]
async fn a_restarted_replica_finds_its_disk_tier_again() {
    let dir = tier_dir("restart");
    let a = prompt(100, 1);
    let first = {
        let e = start(with_disk(16, 0, &dir)).await;
        let first = complete(&e, &a).await;
        for k in 2..6 {
            complete(&e, &prompt(100, k)).await;
        }
        first
    };
    let e = start(with_disk(16, 0, &dir)).await;
    let again = complete(&e, &a).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "{again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    let _ = std::fs::remove_dir_all(&dir);
}
