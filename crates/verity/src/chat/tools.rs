//! Tool use with a chat template that knows no tools: the tools are described in the system message, and
//! earlier calls and their results are written into the conversation in the tagged format that
//! [`super::OutputParser`] reads back (`<tool_call>{json}</tool_call>`, results in `<tool_response>`).

use serde_json::Value;

use super::Message;

/// The system-message text that offers `tools` (OpenAI `tools` array) to the model.
pub fn describe_tools(tools: &Value) -> String {
    let mut s = String::from(
        "You can call functions to help answer. The available functions, one JSON signature per line:\n<tools>\n",
    );
    for t in tools.as_array().into_iter().flatten() {
        let f = t.get("function").unwrap_or(t);
        s.push_str(&f.to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\nTo call a function, answer with one block per call and nothing else:\n\
         <tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>\n\
         The results come back in <tool_response></tool_response> blocks.",
    );
    s
}

/// `messages` rewritten for a template without tool support: the tool description joins the system message,
/// assistant tool calls become tagged text and tool results become user turns.
pub fn for_plain_template(messages: &[Message], tools: Option<&Value>) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    if let Some(tools) = tools {
        let text = describe_tools(tools);
        match messages.first() {
            Some(m) if m.role == "system" => {}
            _ => out.push(Message::new("system", &text)),
        }
    }
    for (i, m) in messages.iter().enumerate() {
        match m.role.as_str() {
            "system" if i == 0 && tools.is_some() => {
                let text = describe_tools(tools.expect("checked"));
                out.push(Message::new("system", &format!("{}\n\n{text}", m.content)));
            }
            "assistant" if m.tool_calls.is_some() => {
                let mut text = m.content.clone();
                for c in m.tool_calls.iter().flatten() {
                    let f = c.get("function").unwrap_or(c);
                    let call = serde_json::json!({
                        "name": f.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": f.get("arguments").cloned().unwrap_or(Value::Null),
                    });
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(Message::new("assistant", &text));
            }
            "tool" => {
                let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
                match out.last_mut() {
                    // Results of one round of calls go back together.
                    Some(prev)
                        if prev.role == "user" && prev.content.ends_with("</tool_response>") =>
                    {
                        prev.content.push('\n');
                        prev.content.push_str(&block);
                    }
                    _ => out.push(Message::new("user", &block)),
                }
            }
            _ => out.push(Message::new(&m.role, &m.content)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::OutputParser;

    #[test]
    fn a_tool_round_trip_is_written_as_tagged_text_the_parser_reads_back() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "add", "parameters": {}}}]);
        let call = serde_json::json!({"type": "function", "function": {"name": "add", "arguments": {"a": 1}}});
        let msgs = vec![
            Message::new("user", "1+?"),
            Message {
                tool_calls: Some(vec![call]),
                ..Message::new("assistant", "")
            },
            Message::new("tool", "2"),
            Message::new("tool", "3"),
        ];
        let out = for_plain_template(&msgs, Some(&tools));
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(out[0].content.contains("\"name\":\"add\""));
        assert_eq!(
            out[3].content,
            "<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n</tool_response>"
        );
        let parsed = OutputParser::new(false, false, true).split_all(&out[2].content);
        assert_eq!(parsed.tool_calls[0].name, "add");
        assert_eq!(parsed.tool_calls[0].arguments, "{\"a\":1}");
    }
}
