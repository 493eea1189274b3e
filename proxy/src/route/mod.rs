//! Backend pools and the choice of a backend for each request: the pool's [`Policy`] over a
//! snapshot of its backends' health and load, then an in-flight slot — waited for in the
//! pool's [`queue`] while every backend is full.
//! Health (active probes, passive ejection) lives in [`backend`] and [`health`].

pub mod backend;
pub mod budget;
pub mod draw;
pub mod events;
pub mod exposition;
pub mod health;
pub mod index;
pub mod key;
pub mod load;
pub mod policy;
pub mod queue;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use backend::{Backend, Ejection, InflightGuard, PrefillTicket};
pub use budget::RetryBudget;
pub use policy::{Candidate, Candidates, Decision, Policy, RouteKey, State};
use queue::{Queue, QueueMetrics};

use crate::config::{
    BackendConfig, BackendRole, BackendUrl, CacheAwareConfig, Config, PolicyKind, PoolConfig,
};
use crate::observe::Metrics;
use crate::upstream::dns::Resolved;
use crate::upstream::Peer;

/// Interchangeable backends serving the same models under one policy: the routing part of a
/// `[[pools]]` entry.
#[derive(Debug)]
pub struct Pool {
    pub name: String,
    pub policy: Arc<dyn Policy>,
    /// The same policy where it is `cache_aware`: its prefix index, fed by load scrapes and
    /// KV events.
    pub cache_aware: Option<Arc<policy::CacheAware>>,
    /// `[pools.cache_aware]`, for the scraper and the event subscribers.
    pub cache_cfg: CacheAwareConfig,
    pub backends: Vec<Arc<Backend>>,
    pub max_inflight: usize,
    /// Requests waiting while every backend is at `max_inflight`.
    pub queue: Arc<Queue>,
    /// Leading prefix blocks in the `prefix_hash` key.
    pub prefix_blocks: usize,
    /// What a unit of the pool's prompts is (how canonicalization cuts them into blocks).
    pub units: PromptUnits,
    pub budget: RetryBudget,
}

/// What one unit of a pool's prompts is: a token of the backends' own tokenizer, or a byte where
/// that is not known (then the tokens a backend's KV capacity holds must be converted).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PromptUnits {
    /// Units are the backends' tokens.
    pub exact_tokens: bool,
    /// Units per token before the pool has learnt its own.
    pub per_token_guess: f64,
    /// Units per prefix block.
    pub per_block: usize,
}

/// One backend as the policy file (or an embedded replica) names it.
#[derive(Debug, Clone)]
pub struct BackendSpec {
    pub name: String,
    pub url: BackendUrl,
    /// The address it connects to (`url`'s host, resolved).
    pub addr: std::net::SocketAddr,
    pub weight: u32,
    /// KV events endpoint, and its replay endpoint.
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
    /// The backend's own API key (from `api_key_env`).
    pub api_key: Option<String>,
    /// Its part in prefill/decode disaggregation.
    pub role: BackendRole,
    /// Where others fetch its cached K/V (`HOST:PORT`).
    pub kv_transfer: Option<String>,
    /// Its blocks go to, and come from, the pool's shared KV tier.
    pub shared_kv_tier: bool,
}

impl BackendSpec {
    /// The backends `b` stands for at the addresses in `resolved`: one, or with `expand` one
    /// per address, named `NAME@ADDRESS`.
    pub fn of(b: &BackendConfig, resolved: &Resolved) -> Result<Vec<BackendSpec>, String> {
        let spec = |name: String, addr| BackendSpec {
            name,
            url: b.url.clone(),
            addr,
            weight: b.weight,
            kv_events: b.kv_events.clone(),
            kv_replay: b.kv_events_replay.clone(),
            api_key: b.api_key_env.as_ref().and_then(|v| std::env::var(v).ok()),
            role: b.role,
            kv_transfer: b.kv_transfer.clone(),
            shared_kv_tier: b.shared_kv_tier,
        };
        Ok(match b.expand {
            true => resolved.all(&b.url).iter().map(|a| spec(format!("{}@{}", b.name, a.ip()), *a)).collect(),
            false => vec![spec(b.name.clone(), resolved.first(&b.url)?)],
        })
    }
}

/// Why no backend could be picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoBackend {
    /// None is up (or every one that is up was tried already).
    Unavailable,
    /// Backends are up but all at their in-flight cap (after waiting in the queue, where the
    /// pool has one).
    Saturated,
    /// The queue was full.
    QueueFull,
}

/// A picked backend with its reserved in-flight slot.
#[derive(Debug)]
pub struct Selected {
    pub index: usize,
    pub reason: &'static str,
    /// The policy's numbers for `x-warmpath-route` (may be empty).
    pub detail: String,
    pub guard: InflightGuard,
    /// The prefill work this request adds to the backend, until its first byte.
    pub prefill: PrefillTicket,
    /// The backend whose cached K/V the chosen one fetches the prompt's prefix from.
    pub fetch_from: Option<usize>,
}

impl Selected {
    pub fn backend(&self) -> &Arc<Backend> {
        self.guard.backend()
    }
}

impl Pool {
    /// Picks a backend and reserves a slot on it, waiting in the pool's queue (in order, by
    /// `priority`) while every backend is full.
    pub async fn acquire(
        &self,
        key: &RouteKey,
        metrics: &Metrics,
        priority: i64,
    ) -> Result<Selected, NoBackend> {
        if self.queue.may_pass(priority) {
            match self.select(key, &[], metrics) {
                Err(NoBackend::Saturated) => {}
                done => return done,
            }
        }
        if !self.queue.enabled() {
            return Err(NoBackend::Saturated);
        }
        let place = self.queue.enter(priority).map_err(|_| NoBackend::QueueFull)?;
        let deadline = Instant::now() + self.queue.timeout;
        loop {
            if place.is_head() {
                match self.select(key, &[], metrics) {
                    Ok(sel) => {
                        place.served();
                        return Ok(sel);
                    }
                    Err(NoBackend::Saturated) => {}
                    Err(e) => return Err(e),
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                place.timed_out();
                return Err(NoBackend::Saturated);
            }
            place.wait(left).await;
        }
    }

    /// The pool as a policy reads it for one decision, `tried` excluded.
    pub fn view<'a>(&'a self, tried: &'a [usize]) -> View<'a> {
        View { pool: self, tried, now: Instant::now(), full: Vec::new(), ejected_serve: false }
    }

    /// Picks a backend not in `tried` and reserves a slot on it.
    pub fn select(&self, key: &RouteKey, tried: &[usize], metrics: &Metrics) -> Result<Selected, NoBackend> {
        let mut view = self.view(tried);
        // A slot can be taken between the policy's read and the reservation; then mark it full
        // and ask again, at most once per backend.
        for _ in 0..=self.backends.len() {
            let Some(d) = self.policy.select(key, &view) else {
                if !view.ejected_serve && self.all_ejected(&view) {
                    view.ejected_serve = true;
                    metrics.ejection_overrides.with_label_values(&[&self.name]).inc();
                    continue;
                }
                break;
            };
            if let Some(mut guard) =
                self.backends[d.index].try_acquire(self.max_inflight, &metrics.inflight_total)
            {
                guard.queue = Some(self.queue.clone());
                metrics
                    .routing_decisions
                    .with_label_values(&[&self.name, self.policy.name(), d.reason])
                    .inc();
                self.policy.routed(key, &d);
                let prefill = self.backends[d.index].prefill(d.prefill_tokens, key.tokens as u64);
                return Ok(Selected {
                    index: d.index,
                    reason: d.reason,
                    detail: d.detail,
                    guard,
                    prefill,
                    fetch_from: d.fetch_from,
                });
            }
            view.full.push(d.index);
        }
        if (0..view.len()).any(|i| view.get(i).state == State::Full) {
            Err(NoBackend::Saturated)
        } else {
            Err(NoBackend::Unavailable)
        }
    }

    /// Passive ejection never empties a pool: when no backend is left to take a request and
    /// some of those out are only ejected (their probes still pass), those take traffic again
    /// (Envoy's panic routing). A backend that answers its probes but failed a few requests is
    /// a better bet than a 503 for every request — with three replicas each failing a few
    /// percent, ejection alone took the whole pool out in the soak.
    fn all_ejected(&self, view: &View<'_>) -> bool {
        let mut ejected = false;
        for i in 0..view.len() {
            match view.get(i).state {
                State::Up | State::Full => return false,
                State::Down => ejected |= self.backends[i].probed_up(),
                State::Tried => {}
            }
        }
        ejected
    }
}

/// The pool as one decision reads it: each backend's health and load when the policy asks for
/// it, so a policy that samples a large pool reads only its sample.
#[derive(Debug)]
pub struct View<'a> {
    pool: &'a Pool,
    tried: &'a [usize],
    now: Instant,
    /// Picked but found full when reserving.
    full: Vec<usize>,
    /// Every backend is out and some only ejected: those serve (see [`Pool::all_ejected`]).
    ejected_serve: bool,
}

impl policy::Candidates for View<'_> {
    fn len(&self) -> usize {
        self.pool.backends.len()
    }

    fn get(&self, i: usize) -> Candidate {
        let b = &self.pool.backends[i];
        let inflight = b.inflight();
        let state = if self.tried.contains(&i) {
            State::Tried
        } else if !(b.is_up(self.now) || self.ejected_serve && b.probed_up()) {
            State::Down
        } else if inflight >= self.pool.max_inflight || self.full.contains(&i) {
            State::Full
        } else {
            State::Up
        };
        Candidate {
            weight: b.weight,
            inflight,
            state,
            pending_tokens: b.pending_tokens(),
            reported: b.reported_requests(),
            fetchable: b.kv_transfer.is_some(),
            shared_tier: b.shared_kv_tier,
        }
    }
}

/// What the background services (health probes, load scrapes, KV event feeds) walk over: the
/// current fleet and settings, which a policy reload swaps.
pub trait Current: Send + Sync {
    fn fleet(&self) -> Arc<Fleet>;
    fn health(&self) -> crate::config::HealthConfig;
    fn upstream(&self) -> Arc<crate::upstream::Upstream>;
}

/// Every pool's routing state: what the background services (health probes, load scrapes, KV
/// event feeds) and readiness walk over.
#[derive(Debug, Default)]
pub struct Fleet {
    pools: Vec<Arc<Pool>>,
}

impl Fleet {
    pub fn new(pools: Vec<Arc<Pool>>) -> Fleet {
        Fleet { pools }
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Every backend of every pool.
    pub fn backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.pools.iter().flat_map(|p| p.backends.iter())
    }

    /// Pools without a backend whose probes pass (what `/readyz` reports): an ejected backend
    /// still serves when no other can.
    pub fn unready(&self) -> Vec<String> {
        self.pools
            .iter()
            .filter(|p| !p.backends.iter().any(|b| b.probed_up()))
            .map(|p| p.name.clone())
            .collect()
    }
}

impl Pool {
    /// The pool `pc` describes over `backends`, whose prompts come in `units`.
    pub fn build(
        pc: &PoolConfig,
        backends: &[BackendSpec],
        cfg: &Config,
        metrics: &Metrics,
        units: PromptUnits,
    ) -> Result<Pool, String> {
        let queue = Arc::new(Queue::new(
            pc.max_queued,
            Duration::from_millis(pc.queue_timeout_ms),
            QueueMetrics {
                depth: metrics.queue_depth.with_label_values(&[&pc.name]),
                wait: metrics.queue_wait.with_label_values(&[&pc.name]),
                timed_out: metrics.queue_rejected.with_label_values(&[&pc.name, "timeout"]),
                full: metrics.queue_rejected.with_label_values(&[&pc.name, "full"]),
            },
        ));
        let mut built = Vec::with_capacity(backends.len());
        for spec in backends {
            let mut peer = Peer::new(spec.url.clone(), spec.addr, &cfg.upstream)?;
            peer.set_api_key(spec.api_key.as_deref())?;
            let labels = [pc.name.as_str(), spec.name.as_str()];
            let mut b = Backend::new(
                spec.name.clone(),
                pc.name.clone(),
                spec.weight,
                peer,
                metrics.inflight.with_label_values(&labels),
                metrics.backend_up.with_label_values(&labels),
            );
            b.kv_events = spec.kv_events.clone();
            b.kv_replay = spec.kv_replay.clone();
            b.kv_transfer = spec.kv_transfer.clone();
            b.shared_kv_tier = spec.shared_kv_tier;
            built.push(Arc::new(b));
        }
        let names: Vec<&str> = built.iter().map(|b| b.name.as_str()).collect();
        let weights: Vec<u32> = built.iter().map(|b| b.weight).collect();
        let mut cache_aware = None;
        let policy: Arc<dyn Policy> = match pc.policy {
            PolicyKind::RoundRobin => Arc::new(policy::RoundRobin::new(&weights)),
            PolicyKind::LeastLoad => Arc::new(policy::LeastLoad::new()),
            PolicyKind::PrefixHash => Arc::new(policy::PrefixHash::new(
                &names,
                &weights,
                pc.prefix_hash.vnodes,
                pc.prefix_hash.load_factor,
            )),
            PolicyKind::Session => Arc::new(policy::Session::new(&names, pc.session.overload_factor)),
            PolicyKind::CacheAware => {
                // An expanded name can resolve to more backends than validation could count.
                if built.len() > index::MAX_BACKENDS {
                    return Err(format!(
                        "pool {}: cache_aware tracks at most {} backends ({} resolved)",
                        pc.name,
                        index::MAX_BACKENDS,
                        built.len()
                    ));
                }
                let ca = &pc.cache_aware;
                let ttl = (ca.ttl_s > 0).then(|| Duration::from_secs(ca.ttl_s));
                let index = Arc::new(index::PrefixIndex::new(built.len(), ca.capacity_blocks, ttl));
                let p = Arc::new(policy::CacheAware::new(&names, index, ca));
                p.set_units_per_token(units.per_token_guess);
                cache_aware = Some(p.clone());
                p
            }
        };
        Ok(Pool {
            name: pc.name.clone(),
            policy,
            cache_aware,
            cache_cfg: pc.cache_aware.clone(),
            backends: built,
            max_inflight: pc.max_inflight_per_backend,
            queue,
            prefix_blocks: pc.prefix_hash.prefix_blocks,
            units,
            budget: RetryBudget::new(cfg.retry.budget_ratio.0, cfg.retry.min_retries_per_sec),
        })
    }
}
