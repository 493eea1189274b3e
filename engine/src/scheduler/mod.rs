//! vLLM v1's scheduler: no prefill/decode phases, just a token budget. Each step every running
//! sequence gets `min(tokens it still needs, budget left)` tokens, in order, then waiting
//! sequences are admitted while budget, sequence slots and blocks last. That one rule gives
//! continuous batching and chunked prefill. When a running sequence needs a block and none is
//! free, the most recently admitted sequence is preempted: its blocks are freed and it will be
//! recomputed (mostly from the prefix cache) when readmitted.
//!
//! With speculative decoding on (`--speculative-config`, or a request's
//! `num_speculative_tokens`), a decoding sequence's step also carries the tokens its
//! [`Drafter`] proposes, when the budget and free blocks allow them without preempting anyone;
//! after the step only what the sampler kept counts as computed.

mod sequence;
mod tier;

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use warmpath_wire::openai::FinishReason;
use warmpath_wire::prefix::extend_block_hashes;

use crate::block_pool::{BlockId, BlockPool};
use crate::executor::{Executor, SeqStep};
use crate::kv_tier::{BlockSink, LocalTiers};
use crate::spec::{Drafter, SpecConfig, MAX_SPECULATIVE_TOKENS};
pub use sequence::{FinishTimings, SamplingParams, SeqOutput, Sequence, StepStats};

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// Look up and register prefix blocks (vLLM's `enable_prefix_caching`).
    pub enable_prefix_caching: bool,
    /// Speculative decoding for every request that does not say otherwise.
    pub spec: Option<SpecConfig>,
    /// Blocks of the host-memory tier evicted blocks go to (0: none).
    pub kv_tier_blocks: usize,
}

/// Scheduler state: queues and the block pool.
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: StepStats,
    /// Finished requests' blocks kept for another replica to fetch, by request id, with when
    /// they are freed at the latest.
    held: HashMap<u64, (Vec<BlockId>, Instant)>,
    /// The tiers evicted blocks go to (host memory, disk), where there are any.
    tier: Option<LocalTiers>,
    /// Where computed blocks are written through (the shared tier), where there is one.
    sink: Option<std::sync::Arc<dyn BlockSink>>,
    /// Blocks computed in this step, to offer the sink once the step is done.
    computed: Vec<(BlockId, warmpath_wire::prefix::BlockHash)>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, pool: BlockPool) -> Scheduler {
        let mut pool = pool;
        let tier = LocalTiers::new(cfg.kv_tier_blocks, None).filter(|_| cfg.enable_prefix_caching);
        if tier.is_some() {
            pool.keep_evictions();
        }
        Scheduler {
            cfg,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stats: StepStats::default(),
            held: HashMap::new(),
            tier,
            sink: None,
            computed: Vec::new(),
        }
    }

    /// Frees the blocks held for request `id`; false if none are.
    pub fn release(&mut self, id: u64) -> bool {
        match self.held.remove(&id) {
            Some((blocks, _)) => {
                self.pool.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// Frees the holds whose time is up; returns how many.
    pub fn expire_held(&mut self, now: Instant) -> usize {
        let due: Vec<u64> =
            self.held.iter().filter(|(_, (_, until))| *until <= now).map(|(&id, _)| id).collect();
        due.iter().filter(|&&id| self.release(id)).count()
    }

    /// When the next hold ends, if any.
    pub fn next_hold_expiry(&self) -> Option<Instant> {
        self.held.values().map(|(_, until)| *until).min()
    }

    /// Blocks held for other replicas to fetch.
    pub fn num_held_blocks(&self) -> usize {
        self.held.values().map(|(b, _)| b.len()).sum()
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

    pub fn add(&mut self, mut seq: Sequence) {
        let spec = match (seq.params.speculative, &self.cfg.spec) {
            (Some(0), _) => None,
            (Some(k), server) => {
                let mut c = server.clone().unwrap_or_else(|| SpecConfig::with_tokens(k));
                c.num_speculative_tokens = k.min(MAX_SPECULATIVE_TOKENS);
                Some(c)
            }
            (None, server) => server.clone(),
        };
        // Scripted outputs (a test hook) are not the model's: nothing to verify against.
        seq.drafter = spec.filter(|_| seq.params.forced.is_empty()).map(Drafter::new);
        self.waiting.push_back(seq);
    }

    /// Removes a request wherever it is and frees its blocks at once. False if unknown.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.pool.free(&s.block_table);
                self.pool.free(&s.pinned);
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
        let scheduled = self.schedule(exec);
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
                        num_draft: s.num_draft,
                        sampler: done.then_some(&mut s.sampler),
                    }
                })
                .collect();
            exec.execute(&mut batch)
        };
        let outputs = self.update(sampled);
        self.write_through(exec);
        outputs
    }

    /// Assigns this step's tokens; returns how many were scheduled.
    fn schedule(&mut self, exec: &mut dyn Executor) -> usize {
        let bs = self.pool.block_size();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        let mut i = 0;
        let drafting = self
            .cfg
            .spec
            .as_ref()
            .and_then(|c| c.disable_by_batch_size)
            .is_none_or(|m| self.running.len() <= m);
        while i < self.running.len() && budget > 0 {
            if drafting {
                self.propose(i, budget);
            }
            let need = self.running[i].tokens.len() - self.running[i].num_computed;
            let n = need.min(budget);
            let want_blocks = (self.running[i].num_computed + n).div_ceil(bs);
            let missing = want_blocks.saturating_sub(self.running[i].block_table.len());
            let mut granted = true;
            loop {
                if let Some(blocks) = self.allocate(exec, missing) {
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
            // Past what the pool holds, what the second tier holds is loaded, not computed.
            let tiered = match hits.len() < max_hit_blocks {
                true => tier::run(self.tier.as_ref(), &seq.hashes[hits.len()..max_hit_blocks]),
                false => 0,
            };
            let mut computed = (hits.len() + tiered) * bs;
            let mut n = (seq.tokens.len() - computed).min(budget);
            let fresh = (computed + n).div_ceil(bs) - hits.len();
            if fresh + self.pool.count_free(&hits) > self.pool.num_free() {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.pool.touch(&hits);
            let Some(new_blocks) = self.allocate(exec, fresh) else {
                // Unreachable after the check above; undo and stop admitting.
                self.pool.free(&hits);
                self.waiting.push_front(seq);
                break;
            };
            if tiered > 0 {
                let (from, to) = (hits.len(), hits.len() + tiered);
                let parent = from.checked_sub(1).map(|p| seq.hashes[p]);
                let tokens = &seq.tokens[from * bs..to * bs];
                let loaded = self.load_tier(exec, &seq.hashes[from..to], parent, &new_blocks, tokens);
                self.stats.tier_hit_tokens += (loaded * bs) as u64;
                if loaded < tiered {
                    // A block failed its check: the rest is computed, within the blocks taken.
                    computed = (from + loaded) * bs;
                    let room = (from + new_blocks.len()) * bs - computed;
                    n = (seq.tokens.len() - computed).min(budget).min(room);
                }
                seq.num_cached_blocks = from + loaded;
            }
            self.stats.prefix_queries += seq.tokens.len() as u64;
            self.stats.prefix_hits += computed as u64;
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(computed.min(seq.num_prompt));
                seq.first_scheduled = Some(Instant::now());
                self.stats.prompt_tokens += seq.num_prompt as u64;
            }
            if tiered == 0 {
                seq.num_cached_blocks = hits.len();
            }
            seq.block_table = hits;
            seq.block_table.extend(new_blocks);
            seq.num_computed = computed;
            seq.num_scheduled = n;
            budget -= n;
            // Loaded blocks are now referenced by the table (they were hits): drop the pin.
            let pinned = std::mem::take(&mut seq.pinned);
            self.pool.free(&pinned);
            self.running.push(seq);
        }
        self.cfg.max_num_batched_tokens - budget
    }

    /// Appends the proposals of running sequence `i` to its tokens when it is decoding (one
    /// token to compute) and its drafter has any that fit the budget, its limits and the
    /// blocks free now (proposals never preempt anyone).
    fn propose(&mut self, i: usize, budget: usize) {
        let bs = self.pool.block_size();
        let max_model_len = self.cfg.max_model_len;
        // Each sequence after this one may need a block for its own token.
        let free = self.pool.num_free().saturating_sub(self.running.len() - i - 1);
        let s = &mut self.running[i];
        let num_output = s.num_output();
        if s.drafter.is_none() || s.tokens.len() != s.num_computed + 1 || num_output == 0 {
            return;
        }
        // Room: the step budget, the request's remaining tokens (the step also yields one
        // token of its own), the context length, and the blocks free without preemption.
        let room_blocks = (s.block_table.len() + free) * bs;
        let limit = (budget - 1)
            .min(s.params.max_tokens.saturating_sub(num_output + 1))
            .min(max_model_len.saturating_sub(s.tokens.len() + 1))
            .min(room_blocks.saturating_sub(s.tokens.len()));
        let Some(drafter) = s.drafter.as_mut() else { return };
        let drafts = drafter.propose(&s.tokens, limit).to_vec();
        s.num_draft = drafts.len();
        s.tokens.extend(drafts);
    }

    fn preempt(&mut self, mut seq: Sequence) {
        seq.take_drafts();
        self.pool.free(&seq.block_table);
        seq.block_table.clear();
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        seq.num_scheduled = 0;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }

    fn update(&mut self, sampled: Vec<Vec<u32>>) -> Vec<SeqOutput> {
        let bs = self.pool.block_size();
        let now = Instant::now();
        let mut sampled = sampled.into_iter();
        let mut outputs = Vec::new();
        let mut finished = Vec::new();
        for (idx, s) in self.running.iter_mut().enumerate() {
            if s.num_scheduled == 0 {
                continue;
            }
            let drafts = s.take_drafts();
            // Proposals count as computed only where they are kept (below).
            s.num_computed += s.num_scheduled - drafts.len();
            s.num_scheduled = 0;
            let tokens = sampled.next().unwrap_or_default();
            let kept = tokens.len().saturating_sub(1);
            if !drafts.is_empty() {
                debug_assert_eq!(&tokens[..kept], &drafts[..kept], "kept proposals are the proposals");
                let st = &mut self.stats;
                st.spec_drafts += 1;
                st.spec_draft_tokens += drafts.len() as u64;
                st.spec_accepted_tokens += kept as u64;
                if st.spec_accepted_per_pos.len() < kept {
                    st.spec_accepted_per_pos.resize(kept, 0);
                }
                st.spec_accepted_per_pos[..kept].iter_mut().for_each(|n| *n += 1);
                if let Some(d) = s.drafter.as_mut() {
                    d.record(drafts.len(), kept);
                }
            }
            let mut pushed = 0;
            for (j, token) in tokens.into_iter().enumerate() {
                let token = s.params.forced.get(s.num_output()).copied().unwrap_or(token);
                s.tokens.push(token);
                pushed += 1;
                self.stats.generation_tokens += 1;
                let mut out = SeqOutput {
                    id: s.id,
                    token: Some(token),
                    finish: None,
                    cached_tokens: s.cached_tokens.unwrap_or(0),
                    ttft: None,
                    itl: None,
                    timings: None,
                    logprobs: s.sampler.take_logprobs(),
                };
                match s.last_token {
                    None => {
                        s.first_token = Some(now);
                        out.ttft = Some(now - s.arrival);
                    }
                    Some(prev) if j == 0 => out.itl = Some(now - prev),
                    Some(_) => {}
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
                    outputs.push(out);
                    break;
                }
                outputs.push(out);
            }
            // Kept proposals' K/V is in the cache: they are computed (the step's own last
            // token is not, yet).
            s.num_computed += kept.min(pushed);
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
                if let Some(sink) = &self.sink {
                    let new = (from..full).map(|j| (s.block_table[j], s.hashes[j]));
                    self.computed.extend(new.filter(|&(_, h)| sink.wants(h)));
                }
                s.num_cached_blocks = full;
            }
        }
        for idx in finished.into_iter().rev() {
            let s = self.running.remove(idx);
            match s.hold {
                Some(d) => {
                    if let Some((old, _)) = self.held.insert(s.id, (s.block_table, now + d)) {
                        self.pool.free(&old);
                    }
                }
                None => self.pool.free(&s.block_table),
            }
        }
        outputs
    }
}

#[cfg(test)]
mod tests;
