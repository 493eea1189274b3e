//! Precise mode for `cache_aware`: each backend's KV events (vLLM's ZMQ format, which the
//! bundled engine also publishes) write its share of the prefix index — `BlockStored` inserts,
//! `BlockRemoved` removes, `AllBlocksCleared` empties it.
//!
//! Block keys are recomputed from the events' token ids with warmpath's own chained hash, so the
//! index speaks the keys requests are cut into whatever hash the backend uses (the bundled
//! engine's equal warmpath's; vLLM's do not); only keys that differ are remembered, to map the
//! backend's later `BlockRemoved`.
//!
//! A backend's events are trusted while they flow. When its socket disconnects, or it has been
//! sent requests but published nothing for `event_timeout_ms`, warmpath falls back to tracking
//! what it routes there (approximate mode) until events resume. A restarted sequence (the
//! backend restarted, its cache empty) drops that backend's entries. Where the backend has a
//! replay socket (vLLM's `replay_endpoint`, the bundled engine's `--kv-events-replay-endpoint`),
//! the batches missed are asked for there: on every (re)connect from the next sequence number
//! (from 0 on the first: what the backend held before warmpath started), and on a gap in the
//! sequence. A gap the replay cannot fill (the backend no longer keeps those batches, or has
//! no replay socket) is counted and otherwise lived with — dropping every entry for a few lost
//! batches cost more hits than the stale entries do (measured: see
//! bench/results/compare-trace-plain-*.md).

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use warmpath_wire::kv_events::REPLAY_END;
use warmpath_wire::kv_events::{decode_batch, KvEvent};
use warmpath_wire::prefix::{block_hash, root_hash};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::index::PrefixIndex;
use super::{Current, Pool};
use crate::config::IndexMode;
use crate::observe::Metrics;

/// What a sequence number says about the events before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    First,
    InOrder,
    /// `missed` batches never arrived.
    Gap {
        missed: u64,
    },
    /// The sequence went back: the publisher restarted.
    Restarted,
}

/// Applies one backend's event batches to the index.
#[derive(Debug)]
pub struct Applier {
    backend: usize,
    block_size: usize,
    /// Backend key → warmpath key, where they differ.
    keys: HashMap<u64, u64>,
    last_seq: Option<u64>,
}

/// Counts of what a batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
}

impl Applier {
    pub fn new(backend: usize, block_size: usize) -> Applier {
        Applier { backend, block_size, keys: HashMap::new(), last_seq: None }
    }

    /// The sequence number expected next: 0 before the first batch.
    pub fn next_seq(&self) -> u64 {
        self.last_seq.map_or(0, |l| l.wrapping_add(1))
    }

    /// `seq` comes after a gap (batches between the last one and it were lost).
    pub fn is_gap(&self, seq: u64) -> bool {
        self.last_seq.is_some_and(|l| seq > l.wrapping_add(1))
    }

    /// Checks `seq` against the last one. On a restart the backend's entries are dropped (its
    /// cache restarted empty); a gap only loses a few batches, whose effect the LRU and later
    /// removals wash out, so the entries stay.
    pub fn check_seq(&mut self, seq: u64, index: &PrefixIndex) -> SeqCheck {
        let check = match self.last_seq {
            None => SeqCheck::First,
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap { missed: seq - last - 1 },
            Some(_) => SeqCheck::Restarted,
        };
        if check == SeqCheck::Restarted {
            index.clear(self.backend);
            self.keys.clear();
        }
        self.last_seq = Some(seq);
        check
    }

    pub fn apply(&mut self, events: &[KvEvent], index: &PrefixIndex) -> Applied {
        let mut n = Applied::default();
        for ev in events {
            match ev {
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, .. } => {
                    let ours =
                        self.our_keys(block_hashes, *parent_block_hash, token_ids, *block_size as usize);
                    index.insert(self.backend, &ours);
                    n.stored += ours.len() as u64;
                }
                // A block leaving a tier (vLLM's `medium` CPU or DISK; the bundled engine's host
                // memory or disk) may still be in the backend's cache or its other tier: it stays
                // until the index's bound (the backend's capacity, its tiers' included) ages it
                // out. A block the cache evicted into a tier comes back with the tier's
                // BlockStored right after its removal.
                KvEvent::BlockRemoved { medium: Some(m), .. } if !m.eq_ignore_ascii_case("GPU") => {}
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    let ours: Vec<u64> =
                        block_hashes.iter().map(|h| self.keys.remove(h).unwrap_or(*h)).collect();
                    index.remove(self.backend, &ours);
                    n.removed += ours.len() as u64;
                }
                KvEvent::AllBlocksCleared => {
                    index.clear(self.backend);
                    self.keys.clear();
                    n.cleared += 1;
                }
            }
        }
        n
    }

    /// warmpath's keys for stored blocks: recomputed from the token ids where they are whole
    /// blocks of warmpath's size, else the backend's own keys.
    fn our_keys(&mut self, theirs: &[u64], parent: Option<u64>, tokens: &[u32], size: usize) -> Vec<u64> {
        if size != self.block_size || tokens.len() != theirs.len() * size {
            // No token ids (a tier's BlockStored): the keys learnt from the cache's own events.
            return theirs.iter().map(|h| self.keys.get(h).copied().unwrap_or(*h)).collect();
        }
        let mut prev = match parent {
            None => root_hash(None),
            Some(p) => self.keys.get(&p).copied().unwrap_or(p),
        };
        let mut out = Vec::with_capacity(theirs.len());
        for (k, &h) in theirs.iter().enumerate() {
            let ours = block_hash(prev, &tokens[k * size..(k + 1) * size], None);
            if ours != h {
                self.keys.insert(h, ours);
            }
            out.push(ours);
            prev = ours;
        }
        out
    }
}

/// Follows the KV events of every backend of every `cache_aware` pool in precise mode: a feed
/// per backend, started as a pool appears (at start, or with a reload) and stopped when its
/// pool is gone from the fleet.
pub struct EventFeeds {
    pub current: Arc<dyn Current>,
    pub metrics: Metrics,
}

/// How often the feeds are matched against the current fleet.
const RESCAN: Duration = Duration::from_secs(1);

#[async_trait]
impl BackgroundService for EventFeeds {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        // By the pool's routing state (its address: a reload that keeps a pool keeps its
        // feeds) and the backend's index.
        let mut feeds: HashMap<(usize, usize), tokio::task::JoinHandle<()>> = HashMap::new();
        loop {
            let mut wanted = HashMap::new();
            for pool in self.current.fleet().pools() {
                if pool.cache_aware.is_none() || pool.cache_cfg.mode != IndexMode::Precise {
                    continue;
                }
                for (i, b) in pool.backends.iter().enumerate() {
                    let Some(endpoint) = b.kv_events.clone() else { continue };
                    wanted.insert((Arc::as_ptr(pool) as usize, i), (pool.clone(), endpoint));
                }
            }
            feeds.retain(|k, t| {
                let keep = wanted.contains_key(k);
                if !keep {
                    t.abort();
                }
                keep
            });
            for (k, (pool, endpoint)) in wanted {
                feeds
                    .entry(k)
                    .or_insert_with(|| tokio::spawn(feed(pool, k.1, endpoint, self.metrics.clone())));
            }
            tokio::select! {
                _ = tokio::time::sleep(RESCAN) => {}
                _ = shutdown.changed() => break,
            }
        }
        for t in feeds.into_values() {
            t.abort();
        }
    }
}

/// Asks a replay socket (ZMQ ROUTER, vLLM's protocol) for every batch it keeps from `from` on:
/// `(seq, payload)` in order. Bounded by `wait` per reply message.
pub async fn replay(endpoint: &str, from: u64, wait: Duration) -> Result<Vec<(u64, Bytes)>, String> {
    let mut dealer = zeromq::DealerSocket::new();
    match tokio::time::timeout(wait, dealer.connect(endpoint)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("connect: {e}")),
        Err(_) => return Err("connect: timed out".to_owned()),
    }
    let req = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())])
        .map_err(|e| e.to_string())?;
    dealer.send(req).await.map_err(|e| format!("send: {e}"))?;
    let mut out = Vec::new();
    loop {
        let msg = match tokio::time::timeout(wait, dealer.recv()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(format!("recv: {e}")),
            Err(_) => return Err(format!("no end of replay after {} batches", out.len())),
        };
        let frames = msg.into_vec();
        let [_, seq, payload] = frames.as_slice() else {
            return Err(format!("a reply of {} frames", frames.len()));
        };
        if seq.as_ref() == REPLAY_END {
            let _ = dealer.close().await;
            return Ok(out);
        }
        let seq =
            <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes).map_err(|_| "a bad sequence number")?;
        out.push((seq, payload.clone()));
    }
}

/// One backend's events going into the index, with their metrics.
struct Intake<'a> {
    applier: Applier,
    index: &'a PrefixIndex,
    metrics: &'a Metrics,
    labels: [&'a str; 2],
}

impl Intake<'_> {
    fn count(&self, kind: &str, v: u64) {
        if v > 0 {
            self.metrics.kv_events.with_label_values(&[self.labels[0], self.labels[1], kind]).inc_by(v);
        }
    }

    /// Applies one batch; false if it was malformed.
    fn take(&mut self, seq: u64, payload: &[u8]) -> bool {
        let Ok(batch) = decode_batch(payload) else {
            self.count("malformed", 1);
            return false;
        };
        let check = self.applier.check_seq(seq, self.index);
        if let SeqCheck::Gap { .. } | SeqCheck::Restarted = check {
            tracing::warn!(backend = self.labels[1], ?check, "KV events lost");
            self.metrics.kv_event_gaps.with_label_values(&self.labels).inc();
        }
        let n = self.applier.apply(&batch.events, self.index);
        self.count("stored", n.stored);
        self.count("removed", n.removed);
        self.count("cleared", n.cleared);
        true
    }

    /// Replays what the backend kept from the next expected sequence number on; the sequence
    /// numbers replayed (live copies of them are duplicates).
    async fn catch_up(&mut self, endpoint: &str) -> Option<RangeInclusive<u64>> {
        let from = self.applier.next_seq();
        match replay(endpoint, from, Duration::from_secs(2)).await {
            Ok(batches) => {
                let last = batches.last().map(|b| b.0)?;
                for (seq, payload) in &batches {
                    self.take(*seq, payload);
                }
                self.metrics.kv_events_replayed.with_label_values(&self.labels).inc_by(batches.len() as u64);
                tracing::info!(backend = self.labels[1], from, batches = batches.len(), "KV events replayed");
                Some(from..=last)
            }
            Err(e) => {
                tracing::warn!(backend = self.labels[1], %endpoint, error = %e, "KV event replay failed");
                None
            }
        }
    }
}

/// One backend's feed, for as long as the process runs.
async fn feed(pool: Arc<Pool>, b: usize, endpoint: String, metrics: Metrics) {
    let Some(ca) = pool.cache_aware.clone() else { return };
    let backend = &pool.backends[b];
    let labels = [pool.name.as_str(), backend.name.as_str()];
    let live = metrics.kv_events_live.with_label_values(&labels);
    let timeout = Duration::from_millis(pool.cache_cfg.event_timeout_ms.max(1));
    let mut intake = Intake {
        applier: Applier::new(b, pool.units.per_block),
        index: ca.index(),
        metrics: &metrics,
        labels,
    };
    loop {
        let mut sub = zeromq::SubSocket::new();
        let mut monitor = sub.monitor();
        let connected = tokio::time::timeout(Duration::from_secs(5), sub.connect(&endpoint)).await;
        if !matches!(connected, Ok(Ok(()))) || sub.subscribe("").await.is_err() {
            tracing::debug!(backend = %backend.name, %endpoint, "KV events: cannot connect, retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        tracing::info!(backend = %backend.name, %endpoint, "KV events: subscribed");
        // What was published before the subscription took (or while it was down).
        let mut replayed = match &backend.kv_replay {
            Some(r) => intake.catch_up(r).await,
            None => None,
        };
        ca.set_precise(b, true);
        live.set(1);
        let mut last_event = Instant::now();
        let mut tick = tokio::time::interval(timeout / 2);
        loop {
            tokio::select! {
                msg = sub.recv() => {
                    let Ok(msg) = msg else { break };
                    let frames = msg.into_vec();
                    let (Some(seq), Some(payload)) = (frames.get(1), frames.get(2)) else { continue };
                    let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else { continue };
                    last_event = Instant::now();
                    if replayed.as_ref().is_some_and(|r| r.contains(&seq)) {
                        continue;
                    }
                    replayed = None;
                    if let (Some(r), true) = (&backend.kv_replay, intake.applier.is_gap(seq)) {
                        replayed = intake.catch_up(r).await;
                        if replayed.as_ref().is_some_and(|r| r.contains(&seq)) {
                            continue;
                        }
                    }
                    intake.take(seq, payload);
                    if !ca.is_precise(b) {
                        tracing::info!(backend = %backend.name, "KV events resumed: precise again");
                        ca.set_precise(b, true);
                        live.set(1);
                    }
                }
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) => {
                        tracing::warn!(backend = %backend.name, "KV events: disconnected, tracking approximately");
                        ca.set_precise(b, false);
                        live.set(0);
                    }
                    Some(SocketEvent::Connected(..)) if !ca.is_precise(b) => {
                        tracing::info!(backend = %backend.name, "KV events: reconnected");
                        if let Some(r) = &backend.kv_replay {
                            replayed = intake.catch_up(r).await;
                        }
                        ca.set_precise(b, true);
                        live.set(1);
                        last_event = Instant::now();
                    }
                    Some(_) => {}
                    None => break,
                },
                _ = tick.tick() => {
                    let silent = last_event.elapsed() > timeout;
                    if silent && ca.routed_since(b, last_event) && ca.is_precise(b) {
                        tracing::warn!(backend = %backend.name, "KV events silent while serving: tracking approximately");
                        ca.set_precise(b, false);
                        live.set(0);
                    }
                }
            }
        }
        ca.set_precise(b, false);
        live.set(0);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warmpath_wire::prefix::block_hashes;

    fn stored(tokens: &[u32], hashes: Vec<u64>, parent: Option<u64>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 16,
            lora_id: None,
            medium: None,
        }
    }

    #[test]
    fn stored_and_removed_blocks_with_warmpaths_own_keys() {
        let idx = PrefixIndex::new(2, 1000, None);
        let mut a = Applier::new(1, 16);
        let tokens: Vec<u32> = (0..64).collect();
        let ours = block_hashes(&tokens, 16, None);
        // Like the bundled engine: its keys are warmpath's.
        assert_eq!(a.check_seq(0, &idx), SeqCheck::First);
        a.apply(&[stored(&tokens[..32], ours[..2].to_vec(), None)], &idx);
        a.apply(&[stored(&tokens[32..], ours[2..].to_vec(), Some(ours[1]))], &idx);
        assert_eq!(idx.depths(&ours), vec![0, 4]);
        assert!(a.keys.is_empty(), "nothing to map");
        a.apply(&[KvEvent::BlockRemoved { block_hashes: vec![ours[3]], medium: None }], &idx);
        assert_eq!(idx.depths(&ours), vec![0, 3]);
        a.apply(&[KvEvent::AllBlocksCleared], &idx);
        assert_eq!(idx.depths(&ours), vec![0, 0]);
    }

    #[test]
    fn foreign_keys_are_recomputed_and_mapped_for_removal() {
        // Like vLLM: its own (here: made-up) keys for the same tokens.
        let idx = PrefixIndex::new(1, 1000, None);
        let mut a = Applier::new(0, 16);
        let tokens: Vec<u32> = (500..548).collect();
        let ours = block_hashes(&tokens, 16, None);
        let theirs = [11, 22, 33];
        a.apply(&[stored(&tokens[..16], vec![11], None)], &idx);
        a.apply(&[stored(&tokens[16..], vec![22, 33], Some(11))], &idx);
        assert_eq!(idx.depths(&ours), vec![3]);
        a.apply(&[KvEvent::BlockRemoved { block_hashes: theirs[1..].to_vec(), medium: None }], &idx);
        assert_eq!(idx.depths(&ours), vec![1]);
        assert_eq!(a.keys.len(), 1);
    }

    #[test]
    fn a_block_the_cache_evicts_into_a_tier_stays_held() {
        let idx = PrefixIndex::new(1, 1000, None);
        let mut a = Applier::new(0, 16);
        let tokens: Vec<u32> = (0..48).collect();
        let ours = block_hashes(&tokens, 16, None);
        a.apply(&[stored(&tokens, ours.clone(), None)], &idx);
        let medium = |m: &str| Some(m.to_owned());
        let tier = |hashes: Vec<u64>, m: &str| KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 16,
            lora_id: None,
            medium: medium(m),
        };
        // The bundled engine: the cache's removal, then the host tier's store.
        a.apply(
            &[
                KvEvent::BlockRemoved { block_hashes: ours[1..].to_vec(), medium: medium("GPU") },
                tier(ours[1..].to_vec(), "CPU"),
            ],
            &idx,
        );
        assert_eq!(idx.depths(&ours), vec![3], "in host memory");
        // Leaving host memory for disk: a tier's removal does not take it out.
        a.apply(
            &[
                KvEvent::BlockRemoved { block_hashes: vec![ours[2]], medium: medium("CPU") },
                tier(vec![ours[2]], "DISK"),
            ],
            &idx,
        );
        assert_eq!(idx.depths(&ours), vec![3]);
        // A cache removal with no tier after it does.
        a.apply(&[KvEvent::BlockRemoved { block_hashes: vec![ours[0]], medium: medium("GPU") }], &idx);
        assert_eq!(idx.depths(&ours), vec![0]);
    }

    #[tokio::test]
    async fn missed_batches_come_back_from_the_replay_socket() {
        // The bundled engine's publisher, with a replay socket keeping 100 batches.
        let p = warmpath_engine::kv_events::start_publisher(
            "tcp://127.0.0.1:0",
            String::new(),
            Some(("tcp://127.0.0.1:0", 100)),
        )
        .await
        .expect("binds");
        let endpoint = p.replay_endpoint.clone().expect("replay endpoint");
        let ep = endpoint.as_str();
        let chains: Vec<Vec<u32>> = (0..6u32).map(|k| (k * 100..k * 100 + 32).collect()).collect();
        let keys: Vec<Vec<u64>> = chains.iter().map(|t| block_hashes(t, 16, None)).collect();
        let publish = |k: usize| p.sink.send(vec![stored(&chains[k], keys[k].clone(), None)]);
        let kept = |n: usize| async move {
            for _ in 0..100 {
                if replay(ep, 0, Duration::from_secs(2)).await.expect("replays").len() == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("the publisher never kept {n} batches");
        };
        for k in 0..3 {
            publish(k);
        }
        kept(3).await;

        let metrics = Metrics::new();
        let index = PrefixIndex::new(1, 1000, None);
        let mut intake =
            Intake { applier: Applier::new(0, 16), index: &index, metrics: &metrics, labels: ["p", "b"] };
        // The first connect: everything kept, from sequence number 0.
        assert_eq!(intake.catch_up(&endpoint).await, Some(0..=2));
        for (k, key) in keys.iter().enumerate().take(3) {
            assert_eq!(index.depths(key), vec![2], "chain {k} from the replay");
        }
        // Batches 3 and 4 are lost on the way; 5 arrives live and shows the gap.
        for k in 3..6 {
            publish(k);
        }
        kept(6).await;
        assert!(intake.applier.is_gap(5) && !intake.applier.is_gap(3));
        let replayed = intake.catch_up(&endpoint).await.expect("replayed");
        assert_eq!(replayed, 3..=5, "from the next expected sequence number on");
        assert!(replayed.contains(&5), "the live copy of 5 is a duplicate");
        for (k, key) in keys.iter().enumerate().skip(3) {
            assert_eq!(index.depths(key), vec![2], "chain {k} recovered");
        }
        let m = String::from_utf8(metrics.render()).expect("text");
        assert!(m.contains("warmpath_kv_events_replayed_total{backend=\"b\",pool=\"p\"} 6"), "{m}");
        assert!(!m.contains("warmpath_kv_event_gaps_total{"), "no gap left: {m}");
        // Nothing new: an empty replay.
        assert_eq!(intake.catch_up(&endpoint).await, None);
        // No replay socket there: an error, not a hang.
        let dead = format!(
            "tcp://127.0.0.1:{}",
            std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
        );
        assert!(replay(&dead, 0, Duration::from_millis(300)).await.is_err());
    }

    #[test]
    fn a_restart_drops_the_backends_entries_a_gap_does_not() {
        let idx = PrefixIndex::new(1, 1000, None);
        let mut a = Applier::new(0, 16);
        let tokens: Vec<u32> = (0..32).collect();
        let ours = block_hashes(&tokens, 16, None);
        a.check_seq(5, &idx);
        a.apply(&[stored(&tokens, ours.clone(), None)], &idx);
        assert_eq!(a.check_seq(6, &idx), SeqCheck::InOrder);
        assert_eq!(idx.depths(&ours), vec![2]);
        assert_eq!(a.check_seq(9, &idx), SeqCheck::Gap { missed: 2 });
        assert_eq!(idx.depths(&ours), vec![2]);
        assert_eq!(a.check_seq(0, &idx), SeqCheck::Restarted);
        assert_eq!(idx.depths(&ours), vec![0]);
    }
}
