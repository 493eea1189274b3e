//! Where an LLM request's answer goes. The forwarding code (`forward`, `relay`, `deferred`)
//! writes a backend's response to a [`Downstream`]: the HTTP client's pingora session, or a
//! Responses translator that turns the backend's chat stream into Responses events for an HTTP
//! client or a WebSocket connection (`crate::responses`).

use async_trait::async_trait;
use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

/// The client side of one request, as the forwarding code sees it. The method names are
/// pingora's, so that the HTTP case is the session itself.
#[async_trait]
pub trait Downstream: Send {
    async fn write_response_header(&mut self, header: Box<ResponseHeader>, end: bool) -> pingora::Result<()>;

    async fn write_response_body(&mut self, body: Option<Bytes>, end: bool) -> pingora::Result<()>;

    /// Resolves when the client has gone (closed its connection, or stopped waiting for this
    /// answer); stays pending otherwise. Cancel-safe: it is raced against backend reads.
    async fn gone(&mut self);

    /// The answer cannot be ended honestly (a body with a length broke off): close the client
    /// connection after it.
    fn close_after(&mut self);

    /// warmpath itself stopped this answer (a safety verdict): writes fail and `gone` resolves
    /// although the client is still there, and the pipeline answers it once the backend call
    /// is dropped.
    fn stopped(&self) -> bool {
        false
    }
}

#[async_trait]
impl Downstream for Session {
    async fn write_response_header(
        &mut self,
        mut header: Box<ResponseHeader>,
        end: bool,
    ) -> pingora::Result<()> {
        crate::observe::request_id::stamp(self.req_header(), &mut header);
        Session::write_response_header(self, header, end).await
    }

    async fn write_response_body(&mut self, body: Option<Bytes>, end: bool) -> pingora::Result<()> {
        Session::write_response_body(self, body, end).await
    }

    async fn gone(&mut self) {
        // An H1 read returning EOF or an error; a client pipelining its next request is not
        // gone.
        if self.read_body_or_idle(true).await.is_err() {
            return;
        }
        std::future::pending::<()>().await
    }

    fn close_after(&mut self) {
        self.set_keepalive(None);
    }
}

/// A client whose answer's header gets `headers` added (the caller's rate-limit state), and,
/// with `hide_routing`, loses warmpath's routing headers (which backend, which prefix, what
/// the router believed cached: what one tenant must not learn of another's prompts) — an API
/// key's view of its answer.
pub struct Stamped<'d> {
    pub inner: &'d mut dyn Downstream,
    pub headers: &'d [(&'static str, String)],
    pub hide_routing: bool,
    /// Takes out the usage chunk warmpath asked for and the client did not.
    pub hide_usage: Option<super::usage::UsageFilter>,
}

#[async_trait]
impl Downstream for Stamped<'_> {
    async fn write_response_header(
        &mut self,
        mut header: Box<ResponseHeader>,
        end: bool,
    ) -> pingora::Result<()> {
        for (k, v) in self.headers {
            header.insert_header(*k, v.as_str())?;
        }
        if self.hide_routing {
            for h in ["x-warmpath-route", "x-warmpath-prefix-hash", "x-warmpath-backend"] {
                header.remove_header(h);
            }
        }
        self.inner.write_response_header(header, end).await
    }

    async fn write_response_body(&mut self, body: Option<Bytes>, end: bool) -> pingora::Result<()> {
        match &mut self.hide_usage {
            Some(f) => match f.pass(body, end) {
                Some(out) => self.inner.write_response_body(Some(out), end).await,
                None => Ok(()),
            },
            None => self.inner.write_response_body(body, end).await,
        }
    }

    async fn gone(&mut self) {
        self.inner.gone().await
    }

    fn close_after(&mut self) {
        self.inner.close_after();
    }

    fn stopped(&self) -> bool {
        self.inner.stopped()
    }
}
