//! Bundled engine replicas for pools that ask for `[pools.embedded]`: each replica is a full
//! `warmpath-engine` server (its own engine thread, HTTP listener on a free loopback port, KV
//! event socket when asked), run on one dedicated runtime thread beside pingora's.

use std::collections::HashMap;
use std::net::SocketAddr;

use clap::Parser;
use warmpath_engine::config::{EngineArgs, ExecutorKind};

use crate::config::{Config, EmbeddedConfig, EmbeddedExecutor};

/// A running set of replicas, addressed per pool index.
/// One running replica.
#[derive(Debug, Clone)]
pub struct Replica {
    pub addr: SocketAddr,
    /// Where it publishes KV events (`kv_events = true`).
    pub kv_events: Option<String>,
    /// Where it answers replays of recent KV event batches.
    pub kv_replay: Option<String>,
    /// It only prefills (`prefill_replicas`), serving its K/V to the others.
    pub prefill: bool,
    /// Where it serves its K/V to the others, where it does.
    pub kv_transfer: Option<SocketAddr>,
    /// It writes to and reads from the pool's shared KV tier.
    pub shared_kv_tier: bool,
}

pub struct Embedded {
    /// Per pool index, its replicas.
    pub addrs: HashMap<usize, Vec<Replica>>,
    /// Replicas serve until the process exits; dropping this stops them.
    _runtime: Option<std::thread::JoinHandle<()>>,
    _stop: Option<tokio::sync::oneshot::Sender<()>>,
}

fn engine_args(e: &EmbeddedConfig, served_name: Option<&str>, id: usize) -> EngineArgs {
    let mut a = EngineArgs::parse_from(["warmpath-engine", "--port", "0"]);
    a.model = e.model.clone();
    a.served_model_name = served_name.map(str::to_owned);
    a.executor = match e.executor {
        EmbeddedExecutor::Llama => ExecutorKind::Llama,
        EmbeddedExecutor::Sim => ExecutorKind::Sim,
    };
    a.kv_blocks = e.kv_blocks;
    a.max_num_seqs = e.max_num_seqs;
    a.max_model_len = e.max_model_len;
    a.engine_id = id.to_string();
    a.speculative_config = e.speculative.clone();
    if e.kv_events {
        a.kv_events_endpoint = Some("tcp://127.0.0.1:0".to_owned());
        a.kv_events_replay_endpoint = Some("tcp://127.0.0.1:0".to_owned());
    }
    if id < e.prefill_replicas || e.kv_transfer {
        a.kv_transfer_port = Some(0);
    }
    a.kv_tier_shared = e.kv_tier_shared.clone();
    a
}

/// Starts every embedded replica the file asks for and waits until all listen.
pub fn start(cfg: &Config) -> anyhow::Result<Embedded> {
    let mut wanted = Vec::new();
    for (pi, pool) in cfg.pools.iter().enumerate() {
        let Some(e) = &pool.embedded else { continue };
        // Served under the pool's first model name, so requests for it route here.
        let name = pool.models.iter().find(|m| *m != "*").map(String::as_str);
        for r in 0..e.replicas {
            wanted.push((pi, r < e.prefill_replicas, engine_args(e, name, r)));
        }
    }
    if wanted.is_empty() {
        return Ok(Embedded { addrs: HashMap::new(), _runtime: None, _stop: None });
    }
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<Vec<(usize, Replica)>>>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let handle = std::thread::Builder::new().name("embedded-engines".into()).spawn(move || {
        let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                let _ = ready_tx.send(Err(e.into()));
                return;
            }
        };
        rt.block_on(async move {
            let mut servers = Vec::new();
            let mut addrs = Vec::new();
            for (pi, prefill, args) in wanted {
                let shared = args.kv_tier_shared.is_some();
                match warmpath_engine::launch(args).await {
                    Ok(s) => {
                        let replica = Replica {
                            addr: s.addr,
                            kv_events: s.kv_events_endpoint.clone(),
                            kv_replay: s.kv_events_replay_endpoint.clone(),
                            prefill,
                            kv_transfer: s.kv_transfer_addr,
                            shared_kv_tier: shared,
                        };
                        addrs.push((pi, replica));
                        servers.push(s);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.context("starting an embedded engine replica")));
                        return;
                    }
                }
            }
            let _ = ready_tx.send(Ok(addrs));
            let (stop_all, _) = tokio::sync::broadcast::channel::<()>(1);
            let tasks: Vec<_> = servers
                .into_iter()
                .map(|s| {
                    let mut stop = stop_all.subscribe();
                    tokio::spawn(s.run_until(async move {
                        let _ = stop.recv().await;
                    }))
                })
                .collect();
            let _ = stop_rx.await;
            let _ = stop_all.send(());
            for t in tasks {
                let _ = t.await;
            }
        });
    })?;
    let list = ready_rx.recv().map_err(|_| anyhow::anyhow!("the embedded engine thread died"))??;
    let mut addrs: HashMap<usize, Vec<Replica>> = HashMap::new();
    for (pi, a) in list {
        addrs.entry(pi).or_default().push(a);
    }
    Ok(Embedded { addrs, _runtime: Some(handle), _stop: Some(stop_tx) })
}
