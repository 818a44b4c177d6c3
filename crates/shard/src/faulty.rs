//! A shard in this process whose answers a test rewrites (fault injection): every session
//! refused for a reason, a whole step failed, another identity described, a route refused.
//! Tests of the tracker use it to reach each refusal and failure path exactly as a real
//! shard's would reach it, without starting a process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use proto::v1::{RouteMsg, RouteReply, SessionError, ShardInfo, ShardStats, StepError, VocabReply};
use proto::{ReplyStream, ShardTransport};
use tokio::sync::mpsc;
use tonic::Status;

use crate::LocalShard;

/// What the shard's answers become.
#[derive(Debug, Clone, Default)]
pub enum Fault {
    #[default]
    None,
    /// Every sampled token becomes this refusal of its session.
    Refuse(SessionError),
    /// Every reply becomes this failure of the whole step.
    FailStep(StepError),
    /// `describe` says the shard holds one layer less than it does.
    OtherLayers,
    /// Opening a route stream is refused with this status.
    RefuseRoute(Status),
}

#[derive(Debug, Default)]
struct State {
    fault: Fault,
    /// Replies the fault still rewrites (`None`: all of them).
    left: Option<usize>,
}

/// A [`LocalShard`] whose answers follow the [`Fault`] set on it.
#[derive(Clone)]
pub struct FaultyShard {
    inner: LocalShard,
    state: Arc<Mutex<State>>,
}

impl FaultyShard {
    pub fn new(core: Arc<crate::ShardCore>) -> Self {
        FaultyShard {
            inner: LocalShard::new(core),
            state: Arc::default(),
        }
    }

    /// Rewrites every answer from now on.
    pub fn set(&self, fault: Fault) {
        *self.lock() = State { fault, left: None };
    }

    /// Rewrites the next `replies` replies, then answers as the shard does.
    pub fn set_for(&self, fault: Fault, replies: usize) {
        *self.lock() = State {
            fault,
            left: Some(replies),
        };
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One reply as the fault makes it (counting it against the fault's replies left).
fn rewrite(state: &Mutex<State>, mut reply: RouteReply) -> RouteReply {
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let hit = match &s.fault {
        Fault::Refuse(e) if !reply.outputs.is_empty() => {
            for o in std::mem::take(&mut reply.outputs) {
                reply.errors.push(SessionError {
                    session_id: o.session_id,
                    ..e.clone()
                });
            }
            true
        }
        Fault::FailStep(e) if reply.progress.is_none() => {
            reply.step_error = Some(e.clone());
            reply.outputs.clear();
            true
        }
        _ => false,
    };
    if hit {
        if let Some(n) = s.left.as_mut() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                *s = State::default();
            }
        }
    }
    reply
}

#[tonic::async_trait]
impl ShardTransport for FaultyShard {
    fn address(&self) -> &str {
        self.inner.address()
    }

    async fn describe(&self, t: Duration) -> Result<ShardInfo, Status> {
        let mut info = self.inner.describe(t).await?;
        if matches!(self.lock().fault, Fault::OtherLayers) {
            info.layer_end -= 1;
            if let Some(r) = info.recipe.as_mut() {
                r.layer_end -= 1;
            }
        }
        Ok(info)
    }

    async fn vocab(&self) -> Result<VocabReply, Status> {
        self.inner.vocab().await
    }

    async fn stats(&self, t: Duration) -> Result<ShardStats, Status> {
        self.inner.stats(t).await
    }

    async fn route(&self, outbound: mpsc::Receiver<RouteMsg>) -> Result<ReplyStream, Status> {
        if let Fault::RefuseRoute(s) = &self.lock().fault {
            return Err(s.clone());
        }
        let state = Arc::clone(&self.state);
        let replies = self.inner.route(outbound).await?;
        Ok(Box::pin(
            replies.map(move |r| r.map(|reply| rewrite(&state, reply))),
        ))
    }

    async fn replies(&self, key: u64) -> Result<ReplyStream, Status> {
        self.inner.replies(key).await
    }
}

impl crate::ShardConfig {
    /// A whole-model shard in the test's own process (labelled `embedded`): one thread, a
    /// context of 256, 16 MiB of KV, 16 sessions.
    pub fn in_process(model_path: std::path::PathBuf) -> Self {
        crate::ShardConfig {
            model_path,
            layers: None,
            n_threads: 1,
            isa: None,
            kv_type: model::KvType::F16,
            n_ctx: 256,
            kv_budget_bytes: 16 << 20,
            kv_ttl: Duration::from_secs(600),
            max_sessions: 16,
            weights_budget_bytes: 1 << 30,
            scratch_budget_bytes: 64 << 20,
            inflight_budget_bytes: 64 << 20,
            pinned: false,
            prefix_cache: true,
            label: "embedded".into(),
            link: proto::Link::plain("unused-in-process-token"),
            tls_identity: None,
            grammar_budget: Duration::from_millis(200),
        }
    }
}
