//! The proxy's Prometheus metrics, in one registry owned by the process (not the global one,
//! so tests and embedded engines never collide). Every metric is listed in `docs/metrics.md`.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Latency buckets (seconds) from 1 ms to 5 min: proxies see both cached 10 ms replies and
/// minutes-long generations.
const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
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
    /// `pool`, `reason` (`connect`, `status_5xx`, `timeout`, `io`).
    pub retries: IntCounterVec,
    /// `pool`: a retry was wanted but the retry budget was spent.
    pub retry_budget_exhausted: IntCounterVec,
    /// `pool`, `backend`.
    pub ejections: IntCounterVec,
    /// `backend`, `kind` (`connect`, `timeout`, `status_5xx`, `io`, `stream_cut`).
    pub upstream_errors: IntCounterVec,
    /// `reason` (`model_not_found`, `bad_request`, `too_large`, `no_backend`, `overloaded`, ...):
    /// requests answered by warmpath itself with an error.
    pub rejections: IntCounterVec,
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
        let request_bytes = Histogram::with_opts(
            HistogramOpts::new("warmpath_request_body_bytes", "Request body sizes in bytes.")
                .buckets(prometheus::exponential_buckets(256.0, 4.0, 10).expect("valid buckets")),
        )
        .expect("valid metric");
        registry.register(Box::new(request_bytes.clone())).expect("unique metric");
        let client_disconnects = IntCounter::new(
            "warmpath_client_disconnects_total",
            "Clients that went away before their response was complete.",
        )
        .expect("valid metric");
        registry.register(Box::new(client_disconnects.clone())).expect("unique metric");
        let inflight_total = IntGauge::new("warmpath_inflight_requests", "Requests in flight in the proxy.")
            .expect("valid metric");
        registry.register(Box::new(inflight_total.clone())).expect("unique metric");
        let m = Metrics {
            requests: counter(
                "warmpath_requests_total",
                "Requests by route, backend and the status the client got.",
                &["route", "backend", "status"],
            ),
            request_duration: histogram(
                "warmpath_request_duration_seconds",
                "Request arrival to the last byte sent to the client.",
                &["route"],
            ),
            ttft: histogram(
                "warmpath_ttft_seconds",
                "Request arrival to the first response body byte sent to the client.",
                &["route"],
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
            retries: counter("warmpath_retries_total", "Retries on another backend.", &["pool", "reason"]),
            retry_budget_exhausted: counter(
                "warmpath_retry_budget_exhausted_total",
                "Retries not made because the retry budget was spent.",
                &["pool"],
            ),
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
            health_checks: counter(
                "warmpath_health_checks_total",
                "Active health probes by result.",
                &["pool", "backend", "result"],
            ),
            build_info: gauge("warmpath_build_info", "Build information (value 1).", &["version"]),
            client_disconnects,
            request_bytes,
            inflight_total,
            registry,
        };
        m.build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        m
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 << 10);
        // Encoding our own registry only fails on invalid metric families, which `new` rules out.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
