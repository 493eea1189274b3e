//! Session affinity: a request that carries a session key (`x-session-id`, `prompt_cache_key`
//! or `user`) goes to the backend that key ranks first by rendezvous hashing, so a conversation
//! keeps hitting the replica that holds its KV cache — on every proxy replica alike, with no
//! shared table. When that backend is down, full or overloaded, the key moves to its next
//! choice (again stable). Requests without a key fall back to least load.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{read_all, Candidate, Candidates, Decision, LeastLoad, Policy, RouteKey, State};

#[derive(Debug)]
pub struct Session {
    /// Per-backend hash seeds derived from the backend names.
    seeds: Vec<u64>,
    overload_factor: f64,
    fallback: LeastLoad,
}

impl Session {
    pub fn new(names: &[&str], overload_factor: f64) -> Session {
        let seeds = names.iter().map(|n| xxhash_rust::xxh3::xxh3_64(n.as_bytes())).collect();
        Session { seeds, overload_factor, fallback: LeastLoad::new() }
    }

    /// Weighted rendezvous score (Schindelhauer & Schomaker): `-w / ln(h)`, h uniform in (0, 1).
    fn score(&self, key: &[u8], i: usize, weight: u32) -> f64 {
        let h = xxh3_64_with_seed(key, self.seeds[i]);
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        -f64::from(weight.max(1)) / u.ln()
    }
}

impl Policy for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    fn wants_session(&self) -> bool {
        true
    }

    fn select(&self, key: &RouteKey, view: &dyn Candidates) -> Option<Decision> {
        let candidates = &read_all(view)[..];
        let Some(session) = key.session.as_deref() else {
            return self.fallback.pick(candidates).map(|index| Decision::new(index, "no_key"));
        };
        let up: Vec<&Candidate> = candidates.iter().filter(|c| c.is_up()).collect();
        if up.is_empty() {
            return None;
        }
        let mean = up.iter().map(|c| c.inflight).sum::<usize>() as f64 / up.len() as f64;
        let limit = self.overload_factor * mean + 1.0;
        let mut order: Vec<(f64, usize)> = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.state != State::Tried)
            .map(|(i, c)| (self.score(session.as_bytes(), i, c.weight), i))
            .collect();
        order.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        let first = order.first()?.1;
        let Some(pick) = order.iter().map(|&(_, i)| i).find(|&i| {
            let c = &candidates[i];
            c.is_up() && (c.inflight as f64) < limit
        }) else {
            // Everyone is past the overload limit: the least loaded one still serves.
            return self.fallback.pick(candidates).map(|index| Decision::new(index, "sticky_all_busy"));
        };
        let reason = match candidates[first].state {
            _ if pick == first => "sticky",
            State::Down => "sticky_moved_down",
            _ => "sticky_moved_overloaded",
        };
        Some(Decision::new(pick, reason))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{spread, up};
    use super::*;

    fn policy(n: usize) -> Session {
        let names: Vec<String> = (0..n).map(|i| format!("engine-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        Session::new(&refs, 2.0)
    }

    fn key(s: &str) -> RouteKey {
        RouteKey { session: Some(s.to_owned()), ..RouteKey::default() }
    }

    #[test]
    fn a_session_sticks_and_sessions_spread() {
        let p = policy(4);
        let c = up(4);
        let home = p.select_from(&key("conv-1"), &c).expect("pick");
        assert_eq!(home.reason, "sticky");
        assert!((0..20).all(|_| p.select_from(&key("conv-1"), &c) == Some(home.clone())));
        let counts = spread(&p, &c, 4000, |i| key(&format!("conv-{i}")));
        assert!(counts.iter().all(|&n| (800..1200).contains(&n)), "{counts:?}");
    }

    #[test]
    fn moves_when_down_or_overloaded_and_comes_back() {
        let p = policy(3);
        let mut c = up(3);
        let home = p.select_from(&key("s"), &c).expect("pick").index;
        c[home].state = State::Down;
        let moved = p.select_from(&key("s"), &c).expect("pick");
        assert_ne!(moved.index, home);
        assert_eq!(moved.reason, "sticky_moved_down");
        c[home].state = State::Up;
        c[home].inflight = 9; // mean 3, limit 2×3+1 = 7
        let d = p.select_from(&key("s"), &c).expect("pick");
        assert_eq!((d.index, d.reason), (moved.index, "sticky_moved_overloaded"), "same second choice");
        c[home].inflight = 0;
        assert_eq!(p.select_from(&key("s"), &c).map(|d| d.index), Some(home));
    }

    #[test]
    fn no_key_is_least_load() {
        let p = policy(2);
        let mut c = up(2);
        c[0].inflight = 4;
        assert_eq!(p.select_from(&RouteKey::default(), &c), Some(Decision::new(1, "no_key")));
    }
}
