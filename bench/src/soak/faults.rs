//! The soak's processes and the faults done to them: engine replicas (`warmpath-engine`, the
//! engine warmpath embeds, run as processes of their own so one can be killed, stalled and
//! restarted), a Redis that can be restarted, and the policy file a reload rewrites.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::targets;

/// A process started from a fixed command line, restartable on the same port.
pub struct Proc {
    pub name: String,
    pub addr: SocketAddr,
    bin: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    fn start(name: &str, bin: PathBuf, args: Vec<String>, addr: SocketAddr) -> anyhow::Result<Proc> {
        let log = targets::work_dir(&format!("soak-{name}"))?.join("log.txt");
        let mut p = Proc { name: name.to_owned(), addr, bin, args, log, child: None };
        p.spawn()?;
        Ok(p)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(&self.bin)
            .args(&self.args)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", self.name))?;
        self.child = Some(child);
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
        }
    }

    /// SIGKILL: a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, and waits for the exit (SIGKILL after five seconds).
    pub fn stop(&mut self) {
        self.signal("-TERM");
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Some(c) = self.child.as_mut() {
            if matches!(c.try_wait(), Ok(Some(_))) || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }

    /// SIGSTOP: the process stalls, its sockets open.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Waits until the port accepts connections.
    pub fn wait_listening(&self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        while std::net::TcpStream::connect(self.addr).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} did not listen (log: {})",
                self.name,
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A simulated engine replica (the sim executor: the real server, scheduler and KV cache,
/// timing modelled instead of computed) with fault flags.
pub fn replica(i: usize, itl_ms: u64, faults: &[&str]) -> anyhow::Result<Proc> {
    let addr = targets::free_addr()?;
    let mut args: Vec<String> = [
        "--executor",
        "sim",
        "--model",
        "tiny",
        "--served-model-name",
        super::traffic::MODEL,
        "--max-num-seqs",
        "512",
        "--kv-blocks",
        "8192",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--port".into(), addr.port().to_string(), "--engine-id".into(), i.to_string()]);
    args.extend(["--sim-itl-ms".into(), itl_ms.to_string()]);
    args.extend(faults.iter().map(|s| s.to_string()));
    Proc::start(&format!("engine-{i}"), targets::sibling("warmpath-engine")?, args, addr)
}

/// A Redis that keeps its data across a restart (append-only file in its directory).
pub fn redis() -> anyhow::Result<Proc> {
    let addr = targets::free_addr()?;
    let dir = targets::work_dir("soak-redis")?;
    for f in ["appendonlydir", "dump.rdb"] {
        let p = dir.join(f);
        let _ = std::fs::remove_dir_all(&p);
        let _ = std::fs::remove_file(&p);
    }
    let args = [
        "--port",
        &addr.port().to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--dir",
        &dir.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bin = which("redis-server").context("redis-server missing: scripts/ensure-deps installs it")?;
    let p = Proc::start("redis", bin, args, addr)?;
    p.wait_listening(Duration::from_secs(10))?;
    Ok(p)
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(name)).find(|p| p.exists())
}

/// warmpath's policy for the soak: one `cache_aware` pool over the replicas, conversations in
/// the Redis, quick health probes, the queue's timeout `queue_timeout_ms` (what the reload
/// changes).
pub fn policy(
    listen: SocketAddr,
    admin: SocketAddr,
    redis: SocketAddr,
    replicas: &[&Proc],
    queue_timeout_ms: u64,
) -> String {
    let mut s = format!(
        "[server]\nlisten = \"{listen}\"\nadmin = \"{admin}\"\nthreads = 2\ngrace_period_secs = 5\n\
         [log]\nlevel = \"warn\"\n\
         [health]\ninterval_ms = 250\ntimeout_ms = 1000\n\
         [upstream]\npool_idle_timeout_ms = 1000\n\
         [redis]\nurl = \"redis://{redis}\"\n\
         [session]\nstore = \"redis\"\n\
         [[pools]]\nname = \"soak\"\nmodels = [\"{}\"]\npolicy = \"cache_aware\"\n\
         max_inflight_per_backend = 384\nqueue_timeout_ms = {queue_timeout_ms}\n",
        super::traffic::MODEL
    );
    for r in replicas {
        s.push_str(&format!("[[pools.backends]]\nname = \"{}\"\nurl = \"http://{}\"\n", r.name, r.addr));
    }
    s
}

/// warmpath itself, from the policy file at `file`.
pub fn warmpath(file: &Path, listen: SocketAddr) -> anyhow::Result<Proc> {
    let args = vec!["--config".to_owned(), file.display().to_string()];
    Proc::start("warmpath", targets::sibling("warmpath")?, args, listen)
}
