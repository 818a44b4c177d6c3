//! What agents ask of a chat answer's form: `response_format` (JSON, held to a schema while it
//! is sampled), `tools` and `tool_choice` (rendered through the model's template, calls parsed
//! out of the answer, `required` and named functions held to a grammar), and tool calls in
//! the history.
//!
//! The tool-call format is the Hermes one Qwen2.5's template teaches:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. A model whose template has
//! another format (or none) refuses `tools` with a 400 rather than pretending.

use constrain::grammar::{self, Tool};
use serde_json::{json, Value};

use engine::Refusal;

/// Which tools the model may or must call.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides; calls in its answer are parsed.
    Auto,
    /// No tools: they are not shown to the model and nothing is parsed.
    None,
    /// At least one call, of any tool: enforced by a grammar.
    Required,
    /// A call of this function: enforced by a grammar.
    Named(String),
}

/// The tools a chat request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    /// `tools` as the request gave them, for the template.
    pub json: Value,
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// What `choice` holds the answer to: calls of the offered tools for `required`, of the
    /// named one for a named function, else nothing.
    grammar: Option<String>,
}

/// The grammar `choice` asks for among `tools`.
fn choice_grammar(tools: &[Tool], choice: &ToolChoice) -> Result<Option<String>, Refusal> {
    let calls = match choice {
        ToolChoice::Auto | ToolChoice::None => return Ok(None),
        ToolChoice::Required => grammar::tool_calls(tools),
        ToolChoice::Named(n) => {
            let only: Vec<Tool> = tools.iter().filter(|t| t.name == *n).cloned().collect();
            grammar::tool_calls(&only)
        }
    };
    calls.map(Some).map_err(|e| grammar_error("tools", e))
}

impl ToolSet {
    /// The grammar the choice asks for (`None`: the answer is free).
    pub fn grammar(&self) -> Option<&str> {
        self.grammar.as_deref()
    }

    /// Whether the model is shown the tools and its answer is searched for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }
}

/// Longest tool list accepted: a tool is a prompt section, and a list is a grammar.
pub const MAX_TOOLS: usize = 128;

/// A grammar the engine refuses, or a schema over a limit, as the refusal of `param`.
pub fn grammar_error(param: &str, e: constrain::Error) -> Refusal {
    match e {
        constrain::Error::TooLarge { limit, .. } => {
            Refusal::over_limit(param, limit, e.to_string())
        }
        e => invalid(param, e.to_string()),
    }
}

fn invalid(param: &str, msg: impl Into<String>) -> Refusal {
    Refusal::invalid(param, msg.into())
}

/// `response_format`: the grammar it asks for (`None` for `text` or when absent).
pub fn response_format(body: &Value) -> Result<Option<String>, Refusal> {
    let Some(rf) = body.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = rf.get("type").and_then(Value::as_str).ok_or_else(|| {
        invalid(
            "response_format",
            "`response_format` must be an object with a `type`",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(grammar::json_object())),
        "json_schema" => {
            let js = rf.get("json_schema").ok_or_else(|| {
                invalid(
                    "response_format.json_schema",
                    "`response_format.json_schema` is required for type json_schema",
                )
            })?;
            match js.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(v) => {
                    return Err(invalid(
                        "response_format.json_schema.strict",
                        format!("`strict` must be a boolean, got {v}"),
                    ))
                }
            }
            if js.get("name").is_some_and(|n| !n.is_string()) {
                return Err(invalid(
                    "response_format.json_schema.name",
                    "`name` must be a string",
                ));
            }
            // Strict or not, the schema is enforced while sampling: the answer always
            // matches it (strict: false would allow less; nothing is gained by it).
            let schema = js.get("schema").unwrap_or(&Value::Null);
            let schema = if schema.is_null() { &json!({}) } else { schema };
            grammar::json_schema(schema)
                .map(Some)
                .map_err(|e| grammar_error("response_format.json_schema.schema", e))
        }
        other => Err(invalid(
            "response_format.type",
            format!(
                "`response_format.type` is `{other}`; expected text, json_object or json_schema"
            ),
        )),
    }
}

/// `tools` and `tool_choice` (and `parallel_tool_calls`, which only `true` or absent may be).
pub fn tools(body: &Value) -> Result<Option<ToolSet>, Refusal> {
    let choice_v = body.get("tool_choice").filter(|v| !v.is_null());
    let list = match body.get("tools").filter(|v| !v.is_null()) {
        None => {
            return match choice_v {
                Some(Value::String(s)) if s == "none" => Ok(None),
                Some(_) => Err(invalid("tool_choice", "`tool_choice` needs `tools`")),
                None => Ok(None),
            }
        }
        Some(Value::Array(l)) if !l.is_empty() => l,
        Some(_) => return Err(invalid("tools", "`tools` must be a non-empty list")),
    };
    if list.len() > MAX_TOOLS {
        return Err(Refusal::over_limit(
            "tools",
            "max_tools",
            format!(
                "`tools` has {} entries; at most {MAX_TOOLS} are allowed",
                list.len()
            ),
        ));
    }
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let checked = tool(i, t, &tools)?;
        tools.push(checked);
    }
    let choice = tool_choice(choice_v, &tools)?;
    match body.get("parallel_tool_calls") {
        None | Some(Value::Null) | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => {
            return Err(invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls: false` is not supported: the model may make several calls",
            ))
        }
        Some(v) => {
            return Err(invalid(
                "parallel_tool_calls",
                format!("`parallel_tool_calls` must be a boolean, got {v}"),
            ))
        }
    }
    // `strict` promises arguments that match the schema: kept by the grammar of `required`
    // and of a named function; under `auto` the answer is free, so it cannot be promised.
    if choice == ToolChoice::Auto {
        if let Some(i) = list.iter().position(|t| {
            t.get("function").and_then(|f| f.get("strict")) == Some(&Value::Bool(true))
        }) {
            return Err(invalid(
                &format!("tools[{i}].function.strict"),
                "`strict: true` needs `tool_choice` `required` or a named function (under `auto` the arguments are not held to the schema)",
            ));
        }
    }
    let grammar = choice_grammar(&tools, &choice)?;
    Ok(Some(ToolSet {
        json: Value::Array(list.clone()),
        tools,
        choice,
        grammar,
    }))
}

/// `tools[i]`, checked (a function with a valid, unused name and an object schema).
fn tool(i: usize, t: &Value, earlier: &[Tool]) -> Result<Tool, Refusal> {
    let p = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(invalid(&p, format!("`{p}.type` must be \"function\"")));
    }
    let f = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| invalid(&p, format!("`{p}.function` is required")))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| {
            !n.is_empty()
                && n.len() <= 64
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
        .ok_or_else(|| {
            invalid(
                &format!("{p}.function.name"),
                "a function name is 1 to 64 letters, digits, `_` or `-`",
            )
        })?;
    if earlier.iter().any(|t| t.name == name) {
        return Err(invalid(
            &format!("{p}.function.name"),
            format!("two tools are named `{name}`"),
        ));
    }
    if f.get("strict")
        .is_some_and(|s| !s.is_boolean() && !s.is_null())
    {
        return Err(invalid(
            &format!("{p}.function.strict"),
            "`strict` must be a boolean",
        ));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(v) if v.is_object() => {
            // Bounded whatever the tool choice: the tools are rendered into the prompt, and
            // `required` or a named function makes them a grammar.
            constrain::limits::LIMITS
                .check(v)
                .map_err(|e| grammar_error(&format!("{p}.function.parameters"), e))?;
            v.clone()
        }
        Some(_) => {
            return Err(invalid(
                &format!("{p}.function.parameters"),
                "`parameters` must be a JSON schema object",
            ))
        }
    };
    Ok(Tool {
        name: name.to_string(),
        parameters,
    })
}

/// `tool_choice` among `tools` (absent: `auto`).
fn tool_choice(choice_v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, Refusal> {
    Ok(match choice_v {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` is `{other}`; expected auto, none, required or a function"
                    ),
                ))
            }
        },
        Some(v) => {
            let name = v
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
            .ok_or_else(|| {
                invalid(
                    "tool_choice",
                    "`tool_choice` must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )
            })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not in `tools`"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
    })
}

/// An assistant message's `tool_calls` as templates read them: the arguments, a JSON string
/// on the wire, become the object they encode.
pub fn history_tool_calls(v: &Value, idx: usize) -> Result<Value, Refusal> {
    let p = format!("messages[{idx}].tool_calls");
    let list = v
        .as_array()
        .ok_or_else(|| invalid(&p, format!("`{p}` must be a list")))?;
    let mut out = Vec::with_capacity(list.len());
    for (k, c) in list.iter().enumerate() {
        let f = c.get("function").ok_or_else(|| {
            invalid(
                &format!("{p}[{k}]"),
                format!("`{p}[{k}].function` is required"),
            )
        })?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
            invalid(
                &format!("{p}[{k}].function.name"),
                "a tool call needs a function name",
            )
        })?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                invalid(
                    &format!("{p}[{k}].function.arguments"),
                    format!("the arguments are not JSON: {e}"),
                )
            })?,
            Some(o) => o.clone(),
        };
        out.push(json!({
            "id": c.get("id").cloned().unwrap_or(Value::Null),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }));
    }
    Ok(Value::Array(out))
}

/// One tool call found in an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text (as OpenAI sends them).
    pub arguments: String,
}

impl ToolCall {
    pub fn json(&self, id: &str, index: usize) -> Value {
        json!({
            "index": index,
            "id": id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A call's body (between the tags): `{"name": ..., "arguments": ...}`, or `None`.
fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Splits an answer into its text and its tool calls. A `<tool_call>` block that does not
/// parse stays in the text, as the model wrote it.
pub fn split_calls(text: &str) -> (String, Vec<ToolCall>) {
    let mut s = ToolStream::default();
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in s.push(text).into_iter().chain(s.finish()) {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (content, calls)
}

/// What a streamed answer becomes: text to send as it comes, or a whole call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Finds tool calls in an answer as it streams: text is passed on at once except what may be
/// the start of a `<tool_call>` tag, and a call is held until its closing tag. Linear in the
/// answer: each byte is looked at a bounded number of times.
#[derive(Debug, Default)]
pub struct ToolStream {
    /// Text not passed on yet: a possible tag start (after at most [`HELD_NEWLINES`]
    /// newlines), or a call's body.
    held: String,
    in_call: bool,
    /// How much of a call's body was searched for the closing tag already.
    searched: usize,
}

/// Newlines held back before a possible tag: past this many they are text.
const HELD_NEWLINES: usize = 64;

impl ToolStream {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                // Only the new text (and a tag cut by the last push) is searched: linear.
                let mut from = self.searched.saturating_sub(CLOSE.len() - 1);
                while !self.held.is_char_boundary(from) {
                    from -= 1;
                }
                let Some(end) = self.held[from..].find(CLOSE).map(|e| e + from) else {
                    self.searched = self.held.len();
                    break;
                };
                self.searched = 0;
                let body = self.held[..end].to_string();
                let rest = self.held[end + CLOSE.len()..].to_string();
                match parse_call(&body) {
                    Some(c) => out.push(Piece::Call(c)),
                    None => out.push(Piece::Text(format!("{OPEN}{body}{CLOSE}"))),
                }
                self.held = rest;
                self.in_call = false;
            } else if let Some(start) = self.held.find(OPEN) {
                let before = &self.held[..start];
                // The newline a model puts between text (or calls) and a call is layout.
                let before = before.trim_end_matches('\n');
                if !before.is_empty() {
                    out.push(Piece::Text(before.to_string()));
                }
                self.held = self.held[start + OPEN.len()..].to_string();
                self.in_call = true;
                self.searched = 0;
            } else {
                // Pass on all but a tail that may begin the tag.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&k| self.held.ends_with(&OPEN[..k]))
                    .unwrap_or(0);
                let mut cut = self.held.len() - keep;
                // Newlines just before a tag are layout: hold them (a bounded run) until what
                // follows shows whether a call comes.
                let floor = cut.saturating_sub(HELD_NEWLINES);
                while cut > floor && self.held.as_bytes()[cut - 1] == b'\n' {
                    cut -= 1;
                }
                if cut > 0 {
                    out.push(Piece::Text(self.held[..cut].to_string()));
                    self.held.drain(..cut);
                }
                break;
            }
        }
        out
    }

    /// The end of the answer: whatever is held is text (an unclosed call included).
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        let text = if self.in_call {
            format!("{OPEN}{held}")
        } else {
            held
        };
        self.in_call = false;
        if text.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Text(text)]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_split_from_text_whole_and_streamed_byte_by_byte() {
        let answer = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"noop\"}\n</tool_call>";
        let (text, calls) = split_calls(answer);
        assert_eq!(text, "Let me check.");
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                ToolCall {
                    name: "noop".into(),
                    arguments: "{}".into()
                }
            ]
        );
        let mut s = ToolStream::default();
        let mut pieces = Vec::new();
        for ch in answer.chars() {
            pieces.extend(s.push(&ch.to_string()));
        }
        pieces.extend(s.finish());
        let streamed_calls: Vec<_> = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Call(c) => Some(c.clone()),
                _ => None,
            })
            .collect();
        let streamed_text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed_calls, calls);
        assert_eq!(streamed_text, "Let me check.");
        // A broken call stays text; an unclosed one too; a lone `<` is passed on at the end.
        assert_eq!(split_calls("<tool_call>\nnot json\n</tool_call>").1, vec![]);
        assert_eq!(split_calls("a <tool_call> b").0, "a <tool_call> b");
        assert_eq!(split_calls("x <").0, "x <");
    }

    #[test]
    fn a_long_call_body_and_a_long_newline_run_stream_in_linear_work() {
        // 200k pushes each of a byte: quadratic rescans would take minutes.
        let mut s = ToolStream::default();
        let mut n = 0;
        for _ in 0..100_000 {
            n += s.push("\n").len();
        }
        assert!(s.held.len() <= HELD_NEWLINES + OPEN.len());
        s.push(OPEN);
        for _ in 0..100_000 {
            assert!(s.push("a").is_empty());
        }
        let out = s.push(CLOSE);
        assert_eq!(out.len(), 1, "the broken call is passed on as text");
        assert!(n > 0);
    }

    #[test]
    fn tool_lists_and_choices_are_checked() {
        let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
        let ok = tools(&json!({"tools": [weather], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        assert_eq!(ok.choice, ToolChoice::Required);
        assert!(ok.grammar().is_some());
        for (body, param) in [
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"tools": []}), "tools"),
            (json!({"tools": [{"type": "x"}]}), "tools[0]"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather], "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather], "parallel_tool_calls": false}),
                "parallel_tool_calls",
            ),
        ] {
            let e = tools(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        for (body, param) in [
            (
                json!({"response_format": {"type": "bogus"}}),
                "response_format.type",
            ),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
        ] {
            let e = response_format(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        assert!(
            response_format(&json!({"response_format": {"type": "text"}}))
                .unwrap()
                .is_none()
        );
    }
}
