//! One route stream on a shard: execute steps in order, forward the accepted work to the next
//! shard (or, on the last shard, answer the tracker), acknowledge each step to the shard before,
//! and turn a dead or silent downstream into typed failures.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use proto::v1::{
    route_msg, CacheRecipe, HopTiming, RouteMsg, RouteReply, RouteSetup, SeamDtype, SessionOutput,
    Step, StepError,
};
use proto::{ReplyStream, ShardTransport};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::core::{EarlyJob, ShardCore, StepJob};
use crate::mib;

type ReplyTx = mpsc::Sender<Result<RouteReply, Status>>;

/// Replies streams the tracker opened on this shard, by key, each waiting for the route whose
/// setup names it (this shard being that route's last).
#[derive(Default)]
pub(crate) struct ReplySinks(Mutex<HashMap<u64, ReplyTx>>);

impl ReplySinks {
    /// Registers a Replies stream under `key`; streams whose reader went away are forgotten.
    pub(crate) fn open(&self, key: u64) -> Result<ReplyStream, Status> {
        if key == 0 {
            return Err(Status::invalid_argument(
                "a replies stream needs a nonzero key",
            ));
        }
        let mut sinks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        sinks.retain(|_, tx| !tx.is_closed());
        if sinks.contains_key(&key) {
            return Err(Status::already_exists(format!(
                "a replies stream with key {key} is already open"
            )));
        }
        let (tx, rx) = mpsc::channel(256);
        sinks.insert(key, tx);
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    fn take(&self, key: u64) -> Option<ReplyTx> {
        let mut sinks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        sinks.remove(&key).filter(|tx| !tx.is_closed())
    }
}

/// Seam round trips the relay measured and the next forwarded step reports (bounded: with no
/// step to carry them, the oldest are kept and the rest dropped).
#[derive(Default)]
struct SeamRtts(Mutex<Vec<u64>>);

impl SeamRtts {
    const MAX: usize = 256;

    fn push(&self, micros: u64) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < Self::MAX {
            v.push(micros);
        }
    }

    fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A step sent downstream and not yet acknowledged.
struct Pending {
    sent: Instant,
    deadline: Duration,
    /// Activation bytes sent with the step (in flight until the acknowledgement comes back).
    bytes: u64,
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

fn shard_failed(step_id: u64, shard: &str, message: String) -> RouteReply {
    RouteReply {
        step_id,
        step_error: Some(StepError {
            reason: "shard_failed".into(),
            shard: shard.into(),
            message,
        }),
        ..Default::default()
    }
}

/// Serves one route stream whose first message must be a `RouteSetup`.
pub async fn run_route<S>(core: Arc<ShardCore>, mut inbound: S) -> Result<ReplyStream, Status>
where
    S: Stream<Item = Result<RouteMsg, Status>> + Send + Unpin + 'static,
{
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
    if setup.model_digest != core.info.model_digest {
        return Err(Status::failed_precondition(format!(
            "recipe_mismatch: shard {} serves model {} but the route expects {}",
            core.config.label, core.info.model_digest, setup.model_digest
        )));
    }
    if let Some(expected) = setup.recipes.first() {
        let own = core.info.recipe.clone().unwrap_or_default();
        if let Some(field) = recipe_difference(&own, expected) {
            return Err(Status::failed_precondition(format!(
                "recipe_mismatch: shard {} has {field} {} but the route expects {}",
                core.config.label,
                field_value(&own, field),
                field_value(expected, field)
            )));
        }
    }
    let has_downstream = !setup.downstream.is_empty();
    if has_downstream == core.is_last() {
        return Err(Status::failed_precondition(format!(
            "recipe_mismatch: shard {} holds layers {}..{} of {} but the route gives it {} downstream shards",
            core.config.label,
            core.info.layer_start,
            core.info.layer_end,
            core.info.n_layers,
            setup.downstream.len()
        )));
    }
    // On a route of several shards the last answers the tracker directly, on the Replies
    // stream the tracker opened on it; its upstream stream carries acknowledgements.
    let several = has_downstream || !core.is_first();
    if several && setup.reply_key == 0 {
        return Err(Status::invalid_argument(
            "a route of several shards needs a reply_key: its last shard answers the tracker on a replies stream",
        ));
    }
    let sink = match (core.is_last() && several).then_some(setup.reply_key) {
        Some(key) => Some(core.reply_sinks.take(key).ok_or_else(|| {
            Status::failed_precondition(format!(
                "no replies stream with key {key} is open on shard {}",
                core.config.label
            ))
        })?),
        None => None,
    };
    let seam = SeamDtype::try_from(setup.seam_dtype).unwrap_or(SeamDtype::SeamF32);
    let stream_id = core.new_stream_id();
    let (up_tx, up_rx) = mpsc::channel::<Result<RouteReply, Status>>(256);

    let downstream = if has_downstream {
        let next_addr = setup.downstream[0].clone();
        let next = proto::connect(&next_addr, &core.config.cluster_token)?;
        let (dn_tx, dn_rx) = mpsc::channel::<RouteMsg>(256);
        let next_setup = RouteSetup {
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
        let replies = next.route(dn_rx).await.map_err(|e| {
            Status::unavailable(format!("shard_failed: {next_addr}: {}", e.message()))
        })?;
        Some((next_addr, dn_tx, replies))
    } else {
        None
    };

    // Tells the inbound loop to stop when the downstream hop dies.
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let (reg_tx, reg_rx) = mpsc::unbounded_channel::<(u64, Pending)>();
    let rtts = Arc::new(SeamRtts::default());
    // Token hints reach the first shard through its relay; later shards pass them upstream.
    let (hint_tx, mut hint_rx) = mpsc::channel::<Vec<SessionOutput>>(4);
    let dn_tx = match downstream {
        Some((addr, dn_tx, replies)) => {
            tokio::spawn(relay(
                Arc::clone(&core),
                addr,
                replies,
                reg_rx,
                up_tx.clone(),
                stop_tx,
                Arc::clone(&rtts),
                core.is_first().then_some(hint_tx),
            ));
            Some(dn_tx)
        }
        None => None,
    };
    let prefix_scope = if seam == SeamDtype::SeamF16 {
        stream_id
    } else {
        0
    };

    let epoch = setup.epoch;
    let label = core.config.label.clone();
    tokio::spawn(async move {
        // The early step started on the last token hint, if any (first shard only).
        let mut early = None;
        loop {
            let stopped = async {
                // A dropped sender (no downstream hop) never signals a stop.
                if stop_rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            let msg = tokio::select! {
                biased;
                m = inbound.next() => m,
                Some(hint) = hint_rx.recv() => {
                    // One early step at a time, started only while no step of the tracker's is
                    // being run (this loop is between steps).
                    if early.is_none() {
                        early = Some(core.early(EarlyJob {
                            stream_id,
                            epoch,
                            tokens: hint.iter().map(|o| (o.session_id, o.token, o.next_pos)).collect(),
                            now: Instant::now(),
                            prefix_scope,
                        }));
                    }
                    continue;
                }
                _ = stopped => None,
            };
            let step: Step = match msg {
                Some(Ok(RouteMsg {
                    msg: Some(route_msg::Msg::Step(s)),
                })) => s,
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => break,
            };
            let received = Instant::now();
            let hidden = if core.is_first() {
                None
            } else {
                match proto::decode_activations(&step.activations, seam) {
                    Some(h) => Some(h),
                    None => {
                        let _ = up_tx
                            .send(Err(Status::invalid_argument(format!(
                                "step {}: {} activation bytes do not decode as {seam:?}",
                                step.step_id,
                                step.activations.len()
                            ))))
                            .await;
                        break;
                    }
                }
            };
            let n_rows: usize = step.fragments.iter().map(|f| f.tokens.len()).sum();
            if let Some(h) = &hidden {
                if h.len() != n_rows * core.info.n_embd as usize {
                    let _ = up_tx
                        .send(Err(Status::invalid_argument(format!(
                            "step {}: {} activations for {n_rows} rows of width {}",
                            step.step_id,
                            h.len(),
                            core.info.n_embd
                        ))))
                        .await;
                    break;
                }
            }
            // Activations this step would add to what is in flight downstream: over the budget,
            // its fragments are refused (typed) before anything is computed.
            let seam_width = if seam == SeamDtype::SeamF16 { 2 } else { 4 };
            let out_bytes = (n_rows * core.info.n_embd as usize * seam_width) as u64;
            let in_flight = core.counters.inflight_bytes.load(Ordering::Relaxed);
            let budget = core.config.inflight_budget_bytes as u64;
            let over = dn_tx.is_some() && in_flight + out_bytes > budget;
            let refused: Vec<proto::v1::SessionError> = if over {
                step.fragments
                    .iter()
                    .map(|f| proto::v1::SessionError {
                        session_id: f.session_id,
                        reason: "capacity".into(),
                        message: format!(
                            "inflight_budget on shard {label}: {:.1} MiB of activations are in flight downstream, this step adds {:.1} MiB, the budget is {:.1} MiB",
                            mib(in_flight),
                            mib(out_bytes),
                            mib(budget)
                        ),
                    })
                    .collect()
            } else {
                Vec::new()
            };
            // An early step is used if it is exactly this step, and rolled back otherwise.
            let (mut used, mut rollback) = (None, Vec::new());
            if let Some(started) = early.take() {
                if let Ok(Some(e)) = started.await {
                    // Early steps run under the route's epoch.
                    if !over && step.epoch == epoch && e.matches(&step.fragments, &step.release) {
                        core.counters
                            .early_steps_used
                            .fetch_add(1, Ordering::Relaxed);
                        core.counters.count_step(&step.fragments);
                        used = Some(crate::core::StepOutcome {
                            accepted: step.fragments.clone(),
                            ..e.outcome
                        });
                    } else {
                        core.counters
                            .early_steps_discarded
                            .fetch_add(1, Ordering::Relaxed);
                        rollback = e.rollback();
                    }
                }
            }
            let out = match used {
                Some(out) => out,
                None => {
                    core.step(StepJob {
                        stream_id,
                        epoch: step.epoch,
                        fragments: if over { Vec::new() } else { step.fragments },
                        release: step.release.clone(),
                        hidden: if over { None } else { hidden },
                        now: received,
                        prefix_scope,
                        rollback,
                    })
                    .await
                }
            };
            // Refusals travel with the step to the last shard, which answers with all of them.
            let mut errors = step.errors;
            errors.extend(out.errors);
            errors.extend(refused);
            let mut hops = step.hops;
            let mut hop = HopTiming {
                shard: label.clone(),
                compute_micros: out.compute_micros,
                ..Default::default()
            };
            // What the acknowledgement names beside the step: on the last shard, the tokens it
            // sampled (a token hint), so that the first shard can start the next decode step
            // while the reply travels through the tracker.
            let mut hint = Vec::new();
            match &dn_tx {
                None => {
                    hop.held_micros = received.elapsed().as_micros() as u64;
                    hops.push(hop);
                    if !core.is_first() {
                        hint = out
                            .outputs
                            .iter()
                            .map(|o| SessionOutput {
                                session_id: o.session_id,
                                token: o.token,
                                next_pos: o.next_pos,
                                ..Default::default()
                            })
                            .collect();
                    }
                    let reply = RouteReply {
                        step_id: step.step_id,
                        outputs: out.outputs,
                        errors,
                        step_error: None,
                        hops,
                    };
                    let answered = match &sink {
                        Some(sink) => sink.send(Ok(reply)).await.is_ok(),
                        None => up_tx.send(Ok(reply)).await.is_ok(),
                    };
                    if !answered {
                        break;
                    }
                }
                Some(dn_tx) => {
                    let activations = proto::encode_activations(&out.hidden, seam);
                    hop.seam_bytes = activations.len() as u64;
                    hop.seam_rtt_micros = rtts.take();
                    core.counters
                        .seam_bytes_out
                        .fetch_add(hop.seam_bytes, Ordering::Relaxed);
                    let spent = received.elapsed().as_millis() as u32;
                    let deadline_ms = step.deadline_ms.saturating_sub(spent).max(1);
                    let pending = Pending {
                        sent: Instant::now(),
                        deadline: Duration::from_millis(deadline_ms as u64),
                        bytes: activations.len() as u64,
                    };
                    // Counted before the relay can see (and subtract) it.
                    core.counters
                        .inflight_bytes
                        .fetch_add(pending.bytes, Ordering::Relaxed);
                    if let Err(unsent) = reg_tx.send((step.step_id, pending)) {
                        core.counters
                            .inflight_bytes
                            .fetch_sub(unsent.0 .1.bytes, Ordering::Relaxed);
                        break;
                    }
                    hop.held_micros = received.elapsed().as_micros() as u64;
                    hops.push(hop);
                    let next = Step {
                        step_id: step.step_id,
                        epoch: step.epoch,
                        fragments: out.accepted,
                        release: step.release,
                        activations,
                        deadline_ms,
                        errors,
                        hops,
                    };
                    if dn_tx
                        .send(RouteMsg {
                            msg: Some(route_msg::Msg::Step(next)),
                        })
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
            // The shard before this one learns that the step has passed: its activation bytes
            // are no longer in flight, and how long this shard held the step (for its seam
            // round trip). The tracker, upstream of the first shard, waits for replies instead.
            if !core.is_first() {
                // The step (or reply) just sent is what the route waits for: let it reach its
                // socket before the acknowledgement takes this thread.
                tokio::task::yield_now().await;
                let ack = acknowledgement(step.step_id, &label, received, hint);
                if up_tx.send(Ok(ack)).await.is_err() {
                    break;
                }
            }
        }
        // The upstream end went away (or downstream died): forget this stream's sessions.
        core.release_stream(stream_id);
    });
    Ok(Box::pin(ReceiverStream::new(up_rx)))
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

/// Reads the next shard's acknowledgements (releasing in-flight bytes, measuring the seam's
/// round trip), hands token hints to the first shard's step loop (`hints`) or passes them
/// upstream, and relays failures from further down upstream; turns a broken or silent
/// downstream into a `shard_failed` reply for every step still waiting.
#[allow(clippy::too_many_arguments)] // reason: one task's channels and shared state, each used once
async fn relay(
    core: Arc<ShardCore>,
    next_addr: String,
    mut replies: ReplyStream,
    mut reg_rx: mpsc::UnboundedReceiver<(u64, Pending)>,
    up_tx: ReplyTx,
    stop_tx: watch::Sender<bool>,
    rtts: Arc<SeamRtts>,
    hints: Option<mpsc::Sender<Vec<SessionOutput>>>,
) {
    let mut pending = PendingSteps {
        core,
        steps: HashMap::new(),
    };
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let failure: String = loop {
        tokio::select! {
            reg = reg_rx.recv() => match reg {
                Some((id, p)) => { pending.steps.insert(id, p); }
                None => return,
            },
            reply = replies.next() => match reply {
                Some(Ok(r)) => {
                    // Registration always precedes the send downstream, but may not have been
                    // read yet: drain it first.
                    while let Ok((id, p)) = reg_rx.try_recv() {
                        pending.steps.insert(id, p);
                    }
                    if r.step_error.is_none() {
                        // An acknowledgement (with a hop), a token hint (with outputs), or both.
                        if let Some(held) = r.hops.first().map(|h| h.held_micros) {
                            if let Some(p) = pending.remove(r.step_id) {
                                rtts.push((p.sent.elapsed().as_micros() as u64).saturating_sub(held));
                            }
                        }
                        if !r.outputs.is_empty() {
                            match &hints {
                                // A hint the step loop has no room for is dropped: it only
                                // saves time.
                                Some(h) => { let _ = h.try_send(r.outputs); }
                                None => {
                                    let hint = RouteReply { step_id: r.step_id, outputs: r.outputs, ..Default::default() };
                                    if up_tx.send(Ok(hint)).await.is_err() {
                                        return;
                                    }
                                }
                            }
                        }
                        continue;
                    }
                    pending.remove(r.step_id);
                    if up_tx.send(Ok(r)).await.is_err() {
                        // Steps still registered are dropped with `pending` (their bytes too).
                        while let Ok((id, p)) = reg_rx.try_recv() {
                            pending.steps.insert(id, p);
                        }
                        return;
                    }
                    break "a shard further down the route failed".to_string();
                }
                Some(Err(status)) => break format!("the stream to {next_addr} failed: {}", status.message()),
                None => break format!("{next_addr} closed the route stream"),
            },
            _ = tick.tick() => {
                if let Some((_, p)) = pending.steps.iter().find(|(_, p)| p.sent.elapsed() > p.deadline) {
                    break format!("{next_addr} did not answer within {} ms", p.deadline.as_millis());
                }
            }
        }
    };
    while let Ok((id, p)) = reg_rx.try_recv() {
        pending.steps.insert(id, p);
    }
    let mut ids: Vec<u64> = pending.steps.keys().copied().collect();
    ids.sort_unstable();
    for id in ids {
        let _ = up_tx
            .send(Ok(shard_failed(id, &next_addr, failure.clone())))
            .await;
    }
    if pending.steps.is_empty() {
        // Nothing was waiting, but the route is broken: say so on the next read.
        let _ = up_tx.send(Ok(shard_failed(0, &next_addr, failure))).await;
    }
    let _ = stop_tx.send(true);
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
