//! Chat templates: Hugging Face Jinja templates rendered with minijinja, configured as transformers configures
//! Jinja (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, Python string methods).

use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls, in the form Hugging Face templates read:
    /// `[{"type": "function", "function": {"name": …, "arguments": {…}}}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            ..Message::default()
        }
    }
}

/// What a request adds to the template's context beyond the messages.
#[derive(Debug, Clone, Default)]
pub struct TemplateArgs {
    /// OpenAI-style `tools` (`[{"type": "function", "function": {name, description, parameters}}]`), passed as
    /// the `tools` variable that tool-aware templates read.
    pub tools: Option<serde_json::Value>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// Compile a template; `bos`/`eos` are the token strings the template may reference.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::Template(format!("cannot compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        args: &TemplateArgs,
    ) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .expect("added at construction");
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
            tools => args.tools,
            ..minijinja::Value::from_serialize(&args.kwargs)
        })
        .map_err(|e| Error::Template(e.to_string()))
    }

    /// Whether the template reads the `tools` variable (else tools are described in a system message).
    pub fn knows_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Whether the template formats reasoning blocks (`<think>`).
    pub fn knows_reasoning(&self) -> bool {
        self.source.contains("<think>")
    }
}
