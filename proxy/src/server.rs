//! Assembling the process: the embedded replicas started, the state built from the policy
//! (`build`), and the pingora server given its services — API listener, admin listener,
//! health checker, load scraper, KV event feeds, keys, limits, certificates, reloads, drain.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use crate::auth::{FlushLimits, WatchKeys};
use crate::build::{self, Base};
use crate::config::{Config, LogFormat};
use crate::entry::WarmpathProxy;
use crate::limits::{Admitted, Buffered, Connections, OpenConnections, WithHeaderDeadline};
use crate::observe::{AdminApp, Lifecycle, Metrics};
use crate::policy::{Policy, RunOptions};
use crate::reload::{DnsRefresh, ReloadTriggers, Reloader};
use crate::route::events::EventFeeds;
use crate::route::health::HealthChecker;
use crate::route::load::LoadScraper;
use crate::shutdown::Handover;
use crate::state::Live;
use crate::tls::{ReloadingCert, WatchCerts};
use crate::upstream::dns::Resolved;

/// Installs the `tracing` subscriber the policy file asks for (`RUST_LOG` wins).
pub fn init_logging(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cfg.log.level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = match cfg.log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Raises the open-file soft limit to the hard one (what Go's runtime does at start, and
/// nginx's `worker_rlimit_nofile`), and warns when it stays below what `max_connections`
/// (each with a backend connection) may need.
fn raise_open_files(max_connections: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((mut soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        soft = hard;
    }
    let need = (max_connections as u64).saturating_mul(2).saturating_add(256);
    if soft < need {
        tracing::warn!(
            open_files = soft,
            max_connections,
            "the open-file limit is below two per connection allowed: raise it (ulimit -n) or lower [limits] max_connections"
        );
    }
}

/// Starts everything and serves until SIGTERM (graceful) or SIGINT (fast). Never returns on
/// success.
pub fn run(policy: Policy, opts: RunOptions) -> anyhow::Result<()> {
    let cfg = policy.cfg.clone();
    init_logging(&cfg);
    let handover = Handover::for_port(cfg.server.listen.port());
    if opts.upgrade {
        let old = handover.take_over().map_err(anyhow::Error::msg)?;
        tracing::info!(old_pid = old, sock = %handover.upgrade_sock, "taking the listening sockets over");
    } else {
        // pingora binds inside its service threads and only panics there when it cannot,
        // leaving the process up without a listener; check first so a taken port is a clear
        // error.
        for (what, addr) in [("listen", cfg.server.listen), ("admin", cfg.server.admin)] {
            std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot bind the {what} address {addr}"))?;
        }
    }
    raise_open_files(cfg.limits.max_connections);
    let hash = crate::reload::file_hash(&std::fs::read(&opts.file).unwrap_or_default());
    let embedded = crate::embedded::start(&cfg)?;
    let mut replicas = std::collections::HashMap::new();
    for (pi, addrs) in &embedded.addrs {
        for a in addrs {
            tracing::info!(pool = %cfg.pools[*pi].name, addr = %a.addr, kv_events = ?a.kv_events, "embedded engine replica listening");
        }
        replicas.insert(cfg.pools[*pi].name.clone(), addrs.clone());
    }
    let mut metrics = Metrics::new();
    // Request traces over OTLP, where an endpoint is set (validated with the policy).
    let otlp = match cfg.tracing.target() {
        Some(Ok(target)) => {
            let t = &cfg.tracing;
            let (tracer, queue) = crate::observe::Tracer::new(
                t.sample_ratio,
                t.max_queued_traces,
                metrics.traces_dropped.clone(),
            );
            metrics.tracer = tracer;
            Some(crate::otlp::OtlpExport {
                target,
                service_name: t.service_name.clone(),
                every: Duration::from_millis(t.export_interval_ms),
                metrics: metrics.clone(),
                queue: std::sync::Mutex::new(Some(queue)),
            })
        }
        _ => None,
    };
    let base = Base {
        metrics: metrics.clone(),
        lifecycle: Arc::new(Lifecycle::default()),
        ws: Arc::new(Connections::new(metrics.ws_connections.with_label_values(&["api"]))),
        buffered: Buffered::new(cfg.limits.max_buffered_mib << 20, metrics.buffered_bytes.clone()),
        replicas,
    };

    let conf = ServerConf {
        threads: cfg.server.threads,
        // warmpath's own drain (`shutdown.rs`) exits as soon as nothing is in flight, and by
        // the grace period plus a moment for the last error events; pingora's own grace (a
        // plain sleep, then every task dropped) must not cut in before it.
        grace_period_seconds: Some(cfg.server.grace_period_secs + 5),
        graceful_shutdown_timeout_seconds: Some(5),
        // pingora's own timer wheel wakes a thread every 10 ms once any of its "fast" timeouts
        // was set: what an idle warmpath spent most of its CPU on. Timeouts of a second and
        // more go to tokio's timers instead, which sleep while nothing is due.
        fast_timeout_to_tokio_threshold_seconds: Some(0),
        work_stealing: cfg.server.work_stealing,
        pid_file: handover.pid_file.clone(),
        upgrade_sock: handover.upgrade_sock.clone(),
        ..ServerConf::default()
    };
    let opt = pingora::server::configuration::Opt { upgrade: opts.upgrade, ..Default::default() };
    let mut server = Server::new_with_opt_and_conf(Some(opt), conf);
    // With `upgrade`, this waits for the running warmpath's sockets.
    server.bootstrap();
    handover.claim().with_context(|| format!("cannot write {}", handover.pid_file))?;

    let resolve = crate::upstream::dns::system();
    let (resolved, _) = Resolved::lookup(&policy.cfg, None, &resolve).map_err(anyhow::Error::msg)?;
    let state = build::state(&base, policy.clone(), Arc::new(resolved), None).map_err(anyhow::Error::msg)?;
    let live = Arc::new(Live::new(state.clone()));
    let reloader = Arc::new(Reloader::new(live.clone(), base, opts.clone(), hash, policy, resolve));
    let current = |live: &Arc<Live>| live.clone() as Arc<dyn crate::route::Current>;
    let keys_live = live.clone();
    let keys = background_service(
        "warmpath keys",
        WatchKeys {
            auth: Arc::new(move || keys_live.load().auth.clone()),
            interval: Duration::from_millis(cfg.auth.reload_interval_ms),
        },
    );
    let limits_live = live.clone();
    let limits =
        background_service("warmpath limits", FlushLimits(Arc::new(move || limits_live.load().auth.fleet())));
    let drain = background_service(
        "warmpath drain",
        crate::shutdown::Drain {
            live: live.clone(),
            grace: Duration::from_secs(cfg.server.grace_period_secs),
            handover: handover.clone(),
        },
    );
    let triggers = background_service(
        "warmpath reload",
        ReloadTriggers { reloader: reloader.clone(), watch: opts.watch },
    );
    let dns = background_service("warmpath dns", DnsRefresh { reloader: reloader.clone() });
    let lifecycle = state.lifecycle.clone();
    let metrics = state.metrics.clone();
    drop(state);
    let proxy = pingora::proxy::http_proxy(&server.configuration, WarmpathProxy { live: live.clone() });
    let app = WithHeaderDeadline {
        inner: Arc::new(proxy),
        limit: Duration::from_millis(cfg.limits.header_read_timeout_ms),
    };
    let (max, probed) = (live.clone(), live.clone());
    let app = Admitted {
        inner: Arc::new(app),
        open: Arc::new(OpenConnections::new(
            metrics.connections_open.clone(),
            metrics.connections_rejected.clone(),
        )),
        max: Box::new(move || max.load().cfg.limits.max_connections),
        readiness: Box::new(move || crate::http::health::readiness(&probed.load())),
    };
    let mut api = Service::new("warmpath api".to_owned(), app);
    // The listeners, with TLS where the policy gives certificates.
    let mut certs = Vec::new();
    match &cfg.server.tls {
        Some(t) => {
            let cert = ReloadingCert::load(&t.cert_file, &t.key_file).map_err(anyhow::Error::msg)?;
            let settings = cert.settings(t.h2, t.client_ca_file.as_deref()).map_err(anyhow::Error::msg)?;
            api.add_tls_with_settings(&cfg.server.listen.to_string(), None, settings);
            certs.push((cert, t.reload_interval_ms));
        }
        None => api.add_tcp(&cfg.server.listen.to_string()),
    }
    let ready = live.clone();
    let status = live.clone();
    let mut admin = Service::new(
        "warmpath admin".to_owned(),
        pingora::apps::http_app::HttpServer::new_app(AdminApp {
            metrics: metrics.clone(),
            unready: Box::new(move || ready.load().unready()),
            api: cfg.server.listen,
            lifecycle,
            reload: reloader,
            status: Box::new(move || status.load().status()),
        }),
    );
    match &cfg.server.admin_tls {
        Some(t) => {
            let cert = ReloadingCert::load(&t.cert_file, &t.key_file).map_err(anyhow::Error::msg)?;
            let settings = cert.settings(false, t.client_ca_file.as_deref()).map_err(anyhow::Error::msg)?;
            admin.add_tls_with_settings(&cfg.server.admin.to_string(), None, settings);
            certs.push((cert, t.reload_interval_ms));
        }
        None => admin.add_tcp(&cfg.server.admin.to_string()),
    }
    let interval = certs.iter().map(|c| c.1).min().unwrap_or(5_000);
    let certs = WatchCerts {
        certs: certs.into_iter().map(|c| c.0).collect(),
        interval: Duration::from_millis(interval),
    };
    let certs = background_service("warmpath certificates", certs);
    let events = background_service(
        "warmpath kv events",
        EventFeeds { current: current(&live), metrics: metrics.clone() },
    );
    let load = background_service("warmpath load", LoadScraper::new(current(&live), metrics.clone()));
    let health = background_service("warmpath health", HealthChecker { current: current(&live), metrics });
    server.add_service(api);
    server.add_service(admin);
    server.add_service(health);
    server.add_service(load);
    server.add_service(events);
    server.add_service(drain);
    server.add_service(keys);
    server.add_service(limits);
    server.add_service(triggers);
    server.add_service(dns);
    server.add_service(certs);
    if let Some(export) = otlp {
        server.add_service(background_service("warmpath traces", export));
    }

    let listen = cfg.server.listen;
    let model = cfg
        .pools
        .iter()
        .flat_map(|p| p.models.iter())
        .find(|m| *m != "*")
        .cloned()
        .unwrap_or_else(|| "MODEL".into());
    let (scheme, admin_scheme) = (
        if cfg.server.tls.is_some() { "https" } else { "http" },
        if cfg.server.admin_tls.is_some() { "https" } else { "http" },
    );
    println!(
        "warmpath listening on {scheme}://{listen} (admin {admin_scheme}://{}/metrics)",
        cfg.server.admin
    );
    println!("try:\n  curl -s {scheme}://{listen}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"}},{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}],\"max_tokens\":32,\"temperature\":0}}'");
    // The replicas live as long as the process.
    let _embedded = embedded;
    server.run_forever()
}
