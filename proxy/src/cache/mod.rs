//! The exact response cache (`[pools.response_cache]`): the complete answer to a deterministic
//! request (temperature 0 or a fixed seed, one choice), served again to the same request
//! without a backend. The key is a 128-bit hash of the pool, route, model, the caller's API key
//! (unless the cache is shared) and the body as it goes to the backend — the canonical body
//! where `[pools.canon]` rewrites, so requests that differ only in tool order or key order meet.
//! A streamed answer is kept with its chunk boundaries and replayed event by event; only
//! answers that ended cleanly (status 200, a stream with its `[DONE]`) are kept. Entries are
//! bounded in bytes (moka's weigher) and expire `ttl_s` after they were stored.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::HeaderValue;
use moka::sync::Cache;
use xxhash_rust::xxh3::Xxh3;

use crate::config::ResponseCacheConfig;
use crate::request::{LlmRequest, LlmRoute, Raw};

/// Bytes an entry costs beyond its body: the map slot, the entry, its header value.
const ENTRY_OVERHEAD: usize = 128;

/// A kept answer.
#[derive(Debug)]
pub struct Entry {
    pub content_type: Option<HeaderValue>,
    /// The body, as the client got it.
    body: Bytes,
    /// Where the chunks of a stream ended (offsets into `body`); empty for a whole body.
    cuts: Vec<u32>,
    pub stream: bool,
    stored: Instant,
}

impl Entry {
    /// The body in the chunks it was relayed in.
    pub fn chunks(&self) -> impl Iterator<Item = Bytes> + '_ {
        let mut start = 0usize;
        let ends = self.cuts.iter().map(|&c| c as usize).chain(std::iter::once(self.body.len()));
        ends.filter_map(move |end| {
            let chunk = (end > start).then(|| self.body.slice(start..end));
            start = end;
            chunk
        })
    }

    pub fn len(&self) -> usize {
        self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    /// Time since it was stored (the `age` header).
    pub fn age(&self) -> Duration {
        self.stored.elapsed()
    }

    fn weight(&self) -> u32 {
        let w = self.body.len() + self.cuts.len() * 4 + ENTRY_OVERHEAD;
        u32::try_from(w).unwrap_or(u32::MAX)
    }
}

/// Whether a request may be answered from the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Eligible,
    /// Not deterministic, or not a route the cache keeps; the reason, for the log.
    Bypass(&'static str),
}

/// A request is deterministic when it asks for one choice (`n` absent or 1) and either samples
/// greedily (`temperature` 0) or fixes the seed. Only chat and text completions are kept
/// (Responses answers carry ids the client may chain on; embeddings are not generated).
pub fn verdict(req: &LlmRequest<'_>) -> Verdict {
    if !matches!(req.route, LlmRoute::Chat | LlmRoute::Completions) {
        return Verdict::Bypass("route");
    }
    let field = |name: &str| req.extra_raw(name);
    let number = |v: Option<Raw<'_>>| v.and_then(|v| serde_json::from_str::<f64>(v.get()).ok());
    if let Some(n) = field("n") {
        if number(Some(n)) != Some(1.0) && n.get() != "null" {
            return Verdict::Bypass("n");
        }
    }
    let greedy = number(field("temperature")) == Some(0.0);
    let seeded = field("seed").is_some_and(|v| serde_json::from_str::<i64>(v.get()).is_ok());
    if greedy || seeded {
        Verdict::Eligible
    } else {
        Verdict::Bypass("sampled")
    }
}

/// What became of a recorded answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Stored,
    /// Larger than `max_entry_kib`.
    TooLarge,
    /// Not a clean, complete 200.
    Incomplete,
}

impl Stored {
    pub fn label(self) -> &'static str {
        match self {
            Stored::Stored => "stored",
            Stored::TooLarge => "too_large",
            Stored::Incomplete => "incomplete",
        }
    }
}

/// An answer being relayed to the client, copied aside for the cache.
#[derive(Debug)]
pub struct Recording {
    key: u128,
    content_type: Option<HeaderValue>,
    body: BytesMut,
    cuts: Vec<u32>,
    stream: bool,
    max: usize,
    too_large: bool,
    complete: bool,
}

impl Recording {
    /// The response header the client got: only a 200 is kept.
    pub fn header(&mut self, status: u16, content_type: Option<&HeaderValue>) {
        if status != 200 {
            self.too_large = false;
            self.complete = false;
            self.max = 0;
        }
        self.stream = content_type.is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        self.content_type = content_type.cloned();
    }

    /// A chunk the client was sent.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.too_large || chunk.is_empty() {
            return;
        }
        if self.body.len() + chunk.len() > self.max {
            self.too_large = self.max > 0;
            self.body = BytesMut::new();
            self.cuts = Vec::new();
            return;
        }
        if !self.body.is_empty() && self.stream {
            self.cuts.push(self.body.len() as u32);
        }
        self.body.extend_from_slice(chunk);
    }

    /// The answer ended cleanly and the client has all of it.
    pub fn complete(&mut self) {
        self.complete = self.max > 0;
    }
}

/// One pool's cache.
pub struct ResponseCache {
    entries: Cache<u128, Arc<Entry>>,
    max_entry: usize,
    shared: bool,
}

impl std::fmt::Debug for ResponseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseCache")
            .field("entries", &self.entries.entry_count())
            .field("bytes", &self.entries.weighted_size())
            .finish()
    }
}

impl ResponseCache {
    pub fn new(cfg: &ResponseCacheConfig) -> ResponseCache {
        let entries = Cache::builder()
            .max_capacity(cfg.max_mib.saturating_mul(1 << 20))
            .weigher(|_: &u128, e: &Arc<Entry>| e.weight())
            .time_to_live(Duration::from_secs(cfg.ttl_s))
            .build();
        ResponseCache {
            entries,
            max_entry: (cfg.max_entry_kib as usize).saturating_mul(1024),
            shared: cfg.shared,
        }
    }

    /// The request's key. `auth` is the caller's `Authorization` header, ignored when the cache
    /// is shared; `body` is what goes to the backend.
    pub fn key(&self, pool: &str, route: LlmRoute, model: &str, auth: Option<&[u8]>, body: &[u8]) -> u128 {
        let mut h = Xxh3::new();
        let auth = if self.shared { None } else { auth };
        // Each part behind its length, so that no two different tuples hash the same bytes.
        for part in [pool.as_bytes(), route.label().as_bytes(), model.as_bytes(), auth.unwrap_or(b"")] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.update(&[u8::from(auth.is_some())]);
        h.update(body);
        h.digest128()
    }

    pub fn get(&self, key: u128) -> Option<Arc<Entry>> {
        self.entries.get(&key)
    }

    /// Starts copying an answer aside under `key`.
    pub fn record(&self, key: u128) -> Recording {
        Recording {
            key,
            content_type: None,
            body: BytesMut::new(),
            cuts: Vec::new(),
            stream: false,
            max: self.max_entry,
            too_large: false,
            complete: false,
        }
    }

    /// Keeps a recorded answer if it is complete and small enough.
    pub fn store(&self, rec: Recording) -> Stored {
        if rec.too_large {
            return Stored::TooLarge;
        }
        if !rec.complete {
            return Stored::Incomplete;
        }
        let entry = Entry {
            content_type: rec.content_type,
            body: rec.body.freeze(),
            cuts: rec.cuts,
            stream: rec.stream,
            stored: Instant::now(),
        };
        self.entries.insert(rec.key, Arc::new(entry));
        Stored::Stored
    }

    /// Bytes held (moka's weights, after its pending evictions ran).
    pub fn bytes(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.weighted_size()
    }

    pub fn entries(&self) -> u64 {
        self.entries.entry_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ResponseCacheConfig {
        ResponseCacheConfig { enabled: true, max_mib: 1, max_entry_kib: 64, ttl_s: 60, shared: false }
    }

    fn verdict_of(body: &str) -> Verdict {
        verdict(&LlmRequest::parse(LlmRoute::Chat, body.as_bytes()).expect("parses"))
    }

    #[test]
    fn only_deterministic_single_choice_requests_are_kept() {
        let m = r#""model":"m","messages":[]"#;
        assert_eq!(verdict_of(&format!("{{{m},\"temperature\":0}}")), Verdict::Eligible);
        assert_eq!(verdict_of(&format!("{{{m},\"temperature\":0.0,\"n\":1}}")), Verdict::Eligible);
        assert_eq!(verdict_of(&format!("{{{m},\"temperature\":0.9,\"seed\":7}}")), Verdict::Eligible);
        assert_eq!(verdict_of(&format!("{{{m}}}")), Verdict::Bypass("sampled"), "default temperature is 1");
        assert_eq!(verdict_of(&format!("{{{m},\"temperature\":0.2}}")), Verdict::Bypass("sampled"));
        assert_eq!(verdict_of(&format!("{{{m},\"seed\":null}}")), Verdict::Bypass("sampled"));
        assert_eq!(verdict_of(&format!("{{{m},\"temperature\":0,\"n\":2}}")), Verdict::Bypass("n"));
        let resp = LlmRequest::parse(LlmRoute::Responses, br#"{"model":"m","input":"x","temperature":0}"#)
            .expect("parses");
        assert_eq!(verdict(&resp), Verdict::Bypass("route"));
        let comp = LlmRequest::parse(LlmRoute::Completions, br#"{"model":"m","prompt":"x","seed":1}"#)
            .expect("parses");
        assert_eq!(verdict(&comp), Verdict::Eligible);
    }

    #[test]
    fn keys_separate_callers_models_and_bodies() {
        let c = ResponseCache::new(&cfg());
        let k = |auth: Option<&[u8]>, model: &str, body: &[u8]| c.key("p", LlmRoute::Chat, model, auth, body);
        let base = k(Some(b"Bearer a"), "m", b"{}");
        assert_eq!(base, k(Some(b"Bearer a"), "m", b"{}"));
        assert_ne!(base, k(Some(b"Bearer b"), "m", b"{}"), "another API key");
        assert_ne!(base, k(None, "m", b"{}"), "no API key");
        assert_ne!(base, k(Some(b"Bearer a"), "n", b"{}"), "another model");
        assert_ne!(base, k(Some(b"Bearer a"), "m", b"{ }"), "another body");
        assert_ne!(base, c.key("p", LlmRoute::Completions, "m", Some(b"Bearer a"), b"{}"), "another route");
        // Parts are length-framed: moving a byte from one part to the next changes the key.
        assert_ne!(c.key("pa", LlmRoute::Chat, "m", None, b""), c.key("p", LlmRoute::Chat, "am", None, b""));
        let shared = ResponseCache::new(&ResponseCacheConfig { shared: true, ..cfg() });
        assert_eq!(
            shared.key("p", LlmRoute::Chat, "m", Some(b"Bearer a"), b"{}"),
            shared.key("p", LlmRoute::Chat, "m", Some(b"Bearer b"), b"{}"),
        );
    }

    #[test]
    fn streams_replay_in_their_chunks_and_only_clean_answers_are_kept() {
        let c = ResponseCache::new(&cfg());
        let sse = HeaderValue::from_static("text/event-stream");
        let mut rec = c.record(1);
        rec.header(200, Some(&sse));
        for ev in ["data: {\"a\":1}\n\n", "data: {\"b\":2}\n\n", "data: [DONE]\n\n"] {
            rec.push(ev.as_bytes());
        }
        rec.complete();
        assert_eq!(c.store(rec), Stored::Stored);
        let e = c.get(1).expect("kept");
        assert!(e.stream);
        let chunks: Vec<Bytes> = e.chunks().collect();
        assert_eq!(chunks, ["data: {\"a\":1}\n\n", "data: {\"b\":2}\n\n", "data: [DONE]\n\n"]);

        let json = HeaderValue::from_static("application/json");
        let mut whole = c.record(2);
        whole.header(200, Some(&json));
        whole.push(b"{\"x\":");
        whole.push(b"1}");
        whole.complete();
        assert_eq!(c.store(whole), Stored::Stored);
        let e = c.get(2).expect("kept");
        assert_eq!(e.chunks().collect::<Vec<_>>(), [Bytes::from_static(b"{\"x\":1}")], "one body");

        let mut cut = c.record(3);
        cut.header(200, Some(&sse));
        cut.push(b"data: {}\n\n");
        assert_eq!(c.store(cut), Stored::Incomplete, "never completed");
        let mut err = c.record(4);
        err.header(400, Some(&json));
        err.push(b"{\"error\":{}}");
        err.complete();
        assert_eq!(c.store(err), Stored::Incomplete, "not a 200");
        let mut big = c.record(5);
        big.header(200, Some(&json));
        big.push(&vec![b'x'; 40 << 10]);
        big.push(&vec![b'x'; 40 << 10]);
        big.complete();
        assert_eq!(c.store(big), Stored::TooLarge);
        assert!(c.get(3).is_none() && c.get(4).is_none() && c.get(5).is_none());
    }

    #[test]
    fn bounded_in_bytes() {
        let c = ResponseCache::new(&cfg());
        let json = HeaderValue::from_static("application/json");
        for key in 0..100u128 {
            let mut rec = c.record(key);
            rec.header(200, Some(&json));
            rec.push(&vec![b'x'; 32 << 10]);
            rec.complete();
            assert_eq!(c.store(rec), Stored::Stored);
        }
        assert!(c.bytes() <= 1 << 20, "{} bytes held", c.bytes());
        assert!(c.entries() < 100 && c.entries() >= 20, "{} entries", c.entries());
    }

    #[test]
    fn entries_expire() {
        let c = ResponseCache::new(&ResponseCacheConfig { ttl_s: 1, ..cfg() });
        let mut rec = c.record(9);
        rec.header(200, None);
        rec.push(b"{}");
        rec.complete();
        c.store(rec);
        assert!(c.get(9).is_some());
        std::thread::sleep(Duration::from_millis(1100));
        assert!(c.get(9).is_none(), "past its TTL");
    }
}
