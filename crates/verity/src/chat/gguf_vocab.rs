//! A `tokenizer.json` equivalent built from GGUF tokenizer metadata (`tokenizer.ggml.*`), so that GGUF bundles
//! run through the same `tokenizers` implementation as Hugging Face bundles.
//!
//! Supported: `gpt2`-model (byte-level BPE) vocabularies with the pre-tokenizers llama.cpp names `default`/`gpt-2`,
//! `smollm`, `llama-bpe`/`llama3`, `qwen2`, whose regexes are those of the models' own tokenizer.json; and
//! `llama`-model (SentencePiece BPE) vocabularies — pieces with scores, spaces as `▁`, `<0xNN>` byte fallback
//! (Llama 2, Gemma) — as Hugging Face's converter represents them: a BPE whose merges are every split of a piece
//! into two pieces, ranked by the merged piece's score (llama.cpp merges the adjacent pair whose union scores
//! highest, which these ranks reproduce).

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::bundle::gguf::GgufFile;
use crate::bundle::gguf_writer::GgufWriter;
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
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    match model {
        "gpt2" => byte_level_bpe(g),
        "llama" => sentencepiece_bpe(g),
        _ => Err(Error::Unsupported(format!(
            "{}: tokenizer model {model:?} (verity reads gpt2 byte-level BPE and llama SentencePiece BPE from \
             GGUF)",
            g.path.display()
        ))),
    }
}

/// The vocabulary's strings, and its control and user-defined tokens as tokenizer.json's added tokens.
fn vocabulary(g: &GgufFile) -> Result<(Vec<&str>, Vec<Value>)> {
    let bad = |m: String| Error::malformed(&g.path, m);
    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad("tokenizer.ggml.tokens is missing".into()))?;
    let types = g
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array());
    let mut strings = Vec::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let s = t
            .as_str()
            .ok_or_else(|| bad(format!("token {id} is not a string")))?;
        strings.push(s);
        let ty = types
            .and_then(|a| a.get(id))
            .and_then(|v| v.as_u64())
            .unwrap_or(1);
        if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
            added.push(json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                              "normalized": false, "special": ty == TYPE_CONTROL}));
        }
    }
    Ok((strings, added))
}

fn vocab_map(strings: &[&str]) -> serde_json::Map<String, Value> {
    strings
        .iter()
        .enumerate()
        .map(|(id, s)| (s.to_string(), json!(id)))
        .collect()
}

/// SentencePiece BPE (`llama` model): the merges of every piece split into two pieces of the vocabulary, a
/// piece's splits in the order of their pieces' ids, all ranked by the merged piece's score, highest first
/// (stable, so equal scores keep vocabulary order).
fn sentencepiece_bpe(g: &GgufFile) -> Result<Value> {
    let bad = |m: String| Error::malformed(&g.path, m);
    let (strings, added) = vocabulary(g)?;
    let scores = g
        .get("tokenizer.ggml.scores")
        .and_then(|v| v.as_array())
        .filter(|a| a.len() == strings.len())
        .ok_or_else(|| bad("tokenizer.ggml.scores is missing or not one per token".into()))?;
    let scores: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_f64()
                .ok_or_else(|| bad(format!("score {i} is not a number")))
        })
        .collect::<Result<_>>()?;
    let index: HashMap<&str, usize> = strings.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let mut merges: Vec<(f64, usize, usize)> = Vec::new();
    for (id, piece) in strings.iter().enumerate() {
        let start = merges.len();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (index.get(l), index.get(r)) {
                merges.push((scores[id], l, r));
            }
        }
        merges[start..].sort_by_key(|&(_, l, r)| (l, r));
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    let merges: Vec<Value> = merges
        .iter()
        .map(|&(_, l, r)| json!([strings[l], strings[r]]))
        .collect();
    let flag = |k: &str, default: bool| g.get(k).and_then(|v| v.as_bool()).unwrap_or(default);
    // llama.cpp puts a space before the text where the vocabulary asks (Llama 2; not Gemma).
    let space_prefix = flag("tokenizer.ggml.add_space_prefix", true);
    let spaces = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if space_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, spaces]})
    } else {
        spaces
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let unk = g
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(|v| v.as_u64())
        .and_then(|id| strings.get(id as usize).copied());
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab_map(&strings), "merges": merges}
    }))
}

/// The byte-level pre-tokenizers verity knows, by the name llama.cpp gives them (`tokenizer.ggml.pre`), as
/// the models' own tokenizer.json writes them.
fn pre_tokenizers() -> [(&'static str, Value); 4] {
    [
        ("gpt-2", byte_level(true)),
        (
            "smollm",
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        ),
        (
            "llama-bpe",
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
        ),
        (
            "qwen2",
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
        ),
    ]
}

/// A vocabulary as GGUF tokenizer metadata: what [`tokenizer_json`] reads back.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.pre`.
    pub pre: &'static str,
    /// `tokenizer.ggml.tokens`, by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 3 control (special added tokens), 4 user-defined (other added
    /// tokens).
    pub token_type: Vec<i32>,
    /// `tokenizer.ggml.merges`, `"left right"`, by rank.
    pub merges: Vec<String>,
}

impl GgufVocab {
    /// A Hugging Face byte-level BPE tokenizer.json as GGUF metadata (`gpt2` model), for the pre-tokenizers
    /// verity knows.
    pub fn from_tokenizer_json(tok: &Value) -> Result<Self> {
        let bad = |m: &str| Error::Unsupported(format!("tokenizer.json: {m}"));
        let model = &tok["model"];
        if model["type"] != "BPE" || model["byte_fallback"] == true {
            return Err(bad(
                "only byte-level BPE vocabularies convert to GGUF (`gpt2` model)",
            ));
        }
        let pre = pre_tokenizers()
            .into_iter()
            .find(|(_, v)| *v == tok["pre_tokenizer"])
            .map(|(name, _)| name)
            .ok_or_else(|| {
                bad("its pre-tokenizer is none of those verity knows (gpt-2, smollm, llama-bpe, qwen2)")
            })?;
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| bad("model.vocab is not a map"))?;
        let added = tok["added_tokens"].as_array().map_or(0, Vec::len);
        // Every id lies below the count of tokens (a gap is refused below), so none sizes the table.
        let mut by_id: Vec<Option<(String, i32)>> = vec![None; vocab.len() + added];
        let total = by_id.len();
        let mut put = |id: Option<u64>, s: &str, ty: i32| -> Result<()> {
            let id = id.ok_or_else(|| bad("a token id is not a number"))?;
            let slot = usize::try_from(id)
                .ok()
                .and_then(|i| by_id.get_mut(i))
                .ok_or_else(|| bad(&format!("token id {id} lies past its {total} tokens")))?;
            *slot = Some((s.to_string(), ty));
            Ok(())
        };
        for (s, id) in vocab {
            put(id.as_u64(), s, 1)?;
        }
        for a in tok["added_tokens"].as_array().into_iter().flatten() {
            let content = a["content"]
                .as_str()
                .ok_or_else(|| bad("an added token has no content"))?;
            let ty = if a["special"] == true {
                TYPE_CONTROL
            } else {
                TYPE_USER_DEFINED
            };
            put(a["id"].as_u64(), content, ty as i32)?;
        }
        // An added token may repeat a vocabulary entry: the slots past the highest id are then unused.
        let used = by_id.iter().rposition(Option::is_some).map_or(0, |i| i + 1);
        let (tokens, token_type) = by_id
            .into_iter()
            .take(used)
            .map(|t| t.ok_or_else(|| bad("its token ids leave a gap")))
            .collect::<Result<(Vec<String>, Vec<i32>)>>()?;
        let merges = model["merges"]
            .as_array()
            .ok_or_else(|| bad("model.merges is not a list"))?
            .iter()
            .map(|m| match m {
                Value::String(s) => Ok(s.clone()),
                Value::Array(p) => match (
                    p.first().and_then(|l| l.as_str()),
                    p.get(1).and_then(|r| r.as_str()),
                ) {
                    (Some(l), Some(r)) if p.len() == 2 => Ok(format!("{l} {r}")),
                    _ => Err(bad("a merge is not a pair of strings")),
                },
                _ => Err(bad("a merge is neither a string nor a pair")),
            })
            .collect::<Result<_>>()?;
        Ok(GgufVocab {
            pre,
            tokens,
            token_type,
            merges,
        })
    }

    /// The vocabulary's keys in a GGUF under construction.
    pub fn write(&self, w: &mut GgufWriter) {
        w.set_str("tokenizer.ggml.model", "gpt2");
        w.set_str("tokenizer.ggml.pre", self.pre);
        w.set_str_array("tokenizer.ggml.tokens", &self.tokens);
        w.set_i32_array("tokenizer.ggml.token_type", &self.token_type);
        w.set_str_array("tokenizer.ggml.merges", &self.merges);
    }
}

/// Byte-level BPE (`gpt2` model) with the pre-tokenizer llama.cpp names.
fn byte_level_bpe(g: &GgufFile) -> Result<Value> {
    let bad = |m: String| Error::malformed(&g.path, m);
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    // `gpt2`: what verity's converter wrote before it took llama.cpp's name.
    let name = match pre {
        "default" | "gpt2" => "gpt-2",
        "llama3" => "llama-bpe",
        other => other,
    };
    let Some((_, pre_tokenizer)) = pre_tokenizers().into_iter().find(|(n, _)| *n == name) else {
        return Err(Error::Unsupported(format!(
            "{}: GGUF pre-tokenizer {pre:?} (verity knows default, gpt-2, smollm, llama-bpe, qwen2)",
            g.path.display()
        )));
    };
    let (strings, added) = vocabulary(g)?;
    let merges = g
        .get("tokenizer.ggml.merges")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad("tokenizer.ggml.merges is missing".into()))?;
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
                  "vocab": vocab_map(&strings), "merges": merges}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::gguf::MetaValue;
    use std::path::{Path, PathBuf};

    fn fixture(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf")
            .join(path)
    }

    /// A GGUF holding nothing but `vocab`'s keys, read back.
    fn gguf_of(vocab: &GgufVocab, name: &str) -> GgufFile {
        let mut w = GgufWriter::new();
        w.set_str("general.architecture", "llama");
        vocab.write(&mut w);
        let path =
            std::env::temp_dir().join(format!("verity-vocab-{name}-{}.gguf", std::process::id()));
        std::fs::write(&path, w.header()).unwrap();
        let g = GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        g
    }

    fn strings(v: &MetaValue) -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn a_gguf_vocabulary_comes_back_from_its_tokenizer_json_key_for_key() {
        let g = GgufFile::open(&fixture("llama-rope-llama3-gguf/model.gguf")).unwrap();
        let back = GgufVocab::from_tokenizer_json(&tokenizer_json(&g).unwrap()).unwrap();
        assert_eq!(
            back.tokens,
            strings(g.get("tokenizer.ggml.tokens").unwrap())
        );
        assert_eq!(
            back.merges,
            strings(g.get("tokenizer.ggml.merges").unwrap())
        );
        let types: Vec<i32> = g
            .get("tokenizer.ggml.token_type")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as i32)
            .collect();
        assert_eq!(back.token_type, types);
        let pre = g.get("tokenizer.ggml.pre").and_then(|p| p.as_str());
        assert_eq!(
            back.pre,
            match pre {
                None | Some("default") => "gpt-2",
                Some("llama3") => "llama-bpe",
                Some(p) => p,
            }
        );
    }

    #[test]
    fn a_tokenizer_json_written_as_gguf_tokenizes_as_it_did() {
        let path = fixture("llama-f32/tokenizer.json");
        let json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let vocab = GgufVocab::from_tokenizer_json(&json).unwrap();
        let back = tokenizer_json(&gguf_of(&vocab, "llama-f32")).unwrap();
        let want = tokenizers::Tokenizer::from_file(&path).unwrap();
        let got = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&back).unwrap()).unwrap();
        for text in [
            "Hello, world! 12345 tokens",
            "<|im_start|>user\nfn main() { println!(\"hi\"); }<|im_end|>",
            "  spaces\tand\nnewlines  ",
            "naïve café — ünïcödé",
        ] {
            let (w, g) = (
                want.encode(text, false).unwrap(),
                got.encode(text, false).unwrap(),
            );
            assert_eq!(w.get_ids(), g.get_ids(), "{text:?}");
            assert_eq!(
                want.decode(w.get_ids(), false).unwrap(),
                got.decode(g.get_ids(), false).unwrap(),
                "{text:?}"
            );
        }
    }

    #[test]
    fn vocabularies_gguf_cannot_carry_and_ids_past_the_vocabulary_are_refused() {
        let path = fixture("llama-f32/tokenizer.json");
        let mut json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let mut far = json.clone();
        far["added_tokens"][0]["id"] = json!(u64::MAX);
        assert!(GgufVocab::from_tokenizer_json(&far).is_err());
        json["pre_tokenizer"] = json!({"type": "Whitespace"});
        assert!(GgufVocab::from_tokenizer_json(&json).is_err());
        json["model"]["type"] = json!("WordPiece");
        assert!(GgufVocab::from_tokenizer_json(&json).is_err());
    }
}
