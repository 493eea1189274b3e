//! The client's request head as forwarding needs it: the headers that go on to a backend
//! (hop-by-hop ones dropped), the session key, cache directives and credentials; and the
//! upstream request header built from it for each backend.

use std::sync::Arc;

use http::header::{self, HeaderName};
use pingora::http::RequestHeader;

/// Hop-by-hop headers (RFC 9110 §7.6.1): never forwarded in either direction.
pub const HOP_BY_HOP: [&str; 7] =
    ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"];

/// Request headers warmpath does not forward: hop-by-hop ones, a WebSocket handshake's (a
/// turn of a connection is a plain request to the backend), and those it sets per backend.
fn skip_request_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n)
        || n.starts_with("sec-websocket-")
        || matches!(n, "host" | "content-length" | "expect" | "proxy-authorization")
}

/// One turn of a conversation as checks read it: its role and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// `user`, `assistant`, `system`, `tool`.
    pub role: String,
    pub text: String,
}

/// A conversation's texts as a caller that keeps the conversation knows them: the turns
/// judged in earlier requests (`context`, the most recent ones) and this request's new ones.
#[derive(Debug, Clone, Default)]
pub struct TurnTexts {
    pub context: Vec<Turn>,
    pub new: Vec<Turn>,
}

/// What one request's forwarding reads of the client's request head.
pub struct Head {
    pub template: RequestTemplate,
    /// `x-session-id`: a routing session key.
    pub session_id: Option<String>,
    pub cache_control: CacheDirectives,
    authorization: Option<Vec<u8>>,
    /// The caller's API key name, where warmpath checks keys (`[auth]`).
    pub key: Option<Arc<str>>,
    /// The conversation's texts, where the caller knows which are new (a Responses turn): the
    /// input checks read these instead of the body.
    pub texts: Option<Arc<TurnTexts>>,
    /// `x-warmpath-priority`: its place in a full pool's queue (higher first; with API keys,
    /// at most the key's own).
    pub priority: Option<i64>,
}

impl Head {
    pub fn of(req: &RequestHeader) -> Head {
        let header = |n: &str| req.headers.get(n).map(|v| v.as_bytes());
        Head {
            template: upstream_template(req),
            session_id: header("x-session-id").and_then(|v| std::str::from_utf8(v).ok()).map(str::to_owned),
            cache_control: CacheDirectives::parse(header(header::CACHE_CONTROL.as_str())),
            authorization: header(header::AUTHORIZATION.as_str()).map(<[u8]>::to_vec),
            key: None,
            texts: None,
            priority: header("x-warmpath-priority")
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.trim().parse().ok()),
        }
    }

    /// The caller authenticated as API key `key`: the key is warmpath's, so it is not sent on
    /// to backends, and the caller is known by the key's name.
    pub fn with_key(mut self, key: Option<Arc<str>>) -> Head {
        if key.is_some() {
            self.template.headers.retain(|(n, _)| n != header::AUTHORIZATION);
        }
        self.key = key;
        self
    }

    /// The same head sent to another path (a translated request), POST, with JSON in.
    pub fn for_path(&self, path: &str) -> Head {
        let mut template = RequestTemplate {
            path: path.as_bytes().to_vec(),
            method: http::Method::POST,
            headers: self.template.headers.clone(),
        };
        // Not the client's content type: the body is warmpath's.
        template.headers.retain(|(n, _)| n != header::CONTENT_TYPE && n != header::ACCEPT);
        template.headers.push((header::CONTENT_TYPE, http::HeaderValue::from_static("application/json")));
        Head {
            template,
            session_id: self.session_id.clone(),
            cache_control: self.cache_control,
            authorization: self.authorization.clone(),
            key: self.key.clone(),
            texts: self.texts.clone(),
            priority: self.priority,
        }
    }

    /// Routes by this session key (where the client gave none of its own).
    /// The conversation's texts, split into those checked before and the new ones.
    pub fn with_texts(mut self, texts: TurnTexts) -> Head {
        self.texts = Some(Arc::new(texts));
        self
    }

    pub fn with_session(mut self, key: Option<String>) -> Head {
        if self.session_id.is_none() {
            self.session_id = key;
        }
        self
    }

    /// Who the caller is, for what is kept per caller (stored conversations, cached answers):
    /// its API key's name where warmpath checks keys, else the `Authorization` it sent.
    pub fn owner(&self) -> Option<&[u8]> {
        match &self.key {
            Some(k) => Some(k.as_bytes()),
            None => self.authorization.as_deref(),
        }
    }
}

/// The client's path and headers, minus what is per hop: what each backend's request header is
/// built from (`Host` and the body length are set per backend).
pub struct RequestTemplate {
    path: Vec<u8>,
    method: http::Method,
    headers: Vec<(HeaderName, http::HeaderValue)>,
}

fn upstream_template(req: &RequestHeader) -> RequestTemplate {
    let headers = req
        .headers
        .iter()
        .filter(|(n, _)| !skip_request_header(n))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    RequestTemplate { path: req.raw_path().to_vec(), method: req.method.clone(), headers }
}

impl RequestTemplate {
    /// A header the client sent that goes on to backends.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.as_str() == name).and_then(|(_, v)| v.to_str().ok())
    }

    /// The method, path (query included) and headers the backend gets.
    pub fn parts(&self) -> (&http::Method, &[u8], &[(HeaderName, http::HeaderValue)]) {
        (&self.method, &self.path, &self.headers)
    }
}

/// What the client's `Cache-Control` asks of warmpath's response cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheDirectives {
    /// `no-cache`: do not answer from the cache (the answer may still be kept).
    pub no_lookup: bool,
    /// `no-store`: neither answer from nor keep.
    pub no_store: bool,
}

impl CacheDirectives {
    pub fn parse(header: Option<&[u8]>) -> CacheDirectives {
        let mut d = CacheDirectives::default();
        let Some(h) = header.and_then(|h| std::str::from_utf8(h).ok()) else { return d };
        for part in h.split(',') {
            match part.trim().to_ascii_lowercase().as_str() {
                "no-cache" => d.no_lookup = true,
                "no-store" => {
                    d.no_lookup = true;
                    d.no_store = true;
                }
                _ => {}
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_control() {
        assert_eq!(CacheDirectives::parse(None), CacheDirectives::default());
        assert_eq!(
            CacheDirectives::parse(Some(b"max-age=0, No-Cache")),
            CacheDirectives { no_lookup: true, no_store: false }
        );
        assert_eq!(
            CacheDirectives::parse(Some(b"no-store")),
            CacheDirectives { no_lookup: true, no_store: true }
        );
    }
}
