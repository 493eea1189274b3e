//! TLS on warmpath's listeners (rustls, through pingora): a certificate that is re-read when its
//! files change (or on SIGHUP) without a restart — each new handshake gets the certificate of
//! the moment, connections already open keep theirs — and the listener's settings (TLS 1.2 and
//! 1.3, ALPN `h2` and `http/1.1`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use pingora::listeners::tls::TlsSettings;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora::tls::sign::CertifiedKey;
use pingora::tls::{ClientHello, CryptoProvider, ResolvesServerCert, RootCertStore, WebPkiClientVerifier};

/// A listener's certificate and key, from PEM files, swapped in place when they change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' modification times when last read.
    seen: Mutex<(Option<SystemTime>, Option<SystemTime>)>,
}

fn modified(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Reads a certificate chain and its private key (PEM) into what rustls signs with.
pub fn load_pair(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, String> {
    pingora::tls::install_default_crypto_provider();
    let (c, k) = (cert_file.display().to_string(), key_file.display().to_string());
    let (certs, key) = pingora::tls::load_certs_and_key_files(&c, &k)
        .map_err(|e| format!("cannot read {c} / {k}: {e}"))?
        .ok_or_else(|| format!("{c} holds no certificate, or {k} no private key (PEM)"))?;
    let provider = CryptoProvider::get_default().ok_or("no TLS crypto provider")?;
    let signer = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| format!("{k}: the private key cannot be used: {e}"))?;
    let pair = CertifiedKey::new(certs, signer);
    pair.keys_match().map_err(|e| format!("{k} is not the key of the certificate in {c}: {e}"))?;
    Ok(pair)
}

impl ReloadingCert {
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Arc<ReloadingCert>, String> {
        let pair = load_pair(cert_file, key_file)?;
        Ok(Arc::new(ReloadingCert {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: RwLock::new(Arc::new(pair)),
            seen: Mutex::new((modified(cert_file), modified(key_file))),
        }))
    }

    /// Re-reads the files if either changed (or `force`); true when the certificate was
    /// replaced. A pair that does not load (a half-written file, a key of another
    /// certificate) leaves the current one serving.
    pub fn reload(&self, force: bool) -> Result<bool, String> {
        let now = (modified(&self.cert_file), modified(&self.key_file));
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if !force && *seen == now {
            return Ok(false);
        }
        let pair = load_pair(&self.cert_file, &self.key_file)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(pair);
        *seen = now;
        Ok(true)
    }

    /// The listener's TLS settings: this certificate, TLS 1.2 and 1.3, ALPN `h2` and
    /// `http/1.1` (or `http/1.1` alone); with `client_ca`, only clients with a certificate
    /// that chains to it get through the handshake.
    pub fn settings(self: &Arc<Self>, h2: bool, client_ca: Option<&Path>) -> Result<TlsSettings, String> {
        // The paths are not read: the resolver answers every handshake.
        let mut s = TlsSettings::intermediate("", "").map_err(|e| e.to_string())?;
        s.set_cert_resolver(self.clone());
        if let Some(ca) = client_ca {
            let mut roots = RootCertStore::empty();
            pingora::tls::load_ca_file_into_store(ca, &mut roots)
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            s.set_client_cert_verifier(verifier);
        }
        if h2 {
            s.enable_h2();
        } else {
            s.set_alpn(pingora::protocols::ALPN::H1);
        }
        Ok(s)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

/// Re-reads the listeners' certificates when their files change, and on SIGHUP.
pub struct WatchCerts {
    pub certs: Vec<Arc<ReloadingCert>>,
    pub interval: Duration,
}

impl WatchCerts {
    fn reload_all(&self, force: bool) {
        for c in &self.certs {
            match c.reload(force) {
                Ok(true) => tracing::info!(cert = %c.cert_file.display(), "TLS certificate re-read"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "TLS certificate not re-read; the current one stays"),
            }
        }
    }
}

#[async_trait]
impl BackgroundService for WatchCerts {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        if self.certs.is_empty() {
            return;
        }
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let forced = tokio::select! {
                _ = tick.tick() => false,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
                _ = shutdown.changed() => return,
            };
            self.reload_all(forced);
        }
    }
}
