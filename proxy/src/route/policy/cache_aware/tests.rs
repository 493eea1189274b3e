//! The decisions `cache_aware` makes on small fleets, each for its stated reason.

use super::super::testing::up;
use super::super::{Candidate, Candidates, State};
use super::*;
use crate::route::draw::xorshift;

fn policy(n: usize) -> CacheAware {
    let names: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let index = Arc::new(PrefixIndex::new(n, 100_000, None));
    CacheAware::new(&refs, index, &CacheAwareConfig::default())
}

fn chain(root: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| xxhash_rust::xxh3::xxh3_64(&[root, i].map(u64::to_le_bytes).concat())).collect()
}

/// A prompt whose blocks are `shared` (common to many prompts) then its own.
fn prompt(shared: &[u64], own: u64, own_blocks: usize) -> RouteKey {
    let mut blocks = shared.to_vec();
    blocks.extend(chain(own, own_blocks));
    RouteKey { tokens: blocks.len() * 16, per_block: 16, blocks, ..RouteKey::default() }
}

/// Routes like the pool does: select, then tell the policy; `pending` tracks the prefill
/// work each backend still has (cleared by `drain`).
fn route(p: &CacheAware, key: &RouteKey, c: &mut [Candidate]) -> Decision {
    let d = p.select_from(key, c).expect("a backend");
    p.routed(key, &d);
    c[d.index].pending_tokens += d.prefill_tokens;
    c[d.index].inflight += 1;
    d
}

fn drain(c: &mut [Candidate]) {
    for x in c {
        x.pending_tokens = 0;
        x.inflight = 0;
    }
}

#[test]
fn a_held_prefix_goes_back_to_its_holder() {
    let p = policy(4);
    let mut c = up(4);
    let k = prompt(&[], 1, 40);
    let first = route(&p, &k, &mut c);
    assert_eq!(first.reason, "new_prefix");
    drain(&mut c);
    for _ in 0..5 {
        let d = route(&p, &k, &mut c);
        assert_eq!((d.index, d.reason, d.prefill_tokens), (first.index, "cache", 0));
        drain(&mut c);
    }
    // The conversation grows: the next turn extends the prompt and still goes home.
    let mut longer = k.clone();
    longer.blocks.extend(chain(99, 5));
    longer.tokens += 80;
    let d = route(&p, &longer, &mut c);
    assert_eq!((d.index, d.prefill_tokens), (first.index, 80));
    assert!(d.detail.starts_with("cached=640/720"), "{}", d.detail);
}

#[test]
fn miss_weight_keeps_a_prompt_on_its_holder_longer() {
    let names = ["b0", "b1"];
    let with = |w: f64| {
        let index = Arc::new(PrefixIndex::new(2, 100_000, None));
        let cfg = CacheAwareConfig { miss_weight: w, tie_tokens: 0, ..CacheAwareConfig::default() };
        CacheAware::new(&names, index, &cfg)
    };
    let k = prompt(&[], 3, 64); // 1,024 tokens
    for (w, home) in [(1.0, false), (2.0, true)] {
        let p = with(w);
        p.index.insert(0, &k.blocks);
        // The holder has 1,500 prompt tokens queued: more than recomputing the prompt on the
        // idle one (1,024), less than twice that.
        let mut c = up(2);
        c[0].pending_tokens = 1500;
        let d = p.select_from(&k, &c).expect("pick");
        assert_eq!(d.index == 0, home, "miss_weight {w}: {} {}", d.reason, d.detail);
    }
}

#[test]
fn a_prefix_many_prompts_share_is_copied_sooner_than_one_conversation() {
    let p = policy(2); // miss_weight 8
    let history = chain(1, 64); // one conversation's 1,024 tokens, held by b0
    let system = chain(2, 64); // a 1,024-token system prompt, held by b0
    p.index.insert(0, &history);
    p.index.insert(0, &system);
    // b0 has 4,096 prompt tokens queued: more than recomputing 1,024 elsewhere, less than
    // miss_weight times that.
    let mut c = up(2);
    c[0].pending_tokens = 4096;
    // The conversation's next turn stays with its history.
    let turn = prompt(&history, 10, 2);
    let d = p.select_from(&turn, &c).expect("pick");
    assert_eq!((d.index, d.reason), (0, "cache"), "{}", d.detail);
    assert!(d.detail.ends_with("shared=0"), "{}", d.detail);
    // Twenty new conversations have just started behind the system prompt (on b0).
    let mut idle = up(2);
    for i in 0..20 {
        let d = p.select_from(&prompt(&system, 100 + i, 2), &idle).expect("pick");
        p.routed(&prompt(&system, 100 + i, 2), &d);
        idle[0].pending_tokens = 0;
    }
    // The next one goes where prefilling the system prompt again is quicker than the queue.
    let d = p.select_from(&prompt(&system, 999, 2), &c).expect("pick");
    assert_eq!((d.index, d.reason), (1, "load_uncached"), "{}", d.detail);
    assert!(d.detail.contains("shared=20; holder_cost="), "{}", d.detail);
    assert!(d.detail.ends_with("holder_over_bound=false"), "moved by its cost, not the bound: {}", d.detail);
}

#[test]
fn a_new_conversation_behind_a_short_held_prefix_starts_where_the_load_is() {
    let p = policy(2); // miss_weight 8
    let system = chain(3, 32); // a 512-token system prompt, held by b0
    p.index.insert(0, &system);
    let mut c = up(2);
    c[0].pending_tokens = 1500;
    // A new conversation of 2,048 tokens: three quarters of it are its own, and wherever it
    // starts its next turns follow. Prefilling the system prompt again on the idle backend
    // beats waiting behind 1,500 tokens.
    let new = prompt(&system, 20, 96);
    let d = p.select_from(&new, &c).expect("pick");
    assert_eq!((d.index, d.reason), (1, "load_uncached"), "{}", d.detail);
    // A conversation whose history is most of its prompt stays with it behind the same queue.
    let history = chain(4, 120);
    p.index.insert(0, &history);
    let d = p.select_from(&prompt(&history, 21, 8), &c).expect("pick");
    assert_eq!((d.index, d.reason), (0, "cache"), "{}", d.detail);
}

#[test]
fn new_prefixes_spread_deterministically() {
    let p = policy(4);
    let mut counts = [0; 4];
    for i in 0..400 {
        let c = up(4);
        let d = p.select_from(&prompt(&[], 1000 + i, 8), &c).expect("pick");
        assert_eq!(d.reason, "new_prefix");
        counts[d.index] += 1;
        // The same prompt, asked again before any routing, picks the same backend.
        assert_eq!(p.select_from(&prompt(&[], 1000 + i, 8), &c).expect("pick").index, d.index);
    }
    assert!(counts.iter().all(|&n| (70..130).contains(&n)), "{counts:?}");
}

#[test]
fn new_prefixes_even_out_the_prefill_work() {
    // 400 new conversations of 1 to 120 blocks, one at a time (no queues to tell backends
    // apart): where they start, their prefill work goes.
    let p = policy(4);
    let mut c = up(4);
    let mut work = [0u64; 4];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for i in 0..400 {
        let d = route(&p, &prompt(&[], 9000 + i, 1 + (xorshift(&mut rng) % 120) as usize), &mut c);
        assert_eq!(d.reason, "new_prefix");
        work[d.index] += d.prefill_tokens;
        drain(&mut c);
    }
    let mean = work.iter().sum::<u64>() as f64 / 4.0;
    let max = *work.iter().max().expect("4") as f64;
    assert!(max / mean < 1.02, "prefill work per backend {work:?}");
}

#[test]
fn prompts_past_a_prefix_every_backend_holds_spread_by_what_follows_it() {
    let p = policy(4);
    let shared = chain(8, 64); // one system prompt, held everywhere
    for b in 0..4 {
        p.index.insert(b, &shared);
    }
    let c = up(4);
    let mut counts = [0; 4];
    for i in 0..400 {
        let k = prompt(&shared, 5000 + i, 8);
        let d = p.select_from(&k, &c).expect("pick");
        assert_eq!(d.reason, "cache");
        counts[d.index] += 1;
        assert_eq!(p.select_from(&k, &c).expect("pick").index, d.index, "the same prompt, the same pick");
    }
    assert!(counts.iter().all(|&n| (70..130).contains(&n)), "{counts:?}");
}

#[test]
fn a_hot_shared_prefix_spreads_over_as_many_replicas_as_the_load_needs() {
    let p = policy(4);
    let shared = chain(7, 200); // a 3,200-token system prompt
    let suffix = 16; // and 256 tokens of each request's own
                     // Light load: one request at a time; all stay on the prefix's holder.
    let mut c = up(4);
    let mut light = [0; 4];
    for i in 0..50 {
        light[route(&p, &prompt(&shared, i, suffix), &mut c).index] += 1;
        drain(&mut c);
    }
    assert_eq!(light.iter().filter(|&&n| n > 0).count(), 1, "{light:?}");
    // Heavy load: 200 requests in flight at once; their prefill work spills over once the
    // holder's queue outweighs prefilling the prefix elsewhere (× miss_weight). The holder
    // takes more requests (each costs it only the suffix), the others take the prefix once
    // each: the prefill work, what delays first tokens, stays even.
    let mut heavy = [0; 4];
    let mut work = [0u64; 4];
    for i in 0..200 {
        let d = route(&p, &prompt(&shared, 100 + i, suffix), &mut c);
        heavy[d.index] += 1;
        work[d.index] += d.prefill_tokens;
    }
    assert!(heavy.iter().all(|&n| n > 0), "every replica serves the hot prefix: {heavy:?}");
    let mean = work.iter().sum::<u64>() as f64 / 4.0;
    assert!(work.iter().all(|&w| (w as f64) < 1.3 * mean), "prefill work {work:?} for requests {heavy:?}");
    // Now every replica holds the prefix: a burst spreads without recomputing it.
    drain(&mut c);
    let d = route(&p, &prompt(&shared, 999, suffix), &mut c);
    assert_eq!(d.prefill_tokens, 256);
}

#[test]
fn sessions_stick_until_overloaded_or_down() {
    let p = policy(3);
    let mut c = up(3);
    let mut k = prompt(&[], 5, 10);
    k.session = Some("conv".into());
    let home = route(&p, &k, &mut c).index;
    drain(&mut c);
    // A different prompt in the same session still goes home.
    let mut other = prompt(&[], 6, 10);
    other.session = Some("conv".into());
    let d = route(&p, &other, &mut c);
    assert_eq!((d.index, d.reason), (home, "affinity"));
    drain(&mut c);
    // Overloaded home: the conversation moves, and stays at its new place.
    c[home].inflight = 10;
    let d = p.select_from(&other, &c).expect("pick");
    assert_ne!(d.index, home);
    assert_eq!(d.reason, "affinity_moved");
    p.routed(&other, &d);
    c[home].inflight = 0;
    assert_eq!(p.select_from(&other, &c).expect("pick").index, d.index);
    // Down: moves too.
    c[d.index].state = State::Down;
    let again = p.select_from(&other, &c).expect("pick");
    assert_ne!(again.index, d.index);
}

#[test]
fn routing_records_the_prompt_before_its_events_come() {
    let p = policy(2);
    p.set_precise(0, true);
    p.set_precise(1, true);
    let mut c = up(2);
    let k = prompt(&[], 3, 10);
    let d = route(&p, &k, &mut c);
    assert_eq!(p.index().len(), 10);
    assert_eq!(p.select_from(&k, &c).expect("pick").index, d.index);
}

#[test]
fn nothing_up_is_none() {
    let p = policy(2);
    let mut c = up(2);
    c[0].state = State::Down;
    c[1].state = State::Full;
    assert!(p.select_from(&prompt(&[], 1, 4), &c).is_none());
}

/// A pool read one backend at a time, counting the reads (as `Pool`'s view reads health and
/// load only when asked).
struct Counted<'a> {
    c: &'a [Candidate],
    reads: std::cell::Cell<usize>,
}

impl Candidates for Counted<'_> {
    fn len(&self) -> usize {
        self.c.len()
    }
    fn get(&self, i: usize) -> Candidate {
        self.reads.set(self.reads.get() + 1);
        self.c[i]
    }
}

#[test]
fn a_fleet_of_4000_is_weighed_by_a_sample_that_holds_the_prompts_holders() {
    let n = 4000;
    let p = policy(n);
    let mut c = up(n);
    // Conversations, each held by one backend somewhere in the fleet.
    let convs: Vec<Vec<u64>> = (0..50).map(|k| chain(100 + k, 40)).collect();
    for (k, conv) in convs.iter().enumerate() {
        p.index.insert(k * 79 % n, conv);
    }
    for (k, conv) in convs.iter().enumerate() {
        let key = prompt(conv, 7000 + k as u64, 3);
        let view = Counted { c: &c, reads: std::cell::Cell::new(0) };
        let d = p.select(&key, &view).expect("pick");
        assert_eq!((d.index, d.reason), (k * 79 % n, "cache"), "{}", d.detail);
        assert!(view.reads.get() <= SAMPLE, "read {} of {n} backends", view.reads.get());
    }
    // The holder is overloaded past the bound: the prompt goes to a sampled backend instead.
    let holder = 0;
    c.iter_mut().for_each(|x| x.inflight = 1);
    c[holder].inflight = 60;
    let d = p.select_from(&prompt(&convs[0], 1, 3), &c).expect("pick");
    assert_ne!(d.index, holder, "{}", d.detail);
    assert!(d.detail.ends_with("holder_over_bound=true"), "{}", d.detail);
}

#[test]
fn in_a_sampled_fleet_new_prompts_spread_over_the_whole_fleet_by_load() {
    let n = 1000;
    let p = policy(n);
    let mut c = up(n);
    let mut seen = std::collections::HashSet::new();
    for i in 0..2000 {
        let d = route(&p, &prompt(&[], 50_000 + i, 4), &mut c);
        assert_eq!(d.reason, "new_prefix");
        seen.insert(d.index);
    }
    // 2,000 prompts on 1,000 backends by the least loaded of 16 drawn: no backend takes more
    // than a few, most take some.
    let most = c.iter().map(|x| x.inflight).max().expect("n");
    assert!(most <= 4, "a backend took {most}");
    assert!(seen.len() > 800, "{} of {n} backends used", seen.len());
    // Every backend down but a few: a draw that finds none up looks further.
    let mut c = up(n);
    c.iter_mut().for_each(|x| x.state = State::Down);
    c[777].state = State::Up;
    for i in 0..20 {
        assert_eq!(p.select_from(&prompt(&[], 90_000 + i, 4), &c).expect("pick").index, 777);
    }
    c[777].state = State::Down;
    assert!(p.select_from(&prompt(&[], 1, 4), &c).is_none());
}

#[test]
fn a_session_home_is_weighed_even_when_the_sample_would_miss_it() {
    let n = 2000;
    let p = policy(n);
    let c = up(n);
    p.bind("conv-9".into(), 1234);
    for i in 0..20 {
        let key = RouteKey { session: Some("conv-9".into()), ..prompt(&[], 300 + i, 4) };
        let d = p.select_from(&key, &c).expect("pick");
        assert_eq!((d.index, d.reason), (1234, "affinity"));
    }
}

#[test]
fn new_prefixes_evict_what_the_fleet_used_least_recently() {
    // Both backends full; backend 1's least recent block was touched 100 s ago, backend 0's a
    // second ago. As one LRU over both memories would, new prompts evict on backend 1.
    let p = policy(2);
    for b in 0..2 {
        p.index.set_capacity(b, 8);
    }
    let ago = |ticks: u32| 65_536 - ticks;
    p.index.insert_at(0, &chain(1, 8), ago(4));
    p.index.insert_at(1, &chain(2, 8), ago(400));
    let c = up(2);
    for i in 0..20 {
        let d = p.select_from(&prompt(&[], 700 + i, 4), &c).expect("pick");
        assert_eq!((d.index, d.reason), (1, "new_prefix"), "{}", d.detail);
    }
}

#[test]
fn a_busy_holders_prefix_is_fetched_by_an_idle_backend_where_it_serves_its_kv() {
    // Backend 0 holds 40 blocks of the prompt's 42 and has 5,000 tokens of prefill queued.
    let p = policy(2);
    let conv = chain(7, 40);
    p.index.insert(0, &conv);
    let key = prompt(&conv, 8, 2);
    let busy = |fetchable: bool| {
        let mut c = up(2);
        c[0].pending_tokens = 5_000;
        c.iter_mut().for_each(|x| x.fetchable = fetchable);
        c
    };
    // Without a transfer port the idle backend would compute 640 tokens: cheaper, not free.
    let d = p.select_from(&key, &busy(false)).expect("a backend");
    assert_eq!((d.index, d.reason, d.fetch_from), (1, "load_uncached", None));
    assert_eq!(d.prefill_tokens, 672);
    // With one, it fetches the 640 held tokens and computes only the 32 after them.
    let d = p.select_from(&key, &busy(true)).expect("a backend");
    assert_eq!((d.index, d.reason, d.fetch_from), (1, "fetch", Some(0)), "{}", d.detail);
    assert_eq!(d.prefill_tokens, 32);
    assert!(d.detail.contains("fetched=640"), "{}", d.detail);
    // An idle holder keeps its prompt: fetching costs more than nothing.
    let d = p
        .select_from(&key, &up(2).iter().map(|c| Candidate { fetchable: true, ..*c }).collect::<Vec<_>>())
        .expect("a backend");
    assert_eq!((d.index, d.reason, d.fetch_from), (0, "cache", None));
}

#[test]
fn a_busy_holders_prefix_is_loaded_from_the_shared_tier_by_an_idle_backend() {
    // As above, with both backends on a shared KV tier instead of transfer ports.
    let p = policy(2);
    let conv = chain(7, 40);
    p.index.insert(0, &conv);
    let key = prompt(&conv, 8, 2);
    let busy = |shared_tier: bool, pending: u64| {
        let mut c = up(2);
        c[0].pending_tokens = pending;
        c.iter_mut().for_each(|x| x.shared_tier = shared_tier);
        c
    };
    let d = p.select_from(&key, &busy(false, 5_000)).expect("a backend");
    assert_eq!((d.index, d.reason), (1, "load_uncached"));
    // On the tier it loads the 640 held tokens (2 units each) and computes the 32 after them.
    let d = p.select_from(&key, &busy(true, 5_000)).expect("a backend");
    assert_eq!((d.index, d.reason, d.fetch_from), (1, "tier", None), "{}", d.detail);
    assert_eq!(d.prefill_tokens, 32);
    assert!(d.detail.contains("tiered=640"), "{}", d.detail);
    // A holder with less queued than loading the prefix costs keeps its prompt (640 × 2 = 1,280).
    let d = p.select_from(&key, &busy(true, 1_000)).expect("a backend");
    assert_eq!((d.index, d.reason), (0, "cache"), "{}", d.detail);
    // A backend off the tier is not priced as if it could load from it.
    let mut c = busy(true, 5_000);
    c[1].shared_tier = false;
    let d = p.select_from(&key, &c).expect("a backend");
    assert_eq!((d.index, d.reason), (1, "load_uncached"), "{}", d.detail);
}
