//! The cost model of `cache_aware`: each backend's estimated prefill work for one prompt (what
//! it does not hold, weighted by `miss_weight`, or fetches from a peer or loads from the shared
//! tier at `fetch_weight` or `tier_weight`, plus what is queued there), and the keys ties are
//! broken by.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::CacheAware;
use std::sync::atomic::Ordering;

use crate::route::draw::xorshift;
use crate::route::policy::{Candidate, Candidates, RouteKey};

/// Backends measured per decision in a pool larger than this: the conversation's home, the
/// holders of the prompt's longest held prefix, [`RANDOM`] others, and the holders of its first
/// block (see [`crate::route::index::PrefixIndex::sampled_depths`]); a pool this size or
/// smaller is measured whole. The cost model is exact for every backend measured.
pub const SAMPLE: usize = 128;

/// Backends drawn at random into a sample: a prompt nobody holds goes to the cheapest of them
/// (the power of d choices), and their mean load stands for the pool's.
pub const RANDOM: usize = 16;

/// One backend's numbers for one decision.
#[derive(Debug, Clone, Copy)]
pub(super) struct Estimate {
    pub index: usize,
    pub cached: u64,
    pub inflight: usize,
    pub cost: f64,
    /// Where the cost counts the prompt's prefix as fetched from another backend's cache: that
    /// backend, and the tokens fetched.
    pub fetch: Option<(usize, u64)>,
    /// Tokens the cost counts as loaded from the pool's shared KV tier.
    pub tiered: u64,
}

/// What one decision weighs.
#[derive(Debug)]
pub(super) struct Estimates {
    /// The backends measured that are up.
    pub est: Vec<Estimate>,
    /// The last block of the longest prefix any of them holds.
    pub held_block: Option<u64>,
    /// How many requests lately shared that prefix.
    pub shared: f64,
    /// The pool's mean in-flight count (over the random draw where the pool was sampled).
    pub mean_inflight: f64,
}

impl CacheAware {
    /// Requests lately that found their longest held prefix ending at `block`.
    pub(super) fn shared_by(&self, block: u64, now: u64) -> f64 {
        self.shared.get(block).map_or(0.0, |(n, at)| {
            n * (-(now.saturating_sub(at) as f64 / 1e6) / self.window.as_secs_f64().max(1e-3)).exp()
        })
    }

    /// The estimates of the backends measured for this prompt (every backend of a pool up to
    /// [`SAMPLE`], a sample of a larger one: see [`Estimates`]).
    pub(super) fn estimates(
        &self,
        key: &RouteKey,
        candidates: &dyn Candidates,
        home: Option<usize>,
    ) -> Estimates {
        let n = candidates.len();
        let sampled = n > SAMPLE;
        let random = if sampled { self.draw(key, n) } else { Vec::new() };
        let measured: Vec<(usize, u32)> = if sampled {
            let pinned: Vec<usize> = home.into_iter().collect();
            self.index.sampled_depths(&key.blocks, &pinned, &random, SAMPLE)
        } else {
            self.index.depths(&key.blocks).into_iter().enumerate().collect()
        };
        let read: Vec<(usize, Candidate, u32)> = measured
            .into_iter()
            .map(|(i, d)| (i, candidates.get(i), d))
            .filter(|(_, c, _)| c.is_up())
            .collect();
        if read.is_empty() && sampled {
            // Nobody sampled is up: look for those who are, once.
            let up: Vec<usize> = (0..n).filter(|&i| candidates.get(i).is_up()).take(SAMPLE).collect();
            if !up.is_empty() {
                let measured = self.index.sampled_depths(&key.blocks, &up, &[], SAMPLE);
                let read = measured.into_iter().map(|(i, d)| (i, candidates.get(i), d)).collect();
                return self.estimate(key, read, &[]);
            }
        }
        self.estimate(key, read, &random)
    }

    /// The cost model over the backends read; `random` are those drawn at random (the ones
    /// whose mean load stands for the pool's), empty when the pool was read whole.
    fn estimate(&self, key: &RouteKey, read: Vec<(usize, Candidate, u32)>, random: &[usize]) -> Estimates {
        let deepest = read.iter().map(|&(_, _, d)| d).max().unwrap_or(0);
        let held_block = (deepest > 0).then(|| key.blocks[deepest as usize - 1]);
        let shared = held_block.map_or(0.0, |b| self.shared_by(b, self.now_us()));
        let tokens = key.tokens as u64;
        let per_block = key.per_block as u64;
        let held_share = (u64::from(deepest) * per_block).min(tokens) as f64 / tokens.max(1) as f64;
        let miss_weight = 1.0 + (self.miss_weight - 1.0) * held_share / shared.max(1.0);
        let decode_cost = self.decode_cost as f64 * self.units_per_token();
        // Over the random draw where there is one (and any of it is up), else over all read.
        let mean_of = |drawn_only: bool| {
            let (sum, n) = read
                .iter()
                .filter(|(i, ..)| !drawn_only || random.contains(i))
                .fold((0.0, 0usize), |(s, n), (_, c, _)| (s + c.inflight as f64, n + 1));
            (n > 0).then(|| sum / n as f64)
        };
        let mean_inflight = mean_of(true).or_else(|| mean_of(false)).unwrap_or(0.0);
        // The deepest holder that serves its K/V to the others: a backend holding less may
        // fetch the prefix from it (`fetch_weight` a token) instead of computing it.
        let source = read
            .iter()
            .filter(|(_, c, d)| c.fetchable && *d > 0)
            .max_by_key(|(i, _, d)| (*d, std::cmp::Reverse(*i)))
            .map(|&(i, _, d)| (i, (u64::from(d) * per_block).min(tokens)))
            .filter(|_| self.fetch_weight > 0.0);
        // What the deepest backend writing to the shared tier computed is there for every
        // backend reading it (`tier_weight` a token).
        let tier_held = read
            .iter()
            .filter(|(_, c, d)| c.shared_tier && *d > 0)
            .map(|&(_, _, d)| (u64::from(d) * per_block).min(tokens))
            .max()
            .filter(|_| self.tier_weight > 0.0);
        let est = read
            .into_iter()
            .map(|(i, c, depth)| {
                let cached = (u64::from(depth) * per_block).min(tokens);
                let running = (c.inflight as u64).max(u64::from(c.reported));
                let queued = c.pending_tokens as f64 + decode_cost * running as f64;
                // Computing what is not held, the prefix up to `held` brought at `weight` a token.
                let work_with = |held: u64, weight: f64| {
                    miss_weight * (tokens - held) as f64 + weight * (held - cached) as f64 + queued
                };
                let mut work = work_with(cached, 0.0);
                let mut fetch = None;
                if let Some((src, held)) = source.filter(|&(src, held)| src != i && held > cached) {
                    let alt = work_with(held, self.fetch_weight);
                    if alt < work {
                        (work, fetch) = (alt, Some((src, held - cached)));
                    }
                }
                let mut tiered = 0;
                if let Some(held) = tier_held.filter(|&held| c.shared_tier && held > cached) {
                    let alt = work_with(held, self.tier_weight);
                    if alt < work {
                        (work, fetch, tiered) = (alt, None, held - cached);
                    }
                }
                Estimate {
                    index: i,
                    cached,
                    inflight: c.inflight,
                    cost: work / f64::from(c.weight.max(1)),
                    fetch,
                    tiered,
                }
            })
            .collect();
        Estimates { est, held_block, shared, mean_inflight }
    }

    /// [`RANDOM`] backends drawn for this prompt (a rotating draw, so that prompts nobody holds
    /// spread over the whole pool).
    fn draw(&self, key: &RouteKey, n: usize) -> Vec<usize> {
        let seed = key.blocks.last().copied().or(key.prefix).unwrap_or(0);
        let mut x = seed ^ self.draws.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..RANDOM).map(|_| (xorshift(&mut x) % n as u64) as usize).collect()
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
