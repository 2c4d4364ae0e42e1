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
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The name of a GGUF `ggml_type` id, for error messages about types verity does not support.
    pub fn gguf_id_name(id: u32) -> &'static str {
        match id {
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
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
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::IQ4XS => QK_K,
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
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::IQ4NL => 18,
            GgmlType::IQ4XS => 136,
        }
    }

    fn is_float(self) -> bool {
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
            GgmlType::Q4K => decode_q4_k(blk, out),
            GgmlType::Q5K => decode_q5_k(blk, out),
            GgmlType::Q6K => decode_q6_k(blk, out),
            GgmlType::IQ4NL => decode_iq4(&blk[2..18], f16_at(blk, 0), out),
            GgmlType::IQ4XS => decode_iq4_xs(blk, out),
            _ => unreachable!("float types handled above"),
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
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
const IQ4_GRID: [i8; 16] = [
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

/// IQ4_XS: `d`, the high 2 bits of eight 6-bit sub-block scales, their low 4 bits, then eight IQ4 sub-blocks;
/// sub-block `j` is scaled by `d · (scale_j − 32)`.
#[inline(always)]
fn decode_iq4_xs(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    for j in 0..8 {
        let lo = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0f;
        let hi = ((scales_h >> (2 * j)) & 3) as u8;
        let dl = d * ((lo | hi << 4) as i32 - 32) as f32;
        decode_iq4(
            &blk[8 + 16 * j..24 + 16 * j],
            dl,
            &mut out[32 * j..32 * j + 32],
        );
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block (ggml `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        let d = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (d as f32, m as f32)
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
        let (d1, m1) = (d * sc1, dmin * m1);
        let (d2, m2) = (d * sc2, dmin * m2);
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
        let (d1, m1) = (d * sc1, dmin * m1);
        let (d2, m2) = (d * sc2, dmin * m2);
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
