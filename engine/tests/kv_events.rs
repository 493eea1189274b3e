//! KV events over ZMQ: a real subscriber receives vLLM-format BlockStored / BlockRemoved for
//! real requests, with the hashes a router computes itself from the token ids.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use warmpath_wire::kv_events::{decode_batch, KvEvent};
use warmpath_wire::prefix::block_hashes;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

async fn next_events(sub: &mut zeromq::SubSocket, wait: Duration) -> Option<(u64, Vec<KvEvent>)> {
    let msg = tokio::time::timeout(wait, sub.recv()).await.ok()?.expect("recv");
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "topic, seq, payload");
    let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte seq"));
    Some((seq, decode_batch(&frames[2]).expect("vLLM batch").events))
}

/// A subscriber to `e`'s events once the subscription has reached the publisher (`warm`'s
/// events come back; a ZMQ subscription takes a moment), the events before now drained.
async fn live_subscriber(e: &TestEngine, warm: &[u32]) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&e.kv_events.clone().expect("bound endpoint")).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    let mut live = false;
    for _ in 0..50 {
        let body = json!({"model": "micro", "prompt": warm, "max_tokens": 1});
        assert_eq!(post_json(e.addr, "/v1/completions", body).await.0, 200);
        if next_events(&mut sub, Duration::from_millis(200)).await.is_some() {
            live = true;
            break;
        }
    }
    assert!(live, "the subscription is live");
    while next_events(&mut sub, Duration::from_millis(100)).await.is_some() {}
    sub
}

#[tokio::test]
async fn subscriber_sees_stored_then_removed_blocks() {
    let mut args = warmpath_engine::config::EngineArgs::for_tests("micro");
    args.kv_blocks = 12;
    args.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
    let e = start(args).await;
    let endpoint = e.kv_events.clone().expect("bound endpoint");
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");

    // A ZMQ subscription takes a moment to reach the publisher: repeat a first request
    // until its events arrive.
    let prompt: Vec<u32> = (100..150).collect(); // 50 tokens: 3 full blocks of 16
    let want = block_hashes(&prompt, 16, None);
    let mut stored = None;
    for _ in 0..50 {
        let (s, _) = post_json(
            e.addr,
            "/v1/completions",
            json!({"model": "micro", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(s, 200);
        if let Some((_, events)) = next_events(&mut sub, Duration::from_millis(200)).await {
            stored = events.into_iter().find(|ev| matches!(ev, KvEvent::BlockStored { .. }));
            if stored.is_some() {
                break;
            }
        }
    }
    match stored.expect("a BlockStored event") {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, .. } => {
            assert_eq!(block_hashes, want, "engine hashes = router-side hashes of the token ids");
            assert_eq!(parent_block_hash, None);
            assert_eq!(token_ids, prompt[..48].to_vec());
            assert_eq!(block_size, 16);
        }
        _ => unreachable!(),
    }
    // Other prompts fill the 12-block cache and evict the first prompt's blocks.
    for base in [1000u32, 2000, 3000, 4000] {
        let p: Vec<u32> = (base..base + 60).collect();
        let (s, _) =
            post_json(e.addr, "/v1/completions", json!({"model": "micro", "prompt": p, "max_tokens": 1}))
                .await;
        assert_eq!(s, 200);
    }
    let mut removed = Vec::new();
    let mut last_seq = None;
    while let Some((seq, events)) = next_events(&mut sub, Duration::from_millis(500)).await {
        if let Some(prev) = last_seq {
            assert_eq!(seq, prev + 1, "sequence numbers are consecutive");
        }
        last_seq = Some(seq);
        for ev in events {
            if let KvEvent::BlockRemoved { block_hashes, .. } = ev {
                removed.extend(block_hashes);
            }
        }
    }
    assert!(want.iter().all(|h| removed.contains(h)), "first prompt's blocks evicted: {removed:?}");
}

/// Asks the replay socket for every kept batch from `from` on: (seq, events) until the end marker.
async fn replay(endpoint: &str, from: u64) -> Vec<(u64, Vec<KvEvent>)> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await.expect("connect");
    let req = vec![bytes::Bytes::new(), bytes::Bytes::copy_from_slice(&from.to_be_bytes())];
    dealer.send(ZmqMessage::try_from(req).expect("frames")).await.expect("send");
    let mut out = Vec::new();
    loop {
        let msg =
            tokio::time::timeout(Duration::from_secs(5), dealer.recv()).await.expect("reply").expect("recv");
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 3, "empty frame, seq, payload");
        assert!(frames[0].is_empty());
        if frames[1].as_ref() == warmpath_wire::kv_events::REPLAY_END {
            assert!(frames[2].is_empty());
            return out;
        }
        let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte seq"));
        out.push((seq, decode_batch(&frames[2]).expect("vLLM batch").events));
    }
}

#[tokio::test]
async fn the_replay_socket_gives_back_the_recent_batches() {
    let mut args = warmpath_engine::config::EngineArgs::for_tests("micro");
    args.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
    args.kv_events_replay_endpoint = Some("tcp://127.0.0.1:0".into());
    args.kv_events_buffer_steps = 4;
    let e = start(args).await;
    let endpoint = e.kv_replay.clone().expect("replay endpoint");
    assert!(replay(&endpoint, 0).await.is_empty(), "nothing published yet");
    // Published with nobody subscribed: only the replay buffer has them.
    let mut last_prompt = Vec::new();
    for base in [100u32, 200, 300, 400, 500, 600] {
        last_prompt = (base..base + 40).collect::<Vec<u32>>();
        let (s, _) = post_json(
            e.addr,
            "/v1/completions",
            json!({"model": "micro", "prompt": last_prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(s, 200);
    }
    let all = replay(&endpoint, 0).await;
    assert_eq!(all.len(), 4, "the buffer keeps 4 batches: {:?}", all.iter().map(|b| b.0).collect::<Vec<_>>());
    let seqs: Vec<u64> = all.iter().map(|b| b.0).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "consecutive: {seqs:?}");
    assert!(seqs[0] >= 2, "the oldest were dropped: {seqs:?}");
    let want = block_hashes(&last_prompt, 16, None);
    let stored_last = all
        .iter()
        .flat_map(|b| &b.1)
        .any(|ev| matches!(ev, KvEvent::BlockStored { block_hashes, .. } if *block_hashes == want));
    assert!(stored_last, "the last prompt's blocks are in the replay");
    let tail = replay(&endpoint, seqs[3]).await;
    assert_eq!(tail.iter().map(|b| b.0).collect::<Vec<_>>(), [seqs[3]], "from a sequence number on");
    assert!(replay(&endpoint, seqs[3] + 1).await.is_empty());
}

#[tokio::test]
async fn blocks_a_decode_replica_loads_are_announced_as_stored() {
    // A router following the decode replica's events learns that it holds the prompt it fetched,
    // with the hashes it computes itself from the token ids.
    let mut pa = warmpath_engine::config::EngineArgs::for_tests("micro");
    pa.kv_transfer_port = Some(0);
    let p = start(pa).await;
    let mut da = warmpath_engine::config::EngineArgs::for_tests("micro");
    da.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
    let d = start(da).await;
    let mut sub = live_subscriber(&d, &(5000..5040).collect::<Vec<u32>>()).await;

    let prompt: Vec<u32> = (700..800).collect();
    let body = json!({"model": "micro", "prompt": prompt, "max_tokens": 1, "stream": false,
                      "kv_transfer_params": {"do_remote_decode": true}});
    let (s, r) = post_json(p.addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    let body = json!({"model": "micro", "prompt": prompt, "max_tokens": 2,
                      "kv_transfer_params": r["kv_transfer_params"]});
    let (s, r) = post_json(d.addr, "/v1/completions", body).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 96, "loaded, not computed");
    let want = block_hashes(&prompt, 16, None);
    let mut stored = Vec::new();
    while let Some((_, events)) = next_events(&mut sub, Duration::from_millis(500)).await {
        for ev in events {
            if let KvEvent::BlockStored { block_hashes, token_ids, .. } = ev {
                stored.push((block_hashes, token_ids));
            }
        }
    }
    let (hashes, tokens) = stored.first().expect("a BlockStored for the loaded blocks").clone();
    assert_eq!(hashes, want[..6].to_vec());
    assert_eq!(tokens, prompt[..96].to_vec());
}

#[tokio::test]
async fn blocks_the_cache_evicts_into_its_host_tier_are_announced_with_their_medium() {
    // vLLM's offloading events: the cache's BlockRemoved (GPU), then the tier's BlockStored
    // (CPU), so a router following them keeps the blocks as held.
    let mut args = warmpath_engine::config::EngineArgs::for_tests("micro");
    args.kv_blocks = 12;
    args.kv_tier_blocks = 64;
    args.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
    let e = start(args).await;
    let first: Vec<u32> = (100..150).collect();
    let mut sub = live_subscriber(&e, &first).await;
    // Two more 3-block prompts push the first out of the 12-block cache.
    for k in 1..4u32 {
        let other: Vec<u32> = (1000 * k..1000 * k + 50).collect();
        let body = json!({"model": "micro", "prompt": other, "max_tokens": 1});
        assert_eq!(post_json(e.addr, "/v1/completions", body).await.0, 200);
    }
    let want = block_hashes(&first, 16, None);
    let (mut removed, mut offloaded) = (Vec::new(), Vec::new());
    while let Some((_, events)) = next_events(&mut sub, Duration::from_millis(500)).await {
        for ev in events {
            match ev {
                KvEvent::BlockRemoved { block_hashes, medium } if medium.as_deref() == Some("GPU") => {
                    removed.extend(block_hashes)
                }
                KvEvent::BlockStored { block_hashes, token_ids, medium, .. }
                    if medium.as_deref() == Some("CPU") =>
                {
                    assert!(token_ids.is_empty(), "a tier's store names its blocks only");
                    // Announced after the cache's removal of the same blocks.
                    assert!(block_hashes.iter().all(|h| removed.contains(h)), "removed first");
                    offloaded.extend(block_hashes)
                }
                _ => {}
            }
        }
    }
    assert!(
        want.iter().all(|h| offloaded.contains(h)),
        "the first prompt's blocks went to the tier: {offloaded:?}"
    );
}
