//! The scheduler's side of the second KV tier ([`crate::kv_tier`]): blocks the pool evicts are
//! copied there before anything overwrites them, and admission loads a prompt's blocks from it
//! where the pool's cached prefix ends and the tier's continues. Blocks computed here are
//! offered to the shared tier ([`crate::kv_tier::shared`]) once the step that filled them is done.

use warmpath_wire::prefix::BlockHash;

use super::Scheduler;
use crate::block_pool::BlockId;
use crate::executor::Executor;
use crate::kv_tier::{BlockSink, HostTier, TierStats};

/// How many of `hashes`, from the start, `tier` holds.
pub(super) fn run(tier: Option<&HostTier>, hashes: &[BlockHash]) -> usize {
    tier.map_or(0, |t| hashes.iter().take_while(|&&h| t.contains(h)).count())
}

impl Scheduler {
    /// `n` fresh blocks ([`crate::block_pool::BlockPool::allocate`]); the cached blocks that
    /// evicts go to the tier first, while their bytes are still in place.
    pub fn allocate(&mut self, exec: &mut dyn Executor, n: usize) -> Option<Vec<BlockId>> {
        let got = self.pool.allocate(n);
        if let Some(tier) = &mut self.tier {
            for (b, h) in self.pool.take_evicted() {
                let mut data = Vec::with_capacity(exec.block_bytes());
                exec.read_block(b, &mut data);
                tier.put(h, data);
            }
        }
        got
    }

    /// Writes the tier's blocks under `hashes` into `blocks` and makes them findable (KV events
    /// announce them as blocks stored); `tokens` are theirs, `parent` the hash before the first.
    /// Stops at a block that fails its check; returns how many were loaded.
    pub(super) fn load_tier(
        &mut self,
        exec: &mut dyn Executor,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        blocks: &[BlockId],
        tokens: &[u32],
    ) -> usize {
        let Some(tier) = &mut self.tier else { return 0 };
        let mut n = 0;
        for (&h, &b) in hashes.iter().zip(blocks) {
            match tier.get(h) {
                Some(data) if exec.write_block(b, data) => n += 1,
                _ => break,
            }
        }
        if n > 0 {
            let bs = self.pool.block_size();
            self.pool.cache_blocks(&blocks[..n], &hashes[..n], parent, &tokens[..n * bs]);
        }
        n
    }

    /// Writes the blocks computed from now on through to `sink`.
    pub fn set_sink(&mut self, sink: std::sync::Arc<dyn BlockSink>) {
        self.sink = Some(sink);
    }

    /// Offers the blocks the last step computed to the sink. They are read before the next
    /// step allocates anything, so a finished request's freed blocks still hold their K/V.
    pub(super) fn write_through(&mut self, exec: &mut dyn Executor) {
        let Some(sink) = &self.sink else { return };
        for (b, h) in self.computed.drain(..) {
            let mut data = Vec::with_capacity(exec.block_bytes());
            exec.read_block(b, &mut data);
            sink.offer(h, data);
        }
    }

    /// Blocks the tier holds, and what it did since the last call; `None` without a tier.
    pub fn tier_state(&mut self) -> Option<(usize, TierStats)> {
        self.tier.as_mut().map(|t| (t.len(), t.take_stats()))
    }

    /// Forgets every cached prefix, in the pool and in the tier.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
        if let Some(t) = &mut self.tier {
            *t = HostTier::new(self.cfg.kv_tier_blocks);
        }
    }
}
