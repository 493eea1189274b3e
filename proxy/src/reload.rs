//! Policy reloads without a restart: on SIGHUP, on the admin listener's `POST /reload`, and
//! with `--watch` when the file changes. The new file is loaded exactly as `check-config`
//! loads it; a bad one is refused with the same `file:line:col: message` (in the log, in the
//! admin answer, and as `warmpath_config_reloads_total{result="error"}`) and the old policy
//! keeps serving. A good one becomes a new state (`build::state`, carrying over what did not
//! change) swapped in whole: requests in flight finish under the policy they started with, new
//! ones get the new one, WebSocket connections stay open and run their next turn under it.
//!
//! What a reload cannot change: the listeners (`[server]`'s `listen`, `admin`, TLS tables,
//! `threads`) and the embedded replicas (which pools have them, and their `[pools.embedded]`
//! tables: engines are started once). A file that changes those is refused, saying to restart
//! (`warmpath --upgrade` does it without a refused connection). `[log]` is read at start: a
//! change to it is reloaded with the rest and takes effect at the next start (the answer says
//! so).
//!
//! The same rebuild follows the backends' host names ([`DnsRefresh`]): every `[upstream]
//! dns_refresh_s` they are looked up again, and when an address changed the policy in memory
//! (not the file, which may hold edits not yet meant to apply) is built again over the new
//! addresses; backends whose address did not change keep their state.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::build::{self, Base};
use crate::config::Config;
use crate::observe::Reload;
use crate::policy::Policy;
use crate::policy::RunOptions;
use crate::state::{AppState, Live};
use crate::upstream::dns::{Resolve, Resolved};

pub struct Reloader {
    live: Arc<Live>,
    base: Base,
    /// The file, and the command line's overrides of it.
    opts: RunOptions,
    /// One reload at a time.
    busy: tokio::sync::Mutex<()>,
    /// The loaded file's hash, as `warmpath_config_info` shows it.
    hash: Mutex<String>,
    /// The policy being served (with the command line's overrides), for rebuilds on new
    /// addresses.
    policy: Mutex<Policy>,
    resolve: Resolve,
}

/// The first 16 hex digits of the SHA-256 of the file's bytes.
pub fn file_hash(bytes: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl Reloader {
    /// `base` and the state in `live` were built from `policy`, loaded from `opts.file`, whose
    /// bytes hash to `hash`; names are looked up with `resolve`.
    pub fn new(
        live: Arc<Live>,
        base: Base,
        opts: RunOptions,
        hash: String,
        policy: Policy,
        resolve: Resolve,
    ) -> Reloader {
        base.metrics.config_info.with_label_values(&[&hash]).set(1);
        Reloader {
            live,
            base,
            opts,
            busy: tokio::sync::Mutex::new(()),
            hash: Mutex::new(hash),
            policy: Mutex::new(policy),
            resolve,
        }
    }

    /// Looks the names of `cfg` up off the async threads, counting the lookups.
    async fn lookup(&self, cfg: &Config, previous: Arc<Resolved>) -> Result<Resolved, String> {
        let (cfg, resolve) = (cfg.clone(), self.resolve.clone());
        let (resolved, done) =
            tokio::task::spawn_blocking(move || Resolved::lookup(&cfg, Some(&previous), &resolve))
                .await
                .map_err(|e| format!("the lookup stopped: {e}"))??;
        let m = &self.base.metrics.dns_lookups;
        m.with_label_values(&["ok"]).inc_by(done.ok as u64);
        m.with_label_values(&["error"]).inc_by(done.failed.len() as u64);
        if !done.failed.is_empty() {
            tracing::warn!(failed = ?done.failed, "backend names did not resolve; their last addresses are kept");
        }
        Ok(resolved)
    }

    /// Looks the served policy's names up again; where an address changed, builds the state
    /// anew over the new addresses. `Ok(None)`: nothing changed.
    pub async fn refresh_addresses(&self) -> Result<Option<Vec<String>>, String> {
        let _one = self.busy.lock().await;
        let old = self.live.load();
        let resolved = self.lookup(&old.cfg, old.resolved.clone()).await?;
        let changed = resolved.changed(&old.resolved);
        if changed.is_empty() {
            return Ok(None);
        }
        let policy = self.policy.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let new = build::state(&self.base, policy, Arc::new(resolved), Some(&old))?;
        forget_gone(&self.base.metrics, &old, &new);
        self.live.swap(new);
        self.base.metrics.dns_updates.inc();
        tracing::info!(names = ?changed, "backend addresses changed: backends rebuilt");
        Ok(Some(changed))
    }

    fn file(&self) -> &PathBuf {
        &self.opts.file
    }

    async fn try_reload(&self) -> Result<String, String> {
        let file = self.file().clone();
        let bytes = std::fs::read(&file).map_err(|e| format!("{}: cannot read: {e}", file.display()))?;
        let hash = file_hash(&bytes);
        // Tokenizers and templates are read and parsed: off the async threads.
        let policy = tokio::task::spawn_blocking(move || Policy::load(&file))
            .await
            .map_err(|e| format!("the reload stopped: {e}"))?
            .map_err(|e| e.to_string())?;
        let mut policy = policy;
        self.opts.apply(&mut policy.cfg);
        let old = self.live.load();
        unchangeable(&old.cfg, &policy.cfg)?;
        let resolved = self.lookup(&policy.cfg, old.resolved.clone()).await?;
        let new = build::state(&self.base, policy.clone(), Arc::new(resolved), Some(&old))?;
        let kept: Vec<&str> = new
            .pools
            .iter()
            .filter(|p| old.pools.named(&p.name).is_some_and(|o| Arc::ptr_eq(&o.route, &p.route)))
            .map(|p| p.name.as_str())
            .collect();
        let mut summary = format!(
            "reloaded {} ({hash}): {} pools, routing state kept in {}",
            self.file().display(),
            new.pools.iter().count(),
            if kept.is_empty() { "none".to_owned() } else { kept.join(", ") }
        );
        if format!("{:?}", old.cfg.log) != format!("{:?}", new.cfg.log) {
            summary.push_str("; [log] takes effect at the next start");
        }
        // Settlements the replaced keys still owe Redis go out before they are dropped.
        if !Arc::ptr_eq(&old.auth, &new.auth) {
            if let Some(f) = old.auth.fleet() {
                let _ = f.flush().await;
            }
        }
        forget_gone(&self.base.metrics, &old, &new);
        self.live.swap(new);
        *self.policy.lock().unwrap_or_else(|p| p.into_inner()) = policy;
        let mut h = self.hash.lock().unwrap_or_else(|p| p.into_inner());
        let info = &self.base.metrics.config_info;
        let _ = info.remove_label_values(&[h.as_str()]);
        info.with_label_values(&[&hash]).set(1);
        *h = hash;
        Ok(summary)
    }
}

#[async_trait]
impl Reload for Reloader {
    async fn reload(&self, why: &str) -> Result<String, String> {
        let _one = self.busy.lock().await;
        let done = self.try_reload().await;
        let m = &self.base.metrics.config_reloads;
        match &done {
            Ok(summary) => {
                m.with_label_values(&["ok"]).inc();
                tracing::info!(trigger = why, "{summary}");
            }
            Err(e) => {
                m.with_label_values(&["error"]).inc();
                tracing::error!(trigger = why, error = %e, "policy not reloaded; the old one keeps serving");
            }
        }
        done
    }
}

/// Drops the gauges of the backends `old` has and `new` does not.
fn forget_gone(metrics: &crate::observe::Metrics, old: &AppState, new: &AppState) {
    for b in old.fleet.backends() {
        let kept = new.fleet.backends().any(|n| n.pool == b.pool && n.name == b.name);
        if !kept {
            metrics.forget_backend(&b.pool, &b.name);
        }
    }
}

/// What a reload cannot change, compared by its printed form.
fn unchangeable(old: &Config, new: &Config) -> Result<(), String> {
    let restart = "restart for that (warmpath --upgrade keeps every connection)";
    let (o, n) = (&old.server, &new.server);
    let listeners = |s: &crate::config::ServerConfig| {
        format!("{:?}", (s.listen, s.admin, &s.tls, &s.admin_tls, s.threads, s.work_stealing))
    };
    if listeners(o) != listeners(n) {
        return Err(format!(
            "[server] listen, admin, tls, admin_tls, threads and work_stealing cannot change by reload: {restart}"
        ));
    }
    let embedded = |c: &Config| {
        let mut e: Vec<String> =
            c.pools.iter().filter_map(|p| p.embedded.as_ref().map(|e| format!("{} {e:?}", p.name))).collect();
        e.sort();
        e
    };
    if embedded(old) != embedded(new) {
        return Err(format!(
            "embedded replicas cannot change by reload (which pools have them, and [pools.embedded]): {restart}"
        ));
    }
    if format!("{:?}", old.tracing) != format!("{:?}", new.tracing) {
        return Err(format!("[tracing] cannot change by reload: {restart}"));
    }
    Ok(())
}

/// Reloads on SIGHUP, and with `watch` when the file's modification time changes (looked at
/// every second).
pub struct ReloadTriggers {
    pub reloader: Arc<Reloader>,
    pub watch: bool,
}

#[async_trait]
impl pingora::services::background::BackgroundService for ReloadTriggers {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
            tracing::warn!("SIGHUP cannot be caught: policy reloads only through POST /reload");
            return;
        };
        let modified = || std::fs::metadata(self.reloader.file()).and_then(|m| m.modified()).ok();
        let mut seen: Option<SystemTime> = modified();
        loop {
            let watching = async {
                match self.watch {
                    true => tokio::time::sleep(Duration::from_secs(1)).await,
                    false => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = hup.recv() => {
                    let _ = self.reloader.reload("SIGHUP").await;
                    seen = modified();
                }
                _ = watching => {
                    let now = modified();
                    if now.is_some() && now != seen {
                        seen = now;
                        let _ = self.reloader.reload("watch").await;
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Looks the backends' names up again every `[upstream] dns_refresh_s` (read at each round, so
/// a reload changes it) and rebuilds the fleet where an address changed. A policy of IP
/// literals (the embedded pools) has nothing to look up and is left alone.
pub struct DnsRefresh {
    pub reloader: Arc<Reloader>,
}

#[async_trait]
impl pingora::services::background::BackgroundService for DnsRefresh {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        loop {
            let (every, names) = {
                let state = self.reloader.live.load();
                (state.cfg.upstream.dns_refresh_s, state.resolved.has_names())
            };
            // Off, or nothing to look up: look again now and then whether a reload changed
            // that (a reload looks names up itself).
            let wait = Duration::from_secs(if every == 0 || !names { 60 } else { every });
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return,
            }
            let state = self.reloader.live.load();
            if every == 0 || state.cfg.upstream.dns_refresh_s == 0 || !state.resolved.has_names() {
                continue;
            }
            drop(state);
            if let Err(e) = self.reloader.refresh_addresses().await {
                tracing::error!(error = %e, "backends not rebuilt on their new addresses");
            }
        }
    }
}
