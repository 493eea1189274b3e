//! `route-cost`: what one `cache_aware` decision costs as the fleet grows. For 8, 64 and 256
//! backends, the prefix index is filled with a million blocks (agent-style prefixes of 500
//! blocks, each held by one or two backends), then requests that extend a held prefix by a new
//! turn (80 %) or start a new one (20 %) are routed — select and record, as the proxy does —
//! and timed one by one. Beside it, the same match done the obvious way (one index lookup per
//! block of the prompt) on the same index, for scale.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use warmpath::config::CacheAwareConfig;
use warmpath::route::index::PrefixIndex;
use warmpath::route::policy::{CacheAware, Candidate, Policy, RouteKey, State};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Indexed blocks before timing.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Timed decisions per fleet size.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Write the report here (default bench/results/route-cost-DATE.md).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Print only; write no file.
    #[arg(long)]
    quick: bool,
}

const PREFIX_BLOCKS: usize = 500;
const TURN_BLOCKS: usize = 20;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn chain(root: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| xxhash_rust::xxh3::xxh3_64(&[root, i].map(u64::to_le_bytes).concat())).collect()
}

struct Row {
    backends: usize,
    indexed: usize,
    index_mb: f64,
    p50: f64,
    p99: f64,
    mean: f64,
    walk_p50: f64,
    walk_p99: f64,
    record_p50: f64,
    record_p99: f64,
}

fn measure(n: usize, a: &Args) -> Row {
    let names: Vec<String> = (0..n).map(|i| format!("b{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let prefixes = a.blocks / PREFIX_BLOCKS;
    // Room for what is indexed plus the turns routed while timing.
    let capacity = (a.blocks * 3 / 2 / n).max(PREFIX_BLOCKS * 4);
    let index = Arc::new(PrefixIndex::new(n, capacity, None));
    let policy = CacheAware::new(&refs, index.clone(), &CacheAwareConfig::default());
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ n as u64);
    let roots: Vec<Vec<u64>> = (0..prefixes as u64).map(|p| chain(p, PREFIX_BLOCKS)).collect();
    for r in &roots {
        index.insert((rng.next() % n as u64) as usize, r);
        if rng.next() % 4 == 0 {
            index.insert((rng.next() % n as u64) as usize, r);
        }
    }
    let indexed = index.len();
    let mut candidates: Vec<Candidate> = (0..n)
        .map(|_| Candidate { weight: 1, inflight: 0, state: State::Up, pending_tokens: 0, reported: 0 })
        .collect();
    let keys: Vec<RouteKey> = (0..a.requests)
        .map(|i| {
            let mut blocks = if rng.next() % 5 == 0 {
                Vec::new()
            } else {
                roots[(rng.next() % prefixes as u64) as usize].clone()
            };
            blocks.extend(chain(1 << 40 | i as u64, TURN_BLOCKS));
            RouteKey { tokens: blocks.len() * 16, per_block: 16, blocks, ..RouteKey::default() }
        })
        .collect();
    let mut times = Vec::with_capacity(keys.len());
    let mut records = Vec::with_capacity(keys.len());
    let mut walk = Vec::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        for c in candidates.iter_mut() {
            c.inflight = (rng.next() % 8) as usize;
            c.pending_tokens = rng.next() % 4096;
        }
        let t = Instant::now();
        let d = policy.select(k, &candidates).expect("a backend");
        times.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        policy.routed(k, &d);
        records.push(t.elapsed().as_secs_f64() * 1e6);
        // The per-block walk over the same index (no routing: it must not change the index).
        if i % 2 == 0 {
            let t = Instant::now();
            let mut depth = vec![0u32; n];
            let mut alive: Option<warmpath::route::index::BackendSet> = None;
            for (j, h) in k.blocks.iter().enumerate() {
                let s = index.holders(*h);
                let s = match alive {
                    None => s,
                    Some(prev) => prev.minus(&prev.minus(&s)),
                };
                if s.is_empty() {
                    break;
                }
                for b in s.iter() {
                    depth[b] = j as u32 + 1;
                }
                alive = Some(s);
            }
            std::hint::black_box(&depth);
            walk.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    Row {
        backends: n,
        indexed,
        index_mb: index.bytes() as f64 / (1 << 20) as f64,
        p50: crate::stats::quantile(times.clone(), 0.5),
        p99: crate::stats::quantile(times, 0.99),
        mean,
        record_p50: crate::stats::quantile(records.clone(), 0.5),
        record_p99: crate::stats::quantile(records, 0.99),
        walk_p50: crate::stats::quantile(walk.clone(), 0.5),
        walk_p99: crate::stats::quantile(walk, 0.99),
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let rows: Vec<Row> = [8, 64, 256].into_iter().map(|n| measure(n, &a)).collect();
    let cmd: Vec<String> = std::env::args().collect();
    let mut md = String::new();
    let _ = writeln!(md, "# cache_aware decision cost — {}\n", crate::report::date());
    let _ = writeln!(md, "Command: `{}`\n", cmd.join(" "));
    let _ = writeln!(
        md,
        "Per fleet size: {} blocks indexed first ({}-block prefixes, each on one backend, a quarter on a \
         second), then {} requests timed one by one on one thread — the decision (`select`: match depths, \
         costs, ties) and, apart, the record (`routed`: the approximate-mode insert of the prompt's blocks, \
         which precise mode leaves to the backends' events): 80 % extend a held prefix by a {}-block turn, 20 % are new. Per-block walk: the same \
         match with one index lookup per prompt block, on the same index (timed on every other request).\n",
        a.blocks, PREFIX_BLOCKS, a.requests, TURN_BLOCKS
    );
    let _ = writeln!(
        md,
        "| backends | blocks indexed | index MiB | decision p50 µs | p99 µs | mean µs | per-block walk p50 µs | p99 µs | walk p99 / decision p99 | record p50 µs | p99 µs |"
    );
    let _ = writeln!(md, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}× | {:.2} | {:.2} |",
            r.backends,
            r.indexed,
            r.index_mb,
            r.p50,
            r.p99,
            r.mean,
            r.walk_p50,
            r.walk_p99,
            r.walk_p99 / r.p99.max(1e-9),
            r.record_p50,
            r.record_p99
        );
    }
    let _ = writeln!(md, "\nTarget: decision p99 under 20 µs at 256 backends.");
    crate::report::publish(&md, "route-cost", a.out, a.quick)
}
