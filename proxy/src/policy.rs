//! The policy file as warmpath serves it ([`Policy`]): parsed and validated (`config`), then
//! every file it names read and checked — each pool's tokenizer and chat template, the guard
//! model's prompt, certificates, keys — so that a file that would fail at start-up (or at a
//! reload) fails here, at its key, as `file:line:col: message`. `check-config` runs the same.

use std::path::Path;

use crate::canon::External;
use crate::config::{Config, ConfigError, Invalid, PathSeg, Source};

/// A policy file with everything loaded from the files it names (each pool's tokenizer and
/// chat template), so that a file that would fail at start-up fails here, at its key.
#[derive(Debug, Clone)]
pub struct Policy {
    pub cfg: Config,
    /// Per pool, its external tokenizer and template.
    pub externals: Vec<Option<External>>,
}

impl Policy {
    /// Reads, validates and loads the policy file at `path`.
    pub fn load(path: &Path) -> Result<Policy, ConfigError> {
        Policy::parse(&Source::read(path)?)
    }

    pub fn parse(src: &Source) -> Result<Policy, ConfigError> {
        let mut cfg = crate::config::parse(&src.file, &src.text)?;
        let mut externals = Vec::with_capacity(cfg.pools.len());
        for (i, pool) in cfg.pools.iter_mut().enumerate() {
            let at = |table: &str, key_name: &str, message: String| {
                let key = |k: &str| PathSeg::Key(k.to_owned());
                let path = vec![key("pools"), PathSeg::Index(i), key(table), key(key_name)];
                src.locate(&Invalid { path, message })
            };
            let mut loaded = External::load(&pool.canon, src.dir()).map_err(|(k, m)| at("canon", k, m))?;
            // An embedded GGUF model's own tokenizer and template, unless the file names others.
            if let (None, Some(e)) = (&loaded, &pool.embedded) {
                loaded = External::of_embedded(&e.model).map_err(|m| at("embedded", "model", m))?;
            }
            externals.push(loaded);
            // Backends' keys come from the environment: a variable that is not set fails here.
            for (b, backend) in pool.backends.iter().enumerate() {
                if let Some(var) = backend.api_key_env.as_deref().filter(|v| std::env::var(v).is_err()) {
                    let key = |k: &str| PathSeg::Key(k.to_owned());
                    let path = vec![
                        key("pools"),
                        PathSeg::Index(i),
                        key("backends"),
                        PathSeg::Index(b),
                        key("api_key_env"),
                    ];
                    let message = format!("the environment variable {var} is not set");
                    return Err(src.locate(&Invalid { path, message }));
                }
            }
            // The guard model's prompt template.
            if let Some(g) = &mut pool.safety.guard_model {
                if let Some(file) = &g.template_file {
                    let path = src.dir().join(file);
                    let key = |k: &str| PathSeg::Key(k.to_owned());
                    let keys = ["safety", "guard_model", "template_file"].map(key);
                    let mut path_keys = vec![key("pools"), PathSeg::Index(i)];
                    path_keys.extend(keys);
                    let text = std::fs::read_to_string(&path).map_err(|e| {
                        src.locate(&Invalid {
                            path: path_keys.clone(),
                            message: format!("cannot read {}: {e}", path.display()),
                        })
                    })?;
                    if !text.contains("{conversation}") {
                        let message =
                            format!("{} has no {{conversation}} to put the conversation in", path.display());
                        return Err(src.locate(&Invalid { path: path_keys, message }));
                    }
                    g.template = Some(text);
                }
            }
        }
        // Files the policy names: `$NAME` is an environment variable's value (paths kept out
        // of the file), resolved next to the policy file, and read now so that a bad one fails
        // here, at its key.
        let key = |k: &str| PathSeg::Key(k.to_owned());
        let at = |keys: &[&str], message: String| {
            src.locate(&Invalid { path: keys.iter().map(|k| key(k)).collect(), message })
        };
        let resolve = |f: &std::path::Path, keys: &[&str]| {
            let named = crate::config::from_env(&f.to_string_lossy()).map_err(|m| at(keys, m))?;
            Ok::<_, ConfigError>(src.dir().join(named))
        };
        for (name, tls) in [("tls", &mut cfg.server.tls), ("admin_tls", &mut cfg.server.admin_tls)] {
            let Some(t) = tls else { continue };
            t.cert_file = resolve(&t.cert_file, &["server", name, "cert_file"])?;
            t.key_file = resolve(&t.key_file, &["server", name, "key_file"])?;
            if let Some(f) = &t.client_ca_file {
                t.client_ca_file = Some(resolve(f, &["server", name, "client_ca_file"])?);
            }
            crate::tls::load_pair(&t.cert_file, &t.key_file)
                .map_err(|m| at(&["server", name, "cert_file"], m))?;
        }
        // A TLS trust bundle and client certificate, read now so that a bad one fails here.
        let read_files = |table: &str, files: [(&str, &mut Option<std::path::PathBuf>); 3]| {
            for (k, file) in files {
                if let Some(f) = file {
                    *f = resolve(f, &[table, k])?;
                    if let Err(e) = std::fs::read(&*f) {
                        return Err(at(&[table, k], format!("cannot read {}: {e}", f.display())));
                    }
                }
            }
            Ok(())
        };
        let up = &mut cfg.upstream;
        read_files(
            "upstream",
            [
                ("ca_file", &mut up.ca_file),
                ("client_cert_file", &mut up.client_cert_file),
                ("client_key_file", &mut up.client_key_file),
            ],
        )?;
        let r = &mut cfg.redis;
        read_files(
            "redis",
            [
                ("ca_file", &mut r.ca_file),
                ("client_cert_file", &mut r.client_cert_file),
                ("client_key_file", &mut r.client_key_file),
            ],
        )?;
        // `[session] redis_url` is the older spelling of `[redis] url`.
        if let Some(url) = cfg.session.redis_url.take() {
            cfg.redis.url = Some(url);
            cfg.redis.timeout_ms = cfg.session.redis_timeout_ms;
        }
        if let Some(f) = &cfg.auth.keys_file {
            let path = resolve(f, &["auth", "keys_file"])?;
            crate::auth::KeyTable::load(&path, &cfg.auth.limits)
                .map_err(|m| at(&["auth", "keys_file"], m))?;
            cfg.auth.keys_file = Some(path);
        }
        Ok(Policy { cfg, externals })
    }
}

/// How `warmpath` serves, from the command line.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The policy file (read again by reloads).
    pub file: std::path::PathBuf,
    /// Take the listening sockets over from the warmpath running on the same listen address
    /// (a restart without a refused connection).
    pub upgrade: bool,
    /// Reload when the policy file changes.
    pub watch: bool,
    /// `--listen`, `--admin`: they override the file's, at start and at every reload.
    pub listen: Option<std::net::SocketAddr>,
    pub admin: Option<std::net::SocketAddr>,
}

impl RunOptions {
    /// The command line's overrides applied to a policy read from the file.
    pub fn apply(&self, cfg: &mut Config) {
        if let Some(a) = self.listen {
            cfg.server.listen = a;
        }
        if let Some(a) = self.admin {
            cfg.server.admin = a;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(file: &str, text: &str) -> Result<Policy, ConfigError> {
        Policy::parse(&Source { file: file.to_owned(), text: text.to_owned() })
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../wire/tests/data").join(name)
    }

    /// A ChatML template with tools, as an external model's `tokenizer_config.json` holds it.
    const TEMPLATE: &str = "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    #[test]
    fn policy_files_load_the_tokenizer_and_the_template_beside_it() {
        let dir = std::env::temp_dir().join(format!("wp-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::copy(fixture("llama3-style.tokenizer.json"), dir.join("tokenizer.json")).expect("copy");
        let config = json!({"chat_template": TEMPLATE, "bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_end|>"}});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
        let policy = "[[pools]]\nname = \"p\"\nmodels = [\"*\"]\n[pools.canon]\nenabled = true\ntokenizer_file = \"tokenizer.json\"\n[[pools.backends]]\nname = \"a\"\nurl = \"http://127.0.0.1:8000\"\n";
        let file = dir.join("p.toml");
        let loaded = parse(&file.display().to_string(), policy).expect("valid");
        let ext = loaded.externals[0].as_ref().expect("loaded");
        assert_eq!(ext.tokenizer.special_id("<|im_end|>"), Some(2));
        assert!(ext.template.as_ref().expect("found beside").source.ends_with("tokenizer_config.json"));

        // A file that is not there, and one that is not a tokenizer: errors at the key.
        let e = parse(&file.display().to_string(), &policy.replace("tokenizer.json\"", "missing.json\""))
            .expect_err("refused");
        assert!(
            e.message.contains("pools[0].canon.tokenizer_file") && e.message.contains("cannot read"),
            "{e}"
        );
        assert_eq!(e.line, 6, "{e}");
        let e = parse(
            &file.display().to_string(),
            &policy.replace("tokenizer.json\"", "tokenizer_config.json\""),
        )
        .expect_err("refused");
        assert!(e.message.contains("model"), "{e}");
        let bad = policy.replace(
            "tokenizer_file = \"tokenizer.json\"\n",
            "tokenizer_file = \"tokenizer.json\"\ntokenizer = \"wp32k\"\n",
        );
        assert!(parse(&file.display().to_string(), &bad).is_err());
        let bad = policy.replace("tokenizer_file = \"tokenizer.json\"\n", "chat_template = \"t.jinja\"\n");
        let e = parse(&file.display().to_string(), &bad).expect_err("refused");
        assert!(e.message.contains("tokenizer_file"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
