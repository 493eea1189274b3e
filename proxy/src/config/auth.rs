//! `[auth]`: API keys and what each may use and spend. Off by default (the quick start); on,
//! every API route needs `Authorization: Bearer KEY`, and the keys live in a file of SHA-256
//! hashes or in Redis (`warmpath keys add NAME` stores one and prints the key once).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    pub enabled: bool,
    /// The keys file (relative to the policy file): `[[keys]]` tables with `name`, `sha256`
    /// and optional `models`, `pools` and limits. Re-read when it changes.
    pub keys_file: Option<PathBuf>,
    /// Where the keys live: `file` (`keys_file`) or `redis` (`[redis]`, shared by a fleet).
    pub keys_store: KeysStore,
    /// How often the keys are checked for changes (the file's time, Redis' version count).
    pub reload_interval_ms: u64,
    /// Where limits are counted: `local` (each replica on its own) or `redis` (one count for
    /// the fleet, one Redis round trip per admission).
    pub limits_store: LimitsStore,
    /// `limits_store = "redis"` and Redis does not answer: `open` admits under this replica's
    /// own counts, `closed` refuses with 503.
    pub limits_on_error: OnRedisError,
    /// The limits of a key that sets none of its own (each unset: unlimited).
    pub limits: KeyLimits,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            enabled: false,
            keys_file: None,
            keys_store: KeysStore::File,
            reload_interval_ms: 2_000,
            limits_store: LimitsStore::Local,
            limits_on_error: OnRedisError::Open,
            limits: KeyLimits::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeysStore {
    File,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LimitsStore {
    Local,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRedisError {
    Open,
    Closed,
}

/// What one key may spend; an unset limit is taken from `[auth.limits]`, and unset there, none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeyLimits {
    pub requests_per_minute: Option<u64>,
    /// Prompt tokens (estimated at admission) plus `max_tokens`, settled with the answer's
    /// real `usage`.
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<u32>,
    pub max_websockets: Option<u32>,
    /// Tokens per UTC day.
    pub tokens_per_day: Option<u64>,
}

impl KeyLimits {
    /// Each limit of `self`, or `default`'s where `self` sets none.
    pub fn or(&self, default: &KeyLimits) -> KeyLimits {
        KeyLimits {
            requests_per_minute: self.requests_per_minute.or(default.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.or(default.tokens_per_minute),
            max_concurrent: self.max_concurrent.or(default.max_concurrent),
            max_websockets: self.max_websockets.or(default.max_websockets),
            tokens_per_day: self.tokens_per_day.or(default.tokens_per_day),
        }
    }
}

/// The keys file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    #[serde(default)]
    pub keys: Vec<KeyEntry>,
}

/// One key: its name (what logs and metrics show), the SHA-256 of the key (hex), what it may
/// use, its limits.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    pub name: String,
    pub sha256: String,
    /// Only these models (any, when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// Only the models of these pools (any, when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<String>>,
    /// Keys of one group share the backends' prefix cache in pools with `tenants = "group"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Its requests' place in a full pool's queue (higher first; default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_websockets: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
}

impl KeyEntry {
    /// The key's own limits (unset ones are `[auth.limits]`'s).
    pub fn limits(&self) -> KeyLimits {
        KeyLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            max_concurrent: self.max_concurrent,
            max_websockets: self.max_websockets,
            tokens_per_day: self.tokens_per_day,
        }
    }
}
