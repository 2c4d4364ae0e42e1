//! Activation-quantized matmul for the GGML legacy formats (Q4_0, Q4_1, Q8_0), the way llama.cpp runs them:
//! each activation row is quantized to 8 bits per 32-value block (scale `d`, `Σq` and `s = d·Σq`), each
//! block's dot product is an exact integer sum, and the weights are in the interleaved layout of
//! [`super::packed`], whose module doc states the arithmetic. A row's operations never depend on how many
//! rows share a call or on the thread count, so a W-row verify is row-exact.

use super::ops::silu_times;
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

/// The same code compiled for AVX2, where it vectorizes (every operation is exact or correctly rounded lane by
/// lane, so the result is bitwise the portable one).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(x: &[f32], out: &mut [Q8Block]) {
    quantize_blocks(x, out)
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
    QX.with(|qx| {
        let mut qx = qx.borrow_mut();
        if qx.len() < rows * nb {
            qx.resize(rows * nb, ZERO_BLOCK);
        }
        for r in 0..rows {
            quantize_row(&x[r * k..(r + 1) * k], &mut qx[r * nb..(r + 1) * nb]);
        }
        let qx = &qx[..rows * nb];
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
                for r0 in (0..rows).step_by(ROWS) {
                    let take = (rows - r0).min(ROWS);
                    let mut xs: [&[Q8Block]; ROWS] = [&[]; ROWS];
                    for (i, x) in xs[..take].iter_mut().enumerate() {
                        *x = &qx[(r0 + i) * nb..(r0 + i + 1) * nb];
                    }
                    w.group(isa, local, &xs[..take], &mut res);
                    for (i, row) in res[..take].iter().enumerate() {
                        let at = (r0 + i) * w.n + local * GROUP;
                        // SAFETY: columns of group `local` of matrix `m` belong to this task; r0 + i < rows.
                        unsafe {
                            std::ptr::copy_nonoverlapping(row.as_ptr(), dsts[m].at(at), cols)
                        };
                    }
                }
            }
        });
    });
}

/// `out = silu(gate · x) ⊙ (up · x)` in one pass of the pool: the thread that computes a group of gate columns
/// computes the same group of up columns and writes their SwiGLU at once, so no serial pass over the
/// intermediate follows. Each output is bitwise `ops::silu_times` of the two products [`matmul`] gives.
pub fn swiglu(pool: &Pool, x: &[f32], rows: usize, gate: &Packed, up: &Packed, out: &mut [f32]) {
    let (k, n) = (gate.k, gate.n);
    let nb = k / 32;
    assert!(up.k == k && up.n == n && k.is_multiple_of(32));
    assert!(x.len() >= rows * k && out.len() >= rows * n);
    let dst = SharedOut::new(out);
    QX.with(|qx| {
        let mut qx = qx.borrow_mut();
        if qx.len() < rows * nb {
            qx.resize(rows * nb, ZERO_BLOCK);
        }
        for r in 0..rows {
            quantize_row(&x[r * k..(r + 1) * k], &mut qx[r * nb..(r + 1) * nb]);
        }
        let qx = &qx[..rows * nb];
        let isa = simd::int8_isa();
        pool.run(&|t| {
            let (mut g_res, mut u_res) = ([[0f32; GROUP]; ROWS], [[0f32; GROUP]; ROWS]);
            for g in share(gate.groups(), pool.threads(), t, 1) {
                let cols = (n - g * GROUP).min(GROUP);
                for r0 in (0..rows).step_by(ROWS) {
                    let take = (rows - r0).min(ROWS);
                    let mut xs: [&[Q8Block]; ROWS] = [&[]; ROWS];
                    for (i, x) in xs[..take].iter_mut().enumerate() {
                        *x = &qx[(r0 + i) * nb..(r0 + i + 1) * nb];
                    }
                    gate.group(isa, g, &xs[..take], &mut g_res);
                    up.group(isa, g, &xs[..take], &mut u_res);
                    for (i, (gr, ur)) in g_res[..take].iter().zip(&u_res).enumerate() {
                        let at = (r0 + i) * n + g * GROUP;
                        for (c, (&gv, &uv)) in gr[..cols].iter().zip(ur).enumerate() {
                            // SAFETY: columns of group g belong to this task; r0 + i < rows.
                            unsafe { *dst.at(at + c) = silu_times(gv, uv) };
                        }
                    }
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

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
