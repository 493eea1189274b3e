//! Properties of canonicalization: idempotent; blind to tool order, JSON key order, whitespace
//! and matched stamp lines; message content outside the rules unchanged; and the blocks the
//! proxy computes are the blocks the bundled engine computes for the body it is sent.

use proptest::prelude::*;
use serde_json::{json, Value};
use warmpath_wire::chat_template::render_tokens;
use warmpath_wire::openai::ChatCompletionRequest;
use warmpath_wire::prefix::block_hashes;

use super::*;
use crate::config::CanonConfig;

fn canon(rewrite: bool) -> Canon {
    let cfg = CanonConfig { enabled: rewrite, tokenizer: TokenizerKind::Wp32k, ..CanonConfig::default() };
    Canon::new(&cfg, &ToolsConfig::default(), false, None)
}

fn prepare(c: &Canon, body: &[u8]) -> Prepared {
    let req = LlmRequest::parse(LlmRoute::Chat, body).expect("valid request");
    c.prepare(&req, true).expect("prepares")
}

/// JSON text of `v` with object keys in an order drawn from `seed` and spaces sprinkled in:
/// the ways clients that serialize from hash maps differ.
fn scrambled(v: &Value, seed: &mut u64) -> String {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    };
    fn go(v: &Value, next: &mut dyn FnMut() -> u64, out: &mut String) {
        let ws = |next: &mut dyn FnMut() -> u64, out: &mut String| {
            if next() % 3 == 0 {
                out.push_str(if next() % 2 == 0 { " " } else { "\n  " });
            }
        };
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                for i in (1..keys.len()).rev() {
                    keys.swap(i, (next() % (i as u64 + 1)) as usize);
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(next, out);
                    out.push_str(&Value::String((*k).clone()).to_string());
                    out.push(':');
                    ws(next, out);
                    go(&m[*k], next, out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    ws(next, out);
                    go(x, next, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    go(v, &mut next, &mut out);
    out
}

#[derive(Debug, Clone)]
struct Case {
    system: Vec<String>,
    stamp_at: usize,
    tools: Vec<(String, Vec<String>)>,
    turns: Vec<(String, String)>,
}

fn word() -> impl Strategy<Value = String> {
    "[a-z]{1,8}( [a-z]{1,8}){0,6}"
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(word(), 1..6),
        0usize..6,
        prop::collection::btree_map("[a-z]{2,10}", prop::collection::vec("[a-z]{1,6}", 0..4), 0..12),
        prop::collection::vec(("(user|assistant|tool)", "[a-zA-Z0-9 .,:\n]{0,80}"), 1..8),
    )
        .prop_map(|(system, stamp_at, tools, turns)| Case {
            stamp_at: stamp_at % (system.len() + 1),
            system,
            tools: tools.into_iter().collect(),
            turns,
        })
}

impl Case {
    /// The request as a client would build it: `order` permutes the tools, `stamp` is the
    /// timestamp line's value.
    fn value(&self, order: &[usize], stamp: &str) -> Value {
        let mut sys = self.system.clone();
        sys.insert(self.stamp_at, format!("Current time: {stamp}"));
        let tools: Vec<Value> = order
            .iter()
            .map(|&i| {
                let (name, params) = &self.tools[i];
                let props: serde_json::Map<String, Value> =
                    params.iter().map(|p| (p.clone(), json!({"type": "string", "description": p}))).collect();
                json!({"type": "function", "function": {"name": name, "description": format!("does {name}"),
                    "parameters": {"type": "object", "properties": props, "required": params}}})
            })
            .collect();
        let mut messages = vec![json!({"role": "system", "content": sys.join("\n")})];
        for (k, (role, text)) in self.turns.iter().enumerate() {
            messages.push(match role.as_str() {
                "tool" => json!({"role": "tool", "tool_call_id": format!("call_{k}"), "content": text}),
                "assistant" if k % 2 == 0 => json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": format!("call_{k}"), "type": "function",
                     "function": {"name": "f", "arguments": json!({"q": text, "n": k}).to_string()}}]}),
                r => json!({"role": r, "content": text}),
            });
        }
        let mut v = json!({"model": "m", "messages": messages, "temperature": 0.5});
        if !tools.is_empty() {
            v["tools"] = Value::Array(tools);
        }
        v
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn canonical_form_is_stable_idempotent_and_what_the_engine_renders(
        c in case(),
        seed in any::<u64>(),
        minute in 0u32..60,
    ) {
        let canon = canon(true);
        let n = c.tools.len();
        let forward: Vec<usize> = (0..n).collect();
        let mut shuffled = forward.clone();
        let mut s = seed | 1;
        for i in (1..n).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            shuffled.swap(i, (s >> 33) as usize % (i + 1));
        }
        let a_text = serde_json::to_string(&c.value(&forward, "2026-12-03T10:00:00Z")).expect("json");
        let mut scramble_seed = seed | 1;
        let b_text = scrambled(&c.value(&shuffled, &format!("2026-12-03T10:{minute:02}:17Z")), &mut scramble_seed);
        let a = prepare(&canon, a_text.as_bytes());
        let b = prepare(&canon, b_text.as_bytes());

        // Tool order, key order, whitespace and the stamp line do not change the prefix.
        let (ab, bb) = (a.blocks.clone().expect("blocks"), b.blocks.clone().expect("blocks"));
        prop_assert_eq!(ab.prefix_hash, bb.prefix_hash);
        // Only the note at the very end (the stamp itself) may differ.
        let stamp_free = ab.hashes.len().min(bb.hashes.len()).saturating_sub(2);
        prop_assert_eq!(&ab.hashes[..stamp_free], &bb.hashes[..stamp_free]);
        prop_assert_eq!(a.edits.moved.len(), 1);

        // Idempotent: the canonical body is its own canonical form, with the same blocks.
        let body = a.body.clone().expect("rewritten");
        let again = prepare(&canon, &body);
        prop_assert_eq!(again.body.as_deref(), Some(body.as_slice()));
        prop_assert_eq!(again.blocks.as_ref(), Some(&ab));
        prop_assert!(!again.edits.tools_reordered && again.edits.moved.is_empty());

        // The bundled engine, given the canonical body, keys exactly these blocks.
        let req: ChatCompletionRequest = serde_json::from_slice(&body).expect("engine parses it");
        let ids = render_tokens(&Tokenizer::wp32k(), &req.messages, req.tools.as_deref().unwrap_or_default(), true);
        prop_assert_eq!(&block_hashes(&ids, 16, None), &ab.hashes);
        prop_assert_eq!(ids.len(), ab.units);

        // Meaning kept: every message but the system prompt as sent, the stamp in the note.
        let sent: Value = serde_json::from_str(&a_text).expect("json");
        let got: Value = serde_json::from_slice(&body).expect("json");
        let (sent_m, got_m) = (sent["messages"].as_array().expect("list"), got["messages"].as_array().expect("list"));
        prop_assert_eq!(got_m.len(), sent_m.len() + 1);
        prop_assert_eq!(&got_m[1..sent_m.len()], &sent_m[1..]);
        let sys_sent = sent_m[0]["content"].as_str().expect("text");
        let sys_got = got_m[0]["content"].as_str().expect("text");
        let without_stamp: Vec<&str> = sys_sent.lines().filter(|l| !l.starts_with("Current time:")).collect();
        prop_assert_eq!(sys_got.lines().collect::<Vec<_>>(), without_stamp);
        prop_assert_eq!(got_m.last().expect("note"), &json!({"role": "system", "content": "Current time: 2026-12-03T10:00:00Z"}));
        prop_assert_eq!(&got["temperature"], &json!(0.5));
        let names = |v: &Value| -> Vec<String> {
            v["tools"].as_array().map(|t| t.iter().map(|t| t["function"]["name"].as_str().unwrap_or("").to_owned()).collect()).unwrap_or_default()
        };
        let mut want = names(&sent);
        want.sort();
        prop_assert_eq!(names(&got), want);
        if let Some(t) = sent.get("tools") {
            let sorted: std::collections::BTreeSet<String> = t.as_array().expect("list").iter().map(Value::to_string).collect();
            let got_set: std::collections::BTreeSet<String> = got["tools"].as_array().expect("list").iter().map(Value::to_string).collect();
            prop_assert_eq!(sorted, got_set, "the same tools, each with the same content");
        }
    }

    #[test]
    fn without_rewriting_the_blocks_are_those_of_the_body_as_sent(c in case(), seed in any::<u64>()) {
        let canon = canon(false);
        let order: Vec<usize> = (0..c.tools.len()).rev().collect();
        let mut s = seed | 1;
        let text = scrambled(&c.value(&order, "2026-12-03"), &mut s);
        let p = prepare(&canon, text.as_bytes());
        prop_assert!(p.body.is_none());
        let req: ChatCompletionRequest = serde_json::from_str(&text).expect("engine parses it");
        let ids = render_tokens(&Tokenizer::wp32k(), &req.messages, req.tools.as_deref().unwrap_or_default(), true);
        prop_assert_eq!(block_hashes(&ids, 16, None), p.blocks.expect("blocks").hashes);
    }
}

#[test]
fn text_parts_and_escapes_render_like_plain_text() {
    let c = canon(false);
    let plain = br#"{"model":"m","messages":[{"role":"user","content":"You are helpful."}]}"#;
    let parts = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"You are "},{"type":"text","text":"helpful."}]}]}"#;
    let escaped = br#"{"model":"m","messages":[{"role":"user","content":"You are \u0068elpful."}]}"#;
    let h = |b: &[u8]| prepare(&c, b).blocks.expect("blocks");
    assert_eq!(h(plain), h(parts));
    assert_eq!(h(plain), h(escaped));
}

#[test]
fn a_system_prompt_with_an_image_is_left_alone() {
    let c = canon(true);
    let body = br#"{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"Now: 2026-12-03\nhi"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"user","content":"q"}]}"#;
    let p = prepare(&c, body);
    assert!(p.edits.moved.is_empty());
    let got: Value = serde_json::from_slice(&p.body.expect("body")).expect("json");
    let sent: Value = serde_json::from_slice(body).expect("json");
    assert_eq!(got, sent);
}

#[test]
fn responses_tools_sort_and_instructions_lose_their_stamp() {
    let c = canon(true);
    let body = br#"{"model":"m","instructions":"Be brief.\nToday is 2026-12-03.","input":"hi","tools":[{"type":"function","name":"b"},{"type":"function","name":"a"}]}"#;
    let req = LlmRequest::parse(LlmRoute::Responses, body).expect("parses");
    let p = c.prepare(&req, true).expect("prepares");
    let got: Value = serde_json::from_slice(&p.body.expect("body")).expect("json");
    assert_eq!(got["instructions"], "Be brief.\n", "every byte but the moved line's is kept");
    assert_eq!(
        got["input"],
        json!([{"role": "user", "content": "hi"}, {"role": "system", "content": "Today is 2026-12-03."}])
    );
    assert_eq!(got["tools"][0]["name"], "a");
    assert!(p.edits.tools_reordered);
    assert_eq!(p.edits.moved, [("date".to_owned(), "Today is 2026-12-03.".len() + 1)]);
}

#[test]
fn completion_prompts_hash_as_text_or_ids() {
    let c = canon(false);
    let blocks = |body: &[u8]| {
        let req = LlmRequest::parse(LlmRoute::Completions, body).expect("parses");
        c.prepare(&req, true).expect("prepares").blocks.expect("blocks")
    };
    let text = blocks(br#"{"model":"m","prompt":"hello world"}"#);
    let ids: Vec<u32> = Tokenizer::wp32k().encode("hello world");
    let by_ids = blocks(format!(r#"{{"model":"m","prompt":{ids:?}}}"#).as_bytes());
    assert_eq!(text, by_ids);
    assert_eq!(text.units, ids.len());
}

#[test]
fn a_tool_that_is_not_an_object_is_a_400() {
    let c = canon(true);
    let req =
        LlmRequest::parse(LlmRoute::Chat, br#"{"model":"m","messages":[],"tools":[1]}"#).expect("parses");
    let e = c.prepare(&req, true).expect_err("rejected");
    assert_eq!(e.status, 400);
    assert!(e.message().starts_with("tools[0]"), "{}", e.message());
}

#[test]
fn canon_corpus_runs_clean() {
    warmpath_tests::run_fuzz_corpus("canon", fuzz_check);
}

/// An external model: the llama3-style fixture tokenizer (trained and checked against Hugging
/// Face's library in `wire/tests/hf_tokenizer.rs`) with a Jinja ChatML template, as a policy
/// file would load them.
mod external {
    use super::*;
    use warmpath_wire::chat_template::jinja::{self, JinjaTemplate};

    const TEMPLATE: &str = "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}{%- for tc in message.tool_calls or [] %}{{- '\\n<tool_call>\\n' + (tc.function | tojson) + '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../wire/tests/data").join(name)
    }

    fn external_canon(rewrite: bool) -> (Canon, Tokenizer, Arc<JinjaTemplate>) {
        let tok = Tokenizer::from_file(&fixture("llama3-style.tokenizer.json")).expect("loads");
        let t = Arc::new(
            JinjaTemplate::new(TEMPLATE.into(), String::new(), String::new(), "t".into()).expect("compiles"),
        );
        let cfg = CanonConfig { enabled: rewrite, ..CanonConfig::default() };
        let external = External { tokenizer: tok.clone(), template: Some(t.clone()) };
        (Canon::new(&cfg, &ToolsConfig::default(), false, Some(external)), tok, t)
    }

    fn body(stamp: &str, reversed: bool) -> Vec<u8> {
        let mut tools = vec![
            json!({"type": "function", "function": {"name": "alpha", "description": "first", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}),
            json!({"type": "function", "function": {"parameters": {"properties": {"y": {"type": "integer"}}, "type": "object"}, "name": "beta", "description": "second"}}),
        ];
        if reversed {
            tools.reverse();
        }
        let system = format!(
            "You are a careful agent.\nCurrent time: {stamp}\nAnswer briefly.\n{}",
            "Rules of the road.\n".repeat(30)
        );
        serde_json::to_vec(&json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "call alpha"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "alpha", "arguments": "{\"x\": \"é\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ],
            "tools": tools,
        }))
        .expect("json")
    }

    #[test]
    fn blocks_are_the_tokens_of_the_template_render_of_the_body_sent() {
        let (c, tok, t) = external_canon(true);
        let p = prepare(&c, &body("2026-12-03T10:00:00Z", false));
        // Read the body sent independently of the proxy's own parse: keys in their order.
        let sent = jinja::parse(std::str::from_utf8(p.body.as_ref().expect("rewritten")).expect("utf-8"))
            .expect("json");
        let list = |k: &str| -> Vec<jinja::TemplateValue> {
            sent.get_attr(k).expect(k).try_iter().expect(k).collect()
        };
        let text = t.render(&list("messages"), Some(&list("tools")), true, None).expect("renders");
        // Arguments parsed into an object, keys in the body's order (json! sorts them).
        assert!(text.contains("<tool_call>\n{\"arguments\": {\"x\": \"é\"}, \"name\": \"alpha\"}"), "{text}");
        let ids = tok.encode_with_special(&text);
        let blocks = p.blocks.expect("hashed");
        assert_eq!(blocks.units, ids.len());
        assert_eq!(blocks.hashes, block_hashes(&ids, 16, None));
        assert!(blocks.hashes.len() > 10, "a real prompt ({} tokens)", ids.len());
    }

    #[test]
    fn tool_order_and_stamps_leave_the_prefix_unchanged() {
        let (c, _, _) = external_canon(true);
        let a = prepare(&c, &body("2026-12-03T10:00:00Z", false)).blocks.expect("hashed");
        let b = prepare(&c, &body("2026-12-04T23:59:59Z", true)).blocks.expect("hashed");
        assert_eq!(a.prefix_hash, b.prefix_hash);
        // Everything before the note (the last message) is the same.
        let common = a.hashes.iter().zip(&b.hashes).take_while(|(x, y)| x == y).count();
        assert!(common + 3 >= a.hashes.len(), "{common} of {} blocks shared", a.hashes.len());
        // As sent, they differ from the second line on.
        let (raw, _, _) = external_canon(false);
        let a = prepare(&raw, &body("2026-12-03T10:00:00Z", false)).blocks.expect("hashed");
        let b = prepare(&raw, &body("2026-12-04T23:59:59Z", true)).blocks.expect("hashed");
        assert_ne!(a.prefix_hash, b.prefix_hash);
    }

    #[test]
    fn a_template_that_raises_falls_back_to_the_builtin_layout() {
        let tok = Tokenizer::from_file(&fixture("llama3-style.tokenizer.json")).expect("loads");
        let t = JinjaTemplate::new(
            "{{ raise_exception('no tools here') }}".into(),
            String::new(),
            String::new(),
            "t".into(),
        )
        .expect("compiles");
        let cfg = CanonConfig { enabled: true, ..CanonConfig::default() };
        let external = External { tokenizer: tok, template: Some(Arc::new(t)) };
        let c = Canon::new(&cfg, &ToolsConfig::default(), false, Some(external));
        let p = prepare(&c, &body("x", false));
        assert!(p.blocks.expect("still hashed").hashes.len() > 10);
    }
}
