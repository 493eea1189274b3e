//! A URL's query string as decoded pairs (`%XX` escapes and `+` for space, as HTML forms and
//! the SDKs write them). A malformed escape is kept as it was.

/// The pairs of `query` in order; a name without `=` has an empty value.
pub fn pairs(query: Option<&str>) -> Vec<(String, String)> {
    let Some(q) = query else { return Vec::new() };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_plus_are_decoded_and_bad_escapes_kept() {
        let p = pairs(Some("after=msg_1&include%5B%5D=a.b&q=x+y%21&flag&bad=%zz%4"));
        let want = [("after", "msg_1"), ("include[]", "a.b"), ("q", "x y!"), ("flag", ""), ("bad", "%zz%4")];
        assert_eq!(p, want.map(|(k, v)| (k.to_owned(), v.to_owned())));
        assert!(pairs(None).is_empty() && pairs(Some("")).is_empty());
    }
}
