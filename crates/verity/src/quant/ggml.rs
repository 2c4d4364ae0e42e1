//! GGML tensor types: the block layouts of llama.cpp's file format, decoded to f32.
//!
//! Layouts follow the GGUF specification (ggml `block_q4_0`, `block_q4_K`, ...). Plain F32/F16/BF16 rows are
//! treated as a "format" with 32-element blocks (and a ragged last block) so that every weight goes through the
//! same block-wise kernels.

use half::{bf16, f16};

/// A GGML tensor element type verity can decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

const QK_K: usize = 256;

impl GgmlType {
    /// The type for a GGUF `ggml_type` id, if verity supports it.
    pub fn from_gguf_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            20 => GgmlType::IQ4NL,
            23 => GgmlType::IQ4XS,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The GGUF `ggml_type` id of this type.
    pub fn gguf_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    /// The name of a GGUF `ggml_type` id, for error messages about types verity does not support.
    pub fn gguf_id_name(id: u32) -> &'static str {
        match id {
            9 => "Q8_1",
            15 => "Q8_K",
            16..=19 | 21 | 22 => "IQ*",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            _ => "unknown",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::IQ4NL => "IQ4_NL",
            GgmlType::IQ4XS => "IQ4_XS",
        }
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::IQ4XS => QK_K,
            _ => 32,
        }
    }

    /// Bytes per block (for float types: per 32 elements).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 128,
            GgmlType::F16 | GgmlType::BF16 => 64,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::IQ4NL => 18,
            GgmlType::IQ4XS => 136,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// Bytes of one row of `cols` elements; `None` if a quantized row would not be whole blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            GgmlType::F32 => cols.checked_mul(4),
            GgmlType::F16 | GgmlType::BF16 => cols.checked_mul(2),
            _ if !cols.is_multiple_of(self.block_len()) => None,
            _ => (cols / self.block_len()).checked_mul(self.block_bytes()),
        }
    }

    /// Decode block `b` of an encoded row into `out`.
    #[inline(always)]
    pub fn decode_block(self, row: &[u8], b: usize, out: &mut [f32]) {
        if self.is_float() {
            let start = b * 32;
            let n = out.len();
            match self {
                GgmlType::F32 => {
                    for (o, c) in out
                        .iter_mut()
                        .zip(row[start * 4..(start + n) * 4].chunks_exact(4))
                    {
                        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
                GgmlType::F16 => {
                    for (o, c) in out
                        .iter_mut()
                        .zip(row[start * 2..(start + n) * 2].chunks_exact(2))
                    {
                        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
                _ => {
                    for (o, c) in out
                        .iter_mut()
                        .zip(row[start * 2..(start + n) * 2].chunks_exact(2))
                    {
                        *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                    }
                }
            }
            return;
        }
        let bb = self.block_bytes();
        let blk = &row[b * bb..(b + 1) * bb];
        match self {
            GgmlType::Q4_0 => decode_q4_0(blk, out),
            GgmlType::Q4_1 => decode_q4_1(blk, out),
            GgmlType::Q5_0 => decode_q5(blk, false, out),
            GgmlType::Q5_1 => decode_q5(blk, true, out),
            GgmlType::Q8_0 => decode_q8_0(blk, out),
            GgmlType::Q2K => decode_q2_k(blk, out),
            GgmlType::Q3K => decode_q3_k(blk, out),
            GgmlType::Q4K => decode_q4_k(blk, out),
            GgmlType::Q5K => decode_q5_k(blk, out),
            GgmlType::Q6K => decode_q6_k(blk, out),
            GgmlType::IQ4NL => decode_iq4(&blk[2..18], f16_at(blk, 0), out),
            GgmlType::IQ4XS => decode_iq4_xs(blk, out),
            _ => unreachable!("float types handled above"),
        }
    }
}

/// A 32-value sub-block of a stored block in integer form: value `e` is `d[e / 16] · (q[e] − offset) + m`,
/// where `d` and `m` are exact products of the stored scales (an f16 times an integer of at most 8 bits fits
/// f32's significand), so a kernel may form them in any order. The 8-bit integer kernels read every format
/// through this view; `decode_block` is its f32 rendering.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntBlock {
    /// Unsigned values (Q8_0's signed bytes and the IQ4 grid's values are stored plus 128).
    pub q: [u8; 32],
    /// What `q` is offset by: 4 (Q3_K), 8 (Q4_0), 16 (Q5_0), 32 (Q6_K), 128 (Q8_0, IQ4_NL, IQ4_XS), else 0.
    pub offset: i32,
    /// The scale of values 0..16 and of values 16..32 (different only for Q3_K and Q6_K, whose sub-blocks are 16
    /// long).
    pub d: [f32; 2],
    /// The additive term: Q4_1/Q5_1's `m`, the K-quants' `−dmin·min`, else 0.
    pub m: f32,
}

impl GgmlType {
    /// Sub-block `sub` (values `32·sub..32·sub+32`) of the stored block `blk`, in integer form (the quantized
    /// block formats; the float types have none).
    pub fn int_block(self, blk: &[u8], sub: usize) -> IntBlock {
        let mut q = [0u8; 32];
        let nibbles = |qs: &[u8], q: &mut [u8; 32]| {
            for j in 0..16 {
                q[j] = qs[j] & 0x0f;
                q[j + 16] = qs[j] >> 4;
            }
        };
        let legacy = |d: f32, offset: i32, m: f32, q: [u8; 32]| IntBlock {
            q,
            offset,
            d: [d; 2],
            m,
        };
        match self {
            GgmlType::Q4_0 => {
                nibbles(&blk[2..18], &mut q);
                legacy(f16_at(blk, 0), 8, 0.0, q)
            }
            GgmlType::Q4_1 => {
                nibbles(&blk[4..20], &mut q);
                legacy(f16_at(blk, 0), 0, f16_at(blk, 2), q)
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let q5_1 = self == GgmlType::Q5_1;
                let at = if q5_1 { 4 } else { 2 };
                let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                nibbles(&blk[at + 4..at + 20], &mut q);
                for (e, v) in q.iter_mut().enumerate() {
                    *v |= (((qh >> e) & 1) << 4) as u8;
                }
                let (offset, m) = if q5_1 { (0, f16_at(blk, 2)) } else { (16, 0.0) };
                legacy(f16_at(blk, 0), offset, m, q)
            }
            GgmlType::Q8_0 => {
                for (v, &b) in q.iter_mut().zip(&blk[2..34]) {
                    *v = (b as i8 as i32 + 128) as u8;
                }
                legacy(f16_at(blk, 0), 128, 0.0, q)
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let (sc, mn) = scale_min_k4(sub, &blk[4..16]);
                let qs_at = if self == GgmlType::Q5K { 48 } else { 16 };
                let qs = &blk[qs_at + (sub / 2) * 32..][..32];
                for (l, v) in q.iter_mut().enumerate() {
                    *v = if sub.is_multiple_of(2) {
                        qs[l] & 0x0f
                    } else {
                        qs[l] >> 4
                    };
                    if self == GgmlType::Q5K {
                        *v |= ((blk[16 + l] >> sub) & 1) << 4;
                    }
                }
                IntBlock {
                    q,
                    offset: 0,
                    d: [d * sc as f32; 2],
                    m: -(dmin * mn as f32),
                }
            }
            GgmlType::Q6K => {
                let (n, k) = (sub / 4, sub % 4);
                let ql = &blk[n * 64 + 32 * (k % 2)..][..32];
                let qh = &blk[128 + n * 32..][..32];
                for (l, v) in q.iter_mut().enumerate() {
                    let low = if k < 2 { ql[l] & 0x0f } else { ql[l] >> 4 };
                    *v = low | ((qh[l] >> (2 * k)) & 3) << 4;
                }
                let d = f16_at(blk, 208);
                let sc = |h: usize| blk[192 + n * 8 + 2 * k + h] as i8 as f32;
                IntBlock {
                    q,
                    offset: 32,
                    d: [d * sc(0), d * sc(1)],
                    m: 0.0,
                }
            }
            GgmlType::Q3K => {
                let qs = &blk[32 + (sub / 4) * 32..][..32];
                let shift = 2 * (sub % 4);
                for (l, v) in q.iter_mut().enumerate() {
                    *v = ((qs[l] >> shift) & 3) | (((blk[l] >> sub) & 1) << 2);
                }
                let d = f16_at(blk, 108);
                let scales = q3_k_scales(&blk[96..108]);
                IntBlock {
                    q,
                    offset: 4,
                    d: [d * scales[2 * sub] as f32, d * scales[2 * sub + 1] as f32],
                    m: 0.0,
                }
            }
            GgmlType::IQ4NL | GgmlType::IQ4XS => {
                let (qs, d) = if self == GgmlType::IQ4NL {
                    (&blk[2..18], f16_at(blk, 0))
                } else {
                    (
                        &blk[8 + 16 * sub..24 + 16 * sub],
                        f16_at(blk, 0) * iq4_xs_scale(blk, sub) as f32,
                    )
                };
                nibbles(qs, &mut q);
                for v in q.iter_mut() {
                    *v = (IQ4_GRID[*v as usize] as i32 + 128) as u8;
                }
                legacy(d, 128, 0.0, q)
            }
            _ => unreachable!("{} has no integer sub-blocks", self.name()),
        }
    }
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[inline(always)]
fn decode_q4_0(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let qs = &blk[2..18];
    for j in 0..16 {
        out[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

#[inline(always)]
fn decode_q4_1(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let m = f16_at(blk, 2);
    let qs = &blk[4..20];
    for j in 0..16 {
        out[j] = (qs[j] & 0x0f) as f32 * d + m;
        out[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q5_0 (`d`, 32 high bits, 16 bytes of low nibbles: `(q − 16)·d`) and Q5_1 (`d`, `m`, high bits, nibbles:
/// `q·d + m`), in ggml's arithmetic: value `j` is nibble `j` (low nibbles first) with bit `j` of the high bits
/// as its fifth bit.
#[inline(always)]
fn decode_q5(blk: &[u8], q5_1: bool, out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let (offset, m, qh_at) = if q5_1 {
        (0, f16_at(blk, 2), 4)
    } else {
        (16, 0.0, 2)
    };
    let qh = u32::from_le_bytes([blk[qh_at], blk[qh_at + 1], blk[qh_at + 2], blk[qh_at + 3]]);
    let qs = &blk[qh_at + 4..qh_at + 20];
    let value = |q: u32| (q as i32 - offset) as f32 * d + m;
    for j in 0..16 {
        out[j] = value((qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4);
        out[j + 16] = value((qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4);
    }
}

#[inline(always)]
fn decode_q8_0(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for (o, &q) in out.iter_mut().zip(&blk[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

/// The non-linear 4-bit grid of IQ4_NL and IQ4_XS (ggml `kvalues_iq4nl`).
pub(crate) const IQ4_GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// 32 values on the IQ4 grid scaled by `d`: nibbles of `qs` (16 bytes), low nibbles first.
#[inline(always)]
fn decode_iq4(qs: &[u8], d: f32, out: &mut [f32]) {
    for j in 0..16 {
        out[j] = d * IQ4_GRID[(qs[j] & 0x0f) as usize] as f32;
        out[j + 16] = d * IQ4_GRID[(qs[j] >> 4) as usize] as f32;
    }
}

/// Sub-block `j`'s signed 6-bit scale of an IQ4_XS block (`scale_j − 32`).
#[inline(always)]
pub(crate) fn iq4_xs_scale(blk: &[u8], j: usize) -> i32 {
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    let lo = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
    let hi = ((scales_h >> (2 * j)) & 3) as u8;
    (lo | hi << 4) as i32 - 32
}

/// IQ4_XS: `d`, the high 2 bits of eight 6-bit sub-block scales, their low 4 bits, then eight IQ4 sub-blocks;
/// sub-block `j` is scaled by `d · (scale_j − 32)`.
#[inline(always)]
fn decode_iq4_xs(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for j in 0..8 {
        let dl = d * iq4_xs_scale(blk, j) as f32;
        decode_iq4(
            &blk[8 + 16 * j..24 + 16 * j],
            dl,
            &mut out[32 * j..32 * j + 32],
        );
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block (ggml `get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let d = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (d, m)
    }
}

#[inline(always)]
fn decode_q4_k(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, 2);
    let scales = &blk[4..16];
    let qs = &blk[16..144];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[j * 32..j * 32 + 32];
        let o = &mut out[j * 64..j * 64 + 64];
        for l in 0..32 {
            o[l] = d1 * (q[l] & 0x0f) as f32 - m1;
            o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

#[inline(always)]
fn decode_q5_k(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, 2);
    let scales = &blk[4..16];
    let qh = &blk[16..48];
    let qs = &blk[48..176];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let q = &qs[j * 32..j * 32 + 32];
        let o = &mut out[j * 64..j * 64 + 64];
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            o[l] = d1 * ((q[l] & 0x0f) + hi1) as f32 - m1;
            o[l + 32] = d2 * ((q[l] >> 4) + hi2) as f32 - m2;
        }
    }
}

#[inline(always)]
fn decode_q6_k(blk: &[u8], out: &mut [f32]) {
    let ql = &blk[0..128];
    let qh = &blk[128..192];
    let sc = &blk[192..208];
    let d = f16_at(blk, 208);
    for n in 0..2 {
        let ql = &ql[n * 64..];
        let qh = &qh[n * 32..];
        let sc = &sc[n * 8..];
        let o = &mut out[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Q2_K: 16 sub-blocks of 16 two-bit values, each with a 4-bit scale and a 4-bit min under the block's f16
/// `d` and `dmin`. Layout: scales[16] (scale in the low nibble, min in the high), qs[64], d, dmin.
fn decode_q2_k(blk: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
    for (p, o) in out.iter_mut().enumerate().take(QK_K) {
        let sc = blk[p / 16];
        let q = (blk[16 + (p / 128) * 32 + p % 32] >> (2 * ((p % 128) / 32))) & 3;
        *o = d * (sc & 0x0f) as f32 * q as f32 - dmin * (sc >> 4) as f32;
    }
}

/// Q3_K's 16 signed 6-bit sub-block scales, from their 12 packed bytes (low nibbles in bytes 0..8, high bit
/// pairs in bytes 8..12).
pub(crate) fn q3_k_scales(packed: &[u8]) -> [i32; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 {
            packed[j] & 0x0f
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    })
}

/// Q3_K: 16 sub-blocks of 16 three-bit values (two low bits in `qs`, the high bit in `hmask`), each with a
/// signed 6-bit scale under the block's f16 `d`. Layout: hmask[32], qs[64], scales[12], d.
fn decode_q3_k(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 108);
    let scales = q3_k_scales(&blk[96..108]);
    for (p, o) in out.iter_mut().enumerate().take(QK_K) {
        let shift = 2 * ((p % 128) / 32);
        let low = (blk[32 + (p / 128) * 32 + p % 32] >> shift) & 3;
        let high = (blk[p % 32] >> (p / 32)) & 1;
        let q = (low | (high << 2)) as i32 - 4;
        *o = d * scales[p / 16] as f32 * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of random bytes whose f16 scales are finite.
    fn random_block(ty: GgmlType, seed: &mut u64) -> Vec<u8> {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 33) as u32
        };
        let mut blk: Vec<u8> = (0..ty.block_bytes()).map(|_| next() as u8).collect();
        let mut put =
            |at: usize, v: f32| blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        let scale = (next() % 2000) as f32 * 1e-4 - 0.1;
        let min = (next() % 2000) as f32 * 1e-4 - 0.1;
        match ty {
            GgmlType::Q6K => put(208, scale),
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => put(0, scale),
            _ => {
                put(0, scale);
                put(2, min);
            }
        }
        blk
    }

    /// The integer view and the f32 decoding agree on every value of every format it reads.
    #[test]
    fn int_blocks_are_the_decoded_values() {
        let mut seed = 7u64;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::IQ4NL,
            GgmlType::IQ4XS,
        ] {
            for _ in 0..50 {
                let blk = random_block(ty, &mut seed);
                let mut want = vec![0f32; ty.block_len()];
                ty.decode_block(&blk, 0, &mut want);
                for sub in 0..ty.block_len() / 32 {
                    let ib = ty.int_block(&blk, sub);
                    for e in 0..32 {
                        let got = ib.d[e / 16] * (ib.q[e] as i32 - ib.offset) as f32 + ib.m;
                        assert_eq!(got, want[sub * 32 + e], "{ty:?} sub {sub} value {e}");
                    }
                }
            }
        }
    }
}
