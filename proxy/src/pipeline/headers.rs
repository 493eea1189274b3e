//! The response header the client gets from a backend's: everything but hop-by-hop fields,
//! plus warmpath's own `x-warmpath-*` headers that say where the request went and why.

use http::header::HeaderName;
use pingora::http::ResponseHeader;

use crate::request::head::HOP_BY_HOP;

/// warmpath's own response headers beside `x-warmpath-backend`.
#[derive(Debug, Clone, Copy)]
pub(super) struct WarmpathHeaders<'a> {
    /// `x-warmpath-route`: policy and reason.
    pub route: &'a str,
    /// `x-warmpath-prefix-hash`, where the prompt was cut into blocks.
    pub prefix: Option<&'a str>,
    /// `x-warmpath-cache`, where the pool has a response cache.
    pub cache: Option<&'a str>,
}

/// Response headers warmpath does not copy: hop-by-hop ones and those framing sets again.
fn skip_response_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    HOP_BY_HOP.contains(&n) || matches!(n, "date" | "content-length")
}

/// What the client sees of the backend's header `up`, from `backend`; the caller sets the
/// framing (a length, or chunked).
pub(super) fn response_header(
    up: &ResponseHeader,
    backend: &str,
    headers: WarmpathHeaders<'_>,
) -> pingora::Result<ResponseHeader> {
    let mut resp = ResponseHeader::build(up.status, Some(up.headers.len() + 4))?;
    for (n, v) in up.headers.iter().filter(|(n, _)| !skip_response_header(n)) {
        resp.append_header(n.clone(), v.clone())?;
    }
    resp.insert_header("x-warmpath-backend", backend)?;
    resp.insert_header("x-warmpath-route", headers.route)?;
    if let Some(p) = headers.prefix {
        resp.insert_header("x-warmpath-prefix-hash", p)?;
    }
    if let Some(c) = headers.cache {
        resp.insert_header("x-warmpath-cache", c)?;
    }
    Ok(resp)
}

/// The answer is an event stream.
pub(super) fn is_sse(h: &ResponseHeader) -> bool {
    h.headers.get(http::header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}
