//! A second KV tier in host memory beyond the block pool (vLLM's CPU offloading, LMCache's local
//! tier): a block the pool evicts is copied here, under its chained hash, and a prompt whose
//! prefix continues here past what the pool holds loads those blocks instead of computing them.
//!
//! Bounded (`--kv-tier-blocks`), least recently used first out. Every block keeps the xxh3 of
//! its bytes; one that no longer matches is dropped and never loaded (the prompt computes it).

use std::collections::HashMap;

use warmpath_wire::prefix::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

use super::lru::Lru;

struct Entry {
    data: Vec<u8>,
    sum: u64,
}

/// What the tier did since it was last asked ([`HostTier::take_stats`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierStats {
    pub stored: u64,
    pub loaded: u64,
    /// Dropped to make room.
    pub evicted: u64,
    /// Found damaged (checksum) and dropped, not loaded.
    pub corrupt: u64,
    /// Not written or not read: the medium failed (a disk tier's directory gone or full).
    pub failed: u64,
}

/// Blocks kept in host memory, by hash.
pub struct HostTier {
    capacity: usize,
    entries: HashMap<BlockHash, Entry>,
    lru: Lru,
    stats: TierStats,
}

impl HostTier {
    /// A tier of at most `capacity` blocks.
    pub fn new(capacity: usize) -> HostTier {
        HostTier { capacity, entries: HashMap::new(), lru: Lru::default(), stats: TierStats::default() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// Keeps `data` under `hash`, dropping the least recently used block when full; returns the
    /// blocks dropped (for a tier below this one).
    pub fn put(&mut self, hash: BlockHash, data: Vec<u8>) -> Vec<(BlockHash, Vec<u8>)> {
        let mut dropped = Vec::new();
        if self.capacity == 0 || data.is_empty() {
            return dropped;
        }
        if self.entries.contains_key(&hash) {
            self.lru.touch(hash);
            return dropped;
        }
        while self.entries.len() >= self.capacity {
            let Some(old) = self.lru.pop_oldest() else { break };
            if let Some(e) = self.entries.remove(&old) {
                dropped.push((old, e.data));
            }
            self.stats.evicted += 1;
        }
        let sum = xxh3_64(&data);
        self.entries.insert(hash, Entry { data, sum });
        self.lru.touch(hash);
        self.stats.stored += 1;
        dropped
    }

    /// The bytes kept under `hash`, checked; a damaged block is dropped and `None` returned.
    pub fn get(&mut self, hash: BlockHash) -> Option<&[u8]> {
        let e = self.entries.get(&hash)?;
        if xxh3_64(&e.data) != e.sum {
            self.entries.remove(&hash);
            self.lru.remove(hash);
            self.stats.corrupt += 1;
            return None;
        }
        self.lru.touch(hash);
        self.stats.loaded += 1;
        self.entries.get(&hash).map(|e| e.data.as_slice())
    }

    /// Counts since the last call.
    pub fn take_stats(&mut self) -> TierStats {
        std::mem::take(&mut self.stats)
    }

    /// Test hook: flips a bit of the block kept under `hash`, as failing memory would.
    #[cfg(test)]
    pub fn damage(&mut self, hash: BlockHash) {
        if let Some(b) = self.entries.get_mut(&hash).and_then(|e| e.data.first_mut()) {
            *b ^= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_tier_drops_what_was_used_longest_ago() {
        let mut t = HostTier::new(2);
        t.put(1, vec![1]);
        t.put(2, vec![2]);
        assert_eq!(t.get(1), Some(&[1u8][..]), "1 is now the newer");
        assert_eq!(t.put(3, vec![3]), vec![(2, vec![2])], "what it drops, for the tier below");
        assert!(t.contains(1) && t.contains(3) && !t.contains(2));
        assert_eq!(t.take_stats(), TierStats { stored: 3, loaded: 1, evicted: 1, ..TierStats::default() });
    }

    #[test]
    fn a_damaged_block_is_never_given_out() {
        let mut t = HostTier::new(4);
        t.put(7, vec![1, 2, 3]);
        t.damage(7);
        assert_eq!(t.get(7), None);
        assert!(!t.contains(7), "dropped");
        assert_eq!(t.take_stats().corrupt, 1);
    }

    #[test]
    fn a_tier_of_nothing_keeps_nothing() {
        let mut t = HostTier::new(0);
        t.put(1, vec![1]);
        assert!(t.is_empty());
    }
}
