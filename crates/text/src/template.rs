//! Chat templates: the GGUF's own `tokenizer.chat_template`, rendered with minijinja.

use std::ops::Range;

use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::Error;

/// One chat message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's tool calls, as templates read them (`[{"type": "function", "function":
    /// {"name": ..., "arguments": {...}}, "id": ...}]`, the arguments an object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's answer to the call with this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool message's tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's thinking, for templates that print it (Qwen3's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// How a template writes tool calls ([`ChatTemplate::tool_syntax`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    Hermes,
    Json,
    None,
}

/// What a template is rendered with beside the messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct Vars<'a> {
    /// The tools a request offers (`[{"type": "function", "function": {...}}]`, as OpenAI
    /// sends them), in the template's `tools` variable.
    pub tools: Option<&'a serde_json::Value>,
    /// Further variables (`enable_thinking`, ...); the caller keeps them off the names the
    /// renderer sets itself.
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

impl ChatMessage {
    /// A message of `role` saying `content`, with no tool calls.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
            ..Default::default()
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's text, for what it says about formats (tools, thinking).
    source: String,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn template_error(e: minijinja::Error) -> Error {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::Template { message }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the token texts templates may refer to.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        // Templates were written for Hugging Face's `tojson` (Python's `json.dumps`: `, ` and
        // `: ` separators, nothing HTML-escaped); minijinja's escapes `<`, `>`, `&` and `'`,
        // which would show a model tool definitions unlike the ones it was trained on.
        env.add_filter(
            "tojson",
            |v: minijinja::Value,
             indent: Option<usize>,
             kwargs: minijinja::value::Kwargs|
             -> Result<minijinja::Value, minijinja::Error> {
                let indent = match kwargs.get::<Option<usize>>("indent")? {
                    Some(i) => Some(i),
                    None => indent,
                };
                kwargs.assert_all_used()?;
                let json = serde_json::to_value(&v).map_err(|e| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string())
                })?;
                let mut out = String::new();
                python_json(&json, indent, 0, &mut out);
                Ok(minijinja::Value::from_safe_string(out))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// The template a GGUF file carries (`tokenizer.chat_template`), with the file's BOS and EOS
    /// token texts; `None` when the file has none.
    pub fn from_header(
        h: &gguf::Header,
        tokenizer: &crate::Tokenizer,
    ) -> Result<Option<Self>, Error> {
        let Some(src) = h.get("tokenizer.chat_template").and_then(|v| v.as_str()) else {
            return Ok(None);
        };
        let text_of = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_string()
        };
        Self::new(src, &text_of(tokenizer.bos), &text_of(tokenizer.eos)).map(Some)
    }

    /// Renders the conversation, ending with the assistant's turn opener when
    /// `add_generation_prompt` is set.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        self.render_vars(messages, Vars::default(), add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the request's tools and variables.
    pub fn render_vars(
        &self,
        messages: &[ChatMessage],
        vars: Vars<'_>,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let texts: Vec<&str> = (0..2 * messages.len())
            .map(|j| text_of(messages, j).unwrap_or(""))
            .collect();
        self.render_with(messages, &texts, vars, add_generation_prompt)
    }

    /// Renders with `texts` in place of what the messages say: `texts[i]` as message `i`'s
    /// content and `texts[n + i]` as its reasoning (where it has one).
    fn render_with(
        &self,
        messages: &[ChatMessage],
        texts: &[&str],
        vars: Vars<'_>,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let tools = vars.tools;
        let tmpl = self.env.get_template("chat").map_err(template_error)?;
        let n = messages.len();
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let base = context! { role => m.role.clone(), content => texts[i] };
                let extra = context! {
                    tool_calls => m.tool_calls.as_ref().map(|v| minijinja::Value::from(minijinja::value::Serde(v))),
                    tool_call_id => m.tool_call_id.clone(),
                    name => m.name.clone(),
                    reasoning_content => m.reasoning_content.as_ref().map(|_| texts[n + i]),
                };
                if m.tool_calls.is_none()
                    && m.tool_call_id.is_none()
                    && m.name.is_none()
                    && m.reasoning_content.is_none()
                {
                    base
                } else {
                    context! { ..base, ..extra }
                }
            })
            .collect();
        let own = context! {
            messages => messages,
            tools => tools.map(|v| minijinja::Value::from(minijinja::value::Serde(v))),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone(),
            eos_token => self.eos.clone(),
        };
        let ctx = match vars.kwargs {
            // The renderer's own variables come first: a kwarg never replaces them.
            Some(k) if !k.is_empty() => {
                context! { ..own, ..minijinja::Value::from(minijinja::value::Serde(k)) }
            }
            _ => own,
        };
        tmpl.render(ctx).map_err(template_error)
    }

    /// Whether the template prints tools and tool calls in the Hermes format
    /// (`<tool_call>...</tool_call>`, as Qwen2.5's does): the one tool format strata parses.
    pub fn has_hermes_tools(&self) -> bool {
        self.source.contains("<tool_call>") && self.source.contains("tools")
    }

    /// How the template writes tool calls: the Hermes `<tool_call>` tags (Qwen2.5), a bare
    /// JSON object with `parameters` (Llama 3.x: tool results in `ipython` turns), or not at
    /// all (the tools are then described in the system turn by the caller).
    pub fn tool_syntax(&self) -> ToolSyntax {
        if self.has_hermes_tools() {
            ToolSyntax::Hermes
        } else if self.source.contains("tools")
            && self.source.contains("\"parameters\"")
            && (self.source.contains("ipython") || self.source.contains("<|python_tag|>"))
        {
            ToolSyntax::Json
        } else {
            ToolSyntax::None
        }
    }

    /// Whether the template has a thinking section (`<think>...</think>`, as Qwen3's).
    pub fn has_thinking(&self) -> bool {
        self.source.contains("<think>") && self.source.contains("</think>")
    }

    /// Renders the conversation and says which bytes of it came from what the messages say
    /// (their content and reasoning) rather than from the template: those must never be read
    /// as control tokens. The template is rendered once as it is and once with every content
    /// and reasoning replaced by a marker; walking both side by side finds each text (as
    /// written, trimmed, or JSON-escaped, the ways templates print it). A template that
    /// transforms a text in any other way gets the marked rendering with the texts put in as
    /// written: the markup is still the template's own and the texts still plain.
    pub fn render_parts(
        &self,
        messages: &[ChatMessage],
        vars: Vars<'_>,
        add_generation_prompt: bool,
    ) -> Result<Rendered, Error> {
        let real = self.render_vars(messages, vars, add_generation_prompt)?;
        let nonce = marker_nonce();
        // Marker `i` stands for message `i`'s content, marker `n + i` for its reasoning.
        let markers: Vec<String> = (0..2 * messages.len())
            .map(|j| format!("{MARK}{nonce:x}.{j}{MARK}"))
            .collect();
        // An empty text stays empty: templates test content for emptiness (an assistant turn
        // that only calls tools), and a marker would take the other branch.
        let marked_texts: Vec<&str> = markers
            .iter()
            .enumerate()
            .map(|(j, m)| match text_of(messages, j) {
                Some(t) if !t.is_empty() => m.as_str(),
                _ => "",
            })
            .collect();
        let marked = self.render_with(messages, &marked_texts, vars, add_generation_prompt)?;
        let pieces = split_marked(&marked, &markers);
        if let Some(content) = walk(&real, &pieces, messages) {
            return Ok(Rendered {
                text: real,
                content,
            });
        }
        let mut text = String::with_capacity(real.len());
        let mut content = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Literal(l) => text.push_str(l),
                Piece::Content(j) => {
                    let start = text.len();
                    text.push_str(text_of(messages, j).unwrap_or(""));
                    content.push(start..text.len());
                }
            }
        }
        Ok(Rendered { text, content })
    }
}

/// `value` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)` writes it.
fn python_json(value: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_separator = if indent.is_some() { "," } else { ", " };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

/// A rendered conversation and the byte ranges of it that are message text (content and
/// reasoning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// In order, not overlapping.
    pub content: Vec<Range<usize>>,
}

impl Rendered {
    /// The whole text as ranges in order, each saying whether control-token text in it is
    /// parsed (the template's markup) or not (content).
    pub fn parts(&self) -> Vec<(Range<usize>, bool)> {
        let mut parts = Vec::with_capacity(2 * self.content.len() + 1);
        let mut at = 0;
        for c in &self.content {
            if c.start > at {
                parts.push((at..c.start, true));
            }
            parts.push((c.clone(), false));
            at = c.end;
        }
        if at < self.text.len() {
            parts.push((at..self.text.len(), true));
        }
        parts
    }
}

/// Brackets each content marker: a character from a private-use plane, which text rarely
/// holds; with a per-call nonce inside, content cannot forge a marker.
const MARK: char = '\u{10FFFD}';

fn marker_nonce() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now())
}

enum Piece<'a> {
    Literal(&'a str),
    /// Text `j` of the messages ([`text_of`]).
    Content(usize),
}

/// Text `j` of `messages`: message `j`'s content for `j < n`, message `j - n`'s reasoning
/// (if it has one) above.
fn text_of(messages: &[ChatMessage], j: usize) -> Option<&str> {
    let n = messages.len();
    if j < n {
        Some(&messages[j].content)
    } else {
        messages.get(j - n)?.reasoning_content.as_deref()
    }
}

/// The marked rendering as template text and the contents' places, in order.
/// Which of `markers` (`MARK nonce . i MARK`, all with one nonce) `text` starts with.
fn index_of_marker(text: &str, markers: &[String]) -> Option<usize> {
    let first = markers.first()?;
    let prefix_len = first.rfind('.')? + 1;
    let prefix = &first[..prefix_len];
    let digits = text.strip_prefix(prefix)?;
    let n = digits
        .bytes()
        .take(20)
        .take_while(u8::is_ascii_digit)
        .count();
    let i: usize = digits[..n].parse().ok()?;
    let m = markers.get(i)?;
    text.starts_with(m.as_str()).then_some(i)
}

fn split_marked<'a>(marked: &'a str, markers: &[String]) -> Vec<Piece<'a>> {
    let mut pieces = Vec::new();
    let mut rest = marked;
    while let Some(at) = rest.find(MARK) {
        // The marker's index is read from it, not searched for: a text full of marker
        // characters (tool arguments may hold any) costs O(1) per character.
        let found = index_of_marker(&rest[at..], markers).map(|i| (i, &markers[i]));
        let Some((i, m)) = found else {
            // A lone marker character that is no marker: template text.
            let end = at + MARK.len_utf8();
            pieces.push(Piece::Literal(&rest[..end]));
            rest = &rest[end..];
            continue;
        };
        if at > 0 {
            pieces.push(Piece::Literal(&rest[..at]));
        }
        pieces.push(Piece::Content(i));
        rest = &rest[at + m.len()..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Literal(rest));
    }
    pieces
}

/// Matches the marked pieces against the real rendering: template text must be the same, and
/// each content must appear as some rendering of it followed by the next template text. The
/// content ranges, or `None` if the two renderings do not line up.
fn walk(real: &str, pieces: &[Piece<'_>], messages: &[ChatMessage]) -> Option<Vec<Range<usize>>> {
    let mut at = 0;
    let mut content = Vec::new();
    for (k, piece) in pieces.iter().enumerate() {
        match piece {
            Piece::Literal(l) => {
                if !real[at..].starts_with(l) {
                    return None;
                }
                at += l.len();
            }
            Piece::Content(j) => {
                let next = match pieces.get(k + 1) {
                    Some(Piece::Literal(l)) => *l,
                    _ => "",
                };
                let c = text_of(messages, *j).unwrap_or("");
                let escaped = serde_json::to_string(c).ok()?;
                let escaped = &escaped[1..escaped.len() - 1];
                let shown = [c, c.trim(), c.trim_start(), c.trim_end(), escaped]
                    .into_iter()
                    .find(|s| {
                        real[at..].starts_with(s)
                            && (next.is_empty() || real[at + s.len()..].starts_with(next))
                    })?;
                content.push(at..at + shown.len());
                at += shown.len();
            }
        }
    }
    (at == real.len()).then_some(content)
}

#[cfg(test)]
mod tests {
    #[test]
    fn template_variables_reach_the_template_but_never_replace_its_own() {
        let t = ChatTemplate::new(
            "{{ messages[0].content }}|{% if enable_thinking is defined %}{{ enable_thinking }}{% endif %}|{{ add_generation_prompt }}",
            "",
            "",
        )
        .unwrap();
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        kwargs.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(false),
        );
        let vars = Vars {
            tools: None,
            kwargs: Some(&kwargs),
        };
        let out = t
            .render_vars(&[ChatMessage::new("user", "hi")], vars, true)
            .unwrap();
        assert_eq!(
            out, "hi|False|True",
            "Python spells booleans as templates expect"
        );
    }

    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    #[test]
    fn chatml_with_own_system_message_matches_the_reference_prompt() {
        let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap();
        let out = t
            .render(
                &[
                    msg("system", "You are a helpful assistant."),
                    msg("user", "What is 2+2?"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_inserts_the_default_system_message() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let out = t.render(&[msg("user", "hi")], false).unwrap();
        assert!(out.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
        assert!(out.ends_with("<|im_start|>user\nhi<|im_end|>\n"));
    }

    #[test]
    fn raise_exception_becomes_a_template_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], true).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip() }}", "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "  x  ")], false).unwrap(), "x");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'] | tojson }}|{{ tools | tojson }}|{{ tools | tojson(indent=2) }}",
            "",
            "",
        )
        .unwrap();
        let tools: serde_json::Value = serde_json::from_str(
            r#"{"d": "the user's <city> & \"zone\"", "n": [1, 2.5, {}], "e": []}"#,
        )
        .unwrap();
        let out = t
            .render_vars(
                &[msg("user", "é\n")],
                Vars {
                    tools: Some(&tools),
                    kwargs: None,
                },
                false,
            )
            .unwrap();
        assert_eq!(
            out,
            concat!(
                r#""é\n"|{"d": "the user's <city> & \"zone\"", "n": [1, 2.5, {}], "e": []}|"#,
                "{\n  \"d\": \"the user's <city> & \\\"zone\\\"\",\n  \"n\": [\n    1,\n    2.5,\n    {}\n  ],\n  \"e\": []\n}"
            )
        );
    }
}
