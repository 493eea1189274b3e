//! Retry budget (as in linkerd and Envoy): retries may add at most `ratio` of the request rate
//! on top, plus a small allowance per second so that a quiet proxy can still retry. A failing
//! fleet therefore sees at most (1 + ratio) × its traffic, never a retry storm.

use std::sync::Mutex;
use std::time::Instant;

#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min_per_sec: f64,
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
}

impl RetryBudget {
    pub fn new(ratio: f64, min_per_sec: u32) -> RetryBudget {
        let min_per_sec = f64::from(min_per_sec);
        RetryBudget {
            ratio,
            min_per_sec,
            state: Mutex::new(Bucket { tokens: min_per_sec, refilled: Instant::now() }),
        }
    }

    /// The cap on saved-up retries: ten seconds of allowance plus ten deposits' worth.
    fn cap(&self) -> f64 {
        (self.min_per_sec * 10.0 + self.ratio * 10.0).max(1.0)
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every first attempt deposits `ratio` of a retry.
    pub fn deposit(&self) {
        let cap = self.cap();
        let mut b = self.bucket();
        b.tokens = (b.tokens + self.ratio).min(cap);
    }

    /// Takes one retry from the budget if there is one.
    pub fn try_withdraw(&self, now: Instant) -> bool {
        let cap = self.cap();
        let mut b = self.bucket();
        let secs = now.saturating_duration_since(b.refilled).as_secs_f64();
        b.tokens = (b.tokens + secs * self.min_per_sec).min(cap);
        b.refilled = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_bounded_by_the_ratio() {
        let b = RetryBudget::new(0.2, 0);
        let now = Instant::now();
        let mut retries = 0;
        for _ in 0..1000 {
            b.deposit();
            if b.try_withdraw(now) {
                retries += 1;
            }
        }
        assert!((195..=200).contains(&retries), "{retries}");
    }

    #[test]
    fn a_quiet_proxy_may_retry() {
        let b = RetryBudget::new(0.0, 2);
        let t = Instant::now();
        assert!(b.try_withdraw(t) && b.try_withdraw(t));
        assert!(!b.try_withdraw(t));
        assert!(b.try_withdraw(t + std::time::Duration::from_millis(600)));
    }
}
