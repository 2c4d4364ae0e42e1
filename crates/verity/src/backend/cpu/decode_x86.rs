//! AVX2 block decoders for the GGML legacy formats (Q4_0, Q4_1, Q8_0), the formats whose decode dominates a
//! plain decode step. Other formats fall back to the portable decoders (auto-vectorized where they inline).

use std::arch::x86_64::*;

use half::f16;

use crate::quant::{GgmlType, RowDecoder};

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Decode block `b` of row `row` into `out`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[inline(always)]
pub unsafe fn decode(dec: &RowDecoder, row: usize, b: usize, out: &mut [f32]) {
    if let RowDecoder::Ggml {
        ty,
        data,
        row_bytes,
    } = *dec
    {
        let bb = ty.block_bytes();
        let off = row * row_bytes + b * bb;
        match ty {
            GgmlType::Q4_0 => {
                return q4(
                    &data[off..off + 18],
                    f16_at(data, off),
                    -8.0 * f16_at(data, off),
                    2,
                    out,
                )
            }
            GgmlType::Q4_1 => {
                return q4(
                    &data[off..off + 20],
                    f16_at(data, off),
                    f16_at(data, off + 2),
                    4,
                    out,
                )
            }
            GgmlType::Q8_0 => return q8_0(&data[off..off + 34], out),
            _ => {}
        }
    }
    dec.decode(row, b, out)
}

/// 4-bit block: `out[j] = d * q[j] + m` with low nibbles first, then high nibbles (Q4_0 uses m = -8d).
#[inline(always)]
unsafe fn q4(blk: &[u8], d: f32, m: f32, qs_at: usize, out: &mut [f32]) {
    assert!(out.len() >= 32 && blk.len() >= qs_at + 16);
    let qs = _mm_loadu_si128(blk.as_ptr().add(qs_at) as *const __m128i);
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(qs, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    let (vd, vm) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
    let o = out.as_mut_ptr();
    for (half, v) in [lo, hi].into_iter().enumerate() {
        let a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        let b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        _mm256_storeu_ps(o.add(half * 16), _mm256_fmadd_ps(a, vd, vm));
        _mm256_storeu_ps(o.add(half * 16 + 8), _mm256_fmadd_ps(b, vd, vm));
    }
}

#[inline(always)]
unsafe fn q8_0(blk: &[u8], out: &mut [f32]) {
    assert!(out.len() >= 32 && blk.len() >= 34);
    let vd = _mm256_set1_ps(f16_at(blk, 0));
    let o = out.as_mut_ptr();
    for i in 0..4 {
        let q = _mm_loadl_epi64(blk.as_ptr().add(2 + i * 8) as *const __m128i);
        let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        _mm256_storeu_ps(o.add(i * 8), _mm256_mul_ps(v, vd));
    }
}
