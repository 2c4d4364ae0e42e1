//! Constrained answers with llguidance: `response_format` JSON (any object, or a JSON schema) and forced tool
//! calls (`tool_choice: required` or a named function) as a grammar over the `<tool_call>` format that
//! [`verity::chat::OutputParser`] reads.
//!
//! The vocabulary is indexed once per model (a byte trie of every token, special tokens behind llguidance's
//! marker byte so no grammar can produce them as text); each request gets its own matcher. Constrained requests
//! decode on the verified AR path (see [`verity::sample::constraint`]).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use verity::chat::Tokenizer;
use verity::sample::constraint::Constraint;

/// The model's vocabulary indexed for grammars.
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl Grammars {
    /// Index the tokenizer's vocabulary, padded to the model's `vocab` (ids past the tokenizer never match).
    pub fn new(tok: &Tokenizer, vocab: usize) -> Result<Self, String> {
        let eos = tok
            .eos()
            .ok_or("the tokenizer has no end-of-sequence token")?;
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tok.token_bytes(id) {
                Some(b) => b,
                None => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tok.token_str(id).unwrap_or_default().into_bytes());
                    w
                }
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env = Arc::new(ApproximateTokEnv::new(trie));
        let factory = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv))
            .map_err(|e| e.to_string())?;
        Ok(Grammars {
            factory: Arc::new(factory),
        })
    }

    fn matcher(&self, grammar: TopLevelGrammar) -> Result<Grammar, String> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(Grammar(m)),
        }
    }

    /// Any JSON object (`json_object`), or a value of `schema` (`json_schema`).
    pub fn json(&self, schema: Option<&Value>) -> Result<Grammar, String> {
        let schema = schema
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}));
        self.matcher(TopLevelGrammar::from_json_schema(schema))
    }

    /// One or more `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks calling the given functions
    /// (OpenAI `function` objects), with arguments valid for each function's `parameters` schema.
    pub fn tool_calls(&self, functions: &[&Value]) -> Result<Grammar, String> {
        let mut alts = Vec::new();
        let mut rules = String::new();
        for (i, f) in functions.iter().enumerate() {
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or("a tool without a name")?;
            let params = f
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| serde_json::json!({"type": "object"}));
            let schema = serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            });
            rules.push_str(&format!("call{i}: %json {schema}\n"));
            alts.push(format!("call{i}"));
        }
        let lark = format!(
            "start: block+\nblock: \"<tool_call>\\n\" ({}) \"\\n</tool_call>\"\n{rules}",
            alts.join(" | ")
        );
        self.matcher(TopLevelGrammar::from_lark(lark))
    }
}

/// One request's grammar state.
pub struct Grammar(Matcher);

impl Constraint for Grammar {
    fn allowed(&mut self, allowed: &mut [bool]) -> verity::Result<()> {
        let mask = self
            .0
            .compute_mask()
            .map_err(|e| verity::Error::Invalid(format!("grammar: {e}")))?;
        mask.iter_set_entries(|i| {
            if let Some(a) = allowed.get_mut(i) {
                *a = true;
            }
        });
        Ok(())
    }

    fn commit(&mut self, token: u32) -> verity::Result<()> {
        self.0
            .consume_token(token)
            .map_err(|e| verity::Error::Invalid(format!("grammar: {e}")))
    }

    fn finished(&self) -> bool {
        self.0.is_stopped()
    }
}
