//! Text in and out: tokenizers (from `tokenizer.json` or GGUF metadata), chat templates, streaming detokenization.

mod gguf_vocab;
mod template;
mod tokenizer;

pub use template::{ChatTemplate, Message};
pub use tokenizer::{StreamDecoder, Tokenizer};
