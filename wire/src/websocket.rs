//! WebSocket framing (RFC 6455 §5) on the server side: client frames decoded and checked
//! (masked, no reserved bits, control frames short and whole), fragments joined into messages
//! under a size limit, server frames encoded (unmasked). Every violation names the close code
//! that says why.

use bytes::{Buf, BytesMut};

pub const CONTINUATION: u8 = 0x0;
pub const TEXT: u8 = 0x1;
pub const BINARY: u8 = 0x2;
pub const CLOSE: u8 = 0x8;
pub const PING: u8 = 0x9;
pub const PONG: u8 = 0xA;

/// Close codes (RFC 6455 §7.4.1).
pub mod code {
    pub const NORMAL: u16 = 1000;
    pub const GOING_AWAY: u16 = 1001;
    pub const PROTOCOL: u16 = 1002;
    pub const UNSUPPORTED: u16 = 1003;
    pub const INVALID_DATA: u16 = 1007;
    pub const TOO_BIG: u16 = 1009;
    pub const RESTART: u16 = 1012;
    pub const TRY_AGAIN_LATER: u16 = 1013;
}

/// Why the connection must close: a close code and a short reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub code: u16,
    pub reason: &'static str,
}

fn protocol(reason: &'static str) -> Violation {
    Violation { code: code::PROTOCOL, reason }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub fin: bool,
    pub opcode: u8,
    pub payload: Vec<u8>,
}

/// Reads client frames from bytes as they arrive.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    /// The largest payload one frame may declare.
    max_frame: usize,
}

impl Decoder {
    pub fn new(max_frame: usize) -> Decoder {
        Decoder { buf: BytesMut::new(), max_frame }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, `None` until one is in.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, Violation> {
        let b = &self.buf[..];
        if b.len() < 2 {
            return Ok(None);
        }
        let (b0, b1) = (b[0], b[1]);
        let fin = b0 & 0x80 != 0;
        if b0 & 0x70 != 0 {
            return Err(protocol("reserved bits set"));
        }
        let opcode = b0 & 0x0F;
        match opcode {
            CONTINUATION | TEXT | BINARY => {}
            CLOSE | PING | PONG => {
                if !fin {
                    return Err(protocol("fragmented control frame"));
                }
            }
            _ => return Err(protocol("unknown opcode")),
        }
        if b1 & 0x80 == 0 {
            return Err(protocol("client frames must be masked"));
        }
        let (len, mut at) = match b1 & 0x7F {
            126 => {
                if b.len() < 4 {
                    return Ok(None);
                }
                (u64::from(u16::from_be_bytes([b[2], b[3]])), 4)
            }
            127 => {
                if b.len() < 10 {
                    return Ok(None);
                }
                let n = u64::from_be_bytes(b[2..10].try_into().expect("8 bytes"));
                if n >> 63 != 0 {
                    return Err(protocol("length with its top bit set"));
                }
                (n, 10)
            }
            n => (u64::from(n), 2),
        };
        if opcode >= CLOSE && len > 125 {
            return Err(protocol("control frame over 125 bytes"));
        }
        if len > self.max_frame as u64 {
            return Err(Violation { code: code::TOO_BIG, reason: "message too big" });
        }
        let len = len as usize;
        if b.len() < at + 4 + len {
            return Ok(None);
        }
        let mask = [b[at], b[at + 1], b[at + 2], b[at + 3]];
        at += 4;
        let payload: Vec<u8> = b[at..at + len].iter().enumerate().map(|(i, x)| x ^ mask[i % 4]).collect();
        self.buf.advance(at + len);
        Ok(Some(Frame { fin, opcode, payload }))
    }
}

/// A whole message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Text(String),
    Binary(Vec<u8>),
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    /// The peer's close code (none when its frame had no body) and reason.
    Close(Option<u16>, String),
}

/// Joins fragments into messages; control frames pass between fragments.
#[derive(Debug)]
pub struct Assembler {
    partial: Option<(u8, Vec<u8>)>,
    max_message: usize,
}

impl Assembler {
    pub fn new(max_message: usize) -> Assembler {
        Assembler { partial: None, max_message }
    }

    pub fn frame(&mut self, f: Frame) -> Result<Option<Message>, Violation> {
        match f.opcode {
            PING => return Ok(Some(Message::Ping(f.payload))),
            PONG => return Ok(Some(Message::Pong(f.payload))),
            CLOSE => return close(&f.payload).map(Some),
            _ => {}
        }
        let (opcode, mut data) = match (f.opcode, self.partial.take()) {
            (CONTINUATION, Some((op, mut data))) => {
                data.extend_from_slice(&f.payload);
                (op, data)
            }
            (CONTINUATION, None) => return Err(protocol("continuation without a message")),
            (_, Some(_)) => return Err(protocol("a new message inside a fragmented one")),
            (op, None) => (op, f.payload),
        };
        if data.len() > self.max_message {
            return Err(Violation { code: code::TOO_BIG, reason: "message too big" });
        }
        if !f.fin {
            self.partial = Some((opcode, std::mem::take(&mut data)));
            return Ok(None);
        }
        match opcode {
            TEXT => String::from_utf8(data)
                .map(|s| Some(Message::Text(s)))
                .map_err(|_| Violation { code: code::INVALID_DATA, reason: "text is not UTF-8" }),
            _ => Ok(Some(Message::Binary(data))),
        }
    }
}

/// Client bytes in, whole messages out.
#[derive(Debug)]
pub struct Reader {
    decoder: Decoder,
    assembler: Assembler,
}

impl Reader {
    /// `max_message`: the largest message (and frame) accepted.
    pub fn new(max_message: usize) -> Reader {
        Reader { decoder: Decoder::new(max_message), assembler: Assembler::new(max_message) }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.decoder.push(bytes);
    }

    /// Bytes held for messages not yet whole: frames not yet complete, and the fragments of a
    /// message not yet ended.
    pub fn buffered(&self) -> usize {
        self.decoder.buf.len() + self.assembler.partial.as_ref().map_or(0, |p| p.1.len())
    }

    /// The next whole message, `None` until one is in.
    pub fn next_message(&mut self) -> Result<Option<Message>, Violation> {
        while let Some(f) = self.decoder.next_frame()? {
            if let Some(m) = self.assembler.frame(f)? {
                return Ok(Some(m));
            }
        }
        Ok(None)
    }
}

fn close(payload: &[u8]) -> Result<Message, Violation> {
    match payload.len() {
        0 => Ok(Message::Close(None, String::new())),
        1 => Err(protocol("close frame with a one-byte body")),
        _ => {
            let c = u16::from_be_bytes([payload[0], payload[1]]);
            // RFC 6455 §7.4 and IANA's registry (1012–1014 were registered after the RFC);
            // 1004–1006 and 1015 never go on the wire, 1016–2999 are unassigned.
            let valid = matches!(c, 1000..=1003 | 1007..=1014 | 3000..=4999);
            if !valid {
                return Err(protocol("invalid close code"));
            }
            let reason = std::str::from_utf8(&payload[2..])
                .map_err(|_| Violation { code: code::INVALID_DATA, reason: "close reason is not UTF-8" })?;
            Ok(Message::Close(Some(c), reason.to_owned()))
        }
    }
}

/// A frame's header: FIN, opcode, the mask bit and the payload length in its shortest form.
fn header(out: &mut Vec<u8>, fin: bool, opcode: u8, len: usize, masked: bool) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    let m = if masked { 0x80 } else { 0 };
    match len {
        n if n < 126 => out.push(m | n as u8),
        n if n <= 0xFFFF => {
            out.push(m | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(m | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
}

/// A server frame (never masked, never fragmented).
pub fn encode(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 10);
    header(&mut out, true, opcode, payload.len(), false);
    out.extend_from_slice(payload);
    out
}

/// A client frame, masked with `mask`: what the tests and the benchmark's client send.
pub fn masked(fin: bool, opcode: u8, payload: &[u8], mask: [u8; 4]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    header(&mut out, fin, opcode, payload.len(), true);
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// A close frame with a code and reason (the reason cut to fit 125 bytes).
pub fn close_frame(code: u16, reason: &str) -> Vec<u8> {
    let mut p = code.to_be_bytes().to_vec();
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    p.extend_from_slice(&reason.as_bytes()[..end]);
    encode(CLOSE, &p)
}

/// The fuzz target's body (`proxy/fuzz`, target `ws_frames`), also run over its corpus and by
/// a property test: any bytes, fed in pieces of any size, give whole messages until at most one
/// violation (with one of the reader's close codes), never a panic; the reader never holds more
/// than one unfinished frame and one unfinished message; and each message delivered reads back
/// the same when sent again as a single frame. The first byte picks the size limit and the
/// piece size.
pub fn fuzz_check(data: &[u8]) {
    let Some((&knobs, data)) = data.split_first() else { return };
    let max = 16 + usize::from(knobs & 0x0F) * 64;
    let piece = 1 + usize::from(knobs >> 4) * 37;
    let mut r = Reader::new(max);
    let mut got = Vec::new();
    'feed: for p in data.chunks(piece) {
        r.push(p);
        loop {
            match r.next_message() {
                Ok(Some(m)) => got.push(m),
                Ok(None) => break,
                Err(v) => {
                    assert!(matches!(v.code, code::PROTOCOL | code::INVALID_DATA | code::TOO_BIG), "{v:?}");
                    break 'feed;
                }
            }
        }
        assert!(r.buffered() < 14 + 2 * max, "{} bytes held under a limit of {max}", r.buffered());
    }
    for m in got {
        let (opcode, payload) = match &m {
            Message::Text(t) => (TEXT, t.as_bytes().to_vec()),
            Message::Binary(b) => (BINARY, b.clone()),
            Message::Ping(b) => (PING, b.clone()),
            Message::Pong(b) => (PONG, b.clone()),
            Message::Close(None, _) => (CLOSE, Vec::new()),
            Message::Close(Some(c), reason) => (CLOSE, [&c.to_be_bytes()[..], reason.as_bytes()].concat()),
        };
        let mut again = Reader::new(max);
        again.push(&masked(true, opcode, &payload, [1, 2, 3, 4]));
        assert_eq!(again.next_message(), Ok(Some(m)), "a delivered message reads back the same");
    }
}

#[cfg(test)]
pub(crate) fn client_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    // RFC 6455 §5.7's example mask.
    masked(fin, opcode, payload, [0x37, 0xfa, 0x21, 0x3d])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(bytes: &[u8], max: usize) -> Result<Vec<Message>, Violation> {
        let mut r = Reader::new(max);
        let mut out = Vec::new();
        // Byte by byte: frames split anywhere must still decode.
        for b in bytes {
            r.push(&[*b]);
            while let Some(m) = r.next_message()? {
                out.push(m);
            }
        }
        Ok(out)
    }

    #[test]
    fn the_rfc_examples_and_every_length_form() {
        // RFC 6455 §5.7: a masked "Hello".
        let hello = [0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58];
        assert_eq!(decode_all(&hello, 1 << 20), Ok(vec![Message::Text("Hello".into())]));
        assert_eq!(encode(TEXT, b"Hello"), [0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f]);
        for n in [0, 125, 126, 65535, 65536, 200_000] {
            let p: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            assert_eq!(
                decode_all(&client_frame(true, BINARY, &p), 1 << 20),
                Ok(vec![Message::Binary(p.clone())]),
                "{n}"
            );
            let e = encode(BINARY, &p);
            assert_eq!(
                e.len(),
                n + if n < 126 {
                    2
                } else if n <= 0xFFFF {
                    4
                } else {
                    10
                }
            );
        }
    }

    #[test]
    fn fragments_join_around_control_frames() {
        let mut bytes = client_frame(false, TEXT, b"hel");
        bytes.extend(client_frame(true, PING, b"p"));
        bytes.extend(client_frame(false, CONTINUATION, b"lo "));
        bytes.extend(client_frame(true, CONTINUATION, "wörld".as_bytes()));
        bytes.extend(client_frame(true, CLOSE, &[0x03, 0xe8, b'b', b'y', b'e']));
        assert_eq!(
            decode_all(&bytes, 1024),
            Ok(vec![
                Message::Ping(b"p".to_vec()),
                Message::Text("hello wörld".into()),
                Message::Close(Some(1000), "bye".into())
            ])
        );
    }

    #[test]
    fn violations_carry_their_close_codes() {
        let unmasked = [0x81, 0x02, b'h', b'i'];
        let cases: Vec<(Vec<u8>, u16)> = vec![
            (unmasked.to_vec(), code::PROTOCOL),
            (client_frame(true, 0x3, b"x"), code::PROTOCOL),
            (
                {
                    let mut f = client_frame(true, TEXT, b"x");
                    f[0] |= 0x40;
                    f
                },
                code::PROTOCOL,
            ),
            (client_frame(false, PING, b"x"), code::PROTOCOL),
            (client_frame(true, PING, &[0; 126]), code::PROTOCOL),
            (client_frame(true, CONTINUATION, b"x"), code::PROTOCOL),
            ([client_frame(false, TEXT, b"a"), client_frame(true, TEXT, b"b")].concat(), code::PROTOCOL),
            (client_frame(true, TEXT, &[0xff, 0xfe]), code::INVALID_DATA),
            (client_frame(true, TEXT, &[b'a'; 2000]), code::TOO_BIG),
            (
                [client_frame(false, TEXT, &[b'a'; 600]), client_frame(true, CONTINUATION, &[b'a'; 600])]
                    .concat(),
                code::TOO_BIG,
            ),
            (client_frame(true, CLOSE, &[0x03]), code::PROTOCOL),
            (client_frame(true, CLOSE, &[0x03, 0xed]), code::PROTOCOL),
        ];
        for (i, (bytes, want)) in cases.into_iter().enumerate() {
            match decode_all(&bytes, 1024) {
                Err(v) => assert_eq!(v.code, want, "case {i}: {}", v.reason),
                Ok(m) => panic!("case {i} accepted: {m:?}"),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_in_any_pieces_hold_the_fuzz_properties(data in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            fuzz_check(&data);
        }

        /// Mostly well-formed streams (real frames with random flags, opcodes and lengths), so
        /// the properties are checked past the first header too.
        #[test]
        fn framed_streams_hold_the_fuzz_properties(
            knobs in proptest::num::u8::ANY,
            frames in proptest::collection::vec((proptest::bool::ANY, 0u8..16, proptest::collection::vec(proptest::num::u8::ANY, 0..200)), 0..12),
        ) {
            let mut data = vec![knobs];
            for (fin, opcode, payload) in frames {
                data.extend(masked(fin, opcode, &payload, [9, 8, 7, 6]));
            }
            fuzz_check(&data);
        }
    }

    #[test]
    fn close_frames_cut_long_reasons_on_a_char_boundary() {
        let f = close_frame(1001, &"é".repeat(100));
        assert!(f.len() <= 127 && f[1] as usize == f.len() - 2);
        assert!(std::str::from_utf8(&f[4..]).is_ok());
    }
}
