//! A small Redis client: RESP2 over TCP, the four commands the conversation store needs
//! (`AUTH`, `SELECT`, `SET … PX`, `GET`), a few pooled connections, every command under a
//! deadline. A connection that fails is dropped, and the next command dials a new one.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use crate::config::RedisUrl;

/// Idle connections kept for reuse.
const POOL: usize = 8;
/// Largest bulk reply read (a stored conversation).
const MAX_BULK: usize = 512 << 20;

/// A reply, as far as these commands need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Ok(String),
    Err(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis: {0}")]
    Io(#[from] std::io::Error),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis error: {0}")]
    Server(String),
    #[error("redis protocol: {0}")]
    Protocol(String),
}

type Conn = BufReader<TcpStream>;

pub struct Redis {
    url: RedisUrl,
    timeout: Duration,
    idle: Mutex<Vec<Conn>>,
}

impl Redis {
    pub fn new(url: RedisUrl, timeout: Duration) -> Redis {
        Redis { url, timeout, idle: Mutex::new(Vec::new()) }
    }

    /// Runs one command: on a pooled connection, or a new one.
    pub async fn command(&self, args: &[&[u8]]) -> Result<Reply, RedisError> {
        let pooled = self.idle.lock().await.pop();
        let work = async {
            let mut conn = match pooled {
                Some(c) => c,
                None => self.dial().await?,
            };
            let reply = call(&mut conn, args).await?;
            Ok::<_, RedisError>((conn, reply))
        };
        let (conn, reply) = tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| RedisError::Timeout(self.timeout))??;
        let mut idle = self.idle.lock().await;
        if idle.len() < POOL {
            idle.push(conn);
        }
        drop(idle);
        match reply {
            Reply::Err(s) => Err(RedisError::Server(s)),
            r => Ok(r),
        }
    }

    async fn dial(&self) -> Result<Conn, RedisError> {
        let stream = TcpStream::connect(&self.url.addr).await?;
        stream.set_nodelay(true)?;
        let mut conn = BufReader::new(stream);
        if let Some(p) = &self.url.password {
            let reply = match &self.url.user {
                Some(u) => call(&mut conn, &[b"AUTH", u.as_bytes(), p.as_bytes()]).await?,
                None => call(&mut conn, &[b"AUTH", p.as_bytes()]).await?,
            };
            expect_ok(reply)?;
        }
        if self.url.db != 0 {
            expect_ok(call(&mut conn, &[b"SELECT", self.url.db.to_string().as_bytes()]).await?)?;
        }
        Ok(conn)
    }

    /// `SET key value PX ttl`.
    pub async fn set(&self, key: &str, value: &[u8], ttl: Duration) -> Result<(), RedisError> {
        let ms = ttl.as_millis().max(1).to_string();
        expect_ok(self.command(&[b"SET", key.as_bytes(), value, b"PX", ms.as_bytes()]).await?)
    }

    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RedisError> {
        match self.command(&[b"GET", key.as_bytes()]).await? {
            Reply::Bulk(b) => Ok(b),
            r => Err(RedisError::Protocol(format!("GET answered {r:?}"))),
        }
    }
}

fn expect_ok(r: Reply) -> Result<(), RedisError> {
    match r {
        Reply::Ok(s) if s == "OK" => Ok(()),
        Reply::Err(s) => Err(RedisError::Server(s)),
        r => Err(RedisError::Protocol(format!("expected OK, got {r:?}"))),
    }
}

/// Writes one command as a RESP array of bulk strings and reads its reply.
async fn call(conn: &mut Conn, args: &[&[u8]]) -> Result<Reply, RedisError> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    conn.get_mut().write_all(&out).await?;
    read_reply(conn).await
}

async fn read_line(conn: &mut Conn) -> Result<String, RedisError> {
    let mut line = String::new();
    if conn.read_line(&mut line).await? == 0 {
        return Err(RedisError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    if !line.ends_with("\r\n") {
        return Err(RedisError::Protocol("a reply line without CRLF".into()));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn read_reply(
    conn: &mut Conn,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Reply, RedisError>> + Send + '_>> {
    Box::pin(async move {
        let line = read_line(conn).await?;
        let (kind, rest) = line.split_at(line.len().min(1));
        let num = || rest.parse::<i64>().map_err(|_| RedisError::Protocol(format!("bad length {rest:?}")));
        match kind {
            "+" => Ok(Reply::Ok(rest.to_owned())),
            "-" => Ok(Reply::Err(rest.to_owned())),
            ":" => Ok(Reply::Int(num()?)),
            "$" => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let n = n as usize;
                if n > MAX_BULK {
                    return Err(RedisError::Protocol(format!("a {n}-byte value is over the limit")));
                }
                let mut buf = vec![0u8; n + 2];
                conn.read_exact(&mut buf).await?;
                buf.truncate(n);
                Ok(Reply::Bulk(Some(buf)))
            }
            "*" => {
                let n = num()?;
                let mut items = Vec::with_capacity(n.clamp(0, 64) as usize);
                for _ in 0..n.max(0) {
                    items.push(read_reply(conn).await?);
                }
                Ok(Reply::Array(items))
            }
            _ => Err(RedisError::Protocol(format!("unknown reply {line:?}"))),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted server: the client's bytes, and replies in each RESP type.
    #[tokio::test]
    async fn commands_and_replies_over_a_socket() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.expect("accept");
            let mut s = BufReader::new(s);
            let mut got = Vec::new();
            for reply in [&b"+OK\r\n"[..], b"$5\r\nhello\r\n", b"$-1\r\n", b"-ERR wrong\r\n"] {
                // One command: its array header says how many lines follow.
                let mut head = String::new();
                s.read_line(&mut head).await.expect("read");
                let n: usize = head.trim_end()[1..].parse().expect("n");
                let mut cmd = head.clone();
                for _ in 0..2 * n {
                    let mut l = String::new();
                    s.read_line(&mut l).await.expect("read");
                    cmd.push_str(&l);
                }
                got.push(cmd);
                s.get_mut().write_all(reply).await.expect("write");
            }
            got
        });
        let r = Redis::new(RedisUrl::parse(&format!("redis://{addr}")).expect("url"), Duration::from_secs(5));
        r.set("k", b"v", Duration::from_secs(2)).await.expect("set");
        assert_eq!(r.get("k").await.expect("get"), Some(b"hello".to_vec()));
        assert_eq!(r.get("gone").await.expect("get"), None);
        assert!(matches!(r.get("k").await, Err(RedisError::Server(m)) if m == "ERR wrong"));
        let got = server.await.expect("server");
        assert_eq!(got[0], "*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nPX\r\n$4\r\n2000\r\n");
        assert_eq!(got[1], "*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
    }
}
