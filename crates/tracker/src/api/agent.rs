//! What agents ask of an answer's form, in each API's shape: a format (JSON, held to a schema
//! while it is sampled), tools and the choice among them (rendered through the model's
//! template, calls held to a grammar and parsed out of the answer), and tool calls in the
//! history.
//!
//! The tool-call format is the Hermes one Qwen2.5's template teaches:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; a model whose template
//! has no tool format is shown the tools in its system turn in that format
//! ([`generic_tool_prompt`]). Under `tool_choice: auto` the grammar is lazy: text is free
//! until the model opens a call, and every call it opens parses and matches its tool's
//! schema.

use constrain::grammar::{self, CallFormat, Tool};
use serde_json::{json, Value};

use engine::Refusal;

/// Which tools the model may or must call.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides; a call it opens is held to the tools' schemas (a lazy grammar).
    Auto,
    /// No tools: they are not shown to the model and nothing is parsed.
    None,
    /// At least one call, of any tool: enforced by a grammar.
    Required,
    /// A call of this function: enforced by a grammar.
    Named(String),
}

/// How an API writes its tools: OpenAI's chat `{"type": "function", "function": {...}}`,
/// the Responses API's flat `{"type": "function", "name": ...}` (and `namespace` groups),
/// Anthropic's `{"name", "input_schema"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolShape {
    Chat,
    Responses,
    Messages,
}

/// The tools a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    /// The tools as templates read them (`[{"type": "function", "function": {name,
    /// description, parameters}}]`, whatever the API's shape).
    pub json: Value,
    pub tools: Vec<Tool>,
    /// Whether each tool asked for `strict` arguments (its schema must compile; a tool that
    /// did not ask falls back to any object when its schema does not).
    strict: Vec<bool>,
    /// The Responses API `namespace` each tool came in ("" for none).
    namespaces: Vec<String>,
    pub choice: ToolChoice,
    /// Several calls in one answer (`parallel_tool_calls`), or at most one.
    pub parallel: bool,
}

impl ToolSet {
    /// Whether the model is shown the tools and its answer is searched for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// Whether some tool did not ask for `strict` arguments.
    pub fn has_loose(&self) -> bool {
        self.strict.iter().any(|s| !s)
    }

    /// The namespace tool `name` came in, if any.
    pub fn namespace_of(&self, name: &str) -> Option<&str> {
        let i = self.tools.iter().position(|t| t.name == name)?;
        Some(self.namespaces[i].as_str()).filter(|n| !n.is_empty())
    }

    /// The tools that did not ask for `strict` arguments, each with the grammar of its call
    /// alone (to find which of them the engine cannot compile).
    pub fn loose_tools(&self, format: CallFormat) -> Vec<(String, String)> {
        let rules = grammar::CallRules {
            lazy: false,
            parallel: false,
            format,
        };
        self.tools
            .iter()
            .zip(&self.strict)
            .filter(|(_, &strict)| !strict)
            .filter_map(|(t, _)| {
                let g = grammar::tool_calls(std::slice::from_ref(t), rules).ok()?;
                Some((t.name.clone(), g))
            })
            .collect()
    }

    /// The grammar the answer is held to: under `auto` free text until the model opens a
    /// call, then the call; under `required` or a named function calls only. The arguments
    /// of the tools named in `loosened` (which did not ask for `strict`) are any object.
    pub fn grammar(
        &self,
        loosened: &[String],
        format: CallFormat,
    ) -> Result<Option<String>, Refusal> {
        let lazy = match self.choice {
            ToolChoice::None => return Ok(None),
            ToolChoice::Auto => true,
            ToolChoice::Required | ToolChoice::Named(_) => false,
        };
        let tools: Vec<Tool> = self
            .tools
            .iter()
            .zip(&self.strict)
            .filter(|(t, _)| match &self.choice {
                ToolChoice::Named(n) => t.name == *n,
                _ => true,
            })
            .map(|(t, &strict)| match !strict && loosened.contains(&t.name) {
                true => Tool {
                    name: t.name.clone(),
                    parameters: json!({"type": "object"}),
                },
                _ => t.clone(),
            })
            .collect();
        let rules = grammar::CallRules {
            lazy,
            parallel: self.parallel,
            format,
        };
        grammar::tool_calls(&tools, rules)
            .map(Some)
            .map_err(|e| grammar_error("tools", e))
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
    match body.get("response_format").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(rf) => format_grammar(rf, "response_format", FormatShape::Nested),
    }
}

/// Where a format object keeps its schema: chat's `{"type": "json_schema", "json_schema":
/// {"name", "schema", "strict"}}`, or flat (the Responses API's `text.format`, Anthropic's
/// `output_config.format`: `{"type": "json_schema", "name", "schema", "strict"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatShape {
    Nested,
    Flat,
}

/// The grammar a format object at `param` asks for: `None` for `text`, any object for
/// `json_object`, the schema for `json_schema` (enforced while sampling, strict or not:
/// the answer always matches it).
pub fn format_grammar(
    rf: &Value,
    param: &str,
    shape: FormatShape,
) -> Result<Option<String>, Refusal> {
    let kind = rf
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(param, format!("`{param}` must be an object with a `type`")))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(grammar::json_object())),
        "json_schema" => {
            let (js, at) = match shape {
                FormatShape::Nested => {
                    let at = format!("{param}.json_schema");
                    let js = rf.get("json_schema").ok_or_else(|| {
                        invalid(&at, format!("`{at}` is required for type json_schema"))
                    })?;
                    (js, at)
                }
                FormatShape::Flat => (rf, param.to_string()),
            };
            match js.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(v) => {
                    return Err(invalid(
                        &format!("{at}.strict"),
                        format!("`strict` must be a boolean, got {v}"),
                    ))
                }
            }
            if js.get("name").is_some_and(|n| !n.is_string()) {
                return Err(invalid(&format!("{at}.name"), "`name` must be a string"));
            }
            let schema = js.get("schema").unwrap_or(&Value::Null);
            let schema = if schema.is_null() { &json!({}) } else { schema };
            grammar::json_schema(schema)
                .map(Some)
                .map_err(|e| grammar_error(&format!("{at}.schema"), e))
        }
        other => Err(invalid(
            &format!("{param}.type"),
            format!("`{param}.type` is `{other}`; expected text, json_object or json_schema"),
        )),
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls` (Anthropic: `tool_choice`'s
/// `disable_parallel_tool_use`) in the API's `shape`. Tools of kinds strata's models cannot
/// call (hosted or built-in tools: web search, file search, computer use, ...) are not
/// shown to the model; a list of only those is no tools.
pub fn tools(body: &Value, shape: ToolShape) -> Result<Option<ToolSet>, Refusal> {
    let choice_v = body.get("tool_choice").filter(|v| !v.is_null());
    let list = match body.get("tools").filter(|v| !v.is_null()) {
        None => {
            return match choice_v {
                None => Ok(None),
                Some(v) if choice_is_none(v, shape) => Ok(None),
                Some(_) => Err(invalid("tool_choice", "`tool_choice` needs `tools`")),
            }
        }
        Some(Value::Array(l)) => l,
        Some(_) => return Err(invalid("tools", "`tools` must be a list")),
    };
    if list.is_empty() && shape == ToolShape::Chat {
        return Err(invalid("tools", "`tools` must be a non-empty list"));
    }
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
    let mut set = ToolSet {
        json: Value::Array(Vec::new()),
        tools: Vec::new(),
        strict: Vec::new(),
        namespaces: Vec::new(),
        choice: ToolChoice::Auto,
        parallel: true,
    };
    for (i, t) in list.iter().enumerate() {
        add_tool(&mut set, &format!("tools[{i}]"), t, shape, "")?;
    }
    if set.tools.len() > MAX_TOOLS {
        return Err(Refusal::over_limit(
            "tools",
            "max_tools",
            format!(
                "`tools` holds {} functions; at most {MAX_TOOLS} are allowed",
                set.tools.len()
            ),
        ));
    }
    let (choice, no_parallel) = tool_choice(choice_v, &set.tools, shape)?;
    let parallel = match (shape, body.get("parallel_tool_calls")) {
        (ToolShape::Messages, _) | (_, None | Some(Value::Null)) => !no_parallel,
        (_, Some(Value::Bool(b))) => *b,
        (_, Some(v)) => {
            return Err(invalid(
                "parallel_tool_calls",
                format!("`parallel_tool_calls` must be a boolean, got {v}"),
            ))
        }
    };
    if set.tools.is_empty() {
        return match choice {
            ToolChoice::Auto | ToolChoice::None => Ok(None),
            _ => Err(invalid(
                "tool_choice",
                "`tool_choice` asks for a call, but `tools` holds no function strata's model can call",
            )),
        };
    }
    set.choice = choice;
    set.parallel = parallel;
    Ok(Some(set))
}

/// Whether a `tool_choice` without tools says "no tools" (which is then no request at all).
fn choice_is_none(v: &Value, shape: ToolShape) -> bool {
    match shape {
        ToolShape::Messages => v.get("type").and_then(Value::as_str) == Some("none"),
        _ => v.as_str() == Some("none"),
    }
}

/// Tool kinds the model is not shown: tools that run at the provider (search, code
/// interpreters, computer use) or the client's own built-ins of another API's models.
fn not_offered(kind: &str, shape: ToolShape) -> bool {
    match shape {
        ToolShape::Chat => false,
        ToolShape::Responses => !matches!(kind, "function" | "namespace" | "custom"),
        ToolShape::Messages => kind != "custom",
    }
}

/// The fields of a tool definition, by shape.
const CHAT_FUNCTION_FIELDS: &[&str] = &["name", "description", "parameters", "strict"];
const RESPONSES_TOOL_FIELDS: &[&str] = &["type", "name", "description", "parameters", "strict"];
const MESSAGES_TOOL_FIELDS: &[&str] = &[
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
];

/// Adds tool `t` (at `p` in the request), or a namespace's tools, to `set`.
fn add_tool(
    set: &mut ToolSet,
    p: &str,
    t: &Value,
    shape: ToolShape,
    namespace: &str,
) -> Result<(), Refusal> {
    if !t.is_object() {
        return Err(invalid(p, format!("`{p}` must be an object")));
    }
    let kind = t.get("type").and_then(Value::as_str);
    let kind = match (shape, kind) {
        (ToolShape::Messages, None) => "custom",
        (_, Some(k)) => k,
        (_, None) => return Err(invalid(p, format!("`{p}.type` is required"))),
    };
    if not_offered(kind, shape) {
        return Ok(());
    }
    let (f, fields, params_key, fp) = match (shape, kind) {
        (ToolShape::Chat, "function") => {
            let f = t
                .get("function")
                .filter(|f| f.is_object())
                .ok_or_else(|| invalid(p, format!("`{p}.function` is required")))?;
            (
                f,
                CHAT_FUNCTION_FIELDS,
                "parameters",
                format!("{p}.function"),
            )
        }
        (ToolShape::Chat, _) => {
            return Err(invalid(p, format!("`{p}.type` must be \"function\"")));
        }
        (ToolShape::Responses, "namespace") if namespace.is_empty() => {
            let name = t.get("name").and_then(Value::as_str).unwrap_or_default();
            let inner = t
                .get("tools")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid(p, format!("`{p}.tools` must be a list")))?;
            for (k, x) in inner.iter().enumerate() {
                add_tool(set, &format!("{p}.tools[{k}]"), x, shape, name)?;
            }
            return Ok(());
        }
        (ToolShape::Responses, "function") => {
            (t, RESPONSES_TOOL_FIELDS, "parameters", p.to_string())
        }
        (ToolShape::Responses, other) => {
            return Err(invalid(
                &format!("{p}.type"),
                format!("`{p}.type` `{other}` is not supported (function tools and namespaces of them are)"),
            ));
        }
        (ToolShape::Messages, _) => (t, MESSAGES_TOOL_FIELDS, "input_schema", p.to_string()),
    };
    super::fields::only(f, &fp, fields, "a tool")?;
    add_function(set, f, &fp, params_key, namespace)
}

/// Adds the function `f` describes (at `fp` in the request; its schema under `params_key`).
fn add_function(
    set: &mut ToolSet,
    f: &Value,
    fp: &str,
    params_key: &str,
    namespace: &str,
) -> Result<(), Refusal> {
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
                &format!("{fp}.name"),
                "a function name is 1 to 64 letters, digits, `_` or `-`",
            )
        })?;
    if set.tools.iter().any(|t| t.name == name) {
        return Err(invalid(
            &format!("{fp}.name"),
            format!("two tools are named `{name}`"),
        ));
    }
    let strict = super::fields::boolean_at(f.get("strict"), &format!("{fp}.strict"))?;
    let description = super::fields::string_at(f.get("description"), &format!("{fp}.description"))?;
    let parameters = match f.get(params_key) {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(v) if v.is_object() => {
            // Bounded whatever the tool choice: the tools are rendered into the prompt, and
            // they become a grammar.
            constrain::limits::LIMITS
                .check(v)
                .map_err(|e| grammar_error(&format!("{fp}.{params_key}"), e))?;
            v.clone()
        }
        Some(_) => {
            return Err(invalid(
                &format!("{fp}.{params_key}"),
                format!("`{params_key}` must be a JSON schema object"),
            ))
        }
    };
    let mut function = json!({"name": name, "parameters": parameters});
    if let Some(d) = description {
        function["description"] = json!(d);
    }
    if let Value::Array(list) = &mut set.json {
        list.push(json!({"type": "function", "function": function}));
    }
    set.tools.push(Tool {
        name: name.to_string(),
        parameters,
    });
    set.strict.push(strict.unwrap_or(false));
    set.namespaces.push(namespace.to_string());
    Ok(())
}

/// `tool_choice` among `tools` (absent: `auto`), and whether it turns parallel calls off
/// (Anthropic's `disable_parallel_tool_use`).
fn tool_choice(
    choice_v: Option<&Value>,
    tools: &[Tool],
    shape: ToolShape,
) -> Result<(ToolChoice, bool), Refusal> {
    let named = |name: &str| -> Result<ToolChoice, Refusal> {
        if !tools.iter().any(|t| t.name == name) {
            return Err(invalid(
                "tool_choice",
                format!("`tool_choice` names `{name}`, which is not in `tools`"),
            ));
        }
        Ok(ToolChoice::Named(name.to_string()))
    };
    let Some(v) = choice_v else {
        return Ok((ToolChoice::Auto, false));
    };
    if shape == ToolShape::Messages {
        super::fields::only(
            v,
            "tool_choice",
            &["type", "name", "disable_parallel_tool_use"],
            "/v1/messages",
        )?;
        let no_parallel = super::fields::boolean_at(
            v.get("disable_parallel_tool_use"),
            "tool_choice.disable_parallel_tool_use",
        )?
        .unwrap_or(false);
        let choice = match v.get("type").and_then(Value::as_str) {
            Some("auto") => ToolChoice::Auto,
            Some("none") => ToolChoice::None,
            Some("any") => ToolChoice::Required,
            Some("tool") => named(v.get("name").and_then(Value::as_str).ok_or_else(|| {
                invalid(
                    "tool_choice.name",
                    "`tool_choice` of type `tool` needs a `name`",
                )
            })?)?,
            _ => {
                return Err(invalid(
                    "tool_choice.type",
                    "`tool_choice.type` must be auto, any, tool or none",
                ))
            }
        };
        return Ok((choice, no_parallel));
    }
    let choice = match v {
        Value::String(s) => match s.as_str() {
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
        v => {
            let name = match shape {
                ToolShape::Responses => v.get("name"),
                _ => v.get("function").and_then(|f| f.get("name")),
            };
            let name = name
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    let form = match shape {
                        ToolShape::Responses => "{\"type\": \"function\", \"name\": ...}",
                        _ => "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                    };
                    invalid(
                        "tool_choice",
                        format!("`tool_choice` must be auto, none, required or {form}"),
                    )
                })?;
            named(name)?
        }
    };
    Ok((choice, false))
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

/// A conversation with tools for a template that has no tool format of its own (Gemma 3,
/// SmolLM2): the tools are described in the system turn with the call format the grammar
/// holds calls to, earlier calls become the assistant's text in that format, and tool
/// results become user turns. The template is then rendered without `tools`.
pub fn generic_tool_prompt(
    messages: &[text::ChatMessage],
    tools: &Value,
) -> Vec<text::ChatMessage> {
    let mut listing = String::from(
        "You can call functions to help answer. Each function is described by a JSON object \
         (its name, what it does, and a JSON schema of its arguments):\n",
    );
    for t in tools.as_array().into_iter().flatten() {
        listing.push_str(&t.get("function").unwrap_or(t).to_string());
        listing.push('\n');
    }
    listing.push_str(
        "\nTo call a function, answer with one block per call and nothing after the blocks:\n\
         <tool_call>\n{\"name\": \"FUNCTION_NAME\", \"arguments\": {ARGUMENTS}}\n</tool_call>\n\
         The results come back in the next user turn. If no function is needed, answer in \
         plain text.",
    );
    let mut out = Vec::with_capacity(messages.len() + 1);
    match messages.first() {
        Some(first) if first.role == "system" => {
            let mut m = first.clone();
            m.content = format!("{}\n\n{listing}", m.content);
            out.push(m);
        }
        _ => out.push(text::ChatMessage::new("system", &listing)),
    }
    let skip = usize::from(messages.first().is_some_and(|m| m.role == "system"));
    for m in &messages[skip..] {
        match m.role.as_str() {
            "assistant" if m.tool_calls.is_some() => {
                let mut content = m.content.clone();
                for c in m
                    .tool_calls
                    .iter()
                    .flat_map(|v| v.as_array().into_iter().flatten())
                {
                    let f = c.get("function").unwrap_or(c);
                    let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(text::ChatMessage::new("assistant", &content));
            }
            "tool" => {
                let who = m
                    .name
                    .as_deref()
                    .or(m.tool_call_id.as_deref())
                    .unwrap_or("the call");
                out.push(text::ChatMessage::new(
                    "user",
                    &format!("Result of {who}:\n{}", m.content),
                ));
            }
            _ => out.push(m.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_lists_and_choices_are_checked() {
        let weather = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
        let ok = tools(
            &json!({"tools": [weather], "tool_choice": "required"}),
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        assert_eq!(ok.choice, ToolChoice::Required);
        assert!(ok.parallel);
        assert!(ok.grammar(&[], CallFormat::Hermes).unwrap().is_some());
        let one = tools(
            &json!({"tools": [weather], "parallel_tool_calls": false}),
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (one.choice.clone(), one.parallel),
            (ToolChoice::Auto, false)
        );
        assert!(
            one.grammar(&[], CallFormat::Hermes).unwrap().is_some(),
            "auto is held lazily"
        );
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
                json!({"tools": [weather], "parallel_tool_calls": "no"}),
                "parallel_tool_calls",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}),
                "tools[0].function.extra",
            ),
        ] {
            let e = tools(&body, ToolShape::Chat).unwrap_err();
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

    #[test]
    fn every_api_s_tool_shape_gives_the_same_tool_set() {
        let params = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let chat = tools(
            &json!({"tools": [{"type": "function", "function": {"name": "w", "description": "d", "parameters": params}}]}),
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        let responses = tools(
            &json!({"tools": [{"type": "function", "name": "w", "description": "d", "parameters": params, "strict": true},
                              {"type": "web_search"}]}),
            ToolShape::Responses,
        )
        .unwrap()
        .unwrap();
        let messages = tools(
            &json!({"tools": [{"name": "w", "description": "d", "input_schema": params, "cache_control": {"type": "ephemeral"}},
                              {"type": "web_search_20250305", "name": "web_search"}],
                    "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
            ToolShape::Messages,
        )
        .unwrap()
        .unwrap();
        assert_eq!(chat.json, responses.json);
        assert_eq!(chat.json, messages.json);
        assert_eq!(chat.tools, messages.tools);
        assert!(!messages.parallel);
        assert!(chat.has_loose() && !responses.has_loose());
        // A namespace's functions are offered under their own names.
        let ns = tools(
            &json!({"tools": [{"type": "namespace", "name": "agents", "description": "x",
                               "tools": [{"type": "function", "name": "spawn", "parameters": params}]}]}),
            ToolShape::Responses,
        )
        .unwrap()
        .unwrap();
        assert_eq!(ns.tools[0].name, "spawn");
        assert_eq!(ns.namespace_of("spawn"), Some("agents"));
        // Only hosted tools: no tools at all.
        assert!(tools(
            &json!({"tools": [{"type": "web_search"}]}),
            ToolShape::Responses
        )
        .unwrap()
        .is_none());
        let e = tools(
            &json!({"tools": [{"type": "custom", "name": "patch"}]}),
            ToolShape::Responses,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let e = tools(
            &json!({"tools": [{"name": "w", "input_schema": params}], "tool_choice": {"type": "tool", "name": "x"}}),
            ToolShape::Messages,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
    }
}
