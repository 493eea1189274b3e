//! The proxy's Prometheus metrics, in one registry owned by the process (not the global one,
//! so tests and embedded engines never collide). Every metric is listed in `docs/metrics.md`.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Latency buckets (seconds) from 1 ms to 5 min: proxies see both cached 10 ms replies and
/// minutes-long generations.
const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

#[derive(Debug, Clone)]
pub struct Metrics {
    pub(super) registry: Registry,
    /// `route`, `backend`, `status` (the status the client got; `backend` is `none` when no
    /// backend was reached).
    pub requests: IntCounterVec,
    /// `route`: accept → last byte to the client.
    pub request_duration: HistogramVec,
    /// `route`: accept → first body byte from the backend to the client.
    pub ttft: HistogramVec,
    /// `pool`, `backend`.
    pub inflight: IntGaugeVec,
    /// `pool`, `backend`: 1 while the backend takes traffic.
    pub backend_up: IntGaugeVec,
    /// `pool`, `policy`, `reason`.
    pub routing_decisions: IntCounterVec,
    /// `pool`: bytes held by the `cache_aware` prefix index.
    pub index_bytes: IntGaugeVec,
    /// `pool`, `backend`: blocks the index says the backend holds.
    pub index_blocks: IntGaugeVec,
    /// `pool`, `backend`: the backend's KV capacity in index blocks (from its metrics).
    pub index_capacity: IntGaugeVec,
    /// `pool`: prompt units (bytes without a tokenizer) per backend token.
    pub index_units_per_token: GaugeVec,
    /// `pool`, `backend`, `result` (`ok`, `fail`): reads of backends' `/metrics`.
    pub load_scrapes: IntCounterVec,
    /// `pool`, `backend`, `kind` (`stored`, `removed` blocks; `cleared`; `malformed` batches).
    pub kv_events: IntCounterVec,
    /// `pool`, `backend`: sequence gaps and restarts (a restart drops the backend's entries).
    pub kv_event_gaps: IntCounterVec,
    /// `pool`, `backend`: 1 while its KV events drive the index, 0 while tracked approximately.
    pub kv_events_live: IntGaugeVec,
    /// `pool`, `backend`: event batches recovered from the backend's replay socket.
    pub kv_events_replayed: IntCounterVec,
    /// `pool`, `reason` (`connect`, `status_5xx`, `timeout`, `io`).
    pub retries: IntCounterVec,
    /// `pool`: a retry was wanted but the retry budget was spent.
    pub retry_budget_exhausted: IntCounterVec,
    /// Prefill/decode disaggregation.
    pub disagg: super::disagg::DisaggMetrics,
    /// `pool`, `backend`.
    pub ejections: IntCounterVec,
    /// `backend`, `kind` (`connect`, `timeout`, `status_5xx`, `io`, `stream_cut`).
    pub upstream_errors: IntCounterVec,
    /// `reason` (`model_not_found`, `bad_request`, `too_large`, `no_backend`, `overloaded`, ...):
    /// requests answered by warmpath itself with an error.
    pub rejections: IntCounterVec,
    /// Safety checks run, by pool, check, stage (input/output) and verdict.
    pub safety_checks: IntCounterVec,
    /// Safety findings, by pool, check, category and the action taken.
    pub safety_findings: IntCounterVec,
    /// Time a safety check took, by check.
    pub safety_check_seconds: HistogramVec,
    /// Safety checks that failed or ran out of time, by pool, check, stage and kind.
    pub safety_check_errors: IntCounterVec,
    /// Turns the input checks judged or knew had passed; answers remembered as passed.
    pub safety_turns: IntCounterVec,
    /// Time a window of output was held waiting for its verdict, by pool and release policy.
    pub safety_output_held_seconds: HistogramVec,
    /// Clients that went away before their response was complete.
    pub client_disconnects: IntCounter,
    /// Request body sizes, bytes.
    pub request_bytes: Histogram,
    /// `pool`, `backend`, `result` (`ok`, `fail`): active health probes.
    pub health_checks: IntCounterVec,
    /// Build information, value 1, label `version`.
    pub build_info: IntGaugeVec,
    /// In-flight requests in the whole proxy.
    pub inflight_total: IntGauge,
    /// `pool`, `edit` (`tools_reordered`, `volatile_moved`): requests canonicalization changed.
    pub canon_edits: IntCounterVec,
    /// `pool`, `rule`: bytes of volatile lines moved behind the prefix.
    pub canon_moved_bytes: IntCounterVec,
    /// `pool`: canonicalization and block hashing time per request.
    pub canon_duration: HistogramVec,
    /// `pool`: prompt tokens of requests cut into token blocks.
    pub prompt_tokens: HistogramVec,
    /// `pool`, `result` (`hit`, `miss`): token-cache lookups of prompt chunks.
    pub token_cache_lookups: IntCounterVec,
    /// `pool`: bytes held by the token cache.
    pub token_cache_bytes: IntGaugeVec,
    /// `pool`: tool schemas replaced by `tool_search`.
    pub tools_deferred: IntCounterVec,
    /// `pool`: prompt bytes those schemas would have taken (less the search tool's).
    pub tools_saved_bytes: IntCounterVec,
    /// `pool`: prompt tokens of the same (pools with a known tokenizer).
    pub tools_saved_tokens: IntCounterVec,
    /// `pool`: searches put back into histories before calls to deferred tools.
    pub tools_reinserted: IntCounterVec,
    /// `pool`, `result` (`found`, `empty`): `tool_search` calls warmpath answered.
    pub tool_searches: IntCounterVec,
    /// `pool`: tool definitions those searches loaded.
    pub tools_loaded: IntCounterVec,
    /// `pool`: time to answer a search round and write the next request.
    pub tool_search_duration: HistogramVec,
    /// `pool`, `result` (`hit`, `miss`, `bypass`): requests to a pool with a response cache.
    pub response_cache_requests: IntCounterVec,
    /// `pool`, `outcome` (`stored`, `too_large`, `incomplete`): answers to cache misses.
    pub response_cache_stores: IntCounterVec,
    /// `pool`: bytes held by the response cache.
    pub response_cache_bytes: IntGaugeVec,
    /// `pool`: answers held by the response cache.
    pub response_cache_entries: IntGaugeVec,
    /// `transport` (`http`, `websocket`), `outcome` (`completed`, `incomplete`, `failed`,
    /// `error`): Responses turns warmpath translated.
    pub responses_turns: IntCounterVec,
    /// `op` (`get`, `put`), `result` (`ok`, `error`): conversation store calls that reached it.
    pub session_store_ops: IntCounterVec,
    /// Bytes and entries of the in-memory conversation store.
    pub session_store_bytes: IntGaugeVec,
    /// Open WebSocket connections.
    pub ws_connections: IntGaugeVec,
    /// `code`: WebSocket connections closed, by close code.
    pub ws_closed: IntCounterVec,
    /// `direction` (`in`, `out`): WebSocket message payload bytes.
    pub ws_bytes: IntCounterVec,
    /// `key` (its name), `outcome` (`admitted`, `limited`, `forbidden`): requests per API key.
    pub key_requests: IntCounterVec,
    /// `key`, `kind` (`prompt`, `completion`): tokens per API key, from the answers' usage.
    pub key_tokens: IntCounterVec,
    /// `key`, `limit` (`requests`, `tokens`, `concurrent`, `websockets`, `daily`): requests
    /// and WebSocket upgrades refused by a limit.
    pub key_limited: IntCounterVec,
    /// Keys in the keys file as last loaded.
    pub auth_keys: IntGauge,
    /// `use` (`sessions`, `keys`, `limits`): Redis calls that failed (an error or past
    /// `[redis] timeout_ms`).
    pub redis_errors: IntCounterVec,
    /// `limit` (`requests`, `websockets`): admissions decided by this replica's own counts
    /// because the fleet's (`limits_store = "redis"`) could not be reached.
    pub limits_fail_open: IntCounterVec,
    /// Bytes of request bodies and unfinished WebSocket messages held.
    pub buffered_bytes: IntGauge,
    /// Open connections on the API listener.
    pub connections_open: IntGauge,
    /// Connections shed because `[limits] max_connections` were open.
    pub connections_rejected: IntCounter,
    /// `result` (`ok`, `error`): policy reloads.
    pub config_reloads: IntCounterVec,
    /// `sha256` (its first 16 hex digits): 1 for the policy file being served.
    pub config_info: IntGaugeVec,
    /// `result`: backend host names looked up (ok, or error: the last addresses kept).
    pub dns_lookups: IntCounterVec,
    /// Rebuilds of the fleet because a backend name's addresses changed.
    pub dns_updates: IntCounter,
    /// `pool`: routing decisions that used ejected backends because every backend whose probes
    /// pass was ejected.
    pub ejection_overrides: IntCounterVec,
    /// `pool`: requests waiting for a backend slot.
    pub queue_depth: IntGaugeVec,
    /// `pool`: how long queued requests waited (served or not).
    pub queue_wait: HistogramVec,
    /// `pool`, `reason` (`full`, `timeout`): queued requests refused.
    pub queue_rejected: IntCounterVec,
    /// The last routing decisions, refusals and WebSocket ends, for the status page.
    pub recent: std::sync::Arc<super::Recent>,
    /// Where sampled request traces go (`[tracing]`; off by default).
    pub tracer: super::Tracer,
    /// Traces dropped because the export queue was full.
    pub traces_dropped: IntCounter,
    /// `result` (`ok`, `error`): OTLP export calls.
    pub trace_exports: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let histogram = |name: &str, help: &str, labels: &[&str]| {
            let h =
                HistogramVec::new(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()), labels)
                    .expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let int_counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let request_bytes = Histogram::with_opts(
            HistogramOpts::new("warmpath_request_body_bytes", "Request body sizes in bytes.")
                .buckets(prometheus::exponential_buckets(256.0, 4.0, 10).expect("valid buckets")),
        )
        .expect("valid metric");
        registry.register(Box::new(request_bytes.clone())).expect("unique metric");
        let client_disconnects = int_counter(
            "warmpath_client_disconnects_total",
            "Clients that went away before their response was complete.",
        );
        let inflight_total = int_gauge("warmpath_inflight_requests", "Requests in flight in the proxy.");
        let auth_keys =
            int_gauge("warmpath_auth_keys", "API keys as last loaded (from the keys file or Redis).");
        let with_buckets = |name: &str, help: &str, labels: &[&str], buckets: Vec<f64>| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
                .expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let traces_dropped = int_counter(
            "warmpath_traces_dropped_total",
            "Request traces dropped because the OTLP export queue was full.",
        );
        let trace_exports = counter(
            "warmpath_trace_exports_total",
            "OTLP trace export calls, by result (ok, error).",
            &["result"],
        );
        let m = Metrics {
            response_cache_requests: counter(
                "warmpath_response_cache_requests_total",
                "Requests to pools with a response cache, by result (bypass: not deterministic).",
                &["pool", "result"],
            ),
            response_cache_stores: counter(
                "warmpath_response_cache_stores_total",
                "Answers to response-cache misses, by what became of them.",
                &["pool", "outcome"],
            ),
            response_cache_bytes: gauge(
                "warmpath_response_cache_bytes",
                "Bytes held by the response cache.",
                &["pool"],
            ),
            response_cache_entries: gauge(
                "warmpath_response_cache_entries",
                "Answers held by the response cache.",
                &["pool"],
            ),
            responses_turns: counter(
                "warmpath_responses_turns_total",
                "Responses turns warmpath translated to chat, by transport and outcome.",
                &["transport", "outcome"],
            ),
            session_store_ops: counter(
                "warmpath_session_store_ops_total",
                "Conversation store calls, by operation and result.",
                &["op", "result"],
            ),
            session_store_bytes: gauge(
                "warmpath_session_store_bytes",
                "Bytes of conversations held by the in-memory store.",
                &["store"],
            ),
                        ws_connections: gauge(
                "warmpath_websocket_connections",
                "Open Responses WebSocket connections.",
                &["listener"],
            ),
            ws_closed: counter(
                "warmpath_websocket_closed_total",
                "Responses WebSocket connections closed, by close code.",
                &["code"],
            ),
            ws_bytes: counter(
                "warmpath_websocket_message_bytes_total",
                "WebSocket message payload bytes, by direction.",
                &["direction"],
            ),
            canon_edits: counter(
                "warmpath_canon_edits_total",
                "Requests that canonicalization changed, by edit.",
                &["pool", "edit"],
            ),
            canon_moved_bytes: counter(
                "warmpath_canon_moved_bytes_total",
                "Bytes of volatile system-prompt lines moved behind the stable prefix, by rule.",
                &["pool", "rule"],
            ),
            canon_duration: with_buckets(
                "warmpath_canon_duration_seconds",
                "Canonicalization and prefix block hashing time per request.",
                &["pool"],
                prometheus::exponential_buckets(5e-6, 2.0, 16).expect("valid buckets"),
            ),
            prompt_tokens: with_buckets(
                "warmpath_prompt_tokens",
                "Prompt tokens of requests cut into token blocks.",
                &["pool"],
                prometheus::exponential_buckets(64.0, 2.0, 14).expect("valid buckets"),
            ),
            token_cache_lookups: counter(
                "warmpath_token_cache_lookups_total",
                "Token-cache lookups of prompt chunks, by result.",
                &["pool", "result"],
            ),
            token_cache_bytes: gauge(
                "warmpath_token_cache_bytes",
                "Bytes held by the token cache.",
                &["pool"],
            ),
            tools_deferred: counter(
                "warmpath_tools_deferred_total",
                "Tool schemas replaced by tool_search.",
                &["pool"],
            ),
            tools_saved_bytes: counter(
                "warmpath_tools_saved_bytes_total",
                "Prompt bytes of deferred tool schemas, less the tool_search tool's.",
                &["pool"],
            ),
            tools_saved_tokens: counter(
                "warmpath_tools_saved_tokens_total",
                "Prompt tokens of deferred tool schemas, less the tool_search tool's.",
                &["pool"],
            ),
            tools_reinserted: counter(
                "warmpath_tools_reinserted_total",
                "Searches put back into histories before calls to deferred tools.",
                &["pool"],
            ),
            tool_searches: counter(
                "warmpath_tool_searches_total",
                "tool_search calls answered by warmpath, by result.",
                &["pool", "result"],
            ),
            tools_loaded: counter(
                "warmpath_tools_loaded_total",
                "Tool definitions loaded by tool_search answers.",
                &["pool"],
            ),
            tool_search_duration: with_buckets(
                "warmpath_tool_search_duration_seconds",
                "Time to answer a tool_search round and write the next request.",
                &["pool"],
                prometheus::exponential_buckets(5e-6, 2.0, 16).expect("valid buckets"),
            ),
            requests: counter(
                "warmpath_requests_total",
                "Requests by route, backend and the status the client got.",
                &["route", "backend", "status"],
            ),
            request_duration: histogram(
                "warmpath_request_duration_seconds",
                "Request arrival to the last byte sent to the client.",
                &["route", "pool", "backend"],
            ),
            ttft: histogram(
                "warmpath_ttft_seconds",
                "Request arrival to the first response body byte sent to the client.",
                &["route", "pool", "backend"],
            ),
            inflight: gauge(
                "warmpath_backend_inflight",
                "Requests in flight per backend.",
                &["pool", "backend"],
            ),
            backend_up: gauge(
                "warmpath_backend_up",
                "1 while a backend takes traffic (healthy and not ejected).",
                &["pool", "backend"],
            ),
            routing_decisions: counter(
                "warmpath_routing_decisions_total",
                "Routing decisions by pool, policy and reason.",
                &["pool", "policy", "reason"],
            ),
            index_bytes: gauge(
                "warmpath_prefix_index_bytes",
                "Memory held by the cache_aware prefix index, in bytes.",
                &["pool"],
            ),
            index_blocks: gauge(
                "warmpath_prefix_index_blocks",
                "Prefix blocks the cache_aware index says each backend holds.",
                &["pool", "backend"],
            ),
            index_capacity: gauge(
                "warmpath_prefix_index_capacity_blocks",
                "Each backend's KV capacity in index blocks, from its vllm:cache_config_info.",
                &["pool", "backend"],
            ),
            index_units_per_token: {
                let g = GaugeVec::new(
                    Opts::new(
                        "warmpath_prefix_index_units_per_token",
                        "Prompt units per backend token in a cache_aware pool: 1 with the backends' tokenizer, else bytes per token learnt from vllm:prompt_tokens_total.",
                    ),
                    &["pool"],
                )
                .expect("valid metric");
                registry.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            load_scrapes: counter(
                "warmpath_backend_load_scrapes_total",
                "Reads of backends' /metrics for cache_aware load, by result.",
                &["pool", "backend", "result"],
            ),
            kv_events: counter(
                "warmpath_kv_events_total",
                "KV events applied to the prefix index: blocks stored and removed, caches cleared, malformed batches.",
                &["pool", "backend", "kind"],
            ),
            kv_event_gaps: counter(
                "warmpath_kv_event_gaps_total",
                "Lost KV events (sequence gaps and publisher restarts; a restart drops the backend's index entries).",
                &["pool", "backend"],
            ),
            kv_events_replayed: counter(
                "warmpath_kv_events_replayed_total",
                "KV event batches recovered from backends' replay sockets (after a reconnect or a gap).",
                &["pool", "backend"],
            ),
            kv_events_live: gauge(
                "warmpath_kv_events_live",
                "1 while a backend's KV events drive the prefix index (precise), 0 while it is tracked approximately.",
                &["pool", "backend"],
            ),
            retries: counter("warmpath_retries_total", "Retries on another backend.", &["pool", "reason"]),
            retry_budget_exhausted: counter(
                "warmpath_retry_budget_exhausted_total",
                "Retries not made because the retry budget was spent.",
                &["pool"],
            ),
            disagg: super::disagg::DisaggMetrics::register(&registry, LATENCY_BUCKETS),
            ejections: counter(
                "warmpath_backend_ejections_total",
                "Passive ejections after consecutive failures.",
                &["pool", "backend"],
            ),
            upstream_errors: counter(
                "warmpath_upstream_errors_total",
                "Failures talking to a backend, by kind.",
                &["backend", "kind"],
            ),
            rejections: counter(
                "warmpath_rejections_total",
                "Requests answered with an error by warmpath itself, by reason.",
                &["reason"],
            ),
            safety_checks: counter(
                "warmpath_safety_checks_total",
                "Safety checks run, by verdict (pass, block, audit_block: would have blocked in audit mode).",
                &["pool", "check", "stage", "verdict"],
            ),
            safety_findings: counter(
                "warmpath_safety_findings_total",
                "Safety findings, by category and the action taken (block, log, audit).",
                &["pool", "check", "category", "action"],
            ),
            safety_check_seconds: with_buckets(
                "warmpath_safety_check_seconds",
                "Time a safety check took.",
                &["check"],
                prometheus::exponential_buckets(1e-6, 4.0, 12).expect("valid buckets"),
            ),
            safety_check_errors: counter(
                "warmpath_safety_check_errors_total",
                "Safety checks that failed (kind error) or ran out of time (kind timeout); on_error decided.",
                &["pool", "check", "stage", "kind"],
            ),
            safety_turns: counter(
                "warmpath_safety_turns_total",
                "Conversation turns by stage: judged by the checks (checked), or known to have passed before (known).",
                &["pool", "stage", "outcome"],
            ),
            safety_output_held_seconds: with_buckets(
                "warmpath_safety_output_held_seconds",
                "Time a window of output was held back waiting for its safety verdict.",
                &["pool", "release"],
                prometheus::exponential_buckets(1e-6, 4.0, 12).expect("valid buckets"),
            ),
            health_checks: counter(
                "warmpath_health_checks_total",
                "Active health probes by result.",
                &["pool", "backend", "result"],
            ),
            build_info: gauge("warmpath_build_info", "Build information (value 1).", &["version"]),
            key_requests: counter(
                "warmpath_key_requests_total",
                "Requests per API key name: admitted, limited (429) or forbidden (403: a model the key may not use).",
                &["key", "outcome"],
            ),
            key_tokens: counter(
                "warmpath_key_tokens_total",
                "Tokens per API key name, from the answers' usage (prompt, completion).",
                &["key", "kind"],
            ),
            key_limited: counter(
                "warmpath_key_limited_total",
                "Requests and WebSocket upgrades refused by a per-key limit, by the limit.",
                &["key", "limit"],
            ),
            auth_keys,
            redis_errors: counter(
                "warmpath_redis_errors_total",
                "Redis calls that failed (an error, or no answer within [redis] timeout_ms), by what they were for: sessions, keys, limits.",
                &["use"],
            ),
            buffered_bytes: int_gauge("warmpath_buffered_bytes", "Bytes of request bodies and unfinished WebSocket messages held ([limits] max_buffered_mib bounds them)."),
            connections_open: int_gauge("warmpath_connections_open", "Open connections on the API listener ([limits] max_connections bounds them)."),
            connections_rejected: int_counter("warmpath_connections_rejected_total", "API connections shed (503, or a health probe answered) because [limits] max_connections were open."),
            dns_lookups: counter(
                "warmpath_dns_lookups_total",
                "Backend host names looked up again ([upstream] dns_refresh_s, reloads), by result: ok, or error (the last addresses are kept).",
                &["result"],
            ),
            dns_updates: int_counter("warmpath_dns_updates_total", "Fleet rebuilds because a backend host name's addresses changed (backends at unchanged addresses keep their state)."),
            ejection_overrides: counter(
                "warmpath_ejection_overrides_total",
                "Routing decisions that used ejected backends because every backend of the pool whose probes pass was ejected (panic routing).",
                &["pool"],
            ),
            config_reloads: counter(
                "warmpath_config_reloads_total",
                "Policy reloads (SIGHUP, POST /reload, --watch), by result: ok, or error (the old policy keeps serving).",
                &["result"],
            ),
            config_info: gauge(
                "warmpath_config_info",
                "The policy file being served: 1, labelled with the first 16 hex digits of its SHA-256.",
                &["sha256"],
            ),
            queue_depth: gauge(
                "warmpath_queue_depth",
                "Requests waiting for a backend slot (every backend of the pool at max_inflight_per_backend).",
                &["pool"],
            ),
            queue_wait: histogram(
                "warmpath_queue_wait_seconds",
                "How long requests waited in a pool's queue for a backend slot.",
                &["pool"],
            ),
            queue_rejected: counter(
                "warmpath_queue_rejected_total",
                "Requests refused by a pool's queue: full (max_queued) or timeout (queue_timeout_ms).",
                &["pool", "reason"],
            ),
            limits_fail_open: counter(
                "warmpath_limits_fail_open_total",
                "Admissions decided by this replica's own counts because the fleet's limits in Redis could not be reached (limits_on_error = open).",
                &["limit"],
            ),
            client_disconnects,
            request_bytes,
            inflight_total,
            registry,
            recent: Default::default(),
            tracer: Default::default(),
            traces_dropped,
            trace_exports,
        };
        m.build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        m
    }

    /// Drops the gauges of a backend that is gone from `pool` (a reload removed it, or its
    /// address went away): a series left behind would show it up and idle forever. Its
    /// counters stay, as counters of a finished process would.
    pub fn forget_backend(&self, pool: &str, backend: &str) {
        for g in
            [&self.inflight, &self.backend_up, &self.index_blocks, &self.index_capacity, &self.kv_events_live]
        {
            let _ = g.remove_label_values(&[pool, backend]);
        }
    }

    /// A request warmpath answered with an error itself: counted by `reason`
    /// (`warmpath_rejections_total`) and kept among the recent events.
    pub fn refused(&self, reason: &str) {
        self.rejections.with_label_values(&[reason]).inc();
        self.recent.push("refused", "", "", reason, String::new());
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
