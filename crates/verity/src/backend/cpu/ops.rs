//! Row-wise and elementwise CPU operations: RMS norm, RoPE, gated activations, residual adds. Each row is processed alone.

use super::math;
#[cfg(target_arch = "x86_64")]
use super::simd;
use super::simd::dot;
use crate::backend::{Glu, RopeStyle};

pub fn rms_norm(x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let inv = inverse_rms(xr, eps);
        for ((o, &a), &g) in out[r * dim..(r + 1) * dim].iter_mut().zip(xr).zip(w) {
            *o = a * inv * g;
        }
    }
}

/// [`rms_norm`] of every `dim`-long row of `x`, in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], dim: usize, eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let inv = inverse_rms(row, eps);
        for (a, &g) in row.iter_mut().zip(w) {
            *a = *a * inv * g;
        }
    }
}

/// `out += rms_norm(x) · w`, each normed value formed as [`rms_norm`] forms it.
pub fn rms_norm_add(x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32, out: &mut [f32]) {
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let inv = inverse_rms(xr, eps);
        for ((o, &a), &g) in out[r * dim..(r + 1) * dim].iter_mut().zip(xr).zip(w) {
            *o += a * inv * g;
        }
    }
}

fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    let ms = dot(x, x) / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// Rotate every head of row `r` by `rotations[r * half + i]`, the `(cos, sin)` of pair `i` at the row's position
/// ([`crate::backend::Rope::angle`]), where `half` is half the values each head rotates.
pub fn rope(
    x: &mut [f32],
    rotations: &[(f32, f32)],
    rows: usize,
    n_heads: usize,
    head_dim: usize,
    style: RopeStyle,
) {
    // The rotated values of each head: `rotations` holds a pair per two of them (partial RoPE rotates only
    // the head's first values, paired among themselves).
    let half = rotations.len() / rows.max(1);
    for r in 0..rows {
        let cs = &rotations[r * half..(r + 1) * half];
        let row = &mut x[r * n_heads * head_dim..(r + 1) * n_heads * head_dim];
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::HalfSplit => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// `out = act(gate) ⊙ up` ([`math::silu_times`], [`math::gelu_tanh_times`]; AVX2 eight at a time, bitwise the
/// same).
pub fn glu(act: Glu, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if simd::isa() == simd::Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected at run time; every access is below n.
        unsafe {
            use std::arch::x86_64::*;
            while done + 8 <= n {
                let g = _mm256_loadu_ps(gate.as_ptr().add(done));
                let u = _mm256_loadu_ps(up.as_ptr().add(done));
                let y = match act {
                    Glu::Silu => math::silu_times_avx2(g, u),
                    Glu::GeluTanh => math::gelu_tanh_times_avx2(g, u),
                };
                _mm256_storeu_ps(out.as_mut_ptr().add(done), y);
                done += 8;
            }
        }
    }
    let f = match act {
        Glu::Silu => math::silu_times,
        Glu::GeluTanh => math::gelu_tanh_times,
    };
    for i in done..n {
        out[i] = f(gate[i], up[i]);
    }
}
