//! The block transfer's wire format, over one TCP connection per fetch.
//!
//! The decode replica sends one line of JSON, [`FetchRequest`]. The prefill replica answers
//! with one frame per hash asked for, in order: a 20-byte header — the block's hash (u64), its
//! length in bytes (u32) and the xxh3-64 of its bytes (u64), little-endian — then the bytes. A
//! header of length [`MISSING`] (and no bytes) says the block is not held there; nothing follows
//! it. The connection then closes.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};
use warmpath_wire::prefix::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

/// Length of a header that says "not held here".
pub const MISSING: u32 = u32::MAX;
/// Header bytes per frame.
pub const HEADER: usize = 20;
/// Longest request line accepted.
pub const MAX_REQUEST: usize = 1 << 20;
/// Largest block accepted (a 70B model's 16-token block is 5 MiB).
pub const MAX_BLOCK: u32 = 64 << 20;

/// What a decode replica asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FetchRequest {
    /// The prefill request whose blocks these are (`remote_request_id`).
    pub request_id: u64,
    /// The blocks wanted, by chained hash, in prompt order.
    pub hashes: Vec<BlockHash>,
    /// Free the request's held blocks once served: no other fetch will come.
    pub release: bool,
}

/// The header and bytes of one block.
pub fn encode(hash: BlockHash, data: &[u8], out: &mut Vec<u8>) {
    out.extend(hash.to_le_bytes());
    out.extend((data.len() as u32).to_le_bytes());
    out.extend(xxh3_64(data).to_le_bytes());
    out.extend(data);
}

/// The header saying `hash` is not held.
pub fn encode_missing(hash: BlockHash, out: &mut Vec<u8>) {
    out.extend(hash.to_le_bytes());
    out.extend(MISSING.to_le_bytes());
    out.extend(0u64.to_le_bytes());
}

/// What reading one frame gave.
#[derive(Debug, PartialEq)]
pub enum Frame {
    Block(Vec<u8>),
    /// The sender does not hold it.
    Missing,
    /// The header names another block than the one expected.
    WrongBlock,
    /// The bytes do not match their checksum (or the length is absurd).
    Corrupt,
}

/// Reads the frame of block `want`; an I/O error means the connection ended early.
pub async fn read<R: AsyncRead + Unpin>(r: &mut R, want: BlockHash) -> std::io::Result<Frame> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).await?;
    let hash = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    let sum = u64::from_le_bytes(h[12..20].try_into().expect("8 bytes"));
    if len == MISSING {
        return Ok(Frame::Missing);
    }
    if hash != want {
        return Ok(Frame::WrongBlock);
    }
    if len > MAX_BLOCK {
        return Ok(Frame::Corrupt);
    }
    let mut data = vec![0u8; len as usize];
    r.read_exact(&mut data).await?;
    Ok(if xxh3_64(&data) == sum { Frame::Block(data) } else { Frame::Corrupt })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_damage_is_seen() {
        let mut buf = Vec::new();
        encode(7, b"abcd", &mut buf);
        encode_missing(8, &mut buf);
        let mut r = &buf[..];
        assert_eq!(read(&mut r, 7).await.expect("valid frame"), Frame::Block(b"abcd".to_vec()));
        assert_eq!(read(&mut r, 8).await.expect("valid frame"), Frame::Missing);
        assert!(read(&mut r, 9).await.is_err(), "nothing left: the connection ended");

        let mut bad = Vec::new();
        encode(7, b"abcd", &mut bad);
        *bad.last_mut().expect("valid frame") ^= 1;
        assert_eq!(read(&mut &bad[..], 7).await.expect("valid frame"), Frame::Corrupt, "one flipped bit");
        assert_eq!(read(&mut &buf[..], 6).await.expect("valid frame"), Frame::WrongBlock);
        let mut cut = Vec::new();
        encode(7, b"abcd", &mut cut);
        cut.truncate(cut.len() - 1);
        assert!(read(&mut &cut[..], 7).await.is_err(), "a block cut short");
    }
}
