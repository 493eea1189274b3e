//! One backend server: its address, in-flight count, and health (active probes and passive
//! ejection). The state is a small std mutex held for a few instructions, never across an await;
//! whether the backend takes traffic is mirrored in atomics, which routing reads.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prometheus::IntGauge;

use crate::config::HealthConfig;
use crate::upstream::Peer;

/// Health bookkeeping of one backend: the counts behind its state (the state itself, down or
/// ejected, is in atomics on [`Backend`], which routing reads without this lock).
#[derive(Debug, Default)]
struct Health {
    probe_fails: u32,
    probe_oks: u32,
    /// Consecutive failed requests.
    failures: u32,
    /// Ejections in a row without a quiet period between them; doubles the next ejection.
    ejections: u32,
}

/// What the passive side decided about a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ejection {
    None,
    Ejected(Duration),
}

#[derive(Debug)]
pub struct Backend {
    pub name: String,
    pub pool: String,
    pub weight: u32,
    /// Where it is and how to connect (URL, resolved address, TLS, timeouts).
    pub peer: Peer,
    /// Where it publishes KV events (ZMQ), for `cache_aware` in precise mode.
    pub kv_events: Option<String>,
    /// Where others fetch its cached K/V (`HOST:PORT`), where it serves it.
    pub kv_transfer: Option<String>,
    /// Its blocks go to, and come from, the pool's shared KV tier (`shared_kv_tier`).
    pub shared_kv_tier: bool,
    /// Where it answers replays of recent KV event batches.
    pub kv_replay: Option<String>,
    inflight: AtomicUsize,
    /// Prompt tokens sent here still waiting for their first token.
    pending_tokens: AtomicU64,
    /// `vllm:num_requests_running` + `_waiting` at the last scrape.
    reported: AtomicU32,
    /// Prompt units (tokens, or bytes where the pool has no tokenizer) of every request routed
    /// here, against the prompt tokens the backend reports.
    prompt_units: AtomicU64,
    health: Mutex<Health>,
    /// Marked down by probes, and ejected until (µs since `epoch`; 0: never ejected): read
    /// without a lock (a decision reads many backends), written with `health` held.
    probe_down: AtomicBool,
    ejected_until_us: AtomicU64,
    epoch: Instant,
    /// What its `/metrics` said last (`cache_aware` pools read it), for the status page.
    scraped: Mutex<Option<super::load::Scraped>>,
    inflight_gauge: IntGauge,
    up_gauge: IntGauge,
}

impl Backend {
    pub fn new(
        name: String,
        pool: String,
        weight: u32,
        peer: Peer,
        inflight_gauge: IntGauge,
        up_gauge: IntGauge,
    ) -> Backend {
        up_gauge.set(1);
        Backend {
            name,
            pool,
            weight,
            peer,
            kv_events: None,
            kv_transfer: None,
            shared_kv_tier: false,
            kv_replay: None,
            inflight: AtomicUsize::new(0),
            pending_tokens: AtomicU64::new(0),
            reported: AtomicU32::new(0),
            prompt_units: AtomicU64::new(0),
            health: Mutex::new(Health::default()),
            probe_down: AtomicBool::new(false),
            ejected_until_us: AtomicU64::new(0),
            epoch: Instant::now(),
            scraped: Mutex::new(None),
            inflight_gauge,
            up_gauge,
        }
    }

    /// Added by a reload: takes no traffic until the health probes find it up.
    pub fn await_probe(&self) {
        let h = self.health();
        self.probe_down.store(true, Ordering::Relaxed);
        drop(h);
        self.up_gauge.set(0);
    }

    fn health(&self) -> MutexGuard<'_, Health> {
        // A panic while holding this lock leaves plain counters behind; keep using them.
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    fn micros(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// When the last ejection ends or ended.
    fn ejected_until(&self) -> Option<Instant> {
        match self.ejected_until_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(self.epoch + Duration::from_micros(us)),
        }
    }

    /// Within `max_ejection_ms` after the last ejection ended: one failure ejects again.
    fn on_probation(&self, cfg: &HealthConfig, now: Instant) -> bool {
        let quiet = Duration::from_millis(cfg.max_ejection_ms);
        self.ejected_until().is_some_and(|t| now.saturating_duration_since(t) < quiet)
    }

    /// Takes traffic now: not marked down by probes and not ejected.
    pub fn is_up(&self, now: Instant) -> bool {
        !self.probe_down.load(Ordering::Relaxed)
            && self.micros(now) >= self.ejected_until_us.load(Ordering::Relaxed)
    }

    /// Not marked down by the active probes (it may be ejected).
    pub fn probed_up(&self) -> bool {
        !self.probe_down.load(Ordering::Relaxed)
    }

    /// Reserves one in-flight slot unless `cap` are taken.
    pub fn try_acquire(self: &Arc<Self>, cap: usize, total: &IntGauge) -> Option<InflightGuard> {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| (n < cap).then_some(n + 1))
            .ok()?;
        self.inflight_gauge.inc();
        total.inc();
        Some(InflightGuard { backend: self.clone(), total: total.clone(), queue: None })
    }

    /// A request completed without a backend fault.
    pub fn record_success(&self, cfg: &HealthConfig, now: Instant) {
        let mut h = self.health();
        h.failures = 0;
        if h.ejections > 0 && !self.on_probation(cfg, now) {
            h.ejections = 0;
        }
    }

    /// A request failed because of the backend (connect error, 5xx, timeout, cut stream).
    /// After `eject_after_failures` in a row — or one, right after an ejection ended — the
    /// backend is ejected for `base × 2^(ejections-1)`, at most `max_ejection_ms`.
    pub fn record_failure(&self, cfg: &HealthConfig, now: Instant) -> Ejection {
        let mut h = self.health();
        if self.ejected_until().is_some_and(|t| now < t) {
            return Ejection::None; // already out; a request that raced the ejection
        }
        h.failures += 1;
        let on_probation = h.ejections > 0 && self.on_probation(cfg, now);
        if h.failures < cfg.eject_after_failures && !on_probation {
            return Ejection::None;
        }
        h.ejections = if on_probation { h.ejections + 1 } else { 1 };
        let factor = 1u64 << (h.ejections - 1).min(20);
        let d = Duration::from_millis(cfg.base_ejection_ms.saturating_mul(factor).min(cfg.max_ejection_ms));
        self.ejected_until_us.store(self.micros(now + d).max(1), Ordering::Relaxed);
        h.failures = 0;
        drop(h);
        self.up_gauge.set(0);
        Ejection::Ejected(d)
    }

    /// An active probe's result; returns the new probe state (`true` = up) when it changed.
    pub fn record_probe(&self, ok: bool, cfg: &HealthConfig) -> Option<bool> {
        let mut h = self.health();
        let down = self.probe_down.load(Ordering::Relaxed);
        let (count, threshold) = if ok {
            h.probe_fails = 0;
            h.probe_oks += 1;
            (h.probe_oks, cfg.healthy_threshold)
        } else {
            h.probe_oks = 0;
            h.probe_fails += 1;
            (h.probe_fails, cfg.unhealthy_threshold)
        };
        // A probe that disagrees with the state often enough in a row flips it.
        (down == ok && count >= threshold).then(|| {
            self.probe_down.store(!ok, Ordering::Relaxed);
            ok
        })
    }

    /// Brings the `warmpath_backend_up` gauge in line with the state (ejections end by time).
    pub fn refresh_gauge(&self, now: Instant) {
        self.up_gauge.set(i64::from(self.is_up(now)));
    }
}

impl Backend {
    pub fn reported_requests(&self) -> u32 {
        self.reported.load(Ordering::Relaxed)
    }

    pub fn set_reported_requests(&self, n: u32) {
        self.reported.store(n, Ordering::Relaxed);
    }

    /// What its `/metrics` said last, if warmpath reads it.
    pub fn scraped(&self) -> Option<super::load::Scraped> {
        *self.scraped.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_scraped(&self, s: super::load::Scraped) {
        *self.scraped.lock().unwrap_or_else(|p| p.into_inner()) = Some(s);
    }

    pub fn prompt_units(&self) -> u64 {
        self.prompt_units.load(Ordering::Relaxed)
    }

    pub fn pending_tokens(&self) -> u64 {
        self.pending_tokens.load(Ordering::Relaxed)
    }

    /// Counts `tokens` of prefill work queued here until the ticket is released (at the
    /// response's first byte) or dropped, for a prompt of `prompt` units.
    pub fn prefill(self: &Arc<Self>, tokens: u64, prompt: u64) -> PrefillTicket {
        self.prompt_units.fetch_add(prompt, Ordering::Relaxed);
        self.pending_tokens.fetch_add(tokens, Ordering::Relaxed);
        PrefillTicket { backend: self.clone(), tokens, released: AtomicBool::new(false) }
    }
}

/// Prefill work queued on a backend; see [`Backend::prefill`].
#[derive(Debug)]
pub struct PrefillTicket {
    backend: Arc<Backend>,
    tokens: u64,
    released: AtomicBool,
}

impl PrefillTicket {
    /// The backend started answering: its prefill is done. Idempotent.
    pub fn release(&self) {
        if !self.released.swap(true, Ordering::Relaxed) {
            self.backend.pending_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for PrefillTicket {
    fn drop(&mut self) {
        self.release();
    }
}

/// One in-flight slot on a backend, released on drop whatever path the request took.
#[derive(Debug)]
pub struct InflightGuard {
    backend: Arc<Backend>,
    total: IntGauge,
    /// The queue of the pool that gave the slot, told when it is freed.
    pub(super) queue: Option<Arc<super::queue::Queue>>,
}

impl InflightGuard {
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.backend.inflight.fetch_sub(1, Ordering::AcqRel);
        self.backend.inflight_gauge.dec();
        self.total.dec();
        if let Some(q) = &self.queue {
            q.slot_freed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend() -> Arc<Backend> {
        let url = crate::config::BackendUrl::parse("http://127.0.0.1:1").expect("url");
        let addr = "127.0.0.1:1".parse().expect("addr");
        let peer = Peer::new(url, addr, &crate::config::UpstreamConfig::default()).expect("peer");
        Arc::new(Backend::new(
            "b".into(),
            "p".into(),
            1,
            peer,
            IntGauge::new("i", "i").expect("g"),
            IntGauge::new("u", "u").expect("g"),
        ))
    }

    fn cfg() -> HealthConfig {
        HealthConfig {
            eject_after_failures: 3,
            base_ejection_ms: 1000,
            max_ejection_ms: 8000,
            ..Default::default()
        }
    }

    #[test]
    fn ejection_grows_and_ends() {
        let (b, cfg) = (backend(), cfg());
        let t0 = Instant::now();
        assert_eq!(b.record_failure(&cfg, t0), Ejection::None);
        assert_eq!(b.record_failure(&cfg, t0), Ejection::None);
        assert_eq!(b.record_failure(&cfg, t0), Ejection::Ejected(Duration::from_secs(1)));
        assert!(!b.is_up(t0));
        let t1 = t0 + Duration::from_millis(1001);
        assert!(b.is_up(t1), "re-admitted when the ejection ends");
        // On probation: one failure ejects again, for twice as long.
        assert_eq!(b.record_failure(&cfg, t1), Ejection::Ejected(Duration::from_secs(2)));
        let t2 = t1 + Duration::from_secs(3);
        assert_eq!(b.record_failure(&cfg, t2), Ejection::Ejected(Duration::from_secs(4)));
        let t3 = t2 + Duration::from_secs(5);
        assert_eq!(b.record_failure(&cfg, t3), Ejection::Ejected(Duration::from_secs(8)));
        let t4 = t3 + Duration::from_secs(9);
        assert_eq!(b.record_failure(&cfg, t4), Ejection::Ejected(Duration::from_secs(8)), "capped");
        // A quiet period as long as the longest ejection forgets the history.
        let t5 = t4 + Duration::from_secs(30);
        b.record_success(&cfg, t5);
        assert_eq!(b.record_failure(&cfg, t5), Ejection::None);
    }

    #[test]
    fn success_resets_the_failure_run() {
        let (b, cfg) = (backend(), cfg());
        let t = Instant::now();
        b.record_failure(&cfg, t);
        b.record_failure(&cfg, t);
        b.record_success(&cfg, t);
        assert_eq!(b.record_failure(&cfg, t), Ejection::None);
        assert!(b.is_up(t));
    }

    #[test]
    fn probes_use_thresholds() {
        let b = backend();
        let cfg = HealthConfig { unhealthy_threshold: 2, healthy_threshold: 2, ..Default::default() };
        let now = Instant::now();
        assert_eq!(b.record_probe(false, &cfg), None);
        assert_eq!(b.record_probe(false, &cfg), Some(false));
        assert!(!b.is_up(now));
        assert_eq!(b.record_probe(true, &cfg), None);
        assert_eq!(b.record_probe(true, &cfg), Some(true));
        assert!(b.is_up(now));
    }

    #[test]
    fn inflight_cap_and_release() {
        let b = backend();
        let total = IntGauge::new("t", "t").expect("g");
        let g1 = b.try_acquire(2, &total).expect("slot");
        let _g2 = b.try_acquire(2, &total).expect("slot");
        assert!(b.try_acquire(2, &total).is_none());
        assert_eq!((b.inflight(), total.get()), (2, 2));
        drop(g1);
        assert_eq!((b.inflight(), total.get()), (1, 1));
    }
}
