//! One request in the engine: its tokens, its place in the KV cache, how it samples, and what a
//! scheduler step reports of it.

use std::time::{Duration, Instant};

use warmpath_wire::openai::FinishReason;
use warmpath_wire::prefix::BlockHash;

use crate::block_pool::BlockId;
use crate::sampler::{Sampler, TokenLogprobs};
use crate::spec::Drafter;

/// What a request asks of generation.
#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// Tokens that end generation (EOS and end-of-turn unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Test hook (`--script`): the output tokens, in order, whatever the model computes; the
    /// model still runs every step. Empty: sample.
    pub forced: Vec<u32>,
    /// Most tokens proposed per step by n-gram lookup for this request (0: none); `None`: the
    /// server's `--speculative-config`.
    pub speculative: Option<usize>,
    /// Log-probabilities of each generated token and of this many alternatives (`None`: none).
    pub logprobs: Option<usize>,
}

/// One request in the engine.
#[derive(Debug)]
pub struct Sequence {
    pub id: u64,
    pub(super) tokens: Vec<u32>,
    pub(super) num_prompt: usize,
    pub(super) num_computed: usize,
    pub(super) block_table: Vec<BlockId>,
    pub(super) hashes: Vec<BlockHash>,
    pub(super) num_cached_blocks: usize,
    pub(super) cache_salt: Option<String>,
    pub(super) params: SamplingParams,
    pub(super) sampler: Sampler,
    /// Proposes tokens when speculative decoding is on for this request.
    pub(super) drafter: Option<Drafter>,
    /// Of `tokens`, the last `num_draft` are proposals under verification this step.
    pub(super) num_draft: usize,
    pub(super) num_scheduled: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub(super) cached_tokens: Option<usize>,
    pub(super) arrival: Instant,
    pub(super) first_scheduled: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    pub(super) last_token: Option<Instant>,
    /// On finish, keep the blocks this long for another replica to fetch (a prefill for remote
    /// decode) instead of freeing them.
    pub(super) hold: Option<Duration>,
    /// Blocks loaded for this request from another replica, referenced until it is admitted so
    /// that nothing evicts them first.
    pub(super) pinned: Vec<BlockId>,
}

impl Sequence {
    pub fn new(id: u64, prompt: Vec<u32>, params: SamplingParams, cache_salt: Option<String>) -> Sequence {
        let sampler =
            Sampler::new(params.temperature, params.top_p, params.seed).with_logprobs(params.logprobs);
        Sequence {
            id,
            num_prompt: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            block_table: Vec::new(),
            hashes: Vec::new(),
            num_cached_blocks: 0,
            cache_salt,
            params,
            sampler,
            drafter: None,
            num_draft: 0,
            num_scheduled: 0,
            cached_tokens: None,
            arrival: Instant::now(),
            first_scheduled: None,
            first_token: None,
            last_token: None,
            hold: None,
            pinned: Vec::new(),
        }
    }

    /// Keeps the blocks for `d` after the request finishes ([`super::Scheduler::release`]).
    pub fn hold_blocks_for(&mut self, d: Duration) {
        self.hold = Some(d);
    }

    /// Blocks referenced for this request until it is admitted (the caller's reference passes
    /// to the scheduler).
    pub fn pin(&mut self, blocks: Vec<BlockId>) {
        self.pinned = blocks;
    }

    /// The prompt's tokens.
    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.num_prompt]
    }

    pub(super) fn num_output(&self) -> usize {
        self.tokens.len() - self.num_prompt
    }

    /// Takes this step's proposals back out of `tokens`.
    pub(super) fn take_drafts(&mut self) -> Vec<u32> {
        let drafts = self.tokens.split_off(self.tokens.len() - self.num_draft);
        self.num_draft = 0;
        drafts
    }
}

/// A token a step produced for one sequence (a verified proposal gives several in a step, in
/// order, the last carrying the finish).
#[derive(Debug, Clone, PartialEq)]
pub struct SeqOutput {
    pub id: u64,
    /// The token.
    pub token: Option<u32>,
    pub finish: Option<FinishReason>,
    pub cached_tokens: usize,
    /// Set with the first token: arrival → first token.
    pub ttft: Option<Duration>,
    /// Set with the first of a step's later tokens: time since the previous step's token (as
    /// vLLM observes it: once per step and request).
    pub itl: Option<Duration>,
    /// Set when finished.
    pub timings: Option<FinishTimings>,
    /// The token's log-probabilities, where the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// Phase durations of a finished request (vLLM's request histograms).
#[derive(Debug, Clone, PartialEq)]
pub struct FinishTimings {
    pub queue: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    pub e2e: Duration,
    pub generation_tokens: usize,
}

/// Counters accumulated since the last [`Scheduler::take_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub steps: u64,
    pub batched_tokens: u64,
    /// Speculative decoding: verifications with at least one proposed token.
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// Accepted proposals by position within their proposal.
    pub spec_accepted_per_pos: Vec<u64>,
    /// Prompt tokens loaded from the second KV tier (counted in `prefix_hits` too).
    pub tier_hit_tokens: u64,
}
