//! The client's request head as forwarding needs it: the headers that go on to a backend
//! (hop-by-hop ones dropped), the session key, cache directives and credentials; and the
//! upstream request header built from it for each backend.

use http::header::{self, HeaderName};
use pingora::http::RequestHeader;

use super::client::request_header;
use crate::cache::Directives;
use crate::route::Backend;

/// Hop-by-hop headers (RFC 9110 §7.6.1): never forwarded in either direction.
pub(super) const HOP_BY_HOP: [&str; 7] =
    ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"];

/// Request headers warmpath does not forward: hop-by-hop ones, a WebSocket handshake's (a
/// turn of a connection is a plain request to the backend), and those it sets per backend.
fn skip_request_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n)
        || n.starts_with("sec-websocket-")
        || matches!(n, "host" | "content-length" | "expect" | "proxy-authorization")
}

/// What one request's forwarding reads of the client's request head.
pub struct Head {
    pub(super) template: Template,
    /// `x-session-id`: a routing session key.
    pub(super) session_id: Option<String>,
    pub(super) cache_control: Directives,
    authorization: Option<Vec<u8>>,
}

impl Head {
    pub fn of(req: &RequestHeader) -> Head {
        let header = |n: &str| req.headers.get(n).map(|v| v.as_bytes());
        Head {
            template: upstream_template(req),
            session_id: header("x-session-id").and_then(|v| std::str::from_utf8(v).ok()).map(str::to_owned),
            cache_control: Directives::parse(header(header::CACHE_CONTROL.as_str())),
            authorization: header(header::AUTHORIZATION.as_str()).map(<[u8]>::to_vec),
        }
    }

    /// The same head sent to another path (a translated request), POST, with JSON in.
    pub fn for_path(&self, path: &str) -> Head {
        let mut template = Template {
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
        }
    }

    /// Routes by this session key (where the client gave none of its own).
    pub fn with_session(mut self, key: Option<String>) -> Head {
        if self.session_id.is_none() {
            self.session_id = key;
        }
        self
    }

    pub fn authorization(&self) -> Option<&[u8]> {
        self.authorization.as_deref()
    }
}

/// The client's path and headers, minus what is per hop; `Host` and the body length are set
/// per backend.
pub struct Template {
    path: Vec<u8>,
    method: http::Method,
    headers: Vec<(HeaderName, http::HeaderValue)>,
}

fn upstream_template(req: &RequestHeader) -> Template {
    let headers = req
        .headers
        .iter()
        .filter(|(n, _)| !skip_request_header(n))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    Template { path: req.raw_path().to_vec(), method: req.method.clone(), headers }
}

pub fn build_request(t: &Template, backend: &Backend, body_len: usize) -> pingora::Result<RequestHeader> {
    let mut path = Vec::with_capacity(backend.url.base_path.len() + t.path.len());
    path.extend_from_slice(backend.url.base_path.as_bytes());
    path.extend_from_slice(&t.path);
    let mut req = request_header(t.method.as_str(), &path, backend)?;
    for (n, v) in &t.headers {
        req.append_header(n.clone(), v.clone())?;
    }
    req.insert_header(header::CONTENT_LENGTH, body_len.to_string())?;
    Ok(req)
}
