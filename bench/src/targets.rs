//! The systems a benchmark compares, each started by the benchmark itself in front of the same
//! backends: a direct connection, warmpath, nginx (Debian), sglang-router and vllm-router (PyPI,
//! installed by `scripts/bench-peers` into `bench/.peers`).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

pub struct Target {
    pub name: String,
    pub addr: SocketAddr,
    /// The process whose CPU is measured (none for the direct connection).
    pub child: Option<Child>,
    /// warmpath's admin listener (its metrics).
    pub admin: Option<SocketAddr>,
    /// How clients talk to it (TLS, an API key, a connection per request).
    pub client: crate::load::Client,
    /// Processes it needs beside it (a Redis), stopped with it; their CPU is not counted.
    pub beside: Vec<Child>,
}

impl Target {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Target {
    /// SIGTERM first, so that nginx's master stops its workers (SIGKILL would orphan them) and
    /// warmpath drains; SIGKILL after two seconds.
    fn drop(&mut self) {
        for b in &mut self.beside {
            let _ = b.kill();
            let _ = b.wait();
        }
        let Some(c) = self.child.as_mut() else { return };
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if matches!(c.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

pub fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A binary built beside this one (`target/release/` or `target/debug/`): warmpath-bench runs
/// the warmpath and warmpath-engine of its own build.
pub fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("warmpath-bench has no directory")?;
    let bin = dir.join(name);
    anyhow::ensure!(
        bin.exists(),
        "{} missing: build it with warmpath-bench (cargo build [--release] -p warmpath -p warmpath-engine -p warmpath-bench)",
        bin.display()
    );
    Ok(bin)
}

pub fn work_dir(name: &str) -> anyhow::Result<PathBuf> {
    let d = root().join("bench/.peers/run").join(name);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

pub fn spawn(name: &str, cmd: &mut Command, addr: SocketAddr) -> anyhow::Result<Target> {
    let log = std::fs::File::create(work_dir(name)?.join("log.txt"))?;
    let child = cmd
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Target {
        name: name.to_owned(),
        addr,
        child: Some(child),
        admin: None,
        client: Default::default(),
        beside: Vec::new(),
    })
}

pub fn direct(upstream: SocketAddr) -> Target {
    Target {
        name: "direct".into(),
        addr: upstream,
        child: None,
        admin: None,
        client: Default::default(),
        beside: Vec::new(),
    }
}

/// The pool tables the `+features` of a warmpath target spec turn on: `canon`
/// (canonicalization, blocks in the bundled engine's tokens), `tok` (blocks in the engine's
/// tokens, requests sent as they are: the tokenizer a deployment names in `tokenizer_file`),
/// `defer` (deferred tool discovery), `precise` (`cache_aware` on the engines' KV events, which
/// needs the engine's tokens, so it implies `tok`). Returns the tables and the lines of the
/// policy's own table.
fn feature_toml<'a>(features: impl Iterator<Item = &'a str>) -> anyhow::Result<(String, String)> {
    let (mut canon, mut tok, mut defer, mut policy) = (false, false, false, String::new());
    for f in features {
        match f {
            "canon" => canon = true,
            "tok" => tok = true,
            "defer" => defer = true,
            "precise" => {
                tok = true;
                policy.push_str("mode = \"precise\"\n");
            }
            _ => anyhow::bail!(
                "unknown warmpath feature +{f} (canon, tok, defer, precise; @KEY=VALUE for policy keys)"
            ),
        }
    }
    let mut tables = String::new();
    if canon || tok {
        tables.push_str("[pools.canon]\ntokenizer = \"wp32k\"\n");
        if canon {
            tables.push_str("enabled = true\n");
        }
    }
    if defer {
        tables.push_str("[pools.tools]\ndefer = true\n");
    }
    Ok((tables, policy))
}

/// warmpath with one pool over `backends` under `spec` (`POLICY[+canon][+tok][+defer][+precise]`,
/// then `@KEY=VALUE` for each key of the policy's table to set, e.g.
/// `cache_aware@miss_weight=2@balance_factor=1.5`);
/// `per_backend` are TOML lines for each backend's table (its KV event endpoint, its K/V
/// transfer address; or empty);
/// `threads` is its `[server] threads`; `extra` is TOML appended to the generated policy file
/// (tables of the pool, such as `[pools.prefix_hash]`).
pub fn warmpath(
    backends: &[SocketAddr],
    per_backend: &[String],
    spec: &str,
    threads: usize,
    extra: &str,
) -> anyhow::Result<Target> {
    warmpath_binary(&sibling("warmpath")?, backends, per_backend, spec, threads, extra)
}

/// [`warmpath`] from the binary `bin` (another build, for a before/after comparison).
pub fn warmpath_binary(
    bin: &Path,
    backends: &[SocketAddr],
    per_backend: &[String],
    spec: &str,
    threads: usize,
    extra: &str,
) -> anyhow::Result<Target> {
    // `POLICY[+feature...][@key=value...]`: the keys go into the policy's own table.
    let mut keys = spec.split('@');
    let mut parts = keys.next().unwrap_or("").split('+');
    let policy = parts.next().unwrap_or("round_robin");
    let (mut features, mut policy_table) = feature_toml(parts)?;
    for kv in keys.filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').with_context(|| format!("{kv:?} in {spec:?}: KEY=VALUE"))?;
        policy_table.push_str(&format!("{k} = {v}\n"));
    }
    if !policy_table.is_empty() {
        features.push_str(&format!("[pools.{policy}]\n{policy_table}"));
    }
    let mut toml = format!(
        "[[pools]]\nname = \"bench\"\nmodels = [\"*\"]\npolicy = \"{policy}\"\nmax_inflight_per_backend = 4096\n"
    );
    for (i, b) in backends.iter().enumerate() {
        toml.push_str(&format!("[[pools.backends]]\nname = \"b{i}\"\nurl = \"http://{b}\"\n"));
        if let Some(lines) = per_backend.get(i) {
            toml.push_str(lines);
        }
    }
    toml.push_str(&features);
    toml.push_str(extra);
    warmpath_pools(bin, &toml, threads, &format!("warmpath {spec}"))
}

/// warmpath from `bin` serving `pools` (the `[[pools]]` tables of a policy file), named `name`.
pub fn warmpath_pools(bin: &Path, pools: &str, threads: usize, name: &str) -> anyhow::Result<Target> {
    let (addr, admin) = (free_addr()?, free_addr()?);
    let run = format!("warmpath-{}", addr.port());
    let file = work_dir(&run)?.join("policy.toml");
    let toml = format!(
        "[server]\nlisten = \"{addr}\"\nadmin = \"{admin}\"\nthreads = {threads}\n\
         [log]\nlevel = \"warn\"\n{pools}"
    );
    std::fs::write(&file, toml)?;
    let mut t = spawn(&run, Command::new(bin).arg("--config").arg(&file), addr)?;
    t.name = name.to_owned();
    t.admin = Some(admin);
    Ok(t)
}

/// nginx round robin over `backends` (one worker process, keep-alive upstream connections).
pub fn nginx(backends: &[SocketAddr]) -> anyhow::Result<Target> {
    let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"].into_iter().find(|p| Path::new(p).exists());
    let bin = bin.context("nginx missing: scripts/bench-peers installs it")?;
    let addr = free_addr()?;
    let dir = work_dir("nginx")?;
    let d = dir.display();
    let servers: String = backends.iter().map(|b| format!("server {b}; ")).collect();
    let conf = format!(
        "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 1000000;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream up {{ {servers}keepalive 64; keepalive_requests 1000000; }}\n\
           server {{\n    listen {addr};\n    client_max_body_size 64m;\n    client_body_buffer_size 1m;\n\
             location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; proxy_read_timeout 300s; }}\n  }}\n}}\n"
    );
    std::fs::write(dir.join("nginx.conf"), conf)?;
    let mut t =
        spawn("nginx", Command::new(bin).arg("-p").arg(&dir).arg("-c").arg(dir.join("nginx.conf")), addr)?;
    t.name = "nginx round_robin".into();
    Ok(t)
}

/// sglang-router or vllm-router (same command-line shape) over `backends`.
pub fn rust_router(which: &str, backends: &[SocketAddr], policy: &str) -> anyhow::Result<Target> {
    let (venv, exe) = match which {
        "sglang-router" => ("venv", "sglang-router"),
        _ => ("vllm-venv", "vllm-router"),
    };
    let bin = root().join("bench/.peers").join(venv).join("bin").join(exe);
    anyhow::ensure!(bin.exists(), "{} missing: run scripts/bench-peers", bin.display());
    let addr = free_addr()?;
    let prom = free_addr()?;
    let mut cmd = Command::new(bin);
    if which == "sglang-router" {
        cmd.arg("launch");
    }
    cmd.args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
        .arg("--worker-urls")
        .args(backends.iter().map(|b| format!("http://{b}")))
        .args(["--policy", policy])
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &prom.port().to_string()])
        .env("HF_HUB_OFFLINE", "1");
    let mut t = spawn(&format!("{which}-{policy}"), &mut cmd, addr)?;
    t.name = format!("{which} {policy}");
    Ok(t)
}

/// Waits until `t` answers `body` with 200. Its process must still be running: one that exited
/// (a port another process took meanwhile) would leave `t.addr` to whatever answers there.
pub async fn wait_ready(t: &mut Target, body: &bytes::Bytes) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let r = crate::load::run(t.addr, "/v1/chat/completions", body.clone(), 1, 1, 200, &t.client).await;
        if let Some(status) = t.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            anyhow::bail!(
                "{} exited ({status}) before it was ready (see bench/.peers/run/*/log.txt)",
                t.name
            );
        }
        if r.errors == 0 && r.latencies.len() == 1 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} did not become ready (see bench/.peers/run/*/log.txt)",
            t.name
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
