//! `[[pools]]`: a set of interchangeable backends, and how it routes, caches and serves.

use serde::Deserialize;

use super::{yes, BackendUrl, CanonConfig, SafetyConfig, ToolsConfig};

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
    /// When every backend is full, a request waits this long for a slot before its 429
    /// (0: no queue).
    #[serde(default = "default_queue_timeout")]
    pub queue_timeout_ms: u64,
    /// Requests waiting at most; one more gets its 429 at once.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// The backends' context length in tokens (vLLM's `--max-model-len`): a request whose
    /// prompt and `max_tokens` cannot fit gets 400 `context_length_exceeded` from warmpath,
    /// where the pool counts tokens exactly. Embedded pools: their `max_model_len`.
    #[serde(default)]
    pub max_model_len: Option<usize>,
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
    pub safety: SafetyConfig,
    /// With API keys: whose requests share the backends' prefix cache.
    #[serde(default)]
    pub tenants: Tenants,
    /// With API keys: whether answers carry `x-warmpath-route`, `x-warmpath-prefix-hash` and
    /// `x-warmpath-backend` (routing details say what is cached; off unless the pool opts in).
    #[serde(default)]
    pub route_headers: bool,
    /// `[pools.disagg]`: which requests go through the prefill backends, where it has any.
    #[serde(default)]
    pub disagg: DisaggConfig,
    #[serde(default)]
    pub backends: Vec<BackendConfig>,
    /// Start bundled engine replicas instead of naming backends.
    #[serde(default)]
    pub embedded: Option<EmbeddedConfig>,
}

fn default_queue_timeout() -> u64 {
    5_000
}

fn default_max_queued() -> usize {
    1024
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tenants {
    /// Each API key's requests are salted apart (`cache_salt`): a key never hits, or learns
    /// of, another key's cached prefixes.
    #[default]
    Key,
    /// Keys of one `group` (the keys file) share; groups are salted apart.
    Group,
    /// Every key shares the cache (cheapest; a key can probe for another's prompts).
    Shared,
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
    /// Weight of a prompt token fetched from another backend's cache (one with `kv_transfer`)
    /// against a queued one: a busy holder's prefix is fetched by a less busy backend when that
    /// costs less than waiting (0: never fetch).
    pub fetch_weight: f64,
    /// Weight of a prompt token loaded from the pool's shared KV tier (backends with
    /// `shared_kv_tier`) against a queued one: a prefix computed on a busy backend is loaded
    /// by a less busy one when that costs less than waiting (0: the tier is not priced).
    pub tier_weight: f64,
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
            fetch_weight: 6.0,
            tier_weight: 2.0,
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
    /// An environment variable holding the backend's own API key: sent as
    /// `Authorization: Bearer …` in place of anything the client sent (the key stays out of
    /// the policy file).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// One backend per address the URL's host name resolves to (a headless Service's pods),
    /// named `NAME@ADDRESS`, following the name as it changes (`[upstream] dns_refresh_s`).
    /// Off: one backend, connecting to the name's first address.
    #[serde(default)]
    pub expand: bool,
    /// What it is sent in prefill/decode disaggregation: `both` (whole requests, and decodes
    /// after a remote prefill where the pool has prefill backends), `decode` (the same; the
    /// name says what it is for), `prefill` (only the prefill half of requests, answered with
    /// vLLM's `kv_transfer_params`).
    #[serde(default)]
    pub role: BackendRole,
    /// Where other replicas fetch this backend's cached K/V (`HOST:PORT`, the bundled engine's
    /// `--kv-transfer-port`): `cache_aware` may send a prompt elsewhere with its prefix fetched
    /// from here instead of recomputed (`fetch_weight`).
    #[serde(default)]
    pub kv_transfer: Option<String>,
    /// Its K/V blocks are written to, and read from, a tier the pool's backends share (the
    /// bundled engine's `--kv-tier-shared`; vLLM with LMCache's remote backend): `cache_aware`
    /// prices a prefix any such backend computed at `tier_weight` a token here, not at its
    /// prefill.
    #[serde(default)]
    pub shared_kv_tier: bool,
}

/// `[pools.disagg]`: prefill/decode disaggregation in a pool with prefill backends.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggConfig {
    /// Prompts shorter than this (in tokens, estimated where the pool does not count them)
    /// are prefilled by the decode backend itself: sending them away costs more than the few
    /// decode steps they slow (as Dynamo's `max_local_prefill_length`).
    pub min_prompt_tokens: usize,
    /// A client's own `kv_transfer_params` go to the backends (a client running its own
    /// disaggregation through warmpath). Off, warmpath removes them: with `do_remote_prefill`
    /// they would make a backend connect wherever they say.
    pub client_params: bool,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig { min_prompt_tokens: 512, client_params: false }
    }
}

/// A backend's part in prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendRole {
    #[default]
    Both,
    Prefill,
    Decode,
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
    /// `[pools.embedded.speculative]`: n-gram speculative decoding (vLLM's speculative config
    /// keys); absent: off unless a request asks (`num_speculative_tokens`).
    pub speculative: Option<warmpath_engine::spec::SpecConfig>,
    /// Of the replicas, how many only prefill (role `prefill`, serving their K/V to the
    /// others, which decode): 0 for none (every replica serves whole requests).
    pub prefill_replicas: usize,
    /// Every replica serves its cached K/V to the others (a transfer port each): `cache_aware`
    /// may then send a prompt to a less busy replica that fetches its prefix.
    pub kv_transfer: bool,
    /// A KV tier every replica shares, in this Redis (`redis://HOST:PORT`): each replica
    /// writes the blocks it computes there and loads what the others computed.
    pub kv_tier_shared: Option<String>,
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
            speculative: None,
            prefill_replicas: 0,
            kv_transfer: false,
            kv_tier_shared: None,
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
