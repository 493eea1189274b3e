//! Reading the whole request body under a size limit (413) and a deadline (408).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;
use warmpath_wire::openai::ApiError;

/// Why the body could not be read.
#[derive(Debug)]
pub enum BodyError {
    /// Answer this and close.
    Reject(ApiError),
    /// The client broke the connection; there is no one to answer.
    ClientGone,
}

pub async fn read_body(session: &mut Session, limit: usize, deadline: Duration) -> Result<Bytes, BodyError> {
    let declared = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::Reject(ApiError::too_large(limit)));
    }
    let expects_continue = session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if expects_continue {
        // curl and others wait for this before sending bodies over 1 KiB.
        session.write_continue_response().await.map_err(|_| BodyError::ClientGone)?;
    }
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
    let read = async {
        while let Some(chunk) = session.read_request_body().await.map_err(|_| BodyError::ClientGone)? {
            if buf.len() + chunk.len() > limit {
                return Err(BodyError::Reject(ApiError::too_large(limit)));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(r) => r?,
        Err(_) => {
            let mut e = ApiError::invalid_request(format!("request body not received within {deadline:?}"));
            e.status = 408;
            return Err(BodyError::Reject(e.with_code("request_timeout")));
        }
    }
    Ok(buf.freeze())
}
