//! `engine::Refusal` on the wire and back: the only place a reason crosses between its domain
//! type and its wire number, and the only place a gRPC status carries one.

use prost::Message;
use tonic::Status;

use crate::v1;
use engine::{Reason, Refusal};

/// A reason's wire number.
pub fn reason_to_wire(r: Reason) -> v1::Reason {
    match r {
        Reason::InvalidRequest => v1::Reason::InvalidRequest,
        Reason::TooLarge => v1::Reason::TooLarge,
        Reason::Timeout => v1::Reason::Timeout,
        Reason::Unauthorized => v1::Reason::Unauthorized,
        Reason::NotFound => v1::Reason::NotFound,
        Reason::MethodNotAllowed => v1::Reason::MethodNotAllowed,
        Reason::ModelNotFound => v1::Reason::ModelNotFound,
        Reason::NotResident => v1::Reason::NotResident,
        Reason::NoRoute => v1::Reason::NoRoute,
        Reason::Draining => v1::Reason::Draining,
        Reason::Capacity => v1::Reason::Capacity,
        Reason::Budget => v1::Reason::Budget,
        Reason::Pinned => v1::Reason::Pinned,
        Reason::ShardFailed => v1::Reason::ShardFailed,
        Reason::RecipeMismatch => v1::Reason::RecipeMismatch,
        Reason::StaleEpoch => v1::Reason::StaleEpoch,
        Reason::CacheMiss => v1::Reason::CacheMiss,
        Reason::GrammarBudget => v1::Reason::GrammarBudget,
        Reason::ProtocolMismatch => v1::Reason::ProtocolMismatch,
    }
}

/// A wire number's reason; one this side does not know (a newer peer's) is an invalid request:
/// terminal, never retried or taken for a capacity limit.
pub fn reason_from_wire(n: i32) -> Reason {
    match v1::Reason::try_from(n).unwrap_or(v1::Reason::Unspecified) {
        v1::Reason::Unspecified | v1::Reason::InvalidRequest => Reason::InvalidRequest,
        v1::Reason::TooLarge => Reason::TooLarge,
        v1::Reason::Timeout => Reason::Timeout,
        v1::Reason::Unauthorized => Reason::Unauthorized,
        v1::Reason::NotFound => Reason::NotFound,
        v1::Reason::MethodNotAllowed => Reason::MethodNotAllowed,
        v1::Reason::ModelNotFound => Reason::ModelNotFound,
        v1::Reason::NotResident => Reason::NotResident,
        v1::Reason::NoRoute => Reason::NoRoute,
        v1::Reason::Draining => Reason::Draining,
        v1::Reason::Capacity => Reason::Capacity,
        v1::Reason::Budget => Reason::Budget,
        v1::Reason::Pinned => Reason::Pinned,
        v1::Reason::ShardFailed => Reason::ShardFailed,
        v1::Reason::RecipeMismatch => Reason::RecipeMismatch,
        v1::Reason::StaleEpoch => Reason::StaleEpoch,
        v1::Reason::CacheMiss => Reason::CacheMiss,
        v1::Reason::GrammarBudget => Reason::GrammarBudget,
        v1::Reason::ProtocolMismatch => Reason::ProtocolMismatch,
    }
}

/// A shard's refusal as the wire carries it: retryable as a shard's refusal of its reason is,
/// with its limit when it names one.
fn from_wire(reason: i32, message: String, limit: &str) -> Refusal {
    let mut r = Refusal::from_shard(reason_from_wire(reason), message);
    r.limit = (!limit.is_empty()).then(|| limit.to_string());
    r
}

impl v1::SessionError {
    /// A shard's refusal of one session's fragment.
    pub fn new(session_id: u64, r: &Refusal) -> Self {
        v1::SessionError {
            session_id,
            message: r.message.clone(),
            reason: reason_to_wire(r.reason) as i32,
            limit: r.limit.clone().unwrap_or_default(),
        }
    }

    /// The refusal it carries, retryable as a shard's refusal of its reason is.
    pub fn refusal(&self) -> Refusal {
        from_wire(self.reason, self.message.clone(), &self.limit)
    }

    /// Its reason, typed.
    pub fn kind(&self) -> Reason {
        reason_from_wire(self.reason)
    }
}

impl v1::StepError {
    /// A failure of a whole step on `shard`.
    pub fn new(shard: &str, r: &Refusal) -> Self {
        v1::StepError {
            shard: shard.to_string(),
            message: r.message.clone(),
            reason: reason_to_wire(r.reason) as i32,
            limit: r.limit.clone().unwrap_or_default(),
        }
    }

    /// Its reason, typed.
    pub fn kind(&self) -> Reason {
        reason_from_wire(self.reason)
    }

    /// The refusal it carries: a failed shard is named as the limit; any other reason is the
    /// shard's refusal as sent.
    pub fn refusal(&self) -> Refusal {
        match reason_from_wire(self.reason) {
            Reason::ShardFailed => Refusal::shard_failed(&self.shard, self.message.clone()),
            _ => from_wire(self.reason, self.message.clone(), &self.limit),
        }
    }
}

/// A gRPC status refusing a stream, with the refusal typed in its details (the status message
/// is the refusal's, for people and for older tools).
pub fn refusal_status(code: tonic::Code, r: &Refusal) -> Status {
    let details = v1::Refusal {
        reason: reason_to_wire(r.reason) as i32,
        message: r.message.clone(),
        limit: r.limit.clone().unwrap_or_default(),
    };
    Status::with_details(code, r.message.clone(), details.encode_to_vec().into())
}

/// The refusal a status carries in its details, if it carries one (a status without one is a
/// transport's or a peer's failure, not a refusal).
pub fn status_refusal(status: &Status) -> Option<Refusal> {
    let d = v1::Refusal::decode(status.details()).ok()?;
    if d.reason == v1::Reason::Unspecified as i32 {
        return None;
    }
    Some(from_wire(d.reason, d.message, &d.limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_crosses_the_wire_and_back() {
        for r in Reason::ALL {
            assert_eq!(reason_from_wire(reason_to_wire(r) as i32), r, "{r}");
        }
        assert_eq!(reason_from_wire(9999), Reason::InvalidRequest);
    }

    #[test]
    fn a_status_carries_its_refusal_typed() {
        let r = Refusal::recipe_mismatch("shard a has layer_end 3").with_limit("layer_end");
        let s = refusal_status(tonic::Code::FailedPrecondition, &r);
        let back = status_refusal(&s).unwrap();
        assert_eq!(
            (back.reason, back.limit.as_deref(), back.message.as_str()),
            (Reason::RecipeMismatch, Some("layer_end"), s.message())
        );
        assert!(status_refusal(&Status::unavailable("gone")).is_none());
    }

    #[test]
    fn a_session_error_keeps_its_limit() {
        let r = Refusal::capacity("kv_budget", "kv_budget on shard x: full");
        let e = v1::SessionError::new(7, &r);
        let back = e.refusal();
        assert_eq!(
            (back.reason, back.limit, back.retry_after),
            (Reason::Capacity, Some("kv_budget".to_string()), Some(1))
        );
    }
}
