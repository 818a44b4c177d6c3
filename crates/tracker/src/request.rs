//! Turning raw OpenAI-style JSON into a [`ValidRequest`]; code behind this never re-checks input.

use serde_json::Value;
use text::ChatMessage;

use crate::error::ApiError;

/// Which endpoint a request came through (it shapes the response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// The prompt before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Messages(Vec<ChatMessage>),
}

/// Sampling as requested.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingRequest {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub seed: u64,
}

/// A request that passed validation (token-level checks happen once it is tokenized).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingRequest,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `Some(n)`: report the chosen token's logprob and the `n` most likely alternatives.
    pub logprobs: Option<u32>,
    /// Also return the generated token ids (`choices[0].token_ids`, as vLLM does).
    pub return_token_ids: bool,
    /// Keep generating past end-of-sequence tokens (vLLM's `ignore_eos`; for benchmarks).
    pub ignore_eos: bool,
    /// `priority`: `agent` or `grading` (the header `x-strata-priority` is used when absent).
    pub priority: Option<engine::Priority>,
}

/// Longest stop string accepted, in bytes. Stop strings are matched against every generated
/// token; a stop string is a marker, not a document.
pub const MAX_STOP_BYTES: usize = 1024;

fn number(body: &Value, key: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v.as_f64().ok_or_else(|| {
                ApiError::invalid(key, format!("`{key}` must be a number, got {v}"))
            })?;
            if !(min..=max).contains(&x) {
                return Err(ApiError::invalid(
                    key,
                    format!("`{key}` is {x} but must be between {min} and {max}"),
                ));
            }
            Ok(Some(x))
        }
    }
}

fn integer(body: &Value, key: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v.as_u64().ok_or_else(|| {
                ApiError::invalid(
                    key,
                    format!("`{key}` must be a non-negative integer, got {v}"),
                )
            })?;
            if !(min..=max).contains(&x) {
                return Err(ApiError::invalid(
                    key,
                    format!("`{key}` is {x} but must be between {min} and {max}"),
                ));
            }
            Ok(Some(x))
        }
    }
}

fn boolean(body: &Value, key: &str) -> Result<Option<bool>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be a boolean, got {v}"),
        )),
    }
}

/// A message's content as text, moved out of the body (a long text is not copied).
fn content_text(v: Value, idx: usize) -> Result<String, ApiError> {
    let param = format!("messages[{idx}].content");
    match v {
        Value::String(s) => Ok(s),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            &param,
                            format!("`{param}` parts must be text parts"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        other => Err(ApiError::invalid(
            &param,
            format!("`{param}` must be a string, got {other}"),
        )),
    }
}

/// Validates a request body for `endpoint`; the prompt's text is moved out of it, not copied.
pub fn validate(endpoint: Endpoint, mut body: Value) -> Result<ValidRequest, ApiError> {
    if !body.is_object() {
        return Err(ApiError::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    }
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(ApiError::invalid(
                "model",
                format!("`model` must be a string, got {v}"),
            ))
        }
    };
    if let Some(n) = integer(&body, "n", 0, u64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("`n` is {n}; only 1 choice per request is supported"),
            ));
        }
    }
    let prompt = match endpoint {
        Endpoint::Completions => match body.get_mut("prompt").map(Value::take) {
            Some(Value::String(s)) => PromptInput::Text(s),
            Some(Value::Array(mut items)) if items.len() == 1 && items[0].is_string() => {
                PromptInput::Text(match items.pop() {
                    Some(Value::String(s)) => s,
                    _ => String::new(),
                })
            }
            Some(Value::Array(items)) if !items.is_empty() && items.iter().all(|v| v.is_u64()) => {
                let ids = items
                    .iter()
                    .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| {
                        ApiError::invalid("prompt", "token ids in `prompt` must fit in 32 bits")
                    })?;
                PromptInput::Ids(ids)
            }
            Some(Value::Array(_)) => {
                return Err(ApiError::invalid(
                    "prompt",
                    "`prompt` must be a string, a list of one string, or a list of token ids",
                ))
            }
            None | Some(Value::Null) => {
                return Err(ApiError::invalid("prompt", "`prompt` is required"))
            }
            Some(v) => {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("`prompt` must be a string, got {v}"),
                ))
            }
        },
        Endpoint::Chat => {
            let msgs = body
                .get_mut("messages")
                .and_then(Value::as_array_mut)
                .ok_or_else(|| {
                    ApiError::invalid("messages", "`messages` must be a non-empty list")
                })?;
            if msgs.is_empty() {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must be a non-empty list",
                ));
            }
            let mut out = Vec::with_capacity(msgs.len());
            for (i, m) in msgs.iter_mut().enumerate() {
                let content = m.get_mut("content").map(Value::take).unwrap_or(Value::Null);
                let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!("`messages[{i}].role` is required"),
                    )
                })?;
                if !matches!(role, "system" | "user" | "assistant" | "developer" | "tool") {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!("`messages[{i}].role` is `{role}`; expected system, user, assistant, developer or tool"),
                    ));
                }
                let role = if role == "developer" { "system" } else { role };
                out.push(ChatMessage {
                    role: role.to_string(),
                    content: content_text(content, i)?,
                });
            }
            PromptInput::Messages(out)
        }
    };
    let max_tokens = match integer(&body, "max_completion_tokens", 1, 1 << 20)? {
        Some(v) => Some(v as usize),
        None => integer(&body, "max_tokens", 1, 1 << 20)?.map(|v| v as usize),
    };
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > 4 {
                return Err(ApiError::invalid(
                    "stop",
                    format!("`stop` has {} strings; at most 4 are allowed", items.len()),
                ));
            }
            items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| {
                    ApiError::invalid("stop", "`stop` must be a string or a list of strings")
                })?
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!("`stop` must be a string or a list, got {v}"),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::over_limit(
            "stop",
            "max_stop_bytes",
            format!(
                "a `stop` string has {} bytes; at most {MAX_STOP_BYTES} are allowed",
                long.len()
            ),
        ));
    }
    number(&body, "presence_penalty", -2.0, 2.0)?;
    number(&body, "frequency_penalty", -2.0, 2.0)?;
    let logprobs = match endpoint {
        Endpoint::Completions => integer(&body, "logprobs", 0, 20)?.map(|v| v as u32),
        Endpoint::Chat => {
            let top = integer(&body, "top_logprobs", 0, 20)?.map(|v| v as u32);
            match boolean(&body, "logprobs")? {
                Some(true) => Some(top.unwrap_or(0)),
                _ if top.is_some() => {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`",
                    ));
                }
                _ => None,
            }
        }
    };
    let sampling = SamplingRequest {
        temperature: number(&body, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_p: number(&body, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: integer(&body, "top_k", 0, 1 << 20)?.unwrap_or(0) as u32,
        min_p: number(&body, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        repeat_penalty: number(&body, "repetition_penalty", 0.01, 10.0)?.unwrap_or(1.0) as f32,
        seed: match body.get("seed") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_i64().map(|s| s as u64).ok_or_else(|| {
                ApiError::invalid("seed", format!("`seed` must be an integer, got {v}"))
            })?,
        },
    };
    if sampling.top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
    }
    Ok(ValidRequest {
        endpoint,
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        stream: boolean(&body, "stream")?.unwrap_or(false),
        logprobs,
        return_token_ids: boolean(&body, "return_token_ids")?.unwrap_or(false),
        ignore_eos: boolean(&body, "ignore_eos")?.unwrap_or(false),
        priority: match body.get("priority") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_str()
                    .and_then(engine::Priority::parse)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "priority",
                            format!("`priority` must be \"agent\" or \"grading\", got {v}"),
                        )
                    })?,
            ),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_plain_completion_is_valid_and_unknown_fields_are_ignored() {
        let r = validate(
            Endpoint::Completions,
            json!({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "whatever": [1, 2]}),
        )
        .unwrap();
        assert_eq!(r.prompt, PromptInput::Text("hi".into()));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling.temperature, 0.0);
    }

    #[test]
    fn invalid_fields_name_themselves() {
        for (body, param) in [
            (json!({"prompt": "x", "temperature": 7}), "temperature"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": "ten"}), "max_tokens"),
            (json!({"prompt": 5}), "prompt"),
            (json!({}), "prompt"),
            (json!({"prompt": "x", "stop": [1]}), "stop"),
            (json!({"prompt": "x", "n": 3}), "n"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (
                json!({"prompt": "x", "stop": "s".repeat(MAX_STOP_BYTES + 1)}),
                "stop",
            ),
        ] {
            let e = validate(Endpoint::Completions, body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = validate(
            Endpoint::Chat,
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = validate(Endpoint::Chat, json!({"messages": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn chat_logprobs_and_content_parts() {
        let r = validate(
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "logprobs": true, "top_logprobs": 3}),
        )
        .unwrap();
        assert_eq!(r.logprobs, Some(3));
        assert_eq!(
            r.prompt,
            PromptInput::Messages(vec![ChatMessage {
                role: "user".into(),
                content: "ab".into()
            }])
        );
    }
}
