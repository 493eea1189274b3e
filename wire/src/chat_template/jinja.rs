//! An external model's chat template (Hugging Face Jinja), rendered the way transformers and
//! vLLM render it, so the proxy's prefix blocks are the backend's own tokens.
//!
//! The environment copies theirs: `trim_blocks` and `lstrip_blocks`, loop controls, Python
//! string and dict methods (`.strip()`, `.items()`, …), `raise_exception`, `strftime_now`, and
//! `tojson` as `json.dumps(…, ensure_ascii=False)` writes it (`", "` and `": "`, no HTML
//! escaping). The messages go in as vLLM passes them: text parts joined by newlines and tool-call
//! arguments parsed into objects.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value;

/// A value as templates see it (what [`parse`] gives).
pub use minijinja::Value as TemplateValue;

/// A loaded chat template with the special tokens it refers to.
pub struct JinjaTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Where the template came from, for logs.
    pub source: String,
}

impl std::fmt::Debug for JinjaTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JinjaTemplate").field("source", &self.source).finish()
    }
}

const NAME: &str = "chat";

impl JinjaTemplate {
    /// Loads `path`: a `.jinja` file, or a `tokenizer_config.json` (its `chat_template` and
    /// `bos_token` / `eos_token`). A `tokenizer_config.json` beside a `.jinja` file supplies the
    /// special tokens.
    pub fn load(path: &Path) -> Result<JinjaTemplate, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let is_json = path.extension().is_some_and(|e| e == "json");
        let config = if is_json {
            Some(text.clone())
        } else {
            path.parent()
                .map(|d| d.join("tokenizer_config.json"))
                .and_then(|p| std::fs::read_to_string(p).ok())
        };
        let config: Option<Value> = match config {
            Some(c) => {
                Some(serde_json::from_str(&c).map_err(|e| format!("{}: not JSON: {e}", path.display()))?)
            }
            None => None,
        };
        let source = if is_json {
            template_of(config.as_ref().expect("read above"))
                .ok_or_else(|| format!("{}: no chat_template", path.display()))?
        } else {
            text
        };
        let token = |key: &str| {
            config
                .as_ref()
                .and_then(|c| c.get(key))
                .and_then(|t| t.as_str().or_else(|| t.get("content").and_then(Value::as_str)))
                .unwrap_or_default()
                .to_owned()
        };
        Self::new(source, token("bos_token"), token("eos_token"), path.display().to_string())
    }

    /// The template beside a `tokenizer.json`: `chat_template.jinja`, else the one in
    /// `tokenizer_config.json`; `None` when neither is there.
    pub fn beside(tokenizer: &Path) -> Option<PathBuf> {
        let dir = tokenizer.parent()?;
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            return Some(jinja);
        }
        let config = dir.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&config).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        template_of(&v).map(|_| config)
    }

    pub fn new(source: String, bos: String, eos: String, name: String) -> Result<JinjaTemplate, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<JValue, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| strftime(&fmt, now_utc()));
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source).map_err(|e| format!("{name}: {e}"))?;
        Ok(JinjaTemplate { env, bos, eos, source: name })
    }

    /// The prompt for `messages` (chat-completions shape, as parsed by [`parse`]) and `tools`;
    /// `extra` holds the request's `chat_template_kwargs`.
    pub fn render(
        &self,
        messages: &[JValue],
        tools: Option<&[JValue]>,
        add_generation_prompt: bool,
        extra: Option<&JValue>,
    ) -> Result<String, String> {
        let mut ctx: Vec<(JValue, JValue)> = Vec::new();
        if let Some(extra) = extra {
            for k in extra.try_iter().map_err(|e| e.to_string())? {
                let v = extra.get_item(&k).map_err(|e| e.to_string())?;
                ctx.push((k, v));
            }
        }
        let messages: Vec<JValue> = messages.iter().map(as_vllm_passes).collect();
        ctx.push(("messages".into(), messages.into()));
        ctx.push(("tools".into(), tools.map_or(JValue::from(()), |t| t.to_vec().into())));
        ctx.push(("add_generation_prompt".into(), add_generation_prompt.into()));
        ctx.push(("bos_token".into(), self.bos.as_str().into()));
        ctx.push(("eos_token".into(), self.eos.as_str().into()));
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        tmpl.render(JValue::from_pairs(ctx)).map_err(|e| e.to_string())
    }
}

/// A JSON value for the template, its object keys in their order.
pub fn parse(json: &str) -> Option<JValue> {
    serde_json::from_str(json).ok()
}

/// `chat_template` of a tokenizer config: a string, or a list of named templates (`default`).
fn template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or(named.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A message as vLLM hands it to the template: text parts joined by newlines, tool-call
/// arguments parsed into objects.
fn as_vllm_passes(m: &JValue) -> JValue {
    map_values(m, |k, v| match (k, v.kind()) {
        ("content", ValueKind::Seq) => {
            let texts: Vec<String> = v
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|p| p.get_attr("text").ok().and_then(|t| t.as_str().map(str::to_owned)))
                .collect();
            JValue::from(texts.join("\n"))
        }
        ("tool_calls", ValueKind::Seq) => {
            v.try_iter().into_iter().flatten().map(|c| with_parsed_arguments(&c)).collect()
        }
        _ => v,
    })
}

/// `{"function": {"arguments": "{…}"}}` with the arguments string parsed, where it is an object.
fn with_parsed_arguments(call: &JValue) -> JValue {
    map_values(call, |k, f| match k {
        "function" => map_values(&f, |k, args| match (k, args.as_str().and_then(parse)) {
            ("arguments", Some(parsed)) if parsed.kind() == ValueKind::Map => parsed,
            _ => args,
        }),
        _ => f,
    })
}

/// `v` with each entry's value passed through `f(key, value)`, keys in their order; anything
/// but a map as it is.
fn map_values(v: &JValue, f: impl Fn(&str, JValue) -> JValue) -> JValue {
    if v.kind() != ValueKind::Map {
        return v.clone();
    }
    let entries: Vec<(JValue, JValue)> = v
        .try_iter()
        .into_iter()
        .flatten()
        .map(|k| {
            let value = v.get_item(&k).unwrap_or_default();
            let value = match k.as_str() {
                Some(name) => f(name, value),
                None => value,
            };
            (k, value)
        })
        .collect();
    JValue::from_pairs(entries)
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: &JValue, indent: Option<JValue>, kwargs: Kwargs) -> Result<JValue, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<JValue>>("indent")?,
    };
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let mut out = Vec::new();
    let written = match indent {
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
            serde::Serialize::serialize(value, &mut ser)
        }
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            serde::Serialize::serialize(value, &mut ser)
        }
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(JValue::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// Python's default JSON separators: `", "` between items, `": "` after keys.
struct Spaced;

impl serde_json::ser::Formatter for Spaced {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// Seconds since the epoch, now.
fn now_utc() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The strftime subset chat templates use (`%d %b %Y` and kin), in UTC.
fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('b') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[days.rem_euclid(7) as usize]),
            Some('a') => out.push_str(&DAYS[days.rem_euclid(7) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn values(json: &str) -> Vec<JValue> {
        parse(json).expect("json").try_iter().expect("list").collect()
    }

    fn compile(src: &str) -> JinjaTemplate {
        JinjaTemplate::new(src.into(), String::new(), String::new(), "t".into()).expect("compiles")
    }

    #[test]
    fn renders_a_chatml_template() {
        let t = compile(CHATML);
        let msgs = values(
            r#"[{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]"#,
        );
        let out = t.render(&msgs, None, true, None).expect("renders");
        assert_eq!(out, "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_tojson_and_raise_exception() {
        let t = compile("{% for m in messages %}{{ m.content.strip() }}|{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}{{ tools | tojson }}{% if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}");
        let msgs = values(
            r#"[{"role": "assistant", "content": "  hi  ", "tool_calls": [{"function": {"name": "f", "arguments": "{\"b\":1,\"a\":\"é<\"}"}}]}]"#,
        );
        let tools = values(r#"[{"type": "function", "function": {"name": "f"}}]"#);
        let out = t.render(&msgs, Some(&tools), false, None).expect("renders");
        // Keys keep their order, Python separators, no HTML escaping, UTF-8 as is.
        assert_eq!(
            out,
            "hi|{\"b\": 1, \"a\": \"é<\"}[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]"
        );
        let three = [msgs[0].clone(), msgs[0].clone(), msgs[0].clone()];
        assert!(t.render(&three, None, false, None).expect_err("raises").contains("too many"));
    }

    #[test]
    fn tojson_indent_matches_python() {
        let t = compile("{{ x | tojson(indent=2) }}");
        let extra = parse(r#"{"x": {"a": [1, 2], "b": {}}}"#).expect("json");
        let out = t.render(&[], None, false, Some(&extra)).expect("renders");
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}");
    }

    /// Prompts and ids from `transformers`' `apply_chat_template` on the fixture tokenizer
    /// (`scripts/make-tokenizer-fixtures.py`): warmpath renders and tokenizes the same.
    #[test]
    fn renders_and_tokenizes_as_transformers_does() {
        let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        let tok =
            crate::tokenizer::Tokenizer::from_file(&data.join("llama3-style.tokenizer.json")).expect("loads");
        let fixture =
            parse(&std::fs::read_to_string(data.join("chat-template.expected.json")).expect("reads"))
                .expect("json");
        let t = compile(fixture.get_attr("template").expect("template").as_str().expect("text"));
        let cases: Vec<JValue> =
            fixture.get_attr("cases").expect("cases").try_iter().expect("list").collect();
        assert_eq!(cases.len(), 6);
        for c in cases {
            let messages: Vec<JValue> =
                c.get_attr("messages").expect("messages").try_iter().expect("list").collect();
            let tools = c.get_attr("tools").expect("tools");
            let tools: Option<Vec<JValue>> =
                (!tools.is_none()).then(|| tools.try_iter().expect("list").collect());
            let gen = c.get_attr("add_generation_prompt").expect("flag").is_true();
            let want = c.get_attr("text").expect("text");
            let got = t.render(&messages, tools.as_deref(), gen, None).expect("renders");
            assert_eq!(got, want.as_str().expect("text"));
            let ids: Vec<u32> = c
                .get_attr("ids")
                .expect("ids")
                .try_iter()
                .expect("list")
                .map(|i| i.as_usize().expect("id") as u32)
                .collect();
            assert_eq!(tok.encode_with_special(&got), ids);
        }
    }

    #[test]
    fn strftime_subset() {
        // 2026-12-03 14:05:09 UTC, a Thursday.
        let secs = 1_796_306_709;
        assert_eq!(strftime("%d %b %Y", secs), "03 Dec 2026");
        assert_eq!(strftime("%A %B %-d %H:%M:%S %%", secs), "Thursday December %-d 14:05:09 %");
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(-1), (1969, 12, 31));
    }
}
