//! Activation-quantized matmul for the GGML legacy formats (Q4_0, Q4_1, Q8_0), the way llama.cpp runs them:
//! each activation row is quantized to 8 bits per 32-value block (scale `d`, and `s = d·Σq` for the formats
//! with an offset), and each block's dot product is an exact integer sum.
//!
//! Exactness: the only floating-point operations are, per block, one fused multiply-add of the block's
//! integer lane sums (eight lanes of four products each) into eight f32 accumulators, and one fused
//! multiply-add of the offset term; then a fixed horizontal reduction. The portable path emulates the eight
//! lanes, so it gives bitwise the AVX2 result; and a row's operations never depend on how many rows share a
//! call, so a W-row verify is row-exact.

use super::pool::{share, Pool, SharedOut};
use super::simd::{self, Isa};
use crate::quant::{GgmlType, QMatrix, WeightFormat};
use half::f16;

/// One quantized block of an activation row.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Q8Block {
    pub d: f32,
    /// `d · Σ qs` (the block's sum, for the offset term of Q4_0/Q4_1).
    pub s: f32,
    pub qs: [i8; 32],
}

const ZERO_BLOCK: Q8Block = Q8Block {
    d: 0.0,
    s: 0.0,
    qs: [0; 32],
};

/// Whether this path runs a format.
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Quantize one row (length a multiple of 32) to 8-bit blocks: `q = round(x / d)` with `d = max|x| / 127`.
pub fn quantize_row(x: &[f32], out: &mut [Q8Block]) {
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = round_even(v * id).clamp(-127.0, 127.0) as i8;
            sum += *q as i32;
        }
        o.d = d;
        o.s = d * sum as f32;
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

/// `out[r * n_out + n] = Σ_k x[r, k] · w[n, k]` with 8-bit activations.
pub fn matmul(pool: &Pool, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    matmuls(pool, x, rows, &mut [(w, out)]);
}

/// Matrices one [`matmuls`] pass takes.
pub const MAX_MATS: usize = 3;

/// Up to [`MAX_MATS`] products of one activation input, `outs[i].1 = outs[i].0 · x`, in one pass of the pool:
/// `x` is quantized once and the threads share the columns of all the matrices (a layer's Q/K/V and gate/up
/// projections cost one dispatch each). Every matrix must be a format [`supports`] runs, with `x`'s width.
pub fn matmuls<O: AsMut<[f32]>>(pool: &Pool, x: &[f32], rows: usize, outs: &mut [(&QMatrix, O)]) {
    assert!((1..=MAX_MATS).contains(&outs.len()));
    let k = outs[0].0.cols;
    let nb = k / 32;
    assert!(x.len() >= rows * k && k.is_multiple_of(32));
    // (type, weights, columns, bytes per row) and the destination of each matrix.
    let mut mats: [(GgmlType, &[u8], usize, usize); MAX_MATS] =
        [(GgmlType::Q8_0, &[], 0, 0); MAX_MATS];
    let mut dsts = [(); MAX_MATS].map(|_| SharedOut::new(&mut []));
    for (i, (w, out)) in outs.iter_mut().enumerate() {
        let WeightFormat::Ggml(ty) = w.format else {
            unreachable!("qmatmul runs GGML formats only")
        };
        let row_bytes = nb * ty.block_bytes();
        let out = out.as_mut();
        assert!(supports(ty) && w.cols == k);
        assert!(w.data().len() >= w.rows * row_bytes && out.len() >= rows * w.rows);
        mats[i] = (ty, w.data(), w.rows, row_bytes);
        dsts[i] = SharedOut::new(out);
    }
    let total: usize = mats.iter().map(|m| m.2).sum();
    QX.with(|qx| {
        let mut qx = qx.borrow_mut();
        if qx.len() < rows * nb {
            qx.resize(rows * nb, ZERO_BLOCK);
        }
        for r in 0..rows {
            quantize_row(&x[r * k..(r + 1) * k], &mut qx[r * nb..(r + 1) * nb]);
        }
        let qx = &qx[..rows * nb];
        let isa = simd::isa();
        pool.run(&|t| {
            // Columns are numbered across the matrices in order; each thread takes a contiguous range.
            let (mut m, mut first) = (0, 0);
            for col in share(total, pool.threads(), t, 4) {
                while col >= first + mats[m].2 {
                    first += mats[m].2;
                    m += 1;
                }
                let (ty, data, n_out, row_bytes) = mats[m];
                let n = col - first;
                let wrow = &data[n * row_bytes..(n + 1) * row_bytes];
                column(isa, ty, wrow, qx, nb, rows, |r, v| {
                    // SAFETY: column n of matrix m belongs to this task; r < rows.
                    unsafe { *dsts[m].at(r * n_out + n) = v };
                });
            }
        });
    });
}

/// Output column `wrow` for every activation row, up to `R_MAX` rows per decoded weight pass.
#[inline(always)]
fn column(
    isa: Isa,
    ty: GgmlType,
    wrow: &[u8],
    qx: &[Q8Block],
    nb: usize,
    rows: usize,
    mut store: impl FnMut(usize, f32),
) {
    let mut r0 = 0;
    while r0 < rows {
        let take = (rows - r0).min(R_MAX);
        let xs = |i: usize| &qx[(r0 + i) * nb..(r0 + i + 1) * nb];
        let mut res = [0f32; R_MAX];
        match take {
            8 => {
                res = dot_rows::<8>(
                    isa,
                    ty,
                    wrow,
                    [xs(0), xs(1), xs(2), xs(3), xs(4), xs(5), xs(6), xs(7)],
                )
            }
            7 => res[..7].copy_from_slice(&dot_rows::<7>(
                isa,
                ty,
                wrow,
                [xs(0), xs(1), xs(2), xs(3), xs(4), xs(5), xs(6)],
            )),
            6 => res[..6].copy_from_slice(&dot_rows::<6>(
                isa,
                ty,
                wrow,
                [xs(0), xs(1), xs(2), xs(3), xs(4), xs(5)],
            )),
            5 => res[..5].copy_from_slice(&dot_rows::<5>(
                isa,
                ty,
                wrow,
                [xs(0), xs(1), xs(2), xs(3), xs(4)],
            )),
            4 => res[..4].copy_from_slice(&dot_rows::<4>(
                isa,
                ty,
                wrow,
                [xs(0), xs(1), xs(2), xs(3)],
            )),
            3 => res[..3].copy_from_slice(&dot_rows::<3>(isa, ty, wrow, [xs(0), xs(1), xs(2)])),
            2 => res[..2].copy_from_slice(&dot_rows::<2>(isa, ty, wrow, [xs(0), xs(1)])),
            _ => res[..1].copy_from_slice(&dot_rows::<1>(isa, ty, wrow, [xs(0)])),
        }
        for (i, &v) in res[..take].iter().enumerate() {
            store(r0 + i, v);
        }
        r0 += take;
    }
}

#[inline(always)]
fn dot_rows<const R: usize>(isa: Isa, ty: GgmlType, wrow: &[u8], xs: [&[Q8Block]; R]) -> [f32; R] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2 is reported only after runtime detection of AVX2 and FMA.
        Isa::Avx2 => unsafe { avx2::dot_rows::<R>(ty, wrow, xs) },
        _ => dot_rows_portable::<R>(ty, wrow, xs),
    }
}

/// A weight block's integer quants (in element order), scale and offset (0 for Q8_0).
#[inline(always)]
fn unpack(ty: GgmlType, blk: &[u8], q: &mut [i32; 32]) -> (f32, f32) {
    let h = |i: usize| f16::from_le_bytes([blk[i], blk[i + 1]]).to_f32();
    match ty {
        GgmlType::Q8_0 => {
            for (o, &b) in q.iter_mut().zip(&blk[2..34]) {
                *o = b as i8 as i32;
            }
            (h(0), 0.0)
        }
        _ => {
            let qs_at = if ty == GgmlType::Q4_1 { 4 } else { 2 };
            for j in 0..16 {
                q[j] = (blk[qs_at + j] & 0x0f) as i32;
                q[j + 16] = (blk[qs_at + j] >> 4) as i32;
            }
            let d = h(0);
            (d, if ty == GgmlType::Q4_1 { h(2) } else { -8.0 * d })
        }
    }
}

/// The eight-lane horizontal sum in the order the AVX2 reduction uses.
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

fn dot_rows_portable<const R: usize>(ty: GgmlType, wrow: &[u8], xs: [&[Q8Block]; R]) -> [f32; R] {
    let bb = ty.block_bytes();
    let mut acc = [[0f32; 8]; R];
    let mut offs = [0f32; R];
    let mut q = [0i32; 32];
    for (b, blk) in wrow.chunks_exact(bb).enumerate() {
        let (d, m) = unpack(ty, blk, &mut q);
        for r in 0..R {
            let x = &xs[r][b];
            let scale = d * x.d;
            for l in 0..8 {
                let s: i32 = (0..4).map(|e| q[4 * l + e] * x.qs[4 * l + e] as i32).sum();
                acc[r][l] = scale.mul_add(s as f32, acc[r][l]);
            }
            if ty != GgmlType::Q8_0 {
                offs[r] = m.mul_add(x.s, offs[r]);
            }
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum8(&acc[r]) + offs[r];
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Q8Block, R_MAX};
    use crate::quant::GgmlType;
    use half::f16;

    #[inline(always)]
    unsafe fn h(blk: &[u8], i: usize) -> f32 {
        f16::from_le_bytes([blk[i], blk[i + 1]]).to_f32()
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows<const R: usize>(
        ty: GgmlType,
        wrow: &[u8],
        xs: [&[Q8Block]; R],
    ) -> [f32; R] {
        debug_assert!(R <= R_MAX);
        let bb = ty.block_bytes();
        let nb = wrow.len() / bb;
        let ones = _mm256_set1_epi16(1);
        let low = _mm_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut offs = [0f32; R];
        for b in 0..nb {
            let blk = wrow.as_ptr().add(b * bb);
            let blk_s = std::slice::from_raw_parts(blk, bb);
            let d = h(blk_s, 0);
            match ty {
                GgmlType::Q8_0 => {
                    let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                    let wa = _mm256_sign_epi8(w, w);
                    for r in 0..R {
                        let x = xs[r].get_unchecked(b);
                        let xv = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                        let p = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, w)),
                            ones,
                        );
                        acc[r] =
                            _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(p), acc[r]);
                    }
                }
                _ => {
                    let (qs_at, m) = if ty == GgmlType::Q4_1 {
                        (4, h(blk_s, 2))
                    } else {
                        (2, -8.0 * d)
                    };
                    let raw = _mm_loadu_si128(blk.add(qs_at) as *const __m128i);
                    let lo = _mm_and_si128(raw, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                    let w = _mm256_set_m128i(hi, lo);
                    for r in 0..R {
                        let x = xs[r].get_unchecked(b);
                        let xv = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
                        acc[r] =
                            _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(p), acc[r]);
                        offs[r] = m.mul_add(x.s, offs[r]);
                    }
                }
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let s = acc[r];
            let q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
            let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
            out[r] = _mm_cvtss_f32(e) + offs[r];
        }
        out
    }
}

/// Rows handled per weight-block load.
const R_MAX: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 kernel must give bitwise what the portable lane emulation gives (so every machine agrees
    /// with the documented arithmetic), for every format and row count.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernel_is_bitwise_the_portable_kernel() {
        if simd::isa() != Isa::Avx2 {
            return;
        }
        let mut seed = 0x1234_5678u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let nb = 9;
            let bb = ty.block_bytes();
            let mut w: Vec<u8> = (0..nb * bb).map(|_| next() as u8).collect();
            for b in 0..nb {
                let d = f16::from_f32((next() % 1000) as f32 * 1e-4 - 0.05).to_le_bytes();
                w[b * bb..b * bb + 2].copy_from_slice(&d);
                if ty == GgmlType::Q4_1 {
                    let m = f16::from_f32((next() % 1000) as f32 * 1e-3 - 0.5).to_le_bytes();
                    w[b * bb + 2..b * bb + 4].copy_from_slice(&m);
                }
            }
            let xs: Vec<Vec<Q8Block>> = (0..4)
                .map(|_| {
                    let x: Vec<f32> = (0..nb * 32)
                        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                        .collect();
                    let mut q = vec![ZERO_BLOCK; nb];
                    quantize_row(&x, &mut q);
                    q
                })
                .collect();
            let a = unsafe { avx2::dot_rows::<4>(ty, &w, [&xs[0], &xs[1], &xs[2], &xs[3]]) };
            let p = dot_rows_portable::<4>(ty, &w, [&xs[0], &xs[1], &xs[2], &xs[3]]);
            assert_eq!(a.map(f32::to_bits), p.map(f32::to_bits), "{ty:?}");
            let one = unsafe { avx2::dot_rows::<1>(ty, &w, [&xs[2]]) };
            assert_eq!(
                one[0].to_bits(),
                a[2].to_bits(),
                "{ty:?}: a row alone equals the same row in a group"
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
        }
    }
}
