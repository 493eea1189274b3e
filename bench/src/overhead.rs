//! Proxy overhead, side by side in one run: every target in front of the same fast upstream,
//! for a small chat request and a ~60 KB agent request, at fixed concurrency. Targets run in
//! rotation, repeated; the report gives medians of requests/s, p50/p99 latency, and the proxy
//! process tree's CPU time per request (from /proc) with ratios against nginx and the best of
//! the Rust routers.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;

use crate::load;
use crate::procfs;
use crate::requests;
use crate::stats::median;
use crate::targets::{self, Target};
use crate::upstream;

#[derive(clap::Args)]
pub struct Args {
    /// Requests per target per round and workload.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Rounds (targets rotate within each; medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// warmpath's worker threads (`[server] threads`); nginx runs one worker process.
    #[arg(long, default_value_t = 1)]
    proxy_threads: usize,
    /// Peers to leave out (comma-separated: nginx, sglang-router, vllm-router).
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
    /// Only the targets named (comma-separated), e.g. to profile
    /// one warmpath configuration alone: `--only "warmpath round_robin"`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only these workloads (comma-separated prefixes: small, agent, streamed).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// A short run for smoke tests (fewer requests, one round).
    #[arg(long)]
    quick: bool,
    /// Where the markdown report goes (default bench/results/overhead-DATE.md).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Measure the edge (TLS, API keys) in a quick run too (full runs always do).
    #[arg(long)]
    edge: bool,
    /// Another warmpath binary (a build of the code before a change) run beside this build's,
    /// in both configurations: the before/after ratio comes from the same run.
    #[arg(long)]
    baseline: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    cpu_us: Option<f64>,
    rss_mb: Option<f64>,
    errors: usize,
}

/// Where a measurement sends its requests and what it expects back.
#[derive(Debug, Clone, Copy)]
struct Probe {
    path: &'static str,
    expect: u16,
}

/// The proxied route.
const PROXIED: Probe = Probe { path: "/v1/chat/completions", expect: 200 };
/// A path warmpath answers itself (404 in the OpenAI error shape) without touching a backend:
/// the floor of its per-request cost, pingora's request handling and response included.
const FLOOR: Probe = Probe { path: "/v1/no-such-route", expect: 404 };

async fn measure(t: &Target, body: &Bytes, n: usize, concurrency: usize, probe: Probe) -> Sample {
    // Warm connections and caches first.
    let warm = (n / 10).max(50);
    load::run(t.addr, probe.path, body.clone(), concurrency, warm, probe.expect, &t.client).await;
    let cpu0 = t.pid().map(procfs::cpu_ns);
    let r = load::run(t.addr, probe.path, body.clone(), concurrency, n, probe.expect, &t.client).await;
    let cpu1 = t.pid().map(procfs::cpu_ns);
    let done = r.latencies.len().max(1) as f64;
    Sample {
        rps: r.rps(),
        p50_ms: r.percentile_ms(0.5),
        p99_ms: r.percentile_ms(0.99),
        cpu_us: cpu0.zip(cpu1).map(|(a, b)| (b.saturating_sub(a)) as f64 / 1e3 / done),
        rss_mb: t.pid().map(|p| procfs::rss_bytes(p) as f64 / (1 << 20) as f64),
        errors: r.errors,
    }
}

/// The warmpath target with every request-shaping stage on.
const FULL: &str = "round_robin+canon+defer";
/// The same with cache-aware routing (block hashes of the canonical prompt, the prefix index).
const CACHE_AWARE: &str = "cache_aware+canon+defer";

pub async fn run(a: Args) -> anyhow::Result<()> {
    let (requests, rounds) = if a.quick { (500, 1) } else { (a.requests, a.rounds) };
    let up = upstream::start()?;
    let model = upstream::model();
    let small = Bytes::from(requests::small(model));
    let agent = Bytes::from(requests::agent(model));
    let (few, many) = (22, 220);
    let stream_few = Bytes::from(requests::streamed(model, few));
    let stream_many = Bytes::from(requests::streamed(model, many));

    let mut list: Vec<Target> = vec![
        targets::direct(up),
        targets::warmpath(&[up], &[], "round_robin", a.proxy_threads, "")?,
        // Everything on: canonicalization, block hashing with the engine's tokenizer, deferral.
        targets::warmpath(&[up], &[], FULL, a.proxy_threads, "")?,
        targets::warmpath(&[up], &[], CACHE_AWARE, a.proxy_threads, "")?,
    ];
    if let Some(bin) = &a.baseline {
        for spec in ["round_robin", FULL] {
            let mut t = targets::warmpath_binary(bin, &[up], &[], spec, a.proxy_threads, "")?;
            t.name = format!("baseline {spec}");
            list.push(t);
        }
    }
    // The edge: HTTPS (kept-alive, and a connection per request with a full or a resumed
    // handshake, beside plain HTTP with a connection per request), and API keys with limits.
    if !a.quick || a.edge {
        list.extend(crate::edge_cost::targets(up, a.proxy_threads)?);
    }
    // A second warmpath whose requests go to a path it answers itself: its floor.
    let mut floor = targets::warmpath(&[up], &[], "round_robin", a.proxy_threads, "")?;
    floor.name = "floor: warmpath answers 404 itself".into();
    list.push(floor);
    let probe = |t: &Target| if t.name.starts_with("floor") { FLOOR } else { PROXIED };
    // The floor answers without a backend: nothing to stream.
    let applies =
        |t: &Target, workload: &str| !(t.name.starts_with("floor") && workload.starts_with("streamed"));
    let skip = |n: &str| a.skip.iter().any(|s| s == n);
    if !skip("nginx") {
        list.push(targets::nginx(&[up])?);
    }
    for (which, policies) in
        [("sglang-router", &["round_robin"][..]), ("vllm-router", &["round_robin", "cache_aware"][..])]
    {
        if !skip(which) {
            for p in policies {
                list.push(targets::rust_router(which, &[up], p)?);
            }
        }
    }
    // A peer that does not start (its port taken meanwhile) is left out and the report says so;
    // warmpath's own targets must start.
    let mut left_out = Vec::new();
    let mut ready = Vec::with_capacity(list.len());
    let wanted = |t: &Target| a.only.is_empty() || a.only.contains(&t.name);
    for mut t in list.into_iter().filter(wanted) {
        match targets::wait_ready(&mut t, &small).await {
            Ok(()) => {
                eprintln!("ready: {}", t.name);
                ready.push(t);
            }
            Err(e) if ["nginx", "sglang-router", "vllm-router"].iter().any(|p| t.name.starts_with(p)) => {
                eprintln!("leaving out {}: {e:#}", t.name);
                left_out.push(format!("{e:#}"));
            }
            Err(e) => return Err(e),
        }
    }
    let list = ready;

    // (name, body, requests ÷): a streamed answer takes a few milliseconds a chunk (the
    // upstream's timer), so the streams run a quarter and a fortieth of the requests.
    let workloads: Vec<(&str, &Bytes, usize)> = [
        ("small", &small, 1),
        ("agent 60 KB", &agent, 1),
        ("streamed, 22 chunks", &stream_few, 4),
        ("streamed, 220 chunks", &stream_many, 40),
    ]
    .into_iter()
    .filter(|(w, ..)| a.workloads.is_empty() || a.workloads.iter().any(|k| w.starts_with(k.as_str())))
    .collect();
    // samples[workload][target] over rounds
    let mut samples = vec![vec![Vec::<Sample>::new(); list.len()]; workloads.len()];
    let steps = rounds * workloads.len() * list.len();
    let mut step = 0;
    for round in 0..rounds {
        for (w, (wname, body, divisor)) in workloads.iter().enumerate() {
            // Rotate the order each round so no target always runs first.
            for k in 0..list.len() {
                let i = (k + round) % list.len();
                step += 1;
                if !applies(&list[i], wname) {
                    continue;
                }
                eprint!("\r[{step}/{steps}] {:<28}", list[i].name);
                let n = (requests / divisor).max(50);
                let s = measure(&list[i], body, n, a.concurrency, probe(&list[i])).await;
                samples[w][i].push(s);
            }
        }
    }
    eprintln!();

    let cmdline: Vec<String> = std::env::args().collect();
    let mut md = String::new();
    let _ = writeln!(md, "# Proxy overhead — {}\n", crate::report::date());
    let _ =
        writeln!(md, "Command: `{}` (release build; peers from `scripts/bench-peers`)\n", cmdline.join(" "));
    let _ = writeln!(
        md,
        "Every target in front of the same fast upstream (an in-process axum server answering a fixed \
         completion), {} requests per target per round at {} keep-alive connections, {} round(s), targets \
         rotating within each round; medians over rounds. CPU is the proxy process tree's time on CPU \
         (all threads, /proc/PID/task/*/schedstat) divided by requests. 2-core shared machine: latency \
         figures include the load generator and upstream competing for the same cores; CPU/request is the \
         stable figure.\n",
        requests, a.concurrency, rounds
    );
    for why in &left_out {
        let _ = writeln!(md, "Left out: {why}.\n");
    }
    let mut per_workload: Vec<Vec<(String, Option<f64>)>> = Vec::new();
    for (w, (wname, body, _)) in workloads.iter().enumerate() {
        let _ = writeln!(md, "## {wname} request ({} bytes)\n", body.len());
        let _ = writeln!(md, "| target | req/s | p50 ms | p99 ms | CPU µs/req | RSS MB | errors |");
        let _ = writeln!(md, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        let mut cpu_of = Vec::new();
        for (i, t) in list.iter().enumerate().filter(|(_, t)| applies(t, wname)) {
            let s = &samples[w][i];
            let cpu = s
                .iter()
                .all(|x| x.cpu_us.is_some())
                .then(|| median(s.iter().filter_map(|x| x.cpu_us).collect()));
            let rss = s
                .iter()
                .all(|x| x.rss_mb.is_some())
                .then(|| median(s.iter().filter_map(|x| x.rss_mb).collect()));
            cpu_of.push((t.name.clone(), cpu));
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.2} | {:.2} | {} | {} | {} |",
                t.name,
                median(s.iter().map(|x| x.rps).collect()),
                median(s.iter().map(|x| x.p50_ms).collect()),
                median(s.iter().map(|x| x.p99_ms).collect()),
                cpu.map(|c| format!("{c:.1}")).unwrap_or_else(|| "—".into()),
                rss.map(|r| format!("{r:.1}")).unwrap_or_else(|| "—".into()),
                s.iter().map(|x| x.errors).sum::<usize>(),
            );
        }
        let get = |prefix: &str| {
            cpu_of.iter().filter(|(n, _)| n.starts_with(prefix)).filter_map(|(_, c)| *c).reduce(f64::min)
        };
        let exact = |name: &str| cpu_of.iter().find(|(n, _)| n == name).and_then(|(_, c)| *c);
        let _ = writeln!(md);
        let rust_best = [get("sglang-router"), get("vllm-router")].into_iter().flatten().reduce(f64::min);
        if let (Some(full), Some(plain)) = (exact(&format!("warmpath {FULL}")), exact("warmpath round_robin"))
        {
            let _ = writeln!(md, "- warmpath {FULL} CPU / warmpath round_robin CPU: {:.2}×", full / plain);
            if let Some(rb) = rust_best {
                let _ = writeln!(md, "- warmpath {FULL} CPU / best Rust router CPU: **{:.2}×**", full / rb);
            }
        }
        for spec in ["round_robin", FULL] {
            if let (Some(now), Some(before)) =
                (exact(&format!("warmpath {spec}")), exact(&format!("baseline {spec}")))
            {
                let _ = writeln!(md, "- warmpath {spec} CPU / baseline {spec} CPU: **{:.2}×**", now / before);
            }
        }
        // The edge against the plain path (same build, same run).
        if let Some(plain) = exact("warmpath round_robin") {
            for (name, base, base_name) in [
                ("warmpath https", plain, "warmpath round_robin"),
                ("warmpath API key + limits", plain, "warmpath round_robin"),
                ("warmpath API key + limits in Redis", plain, "warmpath round_robin"),
            ] {
                if let Some(c) = exact(name) {
                    let _ = writeln!(
                        md,
                        "- {name} CPU / {base_name} CPU: **{:.2}×** (+{:.1} µs/req)",
                        c / base,
                        c - base
                    );
                }
            }
        }
        if let Some(fresh) = exact("warmpath http, new connection per request") {
            for name in [
                "warmpath https, new connection, full handshake",
                "warmpath https, new connection, resumed session",
            ] {
                if let Some(c) = exact(name) {
                    let _ = writeln!(
                        md,
                        "- {name} CPU / http with a new connection per request: **{:.2}×** (the handshake: +{:.1} µs)",
                        c / fresh,
                        c - fresh
                    );
                }
            }
        }
        for spec in [FULL, CACHE_AWARE] {
            if let (Some(full), Some(ng)) = (exact(&format!("warmpath {spec}")), get("nginx")) {
                let _ = writeln!(md, "- warmpath {spec} CPU / nginx CPU: **{:.2}×**", full / ng);
            }
        }
        per_workload.push(cpu_of.clone());
        if let Some(wp) = exact("warmpath round_robin") {
            if let Some(ng) = get("nginx") {
                let _ = writeln!(md, "- warmpath CPU / nginx CPU: **{:.2}×**", wp / ng);
                if let Some(fl) = get("floor") {
                    let _ = writeln!(
                        md,
                        "- floor (warmpath on pingora answering a 404 itself, no upstream) / nginx proxying: {:.2}×",
                        fl / ng
                    );
                }
            }
            if let Some(rb) = rust_best {
                let _ = writeln!(md, "- warmpath CPU / best Rust router CPU: **{:.2}×**", wp / rb);
            }
        }
        let _ = writeln!(md);
    }
    // What one more chunk of a stream costs: the difference between the long and the short
    // stream over the chunks between them. Flat per-chunk cost is this figure matching the
    // short stream's cost per chunk less its fixed part.
    let streamed: Vec<usize> =
        workloads.iter().enumerate().filter(|(_, w)| w.0.starts_with("streamed")).map(|(i, _)| i).collect();
    if let [short, long] = streamed[..] {
        let chunks = (many - few) as f64;
        let _ = writeln!(
            md,
            "## Per streamed chunk
"
        );
        let _ = writeln!(
            md,
            "CPU of one more chunk: (CPU/req with {many} chunks − with {few}) ÷ {}.
",
            many - few
        );
        let _ = writeln!(
            md,
            "| target | CPU µs/chunk |
| --- | ---: |"
        );
        let mut per_chunk = Vec::new();
        for ((name, s), (_, l)) in per_workload[short].iter().zip(&per_workload[long]) {
            if let (Some(s), Some(l)) = (s, l) {
                let c = (l - s) / chunks;
                let _ = writeln!(md, "| {name} | {c:.2} |");
                per_chunk.push((name.clone(), c));
            }
        }
        let find = |p: &str| per_chunk.iter().find(|(n, _)| n.starts_with(p)).map(|(_, c)| *c);
        if let (Some(wp), Some(ng)) = (find("warmpath round_robin"), find("nginx")) {
            let _ = writeln!(md, "\n- warmpath CPU per chunk / nginx CPU per chunk: **{:.2}×**", wp / ng);
        }
        let _ = writeln!(md);
    }
    crate::report::publish(&md, "overhead", a.out, a.quick)?;
    drop(list);
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}
