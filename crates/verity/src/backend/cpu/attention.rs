//! Attention of a batch of new rows over the KV cache, on the CPU.
//!
//! Each (row, head) pair is one task: scores over the visible slots in slot order, a max-subtracted softmax, and
//! the value sum in slot order. A row at a given position sees the same slots in the same order whether it runs
//! alone or in a batch, so its output is bitwise the same.
//!
//! The softmax's exponential is a fixed polynomial ([`exp`]) rather than libm's `expf`: a W-row verify takes W
//! times the exponentials of a step, and a vectorised exponential is several times cheaper. The portable and
//! AVX2 paths compute the scores ([`score`]), the exponentials, their sum (eight lanes, slot `j` in lane `j % 8`,
//! one fixed reduction) and the value sum (`o = fma(p, v, o)` per slot) with the same operations, so they agree
//! bitwise.

use super::pool::{share, Pool, SharedOut};
use super::simd::{self, Isa};
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
    let isa = simd::isa();
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
                // SAFETY: the slice [i*q_dim + h*hd, +hd) belongs to this task alone and lies inside `out`.
                let o =
                    unsafe { std::slice::from_raw_parts_mut(out_ptr.at(i * q_dim + h * hd), hd) };
                let head = Head {
                    k: k_cache,
                    v: v_cache,
                    stride: kv_dim,
                    offset: kvh * hd,
                    scale: s.scale,
                };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: Avx2 (with FMA) is reported only after runtime detection.
                    Isa::Avx2 if hd.is_multiple_of(8) => unsafe {
                        head_avx2(&head, qv, slots, scores, o)
                    },
                    _ => head_portable(&head, qv, slots, scores, o),
                }
            }
        })
    });
}

thread_local! {
    /// Per-thread scores and visible slots, grown to the longest context once.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<usize>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// One KV head of the cache: slot `j`'s key is `k[j * stride + offset..][..head_dim]`, likewise its value.
struct Head<'a> {
    k: &'a [f32],
    v: &'a [f32],
    stride: usize,
    offset: usize,
    scale: f32,
}

impl Head<'_> {
    fn key(&self, slot: usize, hd: usize) -> &[f32] {
        &self.k[slot * self.stride + self.offset..][..hd]
    }

    fn value(&self, slot: usize, hd: usize) -> &[f32] {
        &self.v[slot * self.stride + self.offset..][..hd]
    }
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cody–Waite), so `x - n·ln2` loses no precision.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this, `e^x` is under f32's normal range; inputs are clamped to it (the softmax's weight is ~1e-38).
const EXP_MIN: f32 = -87.336_55;
/// The minimax polynomial of `(e^r - 1 - r) / r²` on `|r| ≤ ln2/2` (Cephes `expf`).
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for `x ≤ 0` (the softmax's `score - max`), within ~2 ulp: `x = n·ln2 + r`, `e^r` by the polynomial,
/// times `2^n`. The AVX2 path does the same operations lane by lane.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The eight-lane horizontal sum in the order the AVX2 reduction uses.
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// `q · k` for a head size that is a multiple of 8: lane `l` sums `q[8c+l]·k[8c+l]` over `c` by fused
/// multiply-adds, then `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))` (what the AVX2 path's add tree gives). Other
/// head sizes (portable path only) sum in element order.
#[inline(always)]
fn score(q: &[f32], k: &[f32]) -> f32 {
    if !q.len().is_multiple_of(8) {
        return q.iter().zip(k).fold(0f32, |a, (&x, &y)| x.mul_add(y, a));
    }
    let mut l = [0f32; 8];
    for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for i in 0..8 {
            l[i] = qc[i].mul_add(kc[i], l[i]);
        }
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

fn head_portable(head: &Head, q: &[f32], slots: &[usize], scores: &mut Vec<f32>, o: &mut [f32]) {
    let hd = q.len();
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for &slot in slots {
        let sc = score(q, head.key(slot, hd)) * head.scale;
        max = max.max(sc);
        scores.push(sc);
    }
    let mut lanes = [0f32; 8];
    for (j, sc) in scores.iter_mut().enumerate() {
        *sc = exp(*sc - max);
        lanes[j % 8] += *sc;
    }
    let sum = hsum8(&lanes);
    o.fill(0.0);
    for (&slot, &p) in slots.iter().zip(scores.iter()) {
        for (a, &b) in o.iter_mut().zip(head.value(slot, hd)) {
            *a = p.mul_add(b, *a);
        }
    }
    let inv = 1.0 / sum;
    for a in o.iter_mut() {
        *a *= inv;
    }
}

/// [`head_portable`] on AVX2 for head sizes that are a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_avx2(head: &Head, q: &[f32], slots: &[usize], scores: &mut Vec<f32>, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = q.len();
    scores.clear();
    // Scores eight slots at a time: lane l of slot j's accumulator sums q[8c+l]·k[8c+l] over c, then one
    // horizontal-add tree reduces the eight accumulators to eight scores (the order `score` writes out).
    let n = slots.len();
    let full = n / 8 * 8;
    scores.resize(n, 0.0);
    let vscale = _mm256_set1_ps(head.scale);
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    for j in (0..full).step_by(8) {
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..hd).step_by(8) {
            let qc = _mm256_loadu_ps(q.as_ptr().add(c));
            for (a, &slot) in acc.iter_mut().zip(&slots[j..j + 8]) {
                *a = _mm256_fmadd_ps(qc, _mm256_loadu_ps(head.key(slot, hd).as_ptr().add(c)), *a);
            }
        }
        let t0 = _mm256_hadd_ps(acc[0], acc[1]);
        let t1 = _mm256_hadd_ps(acc[2], acc[3]);
        let t2 = _mm256_hadd_ps(acc[4], acc[5]);
        let t3 = _mm256_hadd_ps(acc[6], acc[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        let dots = _mm256_add_ps(
            _mm256_permute2f128_ps(u0, u1, 0x20),
            _mm256_permute2f128_ps(u0, u1, 0x31),
        );
        let sc = _mm256_mul_ps(dots, vscale);
        vmax = _mm256_max_ps(vmax, sc);
        _mm256_storeu_ps(scores.as_mut_ptr().add(j), sc);
    }
    let mut maxes = [0f32; 8];
    _mm256_storeu_ps(maxes.as_mut_ptr(), vmax);
    let mut max = maxes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for j in full..n {
        let sc = score(q, head.key(slots[j], hd)) * head.scale;
        max = max.max(sc);
        scores[j] = sc;
    }
    let full = n / 8 * 8;
    let mut sum = _mm256_setzero_ps();
    let exp8 = |x: __m256| {
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let bits = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
    };
    let vmax = _mm256_set1_ps(max);
    let sp = scores.as_mut_ptr();
    for j in (0..full).step_by(8) {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(j)), vmax));
        _mm256_storeu_ps(sp.add(j), e);
        sum = _mm256_add_ps(sum, e);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    for j in full..n {
        let e = exp(scores[j] - max);
        scores[j] = e;
        lanes[j % 8] += e;
    }
    let total = hsum8(&lanes);
    // The value sum with the head's accumulators in registers (8 × 8 lanes for a 64-wide head).
    let op = o.as_mut_ptr();
    for d0 in (0..hd).step_by(64) {
        let width = (hd - d0).min(64) / 8;
        let mut acc = [_mm256_setzero_ps(); 8];
        for (&slot, &p) in slots.iter().zip(scores.iter()) {
            let vp = head.value(slot, hd).as_ptr().add(d0);
            let pv = _mm256_set1_ps(p);
            for (c, a) in acc[..width].iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vp.add(8 * c)), *a);
            }
        }
        let inv = _mm256_set1_ps(1.0 / total);
        for (c, a) in acc[..width].iter().enumerate() {
            _mm256_storeu_ps(op.add(d0 + 8 * c), _mm256_mul_ps(*a, inv));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exponential_is_within_two_ulp_of_libm_on_the_softmax_range() {
        let mut x = 0f32;
        while x > -90.0 {
            let (got, want) = (exp(x), x.exp());
            if want > f32::MIN_POSITIVE {
                let ulp = (got.to_bits() as i64 - want.to_bits() as i64).abs();
                assert!(ulp <= 2, "exp({x}) = {got}, libm {want}");
            }
            x -= 0.000_731;
        }
        assert_eq!(exp(0.0), 1.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_head_is_bitwise_the_portable_head() {
        if simd::isa() != Isa::Avx2 {
            return;
        }
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let (hd, n_slots) = (72, 29);
        let k: Vec<f32> = (0..hd * n_slots).map(|_| next() * 3.0).collect();
        let v: Vec<f32> = (0..hd * n_slots).map(|_| next()).collect();
        let q: Vec<f32> = (0..hd).map(|_| next()).collect();
        let head = Head {
            k: &k,
            v: &v,
            stride: hd,
            offset: 0,
            scale: 0.125,
        };
        let slots: Vec<usize> = (0..n_slots).filter(|s| s % 5 != 3).collect();
        let (mut s1, mut s2) = (Vec::new(), Vec::new());
        let (mut o1, mut o2) = (vec![0f32; hd], vec![0f32; hd]);
        head_portable(&head, &q, &slots, &mut s1, &mut o1);
        unsafe { head_avx2(&head, &q, &slots, &mut s2, &mut o2) };
        assert_eq!(
            o1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            o2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(o1.iter().any(|&x| x != 0.0));
    }
}
