//! `warmpath-bench soak`: warmpath under load while things break, and what every client saw.
//!
//! Real processes on 127.0.0.1: warmpath (this build's), three engine replicas
//! (`warmpath-engine`'s sim executor, each a process so it can be killed and stalled), and a
//! Redis holding the conversations. Chat requests (half streamed) at a fixed concurrency and
//! Responses WebSockets running turns until the requests are done, while, as the requests
//! progress:
//!
//! - replica 1 answers 3 % of requests with 500 and replica 2 cuts 5 % of streams after six
//!   tokens, throughout;
//! - replica 0 is killed (SIGKILL) at 15 % and started again at 30 %;
//! - replica 1 stalls (SIGSTOP) for three seconds at 40 %;
//! - the policy is reloaded (a changed `queue_timeout_ms`, `POST /reload`) at 55 %;
//! - Redis is restarted at 70 %.
//!
//! Every request and turn is sorted as its client saw it (`traffic::Outcome`): succeeded,
//! failed with a clean error (which), lost (cut without a word) or hung (no answer within the
//! deadline). The last two must be 0, the file descriptors warmpath holds once every client is
//! gone must be what it held before, and nothing may be left in flight: otherwise the command
//! fails. `--quick` is the size `scripts/test` runs.

mod faults;
mod traffic;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fleet::{get, post};
use crate::procfs;
use crate::stats::quantile;
use crate::targets;
use faults::Proc;
use traffic::{Tally, Work};

#[derive(clap::Args)]
pub struct Args {
    /// Chat requests in all (half streamed).
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Chat requests in flight at once.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Responses WebSockets open at once, each running turns until the requests are done.
    #[arg(long, default_value_t = 1_000)]
    websockets: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// The replicas' time per generated token.
    #[arg(long, default_value_t = 2)]
    itl_ms: u64,
    /// The WebSockets' mean pause between turns, in ms (an agent running its tools).
    #[arg(long, default_value_t = 2_000)]
    ws_pause_ms: u64,
    /// No answer within this many seconds counts as hung.
    #[arg(long, default_value_t = 60)]
    deadline_s: u64,
    /// The size the test command runs: 1,500 requests at concurrency 64, 100 WebSockets,
    /// 10 ms a token (so the faults fall on traffic in flight).
    #[arg(long)]
    quick: bool,
}

/// A fault and when it happens: the fraction of the requests done.
#[derive(Debug, Clone, Copy)]
enum Fault {
    KillReplica0,
    RestartReplica0,
    StallReplica1,
    Reload,
    RestartRedis,
}

const SCHEDULE: [(f64, Fault); 5] = [
    (0.15, Fault::KillReplica0),
    (0.30, Fault::RestartReplica0),
    (0.40, Fault::StallReplica1),
    (0.55, Fault::Reload),
    (0.70, Fault::RestartRedis),
];

/// What warmpath looked like at one moment.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    rss: u64,
    fds: usize,
    threads: usize,
}

fn snapshot(pid: u32) -> Snapshot {
    Snapshot { rss: procfs::rss_bytes(pid), fds: procfs::open_fds(pid), threads: procfs::threads(pid) }
}

/// The sum of a metric's samples whose name and labels start with `prefix`.
fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub async fn run(mut a: Args) -> anyhow::Result<()> {
    if a.quick {
        (a.requests, a.concurrency, a.websockets, a.itl_ms, a.ws_pause_ms) = (1_500, 64, 100, 10, 250);
    }
    let mut redis = faults::redis()?;
    let mut replicas = vec![
        faults::replica(0, a.itl_ms, &[])?,
        faults::replica(1, a.itl_ms, &["--fault-error-rate", "0.03"])?,
        faults::replica(2, a.itl_ms, &["--fault-die-after-tokens", "6", "--fault-die-rate", "0.05"])?,
    ];
    for r in &replicas {
        r.wait_listening(Duration::from_secs(60))?;
    }
    let (listen, admin) = (targets::free_addr()?, targets::free_addr()?);
    let file = targets::work_dir("soak-warmpath")?.join("policy.toml");
    let all: Vec<&Proc> = replicas.iter().collect();
    let (first, reloaded) = (
        faults::policy(listen, admin, redis.addr, &all, 5_000),
        faults::policy(listen, admin, redis.addr, &all, 6_000),
    );
    std::fs::write(&file, first)?;
    let mut warmpath = faults::warmpath(&file, listen)?;
    let pid = warmpath.pid().expect("started");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(get(admin, "/readyz").await, Ok((200, _))) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "warmpath did not get ready (bench/.peers/run/soak-warmpath/log.txt)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let work = Arc::new(Work {
        addr: listen,
        total: a.requests,
        max_tokens: a.max_tokens,
        next: Default::default(),
        done: Default::default(),
        finished: Default::default(),
        deadline: Duration::from_secs(a.deadline_s),
        ws_pause_ms: a.ws_pause_ms,
    });
    // A warm-up (connections to every replica pooled), then the picture before.
    let warm = Arc::new(Work { total: 30, ..clone_work(&work) });
    let warm_tally = traffic::http_client(warm).await;
    anyhow::ensure!(
        warm_tally.lost() + warm_tally.hung == 0 && warm_tally.ok.len() >= 20,
        "the warm-up failed: {warm_tally:?}"
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let before = snapshot(pid);
    let (_, metrics_before) = get(admin, "/metrics").await?;

    println!(
        "soak: {} chat requests at concurrency {}, {} WebSockets, replicas at {} ms/token",
        a.requests, a.concurrency, a.websockets, a.itl_ms
    );
    let start = Instant::now();
    let http: Vec<_> = (0..a.concurrency).map(|_| tokio::spawn(traffic::http_client(work.clone()))).collect();
    let min_turns = 2;
    let ws: Vec<_> =
        (0..a.websockets).map(|i| tokio::spawn(traffic::ws_client(work.clone(), i, min_turns))).collect();

    // The faults, as the requests progress.
    let mut log = Vec::new();
    let mut next = 0;
    let mut stalled: Option<Instant> = None;
    while work.done.load(Ordering::Relaxed) < a.requests {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if stalled.is_some_and(|t| t.elapsed() >= Duration::from_secs(3)) {
            replicas[1].resume();
            stalled = None;
            log.push((start.elapsed(), "replica 1 resumed".to_owned()));
        }
        let frac = work.done.load(Ordering::Relaxed) as f64 / a.requests as f64;
        while next < SCHEDULE.len() && frac >= SCHEDULE[next].0 {
            let what = match SCHEDULE[next].1 {
                Fault::KillReplica0 => {
                    replicas[0].kill();
                    "replica 0 killed (SIGKILL)".to_owned()
                }
                Fault::RestartReplica0 => {
                    replicas[0].restart()?;
                    "replica 0 started again".to_owned()
                }
                Fault::StallReplica1 => {
                    replicas[1].pause();
                    stalled = Some(Instant::now());
                    "replica 1 stalled (SIGSTOP, 3 s)".to_owned()
                }
                Fault::Reload => {
                    std::fs::write(&file, &reloaded)?;
                    let (status, body) = post(admin, "/reload").await?;
                    anyhow::ensure!(status == 200, "the reload failed: {status} {body}");
                    "policy reloaded (queue_timeout_ms 5000 → 6000)".to_owned()
                }
                Fault::RestartRedis => {
                    redis.stop();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    redis.restart()?;
                    redis.wait_listening(Duration::from_secs(10))?;
                    "Redis restarted".to_owned()
                }
            };
            log.push((start.elapsed(), format!("{what} at {:.0} % of requests", SCHEDULE[next].0 * 100.0)));
            next += 1;
        }
    }
    if stalled.is_some() {
        replicas[1].resume();
    }
    work.finished.store(true, Ordering::Relaxed);
    let mut chat = Tally::default();
    for t in http {
        chat.merge(t.await?);
    }
    let http_wall = start.elapsed();
    let mut turns = Tally::default();
    for t in ws {
        turns.merge(t.await?);
    }
    let wall = start.elapsed();
    let peak = procfs::peak_rss_bytes(pid);

    // Every client is gone: nothing may be left open or in flight once the pooled connections
    // to the replicas idle out.
    let settle = Instant::now();
    let (mut metrics_after, mut left) = (String::new(), f64::NAN);
    while settle.elapsed() < Duration::from_secs(15) {
        metrics_after = get(admin, "/metrics").await?.1;
        left = metric_sum(&metrics_after, "warmpath_inflight_requests")
            + metric_sum(&metrics_after, "warmpath_connections_open")
            + metric_sum(&metrics_after, "warmpath_websocket_connections");
        if left == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let after = snapshot(pid);
    let retries = metric_sum(&metrics_after, "warmpath_retries_total")
        - metric_sum(&metrics_before, "warmpath_retries_total");
    let ejections = metric_sum(&metrics_after, "warmpath_backend_ejections_total")
        - metric_sum(&metrics_before, "warmpath_backend_ejections_total");

    report(&a, &chat, &turns, retries, ejections, &log, before, after, peak, left, http_wall, wall);
    warmpath.stop();
    let lost = chat.lost() + turns.lost() + chat.hung + turns.hung;
    anyhow::ensure!(lost == 0, "{lost} requests or turns were lost or hung");
    anyhow::ensure!(
        left == 0.0,
        "{left} requests or connections still counted in warmpath after every client left"
    );
    // The same descriptors as before: listeners, Redis, the replicas' pooled connections idled
    // out (a small slack for a pooled connection being reopened by a health probe).
    anyhow::ensure!(
        after.fds <= before.fds + 4,
        "warmpath holds {} file descriptors after the soak, {} before",
        after.fds,
        before.fds
    );
    Ok(())
}

fn clone_work(w: &Work) -> Work {
    Work {
        addr: w.addr,
        total: w.total,
        max_tokens: w.max_tokens,
        next: Default::default(),
        done: Default::default(),
        finished: Default::default(),
        deadline: w.deadline,
        ws_pause_ms: w.ws_pause_ms,
    }
}

fn counts(m: &std::collections::BTreeMap<String, usize>) -> String {
    if m.is_empty() {
        return "—".into();
    }
    m.iter().map(|(k, v)| format!("{k} ×{v}")).collect::<Vec<_>>().join("; ")
}

fn percentiles(t: &Tally) -> String {
    let ms: Vec<f64> = t.ok.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    format!("{:.0} / {:.0} / {:.0}", quantile(ms.clone(), 0.5), quantile(ms.clone(), 0.9), quantile(ms, 0.99))
}

#[allow(clippy::too_many_arguments)]
fn report(
    a: &Args,
    chat: &Tally,
    turns: &Tally,
    retries: f64,
    ejections: f64,
    log: &[(Duration, String)],
    before: Snapshot,
    after: Snapshot,
    peak: u64,
    left: f64,
    http_wall: Duration,
    wall: Duration,
) {
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    println!();
    println!("| | chat requests | WebSocket turns |");
    println!("|---|---|---|");
    println!("| in all | {} | {} |", chat.total(), turns.total());
    println!("| succeeded | {} | {} |", chat.ok.len(), turns.ok.len());
    println!(
        "| failed with a clean error | {} | {} |",
        chat.clean.values().sum::<usize>(),
        turns.clean.values().sum::<usize>()
    );
    println!("| lost (cut without a word) | {} | {} |", chat.lost(), turns.lost());
    println!("| hung (no answer in {} s) | {} | {} |", a.deadline_s, chat.hung, turns.hung);
    println!(
        "| latency of successes p50 / p90 / p99 (ms) | {} | {} |",
        percentiles(chat),
        percentiles(turns)
    );
    println!();
    println!("clean errors, chat: {}", counts(&chat.clean));
    println!("clean errors, WebSocket turns: {}", counts(&turns.clean));
    if chat.lost() + turns.lost() > 0 {
        println!("LOST, chat: {}", counts(&chat.lost));
        println!("LOST, WebSocket turns: {}", counts(&turns.lost));
    }
    println!("retried on another replica (warmpath_retries_total): {retries:.0}; ejections: {ejections:.0}");
    println!(
        "requests done in {:.1} s ({:.0}/s); all turns done in {:.1} s",
        http_wall.as_secs_f64(),
        a.requests as f64 / http_wall.as_secs_f64(),
        wall.as_secs_f64()
    );
    println!();
    println!("| warmpath | before | after | peak |");
    println!("|---|---|---|---|");
    println!("| resident memory (MB) | {:.0} | {:.0} | {:.0} |", mb(before.rss), mb(after.rss), mb(peak));
    println!("| file descriptors | {} | {} | |", before.fds, after.fds);
    println!("| threads | {} | {} | |", before.threads, after.threads);
    println!("| in flight + open connections after | | {left} | |");
    println!();
    println!("faults:");
    for (t, what) in log {
        println!("- {:>6.1} s: {what}", t.as_secs_f64());
    }
}
