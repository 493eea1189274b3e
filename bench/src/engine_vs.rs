//! `engine --vs-llama-cpp`: the bundled engine and llama.cpp's `llama-server` serving the same
//! GGUF file, each started here and driven over HTTP by the same client, rotating within each
//! round; `llama-bench`'s own figures on the file beside them. Ratios are ours over llama.cpp's.
//!
//! - prefill: a 512-token prompt never seen before, one output token: prompt tokens / TTFT;
//! - decode, one stream: 128 tokens (end of text ignored), tokens after the first / their time;
//! - decode, 16 concurrent streams of 128 tokens: all output tokens / wall time;
//! - TTFT of a 1,581-token prompt, cold, then again with the same prefix and a new tail;
//! - a shared prefix: one request computes a 1,581-token prefix, then 8 concurrent requests
//!   with it and their own tails: their mean TTFT (one copy of the prefix serves all of them
//!   where the engine shares cached blocks across requests; llama.cpp's cache is per slot).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::stats::median;
use crate::targets::{self, Target};

/// A row of the table: its name, the figure, whether higher is better.
type Row = (&'static str, fn(&Figures) -> f64, bool);

/// What one server did.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    prefill: f64,
    decode_1: f64,
    decode_16: f64,
    ttft_cold_ms: f64,
    ttft_cached_ms: f64,
    shared_prefix_ttft_ms: f64,
}

/// Prompt ids that no other call shares: a distinct start and stride per `salt`, below `vocab`.
fn prompt(n: usize, salt: u32, vocab: u32) -> Vec<u32> {
    let span = vocab.saturating_sub(300).max(1);
    (0..n as u32).map(|i| (salt.wrapping_mul(7919).wrapping_add(i.wrapping_mul(31)) % span) + 200).collect()
}

/// One streamed completion of `max_tokens` (end of text ignored): (TTFT, time from the first
/// to the last chunk with text).
async fn stream(
    addr: SocketAddr,
    model: &str,
    ids: &[u32],
    max_tokens: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let body = serde_json::json!({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "stream": true, "ignore_eos": true, "cache_prompt": true});
    let mut sender = crate::load::connect(addr).await?;
    let req = hyper::Request::post("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let start = Instant::now();
    let resp = sender.send_request(req).await?;
    anyhow::ensure!(resp.status() == 200, "status {}", resp.status());
    let mut body = resp.into_body();
    let mut events = warmpath_wire::sse::Splitter::default();
    let (mut first, mut last) = (None, start);
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else { continue };
        for d in events.feed(data) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&d) else { continue };
            if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                last = Instant::now();
                first.get_or_insert(last);
            }
        }
    }
    let first = first.ok_or_else(|| anyhow::anyhow!("no text streamed"))?;
    Ok((first - start, last - first))
}

async fn measure(t: &Target, model: &str, vocab: u32, salt: &mut u32) -> anyhow::Result<Figures> {
    let mut next = || {
        *salt += 1;
        *salt
    };
    let (ttft, _) = stream(t.addr, model, &prompt(512, next(), vocab), 1).await?;
    let prefill = 512.0 / ttft.as_secs_f64();
    let (_, decode) = stream(t.addr, model, &prompt(16, next(), vocab), 128).await?;
    let decode_1 = 127.0 / decode.as_secs_f64();
    let start = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (addr, model, p) = (t.addr, model.to_owned(), prompt(16, next(), vocab));
            tokio::spawn(async move { stream(addr, &model, &p, 128).await })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    let decode_16 = 16.0 * 128.0 / start.elapsed().as_secs_f64();
    let long = prompt(1581, next(), vocab);
    let with_tail = |tail: u32| {
        let mut p = long.clone();
        p.extend(prompt(8, tail, vocab));
        p
    };
    let (cold, _) = stream(t.addr, model, &with_tail(next()), 1).await?;
    let (cached, _) = stream(t.addr, model, &with_tail(next()), 1).await?;
    let tails: Vec<Vec<u32>> = (0..8).map(|_| with_tail(next())).collect();
    let tasks: Vec<_> = tails
        .into_iter()
        .map(|p| {
            let (addr, model) = (t.addr, model.to_owned());
            tokio::spawn(async move { stream(addr, &model, &p, 1).await })
        })
        .collect();
    let mut shared = Vec::new();
    for task in tasks {
        shared.push(task.await??.0.as_secs_f64() * 1e3);
    }
    Ok(Figures {
        prefill,
        decode_1,
        decode_16,
        ttft_cold_ms: cold.as_secs_f64() * 1e3,
        ttft_cached_ms: cached.as_secs_f64() * 1e3,
        shared_prefix_ttft_ms: shared.iter().sum::<f64>() / shared.len() as f64,
    })
}

/// llama.cpp's binaries, built once by `scripts/llama-cpp`.
pub fn llama_cpp_bin() -> anyhow::Result<PathBuf> {
    let out = Command::new(targets::root().join("scripts/llama-cpp")).output()?;
    anyhow::ensure!(
        out.status.success(),
        "scripts/llama-cpp failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `llama-server` on `file` with `threads` threads, on a free port of 127.0.0.1, with `extra`
/// flags (slots, context, flash attention).
pub fn llama_server(
    name: &str,
    bin: &Path,
    file: &Path,
    threads: usize,
    extra: &[&str],
) -> anyhow::Result<Target> {
    let addr = targets::free_addr()?;
    let mut cmd = Command::new(bin.join("llama-server"));
    cmd.env("LD_LIBRARY_PATH", bin)
        .args(["-m", &file.display().to_string(), "--host", "127.0.0.1", "--port", &addr.port().to_string()])
        .args(["-t", &threads.to_string(), "--no-webui"])
        .args(extra);
    targets::spawn(name, &mut cmd, addr)
}

/// `llama-bench`'s pp512 and tg128 on `file` with 2 threads, tokens/s.
fn llama_bench(bin: &Path, file: &Path, threads: usize) -> anyhow::Result<(f64, f64)> {
    let out = Command::new(bin.join("llama-bench"))
        .env("LD_LIBRARY_PATH", bin)
        .args([
            "-m",
            &file.display().to_string(),
            "-t",
            &threads.to_string(),
            "-p",
            "512",
            "-n",
            "128",
            "-o",
            "json",
        ])
        .output()?;
    anyhow::ensure!(out.status.success(), "llama-bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    let ts = |key: &str| {
        rows.iter()
            .find(|r| r[key].as_u64().is_some_and(|n| n > 0))
            .and_then(|r| r["avg_ts"].as_f64())
            .unwrap_or(0.0)
    };
    Ok((ts("n_prompt"), ts("n_gen")))
}

pub async fn run(file: &Path, repeats: usize, threads: usize) -> anyhow::Result<()> {
    let bin = llama_cpp_bin()?;
    let model = "model";
    let g = warmpath_wire::gguf::Gguf::open(file)?;
    let vocab = g.array("tokenizer.ggml.tokens")?.len() as u32;
    drop(g);
    let ours_addr = targets::free_addr()?;
    let ours = targets::spawn(
        "warmpath-engine-gguf",
        Command::new(targets::sibling("warmpath-engine")?).args([
            "--model",
            &file.display().to_string(),
            "--served-model-name",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            &ours_addr.port().to_string(),
            "--kv-blocks",
            "4096",
            "--max-num-seqs",
            "16",
            "--max-model-len",
            "4096",
            "--threads",
            &threads.to_string(),
        ]),
        ours_addr,
    )?;
    let theirs = llama_server(
        "llama-server",
        &bin,
        file,
        threads,
        &["--alias", model, "-np", "16", "-c", &(16 * 4096).to_string()],
    )?;
    let ready = Bytes::from(serde_json::json!({"model": model, "prompt": "hi", "max_tokens": 1}).to_string());
    for t in [&ours, &theirs] {
        wait_completion(t.addr, &ready).await?;
    }
    let mut salt = 0u32;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..repeats {
        // Alternate which goes first.
        let order: [&Target; 2] = if round % 2 == 0 { [&ours, &theirs] } else { [&theirs, &ours] };
        for t in order {
            eprintln!("round {}: {}", round + 1, t.name);
            let f = measure(t, model, vocab, &mut salt).await?;
            if std::ptr::eq(t, &ours) {
                a.push(f)
            } else {
                b.push(f)
            }
        }
    }
    drop(ours);
    drop(theirs);
    let (pp, tg) = llama_bench(&bin, file, threads)?;
    let med = |v: &[Figures], f: fn(&Figures) -> f64| median(v.iter().map(f).collect());
    let cmdline: Vec<String> = std::env::args().collect();
    let mut md = String::new();
    let _ = writeln!(md, "# warmpath-engine vs llama.cpp — {}\n", crate::report::date());
    let _ = writeln!(
        md,
        "Command: `{}` (release build; llama.cpp from `scripts/llama-cpp`)\n",
        cmdline.join(" ")
    );
    let _ = writeln!(
        md,
        "Both servers on `{}`, {threads} threads (llama-server `-t {threads} -np 16`, flash attention and KV cache \
         type at their defaults; warmpath-engine on a pool of {threads} threads), driven over HTTP by the same \
         streaming client, rotating, {repeats} round(s), medians. Shared 2-core machine: the client competes for \
         the cores too.\n",
        file.display()
    );
    let _ = writeln!(md, "| | warmpath-engine | llama.cpp | ratio |\n| --- | ---: | ---: | ---: |");
    let rows: [Row; 6] = [
        ("prefill, 512-token prompt (tokens/s)", |f| f.prefill, true),
        ("decode, 1 stream (tokens/s)", |f| f.decode_1, true),
        ("decode, 16 streams (tokens/s, all)", |f| f.decode_16, true),
        ("TTFT, 1,581-token prompt, cold (ms)", |f| f.ttft_cold_ms, false),
        ("TTFT, same prefix, new tail (ms)", |f| f.ttft_cached_ms, false),
        ("TTFT, 8 concurrent requests on a cached prefix (ms, mean)", |f| f.shared_prefix_ttft_ms, false),
    ];
    for (name, f, higher_better) in rows {
        let (x, y) = (med(&a, f), med(&b, f));
        let note = if higher_better { "" } else { " (lower is better)" };
        let _ = writeln!(md, "| {name} | {x:.1} | {y:.1} | {:.2}×{note} |", x / y);
    }
    let _ = writeln!(md, "\n`llama-bench -t {threads} -p 512 -n 128` on the same file: pp512 {pp:.1} tokens/s, tg128 {tg:.1} tokens/s.");
    crate::report::publish(&md, "engine-vs-llama-cpp", None, false)?;
    Ok(())
}

/// Waits until a server answers a completion.
pub async fn wait_completion(addr: SocketAddr, body: &Bytes) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(mut s) = crate::load::connect(addr).await {
            if let Ok((200, _)) = crate::load::send(&mut s, addr, "/v1/completions", body).await {
                return Ok(());
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "{addr} did not start answering");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
