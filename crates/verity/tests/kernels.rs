//! CPU kernels against references on random data of odd shapes: block decoders against the `gguf` Python
//! package, the matmul against an f64 reference, and row-exactness of the W-row matmul for every format.

mod common;

use common::*;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use verity::backend::cpu::{Activations, CpuBackend};
use verity::backend::{Backend, Glu};
use verity::quant::{GgmlType, MlxScaleType, QMatrix};
use verity::storage::Bytes;

const GGML_QUANTS: &[(&str, GgmlType)] = &[
    ("Q4_0", GgmlType::Q4_0),
    ("Q4_1", GgmlType::Q4_1),
    ("Q5_0", GgmlType::Q5_0),
    ("Q5_1", GgmlType::Q5_1),
    ("Q8_0", GgmlType::Q8_0),
    ("Q4_K", GgmlType::Q4K),
    ("Q5_K", GgmlType::Q5K),
    ("Q6_K", GgmlType::Q6K),
    ("IQ4_NL", GgmlType::IQ4NL),
    ("IQ4_XS", GgmlType::IQ4XS),
    ("Q2_K", GgmlType::Q2K),
    ("Q3_K", GgmlType::Q3K),
];

/// A format's fixture blocks and the `gguf` package's decoding of them.
fn fixture_blocks(name: &str) -> (Vec<u8>, Vec<f32>) {
    let dir = fixtures().join("quant");
    let decoded = json(&dir.join("decoded.json"));
    let values = decoded[name]
        .as_array()
        .unwrap_or_else(|| panic!("no {name}"));
    (
        std::fs::read(dir.join(format!("{name}.bin"))).unwrap(),
        values.iter().map(|v| v.as_f64().unwrap() as f32).collect(),
    )
}

#[test]
fn ggml_block_decoders_match_the_gguf_package() {
    for &(name, ty) in GGML_QUANTS {
        let (raw, want) = fixture_blocks(name);
        let cols = ty.block_len() * 2;
        let rows = want.len() / cols;
        let m = QMatrix::ggml(name, ty, rows, cols, Bytes::owned(raw)).unwrap();
        let mut got = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut got);
            for (i, (&g, &w)) in got.iter().zip(&want[r * cols..(r + 1) * cols]).enumerate() {
                // gguf computes in f32 too, but may round intermediate products differently: allow 2 ulp-ish.
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{name} row {r} elem {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// Random matrices in every format verity decodes, with shapes that are not multiples of any tile.
fn random_matrices(rng: &mut ChaCha8Rng) -> Vec<QMatrix> {
    let mut out = Vec::new();
    let rows = 37;
    for &(name, ty) in GGML_QUANTS {
        let (raw, _) = fixture_blocks(name);
        let bb = ty.block_bytes();
        let n_fixture = raw.len() / bb;
        let cols = ty.block_len() * 3;
        let blocks = rows * cols / ty.block_len();
        let mut data = Vec::with_capacity(blocks * bb);
        for _ in 0..blocks {
            let b = rng.random_range(0..n_fixture);
            data.extend_from_slice(&raw[b * bb..(b + 1) * bb]);
        }
        out.push(QMatrix::ggml(name, ty, rows, cols, Bytes::owned(data)).unwrap());
    }
    let cols = 75; // ragged: not a multiple of 8, 16 or 32
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16b: Vec<u8> = vals
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let bf16b: Vec<u8> = vals
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    out.push(QMatrix::ggml("f32", GgmlType::F32, rows, cols, Bytes::owned(f32b)).unwrap());
    out.push(QMatrix::ggml("f16", GgmlType::F16, rows, cols, Bytes::owned(f16b)).unwrap());
    out.push(QMatrix::ggml("bf16", GgmlType::BF16, rows, cols, Bytes::owned(bf16b)).unwrap());
    for (bits, group, st) in [
        (4, 32, MlxScaleType::F16),
        (4, 64, MlxScaleType::BF16),
        (8, 128, MlxScaleType::F32),
        (8, 32, MlxScaleType::F16),
    ] {
        let name = format!("mlx-q{bits}-g{group}");
        out.push(random_mlx_matrix(
            &name,
            (bits, group, st),
            rows,
            group * 3,
            rng.random(),
        ));
    }
    out
}

/// `m · x` on `be`, the matrix loaded as a model's would be (the 8-bit path repacks the GGML block formats).
fn run(be: &CpuBackend, m: &QMatrix, x: &[f32], rows: usize) -> Vec<f32> {
    let mut out = be.buffer(rows * m.rows);
    let w = be.load_matrix(m.clone()).unwrap();
    be.matmul(&w, &x.to_vec(), rows, &mut out);
    out
}

#[test]
fn matmul_matches_an_f64_reference_for_every_format() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let be = CpuBackend::with_activations(2, Activations::F32).unwrap();
    for m in random_matrices(&mut rng) {
        let mut w = vec![0f32; m.rows * m.cols];
        for r in 0..m.rows {
            m.dequantize_row(r, &mut w[r * m.cols..(r + 1) * m.cols]);
        }
        for rows in [1, 3, 16, 17] {
            let x: Vec<f32> = (0..rows * m.cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let got = run(&be, &m, &x, rows);
            for r in 0..rows {
                for n in 0..m.rows {
                    let (mut dot, mut mag) = (0f64, 0f64);
                    for k in 0..m.cols {
                        let p = w[n * m.cols + k] as f64 * x[r * m.cols + k] as f64;
                        dot += p;
                        mag += p.abs();
                    }
                    let g = got[r * m.rows + n] as f64;
                    // f32 accumulation over K terms: error ≤ ~K·ε·Σ|terms|; 1e-5 relative to Σ|terms| covers K ≤ 768.
                    assert!(
                        (g - dot).abs() <= 1e-5 * mag.max(1e-3),
                        "{}: rows {rows} r {r} n {n}: {g} vs {dot}",
                        m.name
                    );
                }
            }
        }
    }
}

/// With 8-bit activations each activation moves by at most half a quantization step (its block's max|x|/254),
/// so |error| ≤ Σ_blocks (max|x_b| / 254) · Σ_{i∈b} |w_i|, plus f32 rounding. The test checks that rigorous bound.
#[test]
fn matmul_with_8_bit_activations_stays_within_the_quantization_bound() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let be = CpuBackend::with_activations(2, Activations::Q8).unwrap();
    for m in random_matrices(&mut rng) {
        let mut w = vec![0f32; m.rows * m.cols];
        for r in 0..m.rows {
            m.dequantize_row(r, &mut w[r * m.cols..(r + 1) * m.cols]);
        }
        let rows = 5;
        let x: Vec<f32> = (0..rows * m.cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let got = run(&be, &m, &x, rows);
        for r in 0..rows {
            for n in 0..m.rows {
                let (mut dot, mut mag, mut bound) = (0f64, 0f64, 0f64);
                for b0 in (0..m.cols).step_by(32) {
                    let b1 = (b0 + 32).min(m.cols);
                    let amax = x[r * m.cols + b0..r * m.cols + b1]
                        .iter()
                        .fold(0f32, |a, v| a.max(v.abs())) as f64;
                    for k in b0..b1 {
                        let (wk, xk) = (w[n * m.cols + k] as f64, x[r * m.cols + k] as f64);
                        dot += wk * xk;
                        mag += (wk * xk).abs();
                        bound += wk.abs() * amax / 254.0;
                    }
                }
                let g = got[r * m.rows + n] as f64;
                assert!(
                    (g - dot).abs() <= bound * 1.001 + 1e-5 * mag.max(1e-3),
                    "{}: r {r} n {n}: {g} vs {dot} (bound {bound})",
                    m.name
                );
            }
        }
    }
}

#[test]
fn matmul_rows_are_bitwise_independent_of_batch_width_and_threads() {
    for acts in [Activations::F32, Activations::Q8] {
        rows_are_independent(acts);
    }
}

fn rows_are_independent(acts: Activations) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let be2 = CpuBackend::with_activations(2, acts).unwrap();
    let be1 = CpuBackend::with_activations(1, acts).unwrap();
    for m in random_matrices(&mut rng) {
        let x: Vec<f32> = (0..16 * m.cols)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let single: Vec<Vec<f32>> = (0..16)
            .map(|r| run(&be2, &m, &x[r * m.cols..(r + 1) * m.cols], 1))
            .collect();
        for w in 1..=16 {
            let batch = run(&be2, &m, &x[..w * m.cols], w);
            for (r, want) in single.iter().take(w).enumerate() {
                let got = &batch[r * m.rows..(r + 1) * m.rows];
                assert!(
                    got.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} ({acts:?}): W={w} row {r} differs from the 1-row product",
                    m.name
                );
            }
        }
        let one_thread = run(&be1, &m, &x, 16);
        let two_threads = run(&be2, &m, &x, 16);
        assert!(
            one_thread
                .iter()
                .zip(&two_threads)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: threads",
            m.name
        );
    }
}

/// The fused projections (one pass over several matrices of one input, and the SwiGLU pair) give every output
/// bitwise what its own matmul gives, with either activation precision.
#[test]
fn fused_projections_give_each_output_what_its_own_matmul_gives() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mats: Vec<QMatrix> = random_matrices(&mut rng).into_iter().take(3).collect();
    assert!(mats
        .iter()
        .all(|m| m.cols == mats[0].cols && m.rows == mats[0].rows));
    let rows = 11; // a full group of 8 rows and a partial one
    let x: Vec<f32> = (0..rows * mats[0].cols)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
    for acts in [Activations::F32, Activations::Q8] {
        let be = CpuBackend::with_activations(2, acts).unwrap();
        let alone: Vec<Vec<f32>> = mats.iter().map(|m| run(&be, m, &x, rows)).collect();
        let loaded: Vec<_> = mats
            .iter()
            .map(|m| be.load_matrix(m.clone()).unwrap())
            .collect();
        let mut outs: Vec<Vec<f32>> = (0..3).map(|_| be.buffer(rows * mats[0].rows)).collect();
        let [o0, o1, o2] = &mut outs[..] else {
            unreachable!()
        };
        be.matmuls(
            &x,
            None,
            rows,
            &mut [(&loaded[0], o0), (&loaded[1], o1), (&loaded[2], o2)],
        );
        for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
            assert!(same(got, want), "{acts:?}: output {i} of the fused pass");
        }
        let mut act = be.buffer(rows * mats[0].rows);
        for (glu, f) in [
            (
                Glu::Silu,
                verity::backend::cpu::silu_times as fn(f32, f32) -> f32,
            ),
            (Glu::GeluTanh, verity::backend::cpu::gelu_tanh_times),
        ] {
            be.glu_matmul(&x, None, rows, &loaded[0], &loaded[1], glu, &mut act);
            let want: Vec<f32> = alone[0]
                .iter()
                .zip(&alone[1])
                .map(|(&g, &u)| f(g, u))
                .collect();
            assert!(same(&act, &want), "{acts:?}: {glu:?} pair");
        }
    }
}
