//! Stored responses: what `previous_response_id` continues. Each stored response holds the
//! conversation up to and including its output (Responses items; instructions are per turn and
//! not kept), the model, the caller it belongs to, the conversation's routing key and the
//! response object as the client got it.
//!
//! In memory a response keeps its own items and points at its predecessor, so a chain of turns
//! shares its prefix; the cache is bounded by bytes, each entry weighing its whole conversation
//! (the bound holds however chains share), and entries live `ttl_s`. In Redis each response is
//! one key with the whole conversation, so a client may continue on any warmpath replica
//! sharing the server.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::StoreError;
use crate::shared::Shared;

/// One stored response: its turn's items, after its predecessor's.
#[derive(Debug)]
pub struct Conversation {
    pub id: String,
    pub tenant: u64,
    pub model: String,
    /// The first response of the conversation: its routing session key.
    pub root: String,
    pub parent: Option<Arc<Conversation>>,
    /// This turn's input items, then its output items.
    pub items: Vec<Value>,
    /// How many of `items` are the turn's output (the last ones).
    pub outputs: usize,
    /// The response object as the client got it (JSON text), for `GET /v1/responses/{id}`.
    pub response: Option<String>,
    /// Bytes of the whole conversation (serialized items).
    pub bytes: usize,
    /// Items of the whole conversation.
    pub len: usize,
    /// Where the pool's prompts are token ids: the whole conversation's, as rendered (no system
    /// turn, no generation prompt). The next turn appends only its new messages' ids.
    pub tokens: Option<Arc<Vec<u32>>>,
}

impl Conversation {
    /// The next turn of `parent` (or a new conversation).
    pub fn new(
        id: String,
        tenant: u64,
        model: String,
        parent: Option<Arc<Conversation>>,
        items: Vec<Value>,
    ) -> Conversation {
        let own: usize = items.iter().map(|i| i.to_string().len() + 1).sum();
        let root = parent.as_ref().map_or_else(|| id.clone(), |p| p.root.clone());
        let (bytes, len) = parent.as_ref().map_or((0, 0), |p| (p.bytes, p.len));
        Conversation {
            id,
            tenant,
            model,
            root,
            parent,
            bytes: bytes + own,
            len: len + items.len(),
            items,
            outputs: 0,
            response: None,
            tokens: None,
        }
    }

    /// The last `outputs` items are the turn's output, and `response` the object the client
    /// got (counted in its bytes).
    pub fn with_response(mut self, outputs: usize, response: String) -> Conversation {
        self.outputs = outputs.min(self.items.len());
        self.bytes += response.len();
        self.response = Some(response);
        self
    }

    /// The response's input: the whole conversation before its own output, oldest first.
    pub fn input_items(&self) -> Vec<&Value> {
        let mut all = self.all_items();
        all.truncate(all.len() - self.outputs);
        all
    }

    /// The conversation's token ids (counted in its bytes).
    pub fn with_tokens(mut self, tokens: Vec<u32>) -> Conversation {
        self.bytes += tokens.len() * 4;
        self.tokens = Some(Arc::new(tokens));
        self
    }

    /// Every item of the conversation, oldest first.
    pub fn all_items(&self) -> Vec<&Value> {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(c) = at {
            chain.push(c);
            at = c.parent.as_deref();
        }
        chain.iter().rev().flat_map(|c| c.items.iter()).collect()
    }

    /// The whole conversation as one JSON document (the Redis form).
    fn to_json(&self) -> Vec<u8> {
        let doc = StoredRef {
            tenant: self.tenant.to_string(),
            model: &self.model,
            root: &self.root,
            items: self.all_items(),
            tokens: self.tokens.as_deref().map(Vec::as_slice),
            outputs: self.outputs,
            response: self.response.as_deref(),
        };
        serde_json::to_vec(&doc).unwrap_or_default()
    }

    fn from_json(id: &str, b: &[u8]) -> Option<Conversation> {
        let doc: Stored = serde_json::from_slice(b).ok()?;
        let mut c = Conversation::new(id.to_owned(), doc.tenant.parse().ok()?, doc.model, None, doc.items);
        c.root = doc.root;
        if let Some(ids) = doc.tokens {
            c = c.with_tokens(ids);
        }
        if let Some(r) = doc.response {
            c = c.with_response(doc.outputs, r);
        }
        Some(c)
    }
}

/// A conversation as Redis keeps it (the tenant as a string: JSON numbers lose 64-bit ids).
#[derive(serde::Serialize)]
struct StoredRef<'a> {
    tenant: String,
    model: &'a str,
    root: &'a str,
    items: Vec<&'a Value>,
    tokens: Option<&'a [u32]>,
    outputs: usize,
    response: Option<&'a str>,
}

#[derive(serde::Deserialize)]
struct Stored {
    tenant: String,
    model: String,
    root: String,
    items: Vec<Value>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    outputs: usize,
    #[serde(default)]
    response: Option<String>,
}

/// Where stored responses are kept.
pub enum Responses {
    Memory(moka::sync::Cache<String, Arc<Conversation>>),
    Redis { client: Arc<Shared>, ttl: Duration },
}

impl Responses {
    /// In memory: at most `max_bytes`, each entry for `ttl`.
    pub fn memory(max_bytes: u64, ttl: Duration) -> Responses {
        Responses::Memory(
            moka::sync::Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|_: &String, c: &Arc<Conversation>| u32::try_from(c.bytes + 256).unwrap_or(u32::MAX))
                .time_to_live(ttl)
                .build(),
        )
    }

    fn key(id: &str) -> String {
        format!("warmpath:response:{id}")
    }

    /// The stored response `id` if `tenant` made it.
    pub async fn get(&self, tenant: u64, id: &str) -> Result<Option<Arc<Conversation>>, StoreError> {
        let found = match self {
            Responses::Memory(c) => c.get(id),
            Responses::Redis { client, .. } => {
                let bytes: Option<Vec<u8>> = client.query(redis::cmd("GET").arg(Self::key(id))).await?;
                bytes.and_then(|b| Conversation::from_json(id, &b)).map(Arc::new)
            }
        };
        Ok(found.filter(|c| c.tenant == tenant))
    }

    pub async fn put(&self, c: Arc<Conversation>) -> Result<(), StoreError> {
        match self {
            Responses::Memory(m) => m.insert(c.id.clone(), c),
            Responses::Redis { client, ttl } => {
                let ms = ttl.as_millis().max(1) as u64;
                client
                    .query::<()>(redis::cmd("SET").arg(Self::key(&c.id)).arg(c.to_json()).arg("PX").arg(ms))
                    .await?
            }
        }
        Ok(())
    }

    /// Forgets the stored response `id` if `tenant` made it; whether it did. Responses that
    /// continue it keep their own copy of the conversation (memory: a shared chain; Redis:
    /// whole), so they stay continuable.
    pub async fn delete(&self, tenant: u64, id: &str) -> Result<bool, StoreError> {
        if self.get(tenant, id).await?.is_none() {
            return Ok(false);
        }
        match self {
            Responses::Memory(m) => m.invalidate(id),
            Responses::Redis { client, .. } => {
                client.query::<()>(redis::cmd("DEL").arg(Self::key(id))).await?
            }
        }
        Ok(true)
    }

    /// Bytes and entries held (memory store, as of its last maintenance; 0 for Redis, whose
    /// server holds them).
    pub fn usage(&self) -> (u64, u64) {
        match self {
            Responses::Memory(m) => (m.weighted_size(), m.entry_count()),
            Responses::Redis { .. } => (0, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::session::tenant;

    fn item(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn a_chain_shares_its_prefix_and_reads_back_in_order() {
        let a = Arc::new(Conversation::new("r1".into(), 7, "m".into(), None, vec![item("a"), item("b")]));
        let b = Arc::new(Conversation::new("r2".into(), 7, "m".into(), Some(a.clone()), vec![item("c")]));
        assert_eq!(b.all_items(), vec![&item("a"), &item("b"), &item("c")]);
        assert_eq!((b.root.as_str(), b.len), ("r1", 3));
        assert!(b.bytes > a.bytes);
        let back = Conversation::from_json("r2", &b.to_json()).expect("parse");
        assert_eq!((back.tenant, back.root.as_str(), back.all_items()), (7, "r1", b.all_items()));
        assert_eq!(back.tokens, None);
        let t =
            Conversation::new("r3".into(), 7, "m".into(), None, vec![item("d")]).with_tokens(vec![5, 6, 7]);
        let back = Conversation::from_json("r3", &t.to_json()).expect("parse");
        assert_eq!(back.tokens.as_deref(), Some(&vec![5, 6, 7]));
    }

    #[tokio::test]
    async fn another_tenant_finds_nothing_and_memory_is_bounded() {
        let s = Responses::memory(1 << 20, Duration::from_secs(3600));
        let c = Arc::new(Conversation::new(
            "r1".into(),
            tenant(Some(b"Bearer a")),
            "m".into(),
            None,
            vec![item("x")],
        ));
        s.put(c).await.expect("put");
        assert!(s.get(tenant(Some(b"Bearer a")), "r1").await.expect("get").is_some());
        assert!(s.get(tenant(Some(b"Bearer b")), "r1").await.expect("get").is_none());
        assert!(s.get(tenant(None), "r1").await.expect("get").is_none());
        let big = "y".repeat(64 << 10);
        for i in 0..64 {
            let c = Conversation::new(format!("big{i}"), 0, "m".into(), None, vec![item(&big)]);
            s.put(Arc::new(c)).await.expect("put");
        }
        if let Responses::Memory(m) = &s {
            m.run_pending_tasks();
        }
        let (bytes, entries) = s.usage();
        assert!(bytes <= 1 << 20 && entries < 64, "{bytes} bytes in {entries} entries");
    }
}
