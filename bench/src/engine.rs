//! The engine benchmark: runs an in-process engine (the same `Engine` the HTTP server drives)
//! and measures, on this machine:
//! - prefill tokens/s of a long uncached prompt;
//! - decode tokens/s with 1 request and with N concurrent requests (continuous batching);
//! - TTFT of a request whose long prefix is cached vs one whose prefix is not, interleaved.

use std::sync::Arc;
use std::time::{Duration, Instant};

use warmpath_engine::core::{Engine, EngineInfo};
use warmpath_engine::executor::llama::LlamaExecutor;
use warmpath_engine::metrics::Metrics;
use warmpath_engine::model::{GgufModel, ModelConfig, Weights};
use warmpath_engine::scheduler::{SamplingParams, SchedulerConfig};
use warmpath_engine::spec::SpecConfig;
use warmpath_wire::chat_template::ChatFormat;

use crate::stats::median;

#[derive(clap::Args)]
pub struct Args {
    /// Model: a preset (`tiny`, `micro`), `smollm2-135m-instruct`, or a GGUF file.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Length of the long prompt / cached prefix, in tokens.
    #[arg(long, default_value_t = 1000)]
    prefix_tokens: usize,
    /// Tokens generated per request in the decode runs.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Concurrent requests in the batched decode run.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Repeats of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Scheduler token budget per step.
    #[arg(long, default_value_t = 512)]
    max_num_batched_tokens: usize,
    /// Instead: start `warmpath-engine` and llama.cpp's `llama-server` on the same GGUF model
    /// and measure both over HTTP side by side (see `engine_vs`).
    #[arg(long)]
    vs_llama_cpp: bool,
    /// Instead: how closely the engine's greedy tokens follow llama.cpp's on the same GGUF
    /// model, and llama.cpp's own with flash attention on and off (see `agreement`).
    #[arg(long)]
    agreement: bool,
    /// Tokens per greedy continuation (with `--agreement`).
    #[arg(long, default_value_t = 48)]
    agreement_tokens: usize,
    /// With `--agreement`: also write llama.cpp's continuations as the engine tests' fixture.
    #[arg(long)]
    write_fixture: bool,
    /// Threads each engine computes on (with `--vs-llama-cpp`, `--agreement`).
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

fn params(max_tokens: usize) -> SamplingParams {
    // No stop tokens: every run generates exactly max_tokens.
    SamplingParams {
        max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
        stop_token_ids: Vec::new(),
        forced: Vec::new(),
        speculative: None,
        logprobs: None,
    }
}

/// A prompt of `n` ids that no other call shares (distinct first token and stride).
fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (salt.wrapping_mul(7919).wrapping_add(i.wrapping_mul(31)) % 31_000) + 1).collect()
}

/// Runs one request; returns (TTFT, time of last token - time of first token, tokens).
async fn one(
    engine: &Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> anyhow::Result<(Duration, Duration, usize)> {
    let r = generate(engine, prompt, params(max_tokens)).await?;
    Ok((r.ttft, r.decode, r.tokens.len()))
}

/// What one request produced and when.
pub struct Generated {
    pub ttft: Duration,
    /// First token to last.
    pub decode: Duration,
    pub tokens: Vec<u32>,
}

/// Runs one request to its end.
pub async fn generate(
    engine: &Engine,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> anyhow::Result<Generated> {
    let start = Instant::now();
    let mut s = engine.generate(prompt, params, None).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut first = None;
    let mut tokens = Vec::new();
    let mut last = start;
    while let Some(out) = s.next().await {
        tokens.push(out.token);
        last = Instant::now();
        first.get_or_insert(last);
        if out.finish.is_some() {
            break;
        }
    }
    let first = first.ok_or_else(|| anyhow::anyhow!("no output"))?;
    Ok(Generated { ttft: first - start, decode: last - first, tokens })
}

/// An engine running in this process.
pub struct InProcess {
    pub engine: Arc<Engine>,
    pub metrics: Arc<Metrics>,
    pub cfg: ModelConfig,
    /// A GGUF model's tokenizer and chat template.
    pub format: Option<ChatFormat>,
}

/// Starts `model` (a preset, a known name or a GGUF file) in this process: 4,096 blocks of 16,
/// `budget` tokens per step, `max_seqs` sequences, speculative decoding as `spec` says.
pub fn in_process(
    model: &str,
    budget: usize,
    max_seqs: usize,
    spec: Option<SpecConfig>,
) -> anyhow::Result<InProcess> {
    let (weights, format) = match (ModelConfig::preset(model), warmpath_wire::models::gguf_of(model)) {
        (Some(cfg), _) => (Weights::dummy(&cfg, 0)?, None),
        (None, Some(path)) => {
            let m = GgufModel::load(&path)?;
            (m.weights, Some(m.format))
        }
        (None, None) => anyhow::bail!("unknown model {model}: a preset, a known name or a .gguf file"),
    };
    let cfg = weights.cfg.clone();
    let block_size = 16;
    let num_blocks = 4096;
    let info = EngineInfo {
        model_name: model.to_owned(),
        vocab_size: cfg.vocab_size,
        block_size,
        num_blocks,
        max_model_len: 8192,
        prefix_caching: true,
    };
    let sched = SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: max_seqs,
        max_model_len: 8192,
        enable_prefix_caching: true,
        spec,
        kv_tier_blocks: 0,
    };
    let metrics = Arc::new(Metrics::new(model, "bench", block_size, num_blocks, true));
    let engine = Arc::new(Engine::start(
        info,
        sched,
        Box::new(LlamaExecutor::new(weights, num_blocks, block_size)),
        metrics.clone(),
        None,
        Default::default(),
    )?);
    Ok(InProcess { engine, metrics, cfg, format })
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    if a.vs_llama_cpp || a.agreement {
        let Some(path) = warmpath_wire::models::gguf_of(&a.model) else {
            anyhow::bail!(
                "--vs-llama-cpp and --agreement need a GGUF model (smollm2-135m-instruct or FILE.gguf), not {}",
                a.model
            )
        };
        if a.agreement {
            return crate::agreement::run(&path, a.threads, a.agreement_tokens, a.write_fixture).await;
        }
        return crate::engine_vs::run(&path, a.repeats, a.threads).await;
    }
    let InProcess { engine, cfg, .. } =
        in_process(&a.model, a.max_num_batched_tokens, a.concurrency.max(16), None)?;
    println!(
        "# warmpath-engine benchmark: model {} ({:.1}M params), {} cores, budget {} tokens/step",
        a.model,
        cfg.num_params() as f64 / 1e6,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        a.max_num_batched_tokens
    );
    // Warm-up: first touches of weights and cache pages.
    one(&engine, prompt(64, 999_999), 4).await?;

    let mut salt = 0u32;
    let mut next = || {
        salt += 1;
        salt
    };

    // Prefill: a long unique prompt, one output token.
    let mut prefill = Vec::new();
    for _ in 0..a.repeats {
        let (ttft, _, _) = one(&engine, prompt(a.prefix_tokens, next()), 1).await?;
        prefill.push(a.prefix_tokens as f64 / ttft.as_secs_f64());
    }
    let prefill = median(prefill);
    println!("prefill ({} tokens, uncached): {:.0} tokens/s", a.prefix_tokens, prefill);

    // Decode, 1 request.
    let mut d1 = Vec::new();
    for _ in 0..a.repeats {
        let (_, decode, n) = one(&engine, prompt(16, next()), a.decode_tokens).await?;
        d1.push((n - 1) as f64 / decode.as_secs_f64());
    }
    let d1 = median(d1);
    println!("decode, 1 request: {:.0} tokens/s", d1);

    // Decode, N concurrent requests: aggregate output tokens over the wall time.
    let mut dn = Vec::new();
    for _ in 0..a.repeats {
        let start = Instant::now();
        let tasks: Vec<_> = (0..a.concurrency)
            .map(|_| {
                let e = engine.clone();
                let p = prompt(16, next());
                let max = a.decode_tokens;
                tokio::spawn(async move { one(&e, p, max).await })
            })
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await??.2;
        }
        dn.push(total as f64 / start.elapsed().as_secs_f64());
    }
    let dn = median(dn);
    println!("decode, {} concurrent requests: {:.0} tokens/s (aggregate)", a.concurrency, dn);
    println!("continuous batching speed-up: {:.2}x", dn / d1);

    // TTFT with the prefix cached vs not, interleaved so that both see the same machine state.
    let mut cached = Vec::new();
    let mut uncached = Vec::new();
    let suffix = |s: u32| prompt(12, s + 500_000);
    for _ in 0..a.repeats {
        // Uncached: a fresh prefix.
        let mut p = prompt(a.prefix_tokens, next());
        p.extend(suffix(next()));
        uncached.push(one(&engine, p, 1).await?.0.as_secs_f64());
        // Cached: warm a prefix with one suffix, then measure another suffix.
        let prefix = prompt(a.prefix_tokens, next());
        let mut warm = prefix.clone();
        warm.extend(suffix(next()));
        one(&engine, warm, 1).await?;
        let mut p = prefix;
        p.extend(suffix(next()));
        cached.push(one(&engine, p, 1).await?.0.as_secs_f64());
    }
    let (c, u) = (median(cached), median(uncached));
    println!(
        "TTFT with a {}-token prefix: uncached {:.1} ms, cached {:.1} ms, speed-up {:.1}x",
        a.prefix_tokens,
        u * 1e3,
        c * 1e3,
        u / c
    );
    Ok(())
}
