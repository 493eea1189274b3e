//! A closed-loop HTTP/1.1 load generator: `concurrency` keep-alive connections, each sending the
//! same POST back to back until `total` requests are done; per-request latency recorded.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

#[derive(Debug, Default)]
pub struct LoadResult {
    pub latencies: Vec<Duration>,
    pub wall: Duration,
    pub errors: usize,
}

impl LoadResult {
    /// The `p` quantile of the latencies, in milliseconds (NaN without any).
    pub fn percentile_ms(&self, p: f64) -> f64 {
        crate::stats::quantile(self.latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect(), p)
    }

    pub fn rps(&self) -> f64 {
        self.latencies.len() as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

pub type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// How a load client talks to its target: plain or TLS, with or without an API key, on
/// kept-alive connections or a new one per request.
#[derive(Clone, Default)]
pub struct Client {
    /// TLS to the name `localhost`, resuming sessions as the config says.
    pub tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
    /// `Authorization` on every request.
    pub auth: Option<String>,
    /// A new connection for every request: each pays the TCP (and TLS) handshake.
    pub fresh: bool,
}

/// A keep-alive HTTP/1.1 client connection to `addr`.
pub async fn connect(addr: SocketAddr) -> anyhow::Result<Sender> {
    connect_with(addr, &Client::default()).await
}

/// [`connect`] as `client` says (TLS where it has a config).
pub async fn connect_with(addr: SocketAddr, client: &Client) -> anyhow::Result<Sender> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let Some(tls) = &client.tls else {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        return Ok(sender);
    };
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost")?;
    let stream = tokio_rustls::TlsConnector::from(tls.clone()).connect(name, stream).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// One request; `Ok((status, reusable))` once the whole body is in. `reusable` is false when
/// the server announced `connection: close` (nginx does every `keepalive_requests`), so the
/// caller reconnects instead of counting the next request's reset as an error.
pub async fn send(
    sender: &mut Sender,
    addr: SocketAddr,
    path: &str,
    body: &Bytes,
) -> anyhow::Result<(u16, bool)> {
    send_as(sender, addr, path, body, None).await
}

/// [`send`] with `auth` as the `Authorization` header.
pub async fn send_as(
    sender: &mut Sender,
    addr: SocketAddr,
    path: &str,
    body: &Bytes,
    auth: Option<&str>,
) -> anyhow::Result<(u16, bool)> {
    let mut req = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let req = req.body(Full::new(body.clone()))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let close = resp
        .headers()
        .get(hyper::header::CONNECTION)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    resp.into_body().collect().await?;
    Ok((status, !close && !sender.is_closed()))
}

/// A closed loop of `total` requests over `concurrency` connections, `client`'s transport, key
/// and connection reuse; responses with status `expect` count as successes.
pub async fn run(
    addr: SocketAddr,
    path: &'static str,
    body: Bytes,
    concurrency: usize,
    total: usize,
    expect: u16,
    client: &Client,
) -> LoadResult {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, body, client) = (next.clone(), body.clone(), client.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut errors = 0;
                let mut sender = None;
                while next.fetch_add(1, Ordering::Relaxed) < total {
                    if sender.is_none() {
                        sender = connect_with(addr, &client).await.ok();
                    }
                    let Some(s) = sender.as_mut() else {
                        errors += 1;
                        continue;
                    };
                    let t = Instant::now();
                    match send_as(s, addr, path, &body, client.auth.as_deref()).await {
                        Ok((status, reusable)) => {
                            if status == expect {
                                lat.push(t.elapsed());
                            } else {
                                errors += 1;
                            }
                            if !reusable || client.fresh {
                                sender = None;
                            }
                        }
                        Err(_) => {
                            errors += 1;
                            sender = None;
                        }
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let mut out = LoadResult::default();
    for t in tasks {
        if let Ok((lat, errors)) = t.await {
            out.latencies.extend(lat);
            out.errors += errors;
        }
    }
    out.wall = start.elapsed();
    out
}
