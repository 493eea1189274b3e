//! `engine --agreement`: how closely the bundled engine's greedy tokens follow llama.cpp's on the
//! same GGUF file, and how closely llama.cpp follows itself.
//!
//! Eight chat prompts, rendered and tokenized by warmpath (the same ids go to both engines). For
//! each, greedy continuations of N tokens (end of text ignored) from llama-server with flash
//! attention on and off, and from warmpath's executor (in process, the same kernels the server
//! runs); the report counts how many leading tokens each pair shares. Greedy decoding amplifies
//! the last bits of float arithmetic: at a near-tie one rounding difference picks the other
//! token and the texts part for good, so the figure that says whether two engines compute the
//! same model is the teacher-forced one: warmpath's top-1 at every position of llama.cpp's
//! (flash attention on) continuation, and, where they differ, how far apart llama.cpp itself
//! put the two tokens.
//!
//! With `--write-fixture` the llama.cpp continuations and their top-5 log-probabilities are
//! written to `engine/tests/data/smollm2-llama-cpp-greedy.json`, which the engine's tests check
//! the teacher-forced agreement against without needing llama.cpp built.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;

use bytes::Bytes;
use serde_json::{json, Value};
use warmpath_engine::executor::llama::LlamaExecutor;
use warmpath_engine::model::GgufModel;
use warmpath_wire::openai::{ChatMessage, Role};

use crate::targets;

/// The prompts: (system, user).
const PROMPTS: [(Option<&str>, &str); 8] = [
    (None, "What is the capital of France?"),
    (Some("You are a helpful assistant."), "Write a haiku about the sea."),
    (None, "List three prime numbers and explain why they are prime."),
    (None, "Translate 'good morning' into Spanish."),
    (None, "Write a Python function that returns the n-th Fibonacci number."),
    (None, "Tell me a story about a robot who learns to paint."),
    (Some("You are a helpful assistant."), "Explain how a bicycle works."),
    (Some("You are a concise assistant."), "What are the benefits of drinking water?"),
];

/// The fixture's path.
pub fn fixture_path() -> std::path::PathBuf {
    targets::root().join("engine/tests/data/smollm2-llama-cpp-greedy.json")
}

/// One prompt's greedy continuation from llama-server: tokens and, per position, the top
/// (id, logprob) pairs.
struct Continuation {
    tokens: Vec<u32>,
    top: Vec<Vec<(u32, f64)>>,
}

/// A JSON request's JSON answer; anything but 2xx is an error.
async fn post(addr: SocketAddr, path: &str, body: &Value) -> anyhow::Result<Value> {
    let (status, text) = crate::fleet::post_json(addr, path, body).await?;
    anyhow::ensure!((200..300).contains(&status), "{path}: {status}: {text}");
    Ok(serde_json::from_str(&text)?)
}

async fn llama_greedy(addr: SocketAddr, prompt: &[u32], n: usize) -> anyhow::Result<Continuation> {
    let body = json!({
        "prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": true,
        "cache_prompt": false, "n_probs": 5, "samplers": ["top_k"], "top_k": 1,
    });
    let v = post(addr, "/completion", &body).await?;
    let probs =
        v["completion_probabilities"].as_array().ok_or_else(|| anyhow::anyhow!("no probabilities: {v}"))?;
    let mut c = Continuation { tokens: Vec::new(), top: Vec::new() };
    for p in probs {
        c.tokens.push(p["id"].as_u64().unwrap_or(u64::MAX) as u32);
        let top = p["top_logprobs"].as_array().into_iter().flatten();
        c.top.push(
            top.map(|t| {
                (t["id"].as_u64().unwrap_or(u64::MAX) as u32, t["logprob"].as_f64().unwrap_or(f64::NAN))
            })
            .collect(),
        );
    }
    anyhow::ensure!(c.tokens.len() == n, "llama-server returned {} of {n} tokens", c.tokens.len());
    Ok(c)
}

/// llama-server's greedy pick after every token of `prompt ++ forced[..n-1]`, one request per
/// position (its prompt cache keeps each step incremental).
async fn llama_teacher_forced(addr: SocketAddr, prompt: &[u32], forced: &[u32]) -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::with_capacity(forced.len());
    let mut seq = prompt.to_vec();
    for &f in forced {
        let body = json!({
            "prompt": seq, "n_predict": 1, "temperature": 0, "cache_prompt": true,
            "samplers": ["top_k"], "top_k": 1, "n_probs": 1,
        });
        let v = post(addr, "/completion", &body).await?;
        let id = v["completion_probabilities"][0]["id"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("no token: {v}"))?;
        out.push(id as u32);
        seq.push(f);
    }
    Ok(out)
}

fn shared(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The prompts as token ids, rendered by the model's own template.
pub fn prompts(model: &GgufModel) -> anyhow::Result<Vec<Vec<u32>>> {
    PROMPTS
        .iter()
        .map(|(system, user)| {
            let mut msgs = Vec::new();
            if let Some(s) = system {
                msgs.push(ChatMessage::text(Role::System, *s));
            }
            msgs.push(ChatMessage::text(Role::User, *user));
            model.format.render_tokens(&msgs, &[], true).map_err(anyhow::Error::msg)
        })
        .collect()
}

pub async fn run(file: &Path, threads: usize, n: usize, write_fixture: bool) -> anyhow::Result<()> {
    let bin = crate::engine_vs::llama_cpp_bin()?;
    let model = GgufModel::load(file)?;
    let prompts = prompts(&model)?;
    let start = |fa: &str| {
        let extra = ["-np", "1", "-c", "4096", "-fa", fa];
        crate::engine_vs::llama_server(&format!("llama-server -fa {fa}"), &bin, file, threads, &extra)
    };
    let (on, off) = (start("on")?, start("off")?);
    let ready = Bytes::from(json!({"prompt": "hi", "max_tokens": 1}).to_string());
    for t in [&on, &off] {
        crate::engine_vs::wait_completion(t.addr, &ready).await?;
    }
    let mut with_fa = Vec::new();
    let mut without_fa = Vec::new();
    let mut off_forced = Vec::new();
    for p in &prompts {
        let a = llama_greedy(on.addr, p, n).await?;
        without_fa.push(llama_greedy(off.addr, p, n).await?);
        off_forced.push(llama_teacher_forced(off.addr, p, &a.tokens).await?);
        with_fa.push(a);
    }
    drop((on, off));
    let mut ex = LlamaExecutor::with_threads(model.weights.clone(), 64, 16, threads);

    let cmdline: Vec<String> = std::env::args().collect();
    let mut md = String::new();
    let _ = writeln!(md, "# warmpath-engine and llama.cpp: greedy agreement — {}\n", crate::report::date());
    let _ = writeln!(md, "Command: `{}` (llama.cpp from `scripts/llama-cpp`)\n", cmdline.join(" "));
    let _ = writeln!(
        md,
        "`{}`; {} chat prompts rendered and tokenized by warmpath, the same ids to every engine; greedy, {n} tokens, \
         end of text ignored. llama-server `-fa on` / `-fa off`, {threads} threads; warmpath's executor in \
         process (the server's kernels).\n",
        file.display(),
        prompts.len()
    );
    let _ = writeln!(
        md,
        "| prompt | tokens | warmpath = llama.cpp (fa on) | warmpath = llama.cpp (fa off) | llama.cpp fa on = fa off | \
         teacher-forced top-1 agreement with fa on: warmpath | llama.cpp fa off | llama.cpp's margin where warmpath \
         differs (nats) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    );
    let (mut agree, mut total, mut full, mut off_agree) = (0, 0, [0usize; 3], 0);
    let mut cases = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        let (a, b) = (&with_fa[k], &without_fa[k]);
        let ours = ex.greedy(p, n);
        let forced = ex.teacher_forced(p, &a.tokens);
        let mut margins = Vec::new();
        for (i, (&mine, &theirs)) in forced.iter().zip(&a.tokens).enumerate() {
            total += 1;
            if mine == theirs {
                agree += 1;
                continue;
            }
            let best = a.top[i].first().map_or(f64::NAN, |t| t.1);
            margins.push(match a.top[i].iter().find(|t| t.0 == mine) {
                Some(t) => format!("{:.3}", best - t.1),
                None => "> top 5".to_owned(),
            });
        }
        let off_same = off_forced[k].iter().zip(&a.tokens).filter(|(x, y)| x == y).count();
        off_agree += off_same;
        let s = [shared(&ours, &a.tokens), shared(&ours, &b.tokens), shared(&a.tokens, &b.tokens)];
        for (f, s) in full.iter_mut().zip(s) {
            *f += usize::from(s >= 32);
        }
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {}/{n} | {off_same}/{n} | {} |",
            k + 1,
            p.len(),
            s[0],
            s[1],
            s[2],
            n - margins.len(),
            if margins.is_empty() { "—".to_owned() } else { margins.join(", ") }
        );
        cases.push(json!({
            "prompt": p,
            "tokens": a.tokens,
            "top": a.top.iter().map(|t| t.iter().map(|(id, lp)| json!([id, lp])).collect::<Vec<_>>()).collect::<Vec<_>>(),
        }));
    }
    let m = prompts.len();
    let _ = writeln!(
        md,
        "\nPrompts whose first 32 greedy tokens are identical: warmpath vs llama.cpp fa on {}/{m}, vs fa off {}/{m}; \
         llama.cpp fa on vs fa off {}/{m}. Teacher-forced top-1 agreement with llama.cpp fa on: warmpath \
         {agree}/{total} ({:.1} %), llama.cpp fa off {off_agree}/{total} ({:.1} %).",
        full[0],
        full[1],
        full[2],
        100.0 * agree as f64 / total as f64,
        100.0 * off_agree as f64 / total as f64
    );
    crate::report::publish(&md, "engine-agreement-llama-cpp", None, false)?;
    if write_fixture {
        let doc = json!({
            "about": "llama.cpp 11434 llama-server -fa on, greedy continuations (ignore_eos) of warmpath-bench \
                      engine --agreement's prompts, with the top-5 (id, logprob) at each position",
            "model": file.file_name().map(|f| f.to_string_lossy().into_owned()),
            "cases": cases,
        });
        std::fs::write(fixture_path(), serde_json::to_string(&doc)? + "\n")?;
        eprintln!("written: {}", fixture_path().display());
    }
    Ok(())
}
