//! `cache_aware`: the backend with the lowest estimated time to first token.
//!
//! Cost of backend b, in prompt tokens (prefill time is close to linear in them):
//!
//! ```text
//! cost(b) = ( uncached(b)                 the prompt's tokens b does not hold (prefix index)
//!           + pending(b)                  prefill tokens sent to b still waiting for a token
//!           + decode_cost × running(b) )  a running request slows every batch (warmpath's
//!                                         in-flight count, or what b's /metrics reports)
//!           / weight(b)
//! ```
//!
//! and on top of it:
//! - **ties even out the work**: every backend within `tie_tokens` of the best is as good; the
//!   one holding the most wins, and among equals the one that was sent the least prefill work
//!   lately (decaying over `work_window_s`), then rendezvous hashing on the prompt's
//!   `spread_blocks` blocks past its longest held prefix. New prefixes (and prompts behind a
//!   system prompt every backend holds) so go where the least work went, not all to the first
//!   idle replica: a new prefix's conversation brings its follow-ups with it, and what evens
//!   out the fleet's prefill work (and so the rate each backend's LRU turns over) is where
//!   conversations start. Measured: work imbalance 1.07 → 1.00 at the same hit rate, where the
//!   rendezvous hash alone spread by count;
//! - **a prompt stays where it is cached** until the holder's queue is longer than
//!   `miss_weight` × the recomputation elsewhere: moving one conversation costs more than its
//!   own prefill, it copies its history into a second cache, evicting someone else's there, and
//!   leaves the first copy to waste. A prefix many prompts share is different: a second copy
//!   serves them too; and what a prompt brings that nobody holds is a new conversation, whose
//!   next turns follow it wherever it starts. So the weight is
//!   `1 + (miss_weight − 1) × held / prompt / max(1, n)`: it falls with the share of the prompt
//!   the longest held prefix is, and with how many requests lately found their longest held
//!   prefix ending at the same block (n, decaying over `work_window_s`). Without the share, 8
//!   agent sessions starting together behind one system prompt piled 3 to an engine (work
//!   imbalance 1.41 on 4 engines; with it 1.03);
//! - **a hot shared prefix spreads with load**: its holder's pending work grows with every request
//!   it takes until prefilling the prefix elsewhere is cheaper, and then a second replica caches
//!   it, then a third, as many as the load needs;
//! - **conversations stay** on the backend that served them (session keys; a Responses request's
//!   `previous_response_id` goes where that response came from, [`Policy::bind`]) until it is
//!   down or its in-flight count exceeds `overload_factor` × the pool's mean (plus one).
//!
//! Every decision says why (`reason`) and shows its numbers in `x-warmpath-route`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moka::sync::Cache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::recent::{RecentWork, SharedCounts, SHARED_SLOTS};
use super::{Candidate, Decision, Policy, RouteKey};
use crate::config::CacheAwareConfig;
use crate::route::index::PrefixIndex;

#[derive(Debug)]
pub struct CacheAware {
    index: Arc<PrefixIndex>,
    /// Rendezvous seeds, one per backend (from its name, so replicas of warmpath agree).
    seeds: Vec<u64>,
    /// Per backend: its KV events are live (their state, for the feeds and metrics).
    precise: Vec<AtomicBool>,
    /// Per backend: when a request was last routed there (µs since `epoch`).
    routed_at: Vec<AtomicU64>,
    epoch: Instant,
    /// Prompt units per token (f64 bits): the key's units are bytes where the pool has no
    /// tokenizer, and the token-denominated settings below scale by it.
    units_per_token: AtomicU64,
    sticky: Cache<String, usize>,
    /// Per backend: prefill work routed there lately (see [`RecentWork`]).
    recent: Mutex<RecentWork>,
    /// Per block ending a held prefix: how many requests lately found their longest held
    /// prefix ending there.
    shared: SharedCounts,
    window: Duration,
    decode_cost: u64,
    miss_weight: f64,
    tie_tokens: u64,
    spread_blocks: usize,
    overload_factor: f64,
    balance_factor: f64,
}

/// One backend's numbers for one decision.
#[derive(Debug, Clone, Copy)]
struct Estimate {
    index: usize,
    cached: u64,
    cost: f64,
}

impl CacheAware {
    pub fn new(names: &[&str], index: Arc<PrefixIndex>, cfg: &CacheAwareConfig) -> CacheAware {
        CacheAware {
            index,
            seeds: names.iter().map(|n| xxhash_rust::xxh3::xxh3_64(n.as_bytes())).collect(),
            precise: names.iter().map(|_| AtomicBool::new(false)).collect(),
            routed_at: names.iter().map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            units_per_token: AtomicU64::new(1f64.to_bits()),
            sticky: Cache::builder()
                .max_capacity(1 << 20)
                .time_to_idle(Duration::from_secs(cfg.session_ttl_s.max(1)))
                .build(),
            recent: Mutex::new(RecentWork::new(names.len(), Duration::from_secs_f64(cfg.work_window_s))),
            shared: SharedCounts::new(SHARED_SLOTS),
            window: Duration::from_secs_f64(cfg.work_window_s),
            decode_cost: cfg.decode_cost_tokens,
            miss_weight: cfg.miss_weight,
            tie_tokens: cfg.tie_tokens,
            spread_blocks: cfg.spread_blocks.max(1),
            overload_factor: cfg.overload_factor,
            balance_factor: cfg.balance_factor,
        }
    }

    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// How many of the routing key's units make a token (see [`crate::route::load`]).
    pub fn set_units_per_token(&self, u: f64) {
        self.units_per_token.store(u.to_bits(), Ordering::Relaxed);
    }

    fn units_per_token(&self) -> f64 {
        f64::from_bits(self.units_per_token.load(Ordering::Relaxed))
    }

    /// Backend `i`'s events are live (precise) or not (only routing tracks its blocks).
    pub fn set_precise(&self, i: usize, live: bool) {
        self.precise[i].store(live, Ordering::Relaxed);
    }

    pub fn is_precise(&self, i: usize) -> bool {
        self.precise[i].load(Ordering::Relaxed)
    }

    /// Whether a request was routed to backend `i` after `t`.
    pub fn routed_since(&self, i: usize, t: Instant) -> bool {
        let at = self.routed_at[i].load(Ordering::Relaxed);
        at > 0 && at > t.saturating_duration_since(self.epoch).as_micros() as u64
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Requests lately that found their longest held prefix ending at `block`.
    fn shared_by(&self, block: u64, now: u64) -> f64 {
        self.shared.get(block).map_or(0.0, |(n, at)| {
            n * (-(now.saturating_sub(at) as f64 / 1e6) / self.window.as_secs_f64().max(1e-3)).exp()
        })
    }

    /// The backends' estimates, the last block of the longest prefix any of them holds, and
    /// how many requests lately shared that prefix.
    fn estimates(&self, key: &RouteKey, candidates: &[Candidate]) -> (Vec<Estimate>, Option<u64>, f64) {
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

    fn recent(&self) -> std::sync::MutexGuard<'_, RecentWork> {
        // Plain numbers: a panic elsewhere cannot leave them half-written.
        self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Rendezvous weight of backend `i` for this prompt.
    fn rank(&self, spread_key: u64, i: usize) -> u64 {
        xxh3_64_with_seed(&spread_key.to_le_bytes(), self.seeds[i])
    }

    /// The key ties are spread by: the `spread_blocks`-th block past the first `held` (the
    /// longest prefix any candidate holds), or the last block.
    fn spread_key(&self, key: &RouteKey, held: usize) -> u64 {
        match key.blocks.len() {
            0 => key.prefix.unwrap_or(0),
            n => key.blocks[(held + self.spread_blocks).min(n) - 1],
        }
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn wants_blocks(&self) -> bool {
        true
    }

    fn wants_session(&self) -> bool {
        true
    }

    fn select(&self, key: &RouteKey, candidates: &[Candidate]) -> Option<Decision> {
        let (est, held_block, shared) = self.estimates(key, candidates);
        if est.is_empty() {
            return None;
        }
        // Mean in-flight count of the backends that are up (the estimates' backends).
        let mean = est.iter().map(|e| candidates[e.index].inflight as f64).sum::<f64>() / est.len() as f64;
        let inflight = |i: usize| candidates[i].inflight as f64;
        let most_cached = est.iter().map(|e| e.cached).max().unwrap_or(0);
        let detail = |e: &Estimate| {
            format!(
                "cached={}/{}; cost={:.0}; best_cached={most_cached}; shared={shared:.0}",
                e.cached, key.tokens, e.cost
            )
        };
        let decision = |e: &Estimate, reason: &'static str| Decision {
            index: e.index,
            reason,
            detail: detail(e),
            prefill_tokens: key.tokens as u64 - e.cached,
            held_block,
        };

        let mut moved = false;
        let mut est = est;
        if let Some(home) = key.session.as_ref().and_then(|s| self.sticky.get(s)) {
            match est.iter().find(|e| e.index == home) {
                Some(e) if inflight(home) <= self.overload_factor * mean + 1.0 => {
                    return Some(decision(e, "affinity"))
                }
                // Overloaded or down: the conversation leaves it, even where it holds the most.
                _ => {
                    moved = true;
                    if est.len() > 1 {
                        est.retain(|e| e.index != home);
                    }
                }
            }
        }

        // Bounded load: a backend already above `balance_factor` × the mean in-flight count
        // (plus one) takes no more while another is below it, whatever it holds — what keeps a
        // hot shared prefix from piling onto its first holder faster than its queue grows.
        let bound = self.balance_factor * mean + 1.0;
        let within: Vec<Estimate> = est.iter().copied().filter(|e| inflight(e.index) <= bound).collect();
        let est = if within.is_empty() { est } else { within };
        let best = est.iter().map(|e| e.cost).fold(f64::INFINITY, f64::min);
        let held = (most_cached / key.per_block.max(1) as u64) as usize;
        let spread = self.spread_key(key, held);
        let tie = self.tie_tokens as f64 * self.units_per_token();
        // Recent work compared in steps of the tie: closer than that is the same.
        let step = tie.max(1.0);
        let recent = {
            let mut r = self.recent();
            r.decay(Instant::now());
            r.work.clone()
        };
        let chosen = est
            .iter()
            .filter(|e| e.cost <= best + tie)
            .max_by_key(|e| {
                let lately = (recent[e.index] / step) as u64;
                (e.cached, std::cmp::Reverse(lately), self.rank(spread, e.index))
            })
            .expect("the best is within the tie");
        let reason = match (moved, most_cached, chosen.cached) {
            (true, ..) => "affinity_moved",
            (false, 0, _) => "new_prefix",
            (false, m, c) if c == m => "cache",
            (false, _, 0) => "load_uncached",
            _ => "load_partial",
        };
        Some(decision(chosen, reason))
    }

    fn bind(&self, session: String, index: usize) {
        self.sticky.insert(session, index);
    }

    fn routed(&self, key: &RouteKey, d: &Decision) {
        let now = self.now_us().max(1);
        self.routed_at[d.index].store(now, Ordering::Relaxed);
        if let Some(b) = d.held_block {
            self.shared.set(b, self.shared_by(b, now) + 1.0, now);
        }
        {
            let mut r = self.recent();
            r.decay(Instant::now());
            r.work[d.index] += d.prefill_tokens as f64;
        }
        // Recorded in both modes: a backend's events for this prompt come only after its
        // prefill, and requests sharing the prefix that arrive meanwhile must already see it
        // there. In precise mode the events then correct the guess: removals, and blocks other
        // clients made.
        if !key.blocks.is_empty() {
            self.index.insert(d.index, &key.blocks);
        }
        if let Some(s) = &key.session {
            if self.sticky.get(s) != Some(d.index) {
                self.sticky.insert(s.clone(), d.index);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::up;
    use super::super::State;
    use super::*;

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
        let d = p.select(key, c).expect("a backend");
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
            let d = p.select(&k, &c).expect("pick");
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
        let d = p.select(&turn, &c).expect("pick");
        assert_eq!((d.index, d.reason), (0, "cache"), "{}", d.detail);
        assert!(d.detail.ends_with("shared=0"), "{}", d.detail);
        // Twenty new conversations have just started behind the system prompt (on b0).
        let mut idle = up(2);
        for i in 0..20 {
            let d = p.select(&prompt(&system, 100 + i, 2), &idle).expect("pick");
            p.routed(&prompt(&system, 100 + i, 2), &d);
            idle[0].pending_tokens = 0;
        }
        // The next one goes where prefilling the system prompt again is quicker than the queue.
        let d = p.select(&prompt(&system, 999, 2), &c).expect("pick");
        assert_eq!((d.index, d.reason), (1, "load_uncached"), "{}", d.detail);
        assert!(d.detail.ends_with("shared=20"), "{}", d.detail);
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
        let d = p.select(&new, &c).expect("pick");
        assert_eq!((d.index, d.reason), (1, "load_uncached"), "{}", d.detail);
        // A conversation whose history is most of its prompt stays with it behind the same queue.
        let history = chain(4, 120);
        p.index.insert(0, &history);
        let d = p.select(&prompt(&history, 21, 8), &c).expect("pick");
        assert_eq!((d.index, d.reason), (0, "cache"), "{}", d.detail);
    }

    #[test]
    fn new_prefixes_spread_deterministically() {
        let p = policy(4);
        let mut counts = [0; 4];
        for i in 0..400 {
            let c = up(4);
            let d = p.select(&prompt(&[], 1000 + i, 8), &c).expect("pick");
            assert_eq!(d.reason, "new_prefix");
            counts[d.index] += 1;
            // The same prompt, asked again before any routing, picks the same backend.
            assert_eq!(p.select(&prompt(&[], 1000 + i, 8), &c).expect("pick").index, d.index);
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
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let d = route(&p, &prompt(&[], 9000 + i, 1 + (rng % 120) as usize), &mut c);
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
            let d = p.select(&k, &c).expect("pick");
            assert_eq!(d.reason, "cache");
            counts[d.index] += 1;
            assert_eq!(p.select(&k, &c).expect("pick").index, d.index, "the same prompt, the same pick");
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
        assert!(
            work.iter().all(|&w| (w as f64) < 1.3 * mean),
            "prefill work {work:?} for requests {heavy:?}"
        );
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
        let d = p.select(&other, &c).expect("pick");
        assert_ne!(d.index, home);
        assert_eq!(d.reason, "affinity_moved");
        p.routed(&other, &d);
        c[home].inflight = 0;
        assert_eq!(p.select(&other, &c).expect("pick").index, d.index);
        // Down: moves too.
        c[d.index].state = State::Down;
        let again = p.select(&other, &c).expect("pick");
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
        assert_eq!(p.select(&k, &c).expect("pick").index, d.index);
    }

    #[test]
    fn nothing_up_is_none() {
        let p = policy(2);
        let mut c = up(2);
        c[0].state = State::Down;
        c[1].state = State::Full;
        assert!(p.select(&prompt(&[], 1, 4), &c).is_none());
    }
}
