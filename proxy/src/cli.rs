//! Command-line interface: `warmpath [--config FILE] [--listen ADDR] [--admin ADDR]` serves;
//! `warmpath check-config FILE...` validates policy files.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::server::Policy;

/// warmpath: a cache-aware sidecar proxy for OpenAI-compatible LLM servers.
#[derive(Debug, Parser)]
#[command(name = "warmpath", version)]
pub struct Cli {
    /// The policy file to serve.
    #[arg(long, default_value = "policies/default.toml", global = true)]
    pub config: PathBuf,
    /// Overrides `[server] listen`.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Overrides `[server] admin`.
    #[arg(long)]
    pub admin: Option<SocketAddr>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validates policy files; prints `file:line:col: message` for each bad one.
    CheckConfig {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig { files }) => {
            let mut ok = true;
            for f in &files {
                match Policy::load(f) {
                    Ok(_) => println!("{}: ok", f.display()),
                    Err(e) => {
                        eprintln!("{e}");
                        ok = false;
                    }
                }
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        None => {
            let mut policy = match Policy::load(&cli.config) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            let server = &mut policy.cfg.server;
            if let Some(a) = cli.listen {
                server.listen = a;
            }
            if let Some(a) = cli.admin {
                server.admin = a;
            }
            if server.listen == server.admin {
                eprintln!("--listen and --admin must differ ({})", server.listen);
                return ExitCode::FAILURE;
            }
            match crate::server::run(policy) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("warmpath: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
