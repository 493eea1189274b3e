//! Limits counted for the whole fleet in Redis (`[auth] limits_store = "redis"`): every
//! warmpath replica admits against the same buckets, so a key's limit holds however many
//! replicas serve it.
//!
//! An admission is one Lua script (`lua/admit.lua`): one round trip, atomic, with Redis' own
//! clock. What happens after it — the tokens a finished request really used, its slot freed,
//! a WebSocket closed — is queued and sent by [`FlushLimits`] in one script call per key
//! (`lua/settle.lua`), off the request path: every `FLUSH`, and at once when a slot is freed
//! (a client that waits for its answer before it sends the next request must find its slot
//! free). Slots (requests in flight, WebSockets open) are leases that expire unless renewed by
//! those calls, so a replica that dies frees its slots within `LEASE`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Script;

use super::limiter::{Limited, Meter, Verdict};
use crate::config::KeyLimits;
use crate::observe::Metrics;
use crate::shared::{Shared, SharedError};

/// How long a slot is held without a renewal.
const LEASE: Duration = Duration::from_secs(60);
/// How often queued settlements go out.
pub const FLUSH: Duration = Duration::from_millis(100);
/// How long the flusher sleeps when nothing is owed or held (an idle warmpath stays quiet).
const IDLE: Duration = Duration::from_secs(5);

/// One key's counters in Redis, all in one hash slot (a Cluster runs the scripts on one node).
fn counters(name: &str) -> [String; 5] {
    ["requests", "tokens", "daily", "inflight", "sockets"].map(|c| format!("warmpath:{{key:{name}}}:{c}"))
}

/// What one key owes Redis since the last flush.
#[derive(Debug, Default)]
struct Owed {
    tokens_per_minute: u64,
    /// Tokens used beyond what was reserved (negative: fewer).
    over: i64,
    spent: u64,
    done: Vec<String>,
    closed: Vec<String>,
}

/// A slot held: its key and when it was last renewed.
struct Held {
    name: Arc<str>,
    socket: bool,
    renewed: Instant,
}

pub struct Fleet {
    redis: Arc<Shared>,
    /// Lease ids: this process's random prefix and a count.
    prefix: String,
    next: AtomicU64,
    owed: Mutex<HashMap<Arc<str>, Owed>>,
    held: Mutex<HashMap<String, Held>>,
    admit: Script,
    settle: Script,
    socket: Script,
    /// Wakes the flusher when a slot is freed, or when something is owed while it idles.
    wake: tokio::sync::Notify,
    /// The flusher is in its long sleep.
    idling: std::sync::atomic::AtomicBool,
    metrics: Metrics,
}

impl Fleet {
    pub fn new(redis: Arc<Shared>, metrics: &Metrics) -> Fleet {
        let mut raw = [0u8; 8];
        let _ = getrandom::getrandom(&mut raw);
        Fleet {
            redis,
            prefix: format!("{:016x}", u64::from_le_bytes(raw)),
            next: AtomicU64::new(0),
            owed: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            admit: Script::new(include_str!("lua/admit.lua")),
            settle: Script::new(include_str!("lua/settle.lua")),
            socket: Script::new(include_str!("lua/socket.lua")),
            wake: tokio::sync::Notify::new(),
            idling: std::sync::atomic::AtomicBool::new(false),
            metrics: metrics.clone(),
        }
    }

    fn lease(&self, name: &Arc<str>, socket: bool) -> String {
        let id = format!("{}-{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed));
        let held = Held { name: name.clone(), socket, renewed: Instant::now() };
        self.held.lock().unwrap_or_else(|p| p.into_inner()).insert(id.clone(), held);
        id
    }

    fn failed(&self, e: SharedError) -> SharedError {
        self.metrics.redis_errors.with_label_values(&["limits"]).inc();
        e
    }

    /// Admits a request of key `name` expected to cost `estimate` tokens: the verdict, and
    /// the lease of its slot where the key limits requests in flight.
    pub async fn admit(
        &self,
        name: &Arc<str>,
        limits: &KeyLimits,
        estimate: u64,
    ) -> Result<(Verdict, Option<String>), SharedError> {
        let keys = counters(name);
        let inflight = limits.max_concurrent.unwrap_or(0);
        let lease = (inflight > 0).then(|| self.lease(name, false));
        let mut call = self.admit.prepare_invoke();
        for k in &keys[..4] {
            call.key(k);
        }
        call.arg(limits.requests_per_minute.unwrap_or(0))
            .arg(limits.tokens_per_minute.unwrap_or(0))
            .arg(estimate)
            .arg(limits.tokens_per_day.unwrap_or(0))
            .arg(inflight)
            .arg(lease.as_deref().unwrap_or(""))
            .arg(LEASE.as_millis() as u64);
        let r: Vec<i64> = match self.redis.script(&call).await {
            Ok(r) => r,
            Err(e) => {
                self.forget(lease.as_deref());
                return Err(self.failed(e));
            }
        };
        let [status, wait, req_left, req_reset, tok_left, tok_reset] = r[..] else {
            self.forget(lease.as_deref());
            return Err(SharedError::Redis(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "admit.lua returned the wrong shape",
            ))));
        };
        let ms = |v: i64| Duration::from_millis(v.max(0) as u64);
        let meter = |limit: Option<u64>, left: i64, reset: i64| {
            limit.map(|limit| Meter { limit, remaining: left.max(0) as u64, reset: ms(reset) })
        };
        let wait = ms(wait);
        let limited = match status {
            0 => None,
            1 => Some(Limited::Concurrent { max: inflight }),
            2 => Some(Limited::Requests { limit: limits.requests_per_minute.unwrap_or(0), wait }),
            3 => Some(Limited::Tokens { limit: limits.tokens_per_minute.unwrap_or(0), wait }),
            4 => Some(Limited::TooLarge { limit: limits.tokens_per_minute.unwrap_or(0) }),
            _ => Some(Limited::Daily { limit: limits.tokens_per_day.unwrap_or(0), wait }),
        };
        let lease = match limited {
            Some(_) => {
                self.forget(lease.as_deref());
                None
            }
            None => lease,
        };
        let verdict = Verdict {
            limited,
            requests: meter(limits.requests_per_minute, req_left, req_reset),
            tokens: meter(limits.tokens_per_minute, tok_left, tok_reset),
        };
        Ok((verdict, lease))
    }

    /// A WebSocket of key `name` opens (at most `max` open): its lease, or `None` when the
    /// limit refuses it.
    pub async fn open_socket(&self, name: &Arc<str>, max: u32) -> Result<Option<String>, SharedError> {
        let lease = self.lease(name, true);
        let mut call = self.socket.prepare_invoke();
        call.key(&counters(name)[4]).arg(max).arg(&lease).arg(LEASE.as_millis() as u64);
        match self.redis.script::<i64>(&call).await {
            Ok(1) => Ok(Some(lease)),
            Ok(_) => {
                self.forget(Some(&lease));
                Ok(None)
            }
            Err(e) => {
                self.forget(Some(&lease));
                Err(self.failed(e))
            }
        }
    }

    fn forget(&self, lease: Option<&str>) {
        if let Some(l) = lease {
            self.held.lock().unwrap_or_else(|p| p.into_inner()).remove(l);
        }
    }

    /// A request of key `name` finished: it used `used` tokens where `reserved` were taken;
    /// its lease (if any) is freed. Sent with the next flush.
    pub fn settle(&self, name: &Arc<str>, limits: &KeyLimits, reserved: u64, used: Option<u64>) {
        let mut owed = self.owed.lock().unwrap_or_else(|p| p.into_inner());
        let o = owed.entry(name.clone()).or_default();
        o.tokens_per_minute = limits.tokens_per_minute.unwrap_or(0);
        if let Some(used) = used {
            o.over += used as i64 - reserved as i64;
            o.spent += used;
        } else {
            o.spent += reserved;
        }
        drop(owed);
        if self.idling.load(Ordering::Acquire) {
            self.wake.notify_one();
        }
    }

    /// Nothing owed and no slot held: the flusher may sleep long.
    fn idle(&self) -> bool {
        self.owed.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
            && self.held.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }

    /// A slot (a request's or a WebSocket's) is given back.
    pub fn release(&self, lease: String) {
        let Some(held) = self.held.lock().unwrap_or_else(|p| p.into_inner()).remove(&lease) else { return };
        let mut owed = self.owed.lock().unwrap_or_else(|p| p.into_inner());
        let o = owed.entry(held.name).or_default();
        if held.socket {
            o.closed.push(lease);
        } else {
            o.done.push(lease);
        }
        drop(owed);
        self.wake.notify_one();
    }

    /// One key's settlement and renewals: one script call. What fails to go out is kept for
    /// the next flush (renewals are retried as they fall due again).
    async fn send(
        &self,
        name: &Arc<str>,
        o: Owed,
        renewed: (Vec<String>, Vec<String>),
    ) -> Result<(), SharedError> {
        let keys = counters(name);
        let mut call = self.settle.prepare_invoke();
        call.key(&keys[1]).key(&keys[2]).key(&keys[3]).key(&keys[4]);
        call.arg(o.tokens_per_minute).arg(o.over).arg(o.spent).arg(LEASE.as_millis() as u64);
        for list in [&o.done, &renewed.0, &o.closed, &renewed.1] {
            call.arg(list.len());
            for id in list {
                call.arg(id);
            }
        }
        let Err(e) = self.redis.script::<i64>(&call).await else { return Ok(()) };
        let mut back = self.owed.lock().unwrap_or_else(|p| p.into_inner());
        let b = back.entry(name.clone()).or_default();
        b.tokens_per_minute = o.tokens_per_minute;
        b.over += o.over;
        b.spent += o.spent;
        b.done.extend(o.done);
        b.closed.extend(o.closed);
        Err(self.failed(e))
    }

    /// A request that held a slot finished: its usage settled and its slot freed now, in one
    /// round trip before the request's handler returns — the next request on the client's
    /// connection is read only after it, so a client that sends one request at a time always
    /// finds its slot free.
    pub async fn finish(
        &self,
        name: &Arc<str>,
        limits: &KeyLimits,
        reserved: u64,
        used: Option<u64>,
        lease: String,
    ) {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).remove(&lease);
        let mut o = Owed { tokens_per_minute: limits.tokens_per_minute.unwrap_or(0), ..Owed::default() };
        o.over = used.map_or(0, |u| u as i64 - reserved as i64);
        o.spent = used.unwrap_or(reserved);
        o.done.push(lease);
        let _ = self.send(name, o, (Vec::new(), Vec::new())).await;
    }

    /// Sends what is owed, and renews the slots still held that are due: one script call per
    /// key. What fails to go out is kept for the next flush.
    pub async fn flush(&self) -> Result<(), SharedError> {
        let owed = std::mem::take(&mut *self.owed.lock().unwrap_or_else(|p| p.into_inner()));
        let mut renew: HashMap<Arc<str>, (Vec<String>, Vec<String>)> = HashMap::new();
        {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            for (id, h) in held.iter_mut().filter(|(_, h)| h.renewed.elapsed() > LEASE / 3) {
                h.renewed = Instant::now();
                let r = renew.entry(h.name.clone()).or_default();
                if h.socket {
                    r.1.push(id.clone());
                } else {
                    r.0.push(id.clone());
                }
            }
        }
        let mut names: Vec<Arc<str>> = owed.keys().cloned().collect();
        names.extend(renew.keys().filter(|n| !owed.contains_key(*n)).cloned());
        let mut failed = None;
        let mut owed = owed;
        for name in names {
            let o = owed.remove(&name).unwrap_or_default();
            let renewed = renew.remove(&name).unwrap_or_default();
            if let Err(e) = self.send(&name, o, renewed).await {
                failed = Some(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Sends the fleet's queued settlements every [`FLUSH`] and when a slot is freed, and once
/// more at shutdown. `fleet` gives the counts of the moment (a policy reload may replace them,
/// or turn them on or off).
pub struct FlushLimits(pub Arc<dyn Fn() -> Option<Arc<Fleet>> + Send + Sync>);

#[async_trait::async_trait]
impl pingora::services::background::BackgroundService for FlushLimits {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        let mut warned = false;
        loop {
            let fleet = (self.0)();
            // Every FLUSH while there is work; a long sleep otherwise (woken by new work).
            // (Marked idling before looking, so work queued meanwhile wakes it.)
            if let Some(f) = &fleet {
                f.idling.store(true, Ordering::Release);
            }
            let idle = fleet.as_ref().is_none_or(|f| f.idle());
            if let Some(f) = fleet.as_ref().filter(|_| !idle) {
                f.idling.store(false, Ordering::Release);
            }
            let woken = async {
                match &fleet {
                    Some(f) => f.wake.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(if idle { IDLE } else { FLUSH }) => {}
                _ = woken => {}
                _ = shutdown.changed() => {
                    if let Some(f) = fleet {
                        let _ = f.flush().await;
                    }
                    return;
                }
            }
            let Some(f) = fleet else { continue };
            match f.flush().await {
                Ok(()) => warned = false,
                Err(e) if !warned => {
                    warned = true;
                    tracing::warn!(error = %e, "per-key limits not settled in Redis; retrying");
                }
                Err(_) => {}
            }
        }
    }
}
