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
//! backend restarted, its cache empty) drops that backend's entries; a gap in the sequence (a
//! publisher dropping batches under load) is counted and otherwise lived with — dropping every
//! entry for a few lost batches cost more hits than the stale entries do (measured: see
//! bench/results/compare-trace-plain-*.md).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::StreamExt;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use warmpath_wire::kv_events::{decode_batch, KvEvent};
use warmpath_wire::prefix::{block_hash, root_hash};
use zeromq::{Socket, SocketEvent, SocketRecv};

use super::index::PrefixIndex;
use super::{Pool, Router};
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
            return theirs.to_vec();
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

/// Follows the KV events of every backend of every `cache_aware` pool in precise mode.
pub struct EventFeeds {
    pub router: Arc<Router>,
    pub metrics: Metrics,
}

#[async_trait]
impl BackgroundService for EventFeeds {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut tasks = Vec::new();
        for pool in self.router.pools() {
            if pool.cache_aware.is_none() || pool.cache_cfg.mode != IndexMode::Precise {
                continue;
            }
            for (i, b) in pool.backends.iter().enumerate() {
                let Some(endpoint) = b.kv_events.clone() else { continue };
                tasks.push(tokio::spawn(feed(pool.clone(), i, endpoint, self.metrics.clone())));
            }
        }
        let _ = shutdown.changed().await;
        for t in tasks {
            t.abort();
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
    let mut applier = Applier::new(b, pool.canon.encoder().block_units());
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
                    let Ok(batch) = decode_batch(payload) else {
                        metrics.kv_events.with_label_values(&[labels[0], labels[1], "malformed"]).inc();
                        continue;
                    };
                    let check = applier.check_seq(seq, ca.index());
                    if let SeqCheck::Gap { .. } | SeqCheck::Restarted = check {
                        tracing::warn!(backend = %backend.name, ?check, "KV events lost");
                        metrics.kv_event_gaps.with_label_values(&labels).inc();
                    }
                    let n = applier.apply(&batch.events, ca.index());
                    for (kind, v) in [("stored", n.stored), ("removed", n.removed), ("cleared", n.cleared)] {
                        if v > 0 {
                            metrics.kv_events.with_label_values(&[labels[0], labels[1], kind]).inc_by(v);
                        }
                    }
                    last_event = Instant::now();
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
