//! Weights repacked eight rows at a time, for kernels that compute eight rows' dot products in
//! the eight lanes of one register (llama.cpp repacks Q4_0 for its AVX2 GEMM likewise). In a
//! group of eight rows, each block is stored as the eight rows' scales (half precision, as in
//! the file), then the quants in chunks of 32 bytes: chunk `c` holds, for rows 0 to 7 in turn,
//! bytes `4c..4c + 4` of that row's quants. One 32-byte load then gives four quants (Q8_0) or
//! four bytes of nibbles (Q4_1: four positions in the low nibbles, the four 16 further on in the
//! high ones) of all eight rows, against which four activation bytes broadcast to every lane
//! multiply. Each weight block is unpacked once for up to four activation rows, and no
//! horizontal sums are needed: the lanes are the outputs. The bytes take exactly as much room
//! as the file's blocks.

use warmpath_wire::gguf::GgmlType;

/// Rows per group.
pub const ROWS: usize = 8;

/// Bytes of a group's block of 32 positions, for the types repacked: (scale bytes before the
/// quants, total).
pub fn block_layout(ty: GgmlType) -> Option<(usize, usize)> {
    match ty {
        // d, m: 8 halves each; 16 bytes of nibbles per row.
        GgmlType::Q4_1 => Some((32, 32 + 16 * ROWS)),
        // d: 8 halves; 32 quants per row.
        GgmlType::Q8_0 => Some((16, 16 + 32 * ROWS)),
        _ => None,
    }
}

/// `data` (`rows` rows of `row_bytes`, blocks of `ty` as in the file) in groups of eight rows,
/// or `None` where the type is not repacked or the rows are not whole groups.
pub fn pack(ty: GgmlType, rows: usize, row_bytes: usize, data: &[u8]) -> Option<Vec<u8>> {
    let (head, block) = block_layout(ty)?;
    if rows % ROWS != 0 || rows == 0 {
        return None;
    }
    let (src_block, scales) = (ty.block_bytes(), head / ROWS);
    let nb = row_bytes / src_block;
    let mut out = vec![0u8; rows / ROWS * nb * block];
    for (g, group) in out.chunks_exact_mut(nb * block).enumerate() {
        for (k, dst) in group.chunks_exact_mut(block).enumerate() {
            for r in 0..ROWS {
                let row = &data[(g * ROWS + r) * row_bytes..][..row_bytes];
                let src = &row[k * src_block..(k + 1) * src_block];
                // Scales: each kind of scale as eight halves in a row.
                for s in 0..scales / 2 {
                    dst[s * 2 * ROWS + 2 * r..][..2].copy_from_slice(&src[2 * s..2 * s + 2]);
                }
                for (c, q) in src[scales..].chunks_exact(4).enumerate() {
                    dst[head + c * 4 * ROWS + 4 * r..][..4].copy_from_slice(q);
                }
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_blocks_are_interleaved_by_rows() {
        // 8 rows of one Q4_1 block (20 bytes: d, m, 16 nibble bytes), byte values tagging row and offset.
        let data: Vec<u8> = (0..8u8).flat_map(|r| (0..20u8).map(move |b| r * 32 + b)).collect();
        let p = pack(GgmlType::Q4_1, 8, 20, &data).expect("packed");
        assert_eq!(p.len(), 160);
        // d of rows 0..8, then m of rows 0..8.
        assert_eq!(&p[..4], &[0, 1, 32, 33]);
        assert_eq!(&p[16..20], &[2, 3, 34, 35]);
        // Chunk 0: row 0's nibble bytes 0..4 (offsets 4..8), row 1's, ...
        assert_eq!(&p[32..40], &[4, 5, 6, 7, 36, 37, 38, 39]);
        // Chunk 3, row 7: bytes 12..16 of its nibbles (offsets 16..20).
        assert_eq!(&p[156..160], &[7 * 32 + 16, 7 * 32 + 17, 7 * 32 + 18, 7 * 32 + 19]);
    }

    #[test]
    fn only_whole_groups_of_repacked_types() {
        assert!(pack(GgmlType::Q8_0, 7, 34, &[0; 7 * 34]).is_none());
        assert!(pack(GgmlType::Q4_K, 8, 144, &[0; 8 * 144]).is_none());
        assert_eq!(pack(GgmlType::Q8_0, 16, 68, &[0; 16 * 68]).map(|p| p.len()), Some(16 * 68));
    }
}
