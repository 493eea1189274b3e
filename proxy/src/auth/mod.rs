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
//! Limits are kept in this process. Every replica counts on its own (a fleet of N replicas
//! allows up to N times a limit); keys are read from a file each replica watches.

pub mod keys;
pub mod limiter;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use warmpath_wire::openai::ApiError;

use crate::config::{AuthConfig, KeyLimits, Tenants};
use crate::observe::Metrics;
pub use keys::{Key, KeyTable};
use limiter::{Daily, KeyState};

/// Seeds the tenant salts (not a secret: the salt only has to differ between tenants).
const SALT_SEED: u64 = 0x7761_726d_7361_6c74;

/// The response headers a limited or admitted request carries.
pub type LimitHeaders = Vec<(&'static str, String)>;

/// The process's keys and their running limits.
pub struct Auth {
    enabled: bool,
    default: KeyLimits,
    table: RwLock<Arc<KeyTable>>,
    states: Mutex<HashMap<Arc<str>, Arc<Mutex<KeyState>>>>,
    /// The keys file and its modification time when last read.
    file: Option<(PathBuf, Mutex<Option<SystemTime>>)>,
    metrics: Metrics,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth").field("enabled", &self.enabled).finish_non_exhaustive()
    }
}

/// A refused request: the error and the rate-limit headers that go with it.
#[derive(Debug)]
pub struct Refusal {
    pub error: Box<ApiError>,
    pub headers: LimitHeaders,
}

impl Auth {
    /// `[auth]` of a loaded policy (its keys file path resolved): the keys file read (an
    /// error names it).
    pub fn new(cfg: &AuthConfig, metrics: &Metrics) -> Result<Auth, String> {
        let auth = Auth {
            enabled: cfg.enabled,
            default: cfg.limits.clone(),
            table: RwLock::new(Arc::new(KeyTable::default())),
            states: Mutex::new(HashMap::new()),
            file: cfg.keys_file.clone().map(|f| (f, Mutex::new(None))),
            metrics: metrics.clone(),
        };
        if auth.enabled {
            auth.reload()?;
        }
        Ok(auth)
    }

    /// Re-reads the keys file if it changed since it was last read; true when it was. A file
    /// that no longer parses leaves the keys as they were (and says why in the log).
    pub fn reload(&self) -> Result<bool, String> {
        let Some((path, seen)) = &self.file else { return Ok(false) };
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
        if modified.is_some() && *seen == modified {
            return Ok(false);
        }
        let table = KeyTable::load(path, &self.default)?;
        *seen = modified;
        self.metrics.auth_keys.set(table.len() as i64);
        // Running limits follow edited keys; a removed key's state goes with it.
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        states.retain(|name, _| table.by_name(name).is_some());
        for (name, st) in states.iter() {
            if let Some(k) = table.by_name(name) {
                st.lock().unwrap_or_else(|p| p.into_inner()).update(&k.limits);
            }
        }
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(table);
        Ok(true)
    }

    /// Whether there is a keys file for [`WatchKeys`] to watch.
    pub fn watches(&self) -> bool {
        self.enabled && self.file.is_some()
    }

    fn table(&self) -> Arc<KeyTable> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The caller's key name from its `Authorization` header: `Ok(None)` when auth is off,
    /// 401 `invalid_api_key` when the key is missing or unknown.
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
        match self.table().by_digest(&keys::digest(presented)) {
            Some(k) => Ok(Some(k.name.clone())),
            None => Err(invalid_key(&format!("Incorrect API key provided: {}.", redacted(presented)))),
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

    /// Admits a request of key `name` for `model` on pool `pool`, expected to cost `estimate`
    /// tokens (prompt, as far as known, plus `max_tokens`): a ticket, or 403 / 429.
    pub fn admit(&self, name: &str, pool: &str, model: &str, estimate: u64) -> Result<Ticket, Refusal> {
        let Some(key) = self.key(name) else {
            // Removed from the file since the request authenticated.
            return Err(Refusal {
                error: Box::new(invalid_key("This API key was revoked.")),
                headers: Vec::new(),
            });
        };
        if !key.may_use(pool, model) {
            self.metrics.key_requests.with_label_values(&[name, "forbidden"]).inc();
            let mut e = ApiError::invalid_request(format!("This API key may not use the model `{model}`."))
                .with_code("model_not_allowed");
            e.status = 403;
            e.body.error.kind = "permission_error".into();
            return Err(Refusal { error: Box::new(e), headers: Vec::new() });
        }
        let state = self.state(&key);
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let refused = |st: &mut KeyState, limit: &'static str, e: ApiError, wait: Option<Duration>| {
            self.metrics.key_requests.with_label_values(&[name, "limited"]).inc();
            self.metrics.key_limited.with_label_values(&[name, limit]).inc();
            let mut headers = limit_headers(st, now);
            match wait {
                Some(w) => {
                    headers.push(("retry-after", w.as_secs_f64().ceil().max(1.0).to_string()));
                    headers.push(("retry-after-ms", (w.as_millis().max(1)).to_string()));
                }
                // Waiting would not help: the openai SDKs do not retry on this header.
                None => headers.push(("x-should-retry", "false".to_owned())),
            }
            Err(Refusal { error: Box::new(e), headers })
        };
        if let Some(max) = st.limits.max_concurrent {
            if st.concurrent >= max {
                let e = rate_limited(
                    "requests",
                    format!("Too many requests in flight for this key: limit {max}."),
                );
                return refused(&mut st, "concurrent", e, Some(Duration::from_secs(1)));
            }
        }
        if let Some(b) = st.requests.as_mut() {
            let wait = b.wait_for(1.0, now).unwrap_or(Duration::MAX);
            if !wait.is_zero() {
                let limit = b.limit();
                let e = rate_limited(
                    "requests",
                    format!(
                        "Rate limit reached for requests: limit {limit} per minute. Please try again in {}.",
                        span(wait)
                    ),
                );
                return refused(&mut st, "requests", e, Some(wait));
            }
        }
        if let Some(b) = st.tokens.as_mut() {
            let limit = b.limit();
            match b.wait_for(estimate as f64, now) {
                Some(w) if w.is_zero() => {}
                Some(w) => {
                    let e = rate_limited(
                        "tokens",
                        format!("Rate limit reached for tokens: limit {limit} per minute, requested {estimate}. Please try again in {}.", span(w)),
                    );
                    return refused(&mut st, "tokens", e, Some(w));
                }
                None => {
                    let e = rate_limited(
                        "tokens",
                        format!("Request too large: it may use {estimate} tokens, more than this key's {limit} per minute. Lower max_tokens or the prompt."),
                    );
                    return refused(&mut st, "tokens", e, None);
                }
            }
        }
        if let Some(d) = st.daily.as_mut() {
            if !d.fits(estimate.min(d.limit)) {
                let mut e = rate_limited(
                    "tokens",
                    format!("This key's daily budget of {} tokens is spent.", d.limit),
                );
                e = e.with_code("insufficient_quota");
                return refused(&mut st, "daily", e, Some(Daily::until_tomorrow()));
            }
        }
        // Admitted: take what the request reserves.
        if let Some(b) = st.requests.as_mut() {
            b.take(1.0);
        }
        if let Some(b) = st.tokens.as_mut() {
            b.take(estimate as f64);
        }
        st.concurrent += 1;
        self.metrics.key_requests.with_label_values(&[name, "admitted"]).inc();
        let headers = limit_headers(&mut st, now);
        drop(st);
        Ok(Ticket {
            state,
            name: key.name.clone(),
            reserved: estimate,
            headers,
            metrics: self.metrics.clone(),
        })
    }

    /// A WebSocket connection of key `name` opens: a slot held while it is open, or 429.
    pub fn open_websocket(&self, name: &str) -> Result<SocketSlot, Refusal> {
        let Some(key) = self.key(name) else {
            return Err(Refusal {
                error: Box::new(invalid_key("This API key was revoked.")),
                headers: Vec::new(),
            });
        };
        let state = self.state(&key);
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(max) = st.limits.max_websockets {
            if st.websockets >= max {
                self.metrics.key_limited.with_label_values(&[name, "websockets"]).inc();
                let e = rate_limited(
                    "requests",
                    format!("Too many WebSocket connections for this key: limit {max}."),
                );
                let headers = vec![("retry-after", "1".to_owned())];
                return Err(Refusal { error: Box::new(e), headers });
            }
        }
        st.websockets += 1;
        drop(st);
        Ok(SocketSlot { state })
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
    // An object that is not empty (`model` is required): the salt goes in after its `{`.
    let open = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
    let mut out = Vec::with_capacity(body.len() + salt.len() + 16);
    out.extend_from_slice(&body[..open]);
    out.extend_from_slice(format!("\"cache_salt\":{},", quoted(salt)).as_bytes());
    out.extend_from_slice(&body[open..]);
    bytes::Bytes::from(out)
}

/// Re-reads the keys file when it changes (`warmpath keys add` takes effect without a
/// restart), every `interval`.
pub struct WatchKeys {
    pub auth: Arc<Auth>,
    pub interval: Duration,
}

#[async_trait::async_trait]
impl pingora::services::background::BackgroundService for WatchKeys {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        if !self.auth.watches() {
            return;
        }
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            match self.auth.reload() {
                Ok(true) => tracing::info!(keys = self.auth.table().len(), "keys file re-read"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "keys file not re-read; the keys stay as they were"),
            }
        }
    }
}

/// An admitted request's hold on its key's limits.
pub struct Ticket {
    state: Arc<Mutex<KeyState>>,
    name: Arc<str>,
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
    /// The request is over: `usage` (prompt, completion tokens) where the answer said, which
    /// replaces the reservation; without it the reservation stands.
    pub fn settle(self, usage: Option<(u64, u64)>) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let used = usage.map_or(self.reserved, |(p, c)| p + c);
        if let Some((p, c)) = usage {
            self.metrics.key_tokens.with_label_values(&[&self.name, "prompt"]).inc_by(p);
            self.metrics.key_tokens.with_label_values(&[&self.name, "completion"]).inc_by(c);
        }
        if let Some(b) = st.tokens.as_mut() {
            if used > self.reserved {
                b.take((used - self.reserved) as f64);
            } else {
                b.give((self.reserved - used) as f64);
            }
        }
        if let Some(d) = st.daily.as_mut() {
            d.spend(used);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.concurrent = st.concurrent.saturating_sub(1);
    }
}

/// An open WebSocket's place in its key's count.
pub struct SocketSlot {
    state: Arc<Mutex<KeyState>>,
}

impl std::fmt::Debug for SocketSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SocketSlot")
    }
}

impl Drop for SocketSlot {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.websockets = st.websockets.saturating_sub(1);
    }
}

/// OpenAI's rate-limit headers for the key's per-minute limits.
fn limit_headers(st: &mut KeyState, now: Instant) -> LimitHeaders {
    let mut h = Vec::new();
    if let Some(b) = st.requests.as_mut() {
        h.push(("x-ratelimit-limit-requests", b.limit().to_string()));
        h.push(("x-ratelimit-remaining-requests", b.remaining(now).to_string()));
        h.push(("x-ratelimit-reset-requests", span(b.reset(now))));
    }
    if let Some(b) = st.tokens.as_mut() {
        h.push(("x-ratelimit-limit-tokens", b.limit().to_string()));
        h.push(("x-ratelimit-remaining-tokens", b.remaining(now).to_string()));
        h.push(("x-ratelimit-reset-tokens", span(b.reset(now))));
    }
    h
}

/// A duration as OpenAI writes resets: `20ms`, `1.5s`, `6m0s`.
pub fn span(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = d.as_secs_f64();
    if s < 60.0 {
        let t = format!("{:.3}", s);
        let t = t.trim_end_matches('0').trim_end_matches('.');
        return format!("{t}s");
    }
    let whole = d.as_secs();
    let (h, m, sec) = (whole / 3600, whole % 3600 / 60, whole % 60);
    if h > 0 {
        format!("{h}h{m}m{sec}s")
    } else {
        format!("{m}m{sec}s")
    }
}

/// The key in `Authorization: Bearer KEY`.
fn bearer(h: &[u8]) -> Option<&[u8]> {
    let h = h.strip_prefix(b"Bearer ").or_else(|| h.strip_prefix(b"bearer "))?;
    let h = h.trim_ascii();
    (!h.is_empty()).then_some(h)
}

/// A key as an error may show it: its first characters and its last four.
fn redacted(key: &[u8]) -> String {
    let k = String::from_utf8_lossy(key);
    let chars: Vec<char> = k.chars().collect();
    if chars.len() <= 10 {
        return "***".into();
    }
    let head: String = chars[..3].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}***{tail}")
}

fn invalid_key(message: &str) -> ApiError {
    let mut e = ApiError::invalid_request(message.to_owned()).with_code("invalid_api_key");
    e.status = 401;
    e
}

fn rate_limited(kind: &str, message: String) -> ApiError {
    let mut e = ApiError::invalid_request(message).with_code("rate_limit_exceeded");
    e.status = 429;
    e.body.error.kind = kind.to_owned();
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(keys: &str, default: KeyLimits) -> Auth {
        let table = KeyTable::parse(keys, &default).expect("keys");
        let a = Auth::new(&AuthConfig::default(), &Metrics::new()).expect("auth");
        *a.table.write().expect("lock") = Arc::new(table);
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

    #[test]
    fn spans_read_as_openai_writes_them() {
        assert_eq!(span(Duration::from_millis(20)), "20ms");
        assert_eq!(span(Duration::from_millis(1500)), "1.5s");
        assert_eq!(span(Duration::from_secs(1)), "1s");
        assert_eq!(span(Duration::from_secs(360)), "6m0s");
        assert_eq!(span(Duration::from_secs(3700)), "1h1m40s");
    }

    #[test]
    fn keys_authenticate_and_limits_admit_and_refuse() {
        let keys = entry("alice", "wp-alice-key-0001", "requests_per_minute = 2\nmax_concurrent = 5")
            + &entry("bob", "wp-bob-key-00001", "models = [\"small\"]\ntokens_per_minute = 100");
        let a = auth(&keys, KeyLimits::default());
        assert_eq!(a.authenticate(Some(b"Bearer wp-alice-key-0001")).expect("ok").as_deref(), Some("alice"));
        let e = a.authenticate(Some(b"Bearer wp-alice-key-0002")).expect_err("wrong");
        assert_eq!((e.status, e.body.error.code.as_deref()), (401, Some("invalid_api_key")));
        assert!(e.body.error.message.contains("wp-***0002"), "{}", e.body.error.message);
        assert_eq!(a.authenticate(None).expect_err("none").status, 401);
        // Two a minute, then 429 with the wait.
        let t1 = a.admit("alice", "p", "m", 10).expect("first");
        assert!(t1.headers.contains(&("x-ratelimit-remaining-requests", "1".to_owned())), "{:?}", t1.headers);
        let _t2 = a.admit("alice", "p", "m", 10).expect("second");
        let r = a.admit("alice", "p", "m", 10).expect_err("third");
        assert_eq!((r.error.status, r.error.body.error.code.as_deref()), (429, Some("rate_limit_exceeded")));
        let after: f64 =
            r.headers.iter().find(|h| h.0 == "retry-after").expect("retry-after").1.parse().expect("n");
        assert!((1.0..=31.0).contains(&after), "{after}");
        // Models: bob may use only `small`; tokens: 100 a minute.
        assert_eq!(a.admit("bob", "p", "big", 1).expect_err("model").error.status, 403);
        let t = a.admit("bob", "p", "small", 80).expect("fits");
        // Settled with the real usage (30), 70 come back.
        t.settle(Some((20, 10)));
        let t = a.admit("bob", "p", "small", 60).expect("fits after the refund");
        drop(t);
        let r = a.admit("bob", "p", "small", 500).expect_err("larger than the limit");
        assert!(r.headers.iter().all(|h| h.0 != "retry-after"), "waiting does not help: {:?}", r.headers);
    }

    #[test]
    fn concurrency_and_sockets_are_held_by_their_guards() {
        let keys = entry("c", "wp-concurrent-01", "max_concurrent = 1\nmax_websockets = 1");
        let a = auth(&keys, KeyLimits::default());
        let t = a.admit("c", "p", "m", 0).expect("one");
        assert_eq!(a.admit("c", "p", "m", 0).expect_err("two").error.status, 429);
        drop(t);
        let _t = a.admit("c", "p", "m", 0).expect("one again");
        let s = a.open_websocket("c").expect("socket");
        assert!(a.open_websocket("c").is_err());
        drop(s);
        assert!(a.open_websocket("c").is_ok());
    }
}
