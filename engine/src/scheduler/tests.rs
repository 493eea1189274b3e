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
    fn execute(&mut self, batch: &mut [SeqStep<'_>]) -> Vec<Option<u32>> {
        self.steps.push(batch.iter().map(|s| (s.start_pos, s.tokens.len(), s.sampler.is_some())).collect());
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
