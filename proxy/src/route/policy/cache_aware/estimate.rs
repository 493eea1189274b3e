//! The cost model of `cache_aware`: each backend's estimated prefill work for one prompt (what
//! it does not hold, weighted by `miss_weight`, plus what is queued there), and the keys ties
//! are broken by.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::CacheAware;
use crate::route::policy::{Candidate, RouteKey};

/// One backend's numbers for one decision.
#[derive(Debug, Clone, Copy)]
pub(super) struct Estimate {
    pub index: usize,
    pub cached: u64,
    pub cost: f64,
}

impl CacheAware {
    /// Requests lately that found their longest held prefix ending at `block`.
    pub(super) fn shared_by(&self, block: u64, now: u64) -> f64 {
        self.shared.get(block).map_or(0.0, |(n, at)| {
            n * (-(now.saturating_sub(at) as f64 / 1e6) / self.window.as_secs_f64().max(1e-3)).exp()
        })
    }

    /// The backends' estimates, the last block of the longest prefix any of them holds, and
    /// how many requests lately shared that prefix.
    pub(super) fn estimates(
        &self,
        key: &RouteKey,
        candidates: &[Candidate],
    ) -> (Vec<Estimate>, Option<u64>, f64) {
        let depths = if key.blocks.is_empty() { Vec::new() } else { self.index.depths(&key.blocks) };
        let up = |i: usize| candidates.get(i).is_some_and(Candidate::is_up);
        let deepest = depths.iter().enumerate().filter(|&(i, _)| up(i)).map(|(_, &d)| d).max().unwrap_or(0);
        let held_block = (deepest > 0).then(|| key.blocks[deepest as usize - 1]);
        let shared = held_block.map_or(0.0, |b| self.shared_by(b, self.now_us()));
        let tokens = key.tokens as u64;
        let per_block = key.per_block as u64;
        let held_share = (u64::from(deepest) * per_block).min(tokens) as f64 / tokens.max(1) as f64;
        let miss_weight = 1.0 + (self.miss_weight - 1.0) * held_share / shared.max(1.0);
        let decode_cost = self.decode_cost as f64 * self.units_per_token();
        let est = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_up())
            .map(|(i, c)| {
                let cached = (u64::from(depths.get(i).copied().unwrap_or(0)) * per_block).min(tokens);
                let running = (c.inflight as u64).max(u64::from(c.reported));
                let queued = c.pending_tokens as f64 + decode_cost * running as f64;
                let work = miss_weight * (tokens - cached) as f64 + queued;
                Estimate { index: i, cached, cost: work / f64::from(c.weight.max(1)) }
            })
            .collect();
        (est, held_block, shared)
    }

    /// Rendezvous weight of backend `i` for this prompt.
    pub(super) fn rank(&self, spread_key: u64, i: usize) -> u64 {
        xxh3_64_with_seed(&spread_key.to_le_bytes(), self.seeds[i])
    }

    /// The key ties are spread by: the `spread_blocks`-th block past the first `held` (the
    /// longest prefix any candidate holds), or the last block.
    pub(super) fn spread_key(&self, key: &RouteKey, held: usize) -> u64 {
        match key.blocks.len() {
            0 => key.prefix.unwrap_or(0),
            n => key.blocks[(held + self.spread_blocks).min(n) - 1],
        }
    }
}
