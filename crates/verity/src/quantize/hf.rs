//! A Hugging Face safetensors bundle as a GGUF of its float weights, as llama.cpp's converter writes one for
//! the dense architectures verity runs from both formats (Llama, Qwen2, Qwen3): llama.cpp's tensor names and
//! metadata keys, the tokenizer as `tokenizer.ggml.*` (byte-level BPE), each tensor in its stored type (F32,
//! F16 or BF16), and Llama's Q and K rows reordered from the half-split rotary layout Hugging Face stores to
//! the interleaved pairs GGUF's `llama` architecture rotates. RoPE scaling is written as llama.cpp writes it:
//! linear and YaRN as `rope.scaling.type` with the factor (YaRN: and the original context), Llama 3's
//! per-frequency rule as `rope_freqs.weight` (one divisor per rotated pair) with the original context.
//! [`super::quantize`] then reads it as any float GGUF.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::Value;

use crate::backend::RopeScaling;
use crate::bundle::gguf_writer::{GgufWriter, TensorEntry};
use crate::bundle::hparams::{Arch, BlockStyle, HParams};
use crate::bundle::safetensors::{SafetensorsSet, StDtype, StTensor};
use crate::bundle::TensorKey;
use crate::bundle::{Bundle, Source};
use crate::chat::gguf_vocab::GgufVocab;
use crate::chat::Tokenizer;
use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// The tensors of a dense decoder, in llama.cpp's file order (globals, then each layer's).
fn tensor_keys(hp: &HParams) -> Vec<TensorKey> {
    use TensorKey::*;
    let mut keys = vec![TokenEmbedding, OutputNorm];
    if !hp.tied_embeddings {
        keys.push(Output);
    }
    for l in 0..hp.n_layers {
        keys.extend([AttnNorm(l), Q(l), K(l), V(l), O(l)]);
        if hp.qkv_bias {
            keys.extend([QBias(l), KBias(l), VBias(l)]);
        }
        if hp.qk_norm {
            keys.extend([QNorm(l), KNorm(l)]);
        }
        keys.extend([FfnNorm(l), Gate(l), Up(l), Down(l)]);
    }
    keys
}

/// The GGUF metadata of `hp` (llama.cpp's keys for its architecture).
fn model_keys(w: &mut GgufWriter, hp: &HParams, name: &str) {
    let a = hp.arch.name();
    let u = |v: usize| u32::try_from(v).expect("a model dimension fits 32 bits");
    w.set_str("general.architecture", a);
    w.set_str("general.name", name);
    w.set_u32(&format!("{a}.context_length"), u(hp.context_len));
    w.set_u32(&format!("{a}.embedding_length"), u(hp.hidden));
    w.set_u32(&format!("{a}.block_count"), u(hp.n_layers));
    w.set_u32(&format!("{a}.feed_forward_length"), u(hp.ffn_hidden));
    w.set_u32(&format!("{a}.attention.head_count"), u(hp.n_heads));
    w.set_u32(&format!("{a}.attention.head_count_kv"), u(hp.n_kv_heads));
    if hp.head_dim * hp.n_heads != hp.hidden {
        w.set_u32(&format!("{a}.attention.key_length"), u(hp.head_dim));
        w.set_u32(&format!("{a}.attention.value_length"), u(hp.head_dim));
    }
    w.set_u32(&format!("{a}.rope.dimension_count"), u(hp.head_dim));
    w.set_f32(&format!("{a}.rope.freq_base"), hp.rope_theta);
    w.set_f32(&format!("{a}.attention.layer_norm_rms_epsilon"), hp.rms_eps);
    w.set_u32(&format!("{a}.vocab_size"), u(hp.vocab));
    match hp.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            w.set_str(&format!("{a}.rope.scaling.type"), "linear");
            w.set_f32(&format!("{a}.rope.scaling.factor"), factor);
        }
        RopeScaling::Llama3 {
            original_context, ..
        } => w.set_u32(
            &format!("{a}.rope.scaling.original_context_length"),
            original_context as u32,
        ),
        RopeScaling::Yarn {
            factor,
            original_context,
            ..
        } => {
            w.set_str(&format!("{a}.rope.scaling.type"), "yarn");
            w.set_f32(&format!("{a}.rope.scaling.factor"), factor);
            w.set_u32(
                &format!("{a}.rope.scaling.original_context_length"),
                original_context as u32,
            );
        }
    }
}

/// Llama 3's RoPE scaling as llama.cpp stores it: what each rotated pair's frequency is divided by, as F32 values
/// of the tensor `rope_freqs.weight`; `None` for every other scaling (kept in the metadata).
fn rope_freqs(hp: &HParams) -> Option<Vec<u8>> {
    matches!(hp.rope_scaling, RopeScaling::Llama3 { .. }).then(|| {
        (0..hp.head_dim / 2)
            .flat_map(|i| {
                (hp.rope_scaling.divisor(hp.rope_theta, i, hp.head_dim) as f32).to_le_bytes()
            })
            .collect()
    })
}

/// Whether a GGUF reader recognises this scaling from what [`model_keys`] and [`rope_freqs`] write: llama.cpp's
/// files carry no Llama 3 frequency factors, so readers (verity's among them) take those of every Llama 3.1–3.3
/// release, 1 and 4; nor YaRN's betas or attention factor, so readers take the defaults.
fn rope_scaling_converts(s: RopeScaling) -> bool {
    match s {
        RopeScaling::None | RopeScaling::Linear { .. } => true,
        // llama.cpp's keys carry the factor and the original context; the rest are its defaults.
        RopeScaling::Yarn {
            factor,
            original_context,
            ..
        } => s == RopeScaling::yarn(factor, original_context) && original_context.fract() == 0.0,
        RopeScaling::Llama3 {
            low_freq_factor,
            high_freq_factor,
            original_context,
            ..
        } => {
            low_freq_factor == 1.0
                && high_freq_factor == 4.0
                && original_context.fract() == 0.0
                && original_context >= 1.0
        }
    }
}

/// The tokenizer's GGUF metadata: its vocabulary, BOS/EOS, whether prompts start with BOS, the chat template.
fn tokenizer_keys(w: &mut GgufWriter, bundle: &Bundle, dir: &Path) -> Result<()> {
    let path = dir.join("tokenizer.json");
    let text = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let json: Value = serde_json::from_slice(&text)
        .map_err(|e| Error::malformed(&path, format!("invalid JSON: {e}")))?;
    GgufVocab::from_tokenizer_json(&json)?.write(w);
    let tok = Tokenizer::from_bundle(bundle)?;
    if let Some(bos) = tok.bos {
        w.set_u32("tokenizer.ggml.bos_token_id", bos);
    }
    if let Some(eos) = tok.eos {
        w.set_u32("tokenizer.ggml.eos_token_id", eos);
    }
    w.set_bool("tokenizer.ggml.add_bos_token", tok.add_bos);
    if let Some(t) = &tok.chat_template {
        w.set_str("tokenizer.chat_template", t);
    }
    Ok(())
}

/// The rows of a Llama Q or K projection (`heads` heads of `head_dim` rows of `row_bytes` bytes) in GGUF's
/// rotary order: within each head, row 2i is Hugging Face's row i and row 2i + 1 its row head_dim / 2 + i.
fn interleave_rows(bytes: &[u8], heads: usize, head_dim: usize, row_bytes: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let half = head_dim / 2;
    for h in 0..heads {
        for r in 0..head_dim {
            let from = h * head_dim + if r % 2 == 0 { r / 2 } else { half + r / 2 };
            out.extend_from_slice(&bytes[from * row_bytes..(from + 1) * row_bytes]);
        }
    }
    out
}

/// The heads whose rows a tensor of `key` has reordered into GGUF's rotary order (Llama's Q and K), else 0.
fn rotated_heads(hp: &HParams, key: TensorKey) -> usize {
    match (hp.arch, key) {
        (Arch::Llama, TensorKey::Q(_)) => hp.n_heads,
        (Arch::Llama, TensorKey::K(_)) => hp.n_kv_heads,
        _ => 0,
    }
}

/// What in `hp` the converter does not write, named for the error, or `None`: another architecture, blocks that
/// are not Llama's (a GGUF of the `llama` or `qwen2` architecture would drop a sliding window or a mixture of
/// experts and run differently), or a RoPE scaling no GGUF reader recovers.
fn unconverted(hp: &HParams) -> Option<String> {
    let b = &hp.block;
    if !matches!(hp.arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3) {
        Some(format!("{} bundles", hp.arch.name()))
    } else if b.sliding.is_some() {
        Some("sliding-window attention layers".into())
    } else if b.moe.is_some() || b.linear.is_some() {
        Some("mixture-of-experts or linear-attention layers".into())
    } else if *b != BlockStyle::default() {
        Some(format!(
            "{} blocks that differ from Llama's: {b:?}",
            hp.arch.name()
        ))
    } else if !rope_scaling_converts(hp.rope_scaling) {
        Some(format!("RoPE scaling {:?}", hp.rope_scaling))
    } else {
        None
    }
}

/// Write the bundle at `dir` as a GGUF of its float weights to `out` (see the module doc).
pub fn write_gguf(dir: &Path, out: &Path) -> Result<()> {
    let bundle = Bundle::open(dir)?;
    let hp = &bundle.hparams;
    let Source::Safetensors { tensors, .. } = &bundle.source else {
        return Err(Error::Invalid(format!(
            "{}: not a safetensors bundle",
            dir.display()
        )));
    };
    if let Some(what) = unconverted(hp) {
        return Err(Error::Unsupported(format!(
            "{}: converting {what} to GGUF (verity converts dense Llama, Qwen2 and Qwen3 bundles with full \
             attention, unscaled or with linear, Llama 3 or YaRN RoPE scaling)",
            dir.display(),
        )));
    }
    let mut w = GgufWriter::new();
    let name = dir
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
    model_keys(&mut w, hp, &name);
    tokenizer_keys(&mut w, &bundle, dir)?;
    let freqs = rope_freqs(hp);
    if let Some(f) = &freqs {
        w.add_tensor(TensorEntry {
            name: "rope_freqs.weight".into(),
            dims: vec![f.len() / 4],
            ty: GgmlType::F32,
        })?;
    }
    let keys = tensor_keys(hp);
    let mut sources = Vec::with_capacity(keys.len());
    for key in &keys {
        let name = bundle.tensor_name(*key);
        let t = tensors
            .get(&name)
            .ok_or_else(|| Error::Invalid(tensors.why_missing(&name)))?;
        // The rows the rotary reordering moves must be the heads the config declares.
        let heads = rotated_heads(hp, *key);
        if heads > 0 && t.shape.first() != Some(&(heads * hp.head_dim)) {
            return Err(Error::tensor(
                &name,
                format!(
                    "shape {:?}: the config's {heads} heads of {} rows",
                    t.shape, hp.head_dim
                ),
            ));
        }
        let ty = match t.dtype {
            StDtype::F32 => GgmlType::F32,
            StDtype::F16 => GgmlType::F16,
            StDtype::BF16 => GgmlType::BF16,
            _ => {
                return Err(Error::tensor(
                    &name,
                    format!("stored as {}: only F32, F16 and BF16 convert", t.dtype_name),
                ))
            }
        };
        // Norms and biases in F32, as llama.cpp's converter writes every 1-D tensor (its kernels multiply and
        // add only f32 vectors).
        let (ty, payload) = if t.shape.len() == 1 {
            let floats = bundle.values(*key, &t.shape)?;
            let bytes = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
            (GgmlType::F32, Payload::Floats(bytes))
        } else {
            (ty, Payload::Stored(t.clone()))
        };
        w.add_tensor(TensorEntry {
            name: key.gguf_in(hp.arch),
            dims: t.shape.iter().rev().copied().collect(),
            ty,
        })?;
        sources.push((*key, payload));
    }
    super::write_then_rename(out, |partial| {
        write_tensors(&w, tensors, hp, freqs.as_deref(), &sources, partial)
    })
}

/// A tensor's data as the file takes it: the stored bytes, or values converted to f32 bytes.
enum Payload {
    Stored(StTensor),
    Floats(Vec<u8>),
}

/// The file: `w`'s header, then the tensors in its order (`rope_freqs` first where there is one).
fn write_tensors(
    w: &GgufWriter,
    tensors: &SafetensorsSet,
    hp: &HParams,
    rope_freqs: Option<&[u8]>,
    sources: &[(TensorKey, Payload)],
    out: &Path,
) -> Result<()> {
    let io = |e| Error::io(out, e);
    let mut file = BufWriter::new(File::create(out).map_err(io)?);
    file.write_all(&w.header()).map_err(io)?;
    if let Some(f) = rope_freqs {
        w.write_data(&mut file, f).map_err(io)?;
    }
    for (key, payload) in sources {
        let t = match payload {
            Payload::Stored(t) => t,
            Payload::Floats(bytes) => {
                w.write_data(&mut file, bytes).map_err(io)?;
                continue;
            }
        };
        let bytes = tensors.bytes(t);
        let bytes = bytes.as_slice();
        let heads = rotated_heads(hp, *key);
        if heads > 0 {
            let row_bytes = bytes.len() / (heads * hp.head_dim);
            w.write_data(
                &mut file,
                &interleave_rows(bytes, heads, hp.head_dim, row_bytes),
            )
            .map_err(io)?;
        } else {
            w.write_data(&mut file, bytes).map_err(io)?;
        }
    }
    file.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_q_rows_take_the_interleaved_rotary_order() {
        // Two heads of 4 rows, one byte a row: per head [a0 a1 b0 b1] -> [a0 b0 a1 b1].
        let hf = [0u8, 1, 2, 3, 10, 11, 12, 13];
        assert_eq!(interleave_rows(&hf, 2, 4, 1), [0, 2, 1, 3, 10, 12, 11, 13]);
        let wide: Vec<u8> = (0..8u8).flat_map(|r| [r, r]).collect();
        assert_eq!(
            interleave_rows(&wide, 1, 8, 2),
            [0, 0, 4, 4, 1, 1, 5, 5, 2, 2, 6, 6, 3, 3, 7, 7]
        );
    }
}
