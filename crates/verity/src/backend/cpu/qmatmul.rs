//! Activation-quantized matmul for the GGML legacy formats (Q4_0, Q4_1, Q8_0), the way llama.cpp runs them:
//! each activation row is quantized to 8 bits per 32-value block (scale `d`, `Σq` and `s = d·Σq`), each
//! block's dot product is an exact integer sum, and the weights are in the interleaved layout of
//! [`super::packed`], whose module doc states the arithmetic. A row's operations never depend on how many
//! rows share a call or on the thread count, so a W-row verify is row-exact.

use super::ops;
use super::packed::{Packed, GROUP, ROWS};
use super::pool::{share, Pool, SharedOut};
use super::simd;

/// One quantized block of an activation row.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Q8Block {
    pub d: f32,
    /// `d · Σ qs` (for the offset term of Q4_1).
    pub s: f32,
    /// `Σ qs` (for the exact integer offset of Q4_0 and of Q8_0 weights fed as unsigned bytes).
    pub sum: i32,
    pub qs: [i8; 32],
}

pub const ZERO_BLOCK: Q8Block = Q8Block {
    d: 0.0,
    s: 0.0,
    sum: 0,
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
        o.d = d;
        o.s = d * sum as f32;
        o.sum = sum;
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

thread_local! {
    static QX: std::cell::RefCell<Vec<Q8Block>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f(qx)` with the `rows` rows of `x` (each `k` wide) quantized into this thread's buffer, `k / 32` blocks a row.
fn with_quantized<R>(x: &[f32], rows: usize, k: usize, f: impl FnOnce(&[Q8Block]) -> R) -> R {
    let nb = k / 32;
    QX.with(|qx| {
        let mut qx = qx.borrow_mut();
        if qx.len() < rows * nb {
            qx.resize(rows * nb, ZERO_BLOCK);
        }
        for r in 0..rows {
            quantize_row(&x[r * k..(r + 1) * k], &mut qx[r * nb..(r + 1) * nb]);
        }
        f(&qx[..rows * nb])
    })
}

/// `f(first row, rows)` over the quantized rows in runs of at most [`ROWS`], what one kernel call takes.
#[inline(always)]
fn for_row_runs(qx: &[Q8Block], nb: usize, rows: usize, mut f: impl FnMut(usize, &[&[Q8Block]])) {
    for r0 in (0..rows).step_by(ROWS) {
        let take = (rows - r0).min(ROWS);
        let mut xs: [&[Q8Block]; ROWS] = [&[]; ROWS];
        for (i, x) in xs[..take].iter_mut().enumerate() {
            *x = &qx[(r0 + i) * nb..(r0 + i + 1) * nb];
        }
        f(r0, &xs[..take]);
    }
}

/// `out[r * n_out + n] = Σ_k x[r, k] · w[n, k]` with 8-bit activations.
pub fn matmul(pool: &Pool, w: &Packed, x: &[f32], rows: usize, out: &mut [f32]) {
    matmuls(pool, x, rows, &mut [(w, out)]);
}

/// Matrices one [`matmuls`] pass takes.
pub const MAX_MATS: usize = 3;

/// Up to [`MAX_MATS`] products of one activation input, `outs[i].1 = outs[i].0 · x`, in one pass of the pool:
/// `x` is quantized once and the threads share the column groups of all the matrices (a layer's Q/K/V and
/// gate/up projections cost one dispatch each). Every matrix must have `x`'s width.
pub fn matmuls<O: AsMut<[f32]>>(pool: &Pool, x: &[f32], rows: usize, outs: &mut [(&Packed, O)]) {
    assert!((1..=MAX_MATS).contains(&outs.len()));
    let k = outs[0].0.k;
    let nb = k / 32;
    assert!(x.len() >= rows * k && k.is_multiple_of(32));
    let mut mats: [Option<&Packed>; MAX_MATS] = [None; MAX_MATS];
    let mut dsts = [(); MAX_MATS].map(|_| SharedOut::new(&mut []));
    for (i, (w, out)) in outs.iter_mut().enumerate() {
        let out = out.as_mut();
        assert!(w.k == k && out.len() >= rows * w.n);
        mats[i] = Some(*w);
        dsts[i] = SharedOut::new(out);
    }
    let total: usize = mats.iter().flatten().map(|m| m.groups()).sum();
    with_quantized(x, rows, k, |qx| {
        let isa = simd::int8_isa();
        pool.run(&|t| {
            // Groups are numbered across the matrices in order; each thread takes a contiguous range.
            let (mut m, mut first) = (0, 0);
            let mut res = [[0f32; GROUP]; ROWS];
            for g in share(total, pool.threads(), t, 1) {
                while g >= first + mats[m].map_or(0, |p| p.groups()) {
                    first += mats[m].map_or(0, |p| p.groups());
                    m += 1;
                }
                let w = mats[m].expect("a group belongs to a matrix");
                let local = g - first;
                let cols = (w.n - local * GROUP).min(GROUP);
                for_row_runs(qx, nb, rows, |r0, xs| {
                    w.group(isa, local, xs, &mut res);
                    for (i, row) in res[..xs.len()].iter().enumerate() {
                        let at = (r0 + i) * w.n + local * GROUP;
                        // SAFETY: columns of group `local` of matrix `m` belong to this task; r0 + i < rows.
                        unsafe {
                            std::ptr::copy_nonoverlapping(row.as_ptr(), dsts[m].at(at), cols)
                        };
                    }
                });
            }
        });
    });
}

/// `out = silu(gate · x) ⊙ (up · x)` in one pass of the pool: the thread that computes a group of gate columns
/// computes the same group of up columns and writes their SwiGLU at once, so no serial pass over the
/// intermediate follows. Each output is bitwise what `ops::swiglu` makes of the two products [`matmul`] gives.
pub fn swiglu(pool: &Pool, x: &[f32], rows: usize, gate: &Packed, up: &Packed, out: &mut [f32]) {
    let (k, n) = (gate.k, gate.n);
    let nb = k / 32;
    assert!(up.k == k && up.n == n && k.is_multiple_of(32));
    assert!(x.len() >= rows * k && out.len() >= rows * n);
    let dst = SharedOut::new(out);
    with_quantized(x, rows, k, |qx| {
        let isa = simd::int8_isa();
        pool.run(&|t| {
            let (mut g_res, mut u_res) = ([[0f32; GROUP]; ROWS], [[0f32; GROUP]; ROWS]);
            for g in share(gate.groups(), pool.threads(), t, 1) {
                let cols = (n - g * GROUP).min(GROUP);
                for_row_runs(qx, nb, rows, |r0, xs| {
                    gate.group(isa, g, xs, &mut g_res);
                    up.group(isa, g, xs, &mut u_res);
                    for (i, (gr, ur)) in g_res[..xs.len()].iter().zip(&u_res).enumerate() {
                        // SAFETY: columns of group g belong to this task; r0 + i < rows.
                        let o = unsafe {
                            std::slice::from_raw_parts_mut(dst.at((r0 + i) * n + g * GROUP), cols)
                        };
                        ops::swiglu(&gr[..cols], &ur[..cols], o);
                    }
                });
            }
        });
    });
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
                (p.d.to_bits(), p.s.to_bits(), p.sum),
                (q.d.to_bits(), q.s.to_bits(), q.sum)
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
        }
    }
}
