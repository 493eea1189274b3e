//! Reading a policy file: TOML parse errors and [`super::validate`] failures both come out as
//! `file:line:col: message`.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::{validate, Config, Invalid, PathSeg};

/// A policy file that cannot be used, with the place that is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    /// 1-based; 0 when the file could not be read at all.
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: {}", self.file, self.line, self.col, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// A policy file's text and the name its errors give it.
#[derive(Debug, Clone)]
pub struct Source {
    pub file: String,
    pub text: String,
}

impl Source {
    /// Reads the policy file at `path`.
    pub fn read(path: &Path) -> Result<Source, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            line: 0,
            col: 0,
            message: format!("cannot read: {e}"),
        })?;
        Ok(Source { file, text })
    }

    /// The directory relative paths in the file are resolved against.
    pub fn dir(&self) -> &Path {
        Path::new(&self.file).parent().unwrap_or(Path::new(""))
    }

    /// `inv` located in this file.
    pub fn locate(&self, inv: &Invalid) -> ConfigError {
        locate(&self.file, &self.text, inv)
    }
}

/// Reads, parses and validates the policy file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let src = Source::read(path)?;
    parse(&src.file, &src.text)
}

/// Parses and validates policy text; `file` names it in errors.
pub fn parse(file: &str, text: &str) -> Result<Config, ConfigError> {
    let cfg: Config = toml::from_str(text).map_err(|e| at(file, text, e.span(), e.message().to_owned()))?;
    validate(&cfg).map_err(|inv| locate(file, text, &inv))?;
    Ok(cfg)
}

/// `inv` as an error at its key's place in `text` (or at the closest table above it that is
/// there): for what the stages find wrong when they build from a valid file (a tokenizer file
/// that does not load).
pub fn locate(file: &str, text: &str, inv: &Invalid) -> ConfigError {
    let span = DeTable::parse(text).ok().and_then(|doc| span_of(&doc, &inv.path));
    at(file, text, span, inv.to_string())
}

fn at(file: &str, text: &str, span: Option<Range<usize>>, message: String) -> ConfigError {
    let (line, col) = span.map(|s| line_col(text, s.start)).unwrap_or((1, 1));
    ConfigError { file: file.to_owned(), line, col, message }
}

/// The span of the value at `path`, or of the closest table above it that exists.
fn span_of(doc: &Spanned<DeTable<'_>>, path: &[PathSeg]) -> Option<Range<usize>> {
    let mut span = doc.span();
    let mut table = Some(doc.get_ref());
    let mut value: Option<&Spanned<DeValue<'_>>> = None;
    for seg in path {
        let next = match (seg, table, value) {
            (PathSeg::Key(k), Some(t), _) => t.get(k.as_str()),
            (PathSeg::Key(k), None, Some(v)) => v.get_ref().get(k.as_str()),
            (PathSeg::Index(i), _, Some(v)) => v.get_ref().get(*i),
            _ => None,
        };
        match next {
            Some(v) => {
                span = v.span();
                value = Some(v);
                table = None;
            }
            None => break,
        }
    }
    Some(span)
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    (line, before[line_start..].chars().count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[[pools]]
name = "main"
models = ["*"]

[[pools.backends]]
name = "a"
url = "http://127.0.0.1:8000"
"#;

    fn err(text: &str) -> ConfigError {
        parse("p.toml", text).expect_err("must be rejected")
    }

    #[test]
    fn minimal_file_gets_defaults() {
        let cfg = parse("p.toml", MINIMAL).expect("valid");
        assert_eq!(cfg.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(cfg.limits.max_body_bytes, 32 << 20);
        assert_eq!(cfg.pools[0].backends[0].weight, 1);
    }

    #[test]
    fn unknown_key_points_at_it() {
        let e = err(&format!("{MINIMAL}colour = \"red\"\n"));
        assert_eq!((e.line, e.col), (9, 1), "{e}");
        assert!(e.message.contains("unknown field `colour`"), "{e}");
        assert!(e.to_string().starts_with("p.toml:9:1: "), "{e}");
    }

    #[test]
    fn bad_value_points_at_the_value() {
        let e = err(&MINIMAL.replace("http://127.0.0.1:8000", "127.0.0.1:8000"));
        assert_eq!((e.line, e.col), (8, 7), "{e}");
        assert!(e.message.contains("must start with http://"), "{e}");
        let e = err(&format!("[retry]\nbudget_ratio = 1.5\n{MINIMAL}"));
        assert_eq!((e.line, e.col), (2, 16), "{e}");
    }

    #[test]
    fn cross_field_errors_point_at_the_field() {
        let text = format!("{MINIMAL}\n[[pools.backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:8001\"\n");
        let e = err(&text);
        assert_eq!((e.line, e.col), (11, 8), "{e}");
        assert!(e.message.starts_with("pools[0].backends[1].name: backend \"a\" is already defined"), "{e}");

        let e = err(&format!("[health]\nbase_ejection_ms = 10\nmax_ejection_ms = 5\n{MINIMAL}"));
        assert_eq!((e.line, e.col), (3, 19), "{e}");

        let e = err(&MINIMAL.replace("[\"*\"]", "[]"));
        assert_eq!((e.line, e.col), (4, 10), "{e}");
    }

    #[test]
    fn a_fleets_redis_is_named_once_and_where_it_is_needed() {
        let ok = |t: &str| parse("p.toml", &format!("{t}\n{MINIMAL}")).expect(t);
        let bad = |t: &str| err(&format!("{t}\n{MINIMAL}")).message;
        ok("[redis]\nurl = \"rediss://:pw@cache:6380/1\"\n[session]\nstore = \"redis\"");
        ok("[redis]\ncluster = [\"redis://a:7000\", \"redis://b:7000\"]\n[auth]\nlimits_store = \"redis\"");
        ok("[redis]\nsentinels = [\"redis://s:26379\"]\nsentinel_master = \"m\"\n[auth]\nenabled = true\nkeys_store = \"redis\"");
        // The older spelling still names it.
        ok("[session]\nstore = \"redis\"\nredis_url = \"redis://cache\"");
        let m = bad("[redis]\nurl = \"redis://a\"\ncluster = [\"redis://b:7000\"]");
        assert!(m.starts_with("redis: name one of url, cluster and sentinels"), "{m}");
        let m = bad("[redis]\nsentinels = [\"redis://s:26379\"]");
        assert!(m.starts_with("redis.sentinel_master:"), "{m}");
        let m = bad("[auth]\nenabled = true\nkeys_store = \"redis\"");
        assert!(m.starts_with("auth.keys_store: keys_store = \"redis\" needs a [redis] server"), "{m}");
        let m = bad("[auth]\nlimits_store = \"redis\"");
        assert!(m.starts_with("auth.limits_store:"), "{m}");
        let m = bad("[session]\nstore = \"redis\"");
        assert!(m.starts_with("session.store:"), "{m}");
        let m = bad("[redis]\nurl = \"redis://a\"\n[session]\nredis_url = \"redis://b\"");
        assert!(m.starts_with("session.redis_url:"), "{m}");
        let m = bad("[redis]\nurl = \"memcached://a\"");
        assert!(m.contains("memcached://a"), "{m}");
        let m = bad("[redis]\nurl = \"redis://a\"\nclient_cert_file = \"c.pem\"");
        assert!(m.starts_with("redis.client_cert_file:"), "{m}");
    }

    #[test]
    fn response_cache_limits_are_checked() {
        let rc = |body: &str| format!("{MINIMAL}[pools.response_cache]\nenabled = true\n{body}\n");
        parse("p.toml", &rc("max_mib = 8\nttl_s = 30\nshared = true")).expect("valid");
        let e = err(&rc("ttl_s = 0"));
        assert!(e.message.starts_with("pools[0].response_cache.ttl_s: must be positive"), "{e}");
        let e = err(&rc("max_mib = 1\nmax_entry_kib = 2048"));
        assert!(e.message.contains("more than the whole cache"), "{e}");
        assert_eq!(e.line, 12, "{e}");
        parse("p.toml", &format!("{MINIMAL}[pools.response_cache]\nttl_s = 0\n")).expect("off: not checked");
    }

    #[test]
    fn a_split_pool_keeps_a_backend_that_decodes() {
        let prefill = MINIMAL.replace("8000\"", "8000\"\nrole = \"prefill\"");
        let e = err(&prefill);
        assert!(e.message.starts_with("pools[0].backends: every backend has role \"prefill\""), "{e}");
        let two = format!("{prefill}\n[[pools.backends]]\nname = \"b\"\nurl = \"http://127.0.0.1:8001\"\nrole = \"decode\"\n");
        parse("p.toml", &two).expect("one prefills, one decodes");
        let e = err(&MINIMAL.replace("8000\"", "8000\"\nrole = \"both-ways\""));
        assert!(e.message.contains("expected one of `both`, `prefill`, `decode`"), "{e}");
        let embedded = |n: usize| {
            format!("[[pools]]\nname = \"e\"\nmodels = [\"*\"]\n[pools.embedded]\nreplicas = 2\nprefill_replicas = {n}\n")
        };
        parse("p.toml", &embedded(1)).expect("one of two prefills");
        let e = err(&embedded(2));
        assert!(e.message.starts_with("pools[0].embedded.prefill_replicas: 2 of 2 replicas"), "{e}");
        let transfer = |t: &str| MINIMAL.replace("8000\"", &format!("8000\"\nkv_transfer = {t:?}"));
        parse("p.toml", &transfer("10.0.0.5:7100")).expect("HOST:PORT");
        let e = err(&transfer("10.0.0.5"));
        assert!(
            e.message.starts_with("pools[0].backends[0].kv_transfer: \"10.0.0.5\" is not HOST:PORT"),
            "{e}"
        );
    }

    #[test]
    fn the_index_ttl_is_bounded_by_what_its_clock_keeps() {
        let ttl = |t: u64| format!("{MINIMAL}[pools.cache_aware]\nttl_s = {t}\n");
        parse("p.toml", &ttl(8_000)).expect("valid");
        let e = err(&ttl(8_001));
        assert!(e.message.starts_with("pools[0].cache_aware.ttl_s: 8001 is past the longest TTL"), "{e}");
    }

    #[test]
    fn precise_mode_needs_the_backends_tokens() {
        let precise = |canon: &str| {
            format!(
                "{}[pools.cache_aware]\nmode = \"precise\"\n{canon}",
                MINIMAL
                    .replace(
                        "http://127.0.0.1:8000\"",
                        "http://127.0.0.1:8000\"\nkv_events = \"tcp://127.0.0.1:5557\""
                    )
                    .replace("[[pools.backends]]", "policy = \"cache_aware\"\n[[pools.backends]]")
            )
        };
        let e = err(&precise(""));
        assert!(e.message.starts_with("pools[0].cache_aware.mode: precise mode matches"), "{e}");
        let e = err(&precise("[pools.canon]\ntokenizer = \"none\"\n"));
        assert!(e.message.contains("tokenizer_file"), "{e}");
        parse("p.toml", &precise("[pools.canon]\ntokenizer = \"wp32k\"\n")).expect("token blocks: valid");
    }

    #[test]
    fn embedded_speculative_decoding_is_checked() {
        let spec = |body: &str| {
            format!("[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[pools.embedded]\nmodel = \"micro\"\n[pools.embedded.speculative]\n{body}\n")
        };
        let cfg = parse("p.toml", &spec("num_speculative_tokens = 4\nprompt_lookup_min = 1")).expect("valid");
        let s = cfg.pools[0].embedded.as_ref().and_then(|e| e.speculative.clone()).expect("speculative");
        assert_eq!((s.num_speculative_tokens, s.lookup_min(), s.prompt_lookup_max), (4, 1, 4));
        let e = err(&spec("num_speculative_tokens = 40"));
        assert!(
            e.message.starts_with("pools[0].embedded.speculative: num_speculative_tokens must be within"),
            "{e}"
        );
        let e = err(&spec("num_speculative_tokens = 2\nmethod = \"eagle\""));
        assert!(e.message.contains("only \"ngram\""), "{e}");
    }

    #[test]
    fn missing_parts_fall_back_to_the_closest_table() {
        let e = err("[server]\nthreads = 2\n");
        assert!(e.message.starts_with("pools: at least one"), "{e}");
        let e = err("[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n");
        assert_eq!((e.line, e.col), (1, 1), "{e}");
        assert!(e.message.contains("needs [[pools.backends]] or [pools.embedded]"), "{e}");
    }
}
