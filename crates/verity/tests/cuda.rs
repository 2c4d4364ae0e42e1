//! The CUDA backend (feature `cuda`; these tests need a GPU and are built and run on one, see
//! `docs/cuda.md`): the projection kernels against the CPU backend's (the 8-bit ones bitwise), logits
//! against the CPU backend on the fixture bundles, row-exact verify rows, and greedy speculative output equal to
//! AR for every route on the GPU.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::adversary::{scripted, Adversary};
use common::*;
use verity::backend::cpu::CpuBackend;
use verity::backend::cuda::{CudaBackend, CudaOptions};
use verity::backend::{AttnMask, Backend, Glu};
use verity::bundle::Bundle;
use verity::cache::{CacheShape, KvCache};
use verity::chat::Message;
use verity::engine::{Engine, GenerateRequest};
use verity::model::{Batch, BlockDrafter, HeadInput, LogitRows, Model, MtpHead};
use verity::quant::{GgmlType, MlxScaleType, QMatrix};
use verity::sample::argmax;
use verity::speculative::SpecMode;
use verity::storage::Bytes;

fn gpu() -> Arc<CudaBackend> {
    Arc::new(CudaBackend::new(0).expect("a CUDA device"))
}

/// The fixture bundles whose weight formats the CUDA backend runs.
type GpuBuffer = <CudaBackend as Backend>::Buffer;

const CUDA_BUNDLES: &[&str] = &[
    "llama-f32",
    "llama-bf16",
    "llama-f16-tied",
    "qwen2-f32",
    "qwen3-f32",
    "qwen3-bf16",
    "mlx-llama-q4-g32",
    "mlx-llama-q4-g64",
    "mlx-llama-q8-g128",
    "gemma3-f16",
    "gemma3-gguf",
    "qwen3-moe-f16",
    "qwen3-moe-gguf",
    "qwen3-next-f16",
    "qwen3-next-gguf",
    "llama-rope-llama3",
    "llama-rope-llama3-gguf",
    "gemma3-rope-linear",
    "gemma3-image-text",
    "mistral-window",
    "qwen2-window",
];

/// A `rows` × `cols` matrix of `ty` made of the fixture's real blocks (valid scales) drawn at random.
fn fixture_matrix(ty: GgmlType, name: &str, rows: usize, cols: usize, seed: &mut u64) -> QMatrix {
    let raw = std::fs::read(fixtures().join("quant").join(format!("{name}.bin"))).unwrap();
    let bb = ty.block_bytes();
    let n_fixture = raw.len() / bb;
    let mut data = Vec::with_capacity(rows * cols / ty.block_len() * bb);
    for _ in 0..rows * cols / ty.block_len() {
        *seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let b = (*seed >> 33) as usize % n_fixture;
        data.extend_from_slice(&raw[b * bb..(b + 1) * bb]);
    }
    QMatrix::ggml(name, ty, rows, cols, Bytes::owned(data)).unwrap()
}

fn gpu_matmul(be: &CudaBackend, m: &QMatrix, x: &[f32], rows: usize) -> Vec<f32> {
    let w = be.load_matrix(m.clone()).unwrap();
    let xs = be.upload(x);
    let mut out = be.buffer(rows * m.rows);
    be.matmul(&w, &xs, rows, &mut out);
    be.download(&out, rows * m.rows)
}

/// The formats the int8 kernels run from tensor-core tiles, with their fixture names.
const TILED_FORMATS: &[(GgmlType, &str)] = &[
    (GgmlType::Q4_0, "Q4_0"),
    (GgmlType::Q4_1, "Q4_1"),
    (GgmlType::Q8_0, "Q8_0"),
    (GgmlType::Q5_0, "Q5_0"),
    (GgmlType::Q5_1, "Q5_1"),
    (GgmlType::Q4K, "Q4_K"),
    (GgmlType::Q5K, "Q5_K"),
    (GgmlType::Q6K, "Q6_K"),
    (GgmlType::Q3K, "Q3_K"),
];

/// The tensor-core 8-bit projections quantize x and chain each (column, row)'s blocks exactly as the CPU
/// backend's 8-bit kernels do, so every output is bitwise the CPU's: every tiled format (the legacy ones, the
/// 5-bit ones, the K-quants with Q3_K as Q6_K); a ragged shape (a partial tile), one whose blocks take several
/// exchange chunks, one wide enough for the warp-per-tile schedule, and an 8B model's down projection (rows of
/// 14,336 values, staged in windows); 1 to 16 rows (the narrow and wide schedules), 20 to 70 rows (the tall
/// schedule's launches of up to 64 rows, a partial last n-tile, a launch of 6 rows after one of 64), and those
/// rows again in the GEMM schedule (forced at any grid); the gated product of gate and up (SwiGLU) at every
/// width, the tall and GEMM schedules walking both side by side.
#[test]
fn cuda_int8_projections_are_bitwise_the_cpu_8_bit_kernels() {
    let (gpu, cpu) = (gpu(), backend());
    let gemm = Arc::new(
        CudaBackend::with_options(
            0,
            CudaOptions {
                gemm_ctas: Some(1),
                ..CudaOptions::from_env()
            },
        )
        .expect("a CUDA device"),
    );
    let mut seed = 7u64;
    for &(ty, name) in TILED_FORMATS {
        for (n, k) in [(37, 256), (300, 2560), (16_400, 256), (40, 14_336)] {
            let m = fixture_matrix(ty, name, n, k, &mut seed);
            let up = fixture_matrix(ty, name, n, k, &mut seed);
            let cw = cpu.load_matrix(m.clone()).unwrap();
            let one_row = (
                gpu.load_matrix(m.clone()).unwrap(),
                gpu.load_matrix(up.clone()).unwrap(),
            );
            let gemm_mats = (
                gemm.load_matrix(m.clone()).unwrap(),
                gemm.load_matrix(up).unwrap(),
            );
            for rows in [1, 2, 5, 8, 9, 16, 20, 37, 64, 70] {
                let x = random_f32(rows * k, seed ^ rows as u64, 1.0);
                let mut want = cpu.buffer(rows * n);
                cpu.matmul(&cw, &x, rows, &mut want);
                let schedules = if rows > 16 {
                    &[false, true][..]
                } else {
                    &[false][..]
                };
                for &forced in schedules {
                    let (be, (gw, gu), label) = if forced {
                        (&gemm, &gemm_mats, "GEMM")
                    } else {
                        (&gpu, &one_row, "default")
                    };
                    let got = gpu_matmul(be, &m, &x, rows);
                    let bad = got
                        .iter()
                        .zip(&want)
                        .position(|(a, b)| a.to_bits() != b.to_bits());
                    assert!(
                        bad.is_none(),
                        "{name} {n}×{k}, {rows} rows ({label}): output {} is {} on the GPU, {} on the CPU",
                        bad.unwrap(),
                        got[bad.unwrap()],
                        want[bad.unwrap()]
                    );
                    // The gated product: each row bitwise its one-row launch's (default schedule).
                    let gx = be.upload(&x);
                    let mut out = be.buffer(rows * n);
                    be.glu_matmul(&gx, None, rows, gw, gu, Glu::Silu, &mut out);
                    let got = be.download(&out, rows * n);
                    for r in 0..rows {
                        let (ow, ou) = &one_row;
                        let row = gpu.upload(&x[r * k..(r + 1) * k]);
                        let mut one = gpu.buffer(n);
                        gpu.glu_matmul(&row, None, 1, ow, ou, Glu::Silu, &mut one);
                        let one = gpu.download(&one, n);
                        let bad = got[r * n..(r + 1) * n]
                            .iter()
                            .zip(&one)
                            .position(|(a, b)| a.to_bits() != b.to_bits());
                        assert!(
                            bad.is_none(),
                            "{name} {n}×{k}, {rows} rows ({label}): gated output of row {r} differs from its one-row launch at {bad:?}"
                        );
                    }
                }
            }
        }
    }
}

/// A projection launch with the RMS norm fused (Q/K/V and gate/up, the output layer) computes bitwise what the
/// norm kernel followed by the plain projection computes: the fused staging sums each row's squares in the norm
/// kernel's order, whether it reads x once (its items fit one pass) or twice; every schedule, 1 to 64 rows.
#[test]
fn cuda_fused_norm_projections_are_bitwise_the_norm_then_the_projection() {
    let be = gpu();
    let mut seed = 11u64;
    let eps = 1e-5f32;
    for (ty, name) in [(GgmlType::Q4_1, "Q4_1"), (GgmlType::Q8_0, "Q8_0")] {
        for (n, k) in [(960, 576), (1536, 640), (300, 2560), (16_400, 576)] {
            let m = fixture_matrix(ty, name, n, k, &mut seed);
            let up = fixture_matrix(ty, name, n, k, &mut seed);
            let (w, u) = (be.load_matrix(m).unwrap(), be.load_matrix(up).unwrap());
            let nw = be.upload(&random_f32(k, seed, 1.0));
            for rows in [1, 2, 3, 5, 8, 12, 16, 24, 64] {
                let x = be.upload(&random_f32(rows * k, seed ^ rows as u64, 2.0));
                let mut xn = be.buffer(rows * k);
                be.rms_norm(&x, &nw, rows, k, eps, &mut xn);
                let (mut want, mut got) = (be.buffer(rows * n), be.buffer(rows * n));
                be.matmul(&w, &xn, rows, &mut want);
                be.matmuls(&x, Some((&nw, eps)), rows, &mut [(&w, &mut got)]);
                let first_difference = |want: &GpuBuffer, got: &GpuBuffer| {
                    let (want, got) = (be.download(want, rows * n), be.download(got, rows * n));
                    got.iter()
                        .zip(&want)
                        .position(|(a, b)| a.to_bits() != b.to_bits())
                };
                let bad = first_difference(&want, &got);
                assert!(
                    bad.is_none(),
                    "{name} {n}×{k}, {rows} rows: projection output {bad:?} differs"
                );
                for act in [Glu::Silu, Glu::GeluTanh] {
                    be.glu_matmul(&xn, None, rows, &w, &u, act, &mut want);
                    be.glu_matmul(&x, Some((&nw, eps)), rows, &w, &u, act, &mut got);
                    let bad = first_difference(&want, &got);
                    assert!(
                        bad.is_none(),
                        "{name} {n}×{k}, {rows} rows: {act:?} output {bad:?} differs"
                    );
                }
            }
        }
    }
}

/// `m` on the GPU's f32-activation kernel against the CPU's f32 path, 1, 3 and 16 rows: within float rounding
/// of the sums (the two add in different orders).
fn assert_projection_matches_the_cpu(
    gpu: &CudaBackend,
    cpu: &CpuBackend,
    m: &QMatrix,
    name: &str,
    seed: u64,
) {
    let (n, k) = (m.rows, m.cols);
    let cw = cpu.load_matrix(m.clone()).unwrap();
    for rows in [1, 3, 16] {
        let x = random_f32(rows * k, seed ^ rows as u64, 1.0);
        let mut want = cpu.buffer(rows * n);
        cpu.matmul(&cw, &x, rows, &mut want);
        let got = gpu_matmul(gpu, m, &x, rows);
        assert_within_float_rounding(&got, &want, k, &format!("{name}, {rows} rows"));
    }
}

/// `got` against `want` (projections over `k` inputs that add in different orders): within float rounding of
/// the sums, relative to the largest output.
fn assert_within_float_rounding(got: &[f32], want: &[f32], k: usize, what: &str) {
    let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(worst <= 1e-5 * scale * k as f32, "{what}: max |Δ| {worst}");
}

/// A backend on GPU 0 whose projections all run the f32-activation kernel (`VERITY_CUDA_INT8=0`).
fn float_gpu() -> Arc<CudaBackend> {
    let opts = CudaOptions {
        int8: false,
        ..CudaOptions::from_env()
    };
    Arc::new(CudaBackend::with_options(0, opts).unwrap())
}

/// The K-quants on the f32-activation kernel (decoded from their GGML blocks), as with `VERITY_CUDA_INT8=0`.
#[test]
fn cuda_k_quant_projections_match_the_cpu_backend() {
    let (gpu, cpu) = (float_gpu(), f32_backend());
    let mut seed = 11u64;
    for (ty, name) in [
        (GgmlType::Q4K, "Q4_K"),
        (GgmlType::Q5K, "Q5_K"),
        (GgmlType::Q6K, "Q6_K"),
    ] {
        let m = fixture_matrix(ty, name, 40, 512, &mut seed);
        assert_projection_matches_the_cpu(&gpu, &cpu, &m, name, seed);
    }
}

/// The 5-bit legacy blocks (Q5_0, Q5_1), the IQ4 grid formats (IQ4_NL, IQ4_XS) and the 2- and 3-bit K-quants
/// (Q2_K, Q3_K) decode on the GPU as on the CPU on the f32-activation kernel (the IQ4 formats and Q2_K always
/// run it; the others with `VERITY_CUDA_INT8=0`).
#[test]
fn cuda_float_path_formats_match_the_cpu_backend() {
    let (gpu, cpu) = (float_gpu(), f32_backend());
    let mut seed = 13u64;
    for (ty, name) in [
        (GgmlType::Q5_0, "Q5_0"),
        (GgmlType::Q5_1, "Q5_1"),
        (GgmlType::IQ4NL, "IQ4_NL"),
        (GgmlType::IQ4XS, "IQ4_XS"),
        (GgmlType::Q2K, "Q2_K"),
        (GgmlType::Q3K, "Q3_K"),
    ] {
        for (n, k) in [(40, 512), (37, 256)] {
            let m = fixture_matrix(ty, name, n, k, &mut seed);
            assert_projection_matches_the_cpu(&gpu, &cpu, &m, name, seed);
        }
    }
}

/// A tiled matrix launched beside an untiled one (one input, several projections) runs the f32-activation
/// kernel, which decodes the tiles: within float rounding of the CPU's f32 path, for every tiled format.
#[test]
fn cuda_tiled_matrices_beside_untiled_ones_decode_their_tiles() {
    let (gpu, cpu) = (gpu(), f32_backend());
    let mut seed = 17u64;
    let k = 512;
    let bytes: Vec<u8> = random_f32(24 * k, 3, 1.0)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let float = QMatrix::ggml("f", GgmlType::F32, 24, k, Bytes::owned(bytes)).unwrap();
    let f = gpu.load_matrix(float).unwrap();
    for &(ty, name) in TILED_FORMATS {
        let m = fixture_matrix(ty, name, 40, k, &mut seed);
        let (cw, w) = (
            cpu.load_matrix(m.clone()).unwrap(),
            gpu.load_matrix(m).unwrap(),
        );
        for rows in [1, 3, 16] {
            let x = random_f32(rows * k, seed ^ rows as u64, 1.0);
            let mut want = cpu.buffer(rows * 40);
            cpu.matmul(&cw, &x, rows, &mut want);
            let xs = gpu.upload(&x);
            let (mut got, mut other) = (gpu.buffer(rows * 40), gpu.buffer(rows * 24));
            gpu.matmuls(&xs, None, rows, &mut [(&w, &mut got), (&f, &mut other)]);
            let got = gpu.download(&got, rows * 40);
            assert_within_float_rounding(&got, &want, k, &format!("{name}, {rows} rows"));
        }
    }
}

/// MLX affine matrices (4 and 8 bits, groups of 32 to 128, every scale dtype), re-laid into blocks at upload,
/// decode bitwise as the CPU does and run the f32-activation kernel.
#[test]
fn cuda_mlx_affine_projections_match_the_cpu_backend() {
    let (gpu, cpu) = (gpu(), f32_backend());
    for (i, (bits, group, st)) in [
        (4, 32, MlxScaleType::F16),
        (4, 64, MlxScaleType::BF16),
        (8, 128, MlxScaleType::F32),
        (8, 32, MlxScaleType::F16),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("q{bits}-g{group}");
        let m = random_mlx_matrix(&name, (bits, group, st), 40, group * 4, 0x9e37 + i as u64);
        assert_projection_matches_the_cpu(&gpu, &cpu, &m, &name, u64::from(bits));
    }
}

#[test]
fn cuda_logits_match_the_cpu_backend_on_the_fixture_bundles() {
    let be = gpu();
    for name in CUDA_BUNDLES {
        let dir = hf_bundle(name);
        let bundle = Bundle::open(&dir).unwrap();
        let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
        let mut cpu = Model::load(&bundle, f32_backend()).unwrap();
        let mut gpu_model = Model::load(&bundle, be.clone()).unwrap();
        let batch = Batch::causal(&tokens, 0);
        let mut cc = cpu.new_cache(64);
        let mut gc = gpu_model.new_cache(64);
        let a = cpu.forward(&mut cc, &batch, LogitRows::All, &[]).unwrap();
        let b = gpu_model
            .forward(&mut gc, &batch, LogitRows::All, &[])
            .unwrap();
        let scale = a.logits.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        let worst = a
            .logits
            .iter()
            .zip(&b.logits)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        eprintln!("{name}: max |cpu - cuda| = {worst:.2e} (logit scale {scale:.1})");
        assert!(worst <= 2e-3 * scale, "{name}: max |Δ| {worst}");
    }
}

/// Sequences in one batched forward on the GPU (a prefill, a verify, a draft tree, a chunk with the last row's
/// logits, a step without any; with the target states an MTP head or a block drafter asks for) each get bitwise
/// their own forward's logits, argmaxes, states and cache: what keeps every request of a batching server on the
/// GPU its solo answer.
/// Both with the decoding sequences' RoPE and attention in launches they share and with a launch of each per
/// sequence.
#[test]
fn cuda_batched_forwards_give_every_sequence_its_own_forwards_bits() {
    for shared in [true, false] {
        let opts = CudaOptions {
            seq_launches: shared,
            ..CudaOptions::from_env()
        };
        let be = Arc::new(CudaBackend::with_options(0, opts).unwrap());
        for name in CUDA_BUNDLES {
            let dir = hf_bundle(name);
            let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
            let mut model = Model::load(&Bundle::open(&dir).unwrap(), be.clone()).unwrap();
            let label = format!("{name} (shared launches: {shared})");
            common::batched::assert_batched_equals_alone(&mut model, &tokens, &label);
        }
    }
}

/// Several requests' greedy MTP drafts in one batched call on the GPU (the catch-ups in one head forward, then
/// each recursive step of the requests still drafting in one) give each request bitwise the tokens and head
/// cache of its own chained draft: a random head (its weights re-encoded as Q8_0, the integer kernels) on the
/// tiny Llama bundle, with and without a draft vocabulary.
#[test]
fn cuda_batched_head_drafts_give_every_request_its_own_drafts_bits() {
    let ids: Vec<u32> = (0..320).step_by(3).collect();
    let tokens = [5u32, 17, 42, 99, 7, 250, 31, 8, 64, 3, 128, 77, 19, 200];
    for (tag, vocab) in [
        ("cuda-batched-head", None),
        ("cuda-batched-head-vocab", Some(&ids[..])),
    ] {
        let d = bundle_with_head(
            "llama-f32",
            tag,
            &random_mtp_head(64, 4, 2, 16, 128, 9, vocab),
        );
        let bundle = Bundle::open(&d).unwrap();
        let mut model = Model::load(&bundle, gpu()).unwrap();
        let mut head = MtpHead::load(&bundle, &model).unwrap();
        common::batched::assert_batched_head_drafts_equal_alone(
            &mut model, &mut head, &tokens, tag,
        );
    }
}

/// Several requests' block drafts in one batched call on the GPU give each request bitwise the logits and
/// context cache of its own draft: a random drafter on the tiny bundle, with and without a draft vocabulary.
#[test]
fn cuda_batched_block_drafts_give_every_request_its_own_drafts_bits() {
    let tokens: Vec<u32> = (0..80u32).map(|i| (i * 37 + 5) % 320).collect();
    for d in [
        tiny_with_drafter("cuda-drafter-batched", 3),
        tiny_with_vocab_drafter("cuda-drafter-batched-vocab", 4),
    ] {
        let bundle = Bundle::open(&d).unwrap();
        let mut model = Model::load(&bundle, gpu()).unwrap();
        let mut drafter = BlockDrafter::load(&bundle, &model).unwrap();
        let label = d.display().to_string();
        common::batched::assert_batched_block_drafts_equal_alone(
            &mut model,
            &mut drafter,
            &tokens,
            &label,
        );
    }
}

/// SmolLM2 (Q4_1, the integer kernels with RoPE fused into the Q/K/V launch) on the GPU against the CPU backend
/// (8-bit activations too): the projections agree bitwise given equal inputs, so what differs is the float
/// arithmetic of norms, attention and activations, moved through 8-bit rounding — close logits and the same
/// argmax on nearly every position. A wrong rotation or cache slot would scramble both.
#[test]
fn cuda_smollm2_logits_match_the_cpu_backend() {
    let bundle = Bundle::open(&smollm2()).unwrap();
    let mut cpu = Model::load(&bundle, backend()).unwrap();
    let mut gpu_model = Model::load(&bundle, gpu()).unwrap();
    let e = Engine::load(&smollm2(), backend(), &SpecMode::Off).unwrap();
    let tokens = e
        .chat_prompt(&[Message::new(
            "user",
            "Name three rivers in Europe and say where each one ends.",
        )])
        .unwrap();
    let vocab = cpu.hp.vocab;
    let (mut cc, mut gc) = (cpu.new_cache(256), gpu_model.new_cache(256));
    // A prefill in launches of 16 rows, then one-row steps (the decode path).
    let (head, tail) = tokens.split_at(tokens.len() - 4);
    let mut a = cpu
        .forward(&mut cc, &Batch::causal(head, 0), LogitRows::All, &[])
        .unwrap()
        .logits;
    let mut b = gpu_model
        .forward(&mut gc, &Batch::causal(head, 0), LogitRows::All, &[])
        .unwrap()
        .logits;
    for (i, &t) in tail.iter().enumerate() {
        let at = head.len() + i;
        a.extend(
            cpu.forward(&mut cc, &Batch::causal(&[t], at), LogitRows::All, &[])
                .unwrap()
                .logits,
        );
        b.extend(
            gpu_model
                .forward(&mut gc, &Batch::causal(&[t], at), LogitRows::All, &[])
                .unwrap()
                .logits,
        );
    }
    let argmax = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j])).unwrap();
    let (mut worst, mut scale, mut agree) = (0f32, 1f32, 0);
    let rows = a.len() / vocab;
    for r in 0..rows {
        let (x, y) = (
            &a[r * vocab..(r + 1) * vocab],
            &b[r * vocab..(r + 1) * vocab],
        );
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
            scale = scale.max(p.abs());
        }
        agree += usize::from(argmax(x) == argmax(y));
    }
    eprintln!("smollm2: {rows} positions, max |cpu - cuda| {worst:.3} (logit scale {scale:.1}), argmax agrees {agree}/{rows}");
    assert!(
        worst <= 0.1 * scale,
        "max |Δ| {worst} against a logit scale of {scale}"
    );
    assert!(
        agree * 10 >= rows * 8,
        "argmax agrees on {agree} of {rows} positions"
    );
}

/// The device's argmax picks what the host's `argmax` picks: the lowest index among equal largest values, NaN
/// never (and index 0 when the first value is NaN), over a vocabulary's width and over rows of few distinct
/// values.
#[test]
fn cuda_argmax_picks_what_the_host_argmax_picks() {
    let be = gpu();
    let n = 49_152;
    let mut next = splitmix(7);
    let mut rows: Vec<Vec<f32>> = (0..6)
        .map(|_| (0..n).map(|_| (next() % 9) as f32 - 4.0).collect())
        .collect();
    rows[1][0] = f32::NAN; // the host's scan never moves off a NaN first value
    rows[2][17] = f32::NAN;
    rows[2][40_000] = 9.0;
    rows[3].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    rows[4].iter_mut().for_each(|v| *v = -0.0);
    rows[4][3] = 0.0; // equal to -0.0: index 0 stays
    rows[5][n - 1] = 100.0;
    let x: Vec<f32> = rows.concat();
    let mut out = be.buffer(rows.len());
    be.argmax(&be.upload(&x), rows.len(), n, &mut out);
    let got: Vec<u32> = be
        .download(&out, rows.len())
        .iter()
        .map(|&t| t as u32)
        .collect();
    let want: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
    assert_eq!(got, want);
    assert_eq!(&want[1..], &[0, 40_000, 0, 0, n as u32 - 1]);
    // A width that is not a multiple of four (a draft vocabulary): the kernel's one-value-at-a-time path.
    let odd: Vec<f32> = (0..2 * 1001).map(|_| (next() % 5) as f32).collect();
    let mut out = be.buffer(2);
    be.argmax(&be.upload(&odd), 2, 1001, &mut out);
    let got: Vec<u32> = be.download(&out, 2).iter().map(|&t| t as u32).collect();
    let want: Vec<u32> = odd.chunks(1001).map(argmax).collect();
    assert_eq!(got, want);
}

/// After `ctx`, one forward of all of `rows` and then each row stepped alone: every row's logits bitwise the same.
/// Returns the cache (holding `ctx` again) and the forward's logits.
fn assert_rows_are_one_row_steps(
    m: &mut Model<CudaBackend>,
    ctx: &[u32],
    rows: &[u32],
    what: &str,
) -> (KvCache<CudaBackend>, Vec<f32>) {
    let mut cache = m.new_cache(ctx.len() + rows.len() + 64);
    m.forward(&mut cache, &Batch::causal(ctx, 0), LogitRows::None, &[])
        .unwrap_or_else(|e| panic!("{what}, the context: {e}"));
    let (base, vocab) = (cache.len(), m.hp.vocab);
    let wide = m
        .forward(&mut cache, &Batch::causal(rows, base), LogitRows::All, &[])
        .unwrap_or_else(|e| panic!("{what}, the rows: {e}"))
        .logits;
    cache.truncate(base);
    for (i, &t) in rows.iter().enumerate() {
        let one = m
            .forward(
                &mut cache,
                &Batch::causal(&[t], base + i),
                LogitRows::All,
                &[],
            )
            .unwrap_or_else(|e| panic!("{what}, the one-row step of row {i}: {e}"))
            .logits;
        let row = &wide[i * vocab..(i + 1) * vocab];
        assert!(
            row.iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}, row {i}: not bitwise equal to the one-row step"
        );
    }
    cache.truncate(base);
    (cache, wide)
}

/// A draft tree's verify rows on the GPU are bitwise the one-row steps along each row's path (its ancestors,
/// then itself, committed at consecutive slots as AR commits them): siblings at every depth, a deep line beside
/// short branches, at contexts whose committed part ends inside an attention chunk and at its edge; with the
/// attention's block per chunk and its warp per chunk.
#[test]
fn cuda_tree_verify_rows_are_bitwise_the_one_row_steps_along_their_paths() {
    let path = smollm2();
    for warp_rows in [None, Some(1)] {
        let opts = CudaOptions {
            att_warp_rows: warp_rows,
            ..CudaOptions::from_env()
        };
        let be = Arc::new(CudaBackend::with_options(0, opts).unwrap());
        let mut m = Model::load(&Bundle::open(&path).unwrap(), be).unwrap();
        assert_tree_rows_are_path_steps(&mut m, &format!("warp rows {warp_rows:?}"));
    }
}

fn assert_tree_rows_are_path_steps(m: &mut Model<CudaBackend>, what: &str) {
    use verity::speculative::Draft;
    let path = smollm2();
    let e = Engine::load(&path, f32_backend(), &SpecMode::Off).unwrap();
    let text = e
        .chat_prompt(&[Message::new(
            "user",
            "Explain how a hash map works, with an example in Rust, and say when to avoid one. Then compare it \
             with a binary search tree: lookups, ordering, memory, and what each costs when the data grows.",
        )])
        .unwrap();
    let vocab = m.hp.vocab;
    // Node i's parent row (0: the pending token): two siblings under the root, a line of six under the first,
    // branches off it, and a second line under the other sibling.
    let parents = vec![0, 0, 1, 3, 4, 5, 6, 7, 3, 5, 2, 11, 12];
    let tokens: Vec<u32> = (0..parents.len()).map(|i| text[20 + i]).collect();
    let draft = Draft::tree(tokens, parents.clone()).unwrap();
    let mut failures = Vec::new();
    for ctx_len in [40, 60, 63, 64, 70] {
        let ctx = &text[..ctx_len];
        let mut cache = m.new_cache(ctx_len + 32);
        m.forward(&mut cache, &Batch::causal(ctx, 0), LogitRows::None, &[])
            .unwrap();
        let base = cache.len();
        let (rows, positions, mask) = draft.rows(text[ctx_len], base);
        let batch = Batch {
            tokens: rows.clone(),
            positions,
            mask,
            media: Vec::new(),
            spatial: Vec::new(),
        };
        let wide = m
            .forward(&mut cache, &batch, LogitRows::All, &[])
            .unwrap()
            .logits;
        for r in 0..rows.len() {
            let mut line = vec![r];
            while *line.last().unwrap() > 0 {
                line.push(parents[line.last().unwrap() - 1]);
            }
            line.reverse();
            cache.truncate(base);
            let mut one = Vec::new();
            for (d, &row) in line.iter().enumerate() {
                one = m
                    .forward(
                        &mut cache,
                        &Batch::causal(&[rows[row]], base + d),
                        LogitRows::All,
                        &[],
                    )
                    .unwrap()
                    .logits;
            }
            let got = &wide[r * vocab..(r + 1) * vocab];
            if !got
                .iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits())
            {
                failures.push(format!("context {ctx_len}, row {r} (path {line:?})"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: tree rows not bitwise their paths' one-row steps: {failures:?}"
    );
}

/// On every fixture bundle the GPU runs (float, MLX and GGUF weights; grouped-query, local and mixture layers),
/// each row of a W-row forward is bitwise the one-row step at its position: W = 3, 4, 7 and 16 (one launch per
/// projection and attention), 24 (two attention launches; past 16 rows the projections of tiled weights take the
/// tall schedule); and over contexts of several attention chunks with prefill-sized row counts, with attention
/// of many rows in a block per chunk (the rule at these widths) and in a warp per chunk (forced from 2 rows, and
/// with it the GEMM schedule for every prefill-sized projection launch), against one-row steps in a block per
/// chunk.
#[test]
fn cuda_forward_rows_are_bitwise_one_row_steps_on_the_fixture_bundles() {
    let block = gpu();
    let warp = Arc::new(
        CudaBackend::with_options(
            0,
            CudaOptions {
                att_warp_rows: Some(2),
                gemm_ctas: Some(1),
                ..CudaOptions::from_env()
            },
        )
        .expect("a CUDA device"),
    );
    for name in CUDA_BUNDLES {
        let dir = hf_bundle(name);
        let bundle = Bundle::open(&dir).unwrap();
        let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
        let long: Vec<u32> = tokens.iter().cycle().take(192).copied().collect();
        for (be, kernel) in [(&block, "block"), (&warp, "warp")] {
            let mut m = Model::load(&bundle, be.clone()).unwrap();
            for w in [3usize, 4, 7, 16, 24] {
                let (ctx, rows) = (&tokens[..40], &tokens[40..40 + w]);
                assert_rows_are_one_row_steps(
                    &mut m,
                    ctx,
                    rows,
                    &format!("{name}, {kernel}, W={w}"),
                );
            }
            for (c, w) in [(100usize, 2usize), (100, 70), (129, 63)] {
                let (ctx, rows) = (&long[..c], &long[c..c + w]);
                let what = format!("{name}, {kernel}, context {c}, W={w}");
                assert_rows_are_one_row_steps(&mut m, ctx, rows, &what);
            }
        }
    }
}

/// Every row of a W-row verify is bitwise the logits of the one-row step at that position (W = 2…16), and the
/// W-row projection kernel was admitted for every weight shape of the model (no row-by-row fallback).
#[test]
fn cuda_verify_rows_are_bitwise_the_one_row_step() {
    let be = gpu();
    let path = smollm2();
    let bundle = Bundle::open(&path).unwrap();
    let mut m = Model::load(&bundle, be.clone()).unwrap();
    let (shapes, failed) = be.admission();
    assert!(shapes >= 5, "{shapes} weight shapes checked");
    assert_eq!(failed, 0, "shapes whose W-row kernel was refused");
    let e = Engine::load(&path, f32_backend(), &SpecMode::Off).unwrap();
    let text = e
        .chat_prompt(&[Message::new(
            "user",
            "Explain how a hash map works, with an example in Rust, and say when to avoid one.",
        )])
        .unwrap();
    let vocab = m.hp.vocab;
    for w in 2..=16usize {
        let (ctx, rows) = (&text[..text.len() - w], &text[text.len() - w..]);
        let (mut cache, wide) = assert_rows_are_one_row_steps(&mut m, ctx, rows, &format!("W={w}"));
        let base = cache.len();
        let greedy = m
            .forward(
                &mut cache,
                &Batch::causal(rows, base),
                LogitRows::Greedy,
                &[],
            )
            .unwrap()
            .greedy;
        let want: Vec<u32> = wide.chunks(vocab).map(argmax).collect();
        assert_eq!(
            greedy, want,
            "W={w}: the device's argmax of the verify rows"
        );
    }
}

/// On the GPU, a mixture of experts and a hybrid of Gated DeltaNet and attention layers under drafts that are
/// partly right (each cycle keeps some rows and rolls the rest back: the recurrent state returns to the last
/// kept row): the tokens, the K/V and the recurrent states equal AR's.
#[test]
fn cuda_rollbacks_of_mixture_and_recurrent_state_keep_ar_output() {
    for name in ["qwen3-moe-f16", "qwen3-next-f16"] {
        let mut e = Engine::load(&hf_bundle(name), gpu(), &SpecMode::Off).unwrap();
        let prompt: Vec<u32> = (3..40).collect();
        let ar = GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::greedy(40)
        };
        let run = |e: &mut Engine<CudaBackend>, req: &GenerateRequest| {
            let mut sess = e.new_session();
            let mut got = Vec::new();
            let stats = e
                .generate(&mut sess, &prompt, req, |_, t| {
                    got.push(t.id);
                    true
                })
                .unwrap();
            let ckpt = sess.cache.checkpoint(e.model.backend());
            (got, ckpt, stats)
        };
        let (want, want_cache, _) = run(&mut e, &ar);
        let oracle: Vec<u32> = prompt.iter().chain(&want).copied().collect();
        for right in [0, 1, 2] {
            let vocab = e.model.hp.vocab;
            e.set_proposer(Some(scripted(
                Adversary::RightThenWrong(right),
                &oracle,
                vocab,
            )));
            let req = GenerateRequest {
                draft_width: Some(3),
                ..ar.clone()
            };
            let (got, cache, stats) = run(&mut e, &req);
            assert_eq!(got, want, "{name}, {right} right per cycle");
            assert!(stats.drafted > stats.accepted, "{name}: rollbacks happened");
            assert!(
                cache.layers() == want_cache.layers()
                    && cache.recurrent() == want_cache.recurrent(),
                "{name}, {right} right per cycle: the cache differs from AR's"
            );
        }
    }
}

/// Scripted proposers on SmolLM2 on the GPU (chains always right at fixed widths 1 to 15, always wrong, right
/// then wrong, random, and trees whose kept path leaves the first-child line, so accepted nodes' cache slots
/// move down) leave AR's greedy tokens unchanged: which drafts break GPU exactness, where the routes' own
/// test only says that one does. A failure names the adversary and the first token that differs.
#[test]
fn cuda_adversarial_proposers_never_change_smollm2_greedy_output() {
    let be = gpu();
    let mut e = Engine::load(&smollm2(), be, &SpecMode::Off).unwrap();
    let vocab = e.model.hp.vocab;
    let mut failures = Vec::new();
    for q in [
        "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
        "Explain what a prime number is.",
    ] {
        let prompt = e.chat_prompt(&[Message::new("user", q)]).unwrap();
        let run = |e: &mut Engine<CudaBackend>, width: Option<usize>| {
            let req = GenerateRequest {
                ignore_eos: true,
                draft_width: width,
                ..GenerateRequest::greedy(128)
            };
            let mut s = e.new_session();
            let mut out = Vec::new();
            e.generate(&mut s, &prompt, &req, |_, t| {
                out.push(t.id);
                true
            })
            .unwrap();
            out
        };
        e.set_proposer(None);
        let base = run(&mut e, None);
        let oracle: Vec<u32> = prompt.iter().chain(&base).copied().collect();
        let mut cases: Vec<(Adversary, Option<usize>)> = [1, 2, 3, 4, 7, 8, 15]
            .into_iter()
            .map(|w| (Adversary::AlwaysRight, Some(w)))
            .collect();
        cases.extend([
            (Adversary::AlwaysWrong, Some(4)),
            (Adversary::RightThenWrong(3), Some(6)),
            (Adversary::Random(5), None),
            (Adversary::Tree(5), None),
            (Adversary::Tree(6), None),
        ]);
        for (kind, width) in cases {
            e.set_proposer(Some(scripted(kind.clone(), &oracle, vocab)));
            let got = run(&mut e, width);
            if let Some(first) = got.iter().zip(&base).position(|(a, b)| a != b) {
                failures.push(format!(
                    "{q:?}: {kind:?} at width {width:?} differs from AR from token {first}"
                ));
            }
        }
    }
    // Every case runs before the verdict: which adversaries fail, together, locates the fault.
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_route_reproduces_cuda_ar_greedy_output_on_smollm2() {
    let be = gpu();
    let path = smollm2();
    let mtp_path = smollm2_mtp();
    let mut ar = Engine::load(&path, be.clone(), &SpecMode::Off).unwrap();
    let mut routes = [
        (
            "copy",
            Engine::load(&path, be.clone(), &SpecMode::Copy).unwrap(),
        ),
        (
            "mtp",
            Engine::load(&mtp_path, be.clone(), &SpecMode::Mtp).unwrap(),
        ),
        (
            "draft-model (self)",
            Engine::load(&path, be.clone(), &SpecMode::DraftModel(Some(path.clone()))).unwrap(),
        ),
        (
            "drafter (random)",
            Engine::load(&smollm2_with_drafter(), be.clone(), &SpecMode::Drafter).unwrap(),
        ),
    ];
    let req = GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::greedy(128)
    };
    for q in [
        "Write a Python function that checks whether a number is prime.",
        "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
        "List five facts about the Moon.",
    ] {
        let prompt = ar.chat_prompt(&[Message::new("user", q)]).unwrap();
        let gen = |e: &mut Engine<CudaBackend>| {
            let mut s = e.new_session();
            let mut out = Vec::new();
            let stats = e
                .generate(&mut s, &prompt, &req, |_, t| {
                    out.push(t.id);
                    true
                })
                .unwrap();
            (out, stats)
        };
        let (base, st) = gen(&mut ar);
        eprintln!("{q:?}: ar {:.1} tok/s", st.decode_tok_s());
        for (name, e) in routes.iter_mut() {
            let (toks, st) = gen(e);
            eprintln!(
                "  {name}: {:.1} tok/s, {:.2} tokens/cycle",
                st.decode_tok_s(),
                st.tokens_per_cycle()
            );
            assert_eq!(toks, base, "{q:?} / {name}: differs from AR on the GPU");
        }
    }
}

/// A driver error in the middle of a request (here a launch made to fail as one would) is that request's
/// error, not the process's end: the generation returns it, and the next request on the same engine and backend
/// runs and gives the same tokens as before the fault (no graph recorded around the failed launch is replayed).
#[test]
fn a_device_fault_fails_its_request_and_the_next_request_runs() {
    let be = gpu();
    let mut e = Engine::load(&smollm2(), be.clone(), &SpecMode::Off).unwrap();
    let prompt = e
        .chat_prompt(&[Message::new("user", "List five facts about the Moon.")])
        .unwrap();
    let req = GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::greedy(24)
    };
    let run = |e: &mut Engine<CudaBackend>, fail_after: Option<usize>| {
        let mut s = e.new_session();
        let mut out = Vec::new();
        let result = e.generate(&mut s, &prompt, &req, |_, t| {
            out.push(t.id);
            if fail_after == Some(out.len()) {
                be.fail_next_launch();
            }
            true
        });
        result.map(|_| out)
    };
    let before = run(&mut e, None).unwrap();
    for fail_after in [None, Some(5)] {
        if fail_after.is_none() {
            be.fail_next_launch(); // during the prefill
        }
        let err = run(&mut e, fail_after).expect_err("the fault reaches the request");
        assert!(
            matches!(err, verity::Error::Device(ref m) if m.contains("CUDA")),
            "{err}"
        );
        assert_eq!(
            run(&mut e, None).unwrap(),
            before,
            "after a fault ({fail_after:?})"
        );
    }
}

/// A graph recording the driver breaks off (work outside it, such as another thread freeing memory, invalidates
/// a capture) costs the forward nothing: it runs unrecorded, with no fault, and gives bitwise what the same
/// forward gives when it is recorded and when it is replayed.
#[test]
fn a_broken_off_graph_recording_runs_the_forward_unrecorded() {
    let be = gpu();
    let dir = hf_bundle("llama-rope-llama3-gguf");
    let bundle = Bundle::open(&dir).unwrap();
    let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
    let mut m = Model::load(&bundle, be.clone()).unwrap();
    let mut cache = m.new_cache(tokens.len() + 8);
    let (ctx, next) = (&tokens[..tokens.len() - 1], tokens[tokens.len() - 1]);
    m.forward(&mut cache, &Batch::causal(ctx, 0), LogitRows::None, &[])
        .unwrap();
    let base = cache.len();
    let mut step = |m: &mut Model<CudaBackend>, broken: bool| {
        if broken {
            be.break_next_capture();
        }
        let logits = m
            .forward(
                &mut cache,
                &Batch::causal(&[next], base),
                LogitRows::All,
                &[],
            )
            .unwrap()
            .logits;
        cache.truncate(base);
        assert!(be.take_fault().is_none(), "no fault (broken off: {broken})");
        logits
    };
    let unrecorded = step(&mut m, true);
    let (recorded, replayed) = (step(&mut m, false), step(&mut m, false));
    for (other, what) in [(&recorded, "recorded"), (&replayed, "replayed")] {
        assert!(
            unrecorded
                .iter()
                .zip(other)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "the unrecorded forward differs from the {what} one"
        );
    }
}

/// A backend on GPU 0 with the environment's settings, graph recording on or off.
fn backend_with_graphs(graphs: bool) -> Arc<CudaBackend> {
    let opts = CudaOptions {
        graphs,
        ..CudaOptions::from_env()
    };
    Arc::new(CudaBackend::with_options(0, opts).unwrap())
}

/// A forward replayed from a recorded CUDA graph gives bitwise what launching its kernels one by one gives:
/// across cache growth (new buffers, new recordings), rollbacks, tree masks and both logit modes.
#[test]
fn recorded_forwards_replay_bitwise_what_direct_launches_compute() {
    let bundle = Bundle::open(&smollm2()).unwrap();
    let mut runs = Vec::new();
    for graphs in [true, false] {
        let be = backend_with_graphs(graphs);
        let mut m = Model::load(&bundle, be).unwrap();
        let vocab = m.hp.vocab as u32;
        let mut cache = m.new_cache(1024);
        let mut tok = 11u32;
        let mut next = || {
            tok = (tok * 31 + 7) % vocab;
            tok
        };
        let prompt: Vec<u32> = (0..40).map(|_| next()).collect();
        let mut logits = vec![
            m.forward(&mut cache, &Batch::causal(&prompt, 0), LogitRows::Last, &[])
                .unwrap()
                .logits,
        ];
        // One committed token per step, as a speculative cycle that keeps its first row: the cache passes
        // its first growth (256 slots) on the way.
        for step in 0..260usize {
            let pos = cache.len();
            let w = [1, 3, 1, 8, 16, 2][step % 6];
            let tokens: Vec<u32> = (0..w).map(|_| next()).collect();
            let batch = if step % 7 == 3 && w > 1 {
                // A root and its w - 1 sibling children.
                Batch {
                    positions: (0..w).map(|i| pos + usize::from(i > 0)).collect(),
                    mask: AttnMask::Tree(
                        (0..w * w)
                            .map(|ij| ij % w == 0 || ij / w == ij % w)
                            .collect(),
                    ),
                    tokens,
                    media: Vec::new(),
                    spatial: Vec::new(),
                }
            } else {
                Batch::causal(&tokens, pos)
            };
            let rows = if step % 5 == 0 {
                LogitRows::Last
            } else {
                LogitRows::All
            };
            logits.push(m.forward(&mut cache, &batch, rows, &[]).unwrap().logits);
            cache.truncate(pos + 1);
        }
        runs.push(logits);
    }
    assert_eq!(runs[0].len(), runs[1].len());
    for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        assert!(
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "forward {i}: the replayed graph differs from direct launches"
        );
    }
}

/// A deterministic stream of pseudo-random u32 (a linear congruential generator).
fn lcg(mut seed: u32) -> impl FnMut() -> u32 {
    move || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        seed
    }
}

/// SmolLM2's trained MTP head on GPU 0, with the target's hidden size and vocabulary size.
fn smollm2_head_on_gpu() -> (MtpHead<CudaBackend>, usize, u32) {
    let bundle = Bundle::open(&smollm2_mtp()).unwrap();
    let model = Model::load(&bundle, Arc::new(CudaBackend::new(0).unwrap())).unwrap();
    let head = MtpHead::load(&bundle, &model).unwrap();
    (head, model.hp.hidden, model.hp.vocab as u32)
}

/// On the GPU, a recursive draft step from the state left on the device computes bitwise what the same step
/// computes from that state sent back from the host, across the head cache's growth.
#[test]
fn mtp_draft_steps_from_the_state_left_on_the_device_equal_steps_from_the_state_sent_back() {
    let (mut head, h, vocab) = smollm2_head_on_gpu();
    let mut cache = head.new_cache(1024);
    let mut next = lcg(11);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for step in 0..120usize {
        let greedy = step % 2 == 0;
        let pos = cache.len();
        let w = 1 + step % 3;
        let tokens: Vec<u32> = (0..w + 2).map(|_| next() % vocab).collect();
        let hidden: Vec<f32> = (0..w * h)
            .map(|_| (next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
            .collect();
        let caught = head
            .forward(&mut cache, &tokens[..w], pos, &hidden, greedy)
            .unwrap();
        let a1 = head
            .draft(
                &mut cache,
                &tokens[w..w + 1],
                pos + w,
                HeadInput::Last,
                greedy,
            )
            .unwrap();
        let a2 = head
            .draft(
                &mut cache,
                &tokens[w + 1..],
                pos + w + 1,
                HeadInput::Last,
                greedy,
            )
            .unwrap();
        cache.truncate(pos + w);
        let last = &caught.hidden[(w - 1) * h..];
        let b1 = head
            .forward(&mut cache, &tokens[w..w + 1], pos + w, last, greedy)
            .unwrap();
        let b2 = head
            .forward(
                &mut cache,
                &tokens[w + 1..],
                pos + w + 1,
                &b1.hidden,
                greedy,
            )
            .unwrap();
        for (i, (a, b)) in [(&a1, &b1), (&a2, &b2)].into_iter().enumerate() {
            assert_eq!(bits(&a.logits), bits(&b.logits), "step {step}.{i}");
            assert_eq!(a.greedy, b.greedy, "step {step}.{i}");
        }
        cache.truncate(pos + 3); // past 256 slots: the cache grows
    }
}

/// On the GPU, a chained greedy draft (every step queued before the host waits, each step's token picked on the
/// device from the step before's argmax through the draft vocabulary) gives the tokens of the same steps run one
/// by one, across catch-up widths, depths and the head cache's growth.
#[test]
fn mtp_chained_greedy_drafts_equal_their_steps_run_one_by_one() {
    let (mut head, h, vocab) = smollm2_head_on_gpu();
    let mut cache = head.new_cache(1024);
    let mut next = lcg(5);
    for round in 0..100usize {
        let pos = cache.len();
        let (w, depth) = (1 + round % 3, 1 + round % 8);
        let tokens: Vec<u32> = (0..w).map(|_| next() % vocab).collect();
        let hidden: Vec<f32> = (0..w * h)
            .map(|_| (next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
            .collect();
        let chained = head
            .draft_greedy(&mut cache, &tokens, pos, &hidden, depth)
            .unwrap();
        assert_eq!(cache.len(), pos + w + depth - 1, "round {round}");
        cache.truncate(pos);
        let first = head
            .draft(&mut cache, &tokens, pos, HeadInput::Host(&hidden), true)
            .unwrap();
        let mut stepped = vec![head.token(first.greedy.unwrap() as usize)];
        while stepped.len() < depth {
            let at = pos + w + stepped.len() - 1;
            let last = *stepped.last().unwrap();
            let out = head
                .draft(&mut cache, &[last], at, HeadInput::Last, true)
                .unwrap();
            stepped.push(head.token(out.greedy.unwrap() as usize));
        }
        assert_eq!(chained, stepped, "round {round}");
        cache.truncate(pos + 3); // past 256 slots: the cache grows
    }
}

/// The MTP head's recorded draft steps replay bitwise what direct launches compute (hidden states and logits),
/// across widths and the head cache's growth.
#[test]
fn recorded_mtp_head_steps_replay_bitwise_what_direct_launches_compute() {
    let bundle = Bundle::open(&smollm2_mtp()).unwrap();
    let mut runs = Vec::new();
    for graphs in [true, false] {
        let be = backend_with_graphs(graphs);
        let model = Model::load(&bundle, be).unwrap();
        let mut head = MtpHead::load(&bundle, &model).unwrap();
        let (h, vocab) = (model.hp.hidden, model.hp.vocab as u32);
        let mut cache = head.new_cache(1024);
        let mut next = lcg(7);
        let mut outs = Vec::new();
        for step in 0..300usize {
            let pos = cache.len();
            let w = [1, 1, 3, 1, 2][step % 5];
            let tokens: Vec<u32> = (0..w).map(|_| next() % vocab).collect();
            let hidden: Vec<f32> = (0..w * h)
                .map(|_| (next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
                .collect();
            let greedy = step % 2 == 1;
            let o = head
                .forward(&mut cache, &tokens, pos, &hidden, greedy)
                .unwrap();
            let argmax = o.greedy.map_or(Vec::new(), |t| vec![t as f32]);
            outs.push((o.hidden, [o.logits, argmax].concat()));
            cache.truncate(pos + 1);
        }
        runs.push(outs);
    }
    for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        let same = |x: &[f32], y: &[f32]| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        };
        assert!(
            same(&a.0, &b.0) && same(&a.1, &b.1),
            "head step {i}: replay differs"
        );
    }
}

/// Local layers' ring caches on the GPU (the tiny Gemma 3, window 8, allowed a longer context so its rings wrap
/// many times): forwards of many widths, some rolled back in part, give bitwise the logits that whole-context
/// caches give, and the ring cache holds fewer bytes.
#[test]
fn cuda_ring_caches_compute_what_whole_context_caches_compute() {
    let be = gpu();
    let bundle = Bundle::open(&hf_bundle("gemma3-f16")).unwrap();
    let mut m = Model::load(&bundle, be.clone()).unwrap();
    m.hp.context_len = 2048;
    let shape = CacheShape {
        n_layers: m.hp.n_layers,
        n_heads: m.hp.n_heads,
        n_kv_heads: m.hp.n_kv_heads,
        head_dim: m.hp.head_dim,
    };
    let mut ring = m.new_cache(2048);
    let mut whole = KvCache::new(be.as_ref(), shape, 2048);
    let tokens: Vec<u32> = (0..900u32).map(|i| (i * 7919 + 13) % 320).collect();
    let mut pos = 0;
    for (step, &w) in [64usize, 1, 3, 16, 7, 1, 33, 16, 2]
        .iter()
        .cycle()
        .enumerate()
    {
        if pos + w > tokens.len() {
            break;
        }
        let batch = Batch::causal(&tokens[pos..pos + w], pos);
        let a = m.forward(&mut ring, &batch, LogitRows::All, &[]).unwrap();
        let b = m.forward(&mut whole, &batch, LogitRows::All, &[]).unwrap();
        assert!(
            a.logits
                .iter()
                .zip(&b.logits)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{w} rows at {pos}"
        );
        let keep = if step % 3 == 1 { w.div_ceil(2) } else { w };
        assert_eq!(ring.truncate(pos + keep), pos + keep);
        whole.truncate(pos + keep);
        pos += keep;
    }
    assert!(pos > 800);
    assert!(ring.bytes() <= whole.bytes() / 2);
}

/// The image-text fixture's vision tower on the GPU (its projections and attention products on the CUDA
/// backend's f32 kernels) gives the CPU backend's features within float tolerance, and the engine on the GPU
/// answers an image turn.
#[test]
fn cuda_vision_tower_matches_the_cpu_tower() {
    use verity::vision::{decode, Gemma3Vision, ImageLimits, SquareProcessor};
    let fixtures = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = fixtures.join("vision/gemma3-vl");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("preprocessor_config.json")).unwrap())
            .unwrap();
    let image = std::fs::read(fixtures.join("images/rgb.png")).unwrap();
    let pixels = SquareProcessor::from_config(&config)
        .unwrap()
        .pixel_values(&decode(&image, &ImageLimits::default()).unwrap());
    let on_gpu = Gemma3Vision::load(&dir, gpu())
        .unwrap()
        .image_features(&pixels)
        .unwrap();
    let on_cpu = Gemma3Vision::load(&dir, f32_backend())
        .unwrap()
        .image_features(&pixels)
        .unwrap();
    let e = relative_error(&on_gpu, &on_cpu);
    assert!(e < 1e-5, "features: relative error {e}");
    let mut engine = Engine::load(&dir, gpu(), &SpecMode::Off).unwrap();
    let img = engine
        .vision
        .as_ref()
        .unwrap()
        .image(&image, &ImageLimits::default())
        .unwrap();
    let mut prompt = vec![2, 10, 11, 12];
    prompt.extend(engine.vision.as_ref().unwrap().block(&img));
    prompt.extend([20, 21, 22]);
    let req = GenerateRequest {
        ignore_eos: true,
        images: vec![img],
        ..GenerateRequest::greedy(8)
    };
    let mut s = engine.new_session();
    let stats = engine.generate(&mut s, &prompt, &req, |_, _| true).unwrap();
    assert_eq!(stats.completion_tokens, 8);
}

/// The tiny Qwen2.5-VL bundle on the GPU: its vision transformer gives transformers' image features, and the
/// engine's greedy answer to an image turn (the image's rows at multimodal rotary positions, their rotations
/// uploaded per row; the answer's positions lagging its slots) is transformers' `generate`, token for token.
#[test]
fn cuda_qwen25_vl_image_turn_answers_as_transformers_generates() {
    use verity::vision::{decode, GridProcessor, ImageLimits, Qwen25Vision};
    let fixtures = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = fixtures.join("vision/qwen25-vl");
    let read_json = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap()
    };
    let image = std::fs::read(fixtures.join("images/rgb.png")).unwrap();
    let (pixels, grid) = GridProcessor::from_config(&read_json("preprocessor_config.json"))
        .unwrap()
        .pixel_values(&decode(&image, &ImageLimits::default()).unwrap())
        .unwrap();
    let features = Qwen25Vision::load(&dir, gpu())
        .unwrap()
        .image_features(&pixels, grid)
        .unwrap();
    let want = read_f32(&dir.join("features.f32"));
    let e = relative_error(&features, &want);
    assert!(e < 1e-5, "features: relative error {e}");
    let reference = read_json("reference.json");
    let mut engine = Engine::load(&dir, gpu(), &SpecMode::Off).unwrap();
    let vision = engine.vision.as_ref().unwrap();
    let img = vision.image(&image, &ImageLimits::default()).unwrap();
    let mut prompt = vec![2, 10, 11, 12];
    prompt.extend(vision.block(&img));
    prompt.extend([20, 21, 22]);
    let req = GenerateRequest {
        ignore_eos: true,
        images: vec![img],
        ..GenerateRequest::greedy(12)
    };
    let mut s = engine.new_session();
    let mut got = Vec::new();
    engine
        .generate(&mut s, &prompt, &req, |_, t| {
            got.push(t.id);
            true
        })
        .unwrap();
    assert_eq!(got, ids(&reference["greedy_continuation_ids"]));
}
