//! Assembling an engine server from its flags: weights, executor, engine thread, KV event
//! publisher and HTTP listener. Used by the binary, by tests, and by the proxy's quick start.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use warmpath_wire::chat_template::ChatFormat;

use crate::config::{EngineArgs, ExecutorKind, ModelSource};
use crate::core::{Engine, EngineInfo};
use crate::executor::llama::LlamaExecutor;
use crate::executor::sim::SimExecutor;
use crate::executor::Executor;
use crate::faults::FaultInjector;
use crate::metrics::Metrics;
use crate::model::{GgufModel, Weights};
use crate::scheduler::SchedulerConfig;
use crate::server::{self, AppState};

/// A started engine with its bound listener, not yet serving.
pub struct EngineServer {
    pub addr: SocketAddr,
    pub model_name: String,
    pub kv_events_endpoint: Option<String>,
    /// Where replays of recent KV event batches are answered (port 0 resolved).
    pub kv_events_replay_endpoint: Option<String>,
    /// Where decode replicas fetch this replica's K/V (`--kv-transfer-port`, resolved).
    pub kv_transfer_addr: Option<SocketAddr>,
    pub engine: Arc<Engine>,
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    publisher: Option<tokio::task::JoinHandle<()>>,
    kv_listener: Option<tokio::net::TcpListener>,
}

/// Loads the model, starts the engine thread, binds the port and the KV event socket.
pub async fn launch(args: EngineArgs) -> anyhow::Result<EngineServer> {
    args.validate().map_err(anyhow::Error::msg)?;
    let model_name = args.served_name();
    let (executor, format): (Box<dyn Executor>, ChatFormat) = match (args.executor, args.model_source()) {
        (ExecutorKind::Sim, _) => {
            let format = ChatFormat::builtin();
            let words = (format.tokenizer.vocab_size() - 8) as u32;
            (
                Box::new(SimExecutor::new(
                    args.sim_timing(),
                    words,
                    args.weight_seed,
                    args.kv_blocks,
                    args.block_size,
                )),
                format,
            )
        }
        (ExecutorKind::Llama, ModelSource::Gguf(path)) => {
            if !path.is_file() {
                anyhow::bail!("{} is not installed: scripts/ensure-deps installs it", path.display());
            }
            let m = GgufModel::load(&path)?;
            tracing::info!(model = %m.name, params = m.weights.cfg.num_params(), bytes = m.weights.bytes(), "model loaded");
            (
                Box::new(LlamaExecutor::with_threads(
                    m.weights,
                    args.kv_blocks,
                    args.block_size,
                    args.threads,
                )),
                m.format,
            )
        }
        (ExecutorKind::Llama, source) => {
            let format = ChatFormat::builtin();
            let weights = match source {
                ModelSource::Preset(cfg) => Weights::dummy(&cfg, args.weight_seed)?,
                ModelSource::Checkpoint(path) => Weights::load_llama2c(&path)?,
                ModelSource::Gguf(_) => unreachable!("matched above"),
            };
            let vocab = weights.cfg.vocab_size;
            anyhow::ensure!(
                vocab >= format.tokenizer.vocab_size(),
                "the model's vocabulary ({vocab}) is smaller than the tokenizer's ({})",
                format.tokenizer.vocab_size()
            );
            tracing::info!(params = weights.cfg.num_params(), "model loaded");
            (
                Box::new(LlamaExecutor::with_threads(weights, args.kv_blocks, args.block_size, args.threads)),
                format,
            )
        }
    };
    let vocab_size = format.tokenizer.vocab_size();
    let info = EngineInfo {
        model_name: model_name.clone(),
        vocab_size,
        block_size: args.block_size,
        num_blocks: args.kv_blocks,
        max_model_len: args.max_model_len,
        prefix_caching: !args.no_prefix_caching,
    };
    let metrics = Arc::new(Metrics::new(
        &model_name,
        &args.engine_id,
        args.block_size,
        args.kv_blocks,
        info.prefix_caching,
    ));
    let namespace = crate::kv_tier::namespace(&model_name, args.block_size, executor.block_bytes());
    let disk = match &args.kv_tier_disk {
        Some(dir) if info.prefix_caching && args.kv_tier_disk_blocks > 0 => {
            let dir = dir.join(&namespace);
            let d = crate::kv_tier::DiskTier::open(&dir, args.kv_tier_disk_blocks)
                .with_context(|| format!("the disk KV tier {}", dir.display()))?;
            tracing::info!(dir = %dir.display(), blocks = d.len(), "disk KV tier opened");
            Some(d)
        }
        _ => None,
    };
    if info.prefix_caching {
        metrics.tiers.set_capacity("cpu", args.kv_tier_blocks);
        if disk.is_some() {
            metrics.tiers.set_capacity("disk", args.kv_tier_disk_blocks);
        }
    }
    let (events, kv_events_endpoint, kv_events_replay_endpoint, publisher) = match &args.kv_events_endpoint {
        Some(ep) => {
            let replay = args.kv_events_replay_endpoint.as_deref().map(|r| (r, args.kv_events_buffer_steps));
            let p = crate::kv_events::start_publisher(ep, args.kv_events_topic.clone(), replay)
                .await
                .with_context(|| format!("binding the KV event sockets {ep}"))?;
            (Some(p.sink), Some(p.endpoint), p.replay_endpoint, Some(p.task))
        }
        None => (None, None, None, None),
    };
    let sched = SchedulerConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len,
        enable_prefix_caching: info.prefix_caching,
        spec: args.speculative_config.clone(),
        kv_tier_blocks: args.kv_tier_blocks,
    };
    let shared = match &args.kv_tier_shared {
        Some(url) if info.prefix_caching => Some(shared_tier(&args, url, &model_name, &namespace, &metrics)?),
        _ => None,
    };
    let tiers = crate::kv_tier::Attached {
        disk,
        shared: shared.clone().map(|s| s as Arc<dyn crate::kv_tier::BlockSink>),
    };
    let engine = Arc::new(Engine::start(info, sched, executor, metrics, events, tiers)?);
    let listener = server::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let kv_listener = match args.kv_transfer_port {
        Some(port) => Some(
            server::bind(SocketAddr::new(args.host, port))
                .await
                .with_context(|| format!("binding the K/V transfer port {}:{port}", args.host))?,
        ),
        None => None,
    };
    let kv_transfer_addr = match &kv_listener {
        // Decode replicas connect here: an unspecified bind address is reached on loopback.
        Some(l) => {
            let mut a = l.local_addr()?;
            if a.ip().is_unspecified() {
                a.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            Some(a)
        }
        None => None,
    };
    let transfer = crate::kv_transfer::TransferConfig {
        advertise: kv_transfer_addr,
        hold: std::time::Duration::from_secs_f64(args.kv_hold_s),
        delay_per_block: std::time::Duration::from_secs_f64(args.kv_transfer_delay_us_per_block / 1e6),
        ..crate::kv_transfer::TransferConfig::disabled(&args.engine_id)
    };
    let script = match &args.faults.script {
        Some(p) => crate::script::Script::load(p).map_err(anyhow::Error::msg)?,
        None => crate::script::Script::default(),
    };
    let state = Arc::new(AppState {
        engine: engine.clone(),
        format,
        faults: FaultInjector::new(args.faults.clone()),
        max_body_bytes: args.max_body_bytes,
        script,
        transfer,
        shared,
    });
    Ok(EngineServer {
        addr,
        model_name,
        kv_events_endpoint,
        kv_events_replay_endpoint,
        kv_transfer_addr,
        engine,
        listener,
        state,
        publisher,
        kv_listener,
    })
}

impl EngineServer {
    /// Serves until `shutdown` resolves, then lets in-flight responses finish.
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let timeout = self.state.transfer.timeout;
        let kv = self
            .kv_listener
            .map(|l| tokio::spawn(crate::kv_transfer::serve::serve(l, self.engine.clone(), timeout)));
        let served = server::serve(self.listener, self.state, shutdown).await;
        if let Some(t) = kv {
            t.abort();
        }
        served?;
        drop(self.engine);
        if let Some(p) = self.publisher {
            p.abort();
        }
        Ok(())
    }
}

/// The shared KV tier at `url`, its keys under the namespace given or `namespace` (what makes
/// blocks interchangeable: [`crate::kv_tier::namespace`]).
fn shared_tier(
    args: &EngineArgs,
    url: &str,
    model: &str,
    namespace: &str,
    metrics: &Metrics,
) -> anyhow::Result<Arc<crate::kv_tier::SharedTier>> {
    use crate::kv_tier::{SharedConfig, SharedMetrics, SharedTier};
    let namespace = args.kv_tier_shared_namespace.clone().unwrap_or_else(|| namespace.to_owned());
    let cfg = SharedConfig {
        url: url.to_owned(),
        namespace,
        ttl: std::time::Duration::from_secs(args.kv_tier_shared_ttl_s),
        timeout: std::time::Duration::from_millis(args.kv_tier_shared_timeout_ms.max(1)),
        queue: args.kv_tier_shared_queue,
    };
    let m = SharedMetrics::register(metrics.registry(), model, &args.engine_id)?;
    SharedTier::start(cfg, m).with_context(|| format!("the shared KV tier {url}"))
}
