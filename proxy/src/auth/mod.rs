//! API keys and per-key limits (`[auth]`): who may call, which models, and how much.
//!
//! The entry points call [`Auth::authenticate`] on every API route (a WebSocket on its upgrade)
//! and carry the key's *name* from there on — logs, metric labels, the tenant that scopes
//! stored conversations and cached answers; the key itself is only ever hashed. The pipeline
//! calls [`Auth::admit`] once the pool is known: the model must be one the key may use (403),
//! and the request must fit the key's limits (429 `rate_limit_exceeded` with `retry-after`,
//! as OpenAI answers, so clients' own backoff works). An admitted request holds a [`Ticket`]:
//! its concurrency slot, the tokens reserved for it, and the `x-ratelimit-*` headers its answer
//! carries; the ticket is settled with the answer's real usage. Tenants are kept apart in the
//! backends' prefix cache by a salt per key or group ([`Auth::salt`], [`salted_body`]).
//!
//! Keys come from a file each replica watches, or from Redis ([`store`]) for a fleet. Limits
//! are counted in this process ([`limiter`]: a fleet of N replicas then allows up to N times a
//! limit) or for the whole fleet in Redis ([`fleet`]: one round trip per admission); when Redis
//! does not answer, `limits_on_error` says whether this replica's own counts decide or the
//! request is refused.

pub mod answers;
pub mod fleet;
pub mod keys;
pub mod limiter;
pub mod store;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use warmpath_wire::openai::ApiError;

use crate::config::{AuthConfig, KeyLimits, KeysStore, LimitsStore, OnRedisError, Tenants};
use crate::observe::Metrics;
use crate::shared::Shared;
use answers::{invalid_key, limit_headers};
pub use answers::{LimitHeaders, Refusal};
use fleet::Fleet;
pub use fleet::FlushLimits;
pub use keys::{Key, KeyTable};
use limiter::{KeyState, Verdict};
use store::RedisKeys;

/// Seeds the tenant salts (not a secret: the salt only has to differ between tenants).
const SALT_SEED: u64 = 0x7761_726d_7361_6c74;

/// Where the keys come from.
enum Source {
    /// A keys file and its modification time when last read.
    File(PathBuf, Mutex<Option<SystemTime>>),
    Redis(Arc<Shared>, RedisKeys),
    /// Auth is off.
    None,
}

/// The process's keys and their running limits.
pub struct Auth {
    enabled: bool,
    default: KeyLimits,
    table: RwLock<Arc<KeyTable>>,
    /// Whether keys were ever loaded (from Redis, they may not be yet).
    loaded: AtomicBool,
    /// This replica's own counts (`limits_store = "local"`, and the fallback when the
    /// fleet's cannot be reached).
    states: Mutex<HashMap<Arc<str>, Arc<Mutex<KeyState>>>>,
    source: Source,
    /// The fleet's counts (`limits_store = "redis"`).
    fleet: Option<Arc<Fleet>>,
    on_error: OnRedisError,
    metrics: Metrics,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth").field("enabled", &self.enabled).finish_non_exhaustive()
    }
}

impl Auth {
    /// `[auth]` of a loaded policy (its keys file path resolved): a keys file is read now (an
    /// error names it); keys in Redis are read by [`WatchKeys`]. `redis` is the fleet's Redis,
    /// where `[redis]` names one.
    pub fn new(cfg: &AuthConfig, redis: Option<&Arc<Shared>>, metrics: &Metrics) -> Result<Auth, String> {
        let needs =
            |what: &str| redis.cloned().ok_or_else(|| format!("{what} = \"redis\" needs a [redis] server"));
        let source = match (cfg.enabled, cfg.keys_store, &cfg.keys_file) {
            (false, _, _) => Source::None,
            (true, KeysStore::Redis, _) => Source::Redis(needs("keys_store")?, RedisKeys::default()),
            (true, KeysStore::File, Some(f)) => Source::File(f.clone(), Mutex::new(None)),
            (true, KeysStore::File, None) => return Err("[auth] enabled needs keys_file".into()),
        };
        let fleet = match cfg.limits_store {
            LimitsStore::Redis if cfg.enabled => Some(Arc::new(Fleet::new(needs("limits_store")?, metrics))),
            _ => None,
        };
        let auth = Auth {
            enabled: cfg.enabled,
            default: cfg.limits.clone(),
            table: RwLock::new(Arc::new(KeyTable::default())),
            loaded: AtomicBool::new(false),
            states: Mutex::new(HashMap::new()),
            source,
            fleet,
            on_error: cfg.limits_on_error,
            metrics: metrics.clone(),
        };
        if matches!(auth.source, Source::File(..)) {
            auth.reload_file()?;
        }
        Ok(auth)
    }

    /// Reads the keys again if they changed since they were last read; true when they did.
    /// Keys that no longer parse (or a Redis that does not answer) leave them as they were.
    pub async fn reload(&self) -> Result<bool, String> {
        match &self.source {
            Source::None => Ok(false),
            Source::File(..) => self.reload_file(),
            Source::Redis(redis, keys) => match keys.changed(redis).await {
                Ok(Some(entries)) => {
                    self.install(KeyTable::from_entries(&entries, &self.default)?);
                    Ok(true)
                }
                Ok(None) => Ok(false),
                Err(e) => {
                    self.metrics.redis_errors.with_label_values(&["keys"]).inc();
                    Err(e)
                }
            },
        }
    }

    fn reload_file(&self) -> Result<bool, String> {
        let Source::File(path, seen) = &self.source else { return Ok(false) };
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
        if modified.is_some() && *seen == modified {
            return Ok(false);
        }
        self.install(KeyTable::load(path, &self.default)?);
        *seen = modified;
        Ok(true)
    }

    /// `table` replaces the keys; running limits follow edited keys, and a removed key's
    /// state goes with it.
    fn install(&self, table: KeyTable) {
        self.metrics.auth_keys.set(table.len() as i64);
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        states.retain(|name, _| table.by_name(name).is_some());
        for (name, st) in states.iter() {
            if let Some(k) = table.by_name(name) {
                st.lock().unwrap_or_else(|p| p.into_inner()).update(&k.limits);
            }
        }
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
        self.loaded.store(true, Ordering::Release);
    }

    /// Whether requests can be authenticated: auth is off, or the keys were read.
    pub fn ready(&self) -> bool {
        !self.enabled || self.loaded.load(Ordering::Acquire)
    }

    /// Whether there are keys for [`WatchKeys`] to watch.
    pub fn watches(&self) -> bool {
        !matches!(self.source, Source::None)
    }

    /// The fleet's limits, for [`FlushLimits`] to settle.
    pub fn fleet(&self) -> Option<Arc<Fleet>> {
        self.fleet.clone()
    }

    fn table(&self) -> Arc<KeyTable> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The caller's key name from its `Authorization` header: `Ok(None)` when auth is off,
    /// 401 `invalid_api_key` when the key is missing or unknown, 503 while keys kept in Redis
    /// were never read.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Option<Arc<str>>, ApiError> {
        if !self.enabled {
            return Ok(None);
        }
        let presented = authorization.and_then(bearer);
        let Some(presented) = presented else {
            return Err(invalid_key(
                "You didn't provide an API key. Send it in the Authorization header: `Authorization: Bearer KEY`.",
            ));
        };
        if !self.loaded.load(Ordering::Acquire) {
            return Err(ApiError::unavailable("API keys are not loaded yet: Redis has not answered.")
                .with_code("keys_unavailable"));
        }
        match self.table().by_digest(&keys::digest(presented)) {
            Some(k) => Ok(Some(k.name.clone())),
            None => {
                Err(invalid_key(&format!("Incorrect API key provided: {}.", answers::redacted(presented))))
            }
        }
    }

    /// The key named `name`, as last loaded.
    pub fn key(&self, name: &str) -> Option<Arc<Key>> {
        self.table().by_name(name).cloned()
    }

    /// The `cache_salt` that keeps key `name`'s requests apart in a pool whose tenants are
    /// `tenants`: a hash of the key's name (or its group's), so backends see no names; none
    /// where the pool shares.
    pub fn salt(&self, name: &str, tenants: Tenants) -> Option<String> {
        let tenant = match tenants {
            Tenants::Shared => return None,
            Tenants::Key => format!("key:{name}"),
            Tenants::Group => match self.key(name).and_then(|k| k.group.clone()) {
                Some(g) => format!("group:{g}"),
                None => format!("key:{name}"),
            },
        };
        Some(format!("wp-{:016x}", xxhash_rust::xxh3::xxh3_64_with_seed(tenant.as_bytes(), SALT_SEED)))
    }

    /// Whether key `name` may use `model` (served by pool `pool`).
    pub fn may_use(&self, name: &str, pool: &str, model: &str) -> bool {
        self.key(name).is_some_and(|k| k.may_use(pool, model))
    }

    fn state(&self, key: &Key) -> Arc<Mutex<KeyState>> {
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        states
            .entry(key.name.clone())
            .or_insert_with(|| Arc::new(Mutex::new(KeyState::new(&key.limits))))
            .clone()
    }

    /// The key named `name`, or 401 (removed since the request authenticated).
    fn current(&self, name: &str) -> Result<Arc<Key>, Refusal> {
        self.key(name).ok_or_else(|| Refusal::bare(invalid_key("This API key was revoked.")))
    }

    /// Redis did not answer for the fleet's limits: `Ok` to count here instead
    /// (`limits_on_error = "open"`), or the 503 to answer.
    fn unshared(&self, limit: &str, e: &crate::shared::SharedError) -> Result<(), Refusal> {
        match self.on_error {
            OnRedisError::Open => {
                self.metrics.limits_fail_open.with_label_values(&[limit]).inc();
                tracing::debug!(error = %e, "fleet limits unreachable; this replica's own counts decide");
                Ok(())
            }
            OnRedisError::Closed => Err(Refusal::bare(
                ApiError::unavailable("Rate limits cannot be checked right now; try again shortly.")
                    .with_code("limits_unavailable"),
            )),
        }
    }

    /// Admits a request of key `name` for `model` on pool `pool`, expected to cost `estimate`
    /// tokens (prompt, as far as known, plus `max_tokens`): a ticket, or 403 / 429 (503 when
    /// the fleet's limits are unreachable and `limits_on_error = "closed"`).
    pub async fn admit(&self, name: &str, pool: &str, model: &str, estimate: u64) -> Result<Ticket, Refusal> {
        let key = self.current(name)?;
        if !key.may_use(pool, model) {
            self.metrics.key_requests.with_label_values(&[name, "forbidden"]).inc();
            return Err(Refusal::bare(answers::forbidden_model(model)));
        }
        let shared = match &self.fleet {
            Some(f) => match f.admit(&key.name, &key.limits, estimate).await {
                Ok((verdict, lease)) => Some((verdict, Hold::Fleet { fleet: f.clone(), lease })),
                Err(e) => {
                    self.unshared("requests", &e)?;
                    None
                }
            },
            None => None,
        };
        let (verdict, hold) = shared.unwrap_or_else(|| {
            let state = self.state(&key);
            let v = state.lock().unwrap_or_else(|p| p.into_inner()).admit(estimate, Instant::now());
            (v, Hold::Local(state))
        });
        if let Some(l) = verdict.limited {
            // A refused admission holds nothing: `hold` is dropped without a release.
            self.metrics.key_requests.with_label_values(&[name, "limited"]).inc();
            self.metrics.key_limited.with_label_values(&[name, l.label()]).inc();
            return Err(answers::limited(l, &verdict, estimate));
        }
        self.metrics.key_requests.with_label_values(&[name, "admitted"]).inc();
        Ok(Ticket {
            hold: Some(hold),
            name: key.name.clone(),
            limits: key.limits.clone(),
            reserved: estimate,
            headers: limit_headers(&verdict),
            metrics: self.metrics.clone(),
        })
    }

    /// A WebSocket connection of key `name` opens: a slot held while it is open, or 429.
    pub async fn open_websocket(&self, name: &str) -> Result<SocketSlot, Refusal> {
        let key = self.current(name)?;
        let refused = |l: limiter::Limited| {
            self.metrics.key_limited.with_label_values(&[name, l.label()]).inc();
            let none = Verdict { limited: Some(l), requests: None, tokens: None };
            Err(answers::limited(l, &none, 0))
        };
        if let (Some(f), Some(max)) = (&self.fleet, key.limits.max_websockets) {
            match f.open_socket(&key.name, max).await {
                Ok(Some(lease)) => {
                    return Ok(SocketSlot(Some(Hold::Fleet { fleet: f.clone(), lease: Some(lease) })))
                }
                Ok(None) => return refused(limiter::Limited::Sockets { max }),
                Err(e) => self.unshared("websockets", &e)?,
            }
        }
        let state = self.state(&key);
        let limited = state.lock().unwrap_or_else(|p| p.into_inner()).open_socket();
        match limited {
            Some(l) => refused(l),
            None => Ok(SocketSlot(Some(Hold::Local(state)))),
        }
    }
}

/// The body a backend gets for a tenant: `cache_salt` set to `salt` — joined to the client's
/// own where it sent one (`theirs`) — every other byte as it was.
pub fn salted_body(body: bytes::Bytes, salt: &str, theirs: Option<&str>) -> bytes::Bytes {
    let quoted = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    if let Some(theirs) = theirs {
        // Rare (a client that salts its own requests under a key): rewritten whole.
        let Ok(mut v) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&body) else {
            return body;
        };
        v.insert("cache_salt".into(), serde_json::Value::String(format!("{salt}:{theirs}")));
        return bytes::Bytes::from(serde_json::Value::Object(v).to_string());
    }
    // An object that is not empty (`model` is required): the salt goes in first.
    bytes::Bytes::from(crate::request::json::insert_first(&body, "cache_salt", &quoted(salt)))
}

/// Re-reads the keys when they change (`warmpath keys add` takes effect without a restart),
/// every `interval`; keys in Redis are read at once at start. `auth` gives the keys of the
/// moment (a policy reload may replace them).
pub struct WatchKeys {
    pub auth: Arc<dyn Fn() -> Arc<Auth> + Send + Sync>,
    pub interval: Duration,
}

#[async_trait::async_trait]
impl pingora::services::background::BackgroundService for WatchKeys {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        let mut failing = false;
        loop {
            let auth = (self.auth)();
            let redis = matches!(auth.source, Source::Redis(..));
            let read = match auth.watches() {
                true => auth.reload().await,
                false => Ok(false),
            };
            match read {
                Ok(true) => {
                    failing = false;
                    let keys = auth.table().len();
                    match redis {
                        true => tracing::info!(keys, "keys read from Redis"),
                        false => tracing::info!(keys, "keys file re-read"),
                    }
                }
                Ok(false) => failing = false,
                Err(e) if !failing => {
                    failing = true;
                    match redis {
                        true => {
                            tracing::warn!(error = %e, "keys not read from Redis; the keys stay as they were")
                        }
                        false => {
                            tracing::warn!(error = %e, "keys file not re-read; the keys stay as they were")
                        }
                    }
                }
                Err(_) => {}
            }
            // Keys never read (Redis down at start) are asked for again sooner.
            let pause = match auth.ready() {
                true => self.interval,
                false => self.interval.min(Duration::from_millis(200)),
            };
            drop(auth);
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// What an admitted request or an open WebSocket holds of its key's limits.
enum Hold {
    Local(Arc<Mutex<KeyState>>),
    /// Counted in Redis; the lease of its slot where the key limits slots.
    Fleet {
        fleet: Arc<Fleet>,
        lease: Option<String>,
    },
}

/// An admitted request's hold on its key's limits.
pub struct Ticket {
    hold: Option<Hold>,
    name: Arc<str>,
    limits: KeyLimits,
    reserved: u64,
    /// `x-ratelimit-*` as of admission.
    pub headers: LimitHeaders,
    metrics: Metrics,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("key", &self.name).field("reserved", &self.reserved).finish()
    }
}

impl Ticket {
    /// Whether the key's tokens are limited (so a stream's real usage is worth asking for).
    pub fn counts_tokens(&self) -> bool {
        self.limits.tokens_per_minute.is_some() || self.limits.tokens_per_day.is_some()
    }

    /// The request is over: `usage` (prompt, completion tokens) where the answer said, which
    /// replaces the reservation; without it the reservation stands. A slot counted in Redis
    /// is freed before this returns (see [`Fleet::finish`]).
    pub async fn settle(mut self, usage: Option<(u64, u64)>) {
        if let Some((p, c)) = usage {
            self.metrics.key_tokens.with_label_values(&[&self.name, "prompt"]).inc_by(p);
            self.metrics.key_tokens.with_label_values(&[&self.name, "completion"]).inc_by(c);
        }
        let used = usage.map(|(p, c)| p + c);
        match self.hold.take() {
            Some(Hold::Local(st)) => {
                let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
                st.settle(self.reserved, used.unwrap_or(self.reserved));
                st.concurrent = st.concurrent.saturating_sub(1);
            }
            Some(Hold::Fleet { fleet, lease: Some(lease) }) => {
                fleet.finish(&self.name, &self.limits, self.reserved, used, lease).await
            }
            Some(Hold::Fleet { fleet, lease: None }) => {
                fleet.settle(&self.name, &self.limits, self.reserved, used)
            }
            None => {}
        }
    }
}

/// A ticket never settled (its request dropped midway) gives its slot back.
impl Drop for Ticket {
    fn drop(&mut self) {
        match self.hold.take() {
            Some(Hold::Local(st)) => {
                let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
                st.concurrent = st.concurrent.saturating_sub(1);
            }
            Some(Hold::Fleet { fleet, lease: Some(l) }) => fleet.release(l),
            _ => {}
        }
    }
}

/// An open WebSocket's place in its key's count.
pub struct SocketSlot(Option<Hold>);

impl std::fmt::Debug for SocketSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SocketSlot")
    }
}

impl Drop for SocketSlot {
    fn drop(&mut self) {
        match self.0.take() {
            Some(Hold::Local(st)) => {
                let mut st = st.lock().unwrap_or_else(|p| p.into_inner());
                st.websockets = st.websockets.saturating_sub(1);
            }
            Some(Hold::Fleet { fleet, lease: Some(l) }) => fleet.release(l),
            _ => {}
        }
    }
}

/// The key in `Authorization: Bearer KEY`.
fn bearer(h: &[u8]) -> Option<&[u8]> {
    let h = h.strip_prefix(b"Bearer ").or_else(|| h.strip_prefix(b"bearer "))?;
    let h = h.trim_ascii();
    (!h.is_empty()).then_some(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(keys: &str, default: KeyLimits) -> Auth {
        let table = KeyTable::parse(keys, &default).expect("keys");
        let a = Auth::new(&AuthConfig::default(), None, &Metrics::new()).expect("auth");
        a.install(table);
        Auth { enabled: true, ..a }
    }

    fn entry(name: &str, key: &str, extra: &str) -> String {
        let hex: String = keys::digest(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        format!("[[keys]]\nname = {name:?}\nsha256 = {hex:?}\n{extra}\n")
    }

    #[test]
    fn a_salt_goes_into_the_body_without_touching_the_rest() {
        let body = bytes::Bytes::from_static(br#"{"model":"m","messages":[]}"#);
        let out = salted_body(body.clone(), "wp-1", None);
        assert_eq!(&out[..], br#"{"cache_salt":"wp-1","model":"m","messages":[]}"#);
        let theirs = bytes::Bytes::from_static(br#"{"model":"m","cache_salt":"mine"}"#);
        let v: serde_json::Value =
            serde_json::from_slice(&salted_body(theirs, "wp-1", Some("mine"))).expect("json");
        assert_eq!(v["cache_salt"], "wp-1:mine");
    }

    #[tokio::test]
    async fn keys_authenticate_and_limits_admit_and_refuse() {
        let keys = entry("alice", "wp-alice-key-0001", "requests_per_minute = 2\nmax_concurrent = 5")
            + &entry("bob", "wp-bob-key-00001", "models = [\"small\"]\ntokens_per_minute = 100");
        let a = auth(&keys, KeyLimits::default());
        assert_eq!(a.authenticate(Some(b"Bearer wp-alice-key-0001")).expect("ok").as_deref(), Some("alice"));
        let e = a.authenticate(Some(b"Bearer wp-alice-key-0002")).expect_err("wrong");
        assert_eq!((e.status, e.body.error.code.as_deref()), (401, Some("invalid_api_key")));
        assert!(e.body.error.message.contains("wp-***0002"), "{}", e.body.error.message);
        assert_eq!(a.authenticate(None).expect_err("none").status, 401);
        // Two a minute, then 429 with the wait.
        let t1 = a.admit("alice", "p", "m", 10).await.expect("first");
        assert!(t1.headers.contains(&("x-ratelimit-remaining-requests", "1".to_owned())), "{:?}", t1.headers);
        let _t2 = a.admit("alice", "p", "m", 10).await.expect("second");
        let r = a.admit("alice", "p", "m", 10).await.expect_err("third");
        assert_eq!((r.error.status, r.error.body.error.code.as_deref()), (429, Some("rate_limit_exceeded")));
        let after: f64 =
            r.headers.iter().find(|h| h.0 == "retry-after").expect("retry-after").1.parse().expect("n");
        assert!((1.0..=31.0).contains(&after), "{after}");
        // Models: bob may use only `small`; tokens: 100 a minute.
        assert_eq!(a.admit("bob", "p", "big", 1).await.expect_err("model").error.status, 403);
        let t = a.admit("bob", "p", "small", 80).await.expect("fits");
        // Settled with the real usage (30), 70 come back.
        t.settle(Some((20, 10))).await;
        let t = a.admit("bob", "p", "small", 60).await.expect("fits after the refund");
        drop(t);
        let r = a.admit("bob", "p", "small", 500).await.expect_err("larger than the limit");
        assert!(r.headers.iter().all(|h| h.0 != "retry-after"), "waiting does not help: {:?}", r.headers);
    }

    #[tokio::test]
    async fn concurrency_and_sockets_are_held_by_their_guards() {
        let keys = entry("c", "wp-concurrent-01", "max_concurrent = 1\nmax_websockets = 1");
        let a = auth(&keys, KeyLimits::default());
        let t = a.admit("c", "p", "m", 0).await.expect("one");
        assert_eq!(a.admit("c", "p", "m", 0).await.expect_err("two").error.status, 429);
        drop(t);
        let _t = a.admit("c", "p", "m", 0).await.expect("one again");
        let s = a.open_websocket("c").await.expect("socket");
        assert!(a.open_websocket("c").await.is_err());
        drop(s);
        assert!(a.open_websocket("c").await.is_ok());
    }
}
