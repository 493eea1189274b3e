//! A request's framing, judged once its header is in and before anything reads its body: the
//! forms that let two servers read one byte stream as different requests (request smuggling)
//! are refused, and the connection is closed after the answer.
//!
//! - A transfer coding other than one `chunked`: 501 (RFC 9112 §6.1: a coding the server does
//!   not understand). pingora would read `gzip, chunked` as plain chunked.
//! - A header larger than `limits.max_header_bytes`: 431. pingora itself accepts up to 1 MiB
//!   (nginx stops a line at 8 KiB, a header at 32 KiB).
//!
//! Two different `Content-Length`s, an unparsable one and obs-fold are refused by pingora's
//! parser already (400, connection closed). `Transfer-Encoding` with `Content-Length` is read
//! as RFC 9112 §6.1 says — chunked, the length dropped, the connection closed after the answer —
//! so no second request can hide in it (refusing it, as Envoy does, is the other choice the RFC
//! allows; pingora has dropped the length before this runs). A malformed chunk is judged where
//! the body is read (`http::body`).

use pingora::http::RequestHeader;
use warmpath_wire::openai::ApiError;

/// Why a request's framing is refused: the error to answer (then close).
pub fn refused(req: &RequestHeader, max_header_bytes: usize) -> Option<ApiError> {
    let size = header_size(req);
    if size > max_header_bytes {
        let mut e = ApiError::invalid_request(format!(
            "the request header is {size} bytes; this server takes at most {max_header_bytes}"
        ))
        .with_code("header_too_large");
        e.status = 431;
        return Some(e);
    }
    let te: Vec<&[u8]> =
        req.headers.get_all(http::header::TRANSFER_ENCODING).iter().map(|v| v.as_bytes()).collect();
    if te.is_empty() {
        return None;
    }
    let codings: Vec<String> = te
        .iter()
        .flat_map(|v| v.split(|b| *b == b','))
        .map(|c| String::from_utf8_lossy(c).trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect();
    if codings != ["chunked"] {
        let mut e = ApiError::invalid_request(format!(
            "transfer coding {:?} is not supported; send the body chunked or with a Content-Length",
            codings.join(", ")
        ))
        .with_code("unsupported_transfer_coding");
        e.status = 501;
        return Some(e);
    }
    None
}

/// The header's size as the client sent it, near enough: the request line and each field with
/// its separators.
fn header_size(req: &RequestHeader) -> usize {
    let line = req.method.as_str().len() + req.uri.to_string().len() + 12;
    req.headers.iter().fold(line, |n, (k, v)| n + k.as_str().len() + v.len() + 4) + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("POST", b"/v1/chat/completions", None).expect("builds");
        for (k, v) in headers {
            r.append_header(k.to_string(), *v).expect("header");
        }
        r
    }

    fn status(headers: &[(&str, &str)]) -> Option<u16> {
        refused(&req(headers), 1024).map(|e| e.status)
    }

    #[test]
    fn smuggling_forms_are_refused() {
        assert_eq!(status(&[("content-length", "5")]), None);
        assert_eq!(status(&[("transfer-encoding", "chunked")]), None);
        assert_eq!(status(&[("transfer-encoding", "Chunked")]), None);
        assert_eq!(status(&[("transfer-encoding", "gzip, chunked")]), Some(501));
        assert_eq!(status(&[("transfer-encoding", "chunked"), ("transfer-encoding", "chunked")]), Some(501));
        assert_eq!(status(&[("transfer-encoding", "identity")]), Some(501));
        assert_eq!(status(&[("x-big", &"a".repeat(2000))]), Some(431));
    }
}
