//! Finding where a JSON value ends without parsing it. A request's top level is read field by
//! field, and each value's extent is found from its brackets and strings alone, 64 bytes at a
//! time: the bytes that are quotes, backslashes and brackets become bit masks (AVX2 or SSE2
//! where the CPU has them, plain code elsewhere), escaped quotes are told apart by the parity of
//! the backslash runs before them, the bytes inside strings by a prefix XOR of the quotes, and
//! the depth is counted over the brackets that are left. What a value holds is parsed only by
//! the stage that reads it, so a pool that reads none of it passes the body on having looked at
//! each byte once (the approach of simdjson's first stage, for skipping only).
//!
//! What is checked: the body is UTF-8 (by the caller), the top level is an object with string
//! keys, brackets balance and nest at most [`MAX_DEPTH`] deep, strings are closed. What is not:
//! the grammar inside a value (`[1 2]` and `[1}` pass): the backend parses the body it is sent and
//! refuses it whole, so a value warmpath skipped cannot be read differently by the two.

use std::borrow::Cow;

/// Deepest nesting accepted: serde_json's limit, so every stage's parser agrees.
pub const MAX_DEPTH: usize = 128;

/// Why a body is not JSON warmpath can read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanError {
    pub what: &'static str,
    /// The byte where it was found.
    pub at: usize,
}

impl ScanError {
    fn new(what: &'static str, at: usize) -> ScanError {
        ScanError { what, at }
    }

    /// `what at line L column C`, as serde_json says it.
    pub fn describe(&self, text: &[u8]) -> String {
        let before = &text[..self.at.min(text.len())];
        let line = before.iter().filter(|&&c| c == b'\n').count() + 1;
        let column = before.iter().rev().take_while(|&&c| c != b'\n').count() + 1;
        format!("{} at line {line} column {column}", self.what)
    }
}

/// The top-level fields of an object, in order: each key (unescaped; borrowed unless it had
/// escapes) and its value's text. Fails on anything that is not one well-framed object.
pub fn object_fields(text: &str) -> Result<Vec<(Cow<'_, str>, &str)>, ScanError> {
    let b = text.as_bytes();
    let mut i = skip_ws(b, 0);
    match b.get(i) {
        Some(b'{') => {}
        Some(_) => return Err(ScanError::new("expected a JSON object", i)),
        None => return Err(ScanError::new("EOF while parsing a value", i)),
    }
    let mut fields = Vec::with_capacity(16);
    i = skip_ws(b, i + 1);
    if b.get(i) == Some(&b'}') {
        return end_of_text(b, i + 1).map(|()| fields);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return Err(ScanError::new(
                if i >= b.len() { "EOF while parsing an object" } else { "key must be a string" },
                i,
            ));
        }
        let key_end = string_end(b, i)?;
        let key = unescape(&text[i..key_end]).ok_or_else(|| ScanError::new("invalid string", i))?;
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return Err(ScanError::new("expected `:`", i));
        }
        i = skip_ws(b, i + 1);
        let end = value_end(b, i)?;
        fields.push((key, &text[i..end]));
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return end_of_text(b, i + 1).map(|()| fields),
            Some(_) => return Err(ScanError::new("expected `,` or `}`", i)),
            None => return Err(ScanError::new("EOF while parsing an object", i)),
        }
    }
}

/// The elements of a JSON array's text, each as its own text. `None` when it is not an array.
pub fn array_elements(text: &str) -> Result<Option<Vec<&str>>, ScanError> {
    let b = text.as_bytes();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'[') {
        return Ok(None);
    }
    let mut out = Vec::new();
    i = skip_ws(b, i + 1);
    if b.get(i) == Some(&b']') {
        return end_of_text(b, i + 1).map(|()| Some(out));
    }
    loop {
        let end = value_end(b, i)?;
        out.push(&text[i..end]);
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b']') => return end_of_text(b, i + 1).map(|()| Some(out)),
            Some(_) => return Err(ScanError::new("expected `,` or `]`", i)),
            None => return Err(ScanError::new("EOF while parsing a list", i)),
        }
    }
}

/// The end (exclusive) of the JSON value that starts at `at`.
pub fn value_end(b: &[u8], at: usize) -> Result<usize, ScanError> {
    match b.get(at) {
        None => Err(ScanError::new("EOF while parsing a value", at)),
        Some(b'{' | b'[') => container_end(b, at),
        Some(b'"') => string_end(b, at),
        Some(_) => scalar_end(b, at),
    }
}

fn end_of_text(b: &[u8], i: usize) -> Result<(), ScanError> {
    let i = skip_ws(b, i);
    if i == b.len() {
        Ok(())
    } else {
        Err(ScanError::new("trailing characters", i))
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        i += 1;
    }
    i
}

/// A number, `true`, `false` or `null`: its characters up to the next delimiter.
fn scalar_end(b: &[u8], at: usize) -> Result<usize, ScanError> {
    let mut i = at;
    while let Some(&c) = b.get(i) {
        match c {
            b'0'..=b'9' | b'a'..=b'z' | b'+' | b'-' | b'.' | b'E' => i += 1,
            b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t' => break,
            _ => return Err(ScanError::new("expected value", i)),
        }
    }
    if i == at {
        return Err(ScanError::new("expected value", at));
    }
    Ok(i)
}

/// A key's text (with its quotes) unescaped: borrowed when it has no escapes.
fn unescape(quoted: &str) -> Option<Cow<'_, str>> {
    let inner = &quoted[1..quoted.len() - 1];
    if inner.bytes().all(|c| c >= 0x20 && c != b'\\') {
        return Some(Cow::Borrowed(inner));
    }
    serde_json::from_str::<String>(quoted).ok().map(Cow::Owned)
}

/// The end of the string whose opening quote is at `at` (just past its closing quote).
fn string_end(b: &[u8], at: usize) -> Result<usize, ScanError> {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::has_avx2() {
            return simd::string_end_avx2(b, at);
        }
        string_end_with::<simd::Sse2>(b, at)
    }
    #[cfg(not(target_arch = "x86_64"))]
    string_end_with::<Plain>(b, at)
}

/// The end of the object or list that opens at `at` (just past its closing bracket).
fn container_end(b: &[u8], at: usize) -> Result<usize, ScanError> {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::has_avx2() {
            return simd::container_end_avx2(b, at);
        }
        container_end_with::<simd::Sse2>(b, at)
    }
    #[cfg(not(target_arch = "x86_64"))]
    container_end_with::<Plain>(b, at)
}

/// [`string_end`] with classifier `C`, inlined into its caller (compiled there with the CPU
/// features the caller enables).
#[inline(always)]
fn string_end_with<C: Classifier>(b: &[u8], at: usize) -> Result<usize, ScanError> {
    let mut blocks = Blocks::<C>::new(b, at);
    while let Some(m) = blocks.next() {
        // The first unescaped quote after the opening one closes it.
        let quotes = if m.base == at { m.quotes & !1 } else { m.quotes };
        if quotes != 0 {
            return Ok(m.base + quotes.trailing_zeros() as usize + 1);
        }
    }
    Err(ScanError::new("EOF while parsing a string", b.len()))
}

/// [`container_end`] with classifier `C`. Brackets are counted, not matched by kind: a body
/// whose brackets cross (`[}`) is one the backend refuses whole.
#[inline(always)]
fn container_end_with<C: Classifier>(b: &[u8], at: usize) -> Result<usize, ScanError> {
    let mut depth = 0usize;
    let mut blocks = Blocks::<C>::new(b, at);
    while let Some(m) = blocks.next() {
        let open = m.open & !m.inside;
        let close = m.close & !m.inside;
        let (opens, closes) = (open.count_ones() as usize, close.count_ones() as usize);
        // Most blocks of a long value can neither close it nor go past the depth limit: counted
        // whole.
        if closes < depth && depth + opens <= MAX_DEPTH {
            depth = depth + opens - closes;
            continue;
        }
        let mut brackets = open | close;
        while brackets != 0 {
            let i = brackets.trailing_zeros() as usize;
            brackets &= brackets - 1;
            if open >> i & 1 == 1 {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(ScanError::new("recursion limit exceeded", m.base + i));
                }
            } else {
                depth -= 1;
                if depth == 0 {
                    return Ok(m.base + i + 1);
                }
            }
        }
    }
    Err(ScanError::new("EOF while parsing a list or object", b.len()))
}

/// One 64-byte block's masks: bit `i` stands for byte `base + i`.
#[derive(Debug, Default, Clone, Copy)]
struct Block {
    base: usize,
    /// Quotes that are not escaped.
    quotes: u64,
    /// `{` and `[`; `}` and `]` (inside strings too: masked with `inside` where it matters).
    open: u64,
    close: u64,
    /// Bytes inside a string, its opening quote included.
    inside: u64,
}

/// The raw masks of 64 bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Masks {
    quote: u64,
    backslash: u64,
    open: u64,
    close: u64,
}

/// Turns 64 bytes into their masks.
trait Classifier {
    fn classify(block: &[u8; 64]) -> Masks;

    /// Each bit the XOR of itself and every bit below it: 1 from an opening quote up to, not
    /// including, its closing one. (A carry-less multiply by all ones where the CPU has one.)
    #[inline(always)]
    fn prefix_xor(mut x: u64) -> u64 {
        x ^= x << 1;
        x ^= x << 2;
        x ^= x << 4;
        x ^= x << 8;
        x ^= x << 16;
        x ^= x << 32;
        x
    }
}

/// The blocks from `at` on, with the state that crosses block edges: whether the last block
/// ended inside a string, and in an odd run of backslashes.
struct Blocks<'a, C> {
    b: &'a [u8],
    next: usize,
    in_string: u64,
    odd_backslash: u64,
    classifier: std::marker::PhantomData<C>,
}

impl<'a, C: Classifier> Blocks<'a, C> {
    #[inline(always)]
    fn new(b: &'a [u8], at: usize) -> Blocks<'a, C> {
        Blocks { b, next: at, in_string: 0, odd_backslash: 0, classifier: std::marker::PhantomData }
    }

    #[inline(always)]
    fn next(&mut self) -> Option<Block> {
        let base = self.next;
        if base >= self.b.len() {
            return None;
        }
        let rest = &self.b[base..];
        let m = match rest.first_chunk::<64>() {
            Some(chunk) => C::classify(chunk),
            None => {
                let mut pad = [b' '; 64];
                pad[..rest.len()].copy_from_slice(rest);
                C::classify(&pad)
            }
        };
        self.next = base + 64;
        // Most blocks have no backslash, and most that have one are in a string.
        let escaped = if m.backslash | self.odd_backslash == 0 {
            0
        } else {
            escaped(m.backslash, &mut self.odd_backslash)
        };
        let quotes = m.quote & !escaped;
        let inside = C::prefix_xor(quotes) ^ self.in_string;
        self.in_string = ((inside as i64) >> 63) as u64;
        Some(Block { base, quotes, open: m.open, close: m.close, inside })
    }
}

/// The bytes escaped by a backslash: those right after an odd-length run of backslashes.
/// `carry` is 1 when the previous block ended in such a run, and is updated for the next.
#[inline(always)]
fn escaped(backslash: u64, carry: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    const ODD: u64 = !EVEN;
    let starts = backslash & !(backslash << 1);
    // A run carried in from the last block shifts which starts count as even.
    let even_start_mask = EVEN ^ *carry;
    let even_starts = starts & even_start_mask;
    let odd_starts = starts & !even_start_mask;
    let even_carries = backslash.wrapping_add(even_starts);
    let (odd_carries, overflow) = backslash.overflowing_add(odd_starts);
    let odd_carries = odd_carries | *carry;
    *carry = overflow as u64;
    let even_carry_ends = even_carries & !backslash;
    let odd_carry_ends = odd_carries & !backslash;
    (even_carry_ends & ODD) | (odd_carry_ends & EVEN)
}

/// The portable classifier, byte by byte (x86-64 uses it only to check the others).
#[cfg(any(test, not(target_arch = "x86_64")))]
struct Plain;

#[cfg(any(test, not(target_arch = "x86_64")))]
impl Classifier for Plain {
    #[inline(always)]
    fn classify(block: &[u8; 64]) -> Masks {
        let mut m = Masks::default();
        for (i, &c) in block.iter().enumerate() {
            let bit = 1u64 << i;
            match c {
                b'"' => m.quote |= bit,
                b'\\' => m.backslash |= bit,
                b'{' | b'[' => m.open |= bit,
                b'}' | b']' => m.close |= bit,
                _ => {}
            }
        }
        m
    }
}

#[cfg(target_arch = "x86_64")]
mod simd;

#[cfg(test)]
mod tests;
