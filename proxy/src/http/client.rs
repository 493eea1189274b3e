//! Talking to backends through pingora's connector pool: the shared [`Upstream`], a small
//! `GET` for probes and model lists, and the classification of pingora's errors into what the
//! proxy acts on (retry or not, eject or not, which status the client gets).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::protocols::http::client::HttpSession;
use pingora::{Error, ErrorType};

use crate::route::Backend;

/// The upstream side: one connector (and its connection pool) for the whole process.
pub struct Upstream {
    pub connector: Connector,
    /// How long a released connection may idle in the pool.
    pub pool_idle: Duration,
}

impl Upstream {
    pub fn new(pool_idle: Duration) -> Upstream {
        Upstream { connector: Connector::new(None), pool_idle }
    }

    /// A connection to `backend` (pooled or new; `true` when reused) with the idle timeout on
    /// every read and write: pingora's connector leaves the peer's timeouts to its proxy loop.
    pub async fn connect(&self, backend: &Backend) -> Result<(HttpSession, bool), Box<Error>> {
        let (mut s, reused) = self.connector.get_http_session(&backend.peer).await?;
        s.set_read_timeout(backend.peer.options.read_timeout);
        s.set_write_timeout(backend.peer.options.write_timeout);
        Ok((s, reused))
    }

    /// Returns a connection whose response was read to the end to the pool.
    pub async fn release(&self, session: HttpSession, backend: &Backend) {
        self.connector.release_http_session(session, &backend.peer, Some(self.pool_idle)).await;
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

/// A request header for `path` (already including the backend's base path) with `Host` set.
pub fn request_header(method: &str, path: &[u8], backend: &Backend) -> Result<RequestHeader, Box<Error>> {
    let mut req = RequestHeader::build(method, path, Some(8))?;
    req.insert_header(http::header::HOST, backend.url.authority())?;
    Ok(req)
}

/// `GET {base}{path}` with a deadline; the status and body (at most 4 MiB).
pub async fn get(
    up: &Upstream,
    backend: &Backend,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), String> {
    let call = async {
        let full = format!("{}{path}", backend.url.base_path);
        let (mut s, _) = up.connect(backend).await.map_err(|e| e.to_string())?;
        let req = request_header("GET", full.as_bytes(), backend).map_err(|e| e.to_string())?;
        s.write_request_header(Box::new(req)).await.map_err(|e| e.to_string())?;
        s.finish_request_body().await.map_err(|e| e.to_string())?;
        s.read_response_header().await.map_err(|e| e.to_string())?;
        let status = s.response_header().map(|h| h.status.as_u16()).unwrap_or(0);
        let mut body = BytesMut::new();
        while let Some(chunk) = s.read_response_body().await.map_err(|e| e.to_string())? {
            if body.len() + chunk.len() > 4 << 20 {
                return Err("response over 4 MiB".to_owned());
            }
            body.extend_from_slice(&chunk);
        }
        up.release(s, backend).await;
        Ok((status, body.freeze()))
    };
    tokio::time::timeout(timeout, call).await.map_err(|_| format!("no answer within {timeout:?}"))?
}
