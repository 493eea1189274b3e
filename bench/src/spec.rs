//! `spec`: speculative decoding (n-gram prompt lookup) on a real model, in this process. Each
//! chat prompt of four workloads — JSON echoed back, tool-call arguments quoting the prompt,
//! code edits, free text — is generated greedily with proposals off and on, in alternating
//! order; per workload: the decode speed of each (output tokens after the first over the time
//! from first to last token, one request at a time), their ratio, the share of proposed tokens
//! kept and the tokens per verification, from the engine's own `vllm:spec_decode_*` counters.
//! Greedy outputs must be the same token for token; any that differ are counted. Every run
//! starts from an empty prefix cache, so that both compute their prompts alike.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use warmpath_engine::scheduler::SamplingParams;
use warmpath_wire::openai::{ChatMessage, Role};

use crate::engine::{generate, in_process};
use crate::stats::median;

#[derive(clap::Args)]
pub struct Args {
    /// Model (a GGUF model: its chat template renders the prompts).
    #[arg(long, default_value = "smollm2-135m-instruct")]
    model: String,
    /// Most tokens proposed per step.
    #[arg(long, default_value_t = 4)]
    k: usize,
    /// Longest suffix looked up.
    #[arg(long, default_value_t = 4)]
    lookup_max: usize,
    /// Shortest suffix looked up.
    #[arg(long, default_value_t = 2)]
    lookup_min: usize,
    /// Longest output per request.
    #[arg(long, default_value_t = 160)]
    max_tokens: usize,
    /// Rounds over every prompt (medians reported).
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Print, do not write bench/results/.
    #[arg(long)]
    quick: bool,
}

const SYSTEM: &str = "You are a helpful assistant.";

/// The workloads: a name and its user prompts.
fn workloads() -> Vec<(&'static str, Vec<String>)> {
    let code = "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n";
    let notes = "Meeting notes, 3 March: the billing migration moves to April; Dana owns the rollout plan; the staging cluster needs two more nodes before load tests; next review on Friday.";
    vec![
        (
            "JSON echoed back",
            vec![
                "Repeat this JSON exactly, nothing else:\n{\"name\": \"deploy-service\", \"arguments\": {\"service\": \"billing-api\", \"region\": \"eu-west-1\", \"replicas\": 3, \"image\": \"registry.example.com/billing-api:2.14.1\"}}".into(),
                "Return this JSON with \"theme\" set to \"light\", nothing else:\n{\"user\": {\"id\": 48213, \"email\": \"maria.lopez@example.org\", \"roles\": [\"admin\", \"billing\"]}, \"settings\": {\"theme\": \"dark\", \"language\": \"es-ES\", \"notifications\": {\"email\": true, \"sms\": false}}}".into(),
                "Copy this list as JSON, exactly:\n[{\"sku\": \"A-1001\", \"qty\": 2, \"price\": 19.99}, {\"sku\": \"B-2040\", \"qty\": 1, \"price\": 5.49}, {\"sku\": \"C-3300\", \"qty\": 12, \"price\": 0.99}]".into(),
            ],
        ),
        (
            "tool-call arguments quoting the prompt",
            vec![
                format!("Call the write_file tool to save these notes to notes/meeting.md. Reply with only the tool call as JSON: {{\"name\": \"write_file\", \"arguments\": {{\"path\": ..., \"content\": ...}}}}.\n\n{notes}"),
                "Call the send_email tool. Reply with only the JSON arguments {\"to\": ..., \"subject\": ..., \"body\": ...}. To: ops-team@example.com. Subject: Nightly backup failed on db-prod-2. Body: The nightly backup of db-prod-2 failed at 02:14 UTC with error code 28 (no space left on device). Please free space on /var/backups and rerun the job.".into(),
                "Call the create_ticket tool with the title and description below. Reply with only the JSON arguments.\nTitle: Login page times out for SSO users\nDescription: Since the 2.3 release, users who sign in with SSO wait about 30 seconds and then see a timeout on the login page. Password logins work. The identity provider logs show the callback arriving.".into(),
            ],
        ),
        (
            "code edits",
            vec![
                format!("Rename the variable `subtotal` to `net` in this Python function and return the whole function:\n```python\n{code}```"),
                format!("Add a docstring to this Python function and return the whole function:\n```python\n{code}```"),
                "Change the port from 8080 to 9090 in this config and return the whole file:\n```yaml\nserver:\n  host: 0.0.0.0\n  port: 8080\n  workers: 4\nlogging:\n  level: info\n  file: /var/log/app.log\ndatabase:\n  url: postgres://app@db:5432/app\n  pool_size: 10\n```".into(),
            ],
        ),
        (
            "free text",
            vec![
                "Write a short story about a lighthouse keeper who finds a message in a bottle.".into(),
                "Explain how rainbows form, for a ten-year-old.".into(),
                "Give me three tips for learning to cook at home.".into(),
            ],
        ),
    ]
}

/// The engine's speculative-decoding counters: (drafts, proposed, accepted).
fn counters(metrics: &warmpath_engine::metrics::Metrics) -> (f64, f64, f64) {
    let text = metrics.render();
    let get = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (
        get("vllm:spec_decode_num_drafts_total"),
        get("vllm:spec_decode_num_draft_tokens_total"),
        get("vllm:spec_decode_num_accepted_tokens_total"),
    )
}

#[derive(Default)]
struct Tally {
    /// Per round: (tokens after the first, decode seconds) off and on.
    off: Vec<(f64, f64)>,
    on: Vec<(f64, f64)>,
    drafts: f64,
    proposed: f64,
    accepted: f64,
    outputs: usize,
    differing: usize,
    tokens: usize,
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let mut spec = warmpath_engine::spec::SpecConfig::with_tokens(a.k.max(1));
    spec.prompt_lookup_max = a.lookup_max;
    spec.prompt_lookup_min = Some(a.lookup_min);
    spec.check()?;
    // The server's lookup settings; each request says how many tokens (0: none).
    let ip = in_process(&a.model, 512, 16, Some(spec))?;
    let Some(format) = ip.format.as_ref() else {
        anyhow::bail!("{} has no chat template: use a GGUF model", a.model)
    };
    let params = |k: usize| SamplingParams {
        max_tokens: a.max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
        stop_token_ids: format.stop_ids.clone(),
        forced: Vec::new(),
        speculative: Some(k),
        logprobs: None,
    };
    let mut tallies: BTreeMap<usize, (&str, Tally)> = BTreeMap::new();
    // Warm-up: weights and cache pages touched once.
    generate(&ip.engine, format.prompt_ids("Hello"), params(0)).await?;
    for round in 0..a.repeats {
        for (w, (name, prompts)) in workloads().into_iter().enumerate() {
            let t = &mut tallies.entry(w).or_insert_with(|| (name, Tally::default())).1;
            let (mut off, mut on) = ((0.0, 0.0), (0.0, 0.0));
            for (i, user) in prompts.iter().enumerate() {
                let messages =
                    [ChatMessage::text(Role::System, SYSTEM), ChatMessage::text(Role::User, user.as_str())];
                let ids = format.render_tokens(&messages, &[], true).map_err(anyhow::Error::msg)?;
                // Alternate which goes first, so that neither always meets a warmer machine.
                let order = if (round + i) % 2 == 0 { [0, a.k] } else { [a.k, 0] };
                let mut outs = Vec::new();
                for k in order {
                    // Each run computes its prompt in full: a prompt partly cached is computed in
                    // other chunks, whose float sums differ in the last bits, and a greedy output
                    // may then part at a near tie; that would hide what proposals change.
                    ip.engine.reset_prefix_cache();
                    let before = counters(&ip.metrics);
                    let g = generate(&ip.engine, ids.clone(), params(k)).await?;
                    let after = counters(&ip.metrics);
                    let n = g.tokens.len().saturating_sub(1) as f64;
                    let sum = if k == 0 { &mut off } else { &mut on };
                    sum.0 += n;
                    sum.1 += g.decode.as_secs_f64();
                    if std::env::var_os("SPEC_DEBUG").is_some() {
                        eprintln!(
                            "k={k} tokens {} drafts {} proposed {} accepted {} decode {:.0} ms",
                            g.tokens.len(),
                            after.0 - before.0,
                            after.1 - before.1,
                            after.2 - before.2,
                            g.decode.as_secs_f64() * 1e3
                        );
                    }
                    if k > 0 {
                        t.drafts += after.0 - before.0;
                        t.proposed += after.1 - before.1;
                        t.accepted += after.2 - before.2;
                    }
                    outs.push(g.tokens);
                }
                t.outputs += 1;
                t.tokens += outs[0].len();
                if outs[0] != outs[1] {
                    t.differing += 1;
                }
            }
            t.off.push(off);
            t.on.push(on);
            eprintln!("round {}: {name}", round + 1);
        }
    }
    let rate = |v: &[(f64, f64)]| median(v.iter().map(|(n, s)| n / s).collect());
    let mut md = String::new();
    let _ = writeln!(md, "# Speculative decoding (n-gram prompt lookup) — {}\n", crate::report::date());
    let cmdline: Vec<String> = std::env::args().collect();
    let _ = writeln!(md, "Command: `{}` (release build)\n", cmdline.join(" "));
    let _ = writeln!(
        md,
        "Model `{}`, greedy, up to {} tokens per answer, one request at a time, proposals of up to {} tokens \
         (lookup of the last {}–{} tokens), {} round(s) alternating off/on per prompt; decode speed = tokens after \
         the first / time from first to last token, median of rounds; acceptance from the engine's \
         `vllm:spec_decode_*` counters.\n",
        a.model, a.max_tokens, a.k, a.lookup_min, a.lookup_max, a.repeats
    );
    let _ = writeln!(
        md,
        "| workload | tokens/answer | decode off (tok/s) | decode on (tok/s) | speed-up | proposed kept | tokens per verification | outputs differing |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (name, t) in tallies.values() {
        let (off, on) = (rate(&t.off), rate(&t.on));
        let kept =
            if t.proposed > 0.0 { format!("{:.0} %", 100.0 * t.accepted / t.proposed) } else { "—".into() };
        let per = if t.drafts > 0.0 { format!("{:.2}", 1.0 + t.accepted / t.drafts) } else { "—".into() };
        let _ = writeln!(
            md,
            "| {name} | {:.0} | {off:.1} | {on:.1} | {:.2}× | {kept} | {per} | {} of {} |",
            t.tokens as f64 / t.outputs.max(1) as f64,
            on / off,
            t.differing,
            t.outputs
        );
    }
    crate::report::publish(&md, "speculative-decoding", None, a.quick)?;
    Ok(())
}
