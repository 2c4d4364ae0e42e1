//! Text in and out: tokenizers (from `tokenizer.json` or GGUF metadata), chat templates, streaming detokenization,
//! and splitting generated text into answer, reasoning and tool calls.

pub(crate) mod gguf_vocab;
mod output;
mod template;
mod tokenizer;
pub mod tools;

pub use output::{OutputParser, Split, ToolCall};
pub use template::{ChatTemplate, Message, TemplateArgs};
pub use tokenizer::{StreamDecoder, Tokenizer};
