//! Runtime SIMD dispatch for the CPU kernels: the instruction set is detected once, and each kernel has one body
//! compiled per instruction set. Within one process every call of a kernel uses the same instruction set and the
//! same reduction order, which the row-exact contract relies on.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// x86-64 with AVX2 and FMA.
    Avx2,
    /// aarch64 Advanced SIMD (always present on aarch64).
    Neon,
}

/// The best instruction set this CPU has; `VERITY_ISA=scalar` forces the portable path (for A/B and tests).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        if std::env::var("VERITY_ISA").is_ok_and(|v| v == "scalar") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            return Isa::Neon;
        }
        #[allow(unreachable_code)]
        Isa::Scalar
    })
}

/// The instruction set of the 8-bit integer kernels (see `packed`). Every variant computes the same integer
/// sums and the same float operations, so this choice changes speed only, never a bit of a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Isa {
    Portable,
    /// AVX2: `vpmaddubsw` + `vpmaddwd` over 8 columns per register.
    Avx2,
    /// AVX-512 VNNI: one `vpdpbusd` over 16 columns per register.
    Avx512Vnni,
    /// aarch64 with the dot-product extension: one `sdot` over 4 columns per register.
    NeonDot,
}

/// The best 8-bit kernel this CPU runs (aarch64: NEON's `sdot` where the dot-product extension is there);
/// `VERITY_ISA=scalar` forces the portable one, `VERITY_ISA=avx2` the AVX2 one (for A/B runs and tests).
pub fn int8_isa() -> Int8Isa {
    static ISA: OnceLock<Int8Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "aarch64")]
        {
            if isa() == Isa::Neon && std::arch::is_aarch64_feature_detected!("dotprod") {
                return Int8Isa::NeonDot;
            }
        }
        if isa() != Isa::Avx2 {
            return Int8Isa::Portable;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let forced_avx2 = std::env::var("VERITY_ISA").is_ok_and(|v| v == "avx2");
            if !forced_avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Int8Isa::Avx512Vnni;
            }
            if is_x86_feature_detected!("f16c") {
                return Int8Isa::Avx2;
            }
        }
        Int8Isa::Portable
    })
}

/// Portable dot product with 8 independent partial sums (fixed order, so it vectorizes and stays deterministic).
#[inline(always)]
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// AVX2/FMA dot product: four 8-lane accumulators, a fixed horizontal reduction, a scalar tail.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let [[d]] = dots_avx2::<1, 1>([&a[..n]], [&b[..n]]);
    d
}

/// `C × R` AVX2 dot products at once: `out[c][r]` is bitwise `dot_avx2(a[c], b[r])` (each pair keeps its own
/// four accumulators and the same order of operations), with each 8-lane load of an `a` or a `b` row serving
/// `R` or `C` products instead of one. The rows must share one length.
///
/// # Safety
/// The CPU must support AVX2 and FMA, and the caller's target features must cover the registers `C × R × 4`
/// accumulators need without spilling (2 × 2: AVX-512VL's 32).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::needless_range_loop)] // c, r and j index parallel arrays
pub unsafe fn dots_avx2<const C: usize, const R: usize>(
    a: [&[f32]; C],
    b: [&[f32]; R],
) -> [[f32; R]; C] {
    use std::arch::x86_64::*;
    let n = a[0].len();
    debug_assert!(a.iter().all(|r| r.len() == n) && b.iter().all(|r| r.len() == n));
    let pa = a.map(|r| r.as_ptr());
    let pb = b.map(|r| r.as_ptr());
    let mut acc = [[[_mm256_setzero_ps(); 4]; R]; C];
    let mut i = 0;
    while i + 32 <= n {
        for j in 0..4 {
            let vb: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(pb[r].add(i + 8 * j)));
            for c in 0..C {
                let va = _mm256_loadu_ps(pa[c].add(i + 8 * j));
                for r in 0..R {
                    acc[c][r][j] = _mm256_fmadd_ps(va, vb[r], acc[c][r][j]);
                }
            }
        }
        i += 32;
    }
    let main = i;
    let mut out = [[0f32; R]; C];
    for c in 0..C {
        for r in 0..R {
            let [mut acc0, acc1, acc2, acc3] = acc[c][r];
            let mut i = main;
            while i + 8 <= n {
                acc0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa[c].add(i)),
                    _mm256_loadu_ps(pb[r].add(i)),
                    acc0,
                );
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
            let lo = _mm256_castps256_ps128(s);
            let hi = _mm256_extractf128_ps(s, 1);
            let q = _mm_add_ps(lo, hi);
            let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
            let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
            let mut sum = _mm_cvtss_f32(e);
            let mut tail = 0f32;
            while i < n {
                tail += *pa[c].add(i) * *pb[r].add(i);
                i += 1;
            }
            sum += tail;
            out[c][r] = sum;
        }
    }
    out
}

/// NEON dot product: four 4-lane accumulators, a fixed horizontal reduction, a scalar tail.
///
/// # Safety
/// aarch64 only (NEON is architectural there).
#[cfg(target_arch = "aarch64")]
#[inline]
#[target_feature(enable = "neon")]
pub unsafe fn dot_neon(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::aarch64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = vdupq_n_f32(0.0);
    let mut acc1 = vdupq_n_f32(0.0);
    let mut acc2 = vdupq_n_f32(0.0);
    let mut acc3 = vdupq_n_f32(0.0);
    let mut i = 0;
    while i + 16 <= n {
        acc0 = vfmaq_f32(acc0, vld1q_f32(pa.add(i)), vld1q_f32(pb.add(i)));
        acc1 = vfmaq_f32(acc1, vld1q_f32(pa.add(i + 4)), vld1q_f32(pb.add(i + 4)));
        acc2 = vfmaq_f32(acc2, vld1q_f32(pa.add(i + 8)), vld1q_f32(pb.add(i + 8)));
        acc3 = vfmaq_f32(acc3, vld1q_f32(pa.add(i + 12)), vld1q_f32(pb.add(i + 12)));
        i += 16;
    }
    let s = vaddq_f32(vaddq_f32(acc0, acc1), vaddq_f32(acc2, acc3));
    let mut sum = vaddvq_f32(s);
    let mut tail = 0f32;
    while i < n {
        tail += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    sum += tail;
    sum
}

/// The dot product of the detected instruction set.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` returned Avx2 only after detecting AVX2 and FMA.
        Isa::Avx2 => unsafe { dot_avx2(a, b) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is architectural on aarch64.
        Isa::Neon => unsafe { dot_neon(a, b) },
        _ => dot_scalar(a, b),
    }
}
