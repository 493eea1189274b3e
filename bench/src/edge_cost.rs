//! The edge's cost, as rows of `warmpath-bench overhead`: warmpath behind its own TLS listener
//! (connections kept alive; a new connection per request with a full handshake, and with a
//! resumed session; plain HTTP with a new connection per request beside them, so the
//! handshake's share can be read off), and with API keys and per-key limits on (limits set
//! high enough never to refuse: the cost of checking, not of refusing), counted in the process
//! and, where `redis-server` is installed, for a fleet in Redis (one script per admission and
//! one per settlement; Redis' own CPU is not in the figure).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio_rustls::rustls::{self, pki_types::CertificateDer, RootCertStore};

use crate::load::Client;
use crate::targets::{self, Target};

/// A CA and a `localhost` certificate it signed, in `dir`: the certificate and key files, and
/// the client's roots.
fn certificates(dir: &std::path::Path) -> anyhow::Result<(String, String, RootCertStore)> {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate()?;
    let ca = ca.self_signed(&ca_key)?;
    let key = rcgen::KeyPair::generate()?;
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])?.signed_by(&key, &ca, &ca_key)?;
    let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&c, cert.pem())?;
    std::fs::write(&k, key.serialize_pem())?;
    let mut roots = RootCertStore::empty();
    roots.add(CertificateDer::from(ca.der().to_vec()))?;
    Ok((c.display().to_string(), k.display().to_string(), roots))
}

/// TLS client settings: `resume` keeps sessions (TLS 1.3 tickets) for later handshakes.
fn tls_client(roots: &RootCertStore, resume: bool) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS 1.2 and 1.3")
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
    if !resume {
        c.resumption = rustls::client::Resumption::disabled();
    }
    Arc::new(c)
}

/// The edge targets in front of `up`.
pub fn targets(up: SocketAddr, threads: usize) -> anyhow::Result<Vec<Target>> {
    let dir = targets::work_dir("edge")?;
    let (cert, key, roots) = certificates(&dir)?;
    let tls = format!("[server.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n");
    let mut out = Vec::new();
    let mut add = |name: &str, extra: &str, client: Client| -> anyhow::Result<()> {
        let mut t = targets::warmpath(&[up], &[], "round_robin", threads, extra)?;
        t.name = format!("warmpath {name}");
        t.client = client;
        out.push(t);
        Ok(())
    };
    let fresh = |tls: Option<Arc<rustls::ClientConfig>>| Client { tls, auth: None, fresh: true };
    add("https", &tls, Client { tls: Some(tls_client(&roots, true)), ..Client::default() })?;
    add("http, new connection per request", "", fresh(None))?;
    add("https, new connection, full handshake", &tls, fresh(Some(tls_client(&roots, false))))?;
    add("https, new connection, resumed session", &tls, fresh(Some(tls_client(&roots, true))))?;
    // API keys and limits: one key, limits far above what the run sends.
    let keys = dir.join("keys.toml");
    let _ = std::fs::remove_file(&keys);
    let bench_key = warmpath::auth::keys::add(&keys, "bench", None).map_err(anyhow::Error::msg)?;
    let auth = format!(
        "[auth]\nenabled = true\nkeys_file = {:?}\n[auth.limits]\nrequests_per_minute = 100000000\n\
         tokens_per_minute = 100000000000\nmax_concurrent = 100000\n",
        keys.display().to_string()
    );
    let keyed = Client { auth: Some(format!("Bearer {bench_key}")), ..Client::default() };
    add("API key + limits", &auth, keyed.clone())?;
    if let Some((mut redis, url)) = redis_server()? {
        let fleet = auth.replace(
            "[auth.limits]",
            &format!("limits_store = \"redis\"\n[redis]\nurl = {url:?}\n[auth.limits]"),
        );
        if let Err(e) = add("API key + limits in Redis", &fleet, keyed) {
            let _ = redis.kill();
            return Err(e);
        }
        if let Some(t) = out.last_mut() {
            t.beside.push(redis);
        }
    }
    Ok(out)
}

/// A `redis-server` on a free port, nothing persisted, and its URL; none where it is not
/// installed.
fn redis_server() -> anyhow::Result<Option<(std::process::Child, String)>> {
    let port = targets::free_addr()?.port();
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    let Ok(child) = child else { return Ok(None) };
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(Some((child, format!("redis://127.0.0.1:{port}"))));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    anyhow::bail!("redis-server did not listen on {port}")
}
