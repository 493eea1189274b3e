//! The scheduler's rules, step by step on small block pools.

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
    fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Vec<u32>> {
        self.steps.push(batch.iter().map(|s| (s.start_pos, s.tokens.len(), s.sampler.is_some())).collect());
        batch.iter().map(|s| if s.sampler.is_some() { vec![1] } else { Vec::new() }).collect()
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
        speculative: None,
        logprobs: None,
    }
}

fn sched(blocks: usize, budget: usize, seqs: usize) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: seqs,
            max_model_len: 4096,
            enable_prefix_caching: true,
            spec: None,
            kv_tier_blocks: 0,
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
        fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Vec<u32>> {
            batch.iter().map(|s| if s.sampler.is_some() { vec![0] } else { Vec::new() }).collect()
        }
    }
    let mut s = sched(16, 100, 4);
    s.add(Sequence::new(1, prompt(3, 0), params(50), None));
    let out = s.step(&mut Eos);
    assert_eq!(out[0].finish, Some(FinishReason::Stop));
    assert!(out[0].timings.is_some());
}

/// A model whose greedy continuation is known: position `p` holds `truth[p]`. Checks that every
/// step is given the true tokens before its proposals (rejected proposals never count as
/// computed) and verifies proposals against the truth.
struct Oracle {
    truth: Vec<u32>,
    /// Per step: (start position, tokens, proposals).
    steps: Vec<(usize, usize, usize)>,
}

impl Executor for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Vec<u32>> {
        batch
            .iter()
            .map(|s| {
                self.steps.push((s.start_pos, s.tokens.len(), s.num_draft));
                let known = s.tokens.len() - s.num_draft;
                assert_eq!(s.tokens[..known], self.truth[s.start_pos..s.start_pos + known], "known tokens");
                if s.sampler.is_none() {
                    return Vec::new();
                }
                let next = s.start_pos + known;
                let kept =
                    s.tokens[known..].iter().zip(&self.truth[next..]).take_while(|(a, b)| a == b).count();
                self.truth[next..next + kept + 1].to_vec()
            })
            .collect()
    }
}

fn speculative(k: usize) -> SamplingParams {
    SamplingParams { speculative: Some(k), ..params(30) }
}

#[test]
fn proposals_copied_from_the_prompt_are_kept_and_save_steps() {
    // The output repeats the prompt's 20 tokens: after the first two output tokens, lookup finds them.
    let text = prompt(20, 0);
    let mut truth = text.clone();
    truth.extend(&text);
    truth.extend(&text);
    let run = |k: usize| {
        let mut s = sched(64, 64, 4);
        let mut ex = Oracle { truth: truth.clone(), steps: Vec::new() };
        s.add(Sequence::new(1, text.clone(), speculative(k), None));
        let mut out = Vec::new();
        while !s.is_idle() {
            out.extend(s.step(&mut ex).into_iter().filter_map(|o| o.token));
        }
        (out, ex.steps.len(), s.take_stats())
    };
    let (plain, plain_steps, plain_stats) = run(0);
    let (fast, fast_steps, stats) = run(4);
    assert_eq!(plain, truth[20..50]);
    assert_eq!(fast, plain, "speculation changes no token");
    assert_eq!(plain_stats.spec_drafts, 0);
    assert!(fast_steps * 2 < plain_steps, "{fast_steps} steps with proposals vs {plain_steps}");
    assert_eq!(stats.spec_accepted_tokens, stats.spec_draft_tokens, "every proposal here is right");
    assert_eq!(stats.generation_tokens, 30);
    assert_eq!(stats.spec_accepted_per_pos[0], stats.spec_drafts);
}

#[test]
fn rejected_proposals_roll_back_and_the_request_stays_exact() {
    // The prompt repeats "a b c" but the truth follows "a b" with something new each time:
    // proposals are wrong, the Oracle asserts each step is given only true tokens.
    let mut truth: Vec<u32> = Vec::new();
    for i in 0..20u32 {
        truth.extend([100, 101, 200 + i]);
    }
    let mut s = sched(64, 64, 4);
    let mut ex = Oracle { truth: truth.clone(), steps: Vec::new() };
    s.add(Sequence::new(1, truth[..9].to_vec(), speculative(3), None));
    let mut out = Vec::new();
    while !s.is_idle() {
        out.extend(s.step(&mut ex).into_iter().filter_map(|o| o.token));
    }
    assert_eq!(out, truth[9..39], "output as without speculation");
    let stats = s.take_stats();
    assert!(stats.spec_drafts > 0);
    assert!(stats.spec_accepted_tokens < stats.spec_draft_tokens);
}

#[test]
fn proposals_respect_max_tokens_and_never_take_blocks_others_need() {
    let text = prompt(16, 0);
    let mut truth = text.clone();
    truth.extend(&text);
    // max_tokens 5: proposals stop short of it.
    let mut s = sched(64, 64, 4);
    let mut ex = Oracle { truth: truth.clone(), steps: Vec::new() };
    s.add(Sequence::new(1, text.clone(), SamplingParams { max_tokens: 5, ..speculative(8) }, None));
    let mut out = Vec::new();
    while !s.is_idle() {
        out.extend(s.step(&mut ex).into_iter().filter_map(|o| o.token));
    }
    assert_eq!(out, truth[16..21]);
    assert!(ex.steps.iter().all(|&(.., d)| d <= 3), "{:?}", ex.steps);
    // Five blocks of 4: the prompt takes four, the fifth holds the output; proposals may only
    // use what is free, and nothing is preempted.
    let mut s = sched(5, 64, 4);
    let mut ex = Oracle { truth, steps: Vec::new() };
    s.add(Sequence::new(1, text, SamplingParams { max_tokens: 4, ..speculative(8) }, None));
    while !s.is_idle() {
        s.step(&mut ex);
    }
    assert_eq!(s.take_stats().preemptions, 0);
}

/// A scheduler of `blocks` 4-token blocks with a host tier of `tier` blocks.
fn tiered(blocks: usize, tier: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 4,
        max_model_len: 4096,
        enable_prefix_caching: true,
        spec: None,
        kv_tier_blocks: tier,
    };
    Scheduler::new(cfg, BlockPool::new(blocks, 4, false))
}

fn instant_sim() -> crate::executor::sim::SimExecutor {
    let zero = std::time::Duration::ZERO;
    let t = crate::executor::sim::SimTiming {
        prefill_overhead: zero,
        prefill_per_token: zero,
        inter_token_latency: zero,
        load_factor: 0.0,
        jitter: 0.0,
        max_num_seqs: 4,
        block_load: zero,
    };
    crate::executor::sim::SimExecutor::new(t, 100, 1, 8, 4)
}

fn run(s: &mut Scheduler, ex: &mut dyn Executor, id: u64, p: Vec<u32>) -> usize {
    s.add(Sequence::new(id, p, params(1), None));
    let mut cached = 0;
    while !s.is_idle() {
        for o in s.step(ex) {
            cached = o.cached_tokens;
        }
    }
    cached
}

#[test]
fn a_tier_block_that_fails_its_check_is_computed_not_loaded() {
    // 8 blocks of cache: three 13-token prompts (4 blocks each) push the first out into the tier.
    let mut s = tiered(8, 16);
    let mut ex = instant_sim();
    let a = prompt(13, 0);
    run(&mut s, &mut ex, 1, a.clone());
    run(&mut s, &mut ex, 2, prompt(13, 100));
    run(&mut s, &mut ex, 3, prompt(13, 200));
    let hashes = warmpath_wire::prefix::block_hashes(&a, 4, None);
    let tier = s.tier.as_mut().expect("a tier");
    assert!(hashes[..3].iter().all(|&h| tier.contains(h)), "evicted into the tier");
    tier.damage(hashes[1]);
    assert_eq!(run(&mut s, &mut ex, 4, a.clone()), 4, "the first block loads; the damaged one is computed");
    let (medium, _, st) = s.tier_states().pop().expect("a tier");
    assert_eq!(medium, "cpu");
    assert_eq!((st.loaded, st.corrupt), (1, 1));
    // What the pool holds for the prompt now is what was computed: its tokens (sim K/V).
    let b = s.pool().find_cached_prefix(&hashes, 3);
    assert_eq!(b.len(), 3);
    let mut data = Vec::new();
    ex.read_block(b[1], &mut data);
    let tokens: Vec<u8> = a[4..8].iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(data, tokens);
}
