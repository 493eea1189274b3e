//! Backends' host names as addresses. Every name a policy gives (pools' backends, moderation
//! services) is looked up when the policy is loaded, and again every `[upstream] dns_refresh_s`
//! (`reload.rs`): a Kubernetes Service whose address changes, or a headless Service whose pod
//! set changes, needs no restart. The system resolver gives no TTL, so `dns_refresh_s` stands
//! for it (as nginx's `resolver … valid=`). A name that stops resolving keeps its last
//! addresses (a DNS outage does not empty a pool); at start it is an error, as before.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use crate::config::{BackendUrl, Config};

/// Looks a name and port up: the system resolver in production, a table in tests.
pub type Resolve = Arc<dyn Fn(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + Sync>;

/// The system resolver (`getaddrinfo`, so `/etc/hosts` and `resolv.conf`); it blocks.
pub fn system() -> Resolve {
    Arc::new(|host, port| (host, port).to_socket_addrs().map(|a| a.collect()))
}

/// Every backend name of a policy with its addresses (sorted, without repeats, so a DNS server
/// that rotates its answers changes nothing).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    addrs: BTreeMap<(String, u16), Vec<SocketAddr>>,
}

/// What one round of lookups did.
#[derive(Debug, Default)]
pub struct Lookups {
    /// Names looked up (IP literals are not).
    pub ok: usize,
    /// Names that did not resolve, with why (their previous addresses were kept).
    pub failed: Vec<String>,
}

impl Resolved {
    /// Looks up every name in `cfg` with `resolve` (blocking: call it off the async threads).
    /// A name that fails keeps its addresses in `previous`; one that has none there is an error.
    pub fn lookup(
        cfg: &Config,
        previous: Option<&Resolved>,
        resolve: &Resolve,
    ) -> Result<(Resolved, Lookups), String> {
        let mut out = Resolved::default();
        let mut done = Lookups::default();
        for url in urls(cfg) {
            let key = (url.host.clone(), url.port);
            if out.addrs.contains_key(&key) {
                continue;
            }
            if let Ok(ip) = url.host.parse::<IpAddr>() {
                out.addrs.insert(key, vec![SocketAddr::new(ip, url.port)]);
                continue;
            }
            let found = resolve(&url.host, url.port).and_then(|mut a| {
                a.sort();
                a.dedup();
                match a.is_empty() {
                    true => Err(io::Error::other("no address")),
                    false => Ok(a),
                }
            });
            match (found, previous.and_then(|p| p.addrs.get(&key))) {
                (Ok(a), _) => {
                    done.ok += 1;
                    out.addrs.insert(key, a);
                }
                (Err(e), Some(kept)) => {
                    done.failed.push(format!("{}: {e}", url.host));
                    out.addrs.insert(key, kept.clone());
                }
                (Err(e), None) => return Err(format!("cannot resolve backend {url}: {e}")),
            }
        }
        Ok((out, done))
    }

    /// `url`'s addresses; empty for a URL the policy did not give.
    pub fn all(&self, url: &BackendUrl) -> &[SocketAddr] {
        self.addrs.get(&(url.host.clone(), url.port)).map_or(&[], Vec::as_slice)
    }

    /// The address a backend that is not expanded connects to: the first (lowest) of its name's.
    pub fn first(&self, url: &BackendUrl) -> Result<SocketAddr, String> {
        self.all(url).first().copied().ok_or_else(|| format!("backend {url} was not resolved"))
    }

    /// Whether any name had to be looked up (a policy of IP literals needs no refresh).
    pub fn has_names(&self) -> bool {
        self.addrs.keys().any(|(h, _)| h.parse::<IpAddr>().is_err())
    }

    /// The names whose addresses differ between `self` and `other`, for the log.
    pub fn changed(&self, other: &Resolved) -> Vec<String> {
        let mut names: Vec<String> = self
            .addrs
            .iter()
            .filter(|(k, v)| other.addrs.get(*k) != Some(*v))
            .chain(other.addrs.iter().filter(|(k, _)| !self.addrs.contains_key(*k)))
            .map(|((h, p), _)| format!("{h}:{p}"))
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

/// The URLs of every backend and moderation service `cfg` names (embedded replicas listen on
/// loopback addresses and are not named).
fn urls(cfg: &Config) -> impl Iterator<Item = &BackendUrl> {
    cfg.pools
        .iter()
        .flat_map(|p| p.backends.iter().map(|b| &b.url).chain(p.safety.moderation.as_ref().map(|m| &m.url)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn cfg() -> Config {
        let text = r#"
[[pools]]
name = "p"
models = ["*"]
[[pools.backends]]
name = "svc"
url = "http://svc.test:8000"
[[pools.backends]]
name = "lit"
url = "http://10.1.2.3:8000"
"#;
        crate::config::parse("t.toml", text).expect("config")
    }

    fn table(answers: Arc<Mutex<io::Result<Vec<SocketAddr>>>>) -> Resolve {
        Arc::new(move |host, _| {
            assert_eq!(host, "svc.test", "IP literals are not looked up");
            match &*answers.lock().unwrap() {
                Ok(a) => Ok(a.clone()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            }
        })
    }

    #[test]
    fn names_are_looked_up_sorted_and_kept_through_a_failure() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let answers =
            Arc::new(Mutex::new(Ok(vec![a("10.0.0.2:8000"), a("10.0.0.1:8000"), a("10.0.0.2:8000")])));
        let resolve = table(answers.clone());
        let cfg = cfg();
        let svc = &cfg.pools[0].backends[0].url;
        let lit = &cfg.pools[0].backends[1].url;

        let (first, done) = Resolved::lookup(&cfg, None, &resolve).expect("resolves");
        assert_eq!(first.all(svc), [a("10.0.0.1:8000"), a("10.0.0.2:8000")]);
        assert_eq!(first.first(lit), Ok(a("10.1.2.3:8000")));
        assert_eq!((done.ok, done.failed.len()), (1, 0));
        assert!(first.has_names());

        // The same set in another order: nothing changed.
        *answers.lock().unwrap() = Ok(vec![a("10.0.0.2:8000"), a("10.0.0.1:8000")]);
        let (again, _) = Resolved::lookup(&cfg, Some(&first), &resolve).expect("resolves");
        assert_eq!(again, first);

        // A failure keeps the last addresses, and says so.
        *answers.lock().unwrap() = Err(io::Error::other("SERVFAIL"));
        let (kept, done) = Resolved::lookup(&cfg, Some(&first), &resolve).expect("kept");
        assert_eq!(kept, first);
        assert_eq!(done.failed.len(), 1, "{:?}", done.failed);
        // ...but with nothing to keep (at start) it is an error.
        let err = Resolved::lookup(&cfg, None, &resolve).expect_err("nothing to keep");
        assert!(err.contains("svc.test") && err.contains("SERVFAIL"), "{err}");

        // A changed set is a change, named.
        *answers.lock().unwrap() = Ok(vec![a("10.0.0.3:8000")]);
        let (moved, _) = Resolved::lookup(&cfg, Some(&first), &resolve).expect("resolves");
        assert_eq!(moved.changed(&first), ["svc.test:8000"]);
        assert!(moved.changed(&moved).is_empty());
    }
}
