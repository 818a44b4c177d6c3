//! The API layer: the OpenAI-compatible endpoints and the operator's, over the route layer.
//! It owns HTTP: the server, request validation into typed requests, answers, and the one
//! mapping from a refusal to a status and body ([`error`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, Uri};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use engine::Refusal;

pub mod agent;
pub mod answer;
pub mod auth;
pub mod completions;
pub mod console;
pub mod error;
pub mod fields;
pub mod messages;
pub mod messages_out;
pub mod ops;
pub mod parts;
pub mod record;
pub mod request;
pub mod respond;
pub mod responses;
pub mod responses_out;
pub mod server;
pub mod state;
pub mod store;

use error::Answer;
use state::AppState;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/models", get(ops::models))
        .route("/v1/models/{id}", get(ops::model))
        .route("/tokenize", post(ops::tokenize))
        .route("/detokenize", post(ops::detokenize))
        .route("/v1/usage", get(ops::usage_of_key))
        .route("/admin/routes/{name}/evict", post(ops::evict_route))
        .route("/health", get(ops::health))
        .route("/livez", get(ops::livez))
        .route("/", get(console::page))
        .route("/console", get(console::page))
        .route("/console/console.js", get(console::script))
        .route("/console/console.css", get(console::style))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            key_first,
        ))
        .with_state(state)
}

/// The key comes first: a request to any endpoint that needs one is refused from its headers
/// alone, before its body is read, parsed or validated and before its model is resolved, so
/// an unauthenticated caller learns nothing of the cluster (no model list, no validation
/// message) and costs no more than its headers. The handlers check the key again where they
/// need its identity. Open: the probes (`/livez`, `/readyz`) and the console's static files
/// (the page asks for the key itself); `/health` and `/metrics` as `--public-metrics` says;
/// `/admin/...` under the operator's own token, which its handler checks.
async fn key_first(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let checked = match path {
        "/livez"
        | "/readyz"
        | "/"
        | "/console"
        | "/console/console.js"
        | "/console/console.css" => Ok(()),
        "/health" | "/metrics" => s.may_observe(req.headers()),
        _ if path.starts_with("/admin/") => Ok(()),
        _ => s.key(req.headers()).map(|_| ()),
    };
    match checked {
        Ok(()) => next.run(req).await,
        // The Messages API's clients read Anthropic's error shape.
        Err(refusal) if path.starts_with("/v1/messages") => error::anthropic(&refusal),
        Err(refusal) => refusal.into_response(),
    }
}

async fn not_found(uri: Uri) -> Response {
    error::response(&Refusal::not_found(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error::response(&Refusal::method_not_allowed(method.as_str(), uri.path()))
}
