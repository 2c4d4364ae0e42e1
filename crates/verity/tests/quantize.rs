//! `verity quantize` writes the files llama.cpp's quantizer writes: for two small Llama-shaped models and
//! every preset, the output is byte for byte the file in the fixtures (made by
//! `scripts/fixtures/make_quantize_reference.py` with llama.cpp's `llama_model_quantize`; the script's doc states the
//! test values this file rebuilds).

use std::path::{Path, PathBuf};

use half::f16;
use serde_json::Value;
use sha2::{Digest, Sha256};
use verity::bundle::gguf::GgufFile;
use verity::bundle::gguf_writer::{GgufWriter, TensorEntry};
use verity::quant::GgmlType;
use verity::quantize::{quantize, Preset};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// (layers, d_model, ffn, heads, kv heads, vocabulary, tied embeddings), as in the fixture script.
const MODELS: [(&str, [usize; 6], bool); 2] = [
    ("untied", [4, 256, 640, 4, 2, 320], false),
    ("tied", [2, 256, 512, 4, 1, 384], true),
];

fn splitmix64(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add((i + 1).wrapping_mul(GOLDEN));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fixture script's test matrix, as F16 bytes.
fn test_matrix(seed: u64, rows: usize, cols: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols * 2);
    for r in 0..rows {
        let scale = (2.0f64).powi(-17 - (r % 5) as i32);
        let value = |c: usize| {
            let z = splitmix64(seed, (r * cols + c) as u64);
            let s: u64 = (0..4).map(|k| (z >> (16 * k)) & 0xffff).sum();
            (s as i64 - 131_070) as f64 * scale
        };
        for c in 0..cols {
            let mut v = match r % 17 {
                5 => 0.0,
                11 => value(0),
                _ => value(c),
            };
            if r % 13 == 3 && c == (7 * r) % cols {
                v *= 64.0;
            }
            out.extend_from_slice(&f16::from_f64(v).to_le_bytes());
        }
    }
    out
}

/// The fixture script's input GGUF.
fn input_gguf(name: &str, shape: [usize; 6], tied: bool) -> Vec<u8> {
    let [layers, d, ffn, heads, kv, vocab] = shape;
    let hd = d / heads;
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama");
    w.set_str("general.name", &format!("verity quantize test ({name})"));
    for (key, v) in [
        ("llama.block_count", layers),
        ("llama.context_length", 256),
        ("llama.embedding_length", d),
        ("llama.feed_forward_length", ffn),
        ("llama.attention.head_count", heads),
        ("llama.attention.head_count_kv", kv),
    ] {
        w.set_u32(key, v as u32);
    }
    w.set_f32("llama.rope.freq_base", 10000.0);
    w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    w.set_u32("llama.vocab_size", vocab as u32);
    w.set_u32("general.file_type", 1);

    let mut mats = vec![("token_embd.weight".to_string(), vocab, d)];
    let mut norms = vec![];
    for i in 0..layers {
        norms.push(format!("blk.{i}.attn_norm.weight"));
        norms.push(format!("blk.{i}.ffn_norm.weight"));
        for (suffix, rows, cols) in [
            ("attn_q", d, d),
            ("attn_k", kv * hd, d),
            ("attn_v", kv * hd, d),
            ("attn_output", d, d),
            ("ffn_gate", ffn, d),
            ("ffn_up", ffn, d),
            ("ffn_down", d, ffn),
        ] {
            mats.push((format!("blk.{i}.{suffix}.weight"), rows, cols));
        }
    }
    norms.push("output_norm.weight".to_string());
    if !tied {
        mats.push(("output.weight".to_string(), vocab, d));
    }
    let mut data = vec![];
    for (t, (name, rows, cols)) in mats.iter().enumerate() {
        w.add_tensor(TensorEntry {
            name: name.clone(),
            dims: vec![*cols, *rows],
            ty: GgmlType::F16,
        })
        .unwrap();
        data.push(test_matrix(1000 + t as u64, *rows, *cols));
    }
    for name in norms {
        w.add_tensor(TensorEntry {
            name,
            dims: vec![d],
            ty: GgmlType::F32,
        })
        .unwrap();
        data.push([1.0f32.to_le_bytes(); 1].repeat(d).concat());
    }
    let mut file = w.header();
    for bytes in data {
        w.write_data(&mut file, &bytes).unwrap();
    }
    file
}

fn sha256(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn fixtures() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quantize/llama_cpp.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("verity-quantize-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_preset_writes_the_file_llama_cpp_writes() {
    let fixtures = fixtures();
    let dir = scratch("presets");
    for (name, shape, tied) in MODELS {
        let expected = &fixtures["models"][name];
        let input = dir.join(format!("{name}-input.gguf"));
        let bytes = input_gguf(name, shape, tied);
        assert_eq!(
            sha256(&bytes),
            expected["input_sha256"],
            "{name}: the test input differs from the fixture script's"
        );
        std::fs::write(&input, bytes).unwrap();
        for preset in Preset::ALL {
            let want = &expected["presets"][preset.name()];
            let out = dir.join(format!("{name}-{preset}.gguf"));
            quantize(&input, &out, preset, 2, &mut |_| {}).unwrap();
            let file = GgufFile::open(&out).unwrap();
            let got: Vec<_> = file
                .tensors
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        t.ty.name().to_string(),
                        sha256(file.tensor_bytes(t).as_slice()),
                    )
                })
                .collect();
            let wanted: Vec<_> = want["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    (
                        t["name"].as_str().unwrap().to_string(),
                        t["type"].as_str().unwrap().to_string(),
                        t["sha256"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            for (g, w) in got.iter().zip(&wanted) {
                assert_eq!(g, w, "{name} {preset}: a tensor differs from llama.cpp's");
            }
            assert_eq!(got.len(), wanted.len(), "{name} {preset}: tensor count");
            let body = std::fs::read(&out).unwrap();
            assert_eq!(
                (sha256(&body), body.len() as u64),
                (
                    want["sha256"].as_str().unwrap().to_string(),
                    want["bytes"].as_u64().unwrap()
                ),
                "{name} {preset}: the file differs from llama.cpp's (metadata or layout)"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_output_does_not_depend_on_the_thread_count() {
    let dir = scratch("threads");
    let input = dir.join("in.gguf");
    std::fs::write(&input, input_gguf("untied", MODELS[0].1, false)).unwrap();
    let mut files = vec![];
    for threads in [1, 3] {
        let out = dir.join(format!("out-{threads}.gguf"));
        quantize(&input, &out, Preset::Q4KM, threads, &mut |_| {}).unwrap();
        files.push(std::fs::read(out).unwrap());
    }
    assert_eq!(files[0], files[1]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_inputs_are_refused_and_leave_no_output() {
    let dir = scratch("bad");
    let input = dir.join("in.gguf");
    let bytes = input_gguf("tied", MODELS[1].1, true);
    std::fs::write(&input, &bytes).unwrap();
    let listing = || {
        let mut v: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };

    // The output may not replace the input.
    let e = quantize(&input, &input, Preset::Q4_0, 2, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("is the input"), "{e}");

    // A quantized model is not quantized again.
    let q = dir.join("q.gguf");
    quantize(&input, &q, Preset::Q8_0, 2, &mut |_| {}).unwrap();
    let e = quantize(&q, &dir.join("qq.gguf"), Preset::Q4KM, 2, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("already Q8_0"), "{e}");

    // A truncated file is named as such.
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).unwrap();
    let e = quantize(&cut, &dir.join("cut-q.gguf"), Preset::Q4KM, 2, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");

    // An unwritable output leaves nothing behind.
    let e = quantize(
        &input,
        &dir.join("missing/out.gguf"),
        Preset::Q4KM,
        2,
        &mut |_| {},
    );
    assert!(e.is_err());
    assert_eq!(
        listing(),
        ["cut.gguf", "in.gguf", "q.gguf"].map(std::ffi::OsString::from)
    );
    std::fs::remove_dir_all(dir).unwrap();
}
