//! The bytes clients make warmpath hold, bounded for the whole process (`[limits]
//! max_buffered_mib`): request bodies being read or served, and WebSocket messages not yet
//! whole. Each holder takes its bytes from one budget and gives them back when it lets go
//! ([`Held`] on drop); past the budget a request gets 503 with `retry-after`, and a WebSocket is
//! closed with 1013 (try again later), instead of the process growing without bound. Per-item
//! limits (`max_body_bytes`, `[websocket] max_message_kib`) still apply first.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use prometheus::IntGauge;

#[derive(Debug)]
pub struct Buffered {
    limit: usize,
    used: AtomicUsize,
    /// `warmpath_buffered_bytes`.
    gauge: IntGauge,
}

/// Bytes taken from the budget, given back on drop.
#[derive(Debug)]
pub struct Held {
    budget: Arc<Buffered>,
    bytes: usize,
}

impl Buffered {
    pub fn new(limit: usize, gauge: IntGauge) -> Arc<Buffered> {
        Arc::new(Buffered { limit, used: AtomicUsize::new(0), gauge })
    }

    /// An empty hold, grown as bytes come.
    pub fn hold(self: &Arc<Self>) -> Held {
        Held { budget: self.clone(), bytes: 0 }
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    fn take(&self, n: usize) -> bool {
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| (u + n <= self.limit).then_some(u + n))
            .is_ok();
        if taken {
            self.gauge.add(n as i64);
        }
        taken
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
        self.gauge.sub(n as i64);
    }
}

impl Held {
    /// Holds `n` bytes in all (more or fewer than now); false, holding what it held, when the
    /// budget cannot give the difference.
    pub fn resize(&mut self, n: usize) -> bool {
        if n > self.bytes {
            if !self.budget.take(n - self.bytes) {
                return false;
            }
        } else {
            self.budget.give(self.bytes - n);
        }
        self.bytes = n;
        true
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.give(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_share_one_budget_and_give_back_on_drop() {
        let b = Buffered::new(100, IntGauge::new("b", "b").expect("gauge"));
        let mut one = b.hold();
        let mut two = b.hold();
        assert!(one.resize(60));
        assert!(!two.resize(50), "60 + 50 is over 100");
        assert_eq!((two.bytes(), b.used()), (0, 60));
        assert!(two.resize(40));
        assert!(one.resize(10), "shrinking gives back");
        assert_eq!(b.used(), 50);
        drop(one);
        drop(two);
        assert_eq!(b.used(), 0);
    }
}
