//! Row-exactness: a W-row forward gives each row bitwise the logits the 1-row forward gives at that position,
//! on the quantized GGUF path and on the safetensors paths (f32, bf16, MLX). This is what lets a speculative
//! verify of W drafts reproduce plain decoding exactly.

mod common;

use common::*;
use verity::backend::cpu::CpuBackend;
use verity::model::{Batch, LogitRows, Model};

/// Teacher-forced: prefill `prefix`, then compare a W-row forward of `cont[..w]` with W 1-row steps.
fn assert_row_exact(model: &mut Model<CpuBackend>, prefix: &[u32], cont: &[u32], label: &str) {
    let vocab = model.hp.vocab;
    let mut cache = model.new_cache(prefix.len() + cont.len());
    model
        .forward(&mut cache, &Batch::causal(prefix, 0), LogitRows::None, &[])
        .unwrap();
    let base = cache.len();
    // The 1-row reference logits for every position of `cont`.
    let mut single = Vec::new();
    for (i, &t) in cont.iter().enumerate() {
        let out = model
            .forward(
                &mut cache,
                &Batch::causal(&[t], base + i),
                LogitRows::All,
                &[],
            )
            .unwrap();
        single.push(out.logits);
    }
    // Back to the prefix: a cache with recurrent layers cannot roll back over 16 forwards and is emptied, so
    // the prefix is prefilled again (the same rows give the same state).
    let rewind = |model: &mut Model<CpuBackend>, cache: &mut verity::cache::KvCache<CpuBackend>| {
        if cache.truncate(base) < base {
            model
                .forward(cache, &Batch::causal(prefix, 0), LogitRows::None, &[])
                .unwrap();
        }
    };
    for w in 2..=cont.len() {
        rewind(model, &mut cache);
        let out = model
            .forward(
                &mut cache,
                &Batch::causal(&cont[..w], base),
                LogitRows::All,
                &[],
            )
            .unwrap();
        for (r, want) in single[..w].iter().enumerate() {
            let got = &out.logits[r * vocab..(r + 1) * vocab];
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{label}: W={w} row {r} differs from the 1-row forward"
            );
        }
        // What a greedy verify asks for: each row's argmax, which must be the argmax of those logits.
        rewind(model, &mut cache);
        let greedy = model
            .forward(
                &mut cache,
                &Batch::causal(&cont[..w], base),
                LogitRows::Greedy,
                &[],
            )
            .unwrap()
            .greedy;
        let want: Vec<u32> = single[..w]
            .iter()
            .map(|l| verity::sample::argmax(l))
            .collect();
        assert_eq!(greedy, want, "{label}: W={w} greedy rows");
    }
}

/// Gemma 3 270M (Q4_K_M with Q5_0, Q8_0 and Q6_K tensors; local layers of a 512-token window): verify rows
/// that run across the window edge are bitwise the one-row steps.
#[test]
fn gemma3_verify_rows_across_the_window_edge_are_bitwise_equal_to_single_steps() {
    let path = gemma3_270m();
    let mut model = load_model(&path);
    let bundle = verity::bundle::Bundle::open(&path).unwrap();
    let tokenizer = verity::chat::Tokenizer::from_bundle(&bundle).unwrap();
    let tokens = gemma3_prompt(&tokenizer, 520);
    assert_row_exact(
        &mut model,
        &tokens[..504],
        &tokens[504..520],
        "gemma3 Q4_K_M",
    );
}

#[test]
fn smollm2_gguf_verify_rows_are_bitwise_equal_to_single_steps() {
    let mut model = load_model(&smollm2());
    let reference = json(&fixtures().join("gguf_ref/smollm2-135m-q4_1.json"));
    let tokens = ids(&reference["token_ids"]);
    assert_row_exact(&mut model, &tokens[..20], &tokens[20..28], "smollm2 Q4_1");
}

#[test]
fn safetensors_verify_rows_are_bitwise_equal_to_single_steps() {
    for name in [
        "llama-f32",
        "llama-bf16",
        "qwen2-f32",
        "qwen3-bf16",
        "mlx-llama-q4-g64",
        "mlx-llama-q8-g128",
    ] {
        let dir = hf_bundle(name);
        let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
        let mut model = load_model(&dir);
        assert_row_exact(&mut model, &tokens[..16], &tokens[16..24], name);
    }
}

/// Mixtures of experts (Qwen3-MoE: 8 experts, 2 per token; safetensors, and a GGUF with stacked experts) and
/// hybrids of Gated DeltaNet and gated attention layers with a mixture and a shared expert (Qwen3-Next): the
/// rows of a 16-row verify route to different experts (with random weights every row picks its own pair), each
/// expert runs once over the rows that chose it, the recurrent layers step the rows one after another (each
/// from the row before it), and every row still gets bitwise its 1-row logits, on the 8-bit and the f32 paths.
#[test]
fn mixture_and_linear_attention_verify_rows_are_bitwise_equal_to_single_steps() {
    for name in [
        "qwen3-moe-f16",
        "qwen3-moe-gguf",
        "qwen3-next-f16",
        "qwen3-next-gguf",
    ] {
        let dir = hf_bundle(name);
        let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
        for (be, path) in [(backend(), "8-bit"), (f32_backend(), "f32")] {
            let mut model = load_model_on(&dir, be);
            let label = format!("{name} {path}");
            assert_row_exact(&mut model, &tokens[..16], &tokens[16..32], &label);
        }
    }
}

#[test]
fn truncating_the_cache_then_refeeding_reproduces_the_logits() {
    let mut model = load_model(&smollm2());
    let tokens: Vec<u32> =
        ids(&json(&fixtures().join("gguf_ref/smollm2-135m-q4_1.json"))["token_ids"]);
    let mut cache = model.new_cache(128);
    let first = model
        .forward(
            &mut cache,
            &Batch::causal(&tokens[..12], 0),
            LogitRows::Last,
            &[],
        )
        .unwrap();
    // Append rejected rows, roll back, and re-run the last row: the committed state must be untouched.
    model
        .forward(
            &mut cache,
            &Batch::causal(&[5, 6, 7], 12),
            LogitRows::None,
            &[],
        )
        .unwrap();
    cache.truncate(11);
    let again = model
        .forward(
            &mut cache,
            &Batch::causal(&tokens[11..12], 11),
            LogitRows::Last,
            &[],
        )
        .unwrap();
    assert_eq!(first.logits, again.logits);
}
