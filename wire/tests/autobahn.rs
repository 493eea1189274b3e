//! The framing cases of the Autobahn WebSocket test suite (sections 1–7 and 10: framing,
//! ping/pong, reserved bits, opcodes, fragmentation, UTF-8, close handling, auto-
//! fragmentation), run against warmpath's frame reader. Each case sends the suite's frames,
//! fed whole, in the suite's chunks, and byte by byte, and checks what the server side makes of
//! them: the messages delivered (a server answers pings and echoes closes from these), and
//! where the suite expects the connection failed, the close code it fails with. Cases about
//! compression (12, 13) do not apply: warmpath offers no extension, so RSV1 is a protocol error
//! (section 3). Where the suite allows failing a bad UTF-8 text at its end rather than at the
//! first bad byte ("non-strict"), this reader fails at the end of the message.

use warmpath_wire::websocket::{
    code, masked, Message, Reader, BINARY, CLOSE, CONTINUATION, PING, PONG, TEXT,
};

/// A client frame with the suite's own mask.
fn frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    masked(fin, opcode, payload, [0x1f, 0x2e, 0x3d, 0x4c])
}

/// The same frame with reserved bits set (`rsv` in bits 4–6 of the first byte).
fn with_rsv(mut f: Vec<u8>, rsv: u8) -> Vec<u8> {
    f[0] |= rsv << 4;
    f
}

/// What the reader made of the bytes fed in `chunk`-sized pieces: the messages, and the close
/// code of the violation that ended it, if one did.
fn read(bytes: &[u8], chunk: usize) -> (Vec<Message>, Option<u16>) {
    let mut r = Reader::new(1 << 20);
    let mut out = Vec::new();
    for piece in bytes.chunks(chunk.max(1)) {
        r.push(piece);
        loop {
            match r.next_message() {
                Ok(Some(m)) => out.push(m),
                Ok(None) => break,
                Err(v) => return (out, Some(v.code)),
            }
        }
    }
    (out, None)
}

/// Runs one case fed whole, in 997-byte chunks and byte by byte; all must agree.
fn case(name: &str, bytes: &[u8], messages: &[Message], fails: Option<u16>) {
    for chunk in [bytes.len(), 997, 1] {
        let (got, failed) = read(bytes, chunk);
        assert_eq!(got, messages, "case {name} (chunks of {chunk}): messages");
        assert_eq!(failed, fails, "case {name} (chunks of {chunk}): close code");
    }
}

fn text(s: &str) -> Message {
    Message::Text(s.to_owned())
}

#[test]
fn section_1_framing() {
    for (i, n) in [0usize, 125, 126, 127, 128, 65535, 65536].into_iter().enumerate() {
        let t = "*".repeat(n);
        case(&format!("1.1.{}", i + 1), &frame(true, TEXT, t.as_bytes()), &[text(&t)], None);
        let b = vec![0xfe; n];
        case(&format!("1.2.{}", i + 1), &frame(true, BINARY, &b), &[Message::Binary(b.clone())], None);
    }
}

#[test]
fn section_2_pings_and_pongs() {
    case("2.1", &frame(true, PING, b""), &[Message::Ping(vec![])], None);
    case("2.2", &frame(true, PING, b"Hello, world!"), &[Message::Ping(b"Hello, world!".to_vec())], None);
    let bin = [0x00, 0xff, 0xfe, 0xfd, 0xfc, 0xfb, 0x00, 0xff];
    case("2.3", &frame(true, PING, &bin), &[Message::Ping(bin.to_vec())], None);
    case("2.4", &frame(true, PING, &[0xfe; 125]), &[Message::Ping(vec![0xfe; 125])], None);
    case("2.5", &frame(true, PING, &[0xfe; 126]), &[], Some(code::PROTOCOL));
    // Unsolicited pongs are read (and a server ignores them).
    case("2.7", &frame(true, PONG, b""), &[Message::Pong(vec![])], None);
    case(
        "2.8",
        &frame(true, PONG, b"unsolicited pong payload"),
        &[Message::Pong(b"unsolicited pong payload".to_vec())],
        None,
    );
    case(
        "2.9",
        &[frame(true, PONG, b"unsolicited pong payload"), frame(true, PING, b"ping payload")].concat(),
        &[Message::Pong(b"unsolicited pong payload".to_vec()), Message::Ping(b"ping payload".to_vec())],
        None,
    );
    let ten: Vec<u8> = (0..10).flat_map(|_| frame(true, PING, b"payload-0")).collect();
    case("2.10", &ten, &vec![Message::Ping(b"payload-0".to_vec()); 10], None);
}

#[test]
fn section_3_reserved_bits() {
    case("3.1", &with_rsv(frame(true, TEXT, b"Hello, world!"), 1), &[], Some(code::PROTOCOL));
    let ok = frame(true, TEXT, b"Hello, world!");
    let then_ping = frame(true, PING, b"");
    for (name, rsv, opcode) in [
        ("3.2", 2, TEXT),
        ("3.3", 3, TEXT),
        ("3.4", 4, TEXT),
        ("3.5", 5, BINARY),
        ("3.6", 6, PING),
        ("3.7", 7, CLOSE),
    ] {
        let bad = with_rsv(frame(true, opcode, if opcode == CLOSE { b"\x03\xe8" } else { b"x" }), rsv);
        let bytes = [ok.clone(), bad, then_ping.clone()].concat();
        case(name, &bytes, &[text("Hello, world!")], Some(code::PROTOCOL));
    }
}

#[test]
fn section_4_reserved_opcodes() {
    for (i, op) in [3u8, 4, 5, 6, 7].into_iter().enumerate() {
        case(&format!("4.1.{}a", i + 1), &frame(true, op, b""), &[], Some(code::PROTOCOL));
        let bytes =
            [frame(true, TEXT, b"Hello, world!"), frame(true, op, b"reserved"), frame(true, PING, b"")]
                .concat();
        case(&format!("4.1.{}b", i + 1), &bytes, &[text("Hello, world!")], Some(code::PROTOCOL));
    }
    for (i, op) in [11u8, 12, 13, 14, 15].into_iter().enumerate() {
        case(&format!("4.2.{}a", i + 1), &frame(true, op, b""), &[], Some(code::PROTOCOL));
        let bytes =
            [frame(true, TEXT, b"Hello, world!"), frame(true, op, b"reserved"), frame(true, PING, b"")]
                .concat();
        case(&format!("4.2.{}b", i + 1), &bytes, &[text("Hello, world!")], Some(code::PROTOCOL));
    }
}

#[test]
fn section_5_fragmentation() {
    let two = |op| [frame(false, op, b"fragment1"), frame(true, CONTINUATION, b"fragment2")].concat();
    case("5.1", &two(PING), &[], Some(code::PROTOCOL));
    case("5.2", &two(PONG), &[], Some(code::PROTOCOL));
    case("5.3", &two(TEXT), &[text("fragment1fragment2")], None);
    case("5.6", &two(BINARY), &[Message::Binary(b"fragment1fragment2".to_vec())], None);
    let around_ping =
        [frame(false, TEXT, b"fragment1"), frame(true, PING, b""), frame(true, CONTINUATION, b"fragment2")]
            .concat();
    case("5.7", &around_ping, &[Message::Ping(vec![]), text("fragment1fragment2")], None);
    let around_pong =
        [frame(false, TEXT, b"fragment1"), frame(true, PONG, b""), frame(true, CONTINUATION, b"fragment2")]
            .concat();
    case("5.8", &around_pong, &[Message::Pong(vec![]), text("fragment1fragment2")], None);
    // Continuations without a message started.
    let lone = [frame(true, CONTINUATION, b"non-continuation payload"), frame(true, TEXT, b"Hello, world!")]
        .concat();
    case("5.9", &lone, &[], Some(code::PROTOCOL));
    let lone_unfinished =
        [frame(false, CONTINUATION, b"non-continuation payload"), frame(true, TEXT, b"Hello, world!")]
            .concat();
    case("5.12", &lone_unfinished, &[], Some(code::PROTOCOL));
    // 5.15: a message, then continuations of none, then a new fragmented one.
    let bytes = [
        frame(false, TEXT, b"fragment1"),
        frame(true, CONTINUATION, b"fragment2"),
        frame(false, CONTINUATION, b"fragment3"),
        frame(true, TEXT, b"fragment4"),
    ]
    .concat();
    case("5.15", &bytes, &[text("fragment1fragment2")], Some(code::PROTOCOL));
    // 5.16: continuations first, then a text frame, twice over.
    let bytes = [
        frame(false, CONTINUATION, b"fragment1"),
        frame(false, TEXT, b"fragment2"),
        frame(true, CONTINUATION, b"fragment3"),
    ]
    .concat();
    case("5.16", &bytes, &[], Some(code::PROTOCOL));
    // 5.18: a second text frame inside a fragmented message.
    let bytes = [frame(false, TEXT, b"fragment1"), frame(true, TEXT, b"fragment2")].concat();
    case("5.18", &bytes, &[], Some(code::PROTOCOL));
    // 5.19: five fragments with two pings among them.
    let bytes = [
        frame(false, TEXT, b"fragment1"),
        frame(false, CONTINUATION, b"fragment2"),
        frame(true, PING, b"pongme 1!"),
        frame(false, CONTINUATION, b"fragment3"),
        frame(false, CONTINUATION, b"fragment4"),
        frame(true, PING, b"pongme 2!"),
        frame(true, CONTINUATION, b"fragment5"),
    ]
    .concat();
    case(
        "5.19",
        &bytes,
        &[
            Message::Ping(b"pongme 1!".to_vec()),
            Message::Ping(b"pongme 2!".to_vec()),
            text("fragment1fragment2fragment3fragment4fragment5"),
        ],
        None,
    );
}

/// A text message sent in `pieces` fragments of equal size (the last takes the rest), split
/// anywhere, also inside a code point.
fn fragmented(bytes: &[u8], piece: usize) -> Vec<u8> {
    if bytes.is_empty() {
        return frame(true, TEXT, b"");
    }
    let parts: Vec<&[u8]> = bytes.chunks(piece.max(1)).collect();
    let last = parts.len() - 1;
    parts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| frame(i == last, if i == 0 { TEXT } else { CONTINUATION }, p))
        .collect()
}

#[test]
fn section_6_utf8() {
    case("6.1.1", &frame(true, TEXT, b""), &[text("")], None);
    let empties =
        [frame(false, TEXT, b""), frame(false, CONTINUATION, b""), frame(true, CONTINUATION, b"")].concat();
    case("6.1.2", &empties, &[text("")], None);
    let middle =
        [frame(false, TEXT, b""), frame(false, CONTINUATION, b"middle"), frame(true, CONTINUATION, b"")]
            .concat();
    case("6.1.3", &middle, &[text("middle")], None);
    // Valid text, whole and cut into fragments of every size (splitting code points).
    for (name, s) in
        [("6.2", "Hello-µ@ßöäüàá-UTF-8!!"), ("6.5", "κόσμε"), ("6.9", "\u{7f}\u{7ff}\u{ffff}\u{10ffff}")]
    {
        for piece in 1..=s.len() {
            case(&format!("{name} in pieces of {piece}"), &fragmented(s.as_bytes(), piece), &[text(s)], None);
        }
    }
    // Non-characters and the byte order mark are valid (6.22, 6.23).
    for s in ["\u{fffe}", "\u{ffff}", "\u{fdd0}", "\u{1fffe}", "\u{10ffff}", "\u{feff}"] {
        case("6.22/6.23", &frame(true, TEXT, s.as_bytes()), &[text(s)], None);
    }
    // Invalid UTF-8: the connection fails with 1007, whole or fragmented (6.3, 6.4, 6.6–6.21).
    let invalid: &[&[u8]] = &[
        b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5\xed\xa0\x80\x65\x64\x69\x74\x65\x64", // 6.3: a surrogate in "edited"
        b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5\xf4\x90\x80\x80\x65\x64\x69\x74\x65\x64", // 6.4: past U+10FFFF
        b"\xce",                     // 6.6: a lone start byte
        b"\xf8\x88\x80\x80\x80",     // 6.8: a five-byte sequence
        b"\xfc\x84\x80\x80\x80\x80", // 6.8: a six-byte sequence
        b"\xf4\x90\x80\x80",         // 6.10: past U+10FFFF
        b"\x80",                     // 6.12: a lone continuation byte
        b"\xbf\x80\xbf",             // 6.12
        b"\xc0\x20",                 // 6.14: a start byte, then a space
        b"\xe0\x80",                 // 6.15: a sequence missing its last byte
        b"\xfe",                     // 6.17: impossible bytes
        b"\xff",
        b"\xc0\xaf", // 6.18: overlong '/'
        b"\xe0\x80\xaf",
        b"\xf0\x80\x80\xaf",
        b"\xc1\xbf",     // 6.19: overlong maxima
        b"\xed\xa0\x80", // 6.20: single surrogates
        b"\xed\xbf\xbf",
        b"\xed\xa0\x80\xed\xb0\x80", // 6.21: paired surrogates
    ];
    for (i, bad) in invalid.iter().enumerate() {
        case(&format!("6.x invalid #{i}"), &frame(true, TEXT, bad), &[], Some(code::INVALID_DATA));
        case(&format!("6.x invalid #{i} bytewise"), &fragmented(bad, 1), &[], Some(code::INVALID_DATA));
    }
}

fn close(code: u16, reason: &[u8]) -> Vec<u8> {
    frame(true, CLOSE, &[&code.to_be_bytes()[..], reason].concat())
}

#[test]
fn section_7_close() {
    case(
        "7.1.1",
        &[frame(true, TEXT, b"Hello World!"), close(1000, b"")].concat(),
        &[text("Hello World!"), Message::Close(Some(1000), String::new())],
        None,
    );
    case("7.3.1", &frame(true, CLOSE, b""), &[Message::Close(None, String::new())], None);
    case("7.3.2", &frame(true, CLOSE, b"a"), &[], Some(code::PROTOCOL));
    case("7.3.3", &close(1000, b""), &[Message::Close(Some(1000), String::new())], None);
    case("7.3.4", &close(1000, b"Hello World!"), &[Message::Close(Some(1000), "Hello World!".into())], None);
    let r123 = "*".repeat(123);
    case("7.3.5", &close(1000, r123.as_bytes()), &[Message::Close(Some(1000), r123)], None);
    case("7.3.6", &close(1000, "*".repeat(124).as_bytes()), &[], Some(code::PROTOCOL));
    case(
        "7.5.1",
        &close(1000, b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5\xed\xa0\x80\x65\x64\x69\x74\x65\x64"),
        &[],
        Some(code::INVALID_DATA),
    );
    for c in [1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 3000, 3999, 4000, 4999] {
        case(&format!("7.7 {c}"), &close(c, b""), &[Message::Close(Some(c), String::new())], None);
    }
    for c in [0, 999, 1004, 1005, 1006, 1016, 1100, 2000, 2999] {
        case(&format!("7.9 {c}"), &close(c, b""), &[], Some(code::PROTOCOL));
    }
    // 7.13: codes outside every range (the suite leaves the answer open; this reader fails).
    for c in [5000, 65535] {
        case(&format!("7.13 {c}"), &close(c, b""), &[], Some(code::PROTOCOL));
    }
}

#[test]
fn section_10_a_large_message_in_many_frames() {
    let payload = vec![b'*'; 65536];
    let t = String::from_utf8(payload.clone()).expect("ascii");
    for piece in [64, 256, 1300, 4096] {
        case(&format!("10.1.1 in {piece}"), &fragmented(&payload, piece), &[text(&t)], None);
    }
}
