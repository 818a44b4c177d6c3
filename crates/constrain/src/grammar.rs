//! The grammars the API asks for, in llguidance's JSON form (what the wire carries to the last
//! shard): a JSON schema, any JSON object, or calls of the tools a request offers.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

use crate::limits::LIMITS;
use crate::Error;

/// JSON as the grammars write it: `", "` between items and `": "` after keys, no other
/// whitespace. Fixed separators keep a model from filling its budget with blank lines (free
/// whitespace is a known way for constrained JSON never to end).
fn with_layout(mut schema: Value) -> Value {
    if let Value::Object(o) = &mut schema {
        o.insert(
            "x-guidance".into(),
            json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}),
        );
    }
    schema
}

fn to_json(g: &TopLevelGrammar) -> String {
    serde_json::to_string(g).expect("a grammar serializes")
}

/// Output held to `schema` (a JSON Schema object), which must keep within
/// [`crate::limits::LIMITS`]. Whether llguidance supports every keyword it uses is known only
/// once compiled ([`crate::Vocabulary::check`]).
pub fn json_schema(schema: &Value) -> Result<String, Error> {
    match schema {
        Value::Object(o) => {
            LIMITS.check(schema)?;
            if o.contains_key("x-guidance") {
                return Err(Error::Grammar(
                    "the schema must not carry `x-guidance` (the layout is fixed)".into(),
                ));
            }
            Ok(to_json(&TopLevelGrammar::from_json_schema(with_layout(
                schema.clone(),
            ))))
        }
        Value::Bool(true) => json_schema(&json!({})),
        other => Err(Error::Grammar(format!(
            "a JSON schema must be an object, got {other}"
        ))),
    }
}

/// Output that is one JSON object, any object (`response_format: json_object`).
pub fn json_object() -> String {
    json_schema(&json!({"type": "object"})).expect("a fixed schema")
}

/// A tool a request offers: its name and the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Value,
}

/// Definition sections a schema's `$ref`s point into.
const DEF_SECTIONS: [&str; 2] = ["$defs", "definitions"];

/// Rewrites every `$ref` into a definition section of tool `i` to its hoisted name.
fn rewrite_refs(v: &mut Value, i: usize) {
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match (k.as_str(), x) {
                    ("$ref", Value::String(r)) => {
                        for section in DEF_SECTIONS {
                            if let Some(rest) = r.strip_prefix(&format!("#/{section}/")) {
                                *r = format!("#/$defs/t{i}_{rest}");
                                break;
                            }
                        }
                    }
                    (_, x) => rewrite_refs(x, i),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rewrite_refs(x, i)),
        _ => {}
    }
}

/// Tool `i`'s parameters with their definitions moved into `defs` (the call schema's root,
/// where `$ref`s resolve) under names of their own, and their references rewritten to match:
/// nested under `arguments`, `#/$defs/X` would no longer point anywhere.
fn hoist_definitions(i: usize, params: &Value, defs: &mut serde_json::Map<String, Value>) -> Value {
    let mut p = params.clone();
    if let Value::Object(o) = &mut p {
        for section in DEF_SECTIONS {
            if let Some(Value::Object(d)) = o.remove(section) {
                for (name, mut def) in d {
                    rewrite_refs(&mut def, i);
                    defs.insert(format!("t{i}_{name}"), def);
                }
            }
        }
    }
    rewrite_refs(&mut p, i);
    p
}

/// The schema of one call of any of `tools`: `{"name": ..., "arguments": {...}}` with the
/// name one of theirs and the arguments matching that tool's parameters.
fn call_schema(tools: &[Tool]) -> Value {
    let mut defs = serde_json::Map::new();
    let calls: Vec<Value> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "arguments": hoist_definitions(i, &t.parameters, &mut defs),
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = match <[Value; 1]>::try_from(calls) {
        Ok([one]) => one,
        Err(calls) => json!({"anyOf": calls}),
    };
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    with_layout(schema)
}

/// How the calls of a tool grammar are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallRules {
    /// Free text may come first and the answer may have no call at all; once the model opens
    /// a call (`<tool_call>`), the call is held to the tools (`tool_choice: auto`, as
    /// llama.cpp's lazy grammars). Otherwise the answer is calls and nothing else (`required`
    /// or a named function).
    pub lazy: bool,
    /// Several calls one after another (`parallel_tool_calls`), or exactly one.
    pub parallel: bool,
    pub format: CallFormat,
}

/// How a template writes a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallFormat {
    /// The Hermes format (Qwen2.5): `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`.
    #[default]
    Hermes,
    /// A bare JSON object, `{"name": ..., "parameters": ...}` (Llama 3.x's templates).
    Json,
}

impl CallFormat {
    /// The key a call's arguments are under.
    pub fn arguments_key(self) -> &'static str {
        match self {
            CallFormat::Hermes => "arguments",
            CallFormat::Json => "parameters",
        }
    }
}

/// Blank space the grammars let a bare call's layout have (bounded, so it cannot run on).
const WS: &str = "[ \\t\\n]{0,8}";

/// Tags small models put around a bare call (llama.cpp accepts the same).
pub const BARE_WRAPPERS: [&str; 3] = ["tools", "function_call", "response"];

/// The opening of a bare call of tool `name`, as Qwen2.5-Coder writes calls (a JSON object,
/// often in a ```json fence or a `<tools>` tag, with no `<tool_call>`): blank space, an
/// optional fence, an optional wrapper tag, and `{"name": "NAME"`, as a regex. Tool names
/// are letters, digits, `_` and `-`.
fn bare_opening(names: &str) -> String {
    let wrappers = BARE_WRAPPERS.join("|");
    format!("{WS}(```(json)?\\n)?(<({wrappers})>{WS})?\\{{{WS}\"name\"{WS}:{WS}\"({names})\"")
}

/// Calls of `tools` in the Hermes format Qwen2.5's template teaches
/// (`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, calls separated by a
/// newline), held as `rules` say: every call the model makes parses and its arguments match
/// the tool's schema. A lazy grammar also holds a call the model writes bare at the start of
/// its answer (`{"name": "TOOL", "arguments": {...}}`, in a ```json fence or not), once the
/// name is an offered tool's: a JSON object naming anything else stays text.
pub fn tool_calls(tools: &[Tool], rules: CallRules) -> Result<String, Error> {
    if tools.is_empty() {
        return Err(Error::Grammar("no tools to call".into()));
    }
    // Each tool's parameters alone first (cheap, and no copy of an oversized one is made),
    // then every call together: the limits hold for the grammar as a whole.
    for t in tools {
        LIMITS.check(&t.parameters)?;
    }
    let call = call_schema(tools);
    LIMITS.check(&call)?;
    let schema = serde_json::to_string(&call).expect("a schema serializes");
    if rules.format == CallFormat::Json {
        return Ok(json_calls(tools, rules));
    }
    let more = if rules.parallel {
        " (\"\\n\" call)*"
    } else {
        ""
    };
    let body = "\"\\n\" args \"\\n</tool_call>\"";
    let tagged = format!("call: \"<tool_call>\" body\nbody: {body}\nargs: %json {schema}\n");
    if !rules.lazy {
        return Ok(to_json(&TopLevelGrammar::from_lark(format!(
            "start: call{more}\n{tagged}"
        ))));
    }
    // Competing lexemes from the first byte: text that opens no call, text that ends at the
    // first opening tag (lazy: it stops there), and each tool's bare opening (lazy too);
    // whichever the answer turns out to be, the rest of a call is held to its schema. A
    // lone `<`, a partial tag or a JSON object naming no offered tool stays text.
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let lark = format!(
        "start: FREE | opened body{more} | bare{more}\nFREE: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/ & ~/{}(?s:.*)/\nopened[suffix=\"<tool_call>\"]: /(?s:.*)/\n{tagged}{}",
        bare_opening(&names.join("|")),
        bare_rules(tools, "arguments"),
    );
    Ok(to_json(&TopLevelGrammar::from_lark(lark)))
}

/// The ways a bare call may be wrapped, as regexes of what opens and what closes it: plain,
/// in a ```json fence, in a wrapper tag, or both. A call that opened a wrapping must close it.
fn wrappings() -> [(String, String); 4] {
    let tags = BARE_WRAPPERS.join("|");
    let fence = "```(json)?\\n".to_string();
    let tag = format!("<({tags})>{WS}");
    let untag = format!("{WS}<\\/({tags})>");
    [
        (String::new(), String::new()),
        (format!("{fence}{WS}"), format!("{WS}```")),
        (tag.clone(), untag.clone()),
        (format!("{fence}{WS}{tag}"), format!("{untag}{WS}```")),
    ]
}

/// The `bare` rule: a bare call of one of `tools`, its arguments under `key`, in any of the
/// [`wrappings`].
fn bare_rules(tools: &[Tool], key: &str) -> String {
    let wraps = wrappings();
    let mut alternatives = Vec::new();
    let mut rules = format!("sep: /{WS},{WS}\"{key}\"{WS}:{WS}/\n");
    for (i, t) in tools.iter().enumerate() {
        let params =
            serde_json::to_string(&with_layout(t.parameters.clone())).expect("a schema serializes");
        rules.push_str(&format!("args{i}: %json {params}\n"));
        let name = &t.name;
        for (w, (open, _)) in wraps.iter().enumerate() {
            alternatives.push(format!("b{i}w{w} sep args{i} e{w}"));
            rules.push_str(&format!(
                "b{i}w{w}[lazy]: /{WS}{open}\\{{{WS}\"name\"{WS}:{WS}\"{name}\"/\n"
            ));
        }
    }
    for (w, (_, close)) in wraps.iter().enumerate() {
        rules.push_str(&format!("e{w}: /{WS}\\}}{close}/\n"));
    }
    format!("bare: {}\n{rules}", alternatives.join(" | "))
}

/// Calls in the bare JSON format (Llama 3.x): `{"name": ..., "parameters": ...}`, one per
/// line; lazily, free text unless the answer opens with a call of an offered tool.
fn json_calls(tools: &[Tool], rules: CallRules) -> String {
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let more = if rules.parallel {
        " (\"\\n\" bare)*"
    } else {
        ""
    };
    let start = if rules.lazy {
        format!(
            "start: FREE | bare{more}\nFREE: /(?s:.*)/ & ~/{}(?s:.*)/\n",
            bare_opening(&names.join("|"))
        )
    } else {
        format!("start: bare{more}\n")
    };
    to_json(&TopLevelGrammar::from_lark(format!(
        "{start}{}",
        bare_rules(tools, CallFormat::Json.arguments_key())
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_must_be_objects_and_keep_their_layout() {
        assert!(json_schema(&json!(5)).is_err());
        assert!(json_schema(&json!({"x-guidance": {}})).is_err());
        let g = json_schema(&json!({"type": "object"})).unwrap();
        assert!(g.contains("item_separator"), "{g}");
    }

    #[test]
    fn a_tool_grammar_names_every_tool() {
        let tools = [
            Tool {
                name: "get_weather".into(),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            },
            Tool {
                name: "add".into(),
                parameters: json!({"type": "object"}),
            },
        ];
        for lazy in [false, true] {
            let rules = CallRules {
                lazy,
                parallel: true,
                format: CallFormat::Hermes,
            };
            let g = tool_calls(&tools, rules).unwrap();
            assert!(
                g.contains("get_weather") && g.contains("\\\"add\\\""),
                "{g}"
            );
            assert!(tool_calls(&[], rules).is_err());
        }
    }

    #[test]
    fn definitions_are_hoisted_where_references_resolve() {
        let params = json!({
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/Place"}},
            "$defs": {"Place": {"type": "object", "properties": {"near": {"$ref": "#/$defs/Place"}}}}
        });
        let s = call_schema(&[Tool {
            name: "go".into(),
            parameters: params,
        }]);
        assert_eq!(
            s["properties"]["arguments"]["properties"]["where"]["$ref"],
            "#/$defs/t0_Place"
        );
        assert_eq!(
            s["$defs"]["t0_Place"]["properties"]["near"]["$ref"],
            "#/$defs/t0_Place"
        );
        assert!(s["properties"]["arguments"].get("$defs").is_none());
    }
}
