//! The OpenAI-compatible HTTP API: completions and chat completions (plain and SSE), and the
//! routes of the operator endpoints in [`crate::ops`]. Requests are validated here, tokenized
//! off the async runtime, and offered to the model's routes.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use engine::{Priority, Refusal};

use super::error::Answer;
use serde_json::Value;
use text::Tokenizer;

use super::answer::{Shape, Thinking};
use super::record::{Outcome, RequestRecord};
use super::request::{validate, ContextFit, Endpoint, PromptInput, ValidRequest};
use super::respond::{stream_response, whole_response, Accepted, CancelOnDrop, Choice};
use super::server::read_body;
use super::state::AppState;
use crate::ledger::ApiKey;
use crate::route::driver::Job;
use crate::route::offer::submit_within;
use crate::route::table::ModelEntry;
use constrain::grammar::CallFormat;

/// The seed of a request that gives none: requests without a seed differ. Drawn here, at the
/// edge, so that validation reads no clock and no random source.
pub fn fresh_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now())
}

/// Bodies up to this size are parsed on the async runtime (microseconds); longer ones on a
/// blocking thread.
const INLINE_BODY_BYTES: usize = 64 << 10;

fn parse_body(bytes: &[u8]) -> Result<Value, Refusal> {
    serde_json::from_slice(bytes)
        .map_err(|e| Refusal::invalid("body", format!("the request body is not valid JSON: {e}")))
}

pub async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    handle(s, Endpoint::Completions, &headers, body).await
}

pub async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    handle(s, Endpoint::Chat, &headers, body).await
}

/// The priority class: the request's `priority` field, else the `x-strata-priority` header,
/// else agent.
fn priority_of(req: &ValidRequest, headers: &HeaderMap) -> Result<Priority, Refusal> {
    if let Some(p) = req.priority {
        return Ok(p);
    }
    match headers.get("x-strata-priority") {
        None => Ok(Priority::Agent),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| Priority::parse(v.trim()))
            .ok_or_else(|| {
                Refusal::invalid(
                    "x-strata-priority",
                    "the x-strata-priority header must be \"agent\" or \"grading\"",
                )
            }),
    }
}

/// Prompt ids for a validated request, at most `limit` of them (a longer prompt is refused as
/// soon as that is certain). Runs on a blocking thread: tokenizing is linear in the text, but
/// a long text is still milliseconds of work the async runtime must not wait through.
async fn tokenize(
    s: &AppState,
    model: &ModelEntry,
    prompt: PromptInput,
    tools: Option<Value>,
    kwargs: serde_json::Map<String, Value>,
    limit: usize,
) -> Result<Vec<u32>, Refusal> {
    let tokenizer = Arc::clone(&model.tokenizer);
    let n_vocab = tokenizer.n_vocab();
    let too_long = |at_least: usize| {
        Refusal::over_limit(
            "prompt",
            "n_ctx",
            format!("the prompt has at least {at_least} tokens, but the context length `n_ctx` is {limit}"),
        )
    };
    let ids = match prompt {
        PromptInput::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= n_vocab) {
                return Err(Refusal::invalid(
                    "prompt",
                    format!("token id {bad} is out of range (vocabulary has {n_vocab} tokens)"),
                ));
            }
            if ids.len() > limit {
                return Err(too_long(ids.len()));
            }
            ids
        }
        PromptInput::Text(t) => s
            .run_blocking(move || tokenizer.encode_within(&t, true, true, limit))
            .await
            .ok_or_else(|| Refusal::unavailable("tokenizing the prompt failed"))?
            .map_err(|e| too_long(e.at_least))?,
        PromptInput::Messages(m) => {
            let template = model
                .template
                .clone()
                .ok_or_else(|| Refusal::invalid("messages", "this model has no chat template"))?;
            s.run_blocking(move || {
                // A template without a tool format is shown the tools in the system turn.
                let (m, tools) = match tools {
                    Some(t) if template.tool_syntax() == text::ToolSyntax::None => {
                        (crate::api::agent::generic_tool_prompt(&m, &t), None)
                    }
                    t => (m, t),
                };
                let vars = text::Vars {
                    tools: tools.as_ref(),
                    kwargs: Some(&kwargs),
                };
                tokenizer.encode_chat_within(&template, &m, vars, limit)
            })
            .await
            .ok_or_else(|| Refusal::unavailable("tokenizing the prompt failed"))?
            .map_err(|e| match e {
                text::Error::TooManyTokens(t) => too_long(t.at_least),
                other => Refusal::invalid("messages", other.to_string()),
            })?
        }
    };
    if ids.is_empty() {
        return Err(Refusal::invalid(
            "prompt",
            "the prompt is empty: at least one token is needed",
        ));
    }
    Ok(ids)
}

async fn handle(
    s: Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Response {
    let mut record = RequestRecord::new(Arc::clone(&s.metrics), String::new(), endpoint);
    match admit(&s, endpoint, headers, body, &mut record).await {
        Err(e) => {
            record.finish(Outcome::Failed(&e));
            e.into_response()
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

/// The id a response carries: `n` is the tracker's response number.
pub fn response_id(endpoint: Endpoint, n: u64) -> String {
    match endpoint {
        Endpoint::Chat => format!("chatcmpl-{n}"),
        Endpoint::Completions => format!("cmpl-{n}"),
        Endpoint::Responses => format!("resp_{n}"),
        Endpoint::Messages => format!("msg_{n}"),
    }
}

/// Checks the request's grammar (from `response_format` or `tool_choice`) compiles against
/// the model's vocabulary, off the async runtime; the refusal names the field it came from.
async fn check_grammar(
    s: &AppState,
    model: &ModelEntry,
    grammar: &str,
    param: &str,
) -> Result<(), Refusal> {
    let _permit = s.tokenizing.acquire().await;
    let (vocab, g) = (Arc::clone(&model.grammars), grammar.to_string());
    tokio::task::spawn_blocking(move || {
        let checked = vocab.get().and_then(|v| v.check(&g));
        // Compiling a large grammar allocates tens of megabytes on this thread's arena.
        proto::release_freed_memory();
        checked
    })
    .await
    .map_err(|_| Refusal::unavailable("compiling the grammar failed"))?
    .map_err(|e| crate::api::agent::grammar_error(param, e))
}

/// The ids of a fill-in-the-middle prompt (`prompt` before the gap, `suffix` after it) in the
/// model's own FIM tokens; a model without them refuses `suffix`.
fn fim_ids(
    t: &Tokenizer,
    prompt: &PromptInput,
    suffix: &str,
    limit: usize,
) -> Result<Vec<u32>, Refusal> {
    let (Some(pre), Some(suf), Some(mid)) = (
        t.token_id("<|fim_prefix|>"),
        t.token_id("<|fim_suffix|>"),
        t.token_id("<|fim_middle|>"),
    ) else {
        return Err(Refusal::invalid(
            "suffix",
            "this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)",
        ));
    };
    let PromptInput::Text(text) = prompt else {
        return Err(Refusal::invalid("suffix", "`suffix` needs a text `prompt`"));
    };
    if text.len() + suffix.len() > limit.saturating_mul(64) {
        return Err(Refusal::over_limit(
            "prompt",
            "n_ctx",
            "the prompt and suffix are longer than the context".to_string(),
        ));
    }
    let mut ids = vec![pre];
    ids.extend(t.encode(text, false, false));
    ids.push(suf);
    ids.extend(t.encode(suffix, false, false));
    ids.push(mid);
    if ids.len() > limit {
        return Err(Refusal::over_limit(
            "prompt",
            "n_ctx",
            format!(
                "the prompt and suffix have {} tokens, but the context length `n_ctx` is {limit}",
                ids.len()
            ),
        ));
    }
    Ok(ids)
}

/// What the model decides about a request: `logit_bias` ids inside its vocabulary, and no
/// control-token text in what its template prints as markup (tool definitions, tool calls,
/// tool-call ids, names).
fn check_against_model(model: &ModelEntry, req: &ValidRequest) -> Result<(), Refusal> {
    let n_vocab = model.tokenizer.n_vocab();
    if let Some(&(bad, _)) = req
        .sampling
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= n_vocab)
    {
        return Err(Refusal::invalid(
            "logit_bias",
            format!("`logit_bias` names token {bad}, but the vocabulary has {n_vocab} tokens"),
        ));
    }
    if let Some(t) = req.tools.as_ref().filter(|t| t.active()) {
        if let Some(c) = model.tokenizer.control_text_in(&t.json.to_string()) {
            return Err(Refusal::invalid(
                "tools",
                format!("`tools` holds the control token text `{c}`"),
            ));
        }
    }
    if let PromptInput::Messages(m) = &req.prompt {
        for (i, msg) in m.iter().enumerate() {
            let fields = [
                ("tool_calls", msg.tool_calls.as_ref().map(Value::to_string)),
                ("tool_call_id", msg.tool_call_id.clone()),
                ("name", msg.name.clone()),
            ];
            for (field, text) in fields {
                if let Some(c) = text
                    .as_deref()
                    .and_then(|t| model.tokenizer.control_text_in(t))
                {
                    return Err(Refusal::invalid(
                        &format!("messages[{i}].{field}"),
                        format!("`messages[{i}].{field}` holds the control token text `{c}`"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The grammar the answer is held to (`response_format`, or the tools: lazily under
/// `auto`, calls only under `required` or a named function), checked against the model's
/// vocabulary. A tool that did not ask for `strict` arguments and whose schema the engine
/// cannot compile (Claude Code's use `propertyNames`) has its arguments held to any object;
/// a strict tool's schema must compile.
async fn request_grammar(
    s: &AppState,
    model: &ModelEntry,
    req: &ValidRequest,
) -> Result<Option<String>, Refusal> {
    if let Some(g) = &req.grammar {
        check_grammar(s, model, g, "response_format").await?;
        return Ok(Some(g.clone()));
    }
    let Some(tools) = req.tools.as_ref().filter(|t| t.active()) else {
        return Ok(None);
    };
    let format = call_format(model);
    let Some(g) = tools.grammar(&[], format)? else {
        return Ok(None);
    };
    let first = match check_grammar(s, model, &g, "tools").await {
        Ok(()) => return Ok(Some(g)),
        Err(e) if tools.has_loose() => e,
        Err(e) => return Err(e),
    };
    let mut loosened = Vec::new();
    for (name, alone) in tools.loose_tools(format) {
        if check_grammar(s, model, &alone, "tools").await.is_err() {
            loosened.push(name);
        }
    }
    if loosened.is_empty() {
        return Err(first);
    }
    let Some(g) = tools.grammar(&loosened, format)? else {
        return Err(first);
    };
    check_grammar(s, model, &g, "tools").await?;
    Ok(Some(g))
}

/// How the model writes calls: its template's syntax, or (a template without one is shown
/// the tools in that format) the Hermes tags.
fn call_format(model: &ModelEntry) -> CallFormat {
    match model.template.as_ref().map(|t| t.tool_syntax()) {
        Some(text::ToolSyntax::Json) => CallFormat::Json,
        _ => CallFormat::Hermes,
    }
}

/// Everything from the raw request to a route's acceptance: body, validation, key, prompt,
/// context check, the ledger's reservation, submission.
async fn admit(
    s: &AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: axum::body::Body,
    record: &mut RequestRecord,
) -> Result<Accepted, Refusal> {
    let req = read_request(s, endpoint, headers, body).await?;
    admit_valid(s, req, headers, record).await
}

/// How many tokens a validated request's prompt has for its model (`count_tokens`): the
/// same key, model and prompt checks as an admission, and nothing submitted.
pub async fn prompt_tokens(
    s: &AppState,
    mut req: ValidRequest,
    headers: &HeaderMap,
) -> Result<usize, Refusal> {
    let wait_until = std::time::Instant::now() + s.failover_wait;
    let model = s.model_within(req.model.as_deref(), wait_until).await?;
    s.key(headers)?;
    check_against_model(&model, &req)?;
    thinking_of(&model, &mut req);
    Ok(prompt_ids(s, &model, &mut req).await?.len())
}

/// A validated request (of any endpoint) from its model and key to a route's acceptance.
pub async fn admit_valid(
    s: &AppState,
    mut req: ValidRequest,
    headers: &HeaderMap,
    record: &mut RequestRecord,
) -> Result<Accepted, Refusal> {
    let endpoint = req.endpoint;
    record.priority = priority_of(&req, headers)?;
    record.user = req.user.clone().unwrap_or_default();
    // One bound for all the waiting for a route this request may do (`--failover-wait-ms`).
    let wait_until = std::time::Instant::now() + s.failover_wait;
    let model = s.model_within(req.model.as_deref(), wait_until).await?;
    record.model = model.id.clone();
    let key = s.key(headers)?;
    check_against_model(&model, &req)?;
    let grammar = request_grammar(s, &model, &req).await?;
    let echo = echo_text(&model, &req)?;
    let thinking = thinking_of(&model, &mut req);
    let prompt_ids = prompt_ids(s, &model, &mut req).await?;
    record.prompt_tokens = prompt_ids.len();
    let max_tokens = max_tokens(s, &req, model.n_ctx, prompt_ids.len())?;
    let shape = Shape {
        thinking: thinking.map(|()| thinking_start(&model.tokenizer, &prompt_ids)),
        tools: req
            .tools
            .as_ref()
            .filter(|t| t.active())
            .map(|t| t.tools.iter().map(|x| x.name.clone()).collect()),
        tool_format: call_format(&model),
    };
    let job = Job {
        sampling: req.sampling.to_wire(prompt_ids.len(), grammar),
        prompt_ids,
        max_tokens,
        stop: req.stop.clone(),
        logprobs: req.logprobs,
        ignore_eos: req.ignore_eos,
        speculative: req.speculative,
        priority: record.priority,
        key: key.as_ref().map(|k| k.name.clone()).unwrap_or_default(),
        tenant: s.tenant(key.as_ref(), req.cache_group.as_deref()),
        ledger_row: None,
        billed_prompt: 0,
    };
    let choices = submit_choices(s, &model, key.as_ref(), job, req.n, wait_until).await?;
    let n = s
        .responses
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(Accepted {
        req,
        model_id: model.id.clone(),
        id: response_id(endpoint, n + 1),
        choices,
        echo,
        shape,
    })
}

/// Whether the answer may hold a thinking section: the template has one and the request
/// did not turn it off. The request's choice reaches the template as `enable_thinking`.
fn thinking_of(model: &ModelEntry, req: &mut ValidRequest) -> Option<()> {
    let has = model.template.as_ref().is_some_and(|t| t.has_thinking());
    if !has || !matches!(req.prompt, PromptInput::Messages(_)) {
        return None;
    }
    if let Some(on) = req.thinking {
        req.template_kwargs
            .entry("enable_thinking")
            .or_insert(Value::Bool(on));
    }
    let on = req
        .template_kwargs
        .get("enable_thinking")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    on.then_some(())
}

/// Where the answer's thinking section starts: inside it when the prompt ends with the
/// opening tag (the template opened it), else the answer may open it.
fn thinking_start(t: &Tokenizer, prompt_ids: &[u32]) -> Thinking {
    // Enough tokens for the tag and the blank space after it, however finely they are cut.
    let tail = &prompt_ids[prompt_ids.len().saturating_sub(16)..];
    let text = t.decode(tail, true).unwrap_or_default();
    if text.trim_end().ends_with("<think>") {
        Thinking::Inside
    } else {
        Thinking::MayOpen
    }
}

/// The request's body, read within the server's limits and validated.
async fn read_request(
    s: &AppState,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<ValidRequest, Refusal> {
    let seed = fresh_seed();
    let t = s.default_temperature;
    read_json(s, headers, body, move |v| {
        validate(
            endpoint,
            super::request::with_default_temperature(v, t),
            seed,
        )
    })
    .await
}

/// A JSON body read within the server's limits and checked by `check`. A long body is
/// parsed where prompts are tokenized: off the async runtime, one core's worth at a time, so
/// a flood of them never takes the cores other requests need.
pub async fn read_json<T: Send + 'static>(
    s: &AppState,
    headers: &HeaderMap,
    body: axum::body::Body,
    check: impl FnOnce(Value) -> Result<T, Refusal> + Send + 'static,
) -> Result<T, Refusal> {
    // The body's share of the memory for bodies (part of its key's) is held until it is
    // parsed and checked, also when the client has gone meanwhile.
    let owner = s.key(headers)?.map(|k| k.name).unwrap_or_default();
    let (body, hold) = read_body(body, &s.http, &s.bodies, &owner).await?;
    if body.len() <= INLINE_BODY_BYTES {
        return check(parse_body(&body)?);
    }
    s.run_blocking(move || {
        let _hold = hold;
        check(parse_body(&body)?)
    })
    .await
    .ok_or_else(|| Refusal::unavailable("parsing the request failed"))?
}

/// `echo`: the prompt's text, put before each choice's answer.
fn echo_text(model: &ModelEntry, req: &ValidRequest) -> Result<Option<String>, Refusal> {
    Ok(match (&req.prompt, req.echo) {
        (_, false) => None,
        (PromptInput::Text(t), true) => Some(t.clone()),
        (PromptInput::Ids(ids), true) => Some(
            model
                .tokenizer
                .decode(ids, false)
                .map_err(|e| Refusal::invalid("prompt", e.to_string()))?,
        ),
        (PromptInput::Messages(_), true) => None,
    })
}

/// The prompt's ids (the request's prompt moved out): fill-in-the-middle with a `suffix`,
/// else the text, ids or messages tokenized, at most the model's context of them.
async fn prompt_ids(
    s: &AppState,
    model: &ModelEntry,
    req: &mut ValidRequest,
) -> Result<Vec<u32>, Refusal> {
    let n_ctx = model.n_ctx;
    let prompt = std::mem::replace(&mut req.prompt, PromptInput::Ids(Vec::new()));
    match &req.suffix {
        Some(suffix) => {
            // Tokenized where prompts are: off the async runtime, one core's worth at a time.
            let _permit = s.tokenizing.acquire().await;
            let (t, suffix) = (Arc::clone(&model.tokenizer), suffix.clone());
            tokio::task::spawn_blocking(move || fim_ids(&t, &prompt, &suffix, n_ctx))
                .await
                .map_err(|_| Refusal::unavailable("tokenizing the prompt failed"))?
        }
        None => {
            let tools = req.tools.as_ref().filter(|t| t.active());
            let tools = tools.map(|t| t.json.clone());
            let kwargs = req.template_kwargs.clone();
            tokenize(s, model, prompt, tools, kwargs, n_ctx).await
        }
    }
}

/// `max_tokens`, or the endpoint's default, checked against the context with the prompt.
fn max_tokens(
    s: &AppState,
    req: &ValidRequest,
    n_ctx: usize,
    n_prompt: usize,
) -> Result<usize, Refusal> {
    let left = n_ctx.saturating_sub(n_prompt);
    let max_tokens = match (req.max_tokens, req.endpoint, req.fit) {
        (Some(m), _, ContextFit::Cut) if left > 0 => m.min(left),
        (Some(m), _, _) => m,
        (None, Endpoint::Completions, _) => 16,
        (None, _, _) => s.default_chat_max_tokens.min(left).max(1),
    };
    if n_prompt + max_tokens > n_ctx {
        return Err(Refusal::over_limit("max_tokens", "n_ctx", format!(
            "prompt has {n_prompt} tokens and `max_tokens` is {max_tokens}, but the context length `n_ctx` is {n_ctx}"
        )));
    }
    Ok(max_tokens)
}

/// Submits the `n` choices of a job, each with its own seed and ledger row (the prompt is
/// billed once). The ledger row is committed before the choice is submitted: an accepted
/// request is never lost, whatever happens to this process afterwards. A refusal of any
/// choice refuses the request (dropping the choices already admitted cancels them).
async fn submit_choices(
    s: &AppState,
    model: &ModelEntry,
    key: Option<&ApiKey>,
    job: Job,
    n: usize,
    wait_until: std::time::Instant,
) -> Result<Vec<Choice>, Refusal> {
    let n_prompt = job.prompt_ids.len() as u64;
    let mut choices: Vec<Choice> = Vec::with_capacity(n);
    for i in 0..n {
        let mut job_i = job.clone();
        job_i.sampling.seed = job.sampling.seed.wrapping_add(i as u64);
        let billed_prompt = if i == 0 { n_prompt } else { 0 };
        job_i.billed_prompt = billed_prompt as usize;
        job_i.ledger_row = match (&s.ledger, key) {
            (Some(l), Some(k)) => {
                let (l2, k, max) = (Arc::clone(l), k.clone(), job.max_tokens as u64);
                let row = tokio::task::spawn_blocking(move || l2.reserve(&k, billed_prompt, max))
                    .await
                    .map_err(|_| Refusal::unavailable("the usage ledger stopped"))??;
                Some(row)
            }
            _ => None,
        };
        let ledger_row = job_i.ledger_row;
        // The later choices wait for the first one's prompt first: that is computing, not
        // waiting for a route, so their own wait for a route starts now.
        let wait_until = if i == 0 {
            wait_until
        } else {
            wait_until.max(std::time::Instant::now() + s.failover_wait)
        };
        match submit_within(&s.table, model, job_i, wait_until).await {
            Ok((route, id, events)) => {
                let mut c = Choice {
                    events,
                    guard: CancelOnDrop::new(id, route.commands.clone()),
                    first: None,
                };
                if i == 0 && n > 1 {
                    // The other choices start once the first has its prompt in the KV cache:
                    // its full blocks are in the prefix cache then, and the others share them.
                    c.first = c.events.recv().await;
                }
                choices.push(c);
            }
            Err(e) => {
                if let (Some(l), Some(row)) = (&s.ledger, ledger_row) {
                    l.settle(row, billed_prompt, 0, "refused");
                }
                return Err(e);
            }
        }
    }
    Ok(choices)
}
