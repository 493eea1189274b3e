//! Answers warmpath writes itself: JSON bodies with a Content-Length (pingora can hang on
//! bodies without one), and every error in the OpenAI shape.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::Result;
use warmpath_wire::openai::ApiError;

use super::downstream::Downstream;

/// Writes a complete response.
pub async fn send(
    session: &mut dyn Downstream,
    status: u16,
    content_type: &str,
    body: Bytes,
    headers: &[(&'static str, String)],
) -> Result<()> {
    let mut resp = ResponseHeader::build(status, Some(4 + headers.len()))?;
    resp.insert_header(http::header::CONTENT_TYPE, content_type)?;
    resp.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())?;
    for (k, v) in headers {
        resp.insert_header(*k, v.as_str())?;
    }
    session.write_response_header(Box::new(resp), body.is_empty()).await?;
    if !body.is_empty() {
        session.write_response_body(Some(body), true).await?;
    }
    Ok(())
}

pub async fn send_json(
    session: &mut dyn Downstream,
    status: u16,
    body: Bytes,
    headers: &[(&'static str, String)],
) -> Result<()> {
    send(session, status, "application/json", body, headers).await
}

/// An error in the OpenAI shape; 429 and 503 tell the client when to come back (in a second,
/// unless `headers` say when, or say not to: `x-should-retry: false`).
pub async fn send_error(
    session: &mut dyn Downstream,
    err: &ApiError,
    headers: &[(&'static str, String)],
) -> Result<()> {
    let mut all = headers.to_vec();
    let said = all.iter().any(|(k, _)| matches!(*k, "retry-after" | "x-should-retry"));
    if matches!(err.status, 429 | 503) && !said {
        all.push(("retry-after", "1".to_owned()));
    }
    send_json(session, err.status, Bytes::from(err.to_json()), &all).await
}

/// 429: every backend of the pool is at its in-flight cap.
pub fn overloaded(pool: &str) -> ApiError {
    let mut e = ApiError::unavailable(format!(
        "every backend of pool {pool:?} is at its in-flight limit; retry later"
    ));
    e.status = 429;
    e.body.error.kind = "rate_limit_error".to_owned();
    e.with_code("backends_saturated")
}

/// 503: no backend of the pool takes traffic.
pub fn no_backend(pool: &str) -> ApiError {
    ApiError::unavailable(format!("no healthy backend in pool {pool:?}")).with_code("no_healthy_backend")
}

/// 502/504 after the backends failed and nothing was relayed.
pub fn upstream_failed(status: u16, what: &str) -> ApiError {
    let mut e = ApiError::unavailable(what.to_owned()).with_code("upstream_error");
    e.status = status;
    e
}
