//! What tests send and run: policy files, chat requests, the weather agent's script and tool.

use std::path::Path;

/// Health checks every 200 ms, for tests that watch backends come and go.
pub const FAST_HEALTH: &str = "[health]\ninterval_ms = 200\ntimeout_ms = 500\n";

/// A policy file: `global` TOML (tables other than pools) and one pool `main` serving `models`
/// over `backends` (name, url), with `pool_extra` keys (policy, limits, sub-tables) in it.
pub fn policy(global: &str, pool_extra: &str, models: &[&str], backends: &[(&str, String)]) -> String {
    let models: Vec<String> = models.iter().map(|m| format!("{m:?}")).collect();
    let mut s =
        format!("{global}\n[[pools]]\nname = \"main\"\nmodels = [{}]\n{pool_extra}\n", models.join(", "));
    for (name, url) in backends {
        s.push_str(&format!("\n[[pools.backends]]\nname = {name:?}\nurl = {url:?}\n"));
    }
    s
}

/// Runs a fuzz target's check over every file of its corpus (`proxy/fuzz/corpus/NAME`), so
/// the corpus is a regression suite without cargo-fuzz; fails naming the first file that
/// panics, or a corpus of fewer than 10 files.
pub fn run_fuzz_corpus(name: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy/fuzz/corpus").join(name);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("the fuzz corpus is in the repository") {
        let path = entry.expect("entry").path();
        let data = std::fs::read(&path).expect("readable");
        let r = std::panic::catch_unwind(|| check(&data));
        assert!(r.is_ok(), "{} fails the fuzz check", path.display());
        n += 1;
    }
    assert!(n >= 10, "only {n} files in the {name} corpus");
}

pub fn chat(model: &str, text: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

/// An engine script for a weather agent (`--script`), written into `dir`: any turn calls
/// `get_weather` for Oslo; once the tool's result (`sunny in Oslo`) is in the prompt, the model
/// answers.
pub fn weather_script(dir: &Path) -> String {
    let path = dir.join("script.json");
    let rules = serde_json::json!([
        {"when": "", "reply": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"},
        {"when": "sunny in Oslo", "reply": "It will be sunny."},
    ]);
    std::fs::write(&path, rules.to_string()).expect("script");
    path.display().to_string()
}

/// The weather agent's one tool, in the Responses form.
pub fn weather_tools() -> serde_json::Value {
    serde_json::json!([{"type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
}
