//! Requests waiting for a slot when every backend of a pool is at `max_inflight_per_backend`
//! (`[pools.queue]`): a bounded queue, in arrival order within each priority, higher
//! priorities first. Only the request at the head tries for a slot, woken when a slot is freed
//! (and every `RECHECK` besides, in case a wake-up went to a request that left); a new request
//! does not pass one waiting at its priority or above. Past `timeout` the request gets the
//! pool's 429 with `retry-after`, as it would have at once without the queue.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{Histogram, IntCounter, IntGauge};
use tokio::sync::Notify;

/// How often the head looks for a slot without being woken.
const RECHECK: Duration = Duration::from_millis(50);

/// A pool's queue metrics, resolved once.
#[derive(Debug, Clone)]
pub struct QueueMetrics {
    pub depth: IntGauge,
    pub wait: Histogram,
    pub timed_out: IntCounter,
    pub full: IntCounter,
}

#[derive(Debug)]
struct Waiter {
    priority: i64,
    seq: u64,
    wake: Arc<Notify>,
}

#[derive(Debug)]
pub struct Queue {
    max: usize,
    pub timeout: Duration,
    /// Sorted: priority high to low, then arrival.
    waiting: Mutex<Vec<Waiter>>,
    /// `waiting`'s length, read without the lock on every request (nearly always 0).
    len: AtomicUsize,
    next: AtomicU64,
    metrics: QueueMetrics,
}

/// The queue is full: the request is refused at once.
#[derive(Debug)]
pub struct Full;

/// A request's place in the queue; it leaves when dropped (served, timed out, or gone).
#[derive(Debug)]
pub struct Place<'q> {
    queue: &'q Queue,
    seq: u64,
    wake: Arc<Notify>,
    since: Instant,
}

impl Queue {
    pub fn new(max: usize, timeout: Duration, metrics: QueueMetrics) -> Queue {
        Queue {
            max,
            timeout,
            waiting: Mutex::new(Vec::new()),
            len: AtomicUsize::new(0),
            next: AtomicU64::new(0),
            metrics,
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Vec<Waiter>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the queue is on at all.
    pub fn enabled(&self) -> bool {
        self.max > 0 && !self.timeout.is_zero()
    }

    /// Whether a new request of `priority` may try for a slot without queueing: nobody of its
    /// priority or above is waiting.
    pub fn may_pass(&self, priority: i64) -> bool {
        self.len.load(Ordering::Acquire) == 0 || self.waiting().first().is_none_or(|w| w.priority < priority)
    }

    /// Takes a place, or [`Full`].
    pub fn enter(&self, priority: i64) -> Result<Place<'_>, Full> {
        let mut w = self.waiting();
        if w.len() >= self.max {
            self.metrics.full.inc();
            return Err(Full);
        }
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(Notify::new());
        let at = w.iter().position(|x| x.priority < priority).unwrap_or(w.len());
        w.insert(at, Waiter { priority, seq, wake: wake.clone() });
        self.len.store(w.len(), Ordering::Release);
        self.metrics.depth.set(w.len() as i64);
        Ok(Place { queue: self, seq, wake, since: Instant::now() })
    }

    /// A slot was freed: the head looks at once.
    pub fn slot_freed(&self) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(h) = self.waiting().first() {
            h.wake.notify_one();
        }
    }

    pub fn depth(&self) -> usize {
        self.waiting().len()
    }
}

impl Place<'_> {
    /// First in line.
    pub fn is_head(&self) -> bool {
        self.queue.waiting().first().is_some_and(|w| w.seq == self.seq)
    }

    /// Waits to be woken, `RECHECK` at most (or `left`, when less); whether it was woken.
    pub async fn wait(&self, left: Duration) -> bool {
        tokio::time::timeout(left.min(RECHECK), self.wake.notified()).await.is_ok()
    }

    /// Got a slot.
    pub fn served(self) {
        self.queue.metrics.wait.observe(self.since.elapsed().as_secs_f64());
    }

    /// Waited `timeout` in vain.
    pub fn timed_out(self) {
        self.queue.metrics.timed_out.inc();
        self.queue.metrics.wait.observe(self.since.elapsed().as_secs_f64());
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut w = self.queue.waiting();
        let was_head = w.first().is_some_and(|x| x.seq == self.seq);
        w.retain(|x| x.seq != self.seq);
        self.queue.len.store(w.len(), Ordering::Release);
        self.queue.metrics.depth.set(w.len() as i64);
        // The next in line looks now (a slot may be free that this one did not take).
        if was_head {
            if let Some(h) = w.first() {
                h.wake.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max: usize) -> Queue {
        let m = QueueMetrics {
            depth: IntGauge::new("d", "d").expect("g"),
            wait: Histogram::with_opts(prometheus::HistogramOpts::new("w", "w")).expect("h"),
            timed_out: IntCounter::new("t", "t").expect("c"),
            full: IntCounter::new("f", "f").expect("c"),
        };
        Queue::new(max, Duration::from_secs(1), m)
    }

    #[test]
    fn arrival_order_within_a_priority_and_higher_priorities_first() {
        let q = queue(4);
        let a = q.enter(0).expect("a");
        let b = q.enter(0).expect("b");
        assert!(a.is_head() && !b.is_head());
        assert!(!q.may_pass(0) && q.may_pass(1), "a new request waits behind its priority");
        let urgent = q.enter(5).expect("urgent");
        assert!(urgent.is_head(), "a higher priority goes first");
        let _c = q.enter(0).expect("c");
        assert!(q.enter(9).is_err(), "bounded");
        drop(urgent);
        assert!(a.is_head());
        a.served();
        assert!(b.is_head());
        assert_eq!(q.depth(), 2);
    }

    #[tokio::test]
    async fn the_head_is_woken_when_a_slot_is_freed() {
        let q = queue(4);
        let a = q.enter(0).expect("a");
        q.slot_freed();
        assert!(a.wait(Duration::from_secs(5)).await, "woken, not timed out");
        // Nobody freed a slot: the head looks again after RECHECK on its own.
        assert!(!a.wait(Duration::from_secs(5)).await);
    }
}
