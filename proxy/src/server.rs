//! Assembling the process, the one place where what the policy file says becomes running
//! parts: the files it names are loaded ([`Policy::load`], which `check-config` runs too), each
//! stage builds its part of each pool from its own table, and the pingora server gets its
//! services (API listener, admin listener, health checker, load scraper, KV event feeds,
//! WebSocket drain).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pingora::server::configuration::ServerConf;
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use crate::auth::{Auth, FlushLimits, WatchKeys};
use crate::cache::ResponseCache;
use crate::canon::{Canon, External};
use crate::config::{Config, ConfigError, Invalid, LogFormat, PathSeg, PoolConfig, Source};
use crate::embedded::{Embedded, Replica};
use crate::entry::WarmpathProxy;
use crate::limits::{Connections, WithHeaderDeadline};
use crate::observe::{AdminApp, Lifecycle, Metrics};
use crate::pipeline::guard::{LateState, PoolCompleter};
use crate::route::events::EventFeeds;
use crate::route::health::HealthChecker;
use crate::route::load::LoadScraper;
use crate::route::{self, BackendSpec, Fleet, PromptUnits};
use crate::safety::{Safety, Services};
use crate::shared::Shared;
use crate::shutdown::Handover;
use crate::state::{self, AppState, Pools};
use crate::tls::{ReloadingCert, WatchCerts};
use crate::upstream::Upstream;

/// A policy file with everything loaded from the files it names (each pool's tokenizer and
/// chat template), so that a file that would fail at start-up fails here, at its key.
#[derive(Debug)]
pub struct Policy {
    pub cfg: Config,
    /// Per pool, its external tokenizer and template.
    externals: Vec<Option<External>>,
}

impl Policy {
    /// Reads, validates and loads the policy file at `path`.
    pub fn load(path: &Path) -> Result<Policy, ConfigError> {
        Policy::parse(&Source::read(path)?)
    }

    pub fn parse(src: &Source) -> Result<Policy, ConfigError> {
        let mut cfg = crate::config::parse(&src.file, &src.text)?;
        let mut externals = Vec::with_capacity(cfg.pools.len());
        for (i, pool) in cfg.pools.iter_mut().enumerate() {
            let at = |table: &str, key_name: &str, message: String| {
                let key = |k: &str| PathSeg::Key(k.to_owned());
                let path = vec![key("pools"), PathSeg::Index(i), key(table), key(key_name)];
                src.locate(&Invalid { path, message })
            };
            let mut loaded = External::load(&pool.canon, src.dir()).map_err(|(k, m)| at("canon", k, m))?;
            // An embedded GGUF model's own tokenizer and template, unless the file names others.
            if let (None, Some(e)) = (&loaded, &pool.embedded) {
                loaded = External::of_embedded(&e.model).map_err(|m| at("embedded", "model", m))?;
            }
            externals.push(loaded);
            // Backends' keys come from the environment: a variable that is not set fails here.
            for (b, backend) in pool.backends.iter().enumerate() {
                if let Some(var) = backend.api_key_env.as_deref().filter(|v| std::env::var(v).is_err()) {
                    let key = |k: &str| PathSeg::Key(k.to_owned());
                    let path = vec![
                        key("pools"),
                        PathSeg::Index(i),
                        key("backends"),
                        PathSeg::Index(b),
                        key("api_key_env"),
                    ];
                    let message = format!("the environment variable {var} is not set");
                    return Err(src.locate(&Invalid { path, message }));
                }
            }
            // The guard model's prompt template.
            if let Some(g) = &mut pool.safety.guard_model {
                if let Some(file) = &g.template_file {
                    let path = src.dir().join(file);
                    let key = |k: &str| PathSeg::Key(k.to_owned());
                    let keys = ["safety", "guard_model", "template_file"].map(key);
                    let mut path_keys = vec![key("pools"), PathSeg::Index(i)];
                    path_keys.extend(keys);
                    let text = std::fs::read_to_string(&path).map_err(|e| {
                        src.locate(&Invalid {
                            path: path_keys.clone(),
                            message: format!("cannot read {}: {e}", path.display()),
                        })
                    })?;
                    if !text.contains("{conversation}") {
                        let message =
                            format!("{} has no {{conversation}} to put the conversation in", path.display());
                        return Err(src.locate(&Invalid { path: path_keys, message }));
                    }
                    g.template = Some(text);
                }
            }
        }
        // Files the policy names: `$NAME` is an environment variable's value (paths kept out
        // of the file), resolved next to the policy file, and read now so that a bad one fails
        // here, at its key.
        let key = |k: &str| PathSeg::Key(k.to_owned());
        let at = |keys: &[&str], message: String| {
            src.locate(&Invalid { path: keys.iter().map(|k| key(k)).collect(), message })
        };
        let resolve = |f: &std::path::Path, keys: &[&str]| {
            let named = crate::config::from_env(&f.to_string_lossy()).map_err(|m| at(keys, m))?;
            Ok::<_, ConfigError>(src.dir().join(named))
        };
        for (name, tls) in [("tls", &mut cfg.server.tls), ("admin_tls", &mut cfg.server.admin_tls)] {
            let Some(t) = tls else { continue };
            t.cert_file = resolve(&t.cert_file, &["server", name, "cert_file"])?;
            t.key_file = resolve(&t.key_file, &["server", name, "key_file"])?;
            if let Some(f) = &t.client_ca_file {
                t.client_ca_file = Some(resolve(f, &["server", name, "client_ca_file"])?);
            }
            crate::tls::load_pair(&t.cert_file, &t.key_file)
                .map_err(|m| at(&["server", name, "cert_file"], m))?;
        }
        // A TLS trust bundle and client certificate, read now so that a bad one fails here.
        let read_files = |table: &str, files: [(&str, &mut Option<std::path::PathBuf>); 3]| {
            for (k, file) in files {
                if let Some(f) = file {
                    *f = resolve(f, &[table, k])?;
                    if let Err(e) = std::fs::read(&*f) {
                        return Err(at(&[table, k], format!("cannot read {}: {e}", f.display())));
                    }
                }
            }
            Ok(())
        };
        let up = &mut cfg.upstream;
        read_files(
            "upstream",
            [
                ("ca_file", &mut up.ca_file),
                ("client_cert_file", &mut up.client_cert_file),
                ("client_key_file", &mut up.client_key_file),
            ],
        )?;
        let r = &mut cfg.redis;
        read_files(
            "redis",
            [
                ("ca_file", &mut r.ca_file),
                ("client_cert_file", &mut r.client_cert_file),
                ("client_key_file", &mut r.client_key_file),
            ],
        )?;
        // `[session] redis_url` is the older spelling of `[redis] url`.
        if let Some(url) = cfg.session.redis_url.take() {
            cfg.redis.url = Some(url);
            cfg.redis.timeout_ms = cfg.session.redis_timeout_ms;
        }
        if let Some(f) = &cfg.auth.keys_file {
            let path = resolve(f, &["auth", "keys_file"])?;
            crate::auth::KeyTable::load(&path, &cfg.auth.limits)
                .map_err(|m| at(&["auth", "keys_file"], m))?;
            cfg.auth.keys_file = Some(path);
        }
        Ok(Policy { cfg, externals })
    }
}

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

/// Every pool with each stage's part of it, built from its table; `embedded` gives the
/// bundled replicas started for pools that asked for them.
fn build_pools(
    policy: Policy,
    embedded: &Embedded,
    metrics: &Metrics,
    upstream: &Arc<Upstream>,
    late: &LateState,
) -> Result<Pools, String> {
    let cfg = &policy.cfg;
    let mut pools = Vec::with_capacity(cfg.pools.len());
    for (i, (pc, external)) in cfg.pools.iter().zip(policy.externals).enumerate() {
        let specs: Vec<BackendSpec> = match embedded.addrs.get(&i) {
            Some(replicas) => {
                replicas.iter().enumerate().map(|(r, rep)| replica_spec(&pc.name, r, rep)).collect()
            }
            None => pc.backends.iter().map(BackendSpec::from).collect(),
        };
        let canon = Canon::new(&pc.canon, &pc.tools, pc.embedded.is_some(), external);
        let enc = canon.encoder();
        let units = PromptUnits {
            exact_tokens: enc.exact_tokens(),
            per_token_guess: enc.units_per_token_guess(),
            per_block: enc.block_units(),
        };
        let routing = route::Pool::build(pc, &specs, cfg, metrics, units)?;
        let pool = state::Pool {
            name: pc.name.clone(),
            route: Arc::new(routing),
            canon,
            response_cache: pc.response_cache.enabled.then(|| ResponseCache::new(&pc.response_cache)),
            responses: pc.responses,
            responses_tokens: pc.responses_tokens,
            tenants: pc.tenants,
            route_headers: pc.route_headers,
            safety: Safety::from_config(&pc.safety, &pc.name, metrics, &services(pc, cfg, upstream, late))
                .map_err(|e| format!("pools[{i}].safety: {e}"))?
                .map(Arc::new),
        };
        pools.push((pool, pc.models.clone()));
    }
    Ok(Pools::new(pools))
}

/// What pool `pc`'s checks call: the shared connector, and its guard model's pool.
fn services(pc: &PoolConfig, cfg: &Config, upstream: &Arc<Upstream>, late: &LateState) -> Services {
    let guard = pc.safety.guard_model.as_ref().map(|g| {
        Arc::new(PoolCompleter { state: late.clone(), pool: g.pool.clone() })
            as Arc<dyn crate::safety::guard::Complete>
    });
    Services { upstream: upstream.clone(), upstream_cfg: cfg.upstream.clone(), guard }
}

/// A bundled replica as a backend of pool `pool`: named `{pool}-{r}`.
fn replica_spec(pool: &str, r: usize, rep: &Replica) -> BackendSpec {
    let url = crate::config::BackendUrl {
        tls: false,
        host: rep.addr.ip().to_string(),
        port: rep.addr.port(),
        base_path: String::new(),
    };
    BackendSpec {
        name: format!("{pool}-{r}"),
        url,
        weight: 1,
        kv_events: rep.kv_events.clone(),
        kv_replay: rep.kv_replay.clone(),
        api_key: None,
    }
}

/// Starts everything and serves until SIGTERM (graceful) or SIGINT (fast). Never returns on
/// success. `upgrade`: take the listening sockets over from the warmpath running on the same
/// listen address (a restart without a refused connection).
pub fn run(policy: Policy, upgrade: bool) -> anyhow::Result<()> {
    let cfg = policy.cfg.clone();
    init_logging(&cfg);
    let handover = Handover::for_port(cfg.server.listen.port());
    if upgrade {
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
    let embedded = crate::embedded::start(&cfg)?;
    for (pi, addrs) in &embedded.addrs {
        for a in addrs {
            tracing::info!(pool = %cfg.pools[*pi].name, addr = %a.addr, kv_events = ?a.kv_events, "embedded engine replica listening");
        }
    }
    let metrics = Metrics::new();
    let up = &cfg.upstream;
    let client = up.client_cert_file.as_deref().zip(up.client_key_file.as_deref());
    let upstream = Arc::new(Upstream::new(
        Duration::from_millis(up.pool_idle_timeout_ms),
        up.ca_file.as_deref(),
        client,
    ));
    let late = LateState::default();
    let pools = build_pools(policy, &embedded, &metrics, &upstream, &late).map_err(anyhow::Error::msg)?;
    let fleet = Arc::new(Fleet::new(pools.iter().map(|p| p.route.clone()).collect()));

    let conf = ServerConf {
        threads: cfg.server.threads,
        // warmpath's own drain (`shutdown.rs`) exits as soon as nothing is in flight, and by
        // the grace period plus a moment for the last error events; pingora's own grace (a
        // plain sleep, then every task dropped) must not cut in before it.
        grace_period_seconds: Some(cfg.server.grace_period_secs + 5),
        graceful_shutdown_timeout_seconds: Some(5),
        pid_file: handover.pid_file.clone(),
        upgrade_sock: handover.upgrade_sock.clone(),
        ..ServerConf::default()
    };
    let opt = pingora::server::configuration::Opt { upgrade, ..Default::default() };
    let mut server = Server::new_with_opt_and_conf(Some(opt), conf);
    // With `upgrade`, this waits for the running warmpath's sockets.
    server.bootstrap();
    handover.claim().with_context(|| format!("cannot write {}", handover.pid_file))?;

    // The fleet's Redis, where the policy names one (dialled on first use).
    let redis = match cfg.redis.configured() {
        true => Some(Arc::new(Shared::new(&cfg.redis).map_err(anyhow::Error::msg)?)),
        false => None,
    };
    let state = Arc::new(AppState {
        cfg: cfg.clone(),
        pools,
        fleet: fleet.clone(),
        metrics: metrics.clone(),
        upstream: upstream.clone(),
        sessions: Arc::new(
            crate::session::Store::new(&cfg.session, redis.as_ref()).map_err(anyhow::Error::msg)?,
        ),
        ws: Connections::new(metrics.ws_connections.with_label_values(&["api"])),
        auth: Arc::new(Auth::new(&cfg.auth, redis.as_ref(), &metrics).map_err(anyhow::Error::msg)?),
        lifecycle: Arc::new(Lifecycle::default()),
    });
    let _ = late.set(Arc::downgrade(&state));
    let state_fleet = state.auth.fleet();
    let keys = background_service(
        "warmpath keys",
        WatchKeys { auth: state.auth.clone(), interval: Duration::from_millis(cfg.auth.reload_interval_ms) },
    );
    let drain = background_service(
        "warmpath drain",
        crate::shutdown::Drain {
            state: state.clone(),
            grace: Duration::from_secs(cfg.server.grace_period_secs),
            handover: handover.clone(),
        },
    );
    let lifecycle = state.lifecycle.clone();
    let proxy = pingora::proxy::http_proxy(&server.configuration, WarmpathProxy { state });
    let app = WithHeaderDeadline {
        inner: Arc::new(proxy),
        limit: Duration::from_millis(cfg.limits.header_read_timeout_ms),
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
    let ready = fleet.clone();
    let mut admin = Service::new(
        "warmpath admin".to_owned(),
        pingora::apps::http_app::HttpServer::new_app(AdminApp {
            metrics: metrics.clone(),
            unready: Box::new(move || ready.unready()),
            api: cfg.server.listen,
            lifecycle,
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
        EventFeeds { fleet: fleet.clone(), metrics: metrics.clone() },
    );
    let load = background_service(
        "warmpath load",
        LoadScraper::new(fleet.clone(), metrics.clone(), upstream.clone()),
    );
    let health = background_service(
        "warmpath health",
        HealthChecker { fleet, cfg: cfg.health.clone(), metrics, upstream },
    );
    server.add_service(api);
    server.add_service(admin);
    server.add_service(health);
    server.add_service(load);
    server.add_service(events);
    server.add_service(drain);
    server.add_service(keys);
    if let Some(fleet) = state_fleet {
        server.add_service(background_service("warmpath limits", FlushLimits(fleet)));
    }
    server.add_service(certs);

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(file: &str, text: &str) -> Result<Policy, ConfigError> {
        Policy::parse(&Source { file: file.to_owned(), text: text.to_owned() })
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../wire/tests/data").join(name)
    }

    /// A ChatML template with tools, as an external model's `tokenizer_config.json` holds it.
    const TEMPLATE: &str = "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    #[test]
    fn policy_files_load_the_tokenizer_and_the_template_beside_it() {
        let dir = std::env::temp_dir().join(format!("wp-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::copy(fixture("llama3-style.tokenizer.json"), dir.join("tokenizer.json")).expect("copy");
        let config = json!({"chat_template": TEMPLATE, "bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_end|>"}});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
        let policy = "[[pools]]\nname = \"p\"\nmodels = [\"*\"]\n[pools.canon]\nenabled = true\ntokenizer_file = \"tokenizer.json\"\n[[pools.backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:8000\"\n";
        let file = dir.join("p.toml");
        let loaded = parse(&file.display().to_string(), policy).expect("valid");
        let ext = loaded.externals[0].as_ref().expect("loaded");
        assert_eq!(ext.tokenizer.special_id("<|im_end|>"), Some(2));
        assert!(ext.template.as_ref().expect("found beside").source.ends_with("tokenizer_config.json"));

        // A file that is not there, and one that is not a tokenizer: errors at the key.
        let e = parse(&file.display().to_string(), &policy.replace("tokenizer.json\"", "missing.json\""))
            .expect_err("refused");
        assert!(
            e.message.contains("pools[0].canon.tokenizer_file") && e.message.contains("cannot read"),
            "{e}"
        );
        assert_eq!(e.line, 6, "{e}");
        let e = parse(
            &file.display().to_string(),
            &policy.replace("tokenizer.json\"", "tokenizer_config.json\""),
        )
        .expect_err("refused");
        assert!(e.message.contains("model"), "{e}");
        let bad = policy.replace(
            "tokenizer_file = \"tokenizer.json\"\n",
            "tokenizer_file = \"tokenizer.json\"\ntokenizer = \"wp32k\"\n",
        );
        assert!(parse(&file.display().to_string(), &bad).is_err());
        let bad = policy.replace("tokenizer_file = \"tokenizer.json\"\n", "chat_template = \"t.jinja\"\n");
        let e = parse(&file.display().to_string(), &bad).expect_err("refused");
        assert!(e.message.contains("tokenizer_file"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
