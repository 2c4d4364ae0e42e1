//! The tensor-core tile layout of Q4_0, Q4_1 and Q8_0 matrices on the GPU, read by `kernels.cu`'s `qmatmuls_*`
//! (and by its `decode` for embedding rows and the f32-activation kernel).
//!
//! An m16n8k32 MMA takes its A operand (16 output columns × 32 values of one quant block) as four 32-bit
//! registers per lane: lane `4g + i` holds bytes `4i..4i+3` of rows `g` and `g + 8` and bytes `16 + 4i..` of the
//! same rows. GGUF stores each row's blocks contiguously, so those bytes are 16 rows apart; repacked once at
//! upload, one coalesced 8-byte (4-bit formats) or 16-byte (Q8_0) load per lane fetches a (tile, block).
//!
//! Layout for `rows` × `cols` (nb = cols / 32 blocks per row, `tiles` = ⌈rows / 16⌉, rows past `rows` zero):
//! - quants, per (tile, block) in tile-major order, `quant_bytes` bytes: for the 4-bit formats lane `l = 4g + i`
//!   has bytes `8l..8l+4` = qs[4i..4i+4] of row g and `8l+4..8l+8` = those of row g + 8 (low nibbles are values
//!   4i.., high nibbles 16 + 4i..); for Q8_0 lane l has 16 bytes: qs[4i..] of row g, of row g + 8, then qs[16+4i..]
//!   of row g and of row g + 8;
//! - scales, per (tile, block) 16 little-endian words, one per row: the f16 scale, and for Q4_1 the f16 offset
//!   in the high half.

use crate::quant::GgmlType;

/// Rows per tile (the MMA's M).
pub const TILE_ROWS: usize = 16;

/// Bytes of one (tile, block) of quants.
pub fn quant_bytes(ty: GgmlType) -> usize {
    if ty == GgmlType::Q8_0 {
        512
    } else {
        256
    }
}

/// Whether `ty` has a tiled form.
pub fn tileable(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// The number of tiles of a matrix of `rows` output columns.
pub fn tiles(rows: usize) -> usize {
    rows.div_ceil(TILE_ROWS)
}

/// Where a block's quants and its scale word(s) sit in a GGUF block of `ty`.
fn block_parts(ty: GgmlType, blk: &[u8]) -> (&[u8], u32) {
    let h = |at: usize| u32::from(u16::from_le_bytes([blk[at], blk[at + 1]]));
    match ty {
        GgmlType::Q4_0 => (&blk[2..18], h(0)),
        GgmlType::Q4_1 => (&blk[4..20], h(0) | (h(2) << 16)),
        GgmlType::Q8_0 => (&blk[2..34], h(0)),
        _ => unreachable!("not a tiled format"),
    }
}

/// Repack a GGUF matrix (`rows` rows of `cols` values, row-major blocks) into the tile layout.
pub fn tile(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    assert!(tileable(ty) && cols.is_multiple_of(32));
    let (nb, bb, qb) = (cols / 32, ty.block_bytes(), quant_bytes(ty));
    assert_eq!(data.len(), rows * nb * bb, "matrix bytes");
    let nt = tiles(rows);
    let mut out = vec![0u8; nt * nb * (qb + 4 * TILE_ROWS)];
    let (quants, scales) = out.split_at_mut(nt * nb * qb);
    for r in 0..rows {
        let (t, j) = (r / TILE_ROWS, r % TILE_ROWS);
        let (g, hi) = (j % 8, j / 8);
        for b in 0..nb {
            let at = (r * nb + b) * bb;
            let (qs, sw) = block_parts(ty, &data[at..at + bb]);
            let tb = t * nb + b;
            let q = &mut quants[tb * qb..(tb + 1) * qb];
            for i in 0..4 {
                let lane = 4 * g + i;
                if ty == GgmlType::Q8_0 {
                    let o = lane * 16 + hi * 4;
                    q[o..o + 4].copy_from_slice(&qs[4 * i..4 * i + 4]);
                    q[o + 8..o + 12].copy_from_slice(&qs[16 + 4 * i..16 + 4 * i + 4]);
                } else {
                    let o = lane * 8 + hi * 4;
                    q[o..o + 4].copy_from_slice(&qs[4 * i..4 * i + 4]);
                }
            }
            let s = (tb * TILE_ROWS + j) * 4;
            scales[s..s + 4].copy_from_slice(&sw.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 32 values of block b of row r as `kernels.cu`'s tiled `decode` reads them back (same byte offsets),
    /// as integers with the scale word.
    fn read_back(
        ty: GgmlType,
        tiled: &[u8],
        rows: usize,
        nb: usize,
        r: usize,
        b: usize,
    ) -> ([i32; 32], u32) {
        let qb = quant_bytes(ty);
        let (t, j) = (r / 16, r % 16);
        let (g, hi) = (j & 7, j >> 3);
        let q = &tiled[(t * nb + b) * qb..];
        let mut v = [0i32; 32];
        for i in 0..4 {
            let lane = 4 * g + i;
            for e in 0..4 {
                if ty == GgmlType::Q8_0 {
                    v[4 * i + e] = i32::from(q[lane * 16 + hi * 4 + e] as i8);
                    v[16 + 4 * i + e] = i32::from(q[lane * 16 + 8 + hi * 4 + e] as i8);
                } else {
                    let byte = q[lane * 8 + hi * 4 + e];
                    v[4 * i + e] = i32::from(byte & 15);
                    v[16 + 4 * i + e] = i32::from(byte >> 4);
                }
            }
        }
        let s = tiles(rows) * nb * qb + ((t * nb + b) * 16 + j) * 4;
        let sw = u32::from_le_bytes(tiled[s..s + 4].try_into().unwrap());
        (v, sw)
    }

    /// The block's quants as integers from its GGUF bytes (Q4 nibbles unsigned, as stored).
    fn gguf_values(ty: GgmlType, blk: &[u8]) -> ([i32; 32], u32) {
        let (qs, sw) = block_parts(ty, blk);
        let mut v = [0i32; 32];
        for (i, slot) in v.iter_mut().enumerate() {
            *slot = if ty == GgmlType::Q8_0 {
                i32::from(qs[i] as i8)
            } else if i < 16 {
                i32::from(qs[i] & 15)
            } else {
                i32::from(qs[i - 16] >> 4)
            };
        }
        (v, sw)
    }

    #[test]
    fn every_block_reads_back_from_its_tile_slot() {
        let mut seed = 0x1234_5678u32;
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            // Ragged: 37 rows (a partial last tile), 3 blocks per row.
            let (rows, cols) = (37, 96);
            let nb = cols / 32;
            let data: Vec<u8> = (0..rows * nb * ty.block_bytes())
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 24) as u8
                })
                .collect();
            let tiled = tile(ty, rows, cols, &data);
            assert_eq!(tiled.len(), tiles(rows) * nb * (quant_bytes(ty) + 64));
            for r in 0..rows {
                for b in 0..nb {
                    let at = (r * nb + b) * ty.block_bytes();
                    let want = gguf_values(ty, &data[at..at + ty.block_bytes()]);
                    assert_eq!(
                        read_back(ty, &tiled, rows, nb, r, b),
                        want,
                        "{ty:?} row {r} block {b}"
                    );
                }
            }
            // The padding rows of the last tile are zeros.
            for r in rows..tiles(rows) * 16 {
                assert_eq!(read_back(ty, &tiled, rows, nb, r, 0), ([0; 32], 0));
            }
        }
    }
}
