//! `safety`: what warmpath's safety stage costs a request, on the bundled engine. One engine
//! (SmolLM2-135M by default, every prompt unique so each pays its prefill), one client sending
//! streamed chats one after another, and warmpath in front with: no checks; the built-in rules;
//! a moderation service slowed to each of `--delays` ms, run `before` the backend call and
//! `concurrent` with it; and output checks under each release policy. Reported: TTFT p50/p99
//! and end-to-end times, and the differences to "no checks" measured in the same run.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;

use crate::replay::{self, Outcome};
use crate::stats::quantile;
use crate::targets::{self, Target};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Requests per configuration.
    #[arg(long, default_value_t = 30)]
    pub requests: usize,
    /// The engine's model: `smollm2-135m-instruct` (installed by scripts/ensure-deps), or `sim`
    /// for the timing model (quick runs).
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// Words of each prompt (made-up words of several tokens each), all unique per request.
    #[arg(long, default_value_t = 24)]
    pub prompt_words: usize,
    /// Moderation service latencies to try, ms.
    #[arg(long, default_value = "20,100,300", value_delimiter = ',')]
    pub delays: Vec<u64>,
    /// Tokens generated per request for the output-policy rows.
    #[arg(long, default_value_t = 64)]
    pub output_tokens: usize,
    /// Output window, tokens.
    #[arg(long, default_value_t = 16)]
    pub window: usize,
    /// A short run that writes nothing.
    #[arg(long)]
    pub quick: bool,
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A moderation service that passes everything after a set delay.
async fn moderation_stub(delay_ms: Arc<AtomicU64>) -> anyhow::Result<SocketAddr> {
    use axum::routing::post;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/v1/moderations",
        post(move |body: Bytes| {
            let delay = delay_ms.load(Ordering::Relaxed);
            async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let n = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v["input"].as_array().map(Vec::len))
                    .unwrap_or(1);
                let one = json!({"flagged": false, "categories": {"violence": false}, "category_scores": {"violence": 0.01}});
                let body = json!({"id": "modr-bench", "model": "stub", "results": vec![one; n]}).to_string();
                ([(axum::http::header::CONTENT_TYPE, "application/json")], body)
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// One row of the report.
struct Row {
    name: String,
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    /// Output windows: how many, the mean time each was held for its verdict (ms), and the
    /// mean time a check took (ms, as warmpath timed it: the call to the service included).
    held: Option<(f64, f64, f64)>,
}

impl Row {
    fn p(&self, what: &[f64], q: f64) -> f64 {
        quantile(what.to_vec(), q) * 1000.0
    }
}

/// `n` streamed requests, one after another, each with a prompt of its own.
async fn measure(
    addr: SocketAddr,
    a: &Args,
    salt: &mut u64,
    n: usize,
    max_tokens: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
    for _ in 0..n {
        *salt += 1;
        let words: Vec<String> = (0..a.prompt_words).map(|i| format!("w{}x{}", *salt, i % 97)).collect();
        let body = json!({
            "model": "m",
            "messages": [{"role": "user", "content": format!("Request {salt}. {}", words.join(" "))}],
            "max_tokens": max_tokens, "stream": true, "temperature": 0,
            "ignore_eos": true
        });
        let o: Outcome = replay::once(addr, Bytes::from(body.to_string()), Duration::from_secs(120)).await;
        anyhow::ensure!(o.ok, "request failed: {:?}", o.error);
        ttft.push(o.ttft.unwrap_or_default().as_secs_f64());
        e2e.push(o.e2e.as_secs_f64());
    }
    Ok((ttft, e2e))
}

/// warmpath's `warmpath_safety_output_held_seconds` and `warmpath_safety_check_seconds`
/// (every check), sums and counts.
async fn held(w: &Target) -> anyhow::Result<[f64; 4]> {
    let Some(admin) = w.admin else { return Ok([0.0; 4]) };
    let (_, text) = crate::fleet::get(admin, "/metrics").await?;
    let read = |name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    Ok([
        read("warmpath_safety_output_held_seconds_sum"),
        read("warmpath_safety_output_held_seconds_count"),
        read("warmpath_safety_check_seconds_sum"),
        read("warmpath_safety_check_seconds_count"),
    ])
}

fn engine(a: &Args) -> anyhow::Result<Target> {
    let addr = targets::free_addr()?;
    let mut cmd = Command::new(targets::sibling("warmpath-engine")?);
    cmd.args(["--served-model-name", "m", "--port", &addr.port().to_string()]).args([
        "--kv-blocks",
        "4096",
        "--max-model-len",
        "4096",
    ]);
    if a.model == "sim" {
        cmd.args([
            "--executor",
            "sim",
            "--model",
            "tiny",
            "--sim-prefill-us-per-token",
            "400",
            "--sim-itl-ms",
            "8",
        ]);
    } else {
        cmd.args(["--model", &a.model]);
    }
    targets::spawn("safety-engine", &mut cmd, addr)
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let n = if a.quick { 5 } else { a.requests };
    // One stub per latency, so that every configuration runs at once.
    let mut stubs = std::collections::HashMap::new();
    for &d in a.delays.iter().chain([&0]) {
        stubs.insert(d, moderation_stub(Arc::new(AtomicU64::new(d))).await?);
    }
    let e = engine(&a)?;
    let ready = Bytes::from(
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string(),
    );
    let prompt = Bytes::from(json!({"model": "m", "prompt": "hi", "max_tokens": 1}).to_string());
    crate::engine_vs::wait_completion(e.addr, &prompt).await?;
    let mut salt = 0u64;
    let moderation_toml = |d: u64, stages: &str| {
        format!(
            "[pools.safety.moderation]\nurl = \"http://{}\"\nstages = [{stages}]\ntimeout_ms = 5000\n",
            stubs[&d]
        )
    };
    let rules = "[pools.safety.rules]\nstages = [\"input\", \"output\"]\n".to_owned();
    let output = |release: &str| {
        format!("[pools.safety.output]\nrelease = \"{release}\"\nwindow_tokens = {}\noverlap_tokens = 4\nlag_tokens = {}\n", a.window, a.window)
    };
    // (label, check delay ms, policy tables, tokens generated)
    let mut configs: Vec<(String, u64, String, usize)> = vec![
        ("no checks".into(), 0, String::new(), 1),
        ("rules (input + output)".into(), 0, rules.clone(), 1),
    ];
    for &d in &a.delays {
        configs.push((
            format!("moderation {d} ms, before"),
            d,
            format!("{}[pools.safety.input]\nmode = \"before\"\n", moderation_toml(d, "\"input\"")),
            1,
        ));
        configs.push((format!("moderation {d} ms, concurrent"), d, moderation_toml(d, "\"input\""), 1));
    }
    let out_delay = a.delays.first().copied().unwrap_or(20);
    configs.push((format!("output: none ({} tokens)", a.output_tokens), 0, String::new(), a.output_tokens));
    configs.push((
        "output: rules, after_check".into(),
        0,
        format!("{rules}{}", output("after_check")),
        a.output_tokens,
    ));
    for release in ["after_check", "buffered", "stream"] {
        configs.push((
            format!("output: moderation {out_delay} ms, {release}"),
            out_delay,
            format!("{}{}", moderation_toml(out_delay, "\"output\""), output(release)),
            a.output_tokens,
        ));
    }
    // Every configuration's warmpath at once; requests go round them in turn, so that the
    // machine's drift over the run falls on all alike.
    let mut proxies = Vec::new();
    for (label, _, tables, tokens) in &configs {
        let mut w = targets::warmpath(&[e.addr], &[], "round_robin", 1, tables)?;
        targets::wait_ready(&mut w, &ready).await?;
        measure(w.addr, &a, &mut salt, 1, *tokens).await?; // warm-up
        eprintln!("ready: {label}");
        proxies.push(w);
    }
    let before: Vec<[f64; 4]> = futures_join(&proxies).await?;
    let mut ttft = vec![Vec::new(); configs.len()];
    let mut e2e = vec![Vec::new(); configs.len()];
    let mut direct = Vec::new();
    for round in 0..n {
        eprintln!("round {}/{n}", round + 1);
        let (d, _) = measure(e.addr, &a, &mut salt, 1, 1).await?;
        direct.extend(d);
        for (i, (_, _, _, tokens)) in configs.iter().enumerate() {
            let (t, x) = measure(proxies[i].addr, &a, &mut salt, 1, *tokens).await?;
            ttft[i].extend(t);
            e2e[i].extend(x);
        }
    }
    let after: Vec<[f64; 4]> = futures_join(&proxies).await?;
    let mut rows = Vec::new();
    for (i, (label, d, _, _)) in configs.iter().enumerate() {
        let (b, f) = (before[i], after[i]);
        let windows = f[1] - b[1];
        let checks = (f[3] - b[3]).max(1.0);
        let held = (windows > 0.0)
            .then(|| (windows, (f[0] - b[0]) / windows * 1000.0, (f[2] - b[2]) / checks * 1000.0));
        rows.push((Row { name: label.clone(), ttft: ttft[i].clone(), e2e: e2e[i].clone(), held }, *d));
    }
    let md = report(&a, n, &direct, &rows);
    crate::report::publish(&md, "safety", a.out.clone(), a.quick)
}

/// Every proxy's hold and check counters.
async fn futures_join(proxies: &[Target]) -> anyhow::Result<Vec<[f64; 4]>> {
    let mut out = Vec::with_capacity(proxies.len());
    for p in proxies {
        out.push(held(p).await?);
    }
    Ok(out)
}

fn report(a: &Args, n: usize, direct: &[f64], rows: &[(Row, u64)]) -> String {
    let prefill = quantile(direct.to_vec(), 0.5) * 1000.0;
    let mut md = format!(
        "# Safety checks: what they add to a request\n\n\
         `warmpath-bench safety --model {} --requests {} --prompt-words {} --delays {}` ({}).\n\
         One engine, one client, requests one after another, every prompt unique (each pays its\n\
         prefill), going round every configuration's warmpath in turn (so that drift over the\n\
         run falls on all alike). The engine alone answers its first token in **{prefill:.1} ms** (p50) — the\n\
         prefill the checks race against. Moderation is a stub service on 127.0.0.1 that passes\n\
         everything after the given delay.\n\n",
        a.model,
        n,
        a.prompt_words,
        a.delays.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
        crate::report::date()
    );
    md.push_str("| configuration | TTFT p50 ms | TTFT p99 ms | Δ p50 vs no checks | end-to-end p50 ms |\n|---|---|---|---|---|\n");
    let base =
        rows.iter().find(|(r, _)| r.name == "no checks").map(|(r, _)| r.p(&r.ttft, 0.5)).unwrap_or(0.0);
    let out_base = rows
        .iter()
        .find(|(r, _)| r.name.starts_with("output: none"))
        .map(|(r, _)| r.p(&r.e2e, 0.5))
        .unwrap_or(0.0);
    for (r, _) in rows {
        let p50 = r.p(&r.ttft, 0.5);
        md.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:+.1} ms ({:+.1} %) | {:.1} |\n",
            r.name,
            p50,
            r.p(&r.ttft, 0.99),
            p50 - base,
            (p50 / base - 1.0) * 100.0,
            r.p(&r.e2e, 0.5)
        ));
    }
    md.push_str("\n## Goals\n\n");
    for (r, d) in rows.iter().filter(|(r, _)| r.name.ends_with("concurrent")) {
        let added = r.p(&r.ttft, 0.5) - base;
        let d = *d as f64;
        let (goal, limit) = if d < prefill {
            ("≤ 5 % of p50 TTFT (the check is faster than prefill)", base * 0.05)
        } else {
            ("≤ max(0, check − prefill) + 2 ms", (d - prefill).max(0.0) + 2.0)
        };
        let before = rows
            .iter()
            .find(|(b, _)| b.name == r.name.replace("concurrent", "before"))
            .map(|(b, _)| b.p(&b.ttft, 0.5) - base)
            .unwrap_or(f64::NAN);
        md.push_str(&format!(
            "- {}: adds {added:+.1} ms (sequential adds {before:+.1} ms); goal {goal}: limit {limit:.1} ms — **{}**\n",
            r.name,
            if added <= limit { "met" } else { "not met" }
        ));
    }
    for (r, _) in
        rows.iter().filter(|(r, _)| r.name.starts_with("output:") && !r.name.starts_with("output: none"))
    {
        let added = r.p(&r.e2e, 0.5) - out_base;
        let held = r.held.map_or("no window held".to_owned(), |(w, ms, check)| {
            let verdict = if r.name.contains("after_check") {
                // The window goes out at the first event after its verdict: one token later at most.
                let limit = check + 1.0;
                format!(
                    " (goal for after_check: ≤ one check, {check:.2} ms + 1 ms — **{}**)",
                    if ms <= limit { "met" } else { "not met" }
                )
            } else {
                String::new()
            };
            format!("{w:.0} windows held {ms:.2} ms each on average for their verdict{verdict}")
        });
        md.push_str(&format!(
            "- {}: end-to-end {added:+.1} ms over {} tokens; {held}\n",
            r.name, a.output_tokens
        ));
    }
    md.push_str(&format!(
        "\nUnder `after_check` the first text goes out when the first window of {} tokens is full and\n\
         judged, so its TTFT grows by that window's generation time — the price of releasing nothing\n\
         unchecked; `stream` keeps the TTFT and lets the checks trail.\n",
        a.window
    ));
    md
}
