//! The tokenizer of a bundle: the `tokenizers` crate over `tokenizer.json` (or its GGUF equivalent), plus the
//! special tokens that matter to generation (BOS, EOS, end-of-turn).

use std::ops::Range;
use std::path::Path;

use aho_corasick::AhoCorasick;
use serde_json::Value;

use super::gguf_vocab;
use crate::bundle::gguf::GgufFile;
use crate::bundle::{Bundle, Source};
use crate::error::{Error, Result};

/// Token strings that end a turn in the chat formats verity knows (llama.cpp's end-of-generation list).
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer reading special-token text as plain text: for what users wrote, where only the chat
    /// template's own markers may be control tokens.
    literal: tokenizers::Tokenizer,
    /// Finds the text of any special (control) token in one pass, however many the vocabulary has (thousands in
    /// some: reserved and unused tokens).
    special_texts: AhoCorasick,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Prepend BOS when encoding a prompt.
    pub add_bos: bool,
    /// Tokens that end generation: EOS and the end-of-turn tokens present in the vocabulary.
    pub stop_tokens: Vec<u32>,
    /// The chat template shipped with the bundle, if any.
    pub chat_template: Option<String>,
}

impl Tokenizer {
    pub fn from_bundle(bundle: &Bundle) -> Result<Self> {
        match &bundle.source {
            Source::Gguf(g) => Self::from_gguf(g),
            Source::Safetensors { dir, config, .. } => {
                let cfg_eos = config.eos_token_id.as_ref().and_then(first_id);
                let cfg_bos = config.bos_token_id.as_ref().and_then(first_id);
                Self::from_dir(dir, cfg_bos, cfg_eos)
            }
        }
    }

    /// The tokenizer of a GGUF file's `tokenizer.*` metadata (whatever architecture the file holds).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let json = gguf_vocab::tokenizer_json(g)?;
        let inner = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&json).expect("json"))
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", g.path.display())))?;
        let id = |k: &str| g.get(k).and_then(|v| v.as_u64());
        let template = g
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(String::from);
        let add_bos = g
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Self::assemble(
            &g.path,
            inner,
            id("tokenizer.ggml.bos_token_id"),
            id("tokenizer.ggml.eos_token_id"),
            add_bos,
            template,
        )
    }

    fn from_dir(dir: &Path, cfg_bos: Option<u64>, cfg_eos: Option<u64>) -> Result<Self> {
        let tj = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&tj)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", tj.display())))?;
        let tc_path = dir.join("tokenizer_config.json");
        let tc: Value = if tc_path.is_file() {
            let text = std::fs::read_to_string(&tc_path).map_err(|e| Error::io(&tc_path, e))?;
            serde_json::from_str(&text)
                .map_err(|e| Error::malformed(&tc_path, format!("invalid JSON: {e}")))?
        } else {
            Value::Null
        };
        let token_id = |key: &str| -> Option<u64> {
            let v = tc.get(key)?;
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(s).map(u64::from)
        };
        let bos = token_id("bos_token").or(cfg_bos);
        let eos = token_id("eos_token").or(cfg_eos);
        let add_bos = tc
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let template = match tc.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => {
                let jinja = dir.join("chat_template.jinja");
                std::fs::read_to_string(jinja).ok()
            }
        };
        Self::assemble(&dir.join("config.json"), inner, bos, eos, add_bos, template)
    }

    /// The tokenizer, once its BOS and EOS ids (as `origin` gives them) are checked to be tokens of it: an id
    /// past the vocabulary would index past the embedding table, or never stop a generation.
    fn assemble(
        origin: &Path,
        inner: tokenizers::Tokenizer,
        bos: Option<u64>,
        eos: Option<u64>,
        add_bos: bool,
        chat_template: Option<String>,
    ) -> Result<Self> {
        let vocab = inner.get_vocab_size(true);
        let checked = |what: &str, id: Option<u64>| -> Result<Option<u32>> {
            match id {
                Some(id) if id >= vocab as u64 => Err(Error::malformed(
                    origin,
                    format!("{what} id {id} is outside the vocabulary ({vocab} tokens)"),
                )),
                id => Ok(id.map(|i| i as u32)),
            }
        };
        let (bos, eos) = (checked("BOS", bos)?, checked("EOS", eos)?);
        let mut stop_tokens: Vec<u32> = eos.into_iter().collect();
        for s in END_OF_TURN {
            if let Some(id) = inner.token_to_id(s) {
                // Only tokens the chat template uses (or EOS itself): a base model's `</s>` in the middle of
                // a vocabulary must not end generation unless it is EOS.
                let used = chat_template.as_deref().is_some_and(|t| t.contains(s));
                if used && !stop_tokens.contains(&id) {
                    stop_tokens.push(id);
                }
            }
        }
        let mut literal = inner.clone();
        literal.set_encode_special_tokens(true);
        let specials: Vec<String> = inner
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        let special_texts = AhoCorasick::new(&specials)
            .map_err(|e| Error::Tokenizer(format!("special tokens: {e}")))?;
        Ok(Tokenizer {
            inner,
            literal,
            special_texts,
            bos,
            eos,
            add_bos: add_bos && bos.is_some(),
            stop_tokens,
            chat_template,
        })
    }

    /// Encode text; special-token strings in it (e.g. from a rendered chat template) become their tokens.
    /// With `add_bos`, BOS is prepended if the tokenizer asks for it and the text does not already start with it.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        self.encode_with_literals(text, &[], add_bos)
    }

    /// Encode text whose byte ranges `literals` (sorted, disjoint) are what a user wrote: special-token text
    /// inside them stays text, so a message cannot forge the template's turn markers. The rest is encoded as
    /// [`Tokenizer::encode`] does. Each literal range is encoded on its own, so token merges never cross its
    /// edges.
    pub fn encode_with_literals(
        &self,
        text: &str,
        literals: &[Range<usize>],
        add_bos: bool,
    ) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut piece = |tok: &tokenizers::Tokenizer, part: &str| -> Result<()> {
            if !part.is_empty() {
                let enc = tok
                    .encode(part, false)
                    .map_err(|e| Error::Tokenizer(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Ok(())
        };
        let mut at = 0;
        for r in literals {
            let (Some(before), Some(lit)) = (text.get(at..r.start), text.get(r.clone())) else {
                return Err(Error::Invalid(format!(
                    "literal range {r:?} is not ordered within the text or splits a character"
                )));
            };
            piece(&self.inner, before)?;
            piece(&self.literal, lit)?;
            at = r.end;
        }
        piece(&self.inner, &text[at..])?;
        if add_bos && self.add_bos {
            let bos = self.bos.expect("add_bos implies bos");
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Encode text a user wrote, all of it literal ([`Tokenizer::encode_with_literals`]).
    pub fn encode_literal(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        self.encode_with_literals(text, std::slice::from_ref(&(0..text.len())), add_bos)
    }

    /// Whether `text` holds the text of a special (control) token.
    pub fn mentions_special(&self, text: &str) -> bool {
        self.special_texts.is_match(text)
    }

    /// Decode ids to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Decode ids to text, keeping special tokens.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_tokens.contains(&id)
    }

    /// The end-of-sequence token, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `id` is a special (control) token rather than text.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    /// The bytes a text token stands for (what a grammar engine matches against); `None` for special tokens and
    /// unknown ids. Byte-level BPE tokens map through the GPT-2 byte alphabet; SentencePiece tokens through `▁`
    /// and `<0xNN>` byte fallbacks.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if self.is_special(id) {
            return None;
        }
        let piece = self.inner.id_to_token(id)?;
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        if byte_level {
            return piece.chars().map(byte_level_byte).collect();
        }
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return Some(vec![b]);
            }
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }
}

/// The byte a character of the GPT-2 byte-level alphabet stands for: printable bytes are themselves, the others
/// were shifted to U+0100 and up in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 && printable(c) {
        return Some(c as u8);
    }
    let n = c.checked_sub(256)?;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

fn first_id(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::Array(a) => a.first().and_then(first_id),
        _ => None,
    }
}

/// Incremental detokenization for streaming: emits text only once it is complete UTF-8 and stable.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a token; returns the new text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let delta = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }
}
