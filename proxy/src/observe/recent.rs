//! What warmpath did lately, for the status page: the last routing decisions with their
//! reasons, the requests it refused and why, WebSocket connections that ended. A fixed ring of
//! slots, each behind its own lock, so that concurrent requests rarely meet; the oldest entry
//! is overwritten.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Entries kept.
pub const KEPT: usize = 64;

/// One thing that happened.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Event {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// `route` (a backend chosen), `refused` (warmpath answered an error itself), `websocket`
    /// (a connection ended).
    pub kind: &'static str,
    pub pool: String,
    pub backend: String,
    /// The routing reason, the refusal's reason, or the close code.
    pub reason: String,
    /// More: the cost model's numbers, a retry's attempt.
    pub detail: String,
}

#[derive(Debug)]
pub struct Recent {
    next: AtomicU64,
    slots: Vec<Mutex<Option<(u64, Event)>>>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent { next: AtomicU64::new(0), slots: (0..KEPT).map(|_| Mutex::new(None)).collect() }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Recent {
    /// `detail` is taken, not copied (a routing decision's is built per request anyway).
    pub fn push(&self, kind: &'static str, pool: &str, backend: &str, reason: &str, detail: String) {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let event = Event {
            at_ms: now_ms(),
            kind,
            pool: pool.to_owned(),
            backend: backend.to_owned(),
            reason: reason.to_owned(),
            detail,
        };
        let mut slot = self.slots[(seq % KEPT as u64) as usize].lock().unwrap_or_else(|p| p.into_inner());
        // A slower writer of an older turn of the ring never overwrites a newer entry.
        if slot.as_ref().is_none_or(|(s, _)| *s < seq) {
            *slot = Some((seq, event));
        }
    }

    /// Newest first.
    pub fn events(&self) -> Vec<Event> {
        let mut all: Vec<(u64, Event)> =
            self.slots.iter().filter_map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).clone()).collect();
        all.sort_by_key(|e| std::cmp::Reverse(e.0));
        all.into_iter().map(|(_, e)| e).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_first_and_overwrites_the_oldest() {
        let r = Recent::default();
        for i in 0..KEPT + 5 {
            r.push("route", "main", &format!("b{i}"), "cache", String::new());
        }
        let e = r.events();
        assert_eq!(e.len(), KEPT);
        assert_eq!(e[0].backend, format!("b{}", KEPT + 4));
        assert_eq!(e[KEPT - 1].backend, "b5");
        assert!(e.iter().all(|x| x.at_ms > 0 && x.kind == "route"));
    }

    #[test]
    fn concurrent_writers_lose_nothing_of_the_last_ring() {
        let r = std::sync::Arc::new(Recent::default());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        r.push("route", "main", &format!("{t}-{i}"), "x", String::new());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("writer");
        }
        assert_eq!(r.events().len(), KEPT);
    }
}
