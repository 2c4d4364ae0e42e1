//! Attention of a batch of new rows over the KV cache, on the CPU.
//!
//! Each (row, head) pair is one task: scores over the visible slots in slot order, a max-subtracted softmax, and
//! the value sum in slot order. A row at a given position sees the same slots in the same order whether it runs
//! alone or in a batch, so its output is bitwise the same.

use super::pool::{share, Pool, SharedOut};
use super::simd::dot;
use crate::backend::{AttnMask, AttnShape};

#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &Pool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    s: AttnShape,
    base: usize,
    mask: &AttnMask,
    out: &mut [f32],
) {
    let (hd, group) = (s.head_dim, s.n_heads / s.n_kv_heads);
    let q_dim = s.n_heads * hd;
    let kv_dim = s.n_kv_heads * hd;
    assert!(q.len() >= s.rows * q_dim && out.len() >= s.rows * q_dim);
    assert!(k_cache.len() >= (base + s.rows) * kv_dim && v_cache.len() >= (base + s.rows) * kv_dim);
    let out_ptr = SharedOut::new(out);
    pool.run(&|t| {
        SCRATCH.with(|cell| {
            let (scores, slots) = &mut *cell.borrow_mut();
            for task in share(s.rows * s.n_heads, pool.threads(), t, 1) {
                let (i, h) = (task / s.n_heads, task % s.n_heads);
                let kvh = h / group;
                let qv = &q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd];
                slots.clear();
                slots.extend(0..base);
                slots.extend(
                    (0..s.rows)
                        .filter(|&j| mask.sees(s.rows, i, j))
                        .map(|j| base + j),
                );
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for &slot in slots.iter() {
                    let kv = &k_cache[slot * kv_dim + kvh * hd..slot * kv_dim + (kvh + 1) * hd];
                    let sc = dot(qv, kv) * s.scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                // SAFETY: the slice [i*q_dim + h*hd, +hd) belongs to this task alone and lies inside `out`.
                let o =
                    unsafe { std::slice::from_raw_parts_mut(out_ptr.at(i * q_dim + h * hd), hd) };
                o.fill(0.0);
                for (&slot, &p) in slots.iter().zip(scores.iter()) {
                    let vv = &v_cache[slot * kv_dim + kvh * hd..slot * kv_dim + (kvh + 1) * hd];
                    for (a, &b) in o.iter_mut().zip(vv) {
                        *a += p * b;
                    }
                }
                let inv = 1.0 / sum;
                for a in o.iter_mut() {
                    *a *= inv;
                }
            }
        })
    });
}

thread_local! {
    /// Per-thread scores and visible slots, grown to the longest context once.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<usize>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}
