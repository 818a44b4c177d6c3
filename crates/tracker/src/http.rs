//! The OpenAI-compatible HTTP API: completions and chat completions (plain and SSE), models,
//! health and metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::stream::{self, Stream};
use serde_json::{json, Value};
use text::{ChatTemplate, Tokenizer};
use tokio::sync::{mpsc, oneshot, watch};

use crate::cluster::{Cluster, Health};
use crate::error::ApiError;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::request::{validate, Endpoint, PromptInput, ValidRequest};
use crate::runner::{Command, Job, SessionEvent, TokenLogprob};
use engine::Priority;

/// What the handlers share (all immutable or internally synchronized).
pub struct AppState {
    /// The resident models, each with the routes (nodes) that hold it.
    pub models: Vec<ModelEntry>,
    pub metrics: Arc<Metrics>,
    /// `max_tokens` when a chat request gives none.
    pub default_chat_max_tokens: usize,
    pub ledger: Option<Arc<Ledger>>,
    /// Bearer token of the admin API (`None`: no admin API).
    pub admin_token: Option<String>,
}

/// One resident model: its tokenizer and the routes whose shards hold it.
pub struct ModelEntry {
    pub id: String,
    pub digest: String,
    pub n_layers: u32,
    /// The smallest context any of its routes allows.
    pub n_ctx: usize,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub routes: Vec<RouteHandle>,
}

/// One route's scheduling loop.
pub struct RouteHandle {
    pub name: String,
    pub cluster: Arc<Cluster>,
    pub commands: mpsc::Sender<Command>,
    pub health: watch::Receiver<Health>,
    /// A shard of the route was started with `--pin`: the model is never evicted from it.
    pub pinned: bool,
    /// An operator evicted the model from this route: no new request goes to it.
    pub evicted: std::sync::atomic::AtomicBool,
}

impl RouteHandle {
    fn resident(&self) -> bool {
        !self.evicted.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl ModelEntry {
    fn resident(&self) -> bool {
        self.routes.iter().any(RouteHandle::resident)
    }
}

impl AppState {
    /// The model a request names (or the only one, when it names none). A model no route
    /// holds is refused as `not_resident`: nothing is ever loaded to answer a request.
    fn model(&self, requested: Option<&str>) -> Result<&ModelEntry, ApiError> {
        match requested {
            Some(m) => self
                .models
                .iter()
                .find(|e| (e.id == m || e.digest == m) && e.resident())
                .ok_or_else(|| ApiError::not_resident(m, &self.residency())),
            None if self.models.iter().filter(|m| m.resident()).count() == 1 => {
                Ok(self.models.iter().find(|m| m.resident()).expect("counted"))
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
    fn residency(&self) -> String {
        self.models
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
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/usage", get(usage_of_key))
        .route("/admin/routes/{name}/evict", post(evict_route))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn parse_body(bytes: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid("body", format!("the request body is not valid JSON: {e}")))
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(s, Endpoint::Completions, &headers, body).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
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
fn bearer(headers: &HeaderMap) -> String {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|k| k.trim().to_string())
        .unwrap_or_default()
}

/// Prompt ids for a validated request.
fn tokenize(s: &ModelEntry, req: &ValidRequest) -> Result<Vec<u32>, ApiError> {
    let ids = match &req.prompt {
        PromptInput::Text(t) => s.tokenizer.encode(t, true, true),
        PromptInput::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= s.tokenizer.n_vocab()) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "token id {bad} is out of range (vocabulary has {} tokens)",
                        s.tokenizer.n_vocab()
                    ),
                ));
            }
            ids.clone()
        }
        PromptInput::Messages(m) => {
            let t = s
                .template
                .as_ref()
                .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
            s.tokenizer
                .encode_chat(t, m)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?
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

async fn handle(
    s: Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let mut priority = Priority::Agent;
    let result = async {
        let body = parse_body(&body)?;
        let req = validate(endpoint, &body)?;
        priority = priority_of(&req, headers)?;
        let model = s.model(req.model.as_deref())?;
        // Without a ledger there are no keys; with one, the key must be known.
        let key = match &s.ledger {
            Some(l) => Some(l.authenticate(&bearer(headers))?),
            None => None,
        };
        let prompt_ids = tokenize(model, &req)?;
        let n_ctx = model.n_ctx;
        let max_tokens = match (req.max_tokens, endpoint) {
            (Some(m), _) => m,
            (None, Endpoint::Completions) => 16,
            (None, Endpoint::Chat) => s.default_chat_max_tokens.min(n_ctx.saturating_sub(prompt_ids.len())).max(1),
        };
        if prompt_ids.len() + max_tokens > n_ctx {
            return Err(ApiError {
                status: 400,
                reason: "invalid_request",
                message: format!(
                    "prompt has {} tokens and `max_tokens` is {max_tokens}, but the context length `n_ctx` is {n_ctx}",
                    prompt_ids.len()
                ),
                limit: Some("n_ctx".into()),
                retry_after: None,
                param: Some("max_tokens".into()),
            });
        }
        let job = Job {
            prompt_ids,
            max_tokens,
            sampling: proto::v1::Sampling {
                temperature: req.sampling.temperature,
                top_k: req.sampling.top_k,
                top_p: req.sampling.top_p,
                min_p: req.sampling.min_p,
                repeat_penalty: req.sampling.repeat_penalty,
                repeat_last_n: 64,
                seed: req.sampling.seed,
            },
            stop: req.stop.clone(),
            logprobs: req.logprobs,
            ignore_eos: req.ignore_eos,
            priority,
            key: key.as_ref().map(|k| k.name.clone()).unwrap_or_default(),
            ledger_row: None,
        };
        // The ledger row is committed before the request is submitted: an accepted request
        // is never lost, whatever happens to this process afterwards.
        let (ledger_row, ledger) = match (&s.ledger, key) {
            (Some(l), Some(k)) => {
                let (l2, prompt, max) = (Arc::clone(l), job.prompt_ids.len() as u64, job.max_tokens as u64);
                let row = tokio::task::spawn_blocking(move || l2.reserve(&k, prompt, max))
                    .await
                    .map_err(|_| ApiError::unavailable("the usage ledger stopped"))??;
                (Some(row), Some(Arc::clone(l)))
            }
            _ => (None, None),
        };
        let job = Job { ledger_row, ..job };
        let n_prompt = job.prompt_ids.len() as u64;
        match submit(model, job).await {
            Ok((route, id, events)) => Ok((req, model.id.clone(), route.commands.clone(), id, events)),
            Err(e) => {
                if let (Some(l), Some(row)) = (ledger, ledger_row) {
                    l.settle(row, n_prompt, 0, "refused");
                }
                Err(e)
            }
        }
    }
    .await;
    match result {
        Err(e) => {
            s.metrics.inc(
                "strata_requests_total",
                &[("status", &e.status.to_string())],
                1.0,
            );
            e.count(&s.metrics, priority);
            e.into_response()
        }
        Ok((req, model_id, commands, id, events)) => {
            let guard = CancelOnDrop {
                id,
                commands,
                armed: true,
            };
            if req.stream {
                stream_response(model_id, req, events, guard).into_response()
            } else {
                whole_response(model_id, req, events, guard).await
            }
        }
    }
}

/// Offers the job to the model's routes in turn; the first that admits it runs it. When every
/// route refuses for capacity the last refusal is returned; any other refusal is final.
async fn submit(
    model: &ModelEntry,
    job: Job,
) -> Result<
    (
        &RouteHandle,
        engine::SessionId,
        mpsc::UnboundedReceiver<SessionEvent>,
    ),
    ApiError,
> {
    let mut last = ApiError::unavailable("the model has no route");
    for route in model.routes.iter().filter(|r| r.resident()) {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (acc_tx, acc_rx) = oneshot::channel();
        route
            .commands
            .send(Command::Submit {
                job: job.clone(),
                events: events_tx,
                accepted: acc_tx,
            })
            .await
            .map_err(|_| ApiError::unavailable("the scheduler is shutting down"))?;
        match acc_rx.await {
            Ok(Ok(id)) => return Ok((route, id, events_rx)),
            Ok(Err(e)) if e.status == 503 => last = e,
            Ok(Err(e)) => return Err(e),
            Err(_) => last = ApiError::unavailable("the scheduler is shutting down"),
        }
    }
    Err(last)
}

/// Cancels the session when the response is dropped before it finished (client went away).
struct CancelOnDrop {
    id: engine::SessionId,
    commands: mpsc::Sender<Command>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.try_send(Command::Cancel(self.id));
        }
    }
}

fn logprob_json(endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat => json!({
            "content": lps.iter().map(|l| json!({
                "token": l.token,
                "logprob": l.logprob,
                "bytes": l.token.as_bytes(),
                "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()
        }),
        Endpoint::Completions => json!({
            "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        }),
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn whole_response(
    model_id: String,
    req: ValidRequest,
    mut events: mpsc::UnboundedReceiver<SessionEvent>,
    mut guard: CancelOnDrop,
) -> Response {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut ids = Vec::new();
    let (finish, p, c) = loop {
        match events.recv().await {
            Some(SessionEvent::Token {
                token,
                text: t,
                logprob,
            }) => {
                text.push_str(&t);
                lps.extend(logprob);
                ids.push(token);
            }
            Some(SessionEvent::Text(t)) => text.push_str(&t),
            Some(SessionEvent::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            }) => break (finish_reason, prompt_tokens, completion_tokens),
            Some(SessionEvent::Error(e)) => {
                guard.armed = false;
                return e.into_response();
            }
            None => {
                guard.armed = false;
                return ApiError::unavailable("the session ended without a result").into_response();
            }
        }
    };
    guard.armed = false;
    let id = format!(
        "{}-{}",
        if req.endpoint == Endpoint::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        guard.id.0
    );
    let logprobs = req.logprobs.map(|_| logprob_json(req.endpoint, &lps));
    let mut body = match req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": now_secs(), "model": model_id,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(p, c),
        }),
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion", "created": now_secs(), "model": model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(p, c),
        }),
    };
    if req.return_token_ids {
        body["choices"][0]["token_ids"] = json!(ids);
    }
    (StatusCode::OK, Json(body)).into_response()
}

struct StreamState {
    model_id: String,
    req: ValidRequest,
    events: mpsc::UnboundedReceiver<SessionEvent>,
    guard: CancelOnDrop,
    first: bool,
    /// The final chunk was sent; `[DONE]` is next.
    done_next: bool,
    finished: bool,
}

fn chunk(
    st: &StreamState,
    delta_text: Option<&str>,
    lp: Option<&TokenLogprob>,
    finish: Option<&str>,
    usage_v: Option<Value>,
) -> Value {
    let id = format!(
        "{}-{}",
        if st.req.endpoint == Endpoint::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        st.guard.id.0
    );
    let logprobs = match (st.req.logprobs, lp) {
        (Some(_), Some(l)) => logprob_json(st.req.endpoint, std::slice::from_ref(l)),
        _ => Value::Null,
    };
    let mut v = match st.req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": now_secs(), "model": st.model_id,
            "choices": [{"index": 0, "text": delta_text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}],
        }),
        Endpoint::Chat => {
            let mut delta = json!({});
            if st.first {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = delta_text {
                delta["content"] = json!(t);
            }
            json!({
                "id": id, "object": "chat.completion.chunk", "created": now_secs(), "model": st.model_id,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    };
    if let Some(u) = usage_v {
        v["usage"] = u;
    }
    v
}

fn stream_response(
    model_id: String,
    req: ValidRequest,
    events: mpsc::UnboundedReceiver<SessionEvent>,
    guard: CancelOnDrop,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let state = StreamState {
        model_id,
        req,
        events,
        guard,
        first: true,
        done_next: false,
        finished: false,
    };
    let body = stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        if st.done_next {
            st.finished = true;
            return Some((Ok(SseEvent::default().data("[DONE]")), st));
        }
        let ev = match st.events.recv().await {
            Some(SessionEvent::Token {
                token,
                text,
                logprob,
            }) => {
                let mut c = chunk(&st, Some(&text), logprob.as_ref(), None, None);
                if st.req.return_token_ids {
                    c["choices"][0]["token_ids"] = json!([token]);
                }
                st.first = false;
                SseEvent::default().data(c.to_string())
            }
            Some(SessionEvent::Text(text)) => {
                let c = chunk(&st, Some(&text), None, None, None);
                st.first = false;
                SseEvent::default().data(c.to_string())
            }
            Some(SessionEvent::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                let c = chunk(
                    &st,
                    None,
                    None,
                    Some(finish_reason),
                    Some(usage(prompt_tokens, completion_tokens)),
                );
                st.guard.armed = false;
                st.done_next = true;
                SseEvent::default().data(c.to_string())
            }
            Some(SessionEvent::Error(e)) => {
                st.guard.armed = false;
                st.finished = true;
                SseEvent::default().data(e.body().to_string())
            }
            None => {
                st.guard.armed = false;
                st.finished = true;
                SseEvent::default().data(
                    ApiError::unavailable("the session ended without a result")
                        .body()
                        .to_string(),
                )
            }
        };
        Some((Ok(ev), st))
    });
    Sse::new(body).keep_alive(KeepAlive::default())
}

/// A key's usage and budget: `GET /v1/usage` with its bearer secret.
async fn usage_of_key(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let Some(ledger) = &s.ledger else {
        return ApiError::invalid(
            "ledger",
            "this tracker keeps no usage ledger (start it with --ledger)",
        )
        .into_response();
    };
    let key = match ledger.authenticate(&bearer(&headers)) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let l = Arc::clone(ledger);
    match tokio::task::spawn_blocking(move || l.usage(&key)).await {
        Ok(Ok(u)) => Json(json!({
            "key": u.key,
            "budget_tokens": (u.budget_tokens != u64::MAX).then_some(u.budget_tokens),
            "charged_tokens": u.charged_tokens,
            "reserved_tokens": u.reserved_tokens,
            "requests": u.requests.into_iter().map(|(k, v)| (k, json!(v))).collect::<serde_json::Map<_, _>>(),
        }))
        .into_response(),
        Ok(Err(e)) => ApiError::unavailable(e).into_response(),
        Err(_) => ApiError::unavailable("the usage ledger stopped").into_response(),
    }
}

/// The operator's eviction of a model from one route (node): refused for a pinned model;
/// otherwise no new request goes to the route (sessions on it finish). Nothing is ever loaded
/// in its place: residency changes only by operator action.
async fn evict_route(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match &s.admin_token {
        Some(t) if bearer(&headers) == *t => {}
        _ => return ApiError::unauthorized().into_response(),
    }
    let Some((model, route)) = s
        .models
        .iter()
        .find_map(|m| m.routes.iter().find(|r| r.name == name).map(|r| (m, r)))
    else {
        return ApiError::invalid("name", format!("no route is named `{name}`")).into_response();
    };
    if route.pinned {
        return ApiError {
            status: 409,
            reason: "pinned",
            message: format!(
                "model `{}` is pinned on route {name}: a pinned model is never evicted",
                model.id
            ),
            limit: Some(format!("pinned on route {name}")),
            retry_after: None,
            param: None,
        }
        .into_response();
    }
    route
        .evicted
        .store(true, std::sync::atomic::Ordering::Release);
    s.metrics.set(
        "strata_model_resident",
        &[("model", &model.id), ("route", &name)],
        0.0,
    );
    s.metrics
        .inc("strata_evictions_total", &[("model", &model.id)], 1.0);
    tracing::info!(model = %model.id, route = %name, "evicted by the operator");
    Json(json!({"evicted": {"model": model.id, "route": name}})).into_response()
}

/// The resident models and the routes (nodes) holding each.
async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = s
        .models
        .iter()
        .filter(|m| m.resident())
        .map(|m| {
            let routes: Vec<&RouteHandle> = m.routes.iter().filter(|r| r.resident()).collect();
            json!({"id": m.id, "object": "model", "created": 0, "owned_by": "strata",
                   "digest": m.digest, "n_layers": m.n_layers, "context_length": m.n_ctx,
                   "routes": routes.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
                   "pinned_on": routes.iter().filter(|r| r.pinned).map(|r| r.name.clone()).collect::<Vec<_>>()})
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let mut shards = Vec::new();
    let mut models = Vec::new();
    let mut ok = true;
    for m in &s.models {
        let mut routes = Vec::new();
        for r in &m.routes {
            let h = r.health.borrow().clone();
            ok &= h.all_up();
            routes.push(json!({"name": r.name, "status": if h.all_up() { "up" } else { "down" }}));
            shards.extend(h.shards.iter().map(|sh| {
                json!({
                    "address": sh.address,
                    "model": m.id,
                    "route": r.name,
                    "layers": format!("{}..{}", sh.layers.0, sh.layers.1),
                    "status": if sh.up { "up" } else { "down" },
                    "error": sh.last_error,
                    "kv_bytes_in_use": sh.stats.as_ref().map(|st| st.kv_bytes_in_use),
                    "sessions": sh.stats.as_ref().map(|st| st.sessions),
                    "kv_blocks_in_use": sh.stats.as_ref().map(|st| st.kv_blocks_in_use),
                    "kv_blocks_total": sh.stats.as_ref().map(|st| st.kv_blocks_total),
                    "evictions": sh.stats.as_ref().map(|st| st.evictions),
                })
            }));
        }
        models.push(json!({"id": m.id, "digest": m.digest, "routes": routes}));
    }
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let model = (s.models.len() == 1).then(|| s.models[0].id.clone());
    (
        status,
        Json(json!({"status": if ok { "ok" } else { "degraded" }, "model": model, "models": models, "shards": shards})),
    )
        .into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let (_, rss) = proto::rss_bytes();
    s.metrics.set("strata_tracker_rss_bytes", &[], rss as f64);
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}
