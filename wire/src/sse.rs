//! Server-sent events as they arrive in arbitrary chunks: [`Splitter`] holds the bytes of an
//! event not yet complete and hands out each complete event's `data`.
//!
//! An event ends at the first blank line, whichever line ending the server uses (`\n\n` or
//! `\r\n\r\n`, the earlier of the two). Its `data:` lines (one optional space after the colon
//! dropped) are joined with newlines, as the SSE specification says; comments, `event:` and
//! `id:` lines are not data.

/// Complete events out of a byte stream.
#[derive(Debug, Default)]
pub struct Splitter {
    buf: Vec<u8>,
}

impl Splitter {
    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete event's data: `Some("")` for an event without data (a comment, a
    /// keep-alive, an event name alone), `None` until an event is complete.
    pub fn next_data(&mut self) -> Option<String> {
        let (end, sep) = event_end(&self.buf)?;
        let data = data_of(&self.buf[..end]);
        self.buf.drain(..end + sep);
        Some(data)
    }

    /// The next complete event, its bytes as received (blank line included) and its data;
    /// `None` until an event is complete.
    pub fn next_event(&mut self) -> Option<(Vec<u8>, String)> {
        let (end, sep) = event_end(&self.buf)?;
        let data = data_of(&self.buf[..end]);
        let raw: Vec<u8> = self.buf.drain(..end + sep).collect();
        Some((raw, data))
    }

    /// Takes the bytes held of an event not yet complete.
    pub fn take_rest(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Bytes held of an event not yet complete.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Appends `bytes` and returns the data of every event they completed, skipping events
    /// without data.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.push(bytes);
        std::iter::from_fn(|| self.next_data()).filter(|d| !d.is_empty()).collect()
    }
}

/// Where the first event in `buf` ends, and the length of the blank line that ends it.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = find(buf, b"\n\n").map(|i| (i, 2));
    let crlf = find(buf, b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The `data` of one event's lines.
fn data_of(event: &[u8]) -> String {
    let mut data: Vec<&[u8]> = Vec::new();
    for line in event.split(|&c| c == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(d) = line.strip_prefix(b"data:") {
            data.push(d.strip_prefix(b" ").unwrap_or(d));
        }
    }
    String::from_utf8_lossy(&data.join(&b'\n')).into_owned()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_with_either_line_ending() {
        let mut s = Splitter::default();
        assert!(s.feed(b"data: {\"a\"").is_empty());
        assert_eq!(s.buffered(), 10);
        assert_eq!(s.feed(b":1}\n\ndata:[DONE]\n\n"), ["{\"a\":1}", "[DONE]"]);
        assert_eq!(s.buffered(), 0);
        // An earlier CRLF event is not skipped for a later LF one.
        assert_eq!(s.feed(b"data: one\r\n\r\ndata: two\n\n"), ["one", "two"]);
        // Multi-line data, event names, comments.
        assert_eq!(s.feed(b"event: x\r\ndata: a\r\ndata: b\r\n\r\n: ping\n\n"), ["a\nb"]);
    }

    #[test]
    fn events_without_data_are_seen_one_by_one() {
        let mut s = Splitter::default();
        s.push(b": keep-alive\n\nevent: e\n\ndata: x\n\npartial");
        assert_eq!(s.next_data().as_deref(), Some(""));
        assert_eq!(s.next_data().as_deref(), Some(""));
        assert_eq!(s.next_data().as_deref(), Some("x"));
        assert_eq!(s.next_data(), None);
        assert_eq!(s.buffered(), 7);
    }
}
