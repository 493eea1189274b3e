//! Assembling the process: logging, embedded engines, pools, and the pingora server with its
//! its services (API listener, admin listener, health checker, load scraper, KV event feeds).

use std::sync::Arc;

use anyhow::Context;
use std::time::Duration;

use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use crate::config::{Config, LogFormat};
use crate::http::client::Upstream;
use crate::http::{AppState, WarmpathProxy};
use crate::limits::WithHeaderDeadline;
use crate::observe::{AdminApp, Metrics};
use crate::route::events::EventFeeds;
use crate::route::health::HealthChecker;
use crate::route::load::LoadScraper;
use crate::route::Router;

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

/// Starts everything and serves until SIGTERM (graceful) or SIGINT (fast). Never returns on
/// success.
pub fn run(cfg: Config) -> anyhow::Result<()> {
    init_logging(&cfg);
    // pingora binds inside its service threads and only panics there when it cannot, leaving
    // the process up without a listener; check first so a taken port is a clear error.
    for (what, addr) in [("listen", cfg.server.listen), ("admin", cfg.server.admin)] {
        std::net::TcpListener::bind(addr)
            .with_context(|| format!("cannot bind the {what} address {addr}"))?;
    }
    let embedded = crate::embedded::start(&cfg)?;
    for (pi, addrs) in &embedded.addrs {
        for a in addrs {
            tracing::info!(pool = %cfg.pools[*pi].name, addr = %a.addr, kv_events = ?a.kv_events, "embedded engine replica listening");
        }
    }
    let metrics = Metrics::new();
    let router = Arc::new(Router::build(&cfg, &embedded.addrs, &metrics).map_err(anyhow::Error::msg)?);
    let upstream = Arc::new(Upstream::new(Duration::from_millis(cfg.upstream.pool_idle_timeout_ms)));

    let conf = ServerConf {
        threads: cfg.server.threads,
        grace_period_seconds: Some(cfg.server.grace_period_secs),
        graceful_shutdown_timeout_seconds: Some(5),
        // Each warmpath process gets its own files, so two can run side by side.
        pid_file: format!("/tmp/warmpath-{}.pid", std::process::id()),
        upgrade_sock: format!("/tmp/warmpath-upgrade-{}.sock", std::process::id()),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let state = Arc::new(AppState {
        cfg: cfg.clone(),
        router: router.clone(),
        metrics: metrics.clone(),
        upstream: upstream.clone(),
        sessions: Arc::new(crate::session::Store::new(&cfg.session).map_err(anyhow::Error::msg)?),
        ws: crate::ws::Connections::default(),
    });
    let drain = background_service("warmpath websocket drain", crate::ws::DrainOnShutdown(state.clone()));
    let proxy = pingora::proxy::http_proxy(&server.configuration, WarmpathProxy { state });
    let app = WithHeaderDeadline {
        inner: Arc::new(proxy),
        limit: Duration::from_millis(cfg.limits.header_read_timeout_ms),
    };
    let mut api = Service::new("warmpath api".to_owned(), app);
    api.add_tcp(&cfg.server.listen.to_string());
    let mut admin = Service::new(
        "warmpath admin".to_owned(),
        pingora::apps::http_app::HttpServer::new_app(AdminApp {
            metrics: metrics.clone(),
            router: router.clone(),
            api: cfg.server.listen,
        }),
    );
    admin.add_tcp(&cfg.server.admin.to_string());
    let events = background_service(
        "warmpath kv events",
        EventFeeds { router: router.clone(), metrics: metrics.clone() },
    );
    let load = background_service(
        "warmpath load",
        LoadScraper::new(router.clone(), metrics.clone(), upstream.clone()),
    );
    let health = background_service(
        "warmpath health",
        HealthChecker { router, cfg: cfg.health.clone(), metrics, upstream },
    );
    server.add_service(api);
    server.add_service(admin);
    server.add_service(health);
    server.add_service(load);
    server.add_service(events);
    server.add_service(drain);

    let listen = cfg.server.listen;
    let model = cfg
        .pools
        .iter()
        .flat_map(|p| p.models.iter())
        .find(|m| *m != "*")
        .cloned()
        .unwrap_or_else(|| "MODEL".into());
    println!("warmpath listening on http://{listen} (admin http://{}/metrics)", cfg.server.admin);
    println!("try:\n  curl -s http://{listen}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":32}}'");
    // The replicas live as long as the process.
    let _embedded = embedded;
    server.run_forever()
}
