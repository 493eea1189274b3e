//! Hit-rate references computed offline on the requests of a run, in the order they were sent,
//! with the engines' own accounting (chained block hashes, at most `len - 1` prompt tokens from
//! cache, hits and queries in tokens):
//! - the **oracle**: one infinite cache — what any routing could at best reuse;
//! - the **partition ceiling**: one LRU cache as large as all backends together. Splitting that
//!   capacity over backends can only lose hits, so no router beats it; it is what a router's
//!   hit rate is judged by.

use std::collections::{BTreeMap, HashMap, HashSet};

use warmpath_wire::prefix::{block_hashes, BlockHash};

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HitRate {
    pub hits: u64,
    pub queries: u64,
}

impl HitRate {
    pub fn rate(&self) -> f64 {
        if self.queries == 0 {
            return 0.0;
        }
        self.hits as f64 / self.queries as f64
    }
}

/// Usable leading hits: at most `(len - 1) / block_size` blocks, as the engines do.
fn usable(len: usize, block_size: usize) -> usize {
    len.saturating_sub(1) / block_size
}

pub fn oracle(prompts: &[&[u32]], block_size: usize) -> HitRate {
    let mut seen: HashSet<BlockHash> = HashSet::new();
    let mut r = HitRate::default();
    for p in prompts {
        let hashes = block_hashes(p, block_size, None);
        let hit = hashes.iter().take(usable(p.len(), block_size)).take_while(|h| seen.contains(h)).count();
        r.hits += (hit * block_size) as u64;
        r.queries += p.len() as u64;
        seen.extend(hashes);
    }
    r
}

/// One LRU cache of `capacity_blocks` blocks: a request's leading cached blocks are hits, then
/// every full block of its prompt becomes most recently used and the least recently used blocks
/// beyond capacity are evicted. Within a request the blocks are touched last to first, as the
/// engines (and vLLM) free a finished sequence's blocks in reverse, so a prompt's tail is
/// evicted before its head.
pub fn lru_ceiling(prompts: &[&[u32]], block_size: usize, capacity_blocks: usize) -> HitRate {
    let mut last_use: HashMap<BlockHash, u64> = HashMap::new();
    let mut by_age: BTreeMap<u64, BlockHash> = BTreeMap::new();
    let mut clock = 0u64;
    let mut r = HitRate::default();
    for p in prompts {
        let hashes = block_hashes(p, block_size, None);
        let hit =
            hashes.iter().take(usable(p.len(), block_size)).take_while(|h| last_use.contains_key(h)).count();
        r.hits += (hit * block_size) as u64;
        r.queries += p.len() as u64;
        for h in hashes.into_iter().rev() {
            clock += 1;
            if let Some(old) = last_use.insert(h, clock) {
                by_age.remove(&old);
            }
            by_age.insert(clock, h);
        }
        while last_use.len() > capacity_blocks {
            let Some((_, h)) = by_age.pop_first() else { break };
            last_use.remove(&h);
        }
    }
    r
}

/// Distinct full blocks over all prompts: the working set, in blocks.
pub fn working_set_blocks(prompts: &[&[u32]], block_size: usize) -> usize {
    let mut seen: HashSet<BlockHash> = HashSet::new();
    for p in prompts {
        seen.extend(block_hashes(p, block_size, None));
    }
    seen.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(blocks: &[u32], tail: usize) -> Vec<u32> {
        let mut v: Vec<u32> = blocks.iter().flat_map(|&b| (0..4).map(move |i| b * 100 + i)).collect();
        v.extend((0..tail as u32).map(|i| 9_000 + i));
        v
    }

    #[test]
    fn oracle_counts_leading_cached_blocks_only() {
        let (a, b, c) = (p(&[1, 2, 3], 1), p(&[1, 2, 4], 1), p(&[5, 2, 3], 1));
        let r = oracle(&[&a, &b, &c], 4);
        // b reuses blocks 1,2 (8 tokens); c shares block contents but not the prefix chain.
        assert_eq!(r, HitRate { hits: 8, queries: 39 });
    }

    #[test]
    fn the_last_token_is_never_a_hit() {
        let a = p(&[1, 2], 0);
        let r = oracle(&[&a, &a], 4);
        assert_eq!(r.hits, 4, "8 tokens: only the first block may come from cache");
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let (a, b) = (p(&[1, 2], 1), p(&[3, 4], 1));
        // Capacity 2 blocks: b evicts a, so a misses again; with 4 blocks a hits.
        assert_eq!(lru_ceiling(&[&a, &b, &a], 4, 2).hits, 0);
        assert_eq!(lru_ceiling(&[&a, &b, &a], 4, 4).hits, 8);
        // The tail goes first: with room for 3 blocks, a's head survives b.
        assert_eq!(lru_ceiling(&[&a, &b, &a], 4, 3).hits, 4);
        // Infinite capacity equals the oracle.
        let v = [&a[..], &b[..], &a[..], &b[..]];
        assert_eq!(lru_ceiling(&v, 4, usize::MAX), oracle(&v, 4));
        assert_eq!(working_set_blocks(&v, 4), 4);
    }
}
