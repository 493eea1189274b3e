//! Checks that span several values of a parsed policy file. Each failure names the key path,
//! the value and the reason; [`super::load`] turns the path into a line and column.

use std::collections::HashMap;
use std::fmt;

use super::{
    BackendRole, Config, IndexMode, KeysStore, LimitsStore, PolicyKind, StoreKind, TokenizerKind,
    MAX_BACKENDS_PER_POOL, MAX_INDEX_TTL_S,
};

/// One step of a key path: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathSeg {
    Key(String),
    Index(usize),
}

/// A value that is wrong in context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub path: Vec<PathSeg>,
    pub message: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.path.iter().enumerate() {
            match seg {
                PathSeg::Key(k) if i == 0 => write!(f, "{k}")?,
                PathSeg::Key(k) => write!(f, ".{k}")?,
                PathSeg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        write!(f, ": {}", self.message)
    }
}

struct Path(Vec<PathSeg>);

impl Path {
    fn root() -> Path {
        Path(Vec::new())
    }
    fn key(&self, k: &str) -> Path {
        let mut v = self.0.clone();
        v.push(PathSeg::Key(k.to_owned()));
        Path(v)
    }
    fn index(&self, i: usize) -> Path {
        let mut v = self.0.clone();
        v.push(PathSeg::Index(i));
        Path(v)
    }
    fn err(self, message: impl Into<String>) -> Invalid {
        Invalid { path: self.0, message: message.into() }
    }
}

fn positive(path: Path, v: u64) -> Result<(), Invalid> {
    if v == 0 {
        return Err(path.err("must be positive"));
    }
    Ok(())
}

/// Checks what serde cannot see from one value alone.
pub fn validate(cfg: &Config) -> Result<(), Invalid> {
    let root = Path::root();
    let server = root.key("server");
    if cfg.server.listen == cfg.server.admin {
        return Err(server.key("admin").err(format!("{} is also the API listener", cfg.server.admin)));
    }
    positive(server.key("threads"), cfg.server.threads as u64)?;
    let limits = root.key("limits");
    positive(limits.key("max_body_bytes"), cfg.limits.max_body_bytes as u64)?;
    positive(limits.key("header_read_timeout_ms"), cfg.limits.header_read_timeout_ms)?;
    positive(limits.key("body_read_timeout_ms"), cfg.limits.body_read_timeout_ms)?;
    positive(limits.key("max_header_bytes"), cfg.limits.max_header_bytes as u64)?;
    let up = root.key("upstream");
    positive(up.key("connect_timeout_ms"), cfg.upstream.connect_timeout_ms)?;
    positive(up.key("idle_timeout_ms"), cfg.upstream.idle_timeout_ms)?;
    positive(up.key("models_timeout_ms"), cfg.upstream.models_timeout_ms)?;
    if cfg.upstream.client_cert_file.is_some() != cfg.upstream.client_key_file.is_some() {
        return Err(up.key("client_cert_file").err("client_cert_file and client_key_file go together"));
    }
    let h = root.key("health");
    positive(h.key("interval_ms"), cfg.health.interval_ms)?;
    positive(h.key("timeout_ms"), cfg.health.timeout_ms)?;
    positive(h.key("unhealthy_threshold"), cfg.health.unhealthy_threshold.into())?;
    positive(h.key("healthy_threshold"), cfg.health.healthy_threshold.into())?;
    positive(h.key("eject_after_failures"), cfg.health.eject_after_failures.into())?;
    positive(h.key("base_ejection_ms"), cfg.health.base_ejection_ms)?;
    if cfg.health.max_ejection_ms < cfg.health.base_ejection_ms {
        return Err(h.key("max_ejection_ms").err(format!(
            "{} is below base_ejection_ms ({})",
            cfg.health.max_ejection_ms, cfg.health.base_ejection_ms
        )));
    }
    if !cfg.health.path.starts_with('/') {
        return Err(h.key("path").err(format!("{:?} must start with /", cfg.health.path)));
    }
    positive(root.key("retry").key("max_attempts"), cfg.retry.max_attempts.into())?;
    let tr = root.key("tracing");
    if let Some(Err(e)) = cfg.tracing.target() {
        return Err(tr.key("otlp_endpoint").err(e));
    }
    if !(0.0..=1.0).contains(&cfg.tracing.sample_ratio) {
        return Err(tr
            .key("sample_ratio")
            .err(format!("{} is not between 0 and 1", cfg.tracing.sample_ratio)));
    }
    positive(tr.key("export_interval_ms"), cfg.tracing.export_interval_ms)?;
    positive(tr.key("max_queued_traces"), cfg.tracing.max_queued_traces as u64)?;
    let sess = root.key("session");
    positive(sess.key("max_mib"), cfg.session.max_mib)?;
    positive(sess.key("ttl_s"), cfg.session.ttl_s)?;
    positive(sess.key("conversation_ttl_s"), cfg.session.conversation_ttl_s)?;
    positive(sess.key("max_background_per_key"), cfg.session.max_background_per_key as u64)?;
    positive(sess.key("redis_timeout_ms"), cfg.session.redis_timeout_ms)?;
    let r = root.key("redis");
    let named = [cfg.redis.url.is_some(), !cfg.redis.cluster.is_empty(), !cfg.redis.sentinels.is_empty()];
    if named.iter().filter(|n| **n).count() > 1 {
        return Err(r.err("name one of url, cluster and sentinels"));
    }
    if !cfg.redis.sentinels.is_empty() && cfg.redis.sentinel_master.is_none() {
        return Err(r.key("sentinel_master").err("sentinels need the name of the master they watch"));
    }
    if cfg.redis.client_cert_file.is_some() != cfg.redis.client_key_file.is_some() {
        return Err(r.key("client_cert_file").err("client_cert_file and client_key_file go together"));
    }
    positive(r.key("timeout_ms"), cfg.redis.timeout_ms)?;
    let needs_redis = |at: Path, what: &str| {
        if cfg.redis.configured() || cfg.session.redis_url.is_some() {
            Ok(())
        } else {
            Err(at.err(format!("{what} needs a [redis] server (url, cluster or sentinels)")))
        }
    };
    if cfg.session.store == StoreKind::Redis {
        needs_redis(sess.key("store"), "store = \"redis\"")?;
    }
    if cfg.session.redis_url.is_some() && cfg.redis.configured() {
        return Err(sess.key("redis_url").err("the Redis is named in [redis]; drop redis_url here"));
    }
    let auth = root.key("auth");
    if cfg.auth.keys_store == KeysStore::Redis {
        needs_redis(auth.key("keys_store"), "keys_store = \"redis\"")?;
    }
    if cfg.auth.limits_store == LimitsStore::Redis {
        needs_redis(auth.key("limits_store"), "limits_store = \"redis\"")?;
    }
    if cfg.auth.enabled && cfg.auth.keys_store == KeysStore::File && cfg.auth.keys_file.is_none() {
        return Err(root.key("auth").key("keys_file").err(
            "enabled = true needs a keys file (warmpath keys add NAME writes one), or keys_store = \"redis\"",
        ));
    }
    positive(root.key("auth").key("reload_interval_ms"), cfg.auth.reload_interval_ms)?;
    let ws = root.key("websocket");
    positive(ws.key("max_message_kib"), cfg.websocket.max_message_kib)?;
    positive(ws.key("max_connections"), cfg.websocket.max_connections as u64)?;
    positive(ws.key("max_streams"), cfg.websocket.max_streams as u64)?;
    positive(ws.key("idle_timeout_s"), cfg.websocket.idle_timeout_s)?;
    positive(ws.key("max_age_s"), cfg.websocket.max_age_s)?;
    positive(ws.key("ping_interval_s"), cfg.websocket.ping_interval_s)?;

    if cfg.pools.is_empty() {
        return Err(root.key("pools").err("at least one [[pools]] entry is needed"));
    }
    let mut pool_names = HashMap::new();
    let mut model_owner: HashMap<&str, &str> = HashMap::new();
    let mut backend_names = HashMap::new();
    for (i, pool) in cfg.pools.iter().enumerate() {
        let p = root.key("pools").index(i);
        if pool.name.is_empty() {
            return Err(p.key("name").err("must not be empty"));
        }
        if let Some(j) = pool_names.insert(pool.name.as_str(), i) {
            return Err(p.key("name").err(format!("pool {:?} is already defined by pools[{j}]", pool.name)));
        }
        if pool.models.is_empty() {
            return Err(p.key("models").err("list at least one model name, or \"*\""));
        }
        for (k, m) in pool.models.iter().enumerate() {
            if m.is_empty() {
                return Err(p.key("models").index(k).err("must not be empty"));
            }
            if let Some(other) = model_owner.insert(m, &pool.name) {
                return Err(p
                    .key("models")
                    .index(k)
                    .err(format!("model {m:?} is already routed to pool {other:?}")));
            }
        }
        positive(p.key("max_inflight_per_backend"), pool.max_inflight_per_backend as u64)?;
        match (&pool.embedded, pool.backends.is_empty()) {
            (Some(_), false) => {
                return Err(p
                    .key("embedded")
                    .err("a pool has either [[pools.backends]] or [pools.embedded], not both"))
            }
            (None, true) => return Err(p.err("a pool needs [[pools.backends]] or [pools.embedded]")),
            (Some(e), true) => {
                let ep = p.key("embedded");
                positive(ep.key("replicas"), e.replicas as u64)?;
                positive(ep.key("kv_blocks"), e.kv_blocks as u64)?;
                positive(ep.key("max_num_seqs"), e.max_num_seqs as u64)?;
                positive(ep.key("max_model_len"), e.max_model_len as u64)?;
                if let Some(spec) = &e.speculative {
                    spec.check().map_err(|err| ep.key("speculative").err(err.to_string()))?;
                }
                if e.prefill_replicas >= e.replicas {
                    return Err(ep.key("prefill_replicas").err(format!(
                        "{} of {} replicas would only prefill: at least one must decode",
                        e.prefill_replicas, e.replicas
                    )));
                }
                if let Some(u) = &e.kv_tier_shared {
                    if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
                        return Err(ep.key("kv_tier_shared").err(format!("{u:?} is not a redis:// URL")));
                    }
                }
            }
            (None, false) => {}
        }
        for (k, b) in pool.backends.iter().enumerate() {
            let bp = p.key("backends").index(k);
            if b.name.is_empty() {
                return Err(bp.key("name").err("must not be empty"));
            }
            if let Some((pi, bi)) = backend_names.insert(b.name.as_str(), (i, k)) {
                return Err(bp
                    .key("name")
                    .err(format!("backend {:?} is already defined by pools[{pi}].backends[{bi}]", b.name)));
            }
            positive(bp.key("weight"), b.weight.into())?;
            if let Some(t) = &b.kv_transfer {
                let port = t
                    .rsplit_once(':')
                    .and_then(|(h, p)| (!h.is_empty()).then(|| p.parse::<u16>().ok()).flatten());
                if port.is_none() {
                    return Err(bp.key("kv_transfer").err(format!("{t:?} is not HOST:PORT")));
                }
            }
            if b.expand && (b.kv_events.is_some() || b.kv_events_replay.is_some()) {
                return Err(bp.key("expand").err(
                    "an expanded name's pods each publish their own KV events: expand cannot take kv_events",
                ));
            }
        }
        let prefill = pool.backends.iter().filter(|b| b.role == BackendRole::Prefill).count();
        if prefill > 0 && prefill == pool.backends.len() {
            return Err(p
                .key("backends")
                .err("every backend has role \"prefill\": at least one must decode"));
        }
        if pool.policy == PolicyKind::PrefixHash {
            let ph = p.key("prefix_hash");
            positive(ph.key("prefix_blocks"), pool.prefix_hash.prefix_blocks as u64)?;
            positive(ph.key("vnodes"), pool.prefix_hash.vnodes as u64)?;
        }
        if pool.prefix_hash.load_factor.is_nan() || pool.prefix_hash.load_factor < 1.0 {
            return Err(p.key("prefix_hash").key("load_factor").err(format!(
                "{} must be at least 1.0 (1.0 allows no imbalance at all)",
                pool.prefix_hash.load_factor
            )));
        }
        safety(&p.key("safety"), &pool.safety, &pool.name, &cfg.pools)?;
        let c = p.key("canon");
        positive(c.key("block_size"), pool.canon.block_size as u64)?;
        positive(c.key("chunk_bytes"), pool.canon.chunk_bytes as u64)?;
        positive(c.key("max_moved_line_bytes"), pool.canon.max_moved_line_bytes as u64)?;
        if pool.canon.tokenizer_file.is_some() && pool.canon.tokenizer != TokenizerKind::Auto {
            return Err(c.key("tokenizer").err("tokenizer_file is set: leave tokenizer at \"auto\""));
        }
        if pool.canon.chat_template.is_some() && pool.canon.tokenizer_file.is_none() {
            return Err(c.key("chat_template").err("a chat template needs its model's tokenizer_file"));
        }
        for (k, r) in pool.canon.rules.iter().enumerate() {
            if r.name.is_empty() {
                return Err(c.key("rules").index(k).key("name").err("must not be empty"));
            }
        }
        let t = p.key("tools");
        if pool.tools.defer && !pool.canon.enabled {
            return Err(t
                .key("defer")
                .err("deferral rewrites the tool list: it needs [pools.canon] enabled = true"));
        }
        positive(t.key("search_limit"), pool.tools.search_limit as u64)?;
        positive(t.key("max_search_rounds"), pool.tools.max_search_rounds as u64)?;
        positive(t.key("summary_chars"), pool.tools.summary_chars as u64)?;
        let ca = p.key("cache_aware");
        if pool.cache_aware.overload_factor.is_nan() || pool.cache_aware.overload_factor < 1.0 {
            return Err(ca
                .key("overload_factor")
                .err(format!("{} must be at least 1.0", pool.cache_aware.overload_factor)));
        }
        if pool.cache_aware.balance_factor.is_nan() || pool.cache_aware.balance_factor < 1.0 {
            return Err(ca
                .key("balance_factor")
                .err(format!("{} must be at least 1.0", pool.cache_aware.balance_factor)));
        }
        if !(pool.cache_aware.miss_weight >= 1.0 && pool.cache_aware.miss_weight.is_finite()) {
            return Err(ca
                .key("miss_weight")
                .err(format!("{} must be at least 1.0 and finite", pool.cache_aware.miss_weight)));
        }
        let w = pool.cache_aware.work_window_s;
        if !(w > 0.0 && w.is_finite()) {
            return Err(ca.key("work_window_s").err(format!("{w} must be positive and finite")));
        }
        positive(ca.key("capacity_blocks"), pool.cache_aware.capacity_blocks as u64)?;
        if pool.cache_aware.ttl_s > MAX_INDEX_TTL_S {
            return Err(ca.key("ttl_s").err(format!(
                "{} is past the longest TTL the index keeps, {MAX_INDEX_TTL_S}",
                pool.cache_aware.ttl_s
            )));
        }
        positive(ca.key("spread_blocks"), pool.cache_aware.spread_blocks as u64)?;
        if pool.policy == PolicyKind::CacheAware && pool.cache_aware.mode == IndexMode::Precise {
            // Events name blocks by their token ids: requests must be cut into the same tokens,
            // or no event key ever matches a request's and the events only crowd the index.
            let tokens = match pool.canon.tokenizer {
                TokenizerKind::Wp32k => true,
                TokenizerKind::None => false,
                TokenizerKind::Auto => pool.embedded.is_some() || pool.canon.tokenizer_file.is_some(),
            };
            if !tokens {
                return Err(ca.key("mode").err(
                    "precise mode matches the backends' KV events by token ids: name the model's \
                     tokenizer ([pools.canon] tokenizer_file, or tokenizer = \"wp32k\")",
                ));
            }
            match &pool.embedded {
                Some(e) if !e.kv_events => {
                    return Err(p
                        .key("embedded")
                        .key("kv_events")
                        .err("cache_aware precise mode follows KV events: set kv_events = true"));
                }
                Some(_) => {}
                None => {
                    if let Some((k, b)) =
                        pool.backends.iter().enumerate().find(|(_, b)| b.kv_events.is_none())
                    {
                        return Err(p.key("backends").index(k).err(format!(
                            "cache_aware precise mode follows KV events: backend {:?} needs kv_events = \"tcp://…\"",
                            b.name
                        )));
                    }
                }
            }
        }
        if let Some((k, _)) = pool
            .backends
            .iter()
            .enumerate()
            .find(|(_, b)| b.kv_events_replay.is_some() && b.kv_events.is_none())
        {
            return Err(p
                .key("backends")
                .index(k)
                .key("kv_events_replay")
                .err("a replay socket without kv_events: set the publisher's endpoint too"));
        }
        if pool.policy == PolicyKind::CacheAware {
            let n = pool.embedded.as_ref().map_or(pool.backends.len(), |e| e.replicas);
            if n > MAX_BACKENDS_PER_POOL {
                return Err(p.key("policy").err(format!(
                    "cache_aware tracks at most {} backends per pool ({n} given)",
                    MAX_BACKENDS_PER_POOL
                )));
            }
        }
        let rc = p.key("response_cache");
        if pool.response_cache.enabled {
            positive(rc.key("max_mib"), pool.response_cache.max_mib)?;
            positive(rc.key("max_entry_kib"), pool.response_cache.max_entry_kib)?;
            positive(rc.key("ttl_s"), pool.response_cache.ttl_s)?;
            if pool.response_cache.max_entry_kib > pool.response_cache.max_mib.saturating_mul(1024) {
                return Err(rc.key("max_entry_kib").err(format!(
                    "{} KiB is more than the whole cache (max_mib = {})",
                    pool.response_cache.max_entry_kib, pool.response_cache.max_mib
                )));
            }
            if pool.response_cache.max_entry_kib > u64::from(u32::MAX >> 10) {
                return Err(rc.key("max_entry_kib").err("at most 4 GiB per entry"));
            }
        }
        if pool.session.overload_factor.is_nan() || pool.session.overload_factor < 1.0 {
            return Err(p
                .key("session")
                .key("overload_factor")
                .err(format!("{} must be at least 1.0", pool.session.overload_factor)));
        }
    }
    Ok(())
}

/// `[pools.safety]` of pool `own`: known detectors and actions, windows that fit, a guard
/// pool that exists.
fn safety(s: &Path, c: &super::SafetyConfig, own: &str, pools: &[super::PoolConfig]) -> Result<(), Invalid> {
    use super::Stage;
    let stages = |path: Path, st: &[Stage]| {
        if st.is_empty() {
            return Err(path.err("must name input, output or both"));
        }
        Ok(())
    };
    if let Some(rules) = &c.rules {
        let r = s.key("rules");
        for (k, d) in rules.detect.iter().enumerate() {
            if !super::DETECTORS.contains(&d.as_str()) {
                return Err(r
                    .key("detect")
                    .index(k)
                    .err(format!("unknown detector {d:?} (known: {})", super::DETECTORS.join(", "))));
            }
        }
        for name in rules.actions.keys() {
            if !super::DETECTORS.contains(&name.as_str()) && !rules.deny.contains_key(name) {
                return Err(r.key("actions").key(name).err("names neither a detector nor a deny pattern"));
            }
        }
        stages(r.key("stages"), &rules.stages)?;
        let redacts = rules.default_action == super::RuleAction::Redact
            || rules.actions.values().any(|a| *a == super::RuleAction::Redact);
        if redacts && rules.stages.contains(&Stage::Output) && c.output.release == super::Release::Stream {
            return Err(s.key("output").key("release").err(
                "the rules redact output, but \"stream\" releases text before it is checked: use \"after_check\" or \"buffered\"",
            ));
        }
    }
    let o = s.key("output");
    positive(o.key("window_tokens"), c.output.window_tokens as u64)?;
    if c.output.overlap_tokens >= c.output.window_tokens {
        return Err(o.key("overlap_tokens").err(format!(
            "{} must be below window_tokens ({})",
            c.output.overlap_tokens, c.output.window_tokens
        )));
    }
    if c.output.release == super::Release::Buffered {
        positive(o.key("lag_tokens"), c.output.lag_tokens as u64)?;
    }
    if let Some(m) = &c.moderation {
        let mp = s.key("moderation");
        positive(mp.key("timeout_ms"), m.timeout_ms)?;
        for (cat, t) in &m.thresholds {
            if !(0.0..=1.0).contains(t) {
                return Err(mp.key("thresholds").key(cat).err(format!("{t} is not a score between 0 and 1")));
            }
        }
        stages(mp.key("stages"), &m.stages)?;
    }
    if let Some(g) = &c.guard_model {
        let gp = s.key("guard_model");
        positive(gp.key("timeout_ms"), g.timeout_ms)?;
        if g.pool == own {
            return Err(gp
                .key("pool")
                .err("a pool cannot be its own guard (its checks would check themselves)"));
        }
        match pools.iter().find(|p| p.name == g.pool) {
            None => return Err(gp.key("pool").err(format!("no pool is named {:?}", g.pool))),
            Some(p) if p.safety.any() => {
                return Err(gp.key("pool").err(format!("pool {:?} has safety checks of its own", g.pool)))
            }
            Some(_) => {}
        }
        stages(gp.key("stages"), &g.stages)?;
    }
    Ok(())
}
