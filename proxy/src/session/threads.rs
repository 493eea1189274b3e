//! Conversations (`/v1/conversations`): a list of items that responses read as their history
//! and append their input and output to, with metadata, owned by the API key that made it.
//! Where the pool's turns go as token ids, the ids of the whole conversation are kept beside
//! its items, so the next turn tokenizes only its own items; they are kept only while they
//! match the items (an item added or removed outside a turn, or two turns racing, drops them
//! and the next turn renders the items again).
//!
//! In memory each conversation is one entry behind a mutex (bounded by bytes like responses);
//! in Redis a hash (owner, metadata, token ids) and a list of items, changed by Lua scripts
//! so that appends from several replicas never lose an item (keys share a hash tag, so a
//! cluster keeps them in one slot).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::Script;
use serde_json::{json, Value};

use super::StoreError;
use crate::shared::Shared;

/// A conversation's own fields.
#[derive(Debug, Clone, PartialEq)]
pub struct ThreadMeta {
    pub id: String,
    pub created_at: u64,
    pub metadata: Value,
}

impl ThreadMeta {
    /// The `conversation` object.
    pub fn object(&self) -> Value {
        json!({"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata})
    }
}

/// A conversation as read: its items, oldest first, and where they can be checked for
/// changes since (`len`, `gen`).
#[derive(Debug, Clone)]
pub struct Thread {
    pub meta: ThreadMeta,
    pub items: Vec<Value>,
    /// Moves on whenever an item is removed.
    pub gen: u64,
    /// The whole conversation's token ids, where kept.
    pub tokens: Option<Vec<u32>>,
}

/// What a turn read of a conversation, for its append to keep token ids only if nothing
/// changed in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadAt {
    pub len: usize,
    pub gen: u64,
}

impl Thread {
    pub fn read_at(&self) -> ReadAt {
        ReadAt { len: self.items.len(), gen: self.gen }
    }
}

/// One conversation in memory.
#[derive(Debug)]
struct Held {
    tenant: u64,
    thread: Thread,
    bytes: usize,
}

impl Held {
    fn weigh(&mut self) {
        let items: usize = self.thread.items.iter().map(|i| i.to_string().len() + 1).sum();
        self.bytes = items + self.thread.tokens.as_ref().map_or(0, |t| t.len() * 4) + 256;
    }
}

type Entry = Arc<Mutex<Held>>;

struct Scripts {
    create: Script,
    read: Script,
    append: Script,
    remove_item: Script,
    update: Script,
}

/// Where conversations are kept.
pub struct Threads {
    kind: Kind,
}

enum Kind {
    Memory(moka::sync::Cache<String, Entry>),
    Redis { client: Arc<Shared>, ttl: Duration, scripts: Box<Scripts> },
}

fn lock(e: &Entry) -> std::sync::MutexGuard<'_, Held> {
    e.lock().unwrap_or_else(|p| p.into_inner())
}

/// Token ids as Redis keeps them: 4 bytes each, little-endian.
fn pack(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn unpack(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn text(b: &[u8]) -> &str {
    std::str::from_utf8(b).unwrap_or("")
}

impl Threads {
    pub fn memory(max_bytes: u64, ttl: Duration) -> Threads {
        let cache = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &String, e: &Entry| u32::try_from(lock(e).bytes).unwrap_or(u32::MAX))
            .time_to_idle(ttl)
            .build();
        Threads { kind: Kind::Memory(cache) }
    }

    pub fn redis(client: Arc<Shared>, ttl: Duration) -> Threads {
        let scripts = Scripts {
            create: Script::new(include_str!("lua/thread_create.lua")),
            read: Script::new(include_str!("lua/thread_read.lua")),
            append: Script::new(include_str!("lua/thread_append.lua")),
            remove_item: Script::new(include_str!("lua/thread_remove_item.lua")),
            update: Script::new(include_str!("lua/thread_update.lua")),
        };
        Threads { kind: Kind::Redis { client, ttl, scripts: Box::new(scripts) } }
    }

    /// The hash and the list of conversation `id` (one hash tag: one cluster slot).
    fn keys(id: &str) -> (String, String) {
        (format!("warmpath:conversation:{{{id}}}"), format!("warmpath:conversation:{{{id}}}:items"))
    }

    /// A new conversation of `tenant` with its first items (each with an `id`).
    pub async fn create(&self, tenant: u64, meta: ThreadMeta, items: Vec<Value>) -> Result<(), StoreError> {
        match &self.kind {
            Kind::Memory(m) => {
                let id = meta.id.clone();
                let mut held =
                    Held { tenant, thread: Thread { meta, items, gen: 0, tokens: None }, bytes: 0 };
                held.weigh();
                m.insert(id, Arc::new(Mutex::new(held)));
            }
            Kind::Redis { client, ttl, scripts } => {
                let (h, l) = Self::keys(&meta.id);
                let mut call = scripts.create.prepare_invoke();
                call.key(&h).key(&l).arg(ttl.as_millis() as u64).arg(tenant.to_string());
                call.arg(meta.created_at).arg(meta.metadata.to_string());
                for i in &items {
                    call.arg(i.to_string());
                }
                client.script::<i64>(&call).await?;
            }
        }
        Ok(())
    }

    /// Conversation `id`, whole, if `tenant` made it.
    pub async fn get(&self, tenant: u64, id: &str) -> Result<Option<Thread>, StoreError> {
        match &self.kind {
            Kind::Memory(m) => Ok(m.get(id).map(|e| lock(&e).clone_if(tenant)).unwrap_or(None)),
            Kind::Redis { client, scripts, .. } => {
                let (h, l) = Self::keys(id);
                let mut call = scripts.read.prepare_invoke();
                call.key(&h).key(&l).arg(tenant.to_string());
                let parts: Vec<Vec<u8>> = client.script(&call).await?;
                if parts.len() < 6 {
                    return Ok(None);
                }
                let num = |b: &[u8]| text(b).parse::<i64>().unwrap_or(-1);
                let items: Vec<Value> =
                    parts[6..].iter().map(|b| serde_json::from_slice(b).unwrap_or(Value::Null)).collect();
                let gen = num(&parts[2]).max(0) as u64;
                // The ids count only if they were kept for these very items.
                let tokens = (!parts[3].is_empty()
                    && num(&parts[4]) == items.len() as i64
                    && num(&parts[5]) == gen as i64)
                    .then(|| unpack(&parts[3]));
                let meta = ThreadMeta {
                    id: id.to_owned(),
                    created_at: num(&parts[0]).max(0) as u64,
                    metadata: serde_json::from_slice(&parts[1]).unwrap_or(json!({})),
                };
                Ok(Some(Thread { meta, items, gen, tokens }))
            }
        }
    }

    /// Appends `items` to conversation `id` of `tenant`; with `tokens` (the ids of the whole
    /// conversation after them) kept when the conversation is still as `read` saw it. `false`
    /// when there is no such conversation.
    pub async fn append(
        &self,
        tenant: u64,
        id: &str,
        items: &[Value],
        tokens: Option<(ReadAt, Vec<u32>)>,
    ) -> Result<bool, StoreError> {
        match &self.kind {
            Kind::Memory(m) => {
                let Some(e) = m.get(id) else { return Ok(false) };
                {
                    let mut held = lock(&e);
                    if held.tenant != tenant {
                        return Ok(false);
                    }
                    let now = held.thread.read_at();
                    held.thread.items.extend_from_slice(items);
                    held.thread.tokens = tokens.filter(|(read, _)| *read == now).map(|(_, ids)| ids);
                    held.weigh();
                }
                // Inserted again, to be weighed again.
                m.insert(id.to_owned(), e);
                Ok(true)
            }
            Kind::Redis { client, ttl, scripts } => {
                let (h, l) = Self::keys(id);
                let mut call = scripts.append.prepare_invoke();
                call.key(&h).key(&l).arg(tenant.to_string()).arg(ttl.as_millis() as u64);
                match &tokens {
                    Some((read, ids)) => call.arg(read.len).arg(read.gen).arg(pack(ids)),
                    None => call.arg(-1).arg(-1).arg(""),
                };
                for i in items {
                    call.arg(i.to_string());
                }
                Ok(client.script::<i64>(&call).await? >= 0)
            }
        }
    }

    /// Removes item `item_id` from conversation `id` of `tenant`: `None` without such a
    /// conversation, else whether the item was there.
    pub async fn remove_item(
        &self,
        tenant: u64,
        id: &str,
        item_id: &str,
    ) -> Result<Option<bool>, StoreError> {
        let is = |i: &Value| i["id"].as_str() == Some(item_id);
        match &self.kind {
            Kind::Memory(m) => {
                let Some(e) = m.get(id) else { return Ok(None) };
                let mut held = lock(&e);
                if held.tenant != tenant {
                    return Ok(None);
                }
                let Some(at) = held.thread.items.iter().position(is) else { return Ok(Some(false)) };
                held.thread.items.remove(at);
                held.thread.gen += 1;
                held.thread.tokens = None;
                held.weigh();
                Ok(Some(true))
            }
            Kind::Redis { client, scripts, .. } => {
                let Some(thread) = self.get(tenant, id).await? else { return Ok(None) };
                let Some(item) = thread.items.iter().find(|i| is(i)) else { return Ok(Some(false)) };
                let (h, l) = Self::keys(id);
                let mut call = scripts.remove_item.prepare_invoke();
                call.key(&h).key(&l).arg(tenant.to_string()).arg(item.to_string());
                let n: i64 = client.script(&call).await?;
                Ok((n >= 0).then_some(n > 0))
            }
        }
    }

    /// Replaces the metadata of conversation `id` of `tenant` (`Some`), or deletes it
    /// (`None`); whether there was such a conversation.
    pub async fn update(&self, tenant: u64, id: &str, metadata: Option<Value>) -> Result<bool, StoreError> {
        match &self.kind {
            Kind::Memory(m) => {
                let Some(e) = m.get(id) else { return Ok(false) };
                if lock(&e).tenant != tenant {
                    return Ok(false);
                }
                match metadata {
                    Some(md) => lock(&e).thread.meta.metadata = md,
                    None => m.invalidate(id),
                }
                Ok(true)
            }
            Kind::Redis { client, scripts, .. } => {
                let (h, l) = Self::keys(id);
                let mut call = scripts.update.prepare_invoke();
                call.key(&h)
                    .key(&l)
                    .arg(tenant.to_string())
                    .arg(metadata.map_or(String::new(), |m| m.to_string()));
                Ok(client.script::<i64>(&call).await? == 1)
            }
        }
    }

    /// Bytes and entries held in memory (0 for Redis).
    pub fn usage(&self) -> (u64, u64) {
        match &self.kind {
            Kind::Memory(m) => (m.weighted_size(), m.entry_count()),
            Kind::Redis { .. } => (0, 0),
        }
    }
}

impl Held {
    fn clone_if(&self, tenant: u64) -> Option<Thread> {
        (self.tenant == tenant).then(|| self.thread.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str) -> ThreadMeta {
        ThreadMeta { id: id.into(), created_at: 1, metadata: json!({"k": "v"}) }
    }

    fn item(id: &str) -> Value {
        json!({"id": id, "type": "message", "role": "user", "content": id})
    }

    #[tokio::test]
    async fn items_append_and_token_ids_hold_only_while_they_match() {
        let t = Threads::memory(1 << 20, Duration::from_secs(60));
        t.create(7, meta("conv_1"), vec![item("a")]).await.expect("create");
        assert!(t.get(8, "conv_1").await.expect("get").is_none(), "another tenant");
        let read = t.get(7, "conv_1").await.expect("get").expect("found");
        assert_eq!((read.items.len(), read.tokens.as_ref()), (1, None));
        assert!(t
            .append(7, "conv_1", &[item("b")], Some((read.read_at(), vec![1, 2])))
            .await
            .expect("append"));
        let now = t.get(7, "conv_1").await.expect("get").expect("found");
        assert_eq!((now.items.len(), now.tokens.as_deref()), (2, Some(&[1u32, 2][..])));
        // A turn that read before another's append does not keep its ids.
        assert!(t.append(7, "conv_1", &[item("c")], Some((read.read_at(), vec![9]))).await.expect("append"));
        assert_eq!(t.get(7, "conv_1").await.expect("get").expect("found").tokens, None);
        // Removing an item moves the generation on.
        let before = t.get(7, "conv_1").await.expect("get").expect("found");
        assert_eq!(t.remove_item(7, "conv_1", "b").await.expect("remove"), Some(true));
        assert_eq!(t.remove_item(7, "conv_1", "b").await.expect("remove"), Some(false));
        assert_eq!(t.remove_item(8, "conv_1", "a").await.expect("remove"), None);
        let after = t.get(7, "conv_1").await.expect("get").expect("found");
        assert_ne!(before.read_at(), after.read_at());
        let ids: Vec<&str> = after.items.iter().filter_map(|i| i["id"].as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        assert!(!t.append(8, "conv_1", &[item("x")], None).await.expect("append"), "another tenant");
        assert!(t.update(7, "conv_1", Some(json!({"n": "1"}))).await.expect("update"));
        assert_eq!(t.get(7, "conv_1").await.expect("get").expect("found").meta.metadata, json!({"n": "1"}));
        assert!(!t.update(8, "conv_1", None).await.expect("delete"));
        assert!(t.update(7, "conv_1", None).await.expect("delete"));
        assert!(t.get(7, "conv_1").await.expect("get").is_none());
    }

    #[test]
    fn token_ids_pack_to_four_bytes_each() {
        let ids = vec![0, 1, 65_535, u32::MAX];
        assert_eq!(pack(&ids).len(), 16);
        assert_eq!(unpack(&pack(&ids)), ids);
    }
}
