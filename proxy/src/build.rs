//! What the policy says, built into running parts: each stage's part of each pool from its own
//! table, and the whole [`AppState`] — at start-up, and again at each policy reload, where the
//! parts whose settings did not change are carried over from the state being replaced.

use std::collections::HashMap;
use std::sync::Arc;

use crate::auth::Auth;
use crate::cache::ResponseCache;
use crate::canon::Canon;
use crate::config::{BackendRole, Config, PoolConfig};
use crate::embedded::Replica;
use crate::limits::{Buffered, Connections};
use crate::observe::{Lifecycle, Metrics};
use crate::pipeline::guard::{LateState, PoolCompleter};
use crate::policy::Policy;
use crate::route::{self, BackendSpec, Fleet, PromptUnits};
use crate::safety::{Safety, Services};
use crate::session::Store;
use crate::shared::Shared;
use crate::state::{self, AppState, Pools};
use crate::upstream::dns::Resolved;
use crate::upstream::Upstream;

/// What outlives a policy reload: the metrics registry, where the process is in its life, the
/// open WebSocket connections, and the embedded replicas (started once, by pool name).
pub struct Base {
    pub metrics: Metrics,
    pub lifecycle: Arc<Lifecycle>,
    pub ws: Arc<Connections>,
    /// The bytes of bodies and messages held, for the whole process.
    pub buffered: Arc<Buffered>,
    pub replicas: HashMap<String, Vec<Replica>>,
}

/// Settings compared by their printed form (every config table derives `Debug`): equal text,
/// equal settings.
fn same<T: std::fmt::Debug>(a: &T, b: &T) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

/// The state `policy` describes. `previous`, the state it replaces at a reload, gives what did
/// not change: the connection pool (same `[upstream]`), the conversation store and the keys
/// with their running limits (same `[session]`/`[auth]` and `[redis]`), and each pool's
/// routing state — whole where its routing settings are unchanged (prefix index, health,
/// ejections, load, queue), else each backend that is still there by name and address (health,
/// ejections, in-flight counts); a backend new to the pool takes traffic once probed.
/// `resolved`: the addresses of the names the policy gives (`Resolved::lookup`); a backend
/// whose address changed is a new backend.
pub fn state(
    base: &Base,
    policy: Policy,
    resolved: Arc<Resolved>,
    previous: Option<&AppState>,
) -> Result<Arc<AppState>, String> {
    let cfg = policy.cfg.clone();
    let up = &cfg.upstream;
    let upstream = match previous.filter(|p| same(&p.cfg.upstream, up)) {
        Some(p) => p.upstream.clone(),
        None => {
            let client = up.client_cert_file.as_deref().zip(up.client_key_file.as_deref());
            Arc::new(Upstream::new(
                std::time::Duration::from_millis(up.pool_idle_timeout_ms),
                up.ca_file.as_deref(),
                client,
            ))
        }
    };
    // The fleet's Redis, where the policy names one (dialled on first use), for the parts
    // built anew.
    let redis = match cfg.redis.configured() {
        true => Some(Arc::new(Shared::new(&cfg.redis)?)),
        false => None,
    };
    let kept = |same_tables: bool| previous.filter(|p| same_tables && same(&p.cfg.redis, &cfg.redis));
    let sessions = match kept(previous.is_some_and(|p| same(&p.cfg.session, &cfg.session))) {
        Some(p) => p.sessions.clone(),
        None => Arc::new(Store::new(&cfg.session, redis.as_ref())?),
    };
    let auth = match kept(previous.is_some_and(|p| same(&p.cfg.auth, &cfg.auth))) {
        Some(p) => p.auth.clone(),
        None => Arc::new(Auth::new(&cfg.auth, redis.as_ref(), &base.metrics)?),
    };
    let late = LateState::default();
    let pools = build_pools(policy, base, &upstream, &resolved, &late, previous)?;
    let routed = pools.iter().flat_map(|p| std::iter::once(p.route.clone()).chain(p.prefill.clone()));
    let fleet = Arc::new(Fleet::new(routed.collect()));
    let state = Arc::new(AppState {
        cfg,
        pools,
        fleet,
        metrics: base.metrics.clone(),
        upstream,
        resolved,
        sessions,
        ws: base.ws.clone(),
        buffered: base.buffered.clone(),
        auth,
        lifecycle: base.lifecycle.clone(),
    });
    let _ = late.set(Arc::downgrade(&state));
    Ok(state)
}

/// What makes a pool's routing state: equal between two policies, the old one is kept whole.
fn routing(pc: &PoolConfig, cfg: &Config) -> String {
    format!(
        "{:?}",
        (
            pc.policy,
            pc.max_inflight_per_backend,
            pc.queue_timeout_ms,
            pc.max_queued,
            &pc.prefix_hash,
            &pc.session,
            &pc.cache_aware,
            &pc.canon,
            &pc.backends,
            &pc.embedded,
            &cfg.upstream,
            &cfg.retry,
        )
    )
}

/// Pool `pc`'s routing state: the previous one where nothing it depends on changed, else a new
/// one holding the previous backends that are still there.
fn routing_state(
    pc: &PoolConfig,
    cfg: &Config,
    specs: &[BackendSpec],
    units: PromptUnits,
    metrics: &Metrics,
    previous: Option<&AppState>,
) -> Result<Arc<route::Pool>, String> {
    // A pool's prefill backends are a routing pool of their own, named `POOL:prefill`.
    let (name, prefill) = match pc.name.strip_suffix(PREFILL_SUFFIX) {
        Some(name) => (name, true),
        None => (pc.name.as_str(), false),
    };
    let before = previous.and_then(|p| {
        let old_pc = p.cfg.pools.iter().find(|o| o.name == name)?;
        let old = p.pools.named(name)?;
        let route = if prefill { old.prefill.clone()? } else { old.route.clone() };
        let old_pc = if prefill { prefill_config(old_pc) } else { old_pc.clone() };
        Some((routing(&old_pc, &p.cfg), route, same(&p.cfg.upstream, &cfg.upstream)))
    });
    if let Some((old, route, _)) = &before {
        let same_backends = route.backends.len() == specs.len()
            && route
                .backends
                .iter()
                .zip(specs)
                .all(|(b, s)| b.name == s.name && b.peer.addr() == Some(s.addr));
        if *old == routing(pc, cfg) && same_backends {
            return Ok(route.clone());
        }
    }
    let mut pool = route::Pool::build(pc, specs, cfg, metrics, units)?;
    let old = before.filter(|b| b.2).map(|b| b.1);
    for (b, spec) in pool.backends.iter_mut().zip(specs) {
        let kept = old.as_ref().and_then(|o| {
            o.backends.iter().find(|ob| {
                ob.name == spec.name
                    && ob.weight == spec.weight
                    && ob.kv_events == spec.kv_events
                    && ob.peer.is(&spec.url, spec.addr, spec.api_key.as_deref())
            })
        });
        match kept {
            Some(ob) => *b = ob.clone(),
            // New to a running pool: it waits for the health probes (at start, every backend
            // is taken up at once, as before).
            None if previous.is_some() && cfg.health.enabled => b.await_probe(),
            None => {}
        }
    }
    Ok(Arc::new(pool))
}

/// Every pool with each stage's part of it, built from its table; embedded pools get their
/// replicas from `base`.
fn build_pools(
    policy: Policy,
    base: &Base,
    upstream: &Arc<Upstream>,
    resolved: &Arc<Resolved>,
    late: &LateState,
    previous: Option<&AppState>,
) -> Result<Pools, String> {
    let cfg = &policy.cfg;
    let metrics = &base.metrics;
    let mut pools = Vec::with_capacity(cfg.pools.len());
    for (i, (pc, external)) in cfg.pools.iter().zip(policy.externals).enumerate() {
        let specs: Vec<BackendSpec> = match (&pc.embedded, base.replicas.get(&pc.name)) {
            (Some(_), Some(replicas)) => {
                replicas.iter().enumerate().map(|(r, rep)| replica_spec(&pc.name, r, rep)).collect()
            }
            (Some(_), None) => return Err(format!("pools[{i}]: embedded replicas were not started for it")),
            (None, _) => {
                let mut specs = Vec::new();
                for b in &pc.backends {
                    specs.extend(BackendSpec::of(b, resolved).map_err(|e| format!("pools[{i}]: {e}"))?);
                }
                specs
            }
        };
        let canon = Canon::new(&pc.canon, &pc.tools, pc.embedded.is_some(), external);
        let enc = canon.encoder();
        let units = PromptUnits {
            exact_tokens: enc.exact_tokens(),
            per_token_guess: enc.units_per_token_guess(),
            per_block: enc.block_units(),
        };
        // Prefill-only backends form their own routing pool; the rest serve whole requests and
        // decode after a remote prefill.
        let (prefill_specs, specs): (Vec<BackendSpec>, Vec<BackendSpec>) =
            specs.into_iter().partition(|s| s.role == BackendRole::Prefill);
        let routing = routing_state(pc, cfg, &specs, units, metrics, previous)?;
        let prefill = match prefill_specs.is_empty() {
            true => None,
            false => Some(routing_state(&prefill_config(pc), cfg, &prefill_specs, units, metrics, previous)?),
        };
        let pool = state::Pool {
            name: pc.name.clone(),
            route: routing,
            prefill,
            disagg: pc.disagg.clone(),
            canon,
            response_cache: pc.response_cache.enabled.then(|| ResponseCache::new(&pc.response_cache)),
            responses: pc.responses,
            responses_tokens: pc.responses_tokens,
            tenants: pc.tenants,
            route_headers: pc.route_headers,
            max_model_len: pc.max_model_len.or(pc.embedded.as_ref().map(|e| e.max_model_len)),
            safety: Safety::from_config(
                &pc.safety,
                &pc.name,
                metrics,
                &services(pc, cfg, upstream, resolved, late),
            )
            .map_err(|e| format!("pools[{i}].safety: {e}"))?
            .map(Arc::new),
        };
        pools.push((pool, pc.models.clone()));
    }
    Ok(Pools::new(pools))
}

/// The name suffix of a pool's prefill routing pool.
const PREFILL_SUFFIX: &str = ":prefill";

/// Pool `pc` as its prefill backends' routing pool sees it: the same settings, its own name
/// (in metrics and on its backends).
fn prefill_config(pc: &PoolConfig) -> PoolConfig {
    PoolConfig { name: format!("{}{PREFILL_SUFFIX}", pc.name), ..pc.clone() }
}

/// What pool `pc`'s checks call: the shared connector, and its guard model's pool.
fn services(
    pc: &PoolConfig,
    cfg: &Config,
    upstream: &Arc<Upstream>,
    resolved: &Arc<Resolved>,
    late: &LateState,
) -> Services {
    let guard = pc.safety.guard_model.as_ref().map(|g| {
        Arc::new(PoolCompleter { state: late.clone(), pool: g.pool.clone() })
            as Arc<dyn crate::safety::guard::Complete>
    });
    Services {
        upstream: upstream.clone(),
        upstream_cfg: cfg.upstream.clone(),
        resolved: resolved.clone(),
        guard,
    }
}

/// A bundled replica as a backend of pool `pool`: named `{pool}-{r}`.
fn replica_spec(pool: &str, r: usize, rep: &Replica) -> BackendSpec {
    let url = crate::config::BackendUrl {
        tls: false,
        host: rep.addr.ip().to_string(),
        port: rep.addr.port(),
        base_path: String::new(),
    };
    BackendSpec {
        name: format!("{pool}-{r}"),
        url,
        addr: rep.addr,
        weight: 1,
        kv_events: rep.kv_events.clone(),
        kv_replay: rep.kv_replay.clone(),
        api_key: None,
        role: if rep.prefill { BackendRole::Prefill } else { BackendRole::Both },
        kv_transfer: rep.kv_transfer.map(|a| a.to_string()),
        shared_kv_tier: rep.shared_kv_tier,
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::config::Source;
    use crate::upstream::dns::Resolve;

    fn base() -> Base {
        let metrics = Metrics::new();
        Base {
            lifecycle: Arc::new(Lifecycle::default()),
            ws: Arc::new(Connections::new(metrics.ws_connections.with_label_values(&["api"]))),
            buffered: Buffered::new(1 << 20, metrics.buffered_bytes.clone()),
            replicas: HashMap::new(),
            metrics,
        }
    }

    /// A headless Service `svc.test` whose pods are `ips`.
    fn pods(ips: &[&str]) -> Arc<Resolved> {
        let addrs: Vec<SocketAddr> =
            ips.iter().map(|ip| format!("{ip}:8000").parse().expect("addr")).collect();
        let resolve: Resolve = Arc::new(move |_, _| Ok(addrs.clone()));
        let policy = policy();
        Arc::new(Resolved::lookup(&policy.cfg, None, &resolve).expect("resolves").0)
    }

    fn policy() -> Policy {
        let text = r#"
[[pools]]
name = "p"
models = ["*"]
policy = "cache_aware"
[[pools.backends]]
name = "svc"
url = "http://svc.test:8000"
expand = true
"#;
        Policy::parse(&Source { file: "t.toml".into(), text: text.into() }).expect("policy")
    }

    #[test]
    fn a_name_expands_into_backends_that_follow_its_addresses() {
        let base = base();
        let first = state(&base, policy(), pods(&["10.0.0.1", "10.0.0.2"]), None).expect("state");
        let route = |s: &AppState| s.pools.named("p").expect("pool").route.clone();
        let names = |s: &AppState| route(s).backends.iter().map(|b| b.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&first), ["svc@10.0.0.1", "svc@10.0.0.2"]);
        let old = route(&first);
        assert_eq!(old.backends[1].peer.addr(), Some("10.0.0.2:8000".parse().expect("addr")));

        // The same addresses: the routing state is kept whole.
        let same = state(&base, policy(), pods(&["10.0.0.2", "10.0.0.1"]), Some(&first)).expect("state");
        assert!(Arc::ptr_eq(&route(&same), &old));

        // One pod replaced: the one that stayed keeps its backend (health, load), the new one
        // waits for its probe, the gone one is dropped.
        let moved = state(&base, policy(), pods(&["10.0.0.2", "10.0.0.3"]), Some(&first)).expect("state");
        assert_eq!(names(&moved), ["svc@10.0.0.2", "svc@10.0.0.3"]);
        let now = route(&moved);
        assert!(Arc::ptr_eq(&now.backends[0], &old.backends[1]), "the pod that stayed keeps its state");
        let t = std::time::Instant::now();
        assert!(now.backends[0].is_up(t));
        assert!(!now.backends[1].is_up(t), "a new pod takes traffic once probed");
    }
}
