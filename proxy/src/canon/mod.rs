//! Stable prefixes. A prefix cache only pays when the prefix is byte-identical, and agent
//! harnesses break that all the time: tools serialized from hash maps in varying order, a
//! timestamp on the second line of the system prompt. [`Canon::prepare`] repairs that on the way
//! through and cuts the prompt into the prefix blocks that routing keys on.
//!
//! The canonical arrangement of a request (every rewrite keeps its meaning: the model gets the
//! same messages, tools and parameters):
//! - tools in name order, each with keys sorted at every depth, compact;
//! - lines of the system prompt that a volatile rule matches (dates, times, request ids, the
//!   policy's own patterns) moved into a note appended after the last message;
//! - no insignificant JSON whitespace; every other byte of every message as sent.
//!
//! Everything here is a pure function of the request and the pool's policy (the caches only
//! save work), and canonicalizing a canonical request changes nothing.

mod body;
mod chat;
mod external;
mod items;
pub mod render;
mod responses;
pub mod turns;
pub mod volatile;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use warmpath_wire::chat_template::jinja::JinjaTemplate;
use warmpath_wire::chat_template::Piece;
use warmpath_wire::openai::ApiError;
use warmpath_wire::prefix::Blocks;
use warmpath_wire::tokenizer::Tokenizer;

use crate::config::{CanonConfig, NoteRole, TokenizerKind, ToolsConfig};
use crate::observe::Metrics;
use crate::request::{BodyStr, LlmRequest, LlmRoute};
use crate::tools::def::{CanonTool, ToolCache};
use crate::tools::search::SearchPlan;
use crate::tools::Deferrer;
pub use external::External;
pub use items::text_of;
pub use render::{Encoder, Lookups, TokenCache};
use volatile::Volatile;

/// Share of `token_cache_mib` given to canonical tools.
const TOOL_CACHE_SHARE: u64 = 4;

/// Canonical tools in the order sent on, and whether that differs from what the client sent.
type ToolList = (Vec<Arc<CanonTool>>, bool);

/// One pool's canonicalizer.
#[derive(Debug)]
pub struct Canon {
    rewrite: bool,
    sort_tools: bool,
    volatile: Volatile,
    note_role: &'static str,
    encoder: Encoder,
    /// An external model's own chat template; `None` renders the built-in ChatML layout.
    template: Option<Arc<JinjaTemplate>>,
    /// Prompts are rendered and tokenized exactly as the backends do (the bundled engine's
    /// tokenizer and template), so token ids can be sent in their place.
    exact_ids: bool,
    tools: ToolCache,
    defer: Option<Deferrer>,
}

/// What [`Canon::prepare`] did to a request.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Edits {
    /// The tools were not in canonical order or form.
    pub tools_reordered: bool,
    /// Per moved line: the rule's name and the line's bytes.
    pub moved: Vec<(String, usize)>,
    /// Tools deferred behind `tool_search`.
    pub deferred: Option<Deferred>,
}

/// What deferral took out of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deferred {
    /// Tool schemas replaced by `tool_search`.
    pub tools: usize,
    /// Bytes of their definitions, less the search tool's.
    pub saved_bytes: usize,
    /// Tokens of the same (0 without a tokenizer).
    pub saved_tokens: usize,
    /// Searches put back into the history before calls to deferred tools.
    pub reinserted: usize,
}

/// A request ready to send: its body and its prefix blocks.
#[derive(Debug)]
pub struct Prepared {
    /// The canonical body; `None` sends the client's bytes unchanged.
    pub body: Option<Vec<u8>>,
    /// Present when asked for.
    pub blocks: Option<Blocks>,
    pub edits: Edits,
    /// Token-cache lookups made for the blocks.
    pub lookups: Lookups,
    /// Set when tools were deferred: how to answer the model's `tool_search` calls.
    pub search: Option<SearchPlan>,
}

impl Canon {
    /// `embedded`: the pool's backends are bundled engines, whose tokenizer is known;
    /// `external`: the tokenizer and template files `cfg` names, loaded ([`External::load`]).
    pub fn new(cfg: &CanonConfig, tools: &ToolsConfig, embedded: bool, external: Option<External>) -> Canon {
        let bytes = cfg.token_cache_mib.saturating_mul(1 << 20);
        let tok = match (&external, cfg.tokenizer) {
            (Some(e), _) => Some(e.tokenizer.clone()),
            (None, TokenizerKind::Auto) => embedded.then(Tokenizer::wp32k),
            (None, TokenizerKind::Wp32k) => Some(Tokenizer::wp32k()),
            (None, TokenizerKind::None) => None,
        };
        // The bundled engine's tokenizer and template: what warmpath renders is what it renders.
        let exact_ids = external.is_none() && tok.is_some();
        let encoder = match tok {
            Some(tok) => Encoder::Tokens {
                tok,
                block_size: cfg.block_size,
                cache: TokenCache::new(bytes - bytes / TOOL_CACHE_SHARE),
            },
            None => Encoder::Bytes { chunk: cfg.chunk_bytes },
        };
        Canon {
            rewrite: cfg.enabled,
            sort_tools: cfg.sort_tools,
            volatile: Volatile::new(cfg),
            note_role: match cfg.note_role {
                NoteRole::System => "system",
                NoteRole::Developer => "developer",
                NoteRole::User => "user",
            },
            encoder,
            template: external.and_then(|e| e.template),
            exact_ids,
            tools: ToolCache::new(bytes / TOOL_CACHE_SHARE),
            defer: Deferrer::new(tools),
        }
    }

    /// Requests are rewritten into canonical form.
    pub fn rewrites(&self) -> bool {
        self.rewrite
    }

    pub fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    /// The canonical body (when rewriting) and, with `hash`, the prefix blocks. Errors are
    /// the client's (400): a tool that is not a JSON object.
    pub fn prepare(&self, req: &LlmRequest<'_>, hash: bool) -> Result<Prepared, ApiError> {
        if !self.rewrite && !hash {
            return Ok(Prepared {
                body: None,
                blocks: None,
                edits: Edits::default(),
                lookups: Lookups::default(),
                search: None,
            });
        }
        match req.route {
            LlmRoute::Chat => self.prepare_chat(req, hash),
            LlmRoute::Responses => self.prepare_responses(req, hash),
            LlmRoute::Completions | LlmRoute::Embeddings => {
                let mut lookups = Lookups::default();
                let blocks = hash.then(|| self.raw_blocks(req, &mut lookups));
                Ok(Prepared { body: None, blocks, edits: Edits::default(), lookups, search: None })
            }
        }
    }

    /// The tools of `tools` (raw), canonical, in the order the backend will get them, and
    /// whether that differs from what was sent. `None` when the field is not a list.
    fn tools(&self, req: &LlmRequest<'_>) -> Result<Option<ToolList>, ApiError> {
        let Some(list) = req.tools() else { return Ok(None) };
        let mut out = Vec::with_capacity(list.len());
        let mut changed = false;
        for (i, t) in list.iter().enumerate() {
            let c = self
                .tools
                .get(t.get())
                .map_err(|e| ApiError::invalid_request(format!("tools[{i}]: {e}")).with_param("tools"))?;
            changed |= c.json != t.get();
            out.push(c);
        }
        if self.rewrite && self.sort_tools {
            let before: Vec<*const CanonTool> = out.iter().map(Arc::as_ptr).collect();
            out.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.json.cmp(&b.json)));
            changed |= out.iter().map(Arc::as_ptr).ne(before.iter().copied());
        }
        Ok(Some((out, changed)))
    }

    /// Moves volatile lines out of a system prompt when rewriting.
    fn split_system(&self, text: Option<&str>, edits: &mut Edits) -> Option<volatile::Moved> {
        let m = self.volatile.split(text.filter(|_| self.rewrite)?)?;
        for (line, &rule) in m.lines.iter().zip(&m.rule_of) {
            edits.moved.push((self.volatile.rule_name(rule).to_owned(), line.len() + 1));
        }
        Some(m)
    }

    /// Tokens of `text` as content (0 without a tokenizer).
    fn count_tokens(&self, text: &str) -> usize {
        match &self.encoder {
            Encoder::Tokens { tok, .. } => tok.encode(text).len(),
            Encoder::Bytes { .. } => 0,
        }
    }

    /// Completions and embeddings: the prompt as sent (text, or token ids).
    fn raw_blocks(&self, req: &LlmRequest<'_>, n: &mut Lookups) -> Blocks {
        let salt = salt_of(req);
        let salt = salt.as_deref();
        let text =
            |s: String, n: &mut Lookups| self.encoder.blocks_counted(&[Piece::Content(s)], &[], salt, n);
        let Some(raw) = req.content else { return text(String::new(), n) };
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Prompt<'a> {
            #[serde(borrow)]
            Text(BodyStr<'a>),
            Ids(Vec<u32>),
            #[serde(borrow)]
            Texts(Vec<BodyStr<'a>>),
            Batch(Vec<Vec<u32>>),
        }
        // A batch is keyed by its first prompt.
        match serde_json::from_str::<Prompt<'_>>(raw.get()) {
            Ok(Prompt::Ids(ids)) => self.encoder.blocks_of_ids(&ids, salt),
            Ok(Prompt::Batch(b)) => self.encoder.blocks_of_ids(b.first().map_or(&[], |v| v), salt),
            Ok(Prompt::Text(s)) => text(s.0.into_owned(), n),
            Ok(Prompt::Texts(v)) => {
                text(v.into_iter().next().map(|s| s.0.into_owned()).unwrap_or_default(), n)
            }
            Err(_) => text(raw.get().to_owned(), n),
        }
    }

    /// Counts what [`Canon::prepare`] did to one of `pool`'s requests, and how long it took.
    pub fn record(&self, m: &Metrics, pool: &str, p: &Prepared, took: Duration) {
        if p.body.is_none() && p.blocks.is_none() {
            return;
        }
        m.canon_duration.with_label_values(&[pool]).observe(took.as_secs_f64());
        if p.edits.tools_reordered {
            m.canon_edits.with_label_values(&[pool, "tools_reordered"]).inc();
        }
        if !p.edits.moved.is_empty() {
            m.canon_edits.with_label_values(&[pool, "volatile_moved"]).inc();
        }
        if let Some(d) = &p.edits.deferred {
            m.tools_deferred.with_label_values(&[pool]).inc_by(d.tools as u64);
            m.tools_saved_bytes.with_label_values(&[pool]).inc_by(d.saved_bytes as u64);
            m.tools_saved_tokens.with_label_values(&[pool]).inc_by(d.saved_tokens as u64);
            m.tools_reinserted.with_label_values(&[pool]).inc_by(d.reinserted as u64);
        }
        for (rule, bytes) in &p.edits.moved {
            m.canon_moved_bytes.with_label_values(&[pool, rule]).inc_by(*bytes as u64);
        }
        if let (Some(b), Some(cache)) = (&p.blocks, self.encoder.cache()) {
            m.prompt_tokens.with_label_values(&[pool]).observe(b.units as f64);
            m.token_cache_lookups.with_label_values(&[pool, "hit"]).inc_by(p.lookups.hits);
            m.token_cache_lookups.with_label_values(&[pool, "miss"]).inc_by(p.lookups.misses);
            m.token_cache_bytes.with_label_values(&[pool]).set(cache.weighted_size() as i64);
        }
    }

    fn blocks(&self, stable: Vec<Piece>, rest: Vec<Piece>, req: &LlmRequest<'_>, n: &mut Lookups) -> Blocks {
        self.encoder.blocks_counted(&stable, &rest, salt_of(req).as_deref(), n)
    }
}

/// The function `tool_choice` names, if any.
fn named_tool(req: &LlmRequest<'_>) -> Option<String> {
    let raw = req.extra_raw("tool_choice")?;
    let v: Value = serde_json::from_str(raw.get()).ok()?;
    v.pointer("/function/name").or_else(|| v.get("name")).and_then(Value::as_str).map(str::to_owned)
}

/// The salt of the request's prefix blocks: the tenant's, joined to the request's own
/// `cache_salt` — what the backend is sent (`pipeline`'s `with_salt`).
fn salt_of(req: &LlmRequest<'_>) -> Option<String> {
    let own = req.extra_str("cache_salt");
    match (&req.tenant_salt, own) {
        (Some(t), Some(o)) => Some(format!("{t}:{o}")),
        (Some(t), None) => Some(t.to_string()),
        (None, o) => o.map(Cow::into_owned),
    }
}

#[cfg(test)]
mod tests;

/// The fuzz target's body (`proxy/fuzz`), also run over its corpus by the tests: any input,
/// on every route, either is refused or canonicalizes (tools deferred beyond one) without
/// panicking, and its canonical form is a fixed point with the same blocks.
pub fn fuzz_check(data: &[u8]) {
    static CANON: std::sync::OnceLock<Canon> = std::sync::OnceLock::new();
    let canon = CANON.get_or_init(|| {
        let cfg = CanonConfig { enabled: true, tokenizer: TokenizerKind::Wp32k, ..CanonConfig::default() };
        let tools = ToolsConfig { defer: true, threshold: 1, ..ToolsConfig::default() };
        Canon::new(&cfg, &tools, true, None)
    });
    for route in [LlmRoute::Chat, LlmRoute::Responses, LlmRoute::Completions, LlmRoute::Embeddings] {
        let Ok(req) = LlmRequest::parse(route, data) else { continue };
        let Ok(first) = canon.prepare(&req, true) else { continue };
        let Some(body) = first.body else { continue };
        let again = LlmRequest::parse(route, &body).expect("a canonical body parses");
        let second = canon.prepare(&again, true).expect("a canonical body prepares");
        assert_eq!(second.body.as_deref(), Some(body.as_slice()), "canonical form is a fixed point");
        assert_eq!(second.blocks, first.blocks, "with the same blocks");
    }
}
