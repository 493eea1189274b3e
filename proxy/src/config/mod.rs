//! The policy file: what warmpath listens on, which models go to which backend pool, how each
//! pool routes, and the limits and timeouts around it. Every struct denies unknown keys, values
//! are checked as they are parsed where one value suffices (so errors point at it), and
//! [`load`] runs the checks that span several values. Every key is documented in
//! `docs/policies.md`.

mod load;
mod sessions;
mod types;
mod validate;

pub use load::{load, parse, ConfigError};
pub use sessions::{ConversationConfig, StoreKind, WebSocketConfig};
pub use types::{BackendUrl, Pattern, Ratio};
pub use validate::{validate, Invalid, PathSeg};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::canon::ChatTemplate;

use serde::Deserialize;

/// A whole policy file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub upstream: UpstreamConfig,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub session: ConversationConfig,
    #[serde(default)]
    pub websocket: WebSocketConfig,
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
}

/// `[server]`: listeners and worker threads.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// The API listener (HTTP and, later, WebSocket).
    pub listen: SocketAddr,
    /// The admin listener: `/metrics`, `/healthz`, `/readyz`.
    pub admin: SocketAddr,
    /// pingora worker threads for the API listener.
    pub threads: usize,
    /// Seconds in-flight requests get to finish after SIGTERM.
    pub grace_period_secs: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: SocketAddr::from(([127, 0, 0, 1], 9090)),
            threads: 2,
            grace_period_secs: 30,
        }
    }
}

/// `[limits]`: what a client may send.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// Time from the first byte of a request to its last header byte; slower clients are cut.
    pub header_read_timeout_ms: u64,
    /// Time to receive the whole request body once the headers are in (408 past it).
    pub body_read_timeout_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: 32 << 20,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 60_000,
        }
    }
}

/// `[upstream]`: how warmpath talks to backends.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP (and TLS) connect timeout.
    pub connect_timeout_ms: u64,
    /// Longest silence between two reads from a backend: it bounds the wait for the first
    /// token and every gap in a stream, never a stream's total length.
    pub idle_timeout_ms: u64,
    /// How long an idle pooled connection is kept; keep it below the backends' keep-alive
    /// (uvicorn-based servers close idle connections after 5 s).
    pub pool_idle_timeout_ms: u64,
    /// Timeout of one `GET /v1/models` fan-out call.
    pub models_timeout_ms: u64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 2_000,
            idle_timeout_ms: 300_000,
            pool_idle_timeout_ms: 4_000,
            models_timeout_ms: 2_000,
        }
    }
}

/// `[health]`: active checks and passive ejection.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Active checks on; off leaves only passive ejection.
    pub enabled: bool,
    /// Path probed with `GET`; any 2xx is healthy.
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive failed probes that mark a backend down.
    pub unhealthy_threshold: u32,
    /// Consecutive good probes that mark a down backend up again.
    pub healthy_threshold: u32,
    /// Consecutive failed requests (connect errors, 5xx, timeouts) that eject a backend.
    pub eject_after_failures: u32,
    /// First ejection length; each further ejection doubles it, up to `max_ejection_ms`.
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            enabled: true,
            path: "/health".to_owned(),
            interval_ms: 2_000,
            timeout_ms: 1_000,
            unhealthy_threshold: 2,
            healthy_threshold: 1,
            eject_after_failures: 3,
            base_ejection_ms: 5_000,
            max_ejection_ms: 120_000,
        }
    }
}

/// `[retry]`: one more try on another backend when nothing has reached the client yet.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Most tries per request, the first included (1 turns retries off).
    pub max_attempts: u32,
    /// Retries may add at most this fraction of requests on top.
    pub budget_ratio: Ratio,
    /// Retries always allowed per second regardless of the ratio (so a quiet proxy can retry).
    pub min_retries_per_sec: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig { max_attempts: 2, budget_ratio: Ratio(0.2), min_retries_per_sec: 5 }
    }
}

/// `[log]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A `tracing` filter (`info`, `warmpath=debug,pingora=warn`); `RUST_LOG` overrides it.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: LogFormat::Text, level: "info".to_owned() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// `[[pools]]`: a set of interchangeable backends serving some models.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    pub name: String,
    /// Model names routed here; `"*"` takes every model no other pool names.
    pub models: Vec<String>,
    #[serde(default)]
    pub policy: PolicyKind,
    /// Requests one backend may have in flight; past it the backend is skipped, and when every
    /// backend is full the client gets 429.
    #[serde(default = "default_max_inflight")]
    pub max_inflight_per_backend: usize,
    /// How `/v1/responses` (HTTP and WebSocket) reaches the backends.
    #[serde(default)]
    pub responses: ResponsesMode,
    /// Translated Responses turns go out as token-id completions where the pool renders
    /// prompts exactly as its backends (the bundled engine's tokenizer and template, tools not
    /// deferred): only the new items are rendered and tokenized.
    #[serde(default = "yes")]
    pub responses_tokens: bool,
    #[serde(default)]
    pub prefix_hash: PrefixHashConfig,
    #[serde(default)]
    pub session: SessionConfig,
    #[serde(default)]
    pub cache_aware: CacheAwareConfig,
    #[serde(default)]
    pub canon: CanonConfig,
    #[serde(default)]
    pub tools: ToolsConfig,
    #[serde(default)]
    pub response_cache: ResponseCacheConfig,
    #[serde(default)]
    pub backends: Vec<BackendConfig>,
    /// Start bundled engine replicas instead of naming backends.
    #[serde(default)]
    pub embedded: Option<EmbeddedConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponsesMode {
    /// warmpath serves the Responses API itself: conversations in its store (`[session]`),
    /// each turn sent to the backends as a Chat Completions request, the answer translated
    /// back. Every OpenAI-compatible backend gets Responses and WebSocket mode.
    #[default]
    Translate,
    /// HTTP requests go to the backends' own `/v1/responses` as they are (backends that store
    /// responses themselves); WebSocket mode is not offered for the pool.
    Native,
}

fn yes() -> bool {
    true
}

fn default_max_inflight() -> usize {
    256
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    #[default]
    RoundRobin,
    LeastLoad,
    PrefixHash,
    Session,
    CacheAware,
}

/// `[pools.prefix_hash]`: consistent hashing with bounded load.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixHashConfig {
    /// Leading prefix blocks that form the key (the chained hash of the last of them).
    pub prefix_blocks: usize,
    /// A backend takes a key only while its in-flight count stays within this factor of the
    /// pool's mean (the "c" of consistent hashing with bounded loads).
    pub load_factor: f64,
    /// Points per unit of weight on the hash ring.
    pub vnodes: usize,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        PrefixHashConfig { prefix_blocks: 64, load_factor: 1.25, vnodes: 160 }
    }
}

/// `[pools.cache_aware]`: lowest estimated time to first token, from a prefix index of what
/// each backend holds and each backend's queued work.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareConfig {
    /// Where the index learns what each backend holds.
    pub mode: IndexMode,
    /// Blocks each backend holds in the index before its LRU evicts, until its
    /// `vllm:cache_config_info` says how many it really has.
    pub capacity_blocks: usize,
    /// Approximate entries not touched for this long are dropped (0: only the LRU evicts).
    pub ttl_s: u64,
    /// A running request's weight in the cost, in prompt tokens (decoding slows prefill).
    pub decode_cost_tokens: u64,
    /// Weight of a prompt token the backend does not hold against a queued one: above 1, a
    /// prompt stays on its holder while the holder's queue is shorter than this many times the
    /// recomputation elsewhere (fewer copies of a prefix leave more cache for the rest). Scaled
    /// by the share of the prompt that is held and divided by how many requests lately shared
    /// that prefix: `1 + (miss_weight - 1) × held / prompt / max(1, n)`.
    pub miss_weight: f64,
    /// Backends whose cost is within this many tokens of the best are equally good; ties go
    /// to the one holding most, then by rendezvous hashing on the prompt's block `spread_blocks`
    /// past the longest prefix any backend holds.
    pub tie_tokens: u64,
    /// Among ties, the backend sent the least prefill work lately wins; "lately" decays with
    /// this time constant, in seconds.
    pub work_window_s: f64,
    pub spread_blocks: usize,
    /// A conversation stays on its backend (session keys: `previous_response_id`,
    /// `x-session-id`, `prompt_cache_key`, `user`) until that backend's in-flight count exceeds
    /// this factor of the pool's mean (plus one), or it is down.
    pub overload_factor: f64,
    /// A backend above this × the mean in-flight count (plus one) takes no new request while
    /// another is below it (bounded load).
    pub balance_factor: f64,
    /// How long a session remembers its backend.
    pub session_ttl_s: u64,
    /// How often each backend's `/metrics` is read for its load and KV capacity (0: never).
    pub scrape_interval_ms: u64,
    /// Precise mode: a backend whose events have been silent this long while it served
    /// requests falls back to approximate tracking until they resume.
    pub event_timeout_ms: u64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            mode: IndexMode::Approximate,
            capacity_blocks: 65_536,
            ttl_s: 0,
            decode_cost_tokens: 32,
            miss_weight: 8.0,
            tie_tokens: 64,
            work_window_s: 10.0,
            spread_blocks: 2,
            overload_factor: 1.5,
            balance_factor: 3.0,
            session_ttl_s: 600,
            scrape_interval_ms: 1000,
            event_timeout_ms: 5000,
        }
    }
}

/// `[pools.response_cache]`: complete responses of deterministic requests (temperature 0 or a
/// fixed seed, one choice), served again to the same request without a backend.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponseCacheConfig {
    pub enabled: bool,
    /// Memory for cached responses, in MiB.
    pub max_mib: u64,
    /// Largest response kept, in KiB; larger ones are served and not kept.
    pub max_entry_kib: u64,
    /// Seconds a response is served from the cache after it was stored.
    pub ttl_s: u64,
    /// One cache for every caller; by default each API key (`Authorization` header) has its own,
    /// so that no caller learns what another asked.
    pub shared: bool,
}

impl Default for ResponseCacheConfig {
    fn default() -> Self {
        ResponseCacheConfig { enabled: false, max_mib: 256, max_entry_kib: 1024, ttl_s: 300, shared: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexMode {
    /// What warmpath routed where.
    Approximate,
    /// The backends' KV events (embedded engines with `kv_events = true`, or vLLM's
    /// `--kv-events-config`).
    Precise,
}

/// `[pools.canon]`: stable prefixes. Requests are rewritten into their canonical arrangement
/// (tools by name with sorted keys, volatile system-prompt lines moved behind the prefix) and
/// their prompt is cut into prefix blocks whose hashes are the routing key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CanonConfig {
    /// Rewrite requests; off sends them as the client wrote them (block hashes are still
    /// computed where the policy routes by prefix).
    pub enabled: bool,
    /// Tools in name order, keys sorted at every depth, compact JSON.
    pub sort_tools: bool,
    /// Built-in volatile-line rules in force.
    pub volatile: Vec<BuiltinRule>,
    /// Your own volatile-line rules.
    pub rules: Vec<RuleConfig>,
    /// Longest line a rule moves, in bytes; a longer line is content, not a stamp, and stays.
    pub max_moved_line_bytes: usize,
    /// Role of the message that carries the moved lines, placed after the last message.
    pub note_role: NoteRole,
    /// Tokenizer of the prefix blocks.
    pub tokenizer: TokenizerKind,
    /// The backends' model's Hugging Face `tokenizer.json` (relative to the policy file's
    /// directory); takes the place of `tokenizer`.
    pub tokenizer_file: Option<PathBuf>,
    /// Its chat template: a `.jinja` file or a `tokenizer_config.json`. By default the one beside
    /// `tokenizer_file` (`chat_template.jinja`, else `tokenizer_config.json`), else the built-in
    /// ChatML layout.
    pub chat_template: Option<PathBuf>,
    /// The two above, loaded when the policy file is.
    #[serde(skip)]
    pub external: Option<External>,
    /// Tokens per prefix block (the backends' KV block size).
    pub block_size: usize,
    /// Bytes per block where no tokenizer is known.
    pub chunk_bytes: usize,
    /// Memory for cached token ids of recurring prompt chunks, in MiB.
    pub token_cache_mib: u64,
}

impl Default for CanonConfig {
    fn default() -> Self {
        CanonConfig {
            enabled: false,
            sort_tools: true,
            volatile: vec![BuiltinRule::Date, BuiltinRule::Time, BuiltinRule::RequestId],
            rules: Vec::new(),
            max_moved_line_bytes: 200,
            note_role: NoteRole::System,
            tokenizer: TokenizerKind::Auto,
            tokenizer_file: None,
            chat_template: None,
            external: None,
            block_size: 16,
            chunk_bytes: 64,
            token_cache_mib: 64,
        }
    }
}

/// `[pools.tools]`: deferred tool discovery (needs `[pools.canon] enabled = true`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ToolsConfig {
    /// Replace the tools beyond the core set with `tool_search` when there are many.
    pub defer: bool,
    /// Defer only when a request carries more tools than this.
    pub threshold: usize,
    /// Tools never deferred.
    pub core: Vec<String>,
    /// Most definitions one `tool_search` call loads.
    pub search_limit: usize,
    /// Most `tool_search` rounds warmpath answers within one client request.
    pub max_search_rounds: usize,
    /// Longest one-line summary of a deferred tool in the `tool_search` description.
    pub summary_chars: usize,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        ToolsConfig {
            defer: false,
            threshold: 32,
            core: Vec::new(),
            search_limit: 5,
            max_search_rounds: 3,
            summary_chars: 80,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinRule {
    /// `2026-12-03`, `12/03/2026`, `Dec 3, 2026`, `3 December 2026`.
    Date,
    /// `10:42:07`, `10:42 PM`, `T10:42`, Unix timestamps.
    Time,
    /// UUIDs and `request id:`-style labels.
    RequestId,
}

/// `[[pools.canon.rules]]`: lines of the system prompt matching `pattern` move behind the prefix.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// The `rule` label of the moved-bytes metric.
    pub name: String,
    pub pattern: Pattern,
    #[serde(default = "yes")]
    pub enabled: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NoteRole {
    System,
    Developer,
    User,
}

/// An external model's tokenizer and chat template, loaded from `tokenizer_file` and
/// `chat_template`.
#[derive(Debug, Clone)]
pub struct External {
    pub tokenizer: warmpath_wire::tokenizer::Tokenizer,
    /// `None`: the built-in ChatML layout.
    pub template: Option<Arc<ChatTemplate>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// `wp32k` for embedded pools (the bundled engine's tokenizer), `none` otherwise.
    Auto,
    /// The bundled engine's tokenizer and chat template.
    Wp32k,
    /// Fixed-size byte chunks of the canonical prompt text.
    None,
}

/// `[pools.session]`: sticky routing by a session key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionConfig {
    /// A sticky backend is left for the next one when its in-flight count exceeds this factor
    /// of the pool's mean (plus one), or when it is down or full.
    pub overload_factor: f64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig { overload_factor: 2.0 }
    }
}

/// `[[pools.backends]]`: one OpenAI-compatible server.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub name: String,
    pub url: BackendUrl,
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Its KV event publisher (vLLM `--kv-events-config` endpoint), e.g. `tcp://10.0.0.5:5557`.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its KV event replay socket (vLLM's `replay_endpoint`), e.g. `tcp://10.0.0.5:5558`: after
    /// a reconnect or a gap in the sequence, the batches missed are asked for there.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
}

fn default_weight() -> u32 {
    1
}

/// `[pools.embedded]`: bundled `warmpath-engine` replicas started in-process on loopback.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddedConfig {
    pub replicas: usize,
    /// `micro`, `tiny`, or a llama2.c checkpoint path.
    pub model: String,
    pub executor: EmbeddedExecutor,
    pub kv_blocks: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// Publish KV events (ZMQ) from each replica, for routers that read them.
    pub kv_events: bool,
}

impl Default for EmbeddedConfig {
    fn default() -> Self {
        EmbeddedConfig {
            replicas: 2,
            model: "tiny".to_owned(),
            executor: EmbeddedExecutor::Llama,
            kv_blocks: 1024,
            max_num_seqs: 16,
            max_model_len: 4096,
            kv_events: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbeddedExecutor {
    /// The llama forward pass on the CPU.
    Llama,
    /// The timing model (no math).
    Sim,
}
