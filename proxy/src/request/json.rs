//! JSON text in canonical form (keys sorted at every depth, no insignificant whitespace), and
//! a field put into an object's text without touching its other bytes.

use std::borrow::Cow;

use serde_json::Value;

/// `raw` with keys sorted at every depth and no whitespace outside strings; numbers are
/// written the way serde_json writes them (`1.50` becomes `1.5`), which keeps their value.
pub fn canonical(raw: &str) -> Result<String, serde_json::Error> {
    // serde_json's map is a BTreeMap here (no `preserve_order`), so this sorts.
    let v: Value = serde_json::from_str(raw)?;
    Ok(v.to_string())
}

/// `raw` (valid JSON) without whitespace outside strings, key order and spelling kept;
/// borrowed when there was none.
pub fn minify(raw: &str) -> Cow<'_, str> {
    let mut out: Option<String> = None;
    let (mut in_str, mut escaped) = (false, false);
    // Start of the run of bytes not yet copied (only once `out` exists).
    let mut run = 0;
    for (i, &c) in raw.as_bytes().iter().enumerate() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
        } else if matches!(c, b' ' | b'\n' | b'\r' | b'\t') {
            out.get_or_insert_with(|| String::with_capacity(raw.len())).push_str(&raw[run..i]);
            run = i + 1;
        } else if c == b'"' {
            in_str = true;
        }
    }
    match out {
        None => Cow::Borrowed(raw),
        Some(mut o) => {
            o.push_str(&raw[run..]);
            Cow::Owned(o)
        }
    }
}

/// `s` as a JSON string literal.
pub fn string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// `body` (a JSON object the request parser accepted, so not empty) with `"key":value` put
/// first, every other byte as it was; `value` is JSON text. The object must not have `key`
/// already (the caller rewrites a body that does).
pub fn insert_first(body: &[u8], key: &str, value: &str) -> Vec<u8> {
    let open = body.iter().position(|b| *b == b'{').map_or(0, |i| i + 1);
    let mut out = Vec::with_capacity(body.len() + key.len() + value.len() + 4);
    out.extend_from_slice(&body[..open]);
    out.extend_from_slice(string(key).as_bytes());
    out.push(b':');
    out.extend_from_slice(value.as_bytes());
    out.push(b',');
    out.extend_from_slice(&body[open..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_sorts_keys_at_every_depth() {
        let c = canonical(r#"{ "b": 1, "a": {"z": [ {"y": 1, "x": 2} ], "c": null} }"#).expect("json");
        assert_eq!(c, r#"{"a":{"c":null,"z":[{"x":2,"y":1}]},"b":1}"#);
        assert_eq!(canonical(&c).expect("json"), c, "idempotent");
    }

    #[test]
    fn minify_drops_only_insignificant_whitespace() {
        let raw = "{ \"a b\" : [1, 2],\n\t\"c\": \"x \\\" y\" }";
        assert_eq!(minify(raw), r#"{"a b":[1,2],"c":"x \" y"}"#);
        assert!(matches!(minify(r#"{"a":"b c"}"#), Cow::Borrowed(_)));
        assert_eq!(minify(r#"["\\", 1]"#), r#"["\\",1]"#, "an escaped backslash ends before the quote");
    }
}
