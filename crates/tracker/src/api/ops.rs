//! The operator's endpoints: models, a key's usage, evicting a model from a route, health and
//! metrics.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use engine::Refusal;

use super::auth::bearer;
use super::state::AppState;
use crate::api::error::Answer;
use crate::api::server::read_body;
use crate::route::table::{ModelEntry, RouteHandle};

/// A key's usage and budget: `GET /v1/usage` with its bearer secret.
pub async fn usage_of_key(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let Some(ledger) = &s.ledger else {
        return Refusal::invalid(
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
        Ok(Err(e)) => Refusal::unavailable(e).into_response(),
        Err(_) => Refusal::unavailable("the usage ledger stopped").into_response(),
    }
}

/// The operator's eviction of a model from one route (node): refused for a pinned model;
/// otherwise no new request goes to the route (sessions on it finish). Nothing is ever loaded
/// in its place: residency changes only by operator action.
pub async fn evict_route(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    match &s.admin_token {
        Some(t) if proto::secrets_equal(&bearer(&headers), t) => {}
        _ => return Refusal::unauthorized().into_response(),
    }
    let models = s.table.models();
    let Some((model, route)) = models
        .iter()
        .find_map(|m| m.routes.iter().find(|r| r.name == name).map(|r| (m, r)))
    else {
        return Refusal::invalid("name", format!("no route is named `{name}`")).into_response();
    };
    if route.pinned {
        return Refusal::pinned(
            &name,
            format!(
                "model `{}` is pinned on route {name}: a pinned model is never evicted",
                model.id
            ),
        )
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

fn model_json(m: &ModelEntry) -> Value {
    let routes: Vec<&Arc<RouteHandle>> = m.routes.iter().filter(|r| r.resident()).collect();
    json!({"id": m.id, "object": "model", "created": 0, "owned_by": "strata",
           "digest": m.digest, "n_layers": m.n_layers, "context_length": m.n_ctx,
           "routes": routes.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
           "pinned_on": routes.iter().filter(|r| r.pinned).map(|r| r.name.clone()).collect::<Vec<_>>()})
}

/// The resident models and the routes (nodes) holding each.
/// The resident models (`GET /v1/models`). With API keys on it needs one, like every endpoint
/// but the probes: the list names the models' digests and routes.
pub async fn models(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.key(&headers) {
        return e.into_response();
    }
    let data: Vec<Value> = s
        .table
        .models()
        .iter()
        .filter(|m| m.resident())
        .map(|m| model_json(m))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// One resident model (`GET /v1/models/{id}`, by name or digest).
pub async fn model(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = s.key(&headers) {
        return e.into_response();
    }
    match s
        .table
        .models()
        .iter()
        .find(|m| m.resident() && (m.id == id || m.digest == id))
    {
        Some(m) => Json(model_json(m)).into_response(),
        None => Refusal::model_not_found(&id).into_response(),
    }
}

/// A tokenize or detokenize body: checked fields, the model it names.
fn text_body(
    s: &AppState,
    body: &[u8],
    fields: &[&str],
) -> Result<(Value, Arc<ModelEntry>), Refusal> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        Refusal::invalid("body", format!("the request body is not valid JSON: {e}"))
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| Refusal::invalid("body", "the request body must be a JSON object"))?;
    if let Some(k) = obj
        .keys()
        .find(|k| k.as_str() != "model" && !fields.contains(&k.as_str()))
    {
        return Err(Refusal::invalid(k, format!("`{k}` is not supported here")));
    }
    let model = s.model(v.get("model").and_then(Value::as_str))?;
    Ok((v, model))
}

fn json_or_error(r: Result<Value, Refusal>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn flag(v: &Value, key: &str, default: bool) -> Result<bool, Refusal> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(Refusal::invalid(
            key,
            format!("`{key}` must be a boolean, got {other}"),
        )),
    }
}

/// `POST /tokenize`, with llama-server's fields: `content`, `add_special` (false),
/// `parse_special` (true), `with_pieces` (false) -> `{"tokens": [...]}`.
pub async fn tokenize(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let run = async {
        let owner = s.key(&headers)?.map(|k| k.name).unwrap_or_default();
        let (body, _hold) = read_body(body, &s.http, &s.bodies, &owner).await?;
        let (v, model) = text_body(
            &s,
            &body,
            &["content", "add_special", "parse_special", "with_pieces"],
        )?;
        let content = v
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| Refusal::invalid("content", "`content` must be a string"))?
            .to_string();
        let (add, parse, pieces) = (
            flag(&v, "add_special", false)?,
            flag(&v, "parse_special", true)?,
            flag(&v, "with_pieces", false)?,
        );
        let tok = Arc::clone(&model.tokenizer);
        s.run_blocking(move || {
            let ids = tok.encode(&content, add, parse);
            let tokens: Vec<Value> = if pieces {
                ids.iter()
                    .map(|&id| {
                        let bytes = tok.token_bytes(id, true).unwrap_or_default();
                        let piece = match String::from_utf8(bytes) {
                            Ok(s) => json!(s),
                            Err(e) => json!(e.into_bytes()),
                        };
                        json!({"id": id, "piece": piece})
                    })
                    .collect()
            } else {
                ids.iter().map(|&id| json!(id)).collect()
            };
            json!({"tokens": tokens})
        })
        .await
        .ok_or_else(|| Refusal::unavailable("tokenizing failed"))
    };
    json_or_error(run.await)
}

/// `POST /detokenize`: `{"tokens": [...]}` -> `{"content": "..."}`.
pub async fn detokenize(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let run = async {
        let owner = s.key(&headers)?.map(|k| k.name).unwrap_or_default();
        let (body, _hold) = read_body(body, &s.http, &s.bodies, &owner).await?;
        let (v, model) = text_body(&s, &body, &["tokens"])?;
        let ids = v
            .get("tokens")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| Refusal::invalid("tokens", "`tokens` must be a list of token ids"))?;
        let tok = Arc::clone(&model.tokenizer);
        let content = s
            .run_blocking(move || tok.decode(&ids, false))
            .await
            .ok_or_else(|| Refusal::unavailable("detokenizing failed"))?
            .map_err(|e| Refusal::invalid("tokens", e.to_string()))?;
        Ok::<_, Refusal>(json!({"content": content}))
    };
    json_or_error(run.await)
}

/// `GET /livez`: the process is up and its HTTP server answers. No key, no look at the
/// routes: a liveness probe restarts a process, and a down route is no reason to.
pub async fn livez() -> Response {
    Json(json!({"status": "alive"})).into_response()
}

/// `GET /readyz`: 200 when every resident model has a route open end to end, else 503 naming
/// the models that have none; `?model=ID` asks about one model (404 if it is not resident).
/// No key needed for the verdict (a readiness probe sends none); which models there are, and
/// `?model=`, only for a caller who may read `/health` (with API keys on, a valid key or
/// `--public-metrics`): the model table is not told to a caller without a key.
pub async fn readyz(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    q: Result<Query<std::collections::HashMap<String, String>>, QueryRejection>,
) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return Refusal::invalid("query", e.body_text()).into_response(),
    };
    let named = s.may_observe(&headers);
    let table = s.table.models();
    let asked = q.get("model");
    if let Some(k) = q.keys().find(|k| k.as_str() != "model") {
        return Refusal::invalid(
            k,
            format!("`{k}` is not a /readyz parameter (only `model`)"),
        )
        .into_response();
    }
    if let (Some(_), Err(refusal)) = (asked, &named) {
        return refusal.clone().into_response();
    }
    let mut models = serde_json::Map::new();
    let mut not_ready = Vec::new();
    for m in table.iter().filter(|m| m.resident()) {
        if asked.is_some_and(|a| *a != m.id && *a != m.digest) {
            continue;
        }
        let ready = m.routes.iter().any(|r| r.takes_work());
        if !ready {
            not_ready.push(m.id.clone());
        }
        models.insert(
            m.id.clone(),
            json!(if ready { "ready" } else { "not ready" }),
        );
    }
    if let Some(a) = asked {
        if models.is_empty() {
            return Refusal::model_not_found(a).into_response();
        }
    }
    if models.is_empty() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not ready", "reason": "no model is resident", "models": {}})),
        )
            .into_response();
    }
    if named.is_err() {
        let (code, status) = if not_ready.is_empty() {
            (StatusCode::OK, "ready")
        } else {
            (StatusCode::SERVICE_UNAVAILABLE, "not ready")
        };
        return (code, Json(json!({"status": status}))).into_response();
    }
    if not_ready.is_empty() {
        Json(json!({"status": "ready", "models": models})).into_response()
    } else {
        let reason = format!("no open route for {}", not_ready.join(", "));
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not ready", "reason": reason, "models": models})),
        )
            .into_response()
    }
}

pub async fn health(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.may_observe(&headers) {
        return e.into_response();
    }
    let mut shards = Vec::new();
    let mut models = Vec::new();
    let table = s.table.models();
    // No route at all is not healthy either.
    let mut ok = table.iter().any(|m| !m.routes.is_empty());
    for m in table.iter() {
        let mut routes = Vec::new();
        for r in &m.routes {
            let h = r.health.borrow().clone();
            // Up means the runner has the route open end to end and every shard answers as
            // what the route was validated with: exactly when it would take a request.
            let up = *r.up.borrow();
            ok &= up;
            let layers: Vec<String> = r
                .cluster
                .infos
                .iter()
                .map(|i| format!("{}: {}..{}", i.listen, i.layer_start, i.layer_end))
                .collect();
            // Its measured time per token (route/pace.rs), null while it has none.
            let now = std::time::Instant::now();
            let token_seconds = r.pace.seconds(now);
            // Beside it, the time per token its parts predict (route/pace.rs: the shards'
            // own times per token and the route's messaging).
            let predicted = crate::route::pace::Prediction::of(&h, &r.pace, now);
            routes.push(
                json!({"name": r.name, "status": if up { "up" } else { "down" },
                               "sessions": r.load.load(std::sync::atomic::Ordering::Relaxed),
                               "token_seconds": token_seconds,
                               "predicted_token_seconds": predicted.and_then(|p| p.seconds()),
                               "compute_seconds": predicted.map(|p| p.compute),
                               "messaging_seconds": predicted.and_then(|p| p.messaging),
                               "shards": layers}),
            );
            shards.extend(h.shards.iter().map(|sh| {
                let info = r.cluster.infos.iter().find(|i| i.listen == sh.address);
                json!({
                    "address": sh.address,
                    "version": info.map(|i| i.version.as_str()),
                    "protocol": info.map(|i| i.protocol_version),
                    "numeric_contract": r.cluster.numeric_contract(),
                    "kv_dtype": r.cluster.kv_dtype(),
                    "model": m.id,
                    "route": r.name,
                    "layers": format!("{}..{}", sh.layers.0, sh.layers.1),
                    "status": match (sh.up, sh.stats.as_ref().is_some_and(|st| st.draining)) {
                        (true, true) => "draining",
                        (true, false) => "up",
                        (false, _) => "down",
                    },
                    "error": sh.last_error,
                    "kv_bytes_in_use": sh.stats.as_ref().map(|st| st.kv_bytes_in_use),
                    "sessions": sh.stats.as_ref().map(|st| st.sessions),
                    "kv_blocks_in_use": sh.stats.as_ref().map(|st| st.kv_blocks_in_use),
                    "kv_blocks_total": sh.stats.as_ref().map(|st| st.kv_blocks_total),
                    "evictions": sh.stats.as_ref().map(|st| st.evictions),
                })
            }));
        }
        models.push(
            json!({"id": m.id, "digest": m.digest, "n_layers": m.n_layers, "routes": routes}),
        );
    }
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let model = (table.len() == 1).then(|| table[0].id.clone());
    let mut body = json!({"status": if ok { "ok" } else { "degraded" }, "model": model, "models": models, "shards": shards});
    if let Some(r) = &s.table.registry {
        let m = r.borrow();
        body["registry"] =
            json!({"connected": m.connected, "members": m.shards.len(), "revision": m.revision});
    }
    (status, Json(body)).into_response()
}

pub async fn metrics(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.may_observe(&headers) {
        return e.into_response();
    }
    crate::metrics::observe_process(&s.metrics);
    (
        [("content-type", "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}
