//! The operator's endpoints: models, a key's usage, evicting a model from a route, health and
//! metrics.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::http::{bearer, AppState, RouteHandle};

/// A key's usage and budget: `GET /v1/usage` with its bearer secret.
pub async fn usage_of_key(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
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
pub async fn evict_route(
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
        return ApiError::conflict(
            "pinned",
            format!("pinned on route {name}"),
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

/// The resident models and the routes (nodes) holding each.
pub async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
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

pub async fn health(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.may_observe(&headers) {
        return e.into_response();
    }
    let mut shards = Vec::new();
    let mut models = Vec::new();
    let mut ok = true;
    for m in &s.models {
        let mut routes = Vec::new();
        for r in &m.routes {
            let h = r.health.borrow().clone();
            // Up means the runner has the route open end to end and every shard answers as
            // what the route was validated with: exactly when it would take a request.
            let up = *r.up.borrow();
            ok &= up;
            routes.push(json!({"name": r.name, "status": if up { "up" } else { "down" }}));
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
