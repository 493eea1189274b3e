//! Real `redis-server` processes on 127.0.0.1, nothing persisted, killed on drop: one server
//! (plain, with a password, or over TLS), a Redis Cluster of three masters, and a master with
//! a replica watched by a Sentinel.

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::client::eventually;
use crate::process::{free_port, free_ports};

/// A `redis-server` process; killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Child,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// With extra `redis-server` arguments (`--requirepass secret`).
    pub fn start_with(extra: &[&str]) -> RedisServer {
        RedisServer::start_on(free_port(), extra)
    }

    /// On `port` (a server restarted where warmpath expects it).
    pub fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/ensure-deps installs it)");
        let up = eventually(Duration::from_secs(10), || TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(up, "redis-server did not listen on {port}");
        RedisServer { port, child }
    }

    /// Over TLS only (`--tls-port`), with `cert`/`key` and clients not asked for certificates.
    pub fn start_tls(cert: &Path, key: &Path, ca: &Path) -> RedisServer {
        let port = free_port();
        let (cert, key, ca) =
            (cert.display().to_string(), key.display().to_string(), ca.display().to_string());
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--tls-cert-file", &cert, "--tls-key-file", &key, "--tls-ca-cert-file", &ca])
            .args(["--tls-auth-clients", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs");
        let up = eventually(Duration::from_secs(10), || TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(up, "redis-server (TLS) did not listen on {port}");
        RedisServer { port, child }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli` against this server; its output.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `redis-cli -p PORT ARGS…`: its standard output, trimmed.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A Redis Cluster: three masters, slots spread by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: crate::process::TempDir,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let dir = crate::process::TempDir::new();
        let ports = free_ports::<3>();
        let nodes: Vec<RedisServer> = ports
            .iter()
            .map(|p| {
                let conf = dir.path().join(format!("nodes-{p}.conf")).display().to_string();
                RedisServer::start_on(*p, &["--cluster-enabled", "yes", "--cluster-config-file", &conf])
            })
            .collect();
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(out.status.success(), "cluster create: {}", String::from_utf8_lossy(&out.stdout));
        let ok = eventually(Duration::from_secs(20), || {
            ports.iter().all(|p| redis_cli(*p, &["cluster", "info"]).contains("cluster_state:ok"))
        });
        assert!(ok, "the cluster did not come up");
        RedisCluster { nodes, _dir: dir }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }
}

/// A master, its replica, and one Sentinel watching them (quorum 1, a master down after
/// 500 ms is failed over).
pub struct RedisSentinel {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinel: Child,
    pub sentinel_port: u16,
    _dir: crate::process::TempDir,
}

impl RedisSentinel {
    pub const MASTER: &'static str = "wpmaster";

    pub fn start() -> RedisSentinel {
        let dir = crate::process::TempDir::new();
        let master = RedisServer::start();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port.to_string()]);
        let synced = eventually(Duration::from_secs(20), || {
            replica.cli(&["info", "replication"]).contains("master_link_status:up")
        });
        assert!(synced, "the replica did not sync");
        let sentinel_port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {sentinel_port}\nbind 127.0.0.1\nsentinel monitor {m} 127.0.0.1 {p} 1\n\
                 sentinel down-after-milliseconds {m} 500\nsentinel failover-timeout {m} 5000\n",
                m = Self::MASTER,
                p = master.port
            ),
        )
        .expect("write sentinel.conf");
        let sentinel = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server --sentinel runs");
        let up = eventually(Duration::from_secs(10), || {
            redis_cli(sentinel_port, &["sentinel", "get-master-addr-by-name", Self::MASTER])
                .contains(&master.port.to_string())
        });
        assert!(up, "the sentinel did not come up");
        RedisSentinel { master, replica, sentinel, sentinel_port, _dir: dir }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.sentinel_port)
    }

    /// The master's port as the Sentinel names it now.
    pub fn master_port(&self) -> u16 {
        let out = redis_cli(self.sentinel_port, &["sentinel", "get-master-addr-by-name", Self::MASTER]);
        out.lines().nth(1).and_then(|p| p.trim().parse().ok()).unwrap_or(0)
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        let _ = self.sentinel.kill();
        let _ = self.sentinel.wait();
    }
}
