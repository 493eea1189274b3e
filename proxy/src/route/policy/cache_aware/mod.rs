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
//!   one holding the most wins; among equals the one whose next eviction is stalest (room, or
//!   the least recent block touched longest ago: new blocks there evict what one LRU over the
//!   whole fleet's memory would), then the one that was sent the least prefill work
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

mod estimate;
mod recent;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moka::sync::Cache;

use super::{Candidates, Decision, Policy, RouteKey};
use crate::config::CacheAwareConfig;
use crate::route::index::PrefixIndex;
use estimate::{Estimate, Estimates};
pub use estimate::{RANDOM, SAMPLE};
use recent::{RecentWork, SharedCounts, SHARED_SLOTS};

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
    fetch_weight: f64,
    tier_weight: f64,
    /// Rotates the random part of each sample.
    draws: AtomicU64,
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
            fetch_weight: cfg.fetch_weight.max(0.0),
            tier_weight: cfg.tier_weight.max(0.0),
            draws: AtomicU64::new(0),
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

    fn recent(&self) -> std::sync::MutexGuard<'_, RecentWork> {
        // Plain numbers: a panic elsewhere cannot leave them half-written.
        self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

    fn select(&self, key: &RouteKey, candidates: &dyn Candidates) -> Option<Decision> {
        let home = key.session.as_ref().and_then(|s| self.sticky.get(s));
        let Estimates { est, held_block, shared, mean_inflight: mean } =
            self.estimates(key, candidates, home);
        if est.is_empty() {
            return None;
        }
        let inflight = |e: &Estimate| e.inflight as f64;
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
            prefill_tokens: key.tokens as u64 - e.cached - e.fetch.map_or(0, |(_, n)| n) - e.tiered,
            held_block,
            fetch_from: e.fetch.map(|(src, _)| src),
        };

        let mut moved = false;
        let mut est = est;
        if let Some(home) = home {
            match est.iter().find(|e| e.index == home) {
                Some(e) if inflight(e) <= self.overload_factor * mean + 1.0 => {
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
        let within: Vec<Estimate> = est.iter().copied().filter(|e| inflight(e) <= bound).collect();
        // The best holder's own cost, and whether the bound took it out: what a request sent
        // past its holder was weighed against (`x-warmpath-route`).
        let holder = (most_cached > 0)
            .then(|| est.iter().filter(|e| e.cached == most_cached).min_by(|a, b| a.cost.total_cmp(&b.cost)))
            .flatten();
        let passed = holder.map(|h| (h.cost, !within.is_empty() && inflight(h) > bound));
        let est = if within.is_empty() { est } else { within };
        let best = est.iter().map(|e| e.cost).fold(f64::INFINITY, f64::min);
        let held = (most_cached / key.per_block.max(1) as u64) as usize;
        let spread = self.spread_key(key, held);
        let tie = self.tie_tokens as f64 * self.units_per_token();
        // Recent work compared in steps of the tie: closer than that is the same.
        let step = tie.max(1.0);
        let tied: Vec<Estimate> = est.iter().copied().filter(|e| e.cost <= best + tie).collect();
        let stale = self.index.staleness_of(&tied.iter().map(|e| e.index).collect::<Vec<_>>());
        let tied: Vec<(Estimate, u64, u32)> = {
            let r = self.recent();
            let now = Instant::now();
            tied.into_iter().zip(stale).map(|(e, s)| (e, (r.get(e.index, now) / step) as u64, s)).collect()
        };
        let (chosen, ..) = tied
            .iter()
            .max_by_key(|(e, lately, stale)| {
                (e.cached, *stale, std::cmp::Reverse(*lately), self.rank(spread, e.index))
            })
            .expect("the best is within the tie");
        let reason = match (moved, most_cached, chosen.cached) {
            (true, ..) => "affinity_moved",
            _ if chosen.fetch.is_some() => "fetch",
            _ if chosen.tiered > 0 => "tier",
            (false, 0, _) => "new_prefix",
            (false, m, c) if c == m => "cache",
            (false, _, 0) => "load_uncached",
            _ => "load_partial",
        };
        let mut d = decision(chosen, reason);
        use std::fmt::Write as _;
        if let (Some((cost, bounded)), "load_uncached" | "load_partial" | "fetch" | "tier") = (passed, reason)
        {
            let _ = write!(d.detail, "; holder_cost={cost:.0}; holder_over_bound={bounded}");
        }
        if let Some((_, n)) = chosen.fetch {
            let _ = write!(d.detail, "; fetched={n}");
        }
        if chosen.tiered > 0 {
            let _ = write!(d.detail, "; tiered={}", chosen.tiered);
        }
        Some(d)
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
        self.recent().add(d.index, d.prefill_tokens as f64, Instant::now());
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
mod tests;
