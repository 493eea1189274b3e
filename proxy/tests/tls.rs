//! TLS with certificates made at test time (rcgen): warmpath's listener over https (HTTP/1.1
//! and HTTP/2, curl and the official `openai` SDK, wss for Responses WebSocket mode), its
//! certificate replaced without a restart, mutual TLS; `https://` backends verified against a
//! CA bundle, with a client certificate, and an expired, unknown or wrong-host certificate
//! failing loudly rather than falling back to plain text.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use warmpath_tests::*;

fn tls_policy(cert: &CertFiles, extra: &str) -> String {
    format!(
        "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\n{extra}\n",
        cert.cert.display().to_string(),
        cert.key.display().to_string()
    )
}

/// curl against `https://localhost:PORT{path}` trusting `ca`: (exit code, stdout).
fn curl(port: u16, ca: &Path, args: &[&str], path: &str) -> (i32, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "--cacert"])
        .arg(ca)
        .args(["--resolve", &format!("localhost:{port}:127.0.0.1")])
        .args(args)
        .arg(format!("https://localhost:{port}{path}"))
        .output()
        .expect("curl runs");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn chat_args(body: &serde_json::Value) -> Vec<String> {
    vec!["-H".into(), "content-type: application/json".into(), "-d".into(), body.to_string()]
}

#[test]
fn https_and_http2_and_wss_serve_real_clients() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "ca");
    let cert = ca.issue("server", &["localhost", "127.0.0.1"], false);
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(&tls_policy(&cert, ""), "", &["m"], &[("e", e.url())]));
    let port = proxy.addr.port();
    // curl over HTTP/2 (ALPN h2), a stream: every event arrives, and the protocol is 2.
    let mut body = chat("m", "hi", 5);
    body["stream"] = serde_json::json!(true);
    let mut args = chat_args(&body);
    args.extend(["--http2".into(), "-N".into(), "-w".into(), "\n%{http_version}".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out) = curl(port, &ca.ca_file(), &args, "/v1/chat/completions");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("data: [DONE]") && out.trim_end().ends_with("\n2"), "{out}");
    // And HTTP/1.1 over TLS.
    let (code, out) = curl(port, &ca.ca_file(), &["--http1.1", "-w", "\n%{http_version}"], "/v1/models");
    assert!(code == 0 && out.contains("\"m\"") && out.trim_end().ends_with("1.1"), "{out}");
    // Plain HTTP to the TLS port is not served.
    let mut s = std::net::TcpStream::connect(proxy.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").expect("send");
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(!got.starts_with(b"HTTP/"), "answered in plain text: {got:?}");
    // The openai SDK: https (whole and streamed) and wss, trusting only the test CA.
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(venv.exists(), "{} missing: run scripts/ensure-deps", venv.display());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_tls.py");
    let out = Command::new(venv)
        .arg(script)
        .args([&format!("https://localhost:{port}/v1"), "m"])
        .arg(ca.ca_file())
        .env("no_proxy", "*")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "client failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("{stdout}"));
    assert_eq!(v["chat_tokens"], 4, "{v}");
    assert!(v["stream_chunks"].as_u64().unwrap_or(0) >= 3, "role, text, finish: {v}");
    // Four tokens asked for (a delta for each that decodes to text): incomplete for
    // max_output_tokens, over wss.
    assert_eq!(v["wss_last"], "response.incomplete", "{v}");
    assert!((1..=4).contains(&v["wss_deltas"].as_u64().unwrap_or(0)), "{v}");
    assert_eq!(v["untrusted"], "APIConnectionError", "{v}");
}

#[test]
fn a_new_certificate_is_served_without_a_restart_and_open_streams_go_on() {
    let dir = TempDir::new();
    let (one, two) = (TestCa::new(dir.path(), "one"), TestCa::new(dir.path(), "two"));
    let live = CertFiles { cert: dir.path().join("live.pem"), key: dir.path().join("live-key.pem") };
    let install = |c: &CertFiles| {
        std::fs::copy(&c.cert, &live.cert).expect("copy");
        std::fs::copy(&c.key, &live.key).expect("copy");
    };
    let (a, b) = (one.issue("a", &["localhost"], false), two.issue("b", &["localhost"], false));
    install(&a);
    // Only SIGHUP re-reads here: the files are checked once a minute.
    let e = Engine::sim("m", &["--sim-itl-ms", "50", "--sim-jitter", "0"]);
    let proxy = Proxy::start(&policy(
        &tls_policy(&live, "reload_interval_ms = 60000"),
        "",
        &["m"],
        &[("e", e.url())],
    ));
    let port = proxy.addr.port();
    assert_eq!(curl(port, &one.ca_file(), &[], "/v1/models").0, 0);
    // A 2 s stream, open while the certificate changes under it.
    let mut body = chat("m", "hi", 40);
    body["stream"] = serde_json::json!(true);
    let stream = Command::new("curl")
        .args(["-sS", "-N", "--max-time", "20", "--cacert"])
        .arg(one.ca_file())
        .args(["--resolve", &format!("localhost:{port}:127.0.0.1"), "-H", "content-type: application/json"])
        .args(["-d", &body.to_string(), &format!("https://localhost:{port}/v1/chat/completions")])
        .stdout(Stdio::piped())
        .spawn()
        .expect("curl");
    std::thread::sleep(Duration::from_millis(300));
    install(&b);
    let hup = Command::new("kill").args(["-HUP", &proxy.child.id().to_string()]).status().expect("kill");
    assert!(hup.success());
    assert!(
        eventually(Duration::from_secs(5), || curl(port, &two.ca_file(), &[], "/v1/models").0 == 0),
        "the new certificate is served: {}",
        proxy.log.text()
    );
    assert_ne!(curl(port, &one.ca_file(), &[], "/v1/models").0, 0, "the old one is not");
    let out = stream.wait_with_output().expect("curl ends");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("data: [DONE]"), "the open stream finished: {text}");
    // A key that is not the certificate's: refused, and the current certificate stays.
    std::fs::copy(&a.key, &live.key).expect("copy");
    let _ = Command::new("kill").args(["-HUP", &proxy.child.id().to_string()]).status();
    assert!(eventually(Duration::from_secs(5), || proxy.log.text().contains("TLS certificate not re-read")));
    assert_eq!(curl(port, &two.ca_file(), &[], "/v1/models").0, 0);
}

#[test]
fn mutual_tls_lets_in_only_clients_with_a_certificate() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "ca");
    let server = ca.issue("server", &["localhost"], false);
    let client = ca.issue("client", &["warmpath-client"], false);
    let e = Engine::sim("m", &[]);
    let extra = format!("client_ca_file = {:?}", ca.ca_file().display().to_string());
    let proxy = Proxy::start(&policy(&tls_policy(&server, &extra), "", &["m"], &[("e", e.url())]));
    let port = proxy.addr.port();
    assert_ne!(curl(port, &ca.ca_file(), &[], "/v1/models").0, 0, "no client certificate: no handshake");
    let (cert, key) = (client.cert.display().to_string(), client.key.display().to_string());
    let (code, out) = curl(port, &ca.ca_file(), &["--cert", &cert, "--key", &key], "/v1/models");
    assert_eq!(code, 0, "{out}");
}

/// A warmpath serving `https://localhost:PORT` with `cert` in front of an engine: a real TLS
/// backend for another warmpath.
fn tls_backend(cert: &CertFiles, extra: &str, engine: &Engine) -> Proxy {
    Proxy::start(&policy(&tls_policy(cert, extra), "", &["m"], &[("e", engine.url())]))
}

#[test]
fn https_backends_are_verified_and_a_bad_certificate_fails_the_probe() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "ca");
    let e = Engine::sim("m", &[]);
    let client = ca.issue("client", &["warmpath"], false);
    let client_ca = format!("client_ca_file = {:?}", ca.ca_file().display().to_string());
    // The backend asks for a client certificate too (mutual TLS).
    let good = tls_backend(&ca.issue("good", &["localhost"], false), &client_ca, &e);
    let expired = tls_backend(&ca.issue("expired", &["localhost"], true), "", &e);
    let wrong_host = tls_backend(&ca.issue("wrong", &["wrong.example"], false), "", &e);
    let upstream = |with_client: bool| {
        let mut s = format!("[upstream]\nca_file = {:?}\n", ca.ca_file().display().to_string());
        if with_client {
            s.push_str(&format!(
                "client_cert_file = {:?}\nclient_key_file = {:?}\n",
                client.cert.display().to_string(),
                client.key.display().to_string()
            ));
        }
        s.push_str("[health]\ninterval_ms = 200\n");
        s
    };
    let url = |p: &Proxy| format!("https://localhost:{}", p.addr.port());
    // Verified against the CA, with a client certificate: served.
    let front = Proxy::start(&policy(&upstream(true), "", &["m"], &[("good", url(&good))]));
    let r = post_json(front.addr, "/v1/chat/completions", &chat("m", "hi", 3));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-warmpath-backend"), Some("good"));
    // Each bad case: the probe fails with the reason in the log, the pool is not ready, and a
    // request gets an error — never an answer over plain text.
    for (name, backend, with_client, reason) in [
        ("expired", &expired, true, "xpired"),
        ("wrong_host", &wrong_host, true, "not valid for name"),
        ("no_client_cert", &good, false, "CertificateRequired"),
    ] {
        let front =
            Proxy::start_with(&policy(&upstream(with_client), "", &["m"], &[(name, url(backend))]), false);
        let log = || front.log.text();
        assert!(
            eventually(Duration::from_secs(10), || log().contains("health check failed")),
            "{name}: {}",
            log()
        );
        let line = log().lines().find(|l| l.contains("health check failed")).unwrap_or_default().to_owned();
        assert!(line.contains(reason), "{name}: the reason is logged: {line}");
        assert_eq!(get(front.admin, "/readyz").status, 503, "{name}");
        let r = post_json(front.addr, "/v1/chat/completions", &chat("m", "hi", 3));
        assert!(r.status >= 500, "{name}: {} {}", r.status, r.text());
    }
    // The system's roots do not know the test CA.
    let front = Proxy::start_with(
        &policy("[health]\ninterval_ms = 200\n", "", &["m"], &[("good", url(&good))]),
        false,
    );
    assert!(eventually(Duration::from_secs(10), || front.log.text().contains("health check failed")));
}

#[test]
fn a_certificate_that_does_not_load_fails_at_its_key() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "ca");
    let (a, b) = (ca.issue("a", &["localhost"], false), ca.issue("b", &["localhost"], false));
    let mixed = CertFiles { cert: a.cert.clone(), key: b.key.clone() };
    let file = dir.path().join("p.toml");
    let pool = "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[[pools.backends]]\nname = \"b\"\nurl = \"http://127.0.0.1:1\"\n";
    std::fs::write(&file, format!("{}\n{pool}", tls_policy(&mixed, ""))).expect("write");
    let out =
        Command::new(env!("CARGO_BIN_EXE_warmpath")).arg("check-config").arg(&file).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("p.toml:2:")
            && err.contains("is not the key of the certificate"),
        "{err}"
    );
}

#[test]
fn certificate_paths_may_come_from_the_environment() {
    let dir = TempDir::new();
    let ca = TestCa::new(dir.path(), "ca");
    let cert = ca.issue("server", &["localhost"], false);
    // Variables only this test sets; the proxy inherits them.
    std::env::set_var("WARMPATH_TEST_TLS_CERT", &cert.cert);
    std::env::set_var("WARMPATH_TEST_TLS_KEY", &cert.key);
    let tls =
        "[server.tls]\ncert_file = \"$WARMPATH_TEST_TLS_CERT\"\nkey_file = \"$WARMPATH_TEST_TLS_KEY\"\n";
    let e = Engine::sim("m", &[]);
    let proxy = Proxy::start(&policy(tls, "", &["m"], &[("e", e.url())]));
    assert_eq!(curl(proxy.addr.port(), &ca.ca_file(), &[], "/v1/models").0, 0);
    // A variable that is not set: an error at its key.
    let file = dir.path().join("p.toml");
    let unset = tls.replace("WARMPATH_TEST_TLS_KEY", "WARMPATH_TEST_TLS_UNSET");
    std::fs::write(&file, policy(&unset, "", &["m"], &[("e", e.url())])).expect("write");
    let out =
        Command::new(env!("CARGO_BIN_EXE_warmpath")).arg("check-config").arg(&file).output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("p.toml:3:") && err.contains("WARMPATH_TEST_TLS_UNSET"),
        "{err}"
    );
}
