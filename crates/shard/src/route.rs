//! One route stream on a shard: execute steps in order, forward the accepted work to the next
//! shard (or, on the last shard, answer the tracker), acknowledge each step to the shard before,
//! say while a step takes long that it is still being worked on, and turn a dead or silent
//! downstream (through [`crate::relay`]) or a stopped compute thread into typed failures.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Reason, Refusal};
use futures::{Stream, StreamExt};
use proto::v1::{
    route_msg, CacheRecipe, CachedPrefix, HopTiming, Progress, RouteMsg, RouteReply, RouteSetup,
    SeamDtype, SessionError, SessionOutput, Step,
};
use proto::{ReplyStream, ShardTransport};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::core::{ComputeStopped, ShardCore};
use crate::messages::{Early, EarlyJob, StepJob, StepOutcome};
use crate::mib;
use crate::relay::{shard_failed, Pending, Relay, SeamRtts};
use crate::replies::ReplyTx;

/// How often a shard holding a step says it is still working on it: a quarter of the step's
/// liveness, so that three progress messages may be lost or late before the hop looks silent.
fn progress_period(liveness: Duration) -> Duration {
    (liveness / 4).clamp(Duration::from_millis(10), Duration::from_millis(500))
}

/// Serves one route stream whose first message must be a `RouteSetup`.
pub async fn run_route<S>(core: Arc<ShardCore>, mut inbound: S) -> Result<ReplyStream, Status>
where
    S: Stream<Item = Result<RouteMsg, Status>> + Send + Unpin + 'static,
{
    let label = core.config.label.clone();
    core.check_alive()
        .map_err(|e| Status::unavailable(format!("{}: shard {label}: {e}", Reason::ShardFailed)))?;
    let setup = match inbound.next().await {
        Some(Ok(RouteMsg {
            msg: Some(route_msg::Msg::Setup(s)),
        })) => s,
        _ => {
            return Err(Status::invalid_argument(
                "a route stream must start with a RouteSetup",
            ))
        }
    };
    check_setup(&core, &setup)?;
    let seam = SeamDtype::try_from(setup.seam_dtype).map_err(|_| {
        Status::invalid_argument(format!(
            "seam encoding {} is not one shard {label} knows (f32, f16, q8_0)",
            setup.seam_dtype
        ))
    })?;
    // A q8_0 block never spans two rows, so each row's encoding is its own whatever the batch.
    if seam == SeamDtype::SeamQ80 && !(core.info.n_embd as usize).is_multiple_of(proto::Q8_0_BLOCK)
    {
        return Err(Status::invalid_argument(format!(
            "shard {label}: a q8_0 seam needs rows of a multiple of {} values; this model's are {}",
            proto::Q8_0_BLOCK,
            core.info.n_embd
        )));
    }
    // On a route of several shards the last answers the tracker directly, on the Replies
    // stream the tracker opened on it; its upstream stream carries acknowledgements.
    let several = !setup.downstream.is_empty() || !core.is_first();
    let sink = match (core.is_last() && several).then_some(setup.reply_key) {
        Some(key) => Some(core.reply_sinks.take(key).ok_or_else(|| {
            Status::failed_precondition(format!(
                "no replies stream with key {key} is open on shard {label}"
            ))
        })?),
        None => None,
    };
    let stream_id = core.new_stream_id();
    let (up_tx, up_rx) = mpsc::channel::<Result<RouteReply, Status>>(256);
    // Tells the step loop to stop when the downstream hop dies.
    let (stop_tx, stop_rx) = watch::channel(false);
    let rtts = Arc::new(SeamRtts::default());
    // Token hints reach the first shard through its relay; later shards pass them upstream.
    let (hint_tx, hint_rx) = mpsc::channel::<Vec<SessionOutput>>(4);
    let downstream = match setup.downstream.first() {
        Some(next_addr) => {
            let (dn_tx, replies) = open_downstream(&core, &setup, next_addr).await?;
            let (reg_tx, reg_rx) = mpsc::unbounded_channel();
            let relay = Relay {
                core: Arc::clone(&core),
                next_addr: next_addr.clone(),
                replies,
                registered: reg_rx,
                up_tx: up_tx.clone(),
                stop_tx,
                rtts: Arc::clone(&rtts),
                hints: core.is_first().then_some(hint_tx),
            };
            tokio::spawn(relay.run());
            Some(Downstream {
                tx: dn_tx,
                registered: reg_tx,
            })
        }
        None => None,
    };
    let task = RouteTask {
        prefix_scope: if seam != SeamDtype::SeamF32 {
            stream_id
        } else {
            0
        },
        core,
        stream_id,
        epoch: setup.epoch,
        seam,
        label,
        up_tx,
        sink,
        downstream,
        rtts,
    };
    tokio::spawn(task.run(inbound, hint_rx, stop_rx));
    Ok(Box::pin(ReceiverStream::new(up_rx)))
}

/// A route refused because a shard holds something other than what it expects, typed.
fn mismatch(message: String) -> Status {
    proto::refusal_status(
        tonic::Code::FailedPrecondition,
        &Refusal::recipe_mismatch(message),
    )
}

/// Refuses a setup this shard cannot serve: another model or recipe, a downstream list that
/// does not fit this shard's place in the model, a route without a way to answer, or one that
/// names a shard twice.
fn check_setup(core: &ShardCore, setup: &RouteSetup) -> Result<(), Status> {
    let label = &core.config.label;
    if setup.protocol_version != proto::PROTOCOL_VERSION {
        let r = Refusal::protocol_mismatch(
            "the route's sender",
            setup.protocol_version,
            proto::PROTOCOL_VERSION,
        );
        return Err(proto::refusal_status(tonic::Code::FailedPrecondition, &r));
    }
    if setup.model_digest != core.info.model_digest {
        return Err(mismatch(format!(
            "{}: shard {label} serves model {} but the route expects {}",
            Reason::RecipeMismatch,
            core.info.model_digest,
            setup.model_digest
        )));
    }
    if let Some(expected) = setup.recipes.first() {
        let own = core.info.recipe.clone().unwrap_or_default();
        if let Some(field) = recipe_difference(&own, expected) {
            return Err(mismatch(format!(
                "{}: shard {label} has {field} {} but the route expects {}",
                Reason::RecipeMismatch,
                field_value(&own, field),
                field_value(expected, field)
            )));
        }
    }
    let has_downstream = !setup.downstream.is_empty();
    if has_downstream == core.is_last() {
        return Err(mismatch(format!(
            "{}: shard {label} holds layers {}..{} of {} but the route gives it {} downstream shards",
            Reason::RecipeMismatch,
            core.info.layer_start,
            core.info.layer_end,
            core.info.n_layers,
            setup.downstream.len()
        )));
    }
    if let Some(twice) = setup
        .downstream
        .iter()
        .enumerate()
        .find_map(|(i, a)| setup.downstream[..i].contains(a).then_some(a))
    {
        return Err(Status::invalid_argument(format!(
            "the route names shard {twice} twice: a route passes each shard once"
        )));
    }
    let several = has_downstream || !core.is_first();
    if several && setup.reply_key == 0 {
        return Err(Status::invalid_argument(
            "a route of several shards needs a reply_key: its last shard answers the tracker on a replies stream",
        ));
    }
    Ok(())
}

/// Connects to the next shard, checks that it holds the layers right after this shard's of
/// the same model (so a route can neither skip layers nor loop back: each hop's first layer is
/// larger than the last), and opens its route stream with the rest of the route.
async fn open_downstream(
    core: &ShardCore,
    setup: &RouteSetup,
    next_addr: &str,
) -> Result<(mpsc::Sender<RouteMsg>, ReplyStream), Status> {
    let label = &core.config.label;
    let unreachable = |e: Status| {
        Status::unavailable(format!(
            "{}: {next_addr}: {}",
            Reason::ShardFailed,
            e.message()
        ))
    };
    let next = proto::connect(next_addr, &core.config.link)?;
    let info = next
        .describe(Duration::from_secs(2))
        .await
        .map_err(unreachable)?;
    if info.protocol_version != proto::PROTOCOL_VERSION {
        let r = Refusal::protocol_mismatch(
            &format!("shard {next_addr}"),
            info.protocol_version,
            proto::PROTOCOL_VERSION,
        );
        return Err(proto::refusal_status(tonic::Code::FailedPrecondition, &r));
    }
    if info.model_digest != core.info.model_digest || info.layer_start != core.info.layer_end {
        return Err(mismatch(format!(
            "{}: the route sends shard {label} (layers {}..{}) on to {next_addr}, which holds layers {}..{} of model {}; the next shard must hold layers from {} of model {}",
            Reason::RecipeMismatch,
            core.info.layer_start,
            core.info.layer_end,
            info.layer_start,
            info.layer_end,
            info.model_digest,
            core.info.layer_end,
            core.info.model_digest
        )));
    }
    let (dn_tx, dn_rx) = mpsc::channel::<RouteMsg>(256);
    let next_setup = RouteSetup {
        protocol_version: proto::PROTOCOL_VERSION,
        epoch: setup.epoch,
        downstream: setup.downstream[1..].to_vec(),
        seam_dtype: setup.seam_dtype,
        model_digest: setup.model_digest.clone(),
        recipes: setup.recipes.get(1..).unwrap_or_default().to_vec(),
        reply_key: setup.reply_key,
    };
    let _ = dn_tx
        .send(RouteMsg {
            msg: Some(route_msg::Msg::Setup(next_setup)),
        })
        .await;
    let replies = next.route(dn_rx).await.map_err(unreachable)?;
    Ok((dn_tx, replies))
}

/// The way to the next shard: its route stream, and the relay's register of steps sent.
struct Downstream {
    tx: mpsc::Sender<RouteMsg>,
    registered: mpsc::UnboundedSender<(u64, Pending)>,
}

/// The step loop of one route stream.
struct RouteTask {
    core: Arc<ShardCore>,
    stream_id: u64,
    epoch: u64,
    seam: SeamDtype,
    /// See [`StepJob::prefix_scope`].
    prefix_scope: u64,
    label: String,
    /// Upstream: the tracker on the first shard, else the shard before.
    up_tx: ReplyTx,
    /// The tracker's Replies stream, on the last shard of a route of several.
    sink: Option<ReplyTx>,
    downstream: Option<Downstream>,
    rtts: Arc<SeamRtts>,
}

type Started = oneshot::Receiver<Option<Early>>;

impl RouteTask {
    async fn run<S>(
        self,
        mut inbound: S,
        mut hints: mpsc::Receiver<Vec<SessionOutput>>,
        mut stop_rx: watch::Receiver<bool>,
    ) where
        S: Stream<Item = Result<RouteMsg, Status>> + Send + Unpin + 'static,
    {
        // The early step started on the last token hint, if any (first shard only).
        let mut early: Option<Started> = None;
        loop {
            let stopped = async {
                // A dropped sender (no downstream hop) never signals a stop.
                if stop_rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            let msg = tokio::select! {
                biased;
                _ = self.core.shutting_down() => {
                    self.fail(0, format!("shard {} is shutting down", self.label)).await;
                    break;
                }
                m = inbound.next() => m,
                Some(hint) = hints.recv() => {
                    // One early step at a time, started only while no step of the tracker's is
                    // being run (this loop is between steps).
                    if early.is_none() {
                        early = Some(self.core.early(EarlyJob {
                            stream_id: self.stream_id,
                            epoch: self.epoch,
                            tokens: hint.iter().map(|o| (o.session_id, o.token, o.next_pos)).collect(),
                            now: Instant::now(),
                            prefix_scope: self.prefix_scope,
                        }));
                    }
                    continue;
                }
                _ = stopped => None,
            };
            let step = match msg {
                Some(Ok(RouteMsg {
                    msg: Some(route_msg::Msg::Step(s)),
                })) => s,
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => break,
            };
            if self.handle(step, &mut early).await.is_break() {
                break;
            }
        }
        // The upstream end went away (or downstream died): forget this stream's sessions.
        self.core.release_stream(self.stream_id);
    }

    /// Tells the tracker (on every way it listens) that this shard failed the route.
    async fn fail(&self, step_id: u64, message: String) {
        let failure = shard_failed(step_id, &self.label, message);
        if let Some(sink) = &self.sink {
            let _ = sink.send(Ok(failure.clone())).await;
        }
        let _ = self.up_tx.send(Ok(failure)).await;
    }

    /// The step's incoming hidden states (past layer 0), checked against its rows; `Err` is
    /// the refusal of the whole stream (a malformed step ends it).
    fn hidden_of(&self, step: &Step) -> Result<Option<Vec<f32>>, Status> {
        if self.core.is_first() {
            return Ok(None);
        }
        let h = proto::decode_activations(&step.activations, self.seam).ok_or_else(|| {
            Status::invalid_argument(format!(
                "step {}: {} activation bytes do not decode as {:?}",
                step.step_id,
                step.activations.len(),
                self.seam
            ))
        })?;
        let n_rows: usize = step.fragments.iter().map(|f| f.tokens.len()).sum();
        let n_embd = self.core.info.n_embd as usize;
        if h.len() != n_rows * n_embd {
            return Err(Status::invalid_argument(format!(
                "step {}: {} activations for {n_rows} rows of width {n_embd}",
                step.step_id,
                h.len()
            )));
        }
        Ok(Some(h))
    }

    /// Activations this step would add to what is in flight downstream: over the budget, its
    /// fragments are refused (typed) before anything is computed.
    fn inflight_refusals(&self, step: &Step) -> Vec<SessionError> {
        if self.downstream.is_none() {
            return Vec::new();
        }
        let n_rows: usize = step.fragments.iter().map(|f| f.tokens.len()).sum();
        let out_bytes =
            (n_rows * proto::seam_bytes(self.seam, self.core.info.n_embd as usize)) as u64;
        let in_flight = self.core.counters.inflight_bytes.load(Ordering::Relaxed);
        let budget = self.core.config.inflight_budget_bytes as u64;
        if in_flight + out_bytes <= budget {
            return Vec::new();
        }
        step.fragments
            .iter()
            .map(|f| {
                SessionError::new(
                    f.session_id,
                    &Refusal::capacity(
                        "inflight_budget",
                        format!(
                    "inflight_budget on shard {}: {:.1} MiB of activations are in flight downstream, this step adds {:.1} MiB, the budget is {:.1} MiB",
                    self.label,
                    mib(in_flight),
                    mib(out_bytes),
                    mib(budget)
                ),
                    ),
                )
            })
            .collect()
    }

    /// The early step, if one was started: its outcome when it is exactly this step (it was
    /// run under the route's epoch), else the rollback that undoes it.
    async fn take_early(
        &self,
        early: &mut Option<Started>,
        step: &Step,
        over: bool,
    ) -> (Option<StepOutcome>, Vec<(u64, usize)>) {
        let Some(started) = early.take() else {
            return (None, Vec::new());
        };
        let Ok(Some(e)) = started.await else {
            return (None, Vec::new());
        };
        let counters = &self.core.counters;
        if !over && step.epoch == self.epoch && e.matches(&step.fragments, &step.release) {
            counters.early_steps_used.fetch_add(1, Ordering::Relaxed);
            counters.count_step(&step.fragments);
            let out = StepOutcome {
                accepted: step.fragments.clone(),
                ..e.outcome
            };
            return (Some(out), Vec::new());
        }
        counters
            .early_steps_discarded
            .fetch_add(1, Ordering::Relaxed);
        (None, e.rollback())
    }

    /// Runs a step on the compute thread, telling upstream every so often that the step is
    /// still being worked on (queued or computing) so that a slow step is never taken for a
    /// lost shard.
    async fn compute(
        &self,
        job: StepJob,
        step_id: u64,
        liveness: Duration,
    ) -> Result<StepOutcome, ComputeStopped> {
        let done = self.core.step(job);
        tokio::pin!(done);
        let period = progress_period(liveness);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tokio::select! {
                biased;
                out = &mut done => return out,
                _ = tick.tick() => {
                    let progress = RouteReply {
                        step_id,
                        progress: Some(Progress { shard: self.label.clone() }),
                        ..Default::default()
                    };
                    // Only news that the route is alive: dropped if upstream has no room.
                    let _ = self.up_tx.try_send(Ok(progress));
                }
            }
        }
    }

    /// One step: compute it (or use the early step that is it), then answer the tracker or
    /// forward the accepted rows, then acknowledge upstream. `Break` ends the stream.
    async fn handle(&self, mut step: Step, early: &mut Option<Started>) -> ControlFlow<()> {
        let received = Instant::now();
        let hidden = match self.hidden_of(&step) {
            Ok(h) => h,
            Err(status) => {
                let _ = self.up_tx.send(Err(status)).await;
                return ControlFlow::Break(());
            }
        };
        let refused = self.inflight_refusals(&step);
        let over = !refused.is_empty();
        let (used, rollback) = self.take_early(early, &step, over).await;
        let liveness = Duration::from_millis(u64::from(step.liveness_ms.max(1)));
        let mut out = match used {
            Some(out) => out,
            None => {
                let job = StepJob {
                    stream_id: self.stream_id,
                    epoch: step.epoch,
                    fragments: if over {
                        Vec::new()
                    } else {
                        std::mem::take(&mut step.fragments)
                    },
                    release: step.release.clone(),
                    hidden: if over { None } else { hidden },
                    now: received,
                    prefix_scope: self.prefix_scope,
                    rollback,
                };
                match self.compute(job, step.step_id, liveness).await {
                    Ok(out) => out,
                    Err(stopped) => {
                        self.fail(step.step_id, format!("shard {}: {stopped}", self.label))
                            .await;
                        return ControlFlow::Break(());
                    }
                }
            }
        };
        // Refusals travel with the step to the last shard, which answers with all of them.
        step.errors.extend(std::mem::take(&mut out.errors));
        step.errors.extend(refused);
        let hop = HopTiming {
            shard: self.label.clone(),
            compute_micros: out.compute_micros,
            ..Default::default()
        };
        match &self.downstream {
            None => {
                let cached = out
                    .accepted
                    .iter()
                    .filter(|f| !f.prefix.is_empty())
                    .map(|f| CachedPrefix {
                        session_id: f.session_id,
                        positions: f.prefix.len() as u32,
                    })
                    .collect();
                // After a verification step the tracker's next step for its session carries
                // new drafts, which the first shard cannot guess: no hint for it.
                let verified: Vec<u64> = out
                    .accepted
                    .iter()
                    .filter(|f| f.n_draft > 0)
                    .map(|f| f.session_id)
                    .collect();
                self.answer(step, out.outputs, &verified, cached, hop, received)
                    .await
            }
            Some(down) => self.forward(down, step, out, hop, received, liveness).await,
        }
    }

    /// The last shard's answer to a step: on a route of several the acknowledgement goes
    /// first, naming the tokens this shard sampled (a token hint): the first shard starts the
    /// next decode step on it at once, while the reply still has the tracker to pass through
    /// before that step is confirmed.
    async fn answer(
        &self,
        mut step: Step,
        outputs: Vec<SessionOutput>,
        verified: &[u64],
        cached: Vec<CachedPrefix>,
        mut hop: HopTiming,
        received: Instant,
    ) -> ControlFlow<()> {
        hop.held_micros = received.elapsed().as_micros() as u64;
        step.hops.push(hop);
        if !self.core.is_first() {
            let hint = outputs
                .iter()
                .filter(|o| !verified.contains(&o.session_id))
                .map(|o| SessionOutput {
                    session_id: o.session_id,
                    token: o.token,
                    next_pos: o.next_pos,
                    ..Default::default()
                })
                .collect();
            let ack = acknowledgement(step.step_id, &self.label, received, hint);
            if self.up_tx.send(Ok(ack)).await.is_err() {
                return ControlFlow::Break(());
            }
            tokio::task::yield_now().await;
        }
        let reply = RouteReply {
            step_id: step.step_id,
            outputs,
            errors: step.errors,
            hops: step.hops,
            cached,
            ..Default::default()
        };
        let answered = match &self.sink {
            Some(sink) => sink.send(Ok(reply)).await.is_ok(),
            None => self.up_tx.send(Ok(reply)).await.is_ok(),
        };
        if answered {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    }

    /// Sends a step's accepted rows and their hidden states to the next shard (counted in
    /// flight until it acknowledges), then acknowledges the step to the shard before.
    async fn forward(
        &self,
        down: &Downstream,
        mut step: Step,
        out: StepOutcome,
        mut hop: HopTiming,
        received: Instant,
        liveness: Duration,
    ) -> ControlFlow<()> {
        let activations = proto::encode_activations(&out.hidden, self.seam);
        hop.seam_bytes = activations.len() as u64;
        hop.seam_rtt_micros = self.rtts.take();
        let counters = &self.core.counters;
        counters
            .seam_bytes_out
            .fetch_add(hop.seam_bytes, Ordering::Relaxed);
        let pending = Pending {
            sent: Instant::now(),
            liveness,
            bytes: activations.len() as u64,
        };
        // Counted before the relay can see (and subtract) it.
        counters
            .inflight_bytes
            .fetch_add(pending.bytes, Ordering::Relaxed);
        if let Err(unsent) = down.registered.send((step.step_id, pending)) {
            counters
                .inflight_bytes
                .fetch_sub(unsent.0 .1.bytes, Ordering::Relaxed);
            return ControlFlow::Break(());
        }
        hop.held_micros = received.elapsed().as_micros() as u64;
        step.hops.push(hop);
        let step_id = step.step_id;
        let next = Step {
            fragments: out.accepted,
            activations,
            ..step
        };
        let sent = down.tx.send(RouteMsg {
            msg: Some(route_msg::Msg::Step(next)),
        });
        if sent.await.is_err() {
            return ControlFlow::Break(());
        }
        // The shard before this one learns that the step has passed: its activation bytes are
        // no longer in flight, and how long this shard held the step (for its seam round
        // trip). The tracker, upstream of the first shard, waits for replies instead.
        if !self.core.is_first() {
            // The step just sent is what the route waits for: let it reach its socket before
            // the acknowledgement takes this thread.
            tokio::task::yield_now().await;
            let ack = acknowledgement(step_id, &self.label, received, Vec::new());
            if self.up_tx.send(Ok(ack)).await.is_err() {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }
}

/// The acknowledgement of a step to the shard before: its id, how long this shard held it,
/// and on the last shard the tokens it sampled.
fn acknowledgement(
    step_id: u64,
    label: &str,
    received: Instant,
    hint: Vec<SessionOutput>,
) -> RouteReply {
    RouteReply {
        step_id,
        hops: vec![HopTiming {
            shard: label.to_string(),
            held_micros: received.elapsed().as_micros() as u64,
            ..Default::default()
        }],
        outputs: hint,
        ..Default::default()
    }
}

/// The first field in which two cache recipes differ, if any.
fn recipe_difference(a: &CacheRecipe, b: &CacheRecipe) -> Option<&'static str> {
    [
        "model_digest",
        "layer_start",
        "layer_end",
        "kv_dtype",
        "rope_base",
        "rope_dim",
        "rope_freq_scale",
        "block_size",
        "n_ctx",
    ]
    .into_iter()
    .find(|f| field_value(a, f) != field_value(b, f))
}

fn field_value(r: &CacheRecipe, field: &str) -> String {
    match field {
        "model_digest" => r.model_digest.clone(),
        "layer_start" => r.layer_start.to_string(),
        "layer_end" => r.layer_end.to_string(),
        "kv_dtype" => r.kv_dtype.clone(),
        "rope_base" => r.rope_base.to_string(),
        "rope_dim" => r.rope_dim.to_string(),
        "rope_freq_scale" => r.rope_freq_scale.to_string(),
        "block_size" => r.block_size.to_string(),
        "n_ctx" => r.n_ctx.to_string(),
        _ => String::new(),
    }
}
