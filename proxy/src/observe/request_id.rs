//! `x-request-id`: the client's own, when it sends a usable one, else one warmpath makes (32
//! hex digits, as nginx's `$request_id`). It is set on the request before anything reads it, so
//! it goes on to the backend with the other headers, into the access log, and back on the
//! answer.

use pingora::http::{RequestHeader, ResponseHeader};

pub const HEADER: &str = "x-request-id";

/// Longest id accepted from a client; a longer or non-printable one is replaced.
const MAX_LEN: usize = 128;

/// The request's id, made and set on `req` when it has none it may keep.
pub fn ensure(req: &mut RequestHeader) -> String {
    if let Some(id) = req.headers.get(HEADER).and_then(|v| v.to_str().ok()).filter(|v| usable(v)) {
        return id.to_owned();
    }
    let id = generate();
    // 32 hex digits always make a valid header value.
    let _ = req.insert_header(HEADER, id.as_str());
    id
}

/// Puts the request's id on its answer.
pub fn stamp(req: &RequestHeader, resp: &mut ResponseHeader) {
    if let Some(id) = req.headers.get(HEADER) {
        let _ = resp.insert_header(HEADER, id.clone());
    }
}

fn usable(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_LEN && id.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// 32 hex digits.
fn generate() -> String {
    super::trace::hex(&super::ids::random_bytes::<16>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_usable_id_and_replaces_the_rest() {
        let mut req = RequestHeader::build("POST", b"/v1/chat/completions", None).expect("req");
        req.insert_header(HEADER, "client-42").expect("header");
        assert_eq!(ensure(&mut req), "client-42");
        for bad in ["", "has space", &"x".repeat(129)] {
            let mut req = RequestHeader::build("POST", b"/", None).expect("req");
            req.insert_header(HEADER, bad).expect("header");
            let id = ensure(&mut req);
            assert_eq!(id.len(), 32, "{bad:?} → {id}");
            assert_eq!(req.headers.get(HEADER).and_then(|v| v.to_str().ok()), Some(id.as_str()));
        }
    }

    #[test]
    fn made_ids_are_hex_and_distinct() {
        let ids: std::collections::HashSet<String> = (0..10_000)
            .map(|_| {
                let mut req = RequestHeader::build("GET", b"/", None).expect("req");
                ensure(&mut req)
            })
            .collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|i| i.len() == 32 && i.bytes().all(|b| b.is_ascii_hexdigit())));
    }

    #[test]
    fn the_answer_carries_it() {
        let mut req = RequestHeader::build("GET", b"/", None).expect("req");
        let id = ensure(&mut req);
        let mut resp = ResponseHeader::build(200, None).expect("resp");
        stamp(&req, &mut resp);
        assert_eq!(resp.headers.get(HEADER).and_then(|v| v.to_str().ok()), Some(id.as_str()));
    }
}
