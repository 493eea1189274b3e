//! Command-line interface: `warmpath [--config FILE] [--listen ADDR] [--admin ADDR]` serves;
//! `warmpath check-config FILE...` validates policy files.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::policy::Policy;

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
    /// Take the listening sockets over from the warmpath running on the same listen address,
    /// which then drains: a restart (a new binary, a new policy) without a refused connection.
    #[arg(long)]
    pub upgrade: bool,
    /// Reload the policy file when it changes (SIGHUP and the admin `POST /reload` always do).
    #[arg(long)]
    pub watch: bool,
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
    /// API keys (`[auth]`).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Makes a new key named NAME: prints the key (once; only its SHA-256 is stored) and
    /// appends it to the keys file, or stores it in Redis where the policy's
    /// `[auth] keys_store = "redis"`.
    Add {
        name: String,
        /// The keys file; default: the policy file's `[auth] keys_file`.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Only these models (comma-separated); default: any.
        #[arg(long, value_delimiter = ',')]
        models: Option<Vec<String>>,
    },
    /// Removes the key named NAME from Redis (`keys_store = "redis"`; in a keys file, delete
    /// its `[[keys]]` table).
    Remove { name: String },
    /// Lists the keys kept in Redis by name (never the keys themselves).
    List,
}

/// `warmpath keys add|remove|list` against the Redis of the policy at `config`.
fn redis_keys(config: &std::path::Path, command: KeysCommand) -> ExitCode {
    let policy = match Policy::load(config) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let redis = match crate::shared::Shared::new(&policy.cfg.redis) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{}: {e}", config.display());
            return ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("warmpath keys: {e}");
            return ExitCode::FAILURE;
        }
    };
    let done = rt.block_on(async {
        match command {
            KeysCommand::Add { name, models, .. } => {
                let (key, entry) = crate::auth::keys::new_entry(&name, models)?;
                crate::auth::store::add(&redis, &entry).await?;
                eprintln!("added key {name:?} to Redis (only its hash is stored; this is the one time it is shown):");
                println!("{key}");
                Ok(())
            }
            KeysCommand::Remove { name } => match crate::auth::store::remove(&redis, &name).await? {
                true => {
                    eprintln!("removed key {name:?}; replicas drop it within [auth] reload_interval_ms");
                    Ok(())
                }
                false => Err(format!("no key named {name:?}")),
            },
            KeysCommand::List => {
                for e in crate::auth::store::list(&redis).await? {
                    let models = e.models.map_or("any model".to_owned(), |m| m.join(","));
                    println!("{}\t{models}", e.name);
                }
                Ok(())
            }
        }
    });
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warmpath keys: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Whether the policy at `config` keeps its keys in Redis.
fn keys_in_redis(config: &std::path::Path) -> bool {
    crate::config::load(config).is_ok_and(|c| c.auth.keys_store == crate::config::KeysStore::Redis)
}

/// `warmpath keys add`.
fn add_key(
    config: &std::path::Path,
    name: &str,
    file: Option<PathBuf>,
    models: Option<Vec<String>>,
) -> ExitCode {
    let file = match file {
        Some(f) => f,
        None => match crate::config::load(config)
            .map(|c| c.auth.keys_file.map(|f| config.parent().unwrap_or(std::path::Path::new(".")).join(f)))
        {
            Ok(Some(f)) => f,
            Ok(None) => {
                eprintln!("{}: no [auth] keys_file; name one with --file", config.display());
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        },
    };
    match crate::auth::keys::add(&file, name, models) {
        Ok(key) => {
            eprintln!(
                "added key {name:?} to {} (only its hash is stored; this is the one time it is shown):",
                file.display()
            );
            println!("{key}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("warmpath keys add: {e}");
            ExitCode::FAILURE
        }
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Keys { command: KeysCommand::Add { name, file: Some(file), models } }) => {
            add_key(&cli.config, &name, Some(file), models)
        }
        Some(Command::Keys { command }) if keys_in_redis(&cli.config) => redis_keys(&cli.config, command),
        Some(Command::Keys { command: KeysCommand::Add { name, file, models } }) => {
            add_key(&cli.config, &name, file, models)
        }
        Some(Command::Keys { command: KeysCommand::Remove { .. } | KeysCommand::List }) => {
            eprintln!(
                "{}: keys are in a keys file ([auth] keys_file): edit it (remove) or read it (list)",
                cli.config.display()
            );
            ExitCode::FAILURE
        }
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
            let opts = crate::policy::RunOptions {
                file: cli.config.clone(),
                upgrade: cli.upgrade,
                watch: cli.watch,
                listen: cli.listen,
                admin: cli.admin,
            };
            opts.apply(&mut policy.cfg);
            let server = &policy.cfg.server;
            if server.listen == server.admin {
                eprintln!("--listen and --admin must differ ({})", server.listen);
                return ExitCode::FAILURE;
            }
            match crate::server::run(policy, opts) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("warmpath: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
