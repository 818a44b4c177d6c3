//! What the shard's async side and its compute thread say to each other: the jobs it runs
//! (a step, an early step), what they produce, and the counters it keeps for the stats RPC.
//! `core` sends these and `worker` answers them; neither imports the other's types.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use proto::v1::{Fragment, SessionError, SessionOutput};

/// Counters shared with the stats RPC (written by the compute thread only).
#[derive(Debug, Default)]
pub struct Counters {
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub sessions: AtomicU64,
    pub kv_bytes_in_use: AtomicU64,
    pub seam_bytes_out: AtomicU64,
    pub compute_micros: AtomicU64,
    pub rejected_fragments: AtomicU64,
    pub evictions: AtomicU64,
    pub kv_blocks_in_use: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub kv_block_bytes: AtomicU64,
    pub scratch_bytes_last_step: AtomicU64,
    /// Activation bytes sent downstream and not yet answered (route streams add and subtract).
    pub inflight_bytes: AtomicU64,
    /// Positions sessions started on from the prefix cache instead of computing them.
    pub prefix_reused_tokens: AtomicU64,
    pub kv_blocks_idle: AtomicU64,
    /// Early decode steps (see [`EarlyJob`]): started, used as the tracker's step, discarded.
    pub early_steps_started: AtomicU64,
    pub early_steps_used: AtomicU64,
    pub early_steps_discarded: AtomicU64,
    pub kernel_thread_moves: AtomicU64,
    /// The least compute time of the recent steps that computed one position of one session
    /// ([`TokenSteps`]); 0 before the first.
    pub token_step_micros: AtomicU64,
}

/// A shard's time per token on a single stream: the compute time of its last
/// [`TokenSteps::WINDOW`] steps that computed one position of one session, of which the least
/// is the shard's own speed (a longer context's attention, or a busy host, only add to it).
/// What `strata plan` predicts a route's time per token from, and trackers show beside the
/// time they measure.
#[derive(Debug, Default)]
pub struct TokenSteps {
    micros: std::collections::VecDeque<u64>,
}

impl TokenSteps {
    pub const WINDOW: usize = 16;

    /// A one-position step took `micros`; returns the least of the window now.
    pub fn observe(&mut self, micros: u64) -> u64 {
        if self.micros.len() == Self::WINDOW {
            self.micros.pop_front();
        }
        self.micros.push_back(micros.max(1));
        self.micros.iter().copied().min().unwrap_or(0)
    }
}

impl Counters {
    /// Counts a step that ran these fragments.
    pub fn count_step(&self, fragments: &[Fragment]) {
        for f in fragments {
            let counter = if f.start_pos > 0 && f.tokens.len() == 1 && f.prefix.is_empty() {
                &self.decode_tokens
            } else {
                &self.prefill_tokens
            };
            counter.fetch_add(f.tokens.len() as u64, Ordering::Relaxed);
            self.prefix_reused_tokens
                .fetch_add(f.prefix.len() as u64, Ordering::Relaxed);
        }
        self.steps.fetch_add(1, Ordering::Relaxed);
    }
}

/// One step as the compute thread sees it.
pub struct StepJob {
    pub stream_id: u64,
    pub epoch: u64,
    pub fragments: Vec<Fragment>,
    pub release: Vec<u64>,
    /// Incoming hidden states (rows of every fragment, in order) for a shard past layer 0.
    pub hidden: Option<Vec<f32>>,
    /// When the step arrived (the policy's clock; the compute thread never reads one).
    pub now: Instant,
    /// Sessions whose K and V are the same function of their tokens share cached prefix
    /// blocks: 0 where the incoming hidden states are exact (f32 seams), the route stream
    /// where a lossy seam encoding makes them depend on the route's cut points.
    pub prefix_scope: u64,
    /// Sessions to cut back to a length before anything else (an early step the tracker's
    /// step did not confirm).
    pub rollback: Vec<(u64, usize)>,
}

/// A decode step the first shard starts before the tracker's step arrives: the last shard
/// named the tokens it sampled (a token hint), and the tracker's next step for those sessions
/// is usually exactly them, one position further each. Run like a step, but all or nothing,
/// evicting no one and counted only once used.
pub struct EarlyJob {
    pub stream_id: u64,
    pub epoch: u64,
    /// `(session, token, position)` in the order the step would name them.
    pub tokens: Vec<(u64, u32, u32)>,
    pub now: Instant,
    pub prefix_scope: u64,
}

/// An early step that ran: its fragments and what it produced.
#[derive(Debug)]
pub struct Early {
    pub fragments: Vec<Fragment>,
    pub outcome: StepOutcome,
}

impl Early {
    /// Whether a step of the tracker's (of the epoch the early step ran under) is exactly this
    /// early step: the same sessions at the same positions with the same tokens, in order,
    /// releasing no one and naming no cached prefix.
    pub fn matches(&self, fragments: &[Fragment], release: &[u64]) -> bool {
        release.is_empty()
            && self.fragments.len() == fragments.len()
            && self.fragments.iter().zip(fragments).all(|(e, f)| {
                e.session_id == f.session_id
                    && e.start_pos == f.start_pos
                    && e.tokens == f.tokens
                    && f.prefix.is_empty()
            })
    }

    /// Where each of its sessions stood before it: the rollback that undoes it.
    pub fn rollback(&self) -> Vec<(u64, usize)> {
        self.fragments
            .iter()
            .map(|f| (f.session_id, f.start_pos as usize))
            .collect()
    }
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// The fragments that were executed (forwarded downstream), in order.
    pub accepted: Vec<Fragment>,
    /// Hidden states of the accepted rows (when this is not the last shard).
    pub hidden: Vec<f32>,
    /// Sampled tokens (when this is the last shard).
    pub outputs: Vec<SessionOutput>,
    /// Typed refusals of single fragments.
    pub errors: Vec<SessionError>,
    pub compute_micros: u64,
}
