//! Backend pools and the choice of a backend for each request: model → pool, then the pool's
//! [`Policy`] over a snapshot of its backends' health and load, then an in-flight slot.
//! Health (active probes, passive ejection) lives in [`backend`] and [`health`].

pub mod backend;
pub mod budget;
pub mod events;
pub mod health;
pub mod index;
pub mod key;
pub mod load;
pub mod policy;

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pingora::upstreams::peer::HttpPeer;

pub use backend::{Backend, Ejection, InflightGuard, PrefillTicket};
pub use budget::RetryBudget;
pub use policy::{Candidate, Decision, Policy, RouteKey, State};

use crate::config::{BackendUrl, Config, PolicyKind, PoolConfig, UpstreamConfig};
use crate::observe::Metrics;

/// Interchangeable backends serving the same models under one policy.
#[derive(Debug)]
pub struct Pool {
    pub name: String,
    pub policy: Arc<dyn Policy>,
    /// The same policy where it is `cache_aware`: its prefix index, fed by load scrapes and
    /// KV events.
    pub cache_aware: Option<Arc<policy::CacheAware>>,
    /// `[pools.cache_aware]`, for the scraper and the event subscribers.
    pub cache_cfg: crate::config::CacheAwareConfig,
    pub backends: Vec<Arc<Backend>>,
    pub max_inflight: usize,
    /// Leading prefix blocks in the `prefix_hash` key.
    pub prefix_blocks: usize,
    /// How this pool's requests are canonicalized and cut into prefix blocks.
    pub canon: crate::canon::Canon,
    /// `[pools.response_cache]`, where enabled.
    pub response_cache: Option<crate::cache::ResponseCache>,
    pub budget: RetryBudget,
    /// `responses`: translated by warmpath, or the backends' own.
    pub responses: crate::config::ResponsesMode,
    /// `responses_tokens`: translated turns as token-id completions where the pool can.
    pub responses_tokens: bool,
}

/// Why no backend could be picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoBackend {
    /// None is up (or every one that is up was tried already).
    Unavailable,
    /// Backends are up but all at their in-flight cap.
    Saturated,
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
}

impl Selected {
    pub fn backend(&self) -> &Arc<Backend> {
        self.guard.backend()
    }
}

impl Pool {
    /// Picks a backend not in `tried` and reserves a slot on it.
    pub fn select(&self, key: &RouteKey, tried: &[usize], metrics: &Metrics) -> Result<Selected, NoBackend> {
        let now = Instant::now();
        let mut candidates: Vec<Candidate> = self
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let inflight = b.inflight();
                let state = if tried.contains(&i) {
                    State::Tried
                } else if !b.is_up(now) {
                    State::Down
                } else if inflight >= self.max_inflight {
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
                }
            })
            .collect();
        // A slot can be taken between the snapshot and the reservation; then mark it full and
        // ask again, at most once per backend.
        for _ in 0..self.backends.len() {
            let Some(d) = self.policy.select(key, &candidates) else { break };
            if let Some(guard) =
                self.backends[d.index].try_acquire(self.max_inflight, &metrics.inflight_total)
            {
                metrics
                    .routing_decisions
                    .with_label_values(&[&self.name, self.policy.name(), d.reason])
                    .inc();
                self.policy.routed(key, &d);
                let prefill = self.backends[d.index].prefill(d.prefill_tokens, key.tokens as u64);
                return Ok(Selected { index: d.index, reason: d.reason, detail: d.detail, guard, prefill });
            }
            candidates[d.index].state = State::Full;
        }
        if candidates.iter().any(|c| c.state == State::Full) {
            Err(NoBackend::Saturated)
        } else {
            Err(NoBackend::Unavailable)
        }
    }
}

/// Every pool, and which pool serves which model.
#[derive(Debug)]
pub struct Router {
    pools: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    wildcard: Option<usize>,
}

impl Router {
    /// Builds pools from the policy file. `embedded` gives, per pool index, the addresses of
    /// bundled engine replicas started for pools that asked for them.
    pub fn build(
        cfg: &Config,
        embedded: &HashMap<usize, Vec<crate::embedded::Replica>>,
        metrics: &Metrics,
    ) -> Result<Router, String> {
        let mut pools = Vec::new();
        let mut by_model = HashMap::new();
        let mut wildcard = None;
        for (pi, pc) in cfg.pools.iter().enumerate() {
            // Name, URL, weight, KV events endpoint, its replay endpoint.
            type Spec = (String, BackendUrl, u32, Option<String>, Option<String>);
            let specs: Vec<Spec> = match embedded.get(&pi) {
                Some(replicas) => replicas
                    .iter()
                    .enumerate()
                    .map(|(i, r)| {
                        let url = BackendUrl {
                            tls: false,
                            host: r.addr.ip().to_string(),
                            port: r.addr.port(),
                            base_path: String::new(),
                        };
                        (format!("{}-{i}", pc.name), url, 1, r.kv_events.clone(), r.kv_replay.clone())
                    })
                    .collect(),
                None => pc
                    .backends
                    .iter()
                    .map(|b| {
                        let replay = b.kv_events_replay.clone();
                        (b.name.clone(), b.url.clone(), b.weight, b.kv_events.clone(), replay)
                    })
                    .collect(),
            };
            let mut backends = Vec::with_capacity(specs.len());
            for (name, url, weight, kv_events, kv_replay) in specs {
                let peer = make_peer(&url, &cfg.upstream)?;
                let labels = [pc.name.as_str(), name.as_str()];
                let mut b = Backend::new(
                    name.clone(),
                    pc.name.clone(),
                    url,
                    weight,
                    peer,
                    metrics.inflight.with_label_values(&labels),
                    metrics.backend_up.with_label_values(&labels),
                );
                b.kv_events = kv_events;
                b.kv_replay = kv_replay;
                backends.push(Arc::new(b));
            }
            for m in &pc.models {
                if m == "*" {
                    wildcard = Some(pi);
                } else {
                    by_model.insert(m.clone(), pi);
                }
            }
            pools.push(Arc::new(build_pool(pc, backends, cfg)));
        }
        Ok(Router { pools, by_model, wildcard })
    }

    pub fn pool_for(&self, model: &str) -> Option<&Arc<Pool>> {
        self.by_model.get(model).or(self.wildcard.as_ref()).map(|&i| &self.pools[i])
    }

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Every backend of every pool.
    pub fn backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.pools.iter().flat_map(|p| p.backends.iter())
    }
}

fn build_pool(pc: &PoolConfig, backends: Vec<Arc<Backend>>, cfg: &Config) -> Pool {
    let names: Vec<&str> = backends.iter().map(|b| b.name.as_str()).collect();
    let weights: Vec<u32> = backends.iter().map(|b| b.weight).collect();
    let canon = crate::canon::Canon::new(&pc.canon, &pc.tools, pc.embedded.is_some());
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
            let ca = &pc.cache_aware;
            let ttl = (ca.ttl_s > 0).then(|| Duration::from_secs(ca.ttl_s));
            let index = Arc::new(index::PrefixIndex::new(backends.len(), ca.capacity_blocks, ttl));
            let p = Arc::new(policy::CacheAware::new(&names, index, ca));
            p.set_units_per_token(canon.encoder().units_per_token_guess());
            cache_aware = Some(p.clone());
            p
        }
    };
    Pool {
        name: pc.name.clone(),
        policy,
        cache_aware,
        cache_cfg: pc.cache_aware.clone(),
        backends,
        max_inflight: pc.max_inflight_per_backend,
        prefix_blocks: pc.prefix_hash.prefix_blocks,
        canon,
        response_cache: pc
            .response_cache
            .enabled
            .then(|| crate::cache::ResponseCache::new(&pc.response_cache)),
        budget: RetryBudget::new(cfg.retry.budget_ratio.0, cfg.retry.min_retries_per_sec),
        responses: pc.responses,
        responses_tokens: pc.responses_tokens,
    }
}

/// The connection template of a backend. Names are resolved once, here: pingora's own
/// resolution blocks the worker thread.
fn make_peer(url: &BackendUrl, up: &UpstreamConfig) -> Result<HttpPeer, String> {
    let addr = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve backend {url}: {e}"))?
        .next()
        .ok_or_else(|| format!("backend {url} resolves to no address"))?;
    let mut peer = HttpPeer::new(addr, url.tls, url.host.clone());
    let ms = Duration::from_millis;
    peer.options.connection_timeout = Some(ms(up.connect_timeout_ms));
    peer.options.total_connection_timeout = Some(ms(up.connect_timeout_ms.saturating_mul(2)));
    peer.options.read_timeout = Some(ms(up.idle_timeout_ms));
    peer.options.write_timeout = Some(ms(up.idle_timeout_ms));
    peer.options.idle_timeout = Some(ms(up.pool_idle_timeout_ms));
    Ok(peer)
}
