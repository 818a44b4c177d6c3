//! Pure scheduling policy for strata: which sessions run in the next step and with how many
//! tokens.
//!
//! The key design decision (after vLLM's scheduler): one accounting variable per session,
//! tokens computed versus tokens known. A prompt is just known tokens not yet computed, so
//! chunked prefill, decode and a replay after a failover are the same code. The scheduler is a
//! synchronous state machine with no I/O and no clock: the tracker's async loop asks it for a
//! plan, sends the plan down the route, and feeds the result back.

mod admission;
mod draft;
mod kv;
mod refusal;
mod scheduler;

pub use admission::{Admission, AdmissionConfig, Demand, ShardBudget};
pub use draft::{DraftConfig, DraftKind, DraftLength, DraftPoll, DraftSource, NgramIndex, Wake};
pub use kv::{EvictionPolicy, Resident};
pub use refusal::{Class, Reason, Refusal};

pub use scheduler::{
    Event, FinishReason, PlanItem, Priority, Scheduler, SchedulerConfig, SessionId, StepPlan,
    KV_BLOCK_POSITIONS,
};
