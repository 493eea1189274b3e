//! `warmpath-bench`: benchmark programs. Each prints figures measured side by side in one run.

mod agent;
mod agreement;
mod compare;
mod edge_cost;
mod engine;
mod engine_vs;
mod fleet;
mod load;
mod overhead;
mod pd;
mod procfs;
mod refs;
mod replay;
mod report;
mod requests;
mod route_cost;
mod safety;
mod soak;
mod spec;
mod stats;
mod targets;
mod tool_search;
mod trace;
mod upstream;
mod workload;
mod ws;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "warmpath-bench", version, about = "warmpath benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Speed of the bundled engine: prefill and decode throughput, continuous batching, and
    /// TTFT with a cached vs uncached prefix.
    Engine(engine::Args),
    /// Speculative decoding (n-gram prompt lookup) on a real model: decode speed with and
    /// without proposals and the share kept, on JSON echoes, tool-call arguments, code edits and
    /// free text.
    Spec(spec::Args),
    /// Proxy overhead: warmpath vs a direct connection vs nginx, sglang-router and vllm-router in
    /// front of the same fast upstream, small and ~60 KB requests.
    Overhead(overhead::Args),
    /// Routers side by side on one workload (a Mooncake trace replay, or agent sessions) against
    /// N engines with finite KV caches: hit rates beside the oracle and partition ceiling, TTFT,
    /// imbalance, client bytes, proxy CPU.
    Compare(Box<compare::Args>),
    /// How well warmpath's `tool_search` (BM25) finds the tools a request needs: recall@k and
    /// MRR on a labelled set, beside a word-overlap baseline.
    ToolSearch(tool_search::Args),
    /// What one `cache_aware` routing decision costs through `Pool::select` at 256, 1,000 and
    /// 4,000 backends (`--backends`) with a million indexed blocks, and the index's bytes per
    /// held block.
    RouteCost(route_cost::Args),
    /// What the safety stage adds on the bundled engine: TTFT with no checks, the rules, and a
    /// moderation service at several latencies run before or beside the backend call; output
    /// checks under each release policy.
    Safety(safety::Args),
    /// warmpath under load while replicas crash, stall and fail, the policy is reloaded and
    /// Redis restarts: every request and WebSocket turn sorted as its client saw it (lost and
    /// hung must be 0), with memory and file descriptors before and after.
    Soak(soak::Args),
    /// Prefill/decode disaggregation at equal hardware: co-located engines against the same
    /// count split into prefill and decode, under streams decoding while bursts of long
    /// prompts arrive; TTFT and TPOT p50/p99 and their ratios.
    Pd(pd::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(until_signal(async move {
        match cli.cmd {
            Cmd::Engine(a) => engine::run(a).await,
            Cmd::Spec(a) => spec::run(a).await,
            Cmd::Overhead(a) => overhead::run(a).await,
            Cmd::Compare(a) => compare::run(*a).await,
            Cmd::ToolSearch(a) => tool_search::run(a),
            Cmd::RouteCost(a) => route_cost::run(a),
            Cmd::Safety(a) => safety::run(a).await,
            Cmd::Soak(a) => soak::run(a).await,
            Cmd::Pd(a) => pd::run(a).await,
        }
    }))
}

/// Runs `work` until it ends or SIGINT/SIGTERM arrives. On a signal the future is dropped, and
/// with it every target it started (their `Drop` kills the child processes), so an interrupted
/// benchmark leaves no proxies or engines behind.
async fn until_signal(work: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
        _ = term.recv() => anyhow::bail!("terminated"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_subcommands_flags_are_distinct() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
