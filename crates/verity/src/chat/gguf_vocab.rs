//! A `tokenizer.json` equivalent built from GGUF tokenizer metadata (`tokenizer.ggml.*`), so that GGUF bundles
//! run through the same `tokenizers` implementation as Hugging Face bundles.
//!
//! Supported: `gpt2`-model (byte-level BPE) vocabularies with the pre-tokenizers llama.cpp names `default`/`gpt2`,
//! `smollm`, `llama-bpe`/`llama3`, `qwen2`. The pre-tokenizer regexes are those of the models' own tokenizer.json.

use serde_json::{json, Value};

use crate::bundle::gguf::GgufFile;
use crate::error::{Error, Result};

const LLAMA3_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// GGUF token types (llama.cpp `llama_token_type`).
const TYPE_CONTROL: u64 = 3;
const TYPE_USER_DEFINED: u64 = 4;

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// The tokenizer.json (as a JSON value) for a GGUF file's vocabulary.
pub fn tokenizer_json(g: &GgufFile) -> Result<Value> {
    let bad = |m: String| Error::malformed(&g.path, m);
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if model != "gpt2" {
        return Err(Error::Unsupported(format!(
            "{}: tokenizer model {model:?} (verity reads gpt2 byte-level BPE from GGUF)",
            g.path.display()
        )));
    }
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let pre_tokenizer = match pre {
        "default" | "gpt2" => byte_level(true),
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
        other => {
            return Err(Error::Unsupported(format!(
                "{}: GGUF pre-tokenizer {other:?} (verity knows default, gpt2, smollm, llama-bpe, qwen2)",
                g.path.display()
            )))
        }
    };
    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad("tokenizer.ggml.tokens is missing".into()))?;
    let types = g
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array());
    let merges = g
        .get("tokenizer.ggml.merges")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad("tokenizer.ggml.merges is missing".into()))?;

    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let s = t
            .as_str()
            .ok_or_else(|| bad(format!("token {id} is not a string")))?;
        vocab.insert(s.to_string(), json!(id));
        let ty = types
            .and_then(|a| a.get(id))
            .and_then(|v| v.as_u64())
            .unwrap_or(1);
        if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
            added.push(json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                              "normalized": false, "special": ty == TYPE_CONTROL}));
        }
    }
    let merges: Vec<Value> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.as_str()
                .map(|s| json!(s))
                .ok_or_else(|| bad(format!("merge {i} is not a string")))
        })
        .collect::<Result<_>>()?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    }))
}
