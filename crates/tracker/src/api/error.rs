//! The one place where a refusal becomes an HTTP status and an OpenAI-style error body
//! (DESIGN.md invariant 8). Every `match` on the reason here is exhaustive: a new reason does
//! not compile until it has its status.

use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use engine::{Class, Reason, Refusal};
use serde_json::json;

use crate::metrics::Metrics;

/// The status a refusal answers with.
pub fn status(r: &Refusal) -> StatusCode {
    match r.reason {
        Reason::InvalidRequest | Reason::GrammarBudget => StatusCode::BAD_REQUEST,
        // Headers over a limit are 431; a body, or KV for the tokens asked, 413.
        Reason::TooLarge if r.param.as_deref() == Some("headers") => {
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        }
        Reason::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        Reason::Timeout => StatusCode::REQUEST_TIMEOUT,
        Reason::Unauthorized => StatusCode::UNAUTHORIZED,
        Reason::NotFound | Reason::ModelNotFound | Reason::NotResident => StatusCode::NOT_FOUND,
        Reason::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
        Reason::Budget => StatusCode::TOO_MANY_REQUESTS,
        Reason::Pinned | Reason::StaleEpoch => StatusCode::CONFLICT,
        Reason::NoRoute
        | Reason::Draining
        | Reason::Capacity
        | Reason::ShardFailed
        | Reason::RecipeMismatch
        | Reason::CacheMiss
        | Reason::ProtocolMismatch => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// OpenAI's `type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 404 | 405 | 408 | 413 | 431 => "invalid_request_error",
        401 => "authentication_error",
        429 => "rate_limit_error",
        _ => "server_error",
    }
}

/// Whether the connection closes after the answer: the request's body or headers were not
/// (all) read.
fn closes(r: &Refusal) -> bool {
    matches!(r.reason, Reason::TooLarge | Reason::Timeout)
        && matches!(r.param.as_deref(), Some("body" | "headers"))
}

/// The OpenAI-style body, with strata's typed fields beside the usual ones.
pub fn body(r: &Refusal) -> serde_json::Value {
    json!({
        "error": {
            "message": r.message,
            "type": error_type(status(r)),
            "code": r.reason.name(),
            "param": r.param,
            "reason": r.reason.name(),
            "limit": r.limit,
            "retryable": r.retryable(),
            "retry_after": r.retry_after,
        }
    })
}

/// The whole answer: status, body, `retry-after` and, when the request was not read whole,
/// `connection: close`.
pub fn response(r: &Refusal) -> Response {
    use axum::response::IntoResponse;
    let mut resp = (status(r), axum::Json(body(r))).into_response();
    if let Some(s) = r.retry_after {
        if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
            resp.headers_mut().insert("retry-after", v);
        }
    }
    if closes(r) {
        resp.headers_mut()
            .insert("connection", HeaderValue::from_static("close"));
    }
    resp
}

/// Anthropic's `error.type` for a status.
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 => "overloaded_error",
        _ => "api_error",
    }
}

/// The body in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`, what
/// the Messages API's clients parse), with strata's typed fields beside.
pub fn anthropic_body(r: &Refusal) -> serde_json::Value {
    json!({
        "type": "error",
        "error": {
            "type": anthropic_type(status(r)),
            "message": r.message,
            "param": r.param,
            "reason": r.reason.name(),
            "limit": r.limit,
            "retryable": r.retryable(),
            "retry_after": r.retry_after,
        }
    })
}

/// [`response`] in Anthropic's shape: the same status and headers.
pub fn anthropic(r: &Refusal) -> Response {
    let mut resp = response(r);
    let body = axum::body::Body::from(anthropic_body(r).to_string());
    *resp.body_mut() = body;
    resp.headers_mut()
        .remove(axum::http::header::CONTENT_LENGTH);
    resp
}

/// A refusal's answer, as methods: `refusal.into_response()` and `refusal.body()` in handlers.
pub trait Answer {
    fn into_response(self) -> Response;
    fn body(&self) -> serde_json::Value;
}

impl Answer for Refusal {
    fn into_response(self) -> Response {
        response(&self)
    }

    fn body(&self) -> serde_json::Value {
        body(self)
    }
}

/// Counts a refusal where it belongs: refusals (capacity, budget, invalid) in
/// `strata_refusals_total`, failures in `strata_request_failures_total`.
pub fn count(r: &Refusal, metrics: &Metrics, priority: engine::Priority) {
    let reason = r.reason.name();
    match r.reason.class() {
        Class::Failure => metrics.inc(
            "strata_request_failures_total",
            &[("reason", reason), ("priority", priority.name())],
            1.0,
        ),
        class => metrics.inc(
            "strata_refusals_total",
            &[
                ("reason", reason),
                ("class", class.name()),
                ("priority", priority.name()),
            ],
            1.0,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_a_status_and_headers_are_431() {
        for reason in Reason::ALL {
            let r = Refusal::new(reason, "x");
            assert!(status(&r).as_u16() >= 400, "{reason}");
        }
        let h = Refusal::headers_too_large("max_headers", "x");
        assert_eq!(status(&h).as_u16(), 431);
        assert!(closes(&h));
        let kv = Refusal::too_large("kv_budget", "x");
        assert_eq!((status(&kv).as_u16(), closes(&kv)), (413, false));
        assert_eq!(
            body(&Refusal::shard_failed("a", "gone"))["error"]["retryable"],
            true
        );
        let a = anthropic_body(&Refusal::capacity("kv_budget", "full"));
        assert_eq!(
            (a["type"].as_str(), a["error"]["type"].as_str()),
            (Some("error"), Some("overloaded_error"))
        );
        assert_eq!(
            anthropic_body(&Refusal::invalid("x", "y"))["error"]["type"],
            "invalid_request_error"
        );
    }
}
