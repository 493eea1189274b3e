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

/// A Redis server's URL, as the `redis` crate reads it: `redis://[[user]:password@]host[:port][/db]`,
/// `rediss://…` for TLS, `redis+unix:///path`. Its password is never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(String);

impl RedisUrl {
    pub fn parse(url: &str) -> Result<RedisUrl, String> {
        use redis::IntoConnectionInfo;
        let info = url.into_connection_info().map_err(|e| format!("{:?}: {e}", redact(url)))?;
        if let redis::ConnectionAddr::Tcp(h, _) | redis::ConnectionAddr::TcpTls { host: h, .. } = info.addr()
        {
            if h.is_empty() {
                return Err(format!("{:?}: no host", redact(url)));
            }
        }
        Ok(RedisUrl(url.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A URL with the password in its user part replaced by `***`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    match rest.split_once('@') {
        Some((user, host)) if user.contains(':') => {
            let name = user.split_once(':').map_or("", |(n, _)| n);
            format!("{scheme}://{name}:***@{host}")
        }
        _ => url.to_owned(),
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", redact(&self.0))
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
        assert_eq!(u.as_str(), "redis://:pw@cache:6390");
        assert_eq!(format!("{u:?}"), "\"redis://:***@cache:6390\"");
    }

    #[test]
    fn redis_urls() {
        for good in
            ["redis://127.0.0.1:6390/2", "redis://:secret@cache", "redis://app:pw@h:1/", "rediss://h:6380"]
        {
            assert_eq!(RedisUrl::parse(good).expect(good).as_str(), good);
        }
        for bad in ["http://h", "redis:///0", "redis://h/x"] {
            assert!(RedisUrl::parse(bad).is_err(), "{bad}");
        }
        let e = RedisUrl::parse("redis://u:hunter2@h/x").expect_err("bad db");
        assert!(!e.contains("hunter2"), "{e}");
    }
}
