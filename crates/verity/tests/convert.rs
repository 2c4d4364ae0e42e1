//! `verity quantize` from a Hugging Face safetensors bundle: the bundle written as a GGUF of its float weights
//! (`verity::quantize::hf`) runs as the bundle does, and quantizes.

mod common;

use std::path::{Path, PathBuf};

use common::{f32_backend, hf_bundle, ids, json, load_model_on};
use verity::bundle::Bundle;
use verity::chat::Tokenizer;
use verity::model::{Batch, LogitRows};
use verity::quantize::hf::write_gguf;
use verity::quantize::{quantize, Preset};

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("verity-convert-{}-{name}", std::process::id()))
}

fn logits(path: &Path, tokens: &[u32]) -> Vec<f32> {
    let mut m = load_model_on(path, f32_backend());
    let mut cache = m.new_cache(tokens.len());
    m.forward(&mut cache, &Batch::causal(tokens, 0), LogitRows::All, &[])
        .unwrap()
        .logits
}

/// Dense Llama (F32, BF16, F16 with tied embeddings), Qwen2 (Q/K/V biases) and Qwen3 (Q/K norms) bundles: the
/// GGUF's tokenizer gives the same ids, BOS/EOS and template; its logits over the reference prompt are the
/// bundle's — bitwise for Qwen, whose GGUF keeps the half-split rotary layout, and within 1e-5 of the largest
/// for Llama, whose Q and K rows are reordered into interleaved pairs (the same products, each head's dot
/// summed in another order); every row's argmax is the same; and the GGUF quantizes to Q8_0.
#[test]
fn a_safetensors_bundle_written_as_gguf_runs_as_the_bundle_does() {
    for name in [
        "llama-f32",
        "llama-bf16",
        "llama-f16-tied",
        "qwen2-f32",
        "qwen3-f32",
    ] {
        let dir = hf_bundle(name);
        let out = scratch(&format!("{name}.gguf"));
        write_gguf(&dir, &out).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (hf, gguf) = (
            Tokenizer::from_bundle(&Bundle::open(&dir).unwrap()).unwrap(),
            Tokenizer::from_bundle(&Bundle::open(&out).unwrap()).unwrap(),
        );
        for text in ["Hello, world! 12345", "  tabs\tand\nnewlines — ünïcödé"] {
            assert_eq!(
                hf.encode(text, true).unwrap(),
                gguf.encode(text, true).unwrap(),
                "{name}: {text:?}"
            );
        }
        assert_eq!(
            (hf.bos, hf.eos, hf.add_bos),
            (gguf.bos, gguf.eos, gguf.add_bos),
            "{name}"
        );
        assert_eq!(hf.chat_template, gguf.chat_template, "{name}");

        let tokens = ids(&json(&dir.join("reference.json"))["token_ids"]);
        let (want, got) = (logits(&dir, &tokens), logits(&out, &tokens));
        assert_eq!(want.len(), got.len());
        if name.starts_with("qwen") {
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: logits differ"
            );
        } else {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = want
                .iter()
                .zip(&got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-5 * scale,
                "{name}: logits differ by {worst} (largest {scale})"
            );
        }
        let vocab = want.len() / tokens.len();
        let argmax = |row: &[f32]| {
            row.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i)
        };
        for (w, g) in want.chunks(vocab).zip(got.chunks(vocab)) {
            assert_eq!(argmax(w), argmax(g), "{name}");
        }

        let q8 = scratch(&format!("{name}-q8_0.gguf"));
        quantize(&out, &q8, "q8_0".parse::<Preset>().unwrap(), 2, &mut |_| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(logits(&q8, &tokens).len(), want.len());
        for p in [&out, &q8] {
            std::fs::remove_file(p).unwrap();
        }
    }
}

/// What the converter cannot write is refused by name, and leaves no file: a bundle of an architecture it does
/// not convert (Gemma 3), one with RoPE scaling.
#[test]
fn bundles_the_converter_does_not_take_are_refused() {
    for name in ["gemma3-f16", "llama-rope-llama3"] {
        let out = scratch(&format!("refused-{name}.gguf"));
        let err = write_gguf(&hf_bundle(name), &out)
            .expect_err(name)
            .to_string();
        assert!(err.contains("converting"), "{name}: {err}");
        assert!(!out.exists(), "{name}");
    }
}
