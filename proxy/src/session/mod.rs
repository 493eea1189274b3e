//! The conversation store: stored responses (`previous_response_id`, `GET /v1/responses/{id}`;
//! `responses.rs`) and conversations (`/v1/conversations`; `threads.rs`), in memory
//! (`[session] store = "memory"`, the default: moka, bounded by bytes) or in the fleet's Redis
//! (`store = "redis"`: one server, a cluster or Sentinel), so a client may continue on any
//! warmpath replica sharing the server.
//!
//! Runs (`background.rs`): background responses and the events of stored responses, for
//! `GET` while they run, resuming a stream, and `cancel`; in this process only.
//!
//! Everything belongs to the API key that made it (the `Authorization` header, hashed): a
//! lookup with another key finds nothing, exactly as an unknown id.

mod background;
mod responses;
mod threads;

use std::sync::Arc;
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use background::{Background, Logged, Run, TooMany};
pub use responses::{Conversation, Responses};
pub use threads::{ReadAt, Thread, ThreadMeta, Threads};

use crate::config::{ConversationConfig, StoreKind};
use crate::shared::{Shared, SharedError};

/// Seed of the caller hash (any fixed value: it only partitions ids).
const TENANT_SEED: u64 = 0x7761_726d_7061_7468;

/// The caller a response belongs to: a hash of its `Authorization` header (0 without one).
pub fn tenant(authorization: Option<&[u8]>) -> u64 {
    authorization.map_or(0, |a| xxh3_64_with_seed(a, TENANT_SEED))
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Redis(#[from] SharedError),
}

/// Stored responses and conversations, kept the same way, and this process's runs (background
/// responses, kept events).
pub struct Store {
    pub responses: Responses,
    pub threads: Threads,
    pub runs: Background,
}

impl Store {
    /// `redis` is the fleet's Redis (`[redis]`), where one is configured.
    pub fn new(cfg: &ConversationConfig, redis: Option<&Arc<Shared>>) -> Result<Store, String> {
        let ttl = Duration::from_secs(cfg.ttl_s);
        let threads_ttl = Duration::from_secs(cfg.conversation_ttl_s);
        let runs = Background::new(cfg.max_mib << 20, ttl, cfg.max_background_per_key);
        match cfg.store {
            StoreKind::Memory => Ok(Store {
                responses: Responses::memory(cfg.max_mib << 20, ttl),
                threads: Threads::memory(cfg.max_mib << 20, threads_ttl),
                runs,
            }),
            StoreKind::Redis => {
                let client = redis.ok_or("store = \"redis\" needs a [redis] server")?.clone();
                Ok(Store {
                    responses: Responses::Redis { client: client.clone(), ttl },
                    threads: Threads::redis(client, threads_ttl),
                    runs,
                })
            }
        }
    }

    /// Kept in this process (not Redis).
    pub fn in_memory(&self) -> bool {
        matches!(self.responses, Responses::Memory(_))
    }

    /// Bytes and entries held in memory (0 for Redis, whose server holds them).
    pub fn usage(&self) -> (u64, u64) {
        let (a, b) = (self.responses.usage(), self.threads.usage());
        (a.0 + b.0, a.1 + b.1)
    }
}
