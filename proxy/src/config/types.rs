//! Value types of the policy file that check themselves while they are parsed, so that a bad
//! value is reported at its own line and column.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// A backend's base URL: `http://host:port` or `https://host:port`, with an optional path
/// prefix (`http://10.0.0.5:8000/prefix`) that is put in front of every route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendUrl {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// Path prefix without a trailing slash; empty for none.
    pub base_path: String,
}

impl BackendUrl {
    /// A backend's URL, read by `http`'s URI parser: `http://` or `https://`, a host (a name,
    /// IPv4, or a bracketed IPv6 literal), an optional port (80 / 443 by default) and path.
    pub fn parse(s: &str) -> Result<BackendUrl, String> {
        let uri: http::Uri = s.parse().map_err(|e| format!("backend url {s:?} is not a URL: {e}"))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(format!("backend url {s:?} must start with http:// or https://")),
        };
        let authority = uri.authority().ok_or_else(|| format!("backend url {s:?} has no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!("backend url {s:?} may not carry credentials (use api_key_env)"));
        }
        if uri.query().is_some() || s.contains('#') {
            return Err(format!("backend url {s:?} may not carry a query or fragment"));
        }
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_owned();
        if host.is_empty() {
            return Err(format!("backend url {s:?} has no host"));
        }
        // What follows the host: nothing, or `:PORT`.
        let port = match authority.as_str()[authority.host().len()..].strip_prefix(':') {
            None => {
                if tls {
                    443
                } else {
                    80
                }
            }
            Some(p) => p.parse::<u16>().map_err(|_| format!("backend url {s:?} has a bad port {p:?}"))?,
        };
        let base_path = uri.path().trim_end_matches('/').to_owned();
        Ok(BackendUrl { tls, host, port, base_path })
    }

    /// `host:port`, bracketing IPv6 literals.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority(), self.base_path)
    }
}

impl<'de> Deserialize<'de> for BackendUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        BackendUrl::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// `redis://[:password@]host:port[/db]` (also `redis://user:password@…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    pub addr: String,
    pub user: Option<String>,
    pub password: Option<String>,
    pub db: u32,
}

impl RedisUrl {
    pub fn parse(url: &str) -> Result<RedisUrl, String> {
        let rest = url.strip_prefix("redis://").ok_or_else(|| format!("{url:?}: only redis:// URLs"))?;
        let (auth, hostpart) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let (host, db) = match hostpart.split_once('/') {
            Some((h, "")) => (h, 0),
            Some((h, d)) => (h, d.parse().map_err(|_| format!("{url:?}: the database must be a number"))?),
            None => (hostpart, 0),
        };
        if host.is_empty() {
            return Err(format!("{url:?}: no host"));
        }
        let addr = if host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
            host.to_owned()
        } else {
            format!("{host}:6379")
        };
        let (user, password) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some(("", p)) => (None, Some(p.to_owned())),
                Some((u, p)) => (Some(u.to_owned()), Some(p.to_owned())),
                None => (None, Some(a.to_owned())),
            },
        };
        Ok(RedisUrl { addr, user, password, db })
    }
}

impl<'de> Deserialize<'de> for RedisUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let s = from_env(&s).map_err(serde::de::Error::custom)?;
        RedisUrl::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// A value that may live in the environment: `$NAME` is the variable NAME's value (a secret
/// kept out of the policy file: a Redis URL with its password, a key file's path); anything
/// else is itself.
pub fn from_env(value: &str) -> Result<String, String> {
    match value.strip_prefix('$') {
        Some(name) => std::env::var(name).map_err(|_| format!("the environment variable {name} is not set")),
        None => Ok(value.to_owned()),
    }
}

/// A fraction within 0..=1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ratio(pub f64);

impl<'de> Deserialize<'de> for Ratio {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = f64::deserialize(d)?;
        if (0.0..=1.0).contains(&v) {
            Ok(Ratio(v))
        } else {
            Err(serde::de::Error::custom(format!("{v} is not a fraction within 0..=1")))
        }
    }
}

/// A regular expression, compiled (and so checked) while the file is parsed.
#[derive(Debug, Clone)]
pub struct Pattern(pub regex::Regex);

impl<'de> Deserialize<'de> for Pattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        regex::RegexBuilder::new(&s)
            .size_limit(1 << 20)
            .build()
            .map(Pattern)
            .map_err(|e| serde::de::Error::custom(format!("bad pattern: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = BackendUrl::parse("http://127.0.0.1:8000").expect("ok");
        assert_eq!((u.tls, u.host.as_str(), u.port, u.base_path.as_str()), (false, "127.0.0.1", 8000, ""));
        let u = BackendUrl::parse("https://gpu-1.internal/v2/").expect("ok");
        assert_eq!((u.tls, u.port, u.base_path.as_str()), (true, 443, "/v2"));
        assert_eq!(u.to_string(), "https://gpu-1.internal:443/v2");
        let u = BackendUrl::parse("http://[::1]:9000").expect("ok");
        assert_eq!((u.host.as_str(), u.port), ("::1", 9000));
        assert_eq!(u.authority(), "[::1]:9000");
        // IPv6 without a port (it was refused as "bad port"), with a path.
        let u = BackendUrl::parse("http://[::1]/v1").expect("ok");
        assert_eq!((u.host.as_str(), u.port, u.base_path.as_str()), ("::1", 80, "/v1"));
        let u = BackendUrl::parse("https://[2001:db8::7]").expect("ok");
        assert_eq!(
            (u.host.as_str(), u.port, u.authority().as_str()),
            ("2001:db8::7", 443, "[2001:db8::7]:443")
        );
        for bad in [
            "127.0.0.1:8000",
            "ftp://x",
            "http://",
            "http://h:port",
            "http://h:1/a?b",
            "http://h/a#b",
            "http://user:pw@h",
            "http://h:/",
            "http://h:70000",
            "http://::1/v1",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn values_from_the_environment() {
        std::env::set_var("WARMPATH_TYPES_TEST_URL", "redis://:pw@cache:6390");
        assert_eq!(from_env("plain").as_deref(), Ok("plain"));
        assert_eq!(from_env("$WARMPATH_TYPES_TEST_URL").as_deref(), Ok("redis://:pw@cache:6390"));
        assert!(from_env("$WARMPATH_TYPES_TEST_UNSET").is_err());
        let u: RedisUrl = toml::from_str::<toml::Value>("u = \"$WARMPATH_TYPES_TEST_URL\"").expect("toml")
            ["u"]
            .clone()
            .try_into()
            .expect("url from the environment");
        assert_eq!((u.addr.as_str(), u.password.as_deref()), ("cache:6390", Some("pw")));
    }

    #[test]
    fn redis_urls() {
        let u = RedisUrl::parse("redis://127.0.0.1:6390/2").expect("url");
        assert_eq!((u.addr.as_str(), u.db, u.password), ("127.0.0.1:6390", 2, None));
        let u = RedisUrl::parse("redis://:secret@cache").expect("url");
        assert_eq!((u.addr.as_str(), u.user, u.password.as_deref()), ("cache:6379", None, Some("secret")));
        let u = RedisUrl::parse("redis://app:pw@h:1/").expect("url");
        assert_eq!((u.user.as_deref(), u.password.as_deref(), u.db), (Some("app"), Some("pw"), 0));
        assert!(RedisUrl::parse("http://h").is_err());
        assert!(RedisUrl::parse("redis:///0").is_err());
        assert!(RedisUrl::parse("redis://h/x").is_err());
    }
}
