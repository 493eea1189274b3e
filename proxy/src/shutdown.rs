//! SIGTERM, as a drain: pingora stops accepting and ends kept-alive connections after their
//! current request; this service marks the process draining (`/readyz` and `/health` answer
//! 503), tells WebSocket connections to close after their turn in flight, and waits for the
//! requests being served to finish — exiting as soon as none is left, not after the whole grace
//! period. When `[server] grace_period_secs` runs out first, streams still running end with an
//! error event (their backends' generations are cancelled), and the process exits a moment
//! later. Per-key settlements still queued go to Redis first. SIGINT stays immediate.
//!
//! A restart without a refused connection ([`Handover`]): a second warmpath started with
//! `--upgrade` on the same listen address sends the running one SIGQUIT; pingora hands the
//! listening sockets over a Unix socket, both accept on them for a few seconds, and the old one
//! then drains as above while the new one serves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::observe::Active;
use crate::state::Live;

/// How often the drain looks at what is left.
const POLL: Duration = Duration::from_millis(50);
/// After the grace period, how long ended streams get to write their error events.
const LAST_WORDS: Duration = Duration::from_secs(2);

/// The files two warmpath processes on one listen address meet at: the running one's pid
/// and the Unix socket the listening sockets are handed over.
#[derive(Debug, Clone)]
pub struct Handover {
    pub pid_file: String,
    pub upgrade_sock: String,
}

impl Handover {
    /// Per listen port, so that warmpath processes on other ports never meet.
    pub fn for_port(port: u16) -> Handover {
        let dir = std::env::temp_dir();
        Handover {
            pid_file: dir.join(format!("warmpath-{port}.pid")).display().to_string(),
            upgrade_sock: dir.join(format!("warmpath-{port}.upgrade.sock")).display().to_string(),
        }
    }

    /// This process serves now: its pid in the file.
    pub fn claim(&self) -> std::io::Result<()> {
        std::fs::write(&self.pid_file, std::process::id().to_string())
    }

    /// On the way out: the pid file, unless a successor holds it already.
    pub fn release(&self) {
        let ours =
            std::fs::read_to_string(&self.pid_file).is_ok_and(|p| p.trim() == std::process::id().to_string());
        if ours {
            let _ = std::fs::remove_file(&self.pid_file);
        }
    }

    /// `--upgrade`: asks the warmpath running on this port to hand its sockets over (SIGQUIT,
    /// a moment after this process starts waiting for them; pingora retries either way).
    pub fn take_over(&self) -> Result<u32, String> {
        let pid = std::fs::read_to_string(&self.pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
            .ok_or_else(|| format!("--upgrade: no running warmpath found ({} is missing)", self.pid_file))?;
        // A pid file left by a process killed outright may name another program by now.
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() != "warmpath" {
            return Err(format!("--upgrade: pid {pid} in {} is not a running warmpath", self.pid_file));
        }
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let sent = std::process::Command::new("kill").args(["-QUIT", &pid.to_string()]).status();
            if !sent.is_ok_and(|s| s.success()) {
                tracing::error!(pid, "--upgrade: could not signal the running warmpath");
            }
        });
        Ok(pid)
    }
}

pub struct Drain {
    /// The state of the moment (its WebSockets and lifecycle are the process's).
    pub live: Arc<Live>,
    pub grace: Duration,
    pub handover: Handover,
}

#[async_trait]
impl pingora::services::background::BackgroundService for Drain {
    async fn start(&self, mut shutdown: pingora::server::ShutdownWatch) {
        if shutdown.changed().await.is_err() {
            return;
        }
        let state = &self.live.load();
        let started = Instant::now();
        state.lifecycle.drain();
        state.ws.drain();
        tracing::info!(in_flight = Active::count(), grace_s = self.grace.as_secs(), "SIGTERM: draining");
        let mut closed_at = None;
        // Nothing left on two looks in a row (a request whose header was just read is counted
        // on the next look).
        let mut quiet = 0;
        loop {
            quiet = if Active::count() == 0 { quiet + 1 } else { 0 };
            if quiet >= 2 {
                break;
            }
            match closed_at {
                None if started.elapsed() >= self.grace => {
                    tracing::warn!(in_flight = Active::count(), "grace period over: ending what still runs");
                    state.lifecycle.close();
                    closed_at = Some(Instant::now());
                }
                Some(at) if at.elapsed() >= LAST_WORDS => break,
                _ => {}
            }
            tokio::time::sleep(POLL).await;
        }
        if let Some(fleet) = self.live.load().auth.fleet() {
            if let Err(e) = fleet.flush().await {
                tracing::warn!(error = %e, "per-key settlements not sent to Redis before exit");
            }
        }
        self.handover.release();
        tracing::info!(
            after_ms = started.elapsed().as_millis() as u64,
            left = Active::count(),
            "drained; exiting"
        );
        std::process::exit(0);
    }
}
