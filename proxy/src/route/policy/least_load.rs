//! Least load: the backend with the fewest in-flight requests per unit of weight; ties go
//! round the pool so an idle fleet is not served by its first member alone.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{read_all, Candidate, Candidates, Decision, Policy, RouteKey};

#[derive(Debug, Default)]
pub struct LeastLoad {
    next: AtomicUsize,
}

impl LeastLoad {
    pub fn new() -> LeastLoad {
        LeastLoad::default()
    }

    /// The pick, without a reason (other policies fall back to it).
    pub fn pick(&self, candidates: &[Candidate]) -> Option<usize> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let mut best: Option<(usize, u64)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            let c = &candidates[i];
            if !c.is_up() {
                continue;
            }
            // (inflight + 1) / weight, compared without floats: scale by the other's weight.
            let load = (c.inflight as u64 + 1) * 1_000_000 / u64::from(c.weight.max(1));
            if best.is_none_or(|(_, b)| load < b) {
                best = Some((i, load));
            }
        }
        best.map(|(i, _)| i)
    }
}

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn select(&self, _key: &RouteKey, view: &dyn Candidates) -> Option<Decision> {
        let candidates = &read_all(view)[..];
        self.pick(candidates).map(|index| Decision::new(index, "least_load"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{spread, up};
    use super::super::State;
    use super::*;

    #[test]
    fn picks_the_least_loaded() {
        let p = LeastLoad::new();
        let mut c = up(3);
        c[0].inflight = 5;
        c[1].inflight = 2;
        c[2].inflight = 7;
        assert_eq!(spread(&p, &c, 5, |_| RouteKey::default()), vec![0, 5, 0]);
        c[1].state = State::Down;
        assert_eq!(p.select_from(&RouteKey::default(), &c).map(|d| d.index), Some(0));
    }

    #[test]
    fn weight_scales_load() {
        let p = LeastLoad::new();
        let mut c = up(2);
        c[0].weight = 4;
        c[0].inflight = 6; // 7/4 < 2/1
        c[1].inflight = 1;
        assert_eq!(p.select_from(&RouteKey::default(), &c).map(|d| d.index), Some(0));
    }

    #[test]
    fn ties_rotate() {
        let p = LeastLoad::new();
        assert_eq!(spread(&p, &up(4), 400, |_| RouteKey::default()), vec![100; 4]);
    }
}
