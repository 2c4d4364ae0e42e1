//! The tensor-core tile layout of quantized matrices on the GPU, read by `kernels.cu`'s `qmatmuls_*` (and by
//! its `decode` for embedding rows and the f32-activation kernel): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
//! K-quants Q4_K, Q5_K, Q6_K (what a `_K_M` file holds), with Q3_K stored as Q6_K (its 3-bit values `v`,
//! offset 4, as the 6-bit values `v + 28`, offset 32 — the same integers — under its own signed scales), as the
//! CPU's repacked kernels hold it.
//!
//! An m16n8k32 MMA takes its A operand (16 output columns × 32 values of one quant block) as four 32-bit
//! registers per lane: lane `4g + i` holds bytes `4i..4i+3` of rows `g` and `g + 8` and bytes `16 + 4i..` of the
//! same rows. GGUF stores each row's blocks contiguously, so those bytes are 16 rows apart; repacked once at
//! upload, one coalesced load per lane fetches a (tile, block).
//!
//! Layout for `rows` × `cols` (nb = cols / 32 blocks per row, `tiles` = ⌈rows / 16⌉, rows past `rows` zero):
//! - quants, per (tile, block) in tile-major order, [`quant_bytes`] bytes. Q8_0: lane `l` has 16 bytes,
//!   values `4i..` of row g, of row g + 8, then values `16+4i..` of row g and of row g + 8 (signed bytes). The
//!   other formats: 256 bytes of nibbles, lane `l` 8 bytes: values `4i..4i+4` of row g in the low nibbles of
//!   bytes `8l..8l+4` and values `16+4i..` in their high nibbles, then row g + 8 likewise; then their high bits:
//!   5-bit formats 64 bytes, lane `l` a little-endian u16 whose bits `4e..4e+4` are bit 4 of (row g, value
//!   `4i+e`), (row g, `16+4i+e`), (row g + 8, `4i+e`), (row g + 8, `16+4i+e`); 6-bit formats 128 bytes, lane
//!   `l` four bytes, byte `e` holding bits 4-5 of the same four values in that order, two bits each.
//! - scales. Legacy formats: per (tile, block) 16 little-endian words, one per row: the block's f16 scale, and
//!   for Q4_1/Q5_1 its f16 offset in the high half. K-quants: per (tile, super-block of 8 blocks) 16 words, the
//!   f16 `d` (and for Q4_K/Q5_K `dmin` in the high half), then per block 16 u16, Q4_K/Q5_K the 6-bit scale and
//!   min (`sc | min << 8`), Q6_K/Q3_K the signed scales of the block's two 16-value halves.
//!
//! What the kernels compute from it is the CPU's 8-bit contract (`backend/cpu/packed.rs`), so a GPU row is
//! bitwise the CPU's.

use crate::quant::ggml::{q3_k_scales, scale_min_k4};
use crate::quant::GgmlType;

/// Rows per tile (the MMA's M).
pub const TILE_ROWS: usize = 16;
/// Blocks of 32 values per K-quant super-block.
const SUPER: usize = 8;

/// The tiled forms, in `kernels.cu`'s names (`T_TQ*`); Q3_K takes Q6_K's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl Form {
    /// The tiled form `ty` is stored in, if any.
    pub fn of(ty: GgmlType) -> Option<Form> {
        Some(match ty {
            GgmlType::Q4_0 => Form::Q4_0,
            GgmlType::Q4_1 => Form::Q4_1,
            GgmlType::Q8_0 => Form::Q8_0,
            GgmlType::Q5_0 => Form::Q5_0,
            GgmlType::Q5_1 => Form::Q5_1,
            GgmlType::Q4K => Form::Q4K,
            GgmlType::Q5K => Form::Q5K,
            GgmlType::Q6K | GgmlType::Q3K => Form::Q6K,
            _ => return None,
        })
    }

    /// Bytes of one (tile, block) of quants.
    pub fn quant_bytes(self) -> usize {
        match self {
            Form::Q8_0 => 512,
            Form::Q5_0 | Form::Q5_1 | Form::Q5K => 320,
            Form::Q6K => 384,
            _ => 256,
        }
    }

    /// High-bit planes above the nibbles (1: 5-bit, 2: 6-bit).
    fn planes(self) -> usize {
        match self {
            Form::Q5_0 | Form::Q5_1 | Form::Q5K => 1,
            Form::Q6K => 2,
            _ => 0,
        }
    }

    pub fn k_quant(self) -> bool {
        matches!(self, Form::Q4K | Form::Q5K | Form::Q6K)
    }

    /// Bytes of one tile's scales for `nb` blocks.
    pub fn scale_bytes(self, nb: usize) -> usize {
        if self.k_quant() {
            nb / SUPER * (4 * TILE_ROWS + SUPER * 2 * TILE_ROWS)
        } else {
            nb * 4 * TILE_ROWS
        }
    }
}

/// Whether `ty` has a tiled form.
pub fn tileable(ty: GgmlType) -> bool {
    Form::of(ty).is_some()
}

/// The number of tiles of a matrix of `rows` output columns.
pub fn tiles(rows: usize) -> usize {
    rows.div_ceil(TILE_ROWS)
}

/// Repack a GGUF matrix of `ty` (`rows` rows of `cols` values, row-major blocks) into the tile layout.
pub fn tile(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    let form = Form::of(ty).expect("a tiled format");
    let (bl, bb) = (ty.block_len(), ty.block_bytes());
    assert!(cols.is_multiple_of(bl));
    let (nb, qb) = (cols / 32, form.quant_bytes());
    assert_eq!(data.len(), rows * (cols / bl) * bb, "matrix bytes");
    let nt = tiles(rows);
    let sb = form.scale_bytes(nb);
    let mut out = vec![0u8; nt * (nb * qb + sb)];
    let (quants, scales) = out.split_at_mut(nt * nb * qb);
    for r in 0..rows {
        let (t, j) = (r / TILE_ROWS, r % TILE_ROWS);
        let (g, hi) = (j % 8, j / 8);
        let tile_scales = &mut scales[t * sb..(t + 1) * sb];
        for b in 0..nb {
            let subs = bl / 32;
            let blk = &data[(r * nb / subs + b / subs) * bb..][..bb];
            let mut q = ty.int_block(blk, b % subs).q;
            if ty == GgmlType::Q3K {
                // Q6_K's offset (32) where Q3_K's is 4.
                q.iter_mut().for_each(|v| *v += 28);
            }
            let tb = t * nb + b;
            put_quants(form, &q, &mut quants[tb * qb..(tb + 1) * qb], g, hi);
            put_scales(ty, form, blk, tile_scales, b, j);
        }
    }
    out
}

/// Row `g + 8·hi` of a tile's values `q` (the integer view, plus 128 for Q8_0's signed bytes) of one block.
fn put_quants(form: Form, q: &[u8; 32], dst: &mut [u8], g: usize, hi: usize) {
    for i in 0..4 {
        let lane = 4 * g + i;
        for e in 0..4 {
            let (lo, up) = (q[4 * i + e], q[16 + 4 * i + e]);
            if form == Form::Q8_0 {
                dst[lane * 16 + hi * 4 + e] = lo ^ 0x80;
                dst[lane * 16 + 8 + hi * 4 + e] = up ^ 0x80;
                continue;
            }
            dst[lane * 8 + hi * 4 + e] = (lo & 0x0f) | (up & 0x0f) << 4;
            // The four values of a lane position e: (row g, lo), (row g, up), (row g + 8, lo), (row g + 8, up).
            let (slot_lo, slot_up) = (2 * hi, 2 * hi + 1);
            match form.planes() {
                1 => {
                    let at = 256 + lane * 2 + e / 2;
                    let shift = 4 * (e % 2);
                    dst[at] |= ((lo >> 4) & 1) << (shift + slot_lo);
                    dst[at] |= ((up >> 4) & 1) << (shift + slot_up);
                }
                2 => {
                    let at = 256 + lane * 4 + e;
                    dst[at] |= ((lo >> 4) & 3) << (2 * slot_lo);
                    dst[at] |= ((up >> 4) & 3) << (2 * slot_up);
                }
                _ => {}
            }
        }
    }
}

/// Column `j` of a tile's scales for block `b` (of the stored block `blk` of `ty`).
fn put_scales(ty: GgmlType, form: Form, blk: &[u8], dst: &mut [u8], b: usize, j: usize) {
    let word = |at: usize| [blk[at], blk[at + 1]];
    if !form.k_quant() {
        let (d, m) = match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => (word(0), word(2)),
            _ => (word(0), [0, 0]),
        };
        let at = (b * TILE_ROWS + j) * 4;
        dst[at..at + 4].copy_from_slice(&[d[0], d[1], m[0], m[1]]);
        return;
    }
    let (s, sub) = (b / SUPER, b % SUPER);
    let sup = s * (4 * TILE_ROWS + SUPER * 2 * TILE_ROWS);
    let (head, pair) = match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            let (sc, mn) = scale_min_k4(sub, &blk[4..16]);
            ([blk[0], blk[1], blk[2], blk[3]], [sc, mn])
        }
        GgmlType::Q6K => {
            let at = 192 + (sub / 4) * 8 + 2 * (sub % 4);
            ([blk[208], blk[209], 0, 0], [blk[at], blk[at + 1]])
        }
        GgmlType::Q3K => {
            let scales = q3_k_scales(&blk[96..108]);
            let signed = |v: i32| v as i8 as u8;
            (
                [blk[108], blk[109], 0, 0],
                [signed(scales[2 * sub]), signed(scales[2 * sub + 1])],
            )
        }
        _ => unreachable!("not a K-quant"),
    };
    dst[sup + 4 * j..sup + 4 * j + 4].copy_from_slice(&head);
    let at = sup + 4 * TILE_ROWS + (sub * TILE_ROWS + j) * 2;
    dst[at..at + 2].copy_from_slice(&pair);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 32 values of block b of row r as `kernels.cu`'s `load_quants` and `fragment` read them back (same
    /// byte offsets and bit positions), in the integer view.
    fn read_back_values(form: Form, tiled: &[u8], nb: usize, r: usize, b: usize) -> [u8; 32] {
        let qb = form.quant_bytes();
        let (t, j) = (r / 16, r % 16);
        let (g, hi) = (j & 7, j >> 3);
        let q = &tiled[(t * nb + b) * qb..];
        let mut v = [0u8; 32];
        for i in 0..4 {
            let lane = 4 * g + i;
            for e in 0..4 {
                let (lo, up) = (4 * i + e, 16 + 4 * i + e);
                if form == Form::Q8_0 {
                    v[lo] = q[lane * 16 + hi * 4 + e] ^ 0x80;
                    v[up] = q[lane * 16 + 8 + hi * 4 + e] ^ 0x80;
                    continue;
                }
                let byte = q[lane * 8 + hi * 4 + e];
                v[lo] = byte & 15;
                v[up] = byte >> 4;
                match form.planes() {
                    1 => {
                        let h = u16::from_le_bytes([q[256 + lane * 2], q[256 + lane * 2 + 1]]);
                        v[lo] |= (((h >> (4 * e + 2 * hi)) & 1) as u8) << 4;
                        v[up] |= (((h >> (4 * e + 2 * hi + 1)) & 1) as u8) << 4;
                    }
                    2 => {
                        let h = q[256 + lane * 4 + e];
                        v[lo] |= ((h >> (4 * hi)) & 3) << 4;
                        v[up] |= ((h >> (4 * hi + 2)) & 3) << 4;
                    }
                    _ => {}
                }
            }
        }
        v
    }

    /// Block b of row r's exact scales from the tile (`kernels.cu`'s `block_scale`): the scale of each half
    /// and the additive term.
    fn read_back_scales(
        form: Form,
        tiled: &[u8],
        rows: usize,
        nb: usize,
        r: usize,
        b: usize,
    ) -> ([f32; 2], f32) {
        let f16 = |at: usize| half::f16::from_le_bytes([tiled[at], tiled[at + 1]]).to_f32();
        let (t, j) = (r / 16, r % 16);
        let base = tiles(rows) * nb * form.quant_bytes() + t * form.scale_bytes(nb);
        if !form.k_quant() {
            let at = base + (b * 16 + j) * 4;
            let m = if matches!(form, Form::Q4_1 | Form::Q5_1) {
                f16(at + 2)
            } else {
                0.0
            };
            return ([f16(at); 2], m);
        }
        let sup = base + (b / 8) * 320;
        let (d, dmin) = (f16(sup + 4 * j), f16(sup + 4 * j + 2));
        let at = sup + 64 + ((b % 8) * 16 + j) * 2;
        let (s0, s1) = (tiled[at], tiled[at + 1]);
        if form == Form::Q6K {
            ([d * s0 as i8 as f32, d * s1 as i8 as f32], 0.0)
        } else {
            ([d * s0 as f32; 2], -(dmin * s1 as f32))
        }
    }

    fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: &mut u32) -> Vec<u8> {
        let blocks = rows * cols / ty.block_len();
        let mut data: Vec<u8> = (0..blocks * ty.block_bytes())
            .map(|_| {
                *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (*seed >> 24) as u8
            })
            .collect();
        // Finite f16 scales (random bytes could be NaN, which compares unequal to itself).
        let bb = ty.block_bytes();
        let scale_at: &[usize] = match ty {
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
            GgmlType::Q6K => &[208],
            GgmlType::Q3K => &[108],
            _ => &[0],
        };
        for blk in data.chunks_mut(bb) {
            for &at in scale_at {
                blk[at + 1] &= 0x3b;
            }
        }
        data
    }

    #[test]
    fn every_block_reads_back_from_its_tile_slot() {
        let mut seed = 0x1234_5678u32;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Q3K,
        ] {
            let form = Form::of(ty).unwrap();
            // Ragged: 37 rows (a partial last tile), 2 super-blocks (16 blocks) per row.
            let (rows, cols) = (37, 512);
            let nb = cols / 32;
            let data = random_matrix(ty, rows, cols, &mut seed);
            let tiled = tile(ty, rows, cols, &data);
            assert_eq!(
                tiled.len(),
                tiles(rows) * (nb * form.quant_bytes() + form.scale_bytes(nb))
            );
            let subs = ty.block_len() / 32;
            for r in 0..rows {
                for b in 0..nb {
                    let blk =
                        &data[(r * nb / subs + b / subs) * ty.block_bytes()..][..ty.block_bytes()];
                    let want = ty.int_block(blk, b % subs);
                    let mut q = want.q;
                    if ty == GgmlType::Q3K {
                        q.iter_mut().for_each(|v| *v += 28);
                    }
                    assert_eq!(
                        read_back_values(form, &tiled, nb, r, b),
                        q,
                        "{ty:?} row {r} block {b}"
                    );
                    assert_eq!(
                        read_back_scales(form, &tiled, rows, nb, r, b),
                        (want.d, want.m),
                        "{ty:?} row {r} block {b} scales"
                    );
                }
            }
            // The padding rows of the last tile are zeros.
            for r in rows..tiles(rows) * 16 {
                assert_eq!(
                    read_back_values(form, &tiled, nb, r, 0),
                    if form == Form::Q8_0 {
                        [0x80; 32]
                    } else {
                        [0; 32]
                    }
                );
            }
        }
    }
}
