//! A KV tier the fleet shares, in Redis (LMCache's remote backend): every block a replica
//! computes is written there, off the step loop, under the model's namespace and the block's
//! chained hash; a replica receiving a prompt reads the blocks past its own cached prefix before
//! the request is queued and loads them as prefix hits. A prefix one replica computed is then
//! fetched, not recomputed, wherever the next request lands — also after every replica evicted it.
//!
//! A value is the block's hash and the xxh3 of its bytes, then the bytes: one that does not
//! check out is deleted and never loaded. Redis bounds the tier (its `maxmemory` and eviction
//! policy, `allkeys-lru` for a cache); keys also expire (`--kv-tier-shared-ttl-s`). A Redis that
//! is down, slow or full costs only the tier: calls fail within `--kv-tier-shared-timeout-ms`,
//! after a failure the tier is skipped for [`DOWN_FOR`], and the prompt is computed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use tokio::sync::mpsc;
use warmpath_wire::prefix::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

use super::metrics::SharedMetrics;
use super::BlockSink;

/// How long the tier is skipped after a call failed.
pub const DOWN_FOR: Duration = Duration::from_secs(1);

/// Blocks asked for in one round trip; a lookup stops at the first chunk that comes back short.
const CHUNK: usize = 16;

/// Blocks written in one round trip at most.
const WRITE_BATCH: usize = 32;

/// Hashes remembered as written lately, per generation (two are kept).
const RECENT: usize = 1 << 16;

/// Where the tier is and how it is used.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    /// `redis://HOST:PORT[/DB]` (`--kv-tier-shared`).
    pub url: String,
    /// Prefix of every key: replicas share blocks only under the same namespace (the launcher
    /// derives it from the model, block size and block bytes unless told).
    pub namespace: String,
    /// Keys expire this long after they were last written.
    pub ttl: Duration,
    /// Longest wait for Redis: dialling, and each call.
    pub timeout: Duration,
    /// Blocks waiting to be written at most; more are dropped.
    pub queue: usize,
}

/// Why a call to the tier did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Redis refused to store for want of memory (`maxmemory` with `noeviction`).
    Full,
    /// An error or no answer in time: the tier is skipped for [`DOWN_FOR`].
    Down,
}

/// The hashes written lately: the scheduler offers a block again only after they rotate out.
struct Recent {
    now: HashSet<BlockHash>,
    before: HashSet<BlockHash>,
}

impl Recent {
    fn contains(&self, h: BlockHash) -> bool {
        self.now.contains(&h) || self.before.contains(&h)
    }

    fn clear(&mut self) {
        self.now.clear();
        self.before.clear();
    }

    fn insert(&mut self, h: BlockHash) {
        if self.now.len() >= RECENT {
            self.before = std::mem::take(&mut self.now);
        }
        self.now.insert(h);
    }
}

/// The fleet's tier, as this replica uses it.
pub struct SharedTier {
    cfg: SharedConfig,
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    down_until: Mutex<Option<Instant>>,
    recent: Mutex<Recent>,
    tx: mpsc::Sender<(BlockHash, Vec<u8>)>,
    pub metrics: SharedMetrics,
}

impl SharedTier {
    /// Starts the writer on the current runtime. Nothing is dialled until the first call, so a
    /// replica starts while Redis is down.
    pub fn start(cfg: SharedConfig, metrics: SharedMetrics) -> anyhow::Result<Arc<SharedTier>> {
        let client = redis::Client::open(cfg.url.as_str())?;
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let tier = Arc::new(SharedTier {
            client,
            conn: tokio::sync::Mutex::new(None),
            down_until: Mutex::new(None),
            recent: Mutex::new(Recent { now: HashSet::new(), before: HashSet::new() }),
            tx,
            metrics,
            cfg,
        });
        tier.metrics.up.set(1.0);
        tokio::spawn(write_loop(Arc::downgrade(&tier), rx));
        Ok(tier)
    }

    fn key(&self, h: BlockHash) -> String {
        format!("{}:{h:016x}", self.cfg.namespace)
    }

    /// A connection, dialled if there is none; `None` while the tier is skipped after a failure.
    async fn conn(&self) -> Option<MultiplexedConnection> {
        let down =
            self.down_until.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|t| Instant::now() < t);
        if down {
            return None;
        }
        let mut held = self.conn.lock().await;
        if let Some(c) = &*held {
            return Some(c.clone());
        }
        // Dialled under the lock (one dial at a time), judged after it (a failure takes it).
        let dialled =
            tokio::time::timeout(self.cfg.timeout, self.client.get_multiplexed_async_connection()).await;
        if let Ok(Ok(c)) = &dialled {
            *held = Some(c.clone());
        }
        drop(held);
        self.guarded(std::future::ready(dialled)).await.ok()
    }

    /// A call failed: the connection is dropped and the tier skipped for a while.
    async fn failed(&self) {
        *self.conn.lock().await = None;
        *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + DOWN_FOR);
        self.metrics.up.set(0.0);
    }

    fn answered(&self) {
        self.metrics.up.set(1.0);
    }

    /// `c` under the timeout ([`SharedTier::guarded`]).
    async fn call<T: redis::FromRedisValue>(
        &self,
        c: &mut MultiplexedConnection,
        cmd: &redis::Cmd,
    ) -> Result<T, Failure> {
        self.guarded(tokio::time::timeout(self.cfg.timeout, cmd.query_async::<T>(c))).await
    }

    /// What a dial or call bounded by the timeout came to. A failure (an error, no answer in
    /// time) marks the tier down; Redis refusing a write for want of memory does not.
    async fn guarded<T>(
        &self,
        bounded: impl std::future::Future<Output = Result<redis::RedisResult<T>, tokio::time::error::Elapsed>>,
    ) -> Result<T, Failure> {
        let e = match bounded.await {
            Ok(Ok(v)) => {
                self.answered();
                return Ok(v);
            }
            // (A pipeline's server errors come back as one error naming them.)
            Ok(Err(e)) if e.code() == Some("OOM") || e.to_string().contains("OOM") => {
                return Err(Failure::Full)
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer in time".to_owned(),
        };
        tracing::warn!(error = %e, "shared KV tier failed: computing instead for {DOWN_FOR:?}");
        self.failed().await;
        Err(Failure::Down)
    }

    /// The bytes of the blocks under `hashes`, from the first, up to the first the tier does not
    /// hold (or holds damaged: that one is deleted). Empty when the tier is down.
    pub async fn fetch(&self, hashes: &[BlockHash]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let Some(mut c) = self.conn().await else {
            self.metrics.count("failed", hashes.len());
            return out;
        };
        for chunk in hashes.chunks(CHUNK) {
            let keys: Vec<String> = chunk.iter().map(|&h| self.key(h)).collect();
            let got: Vec<Option<Vec<u8>>> = match self.call(&mut c, redis::cmd("MGET").arg(&keys)).await {
                Ok(v) => v,
                Err(_) => {
                    self.metrics.count("failed", chunk.len());
                    break;
                }
            };
            let before = out.len();
            for (&h, v) in chunk.iter().zip(got) {
                let Some(v) = v else { break };
                match unpack(h, v) {
                    Some(data) => out.push(data),
                    None => {
                        self.metrics.count("corrupt", 1);
                        let _ = self.call::<i64>(&mut c, redis::cmd("DEL").arg(self.key(h))).await;
                        break;
                    }
                }
            }
            if out.len() - before < chunk.len() {
                break;
            }
        }
        self.metrics.count("loaded", out.len());
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        for &h in &hashes[..out.len()] {
            recent.insert(h);
        }
        out
    }

    /// Writes `batch` in one round trip.
    async fn write(&self, batch: &[(BlockHash, Vec<u8>)]) {
        let Some(mut c) = self.conn().await else {
            self.metrics.count("failed", batch.len());
            return;
        };
        let mut pipe = redis::pipe();
        let ttl = self.cfg.ttl.as_secs().max(1);
        for (h, data) in batch {
            pipe.cmd("SET").arg(self.key(*h)).arg(pack(*h, data)).arg("EX").arg(ttl).ignore();
        }
        let event = match self
            .guarded(tokio::time::timeout(self.cfg.timeout, pipe.query_async::<()>(&mut c)))
            .await
        {
            Ok(()) => "written",
            // Full (maxmemory with `noeviction`): the tier is up, it keeps what it has.
            Err(Failure::Full) => "rejected",
            Err(Failure::Down) => "failed",
        };
        self.metrics.count(event, batch.len());
    }
}

impl BlockSink for SharedTier {
    fn wants(&self, hash: BlockHash) -> bool {
        !self.recent.lock().unwrap_or_else(|e| e.into_inner()).contains(hash)
    }

    fn offer(&self, hash: BlockHash, data: Vec<u8>) {
        if data.is_empty() {
            return;
        }
        match self.tx.try_send((hash, data)) {
            Ok(()) => self.recent.lock().unwrap_or_else(|e| e.into_inner()).insert(hash),
            Err(_) => self.metrics.count("dropped", 1),
        }
    }

    fn forget(&self) {
        self.recent.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Writes what the scheduler offers, in batches, until the tier is dropped.
async fn write_loop(tier: std::sync::Weak<SharedTier>, mut rx: mpsc::Receiver<(BlockHash, Vec<u8>)>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while rx.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        let Some(t) = tier.upgrade() else { return };
        t.write(&batch).await;
        batch.clear();
    }
}

/// A block as stored: its hash, the xxh3 of its bytes, the bytes.
pub fn pack(hash: BlockHash, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + data.len());
    v.extend_from_slice(&hash.to_le_bytes());
    v.extend_from_slice(&xxh3_64(data).to_le_bytes());
    v.extend_from_slice(data);
    v
}

/// The bytes of a stored block, if it is block `hash` and undamaged.
pub fn unpack(hash: BlockHash, mut v: Vec<u8>) -> Option<Vec<u8>> {
    if v.len() <= 16 {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(v[at..at + 8].try_into().unwrap_or_default());
    let (h, sum) = (word(0), word(8));
    if h != hash || xxh3_64(&v[16..]) != sum {
        return None;
    }
    v.drain(..16);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_unpacks_only_as_itself_and_whole() {
        let v = pack(7, &[1, 2, 3]);
        assert_eq!(unpack(7, v.clone()), Some(vec![1, 2, 3]));
        assert_eq!(unpack(8, v.clone()), None, "another block's value");
        let mut bad = v.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(unpack(7, bad), None, "a flipped bit");
        assert_eq!(unpack(7, v[..16].to_vec()), None, "no bytes");
    }

    #[test]
    fn recent_hashes_rotate_out() {
        let mut r = Recent { now: HashSet::new(), before: HashSet::new() };
        for h in 0..(RECENT as u64 * 2 + 1) {
            r.insert(h);
        }
        assert!(!r.contains(0), "two generations ago");
        assert!(r.contains(RECENT as u64 * 2) && r.contains(RECENT as u64 + 1));
    }
}
