//! One key's limits as running state in this process: per-minute limits as token buckets
//! (full at the limit, refilled continuously at limit/60 per second — how OpenAI states its
//! limits and reports them in `x-ratelimit-*`), a daily token budget, and counts of requests
//! and WebSockets open. [`Limited`] and [`Meter`] are what any count (this one, or the fleet's
//! in Redis) reports.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::KeyLimits;

/// A per-minute limit as OpenAI's `x-ratelimit-*` headers state it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meter {
    pub limit: u64,
    pub remaining: u64,
    /// Until the bucket is full again.
    pub reset: Duration,
}

/// Which limit refused a request or a WebSocket, and how long waiting would take (none:
/// waiting does not help).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    Concurrent {
        max: u32,
    },
    Requests {
        limit: u64,
        wait: Duration,
    },
    Tokens {
        limit: u64,
        wait: Duration,
    },
    /// The request alone needs more than the key's tokens per minute.
    TooLarge {
        limit: u64,
    },
    Daily {
        limit: u64,
        wait: Duration,
    },
    Sockets {
        max: u32,
    },
}

impl Limited {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Limited::Concurrent { .. } => "concurrent",
            Limited::Requests { .. } => "requests",
            Limited::Tokens { .. } | Limited::TooLarge { .. } => "tokens",
            Limited::Daily { .. } => "daily",
            Limited::Sockets { .. } => "websockets",
        }
    }

    /// How long until a retry could succeed; none when waiting does not help.
    pub fn wait(&self) -> Option<Duration> {
        match self {
            Limited::Concurrent { .. } | Limited::Sockets { .. } => Some(Duration::from_secs(1)),
            Limited::Requests { wait, .. } | Limited::Tokens { wait, .. } | Limited::Daily { wait, .. } => {
                Some(*wait)
            }
            Limited::TooLarge { .. } => None,
        }
    }
}

/// An admission's outcome: refused (and why) or not, and the per-minute meters after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub limited: Option<Limited>,
    pub requests: Option<Meter>,
    pub tokens: Option<Meter>,
}

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

    pub fn meter(&mut self, now: Instant) -> Meter {
        Meter { limit: self.limit(), remaining: self.remaining(now), reset: self.reset(now) }
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

    /// Admits a request expected to cost `estimate` tokens, or says which limit refuses it;
    /// an admitted one takes a request, its tokens and a concurrency slot.
    pub fn admit(&mut self, estimate: u64, now: Instant) -> Verdict {
        let limited = self.check(estimate, now);
        if limited.is_none() {
            if let Some(b) = self.requests.as_mut() {
                b.take(1.0);
            }
            if let Some(b) = self.tokens.as_mut() {
                b.take(estimate as f64);
            }
            self.concurrent += 1;
        }
        Verdict {
            limited,
            requests: self.requests.as_mut().map(|b| b.meter(now)),
            tokens: self.tokens.as_mut().map(|b| b.meter(now)),
        }
    }

    fn check(&mut self, estimate: u64, now: Instant) -> Option<Limited> {
        if let Some(max) = self.limits.max_concurrent.filter(|m| self.concurrent >= *m) {
            return Some(Limited::Concurrent { max });
        }
        if let Some(b) = self.requests.as_mut() {
            let wait = b.wait_for(1.0, now).unwrap_or(Duration::MAX);
            if !wait.is_zero() {
                return Some(Limited::Requests { limit: b.limit(), wait });
            }
        }
        if let Some(b) = self.tokens.as_mut() {
            match b.wait_for(estimate as f64, now) {
                Some(w) if w.is_zero() => {}
                Some(wait) => return Some(Limited::Tokens { limit: b.limit(), wait }),
                None => return Some(Limited::TooLarge { limit: b.limit() }),
            }
        }
        if let Some(d) = self.daily.as_mut() {
            if !d.fits(estimate.min(d.limit)) {
                return Some(Limited::Daily { limit: d.limit, wait: Daily::until_tomorrow() });
            }
        }
        None
    }

    /// A request is over: it used `used` tokens where `reserved` were taken.
    pub fn settle(&mut self, reserved: u64, used: u64) {
        if let Some(b) = self.tokens.as_mut() {
            if used > reserved {
                b.take((used - reserved) as f64);
            } else {
                b.give((reserved - used) as f64);
            }
        }
        if let Some(d) = self.daily.as_mut() {
            d.spend(used);
        }
    }

    /// A WebSocket opens: a slot, or the limit that refuses it.
    pub fn open_socket(&mut self) -> Option<Limited> {
        if let Some(max) = self.limits.max_websockets.filter(|m| self.websockets >= *m) {
            return Some(Limited::Sockets { max });
        }
        self.websockets += 1;
        None
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
