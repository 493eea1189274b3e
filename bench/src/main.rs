//! `warmpath-bench`: benchmark programs. Each prints figures measured side by side in one run.

mod engine;
mod load;
mod overhead;
mod procfs;
mod requests;
mod targets;
mod upstream;

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
    /// Proxy overhead: warmpath vs a direct connection vs nginx, sglang-router and vllm-router in
    /// front of the same fast upstream, small and ~60 KB requests.
    Overhead(overhead::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.cmd {
        Cmd::Engine(a) => rt.block_on(engine::run(a)),
        Cmd::Overhead(a) => rt.block_on(overhead::run(a)),
    }
}
