//! Routing policies: given the request's routing key and a snapshot of the pool, pick one
//! backend and say why. Selection only — reserving the slot, connecting and retrying belong to
//! the caller ([`super::Pool::select`] and the pipeline's attempts, `pipeline::attempt`).

mod cache_aware;
mod least_load;
mod prefix_hash;
mod round_robin;
mod session;

pub use cache_aware::{CacheAware, RANDOM, SAMPLE};
pub use least_load::LeastLoad;
pub use prefix_hash::PrefixHash;
pub use round_robin::RoundRobin;
pub use session::Session;

/// Where a backend stands for this one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Takes traffic.
    Up,
    /// Marked down by probes or ejected.
    Down,
    /// At its in-flight cap.
    Full,
    /// Already tried by this request (a retry goes elsewhere).
    Tried,
}

/// One backend as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub weight: u32,
    pub inflight: usize,
    pub state: State,
    /// Prompt tokens of requests sent there that have not had their first token yet
    /// (warmpath's own estimate of the prefill work queued ahead).
    pub pending_tokens: u64,
    /// Requests running and waiting as the backend last reported them (its `/metrics`; 0 when
    /// unknown): traffic from other clients and warmpath replicas counts too.
    pub reported: u32,
    /// It serves its cached K/V to the others (`kv_transfer`).
    pub fetchable: bool,
    /// It writes its blocks to, and loads them from, the pool's shared tier (`shared_kv_tier`).
    pub shared_tier: bool,
}

impl Candidate {
    pub fn is_up(&self) -> bool {
        self.state == State::Up
    }
}

/// The pool as a policy sees it, read one backend at a time: a policy that samples a large
/// fleet reads only the backends it samples ([`super::Pool`] reads each one's health and load
/// when asked, not before).
pub trait Candidates {
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> Candidate;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Every candidate, read (for the policies that weigh them all).
pub fn read_all(c: &dyn Candidates) -> Vec<Candidate> {
    (0..c.len()).map(|i| c.get(i)).collect()
}

/// Candidates already read into a list.
#[derive(Debug, Clone, Copy)]
pub struct Listed<'a>(pub &'a [Candidate]);

impl Candidates for Listed<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, i: usize) -> Candidate {
        self.0[i]
    }
}

/// What a request offers for routing.
#[derive(Debug, Clone, Default)]
pub struct RouteKey {
    /// Hash of the request's leading content (for `prefix_hash`).
    pub prefix: Option<u64>,
    /// Sticky key: `x-session-id`, `prompt_cache_key` or `user` (for `session`).
    pub session: Option<String>,
    /// The prompt's chained block keys, root first (for `cache_aware`).
    pub blocks: Vec<u64>,
    /// Prompt tokens (bytes where no tokenizer is known).
    pub tokens: usize,
    /// Of those, per block.
    pub per_block: usize,
}

/// A choice and its reason (the `reason` label of `warmpath_routing_decisions_total`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decision {
    pub index: usize,
    pub reason: &'static str,
    /// What else `x-warmpath-route` shows (`cached=…`), empty for most policies.
    pub detail: String,
    /// Prompt tokens the backend is expected to prefill (its pending work until the first
    /// token).
    pub prefill_tokens: u64,
    /// `cache_aware`: the last block of the longest prefix any backend held, which
    /// [`Policy::routed`] counts as shared by one more request.
    pub held_block: Option<u64>,
    /// `cache_aware`: the backend whose cached K/V the chosen one fetches the prompt's held
    /// prefix from (it serves it, `kv_transfer`), where that cost less than the holder's queue.
    pub fetch_from: Option<usize>,
}

impl Decision {
    pub fn new(index: usize, reason: &'static str) -> Decision {
        Decision { index, reason, ..Decision::default() }
    }
}

/// A routing policy. Implementations are deterministic given the same key and snapshot, apart
/// from rotating counters used to spread ties.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// The policy's name: the `policy` label in metrics and in `x-warmpath-route`.
    fn name(&self) -> &'static str;

    /// Picks one of the candidates whose state is [`State::Up`], or `None` when there is none.
    fn select(&self, key: &RouteKey, candidates: &dyn Candidates) -> Option<Decision>;

    /// [`Policy::select`] over a list.
    fn select_from(&self, key: &RouteKey, candidates: &[Candidate]) -> Option<Decision> {
        self.select(key, &Listed(candidates))
    }

    /// Whether the policy reads [`RouteKey::prefix`] (so callers skip hashing otherwise).
    fn wants_prefix(&self) -> bool {
        false
    }

    /// Whether the policy reads [`RouteKey::session`].
    fn wants_session(&self) -> bool {
        false
    }

    /// Whether the policy reads [`RouteKey::blocks`].
    fn wants_blocks(&self) -> bool {
        false
    }

    /// The request went to `index` (its slot is reserved): what the policy learns from it.
    fn routed(&self, _key: &RouteKey, _decision: &Decision) {}

    /// A later request with this session key belongs on `index` (a response id the backend
    /// there answered with: `previous_response_id` chains to it). Policies that keep no session
    /// map ignore it.
    fn bind(&self, _session: String, _index: usize) {}
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub fn up(n: usize) -> Vec<Candidate> {
        vec![
            Candidate {
                weight: 1,
                inflight: 0,
                state: State::Up,
                pending_tokens: 0,
                reported: 0,
                fetchable: false,
                shared_tier: false,
            };
            n
        ]
    }

    /// How many of `rounds` selections land on each backend.
    pub fn spread(
        p: &dyn Policy,
        c: &[Candidate],
        rounds: usize,
        key: impl Fn(usize) -> RouteKey,
    ) -> Vec<usize> {
        let mut counts = vec![0; c.len()];
        for i in 0..rounds {
            counts[p.select_from(&key(i), c).expect("a backend").index] += 1;
        }
        counts
    }
}
