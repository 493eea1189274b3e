//! `[redis]`: the Redis that a fleet of warmpath replicas shares — stored conversations
//! (`[session] store = "redis"`), API keys (`[auth] keys_store = "redis"`) and the running
//! counts of per-key limits (`[auth] limits_store = "redis"`). One server, a Redis Cluster or
//! a master found through Sentinel; TLS with `rediss://` URLs.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer};

use super::{from_env, RedisUrl};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// One server: `redis://[[user]:password@]host[:port][/db]`, `rediss://` for TLS.
    pub url: Option<RedisUrl>,
    /// A Redis Cluster: some of its nodes (the rest are found from them).
    pub cluster: Vec<RedisUrl>,
    /// Sentinel: the sentinels' URLs; the master they name `sentinel_master` is used, and
    /// found again after a failover.
    pub sentinels: Vec<RedisUrl>,
    pub sentinel_master: Option<String>,
    /// The data nodes' user and password where the URLs carry none (Sentinel: the master's;
    /// the sentinels' own go in their URLs). `$NAME` reads the environment.
    #[serde(deserialize_with = "secret")]
    pub username: Option<String>,
    #[serde(deserialize_with = "secret")]
    pub password: Option<String>,
    /// Sentinel: the master's database number (a single server's goes in its URL).
    pub db: i64,
    /// TLS to Redis: trust this CA bundle (PEM) instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// TLS to Redis: a client certificate and its key (PEM), for servers that ask for one.
    pub client_cert_file: Option<PathBuf>,
    pub client_key_file: Option<PathBuf>,
    /// Use TLS to the data nodes found through Sentinel (the sentinels' own URLs say it with
    /// `rediss://`).
    pub sentinel_tls: bool,
    /// The most one Redis call may take, connecting included.
    pub timeout_ms: u64,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: None,
            cluster: Vec::new(),
            sentinels: Vec::new(),
            sentinel_master: None,
            username: None,
            password: None,
            db: 0,
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            sentinel_tls: false,
            timeout_ms: 1000,
        }
    }
}

impl RedisConfig {
    /// Whether a Redis is named at all.
    pub fn configured(&self) -> bool {
        self.url.is_some() || !self.cluster.is_empty() || !self.sentinels.is_empty()
    }
}

fn secret<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s = String::deserialize(d)?;
    from_env(&s).map(Some).map_err(serde::de::Error::custom)
}
