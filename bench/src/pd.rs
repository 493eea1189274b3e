//! `pd`: prefill/decode disaggregation against co-located replicas, at equal hardware. The same
//! `--engines` engines serve a mixed workload — `--streams` clients each streaming answers one
//! after another, while bursts of long prompts (an agent's turns: big context, short answer)
//! arrive every `--burst-every-ms` — through warmpath, first co-located (every engine serves
//! whole requests), then split: P prefill engines and the rest decoding, for each P of
//! `--splits`. On the sim executor a step that prefills a chunk of a long prompt takes the
//! chunk's prefill time, and every sequence decoding in that step waits for it: the
//! interference disaggregation removes. Decode engines model the K/V transfer's time per block
//! (`--transfer-us-per-block`, 80 µs: a 16-token block of an 8B model, 2 MiB, at 25 GB/s).
//!
//! Reported per configuration: TTFT p50/p99 (all requests, streams, long prompts) and TPOT
//! p50/p99 of the streams (time per output token after the first, per request, as vLLM's
//! benchmarks define it), with the split's ratios to co-located measured in the same run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use crate::fleet::{EngineOpts, Fleet};
use crate::replay::{self, Outcome};
use crate::stats::quantile;
use crate::targets;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Engines in every configuration.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Prefill engines of each split configuration, beside co-located (0, always run first).
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub splits: Vec<usize>,
    /// Clients streaming answers back to back.
    #[arg(long, default_value_t = 24)]
    pub streams: usize,
    /// Words of a stream's prompt (each unique).
    #[arg(long, default_value_t = 40)]
    pub stream_words: usize,
    /// Tokens each stream generates.
    #[arg(long, default_value_t = 64)]
    pub stream_tokens: usize,
    /// Long prompts per burst.
    #[arg(long, default_value_t = 4)]
    pub burst: usize,
    /// Time between bursts, ms.
    #[arg(long, default_value_t = 1500)]
    pub burst_every_ms: u64,
    /// Words of a long prompt (each unique; a word is one to three tokens).
    #[arg(long, default_value_t = 1500)]
    pub long_words: usize,
    /// Tokens each long prompt's answer has.
    #[arg(long, default_value_t = 8)]
    pub long_tokens: usize,
    /// Seconds of load per configuration.
    #[arg(long, default_value_t = 30)]
    pub duration_s: u64,
    /// The pool's `[pools.disagg] min_prompt_tokens`: shorter prompts prefill where they decode.
    #[arg(long, default_value_t = 512)]
    pub min_prompt_tokens: usize,
    /// Threads of each engine's forward pass (`--executor llama`).
    #[arg(long, default_value_t = 1)]
    pub engine_threads: usize,
    /// The pool's policy.
    #[arg(long, default_value = "cache_aware")]
    pub policy: String,
    #[command(flatten)]
    pub engine: EngineOpts,
    /// A short run that writes nothing.
    #[arg(long)]
    pub quick: bool,
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// KV blocks per engine unless `--kv-blocks` says otherwise: every prompt of a run fits.
const KV_BLOCKS: usize = 8192;

/// What one configuration's clients saw.
#[derive(Default)]
struct Seen {
    streams: Vec<Outcome>,
    long: Vec<Outcome>,
}

/// A prompt of `words` made-up words, unique to `id` from its first word.
fn prompt(id: u64, words: usize) -> String {
    const SYL: [&str; 12] = ["ka", "lo", "mir", "ten", "zu", "ve", "dra", "pon", "si", "gal", "or", "nex"];
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut s = format!("Request {id}:");
    for _ in 0..words {
        s.push(' ');
        for _ in 0..2 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push_str(SYL[(x % SYL.len() as u64) as usize]);
        }
    }
    s
}

fn body(id: u64, words: usize, tokens: usize) -> Bytes {
    Bytes::from(
        json!({"model": "m", "messages": [{"role": "user", "content": prompt(id, words)}],
               "max_tokens": tokens, "ignore_eos": true, "temperature": 0, "stream": true,
               "stream_options": {"include_usage": true}})
        .to_string(),
    )
}

/// Runs the workload against `addr` for the configured time.
async fn drive(a: &Args, addr: std::net::SocketAddr, seed: u64) -> Seen {
    let deadline = Instant::now() + Duration::from_secs(if a.quick { 6 } else { a.duration_s });
    let timeout = Duration::from_secs(120);
    let mut workers = Vec::new();
    for c in 0..a.streams {
        let (words, tokens) = (a.stream_words, a.stream_tokens);
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut n = 0u64;
            // Staggered starts, so the streams do not march in step.
            tokio::time::sleep(Duration::from_millis(37 * c as u64)).await;
            while Instant::now() < deadline {
                let id = seed + 1_000_000 * (c as u64 + 1) + n;
                out.push(replay::once(addr, body(id, words, tokens), timeout).await);
                n += 1;
            }
            out
        }));
    }
    let mut bursts = Vec::new();
    let mut k = 0u64;
    // The first burst after the streams have started.
    tokio::time::sleep(Duration::from_millis(a.burst_every_ms / 2)).await;
    while Instant::now() < deadline {
        for _ in 0..a.burst {
            let id = seed + 500_000_000 + k;
            k += 1;
            let b = body(id, a.long_words, a.long_tokens);
            bursts.push(tokio::spawn(async move { replay::once(addr, b, timeout).await }));
        }
        tokio::time::sleep(Duration::from_millis(a.burst_every_ms)).await;
    }
    let mut seen = Seen::default();
    for w in workers {
        seen.streams.extend(w.await.unwrap_or_default());
    }
    for b in bursts {
        if let Ok(o) = b.await {
            seen.long.push(o);
        }
    }
    seen
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1e3)
}

fn ttfts(os: &[&Outcome]) -> Vec<f64> {
    os.iter().filter(|o| o.ok).filter_map(|o| ms(o.ttft)).collect()
}

/// Time per output token after the first, per request (ms).
fn tpots(os: &[Outcome]) -> Vec<f64> {
    os.iter()
        .filter(|o| o.ok && o.output_tokens > 1)
        .filter_map(|o| {
            let first = o.ttft?;
            Some((o.e2e - first).as_secs_f64() * 1e3 / (o.output_tokens - 1) as f64)
        })
        .collect()
}

/// One configuration's row: label, TTFT all/streams/long p50 & p99, TPOT p50/p99, counts.
struct Row {
    label: String,
    ttft_all: (f64, f64),
    ttft_streams: (f64, f64),
    ttft_long: (f64, f64),
    tpot: (f64, f64),
    requests: usize,
    errors: usize,
    transferred: f64,
}

fn p(v: &[f64]) -> (f64, f64) {
    (quantile(v.to_vec(), 0.5), quantile(v.to_vec(), 0.99))
}

fn row(label: String, s: &Seen, transferred: f64) -> Row {
    let all: Vec<&Outcome> = s.streams.iter().chain(&s.long).collect();
    let streams: Vec<&Outcome> = s.streams.iter().collect();
    let long: Vec<&Outcome> = s.long.iter().collect();
    Row {
        label,
        ttft_all: p(&ttfts(&all)),
        ttft_streams: p(&ttfts(&streams)),
        ttft_long: p(&ttfts(&long)),
        tpot: p(&tpots(&s.streams)),
        requests: all.len(),
        errors: all.iter().filter(|o| !o.ok).count(),
        transferred,
    }
}

/// Runs one configuration: `prefill` of the engines only prefill (0: co-located).
async fn configuration(a: &Args, prefill: usize, seed: u64) -> anyhow::Result<Row> {
    let kv_blocks = a.engine.kv_blocks.unwrap_or(KV_BLOCKS);
    let delay = a.engine.transfer_us_per_block.to_string();
    let extra = |i: usize| -> Vec<String> {
        let mut v: Vec<String> = if i < prefill {
            vec!["--kv-transfer-port".into(), "0".into()]
        } else {
            vec!["--kv-transfer-delay-us-per-block".into(), delay.clone()]
        };
        if a.engine.executor == "llama" {
            v.extend(["--threads".into(), a.engine_threads.to_string()]);
        }
        v
    };
    // Room for the longest prompt: a made-up word is at most about three tokens.
    let max_model_len = (a.long_words.max(a.stream_words) * 3 + 1024).max(4096);
    let fleet = Fleet::start_with(a.engines, &a.engine, kv_blocks, max_model_len, "m", &extra).await?;
    let mut pool = format!(
        "[[pools]]\nname = \"pd\"\nmodels = [\"*\"]\npolicy = \"{}\"\nmax_inflight_per_backend = 4096\n\
         [pools.disagg]\nmin_prompt_tokens = {}\n",
        a.policy, a.min_prompt_tokens
    );
    for (i, addr) in fleet.addrs().iter().enumerate() {
        let role = if i < prefill { "prefill" } else { "both" };
        pool.push_str(&format!(
            "[[pools.backends]]\nname = \"e{i}\"\nurl = \"http://{addr}\"\nrole = \"{role}\"\n"
        ));
    }
    let label = match prefill {
        0 => format!("co-located ({} engines)", a.engines),
        p => format!("split {p}P + {}D", a.engines - p),
    };
    let mut w = targets::warmpath_pools(&targets::sibling("warmpath")?, &pool, 1, &label)?;
    targets::wait_ready(&mut w, &body(seed + 999_999_999, 4, 1)).await?;
    eprintln!("{label}: running {} s", if a.quick { 6 } else { a.duration_s });
    let seen = drive(a, w.addr, seed).await;
    let mut transferred = 0.0;
    for c in &fleet.engines {
        let (_, text) = crate::fleet::get(c.addr, "/metrics").await?;
        transferred += text
            .lines()
            .filter(|l| {
                l.starts_with("warmpath_engine_kv_transfer_blocks_total") && l.contains("\"received\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    Ok(row(label, &seen, transferred))
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.splits.iter().all(|&p| p > 0 && p < a.engines),
        "every split needs 1..engines prefill engines"
    );
    let mut rows = vec![configuration(&a, 0, 0).await?];
    for (k, &p) in a.splits.iter().enumerate() {
        rows.push(configuration(&a, p, (k as u64 + 1) * 10_000_000_000).await?);
    }
    let md = report(&a, &rows);
    crate::report::publish(&md, "pd", a.out.clone(), a.quick)?;
    // A smoke test fails when anything failed.
    let errors: usize = rows.iter().map(|r| r.errors).sum();
    anyhow::ensure!(!a.quick || errors == 0, "{errors} requests failed");
    Ok(())
}

fn report(a: &Args, rows: &[Row]) -> String {
    let e = &a.engine;
    let mut md = format!(
        "# Prefill/decode disaggregation — {}\n\nCommand: `target/release/warmpath-bench pd --engines {} --splits {} \
         --streams {} --stream-words {} --stream-tokens {} --burst {} --burst-every-ms {} --long-words {} \
         --long-tokens {} --duration-s {} --transfer-us-per-block {} --min-prompt-tokens {} --executor {} \
         --engine-model {} --kv-blocks {} --engine-threads {}` (release build)\n\n\
         {} `warmpath-engine --executor {}` engines ({}, {} tokens per step, \
         {} sequences at most; decode engines spend {} µs per K/V block received) behind warmpath (`{}`, \
         `[pools.disagg] min_prompt_tokens = {}`). Load for {} s per configuration: {} clients each streaming \
         {}-token answers to {}-word prompts back to back, and every {} ms a burst of {} prompts of {} words \
         (an agent's long context) answered in {} tokens. Every prompt is unique (no prefix-cache hits). \
         Configurations run one after another on the shared 2-core machine.\n\n",
        crate::report::date(),
        a.engines,
        a.splits.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","),
        a.streams,
        a.stream_words,
        a.stream_tokens,
        a.burst,
        a.burst_every_ms,
        a.long_words,
        a.long_tokens,
        a.duration_s,
        a.engine.transfer_us_per_block,
        a.min_prompt_tokens,
        e.executor,
        e.engine_model,
        e.kv_blocks.unwrap_or(KV_BLOCKS),
        a.engine_threads,
        a.engines,
        e.executor,
        match e.executor.as_str() {
            "sim" => format!("prefill {} µs/token, {} ms per decode step", e.prefill_us_per_token, e.itl_ms),
            _ => format!("model {}, {} thread(s) each", e.engine_model, a.engine_threads),
        },
        e.max_num_batched_tokens,
        e.max_num_seqs,
        a.engine.transfer_us_per_block,
        a.policy,
        a.min_prompt_tokens,
        a.duration_s,
        a.streams,
        a.stream_tokens,
        a.stream_words,
        a.burst_every_ms,
        a.burst,
        a.long_words,
        a.long_tokens,
    );
    md.push_str(
        "| configuration | requests | errors | TTFT p50 ms | TTFT p99 | streams' TTFT p50 | p99 | long prompts' TTFT p50 | p99 | \
         TPOT p50 ms | TPOT p99 | K/V blocks moved |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.0} |\n",
            r.label,
            r.requests,
            r.errors,
            r.ttft_all.0,
            r.ttft_all.1,
            r.ttft_streams.0,
            r.ttft_streams.1,
            r.ttft_long.0,
            r.ttft_long.1,
            r.tpot.0,
            r.tpot.1,
            r.transferred
        ));
    }
    let base = &rows[0];
    md.push('\n');
    for r in &rows[1..] {
        md.push_str(&format!(
            "- {} against co-located: TPOT p99 cut {:.2}× (p50 {:.2}×); TTFT p50 {:.2}× (streams {:.2}×, long prompts {:.2}×), p99 {:.2}×\n",
            r.label,
            base.tpot.1 / r.tpot.1,
            base.tpot.0 / r.tpot.0,
            r.ttft_all.0 / base.ttft_all.0,
            r.ttft_streams.0 / base.ttft_streams.0,
            r.ttft_long.0 / base.ttft_long.0,
            r.ttft_all.1 / base.ttft_all.1,
        ));
    }
    md.push_str(
        "\nTTFT: time to the first streamed chunk with text, at the client. TPOT: (end − first token) ÷ (tokens − 1) \
         per stream, its p50 and p99 over the streams (vLLM's benchmark definition). K/V blocks moved: blocks the \
         decode engines received from prefill engines.\n",
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_differ_from_their_first_word_and_have_the_asked_length() {
        let (a, b) = (prompt(1, 50), prompt(2, 50));
        assert_ne!(a.split(' ').nth(1), b.split(' ').nth(1));
        assert_eq!(a.split(' ').count(), 52);
    }

    #[test]
    fn tpot_is_the_time_after_the_first_token_per_token() {
        let o = Outcome {
            ok: true,
            ttft: Some(Duration::from_millis(100)),
            e2e: Duration::from_millis(190),
            output_tokens: 10,
            ..Outcome::default()
        };
        assert_eq!(tpots(&[o]), vec![10.0]);
    }
}
