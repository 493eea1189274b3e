//! What `cache_aware` remembers of its recent decisions: the prefill work sent to each
//! backend (decaying), and how many requests lately shared each held prefix.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Prefill work (prompt units to compute) routed to each backend, decaying exponentially with
/// a time constant of `window`: what the tie-break evens out. Each backend's figure decays when
/// it is read or added to, so a decision costs only the backends it weighs.
#[derive(Debug)]
pub(super) struct RecentWork {
    /// Per backend: its work when last updated, and when (seconds since `epoch`).
    work: Vec<(f64, f64)>,
    epoch: Instant,
    window: f64,
}

impl RecentWork {
    pub fn new(n: usize, window: Duration) -> RecentWork {
        RecentWork {
            work: vec![(0.0, 0.0); n],
            epoch: Instant::now(),
            window: window.as_secs_f64().max(1e-3),
        }
    }

    fn secs(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.epoch).as_secs_f64()
    }

    /// Backend `i`'s work at `now`.
    pub fn get(&self, i: usize, now: Instant) -> f64 {
        let (w, t) = self.work[i];
        w * (-(self.secs(now) - t).max(0.0) / self.window).exp()
    }

    pub fn add(&mut self, i: usize, units: f64, now: Instant) {
        self.work[i] = (self.get(i, now) + units, self.secs(now));
    }
}

/// Slots of [`SharedCounts`]: more than the prefixes a pool sees shared within a few work
/// windows.
pub(super) const SHARED_SLOTS: usize = 4096;

/// A direct-mapped table of decaying counts by block: one slot per block hash (a collision
/// replaces the older entry, which a prefix that is really shared soon takes back), atomics
/// only, so that counting costs a routing decision no lock, allocation or cache maintenance.
/// Racing updates may lose a count; the count only weighs a cost.
#[derive(Debug)]
pub(super) struct SharedCounts {
    slots: Vec<[AtomicU64; 3]>,
}

impl SharedCounts {
    pub fn new(n: usize) -> SharedCounts {
        SharedCounts {
            slots: (0..n).map(|_| [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]).collect(),
        }
    }

    fn slot(&self, block: u64) -> &[AtomicU64; 3] {
        &self.slots[(block % self.slots.len() as u64) as usize]
    }

    /// The count and when it was last set (µs since the policy's epoch).
    pub fn get(&self, block: u64) -> Option<(f64, u64)> {
        let [b, n, at] = self.slot(block);
        (b.load(Ordering::Relaxed) == block)
            .then(|| (f64::from_bits(n.load(Ordering::Relaxed)), at.load(Ordering::Relaxed)))
    }

    pub fn set(&self, block: u64, count: f64, now: u64) {
        let [b, n, at] = self.slot(block);
        b.store(block, Ordering::Relaxed);
        n.store(count.to_bits(), Ordering::Relaxed);
        at.store(now, Ordering::Relaxed);
    }
}
