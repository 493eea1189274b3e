//! Real processes on 127.0.0.1: `warmpath-engine` and `warmpath` (from this workspace's build),
//! each killed on drop, with their output kept for failure messages.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::client::{get, try_get};

/// A binary of this workspace next to the running test's target directory (`target/debug/`
/// or `target/release/`), built once if missing: `cargo test` builds a package's own binaries
/// before its integration tests, and the engine's for the engine's tests.
pub fn bin(package: &str, name: &str) -> PathBuf {
    static BINS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut bins = BINS.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner());
    bins.entry(name.to_owned())
        .or_insert_with(|| {
            let exe = std::env::current_exe().expect("test exe");
            let dir = exe.parent().and_then(Path::parent).expect("target dir").to_path_buf();
            let bin = dir.join(name);
            if bin.exists() {
                // Building it here again could resolve features differently and rebuild the world.
                return bin;
            }
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "-q", "-p", package, "--bin", name]);
            if dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("cargo runs");
            assert!(status.success(), "building {name} failed");
            assert!(bin.exists(), "{} missing after build", bin.display());
            bin
        })
        .clone()
}

/// The `warmpath-engine` binary.
pub fn engine_bin() -> PathBuf {
    bin("warmpath-engine", "warmpath-engine")
}

/// Output of a child process, kept for failure messages.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<String>>);

impl Log {
    pub fn text(&self) -> String {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }
    pub fn drain(&self, r: impl Read + Send + 'static) {
        let log = self.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines().map_while(Result::ok) {
                if let Ok(mut s) = log.0.lock() {
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        });
    }
}

/// A `warmpath-engine` process; killed on drop.
pub struct Engine {
    pub addr: SocketAddr,
    pub child: Child,
    pub log: Log,
    pub args: Vec<String>,
}

impl Engine {
    /// Starts an engine with the `sim` executor (fast, no math) and extra flags.
    pub fn sim(name: &str, extra: &[&str]) -> Engine {
        let mut args: Vec<String> =
            ["--executor", "sim", "--served-model-name", name].iter().map(|s| s.to_string()).collect();
        // Defaults a test may override (clap refuses a flag given twice).
        for (flag, value) in [("--kv-blocks", "512"), ("--sim-itl-ms", "2")] {
            if !extra.contains(&flag) {
                args.extend([flag.to_owned(), value.to_owned()]);
            }
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        Engine::start_args(args, 0)
    }

    pub fn start_args(args: Vec<String>, port: u16) -> Engine {
        let mut child = Command::new(engine_bin())
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("engine spawns");
        let log = Log::default();
        log.drain(child.stderr.take().expect("stderr"));
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            line.clear();
            if out.read_line(&mut line).unwrap_or(0) == 0 || Instant::now() > deadline {
                panic!("engine did not start: {}", log.text());
            }
            if let Some(a) = line.trim().rsplit("http://").next().filter(|_| line.contains("serving model")) {
                break a.parse::<SocketAddr>().expect("engine address");
            }
        };
        log.drain(out.into_inner());
        Engine { addr, child, log, args }
    }

    /// Stops the process (the port is freed).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the same engine again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.addr.port();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // The port may linger for a moment after the kill.
            if TcpListener::bind(self.addr).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        *self = Engine::start_args(self.args.clone(), port);
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn metrics(&self) -> String {
        String::from_utf8_lossy(&get(self.addr, "/metrics").body).into_owned()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port (bound and released; a race with other processes is possible but rare).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// `n` distinct free ports: held open together while they are picked, so that two calls in a
/// row cannot hand out the same port (the kernel may reuse a port the moment it is closed).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> =
        (0..N).map(|_| TcpListener::bind("127.0.0.1:0").expect("free port")).collect();
    std::array::from_fn(|i| held[i].local_addr().expect("addr").port())
}

/// A `warmpath` process serving a policy file; killed on drop.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub child: Child,
    pub log: Log,
    /// The policy file it serves.
    pub policy_file: PathBuf,
    _dir: TempDir,
}

impl Proxy {
    /// Starts warmpath with `policy` (TOML) and waits until its admin listener answers and, when
    /// `ready`, until `/readyz` says every pool has a backend.
    pub fn start_with(policy: &str, ready: bool) -> Proxy {
        Proxy::start_args(policy, ready, &[])
    }

    /// With extra command-line arguments (`--watch`). Ports are picked free and released
    /// before warmpath binds them, so a process started meanwhile (an engine binding port 0)
    /// may take one: warmpath then exits saying it cannot bind, and is started again on others.
    pub fn start_args(policy: &str, ready: bool, args: &[&str]) -> Proxy {
        let path = if ready { "/readyz" } else { "/healthz" };
        for _ in 0..3 {
            let dir = TempDir::new();
            let file = dir.path().join("policy.toml");
            std::fs::write(&file, policy).expect("write policy");
            let [port, admin_port] = free_ports();
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
            let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().expect("addr");
            let mut proxy = Proxy::spawn(file, addr, admin, args, dir);
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if try_get(admin, path).is_some_and(|r| r.status == 200) && TcpStream::connect(addr).is_ok() {
                    return proxy;
                }
                if proxy.child.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
            // (The log is drained by threads: give them the exit's last lines.)
            std::thread::sleep(Duration::from_millis(100));
            let log = proxy.log.text();
            assert!(log.contains("cannot bind"), "warmpath did not become ready:\n{log}");
        }
        panic!("warmpath could not bind free ports three times");
    }

    pub fn start(policy: &str) -> Proxy {
        Proxy::start_with(policy, true)
    }

    fn spawn(file: PathBuf, addr: SocketAddr, admin: SocketAddr, extra: &[&str], dir: TempDir) -> Proxy {
        let mut child = Command::new(bin("warmpath", "warmpath"))
            .arg("--config")
            .arg(&file)
            .args(["--listen", &addr.to_string(), "--admin", &admin.to_string()])
            .args(extra)
            .env("RUST_LOG", "warn,warmpath=info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("warmpath spawns");
        let log = Log::default();
        log.drain(child.stdout.take().expect("stdout"));
        log.drain(child.stderr.take().expect("stderr"));
        Proxy { addr, admin, child, log, policy_file: file, _dir: dir }
    }

    /// A second warmpath on the same addresses and policy, started with `--upgrade`: it takes
    /// this one's listening sockets over, and this one drains.
    pub fn successor(&self) -> Proxy {
        let dir = TempDir::new();
        let file = dir.path().join("policy.toml");
        std::fs::copy(&self.policy_file, &file).expect("copy policy");
        Proxy::spawn(file, self.addr, self.admin, &["--upgrade"], dir)
    }

    pub fn metrics(&self) -> String {
        String::from_utf8_lossy(&get(self.admin, "/metrics").body).into_owned()
    }
}

/// POST `body` as JSON to `path` with `Authorization: Bearer KEY`.
pub fn post_as(proxy: &Proxy, key: &str, path: &str, body: &serde_json::Value) -> crate::client::Resp {
    let auth = format!("Bearer {key}");
    crate::client::request(
        proxy.addr,
        "POST",
        path,
        &[("authorization", auth.as_str()), ("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("warmpath-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Default for TempDir {
    fn default() -> Self {
        TempDir::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Resident memory of a process, in kB (`/proc/PID/status`).
pub fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
        .expect("rss")
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `cmd` to its end: whether it succeeded, and its stdout then stderr.
pub fn output_of(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}
