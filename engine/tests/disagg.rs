//! Prefill/decode disaggregation between real engine servers on 127.0.0.1: vLLM's
//! `kv_transfer_params` round trip, the K/V a decode replica receives, and what happens when the
//! prefill side is partly held already, dies mid-transfer, sends a damaged block or is gone.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use warmpath_engine::config::{EngineArgs, ExecutorKind};
use warmpath_engine::kv_transfer::frame::{self, FetchRequest, Frame};
use warmpath_tests::series;
use warmpath_wire::prefix::block_hashes;

/// A prompt of `n` token ids (ordinary ids of the built-in vocabulary).
fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 300 + (i * 7 + seed * 13) % 2000).collect()
}

fn sim_args() -> EngineArgs {
    let mut a = EngineArgs::for_tests("micro");
    a.executor = ExecutorKind::Sim;
    a.sim_itl_ms = 1.0;
    a.sim_prefill_us_per_token = 20.0;
    a.sim_prefill_overhead_ms = 0.5;
    a
}

fn with_port(mut a: EngineArgs) -> EngineArgs {
    a.kv_transfer_port = Some(0);
    a
}

async fn metrics(addr: SocketAddr) -> String {
    get(addr, "/metrics").await.1
}

/// Sends the prefill half: vLLM's proxies' body (max_tokens 1, not streamed).
async fn prefill(addr: SocketAddr, ids: &[u32]) -> Value {
    let body = json!({"model": "micro", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null}});
    let (s, r) = post_json(addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    r["kv_transfer_params"].clone()
}

/// Sends the decode half with the prefill's `kv_transfer_params`.
async fn decode(addr: SocketAddr, ids: &[u32], params: Value, max_tokens: u32) -> Value {
    let body = json!({"model": "micro", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "kv_transfer_params": params});
    let (s, r) = post_json(addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    r
}

async fn colocated(addr: SocketAddr, ids: &[u32], max_tokens: u32) -> Value {
    let body = json!({"model": "micro", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true});
    let (s, r) = post_json(addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    r
}

/// Reads the blocks under `hashes` from a replica's transfer port (without releasing anything).
async fn raw_fetch(addr: SocketAddr, hashes: &[u64]) -> Vec<Vec<u8>> {
    let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (r, mut w) = s.into_split();
    let req = FetchRequest { request_id: 0, hashes: hashes.to_vec(), release: false };
    w.write_all(format!("{}\n", serde_json::to_string(&req).expect("test setup")).as_bytes())
        .await
        .expect("test setup");
    let mut r = BufReader::new(r);
    let mut out = Vec::new();
    for &h in hashes {
        match frame::read(&mut r, h).await.expect("frame") {
            Frame::Block(d) => out.push(d),
            other => panic!("block {h:x}: {other:?}"),
        }
    }
    out
}

#[tokio::test]
async fn a_prefill_and_a_decode_replica_answer_as_one_would_with_the_same_kv() {
    // The real forward pass (micro's dummy weights): the decode replica's greedy answer is the
    // co-located one, its prompt came from the cache, and the K/V bytes it holds are those the
    // prefill replica computed, which are those a co-located replica computes.
    let p = start(with_port(EngineArgs::for_tests("micro"))).await;
    let d = start(with_port(EngineArgs::for_tests("micro"))).await;
    let c = start(with_port(EngineArgs::for_tests("micro"))).await;
    let ids = prompt(100, 1);
    let params = prefill(p.addr, &ids).await;
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    assert_eq!(params["remote_port"], p.kv_transfer.expect("port").port());
    let held = metrics(p.addr).await;
    assert_eq!(
        series(&held, "warmpath_engine_kv_held_blocks", ""),
        7.0,
        "100 tokens: 6 full blocks and a partial one"
    );

    let answer = decode(d.addr, &ids, params, 12).await;
    let alone = colocated(c.addr, &ids, 12).await;
    assert_eq!(answer["choices"][0]["text"], alone["choices"][0]["text"]);
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "six blocks loaded: {answer}");
    let dm = metrics(d.addr).await;
    assert_eq!(series(&dm, "warmpath_engine_kv_transfer_blocks_total", "\"received\""), 6.0);
    let bytes = series(&dm, "warmpath_engine_kv_transfer_bytes_total", "\"received\"");
    assert!(bytes > 6.0 * 16.0 * 4.0, "real K/V is more than the tokens: {bytes}");
    assert_eq!(series(&dm, "warmpath_engine_kv_transfer_failures_total", ""), 0.0);
    let pm = metrics(p.addr).await;
    assert_eq!(series(&pm, "warmpath_engine_kv_transfer_bytes_total", "\"sent\""), bytes);
    assert_eq!(series(&pm, "warmpath_engine_kv_held_blocks", ""), 0.0, "released once fetched");

    let hashes = &block_hashes(&ids, 16, None)[..6];
    let from_p = raw_fetch(p.kv_transfer.expect("test setup"), hashes).await;
    let at_d = raw_fetch(d.kv_transfer.expect("test setup"), hashes).await;
    let at_c = raw_fetch(c.kv_transfer.expect("test setup"), hashes).await;
    assert!(from_p == at_d, "the decode replica holds the bytes the prefill replica computed");
    assert!(from_p == at_c, "and they are what a replica computing it alone holds");
}

#[tokio::test]
async fn a_decode_replica_fetches_only_the_blocks_it_does_not_hold() {
    let p = start(with_port(sim_args())).await;
    let d = start(sim_args()).await;
    let ids = prompt(100, 2);
    // The decode replica already served the first 49 tokens: 3 full blocks of this prompt.
    colocated(d.addr, &ids[..49], 1).await;
    let params = prefill(p.addr, &ids).await;
    let answer = decode(d.addr, &ids, params, 4).await;
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    let m = metrics(d.addr).await;
    assert_eq!(series(&m, "warmpath_engine_kv_transfer_blocks_total", "\"skipped\""), 3.0);
    assert_eq!(series(&m, "warmpath_engine_kv_transfer_blocks_total", "\"received\""), 3.0);
    let pm = metrics(p.addr).await;
    assert_eq!(series(&pm, "warmpath_engine_kv_transfer_blocks_total", "\"sent\""), 3.0);
}

#[tokio::test]
async fn a_chat_request_is_handed_over_the_same_way() {
    let p = start(with_port(sim_args())).await;
    let d = start(sim_args()).await;
    let messages = json!([{"role": "user", "content": long_text(60)}]);
    let (s, r) = post_json(
        p.addr,
        "/v1/chat/completions",
        json!({"model": "micro", "messages": messages,
        "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    let params = r["kv_transfer_params"].clone();
    let body = json!({"model": "micro", "messages": messages, "max_tokens": 3, "stream": true,
        "kv_transfer_params": params});
    let (s, text) = post(d.addr, "/v1/chat/completions", body.to_string()).await;
    assert_eq!(s, 200, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let m = metrics(d.addr).await;
    assert!(series(&m, "warmpath_engine_kv_transfer_blocks_total", "\"received\"") >= 4.0, "{m}");
}

/// A prefill replica that serves the first `good` blocks of `ids` (sim K/V: the block's tokens),
/// then `then`: nothing more (it dies) or a damaged block.
async fn fake_prefill(ids: Vec<u32>, good: usize, damaged: bool) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("test setup");
    let addr = l.local_addr().expect("test setup");
    tokio::spawn(async move {
        let (s, _) = l.accept().await.expect("test setup");
        let (r, mut w) = s.into_split();
        let mut line = String::new();
        BufReader::new(r).read_line(&mut line).await.expect("test setup");
        let req: FetchRequest = serde_json::from_str(&line).expect("test setup");
        let mut out = Vec::new();
        for (i, &h) in req.hashes.iter().enumerate().take(good + usize::from(damaged)) {
            let data: Vec<u8> = ids[i * 16..(i + 1) * 16].iter().flat_map(|t| t.to_le_bytes()).collect();
            frame::encode(h, &data, &mut out);
            if i == good {
                *out.last_mut().expect("test setup") ^= 0x40;
            }
        }
        w.write_all(&out).await.expect("test setup");
        // Dropped here: the connection ends as a dying process's would.
    });
    addr
}

fn remote(addr: SocketAddr) -> Value {
    json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": addr.port(),
           "remote_request_id": "1"})
}

#[tokio::test]
async fn a_prefill_replica_dying_mid_transfer_costs_recomputation_not_the_answer() {
    let d = start(sim_args()).await;
    let ids = prompt(100, 3);
    let addr = fake_prefill(ids.clone(), 2, false).await;
    let answer = decode(d.addr, &ids, remote(addr), 4).await;
    assert_eq!(answer["usage"]["completion_tokens"], 4);
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 32, "the two blocks that came");
    let m = metrics(d.addr).await;
    assert_eq!(series(&m, "warmpath_engine_kv_transfer_failures_total", "\"broken\""), 1.0);
    assert_eq!(series(&m, "warmpath_engine_kv_transfer_blocks_total", "\"received\""), 2.0);
}

#[tokio::test]
async fn a_damaged_block_is_never_loaded() {
    let d = start(with_port(sim_args())).await;
    let ids = prompt(100, 4);
    let addr = fake_prefill(ids.clone(), 1, true).await;
    let answer = decode(d.addr, &ids, remote(addr), 4).await;
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 16, "only the block before it");
    let m = metrics(d.addr).await;
    assert_eq!(series(&m, "warmpath_engine_kv_transfer_failures_total", "\"corrupt\""), 1.0);
    // What the decode replica holds in the second block is what it computed itself.
    let hashes = &block_hashes(&ids, 16, None)[..2];
    let held = raw_fetch(d.kv_transfer.expect("test setup"), hashes).await;
    let computed: Vec<u8> = ids[16..32].iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(held[1], computed);
}

#[tokio::test]
async fn an_unreachable_prefill_replica_leaves_the_decode_replica_to_compute() {
    let d = start(sim_args()).await;
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("test setup")
        .local_addr()
        .expect("test setup");
    let ids = prompt(60, 5);
    let answer = decode(d.addr, &ids, remote(gone), 2).await;
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let m = metrics(d.addr).await;
    assert_eq!(series(&m, "warmpath_engine_kv_transfer_failures_total", "\"connect\""), 1.0);
}

#[tokio::test]
async fn held_blocks_are_freed_when_nobody_fetches_them() {
    let mut a = with_port(sim_args());
    a.kv_hold_s = 0.3;
    let p = start(a).await;
    prefill(p.addr, &prompt(64, 6)).await;
    assert_eq!(series(&metrics(p.addr).await, "warmpath_engine_kv_held_blocks", ""), 4.0);
    let freed = eventually(Duration::from_secs(5), || async {
        series(&metrics(p.addr).await, "warmpath_engine_kv_held_blocks", "") == 0.0
    })
    .await;
    assert!(freed, "the hold ran out");
}

#[tokio::test]
async fn handoffs_that_cannot_work_are_refused_in_the_openai_shape() {
    let p = start(with_port(sim_args())).await;
    let plain = start(sim_args()).await;
    let ids = prompt(40, 7);
    let ask = |stream: bool, n: u32, params: Value| {
        json!({"model": "micro", "prompt": ids, "max_tokens": 1, "stream": stream, "n": n,
               "kv_transfer_params": params})
    };
    let cases = [
        (p.addr, ask(true, 1, json!({"do_remote_decode": true})), "stream"),
        (p.addr, ask(false, 2, json!({"do_remote_decode": true})), "one choice"),
        (plain.addr, ask(false, 1, json!({"do_remote_decode": true})), "--kv-transfer-port"),
        (p.addr, ask(false, 1, json!({"do_remote_prefill": true})), "remote_host"),
        (p.addr, ask(false, 1, json!(["not", "an", "object"])), "object"),
    ];
    for (addr, body, says) in cases {
        let (s, r) = post_json(addr, "/v1/completions", body).await;
        assert_eq!(s, 400, "{r}");
        assert_eq!(r["error"]["param"], "kv_transfer_params");
        assert!(r["error"]["message"].as_str().expect("test setup").contains(says), "{r}");
    }
    assert_eq!(series(&metrics(p.addr).await, "warmpath_engine_kv_held_blocks", ""), 0.0, "nothing held");
}
