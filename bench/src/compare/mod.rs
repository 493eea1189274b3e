//! `compare`: one workload, against the same N engines, through each target in turn — warmpath
//! under its policies, sglang-router, vllm-router, nginx, or a direct connection — with the
//! engines' prefix caches emptied before every run.
//! - `--workload trace`: a Mooncake trace replayed open-loop. Hit rates beside the offline oracle
//!   and partition ceiling, TTFT and end-to-end percentiles, prefilled tokens, request and work
//!   imbalance across backends, client bytes, proxy CPU and RSS, errors.
//! - `--workload agent`: agent sessions run closed-loop and in step under each client mode
//!   (`naive`: a new connection per turn; `http`: keep-alive; `ws`: Responses WebSocket mode,
//!   only new items per turn), with the same figures plus a per-turn table (prefilled tokens,
//!   TTFT, client bytes, the target's CPU as conversations grow).

mod summary;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use warmpath_wire::tokenizer::Tokenizer;

use crate::agent::{self, AgentOpts};
use crate::fleet::{Counters, EngineOpts, Fleet, BLOCK_SIZE};
use crate::refs::{self, HitRate};
use crate::replay::{self, Connection, Outcome, Progress};
use crate::targets::{self, Target};
use crate::trace::{self, TraceOpts};
use crate::workload::Request;
use crate::{procfs, stats};
use summary::Context;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// The trace as recorded (after scaling).
    Plain,
    /// Arrivals `--load-multiplier` times faster than plain.
    HighLoad,
    /// One long system prompt shared by every request (one agent persona for all traffic).
    HotPrefix,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    Trace,
    Agent,
}

/// How the agent workload's client talks to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Full resend over a new HTTP connection per turn.
    Naive,
    /// Full resend over one keep-alive connection per session.
    Http,
    /// Responses WebSocket mode, one connection per session, only new items per turn
    /// (`previous_response_id`); warmpath targets only.
    Ws,
}

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = Workload::Trace)]
    workload: Workload,
    /// Mooncake-format trace (default: the synthetic trace in ../shared/traces; with --quick,
    /// its first 300 records bundled in bench/traces).
    #[arg(long)]
    trace: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Scenario::Plain)]
    scenario: Scenario,
    /// Number of engine replicas.
    #[arg(long, default_value_t = 4)]
    backends: usize,
    /// Targets, `system:policy`: warmpath:round_robin|least_load|prefix_hash|session|cache_aware,
    /// each with optional `+canon` (canonicalization), `+tok` (prefix blocks in the engines'
    /// tokens, requests as sent; without it, byte chunks), `+defer` (tool deferral) and
    /// `+precise` (cache_aware on the engines' KV events; implies `+tok`), then `@KEY=VALUE` per
    /// key of the policy's table (`warmpath:cache_aware@miss_weight=2`), sglang-router:POLICY,
    /// vllm-router:POLICY, nginx:round_robin, direct (all to engine 0). Default for `trace`:
    /// warmpath cache_aware (precise, and approximate with +tok), prefix_hash and round_robin,
    /// sglang-router and vllm-router cache_aware; for `agent`: warmpath:session as sent and
    /// with +canon+defer, and cache_aware+canon+defer+precise.
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// agent: client modes, each run against every target.
    #[arg(long, value_delimiter = ',', default_value = "naive,http")]
    modes: Vec<Mode>,
    /// agent: concurrent sessions.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// agent: turns per session.
    #[arg(long, default_value_t = 10)]
    turns: usize,
    /// agent: seed of the sessions' scripts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// agent: tokens of the system prompt's stable part.
    #[arg(long, default_value_t = 1500)]
    system_tokens: usize,
    /// agent: tool schemas per session, `MIN:MAX`.
    #[arg(long, default_value = "100:200")]
    tools: String,
    /// agent: tokens of each tool result.
    #[arg(long, default_value_t = 200)]
    result_tokens: usize,
    /// Length scale: a 512-token trace block becomes 512 × scale tokens.
    #[arg(long, default_value_t = 0.0625)]
    scale: f64,
    /// Time speed-up of the arrivals (high-load multiplies it by `--load-multiplier`).
    #[arg(long, default_value_t = 10.0)]
    speedup: f64,
    /// First and last request of the trace, `START:END`.
    #[arg(long)]
    slice: Option<String>,
    /// At most this many requests.
    #[arg(long)]
    cap: Option<usize>,
    /// Tokens of the shared system prompt in the hot-prefix scenario.
    #[arg(long, default_value_t = 1024)]
    hot_prefix_tokens: usize,
    /// How much faster than `--speedup` the high-load scenario's arrivals come.
    #[arg(long, default_value_t = 1.6)]
    load_multiplier: f64,
    /// Cap on generated tokens per request (after scaling).
    #[arg(long, default_value_t = 32)]
    max_output: usize,
    /// Runs of every target (interleaved; medians reported).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// warmpath's worker threads.
    #[arg(long, default_value_t = 2)]
    proxy_threads: usize,
    /// TOML appended to warmpath's generated policy file (e.g. `[pools.prefix_hash]` keys).
    #[arg(long)]
    warmpath_toml: Option<PathBuf>,
    /// Seconds a request may take before it counts as an error.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// Print the workload's size, KV sizing, references and estimated load, then exit.
    #[arg(long)]
    plan: bool,
    /// Smoke test: 300 requests (agent: 4 sessions × 4 turns), 2 backends, no file written
    /// unless --out is given; exits non-zero if any request failed.
    #[arg(long)]
    quick: bool,
    /// Report directory (default bench/results).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also write every request's numbers (one TSV per run: request, prompt tokens, cached
    /// tokens, TTFT and end-to-end ms) to this directory, for looking into tails.
    #[arg(long)]
    per_request: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineOpts,
}

/// How long each target's idle CPU rate is measured before its run.
const IDLE_PROBE: Duration = Duration::from_secs(2);

/// One run of one target.
#[derive(Debug, Clone)]
struct Run {
    outcomes: Vec<Outcome>,
    per_backend: Vec<Counters>,
    wall: Duration,
    proxy_cpu_ns: Option<u64>,
    rss_mb: Option<f64>,
    /// Agent workload: the target's CPU per session in each turn, µs (turns run in step).
    turn_cpu_us: Vec<f64>,
}

impl Run {
    fn hit(&self) -> HitRate {
        let q: f64 = self.per_backend.iter().map(|c| c.prefix_queries).sum();
        let h: f64 = self.per_backend.iter().map(|c| c.prefix_hits).sum();
        HitRate { hits: h as u64, queries: q as u64 }
    }
    fn imbalance(v: impl Iterator<Item = f64>) -> f64 {
        let v: Vec<f64> = v.collect();
        let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
        v.iter().copied().fold(0.0, f64::max) / mean.max(1e-9)
    }
    fn request_imbalance(&self) -> f64 {
        Self::imbalance(self.per_backend.iter().map(|c| c.requests))
    }
    fn work_imbalance(&self) -> f64 {
        Self::imbalance(self.per_backend.iter().map(Counters::prefilled))
    }
    /// Engines' busy fraction over the run: the mean, or the busiest engine's.
    fn busy(&self, max: bool) -> f64 {
        let w = self.wall.as_secs_f64().max(1e-9);
        let v = self.per_backend.iter().map(|c| c.busy_s / w);
        if max {
            v.fold(0.0, f64::max)
        } else {
            v.sum::<f64>() / self.per_backend.len().max(1) as f64
        }
    }

    fn pct(&self, p: f64, f: impl Fn(&Outcome) -> Option<Duration>) -> f64 {
        stats::quantile(
            self.outcomes.iter().filter(|o| o.ok).filter_map(&f).map(|d| d.as_secs_f64() * 1e3).collect(),
            p,
        )
    }
    fn errors(&self) -> usize {
        self.outcomes.iter().filter(|o| !o.ok).count()
    }
    fn output_tps(&self) -> f64 {
        self.outcomes.iter().map(|o| o.output_tokens).sum::<usize>() as f64
            / self.wall.as_secs_f64().max(1e-9)
    }
}

fn parse_slice(s: &Option<String>) -> anyhow::Result<(usize, Option<usize>)> {
    let Some(s) = s else { return Ok((0, None)) };
    let (a, b) = s.split_once(':').ok_or_else(|| anyhow::anyhow!("--slice wants START:END"))?;
    let start = if a.is_empty() { 0 } else { a.parse()? };
    let end = if b.is_empty() { None } else { Some(b.parse()?) };
    Ok((start, end))
}

/// The workload's requests and how they are sent.
struct Built {
    reqs: Vec<Request>,
    /// Trace options (for the report), or `None` for the agent workload.
    topts: Option<TraceOpts>,
    sessions: Vec<Vec<usize>>,
}

fn build(a: &Args, model: &str, tok: &Tokenizer) -> anyhow::Result<Built> {
    Ok(match a.workload {
        Workload::Trace => {
            let path = a.trace.clone().unwrap_or_else(|| {
                targets::root().join(if a.quick {
                    "bench/traces/mooncake-synthetic-head300.jsonl"
                } else {
                    "../shared/traces/mooncake_synthetic_trace.jsonl"
                })
            });
            let records = trace::load(&path)?;
            let topts = TraceOpts {
                scale: a.scale,
                speedup: a.speedup,
                slice: parse_slice(&a.slice)?,
                cap: if a.quick { Some(a.cap.unwrap_or(300).min(300)) } else { a.cap },
                hot_prefix_tokens: if a.scenario == Scenario::HotPrefix { a.hot_prefix_tokens } else { 0 },
                max_output: a.max_output,
            };
            let selected = trace::select(&records, &topts);
            anyhow::ensure!(!selected.is_empty(), "the slice of {} is empty", path.display());
            Built {
                reqs: trace::requests(&selected, &topts, model, tok),
                topts: Some(topts),
                sessions: Vec::new(),
            }
        }
        Workload::Agent => {
            let (lo, hi) = a.tools.split_once(':').ok_or_else(|| anyhow::anyhow!("--tools wants MIN:MAX"))?;
            let (lo, hi): (usize, usize) = (lo.parse()?, hi.parse()?);
            anyhow::ensure!(1 <= lo && lo <= hi, "--tools: need 1 <= MIN <= MAX");
            let o = AgentOpts {
                sessions: if a.quick { a.sessions.min(4) } else { a.sessions },
                turns: if a.quick { a.turns.min(4) } else { a.turns },
                seed: a.seed,
                system_tokens: a.system_tokens,
                tools: (lo, hi),
                result_tokens: a.result_tokens,
                max_output: a.max_output,
            };
            let reqs = agent::requests(&o, model, tok);
            let sessions = agent::sessions(&reqs);
            Built { reqs, topts: None, sessions }
        }
    })
}

/// What one run sends: a target spec and, for the agent workload, a client mode.
#[derive(Debug, Clone)]
struct Slot {
    spec: String,
    mode: Option<Mode>,
}

impl Slot {
    fn label(&self) -> String {
        match self.mode {
            None => self.spec.clone(),
            Some(m) => format!("{} ({})", self.spec, value_name(m)),
        }
    }
}

/// One run's requests as TSV, in the workload's order (`per_request`).
fn write_per_request(
    dir: &std::path::Path,
    label: &str,
    round: usize,
    outcomes: &[Outcome],
) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir)?;
    let name: String =
        label.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut text =
        String::from("request\tok\tprompt_tokens\tcached_tokens\tttft_ms\te2e_ms\tbackend\troute\n");
    for (i, o) in outcomes.iter().enumerate() {
        let opt = |v: Option<usize>| v.map_or(String::new(), |v| v.to_string());
        let ttft = o.ttft.map_or(String::new(), |d| format!("{:.1}", ms(d)));
        let _ = writeln!(
            text,
            "{i}\t{}\t{}\t{}\t{ttft}\t{:.1}\t{}\t{}",
            u8::from(o.ok),
            opt(o.prompt_tokens),
            opt(o.cached_tokens),
            ms(o.e2e),
            o.backend.as_deref().unwrap_or(""),
            o.route.as_deref().unwrap_or(""),
        );
    }
    std::fs::write(dir.join(format!("{name}-{round}.tsv")), text)?;
    Ok(())
}

/// The command-line spelling of a value (`high-load`, `naive`): reports use the flags' words.
fn value_name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value().map(|p| p.get_name().to_owned()).unwrap_or_default()
}

pub async fn run(mut a: Args) -> anyhow::Result<()> {
    let tok = Tokenizer::wp32k();
    let model = "bench-model";
    let backends = if a.quick { a.backends.min(2) } else { a.backends };
    if a.targets.is_empty() {
        a.targets = match a.workload {
            Workload::Trace => "warmpath:cache_aware+precise,warmpath:cache_aware+tok,warmpath:prefix_hash,warmpath:round_robin,sglang-router:cache_aware,vllm-router:cache_aware",
            Workload::Agent => "warmpath:session,warmpath:session+canon+defer,warmpath:cache_aware+canon+defer+precise",
        }
        .split(',')
        .map(String::from)
        .collect();
    }
    let mut built = build(&a, model, &tok)?;

    // References and engine sizing, on exactly these prompts.
    let prompts: Vec<&[u32]> = built.reqs.iter().map(|r| &r.tokens[..]).collect();
    let ws = refs::working_set_blocks(&prompts, BLOCK_SIZE);
    let longest = built.reqs.iter().map(|r| r.tokens.len() + r.max_tokens).max().unwrap_or(0);
    let min_blocks = longest.div_ceil(BLOCK_SIZE) + 8;
    let kv_blocks = a
        .engine
        .kv_blocks
        .unwrap_or_else(|| (ws as f64 * a.engine.kv_fraction).ceil() as usize)
        .max(min_blocks);
    // The agent workload's sessions interleave turn by turn; the references take that order.
    let order: Vec<usize> = if built.sessions.is_empty() {
        (0..prompts.len()).collect()
    } else {
        let turns = built.sessions.iter().map(Vec::len).max().unwrap_or(0);
        (0..turns).flat_map(|t| built.sessions.iter().filter_map(move |s| s.get(t).copied())).collect()
    };
    let ordered: Vec<&[u32]> = order.iter().map(|&i| prompts[i]).collect();
    let oracle = refs::oracle(&ordered, BLOCK_SIZE);
    let ceiling = refs::lru_ceiling(&ordered, BLOCK_SIZE, kv_blocks * backends);
    if a.workload == Workload::Trace && a.scenario == Scenario::HighLoad {
        anyhow::ensure!(a.load_multiplier > 0.0, "--load-multiplier must be positive");
        for r in &mut built.reqs {
            r.at = r.at.div_f64(a.load_multiplier);
        }
        if let Some(t) = built.topts.as_mut() {
            t.speedup *= a.load_multiplier;
        }
    }
    let span = built.reqs.last().map_or(0.0, |r| r.at.as_secs_f64());
    eprintln!(
        "{} requests{}, working set {ws} blocks, {backends} engines × {kv_blocks} blocks (KV {:.2}× the working \
         set), oracle {:.3}, partition ceiling {:.3}",
        built.reqs.len(),
        match &built.topts {
            Some(t) => format!(" over {span:.0} s (speed-up {:.1})", t.speedup),
            None => format!(" ({} sessions)", built.sessions.len()),
        },
        (kv_blocks * backends) as f64 / ws.max(1) as f64,
        oracle.rate(),
        ceiling.rate()
    );
    if a.plan {
        return Ok(());
    }
    // In `ws` mode the conversation warmpath keeps holds the model's answers too: each turn's
    // output joins the next prompt.
    let answers = if a.modes.contains(&Mode::Ws) { a.turns * (a.max_output + 16) } else { 0 };
    let fleet = Fleet::start(backends, &a.engine, kv_blocks, longest + 64 + answers, model).await?;
    let extra = match &a.warmpath_toml {
        Some(p) => std::fs::read_to_string(p)?,
        None => String::new(),
    };
    let slots: Vec<Slot> = match a.workload {
        Workload::Trace => a.targets.iter().map(|t| Slot { spec: t.clone(), mode: None }).collect(),
        Workload::Agent => a
            .targets
            .iter()
            .flat_map(|t| {
                a.modes
                    .iter()
                    .filter(|m| **m != Mode::Ws || t.starts_with("warmpath"))
                    .map(|m| Slot { spec: t.clone(), mode: Some(*m) })
            })
            .collect(),
    };
    let reqs = Arc::new(built.reqs.clone());
    let ready_body = Bytes::from(crate::requests::small(model));
    let timeout = Duration::from_secs(a.timeout_s);
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); slots.len()];
    let total_runs = a.rounds * slots.len();
    let mut n = 0;
    for round in 0..a.rounds {
        for k in 0..slots.len() {
            let i = (k + round) % slots.len();
            n += 1;
            let slot = &slots[i];
            let mut target =
                start_target(&slot.spec, &fleet.addrs(), &fleet.backend_toml(), a.proxy_threads, &extra)?;
            targets::wait_ready(&mut target, &ready_body).await?;
            // Let routers finish their start-up probes, then start every engine cold.
            tokio::time::sleep(Duration::from_millis(500)).await;
            fleet.reset().await?;
            // The target's CPU while idle (health probes, timers), subtracted from the run's.
            let idle0 = target.pid().map(procfs::cpu_ns);
            tokio::time::sleep(IDLE_PROBE).await;
            let before = fleet.counters().await?;
            let cpu0 = target.pid().map(procfs::cpu_ns);
            let idle_rate =
                idle0.zip(cpu0).map(|(a, b)| b.saturating_sub(a) as f64 / IDLE_PROBE.as_secs_f64());
            let progress = Arc::new(Progress::default());
            let line = replay::progress_line(
                format!("[{n}/{total_runs}] {}", slot.label()),
                reqs.len(),
                progress.clone(),
            );
            let start = Instant::now();
            let clock = slot.mode.map(|_| replay::TurnClock::new(built.sessions.len(), target.pid()));
            let outcomes = match slot.mode {
                None => replay::open_loop(target.addr, reqs.clone(), progress, timeout).await,
                Some(Mode::Ws) => {
                    let s = built.sessions.clone();
                    replay::ws_sessions(target.addr, reqs.clone(), s, progress, timeout, clock.clone()).await
                }
                Some(m) => {
                    let conn = if m == Mode::Naive { Connection::PerRequest } else { Connection::KeepAlive };
                    replay::sessions(
                        target.addr,
                        reqs.clone(),
                        built.sessions.clone(),
                        conn,
                        progress,
                        timeout,
                        clock.clone(),
                    )
                    .await
                }
            };
            let wall = start.elapsed();
            let _ = line.await;
            let cpu1 = target.pid().map(procfs::cpu_ns);
            let after = fleet.counters().await?;
            let rss_mb = target.pid().map(|p| procfs::rss_bytes(p) as f64 / (1 << 20) as f64);
            if let Some(e) = outcomes.iter().find_map(|o| o.error.clone()) {
                eprintln!("  first error: {e}");
            }
            if let Some(dir) = &a.per_request {
                write_per_request(dir, &slot.label(), runs[i].len(), &outcomes)?;
            }
            runs[i].push(Run {
                outcomes,
                per_backend: after.iter().zip(&before).map(|(a, b)| a.minus(b)).collect(),
                wall,
                proxy_cpu_ns: cpu0.zip(cpu1).zip(idle_rate).map(|((a, b), idle)| {
                    (b.saturating_sub(a) as f64 - idle * wall.as_secs_f64()).max(0.0) as u64
                }),
                rss_mb,
                turn_cpu_us: clock
                    .map(|c| c.per_turn_us(built.sessions.len(), idle_rate.unwrap_or(0.0)))
                    .filter(|_| target.pid().is_some())
                    .unwrap_or_default(),
            });
            drop(target);
        }
    }

    let ctx = Context {
        a: &a,
        slots: &slots,
        reqs: &built.reqs,
        topts: built.topts.as_ref(),
        ws,
        kv_blocks,
        backends,
        oracle,
        ceiling,
    };
    let md = ctx.markdown(&runs);
    print!("{md}");
    let out_dir = a.out.clone().or_else(|| (!a.quick).then(|| targets::root().join("bench/results")));
    if let Some(dir) = out_dir {
        std::fs::create_dir_all(&dir)?;
        let stem = match a.workload {
            Workload::Trace => format!("compare-trace-{}-{}", value_name(a.scenario), crate::report::date()),
            Workload::Agent => format!("compare-agent-{}", crate::report::date()),
        };
        std::fs::write(dir.join(format!("{stem}.svg")), ctx.chart(&runs))?;
        let md = md.replace("CHART", &format!("![hit rate and TTFT by target]({stem}.svg)"));
        std::fs::write(dir.join(format!("{stem}.md")), md)?;
        eprintln!("written: {}", dir.join(format!("{stem}.md")).display());
    }
    drop(fleet);
    // A smoke test fails when anything failed.
    let errors: usize = runs.iter().flatten().map(Run::errors).sum();
    anyhow::ensure!(!a.quick || errors == 0, "{errors} requests failed (first errors above)");
    Ok(())
}

fn start_target(
    spec: &str,
    backends: &[std::net::SocketAddr],
    per_backend: &[String],
    threads: usize,
    extra: &str,
) -> anyhow::Result<Target> {
    let (system, policy) = spec.split_once(':').unwrap_or((spec, ""));
    match system {
        "warmpath" => targets::warmpath(backends, per_backend, if policy.is_empty() { "round_robin" } else { policy }, threads, extra),
        "sglang-router" | "vllm-router" => {
            targets::rust_router(system, backends, if policy.is_empty() { "cache_aware" } else { policy })
        }
        "nginx" => targets::nginx(backends),
        "direct" => Ok(targets::direct(backends[0])),
        _ => anyhow::bail!("unknown target {spec:?} (warmpath:POLICY, sglang-router:POLICY, vllm-router:POLICY, nginx, direct)"),
    }
}
