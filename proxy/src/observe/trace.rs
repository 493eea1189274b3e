//! Request traces, exported over OTLP (`[tracing] otlp_endpoint`; off by default). A sampled
//! request gets a [`Trace`]: one root span for the request and child spans the stages add as
//! they go (routing, each upstream attempt, the first token, deferred-tool rounds, the safety
//! stage). A client's W3C `traceparent` is joined; the backend gets one naming warmpath's span
//! as its parent, so a backend that traces (vLLM's `--otlp-traces-endpoint`) continues the same
//! trace. Finished traces go to a bounded queue that the export service drains (`otlp.rs`); a
//! full queue drops them, counted, and never slows a request.
//!
//! Encoding is OTLP/HTTP's JSON (trace and span ids as hex, times as decimal strings of Unix
//! nanoseconds, enums as numbers), which every OTLP collector accepts on `/v1/traces`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use prometheus::IntCounter;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// A span's kind, as OTLP numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(String),
    Int(i64),
    Bool(bool),
}

impl From<&str> for Attr {
    fn from(s: &str) -> Attr {
        Attr::Str(s.to_owned())
    }
}
impl From<String> for Attr {
    fn from(s: String) -> Attr {
        Attr::Str(s)
    }
}
impl From<i64> for Attr {
    fn from(n: i64) -> Attr {
        Attr::Int(n)
    }
}
impl From<u64> for Attr {
    fn from(n: u64) -> Attr {
        Attr::Int(n as i64)
    }
}
impl From<bool> for Attr {
    fn from(b: bool) -> Attr {
        Attr::Bool(b)
    }
}

/// One finished span.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent: Option<[u8; 8]>,
    pub name: &'static str,
    pub kind: Kind,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: Vec<(&'static str, Attr)>,
    /// Set: the span failed, with this message.
    pub error: Option<String>,
}

/// One request's trace while it runs.
#[derive(Debug)]
pub struct Trace {
    pub trace_id: [u8; 16],
    /// The request's own span.
    pub root: [u8; 8],
    /// The client's span, where it sent a `traceparent`.
    remote_parent: Option<[u8; 8]>,
    origin: (Instant, u64),
    spans: Vec<Span>,
}

impl Trace {
    /// A new trace, or the client's continued: `traceparent` is W3C's
    /// `00-TRACEID-PARENTID-FLAGS`. `start` is when the request arrived.
    pub fn start(traceparent: Option<&str>, start: Instant) -> Trace {
        let (trace_id, remote_parent) = match traceparent.and_then(parse_traceparent) {
            Some((t, p)) => (t, Some(p)),
            None => (super::ids::random_bytes::<16>(), None),
        };
        let now_ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        let since = start.elapsed().as_nanos() as u64;
        Trace {
            trace_id,
            root: super::ids::random_bytes::<8>(),
            remote_parent,
            origin: (start, now_ns.saturating_sub(since)),
            spans: Vec::new(),
        }
    }

    /// What the backend gets: this trace, warmpath's request span as the parent, sampled.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&self.root))
    }

    fn ns(&self, t: Instant) -> u64 {
        self.origin.1 + t.saturating_duration_since(self.origin.0).as_nanos() as u64
    }

    /// A child of the request's span, from `start` to `end`.
    pub fn span(
        &mut self,
        name: &'static str,
        kind: Kind,
        (start, end): (Instant, Instant),
        attrs: Vec<(&'static str, Attr)>,
        error: Option<String>,
    ) {
        let span = Span {
            trace_id: self.trace_id,
            span_id: super::ids::random_bytes::<8>(),
            parent: Some(self.root),
            name,
            kind,
            start_ns: self.ns(start),
            end_ns: self.ns(end),
            attrs,
            error,
        };
        self.spans.push(span);
    }

    /// The request's span closes at `end`: every span of the trace.
    pub fn finish(self, end: Instant, attrs: Vec<(&'static str, Attr)>, error: Option<String>) -> Vec<Span> {
        self.finish_as("warmpath request", end, attrs, error)
    }

    /// [`Trace::finish`], the request's span named `name` (a WebSocket turn's).
    pub fn finish_as(
        mut self,
        name: &'static str,
        end: Instant,
        attrs: Vec<(&'static str, Attr)>,
        error: Option<String>,
    ) -> Vec<Span> {
        let root = Span {
            trace_id: self.trace_id,
            span_id: self.root,
            parent: self.remote_parent,
            name,
            kind: Kind::Server,
            start_ns: self.origin.1,
            end_ns: self.ns(end),
            attrs,
            error,
        };
        self.spans.insert(0, root);
        self.spans
    }
}

/// `00-<32 hex>-<16 hex>-<2 hex>`, ids not all zero; the version-00 layout (later versions
/// start the same way).
fn parse_traceparent(v: &str) -> Option<([u8; 16], [u8; 8])> {
    let mut parts = v.trim().split('-');
    let version = parts.next()?;
    let (trace, parent, flags) = (parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2
        || version == "ff"
        || flags.len() != 2
        || (version == "00" && parts.next().is_some())
    {
        return None;
    }
    let trace: [u8; 16] = unhex(trace)?;
    let parent: [u8; 8] = unhex(parent)?;
    (trace != [0; 16] && parent != [0; 8]).then_some((trace, parent))
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `ExportTraceServiceRequest` in OTLP/HTTP JSON.
pub fn encode(service_name: &str, spans: &[Span]) -> Vec<u8> {
    let spans: Vec<Value> = spans.iter().map(span_json).collect();
    let body = json!({
        "resourceSpans": [{
            "resource": {"attributes": [
                attr_json("service.name", &Attr::Str(service_name.to_owned())),
                attr_json("service.version", &Attr::Str(env!("CARGO_PKG_VERSION").to_owned())),
            ]},
            "scopeSpans": [{
                "scope": {"name": "warmpath", "version": env!("CARGO_PKG_VERSION")},
                "spans": spans,
            }],
        }],
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

fn attr_json(key: &str, v: &Attr) -> Value {
    let value = match v {
        Attr::Str(s) => json!({"stringValue": s}),
        // OTLP JSON writes 64-bit integers as strings.
        Attr::Int(n) => json!({"intValue": n.to_string()}),
        Attr::Bool(b) => json!({"boolValue": b}),
    };
    json!({"key": key, "value": value})
}

fn span_json(s: &Span) -> Value {
    let mut v = json!({
        "traceId": hex(&s.trace_id),
        "spanId": hex(&s.span_id),
        "name": s.name,
        "kind": s.kind as u8,
        "startTimeUnixNano": s.start_ns.to_string(),
        "endTimeUnixNano": s.end_ns.max(s.start_ns).to_string(),
        "attributes": s.attrs.iter().map(|(k, a)| attr_json(k, a)).collect::<Vec<_>>(),
        // STATUS_CODE_OK = 1, STATUS_CODE_ERROR = 2.
        "status": match &s.error {
            None => json!({"code": 1}),
            Some(m) => json!({"code": 2, "message": m}),
        },
    });
    if let Some(p) = s.parent {
        v["parentSpanId"] = Value::String(hex(&p));
    }
    v
}

/// Where sampled traces go: a bounded queue to the export service. Off (the default) when no
/// endpoint is set.
#[derive(Debug, Clone, Default)]
pub struct Tracer(Option<Arc<TracerInner>>);

#[derive(Debug)]
struct TracerInner {
    queue: mpsc::Sender<Vec<Span>>,
    /// Sampled: 1 in `1 / ratio` traces, counted deterministically.
    every: u64,
    seen: AtomicU64,
    dropped: IntCounter,
}

impl Tracer {
    /// A tracer sampling `ratio` of the requests (0–1), holding up to `queue` traces; the
    /// receiver is the export service's.
    pub fn new(ratio: f64, queue: usize, dropped: IntCounter) -> (Tracer, mpsc::Receiver<Vec<Span>>) {
        let (tx, rx) = mpsc::channel(queue.max(1));
        let every = if ratio <= 0.0 { 0 } else { (1.0 / ratio.min(1.0)).round().max(1.0) as u64 };
        let inner = TracerInner { queue: tx, every, seen: AtomicU64::new(0), dropped };
        (Tracer(Some(Arc::new(inner))), rx)
    }

    /// A trace for a request that arrived at `start`, when tracing is on and it is sampled: a
    /// client's sampled `traceparent` is always followed.
    pub fn start(&self, traceparent: Option<&str>, start: Instant) -> Option<Trace> {
        let t = self.0.as_ref()?;
        let client_sampled = traceparent.is_some_and(|v| v.trim().ends_with("-01"));
        let n = t.seen.fetch_add(1, Ordering::Relaxed);
        let sampled = client_sampled || (t.every > 0 && n % t.every == 0);
        sampled.then(|| Trace::start(traceparent, start))
    }

    /// A finished trace, queued for export (dropped, and counted, when the queue is full).
    pub fn submit(&self, spans: Vec<Span>) {
        let Some(t) = &self.0 else { return };
        if t.queue.try_send(spans).is_err() {
            t.dropped.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_a_clients_traceparent_and_makes_one_for_the_backend() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut t = Trace::start(Some(tp), Instant::now());
        assert_eq!(hex(&t.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        let ours = t.traceparent();
        assert!(ours.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-") && ours.ends_with("-01"), "{ours}");
        assert_ne!(&ours[36..52], "00f067aa0ba902b7");
        let now = Instant::now();
        t.span("route", Kind::Internal, (now, now), vec![("warmpath.reason", "cache".into())], None);
        let spans = t.finish(Instant::now(), vec![("http.response.status_code", 200i64.into())], None);
        assert_eq!(spans.len(), 2);
        assert_eq!(hex(&spans[0].parent.expect("the client's span")), "00f067aa0ba902b7");
        assert_eq!(spans[1].parent, Some(spans[0].span_id));
        assert!(spans[0].start_ns > 1_600_000_000_000_000_000 && spans[0].end_ns >= spans[0].start_ns);
    }

    #[test]
    fn a_bad_traceparent_starts_a_new_trace() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            let t = Trace::start(Some(bad), Instant::now());
            assert!(t.remote_parent.is_none(), "{bad:?} was followed");
            assert_ne!(t.trace_id, [0; 16]);
        }
    }

    #[test]
    fn encodes_otlp_json() {
        let mut t = Trace::start(None, Instant::now());
        let now = Instant::now();
        t.span(
            "upstream attempt",
            Kind::Client,
            (now, now),
            vec![("warmpath.attempt", 2i64.into())],
            Some("io".into()),
        );
        let spans = t.finish(Instant::now(), vec![("warmpath.cached", true.into())], None);
        let v: Value = serde_json::from_slice(&encode("wp", &spans)).expect("JSON");
        let rs = &v["resourceSpans"][0];
        assert_eq!(rs["resource"]["attributes"][0]["value"]["stringValue"], "wp");
        let s = rs["scopeSpans"][0]["spans"].as_array().expect("spans");
        assert_eq!(s.len(), 2);
        assert_eq!((s[0]["kind"].as_u64(), s[0]["parentSpanId"].is_null()), (Some(2), true));
        assert_eq!(s[0]["traceId"].as_str().map(str::len), Some(32));
        assert_eq!(s[1]["parentSpanId"], s[0]["spanId"]);
        assert_eq!(s[1]["attributes"][0]["value"]["intValue"], "2");
        assert_eq!(s[1]["status"], json!({"code": 2, "message": "io"}));
        assert!(s[0]["startTimeUnixNano"].as_str().is_some_and(|t| t.parse::<u64>().is_ok()));
    }

    #[test]
    fn samples_by_ratio_and_drops_when_the_queue_is_full() {
        let dropped = IntCounter::new("d", "d").expect("counter");
        let (tracer, _rx) = Tracer::new(0.25, 2, dropped.clone());
        let sampled = (0..100).filter(|_| tracer.start(None, Instant::now()).is_some()).count();
        assert_eq!(sampled, 25);
        for _ in 0..5 {
            tracer.submit(Vec::new());
        }
        assert_eq!(dropped.get(), 3);
        assert!(Tracer::default().start(None, Instant::now()).is_none());
        let (none, _rx) = Tracer::new(0.0, 2, dropped);
        assert!(none.start(None, Instant::now()).is_none());
        assert!(none
            .start(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), Instant::now())
            .is_some());
    }
}
