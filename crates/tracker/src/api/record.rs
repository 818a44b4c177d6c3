//! One request's account, kept from its arrival to its end whichever way it ends: answered,
//! refused, failed, or abandoned by its client. It is the one place that counts requests
//! (`strata_requests_total` by final status, end-to-end latency, prompt and generation
//! lengths, finished requests by `finish_reason`) and writes the request's log line.

use std::sync::Arc;
use std::time::Instant;

use crate::api::request::Endpoint;
use crate::metrics::{Metrics, LATENCY_BUCKETS, TOKEN_BUCKETS};
use engine::Refusal;

/// How a request ended.
pub enum Outcome<'a> {
    /// Answered; `finish_reason` as the response says it.
    Done {
        finish_reason: engine::FinishReason,
        completion_tokens: usize,
    },
    /// Refused or failed with this error (before or during its answer).
    Failed(&'a Refusal),
}

/// The account of one request; dropped unfinished, it counts as `cancelled` (the client went
/// away before the answer was complete).
pub struct RequestRecord {
    metrics: Arc<Metrics>,
    pub id: String,
    endpoint: Endpoint,
    pub model: String,
    pub priority: engine::Priority,
    /// The end user the request names (`user`), "" when none.
    pub user: String,
    started: Instant,
    first_token: Option<Instant>,
    pub prompt_tokens: usize,
    completion_tokens: usize,
    finished: bool,
}

impl RequestRecord {
    pub fn new(metrics: Arc<Metrics>, id: String, endpoint: Endpoint) -> Self {
        RequestRecord {
            metrics,
            id,
            endpoint,
            model: String::new(),
            priority: engine::Priority::Agent,
            user: String::new(),
            started: Instant::now(),
            first_token: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            finished: false,
        }
    }

    /// A token reached the client.
    pub fn token(&mut self) {
        self.first_token.get_or_insert_with(Instant::now);
        self.completion_tokens += 1;
    }

    pub fn finish(&mut self, outcome: Outcome<'_>) {
        if self.finished {
            return;
        }
        self.finished = true;
        let (status, finish_reason) = match &outcome {
            Outcome::Done {
                finish_reason,
                completion_tokens,
            } => {
                self.completion_tokens = *completion_tokens;
                ("ok", Some(finish_reason.name()))
            }
            Outcome::Failed(e) => {
                crate::api::error::count(e, &self.metrics, self.priority);
                (e.reason.name(), None)
            }
        };
        self.account(status, finish_reason);
    }

    fn account(&self, status: &str, finish_reason: Option<&str>) {
        let m = &self.metrics;
        let took = self.started.elapsed();
        let priority = self.priority.name();
        m.inc("strata_requests_total", &[("status", status)], 1.0);
        m.observe(
            "strata_request_duration_seconds",
            &[("status", status), ("priority", priority)],
            LATENCY_BUCKETS,
            took.as_secs_f64(),
        );
        if let Some(reason) = finish_reason {
            m.inc(
                "strata_finished_requests_total",
                &[("finish_reason", reason)],
                1.0,
            );
            m.observe(
                "strata_request_prompt_tokens",
                &[],
                TOKEN_BUCKETS,
                self.prompt_tokens as f64,
            );
            m.observe(
                "strata_request_generation_tokens",
                &[],
                TOKEN_BUCKETS,
                self.completion_tokens as f64,
            );
        }
        let ttft_ms = self
            .first_token
            .map(|t| (t - self.started).as_secs_f64() * 1e3);
        tracing::info!(
            target: "strata::request",
            id = %self.id,
            endpoint = self.endpoint.path(),
            model = %self.model,
            priority,
            user = %self.user,
            status,
            finish_reason = finish_reason.unwrap_or(""),
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            ttft_ms = ttft_ms.unwrap_or(0.0),
            duration_ms = took.as_secs_f64() * 1e3,
            "request"
        );
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.finished = true;
            self.account("cancelled", None);
        }
    }
}
