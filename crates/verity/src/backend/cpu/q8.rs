//! 8-bit activation blocks: each 32-value block of an activation row as `round(x / d)` with `d = max|x| / 127`,
//! the form llama.cpp feeds its integer dot products. The portable and AVX2 quantizers are bitwise equal, so a
//! row's blocks never depend on the machine's vector width.

#[cfg(target_arch = "x86_64")]
use super::simd;

/// One quantized block of an activation row.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Q8Block {
    pub d: f32,
    /// `d · Σ qs` (for the offset term of Q4_1).
    pub s: f32,
    /// `Σ qs` (for the exact integer offset of Q4_0, Q5_0 and of Q8_0 weights fed as unsigned bytes).
    pub sum: i32,
    /// `Σ qs[..16]` (Q6_K's sub-blocks are 16 values long, each with its own offset correction).
    pub sum_lo: i32,
    pub qs: [i8; 32],
}

pub const ZERO_BLOCK: Q8Block = Q8Block {
    d: 0.0,
    s: 0.0,
    sum: 0,
    sum_lo: 0,
    qs: [0; 32],
};

/// Quantize one row (length a multiple of 32) to 8-bit blocks: `q = round(x / d)` with `d = max|x| / 127`.
pub fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    #[cfg(target_arch = "x86_64")]
    if simd::isa() == simd::Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { quantize_row_avx2(x, out) };
    }
    quantize_blocks(x, out)
}

/// [`quantize_blocks`] in AVX2 intrinsics, bitwise the same: the maximum is exact, `d` and `1/d` are the same
/// scalar operations, `vroundps` rounds ties to even like [`round_even`], and the clamped integers are exact.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [Q8Block]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let p = xb.as_ptr();
        let v: [__m256; 4] = std::array::from_fn(|c| _mm256_loadu_ps(p.add(8 * c)));
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)),
        );
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let q: [__m256i; 4] = std::array::from_fn(|c| {
            let r = _mm256_round_ps(
                _mm256_mul_ps(v[c], id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        // Pack 32 i32 to 32 i8 in order (the packs work per 128-bit lane; the permute restores the order).
        let w01 = _mm256_packs_epi32(q[0], q[1]);
        let w23 = _mm256_packs_epi32(q[2], q[3]);
        let b = _mm256_packs_epi16(w01, w23);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, b);
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01)));
        let l = _mm256_add_epi32(q[0], q[1]);
        let l4 = _mm_add_epi32(_mm256_castsi256_si128(l), _mm256_extracti128_si256(l, 1));
        let l2 = _mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0b01_00_11_10));
        let sum_lo = _mm_cvtsi128_si32(_mm_add_epi32(l2, _mm_shuffle_epi32(l2, 0b10_11_00_01)));
        o.d = d;
        o.s = d * sum as f32;
        o.sum = sum;
        o.sum_lo = sum_lo;
    }
}

#[inline(always)]
fn quantize_blocks(x: &[f32], out: &mut [Q8Block]) {
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        // Eight independent maxima (max is exact, so the grouping changes nothing but speed).
        let mut lanes = [0f32; 8];
        for c in xb.chunks_exact(8) {
            for (m, v) in lanes.iter_mut().zip(c) {
                *m = m.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = round_even(v * id).clamp(-127.0, 127.0) as i8;
        }
        let sum: i32 = o.qs.iter().map(|&q| q as i32).sum();
        o.d = d;
        o.s = d * sum as f32;
        o.sum = sum;
        o.sum_lo = o.qs[..16].iter().map(|&q| q as i32).sum();
    }
}

/// Round to nearest, ties to even, for |v| ≤ 2^22 (here |v| ≤ 127.5): adding and subtracting 1.5·2^23 leaves the
/// rounded value in IEEE round-to-nearest-even arithmetic. Unlike `f32::round_ties_even` it needs no libm call
/// on baseline x86-64, and it vectorizes.
#[inline(always)]
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantizer_is_bitwise_the_portable_one() {
        if simd::isa() != simd::Isa::Avx2 {
            return;
        }
        let mut seed = 11u64;
        let x: Vec<f32> = (0..32 * 40)
            .map(|i| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0;
                // Some blocks hold exact ties (k + 0.5 steps) and one is all zeros.
                match i / 32 {
                    3 => 0.0,
                    5 => ((i % 32) as f32 - 15.5) * 2.0,
                    _ => v,
                }
            })
            .collect();
        let (mut a, mut b) = (vec![ZERO_BLOCK; 40], vec![ZERO_BLOCK; 40]);
        quantize_blocks(&x, &mut a);
        unsafe { quantize_row_avx2(&x, &mut b) };
        for (p, q) in a.iter().zip(&b) {
            assert_eq!(p.qs, q.qs);
            assert_eq!(
                (p.d.to_bits(), p.s.to_bits(), p.sum, p.sum_lo),
                (q.d.to_bits(), q.s.to_bits(), q.sum, q.sum_lo)
            );
        }
    }

    #[test]
    fn magic_rounding_is_round_ties_even() {
        for i in -300_000..300_000 {
            let v = i as f32 * 0.000_43;
            assert_eq!(round_even(v), v.round_ties_even(), "{v}");
        }
        for v in [0.5f32, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 127.0] {
            assert_eq!(round_even(v), v.round_ties_even(), "{v}");
        }
    }

    #[test]
    fn quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.173)
            .collect();
        let mut q = [ZERO_BLOCK; 2];
        quantize_row(&x, &mut q);
        for (b, blk) in q.iter().enumerate() {
            for (i, &qi) in blk.qs.iter().enumerate() {
                assert!((qi as f32 * blk.d - x[b * 32 + i]).abs() <= blk.d * 0.5 + 1e-6);
            }
            let sum: i32 = blk.qs.iter().map(|&v| v as i32).sum();
            assert_eq!(blk.s, blk.d * sum as f32);
            assert_eq!(blk.sum, sum);
            assert_eq!(
                blk.sum_lo,
                blk.qs[..16].iter().map(|&v| v as i32).sum::<i32>()
            );
        }
    }
}
