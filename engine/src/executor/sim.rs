//! A timing model in place of the math (llm-d-inference-sim's model), so that one machine can
//! host dozens of replicas: the scheduler, block pool, KV events and metrics are the real ones;
//! only the forward pass is replaced by a sleep of the time it would have taken.
//!
//! A step that prefills `p` uncached tokens and decodes `d` sequences takes
//! `prefill_overhead·[p>0] + p·prefill_per_token + [d>0]·itl·(1 + load_factor·d/max_num_seqs)`,
//! each term with bounded multiplicative jitter. Prefix-cache hits shrink `p`, so they shorten
//! TTFT exactly as on a real engine.
//!
//! In place of K/V, each block slot keeps the token computed there, so that a block handed to
//! another replica ([`crate::kv_transfer`]) carries what it holds and a test can check that
//! what arrived is what was computed.

use std::time::Duration;

use super::{Executor, SeqStep};
use crate::block_pool::BlockId;
use crate::sampler::Rng;

/// Parameters of the timing model.
#[derive(Debug, Clone)]
pub struct SimTiming {
    pub prefill_overhead: Duration,
    pub prefill_per_token: Duration,
    pub inter_token_latency: Duration,
    /// Extra decode slow-down when `max_num_seqs` sequences decode together (0.5 = 50 %).
    pub load_factor: f64,
    /// Relative jitter bound (0.1 = ±10 %).
    pub jitter: f64,
    pub max_num_seqs: usize,
    /// Time to load one block's K/V into the cache (from a host tier or another replica):
    /// what a PCIe or network copy of a real model's block would take.
    pub block_load: Duration,
}

/// The `sim` executor.
pub struct SimExecutor {
    timing: SimTiming,
    vocab: u32,
    rng: Rng,
    block_size: usize,
    /// The token computed at each slot of each block (`num_blocks × block_size`).
    slots: Vec<u32>,
}

impl SimExecutor {
    /// `vocab` bounds the ordinary ids it emits (it never emits special tokens, so a sim request
    /// runs to `max_tokens`). The cache has `num_blocks` blocks of `block_size` tokens.
    pub fn new(
        timing: SimTiming,
        vocab: u32,
        seed: u64,
        num_blocks: usize,
        block_size: usize,
    ) -> SimExecutor {
        let block_size = block_size.max(1);
        SimExecutor {
            timing,
            vocab,
            rng: Rng::new(seed),
            block_size,
            slots: vec![0; num_blocks * block_size],
        }
    }

    /// Records the tokens of one sequence's step in their slots.
    fn store(&mut self, s: &SeqStep<'_>) {
        let bs = self.block_size;
        for (j, &t) in s.tokens.iter().enumerate() {
            let pos = s.start_pos + j;
            if let Some(&b) = s.block_table.get(pos / bs) {
                if let Some(slot) = self.slots.get_mut(b as usize * bs + pos % bs) {
                    *slot = t;
                }
            }
        }
    }

    /// How long a step with `prefill_tokens` to prefill and `decodes` sequences decoding takes.
    pub fn step_time(&mut self, prefill_tokens: usize, decodes: usize) -> Duration {
        let t = self.timing.clone();
        let mut secs = 0.0;
        if prefill_tokens > 0 {
            let p =
                t.prefill_overhead.as_secs_f64() + prefill_tokens as f64 * t.prefill_per_token.as_secs_f64();
            secs += p * self.jitter();
        }
        if decodes > 0 {
            let load = 1.0 + t.load_factor * decodes as f64 / t.max_num_seqs.max(1) as f64;
            secs += t.inter_token_latency.as_secs_f64() * load * self.jitter();
        }
        Duration::from_secs_f64(secs)
    }

    fn jitter(&mut self) -> f64 {
        1.0 + self.timing.jitter * (2.0 * self.rng.next_f32() as f64 - 1.0)
    }
}

impl Executor for SimExecutor {
    fn name(&self) -> &'static str {
        "sim"
    }

    /// Proposals are computed (their time counted) but never kept: the timing model has no
    /// text to agree with.
    fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Vec<u32>> {
        let decodes =
            batch.iter().filter(|s| s.tokens.len() == 1 && s.start_pos > 0 && s.sampler.is_some()).count();
        let prefill: usize = batch.iter().map(|s| s.tokens.len()).sum::<usize>() - decodes;
        std::thread::sleep(self.step_time(prefill, decodes));
        for s in batch.iter() {
            self.store(s);
        }
        let vocab = self.vocab;
        batch
            .iter_mut()
            .map(|s| {
                let Some(sampler) = s.sampler.as_deref_mut() else { return Vec::new() };
                let Some(&last) = s.tokens.get(s.tokens.len().wrapping_sub(1 + s.num_draft)) else {
                    return Vec::new();
                };
                let last = last as u64;
                let pos = (s.start_pos + s.tokens.len() - s.num_draft) as u64;
                // Greedy: a fixed function of context; otherwise the request's own RNG.
                let r = if sampler.is_greedy() {
                    Rng::new(last.wrapping_mul(0x9E37_79B9).wrapping_add(pos)).next_u64()
                } else {
                    sampler.rng().next_u64()
                };
                vec![(r % vocab as u64) as u32]
            })
            .collect()
    }

    fn block_bytes(&self) -> usize {
        self.block_size * 4
    }

    fn read_block(&self, b: BlockId, out: &mut Vec<u8>) {
        let at = b as usize * self.block_size;
        if let Some(slots) = self.slots.get(at..at + self.block_size) {
            out.extend(slots.iter().flat_map(|t| t.to_le_bytes()));
        }
    }

    fn write_block(&mut self, b: BlockId, data: &[u8]) -> bool {
        if !self.timing.block_load.is_zero() {
            std::thread::sleep(self.timing.block_load);
        }
        let at = b as usize * self.block_size;
        let Some(slots) = self.slots.get_mut(at..at + self.block_size) else { return false };
        if data.len() != slots.len() * 4 {
            return false;
        }
        for (t, q) in slots.iter_mut().zip(data.chunks_exact(4)) {
            *t = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing() -> SimTiming {
        SimTiming {
            prefill_overhead: Duration::from_millis(10),
            prefill_per_token: Duration::from_micros(100),
            inter_token_latency: Duration::from_millis(5),
            load_factor: 1.0,
            jitter: 0.0,
            max_num_seqs: 10,
            block_load: Duration::ZERO,
        }
    }

    #[test]
    fn time_follows_the_model() {
        let mut s = SimExecutor::new(timing(), 100, 1, 4, 16);
        assert_eq!(s.step_time(0, 0), Duration::ZERO);
        assert_eq!(s.step_time(1000, 0), Duration::from_millis(110));
        assert_eq!(s.step_time(0, 10), Duration::from_millis(10), "full load doubles ITL");
    }

    #[test]
    fn jitter_is_bounded() {
        let mut t = timing();
        t.jitter = 0.2;
        let mut s = SimExecutor::new(t, 100, 1, 4, 16);
        for _ in 0..100 {
            let d = s.step_time(1000, 0).as_secs_f64();
            assert!((0.088..=0.132).contains(&d), "{d}");
        }
    }
}
