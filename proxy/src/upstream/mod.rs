//! Talking to backends: the shared [`Upstream`] (connections made or taken from a backend's
//! idle pool), each backend's [`Peer`] (where and how to connect, its idle connections), a
//! small `GET` and `POST` for probes, model lists and moderation, and the classification of
//! errors into what the proxy acts on (retry or not, eject or not, which status the client
//! gets). The HTTP/1.1 exchange itself is warmpath's own ([`conn`], [`wire`]).

pub mod conn;
pub mod dns;
pub mod idle;
pub mod wire;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::connectors::{ConnectorOptions, TransportConnector};
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorType};
use tokio::net::TcpStream;

use self::conn::{Conn, Io};
use self::idle::IdlePool;
use self::wire::RequestHead;
use crate::config::{BackendUrl, StreamAcks, UpstreamConfig};
use crate::request::head::RequestTemplate;

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
    /// Connections to it between requests.
    pub idle: IdlePool,
    /// `[upstream] stream_acks = "quick"`.
    quick_acks: bool,
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
        Ok(Peer {
            authority: url.authority(),
            url,
            http: peer,
            authorization: None,
            idle: IdlePool::default(),
            quick_acks: up.stream_acks == StreamAcks::Quick,
        })
    }

    /// The address it connects to.
    pub fn addr(&self) -> Option<SocketAddr> {
        match &self.http._address {
            pingora::protocols::l4::socket::SocketAddr::Inet(a) => Some(*a),
            _ => None,
        }
    }

    /// Puts the backend's own key on a request to it, where it has one.
    pub fn authorize(&self, req: &mut RequestHead) {
        if let Some(a) = &self.authorization {
            req.header("authorization", a.as_bytes());
        }
    }

    /// The head of a forwarded request to this backend, as sent: `template`'s method, path
    /// (after the backend's base path) and headers, `Host` and `Content-Length` set, and the
    /// backend's own key in place of the client's `Authorization` where it has one.
    pub fn request_head(&self, template: &RequestTemplate, body_len: usize) -> Vec<u8> {
        let (method, path, headers) = template.parts();
        let room: usize = headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum();
        let mut req =
            RequestHead::new(method.as_str(), &self.url.base_path, path, room + self.authority.len() + 48);
        req.header("host", self.authority.as_bytes());
        let own_key = self.authorization.is_some();
        for (n, v) in headers {
            if !(own_key && n == http::header::AUTHORIZATION) {
                req.header(n.as_str(), v.as_bytes());
            }
        }
        self.authorize(&mut req);
        req.content_length(body_len);
        req.finish()
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

/// The upstream side, one for the whole process: how connections are made (TLS settings) and
/// how long an idle one is kept.
pub struct Upstream {
    /// TCP + TLS for `https://` backends (roots, client certificate, SNI, ALPN).
    tls: TransportConnector,
    /// How long a released connection may idle in its backend's pool.
    pub pool_idle: Duration,
}

impl Upstream {
    /// `ca_file`: the roots `https://` backends are checked against (the system's, when
    /// none); `client`: warmpath's certificate and key for backends that ask (mTLS).
    pub fn new(pool_idle: Duration, ca_file: Option<&Path>, client: Option<(&Path, &Path)>) -> Upstream {
        let mut options = ConnectorOptions::new(1);
        options.ca_file = ca_file.map(|p| p.display().to_string());
        options.cert_key_file = client.map(|(c, k)| (c.display().to_string(), k.display().to_string()));
        Upstream { tls: TransportConnector::new(Some(options)), pool_idle }
    }

    /// A connection to `backend` (idle or new; `true` when reused) with the backend's idle
    /// timeout on every read and write.
    pub async fn connect(&self, peer: &Peer) -> Result<(Conn, bool), Box<Error>> {
        let timeout = peer.http.options.read_timeout;
        if let Some(c) = peer.idle.take(self.pool_idle) {
            return Ok((c, true));
        }
        let io = if peer.url.tls {
            Io::Tls(self.tls.new_stream(&peer.http).await?)
        } else {
            let addr = peer.addr().ok_or_else(|| Error::explain(ErrorType::ConnectError, "no address"))?;
            Io::Tcp(dial(addr, peer.http.options.connection_timeout).await?)
        };
        Ok((Conn::new(io, timeout, peer.quick_acks), false))
    }

    /// Hands a connection back after its exchange: kept for the next request when its
    /// response was read to the end and the backend keeps it open, else closed.
    pub fn release(&self, mut conn: Conn, peer: &Peer) {
        if conn.reusable() {
            conn.park();
            peer.idle.put(conn);
        }
    }
}

/// A TCP connection to `addr`, without Nagle's delay (a request is written whole).
async fn dial(addr: SocketAddr, timeout: Option<Duration>) -> Result<TcpStream, Box<Error>> {
    let connect = TcpStream::connect(addr);
    let stream = match timeout {
        Some(t) => tokio::time::timeout(t, connect)
            .await
            .map_err(|_| Error::explain(ErrorType::ConnectTimedout, format!("connecting to {addr}")))?,
        None => connect.await,
    }
    .map_err(|e| {
        let kind = match e.kind() {
            std::io::ErrorKind::ConnectionRefused => ErrorType::ConnectRefused,
            std::io::ErrorKind::TimedOut => ErrorType::ConnectTimedout,
            _ => ErrorType::ConnectError,
        };
        Error::because(kind, format!("connecting to {addr}"), e)
    })?;
    stream.set_nodelay(true).map_err(|e| Error::because(ErrorType::SocketError, "TCP_NODELAY", e))?;
    Ok(stream)
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
    let mut req = RequestHead::new("POST", &peer.url.base_path, path.as_bytes(), 128);
    req.header("host", peer.authority.as_bytes());
    req.header("content-type", b"application/json");
    req.content_length(body.len());
    if let Some(key) = bearer {
        req.header("authorization", format!("Bearer {key}").as_bytes());
    }
    exchange(up, peer, req.finish(), &body).await
}

/// `GET {base}{path}` with a deadline; the status and body (at most 4 MiB).
pub async fn get(up: &Upstream, peer: &Peer, path: &str, timeout: Duration) -> Result<(u16, Bytes), String> {
    let mut req = RequestHead::new("GET", &peer.url.base_path, path.as_bytes(), 64);
    req.header("host", peer.authority.as_bytes());
    peer.authorize(&mut req);
    let call = exchange(up, peer, req.finish(), b"");
    tokio::time::timeout(timeout, call).await.map_err(|_| format!("no answer within {timeout:?}"))?
}

/// Sends one request and reads its response whole: the status and body (at most 4 MiB); the
/// connection goes back to the pool.
async fn exchange(up: &Upstream, peer: &Peer, head: Vec<u8>, body: &[u8]) -> Result<(u16, Bytes), String> {
    let (mut s, _) = up.connect(peer).await.map_err(|e| e.to_string())?;
    s.send(&head, body).await.map_err(|e| e.to_string())?;
    let status = s.read_response_header().await.map_err(|e| e.to_string())?.status.as_u16();
    let mut body = BytesMut::new();
    while let Some(chunk) = s.read_response_body().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > 4 << 20 {
            return Err("response over 4 MiB".to_owned());
        }
        body.extend_from_slice(&chunk);
    }
    up.release(s, peer);
    Ok((status, body.freeze()))
}
