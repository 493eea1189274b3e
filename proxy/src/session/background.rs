//! Responses run in the background (`background: true`) and the events of streamed ones: each
//! run keeps its events as they come (for `GET /v1/responses/{id}?stream=true&starting_after=N`
//! to resume a stream a client lost, and for followers waiting on new ones), the latest response
//! object (what `GET` answers while it runs), and the handle that cancels it. A run is kept
//! `ttl` after it was made, bounded by bytes once it has ended; a key may have at most
//! `max_per_key` running at once.
//!
//! Runs live in the process that runs them: another replica sharing Redis retrieves the
//! response once it is stored, but does not follow its events or cancel it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::AbortHandle;

/// One event as a run keeps it: its type and JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    pub kind: String,
    pub json: String,
}

#[derive(Debug)]
struct RunState {
    events: Vec<Logged>,
    /// The response object as it stands (JSON text).
    response: String,
    done: bool,
    abort: Option<AbortHandle>,
    bytes: usize,
}

/// One response run in the background, or streamed with its events kept.
#[derive(Debug)]
pub struct Run {
    pub id: String,
    pub tenant: u64,
    /// Counted against its key's running runs.
    pub background: bool,
    state: Mutex<RunState>,
    /// Events kept so far, and whether the run ended: followers wait on it.
    progress: watch::Sender<(usize, bool)>,
    registry: Arc<Counts>,
}

/// Running background runs per tenant.
#[derive(Debug, Default)]
struct Counts(Mutex<HashMap<u64, usize>>);

impl Counts {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Run {
    fn lock(&self) -> MutexGuard<'_, RunState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The task running it (aborted by [`Run::cancel`]).
    pub fn set_abort(&self, abort: AbortHandle) {
        let mut s = self.lock();
        if s.done {
            abort.abort();
        } else {
            s.abort = Some(abort);
        }
    }

    /// Events in order; `response`: the response object one of them carries, where one does.
    pub fn push(&self, events: impl IntoIterator<Item = Logged>, response: Option<String>) {
        let mut s = self.lock();
        if s.done {
            return;
        }
        for e in events {
            s.bytes += e.kind.len() + e.json.len() + 32;
            s.events.push(e);
        }
        if let Some(r) = response {
            s.response = r;
        }
        let n = s.events.len();
        drop(s);
        self.progress.send_replace((n, false));
    }

    /// The run ended with `response` (its final object); `false` when it had already ended
    /// (cancelled first).
    pub fn finish(&self, response: Option<String>) -> bool {
        let mut s = self.lock();
        if s.done {
            return false;
        }
        if let Some(r) = response {
            s.response = r;
        }
        self.end(s);
        true
    }

    /// Cancels a running run: its task is aborted (the backend's generation with it) and its
    /// object says `cancelled`. The object as it ends, and whether this call cancelled it.
    pub fn cancel(&self) -> (String, bool) {
        let mut s = self.lock();
        if s.done {
            return (s.response.clone(), false);
        }
        if let Some(a) = s.abort.take() {
            a.abort();
        }
        if let Ok(serde_json::Value::Object(mut o)) = serde_json::from_str(&s.response) {
            o.insert("status".into(), "cancelled".into());
            s.response = serde_json::Value::Object(o).to_string();
        }
        let r = s.response.clone();
        self.end(s);
        (r, true)
    }

    fn end(&self, mut s: MutexGuard<'_, RunState>) {
        s.done = true;
        s.abort = None;
        let n = s.events.len();
        drop(s);
        if self.background {
            let mut counts = self.registry.lock();
            if let Some(c) = counts.get_mut(&self.tenant) {
                *c -= 1;
                if *c == 0 {
                    counts.remove(&self.tenant);
                }
            }
        }
        self.progress.send_replace((n, true));
    }

    /// The response object as it stands, and whether the run ended.
    pub fn response(&self) -> (String, bool) {
        let s = self.lock();
        (s.response.clone(), s.done)
    }

    /// Events from index `from` on, and whether the run ended after them.
    pub fn events_from(&self, from: usize) -> (Vec<Logged>, bool) {
        let s = self.lock();
        (s.events.get(from..).map(<[Logged]>::to_vec).unwrap_or_default(), s.done)
    }

    /// Resolves when events past `seen` were kept or the run ended.
    pub async fn changed(&self, seen: usize) {
        let mut rx = self.progress.subscribe();
        let _ = rx.wait_for(|&(n, done)| n > seen || done).await;
    }
}

/// Every run of this process, by response id.
pub struct Background {
    runs: moka::sync::Cache<String, Arc<Run>>,
    counts: Arc<Counts>,
    max_per_key: usize,
}

/// A tenant has `max_per_key` background responses running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooMany(pub usize);

impl Background {
    pub fn new(max_bytes: u64, ttl: Duration, max_per_key: usize) -> Background {
        let runs = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &String, r: &Arc<Run>| u32::try_from(r.lock().bytes + 512).unwrap_or(u32::MAX))
            .time_to_live(ttl)
            .build();
        Background { runs, counts: Arc::default(), max_per_key }
    }

    /// Starts run `id` of `tenant` with its first object; a background one counts against the
    /// tenant's running ones (refused past `max_per_key`).
    pub fn start(
        &self,
        id: &str,
        tenant: u64,
        background: bool,
        response: String,
    ) -> Result<Arc<Run>, TooMany> {
        if background {
            let mut counts = self.counts.lock();
            let c = counts.entry(tenant).or_default();
            if *c >= self.max_per_key {
                return Err(TooMany(self.max_per_key));
            }
            *c += 1;
        }
        let bytes = response.len();
        let run = Arc::new(Run {
            id: id.to_owned(),
            tenant,
            background,
            state: Mutex::new(RunState { events: Vec::new(), response, done: false, abort: None, bytes }),
            progress: watch::channel((0, false)).0,
            registry: self.counts.clone(),
        });
        self.runs.insert(id.to_owned(), run.clone());
        Ok(run)
    }

    /// Weighs an ended run again (it grew while it ran).
    pub fn ended(&self, run: &Arc<Run>) {
        self.runs.insert(run.id.clone(), run.clone());
    }

    /// Run `id` if `tenant` made it.
    pub fn get(&self, tenant: u64, id: &str) -> Option<Arc<Run>> {
        self.runs.get(id).filter(|r| r.tenant == tenant)
    }

    /// Forgets run `id` (the response was deleted).
    pub fn forget(&self, id: &str) {
        self.runs.invalidate(id);
    }

    /// Background runs of `tenant` running now.
    pub fn running(&self, tenant: u64) -> usize {
        self.counts.lock().get(&tenant).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(n: usize) -> Logged {
        Logged { kind: "response.output_text.delta".into(), json: format!("{{\"sequence_number\":{n}}}") }
    }

    #[tokio::test]
    async fn runs_are_counted_per_key_and_followers_see_every_event() {
        let b = Background::new(1 << 20, Duration::from_secs(60), 2);
        let r1 = b.start("r1", 7, true, r#"{"id":"r1","status":"in_progress"}"#.into()).expect("first");
        let _r2 = b.start("r2", 7, true, "{}".into()).expect("second");
        assert_eq!(b.start("r3", 7, true, "{}".into()).err(), Some(TooMany(2)));
        assert!(b.start("r4", 8, true, "{}".into()).is_ok(), "another key has its own");
        assert!(b.start("s1", 7, false, "{}".into()).is_ok(), "a stream kept for resuming is not counted");
        assert!(b.get(8, "r1").is_none());

        let follower = {
            let r = r1.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                loop {
                    let (evs, done) = r.events_from(seen.len());
                    seen.extend(evs);
                    if done {
                        return seen;
                    }
                    r.changed(seen.len()).await;
                }
            })
        };
        r1.push([ev(0), ev(1)], None);
        tokio::task::yield_now().await;
        r1.push([ev(2)], Some(r#"{"id":"r1","status":"in_progress","output":[]}"#.into()));
        let (obj, cancelled) = r1.cancel();
        assert!(cancelled && obj.contains("\"cancelled\""), "{obj}");
        assert!(!r1.cancel().1, "once");
        assert!(!r1.finish(Some("{}".into())), "a cancelled run does not finish");
        assert_eq!(follower.await.expect("follower"), vec![ev(0), ev(1), ev(2)]);
        assert_eq!(b.running(7), 1);
        assert!(b.start("r5", 7, true, "{}".into()).is_ok(), "the cancelled one's place is free");
    }
}
