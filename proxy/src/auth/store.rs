//! API keys kept in Redis (`[auth] keys_store = "redis"`), so every replica of a fleet knows
//! the same keys: a hash of entries by the key's SHA-256 (the same fields as a keys file's
//! `[[keys]]`, as JSON) and a version count that every change bumps. Replicas poll the
//! version every `reload_interval_ms` and read the entries only when it moved; lookups stay in
//! memory, so authenticating costs no round trip. `warmpath keys add|remove|list` edit them.

use std::sync::Mutex;

use redis::Script;

use crate::config::KeyEntry;
use crate::shared::{Shared, SharedError};

/// The entries and their version, in one hash slot.
const ENTRIES: &str = "warmpath:{keys}";
const VERSION: &str = "warmpath:{keys}:version";

/// The keys as a replica reads them.
pub struct RedisKeys {
    /// The version last read.
    seen: Mutex<Option<String>>,
    load: Script,
}

impl Default for RedisKeys {
    fn default() -> Self {
        RedisKeys { seen: Mutex::new(None), load: Script::new(include_str!("lua/keys_load.lua")) }
    }
}

impl RedisKeys {
    /// The entries if they changed since the last call (all of them on the first), or `None`.
    /// An entry that does not parse is an error naming it; nothing is taken from that read.
    pub async fn changed(&self, redis: &Shared) -> Result<Option<Vec<KeyEntry>>, String> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut call = self.load.prepare_invoke();
        call.key(ENTRIES).key(VERSION).arg(seen.as_deref().unwrap_or(""));
        let mut got: Vec<String> = redis.script(&call).await.map_err(|e| e.to_string())?;
        if got.is_empty() {
            return Err("keys_load.lua returned nothing".into());
        }
        let version = got.remove(0);
        if got.is_empty() && seen.as_deref() == Some(version.as_str()) {
            return Ok(None);
        }
        let entries = parse(&got)?;
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(version);
        Ok(Some(entries))
    }
}

fn parse(raw: &[String]) -> Result<Vec<KeyEntry>, String> {
    raw.iter()
        .map(|e| {
            serde_json::from_str::<KeyEntry>(e)
                .map_err(|err| format!("a key in Redis ({ENTRIES}): {err}: {e}"))
        })
        .collect()
}

/// Stores `entry`; an error when its name is taken or its key stored already.
pub async fn add(redis: &Shared, entry: &KeyEntry) -> Result<(), String> {
    let json = serde_json::to_string(entry).map_err(|e| e.to_string())?;
    let script = Script::new(include_str!("lua/keys_add.lua"));
    let mut call = script.prepare_invoke();
    call.key(ENTRIES).key(VERSION).arg(&entry.sha256).arg(json).arg(&entry.name);
    match redis.script::<i64>(&call).await.map_err(|e: SharedError| e.to_string())? {
        1 => Ok(()),
        0 => Err(format!("a key named {:?} exists already", entry.name)),
        _ => Err("that key is stored already".into()),
    }
}

/// Removes the key named `name`; false when there is none.
pub async fn remove(redis: &Shared, name: &str) -> Result<bool, String> {
    let script = Script::new(include_str!("lua/keys_remove.lua"));
    let mut call = script.prepare_invoke();
    call.key(ENTRIES).key(VERSION).arg(name);
    let n: i64 = redis.script(&call).await.map_err(|e| e.to_string())?;
    Ok(n == 1)
}

/// Every stored entry.
pub async fn list(redis: &Shared) -> Result<Vec<KeyEntry>, String> {
    let raw: Vec<String> = redis.query(redis::cmd("HVALS").arg(ENTRIES)).await.map_err(|e| e.to_string())?;
    parse(&raw)
}
