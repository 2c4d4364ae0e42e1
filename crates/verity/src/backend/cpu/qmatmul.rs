//! Activation-quantized matmul for the GGML block formats (see [`super::packed`]), as llama.cpp runs them: each
//! activation row is quantized to 8 bits per 32-value block (scale `d`, `Σq` and `s = d·Σq`; llama.cpp's
//! K-quant path uses 256-value blocks, here every format shares the finer ones), each
//! block's dot product is an exact integer sum, and the weights are in the interleaved layout of
//! [`super::packed`], whose module doc states the arithmetic. A row's operations never depend on how many
//! rows share a call or on the thread count, so a W-row verify is row-exact.

use super::ops;
use super::packed::{Packed, GROUP, ROWS};
use super::pool::{share, Pool, SharedOut};
use super::q8::{quantize_row, Q8Block, ZERO_BLOCK};
use super::simd;
use crate::backend::Glu;

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

/// `out = act(gate · x) ⊙ (up · x)` in one pass of the pool: the thread that computes a group of gate columns
/// computes the same group of up columns and writes their activation at once, so no serial pass over the
/// intermediate follows. Each output is bitwise what `ops::glu` makes of the two products [`matmul`] gives.
#[allow(clippy::too_many_arguments)]
pub fn glu(
    pool: &Pool,
    x: &[f32],
    rows: usize,
    gate: &Packed,
    up: &Packed,
    act: Glu,
    out: &mut [f32],
) {
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
                        ops::glu(act, &gr[..cols], &ur[..cols], o);
                    }
                });
            }
        });
    });
}
