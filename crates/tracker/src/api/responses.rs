//! `POST /v1/responses` (OpenAI's Responses API, what Codex CLI and the OpenAI Agents SDK
//! speak) and `GET`/`DELETE /v1/responses/{id}`: an adapter over the chat session. The input
//! items become chat messages, the tools and formats the same tool set and grammar as chat
//! completions; the answer's parts are rendered as output items ([`super::responses_out`]).
//! `store` (default true) keeps the conversation in a bounded store for
//! `previous_response_id`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use engine::{Reason, Refusal};
use serde_json::{json, Value};
use text::ChatMessage;

use super::agent::{format_grammar, tools, FormatShape, ToolShape};
use super::completions::{admit_valid, read_json};
use super::error::Answer;
use super::fields::{boolean, integer, only, only_value, string};
use super::record::{Outcome, RequestRecord};
use super::request::{
    effort_thinks, logit_bias, priority, sampling, template_kwargs, user, Endpoint, PromptInput,
    ValidRequest,
};
use super::responses_out::{stream_response, whole_response, Turn};
use super::state::AppState;

/// The fields `/v1/responses` takes: OpenAI's, the few strata adds (`seed`, `top_k`,
/// `min_p`, `priority`, `chat_template_kwargs`), and those on the no-effect list.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "reasoning",
    "include",
    "user",
    "seed",
    "top_k",
    "min_p",
    "priority",
    "chat_template_kwargs",
    "prompt_cache_key",
    "cache_salt",
    // On the no-effect list (`fields::NO_EFFECT`).
    "metadata",
    "safety_identifier",
    "prompt_cache_retention",
    "service_tier",
    "client_metadata",
    "truncation",
    "background",
];

/// The `include` values taken: one has an effect (the logprobs of output text), the
/// others name things strata never produces (encrypted reasoning, hosted tools' results).
const INCLUDES: &[&str] = &[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
];

/// Fields of the request echoed in the response object.
const ECHOED: &[&str] = &[
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_output_tokens",
    "metadata",
    "prompt_cache_key",
    "previous_response_id",
    "text",
    "reasoning",
    "truncation",
    "user",
];

/// A validated Responses request: the chat request it becomes, and what only this API has.
pub struct ResponsesRequest {
    pub req: ValidRequest,
    /// The instructions, put first in the prompt and not inherited by a later response.
    pub instructions: Option<String>,
    /// This request's input as messages (the conversation stored after it).
    pub input: Vec<ChatMessage>,
    pub previous: Option<String>,
    pub store: bool,
    /// Request fields the response object echoes.
    pub echo: serde_json::Map<String, Value>,
}

/// A message's content parts as text: `input_text`, `output_text` and `text` parts (a
/// `refusal` part is the model's text too); images, files and audio are refused.
fn content_text(v: &Value, param: &str) -> Result<String, Refusal> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (k, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                let text = match kind {
                    "input_text" | "output_text" | "text" => p.get("text"),
                    "refusal" => p.get("refusal"),
                    other => {
                        return Err(Refusal::invalid(
                            &format!("{param}[{k}].type"),
                            format!("`{param}[{k}].type` is `{other}`: only text parts are supported (this model reads text)"),
                        ))
                    }
                };
                match text.and_then(Value::as_str) {
                    Some(t) => out.push_str(t),
                    None => {
                        return Err(Refusal::invalid(
                            &format!("{param}[{k}]"),
                            format!("`{param}[{k}]` has no text"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        other => Err(Refusal::invalid(
            param,
            format!("`{param}` must be a string or a list of content parts, got {other}"),
        )),
    }
}

/// The input items as chat messages, in order: messages as they are (`developer` is
/// `system`), `function_call` items as the assistant's tool calls (consecutive ones, and
/// the assistant text just before them, in one message), `function_call_output` items as
/// tool messages, a `reasoning` item's text as the next assistant message's thinking.
pub fn input_messages(input: &Value) -> Result<Vec<ChatMessage>, Refusal> {
    let items = match input {
        Value::String(s) => return Ok(vec![ChatMessage::new("user", s)]),
        Value::Array(items) => items,
        Value::Null => return Ok(Vec::new()),
        other => {
            return Err(Refusal::invalid(
                "input",
                format!("`input` must be a string or a list of items, got {other}"),
            ))
        }
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(items.len());
    let mut reasoning: Option<String> = None;
    // The tool name of each call id, for the outputs that answer them.
    let mut names: Vec<(String, String)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        let kind = match item.get("type").and_then(Value::as_str) {
            Some(k) => k,
            None if item.get("role").is_some() => "message",
            None => return Err(Refusal::invalid(&p, format!("`{p}.type` is required"))),
        };
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                let role = match role {
                    "user" | "assistant" | "system" => role,
                    "developer" => "system",
                    other => {
                        return Err(Refusal::invalid(
                            &format!("{p}.role"),
                            format!("`{p}.role` is `{other}`; expected user, assistant, system or developer"),
                        ))
                    }
                };
                let text = content_text(item.get("content").unwrap_or(&Value::Null), &format!("{p}.content"))?;
                let mut m = ChatMessage::new(role, &text);
                if role == "assistant" {
                    m.reasoning_content = reasoning.take();
                }
                out.push(m);
            }
            "function_call" => {
                let (call, call_id, name) = function_call(item, &p)?;
                names.push((call_id, name));
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => m
                        .tool_calls
                        .get_or_insert_with(|| Value::Array(Vec::new()))
                        .as_array_mut()
                        .expect("tool calls are a list")
                        .push(call),
                    _ => out.push(ChatMessage {
                        tool_calls: Some(Value::Array(vec![call])),
                        reasoning_content: reasoning.take(),
                        ..ChatMessage::new("assistant", "")
                    }),
                }
            }
            "function_call_output" => {
                let call_id = string_of(item, "call_id", &p)?;
                let output = content_text(item.get("output").unwrap_or(&Value::Null), &format!("{p}.output"))?;
                let name = names
                    .iter()
                    .rev()
                    .find(|(id, _)| *id == call_id)
                    .map(|(_, n)| n.clone());
                out.push(ChatMessage {
                    tool_call_id: Some(call_id),
                    name,
                    ..ChatMessage::new("tool", &output)
                });
            }
            "reasoning" => {
                let text: String = item
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|part| part.get("text").and_then(Value::as_str))
                    .collect();
                reasoning = Some(text).filter(|t| !t.is_empty());
            }
            "item_reference" => {
                return Err(Refusal::invalid(
                    &format!("{p}.type"),
                    format!("`{p}` is an `item_reference`: send the item itself, or `previous_response_id`"),
                ))
            }
            other => {
                return Err(Refusal::invalid(
                    &format!("{p}.type"),
                    format!("`{p}.type` is `{other}`; expected message, function_call, function_call_output or reasoning"),
                ))
            }
        }
    }
    Ok(out)
}

/// A `function_call` item (at `p`) as a call in the history: the call as templates read it
/// (its arguments an object), its call id and its tool's name.
fn function_call(item: &Value, p: &str) -> Result<(Value, String, String), Refusal> {
    let name = string_of(item, "name", p)?;
    let call_id = string_of(item, "call_id", p)?;
    let arguments = match item.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) if s.trim().is_empty() => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
            Refusal::invalid(
                &format!("{p}.arguments"),
                format!("`{p}.arguments` is not JSON: {e}"),
            )
        })?,
        Some(_) => {
            return Err(Refusal::invalid(
                &format!("{p}.arguments"),
                format!("`{p}.arguments` must be a JSON text"),
            ))
        }
    };
    let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
    Ok((call, call_id, name))
}

fn string_of(item: &Value, key: &str, p: &str) -> Result<String, Refusal> {
    item.get(key)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            Refusal::invalid(
                &format!("{p}.{key}"),
                format!("`{p}.{key}` is required and must be a string"),
            )
        })
}

/// The fields with no effect whose other values would change something: checked here.
fn no_effect_fields(body: &Value) -> Result<(), Refusal> {
    only_value(body.get("truncation"), "truncation", &json!("disabled"))?;
    only_value(body.get("background"), "background", &json!(false))?;
    if let Some(so) = body.get("stream_options").filter(|v| !v.is_null()) {
        only(
            so,
            "stream_options",
            &["include_obfuscation"],
            "/v1/responses",
        )?;
    }
    if let Some(list) = body.get("include").filter(|v| !v.is_null()) {
        let list = list
            .as_array()
            .ok_or_else(|| Refusal::invalid("include", "`include` must be a list of strings"))?;
        for (k, v) in list.iter().enumerate() {
            if !v.as_str().is_some_and(|s| INCLUDES.contains(&s)) {
                return Err(Refusal::invalid(
                    &format!("include[{k}]"),
                    format!(
                        "`include[{k}]` is {v}; expected one of {}",
                        INCLUDES.join(", ")
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// `text`: its `format` as a grammar; `verbosity` only at its default.
fn text_format(body: &Value) -> Result<Option<String>, Refusal> {
    let Some(t) = body.get("text").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    only(t, "text", &["format", "verbosity"], "/v1/responses")?;
    only_value(t.get("verbosity"), "text.verbosity", &json!("medium"))?;
    match t.get("format").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(f) => format_grammar(f, "text.format", FormatShape::Flat),
    }
}

/// `reasoning`: its effort turns a thinking template's section on or off.
fn reasoning(body: &Value) -> Result<Option<bool>, Refusal> {
    let Some(r) = body.get("reasoning").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    only(
        r,
        "reasoning",
        &["effort", "summary", "generate_summary"],
        "/v1/responses",
    )?;
    effort_thinks(r.get("effort"), "reasoning.effort")
}

/// Validates a Responses request body.
pub fn validate(mut body: Value, fresh_seed: u64) -> Result<ResponsesRequest, Refusal> {
    if !body.is_object() {
        return Err(Refusal::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    }
    only(&body, "", FIELDS, "/v1/responses")?;
    super::fields::metadata(&body)?;
    no_effect_fields(&body)?;
    let model = string(&body, "model")?;
    let instructions = string(&body, "instructions")?;
    let input_v = body
        .get_mut("input")
        .map(Value::take)
        .unwrap_or(Value::Null);
    let input = input_messages(&input_v)?;
    let previous = string(&body, "previous_response_id")?;
    if input.is_empty() && previous.is_none() {
        return Err(Refusal::invalid("input", "`input` is required"));
    }
    let stream = boolean(&body, "stream")?.unwrap_or(false);
    if body.get("stream_options").is_some_and(|v| !v.is_null()) && !stream {
        return Err(Refusal::invalid(
            "stream_options",
            "`stream_options` is only for `stream: true`",
        ));
    }
    let top = integer(&body, "top_logprobs", 0, 20)?.map(|v| v as u32);
    let wants_logprobs = body
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|l| l.iter().any(|v| v == "message.output_text.logprobs"));
    let logprobs = match (top, wants_logprobs) {
        (Some(n), _) => Some(n),
        (None, true) => Some(0),
        (None, false) => None,
    };
    let grammar = text_format(&body)?;
    let tools = tools(&body, ToolShape::Responses)?;
    if grammar.is_some() && tools.as_ref().is_some_and(|t| t.active()) {
        return Err(Refusal::invalid(
            "text.format",
            "`text.format` with `tools` is not supported: the answer is either a document or tool calls (give `tool_choice: \"none\"` to keep the tools out)",
        ));
    }
    let echo = ECHOED
        .iter()
        .filter_map(|k| body.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect();
    let sampling = sampling(&body, logit_bias(&body)?, fresh_seed)?;
    let req = ValidRequest {
        model,
        max_tokens: integer(&body, "max_output_tokens", 1, 1 << 20)?.map(|v| v as usize),
        stream,
        logprobs,
        priority: priority(&body)?,
        grammar,
        tools,
        user: user(&body)?,
        thinking: reasoning(&body)?,
        template_kwargs: template_kwargs(&body)?,
        cache_group: super::fields::cache_group(&body)?,
        ..ValidRequest::session(Endpoint::Responses, Vec::new(), sampling)
    };
    if req.sampling.top_p == 0.0 {
        return Err(Refusal::invalid("top_p", "`top_p` must be greater than 0"));
    }
    Ok(ResponsesRequest {
        req,
        instructions,
        input,
        previous,
        store: boolean(&body, "store")?.unwrap_or(true),
        echo,
    })
}

/// The API key name a request stores and reads responses under ("" without keys).
fn key_name(s: &AppState, headers: &HeaderMap) -> Result<String, Refusal> {
    Ok(s.key(headers)?.map(|k| k.name).unwrap_or_default())
}

fn unknown_response(id: &str) -> Refusal {
    Refusal::new(
        Reason::NotFound,
        format!("no stored response `{id}` (responses are kept while the store has room, and only for the key that made them)"),
    )
    .with_param("previous_response_id")
}

pub async fn create(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let mut record = RequestRecord::new(Arc::clone(&s.metrics), String::new(), Endpoint::Responses);
    match start(&s, &headers, body, &mut record).await {
        Err(e) => {
            record.finish(Outcome::Failed(&e));
            e.into_response()
        }
        Ok((accepted, turn)) => {
            record.id = accepted.id.clone();
            if accepted.req.stream {
                stream_response(accepted, record, turn, Arc::clone(&s)).into_response()
            } else {
                whole_response(accepted, record, turn, &s).await
            }
        }
    }
}

/// Validation, the stored conversation a `previous_response_id` continues, and admission.
async fn start(
    s: &AppState,
    headers: &HeaderMap,
    body: axum::body::Body,
    record: &mut RequestRecord,
) -> Result<(super::respond::Accepted, Turn), Refusal> {
    let seed = super::completions::fresh_seed();
    let t = s.default_temperature;
    let check = move |v| validate(super::request::with_default_temperature(v, t), seed);
    let r = read_json(s, headers, body, check).await?;
    let key = key_name(s, headers)?;
    let mut conversation = match &r.previous {
        None => Vec::new(),
        Some(id) => s
            .stored_responses
            .get(&key, id)
            .ok_or_else(|| unknown_response(id))?
            .conversation
            .as_ref()
            .clone(),
    };
    conversation.extend(r.input.iter().cloned());
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(i) = &r.instructions {
        messages.push(ChatMessage::new("system", i));
    }
    messages.extend(conversation.iter().cloned());
    if messages.is_empty() {
        return Err(Refusal::invalid("input", "`input` is required"));
    }
    let mut req = r.req;
    req.prompt = PromptInput::Messages(messages);
    let turn = Turn {
        key,
        conversation: r.store.then_some(conversation),
        echo: r.echo,
        store: r.store,
    };
    let accepted = admit_valid(s, req, headers, record).await?;
    Ok((accepted, turn))
}

/// `GET /v1/responses/{id}`: a stored response, for the key that made it.
pub async fn get(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let key = match key_name(&s, &headers) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    match s.stored_responses.get(&key, &id) {
        Some(st) => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            st.response.clone(),
        )
            .into_response(),
        None => unknown_response(&id).with_param("id").into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let key = match key_name(&s, &headers) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    if s.stored_responses.delete(&key, &id) {
        axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        unknown_response(&id).with_param("id").into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::request::ContextFit;

    #[test]
    fn items_become_the_chat_messages_they_say() {
        let m = input_messages(&json!([
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "need a call"}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]))
        .unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(
            (m[0].role.as_str(), m[0].content.as_str()),
            ("system", "be brief")
        );
        assert_eq!(m[1].content, "weather in Paris?");
        assert_eq!(m[2].role, "assistant");
        assert_eq!(m[2].reasoning_content.as_deref(), Some("need a call"));
        let calls = m[2].tool_calls.as_ref().unwrap().as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!(m[3].role, "tool");
        assert_eq!(m[3].name.as_deref(), Some("w"));
        assert_eq!(m[4].content, "Sunny.");
        assert_eq!(input_messages(&json!("hi")).unwrap()[0].role, "user");
    }

    #[test]
    fn what_this_api_cannot_do_is_refused_by_name() {
        for (body, param) in [
            (json!({"input": "x", "conversation": "c"}), "conversation"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (json!({"input": "x", "include": ["nope"]}), "include[0]"),
            (
                json!({"input": "x", "text": {"verbosity": "low"}}),
                "text.verbosity",
            ),
            (
                json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0].content[0].type",
            ),
            (
                json!({"input": [{"type": "computer_call"}]}),
                "input[0].type",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "{"}]}),
                "input[0].arguments",
            ),
            (
                json!({"input": "x", "reasoning": {"effort": "huge"}}),
                "reasoning.effort",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}),
                "text.format.schema",
            ),
            (json!({}), "input"),
            // `metadata` as OpenAI bounds it: it is echoed into the stored response.
            (json!({"input": "x", "metadata": vec![0; 1000]}), "metadata"),
            (json!({"input": "x", "metadata": {"k": 1}}), "metadata"),
            (
                json!({"input": "x", "metadata": {"k": "v".repeat(513)}}),
                "metadata",
            ),
            (
                json!({"input": "x", "metadata": {"k".repeat(65): "v"}}),
                "metadata",
            ),
            (
                json!({"input": "x", "metadata": (0..17).map(|i| (i.to_string(), json!("v"))).collect::<serde_json::Map<_, _>>()}),
                "metadata",
            ),
        ] {
            let e = validate(body.clone(), 1).err().expect("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn codex_s_request_fields_are_taken() {
        let r = validate(
            json!({"model": "m", "stream": true, "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                   "tools": [{"type": "function", "name": "exec_command", "strict": false, "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
                             {"type": "web_search", "external_web_access": false}],
                   "tool_choice": "auto", "parallel_tool_calls": true, "reasoning": {"summary": "auto"}, "store": false,
                   "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "client_metadata": {"a": "b"},
                   "metadata": {"session": "s-1", "user": "u"},
                   "text": {"format": {"type": "text"}}}),
            1,
        )
        .unwrap();
        assert!(!r.store);
        assert_eq!(r.req.tools.as_ref().unwrap().tools.len(), 1);
        assert_eq!(r.req.fit, ContextFit::Cut);
        assert!(r.req.grammar.is_none());
    }
}
