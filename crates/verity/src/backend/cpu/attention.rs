//! Attention of a batch of new rows over the KV cache, on the CPU.
//!
//! Each (row, head) pair is one task: scores over the visible slots in slot order, a max-subtracted softmax, and
//! the value sum in slot order. A row at a given position sees the same slots in the same order whether it runs
//! alone or in a batch, so its output is bitwise the same.
//!
//! The softmax's exponential is a fixed polynomial ([`math::exp`]) rather than libm's `expf`: a W-row verify takes W
//! times the exponentials of a step, and a vectorised exponential is several times cheaper. The portable and
//! AVX2 paths compute the scores ([`score`]), the exponentials, their sum (eight lanes, slot `j` in lane `j % 8`,
//! one fixed reduction) and the value sum (`o = fma(p, v, o)` per slot) with the same operations, so they agree
//! bitwise.
//!
//! A local layer's window ([`AttnShape::window`]) hides the keys before a row's `position - window + 1`. Each
//! score keeps its place in the row, numbered by key position (slot `j` of the cache holds position `j`, and a
//! new row's ancestors follow at `base`, `base + 1`, ...), and a hidden key's weight is exactly 0: the sums
//! then take the same values in the same lanes in the same order whichever earlier keys a batch also visits, so
//! a row stays bitwise the same alone or in a batch. Whole groups of eight hidden keys are skipped.

use super::math;
use super::pool::{share, Pool, SharedOut};
use super::simd;
use crate::backend::{AttnMask, AttnShape};

#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &Pool,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    s: AttnShape,
    base: usize,
    positions: &[usize],
    mask: &AttnMask,
    out: &mut [f32],
) {
    let (hd, group) = (s.head_dim, s.n_heads / s.n_kv_heads);
    // The first key position row `i` sees.
    let first_seen = |i: usize| s.window.map_or(0, |w| (positions[i] + 1).saturating_sub(w));
    let q_dim = s.n_heads * hd;
    let kv_dim = s.n_kv_heads * hd;
    assert!(q.len() >= s.rows * q_dim && out.len() >= s.rows * q_dim);
    // A cache buffer of `slots` slots is a ring (a local layer's): slot j at j mod slots.
    let slots = k_cache.len() / kv_dim;
    assert!(slots > 0 && v_cache.len() == k_cache.len());
    assert!(s.window.is_some() || slots >= base + s.rows);
    let out_ptr = SharedOut::new(out);
    let isa = simd::isa();
    // A task is a run of one KV head's queries (its `group` heads × the rows): they share that head's keys and
    // values, read once per chunk of slots. About four tasks per KV head keep two or more threads busy.
    let queries = group * s.rows;
    let per_task = queries.div_ceil(4);
    let tasks_per_head = queries.div_ceil(per_task);
    pool.run(&|t| {
        SCRATCH.with(|cell| {
            let scratch = &mut *cell.borrow_mut();
            for task in share(s.n_kv_heads * tasks_per_head, pool.threads(), t, 1) {
                let kvh = task / tasks_per_head;
                let first = (task % tasks_per_head) * per_task;
                let head = Head {
                    k: k_cache,
                    v: v_cache,
                    slots,
                    stride: kv_dim,
                    offset: kvh * hd,
                    hd,
                    scale: s.scale,
                };
                scratch.items.clear();
                scratch.extra.clear();
                for m in first..(first + per_task).min(queries) {
                    let (i, h) = (m / group, kvh * group + m % group);
                    let from = scratch.extra.len();
                    scratch.extra.extend(
                        (0..s.rows)
                            .filter(|&j| mask.sees(s.rows, i, j))
                            .map(|j| base + j),
                    );
                    scratch.items.push(Query {
                        q: i * q_dim + h * hd,
                        extra: from..scratch.extra.len(),
                        first_seen: first_seen(i),
                        out: out_ptr.at(i * q_dim + h * hd),
                    });
                }
                // The task's first visited key: whole groups of eight keys that no query sees are skipped.
                let seen = scratch
                    .items
                    .iter()
                    .map(|it| it.first_seen)
                    .min()
                    .unwrap_or(0);
                let start = seen.min(base) / 8 * 8;
                // (`sums` serves the AVX2 path alone.)
                #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
                let Scratch {
                    items,
                    extra,
                    scores,
                    sums,
                    slots,
                } = scratch;
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: Avx2 (with FMA) is reported only after runtime detection; every item's output is
                    // a disjoint `hd`-slice of `out` that this task alone writes.
                    simd::Isa::Avx2 if hd.is_multiple_of(8) => unsafe {
                        heads_avx2(&head, q, start..base, items, extra, scores, sums)
                    },
                    _ => {
                        for it in items.iter() {
                            slots.clear();
                            slots.extend(start..base);
                            slots.extend_from_slice(&extra[it.extra.clone()]);
                            // SAFETY: as above.
                            let o = unsafe { std::slice::from_raw_parts_mut(it.out, hd) };
                            let hidden = it.first_seen - start;
                            head_portable(&head, &q[it.q..it.q + hd], slots, hidden, scores, o);
                        }
                    }
                }
            }
        })
    });
}

/// One query of a task: its vector's offset in `q`, the new slots it sees (a range of the task's list; every
/// query sees the cached slots before them from `first_seen` on), the first key position its window shows, and
/// where its output goes.
struct Query {
    q: usize,
    extra: std::ops::Range<usize>,
    first_seen: usize,
    out: *mut f32,
}

/// A thread's working memory, grown to the largest task once.
#[derive(Default)]
struct Scratch {
    items: Vec<Query>,
    extra: Vec<usize>,
    scores: Vec<f32>,
    sums: Vec<f32>,
    slots: Vec<usize>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// One KV head of the cache: slot `j`'s key is `k[(j mod slots) * stride + offset..][..head_dim]`, likewise
/// its value.
struct Head<'a> {
    k: &'a [f32],
    v: &'a [f32],
    slots: usize,
    stride: usize,
    offset: usize,
    hd: usize,
    scale: f32,
}

impl Head<'_> {
    fn key(&self, slot: usize) -> &[f32] {
        &self.k[self.at(slot)..][..self.hd]
    }

    fn value(&self, slot: usize) -> &[f32] {
        &self.v[self.at(slot)..][..self.hd]
    }

    /// Where slot `slot` starts: a whole-context cache never wraps, so only a ring pays for the division.
    #[inline(always)]
    fn at(&self, slot: usize) -> usize {
        let s = if slot < self.slots {
            slot
        } else {
            slot % self.slots
        };
        s * self.stride + self.offset
    }
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

/// One query over `slots` (consecutive key positions from a multiple of eight), the first `hidden` of them
/// outside its window (weight 0).
fn head_portable(
    head: &Head,
    q: &[f32],
    slots: &[usize],
    hidden: usize,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for (j, &slot) in slots.iter().enumerate() {
        let sc = score(q, head.key(slot)) * head.scale;
        if j >= hidden {
            max = max.max(sc);
        }
        scores.push(sc);
    }
    let mut lanes = [0f32; 8];
    for (j, sc) in scores.iter_mut().enumerate() {
        *sc = if j < hidden {
            0.0
        } else {
            math::exp(*sc - max)
        };
        lanes[j % 8] += *sc;
    }
    let sum = hsum8(&lanes);
    o.fill(0.0);
    for (&slot, &p) in slots.iter().zip(scores.iter()) {
        for (a, &b) in o.iter_mut().zip(head.value(slot)) {
            *a = p.mul_add(b, *a);
        }
    }
    let inv = 1.0 / sum;
    for a in o.iter_mut() {
        *a *= inv;
    }
}

/// Slots per chunk of the blocked path: their keys (or values) stay in L1 while every query of the task reads them.
#[cfg(target_arch = "x86_64")]
const CHUNK: usize = 32;

/// [`head_portable`] for every query of a task on AVX2 (head sizes a multiple of 8), bitwise the same per query:
/// the cached slots `cached` (from a multiple of eight) are visited in chunks of [`CHUNK`] with each query's
/// scores, and later its value sums, taken chunk after chunk in slot order; each score is [`score`]'s
/// arithmetic, eight slots at a time. A query's scores are stored from `cached.start` on.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn heads_avx2(
    head: &Head,
    q: &[f32],
    cached: std::ops::Range<usize>,
    items: &[Query],
    extra: &[usize],
    scores: &mut Vec<f32>,
    sums: &mut Vec<f32>,
) {
    use std::arch::x86_64::*;
    let hd = head.hd;
    let (start, base) = (cached.start, cached.end);
    let stride = base - start + items.iter().map(|it| it.extra.len()).max().unwrap_or(0);
    scores.resize(items.len() * stride, 0.0);
    // Row n's score of slot j is at `at(n, j)`.
    let sp = scores.as_mut_ptr();
    let at = |n: usize, j: usize| sp.add(n * stride + j - start);
    let vscale = _mm256_set1_ps(head.scale);
    // Scores over the cached slots, chunk by chunk.
    let wide = wide_registers();
    for c0 in (start..base).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(base);
        let mut n = 0;
        if wide {
            // Two queries per pass: each key row is loaded once for both.
            while n + 2 <= items.len() {
                let qa = &q[items[n].q..items[n].q + hd];
                let qb = &q[items[n + 1].q..items[n + 1].q + hd];
                let (ra, rb) = (at(n, start), at(n + 1, start));
                let mut j = c0;
                while j + 8 <= c1 {
                    let (da, db) = scores8x2_wide(head, qa, qb, j);
                    _mm256_storeu_ps(ra.add(j - start), _mm256_mul_ps(da, vscale));
                    _mm256_storeu_ps(rb.add(j - start), _mm256_mul_ps(db, vscale));
                    j += 8;
                }
                for slot in j..c1 {
                    *ra.add(slot - start) = score(qa, head.key(slot)) * head.scale;
                    *rb.add(slot - start) = score(qb, head.key(slot)) * head.scale;
                }
                n += 2;
            }
        }
        for (n, it) in items.iter().enumerate().skip(n) {
            let qv = &q[it.q..it.q + hd];
            let row = at(n, start);
            let mut j = c0;
            while j + 8 <= c1 {
                // Fixed-size loops over raw pointers, so the accumulators stay in registers.
                let keys: [*const f32; 8] = std::array::from_fn(|s| head.key(j + s).as_ptr());
                let mut acc = [_mm256_setzero_ps(); 8];
                for c in (0..hd).step_by(8) {
                    let qc = _mm256_loadu_ps(qv.as_ptr().add(c));
                    for s in 0..8 {
                        acc[s] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys[s].add(c)), acc[s]);
                    }
                }
                _mm256_storeu_ps(row.add(j - start), _mm256_mul_ps(reduce8(acc), vscale));
                j += 8;
            }
            for slot in j..c1 {
                *row.add(slot - start) = score(qv, head.key(slot)) * head.scale;
            }
        }
    }
    // Each query's own new slots, then its softmax weights (unnormalised) and their sum.
    sums.clear();
    for (n, it) in items.iter().enumerate() {
        let qv = &q[it.q..it.q + hd];
        let len = base - start + it.extra.len();
        let row = std::slice::from_raw_parts_mut(at(n, start), len);
        for (e, &slot) in extra[it.extra.clone()].iter().enumerate() {
            row[base - start + e] = score(qv, head.key(slot)) * head.scale;
        }
        sums.push(softmax_weights_avx2(row, it.first_seen - start));
    }
    // Value sums, chunk by chunk, then the new slots, then the normalisation.
    for it in items {
        std::slice::from_raw_parts_mut(it.out, hd).fill(0.0);
    }
    for c0 in (start..base).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(base);
        let weights = |n: usize| std::slice::from_raw_parts(at(n, c0), c1 - c0);
        let mut n = 0;
        if hd == 64 && wide_registers() {
            // Two queries per pass: each value row is loaded once for both.
            while n + 2 <= items.len() {
                let o = [items[n].out, items[n + 1].out];
                values2_avx2(head, o, c0..c1, [weights(n), weights(n + 1)]);
                n += 2;
            }
        }
        for (m, it) in items.iter().enumerate().skip(n) {
            values_avx2(head, it.out, c0..c1, weights(m));
        }
    }
    for ((n, it), &total) in items.iter().enumerate().zip(sums.iter()) {
        let w = std::slice::from_raw_parts(at(n, base), it.extra.len());
        values_avx2(head, it.out, extra[it.extra.clone()].iter().copied(), w);
        let o = it.out;
        let inv = _mm256_set1_ps(1.0 / total);
        for c in (0..hd).step_by(8) {
            _mm256_storeu_ps(o.add(c), _mm256_mul_ps(_mm256_loadu_ps(o.add(c)), inv));
        }
    }
}

/// `row[j] = exp(row[j] - max)` with the max over `row[hidden..]` and the first `hidden` set to 0 (keys outside
/// the window), returning their sum in [`head_portable`]'s lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_weights_avx2(row: &mut [f32], hidden: usize) -> f32 {
    use std::arch::x86_64::*;
    let n = row.len();
    // The max over the visible scores: hidden ones are first set to -inf (their weights are set to 0 below).
    row[..hidden].fill(f32::NEG_INFINITY);
    let full = n / 8 * 8;
    let p = row.as_mut_ptr();
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    for j in (0..full).step_by(8) {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p.add(j)));
    }
    let mut maxes = [0f32; 8];
    _mm256_storeu_ps(maxes.as_mut_ptr(), vmax);
    let max = row[full..]
        .iter()
        .chain(&maxes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let vmax = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    let zero_below = _mm256_set1_epi32(hidden.min(i32::MAX as usize) as i32);
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for j in (0..full).step_by(8) {
        let e = math::exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), vmax));
        // Lanes below `hidden` hold exactly 0.
        let idx = _mm256_add_epi32(lane, _mm256_set1_epi32(j as i32));
        let keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_add_epi32(idx, _mm256_set1_epi32(1)),
            zero_below,
        ));
        let e = _mm256_and_ps(e, keep);
        _mm256_storeu_ps(p.add(j), e);
        sum = _mm256_add_ps(sum, e);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    for (j, v) in row.iter_mut().enumerate().skip(full) {
        *v = if j < hidden { 0.0 } else { math::exp(*v - max) };
        lanes[j % 8] += *v;
    }
    hsum8(&lanes)
}

/// Eight slots' lane accumulators reduced to their eight dot products, in [`score`]'s order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce8(acc: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let t0 = _mm256_hadd_ps(acc[0], acc[1]);
    let t1 = _mm256_hadd_ps(acc[2], acc[3]);
    let t2 = _mm256_hadd_ps(acc[4], acc[5]);
    let t3 = _mm256_hadd_ps(acc[6], acc[7]);
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    _mm256_add_ps(
        _mm256_permute2f128_ps(u0, u1, 0x20),
        _mm256_permute2f128_ps(u0, u1, 0x31),
    )
}

/// The unscaled scores of slots `j..j+8` for two queries (the single-query loop's operations for each), each key
/// row loaded once; compiled with AVX-512VL for its 32 registers (the instructions stay AVX2's).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn scores8x2_wide(
    head: &Head,
    qa: &[f32],
    qb: &[f32],
    j: usize,
) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
    use std::arch::x86_64::*;
    let keys: [*const f32; 8] = std::array::from_fn(|s| head.key(j + s).as_ptr());
    let mut a = [_mm256_setzero_ps(); 8];
    let mut b = [_mm256_setzero_ps(); 8];
    for c in (0..head.hd).step_by(8) {
        let (xa, xb) = (
            _mm256_loadu_ps(qa.as_ptr().add(c)),
            _mm256_loadu_ps(qb.as_ptr().add(c)),
        );
        for s in 0..8 {
            let k = _mm256_loadu_ps(keys[s].add(c));
            a[s] = _mm256_fmadd_ps(xa, k, a[s]);
            b[s] = _mm256_fmadd_ps(xb, k, b[s]);
        }
    }
    (reduce8(a), reduce8(b))
}

/// Whether AVX-512VL's 32 vector registers are there: [`values2_avx2`] keeps 16 accumulators live and spills
/// them with AVX2's 16.
#[cfg(target_arch = "x86_64")]
fn wide_registers() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl")
}

/// [`values_avx2`] for two queries at once over the same slots, for 64-value heads (the same operations per
/// query, each value row loaded once); compiled with AVX-512VL for its registers (the instructions stay AVX2's).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn values2_avx2(
    head: &Head,
    o: [*mut f32; 2],
    slots: std::ops::Range<usize>,
    w: [&[f32]; 2],
) {
    use std::arch::x86_64::*;
    let mut a: [__m256; 8] = std::array::from_fn(|c| _mm256_loadu_ps(o[0].add(8 * c)));
    let mut b: [__m256; 8] = std::array::from_fn(|c| _mm256_loadu_ps(o[1].add(8 * c)));
    for (j, slot) in slots.enumerate() {
        let vp = head.value(slot).as_ptr();
        let (pa, pb) = (_mm256_set1_ps(w[0][j]), _mm256_set1_ps(w[1][j]));
        for c in 0..8 {
            let v = _mm256_loadu_ps(vp.add(8 * c));
            a[c] = _mm256_fmadd_ps(pa, v, a[c]);
            b[c] = _mm256_fmadd_ps(pb, v, b[c]);
        }
    }
    for c in 0..8 {
        _mm256_storeu_ps(o[0].add(8 * c), a[c]);
        _mm256_storeu_ps(o[1].add(8 * c), b[c]);
    }
}

/// `o += p_j · value(slot_j)` in order, `o` held in registers 64 values at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_avx2(
    head: &Head,
    o: *mut f32,
    slots: impl Iterator<Item = usize> + Clone,
    weights: &[f32],
) {
    use std::arch::x86_64::*;
    if head.hd.is_multiple_of(64) {
        // Fixed-size loops, so the accumulators stay in registers.
        for d0 in (0..head.hd).step_by(64) {
            let mut acc: [__m256; 8] = std::array::from_fn(|c| _mm256_loadu_ps(o.add(d0 + 8 * c)));
            for (slot, &p) in slots.clone().zip(weights) {
                let vp = head.value(slot).as_ptr().add(d0);
                let pv = _mm256_set1_ps(p);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vp.add(8 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(d0 + 8 * c), *a);
            }
        }
        return;
    }
    for d0 in (0..head.hd).step_by(64) {
        let width = (head.hd - d0).min(64) / 8;
        let mut acc = [_mm256_setzero_ps(); 8];
        for (c, a) in acc[..width].iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.add(d0 + 8 * c));
        }
        for (slot, &p) in slots.clone().zip(weights) {
            let vp = head.value(slot).as_ptr().add(d0);
            let pv = _mm256_set1_ps(p);
            for (c, a) in acc[..width].iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vp.add(8 * c)), *a);
            }
        }
        for (c, a) in acc[..width].iter().enumerate() {
            _mm256_storeu_ps(o.add(d0 + 8 * c), *a);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn avx2_head_is_bitwise_the_portable_head() {
        if simd::isa() != simd::Isa::Avx2 {
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
        let head = Head {
            k: &k,
            v: &v,
            slots: n_slots,
            stride: hd,
            offset: 0,
            hd,
            scale: 0.125,
        };
        // Three queries over 21 cached slots, each seeing its own subset of the 8 new ones (a tree mask), without
        // a window and with windows that hide different numbers of early keys.
        let base = 21;
        let q: Vec<f32> = (0..3 * hd).map(|_| next()).collect();
        let extras: Vec<Vec<usize>> = vec![vec![21], vec![21, 23, 26], (21..29).collect()];
        for first_seen in [[0, 0, 0], [9, 3, 17], [20, 21, 22]] {
            let start = first_seen.iter().min().unwrap() / 8 * 8;
            let mut outs = vec![vec![0f32; hd]; 3];
            let mut extra = Vec::new();
            let items: Vec<Query> = outs
                .iter_mut()
                .enumerate()
                .map(|(n, o)| {
                    let from = extra.len();
                    extra.extend_from_slice(&extras[n]);
                    Query {
                        q: n * hd,
                        extra: from..extra.len(),
                        first_seen: first_seen[n],
                        out: o.as_mut_ptr(),
                    }
                })
                .collect();
            unsafe {
                heads_avx2(
                    &head,
                    &q,
                    start..base,
                    &items,
                    &extra,
                    &mut Vec::new(),
                    &mut Vec::new(),
                )
            };
            for (n, got) in outs.iter().enumerate() {
                // Alone, a query starts at its own first group of eight keys.
                let own = first_seen[n] / 8 * 8;
                let slots: Vec<usize> = (own..base).chain(extras[n].iter().copied()).collect();
                let mut want = vec![0f32; hd];
                head_portable(
                    &head,
                    &q[n * hd..(n + 1) * hd],
                    &slots,
                    first_seen[n] - own,
                    &mut Vec::new(),
                    &mut want,
                );
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "query {n}, first seen {first_seen:?}"
                );
                assert!(want.iter().any(|&x| x != 0.0));
            }
        }
    }
}
