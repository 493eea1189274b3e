//! One key's limits as running state: per-minute limits as token buckets (full at the limit,
//! refilled continuously at limit/60 per second — how OpenAI states its limits and reports
//! them in `x-ratelimit-*`), a daily token budget, and counts of requests and WebSockets open.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::KeyLimits;

/// A per-minute limit.
#[derive(Debug, Clone)]
pub struct Bucket {
    limit: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    pub fn new(limit: u64, now: Instant) -> Bucket {
        Bucket { limit: limit as f64, level: limit as f64, at: now }
    }

    fn per_sec(&self) -> f64 {
        self.limit / 60.0
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_sec()).min(self.limit);
        self.at = now;
    }

    /// How long until `n` could be taken (zero: now); `None` when `n` exceeds the limit itself.
    pub fn wait_for(&mut self, n: f64, now: Instant) -> Option<Duration> {
        self.refill(now);
        if n > self.limit {
            return None;
        }
        let short = n - self.level;
        Some(if short <= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(short / self.per_sec()) })
    }

    /// Takes `n` (the level may go below zero when a settlement takes more than was reserved).
    pub fn take(&mut self, n: f64) {
        self.level -= n;
    }

    /// Gives back `n` (a reservation larger than what was used).
    pub fn give(&mut self, n: f64) {
        self.level = (self.level + n).min(self.limit);
    }

    pub fn limit(&self) -> u64 {
        self.limit as u64
    }

    pub fn remaining(&mut self, now: Instant) -> u64 {
        self.refill(now);
        self.level.max(0.0) as u64
    }

    /// Time until the bucket is full again (OpenAI's `x-ratelimit-reset-*`).
    pub fn reset(&mut self, now: Instant) -> Duration {
        self.refill(now);
        Duration::from_secs_f64((self.limit - self.level).max(0.0) / self.per_sec())
    }
}

/// Tokens spent in the current UTC day.
#[derive(Debug, Clone)]
pub struct Daily {
    pub limit: u64,
    day: u64,
    pub used: u64,
}

impl Daily {
    fn today() -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400)
    }

    fn roll(&mut self) {
        let today = Daily::today();
        if today != self.day {
            self.day = today;
            self.used = 0;
        }
    }

    /// True while `n` more fits today.
    pub fn fits(&mut self, n: u64) -> bool {
        self.roll();
        self.used + n <= self.limit
    }

    pub fn spend(&mut self, n: u64) {
        self.roll();
        self.used += n;
    }

    /// Time until the next UTC midnight.
    pub fn until_tomorrow() -> Duration {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        Duration::from_secs(86_400 - now % 86_400)
    }
}

/// One key's running state.
#[derive(Debug)]
pub struct KeyState {
    pub limits: KeyLimits,
    pub requests: Option<Bucket>,
    pub tokens: Option<Bucket>,
    pub daily: Option<Daily>,
    pub concurrent: u32,
    pub websockets: u32,
}

impl KeyState {
    pub fn new(limits: &KeyLimits) -> KeyState {
        let now = Instant::now();
        KeyState {
            limits: limits.clone(),
            requests: limits.requests_per_minute.map(|l| Bucket::new(l, now)),
            tokens: limits.tokens_per_minute.map(|l| Bucket::new(l, now)),
            daily: limits.tokens_per_day.map(|limit| Daily { limit, day: Daily::today(), used: 0 }),
            concurrent: 0,
            websockets: 0,
        }
    }

    /// The limits changed (the keys file was edited): buckets keep their level, capped.
    pub fn update(&mut self, limits: &KeyLimits) {
        if &self.limits == limits {
            return;
        }
        let now = Instant::now();
        let carry = |old: Option<Bucket>, new: Option<u64>| {
            new.map(|l| {
                let mut b = Bucket::new(l, now);
                if let Some(mut o) = old {
                    o.refill(now);
                    b.level = o.level.min(b.limit);
                }
                b
            })
        };
        self.requests = carry(self.requests.take(), limits.requests_per_minute);
        self.tokens = carry(self.tokens.take(), limits.tokens_per_minute);
        let used = self.daily.as_ref().map_or(0, |d| d.used);
        self.daily = limits.tokens_per_day.map(|limit| Daily { limit, day: Daily::today(), used });
        self.limits = limits.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_at_its_limit_per_minute() {
        let t0 = Instant::now();
        let mut b = Bucket::new(60, t0);
        assert_eq!(b.wait_for(60.0, t0), Some(Duration::ZERO));
        b.take(60.0);
        assert_eq!(b.remaining(t0), 0);
        // One a second comes back.
        let wait = b.wait_for(2.0, t0).expect("fits the limit");
        assert!((wait.as_secs_f64() - 2.0).abs() < 1e-6, "{wait:?}");
        assert_eq!(b.remaining(t0 + Duration::from_secs(10)), 10);
        let reset = b.reset(t0 + Duration::from_secs(10));
        assert!((reset.as_secs_f64() - 50.0).abs() < 1e-6, "{reset:?}");
        assert_eq!(b.wait_for(61.0, t0), None, "more than the limit never fits");
        // A settlement over the reservation leaves a debt.
        b.take(30.0);
        assert_eq!(b.remaining(t0 + Duration::from_secs(10)), 0);
        b.give(100.0);
        assert_eq!(b.remaining(t0 + Duration::from_secs(10)), 60);
    }

    #[test]
    fn edited_limits_keep_what_was_spent() {
        let limits = KeyLimits { requests_per_minute: Some(10), ..KeyLimits::default() };
        let mut s = KeyState::new(&limits);
        s.requests.as_mut().expect("bucket").take(8.0);
        s.update(&KeyLimits { requests_per_minute: Some(100), ..KeyLimits::default() });
        let b = s.requests.as_mut().expect("bucket");
        assert_eq!((b.limit(), b.remaining(Instant::now())), (100, 2));
    }
}
