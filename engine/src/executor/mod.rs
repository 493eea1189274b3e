//! Executors run one scheduler step: compute the scheduled tokens of every sequence in the
//! batch, writing their K/V into the paged cache, and sample the next token where a sequence
//! has reached the end of its known tokens.
//!
//! - [`llama::LlamaExecutor`]: the real forward pass on the CPU.
//! - [`sim::SimExecutor`]: a timing model in place of the math, for fleets of simulated replicas.

mod attention;
pub mod llama;
pub mod sim;

use crate::block_pool::BlockId;
use crate::sampler::Sampler;

/// One sequence's share of a step.
pub struct SeqStep<'a> {
    /// The tokens to compute this step.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions before it are already in the cache.
    pub start_pos: usize,
    /// The sequence's blocks, covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [BlockId],
    /// The last `num_draft` of `tokens` are proposed, not known: verify them
    /// ([`Sampler::verify`]) with the logits of the last `num_draft + 1` positions.
    pub num_draft: usize,
    /// Set when the last of `tokens` is the last known (or proposed) token: sample the next one.
    pub sampler: Option<&'a mut Sampler>,
}

/// A model executor.
pub trait Executor: Send {
    /// `llama` or `sim`, reported in logs and metrics.
    fn name(&self) -> &'static str;

    /// Runs one step; returns, per entry, the tokens sampled when its `sampler` was set (the
    /// proposals kept and one more), else none.
    fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Vec<u32>>;

    /// Bytes of one block's K/V as [`Executor::read_block`] gives them (0: this executor's
    /// K/V cannot be moved).
    fn block_bytes(&self) -> usize {
        0
    }

    /// Appends block `b`'s K/V to `out` (for another replica of the same model to load:
    /// prefill/decode disaggregation, [`crate::kv_transfer`]).
    fn read_block(&self, _b: BlockId, _out: &mut Vec<u8>) {}

    /// Fills block `b` with K/V that [`Executor::read_block`] gave; false (and nothing
    /// written) when `data` is not one block of this executor's model.
    fn write_block(&mut self, _b: BlockId, _data: &[u8]) -> bool {
        false
    }
}
