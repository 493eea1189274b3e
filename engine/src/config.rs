//! Command-line flags of `warmpath-engine`, which are also its configuration.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::executor::sim::SimTiming;
use crate::faults::FaultConfig;
use crate::model::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExecutorKind {
    /// The llama forward pass on the CPU.
    Llama,
    /// A timing model instead of the math (same scheduler, cache, events and metrics).
    Sim,
}

/// warmpath-engine: an OpenAI-compatible, vLLM-style inference server that runs a llama model
/// on the CPU (or simulates one), with a paged KV cache, prefix caching, continuous batching,
/// chunked prefill, KV events and vLLM's metrics.
#[derive(Debug, Clone, Parser)]
#[command(name = "warmpath-engine", version)]
pub struct EngineArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one; the chosen address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Which executor computes the steps.
    #[arg(long, value_enum, default_value_t = ExecutorKind::Llama)]
    pub executor: ExecutorKind,
    /// `smollm2-135m-instruct` (the real model `scripts/ensure-deps` installs), a GGUF file
    /// (`FILE.gguf`: llama-architecture models, weights kept quantized), `micro` (2.1M params, for
    /// tests) or `tiny` (15M, llama2.c stories15M shape) with seeded dummy weights, or the path of
    /// a llama2.c checkpoint (its vocabulary must fit the built-in 32,000-id tokenizer).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Name the model is served under (default: the --model value, or the checkpoint's stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seed of the dummy weights.
    #[arg(long, default_value_t = 0)]
    pub weight_seed: u64,
    /// Number of KV cache blocks (capacity = kv-blocks × block-size tokens).
    #[arg(long, default_value_t = 1024)]
    pub kv_blocks: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Turn prefix caching off (every prompt is computed in full).
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Token budget of one scheduler step (bounds chunked prefill).
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Longest prompt + output, in tokens.
    #[arg(long, default_value_t = 4096)]
    pub max_model_len: usize,
    /// Publish KV cache events on a ZMQ PUB socket bound here (e.g. tcp://127.0.0.1:5557).
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// Answer replay requests for recent KV event batches on a ZMQ ROUTER socket bound here
    /// (vLLM's `replay_endpoint`: a DEALER sends an empty frame and the 8-byte big-endian first
    /// sequence number; each buffered batch from it comes back as empty frame, sequence number,
    /// payload, and a sequence number of -1 with an empty payload ends the reply).
    #[arg(long, requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Recent KV event batches kept for replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Topic frame of published KV event messages.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Value of the `engine` label on metrics.
    #[arg(long, default_value = "0")]
    pub engine_id: String,
    /// Largest request body accepted, in bytes (413 above).
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Speculative decoding for every request, as vLLM's JSON: `{"method": "ngram",
    /// "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}` (n-gram
    /// prompt lookup; optional `"disable_by_batch_size"`). A request's `num_speculative_tokens`
    /// overrides the count (0: off for it).
    #[arg(long, value_parser = crate::spec::SpecConfig::parse)]
    pub speculative_config: Option<crate::spec::SpecConfig>,
    /// Threads a step's matrix products and attention are split over (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Blocks of a second KV tier in host memory: blocks evicted from the cache are copied
    /// there (least recently used out when full) and a prompt whose prefix continues there
    /// loads them instead of computing them (0: no tier).
    #[arg(long, default_value_t = 0)]
    pub kv_tier_blocks: usize,
    /// A KV tier on local disk, in this directory (a subdirectory per model): what the host
    /// tier drops (or, without one, what the cache evicts) is written there and loaded from
    /// there instead of computed; it is found again after a restart.
    #[arg(long)]
    pub kv_tier_disk: Option<std::path::PathBuf>,
    /// Blocks the disk tier holds at most (least recently used out).
    #[arg(long, default_value_t = 8192)]
    pub kv_tier_disk_blocks: usize,
    /// A KV tier the fleet shares, in Redis (`redis://HOST:PORT[/DB]`): every block computed
    /// here is written there, and a prompt's blocks past this replica's cache that any replica
    /// computed are loaded from there instead of computed. Size it with Redis's `maxmemory`
    /// (and `maxmemory-policy allkeys-lru`).
    #[arg(long)]
    pub kv_tier_shared: Option<String>,
    /// The shared tier's key prefix: replicas share blocks only under the same one (default:
    /// derived from the model's name, the block size and the block's bytes).
    #[arg(long)]
    pub kv_tier_shared_namespace: Option<String>,
    /// Seconds a block stays in the shared tier after it was last written.
    #[arg(long, default_value_t = 3600)]
    pub kv_tier_shared_ttl_s: u64,
    /// Longest wait for the shared tier (dialling, each call), in milliseconds; past it the
    /// prompt is computed and the tier skipped for a second.
    #[arg(long, default_value_t = 200)]
    pub kv_tier_shared_timeout_ms: u64,
    /// Blocks waiting to be written to the shared tier at most; more are dropped (counted).
    #[arg(long, default_value_t = 256)]
    pub kv_tier_shared_queue: usize,
    /// Serve this replica's K/V to decode replicas on this port (0 picks one): requests with
    /// `kv_transfer_params.do_remote_decode` hold their blocks for them (prefill/decode
    /// disaggregation). Without it such requests are refused; any replica can decode. The port
    /// has no authentication: it binds `--host`, which only the replicas should reach.
    #[arg(long)]
    pub kv_transfer_port: Option<u16>,
    /// How long a prefilled request's blocks wait to be fetched before they are freed.
    #[arg(long, default_value_t = 60.0)]
    pub kv_hold_s: f64,
    /// Added per K/V block a decode replica receives, in microseconds: models a link slower
    /// than loopback (the sim executor's blocks are a few bytes).
    #[arg(long, default_value_t = 0.0)]
    pub kv_transfer_delay_us_per_block: f64,

    /// sim: fixed cost of a step that prefills, in milliseconds.
    #[arg(long, default_value_t = 2.0)]
    pub sim_prefill_overhead_ms: f64,
    /// sim: prefill time per uncached prompt token, in microseconds.
    #[arg(long, default_value_t = 200.0)]
    pub sim_prefill_us_per_token: f64,
    /// sim: time per decode step, in milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub sim_itl_ms: f64,
    /// sim: extra decode slow-down at max-num-seqs running (0.5 = 50 %).
    #[arg(long, default_value_t = 0.5)]
    pub sim_load_factor: f64,
    /// sim: relative jitter bound of step times (0.1 = ±10 %).
    #[arg(long, default_value_t = 0.1)]
    pub sim_jitter: f64,
    /// sim: time to load one K/V block into the cache from the host tier or another replica,
    /// in microseconds, spent in the step that loads it (80: a 2 MiB block over PCIe).
    #[arg(long, default_value_t = 0.0)]
    pub sim_kv_load_us_per_block: f64,

    #[command(flatten)]
    pub faults: FaultConfig,
}

impl EngineArgs {
    /// The model shape and where its weights come from.
    pub fn model_source(&self) -> ModelSource {
        if let Some(cfg) = ModelConfig::preset(&self.model) {
            return ModelSource::Preset(cfg);
        }
        match warmpath_wire::models::gguf_of(&self.model) {
            Some(file) => ModelSource::Gguf(file),
            None => ModelSource::Checkpoint(PathBuf::from(&self.model)),
        }
    }

    pub fn served_name(&self) -> String {
        let known = warmpath_wire::models::file_of(&self.model).is_some();
        self.served_model_name.clone().unwrap_or_else(|| match self.model_source() {
            ModelSource::Preset(_) => self.model.clone(),
            ModelSource::Gguf(_) if known => self.model.clone(),
            ModelSource::Checkpoint(p) | ModelSource::Gguf(p) => {
                p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| self.model.clone())
            }
        })
    }

    pub fn sim_timing(&self) -> SimTiming {
        let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e3);
        SimTiming {
            prefill_overhead: ms(self.sim_prefill_overhead_ms),
            prefill_per_token: ms(self.sim_prefill_us_per_token / 1e3),
            inter_token_latency: ms(self.sim_itl_ms),
            load_factor: self.sim_load_factor.max(0.0),
            jitter: self.sim_jitter.clamp(0.0, 0.9),
            max_num_seqs: self.max_num_seqs,
            block_load: Duration::from_secs_f64(self.sim_kv_load_us_per_block.max(0.0) / 1e6),
        }
    }

    /// Checks values that clap cannot; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.kv_hold_s.is_finite() && self.kv_hold_s > 0.0) {
            return Err("--kv-hold-s must be positive".into());
        }
        if !(self.kv_transfer_delay_us_per_block.is_finite() && self.kv_transfer_delay_us_per_block >= 0.0) {
            return Err("--kv-transfer-delay-us-per-block must be zero or more".into());
        }
        let positive = [
            ("--kv-blocks", self.kv_blocks),
            ("--block-size", self.block_size),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
        ];
        for (flag, v) in positive {
            if v == 0 {
                return Err(format!("{flag} must be positive"));
            }
        }
        self.faults.validate()
    }

    /// Arguments for an engine in tests and embedded use: defaults, loopback, port 0.
    pub fn for_tests(model: &str) -> EngineArgs {
        let mut a = EngineArgs::parse_from(["warmpath-engine", "--port", "0", "--model", model]);
        a.kv_blocks = 256;
        a
    }
}

/// Where the weights come from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    Preset(ModelConfig),
    Checkpoint(PathBuf),
    /// A GGUF file (a model known by name resolved to its installed file).
    Gguf(PathBuf),
}
