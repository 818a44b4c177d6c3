//! The OpenAI-compatible HTTP API: completions and chat completions (plain and SSE), and the
//! routes of the operator endpoints in [`crate::ops`]. Requests are validated here, tokenized
//! off the async runtime, and offered to the model's routes.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::Value;
use text::{ChatTemplate, Tokenizer};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};

use crate::cluster::{Cluster, Health};
use crate::error::ApiError;
use crate::ledger::{ApiKey, Ledger};
use crate::metrics::Metrics;
use crate::record::{Outcome, RequestRecord};
use crate::request::{validate, Endpoint, PromptInput, ValidRequest};
use crate::respond::{stream_response, whole_response, CancelOnDrop};
use crate::runner::{Command, Job, SessionEvent};
use crate::server::{read_body, HttpConfig};
use engine::Priority;

/// What the handlers share (all immutable or internally synchronized).
pub struct AppState {
    /// The resident models, each with the routes (nodes) that hold it; routes join and leave
    /// while the tracker runs when it follows a registry.
    pub table: Arc<crate::table::RouteTable>,
    pub metrics: Arc<Metrics>,
    /// `max_tokens` when a chat request gives none.
    pub default_chat_max_tokens: usize,
    pub ledger: Option<Arc<Ledger>>,
    /// The one API key every request must present, when configured (`--api-key`).
    pub api_key: Option<String>,
    /// Whether `/health` and `/metrics` are open to anyone although API keys are on.
    pub public_metrics: bool,
    /// Bearer token of the admin API (`None`: no admin API).
    pub admin_token: Option<String>,
    pub http: HttpConfig,
    /// Long bodies parsed and prompts tokenized at once (each on a blocking thread): all cores
    /// but one, so a flood of long prompts waits here instead of taking the cores that shards
    /// and other requests need.
    pub tokenizing: Semaphore,
    /// Numbers the responses (ids unique across routes: each route numbers its sessions).
    pub responses: std::sync::atomic::AtomicU64,
}

/// One resident model: its tokenizer and the routes whose shards hold it.
#[derive(Clone)]
pub struct ModelEntry {
    pub id: String,
    pub digest: String,
    pub n_layers: u32,
    /// The smallest context any of its routes allows.
    pub n_ctx: usize,
    pub tokenizer: Arc<Tokenizer>,
    /// The vocabulary request grammars are checked against before they are queued.
    pub grammars: Arc<constrain::LazyVocabulary>,
    pub template: Option<Arc<ChatTemplate>>,
    pub routes: Vec<Arc<RouteHandle>>,
}

/// One route's scheduling loop.
pub struct RouteHandle {
    pub name: String,
    pub cluster: Arc<Cluster>,
    pub commands: mpsc::Sender<Command>,
    pub health: watch::Receiver<Health>,
    /// Whether the route can take work (open end to end, every shard answering as validated):
    /// published by the route's runner.
    pub up: watch::Receiver<bool>,
    /// A shard of the route was started with `--pin`: the model is never evicted from it.
    pub pinned: bool,
    /// An operator evicted the model from this route: no new request goes to it.
    pub evicted: Arc<std::sync::atomic::AtomicBool>,
    /// Sessions its loop holds (published by it) and requests on their way to it: new work
    /// goes to the route with the fewest.
    pub load: Arc<std::sync::atomic::AtomicUsize>,
    pub submitting: std::sync::atomic::AtomicUsize,
}

impl RouteHandle {
    pub fn resident(&self) -> bool {
        !self.evicted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Open, serving and resident: it takes new sessions and moved ones.
    pub fn takes_work(&self) -> bool {
        *self.up.borrow() && self.resident()
    }
}

impl ModelEntry {
    pub fn resident(&self) -> bool {
        self.routes.iter().any(|r| r.resident())
    }
}

impl AppState {
    /// The model a request names (or the only one, when it names none). A model no route
    /// holds is refused as `not_resident`: nothing is ever loaded to answer a request. With
    /// no route at all (none joined yet, or the model's routes all left), the refusal is a
    /// retryable `no_route`.
    pub fn model(&self, requested: Option<&str>) -> Result<Arc<ModelEntry>, ApiError> {
        let models = self.table.models();
        let resident: Vec<&Arc<ModelEntry>> = models.iter().filter(|m| m.resident()).collect();
        let no_route = |what: &str| {
            ApiError::no_route(format!(
                "no route serves {what} now; shards join the registry at any time, retry shortly"
            ))
        };
        // Known, but every route of it left (an evicted route is still there: that model is
        // not resident, which only an operator changes).
        let departed = |e: &ModelEntry| e.routes.is_empty();
        match requested {
            Some(m) => match resident.iter().find(|e| e.id == m || e.digest == m) {
                Some(e) => Ok(Arc::clone(e)),
                None if models.is_empty() => Err(no_route(&format!("`{m}`"))),
                None if models
                    .iter()
                    .any(|e| (e.id == m || e.digest == m) && departed(e)) =>
                {
                    Err(no_route(&format!("`{m}`")))
                }
                None => Err(ApiError::not_resident(m, &self.residency())),
            },
            None if resident.len() == 1 => Ok(Arc::clone(resident[0])),
            None if resident.is_empty() && models.iter().all(|e| departed(e)) => {
                Err(no_route("any model"))
            }
            None => Err(ApiError::invalid(
                "model",
                format!(
                    "`model` is required: this tracker serves {}",
                    self.residency()
                ),
            )),
        }
    }

    /// "model on route, route; model on route" for messages.
    pub fn residency(&self) -> String {
        self.table
            .models()
            .iter()
            .filter(|m| m.resident())
            .map(|m| {
                let routes: Vec<&str> = m
                    .routes
                    .iter()
                    .filter(|r| r.resident())
                    .map(|r| r.name.as_str())
                    .collect();
                format!("`{}` on {}", m.id, routes.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Whether requests must present an API key.
    pub fn keys_on(&self) -> bool {
        self.api_key.is_some() || self.ledger.as_ref().is_some_and(|l| l.has_keys())
    }

    /// The caller's key for a completion: checked against `--api-key`, or looked up in the
    /// ledger (which then records the request's usage under it).
    pub fn key(&self, headers: &HeaderMap) -> Result<Option<ApiKey>, ApiError> {
        let secret = bearer(headers);
        if let Some(expected) = &self.api_key {
            if !proto::secrets_equal(&secret, expected) {
                return Err(ApiError::unauthorized());
            }
        }
        self.ledger
            .as_ref()
            .map(|l| l.authenticate(&secret))
            .transpose()
    }

    /// `/health` and `/metrics` tell an operator about the cluster: with API keys on they
    /// need a valid key, unless the tracker was started with `--public-metrics`.
    pub fn may_observe(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.public_metrics || !self.keys_on() {
            return Ok(());
        }
        self.key(headers).map(|_| ())
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(crate::ops::models))
        .route("/v1/models/{id}", get(crate::ops::model))
        .route("/tokenize", post(crate::ops::tokenize))
        .route("/detokenize", post(crate::ops::detokenize))
        .route("/v1/usage", get(crate::ops::usage_of_key))
        .route("/admin/routes/{name}/evict", post(crate::ops::evict_route))
        .route("/health", get(crate::ops::health))
        .route("/metrics", get(crate::ops::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::method_not_allowed(method.as_str(), uri.path()).into_response()
}

/// Bodies up to this size are parsed on the async runtime (microseconds); longer ones on a
/// blocking thread.
const INLINE_BODY_BYTES: usize = 64 << 10;

fn parse_body(bytes: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid("body", format!("the request body is not valid JSON: {e}")))
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    handle(s, Endpoint::Completions, &headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    handle(s, Endpoint::Chat, &headers, body).await
}

/// The priority class: the request's `priority` field, else the `x-strata-priority` header,
/// else agent.
fn priority_of(req: &ValidRequest, headers: &HeaderMap) -> Result<Priority, ApiError> {
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
                ApiError::invalid(
                    "x-strata-priority",
                    "the x-strata-priority header must be \"agent\" or \"grading\"",
                )
            }),
    }
}

/// The secret from `Authorization: Bearer <key>` ("" when there is none).
pub fn bearer(headers: &HeaderMap) -> String {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .unwrap_or_default()
}

/// The token of an `Authorization` value in the Bearer scheme, whose name is
/// case-insensitive (RFC 7235): `Bearer k`, `bearer k` and `BEARER k` all carry `k`.
fn bearer_token(value: &str) -> Option<String> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_string())
        .filter(|t| !t.is_empty())
}

/// Prompt ids for a validated request, at most `limit` of them (a longer prompt is refused as
/// soon as that is certain). Runs on a blocking thread: tokenizing is linear in the text, but
/// a long text is still milliseconds of work the async runtime must not wait through.
async fn tokenize(
    s: &AppState,
    model: &ModelEntry,
    prompt: PromptInput,
    tools: Option<Value>,
    limit: usize,
) -> Result<Vec<u32>, ApiError> {
    let tokenizer = Arc::clone(&model.tokenizer);
    let n_vocab = tokenizer.n_vocab();
    let too_long = |at_least: usize| {
        ApiError::over_limit(
            "prompt",
            "n_ctx",
            format!("the prompt has at least {at_least} tokens, but the context length `n_ctx` is {limit}"),
        )
    };
    let ids = match prompt {
        PromptInput::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= n_vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is out of range (vocabulary has {n_vocab} tokens)"),
                ));
            }
            if ids.len() > limit {
                return Err(too_long(ids.len()));
            }
            ids
        }
        PromptInput::Text(t) => {
            let _permit = s.tokenizing.acquire().await;
            tokio::task::spawn_blocking(move || tokenizer.encode_within(&t, true, true, limit))
                .await
                .map_err(|_| ApiError::unavailable("tokenizing the prompt failed"))?
                .map_err(|e| too_long(e.at_least))?
        }
        PromptInput::Messages(m) => {
            let template = model
                .template
                .clone()
                .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
            let _permit = s.tokenizing.acquire().await;
            tokio::task::spawn_blocking(move || {
                tokenizer.encode_chat_within(&template, &m, tools.as_ref(), limit)
            })
            .await
            .map_err(|_| ApiError::unavailable("tokenizing the prompt failed"))?
            .map_err(|e| match e {
                text::Error::TooManyTokens(t) => too_long(t.at_least),
                other => ApiError::invalid("messages", other.to_string()),
            })?
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt is empty: at least one token is needed",
        ));
    }
    Ok(ids)
}

/// One choice of an accepted request: its session and what it sends.
pub struct Choice {
    pub events: mpsc::UnboundedReceiver<SessionEvent>,
    pub guard: CancelOnDrop,
    /// An event taken off `events` already (the first choice's first, awaited before the
    /// other choices are submitted), to be handled first.
    pub first: Option<SessionEvent>,
}

impl Choice {
    pub async fn next(&mut self) -> Option<SessionEvent> {
        match self.first.take() {
            Some(e) => Some(e),
            None => self.events.recv().await,
        }
    }
}

/// A request accepted by a route: what its response needs.
pub struct Accepted {
    pub req: ValidRequest,
    pub model_id: String,
    /// The response's id (the first choice's session).
    pub id: String,
    pub choices: Vec<Choice>,
    /// `echo`: the prompt's text, put before each choice's answer.
    pub echo: Option<String>,
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
    }
}

/// Checks the request's grammar (from `response_format` or `tool_choice`) compiles against
/// the model's vocabulary, off the async runtime; the refusal names the field it came from.
async fn check_grammar(
    s: &AppState,
    model: &ModelEntry,
    grammar: &str,
    param: &str,
) -> Result<(), ApiError> {
    let _permit = s.tokenizing.acquire().await;
    let (vocab, g) = (Arc::clone(&model.grammars), grammar.to_string());
    tokio::task::spawn_blocking(move || {
        let checked = vocab.get().and_then(|v| v.check(&g));
        release_freed_memory();
        checked
    })
    .await
    .map_err(|_| ApiError::unavailable("compiling the grammar failed"))?
    .map_err(|e| crate::agent::grammar_error(param, e))
}

/// Hands the heap's free pages back to the system. Compiling a large grammar allocates tens
/// of megabytes on the checking thread's arena and frees them; without this, glibc keeps them
/// and the tracker's resident memory stays at its peak after a burst of large schemas.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The ids of a fill-in-the-middle prompt (`prompt` before the gap, `suffix` after it) in the
/// model's own FIM tokens; a model without them refuses `suffix`.
fn fim_ids(
    t: &Tokenizer,
    prompt: &PromptInput,
    suffix: &str,
    limit: usize,
) -> Result<Vec<u32>, ApiError> {
    let (Some(pre), Some(suf), Some(mid)) = (
        t.token_id("<|fim_prefix|>"),
        t.token_id("<|fim_suffix|>"),
        t.token_id("<|fim_middle|>"),
    ) else {
        return Err(ApiError::invalid(
            "suffix",
            "this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)",
        ));
    };
    let PromptInput::Text(text) = prompt else {
        return Err(ApiError::invalid(
            "suffix",
            "`suffix` needs a text `prompt`",
        ));
    };
    if text.len() + suffix.len() > limit.saturating_mul(64) {
        return Err(ApiError::over_limit(
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
        return Err(ApiError::over_limit(
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

/// What the model decides about a request: `logit_bias` ids inside its vocabulary, `tools`
/// only with a template that has a tool-call format, and no control-token text in what its
/// template prints as markup (tool definitions, tool calls, tool-call ids, names).
fn check_against_model(model: &ModelEntry, req: &ValidRequest) -> Result<(), ApiError> {
    let n_vocab = model.tokenizer.n_vocab();
    if let Some(&(bad, _)) = req
        .sampling
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= n_vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` names token {bad}, but the vocabulary has {n_vocab} tokens"),
        ));
    }
    if let Some(t) = req.tools.as_ref().filter(|t| t.active()) {
        if !model
            .template
            .as_ref()
            .is_some_and(|t| t.has_hermes_tools())
        {
            return Err(ApiError::invalid(
                "tools",
                format!("the chat template of `{}` has no tool-call format strata knows (Hermes `<tool_call>`, as Qwen2.5's)", model.id),
            ));
        }
        if let Some(c) = model.tokenizer.control_text_in(&t.json.to_string()) {
            return Err(ApiError::invalid(
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
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].{field}"),
                        format!("`messages[{i}].{field}` holds the control token text `{c}`"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The grammar the answer is held to (`response_format`, or `tool_choice` `required` or a
/// named function), checked against the model's vocabulary.
async fn request_grammar(
    s: &AppState,
    model: &ModelEntry,
    req: &ValidRequest,
) -> Result<Option<String>, ApiError> {
    if let Some(g) = &req.grammar {
        check_grammar(s, model, g, "response_format").await?;
        return Ok(Some(g.clone()));
    }
    match req
        .tools
        .as_ref()
        .filter(|t| t.active())
        .and_then(|t| t.grammar())
    {
        Some(g) => {
            check_grammar(s, model, g, "tools").await?;
            Ok(Some(g.to_string()))
        }
        None => Ok(None),
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
) -> Result<Accepted, ApiError> {
    let body = read_body(body, &s.http).await?;
    let mut req = if body.len() <= INLINE_BODY_BYTES {
        validate(endpoint, parse_body(&body)?)?
    } else {
        // A long body is parsed where prompts are tokenized: off the async runtime, one core's
        // worth at a time, so a flood of them never takes the cores other requests need.
        let _permit = s.tokenizing.acquire().await;
        tokio::task::spawn_blocking(move || validate(endpoint, parse_body(&body)?))
            .await
            .map_err(|_| ApiError::unavailable("parsing the request failed"))??
    };
    record.priority = priority_of(&req, headers)?;
    record.user = req.user.clone().unwrap_or_default();
    let model = s.model(req.model.as_deref())?;
    record.model = model.id.clone();
    let key = s.key(headers)?;
    let n_ctx = model.n_ctx;
    check_against_model(&model, &req)?;
    let tools = req.tools.clone().filter(|t| t.active());
    let grammar = request_grammar(s, &model, &req).await?;
    let echo = match (&req.prompt, req.echo) {
        (_, false) => None,
        (PromptInput::Text(t), true) => Some(t.clone()),
        (PromptInput::Ids(ids), true) => Some(
            model
                .tokenizer
                .decode(ids, false)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        ),
        (PromptInput::Messages(_), true) => None,
    };
    let prompt = std::mem::replace(&mut req.prompt, PromptInput::Ids(Vec::new()));
    let prompt_ids = match &req.suffix {
        Some(suffix) => {
            // Tokenized where prompts are: off the async runtime, one core's worth at a time.
            let _permit = s.tokenizing.acquire().await;
            let (t, suffix) = (Arc::clone(&model.tokenizer), suffix.clone());
            tokio::task::spawn_blocking(move || fim_ids(&t, &prompt, &suffix, n_ctx))
                .await
                .map_err(|_| ApiError::unavailable("tokenizing the prompt failed"))??
        }
        None => {
            tokenize(
                s,
                &model,
                prompt,
                tools.as_ref().map(|t| t.json.clone()),
                n_ctx,
            )
            .await?
        }
    };
    record.prompt_tokens = prompt_ids.len();
    let max_tokens = match (req.max_tokens, endpoint) {
        (Some(m), _) => m,
        (None, Endpoint::Completions) => 16,
        (None, Endpoint::Chat) => s
            .default_chat_max_tokens
            .min(n_ctx.saturating_sub(prompt_ids.len()))
            .max(1),
    };
    if prompt_ids.len() + max_tokens > n_ctx {
        return Err(ApiError::over_limit("max_tokens", "n_ctx", format!(
            "prompt has {} tokens and `max_tokens` is {max_tokens}, but the context length `n_ctx` is {n_ctx}",
            prompt_ids.len()
        )));
    }
    let r = &req.sampling;
    let job = Job {
        sampling: proto::v1::Sampling {
            temperature: r.temperature,
            top_k: r.top_k,
            top_p: r.top_p,
            min_p: r.min_p,
            repeat_penalty: r.repeat_penalty,
            repeat_last_n: 64,
            seed: r.seed,
            presence_penalty: r.presence_penalty,
            frequency_penalty: r.frequency_penalty,
            logit_bias: r
                .logit_bias
                .iter()
                .map(|&(token, bias)| proto::v1::LogitBias { token, bias })
                .collect(),
            n_prompt: prompt_ids.len() as u32,
            grammar: grammar.unwrap_or_default(),
        },
        prompt_ids,
        max_tokens,
        stop: req.stop.clone(),
        logprobs: req.logprobs,
        ignore_eos: req.ignore_eos,
        priority: record.priority,
        key: key.as_ref().map(|k| k.name.clone()).unwrap_or_default(),
        ledger_row: None,
        billed_prompt: 0,
    };
    let n_prompt = job.prompt_ids.len() as u64;
    let mut choices: Vec<Choice> = Vec::with_capacity(req.n);
    for i in 0..req.n {
        let mut job_i = job.clone();
        // Each choice has its own seed and its own ledger row (the prompt is billed once).
        job_i.sampling.seed = job.sampling.seed.wrapping_add(i as u64);
        let billed_prompt = if i == 0 { n_prompt } else { 0 };
        job_i.billed_prompt = billed_prompt as usize;
        // The ledger row is committed before the request is submitted: an accepted request
        // is never lost, whatever happens to this process afterwards.
        job_i.ledger_row = match (&s.ledger, &key) {
            (Some(l), Some(k)) => {
                let (l2, k, max) = (Arc::clone(l), k.clone(), job.max_tokens as u64);
                let row = tokio::task::spawn_blocking(move || l2.reserve(&k, billed_prompt, max))
                    .await
                    .map_err(|_| ApiError::unavailable("the usage ledger stopped"))??;
                Some(row)
            }
            _ => None,
        };
        let ledger_row = job_i.ledger_row;
        match submit(&model, job_i).await {
            Ok((route, id, events)) => {
                let mut c = Choice {
                    events,
                    guard: CancelOnDrop::new(id, route.commands.clone()),
                    first: None,
                };
                if i == 0 && req.n > 1 {
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
                // Dropping the choices already admitted cancels them.
                return Err(e);
            }
        }
    }
    let n = s
        .responses
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = response_id(endpoint, n + 1);
    Ok(Accepted {
        req,
        model_id: model.id.clone(),
        id,
        choices,
        echo,
    })
}

/// Offers the job to the model's routes in turn; the first that admits it runs it. When every
/// route refuses for capacity the last refusal is returned; any other refusal is final.
async fn submit(
    model: &ModelEntry,
    job: Job,
) -> Result<
    (
        Arc<RouteHandle>,
        engine::SessionId,
        mpsc::UnboundedReceiver<SessionEvent>,
    ),
    ApiError,
> {
    use std::sync::atomic::Ordering::Relaxed;
    let mut last = ApiError::no_route("the model has no route now; retry shortly");
    // The least loaded route first (sessions held and requests on their way; between equals,
    // the one whose tightest shard has the most free KV); the others in turn when it refuses
    // for capacity.
    let mut routes: Vec<&Arc<RouteHandle>> = model.routes.iter().filter(|r| r.resident()).collect();
    routes.sort_by_key(|r| {
        (
            r.load.load(Relaxed) + r.submitting.load(Relaxed),
            std::cmp::Reverse(r.health.borrow().kv_headroom()),
        )
    });
    for route in routes {
        route.submitting.fetch_add(1, Relaxed);
        let answer = offer(route, &job).await;
        route.submitting.fetch_sub(1, Relaxed);
        match answer {
            Ok((id, events)) => return Ok((Arc::clone(route), id, events)),
            Err(e) if e.status == 503 => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Offers the job to one route: its session id and events, or its refusal.
async fn offer(
    route: &RouteHandle,
    job: &Job,
) -> Result<(engine::SessionId, mpsc::UnboundedReceiver<SessionEvent>), ApiError> {
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (acc_tx, acc_rx) = oneshot::channel();
    route
        .commands
        .send(Command::Submit {
            job: Box::new(job.clone()),
            events: events_tx,
            accepted: acc_tx,
        })
        .await
        .map_err(|_| ApiError::unavailable("the scheduler is shutting down"))?;
    match acc_rx.await {
        Ok(Ok(id)) => Ok((id, events_rx)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ApiError::unavailable("the scheduler is shutting down")),
    }
}

#[cfg(test)]
mod tests {
    use super::bearer_token;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k1", "bearer k1", "BEARER  k1 ", "  bEaReR k1"] {
            assert_eq!(bearer_token(v).as_deref(), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "Bearer ", "k1", ""] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }
}
