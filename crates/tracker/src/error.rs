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
    /// Seconds after which a retry may succeed (retryable errors only).
    pub retry_after: Option<u64>,
    /// The request field at fault, for invalid requests.
    pub param: Option<String>,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            reason: "invalid_request",
            message: message.into(),
            limit: None,
            retry_after: None,
            param: Some(param.to_string()),
        }
    }

    /// A model no route of this tracker holds: refused, never loaded on demand.
    pub fn not_resident(requested: &str, resident: &str) -> Self {
        ApiError {
            status: 404,
            reason: "not_resident",
            message: format!(
                "model `{requested}` is not resident on any route of this tracker (resident: {resident}); models are loaded only when their shards start"
            ),
            limit: None,
            retry_after: None,
            param: Some("model".into()),
        }
    }

    pub fn shard_failed(shard: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 503,
            reason: "shard_failed",
            message: format!("shard {shard} failed: {}", message.into()),
            limit: Some(format!("shard {shard}")),
            retry_after: Some(1),
            param: None,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: 503,
            reason: "shard_failed",
            message: message.into(),
            limit: None,
            retry_after: Some(1),
            param: None,
        }
    }

    pub fn capacity(limit: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 503,
            reason: "capacity",
            message: message.into(),
            limit: Some(limit.to_string()),
            retry_after: Some(1),
            param: None,
        }
    }

    /// A request that could never fit, whatever else ran (terminal).
    pub fn too_large(limit: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 413,
            reason: "too_large",
            message: message.into(),
            limit: Some(limit.to_string()),
            retry_after: None,
            param: Some("max_tokens".into()),
        }
    }

    /// A usage budget (API key tokens) that is spent: 429, distinct from capacity, and
    /// terminal until an operator raises the budget.
    pub fn budget(limit: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: 429,
            reason: "budget",
            message: message.into(),
            limit: Some(limit.to_string()),
            retry_after: None,
            param: None,
        }
    }

    /// No or an unknown API key where keys are configured.
    pub fn unauthorized() -> Self {
        ApiError {
            status: 401,
            reason: "unauthorized",
            message: "a valid API key is required (Authorization: Bearer <key>)".into(),
            limit: None,
            retry_after: None,
            param: None,
        }
    }

    pub fn retry_after(mut self, secs: Option<u64>) -> Self {
        self.retry_after = secs;
        self
    }

    /// The refusal's class for metrics: `budget` (429), `capacity` (5xx: may fit later),
    /// `invalid` (other 4xx: never will as sent).
    pub fn class(&self) -> &'static str {
        match self.status {
            429 => "budget",
            s if s >= 500 => "capacity",
            _ => "invalid",
        }
    }

    /// Counts this refusal in `strata_refusals_total` by reason, class and priority.
    pub fn count(&self, metrics: &crate::Metrics, priority: engine::Priority) {
        metrics.inc(
            "strata_refusals_total",
            &[
                ("reason", self.reason),
                ("class", self.class()),
                ("priority", priority.name()),
            ],
            1.0,
        );
    }

    /// A refusal a shard sent for one fragment.
    pub fn from_shard_refusal(reason: &str, message: &str) -> Self {
        let (status, reason, retry): (u16, &'static str, Option<u64>) = match reason {
            "capacity" => (503, "capacity", Some(1)),
            "budget" => (429, "budget", Some(1)),
            "stale_epoch" => (409, "stale_epoch", Some(0)),
            "cache_miss" => (503, "cache_miss", Some(0)),
            "recipe_mismatch" => (503, "recipe_mismatch", None),
            "shard_failed" => (503, "shard_failed", Some(1)),
            _ => (400, "invalid_request", None),
        };
        ApiError {
            status,
            reason,
            message: message.to_string(),
            limit: None,
            retry_after: retry,
            param: None,
        }
    }

    /// Whether the same request may succeed later; a spent budget stays spent.
    pub fn retryable(&self) -> bool {
        matches!(self.status, 409 | 503) || (self.status == 429 && self.reason != "budget")
    }

    fn error_type(&self) -> &'static str {
        match self.status {
            400 | 404 | 413 => "invalid_request_error",
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
                "retryable": self.retryable(),
                "retry_after": self.retry_after,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert("retry-after", v);
            }
        }
        resp
    }
}
