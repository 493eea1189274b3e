//! vLLM v1's scheduler: no prefill/decode phases, just a token budget. Each step every running
//! sequence gets `min(tokens it still needs, budget left)` tokens, in order, then waiting
//! sequences are admitted while budget, sequence slots and blocks last. That one rule gives
//! continuous batching and chunked prefill. When a running sequence needs a block and none is
//! free, the most recently admitted sequence is preempted: its blocks are freed and it will be
//! recomputed (mostly from the prefix cache) when readmitted.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use warmpath_wire::openai::FinishReason;
use warmpath_wire::prefix::{extend_block_hashes, BlockHash};

use crate::block_pool::{BlockId, BlockPool};
use crate::executor::{Executor, SeqStep};
use crate::sampler::Sampler;

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// Look up and register prefix blocks (vLLM's `enable_prefix_caching`).
    pub enable_prefix_caching: bool,
}

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
}

/// One request in the engine.
#[derive(Debug)]
pub struct Sequence {
    pub id: u64,
    tokens: Vec<u32>,
    num_prompt: usize,
    num_computed: usize,
    block_table: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    num_cached_blocks: usize,
    cache_salt: Option<String>,
    params: SamplingParams,
    sampler: Sampler,
    num_scheduled: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    cached_tokens: Option<usize>,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Sequence {
    pub fn new(id: u64, prompt: Vec<u32>, params: SamplingParams, cache_salt: Option<String>) -> Sequence {
        let sampler = Sampler::new(params.temperature, params.top_p, params.seed);
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
            num_scheduled: 0,
            cached_tokens: None,
            arrival: Instant::now(),
            first_scheduled: None,
            first_token: None,
            last_token: None,
        }
    }

    fn num_output(&self) -> usize {
        self.tokens.len() - self.num_prompt
    }
}

/// What a step produced for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqOutput {
    pub id: u64,
    /// The token sampled this step, if any.
    pub token: Option<u32>,
    pub finish: Option<FinishReason>,
    pub cached_tokens: usize,
    /// Set with the first token: arrival → first token.
    pub ttft: Option<Duration>,
    /// Set with later tokens: time since the previous token.
    pub itl: Option<Duration>,
    /// Set when finished.
    pub timings: Option<FinishTimings>,
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
}

/// Scheduler state: queues and the block pool.
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: StepStats,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, pool: BlockPool) -> Scheduler {
        Scheduler { cfg, pool, waiting: VecDeque::new(), running: Vec::new(), stats: StepStats::default() }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Removes a request wherever it is and frees its blocks at once. False if unknown.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.pool.free(&s.block_table);
            }
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.pool.free(&s.block_table);
            return true;
        }
        false
    }

    pub fn take_stats(&mut self) -> StepStats {
        std::mem::take(&mut self.stats)
    }

    /// Schedules, executes and updates one step. Returns nothing when nothing could run.
    pub fn step(&mut self, exec: &mut dyn Executor) -> Vec<SeqOutput> {
        let scheduled = self.schedule();
        if scheduled == 0 {
            return Vec::new();
        }
        self.stats.steps += 1;
        self.stats.batched_tokens += scheduled as u64;
        let sampled = {
            let mut batch: Vec<SeqStep<'_>> = self
                .running
                .iter_mut()
                .filter(|s| s.num_scheduled > 0)
                .map(|s| {
                    let end = s.num_computed + s.num_scheduled;
                    let done = end == s.tokens.len();
                    SeqStep {
                        tokens: &s.tokens[s.num_computed..end],
                        start_pos: s.num_computed,
                        block_table: &s.block_table,
                        sampler: done.then_some(&mut s.sampler),
                    }
                })
                .collect();
            exec.execute(&mut batch)
        };
        self.update(sampled)
    }

    /// Assigns this step's tokens; returns how many were scheduled.
    fn schedule(&mut self) -> usize {
        let bs = self.pool.block_size();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let need = self.running[i].tokens.len() - self.running[i].num_computed;
            let n = need.min(budget);
            let want_blocks = (self.running[i].num_computed + n).div_ceil(bs);
            let missing = want_blocks.saturating_sub(self.running[i].block_table.len());
            let mut granted = true;
            loop {
                if let Some(blocks) = self.pool.allocate(missing) {
                    self.running[i].block_table.extend(blocks);
                    break;
                }
                // Out of blocks: preempt the lowest-priority (last admitted) sequence.
                let Some(victim) = self.running.pop() else {
                    break;
                };
                preempted = true;
                let is_self = self.running.len() == i;
                self.preempt(victim);
                if is_self {
                    granted = false;
                    break;
                }
            }
            if !granted {
                break;
            }
            self.running[i].num_scheduled = n;
            budget -= n;
            i += 1;
        }
        // No admissions in a step that had to preempt: memory is short.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            // Incremental: hashes only blocks completed since the last call (a preempted
            // sequence comes back longer).
            extend_block_hashes(&mut seq.hashes, &seq.tokens, bs, seq.cache_salt.as_deref());
            // At most len-1 tokens from cache: the last prompt token is always computed.
            let max_hit_blocks = (seq.tokens.len() - 1) / bs;
            let hits = if self.cfg.enable_prefix_caching {
                self.pool.find_cached_prefix(&seq.hashes, max_hit_blocks)
            } else {
                Vec::new()
            };
            let computed = hits.len() * bs;
            let n = (seq.tokens.len() - computed).min(budget);
            let fresh = (computed + n).div_ceil(bs) - hits.len();
            if fresh + self.pool.count_free(&hits) > self.pool.num_free() {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.pool.touch(&hits);
            let Some(new_blocks) = self.pool.allocate(fresh) else {
                // Unreachable after the check above; undo and stop admitting.
                self.pool.free(&hits);
                self.waiting.push_front(seq);
                break;
            };
            self.stats.prefix_queries += seq.tokens.len() as u64;
            self.stats.prefix_hits += computed as u64;
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(computed.min(seq.num_prompt));
                seq.first_scheduled = Some(Instant::now());
                self.stats.prompt_tokens += seq.num_prompt as u64;
            }
            seq.num_cached_blocks = hits.len();
            seq.block_table = hits;
            seq.block_table.extend(new_blocks);
            seq.num_computed = computed;
            seq.num_scheduled = n;
            budget -= n;
            self.running.push(seq);
        }
        self.cfg.max_num_batched_tokens - budget
    }

    fn preempt(&mut self, mut seq: Sequence) {
        self.pool.free(&seq.block_table);
        seq.block_table.clear();
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        seq.num_scheduled = 0;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }

    fn update(&mut self, sampled: Vec<Option<u32>>) -> Vec<SeqOutput> {
        let bs = self.pool.block_size();
        let now = Instant::now();
        let mut sampled = sampled.into_iter();
        let mut outputs = Vec::new();
        let mut finished = Vec::new();
        for (idx, s) in self.running.iter_mut().enumerate() {
            if s.num_scheduled == 0 {
                continue;
            }
            s.num_computed += s.num_scheduled;
            s.num_scheduled = 0;
            // Register blocks that are now full of computed tokens.
            extend_block_hashes(&mut s.hashes, &s.tokens[..s.num_computed], bs, s.cache_salt.as_deref());
            let full = s.num_computed / bs;
            if full > s.num_cached_blocks && self.cfg.enable_prefix_caching {
                let from = s.num_cached_blocks;
                let parent = from.checked_sub(1).map(|p| s.hashes[p]);
                self.pool.cache_blocks(
                    &s.block_table[from..full],
                    &s.hashes[from..full],
                    parent,
                    &s.tokens[from * bs..full * bs],
                );
                s.num_cached_blocks = full;
            }
            let Some(token) = sampled.next().flatten() else {
                continue;
            };
            let token = s.params.forced.get(s.num_output()).copied().unwrap_or(token);
            s.tokens.push(token);
            self.stats.generation_tokens += 1;
            let mut out = SeqOutput {
                id: s.id,
                token: Some(token),
                finish: None,
                cached_tokens: s.cached_tokens.unwrap_or(0),
                ttft: None,
                itl: None,
                timings: None,
            };
            match s.last_token {
                None => {
                    s.first_token = Some(now);
                    out.ttft = Some(now - s.arrival);
                }
                Some(prev) => out.itl = Some(now - prev),
            }
            s.last_token = Some(now);
            if s.params.stop_token_ids.contains(&token) {
                out.finish = Some(FinishReason::Stop);
            } else if s.num_output() >= s.params.max_tokens || s.tokens.len() >= self.cfg.max_model_len {
                out.finish = Some(FinishReason::Length);
            }
            if out.finish.is_some() {
                let first_sched = s.first_scheduled.unwrap_or(s.arrival);
                let first_tok = s.first_token.unwrap_or(now);
                out.timings = Some(FinishTimings {
                    queue: first_sched - s.arrival,
                    prefill: first_tok - first_sched,
                    decode: now - first_tok,
                    e2e: now - s.arrival,
                    generation_tokens: s.num_output(),
                });
                finished.push(idx);
            }
            outputs.push(out);
        }
        for idx in finished.into_iter().rev() {
            let s = self.running.remove(idx);
            self.pool.free(&s.block_table);
        }
        outputs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what it was asked to compute; samples token 1 always.
    #[derive(Default)]
    struct Recorder {
        steps: Vec<Vec<(usize, usize, bool)>>,
    }

    impl Executor for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Option<u32>> {
            self.steps
                .push(batch.iter().map(|s| (s.start_pos, s.tokens.len(), s.sampler.is_some())).collect());
            batch.iter().map(|s| s.sampler.as_ref().map(|_| 1)).collect()
        }
    }

    fn params(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
            stop_token_ids: vec![0],
            forced: Vec::new(),
        }
    }

    fn sched(blocks: usize, budget: usize, seqs: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_num_batched_tokens: budget,
                max_num_seqs: seqs,
                max_model_len: 4096,
                enable_prefix_caching: true,
            },
            BlockPool::new(blocks, 4, false),
        )
    }

    fn prompt(len: usize, base: u32) -> Vec<u32> {
        (0..len as u32).map(|i| base + i + 10).collect()
    }

    #[test]
    fn long_prompts_are_chunked_under_the_budget() {
        let mut s = sched(64, 8, 4);
        let mut ex = Recorder::default();
        s.add(Sequence::new(1, prompt(20, 0), params(2), None));
        let mut outs = Vec::new();
        while !s.is_idle() {
            outs.extend(s.step(&mut ex));
        }
        assert_eq!(ex.steps[0], vec![(0, 8, false)]);
        assert_eq!(ex.steps[1], vec![(8, 8, false)]);
        assert_eq!(ex.steps[2], vec![(16, 4, true)], "last chunk samples");
        assert_eq!(ex.steps[3], vec![(20, 1, true)], "then decode");
        assert_eq!(outs.len(), 2);
        assert_eq!(outs[1].finish, Some(FinishReason::Length));
        assert_eq!(s.pool().num_free(), 64, "blocks returned");
    }

    #[test]
    fn decodes_and_prefills_share_a_step() {
        let mut s = sched(64, 10, 4);
        let mut ex = Recorder::default();
        s.add(Sequence::new(1, prompt(4, 0), params(5), None));
        s.step(&mut ex);
        s.add(Sequence::new(2, prompt(30, 100), params(5), None));
        s.step(&mut ex);
        // Running decode first (1 token), then the newcomer gets the rest of the budget.
        assert_eq!(ex.steps[1], vec![(4, 1, true), (0, 9, false)]);
    }

    #[test]
    fn max_num_seqs_caps_the_batch() {
        let mut s = sched(64, 100, 2);
        let mut ex = Recorder::default();
        for i in 0..3 {
            s.add(Sequence::new(i, prompt(4, i as u32 * 50), params(3), None));
        }
        s.step(&mut ex);
        assert_eq!(ex.steps[0].len(), 2);
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn prefix_hits_skip_computation_but_not_the_last_token() {
        let mut s = sched(64, 100, 4);
        let mut ex = Recorder::default();
        s.add(Sequence::new(1, prompt(12, 0), params(1), None));
        s.step(&mut ex);
        // Same 12-token prompt: all 3 blocks cached, but only 2 may be used (last token computed).
        s.add(Sequence::new(2, prompt(12, 0), params(1), None));
        let out = s.step(&mut ex);
        assert_eq!(ex.steps[1], vec![(8, 4, true)]);
        assert_eq!(out[0].cached_tokens, 8);
        // A longer prompt sharing 12 tokens reuses all three blocks.
        let mut p = prompt(12, 0);
        p.extend([900, 901, 902]);
        s.add(Sequence::new(3, p, params(1), None));
        let out = s.step(&mut ex);
        assert_eq!(out[0].cached_tokens, 12);
        let st = s.take_stats();
        assert_eq!((st.prefix_queries, st.prefix_hits), (12 + 12 + 15, 8 + 12));
    }

    #[test]
    fn running_out_of_blocks_preempts_the_newest_and_recomputes_it() {
        // 6 blocks of 4: two sequences of 8 prompt tokens take 2 blocks each, then grow.
        let mut s = sched(6, 100, 4);
        let mut ex = Recorder::default();
        s.add(Sequence::new(1, prompt(8, 0), params(8), None));
        s.add(Sequence::new(2, prompt(8, 100), params(8), None));
        let mut finished = Vec::new();
        for _ in 0..100 {
            if s.is_idle() {
                break;
            }
            for o in s.step(&mut ex) {
                if o.finish.is_some() {
                    finished.push(o.id);
                }
            }
        }
        assert_eq!(finished.len(), 2, "both complete");
        assert!(s.take_stats().preemptions >= 1);
        // Sequence 2 was recomputed from position 0 or from its cached blocks after preemption.
        assert!(ex.steps.iter().skip(1).any(|st| st.iter().any(|&(pos, n, _)| n > 1 && pos < 16)));
        assert_eq!(s.pool().num_free(), 6);
    }

    #[test]
    fn abort_frees_blocks_at_once() {
        let mut s = sched(16, 100, 4);
        let mut ex = Recorder::default();
        s.add(Sequence::new(1, prompt(10, 0), params(50), None));
        s.add(Sequence::new(2, prompt(10, 50), params(50), None));
        s.step(&mut ex);
        assert!(s.pool().num_free() < 16);
        assert!(s.abort(1));
        assert!(s.abort(2));
        assert!(!s.abort(3));
        assert_eq!(s.pool().num_free(), 16);
        assert!(s.is_idle());
    }

    #[test]
    fn stop_tokens_finish_with_stop() {
        struct Eos;
        impl Executor for Eos {
            fn name(&self) -> &'static str {
                "eos"
            }
            fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Option<u32>> {
                batch.iter().map(|s| s.sampler.as_ref().map(|_| 0)).collect()
            }
        }
        let mut s = sched(16, 100, 4);
        s.add(Sequence::new(1, prompt(3, 0), params(50), None));
        let out = s.step(&mut Eos);
        assert_eq!(out[0].finish, Some(FinishReason::Stop));
        assert!(out[0].timings.is_some());
    }
}
