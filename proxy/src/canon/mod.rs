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

mod items;
pub mod json;
pub mod render;
mod responses;
mod template;
pub mod tools;
pub mod turns;
pub mod volatile;

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use warmpath_wire::chat_template::{tool_call_text, Piece, PromptBuilder};
use warmpath_wire::openai::ApiError;
use warmpath_wire::tokenizer::Tokenizer;

use crate::config::{CanonConfig, NoteRole, TokenizerKind, ToolsConfig};
use crate::http::request::{ContentView, LlmRequest, LlmRoute, MessageView, Str};
use crate::tools::search::{self, SearchPlan};
use crate::tools::{DeferredSet, Deferrer, Form, SEARCH_TOOL};
pub use items::text_of;
pub use render::{Blocks, Encoder, Lookups, TokenCache};
pub use template::ChatTemplate;
use tools::{CanonTool, ToolCache};
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
    template: Option<Arc<ChatTemplate>>,
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
    /// `embedded`: the pool's backends are bundled engines, whose tokenizer is known.
    pub fn new(cfg: &CanonConfig, tools: &ToolsConfig, embedded: bool) -> Canon {
        let bytes = cfg.token_cache_mib.saturating_mul(1 << 20);
        let tok = match (&cfg.external, cfg.tokenizer) {
            (Some(e), _) => Some(e.tokenizer.clone()),
            (None, TokenizerKind::Auto) => embedded.then(Tokenizer::wp32k),
            (None, TokenizerKind::Wp32k) => Some(Tokenizer::wp32k()),
            (None, TokenizerKind::None) => None,
        };
        // The bundled engine's tokenizer and template: what warmpath renders is what it renders.
        let exact_ids = cfg.external.is_none() && tok.is_some();
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
            template: cfg.external.as_ref().and_then(|e| e.template.clone()),
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
        let Some((_, list)) = &req.tools else { return Ok(None) };
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

    fn prepare_chat(&self, req: &LlmRequest<'_>, hash: bool) -> Result<Prepared, ApiError> {
        let mut edits = Edits::default();
        let mut lookups = Lookups::default();
        let tools = self.tools(req)?;
        let lead_system =
            req.messages.first().is_some_and(|m| matches!(m.role.0.as_ref(), "system" | "developer"));
        let system_text =
            lead_system.then(|| req.messages[0].content.as_ref().and_then(ContentView::text)).flatten();
        let moved = self.split_system(system_text.as_deref(), &mut edits);
        let note = moved.as_ref().map(|m| m.lines.join("\n"));
        if let Some((_, changed)) = &tools {
            edits.tools_reordered = *changed;
        }
        // Searches are answered for one choice; with `n` > 1 every tool stays.
        let one_choice =
            raw_field(req, "n").is_none_or(|n| n.get().trim() == "1" || n.get().trim() == "null");
        let plan = match (&self.defer, &tools) {
            (Some(d), Some((list, _))) if self.rewrite && one_choice => {
                d.plan(list, named_tool(req).as_deref(), Form::Chat, &|t| self.count_tokens(t))
            }
            _ => None,
        };
        let sent_tools: Option<&[Arc<CanonTool>]> =
            plan.as_ref().map(|p| p.kept.as_slice()).or(tools.as_ref().map(|(t, _)| t.as_slice()));
        let reinserts = plan.as_ref().map(|p| reinserts(&p.set, &req.messages)).unwrap_or_default();
        if let Some(p) = &plan {
            edits.deferred = Some(Deferred {
                tools: p.set.tools.len(),
                saved_bytes: p.set.saved_bytes,
                saved_tokens: p.set.saved_tokens,
                reinserted: reinserts.iter().flatten().count(),
            });
        }

        let mut messages_end = 0;
        let body = self.rewrite.then(|| {
            let mut b = Body::new(req.model());
            b.key("messages");
            b.out.push('[');
            for (i, raw) in req.raw_messages.iter().enumerate() {
                if i > 0 {
                    b.out.push(',');
                }
                if let Some(Some(r)) = reinserts.get(i) {
                    b.out.push_str(&r.call_json);
                    b.out.push(',');
                    b.out.push_str(&search::tool_message(&r.id, &r.result));
                    b.out.push(',');
                }
                match (&moved, i) {
                    (Some(m), 0) => b.out.push_str(&with_content(raw.get(), &m.kept)),
                    _ => b.out.push_str(&json::minify(raw.get())),
                }
            }
            if let Some(n) = &note {
                b.out.push(',');
                b.out.push_str(&note_message(self.note_role, n));
            }
            messages_end = b.out.len();
            b.out.push(']');
            b.extras(req, sent_tools);
            b.finish()
        });
        // An external template renders the body the backend gets; the built-in layout renders
        // the request views (no second parse).
        let templated = match (&self.template, hash) {
            (Some(t), true) => self.template_blocks(t, body.as_deref(), req, &mut lookups),
            _ => None,
        };
        let blocks = templated.or_else(|| {
            hash.then(|| {
                let mut stable = PromptBuilder::default();
                let system = match (&moved, lead_system) {
                    (Some(m), _) => Some(Cow::Borrowed(m.kept.as_str())),
                    (None, true) => Some(system_text.clone().unwrap_or_default()),
                    (None, false) => None,
                };
                let lines = sent_tools.iter().flat_map(|t| t.iter().map(|t| t.line.as_str()));
                stable.system_turn(system.as_deref(), lines);
                let mut rest = PromptBuilder::default();
                let skip = usize::from(lead_system);
                for (i, m) in req.messages.iter().enumerate().skip(skip) {
                    if let Some(Some(r)) = reinserts.get(i) {
                        rest.turn("assistant", "", [tool_call_text(SEARCH_TOOL, &r.arguments).as_str()]);
                        rest.tool_result(&r.id, &r.result);
                    }
                    render_message(&mut rest, m);
                }
                if let Some(n) = &note {
                    rest.turn(self.note_role, n, []);
                }
                rest.generation_prompt();
                self.blocks(stable.finish(), rest.finish(), req, &mut lookups)
            })
        });
        let search = match (&plan, &self.defer) {
            (Some(p), Some(d)) => Some(SearchPlan {
                set: p.set.clone(),
                limit: d.limit,
                max_rounds: d.max_rounds,
                messages_end,
                form: Form::Chat,
                native: false,
            }),
            _ => None,
        };
        Ok(Prepared { body, blocks, edits, lookups, search })
    }

    /// Tokens of `text` as content (0 without a tokenizer).
    fn count_tokens(&self, text: &str) -> usize {
        match &self.encoder {
            Encoder::Tokens { tok, .. } => tok.encode(text).len(),
            Encoder::Bytes { .. } => 0,
        }
    }

    /// Blocks of the prompt an external chat template renders from `body` (the request's own
    /// when not rewriting); `None` when the template fails, which falls back to the built-in
    /// layout. The stable prefix is the render of the leading system message with the tools,
    /// cut back to where the tokenizer surely splits.
    fn template_blocks(
        &self,
        t: &ChatTemplate,
        body: Option<&[u8]>,
        req: &LlmRequest<'_>,
        n: &mut Lookups,
    ) -> Option<Blocks> {
        let Encoder::Tokens { tok, .. } = &self.encoder else { return None };
        use minijinja::Value as JValue;
        #[derive(Deserialize)]
        struct Input {
            messages: Vec<JValue>,
            tools: Option<Vec<JValue>>,
            chat_template_kwargs: Option<JValue>,
        }
        let input = match body {
            Some(b) => serde_json::from_slice::<Input>(b).ok()?,
            None => Input {
                messages: req.raw_messages.iter().filter_map(|r| template::parse(r.get())).collect(),
                tools: req
                    .tools
                    .as_ref()
                    .map(|(_, l)| l.iter().filter_map(|r| template::parse(r.get())).collect()),
                chat_template_kwargs: raw_field(req, "chat_template_kwargs")
                    .and_then(|r| template::parse(r.get())),
            },
        };
        let kwargs = input.chat_template_kwargs.as_ref();
        let tools = input.tools.as_deref();
        let full = t
            .render(&input.messages, tools, true, kwargs)
            .map_err(|e| tracing::debug!(template = %t.source, "chat template failed: {e}"))
            .ok()?;
        let lead = input.messages.first().filter(|m| {
            m.get_attr("role").ok().is_some_and(|r| matches!(r.as_str(), Some("system" | "developer")))
        });
        let stable = match lead {
            Some(m) => t.render(std::slice::from_ref(m), tools, false, kwargs).ok()?,
            None => String::new(),
        };
        let mut cut = full.bytes().zip(stable.bytes()).take_while(|(a, b)| a == b).count();
        while !tok.splits_at(&full, cut) {
            cut -= 1;
        }
        let (a, b) = full.split_at(cut);
        let salt = salt_of(req);
        Some(self.encoder.blocks_counted(
            &[Piece::Rendered(a.to_owned())],
            &[Piece::Rendered(b.to_owned())],
            salt.as_deref(),
            n,
        ))
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
            Text(Str<'a>),
            Ids(Vec<u32>),
            #[serde(borrow)]
            Texts(Vec<Str<'a>>),
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

    fn blocks(&self, stable: Vec<Piece>, rest: Vec<Piece>, req: &LlmRequest<'_>, n: &mut Lookups) -> Blocks {
        self.encoder.blocks_counted(&stable, &rest, salt_of(req).as_deref(), n)
    }
}

/// The function `tool_choice` names, if any.
fn named_tool(req: &LlmRequest<'_>) -> Option<String> {
    let raw = raw_field(req, "tool_choice")?;
    let v: Value = serde_json::from_str(raw.get()).ok()?;
    v.pointer("/function/name").or_else(|| v.get("name")).and_then(Value::as_str).map(str::to_owned)
}

/// A search put back into the history: before the assistant message that first calls deferred
/// tools, a `tool_search` call for them and its result, so that the model sees the definitions
/// of the tools it uses.
#[derive(Debug)]
struct Reinsert {
    id: String,
    arguments: String,
    call_json: String,
    result: String,
}

/// One call of an assistant message's `tool_calls`, read leniently.
#[derive(Deserialize)]
struct CallView<'a> {
    #[serde(borrow, default)]
    id: Option<Str<'a>>,
    #[serde(borrow)]
    function: FunctionView<'a>,
}

#[derive(Deserialize)]
struct FunctionView<'a> {
    #[serde(borrow)]
    name: Str<'a>,
    #[serde(borrow, default)]
    arguments: Option<Str<'a>>,
}

/// A message's tool calls; none when they do not parse.
fn calls_of<'a>(m: &MessageView<'a>) -> Vec<CallView<'a>> {
    m.tool_calls.and_then(|r| serde_json::from_str(r.get()).ok()).unwrap_or_default()
}

/// Per message, the search to put before it.
fn reinserts(set: &DeferredSet, messages: &[MessageView<'_>]) -> Vec<Option<Reinsert>> {
    let mut loaded = std::collections::HashSet::new();
    messages
        .iter()
        .map(|m| {
            let calls = calls_of(m);
            let mut missing: Vec<&Arc<CanonTool>> = Vec::new();
            for c in &calls {
                if let Some(t) = set.get(&c.function.name.0) {
                    if loaded.insert(t.name.clone()) {
                        missing.push(t);
                    }
                }
            }
            if missing.is_empty() {
                return None;
            }
            let first = calls.first().and_then(|c| c.id.as_ref()).map_or("", |s| s.0.as_ref());
            let id = format!("ts_{first}");
            let query = missing.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(" ");
            let (call_json, arguments) = search::synthetic_call(&id, &query);
            let result = crate::tools::result_text(&query, &missing);
            Some(Reinsert { id, arguments, call_json, result })
        })
        .collect()
}

fn raw_field<'a>(req: &LlmRequest<'a>, name: &str) -> Option<&'a RawValue> {
    req.extra.iter().find(|(k, _)| k.0 == name).map(|(_, v)| *v)
}

fn salt_of(req: &LlmRequest<'_>) -> Option<String> {
    req.extra_str("cache_salt").map(Cow::into_owned)
}

/// One chat message into the prompt, the way the bundled template renders it.
fn render_message(b: &mut PromptBuilder, m: &MessageView<'_>) {
    let text = m.content.as_ref().and_then(ContentView::text).unwrap_or_default();
    if m.role.0 == "tool" {
        b.tool_result(m.tool_call_id.as_ref().map_or("", |s| s.0.as_ref()), &text);
        return;
    }
    let calls: Vec<String> = calls_of(m)
        .iter()
        .map(|c| {
            tool_call_text(&c.function.name.0, c.function.arguments.as_ref().map_or("", |a| a.0.as_ref()))
        })
        .collect();
    b.turn(&m.role.0, &text, calls.iter().map(String::as_str));
}

/// A message object with its `content` replaced by `text`; its other fields kept.
fn with_content(raw: &str, text: &str) -> String {
    match serde_json::from_str::<Map<String, Value>>(raw) {
        Ok(mut m) => {
            m.insert("content".to_owned(), Value::String(text.to_owned()));
            Value::Object(m).to_string()
        }
        Err(_) => json::minify(raw).into_owned(),
    }
}

/// A string `input` as the one user message item it stands for.
fn user_item(content: &RawValue) -> String {
    format!("{{\"role\":\"user\",\"content\":{}}}", json::minify(content.get()))
}

fn note_message(role: &str, text: &str) -> String {
    format!("{{\"role\":\"{role}\",\"content\":{}}}", json::string(text))
}

/// A body being written: `{"model":..., ...}`.
struct Body {
    out: String,
}

impl Body {
    fn new(model: &str) -> Body {
        let mut out = String::with_capacity(4096);
        out.push_str("{\"model\":");
        out.push_str(&json::string(model));
        Body { out }
    }

    fn key(&mut self, k: &str) {
        self.out.push(',');
        self.out.push_str(&json::string(k));
        self.out.push(':');
    }

    /// Every other top-level field in the order sent, `tools` canonical.
    fn extras(&mut self, req: &LlmRequest<'_>, tools: Option<&[Arc<CanonTool>]>) {
        let at = req.tools.as_ref().map(|(at, _)| *at);
        for i in 0..=req.extra.len() {
            if let (Some(tools), true) = (tools, at == Some(i)) {
                self.key("tools");
                self.out.push('[');
                for (i, t) in tools.iter().enumerate() {
                    if i > 0 {
                        self.out.push(',');
                    }
                    self.out.push_str(&t.json);
                }
                self.out.push(']');
            }
            if let Some((k, v)) = req.extra.get(i) {
                self.key(&k.0);
                self.out.push_str(&json::minify(v.get()));
            }
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.push('}');
        self.out.into_bytes()
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
        Canon::new(&cfg, &tools, true)
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
