//! The engine's Prometheus metrics under vLLM's names (`vllm:*`, labels `model_name` and
//! `engine`), so that routers and dashboards built for vLLM read the bundled engine unchanged.
//! Each engine has its own registry: several engines can live in one process.

use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, Opts, Registry, TextEncoder,
};

use crate::scheduler::{FinishTimings, StepStats};

// vLLM's bucket boundaries, per metric (vllm/v1/metrics/loggers.py), so that dashboards and
// alerts built for vLLM read these histograms unchanged.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
/// End to end, queue, prefill and decode times.
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];

/// All metrics of one engine.
pub struct Metrics {
    registry: Registry,
    model_name: String,
    engine: String,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge,
    kv_usage_legacy: Gauge,
    prefix_queries: prometheus::Counter,
    prefix_hits: prometheus::Counter,
    prompt_tokens: prometheus::Counter,
    generation_tokens: prometheus::Counter,
    preemptions: prometheus::Counter,
    busy: prometheus::Counter,
    spec_drafts: prometheus::Counter,
    spec_draft_tokens: prometheus::Counter,
    spec_accepted: prometheus::Counter,
    spec_accepted_per_pos: CounterVec,
    success: CounterVec,
    ttft: prometheus::Histogram,
    itl: prometheus::Histogram,
    e2e: prometheus::Histogram,
    queue: prometheus::Histogram,
    prefill: prometheus::Histogram,
    decode: prometheus::Histogram,
    /// Prefill/decode K/V transfers ([`crate::kv_transfer`]).
    pub transfer: crate::kv_transfer::TransferMetrics,
    /// The replica's own KV tiers (host memory, disk) ([`crate::kv_tier`]).
    pub tiers: crate::kv_tier::TierMetrics,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new(
        model_name: &str,
        engine: &str,
        block_size: usize,
        num_blocks: usize,
        prefix_caching: bool,
    ) -> Metrics {
        Self::build(model_name, engine, block_size, num_blocks, prefix_caching)
            .expect("metric names and labels are static and valid")
    }

    fn build(
        model_name: &str,
        engine: &str,
        block_size: usize,
        num_blocks: usize,
        prefix_caching: bool,
    ) -> prometheus::Result<Metrics> {
        let registry = Registry::new();
        let labels = ["model_name", "engine"];
        let values = [model_name, engine];
        let gauge = |name: &str, help: &str| -> prometheus::Result<Gauge> {
            let g = GaugeVec::new(Opts::new(name, help), &labels)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g.with_label_values(&values))
        };
        let counter = |name: &str, help: &str| -> prometheus::Result<prometheus::Counter> {
            let c = CounterVec::new(Opts::new(name, help), &labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c.with_label_values(&values))
        };
        let histogram =
            |name: &str, help: &str, buckets: &[f64]| -> prometheus::Result<prometheus::Histogram> {
                let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), &labels)?;
                registry.register(Box::new(h.clone()))?;
                Ok(h.with_label_values(&values))
            };
        let info = GaugeVec::new(
            Opts::new("vllm:cache_config_info", "Information of the KV cache configuration"),
            &["model_name", "engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )?;
        registry.register(Box::new(info.clone()))?;
        info.with_label_values(&[
            model_name,
            engine,
            &block_size.to_string(),
            &num_blocks.to_string(),
            if prefix_caching { "True" } else { "False" },
        ])
        .set(1.0);
        let success = CounterVec::new(
            Opts::new("vllm:request_success_total", "Count of successfully processed requests"),
            &["model_name", "engine", "finished_reason"],
        )?;
        registry.register(Box::new(success.clone()))?;
        let spec_accepted_per_pos = CounterVec::new(
            Opts::new(
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                "Accepted speculative tokens, by position within their proposal",
            ),
            &["model_name", "engine", "position"],
        )?;
        registry.register(Box::new(spec_accepted_per_pos.clone()))?;
        Ok(Metrics {
            tiers: crate::kv_tier::TierMetrics::register(&registry, model_name, engine)?,
            running: gauge("vllm:num_requests_running", "Number of requests in model execution batches")?,
            waiting: gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed")?,
            kv_usage: gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage")?,
            kv_usage_legacy: gauge(
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage (older name of vllm:kv_cache_usage_perc)",
            )?,
            prefix_queries: counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in tokens")?,
            prefix_hits: counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in tokens")?,
            prompt_tokens: counter("vllm:prompt_tokens_total", "Number of prefill tokens processed")?,
            generation_tokens: counter(
                "vllm:generation_tokens_total",
                "Number of generation tokens processed",
            )?,
            preemptions: counter("vllm:num_preemptions_total", "Cumulative number of preemptions")?,
            busy: counter(
                "warmpath_engine_busy_seconds_total",
                "Seconds spent executing scheduler steps (its rate is the engine's busy fraction)",
            )?,
            spec_drafts: counter(
                "vllm:spec_decode_num_drafts_total",
                "Number of speculative proposals verified",
            )?,
            spec_draft_tokens: counter(
                "vllm:spec_decode_num_draft_tokens_total",
                "Number of proposed tokens",
            )?,
            spec_accepted: counter(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Number of accepted proposed tokens",
            )?,
            spec_accepted_per_pos,
            ttft: histogram(
                "vllm:time_to_first_token_seconds",
                "Time to first token in seconds",
                TTFT_BUCKETS,
            )?,
            itl: histogram(
                "vllm:inter_token_latency_seconds",
                "Inter-token latency in seconds",
                ITL_BUCKETS,
            )?,
            e2e: histogram(
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency in seconds",
                REQUEST_LATENCY_BUCKETS,
            )?,
            queue: histogram(
                "vllm:request_queue_time_seconds",
                "Time spent waiting in the queue, in seconds",
                REQUEST_LATENCY_BUCKETS,
            )?,
            prefill: histogram(
                "vllm:request_prefill_time_seconds",
                "Time spent in prefill, in seconds",
                REQUEST_LATENCY_BUCKETS,
            )?,
            decode: histogram(
                "vllm:request_decode_time_seconds",
                "Time spent in decode, in seconds",
                REQUEST_LATENCY_BUCKETS,
            )?,
            success,
            transfer: crate::kv_transfer::TransferMetrics::register(&registry, model_name, engine)?,
            registry,
            model_name: model_name.to_owned(),
            engine: engine.to_owned(),
        })
    }

    /// Gauges after a step.
    pub fn set_state(&self, running: usize, waiting: usize, kv_usage: f64) {
        self.running.set(running as f64);
        self.waiting.set(waiting as f64);
        self.kv_usage.set(kv_usage);
        self.kv_usage_legacy.set(kv_usage);
    }

    /// Blocks held for decode replicas to fetch.
    pub fn set_held_blocks(&self, n: usize) {
        self.transfer.held.set(n as f64);
    }

    pub fn add_stats(&self, s: &StepStats) {
        self.prefix_queries.inc_by(s.prefix_queries as f64);
        self.prefix_hits.inc_by(s.prefix_hits as f64);
        self.tiers.hits.inc_by(s.tier_hit_tokens as f64);
        self.prompt_tokens.inc_by(s.prompt_tokens as f64);
        self.generation_tokens.inc_by(s.generation_tokens as f64);
        self.preemptions.inc_by(s.preemptions as f64);
        self.spec_drafts.inc_by(s.spec_drafts as f64);
        self.spec_draft_tokens.inc_by(s.spec_draft_tokens as f64);
        self.spec_accepted.inc_by(s.spec_accepted_tokens as f64);
        for (pos, &n) in s.spec_accepted_per_pos.iter().enumerate() {
            self.spec_accepted_per_pos
                .with_label_values(&[self.model_name.as_str(), self.engine.as_str(), &pos.to_string()])
                .inc_by(n as f64);
        }
    }

    /// Time one scheduler step took.
    pub fn add_busy(&self, secs: f64) {
        self.busy.inc_by(secs);
    }

    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.observe(secs);
    }

    pub fn observe_itl(&self, secs: f64) {
        self.itl.observe(secs);
    }

    pub fn observe_finished(&self, reason: &str, t: &FinishTimings) {
        self.success.with_label_values(&[self.model_name.as_str(), self.engine.as_str(), reason]).inc();
        self.e2e.observe(t.e2e.as_secs_f64());
        self.queue.observe(t.queue.as_secs_f64());
        self.prefill.observe(t.prefill.as_secs_f64());
        self.decode.observe(t.decode.as_secs_f64());
    }

    /// The Prometheus text exposition.
    /// Where this engine's metrics are registered (for its parts that register their own).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn renders_vllm_names_with_labels() {
        let m = Metrics::new("tiny", "0", 16, 128, true);
        m.set_state(2, 1, 0.25);
        m.add_stats(&StepStats {
            prefix_queries: 100,
            prefix_hits: 40,
            spec_drafts: 3,
            spec_draft_tokens: 9,
            spec_accepted_tokens: 4,
            spec_accepted_per_pos: vec![3, 1],
            ..Default::default()
        });
        let t = FinishTimings {
            queue: Duration::from_millis(1),
            prefill: Duration::from_millis(2),
            decode: Duration::from_millis(3),
            e2e: Duration::from_millis(6),
            generation_tokens: 4,
        };
        m.observe_finished("length", &t);
        let text = m.render();
        for want in [
            r#"vllm:num_requests_running{engine="0",model_name="tiny"} 2"#,
            r#"vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25"#,
            r#"vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 40"#,
            r#"vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1"#,
            r#"vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",model_name="tiny",num_gpu_blocks="128"} 1"#,
            "vllm:e2e_request_latency_seconds_count",
            r#"vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 3"#,
            r#"vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 9"#,
            r#"vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 4"#,
            r#"vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 1"#,
        ] {
            assert!(text.contains(want), "missing {want} in\n{text}");
        }
    }

    #[test]
    fn histograms_use_vllms_buckets_per_metric() {
        let text = Metrics::new("tiny", "0", 16, 128, true).render();
        let les = |name: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.starts_with(&format!("{name}_bucket{{")))
                .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next().map(str::to_owned))
                .collect()
        };
        let ttft = les("vllm:time_to_first_token_seconds");
        assert_eq!((ttft.len(), ttft[0].as_str(), ttft[21].as_str()), (23, "0.001", "2560"), "{ttft:?}");
        let itl = les("vllm:inter_token_latency_seconds");
        assert_eq!((itl.len(), itl[0].as_str(), itl[18].as_str()), (20, "0.01", "80"), "{itl:?}");
        for name in [
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds",
        ] {
            let l = les(name);
            assert_eq!((l.len(), l[0].as_str(), l[20].as_str()), (22, "0.3", "7680"), "{name}: {l:?}");
        }
    }
}
