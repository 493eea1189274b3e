//! Weighted round robin: a fixed schedule in which each backend appears `weight` times,
//! interleaved (nginx's smooth weighted order), walked by one atomic counter.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{read_all, Candidate, Candidates, Decision, Policy, RouteKey, State};

#[derive(Debug)]
pub struct RoundRobin {
    schedule: Vec<usize>,
    next: AtomicUsize,
}

impl RoundRobin {
    pub fn new(weights: &[u32]) -> RoundRobin {
        RoundRobin { schedule: smooth_schedule(weights), next: AtomicUsize::new(0) }
    }
}

/// nginx's smooth weighted round robin, unrolled into one period.
fn smooth_schedule(weights: &[u32]) -> Vec<usize> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        for (c, &w) in current.iter_mut().zip(weights) {
            *c += i64::from(w);
        }
        let Some(best) = (0..weights.len()).max_by_key(|&i| (current[i], std::cmp::Reverse(i))) else {
            break;
        };
        current[best] -= total;
        out.push(best);
    }
    out
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, _key: &RouteKey, view: &dyn Candidates) -> Option<Decision> {
        let candidates = &read_all(view)[..];
        let n = self.schedule.len();
        // A retry does not take a turn: with two backends and one failing, turns that advanced
        // on retries would send every first attempt to the failing one.
        let retry = candidates.iter().any(|c| c.state == State::Tried);
        let start =
            if retry { self.next.load(Ordering::Relaxed) } else { self.next.fetch_add(1, Ordering::Relaxed) };
        (0..n)
            .map(|k| self.schedule[(start + k) % n])
            .find(|&i| candidates.get(i).is_some_and(Candidate::is_up))
            .map(|index| Decision::new(index, "round_robin"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{spread, up};
    use super::*;

    #[test]
    fn equal_weights_rotate() {
        let p = RoundRobin::new(&[1, 1, 1]);
        assert_eq!(spread(&p, &up(3), 300, |_| RouteKey::default()), vec![100, 100, 100]);
    }

    #[test]
    fn weights_are_interleaved() {
        assert_eq!(smooth_schedule(&[5, 1, 1]), vec![0, 0, 1, 0, 2, 0, 0]);
        let p = RoundRobin::new(&[3, 1]);
        assert_eq!(spread(&p, &up(2), 400, |_| RouteKey::default()), vec![300, 100]);
    }

    #[test]
    fn skips_backends_that_are_not_up() {
        let p = RoundRobin::new(&[1, 1, 1]);
        let mut c = up(3);
        c[1].state = State::Down;
        c[2].state = State::Full;
        assert_eq!(spread(&p, &c, 10, |_| RouteKey::default()), vec![10, 0, 0]);
        c[0].state = State::Tried;
        assert!(p.select_from(&RouteKey::default(), &c).is_none());
    }

    #[test]
    fn a_retry_does_not_take_a_turn() {
        let p = RoundRobin::new(&[1, 1]);
        let c = up(2);
        let first = p.select_from(&RouteKey::default(), &c).expect("pick").index;
        let mut retry = c.clone();
        retry[first].state = State::Tried;
        assert_eq!(p.select_from(&RouteKey::default(), &retry).map(|d| d.index), Some(1 - first));
        assert_eq!(
            p.select_from(&RouteKey::default(), &c).map(|d| d.index),
            Some(1 - first),
            "the next turn is unchanged"
        );
    }
}
