//! `POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API, what
//! Claude Code and the anthropic SDKs speak): an adapter over the chat session. Content
//! blocks become chat messages (`tool_use` the assistant's calls, `tool_result` tool
//! messages, `thinking` the assistant's reasoning), tools and `tool_choice` the same tool set
//! and grammar as chat completions; the answer is rendered as content blocks
//! ([`super::messages_out`]). Errors have Anthropic's shape ([`super::error::anthropic`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use engine::Refusal;
use serde_json::{json, Value};
use text::ChatMessage;

use super::agent::{format_grammar, tools, FormatShape, ToolShape};
use super::completions::{admit_valid, fresh_seed, prompt_tokens, read_json};
use super::error::anthropic;
use super::fields::{boolean, integer, number, only, string};
use super::messages_out::{stream_response, whole_response};
use super::record::{Outcome, RequestRecord};
use super::request::{priority, sampling, stop_strings, template_kwargs, Endpoint, ValidRequest};
use super::state::AppState;

/// The fields `/v1/messages` takes: Anthropic's, the few strata adds (`seed`, `min_p`,
/// `priority`, `chat_template_kwargs`), and those on the no-effect list.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "output_format",
    "seed",
    "min_p",
    "priority",
    "chat_template_kwargs",
    // On the no-effect list (`fields::NO_EFFECT`).
    "metadata",
    "service_tier",
    "context_management",
];

/// Most stop sequences.
const MAX_STOP_SEQUENCES: usize = 16;

/// A block list's or a string's text (`text` blocks; `cache_control` is taken, prompt
/// caching being automatic); other blocks are refused, naming them.
fn text_of(v: &Value, param: &str) -> Result<String, Refusal> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (k, b) in blocks.iter().enumerate() {
                let p = format!("{param}[{k}]");
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        if !out.is_empty() {
                            out.push('\n');
                        }
                        out.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| {
                            Refusal::invalid(
                                &format!("{p}.text"),
                                format!("`{p}.text` must be a string"),
                            )
                        })?)
                    }
                    Some(other) => return Err(unsupported_block(&p, other)),
                    None => return Err(Refusal::invalid(&p, format!("`{p}.type` is required"))),
                }
            }
            Ok(out)
        }
        other => Err(Refusal::invalid(
            param,
            format!("`{param}` must be a string or a list of text blocks, got {other}"),
        )),
    }
}

fn unsupported_block(p: &str, kind: &str) -> Refusal {
    Refusal::invalid(
        &format!("{p}.type"),
        format!("`{p}` is a block of type `{kind}`: this model reads text, tool_use, tool_result and thinking blocks"),
    )
}

/// A string field of block `b` (at `bp`), required.
fn field<'a>(b: &'a Value, key: &str, bp: &str) -> Result<&'a str, Refusal> {
    b.get(key).and_then(Value::as_str).ok_or_else(|| {
        Refusal::invalid(
            &format!("{bp}.{key}"),
            format!("`{bp}.{key}` must be a string"),
        )
    })
}

/// One message of `messages` as chat messages: a user turn's `tool_result` blocks become
/// tool messages (before the turn's text), an assistant turn's `tool_use` blocks its calls
/// and `thinking` blocks its reasoning; a `system` turn (Claude Code sends them between
/// others) stays a system message.
fn message(
    i: usize,
    m: &Value,
    last: bool,
    names: &mut Vec<(String, String)>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), Refusal> {
    let p = format!("messages[{i}]");
    only(m, &p, &["role", "content"], "/v1/messages")?;
    let role = m.get("role").and_then(Value::as_str).unwrap_or("");
    let content = m.get("content").unwrap_or(&Value::Null);
    let cp = format!("{p}.content");
    match (role, content) {
        // As Anthropic: every turn says something, but the last one may be an empty
        // assistant turn (the answer's start, prefilled with nothing).
        ("user" | "assistant", Value::Array(blocks))
            if blocks.is_empty() && !(last && role == "assistant") =>
        {
            return Err(Refusal::invalid(
                &cp,
                format!("`{cp}` is an empty list: a turn holds at least one block"),
            ))
        }
        ("system", c) => out.push(ChatMessage::new("system", &text_of(c, &cp)?)),
        ("user" | "assistant", Value::String(s)) => out.push(ChatMessage::new(role, s)),
        ("user" | "assistant", Value::Array(blocks)) => turn(role, blocks, &cp, names, out)?,
        ("user" | "assistant", other) => {
            return Err(Refusal::invalid(
                &cp,
                format!("`{cp}` must be a string or a list of blocks, got {other}"),
            ))
        }
        (other, _) => {
            return Err(Refusal::invalid(
                &format!("{p}.role"),
                format!("`{p}.role` is `{other}`; expected user or assistant"),
            ))
        }
    }
    Ok(())
}

/// A user or assistant turn's blocks (at `cp`), into `out`.
fn turn(
    role: &str,
    blocks: &[Value],
    cp: &str,
    names: &mut Vec<(String, String)>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), Refusal> {
    let mut msg = ChatMessage::new(role, "");
    let mut calls = Vec::new();
    let mut results = 0;
    for (k, b) in blocks.iter().enumerate() {
        let bp = format!("{cp}[{k}]");
        match (role, b.get("type").and_then(Value::as_str).unwrap_or("")) {
            (_, "text") => {
                if !msg.content.is_empty() {
                    msg.content.push('\n');
                }
                msg.content.push_str(field(b, "text", &bp)?);
            }
            ("assistant", "tool_use") => {
                let id = b.get("id").and_then(Value::as_str).unwrap_or_default();
                let name = field(b, "name", &bp)?;
                let input = b.get("input").cloned().unwrap_or(json!({}));
                if !input.is_object() {
                    return Err(Refusal::invalid(
                        &format!("{bp}.input"),
                        format!("`{bp}.input` must be an object"),
                    ));
                }
                names.push((id.to_string(), name.to_string()));
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            ("assistant", "thinking") => {
                let t = b
                    .get("thinking")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                msg.reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(t);
            }
            // Nothing readable: Anthropic's encrypted thinking.
            ("assistant", "redacted_thinking") => {}
            ("user", "tool_result") => {
                results += 1;
                out.push(tool_result(b, &bp, names)?);
            }
            (_, other) => return Err(unsupported_block(&bp, other)),
        }
    }
    // A turn of tool results alone is those results.
    if role == "user" && msg.content.is_empty() && results > 0 {
        return Ok(());
    }
    if !calls.is_empty() {
        msg.tool_calls = Some(Value::Array(calls));
    }
    out.push(msg);
    Ok(())
}

/// A `tool_result` block (at `bp`) as a tool message, named after the call it answers.
fn tool_result(b: &Value, bp: &str, names: &[(String, String)]) -> Result<ChatMessage, Refusal> {
    let id = field(b, "tool_use_id", bp)?;
    let mut result = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(c) => text_of(c, &format!("{bp}.content"))?,
    };
    if boolean(b, "is_error")?.unwrap_or(false) {
        result = format!("Error: {result}");
    }
    // As Anthropic: a result answers a call made before it.
    let Some(name) = names
        .iter()
        .rev()
        .find(|(c, _)| c == id)
        .map(|(_, n)| n.clone())
    else {
        return Err(Refusal::invalid(
            &format!("{bp}.tool_use_id"),
            format!("`{bp}.tool_use_id` is `{id}`, which no earlier tool_use block names"),
        ));
    };
    let name = Some(name);
    Ok(ChatMessage {
        tool_call_id: Some(id.to_string()),
        name,
        ..ChatMessage::new("tool", &result)
    })
}

/// `system` and `messages` as chat messages.
pub fn conversation(body: &Value) -> Result<Vec<ChatMessage>, Refusal> {
    let mut out = Vec::new();
    if let Some(s) = body.get("system").filter(|v| !v.is_null()) {
        out.push(ChatMessage::new("system", &text_of(s, "system")?));
    }
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| Refusal::invalid("messages", "`messages` must be a non-empty list"))?;
    let mut names = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        message(i, m, i + 1 == msgs.len(), &mut names, &mut out)?;
    }
    Ok(out)
}

/// `thinking`: on or off for a template with a thinking section (`adaptive` is on: the
/// model decides how long it thinks).
fn thinking(body: &Value) -> Result<Option<bool>, Refusal> {
    let Some(t) = body.get("thinking").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    only(
        t,
        "thinking",
        &["type", "budget_tokens", "display"],
        "/v1/messages",
    )?;
    integer(t, "budget_tokens", 0, 1 << 20).map_err(|e| e.with_param("thinking.budget_tokens"))?;
    match t.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        _ => Err(Refusal::invalid(
            "thinking.type",
            "`thinking.type` must be enabled, adaptive or disabled",
        )),
    }
}

/// `output_config` (its `format` a grammar; `effort` on the no-effect list) or the older
/// `output_format`.
fn output_format(body: &Value) -> Result<Option<String>, Refusal> {
    if let Some(f) = body.get("output_format").filter(|v| !v.is_null()) {
        return format_grammar(f, "output_format", FormatShape::Flat);
    }
    let Some(c) = body.get("output_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    only(c, "output_config", &["effort", "format"], "/v1/messages")?;
    match c.get("format").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(f) => format_grammar(f, "output_config.format", FormatShape::Flat),
    }
}

/// Validates a Messages request body (`count`: for `count_tokens`, which needs no
/// `max_tokens`).
pub fn validate(body: Value, fresh_seed: u64, count: bool) -> Result<ValidRequest, Refusal> {
    if !body.is_object() {
        return Err(Refusal::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    }
    only(
        &body,
        "",
        FIELDS,
        if count {
            "/v1/messages/count_tokens"
        } else {
            "/v1/messages"
        },
    )?;
    let messages = conversation(&body)?;
    let max_tokens = integer(&body, "max_tokens", 1, 1 << 20)?.map(|v| v as usize);
    if max_tokens.is_none() && !count {
        return Err(Refusal::invalid("max_tokens", "`max_tokens` is required"));
    }
    let grammar = output_format(&body)?;
    let tools = tools(&body, ToolShape::Messages)?;
    if grammar.is_some() && tools.as_ref().is_some_and(|t| t.active()) {
        return Err(Refusal::invalid(
            "output_config.format",
            "an output format with `tools` is not supported: the answer is either a document or tool calls",
        ));
    }
    number(&body, "temperature", 0.0, 1.0)?;
    let sampling = sampling(&body, Vec::new(), fresh_seed)?;
    let req = ValidRequest {
        model: string(&body, "model")?,
        max_tokens,
        stop: stop_strings(
            body.get("stop_sequences"),
            "stop_sequences",
            MAX_STOP_SEQUENCES,
        )?,
        stream: boolean(&body, "stream")?.unwrap_or(false),
        priority: priority(&body)?,
        grammar,
        tools,
        thinking: thinking(&body)?,
        template_kwargs: template_kwargs(&body)?,
        ..ValidRequest::session(Endpoint::Messages, messages, sampling)
    };
    if req.sampling.top_p == 0.0 {
        return Err(Refusal::invalid("top_p", "`top_p` must be greater than 0"));
    }
    Ok(req)
}

pub async fn create(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let mut record = RequestRecord::new(Arc::clone(&s.metrics), String::new(), Endpoint::Messages);
    let seed = fresh_seed();
    let t = s.default_temperature;
    let check = move |v| validate(super::request::with_default_temperature(v, t), seed, false);
    let admitted = match read_json(&s, &headers, body, check).await {
        Ok(req) => admit_valid(&s, req, &headers, &mut record).await,
        Err(e) => Err(e),
    };
    match admitted {
        Err(e) => {
            record.finish(Outcome::Failed(&e));
            anthropic(&e)
        }
        Ok(a) => {
            record.id = a.id.clone();
            if a.req.stream {
                stream_response(a, record).into_response()
            } else {
                whole_response(a, record).await
            }
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model would see them.
pub async fn count_tokens(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let counted = match read_json(&s, &headers, body, move |v| validate(v, 0, true)).await {
        Ok(req) => prompt_tokens(&s, req, &headers).await,
        Err(e) => Err(e),
    };
    match counted {
        Ok(n) => axum::Json(json!({"input_tokens": n})).into_response(),
        Err(e) => anthropic(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::request::ContextFit;

    #[test]
    fn blocks_become_the_chat_messages_they_say() {
        let m = conversation(&json!({
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "weather?", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "agents: none"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "need a call", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": true}, {"type": "text", "text": "and?"}]},
            ]
        }))
        .unwrap();
        let roles: Vec<&str> = m.iter().map(|x| x.role.as_str()).collect();
        assert_eq!(
            roles,
            [
                "system",
                "user",
                "system",
                "assistant",
                "tool",
                "tool",
                "user"
            ]
        );
        assert_eq!(m[3].content, "Checking.");
        assert_eq!(m[3].reasoning_content.as_deref(), Some("need a call"));
        assert_eq!(
            m[3].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["city"],
            "Paris"
        );
        assert_eq!(
            (m[4].content.as_str(), m[4].name.as_deref()),
            ("sunny", Some("w"))
        );
        assert_eq!(m[5].content, "Error: boom");
        assert_eq!(m[6].content, "and?");
    }

    #[test]
    fn what_this_api_cannot_do_is_refused_by_name() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for (body, param) in [
            (json!({"messages": user}), "max_tokens"),
            (
                json!({"messages": user, "max_tokens": 5, "mcp_servers": []}),
                "mcp_servers",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}),
                "messages[0].content[0].type",
            ),
            (
                json!({"messages": user, "max_tokens": 5, "temperature": 1.5}),
                "temperature",
            ),
            (
                json!({"messages": user, "max_tokens": 5, "thinking": {"type": "sometimes"}}),
                "thinking.type",
            ),
            (
                json!({"messages": user, "max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": 1}}}),
                "output_config.format.schema",
            ),
            (
                json!({"messages": user, "max_tokens": 5, "stop_sequences": [""]}),
                "stop_sequences",
            ),
            (json!({"messages": [], "max_tokens": 5}), "messages"),
            (
                json!({"messages": [{"role": "user", "content": []}], "max_tokens": 5}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": []}, {"role": "user", "content": "hi"}], "max_tokens": 5}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nobody", "content": "sunny"}]}], "max_tokens": 5}),
                "messages[0].content[0].tool_use_id",
            ),
        ] {
            let e = validate(body.clone(), 1, false).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        assert!(
            validate(json!({"messages": user}), 1, true).is_ok(),
            "count_tokens needs no max_tokens"
        );
        let prefilled_with_nothing =
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]);
        assert!(
            validate(
                json!({"messages": prefilled_with_nothing, "max_tokens": 5}),
                1,
                false
            )
            .is_ok(),
            "the last turn may be an empty assistant turn"
        );
    }

    #[test]
    fn claude_code_s_request_fields_are_taken() {
        let r = validate(
            json!({"model": "m", "max_tokens": 32000, "stream": true,
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
                   "system": [{"type": "text", "text": "x"}],
                   "tools": [{"name": "Read", "description": "reads", "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"], "additionalProperties": false}}],
                   "metadata": {"user_id": "u"}, "thinking": {"type": "adaptive"},
                   "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                   "output_config": {"effort": "high"}}),
            1,
            false,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(32000));
        assert_eq!(r.fit, ContextFit::Cut);
        assert_eq!(r.thinking, Some(true));
        assert_eq!(r.tools.as_ref().unwrap().tools[0].name, "Read");
    }
}
