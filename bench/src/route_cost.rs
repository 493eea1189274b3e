//! `route-cost`: what one `cache_aware` decision costs as the fleet grows. For 256, 1,000 and
//! 4,000 backends, the prefix index is filled with a million blocks (agent-style prefixes of 500
//! blocks, each held by one or two backends), then requests that extend a held prefix by a new
//! turn (80 %) or start a new one (20 %) are routed through `Pool::select` exactly as the proxy
//! calls it — the pool read, the policy's choice, the slot reserved and the choice recorded in
//! the index — and timed one by one, with each request's slot and prefill work held while later
//! requests are routed (a few in flight per backend).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::Instant;

use warmpath::observe::Metrics;
use warmpath::route::{BackendSpec, Pool, PromptUnits, RouteKey};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Indexed blocks before timing.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Timed decisions per fleet size.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Fleet sizes.
    #[arg(long, value_delimiter = ',', default_value = "256,1000,4000")]
    backends: Vec<usize>,
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
    holder_blocks: usize,
    index_mb: f64,
    per_holder_block: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    mean: f64,
    choice_p50: f64,
    choice_p99: f64,
    reasons: Vec<(String, usize)>,
}

/// A pool of `n` cache_aware backends as a policy file would give it (nothing is connected).
fn pool(n: usize, capacity: usize, metrics: &Metrics) -> anyhow::Result<Pool> {
    let mut text = format!(
        "[[pools]]\nname = \"fleet\"\nmodels = [\"*\"]\npolicy = \"cache_aware\"\n\
         max_inflight_per_backend = 64\n[pools.cache_aware]\ncapacity_blocks = {capacity}\n"
    );
    for i in 0..n {
        let _ =
            write!(text, "[[pools.backends]]\nname = \"b{i}\"\nurl = \"http://127.0.0.1:{}\"\n", 10_000 + i);
    }
    let cfg = warmpath::config::parse("route-cost.toml", &text).map_err(|e| anyhow::anyhow!("{e}"))?;
    let pc = &cfg.pools[0];
    let specs: Vec<BackendSpec> = pc
        .backends
        .iter()
        .map(|b| BackendSpec {
            name: b.name.clone(),
            url: b.url.clone(),
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], b.url.port)),
            weight: 1,
            kv_events: None,
            kv_replay: None,
            api_key: None,
            role: b.role,
            kv_transfer: None,
            shared_kv_tier: false,
        })
        .collect();
    let units = PromptUnits { exact_tokens: true, per_token_guess: 1.0, per_block: 16 };
    Pool::build(pc, &specs, &cfg, metrics, units).map_err(|e| anyhow::anyhow!(e))
}

fn measure(n: usize, a: &Args) -> anyhow::Result<Row> {
    let metrics = Metrics::new();
    let prefixes = a.blocks / PREFIX_BLOCKS;
    // Room for what is indexed plus the turns routed while timing.
    let capacity = (a.blocks * 3 / 2 / n).max(PREFIX_BLOCKS * 4);
    let pool = pool(n, capacity, &metrics)?;
    let index = pool.cache_aware.as_ref().expect("a cache_aware pool").index().clone();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ n as u64);
    let roots: Vec<Vec<u64>> = (0..prefixes as u64).map(|p| chain(p, PREFIX_BLOCKS)).collect();
    for r in &roots {
        index.insert((rng.next() % n as u64) as usize, r);
        if rng.next() % 4 == 0 {
            index.insert((rng.next() % n as u64) as usize, r);
        }
    }
    let indexed = index.len();
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
    // Each request holds its slot for the next 4n decisions (4 in flight per backend on
    // average) and its prefill work for the next n.
    let mut held = VecDeque::new();
    let mut times = Vec::with_capacity(keys.len());
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    let mut choices = Vec::with_capacity(keys.len());
    for k in &keys {
        // The choice alone (it changes nothing but a rotating draw), then the whole of it.
        let t = Instant::now();
        std::hint::black_box(pool.policy.select(k, &pool.view(&[])));
        choices.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let sel = pool.select(k, &[], &metrics).map_err(|e| anyhow::anyhow!("no backend: {e:?}"))?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        *reasons.entry(sel.reason.to_string()).or_default() += 1;
        held.push_back(sel);
        if held.len() > n {
            held[held.len() - n - 1].prefill.release();
        }
        if held.len() > 4 * n {
            held.pop_front();
        }
    }
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let holder_blocks: usize = index.blocks().iter().sum();
    Ok(Row {
        backends: n,
        indexed,
        holder_blocks,
        index_mb: index.bytes() as f64 / (1 << 20) as f64,
        per_holder_block: index.bytes() as f64 / holder_blocks.max(1) as f64,
        p50: crate::stats::quantile(times.clone(), 0.5),
        p99: crate::stats::quantile(times.clone(), 0.99),
        p999: crate::stats::quantile(times, 0.999),
        choice_p50: crate::stats::quantile(choices.clone(), 0.5),
        choice_p99: crate::stats::quantile(choices, 0.99),
        mean,
        reasons: reasons.into_iter().collect(),
    })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let rows = a.backends.iter().map(|&n| measure(n, &a)).collect::<anyhow::Result<Vec<Row>>>()?;
    let cmd: Vec<String> = std::env::args().collect();
    let mut md = String::new();
    let _ = writeln!(md, "# cache_aware decision cost — {}\n", crate::report::date());
    let _ = writeln!(md, "Command: `{}`\n", cmd.join(" "));
    let _ = writeln!(
        md,
        "Per fleet size: {} blocks indexed first ({}-block prefixes, each on one backend, a quarter on a \
         second), then {} requests routed one by one on one thread through `Pool::select`, as the proxy \
         calls it: the pool read (each backend's health and load, for the backends the policy weighs), \
         the choice, the slot reserved and the prompt's blocks recorded in the index (approximate mode). \
         80 % extend a held prefix by a {}-block turn, 20 % are new. Each request keeps its slot for the \
         next 4 × backends requests and its prefill work for the next 1 × backends. Pools above {} \
         backends are sampled: the conversation's home, the holders of the longest held prefix, {} drawn \
         at random and the holders of the first block, up to {}. Holder-blocks: (block, backend holding \
         it) pairs. Choice: the policy's pick alone over the pool's view (timed just before the same \
         request's `Pool::select`); select + record: all of `Pool::select`.\n",
        a.blocks,
        PREFIX_BLOCKS,
        a.requests,
        TURN_BLOCKS,
        warmpath::route::policy::SAMPLE,
        warmpath::route::policy::RANDOM,
        warmpath::route::policy::SAMPLE,
    );
    let _ = writeln!(
        md,
        "| backends | blocks indexed | holder-blocks | index MiB | B per holder-block | choice p50 µs | p99 µs | select + record p50 µs | p99 µs | p99.9 µs | mean µs | reasons |"
    );
    let _ =
        writeln!(md, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for r in &rows {
        let reasons: Vec<String> = r.reasons.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            r.backends,
            r.indexed,
            r.holder_blocks,
            r.index_mb,
            r.per_holder_block,
            r.choice_p50,
            r.choice_p99,
            r.p50,
            r.p99,
            r.p999,
            r.mean,
            reasons.join(", ")
        );
    }
    let _ = writeln!(
        md,
        "\nTargets (issue 27): decision p99 under 20 µs at 4,000 backends; at most 32 B per holder-block."
    );
    crate::report::publish(&md, "route-cost", a.out, a.quick)
}
