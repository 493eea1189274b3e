//! The scheduler's side of the second KV tier ([`crate::kv_tier`]): blocks the pool evicts are
//! copied there before anything overwrites them, and admission loads a prompt's blocks from it
//! where the pool's cached prefix ends and the tier's continues. Blocks computed here are
//! offered to the shared tier ([`crate::kv_tier::shared`]) once the step that filled them is done.

use warmpath_wire::kv_events::KvEvent;
use warmpath_wire::prefix::BlockHash;

use super::Scheduler;
use crate::block_pool::BlockId;
use crate::executor::Executor;
use crate::kv_tier::{BlockSink, DiskTier, LocalTiers, TierStats};

/// How many of `hashes`, from the start, `tier` holds.
pub(super) fn run(tier: Option<&LocalTiers>, hashes: &[BlockHash]) -> usize {
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
            // As vLLM's offloading announces them: the pool's own removals say GPU, these the
            // tier's medium, so that a router keeps what a tier holds.
            let bs = self.pool.block_size() as u32;
            for c in tier.take_changes() {
                let medium = Some(c.medium.to_owned());
                self.pool.emit(match c.stored {
                    true => KvEvent::BlockStored {
                        block_hashes: c.hashes,
                        parent_block_hash: None,
                        token_ids: Vec::new(),
                        block_size: bs,
                        lora_id: None,
                        medium,
                    },
                    false => KvEvent::BlockRemoved { block_hashes: c.hashes, medium },
                });
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
            if !tier.load(h, &mut |data| exec.write_block(b, data)) {
                break;
            }
            n += 1;
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

    /// Puts `disk` below the host tier (or below the pool, where there is none).
    pub fn set_disk_tier(&mut self, disk: DiskTier) {
        if self.cfg.enable_prefix_caching {
            self.pool.keep_evictions();
            self.tier = LocalTiers::new(self.cfg.kv_tier_blocks, Some(disk));
        }
    }

    /// Per medium (`cpu`, `disk`), blocks held and what it did since the last call.
    pub fn tier_states(&mut self) -> Vec<(&'static str, usize, TierStats)> {
        self.tier.as_mut().map(LocalTiers::states).unwrap_or_default()
    }

    /// Forgets every cached prefix, in the pool and the replica's own tiers (the shared tier
    /// is the fleet's: only what this replica remembers writing there is forgotten).
    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
        if let Some(t) = &mut self.tier {
            t.reset();
        }
        if let Some(s) = &self.sink {
            s.forget();
        }
    }
}
