//! The paged KV cache's bookkeeping: fixed-size blocks, reference counts, a prefix cache keyed
//! by chained block hashes, and vLLM v1's LRU free queue.
//!
//! Freed blocks keep their hash and stay findable until they are popped for reuse, so a
//! finished conversation's prefix is still a cache hit for the next turn. The free queue's front
//! is evicted first; a request's blocks are freed tail-first, so the ends of chains go before
//! their shared beginnings. The KV tensors themselves live in the executor; this module only
//! decides which block holds what.

use std::collections::HashMap;

use warmpath_wire::kv_events::KvEvent;
use warmpath_wire::prefix::BlockHash;

/// Index of a block in the KV cache.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Block bookkeeping of one engine.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    ref_cnt: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    // Intrusive doubly linked free queue over block ids: O(1) removal when a hit revives a block.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
    events: Option<Vec<KvEvent>>,
    /// Where a second tier keeps evicted blocks: the blocks evicted since the last
    /// [`BlockPool::take_evicted`], whose bytes are still in place until the next step.
    evicted: Option<Vec<(BlockId, BlockHash)>>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens. With `record_events`, every change
    /// of the cached set is queued for [`BlockPool::take_events`].
    pub fn new(num_blocks: usize, block_size: usize, record_events: bool) -> BlockPool {
        assert!(num_blocks > 0 && num_blocks < NIL as usize && block_size > 0);
        let n = num_blocks as u32;
        BlockPool {
            block_size,
            ref_cnt: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            prev: (0..n).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n).map(|i| if i + 1 == n { NIL } else { i + 1 }).collect(),
            head: 0,
            tail: n - 1,
            num_free: num_blocks,
            cached: HashMap::new(),
            events: record_events.then(Vec::new),
            evicted: None,
        }
    }

    /// Keeps a list of evicted blocks for a second tier to copy ([`BlockPool::take_evicted`]).
    pub fn keep_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The blocks evicted since the last call, with the hash each held; their bytes stay in
    /// place until a step writes them.
    pub fn take_evicted(&mut self) -> Vec<(BlockId, BlockHash)> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    /// Blocks that can be handed out (free, cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Fraction of blocks in use by requests (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.num_blocks() as f64
    }

    /// Number of blocks whose contents are findable by hash.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// The longest run of `hashes`, from the start, that is cached, at most `max_blocks` long.
    pub fn find_cached_prefix(&self, hashes: &[BlockHash], max_blocks: usize) -> Vec<BlockId> {
        hashes.iter().take(max_blocks).map_while(|h| self.cached.get(h).copied()).collect()
    }

    /// How many of `blocks` sit in the free queue (touching them takes them out of it).
    pub fn count_free(&self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|&&b| self.ref_cnt[b as usize] == 0).count()
    }

    /// Takes a reference on cache hits, reviving free ones.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.ref_cnt[b as usize] == 0 {
                self.unlink(b);
            }
            self.ref_cnt[b as usize] += 1;
        }
    }

    /// `n` fresh blocks from the front of the free queue, evicting their cached contents; `None`
    /// (and nothing taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        let mut evicted = Vec::new();
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                    evicted.push(h);
                    if let Some(kept) = &mut self.evicted {
                        kept.push((b, h));
                    }
                }
            }
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        if !evicted.is_empty() {
            self.emit(KvEvent::BlockRemoved { block_hashes: evicted, medium: Some("GPU".into()) });
        }
        Some(out)
    }

    /// Drops one reference on each of a request's blocks, given in table order; they are queued
    /// tail-first so that chain ends are evicted before chain beginnings.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let rc = &mut self.ref_cnt[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc = rc.saturating_sub(1);
            if *rc == 0 {
                self.push_back(b);
            }
        }
    }

    /// Makes full, computed blocks findable. `blocks[i]` holds `tokens[i*bs..(i+1)*bs]` with key
    /// `hashes[i]`; `parent` is the key of the block before `blocks[0]` (None at the start).
    /// A key already cached in another block (computed twice concurrently) is left as it is.
    pub fn cache_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) {
        debug_assert_eq!(blocks.len(), hashes.len());
        let mut stored = Vec::new();
        for (&b, &h) in blocks.iter().zip(hashes) {
            if self.hash[b as usize].is_some() || self.cached.contains_key(&h) {
                continue;
            }
            self.hash[b as usize] = Some(h);
            self.cached.insert(h, b);
            stored.push(h);
        }
        if stored.len() == hashes.len() && !stored.is_empty() {
            self.emit(KvEvent::BlockStored {
                block_hashes: stored,
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size: self.block_size as u32,
                lora_id: None,
                medium: Some("GPU".into()),
            });
        } else if !stored.is_empty() {
            // Some blocks were duplicates: describe each stored one with its own parent.
            let bs = self.block_size;
            for (i, &h) in hashes.iter().enumerate() {
                if stored.contains(&h) {
                    let parent = if i == 0 { parent } else { Some(hashes[i - 1]) };
                    self.emit(KvEvent::BlockStored {
                        block_hashes: vec![h],
                        parent_block_hash: parent,
                        token_ids: tokens[i * bs..(i + 1) * bs].to_vec(),
                        block_size: bs as u32,
                        lora_id: None,
                        medium: Some("GPU".into()),
                    });
                }
            }
        }
    }

    /// Forgets every cached hash (vLLM's `reset_prefix_cache`). Blocks in use keep their data.
    pub fn reset_prefix_cache(&mut self) {
        self.cached.clear();
        self.hash.iter_mut().for_each(|h| *h = None);
        self.emit(KvEvent::AllBlocksCleared);
    }

    /// Events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The free queue, front (next evicted) first. For tests and debugging.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut b = self.head;
        while b != NIL {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_cnt[b as usize]
    }

    /// Queues `ev` for [`BlockPool::take_events`] where events are recorded (also the tiers':
    /// blocks stored in or dropped from host memory or disk).
    pub fn emit(&mut self, ev: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(ev);
        }
    }

    fn unlink(&mut self, b: BlockId) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, b: BlockId) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warmpath_wire::prefix::block_hashes;

    fn cache_all(pool: &mut BlockPool, blocks: &[BlockId], tokens: &[u32]) -> Vec<BlockHash> {
        let h = block_hashes(tokens, pool.block_size(), None);
        pool.cache_blocks(blocks, &h, None, tokens);
        h
    }

    #[test]
    fn allocate_takes_from_the_front_and_refuses_when_short() {
        let mut p = BlockPool::new(4, 16, false);
        assert_eq!(p.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(p.allocate(2), None, "all or nothing");
        assert_eq!(p.num_free(), 1);
        assert!((p.usage() - 0.75).abs() < 1e-9);
    }

    #[test]
    fn freed_blocks_stay_cached_until_reused() {
        let mut p = BlockPool::new(4, 2, false);
        let toks = [1, 2, 3, 4];
        let blocks = p.allocate(2).expect("free");
        let h = cache_all(&mut p, &blocks, &toks);
        p.free(&blocks);
        assert_eq!(p.find_cached_prefix(&h, 8), blocks, "hit after free");
        // Two more allocations pop blocks 2, 3 first (never used), then the freed ones.
        p.allocate(2).expect("free");
        assert_eq!(p.find_cached_prefix(&h, 8).len(), 2);
        p.allocate(1).expect("free");
        assert_eq!(p.find_cached_prefix(&h, 8).len(), 1, "tail (block 1) evicted first");
        assert_eq!(p.find_cached_prefix(&h, 8), vec![0]);
    }

    #[test]
    fn free_queues_tail_first_and_touch_revives() {
        let mut p = BlockPool::new(3, 2, false);
        let b = p.allocate(3).expect("free");
        p.free(&b);
        assert_eq!(p.free_queue(), vec![2, 1, 0]);
        p.touch(&[1]);
        assert_eq!(p.free_queue(), vec![2, 0]);
        assert_eq!(p.ref_count(1), 1);
        p.touch(&[1]);
        assert_eq!(p.ref_count(1), 2);
        p.free(&[1]);
        assert_eq!(p.free_queue(), vec![2, 0], "still referenced");
        p.free(&[1]);
        assert_eq!(p.free_queue(), vec![2, 0, 1]);
    }

    #[test]
    fn hits_stop_at_the_first_miss_and_at_the_limit() {
        let mut p = BlockPool::new(8, 2, false);
        let toks = [1, 2, 3, 4, 5, 6];
        let blocks = p.allocate(3).expect("free");
        let h = cache_all(&mut p, &blocks, &toks);
        assert_eq!(p.find_cached_prefix(&h, 2), vec![0, 1]);
        let other = block_hashes(&[1, 2, 9, 9, 5, 6], 2, None);
        assert_eq!(p.find_cached_prefix(&other, 8), vec![0], "chain breaks at block 1");
    }

    #[test]
    fn events_describe_stores_and_evictions() {
        let mut p = BlockPool::new(2, 2, true);
        let b = p.allocate(2).expect("free");
        let h = cache_all(&mut p, &b, &[1, 2, 3, 4]);
        p.free(&b);
        p.allocate(1).expect("free");
        let ev = p.take_events();
        assert_eq!(ev.len(), 2);
        match &ev[0] {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } => {
                assert_eq!(block_hashes, &h);
                assert_eq!(*parent_block_hash, None);
                assert_eq!(token_ids, &vec![1, 2, 3, 4]);
            }
            e => panic!("unexpected {e:?}"),
        }
        assert_eq!(ev[1], KvEvent::BlockRemoved { block_hashes: vec![h[1]], medium: Some("GPU".into()) });
        assert!(p.take_events().is_empty());
    }

    #[test]
    fn duplicate_contents_are_not_cached_twice() {
        let mut p = BlockPool::new(4, 2, true);
        let a = p.allocate(1).expect("free");
        let b = p.allocate(1).expect("free");
        cache_all(&mut p, &a, &[7, 7]);
        cache_all(&mut p, &b, &[7, 7]);
        assert_eq!(p.num_cached(), 1);
        assert_eq!(p.take_events().len(), 1);
        p.free(&b);
        p.allocate(3).expect("free");
        assert_eq!(p.num_cached(), 1, "evicting the duplicate keeps the original findable");
    }

    #[test]
    fn reset_forgets_everything() {
        let mut p = BlockPool::new(2, 2, true);
        let b = p.allocate(1).expect("free");
        let h = cache_all(&mut p, &b, &[1, 2]);
        p.reset_prefix_cache();
        assert!(p.find_cached_prefix(&h, 4).is_empty());
        assert_eq!(p.take_events().last(), Some(&KvEvent::AllBlocksCleared));
    }
}
