//! examples/, checked by what this machine has: the YAML parses and points at files that exist
//! (`check_examples.py`), every policy the examples embed passes `warmpath check-config`, the
//! Prometheus configuration passes `promtool check config`, the systemd unit passes
//! `systemd-analyze verify` without a warning, and the client examples run against a warmpath
//! in front of a scripted engine.

use std::process::Command;

use serde_json::Value;
use warmpath_tests::*;
use warmpath_tests::{output_of as run, repo_root as repo};

#[test]
fn the_deployment_examples_parse_and_their_policies_pass_check_config() {
    let dir = TempDir::new();
    let (ok, out) = run(Command::new(repo().join(".venv/bin/python"))
        .arg(repo().join("tests/tests/check_examples.py"))
        .arg(repo())
        .arg(dir.path()));
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("{out}"));
    assert_eq!(v["errors"], serde_json::json!([]), "{v:#}");
    let policies: Vec<&str> =
        v["policies"].as_array().expect("policies").iter().filter_map(Value::as_str).collect();
    // The compose file's, and one per Kubernetes example.
    assert_eq!(policies.len(), 3, "{v:#}");
    for p in policies {
        let (ok, out) = run(Command::new(bin("warmpath", "warmpath")).args(["check-config", p]));
        assert!(ok, "{p}: {out}");
    }
    // Prometheus' configuration, with its rule file where this repository keeps it.
    for p in v["prometheus"].as_array().expect("prometheus").iter().filter_map(Value::as_str) {
        let rules = repo().join("grafana/alerts/warmpath.rules.yml");
        let text = std::fs::read_to_string(p)
            .expect("read")
            .replace("/etc/prometheus/rules/warmpath.rules.yml", &rules.display().to_string());
        let copy = dir.path().join("prometheus.yml");
        std::fs::write(&copy, text).expect("write");
        let (ok, out) = run(Command::new("promtool").args(["check", "config"]).arg(&copy));
        assert!(ok, "{p}: {out}");
    }
}

#[test]
fn the_systemd_unit_verifies_cleanly() {
    // Verified as installed: the binary where the unit names it is this build's.
    let unit = std::fs::read_to_string(repo().join("examples/systemd/warmpath.service")).expect("unit");
    let dir = TempDir::new();
    let path = dir.path().join("warmpath.service");
    let warmpath = bin("warmpath", "warmpath");
    std::fs::write(&path, unit.replace("/usr/local/bin/warmpath", &warmpath.display().to_string()))
        .expect("write");
    let (ok, out) = run(Command::new("systemd-analyze").arg("verify").arg(&path));
    assert!(ok && out.trim().is_empty(), "systemd-analyze verify: {out}");
}

/// Both client examples against the quick start itself (`policies/default.toml`: two embedded
/// SmolLM2 replicas), as a user runs them.
#[test]
fn the_client_examples_run_against_the_quick_start() {
    let policy = std::fs::read_to_string(repo().join("policies/default.toml")).expect("the quick start");
    let proxy = Proxy::start(&policy);
    let (base, admin) = (format!("http://{}", proxy.addr), format!("http://{}", proxy.admin));
    let (ok, out) = run(Command::new(repo().join("examples/clients/curl.sh")).args([&base, &admin]));
    assert!(ok, "curl.sh:\n{out}");
    assert!(out.contains("Paris"), "the quick start's answer: {out}");
    let (ok, out) = run(Command::new(repo().join(".venv/bin/python"))
        .arg(repo().join("examples/clients/agent_loop.py"))
        .arg(format!("{base}/v1")));
    assert!(ok, "agent_loop.py:\n{out}");
    assert!(out.contains(" turns; last turn: "), "{out}");
}

#[test]
fn the_client_examples_run_against_warmpath() {
    let dir = TempDir::new();
    let e = Engine::sim("m", &["--script", &weather_script(dir.path())]);
    let proxy = Proxy::start(&policy("", "", &["m"], &[("e", e.url())]));
    let base = format!("http://{}", proxy.addr);
    let admin = format!("http://{}", proxy.admin);

    let (ok, out) = run(Command::new(repo().join("examples/clients/curl.sh")).args([&base, &admin, "m"]));
    assert!(ok, "curl.sh:\n{out}");
    for want in [
        "x-warmpath-route",
        "data: [DONE]",
        "\"previous_response_id\"",
        "x-request-id: my-trace-123",
        "ready",
        "('e', 'up')",
    ] {
        assert!(
            out.to_ascii_lowercase().contains(&want.to_ascii_lowercase()),
            "curl.sh printed no {want:?}:\n{out}"
        );
    }

    let python = repo().join(".venv/bin/python");
    let (ok, out) = run(Command::new(&python).arg(repo().join("examples/clients/agent_loop.py")).args([
        &format!("{base}/v1"),
        "m",
        "What will the weather be in Oslo?",
    ]));
    assert!(ok, "agent_loop.py:\n{out}");
    assert!(out.contains("get_weather") && out.contains("sunny in Oslo"), "the tool ran: {out}");
    assert!(
        out.contains("It will be sunny.") && out.contains("[2 turns;"),
        "the answer after the tool: {out}"
    );
}
