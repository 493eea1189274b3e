//! Talking to backends through pingora's connector pool: the shared [`Upstream`], each
//! backend's [`Peer`] (where and how to connect), a small `GET` for probes and model lists, and
//! the classification of pingora's errors into what the proxy acts on (retry or not, eject or
//! not, which status the client gets).

pub mod dns;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::connectors::http::Connector;
use pingora::connectors::ConnectorOptions;
use pingora::http::RequestHeader;
use pingora::protocols::http::client::HttpSession;
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorType};

use crate::config::{BackendUrl, UpstreamConfig};

/// One backend's address as the connector uses it.
#[derive(Debug)]
pub struct Peer {
    pub url: BackendUrl,
    /// `host:port`, the `Host` header of every request.
    pub authority: String,
    /// The connection template (resolved address, TLS, timeouts).
    pub http: HttpPeer,
    /// `Authorization` for every request to this backend (its own API key), replacing the
    /// client's.
    authorization: Option<http::HeaderValue>,
}

impl Peer {
    /// Whether this peer is what `url` at `addr` with key `key` would make (a reload keeps the
    /// backend).
    pub fn is(&self, url: &BackendUrl, addr: SocketAddr, key: Option<&str>) -> bool {
        self.url.to_string() == url.to_string()
            && self.addr() == Some(addr)
            && self.authorization.as_ref().map(|v| v.as_bytes().to_vec())
                == key.map(|k| format!("Bearer {k}").into_bytes())
    }

    /// The connection template of a backend at `addr`, resolved from `url`'s host beforehand
    /// ([`dns`]): pingora's own resolution would block the worker thread.
    pub fn new(url: BackendUrl, addr: SocketAddr, up: &UpstreamConfig) -> Result<Peer, String> {
        let mut peer = HttpPeer::new(addr, url.tls, url.host.clone());
        let ms = Duration::from_millis;
        peer.options.connection_timeout = Some(ms(up.connect_timeout_ms));
        peer.options.total_connection_timeout = Some(ms(up.connect_timeout_ms.saturating_mul(2)));
        peer.options.read_timeout = Some(ms(up.idle_timeout_ms));
        peer.options.write_timeout = Some(ms(up.idle_timeout_ms));
        peer.options.idle_timeout = Some(ms(up.pool_idle_timeout_ms));
        Ok(Peer { authority: url.authority(), url, http: peer, authorization: None })
    }

    /// The address it connects to.
    pub fn addr(&self) -> Option<SocketAddr> {
        match &self.http._address {
            pingora::protocols::l4::socket::SocketAddr::Inet(a) => Some(*a),
            _ => None,
        }
    }

    /// Puts the backend's own key on a request to it (in place of the client's), where it has
    /// one: every request to a backend is built through here.
    pub fn authorize(&self, req: &mut RequestHeader) -> pingora::Result<()> {
        if let Some(a) = &self.authorization {
            req.insert_header(http::header::AUTHORIZATION, a.clone())?;
        }
        Ok(())
    }

    /// The backend's own API key, sent on every request to it.
    pub fn set_api_key(&mut self, key: Option<&str>) -> Result<(), String> {
        self.authorization = match key {
            None => None,
            Some(k) => {
                let mut v = http::HeaderValue::from_str(&format!("Bearer {k}"))
                    .map_err(|_| "a backend API key must be printable ASCII".to_owned())?;
                v.set_sensitive(true);
                Some(v)
            }
        };
        Ok(())
    }
}

/// The upstream side: one connector (and its connection pool) for the whole process.
pub struct Upstream {
    pub connector: Connector,
    /// How long a released connection may idle in the pool.
    pub pool_idle: Duration,
}

impl Upstream {
    /// `ca_file`: the roots `https://` backends are checked against (the system's, when
    /// none); `client`: warmpath's certificate and key for backends that ask (mTLS).
    pub fn new(pool_idle: Duration, ca_file: Option<&Path>, client: Option<(&Path, &Path)>) -> Upstream {
        let mut options = ConnectorOptions::new(128);
        options.ca_file = ca_file.map(|p| p.display().to_string());
        options.cert_key_file = client.map(|(c, k)| (c.display().to_string(), k.display().to_string()));
        Upstream { connector: Connector::new(Some(options)), pool_idle }
    }

    /// A connection to `backend` (pooled or new; `true` when reused) with the idle timeout on
    /// every read and write: pingora's connector leaves the peer's timeouts to its proxy loop.
    pub async fn connect(&self, peer: &Peer) -> Result<(HttpSession, bool), Box<Error>> {
        let (mut s, reused) = self.connector.get_http_session(&peer.http).await?;
        s.set_read_timeout(peer.http.options.read_timeout);
        s.set_write_timeout(peer.http.options.write_timeout);
        Ok((s, reused))
    }

    /// Returns a connection whose response was read to the end to the pool.
    pub async fn release(&self, session: HttpSession, peer: &Peer) {
        self.connector.release_http_session(session, &peer.http, Some(self.pool_idle)).await;
    }
}

/// What went wrong with a backend, as far as the proxy cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// No connection (refused, unreachable, TLS, connect timeout).
    Connect,
    /// The backend went silent past the idle timeout.
    Timeout,
    /// The connection broke or the backend spoke broken HTTP.
    Io,
}

impl FailKind {
    pub fn of(e: &Error) -> FailKind {
        use ErrorType::*;
        match e.etype() {
            ConnectTimedout | ConnectRefused | ConnectNoRoute | TLSHandshakeFailure
            | TLSHandshakeTimedout | InvalidCert | HandshakeError | ConnectError | BindError
            | SocketError | ConnectProxyFailure => FailKind::Connect,
            ReadTimedout | WriteTimedout => FailKind::Timeout,
            _ => FailKind::Io,
        }
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            FailKind::Connect => "connect",
            FailKind::Timeout => "timeout",
            FailKind::Io => "io",
        }
    }
}

/// `POST {base}{path}` of a JSON body (with a bearer token where given); the status and body
/// (at most 4 MiB). The caller sets the deadline.
pub async fn post_json(
    up: &Upstream,
    peer: &Peer,
    path: &str,
    body: Bytes,
    bearer: Option<&str>,
) -> Result<(u16, Bytes), String> {
    let full = format!("{}{path}", peer.url.base_path);
    let (mut s, _) = up.connect(peer).await.map_err(|e| e.to_string())?;
    let mut req = RequestHeader::build("POST", full.as_bytes(), Some(4)).map_err(|e| e.to_string())?;
    let e = |e: Box<Error>| e.to_string();
    req.insert_header(http::header::HOST, peer.authority.as_str()).map_err(e)?;
    req.insert_header(http::header::CONTENT_TYPE, "application/json").map_err(e)?;
    req.insert_header(http::header::CONTENT_LENGTH, body.len().to_string()).map_err(e)?;
    if let Some(key) = bearer {
        req.insert_header(http::header::AUTHORIZATION, format!("Bearer {key}")).map_err(e)?;
    }
    s.write_request_header(Box::new(req)).await.map_err(e)?;
    s.write_request_body(body, true).await.map_err(e)?;
    s.finish_request_body().await.map_err(e)?;
    read_whole(up, peer, s).await
}

/// Reads a response whose request is sent: its status and body (at most 4 MiB); the connection
/// goes back to the pool.
async fn read_whole(up: &Upstream, peer: &Peer, mut s: HttpSession) -> Result<(u16, Bytes), String> {
    s.read_response_header().await.map_err(|e| e.to_string())?;
    let status = s.response_header().map(|h| h.status.as_u16()).unwrap_or(0);
    let mut body = BytesMut::new();
    while let Some(chunk) = s.read_response_body().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > 4 << 20 {
            return Err("response over 4 MiB".to_owned());
        }
        body.extend_from_slice(&chunk);
    }
    up.release(s, peer).await;
    Ok((status, body.freeze()))
}

/// `GET {base}{path}` with a deadline; the status and body (at most 4 MiB).
pub async fn get(up: &Upstream, peer: &Peer, path: &str, timeout: Duration) -> Result<(u16, Bytes), String> {
    let call = async {
        let full = format!("{}{path}", peer.url.base_path);
        let (mut s, _) = up.connect(peer).await.map_err(|e| e.to_string())?;
        let mut req = RequestHeader::build("GET", full.as_bytes(), Some(2)).map_err(|e| e.to_string())?;
        req.insert_header(http::header::HOST, peer.authority.as_str()).map_err(|e| e.to_string())?;
        peer.authorize(&mut req).map_err(|e| e.to_string())?;
        s.write_request_header(Box::new(req)).await.map_err(|e| e.to_string())?;
        s.finish_request_body().await.map_err(|e| e.to_string())?;
        read_whole(up, peer, s).await
    };
    tokio::time::timeout(timeout, call).await.map_err(|_| format!("no answer within {timeout:?}"))?
}
