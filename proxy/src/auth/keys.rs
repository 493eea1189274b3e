//! API keys: a new key (`wp-` and 43 characters of base64url, 256 random bits), its SHA-256
//! (all that is stored), and the keys file — read into a table keyed by hash, and appended to
//! by `warmpath keys add`.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use base64::Engine;

use crate::config::{KeyEntry, KeyLimits, KeysFile};

/// A key as the proxy knows it: never the key itself.
#[derive(Debug)]
pub struct Key {
    pub name: Arc<str>,
    pub models: Option<Vec<String>>,
    pub pools: Option<Vec<String>>,
    /// Its group (`tenants = "group"` pools share the prefix cache within it).
    pub group: Option<String>,
    /// Its requests' place in a full pool's queue.
    pub priority: i64,
    pub limits: KeyLimits,
}

impl Key {
    /// Whether this key may use `model` of pool `pool`.
    pub fn may_use(&self, pool: &str, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.iter().any(|x| x == model))
            && self.pools.as_ref().is_none_or(|p| p.iter().any(|x| x == pool))
    }
}

/// The SHA-256 of a key.
pub fn digest(key: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A new random key.
pub fn new_key() -> Result<String, String> {
    let mut raw = [0u8; 32];
    getrandom::getrandom(&mut raw).map_err(|e| format!("no randomness: {e}"))?;
    Ok(format!("wp-{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)))
}

/// The keys by their hash.
#[derive(Debug, Default)]
pub struct KeyTable {
    by_hash: HashMap<[u8; 32], Arc<Key>>,
    by_name: HashMap<Arc<str>, Arc<Key>>,
}

impl KeyTable {
    /// Reads a keys file; each problem names the key it is in.
    pub fn load(path: &Path, default: &KeyLimits) -> Result<KeyTable, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        KeyTable::parse(&text, default).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str, default: &KeyLimits) -> Result<KeyTable, String> {
        let file: KeysFile = toml::from_str(text).map_err(|e| e.to_string())?;
        KeyTable::from_entries(&file.keys, default)
    }

    /// The table of `entries` (a keys file's, or those kept in Redis).
    pub fn from_entries(entries: &[KeyEntry], default: &KeyLimits) -> Result<KeyTable, String> {
        let mut t = KeyTable::default();
        for k in entries {
            let hash =
                unhex(&k.sha256).ok_or_else(|| format!("key {:?}: sha256 must be 64 hex digits", k.name))?;
            if k.name.is_empty() || t.by_name.contains_key(k.name.as_str()) {
                return Err(format!("key {:?}: names must be unique and not empty", k.name));
            }
            let key = Arc::new(Key {
                name: Arc::from(k.name.as_str()),
                models: k.models.clone(),
                pools: k.pools.clone(),
                group: k.group.clone(),
                priority: k.priority.unwrap_or(0),
                limits: k.limits().or(default),
            });
            if t.by_hash.insert(hash, key.clone()).is_some() {
                return Err(format!("key {:?}: the same key is listed twice", k.name));
            }
            t.by_name.insert(key.name.clone(), key);
        }
        Ok(t)
    }

    /// The key whose hash is `digest`. The table is looked up by the hash of what the client
    /// sent, so the time a lookup takes tells nothing about any stored key.
    pub fn by_digest(&self, digest: &[u8; 32]) -> Option<&Arc<Key>> {
        self.by_hash.get(digest)
    }

    pub fn by_name(&self, name: &str) -> Option<&Arc<Key>> {
        self.by_name.get(name)
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// A new key named `name` and the entry that stores it (its hash, not the key).
pub fn new_entry(name: &str, models: Option<Vec<String>>) -> Result<(String, KeyEntry), String> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(format!("{name:?}: a key's name is letters, digits, '-', '_' and '.'"));
    }
    let key = new_key()?;
    let entry = KeyEntry {
        name: name.to_owned(),
        sha256: hex(&digest(key.as_bytes())),
        models,
        pools: None,
        group: None,
        priority: None,
        requests_per_minute: None,
        tokens_per_minute: None,
        max_concurrent: None,
        max_websockets: None,
        tokens_per_day: None,
    };
    Ok((key, entry))
}

/// Appends a new key named `name` to the keys file at `path` (created if missing) and returns
/// the key, which is stored nowhere.
pub fn add(path: &Path, name: &str, models: Option<Vec<String>>) -> Result<String, String> {
    let (key, new) = new_entry(name, models)?;
    let existing = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let file: KeysFile = toml::from_str(&existing).map_err(|e| format!("{}: {e}", path.display()))?;
    if file.keys.iter().any(|k: &KeyEntry| k.name == name) {
        return Err(format!("{}: a key named {name:?} exists already", path.display()));
    }
    let mut entry = format!("\n[[keys]]\nname = {name:?}\nsha256 = \"{}\"\n", new.sha256);
    if let Some(models) = new.models {
        let list: Vec<String> = models.iter().map(|m| format!("{m:?}")).collect();
        entry.push_str(&format!("models = [{}]\n", list.join(", ")));
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    f.write_all(entry.as_bytes()).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stored_as_hashes_and_found_by_them() {
        let key = new_key().expect("random");
        assert!(key.starts_with("wp-") && key.len() == 46, "{key}");
        assert_ne!(key, new_key().expect("random"));
        let text = format!(
            "[[keys]]\nname = \"alice\"\nsha256 = \"{}\"\nmodels = [\"m\"]\nrequests_per_minute = 5\n",
            hex(&digest(key.as_bytes()))
        );
        let default =
            KeyLimits { tokens_per_minute: Some(1000), requests_per_minute: Some(1), ..Default::default() };
        let t = KeyTable::parse(&text, &default).expect("parses");
        let k = t.by_digest(&digest(key.as_bytes())).expect("found");
        assert_eq!(&*k.name, "alice");
        assert_eq!((k.limits.requests_per_minute, k.limits.tokens_per_minute), (Some(5), Some(1000)));
        assert!(k.may_use("p", "m") && !k.may_use("p", "other"));
        assert!(t.by_digest(&digest(b"wp-wrong")).is_none());
        assert!(KeyTable::parse("[[keys]]\nname = \"a\"\nsha256 = \"xyz\"\n", &default).is_err());
        assert!(KeyTable::parse("[[keys]]\nname = \"a\"\nsha256 = \"00\"\nextra = 1\n", &default).is_err());
    }

    #[test]
    fn adding_a_key_appends_its_hash_only() {
        let dir = std::env::temp_dir().join(format!("warmpath-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("keys.toml");
        let _ = std::fs::remove_file(&path);
        let a = add(&path, "alice", None).expect("added");
        let b = add(&path, "bob", Some(vec!["m".into()])).expect("added");
        assert!(add(&path, "alice", None).is_err(), "names are unique");
        assert!(add(&path, "bad name", None).is_err());
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(!text.contains(&a) && !text.contains(&b), "{text}");
        let t = KeyTable::load(&path, &KeyLimits::default()).expect("loads");
        assert_eq!(t.len(), 2);
        assert_eq!(&*t.by_digest(&digest(b.as_bytes())).expect("bob").name, "bob");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
