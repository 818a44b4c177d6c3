//! The one place where errors become HTTP statuses and OpenAI-style error bodies.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A typed refusal or failure as the API reports it (DESIGN.md invariant 8).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    /// `invalid_request`, `not_resident`, `capacity`, `budget`, `shard_failed`, ...
    pub reason: &'static str,
    pub message: String,
    /// The limit that was hit, when one was.
    pub limit: Option<String>,
    /// Whether the same request may succeed later, as sent.
    pub retryable: bool,
    /// Seconds after which a retry may succeed (retryable errors only).
    pub retry_after: Option<u64>,
    /// The request field at fault, for invalid requests.
    pub param: Option<String>,
    /// Whether the connection closes after the answer: its request body was not (all) read.
    pub close: bool,
}

/// What kind of "no" an error is, for metrics: the client's own request (`invalid`), a limit
/// of the cluster that may free up (`capacity`), a spent allowance (`budget`), or something
/// that broke (`failure`: a shard lost, a recipe that no longer matches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    Invalid,
    Capacity,
    Budget,
    Failure,
}

impl ErrorClass {
    pub fn name(self) -> &'static str {
        match self {
            ErrorClass::Invalid => "invalid",
            ErrorClass::Capacity => "capacity",
            ErrorClass::Budget => "budget",
            ErrorClass::Failure => "failure",
        }
    }
}

impl ApiError {
    fn new(status: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            reason,
            message: message.into(),
            limit: None,
            retryable: false,
            retry_after: None,
            param: None,
            close: false,
        }
    }

    /// Closes the connection after the answer.
    fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    /// Marks the error retryable after `secs` seconds.
    fn retry_in(mut self, secs: u64) -> Self {
        self.retryable = true;
        self.retry_after = Some(secs);
        self
    }

    fn limit(mut self, limit: impl Into<String>) -> Self {
        self.limit = Some(limit.into());
        self
    }

    /// The request field at fault.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request", message).param(param)
    }

    /// A request that exceeds a fixed limit of the API (context, stop strings, body size):
    /// 400 naming the field and the limit.
    pub fn over_limit(param: &str, limit: &str, message: impl Into<String>) -> Self {
        Self::invalid(param, message).limit(limit)
    }

    /// A request body over the limit (413, terminal as sent).
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self::new(
            413,
            "too_large",
            format!("the request body is larger than the limit of {limit_bytes} bytes"),
        )
        .limit("max_body_bytes")
        .param("body")
        .closing()
    }

    /// Request headers over a limit (431, terminal as sent; the connection closes).
    pub fn headers_too_large(limit: &str, message: impl Into<String>) -> Self {
        Self::new(431, "too_large", message)
            .limit(limit)
            .param("headers")
            .closing()
    }

    /// A request body that did not arrive in time (408).
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            408,
            "timeout",
            format!(
                "the request body did not arrive within {} ms",
                limit.as_millis()
            ),
        )
        .limit("body_timeout")
        .param("body")
        .closing()
    }

    /// No route serves the model now (none joined yet, or all left): retryable, since shards
    /// join a registry at any time.
    pub fn no_route(message: impl Into<String>) -> Self {
        Self::new(503, "no_route", message).retry_in(1)
    }

    /// A shard is draining (going away): it takes no new session; another route may.
    pub fn draining(message: impl Into<String>) -> Self {
        Self::new(503, "draining", message).retry_in(1)
    }

    /// A model no route of this tracker holds: refused, never loaded on demand.
    pub fn not_resident(requested: &str, resident: &str) -> Self {
        Self::new(404, "not_resident", format!(
            "model `{requested}` is not resident on any route of this tracker (resident: {resident}); models are loaded only when their shards start"
        ))
        .param("model")
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(404, "not_found", format!("no route for `{path}`"))
    }

    /// A model this tracker does not serve, asked for by id (`GET /v1/models/{id}`).
    pub fn model_not_found(id: &str) -> Self {
        Self::new(
            404,
            "model_not_found",
            format!("no resident model is named `{id}`"),
        )
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            405,
            "method_not_allowed",
            format!("`{path}` does not take {method}"),
        )
    }

    pub fn shard_failed(shard: &str, message: impl Into<String>) -> Self {
        Self::new(
            503,
            "shard_failed",
            format!("shard {shard} failed: {}", message.into()),
        )
        .limit(format!("shard {shard}"))
        .retry_in(1)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, "shard_failed", message).retry_in(1)
    }

    /// A shard is no longer what the route was validated with (another model, range or
    /// recipe): terminal until an operator restarts it as it was.
    pub fn recipe_mismatch(message: impl Into<String>) -> Self {
        Self::new(503, "recipe_mismatch", message)
    }

    /// A route stream a shard refused or broke: a recipe mismatch is terminal, anything else
    /// is that shard failing.
    pub fn from_route_status(shard: &str, status: &tonic::Status) -> Self {
        let message = status.message();
        if status.code() == tonic::Code::FailedPrecondition && message.contains("recipe_mismatch") {
            Self::recipe_mismatch(message)
        } else {
            Self::shard_failed(shard, message)
        }
    }

    pub fn capacity(limit: &str, message: impl Into<String>) -> Self {
        Self::new(503, "capacity", message).limit(limit).retry_in(1)
    }

    /// A request that could never fit, whatever else ran (terminal).
    pub fn too_large(limit: &str, message: impl Into<String>) -> Self {
        Self::new(413, "too_large", message)
            .limit(limit)
            .param("max_tokens")
    }

    /// A usage budget (API key tokens) that is spent: 429, distinct from capacity, and
    /// terminal until an operator raises the budget.
    pub fn budget(limit: &str, message: impl Into<String>) -> Self {
        Self::new(429, "budget", message).limit(limit)
    }

    /// No or an unknown API key where keys are configured.
    pub fn unauthorized() -> Self {
        Self::new(
            401,
            "unauthorized",
            "a valid API key is required (Authorization: Bearer <key>)",
        )
    }

    /// A 409 for an operator action that cannot be done as asked.
    pub fn conflict(reason: &'static str, limit: String, message: impl Into<String>) -> Self {
        Self::new(409, reason, message).limit(limit)
    }

    pub fn retry_after(mut self, secs: Option<u64>) -> Self {
        self.retryable = secs.is_some();
        self.retry_after = secs;
        self
    }

    /// What kind of "no" this is (see [`ErrorClass`]).
    pub fn class(&self) -> ErrorClass {
        match self.reason {
            "budget" => ErrorClass::Budget,
            "capacity" | "too_large" => ErrorClass::Capacity,
            "shard_failed" | "recipe_mismatch" | "cache_miss" | "stale_epoch" => {
                ErrorClass::Failure
            }
            _ => ErrorClass::Invalid,
        }
    }

    /// Counts this error where it belongs: refusals (capacity, budget, invalid) in
    /// `strata_refusals_total`, failures in `strata_request_failures_total`.
    pub fn count(&self, metrics: &crate::Metrics, priority: engine::Priority) {
        match self.class() {
            ErrorClass::Failure => metrics.inc(
                "strata_request_failures_total",
                &[("reason", self.reason), ("priority", priority.name())],
                1.0,
            ),
            class => metrics.inc(
                "strata_refusals_total",
                &[
                    ("reason", self.reason),
                    ("class", class.name()),
                    ("priority", priority.name()),
                ],
                1.0,
            ),
        }
    }

    /// A refusal a shard sent for one fragment.
    pub fn from_shard_refusal(reason: &str, message: &str) -> Self {
        match reason {
            // A shard's capacity refusal starts with the limit it hit (`kv_budget on shard
            // ...`), named as the tracker's own refusals name theirs.
            "capacity" => {
                let err = Self::new(503, "capacity", message).retry_in(1);
                match message.split_once(" on shard ") {
                    Some((limit, _))
                        if !limit.is_empty()
                            && limit.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') =>
                    {
                        err.limit(limit)
                    }
                    _ => err,
                }
            }
            "budget" => Self::new(429, "budget", message).retry_in(1),
            "stale_epoch" => Self::new(409, "stale_epoch", message).retry_in(0),
            "cache_miss" => Self::new(503, "cache_miss", message).retry_in(0),
            "recipe_mismatch" => Self::recipe_mismatch(message),
            "shard_failed" => Self::new(503, "shard_failed", message).retry_in(1),
            // The request's grammar was too slow for one token on the last shard.
            "grammar_budget" => {
                Self::new(400, "grammar_budget", message).limit("grammar_budget_ms")
            }
            _ => Self::new(400, "invalid_request", message),
        }
    }

    fn error_type(&self) -> &'static str {
        match self.status {
            400 | 404 | 405 | 408 | 413 | 431 => "invalid_request_error",
            401 => "authentication_error",
            429 => "rate_limit_error",
            _ => "server_error",
        }
    }

    /// The OpenAI-style body, with strata's typed fields beside the usual ones.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.error_type(),
                "code": self.reason,
                "param": self.param,
                "reason": self.reason,
                "limit": self.limit,
                "retryable": self.retryable,
                "retry_after": self.retry_after,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after.filter(|_| self.retryable) {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert("retry-after", v);
            }
        }
        if self.close {
            resp.headers_mut()
                .insert("connection", HeaderValue::from_static("close"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recipe_mismatch_is_not_retryable_and_a_lost_shard_is() {
        let status = tonic::Status::failed_precondition(
            "recipe_mismatch: shard a has layer_end 10 but the route expects 15",
        );
        let e = ApiError::from_route_status("a", &status);
        assert_eq!(
            (e.reason, e.retryable, e.retry_after),
            ("recipe_mismatch", false, None)
        );
        assert_eq!(e.body()["error"]["retryable"], false);
        let full = ApiError::from_shard_refusal(
            "capacity",
            "max_sessions on shard 127.0.0.1:1: 1 sessions held",
        );
        assert_eq!(
            (full.status, full.limit.as_deref()),
            (503, Some("max_sessions"))
        );
        let odd = ApiError::from_shard_refusal("capacity", "Something else on shard x");
        assert_eq!(odd.limit, None);
        let lost = ApiError::from_route_status("a", &tonic::Status::unavailable("gone"));
        assert_eq!((lost.reason, lost.retryable), ("shard_failed", true));
    }

    #[test]
    fn a_shard_failure_is_a_failure_not_a_capacity_refusal() {
        assert_eq!(
            ApiError::shard_failed("a", "x").class(),
            ErrorClass::Failure
        );
        assert_eq!(
            ApiError::capacity("kv_budget", "x").class(),
            ErrorClass::Capacity
        );
        assert_eq!(ApiError::budget("key", "x").class(), ErrorClass::Budget);
        assert_eq!(ApiError::invalid("n", "x").class(), ErrorClass::Invalid);
    }
}
