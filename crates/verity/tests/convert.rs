//! `verity quantize` from a Hugging Face safetensors bundle: the bundle written as a GGUF of its float weights
//! (`verity::quantize::hf`) runs as the bundle does, and quantizes.

mod common;

use std::path::{Path, PathBuf};

use common::{f32_backend, hf_bundle, ids, json, load_model_on};
use verity::bundle::gguf::GgufFile;
use verity::bundle::Bundle;
use verity::chat::Tokenizer;
use verity::model::{Batch, LogitRows};
use verity::quant::GgmlType;
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

/// Dense Llama (F32, BF16, F16 with tied embeddings, Llama 3 and linear RoPE scaling), Qwen2 (Q/K/V biases) and
/// Qwen3 (Q/K norms) bundles (llama.cpp loads the same files and gives transformers' logits:
/// `scripts/check_gguf_with_llama_cpp.py`): the
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
        "llama-rope-llama3",
        "llama-rope-linear",
        "qwen2-f32",
        "qwen3-f32",
    ] {
        let dir = hf_bundle(name);
        let out = scratch(&format!("{name}.gguf"));
        write_gguf(&dir, &out).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Norms and biases in F32, as llama.cpp's converter writes them (its CPU kernels refuse F16/BF16 ones).
        let g = GgufFile::open(&out).unwrap();
        for t in g.tensors.iter().filter(|t| t.dims.len() == 1) {
            assert_eq!(t.ty, GgmlType::F32, "{name}: {}", t.name);
        }
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

/// Llama 3's RoPE scaling is written as llama.cpp's converter writes it: the fixture GGUF made by that
/// converter's rule (`scripts/fixtures/make_rope_scaling_bundles.py`) has the same `rope_freqs.weight` and
/// original context.
#[test]
fn llama3_rope_scaling_is_written_as_llama_cpp_writes_it() {
    let out = scratch("llama3-rope.gguf");
    write_gguf(&hf_bundle("llama-rope-llama3"), &out).unwrap();
    let (ours, theirs) = (
        GgufFile::open(&out).unwrap(),
        GgufFile::open(&hf_bundle("llama-rope-llama3-gguf").join("model.gguf")).unwrap(),
    );
    let freqs = |g: &GgufFile| -> Vec<f32> {
        let t = g.tensor("rope_freqs.weight").expect("rope_freqs.weight");
        g.tensor_bytes(t)
            .as_slice()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (a, b) = (freqs(&ours), freqs(&theirs));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * y, "{a:?} vs {b:?}");
    }
    assert!(a.contains(&1.0) && a.iter().any(|&f| f > 1.0 && f < 8.0));
    let ctx = |g: &GgufFile| {
        g.get("llama.rope.scaling.original_context_length")
            .and_then(|v| v.as_f64())
    };
    assert_eq!(ctx(&ours), Some(32.0));
    assert_eq!(ctx(&ours), ctx(&theirs));
    std::fs::remove_file(&out).unwrap();
}

/// A copy of fixture bundle `name` in a scratch folder, its config.json edited by `edit`.
fn edited_bundle(name: &str, copy: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = scratch(copy);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(hf_bundle(name)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let config = dir.join("config.json");
    let mut cfg = json(&config);
    edit(&mut cfg);
    std::fs::write(&config, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    assert!(Bundle::open(&dir).is_ok(), "{copy}");
    dir
}

/// YaRN as llama.cpp reads it (`rope.scaling.type` yarn, its factor and original context; the betas and
/// attention factor its defaults): the GGUF of a Llama bundle with YaRN gives the bundle's logits, and the
/// stretch matters (without it they differ).
#[test]
fn yarn_rope_scaling_survives_the_conversion() {
    let yarn = edited_bundle("llama-f32", "llama-yarn", |c| {
        c["rope_scaling"] = serde_json::json!({
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        });
    });
    let out = scratch("llama-yarn.gguf");
    write_gguf(&yarn, &out).unwrap();
    let tokens = ids(&json(&yarn.join("reference.json"))["token_ids"]);
    assert!(
        tokens.len() > 32,
        "the prompt must pass the original context"
    );
    let (want, got) = (logits(&yarn, &tokens), logits(&out, &tokens));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst(&want, &got) <= 1e-5 * scale,
        "{} (largest {scale})",
        worst(&want, &got)
    );
    let plain = logits(&hf_bundle("llama-f32"), &tokens);
    assert!(worst(&want, &plain) > 1e-3 * scale);
    std::fs::remove_file(&out).unwrap();
    std::fs::remove_dir_all(&yarn).unwrap();
}

/// What the converter cannot write is refused by name, and leaves no file: a bundle of an architecture it does
/// not convert (Gemma 3), sliding-window layers (Mistral's, Qwen2's), which a GGUF of those architectures would
/// drop, and RoPE scalings no GGUF reader would recover — Llama 3 with other frequency factors, YaRN with its
/// own betas (verity runs those bundles from safetensors).
#[test]
fn bundles_the_converter_does_not_take_are_refused() {
    let llama3 = edited_bundle("llama-rope-llama3", "llama3-low-2", |c| {
        c["rope_parameters"]["low_freq_factor"] = serde_json::json!(2.0);
    });
    let yarn = edited_bundle("llama-f32", "yarn-beta-16", |c| {
        c["rope_scaling"] = serde_json::json!({
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16,
        });
    });
    for (dir, why) in [
        (hf_bundle("gemma3-f16"), "converting gemma3 bundles"),
        (hf_bundle("mistral-window"), "converting sliding-window"),
        (hf_bundle("qwen2-window"), "converting sliding-window"),
        (llama3.clone(), "converting RoPE scaling Llama3"),
        (yarn.clone(), "converting RoPE scaling Yarn"),
    ] {
        let out = scratch("refused.gguf");
        let err = write_gguf(&dir, &out).expect_err("refused").to_string();
        assert!(err.contains(why), "{}: {err}", dir.display());
        assert!(!out.exists(), "{}", dir.display());
    }
    for dir in [llama3, yarn] {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
