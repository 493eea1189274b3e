//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018) on a hash of
//! the request's leading content: equal prefixes land on the same backend, so its prefix cache
//! hits, unless that backend already carries more than `load_factor` × its fair share of the
//! in-flight requests — then the key walks on along the ring. Keys without content fall back to
//! least load.

use xxhash_rust::xxh3::xxh3_64;

use super::{read_all, Candidates, Decision, LeastLoad, Policy, RouteKey};

#[derive(Debug)]
pub struct PrefixHash {
    /// (point, backend index), sorted by point.
    ring: Vec<(u64, usize)>,
    load_factor: f64,
    fallback: LeastLoad,
}

impl PrefixHash {
    /// `names` place each backend on the ring, so every proxy replica with the same backends
    /// builds the same ring whatever the order of the file.
    pub fn new(names: &[&str], weights: &[u32], vnodes: usize, load_factor: f64) -> PrefixHash {
        let mut ring = Vec::new();
        for (i, (name, &w)) in names.iter().zip(weights).enumerate() {
            for v in 0..vnodes * w as usize {
                ring.push((xxh3_64(format!("{name}#{v}").as_bytes()), i));
            }
        }
        ring.sort_unstable();
        PrefixHash { ring, load_factor, fallback: LeastLoad::new() }
    }
}

impl Policy for PrefixHash {
    fn name(&self) -> &'static str {
        "prefix_hash"
    }

    fn wants_prefix(&self) -> bool {
        true
    }

    fn select(&self, key: &RouteKey, view: &dyn Candidates) -> Option<Decision> {
        let candidates = &read_all(view)[..];
        let Some(hash) = key.prefix else {
            return self.fallback.pick(candidates).map(|index| Decision::new(index, "no_key"));
        };
        let (mut inflight, mut weight) = (0u64, 0u64);
        for c in candidates.iter().filter(|c| c.is_up()) {
            inflight += c.inflight as u64;
            weight += u64::from(c.weight);
        }
        if weight == 0 || self.ring.is_empty() {
            return None;
        }
        // Capacity of one unit of weight: c × (in flight, this one included) / total weight.
        let per_weight = self.load_factor * (inflight + 1) as f64 / weight as f64;
        let start = self.ring.partition_point(|&(p, _)| p < hash);
        let mut seen = vec![false; candidates.len()];
        let mut first = true;
        let mut skipped_down = false;
        for k in 0..self.ring.len() {
            let i = self.ring[(start + k) % self.ring.len()].1;
            if std::mem::replace(&mut seen[i], true) {
                continue;
            }
            let c = &candidates[i];
            if c.is_up() && (c.inflight + 1) as f64 <= (per_weight * f64::from(c.weight)).ceil() {
                let reason = match (first, skipped_down) {
                    (true, _) => "hash",
                    (false, true) => "hash_next_down",
                    (false, false) => "hash_overflow",
                };
                return Some(Decision::new(i, reason));
            }
            if first {
                skipped_down = !c.is_up();
            }
            first = false;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{spread, up};
    use super::super::State;
    use super::*;

    fn policy(n: usize, c: f64) -> PrefixHash {
        let names: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        PrefixHash::new(&refs, &vec![1; n], 160, c)
    }

    fn key(k: u64) -> RouteKey {
        RouteKey { prefix: Some(xxh3_64(&k.to_le_bytes())), ..RouteKey::default() }
    }

    #[test]
    fn same_key_same_backend_and_keys_spread() {
        let p = policy(4, 1.25);
        let c = up(4);
        let first = p.select_from(&key(7), &c).expect("pick");
        assert_eq!(first.reason, "hash");
        for _ in 0..10 {
            assert_eq!(p.select_from(&key(7), &c), Some(first.clone()));
        }
        let counts = spread(&p, &c, 4000, |i| key(i as u64));
        assert!(counts.iter().all(|&n| (700..1300).contains(&n)), "{counts:?}");
    }

    #[test]
    fn bounded_load_moves_keys_off_a_hot_backend() {
        let p = policy(4, 1.25);
        let mut c = up(4);
        let home = p.select_from(&key(1), &c).expect("pick").index;
        c[home].inflight = 10; // mean (10+1)/4 → bound ceil(1.25 × 11/4) = 4
        let d = p.select_from(&key(1), &c).expect("pick");
        assert_ne!(d.index, home);
        assert_eq!(d.reason, "hash_overflow");
        c[home].inflight = 0;
        c[home].state = State::Down;
        let d = p.select_from(&key(1), &c).expect("pick");
        assert_eq!(d.reason, "hash_next_down");
        // The key's second choice is stable: the ring order, not the load, decides it.
        assert_eq!(p.select_from(&key(1), &c), Some(d));
    }

    #[test]
    fn adding_a_backend_moves_few_keys() {
        let (p4, p5) = (policy(4, 10.0), policy(5, 10.0));
        let (c4, c5) = (up(4), up(5));
        let moved = (0..2000u64)
            .filter(|&k| {
                p4.select_from(&key(k), &c4).map(|d| d.index) != p5.select_from(&key(k), &c5).map(|d| d.index)
            })
            .count();
        assert!(moved < 2000 * 2 / 5, "{moved} of 2000 keys moved (ideal 400)");
    }

    #[test]
    fn no_key_falls_back_to_least_load() {
        let p = policy(3, 1.25);
        let mut c = up(3);
        c[0].inflight = 3;
        c[2].inflight = 3;
        assert_eq!(p.select_from(&RouteKey::default(), &c), Some(Decision::new(1, "no_key")));
    }
}
