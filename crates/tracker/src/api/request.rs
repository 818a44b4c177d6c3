//! Turning raw OpenAI-style JSON into a [`ValidRequest`]; code behind this never re-checks input.

use serde_json::Value;
use text::ChatMessage;

use engine::Refusal;

use super::fields::{boolean, integer, number, string};

/// Which endpoint a request came through (it shapes the response).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
    /// OpenAI's Responses API: a chat session, its input as items.
    Responses,
    /// Anthropic's Messages API: a chat session, its content as blocks.
    Messages,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
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

/// How many of the last tokens the repetition penalty looks at (llama.cpp's default).
pub const REPEAT_LAST_N: u32 = 64;

/// Sampling as requested.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingRequest {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Token id to bias, in [-100, 100] (ids are checked against the vocabulary once the
    /// model is known).
    pub logit_bias: Vec<(u32, f32)>,
    /// The request's seed, or a fresh one: requests without a seed differ.
    pub seed: u64,
    /// Whether the request gave the seed (choice `i` of `n` then uses `seed + i`).
    pub seeded: bool,
}

impl SamplingRequest {
    /// The sampling the last shard runs for a session of `n_prompt` prompt tokens, held to
    /// `grammar` when there is one: the one conversion from request to wire.
    pub fn to_wire(&self, n_prompt: usize, grammar: Option<String>) -> proto::v1::Sampling {
        proto::v1::Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: REPEAT_LAST_N,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self
                .logit_bias
                .iter()
                .map(|&(token, bias)| proto::v1::LogitBias { token, bias })
                .collect(),
            n_prompt: n_prompt as u32,
            grammar: grammar.unwrap_or_default(),
        }
    }
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
    /// Choices to generate (`n`), each its own session with its own seed.
    pub n: usize,
    /// Completions: the prompt's text comes back before the answer.
    pub echo: bool,
    /// Completions: the text after the insertion point (fill-in-the-middle).
    pub suffix: Option<String>,
    /// Streaming: a last chunk with the usage and no choices (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The grammar `response_format` asks for.
    pub grammar: Option<String>,
    /// Chat: the tools offered and the choice among them.
    pub tools: Option<crate::api::agent::ToolSet>,
    /// The end user the caller names (`user`), written in the request's log line.
    pub user: Option<String>,
    /// Whether the model thinks before it answers, when its template has a thinking
    /// section: `Some(false)` turns it off, `Some(true)` on, `None` leaves the template's
    /// default. A model without one never thinks, whatever this says.
    pub thinking: Option<bool>,
    /// Variables for the chat template (`chat_template_kwargs`), beside the ones strata sets.
    pub template_kwargs: serde_json::Map<String, Value>,
    /// What a `max_tokens` over the context left after the prompt does.
    pub fit: ContextFit,
    /// The prefix-cache group it names (`prompt_cache_key`, `cache_salt`; see
    /// [`super::fields::cache_group`]).
    pub cache_group: Option<String>,
    /// `speculative`: whether its decode steps may carry drafted tokens when the route
    /// speculates (the tokens are the same either way; `false` opts out).
    pub speculative: bool,
}

impl ValidRequest {
    /// One chat session of the Responses or Messages API, as those APIs have them: one
    /// choice, no echo, suffix or token ids, output cut to the context; the adapters set the
    /// rest.
    pub fn session(
        endpoint: Endpoint,
        messages: Vec<ChatMessage>,
        sampling: SamplingRequest,
    ) -> Self {
        ValidRequest {
            endpoint,
            model: None,
            prompt: PromptInput::Messages(messages),
            max_tokens: None,
            sampling,
            stop: Vec::new(),
            stream: false,
            logprobs: None,
            return_token_ids: false,
            ignore_eos: false,
            speculative: true,
            priority: None,
            n: 1,
            echo: false,
            suffix: None,
            include_usage: false,
            grammar: None,
            tools: None,
            user: None,
            thinking: None,
            template_kwargs: Default::default(),
            fit: ContextFit::Cut,
            cache_group: None,
        }
    }
}

/// What a `max_tokens` over the context left after the prompt does: OpenAI's endpoints
/// refuse it (as OpenAI does); the Responses and Messages APIs, whose clients send the
/// largest output their own models allow (Claude Code asks for 32000 on every request), cut
/// it to what the context leaves, as llama-server does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextFit {
    Refuse,
    Cut,
}

/// The fields each endpoint takes; any other is refused with a 400 naming it, never ignored.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "n",
    "response_format",
    "user",
    "priority",
    "return_token_ids",
    "ignore_eos",
    "speculative",
];
const COMPLETION_FIELDS: &[&str] = &[
    "prompt",
    "echo",
    "suffix",
    "best_of",
    "prompt_cache_key",
    "cache_salt",
];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "prompt_cache_key",
    "cache_salt",
    // On the no-effect list (`fields::NO_EFFECT`).
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_retention",
    "safety_identifier",
];

/// The fields a chat message may have.
const MESSAGE_FIELDS: &[&str] = &[
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
];

/// Most choices one request may ask for.
pub const MAX_N: u64 = 16;
/// Most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Longest stop string accepted, in bytes. Stop strings are matched against every generated
/// token; a stop string is a marker, not a document.
pub const MAX_STOP_BYTES: usize = 1024;

/// A message's content as text, moved out of the body (a long text is not copied).
fn content_text(v: Value, idx: usize) -> Result<String, Refusal> {
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
                        return Err(Refusal::invalid(
                            &param,
                            format!("`{param}` parts must be text parts"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        other => Err(Refusal::invalid(
            &param,
            format!("`{param}` must be a string, got {other}"),
        )),
    }
}

/// Validates a request body for `endpoint`; the prompt's text is moved out of it, not copied.
/// `fresh_seed` is the seed of a request that gives none (the caller draws it: nothing here
/// reads a clock or a random source). Checks run in a fixed order: the first fault found is
/// the one named.
pub fn validate(
    endpoint: Endpoint,
    mut body: Value,
    fresh_seed: u64,
) -> Result<ValidRequest, Refusal> {
    let model = model_and_fields(endpoint, &body)?;
    super::fields::metadata(&body)?;
    let n = choices(&body)?;
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(&mut body)?,
        _ => chat_messages(&mut body)?,
    };
    let max_tokens = match integer(&body, "max_completion_tokens", 1, 1 << 20)? {
        Some(v) => Some(v as usize),
        None => integer(&body, "max_tokens", 1, 1 << 20)?.map(|v| v as usize),
    };
    let stop = stop(&body)?;
    let logit_bias = logit_bias(&body)?;
    let (stream, include_usage) = streaming(&body)?;
    let logprobs = logprobs(endpoint, &body)?;
    let sampling = sampling(&body, logit_bias, fresh_seed)?;
    let (echo, suffix) = echo_and_suffix(&body, logprobs)?;
    let grammar = crate::api::agent::response_format(&body)?;
    let tools = match endpoint {
        Endpoint::Completions => None,
        _ => crate::api::agent::tools(&body, crate::api::agent::ToolShape::Chat)?,
    };
    let (return_token_ids, ignore_eos) =
        constrained_rules(&body, &grammar, tools.as_ref(), stream, logprobs)?;
    let user = user(&body)?;
    if sampling.top_p == 0.0 {
        return Err(Refusal::invalid("top_p", "`top_p` must be greater than 0"));
    }
    Ok(ValidRequest {
        endpoint,
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        stream,
        logprobs,
        return_token_ids,
        ignore_eos,
        speculative: boolean(&body, "speculative")?.unwrap_or(true),
        priority: priority(&body)?,
        n,
        echo,
        suffix,
        include_usage,
        grammar,
        tools,
        user,
        thinking: reasoning_effort(&body)?,
        template_kwargs: template_kwargs(&body)?,
        fit: ContextFit::Refuse,
        cache_group: super::fields::cache_group(&body)?,
    })
}

/// Efforts a reasoning request may name: `none` turns thinking off, the others on.
pub const EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh"];

/// Whether an effort level (`reasoning_effort`, `reasoning.effort`) turns thinking on.
pub fn effort_thinks(v: Option<&Value>, param: &str) -> Result<Option<bool>, Refusal> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(e)) if EFFORTS.contains(&e.as_str()) => Ok(Some(e != "none")),
        Some(v) => Err(Refusal::invalid(
            param,
            format!("`{param}` is {v}; expected one of {}", EFFORTS.join(", ")),
        )),
    }
}

fn reasoning_effort(body: &Value) -> Result<Option<bool>, Refusal> {
    effort_thinks(body.get("reasoning_effort"), "reasoning_effort")
}

/// Template variables strata sets itself, which `chat_template_kwargs` may not replace.
const RESERVED_TEMPLATE_VARS: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// Most `chat_template_kwargs` entries, and the longest string among them.
const MAX_TEMPLATE_KWARGS: usize = 16;
const MAX_TEMPLATE_KWARG_BYTES: usize = 1024;

/// `chat_template_kwargs`: plain values (booleans, numbers, short strings) for the chat
/// template, as vLLM and llama-server take them (`enable_thinking` for Qwen3's).
pub fn template_kwargs(body: &Value) -> Result<serde_json::Map<String, Value>, Refusal> {
    let param = "chat_template_kwargs";
    let m = match body.get(param) {
        None | Some(Value::Null) => return Ok(Default::default()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(Refusal::invalid(
                param,
                "`chat_template_kwargs` must be an object",
            ))
        }
    };
    if m.len() > MAX_TEMPLATE_KWARGS {
        return Err(Refusal::invalid(
            param,
            format!(
                "`chat_template_kwargs` has {} entries; at most {MAX_TEMPLATE_KWARGS} are allowed",
                m.len()
            ),
        ));
    }
    for (k, v) in m {
        let p = format!("{param}.{k}");
        if RESERVED_TEMPLATE_VARS.contains(&k.as_str()) {
            return Err(Refusal::invalid(
                &p,
                format!("`{p}` is set by strata and cannot be given"),
            ));
        }
        let plain = match v {
            Value::Bool(_) | Value::Number(_) | Value::Null => true,
            Value::String(s) => s.len() <= MAX_TEMPLATE_KWARG_BYTES,
            _ => false,
        };
        if !plain {
            return Err(Refusal::invalid(
                &p,
                format!("`{p}` must be a boolean, a number or a string of at most {MAX_TEMPLATE_KWARG_BYTES} bytes"),
            ));
        }
    }
    Ok(m.clone())
}

/// The `model` field, after refusing any field the endpoint does not take.
fn model_and_fields(endpoint: Endpoint, body: &Value) -> Result<Option<String>, Refusal> {
    if !body.is_object() {
        return Err(Refusal::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    }
    let model = string(body, "model")?;
    if let Some(obj) = body.as_object() {
        let own = match endpoint {
            Endpoint::Completions => COMPLETION_FIELDS,
            _ => CHAT_FIELDS,
        };
        if let Some(k) = obj
            .keys()
            .find(|k| !COMMON_FIELDS.contains(&k.as_str()) && !own.contains(&k.as_str()))
        {
            return Err(Refusal::invalid(
                k,
                format!("`{k}` is not supported on {}", endpoint.path()),
            ));
        }
    }
    Ok(model)
}

/// `n`, and `best_of`, which must equal it.
fn choices(body: &Value) -> Result<usize, Refusal> {
    let n = integer(body, "n", 1, MAX_N)?.unwrap_or(1) as usize;
    if let Some(b) = integer(body, "best_of", 1, MAX_N)? {
        if b as usize != n {
            return Err(Refusal::invalid(
                "best_of",
                format!("`best_of` is {b}; only `best_of` equal to `n` ({n}) is supported: strata returns every choice it generates"),
            ));
        }
    }
    Ok(n)
}

/// A completion's `prompt`: a text, a list of one text, or token ids.
fn completion_prompt(body: &mut Value) -> Result<PromptInput, Refusal> {
    Ok(match body.get_mut("prompt").map(Value::take) {
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
                    Refusal::invalid("prompt", "token ids in `prompt` must fit in 32 bits")
                })?;
            PromptInput::Ids(ids)
        }
        Some(Value::Array(_)) => {
            return Err(Refusal::invalid(
                "prompt",
                "`prompt` must be a string, a list of one string, or a list of token ids",
            ))
        }
        None | Some(Value::Null) => return Err(Refusal::invalid("prompt", "`prompt` is required")),
        Some(v) => {
            return Err(Refusal::invalid(
                "prompt",
                format!("`prompt` must be a string, got {v}"),
            ))
        }
    })
}

/// A chat's `messages`, each checked.
fn chat_messages(body: &mut Value) -> Result<PromptInput, Refusal> {
    let msgs = body
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| Refusal::invalid("messages", "`messages` must be a non-empty list"))?;
    if msgs.is_empty() {
        return Err(Refusal::invalid(
            "messages",
            "`messages` must be a non-empty list",
        ));
    }
    let mut out: Vec<ChatMessage> = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter_mut().enumerate() {
        out.push(message(i, m)?);
    }
    Ok(PromptInput::Messages(out))
}

/// Message `i` of a chat (its content moved out of the body).
fn message(i: usize, m: &mut Value) -> Result<ChatMessage, Refusal> {
    if let Some(k) = m.as_object().and_then(|o| {
        o.keys()
            .find(|k| !MESSAGE_FIELDS.contains(&k.as_str()))
            .cloned()
    }) {
        return Err(Refusal::invalid(
            &format!("messages[{i}].{k}"),
            format!("`messages[{i}].{k}` is not supported"),
        ));
    }
    let content = m.get_mut("content").map(Value::take).unwrap_or(Value::Null);
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
        Refusal::invalid(
            &format!("messages[{i}].role"),
            format!("`messages[{i}].role` is required"),
        )
    })?;
    if !matches!(role, "system" | "user" | "assistant" | "developer" | "tool") {
        return Err(Refusal::invalid(
            &format!("messages[{i}].role"),
            format!("`messages[{i}].role` is `{role}`; expected system, user, assistant, developer or tool"),
        ));
    }
    let role = if role == "developer" { "system" } else { role };
    let tool_calls = match m.get("tool_calls").filter(|v| !v.is_null()) {
        Some(_) if role != "assistant" => {
            return Err(Refusal::invalid(
                &format!("messages[{i}].tool_calls"),
                "only assistant messages carry `tool_calls`",
            ))
        }
        Some(v) => Some(crate::api::agent::history_tool_calls(v, i)?),
        None => None,
    };
    let text_field = |key: &str| -> Result<Option<String>, Refusal> {
        match m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(Refusal::invalid(
                &format!("messages[{i}].{key}"),
                format!("`messages[{i}].{key}` must be a string"),
            )),
        }
    };
    Ok(ChatMessage {
        role: role.to_string(),
        content: content_text(content, i)?,
        tool_calls,
        tool_call_id: text_field("tool_call_id")?,
        name: text_field("name")?,
        reasoning_content: text_field("reasoning_content")?,
    })
}

/// `stop`: at most 4 strings, none empty or over [`MAX_STOP_BYTES`].
fn stop(body: &Value) -> Result<Vec<String>, Refusal> {
    stop_strings(body.get("stop"), "stop", 4)
}

/// Stop strings at `param` (a string or a list of at most `max`), none empty or over
/// [`MAX_STOP_BYTES`].
pub fn stop_strings(v: Option<&Value>, param: &str, max: usize) -> Result<Vec<String>, Refusal> {
    let stop = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > max {
                return Err(Refusal::invalid(
                    param,
                    format!(
                        "`{param}` has {} strings; at most {max} are allowed",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| {
                    Refusal::invalid(
                        param,
                        format!("`{param}` must be a string or a list of strings"),
                    )
                })?
        }
        Some(v) => {
            return Err(Refusal::invalid(
                param,
                format!("`{param}` must be a string or a list, got {v}"),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(Refusal::invalid(
            param,
            format!("`{param}` strings must not be empty"),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(Refusal::over_limit(
            param,
            "max_stop_bytes",
            format!(
                "a `{param}` string has {} bytes; at most {MAX_STOP_BYTES} are allowed",
                long.len()
            ),
        ));
    }
    Ok(stop)
}

/// `logit_bias`: token ids to biases in [-100, 100].
pub fn logit_bias(body: &Value) -> Result<Vec<(u32, f32)>, Refusal> {
    Ok(match body.get("logit_bias") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(m)) => {
            if m.len() > MAX_LOGIT_BIAS {
                return Err(Refusal::over_limit(
                    "logit_bias",
                    "max_logit_bias",
                    format!(
                        "`logit_bias` has {} entries; at most {MAX_LOGIT_BIAS} are allowed",
                        m.len()
                    ),
                ));
            }
            let mut out = Vec::with_capacity(m.len());
            for (k, v) in m {
                let id = k.parse::<u32>().map_err(|_| {
                    Refusal::invalid(
                        "logit_bias",
                        format!("`logit_bias` keys are token ids; `{k}` is not one"),
                    )
                })?;
                let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                    Refusal::invalid(
                        "logit_bias",
                        format!("`logit_bias` values are numbers from -100 to 100; token {id} has {v}"),
                    )
                })?;
                out.push((id, b as f32));
            }
            out
        }
        Some(v) => {
            return Err(Refusal::invalid(
                "logit_bias",
                format!("`logit_bias` must be an object of token ids to biases, got {v}"),
            ))
        }
    })
}

/// `stream`, and `stream_options.include_usage` (only with `stream: true`).
fn streaming(body: &Value) -> Result<(bool, bool), Refusal> {
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| k.as_str() != "include_usage") {
                return Err(Refusal::invalid(
                    &format!("stream_options.{k}"),
                    format!("`stream_options.{k}` is not supported"),
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(Refusal::invalid(
                        "stream_options.include_usage",
                        format!("`include_usage` must be a boolean, got {v}"),
                    ))
                }
            }
        }
        Some(v) => {
            return Err(Refusal::invalid(
                "stream_options",
                format!("`stream_options` must be an object, got {v}"),
            ))
        }
    };
    let stream = boolean(body, "stream")?.unwrap_or(false);
    if body.get("stream_options").is_some_and(|v| !v.is_null()) && !stream {
        return Err(Refusal::invalid(
            "stream_options",
            "`stream_options` is only for `stream: true`",
        ));
    }
    Ok((stream, include_usage))
}

/// `logprobs` (and chat's `top_logprobs`): how many alternatives to report, if any.
fn logprobs(endpoint: Endpoint, body: &Value) -> Result<Option<u32>, Refusal> {
    Ok(match endpoint {
        Endpoint::Completions => integer(body, "logprobs", 0, 20)?.map(|v| v as u32),
        _ => {
            let top = integer(body, "top_logprobs", 0, 20)?.map(|v| v as u32);
            match boolean(body, "logprobs")? {
                Some(true) => Some(top.unwrap_or(0)),
                _ if top.is_some() => {
                    return Err(Refusal::invalid(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`",
                    ));
                }
                _ => None,
            }
        }
    })
}

/// `body` with the server's default temperature (`--default-temperature`) where it gives none
/// (`temperature` absent or null); a body that is no object is left for validation to refuse.
pub fn with_default_temperature(mut body: Value, default: Option<f64>) -> Value {
    if let (Some(t), Some(o)) = (default, body.as_object_mut()) {
        if o.get("temperature").is_none_or(Value::is_null) {
            o.insert("temperature".to_string(), Value::from(t));
        }
    }
    body
}

/// The sampling fields, with their defaults.
pub fn sampling(
    body: &Value,
    logit_bias: Vec<(u32, f32)>,
    fresh_seed: u64,
) -> Result<SamplingRequest, Refusal> {
    Ok(SamplingRequest {
        temperature: number(body, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_p: number(body, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: integer(body, "top_k", 0, 1 << 20)?.unwrap_or(0) as u32,
        min_p: number(body, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        repeat_penalty: number(body, "repetition_penalty", 0.01, 10.0)?.unwrap_or(1.0) as f32,
        presence_penalty: number(body, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: number(body, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        logit_bias,
        seed: match body.get("seed") {
            None | Some(Value::Null) => fresh_seed,
            Some(v) => v
                .as_i64()
                .map(|s| s as u64)
                .or_else(|| v.as_u64())
                .ok_or_else(|| {
                    Refusal::invalid("seed", format!("`seed` must be an integer, got {v}"))
                })?,
        },
        seeded: body.get("seed").is_some_and(|v| !v.is_null()),
    })
}

/// `echo` and `suffix` (completions), neither beside `logprobs` or each other.
fn echo_and_suffix(body: &Value, logprobs: Option<u32>) -> Result<(bool, Option<String>), Refusal> {
    let echo = boolean(body, "echo")?.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(Refusal::invalid(
            "echo",
            "`echo` with `logprobs` is not supported (the prompt's log-probabilities are not computed)",
        ));
    }
    let suffix = string(body, "suffix")?;
    if suffix.is_some() && echo {
        return Err(Refusal::invalid(
            "echo",
            "`echo` with `suffix` is not supported",
        ));
    }
    Ok((echo, suffix))
}

/// The rules that tie `response_format`, `tools`, streaming and `ignore_eos` together;
/// `return_token_ids` and `ignore_eos` as asked.
fn constrained_rules(
    body: &Value,
    grammar: &Option<String>,
    tools: Option<&crate::api::agent::ToolSet>,
    stream: bool,
    logprobs: Option<u32>,
) -> Result<(bool, bool), Refusal> {
    if grammar.is_some() && tools.is_some_and(|t| t.active()) {
        return Err(Refusal::invalid(
            "response_format",
            "`response_format` with `tools` is not supported: the answer is either a document or tool calls (give `tool_choice: \"none\"` to keep the tools out)",
        ));
    }
    let return_token_ids = boolean(body, "return_token_ids")?.unwrap_or(false);
    if stream && tools.is_some_and(|t| t.active()) {
        // A streamed answer with tools goes through the tool-call finder, which passes text
        // on, not tokens.
        if logprobs.is_some() {
            return Err(Refusal::invalid(
                "logprobs",
                "`logprobs` with `tools` is not supported when streaming",
            ));
        }
        if return_token_ids {
            return Err(Refusal::invalid(
                "return_token_ids",
                "`return_token_ids` with `tools` is not supported when streaming",
            ));
        }
    }
    let ignore_eos = boolean(body, "ignore_eos")?.unwrap_or(false);
    if ignore_eos && (grammar.is_some() || tools.is_some_and(|t| t.active())) {
        return Err(Refusal::invalid(
            "ignore_eos",
            "`ignore_eos` with a constrained answer is not supported: a complete document ends",
        ));
    }
    Ok((return_token_ids, ignore_eos))
}

/// `priority`: `agent` or `grading`, when given.
pub fn priority(body: &Value) -> Result<Option<engine::Priority>, Refusal> {
    match body.get("priority") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_str()
            .and_then(engine::Priority::parse)
            .map(Some)
            .ok_or_else(|| {
                Refusal::invalid(
                    "priority",
                    format!("`priority` must be \"agent\" or \"grading\", got {v}"),
                )
            }),
    }
}

/// `user`: the end user the caller names, at most 256 bytes.
pub fn user(body: &Value) -> Result<Option<String>, Refusal> {
    Ok(match body.get("user") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.len() <= 256 => Some(s.clone()),
        Some(_) => {
            return Err(Refusal::invalid(
                "user",
                "`user` must be a string of at most 256 bytes",
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_plain_completion_is_valid_and_unknown_fields_are_refused() {
        let r = validate(
            Endpoint::Completions,
            json!({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0}),
            7,
        )
        .unwrap();
        assert_eq!(r.prompt, PromptInput::Text("hi".into()));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling.temperature, 0.0);
        for (endpoint, body, param) in [
            (
                Endpoint::Completions,
                json!({"prompt": "hi", "whatever": [1, 2]}),
                "whatever",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "hi", "tools": []}),
                "tools",
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": "x"}], "functions": []}),
                "functions",
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": "x"}], "echo": true}),
                "echo",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "stream": true, "stream_options": {"x": 1}}),
                "stream_options.x",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "best_of": 2}),
                "best_of",
            ),
            (Endpoint::Completions, json!({"prompt": "x", "n": 17}), "n"),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "logit_bias": {"a": 1}}),
                "logit_bias",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "logit_bias": {"1": 101}}),
                "logit_bias",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "echo": true, "logprobs": 1}),
                "echo",
            ),
            (
                Endpoint::Completions,
                json!({"prompt": "x", "ignore_eos": true, "response_format": {"type": "json_object"}}),
                "ignore_eos",
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": "x", "function_call": {}}]}),
                "messages[0].function_call",
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": "x"}],
                       "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}),
                "tools[0].function.strict",
            ),
            (
                Endpoint::Chat,
                json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "logprobs": true,
                       "tools": [{"type": "function", "function": {"name": "f"}}]}),
                "logprobs",
            ),
        ] {
            let e = validate(endpoint, body.clone(), 7).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn the_caller_s_seed_is_used_unless_given_and_penalties_are_kept() {
        let body = json!({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100}});
        let a = validate(Endpoint::Completions, body.clone(), 7).unwrap();
        let b = validate(Endpoint::Completions, body, 8).unwrap();
        assert!(!a.sampling.seeded);
        assert_eq!((a.sampling.seed, b.sampling.seed), (7, 8));
        assert_eq!(a.sampling.presence_penalty, 0.5);
        assert_eq!(a.sampling.frequency_penalty, -1.0);
        assert_eq!(a.sampling.logit_bias, vec![(7, -100.0)]);
        let s = validate(
            Endpoint::Completions,
            json!({"prompt": "x", "seed": 5, "n": 3}),
            7,
        )
        .unwrap();
        assert!(s.sampling.seeded);
        assert_eq!((s.sampling.seed, s.n), (5, 3));
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
            (json!({"prompt": "x", "n": 0}), "n"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (
                json!({"prompt": "x", "stop": "s".repeat(MAX_STOP_BYTES + 1)}),
                "stop",
            ),
        ] {
            let e = validate(Endpoint::Completions, body.clone(), 7).unwrap_err();
            assert_eq!(e.reason, engine::Reason::InvalidRequest, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = validate(
            Endpoint::Chat,
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            7,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = validate(Endpoint::Chat, json!({"messages": []}), 7).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn chat_logprobs_and_content_parts() {
        let r = validate(
            Endpoint::Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "logprobs": true, "top_logprobs": 3}), 7)
        .unwrap();
        assert_eq!(r.logprobs, Some(3));
        assert_eq!(
            r.prompt,
            PromptInput::Messages(vec![ChatMessage::new("user", "ab")])
        );
    }
}
