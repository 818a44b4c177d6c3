//! The one refusal: why a request, a session or a step was refused or failed, as every layer
//! speaks it. A shard builds one, the wire carries it typed (`proto` converts), the route layer
//! decides on it (replay, move, fail) by its [`Reason`], and the API maps it to one HTTP
//! status and body. No code learns what happened by reading a message: the message is for
//! people.
//!
//! [`Reason::name`] is the one place a reason is spelled: the `reason`/`code` field of API
//! bodies, metric labels and the ledger all take it from there.

/// Why something was refused or failed. Adding one: a variant here, its name, its class and
/// its retry rule below, its wire number in `strata.proto` (`Reason`) and `proto`'s
/// conversion, and its HTTP status in the tracker's API layer (each match is exhaustive, so
/// the compiler lists every place).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The request itself is wrong (a field, its type, a limit of the API).
    InvalidRequest,
    /// The request could never fit, whatever else ran (a body, headers, KV for its tokens).
    TooLarge,
    /// The request's body did not arrive in time.
    Timeout,
    /// No or an unknown API key where keys are on.
    Unauthorized,
    /// No endpoint at that path.
    NotFound,
    /// The endpoint exists but does not take that method.
    MethodNotAllowed,
    /// `GET /v1/models/{id}` of a model this tracker does not serve.
    ModelNotFound,
    /// A model no route of this tracker holds (never loaded on demand).
    NotResident,
    /// No route serves the model now (none joined yet, or all left).
    NoRoute,
    /// A shard or route is going away and takes no new session.
    Draining,
    /// A limit of the cluster that frees up (KV, session places, queue places, connections).
    Capacity,
    /// A usage budget that is spent.
    Budget,
    /// An operator action refused because the model is pinned there.
    Pinned,
    /// A shard failed (lost, frozen, its compute stopped).
    ShardFailed,
    /// A shard no longer holds what the route was validated with.
    RecipeMismatch,
    /// A step of an older epoch of the route reached a shard.
    StaleEpoch,
    /// A shard no longer holds the session's KV.
    CacheMiss,
    /// The session's grammar took longer than the last shard's budget for one token.
    GrammarBudget,
    /// A peer speaks another version of the wire protocol.
    ProtocolMismatch,
}

/// What kind of "no" a reason is, for metrics: the client's own request (`invalid`), a limit
/// of the cluster that may free up (`capacity`), a spent allowance (`budget`), or something
/// that broke (`failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Invalid,
    Capacity,
    Budget,
    Failure,
}

impl Class {
    pub fn name(self) -> &'static str {
        match self {
            Class::Invalid => "invalid",
            Class::Capacity => "capacity",
            Class::Budget => "budget",
            Class::Failure => "failure",
        }
    }
}

impl Reason {
    pub const ALL: [Reason; 19] = [
        Reason::InvalidRequest,
        Reason::TooLarge,
        Reason::Timeout,
        Reason::Unauthorized,
        Reason::NotFound,
        Reason::MethodNotAllowed,
        Reason::ModelNotFound,
        Reason::NotResident,
        Reason::NoRoute,
        Reason::Draining,
        Reason::Capacity,
        Reason::Budget,
        Reason::Pinned,
        Reason::ShardFailed,
        Reason::RecipeMismatch,
        Reason::StaleEpoch,
        Reason::CacheMiss,
        Reason::GrammarBudget,
        Reason::ProtocolMismatch,
    ];

    /// The reason's one spelling (API bodies, metric labels, logs).
    pub fn name(self) -> &'static str {
        match self {
            Reason::InvalidRequest => "invalid_request",
            Reason::TooLarge => "too_large",
            Reason::Timeout => "timeout",
            Reason::Unauthorized => "unauthorized",
            Reason::NotFound => "not_found",
            Reason::MethodNotAllowed => "method_not_allowed",
            Reason::ModelNotFound => "model_not_found",
            Reason::NotResident => "not_resident",
            Reason::NoRoute => "no_route",
            Reason::Draining => "draining",
            Reason::Capacity => "capacity",
            Reason::Budget => "budget",
            Reason::Pinned => "pinned",
            Reason::ShardFailed => "shard_failed",
            Reason::RecipeMismatch => "recipe_mismatch",
            Reason::StaleEpoch => "stale_epoch",
            Reason::CacheMiss => "cache_miss",
            Reason::GrammarBudget => "grammar_budget",
            Reason::ProtocolMismatch => "protocol_mismatch",
        }
    }

    /// What kind of "no" it is.
    pub fn class(self) -> Class {
        match self {
            Reason::Budget => Class::Budget,
            Reason::Capacity | Reason::TooLarge => Class::Capacity,
            Reason::ShardFailed
            | Reason::RecipeMismatch
            | Reason::CacheMiss
            | Reason::StaleEpoch
            | Reason::ProtocolMismatch => Class::Failure,
            Reason::InvalidRequest
            | Reason::Timeout
            | Reason::Unauthorized
            | Reason::NotFound
            | Reason::MethodNotAllowed
            | Reason::ModelNotFound
            | Reason::NotResident
            | Reason::NoRoute
            | Reason::Draining
            | Reason::Pinned
            | Reason::GrammarBudget => Class::Invalid,
        }
    }

    /// Seconds after which the same work may succeed when a shard refuses it for this reason
    /// (`None`: it will not, as sent).
    pub fn shard_retry_after(self) -> Option<u64> {
        match self {
            Reason::Capacity | Reason::Budget | Reason::ShardFailed | Reason::Draining => Some(1),
            Reason::StaleEpoch | Reason::CacheMiss => Some(0),
            Reason::InvalidRequest
            | Reason::TooLarge
            | Reason::Timeout
            | Reason::Unauthorized
            | Reason::NotFound
            | Reason::MethodNotAllowed
            | Reason::ModelNotFound
            | Reason::NotResident
            | Reason::NoRoute
            | Reason::Pinned
            | Reason::RecipeMismatch
            | Reason::GrammarBudget
            | Reason::ProtocolMismatch => None,
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A typed refusal or failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    /// For people: what happened, with the figures.
    pub message: String,
    /// The limit that was hit, by its name (`kv_budget`, `queue_slots[agent]`, `n_ctx`, ...).
    pub limit: Option<String>,
    /// Seconds after which the same request may succeed as sent; `None`: it will not.
    pub retry_after: Option<u64>,
    /// The request field at fault (`max_tokens`, `messages[2].name`, `body`, `headers`, ...).
    pub param: Option<String>,
}

impl Refusal {
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        Refusal {
            reason,
            message: message.into(),
            limit: None,
            retry_after: None,
            param: None,
        }
    }

    /// Whether the same request may succeed later, as sent.
    pub fn retryable(&self) -> bool {
        self.retry_after.is_some()
    }

    pub fn with_limit(mut self, limit: impl Into<String>) -> Self {
        self.limit = Some(limit.into());
        self
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Retryable after `secs` seconds (`None`: terminal as sent).
    pub fn retry_after(mut self, secs: Option<u64>) -> Self {
        self.retry_after = secs;
        self
    }

    fn retry_in(self, secs: u64) -> Self {
        self.retry_after(Some(secs))
    }

    /// A request field that is wrong.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(Reason::InvalidRequest, message).with_param(param)
    }

    /// A request over a fixed limit of the API (context, stop strings, schema size): the
    /// field and the limit named.
    pub fn over_limit(param: &str, limit: &str, message: impl Into<String>) -> Self {
        Self::invalid(param, message).with_limit(limit)
    }

    /// A request body over the limit (terminal as sent; the connection closes).
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self::new(
            Reason::TooLarge,
            format!("the request body is larger than the limit of {limit_bytes} bytes"),
        )
        .with_limit("max_body_bytes")
        .with_param("body")
    }

    /// Request headers over a limit (terminal as sent; the connection closes).
    pub fn headers_too_large(limit: &str, message: impl Into<String>) -> Self {
        Self::new(Reason::TooLarge, message)
            .with_limit(limit)
            .with_param("headers")
    }

    /// A request body that did not arrive in time.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            Reason::Timeout,
            format!(
                "the request body did not arrive within {} ms",
                limit.as_millis()
            ),
        )
        .with_limit("body_timeout")
        .with_param("body")
    }

    /// No route serves the model now: retryable, since shards join a registry at any time.
    pub fn no_route(message: impl Into<String>) -> Self {
        Self::new(Reason::NoRoute, message).retry_in(1)
    }

    /// A shard or route is going away: it takes no new session; another route may.
    pub fn draining(message: impl Into<String>) -> Self {
        Self::new(Reason::Draining, message).retry_in(1)
    }

    /// A model no route of this tracker holds: refused, never loaded on demand.
    pub fn not_resident(requested: &str, resident: &str) -> Self {
        Self::new(Reason::NotResident, format!(
            "model `{requested}` is not resident on any route of this tracker (resident: {resident}); models are loaded only when their shards start"
        ))
        .with_param("model")
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(Reason::NotFound, format!("no route for `{path}`"))
    }

    /// A model this tracker does not serve, asked for by id.
    pub fn model_not_found(id: &str) -> Self {
        Self::new(
            Reason::ModelNotFound,
            format!("no resident model is named `{id}`"),
        )
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            Reason::MethodNotAllowed,
            format!("`{path}` does not take {method}"),
        )
    }

    /// A shard failed: the shard named as the limit.
    pub fn shard_failed(shard: &str, message: impl Into<String>) -> Self {
        Self::new(
            Reason::ShardFailed,
            format!("shard {shard} failed: {}", message.into()),
        )
        .with_limit(format!("shard {shard}"))
        .retry_in(1)
    }

    /// Something of the tracker's own stopped (a thread, a channel): retryable.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Reason::ShardFailed, message).retry_in(1)
    }

    /// A shard is no longer what the route was validated with: terminal until an operator
    /// restarts it as it was.
    pub fn recipe_mismatch(message: impl Into<String>) -> Self {
        Self::new(Reason::RecipeMismatch, message)
    }

    /// A peer on another protocol version: terminal until one of them is upgraded.
    pub fn protocol_mismatch(peer: &str, theirs: u32, ours: u32) -> Self {
        Self::new(
            Reason::ProtocolMismatch,
            format!("{peer} speaks protocol version {theirs}, this process speaks {ours}"),
        )
        .with_limit("protocol_version")
    }

    /// A limit of the cluster that may free up.
    pub fn capacity(limit: &str, message: impl Into<String>) -> Self {
        Self::new(Reason::Capacity, message)
            .with_limit(limit)
            .retry_in(1)
    }

    /// A request that could never fit, whatever else ran (terminal).
    pub fn too_large(limit: &str, message: impl Into<String>) -> Self {
        Self::new(Reason::TooLarge, message)
            .with_limit(limit)
            .with_param("max_tokens")
    }

    /// A usage budget that is spent: terminal until an operator raises it.
    pub fn budget(limit: &str, message: impl Into<String>) -> Self {
        Self::new(Reason::Budget, message).with_limit(limit)
    }

    /// No or an unknown API key where keys are configured.
    pub fn unauthorized() -> Self {
        Self::new(
            Reason::Unauthorized,
            "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
        )
    }

    /// An operator's eviction of a model pinned on the route.
    pub fn pinned(route: &str, message: impl Into<String>) -> Self {
        Self::new(Reason::Pinned, message).with_limit(format!("pinned on route {route}"))
    }

    /// A refusal a shard sent: retryable as its reason says.
    pub fn from_shard(reason: Reason, message: impl Into<String>) -> Self {
        Self::new(reason, message).retry_after(reason.shard_retry_after())
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_name() {
        let names: std::collections::HashSet<&str> = Reason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
    }

    #[test]
    fn a_lost_shard_is_a_retryable_failure_and_a_recipe_mismatch_is_terminal() {
        let lost = Refusal::shard_failed("a", "gone");
        assert_eq!(
            (lost.reason.class(), lost.retryable()),
            (Class::Failure, true)
        );
        let changed = Refusal::recipe_mismatch("layers");
        assert!(!changed.retryable());
        assert_eq!(
            Refusal::capacity("kv_budget", "x").reason.class(),
            Class::Capacity
        );
        assert_eq!(Refusal::budget("key", "x").reason.class(), Class::Budget);
        assert_eq!(Refusal::invalid("n", "x").reason.class(), Class::Invalid);
        assert_eq!(
            Refusal::from_shard(Reason::CacheMiss, "x").retry_after,
            Some(0)
        );
    }
}
