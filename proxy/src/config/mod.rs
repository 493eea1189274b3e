//! The policy file: what warmpath listens on, which models go to which backend pool, how each
//! pool routes, and the limits and timeouts around it. Every struct denies unknown keys, values
//! are checked as they are parsed where one value suffices (so errors point at it), and
//! [`load`] runs the checks that span several values. Every key is documented in
//! `docs/policies.md`.

mod auth;
mod canon;
mod load;
mod pool;
mod redis;
mod safety;
mod sessions;
mod types;
mod validate;

pub use auth::{AuthConfig, KeyEntry, KeyLimits, KeysFile, KeysStore, LimitsStore, OnRedisError};

pub use canon::{BuiltinRule, CanonConfig, NoteRole, RuleConfig, TokenizerKind, ToolsConfig};
pub use load::{load, locate, parse, ConfigError, Source};
pub use pool::{
    BackendConfig, BackendRole, CacheAwareConfig, DisaggConfig, EmbeddedConfig, EmbeddedExecutor, IndexMode,
    PolicyKind, PoolConfig, PrefixHashConfig, ResponseCacheConfig, ResponsesMode, SessionConfig, Tenants,
};
pub use redis::RedisConfig;
pub use safety::{
    GuardConfig, InputConfig, InputMode, ModerationConfig, OnError, OutputConfig, Refusal, Release,
    RuleAction, RulesConfig, SafetyConfig, Stage, DETECTORS,
};
pub use sessions::{ConversationConfig, StoreKind, WebSocketConfig};
pub use types::{from_env, BackendUrl, Pattern, Ratio, RedisUrl};
pub use validate::{validate, Invalid, PathSeg};

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

/// Most backends one `cache_aware` pool tracks (its prefix index names a backend in 16 bits and
/// samples a fleet this size in microseconds; see `route::index`).
pub const MAX_BACKENDS_PER_POOL: usize = 4096;

/// Longest `[pools.cache_aware] ttl_s`: the prefix index keeps entries' ages modulo 2^16
/// quarter-seconds and needs them below that, which a TTL of at most half of it ensures (see
/// `route::index`).
pub const MAX_INDEX_TTL_S: u64 = 8_000;

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
    pub auth: AuthConfig,
    #[serde(default)]
    pub redis: RedisConfig,
    #[serde(default)]
    pub tracing: TracingConfig,
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
}

/// `[tracing]`: request traces over OTLP (off until an endpoint is set).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP base URL (`http://127.0.0.1:4318`); traces go to
    /// `{otlp_endpoint}/v1/traces`.
    pub otlp_endpoint: Option<String>,
    pub service_name: String,
    /// Share of requests traced (0–1); a client's sampled `traceparent` is always followed.
    pub sample_ratio: f64,
    /// How often queued traces are sent.
    pub export_interval_ms: u64,
    /// Traces held for export at most; more are dropped (`warmpath_traces_dropped_total`).
    pub max_queued_traces: usize,
}

/// Where traces are posted: host, port and path of `{otlp_endpoint}/v1/traces`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpTarget {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl TracingConfig {
    /// The endpoint, read: plain `http://HOST[:PORT][/PATH]` (a collector runs beside
    /// warmpath; TLS to a remote one is the collector's job). `None` when tracing is off.
    pub fn target(&self) -> Option<Result<OtlpTarget, String>> {
        let url = self.otlp_endpoint.as_deref()?;
        let Some(rest) = url.strip_prefix("http://") else {
            return Some(Err(format!("{url:?}: only http:// (send to a local OpenTelemetry Collector)")));
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse::<u16>() {
                Ok(p) => (h, p),
                Err(_) => return Some(Err(format!("{url:?}: bad port {p:?}"))),
            },
            _ => (authority, 4318),
        };
        if host.is_empty() {
            return Some(Err(format!("{url:?}: no host")));
        }
        Some(Ok(OtlpTarget { host: host.to_owned(), port, path: format!("{path}/v1/traces") }))
    }
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            service_name: "warmpath".to_owned(),
            sample_ratio: 1.0,
            export_interval_ms: 1000,
            max_queued_traces: 2048,
        }
    }
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
    /// Let the worker threads take each other's tasks (one tokio runtime for all of them);
    /// off, each thread runs its own single-threaded runtime and keeps the connections it
    /// accepted, as nginx's workers do: less bookkeeping per wake-up.
    pub work_stealing: bool,
    /// Seconds in-flight requests get to finish after SIGTERM.
    pub grace_period_secs: u64,
    /// TLS on the API listener (HTTPS, HTTP/2, `wss://`).
    pub tls: Option<TlsConfig>,
    /// TLS on the admin listener.
    pub admin_tls: Option<TlsConfig>,
}

/// `[server.tls]`, `[server.admin_tls]`: a listener's certificate.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The certificate chain (PEM), relative to the policy file.
    pub cert_file: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// Offer HTTP/2 (ALPN `h2`) beside HTTP/1.1.
    #[serde(default = "yes")]
    pub h2: bool,
    /// How often the files are checked for a new certificate (SIGHUP re-reads at once).
    #[serde(default = "default_tls_reload")]
    pub reload_interval_ms: u64,
    /// Require a client certificate that chains to this CA bundle (PEM): mutual TLS.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

fn default_tls_reload() -> u64 {
    5_000
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: SocketAddr::from(([127, 0, 0, 1], 8081)),
            threads: 2,
            work_stealing: false,
            grace_period_secs: 30,
            tls: None,
            admin_tls: None,
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
    /// Largest request header (request line and every field) in bytes; larger ones get 431.
    pub max_header_bytes: usize,
    /// What a client that half-closes its socket after sending a request gets.
    pub client_half_close: HalfClose,
    /// Seconds an idle kept-alive connection stays open waiting for its next request (nginx's
    /// `keepalive_timeout`); 0 keeps it open without limit.
    pub keepalive_idle_s: u64,
    /// MiB of request bodies and unfinished WebSocket messages the whole process holds at
    /// most; past it requests get 503 and WebSockets close with 1013.
    pub max_buffered_mib: usize,
    /// Open connections the API listener holds at most (WebSockets included); one more is
    /// answered 503 `too_many_connections` and closed. The admin listener is not bounded.
    pub max_connections: usize,
}

/// A client half-closed its connection (sent FIN) while its request is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HalfClose {
    /// Taken as the client leaving: the backend call is cancelled (nginx's 499, and what vLLM
    /// does), so a client that closes its socket frees the GPU at once.
    Cancel,
    /// Answered (RFC 9112 §9.6): the client still reads; a client that is really gone is
    /// noticed when a write to it fails, so a whole answer is computed to the end.
    Answer,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: 32 << 20,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 60_000,
            max_header_bytes: 32 << 10,
            client_half_close: HalfClose::Cancel,
            keepalive_idle_s: 75,
            max_buffered_mib: 1024,
            max_connections: 10_000,
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
    /// `https://` backends: the CA bundle (PEM) their certificates must chain to, in place of
    /// the system's roots.
    pub ca_file: Option<PathBuf>,
    /// `https://` backends that ask for a client certificate (mTLS): warmpath's, and its key.
    pub client_cert_file: Option<PathBuf>,
    pub client_key_file: Option<PathBuf>,
    /// Backends' host names are looked up again this often (seconds; 0: once, when the policy
    /// is loaded). The system resolver gives no TTL: this stands for it (Envoy's
    /// `dns_refresh_rate`, 5 s, as is CoreDNS's TTL for Kubernetes Service records).
    pub dns_refresh_s: u64,
    /// How a streamed answer's segments are acknowledged.
    pub stream_acks: StreamAcks,
}

/// How warmpath acknowledges a streamed answer (`[upstream] stream_acks`). A kept-alive
/// connection is in the kernel's interactive mode, which delays an ACK by up to 40 ms hoping
/// to send it with data; a server that writes without TCP_NODELAY (Nagle's algorithm) holds
/// each small write until the one before is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StreamAcks {
    /// The head is acknowledged at once (the first token is not held), then ACKs are delayed
    /// as the kernel does: against a server without TCP_NODELAY, one later event waits for
    /// the delayed ACK (up to 40 ms), after which the kernel acknowledges at once by itself.
    #[default]
    Head,
    /// Acknowledged at once throughout (the kernel's quick-ACK mode): no event of a server
    /// without TCP_NODELAY waits, at the cost of many more ACK packets (streams measured
    /// 1.05–1.18× the CPU of `head`).
    Quick,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 2_000,
            idle_timeout_ms: 300_000,
            pool_idle_timeout_ms: 4_000,
            models_timeout_ms: 2_000,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            dns_refresh_s: 5,
            stream_acks: StreamAcks::Head,
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

fn yes() -> bool {
    true
}
