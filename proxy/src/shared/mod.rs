//! The Redis that a fleet of warmpath replicas shares ([`Shared`]), through the `redis` crate:
//! one server (its connection kept, and re-dialled after a loss, by the crate's connection
//! manager), a Redis Cluster (slots followed as they move), or the master that Sentinel names
//! (asked for again after a connection error, so a failover is followed). TLS with `rediss://`
//! URLs, a CA bundle and an optional client certificate from `[redis]`.
//!
//! Every call runs under `[redis] timeout_ms`. Nothing is dialled until the first call, so
//! warmpath starts while Redis is down; after a failed dial, calls fail at once for one
//! timeout's length instead of each waiting out its own.

use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ClientTlsConfig, Cmd, FromRedisValue, IntoConnectionInfo, RedisError, RedisFuture,
    TlsCertificates, Value,
};
use tokio::sync::Mutex;

use crate::config::RedisConfig;

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis is unreachable (the last dial failed {0:?} ago)")]
    Down(Duration),
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
}

/// How the servers are found.
enum Target {
    Single(redis::Client),
    Cluster(ClusterClient),
    Sentinel(Mutex<SentinelClient>),
}

/// A connection, whichever kind: cheap to clone (each is a handle on one multiplexed socket,
/// or on the cluster's).
#[derive(Clone)]
pub enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Master(MultiplexedConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Master(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Master(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Master(c) => c.get_db(),
        }
    }
}

/// The fleet's Redis.
pub struct Shared {
    target: Target,
    conn: Mutex<Option<Conn>>,
    /// When the last dial failed.
    failed: std::sync::Mutex<Option<Instant>>,
    timeout: Duration,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("kind", &self.kind()).finish_non_exhaustive()
    }
}

impl Shared {
    /// The clients for `[redis]` (its files read; nothing dialled yet).
    pub fn new(cfg: &RedisConfig) -> Result<Shared, String> {
        let certs = certificates(cfg)?;
        let target = if let Some(url) = &cfg.url {
            let mut info = url.as_str().into_connection_info().map_err(|e| e.to_string())?;
            info = with_credentials(info, cfg);
            let client = match certs {
                Some(c) => redis::Client::build_with_tls(info, c),
                None => redis::Client::open(info),
            };
            Target::Single(client.map_err(|e| format!("redis url: {e}"))?)
        } else if !cfg.cluster.is_empty() {
            let mut b = ClusterClientBuilder::new(cfg.cluster.iter().map(|u| u.as_str()))
                .connection_timeout(Duration::from_millis(cfg.timeout_ms))
                .response_timeout(Duration::from_millis(cfg.timeout_ms))
                .retries(2);
            if let Some(u) = &cfg.username {
                b = b.username(u);
            }
            if let Some(p) = &cfg.password {
                b = b.password(p);
            }
            if let Some(c) = certs {
                b = b.certs(c);
            }
            Target::Cluster(b.build().map_err(|e| format!("redis cluster: {e}"))?)
        } else if !cfg.sentinels.is_empty() {
            let master = cfg.sentinel_master.as_deref().ok_or("sentinels need sentinel_master")?;
            let mut addrs = Vec::new();
            let mut sentinel_password = None;
            for u in &cfg.sentinels {
                let info = u.as_str().into_connection_info().map_err(|e| e.to_string())?;
                sentinel_password = sentinel_password.or(info.redis_settings().password().map(str::to_owned));
                addrs.push(info.addr().clone());
            }
            let mut b = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
                .map_err(|e| format!("redis sentinels: {e}"))?
                .set_client_to_redis_db(cfg.db);
            if let Some(u) = &cfg.username {
                b = b.set_client_to_redis_username(u);
            }
            if let Some(p) = &cfg.password {
                b = b.set_client_to_redis_password(p);
            }
            if let Some(p) = sentinel_password {
                b = b.set_client_to_sentinel_password(p);
            }
            if cfg.sentinel_tls {
                b = b.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
            }
            if let Some(c) = certs {
                b = b.set_client_to_redis_certificates(c);
            }
            Target::Sentinel(Mutex::new(b.build().map_err(|e| format!("redis sentinels: {e}"))?))
        } else {
            return Err("[redis] names no server: set url, cluster or sentinels".into());
        };
        Ok(Shared {
            target,
            conn: Mutex::new(None),
            failed: std::sync::Mutex::new(None),
            timeout: Duration::from_millis(cfg.timeout_ms),
        })
    }

    /// `single`, `cluster` or `sentinel`.
    pub fn kind(&self) -> &'static str {
        match self.target {
            Target::Single(_) => "single",
            Target::Cluster(_) => "cluster",
            Target::Sentinel(_) => "sentinel",
        }
    }

    /// A connection: the one kept, or a new one.
    async fn conn(&self) -> Result<Conn, SharedError> {
        let mut kept = self.conn.lock().await;
        if let Some(c) = kept.as_ref() {
            return Ok(c.clone());
        }
        if let Some(at) = *self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            if at.elapsed() < self.timeout {
                return Err(SharedError::Down(at.elapsed()));
            }
        }
        let dial = async {
            let cfg = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(self.timeout))
                .set_response_timeout(Some(self.timeout));
            Ok::<_, RedisError>(match &self.target {
                Target::Single(client) => {
                    let cfg = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout))
                        .set_number_of_retries(1)
                        .set_max_delay(self.timeout);
                    Conn::Single(ConnectionManager::new_with_config(client.clone(), cfg).await?)
                }
                Target::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
                Target::Sentinel(s) => {
                    let client = s.lock().await.async_get_client().await?;
                    Conn::Master(client.get_multiplexed_async_connection_with_config(&cfg).await?)
                }
            })
        };
        let dialled = match tokio::time::timeout(self.timeout, dial).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                return Err(e.into());
            }
            Err(_) => {
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                return Err(SharedError::Timeout(self.timeout));
            }
        };
        *kept = Some(dialled.clone());
        Ok(dialled)
    }

    /// After a failed call: a connection to a Sentinel master is dropped (the master may have
    /// changed), so the next call asks the sentinels again. The other kinds re-dial by
    /// themselves.
    async fn failed(&self, e: &SharedError) {
        let lost = match e {
            SharedError::Timeout(_) => true,
            SharedError::Down(_) => false,
            SharedError::Redis(r) => {
                r.is_io_error()
                    || r.is_connection_dropped()
                    || r.is_unrecoverable_error()
                    || r.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
            }
        };
        if lost && matches!(self.target, Target::Sentinel(_)) {
            *self.conn.lock().await = None;
        }
    }

    /// Runs one command.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, SharedError> {
        self.call(|mut c| async move { cmd.query_async(&mut c).await }).await
    }

    /// Runs a Lua script (by its hash; loaded first where the server lacks it).
    pub async fn script<T: FromRedisValue>(
        &self,
        call: &redis::ScriptInvocation<'_>,
    ) -> Result<T, SharedError> {
        self.call(|mut c| async move { call.invoke_async(&mut c).await }).await
    }

    /// `work` on a connection, under the timeout; a failure is looked at ([`Shared::failed`]).
    async fn call<T, F, Fut>(&self, work: F) -> Result<T, SharedError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let run = async { Ok::<T, SharedError>(work(self.conn().await?).await?) };
        let r =
            tokio::time::timeout(self.timeout, run).await.unwrap_or(Err(SharedError::Timeout(self.timeout)));
        if let Err(e) = &r {
            self.failed(e).await;
        }
        r
    }
}

/// A single server's URL with `[redis]`'s user and password where it carries none.
fn with_credentials(info: redis::ConnectionInfo, cfg: &RedisConfig) -> redis::ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if settings.password().is_none() {
        if let Some(p) = &cfg.password {
            settings = settings.set_password(p);
        }
    }
    if settings.username().is_none() {
        if let Some(u) = &cfg.username {
            settings = settings.set_username(u);
        }
    }
    info.set_redis_settings(settings)
}

/// `[redis]`'s CA bundle and client certificate, read.
fn certificates(cfg: &RedisConfig) -> Result<Option<TlsCertificates>, String> {
    let read =
        |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let root_cert = cfg.ca_file.as_deref().map(read).transpose()?;
    let client_tls = match (&cfg.client_cert_file, &cfg.client_key_file) {
        (Some(c), Some(k)) => Some(ClientTlsConfig { client_cert: read(c)?, client_key: read(k)? }),
        (None, None) => None,
        _ => return Err("client_cert_file and client_key_file go together".into()),
    };
    Ok((root_cert.is_some() || client_tls.is_some()).then_some(TlsCertificates { client_tls, root_cert }))
}
