//! The downstream half of a route stream on a shard that has a next shard: reads that shard's
//! acknowledgements, token hints, progress and failures, and turns a dead or silent next shard
//! into `shard_failed` for every step still waiting on it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Reason, Refusal};
use futures::StreamExt;
use proto::v1::{RouteReply, SessionOutput, StepError};
use proto::ReplyStream;
use tokio::sync::{mpsc, watch};

use crate::core::ShardCore;
use crate::replies::ReplyTx;

/// Seam round trips the relay measured and the next forwarded step reports (bounded: with no
/// step to carry them, the oldest are kept and the rest dropped).
#[derive(Default)]
pub(crate) struct SeamRtts(Mutex<Vec<u64>>);

impl SeamRtts {
    const MAX: usize = 256;

    fn push(&self, micros: u64) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < Self::MAX {
            v.push(micros);
        }
    }

    pub(crate) fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A step sent downstream and not yet acknowledged.
pub(crate) struct Pending {
    pub sent: Instant,
    /// How long the next shard may stay silent while it holds the step.
    pub liveness: Duration,
    /// Activation bytes sent with the step (in flight until the acknowledgement comes back).
    pub bytes: u64,
}

/// Steps waiting for their downstream acknowledgement. Their activation bytes count as in
/// flight on the shard until it arrives or the relay ends (whichever way it ends).
struct PendingSteps {
    core: Arc<ShardCore>,
    steps: HashMap<u64, Pending>,
}

impl PendingSteps {
    fn remove(&mut self, step_id: u64) -> Option<Pending> {
        let p = self.steps.remove(&step_id)?;
        self.core
            .counters
            .inflight_bytes
            .fetch_sub(p.bytes, Ordering::Relaxed);
        Some(p)
    }

    /// The silence a pending step allows ran out: no word from downstream since it was sent
    /// (or since `heard`, if later) for longer than its liveness.
    fn overdue(&self, heard: Instant) -> Option<Duration> {
        self.steps
            .values()
            .find(|p| p.sent.max(heard).elapsed() > p.liveness)
            .map(|p| p.liveness)
    }
}

impl Drop for PendingSteps {
    fn drop(&mut self) {
        let stranded: u64 = self.steps.values().map(|p| p.bytes).sum();
        self.core
            .counters
            .inflight_bytes
            .fetch_sub(stranded, Ordering::Relaxed);
    }
}

pub(crate) fn shard_failed(step_id: u64, shard: &str, message: String) -> RouteReply {
    RouteReply {
        step_id,
        step_error: Some(StepError::new(
            shard,
            &Refusal::new(Reason::ShardFailed, message),
        )),
        ..Default::default()
    }
}

/// What a relay needs: the next shard's replies, the steps registered as sent to it, and the
/// ways back.
pub(crate) struct Relay {
    pub core: Arc<ShardCore>,
    pub next_addr: String,
    pub replies: ReplyStream,
    pub registered: mpsc::UnboundedReceiver<(u64, Pending)>,
    pub up_tx: ReplyTx,
    /// Told when the next shard is lost, so the step loop stops taking steps.
    pub stop_tx: watch::Sender<bool>,
    pub rtts: Arc<SeamRtts>,
    /// On the first shard, token hints go to its step loop; elsewhere they go upstream.
    pub hints: Option<mpsc::Sender<Vec<SessionOutput>>>,
}

impl Relay {
    /// Runs until the route ends: releases in-flight bytes and measures the seam's round trip
    /// on each acknowledgement, hands token hints on, passes progress and failures from further
    /// down upstream, and on a broken or silent next shard answers every waiting step with
    /// `shard_failed`.
    pub(crate) async fn run(mut self) {
        let mut pending = PendingSteps {
            core: Arc::clone(&self.core),
            steps: HashMap::new(),
        };
        // The last time anything came from downstream: liveness is silence, not slowness.
        let mut heard = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let failure: String = loop {
            tokio::select! {
                reg = self.registered.recv() => match reg {
                    Some((id, p)) => { pending.steps.insert(id, p); }
                    None => return,
                },
                reply = self.replies.next() => match reply {
                    Some(Ok(r)) => {
                        heard = Instant::now();
                        // Registration always precedes the send downstream, but may not have
                        // been read yet: drain it first.
                        while let Ok((id, p)) = self.registered.try_recv() {
                            pending.steps.insert(id, p);
                        }
                        if r.step_error.is_none() {
                            if !self.passed_on(r, &mut pending).await {
                                return;
                            }
                            continue;
                        }
                        pending.remove(r.step_id);
                        if self.up_tx.send(Ok(r)).await.is_err() {
                            // Steps still registered are dropped with `pending` (their bytes too).
                            while let Ok((id, p)) = self.registered.try_recv() {
                                pending.steps.insert(id, p);
                            }
                            return;
                        }
                        break "a shard further down the route failed".to_string();
                    }
                    Some(Err(status)) => break format!("the stream to {} failed: {}", self.next_addr, status.message()),
                    None => break format!("{} closed the route stream", self.next_addr),
                },
                _ = tick.tick() => {
                    if let Some(liveness) = pending.overdue(heard) {
                        break format!("{} was silent for {} ms while holding a step", self.next_addr, liveness.as_millis());
                    }
                }
            }
        };
        self.fail_pending(pending, failure).await;
    }

    /// Handles a message that is not a failure: an acknowledgement (with a hop), a token hint
    /// (with outputs), progress, or a combination. `false` when upstream is gone.
    async fn passed_on(&mut self, r: RouteReply, pending: &mut PendingSteps) -> bool {
        if let Some(held) = r.hops.first().map(|h| h.held_micros) {
            if let Some(p) = pending.remove(r.step_id) {
                self.rtts
                    .push((p.sent.elapsed().as_micros() as u64).saturating_sub(held));
            }
        }
        if r.progress.is_some() {
            // Only news that the route is alive: dropped if upstream has no room for it.
            let progress = RouteReply {
                step_id: r.step_id,
                progress: r.progress.clone(),
                ..Default::default()
            };
            let _ = self.up_tx.try_send(Ok(progress));
        }
        if r.outputs.is_empty() {
            return true;
        }
        match &self.hints {
            // A hint the step loop has no room for is dropped: it only saves time.
            Some(h) => {
                let _ = h.try_send(r.outputs);
                true
            }
            None => {
                let hint = RouteReply {
                    step_id: r.step_id,
                    outputs: r.outputs,
                    ..Default::default()
                };
                self.up_tx.send(Ok(hint)).await.is_ok()
            }
        }
    }

    /// Answers every step still waiting downstream with `shard_failed` naming the next shard
    /// (or, with none waiting, says the route is broken), and stops the step loop.
    async fn fail_pending(mut self, mut pending: PendingSteps, failure: String) {
        while let Ok((id, p)) = self.registered.try_recv() {
            pending.steps.insert(id, p);
        }
        let mut ids: Vec<u64> = pending.steps.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let _ = self
                .up_tx
                .send(Ok(shard_failed(id, &self.next_addr, failure.clone())))
                .await;
        }
        if pending.steps.is_empty() {
            // Nothing was waiting, but the route is broken: say so on the next read.
            let _ = self
                .up_tx
                .send(Ok(shard_failed(0, &self.next_addr, failure)))
                .await;
        }
        let _ = self.stop_tx.send(true);
    }
}
