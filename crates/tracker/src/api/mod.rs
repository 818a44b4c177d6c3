//! The API layer: the OpenAI-compatible endpoints and the operator's, over the route layer.
//! It owns HTTP: the server, request validation into typed requests, answers, and the one
//! mapping from a refusal to a status and body ([`error`]).

use std::sync::Arc;

use axum::http::{Method, Uri};
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
            auth::key_first,
        ))
        .with_state(state)
}

async fn not_found(uri: Uri) -> Response {
    error::response(&Refusal::not_found(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error::response(&Refusal::method_not_allowed(method.as_str(), uri.path()))
}
