//! The scheduling loop: a thin actor around `engine::Scheduler`. It owns the sessions, sends
//! each plan down the route, turns replies into per-session events, and fails sessions with
//! typed errors when the route breaks. Policy lives in the scheduler, not here.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{
    Admission, Demand, Event, FinishReason, PlanItem, Priority, RefusalKind, Scheduler,
    SchedulerConfig, SessionId,
};
use futures::StreamExt;
use proto::v1::{route_msg, Fragment, RouteMsg, RouteReply, Sampling, SeamDtype, Step};
use proto::ReplyStream;
use text::{StopMatcher, StopStep, StreamDecoder, Tokenizer};
use tokio::sync::{mpsc, oneshot, watch};

use crate::cluster::{Cluster, Health};
use crate::error::ApiError;
use crate::metrics::{Metrics, COUNT_BUCKETS, LATENCY_BUCKETS};

/// A session ready to run: tokenized prompt and sampling.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub logprobs: Option<u32>,
    pub ignore_eos: bool,
    pub priority: Priority,
    /// The caller's API key name ("" when there is no ledger).
    pub key: String,
    /// The request's row in the usage ledger, settled when the session ends.
    pub ledger_row: Option<i64>,
}

/// One generated token's log-probabilities, as text.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What a session's client receives.
#[derive(Debug, Clone)]
pub enum SessionEvent {
    /// One generated token and the text it completed (possibly empty; always empty for the
    /// end-of-sequence token).
    Token {
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Text held back (an incomplete character or a possible stop string) released at the end.
    Text(String),
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(ApiError),
}

pub enum Command {
    Submit {
        job: Job,
        events: mpsc::UnboundedSender<SessionEvent>,
        accepted: oneshot::Sender<Result<SessionId, ApiError>>,
    },
    Cancel(SessionId),
}

/// Settings of the loop.
#[derive(Debug, Clone, Copy)]
pub struct RunnerConfig {
    pub scheduler: SchedulerConfig,
    pub seam: SeamDtype,
    /// A step may take this long plus `step_deadline_per_token` per token before the route is
    /// declared failed.
    pub step_deadline_base: Duration,
    pub step_deadline_per_token: Duration,
}

/// Times one session may be recomputed after a shard lost its cache before it fails.
const MAX_REPLAYS: u32 = 3;

struct Live {
    n_replays: u32,
    events: mpsc::UnboundedSender<SessionEvent>,
    decoder: StreamDecoder,
    stops: StopMatcher,
    n_prompt: usize,
    n_generated: usize,
    started: Instant,
    last_token: Option<Instant>,
    logprobs: Option<u32>,
    sampling: Sampling,
    ignore_eos: bool,
    priority: Priority,
    /// Admitted and not yet part of any step.
    queued: bool,
    ledger_row: Option<i64>,
}

struct Link {
    tx: mpsc::Sender<RouteMsg>,
    /// The first shard's stream: the replies on a route of one shard, else failures only.
    upstream: ReplyStream,
    /// The last shard's replies on a route of several shards; `None` once it has ended
    /// cleanly (something upstream closed the route, and the upstream stream says what).
    direct: Option<ReplyStream>,
    /// A route of one shard: its replies come on `upstream`.
    replies_upstream: bool,
}

pub struct Runner {
    config: RunnerConfig,
    cluster: Arc<Cluster>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    health: watch::Receiver<Health>,
    /// Published: whether the route is open.
    route_up: watch::Sender<bool>,
    scheduler: Scheduler,
    /// What admitted sessions reserved on every shard; released when they leave `live`.
    admission: Admission,
    ledger: Option<Arc<crate::ledger::Ledger>>,
    live: HashMap<SessionId, Live>,
    next_id: u64,
    epoch: u64,
    link: Option<Link>,
    /// Steps sent and not yet answered, oldest first (replies come back in order).
    in_flight: VecDeque<InFlight>,
    /// Why the route is down, for refusals.
    down_reason: Option<ApiError>,
    next_attempt: Instant,
}

/// A step sent down the route whose reply has not come back yet.
struct InFlight {
    plan: engine::StepPlan,
    sent: Instant,
    deadline: Duration,
}

enum Waited {
    Upstream(Option<Result<RouteReply, tonic::Status>>),
    Direct(Option<Result<RouteReply, tonic::Status>>),
    Timeout,
}

/// The next item of the last shard's replies stream, or never when there is none.
async fn next_direct(
    direct: &mut Option<ReplyStream>,
) -> Option<Result<RouteReply, tonic::Status>> {
    match direct {
        Some(d) => d.next().await,
        None => std::future::pending().await,
    }
}

impl Runner {
    pub fn new(
        config: RunnerConfig,
        cluster: Arc<Cluster>,
        tokenizer: Arc<Tokenizer>,
        metrics: Arc<Metrics>,
        health: watch::Receiver<Health>,
        route_up: watch::Sender<bool>,
        admission: Admission,
        ledger: Option<Arc<crate::ledger::Ledger>>,
    ) -> Runner {
        Runner {
            route_up,
            admission,
            ledger,
            scheduler: Scheduler::new(config.scheduler),
            config,
            cluster,
            tokenizer,
            metrics,
            health,
            live: HashMap::new(),
            next_id: 1,
            epoch: 0,
            link: None,
            in_flight: VecDeque::new(),
            down_reason: Some(ApiError::unavailable("the route is starting")),
            next_attempt: Instant::now(),
        }
    }

    pub async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        for s in self.admission.shards() {
            let labels = [("shard", s.address.as_str())];
            self.metrics.set(
                "strata_admission_kv_budget_bytes",
                &labels,
                s.kv_budget_bytes as f64,
            );
        }
        loop {
            self.ensure_route().await;
            // Requests that arrived while a step was in flight join before the next plan, so
            // agent work is never planned behind grading work that merely answered first.
            loop {
                match commands.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            self.drop_disconnected();
            // Keep up to `pipeline_depth` steps in flight: shards process steps in order and
            // reply in order, so while the last shard finishes one micro-batch the first
            // already computes the next.
            while self.link.is_some()
                && self.in_flight.len() < self.config.scheduler.pipeline_depth.max(1)
            {
                let Some(plan) = self.scheduler.schedule(Instant::now()) else {
                    break;
                };
                self.send(plan).await;
            }
            for p in Priority::ALL {
                let labels = [("priority", p.name())];
                let waiting = self.scheduler.n_waiting_of(p) as f64;
                self.metrics.set("strata_queue_depth", &labels, waiting);
                let active = self.scheduler.n_active_of(p) as f64;
                self.metrics.set("strata_active_sessions", &labels, active);
            }
            let reserved = self.admission.reserved_kv_bytes();
            for (s, r) in self.admission.shards().iter().zip(reserved) {
                let labels = [("shard", s.address.as_str())];
                self.metrics
                    .set("strata_admission_kv_reserved_bytes", &labels, r as f64);
            }
            self.metrics
                .set("strata_steps_in_flight", &[], self.in_flight.len() as f64);
            let Some(oldest) = self.in_flight.front() else {
                tokio::select! {
                    cmd = commands.recv() => match cmd {
                        Some(c) => self.handle(c),
                        None => return,
                    },
                    _ = self.health.changed() => {}
                    // Work held back (grading waiting out the gap after agent work) is looked
                    // at again soon; an idle route sleeps longer.
                    _ = tokio::time::sleep(if self.scheduler.is_idle() {
                        Duration::from_millis(100)
                    } else {
                        Duration::from_millis(5)
                    }) => {}
                }
                continue;
            };
            let (due, n_tokens, deadline) = (
                oldest.sent + oldest.deadline,
                oldest.plan.n_tokens(),
                oldest.deadline,
            );
            let link = self
                .link
                .as_mut()
                .expect("steps are in flight only with a link");
            let waited = tokio::select! {
                reply = link.upstream.next() => Waited::Upstream(reply),
                reply = next_direct(&mut link.direct) => Waited::Direct(reply),
                _ = tokio::time::sleep_until(due.into()) => Waited::Timeout,
                cmd = commands.recv() => match cmd {
                    // A new request can join the next step while this one is in flight.
                    Some(c) => {
                        self.handle(c);
                        continue;
                    }
                    None => return,
                },
            };
            let first = || self.cluster.addresses()[0].clone();
            let last = || self.cluster.addresses().last().cloned().unwrap_or_default();
            let reply = match waited {
                Waited::Upstream(Some(Ok(r)))
                    if r.step_error.is_some() || link.replies_upstream =>
                {
                    r
                }
                Waited::Direct(Some(Ok(r))) => r,
                Waited::Direct(None) => {
                    // The last shard's route ended because a shard before it closed it: the
                    // upstream stream names that shard (or the step deadline runs out).
                    link.direct = None;
                    continue;
                }
                Waited::Timeout => {
                    let culprit = self
                        .cluster
                        .first_unresponsive(Duration::from_millis(300))
                        .await
                        .unwrap_or_else(|| "on the route".to_string());
                    self.route_failed(ApiError::shard_failed(
                        &culprit,
                        format!(
                            "no reply to a {n_tokens}-token step within {} ms",
                            deadline.as_millis()
                        ),
                    ));
                    continue;
                }
                broken => {
                    let (shard, why) = match broken {
                        Waited::Upstream(Some(Ok(r))) => (
                            first(),
                            format!(
                                "an unexpected answer to step {} on the route stream",
                                r.step_id
                            ),
                        ),
                        Waited::Upstream(Some(Err(status))) => {
                            (first(), status.message().to_string())
                        }
                        Waited::Direct(Some(Err(status))) => (last(), status.message().to_string()),
                        // The first shard closed the route stream.
                        _ => (first(), "the route stream ended".to_string()),
                    };
                    self.route_failed(ApiError::shard_failed(&shard, why));
                    continue;
                }
            };
            if let Some(e) = &reply.step_error {
                // The route is broken: every session on it fails (route_failed resets them all).
                let err = if e.reason == "shard_failed" {
                    ApiError::shard_failed(&e.shard, e.message.clone())
                } else {
                    ApiError::from_shard_refusal(&e.reason, &e.message)
                };
                self.route_failed(err);
                continue;
            }
            let f = self.in_flight.pop_front().expect("oldest step");
            if reply.step_id != f.plan.step_id {
                self.route_failed(ApiError::shard_failed(
                    &last(),
                    format!(
                        "reply for step {} while step {} was the oldest in flight",
                        reply.step_id, f.plan.step_id
                    ),
                ));
                continue;
            }
            self.apply(f.plan, reply, f.sent);
        }
    }

    /// Sends one planned step down the route and records it as in flight.
    async fn send(&mut self, plan: engine::StepPlan) {
        tracing::debug!(
            step = plan.step_id,
            items = plan.items.len(),
            release = plan.release.len(),
            in_flight = self.in_flight.len(),
            "step"
        );
        let n_tokens = plan.n_tokens();
        let deadline =
            self.config.step_deadline_base + self.config.step_deadline_per_token * n_tokens as u32;
        let step = self.to_wire(&plan, deadline);
        let link = self.link.as_mut().expect("a plan is sent only with a link");
        if link
            .tx
            .send(RouteMsg {
                msg: Some(route_msg::Msg::Step(step)),
            })
            .await
            .is_err()
        {
            let shard = self.cluster.addresses()[0].clone();
            self.route_failed(ApiError::shard_failed(&shard, "the route stream closed"));
            return;
        }
        for item in &plan.items {
            if let Some(l) = self.live.get_mut(&item.session).filter(|l| l.queued) {
                l.queued = false;
                self.metrics.observe(
                    "strata_queue_wait_seconds",
                    &[("priority", l.priority.name())],
                    LATENCY_BUCKETS,
                    l.started.elapsed().as_secs_f64(),
                );
            }
        }
        if !plan.items.is_empty() {
            self.metrics
                .observe("strata_batch_tokens", &[], COUNT_BUCKETS, n_tokens as f64);
            self.metrics.observe(
                "strata_batch_sessions",
                &[],
                COUNT_BUCKETS,
                plan.items.len() as f64,
            );
        }
        self.in_flight.push_back(InFlight {
            plan,
            sent: Instant::now(),
            deadline,
        });
    }

    /// Opens the route when it is down and every shard answers again.
    async fn ensure_route(&mut self) {
        if self.link.is_some() || Instant::now() < self.next_attempt {
            return;
        }
        let health = self.health.borrow().clone();
        if !health.all_up() {
            if !health.shards.is_empty() {
                let down = health.down().join(", ");
                self.down_reason = Some(ApiError::shard_failed(
                    &down,
                    "the shard is down; retry when it is back",
                ));
            }
            return;
        }
        self.epoch += 1;
        match self.cluster.open_route(self.epoch, self.config.seam).await {
            Ok(route) => {
                tracing::info!(epoch = self.epoch, "route open");
                self.link = Some(Link {
                    tx: route.tx,
                    upstream: route.upstream,
                    replies_upstream: route.direct.is_none(),
                    direct: route.direct,
                });
                self.down_reason = None;
                self.metrics
                    .set("strata_route_epoch", &[], self.epoch as f64);
                self.metrics.set("strata_route_up", &[], 1.0);
                let _ = self.route_up.send(true);
            }
            Err(e) => {
                self.down_reason = Some(ApiError::unavailable(format!(
                    "the route cannot be opened: {e}"
                )));
                self.next_attempt = Instant::now() + Duration::from_millis(250);
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                job,
                events,
                accepted,
            } => {
                // Refusals are counted where they are answered (the HTTP handler).
                if let Some(reason) = &self.down_reason {
                    let _ = accepted.send(Err(reason.clone()));
                    return;
                }
                let id = SessionId(self.next_id);
                let demand = Demand {
                    n_positions: job.prompt_ids.len() + job.max_tokens,
                    priority: job.priority,
                    key: &job.key,
                };
                let queued = self.scheduler.n_waiting_of(job.priority);
                if let Err(r) = self.admission.admit(id, &demand, queued) {
                    let err = match r.kind {
                        RefusalKind::Capacity => {
                            ApiError::capacity(&r.limit, r.message).retry_after(r.retry_after_secs)
                        }
                        RefusalKind::TooLarge => ApiError::too_large(&r.limit, r.message),
                    };
                    let _ = accepted.send(Err(err));
                    return;
                }
                self.next_id += 1;
                let owner = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    job.key.hash(&mut h);
                    h.finish()
                };
                self.scheduler.add(
                    id,
                    job.prompt_ids.clone(),
                    job.max_tokens,
                    job.priority,
                    owner,
                );
                self.live.insert(
                    id,
                    Live {
                        n_replays: 0,
                        events,
                        decoder: StreamDecoder::new(),
                        stops: StopMatcher::new(job.stop),
                        n_prompt: job.prompt_ids.len(),
                        n_generated: 0,
                        started: Instant::now(),
                        last_token: None,
                        logprobs: job.logprobs,
                        sampling: job.sampling,
                        ignore_eos: job.ignore_eos,
                        priority: job.priority,
                        queued: true,
                        ledger_row: job.ledger_row,
                    },
                );
                let _ = accepted.send(Ok(id));
            }
            Command::Cancel(id) => self.cancel(id),
        }
    }

    /// Removes a session from the live set, returns what it reserved at admission and settles
    /// its usage (`status`: done, cancelled or failed).
    fn forget(&mut self, id: SessionId, status: &'static str) -> Option<Live> {
        self.admission.release(id);
        let live = self.live.remove(&id)?;
        self.settle(&live, status);
        Some(live)
    }

    fn settle(&self, live: &Live, status: &'static str) {
        if let (Some(ledger), Some(row)) = (&self.ledger, live.ledger_row) {
            ledger.settle(row, live.n_prompt as u64, live.n_generated as u64, status);
        }
    }

    fn cancel(&mut self, id: SessionId) {
        if self.forget(id, "cancelled").is_some() {
            self.scheduler.abort(id);
            self.metrics.inc("strata_cancelled_total", &[], 1.0);
        }
    }

    /// Sessions whose client went away are cancelled (their KV is released with the next plan).
    fn drop_disconnected(&mut self) {
        let gone: Vec<SessionId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.cancel(id);
        }
    }

    fn to_wire(&self, plan: &engine::StepPlan, deadline: Duration) -> Step {
        let fragments = plan
            .items
            .iter()
            .map(|item: &PlanItem| {
                let live = self.live.get(&item.session);
                Fragment {
                    session_id: item.session.0,
                    start_pos: item.start_pos as u32,
                    tokens: item.tokens.clone(),
                    want_output: item.want_output,
                    sampling: if item.start_pos == 0 {
                        live.map(|l| l.sampling)
                    } else {
                        None
                    },
                    n_top_logprobs: live.and_then(|l| l.logprobs).unwrap_or(0),
                    want_logprob: live.is_some_and(|l| l.logprobs.is_some()),
                    // Shards may take a prompt's positions from cached blocks of a shared
                    // prefix; a session being recomputed after a cache miss computes them.
                    reuse_prefix: item.tokens.len() > 1 && live.is_some_and(|l| l.n_replays == 0),
                    prefix: Vec::new(),
                }
            })
            .collect();
        Step {
            step_id: plan.step_id,
            epoch: self.epoch,
            fragments,
            release: plan.release.iter().map(|s| s.0).collect(),
            activations: Vec::new(),
            deadline_ms: deadline.as_millis() as u32,
            errors: Vec::new(),
            hops: Vec::new(),
        }
    }

    fn route_failed(&mut self, err: ApiError) {
        tracing::warn!(error = %err.message, "route failed");
        self.link = None;
        self.in_flight.clear();
        self.metrics.set("strata_route_up", &[], 0.0);
        let _ = self.route_up.send(false);
        self.metrics
            .inc("strata_failures_total", &[("kind", err.reason)], 1.0);
        self.scheduler.reset();
        for (id, l) in std::mem::take(&mut self.live) {
            self.admission.release(id);
            self.settle(&l, "failed");
            let _ = l.events.send(SessionEvent::Error(err.clone()));
        }
        self.down_reason = Some(err);
        self.next_attempt = Instant::now() + Duration::from_millis(200);
    }

    fn apply(&mut self, plan: engine::StepPlan, reply: RouteReply, sent: Instant) {
        self.record_hops(&reply, sent.elapsed());
        let mut failed = Vec::new();
        let mut replays = Vec::new();
        for e in &reply.errors {
            let id = SessionId(e.session_id);
            // A shard forgot the session (eviction): recompute it from its known tokens, a few
            // times at most, instead of failing the client.
            if e.reason == "cache_miss" {
                if let Some(l) = self.live.get_mut(&id) {
                    if l.n_replays < MAX_REPLAYS {
                        l.n_replays += 1;
                        replays.push(id);
                        self.metrics.inc("strata_replays_total", &[], 1.0);
                        continue;
                    }
                }
            }
            failed.push(id);
            let err = ApiError::from_shard_refusal(&e.reason, &e.message);
            if let Some(l) = self.forget(id, "failed") {
                err.count(&self.metrics, l.priority);
                let _ = l.events.send(SessionEvent::Error(err));
            }
        }
        let outputs: Vec<(SessionId, u32)> = reply
            .outputs
            .iter()
            .map(|o| (SessionId(o.session_id), o.token))
            .collect();
        let logprobs: HashMap<u64, &proto::v1::SessionOutput> =
            reply.outputs.iter().map(|o| (o.session_id, o)).collect();
        let (mut n_prefill, mut n_decode) = (0usize, 0usize);
        for item in &plan.items {
            if item.start_pos > 0 && item.tokens.len() == 1 {
                n_decode += 1;
            } else {
                n_prefill += item.tokens.len();
            }
        }
        self.metrics
            .inc("strata_prefill_tokens_total", &[], n_prefill as f64);
        self.metrics
            .inc("strata_decode_tokens_total", &[], n_decode as f64);
        let events = self
            .scheduler
            .update_from_output(plan.step_id, &outputs, &failed);
        for id in replays {
            self.scheduler.replay(id);
        }
        for event in events {
            match event {
                Event::Token { session, token } => {
                    let lp = logprobs.get(&session.0).copied();
                    self.on_token(session, token, lp);
                }
                Event::Finished { session, reason } => {
                    let why = match reason {
                        FinishReason::Length => "length",
                        FinishReason::Stop => "stop",
                    };
                    self.finish(session, why);
                }
            }
        }
    }

    fn piece(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.tokenizer.token_bytes(id, true).unwrap_or_default())
            .into_owned()
    }

    fn on_token(&mut self, id: SessionId, token: u32, out: Option<&proto::v1::SessionOutput>) {
        let now = Instant::now();
        let logprob = match (self.live.get(&id).and_then(|l| l.logprobs), out) {
            (Some(_), Some(o)) => Some(TokenLogprob {
                token: self.piece(token),
                logprob: o.logprob,
                top: o
                    .top
                    .iter()
                    .map(|t| (self.piece(t.token), t.logprob))
                    .collect(),
            }),
            _ => None,
        };
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        let is_end = self.tokenizer.is_end(token) && !live.ignore_eos;
        match live.last_token {
            None => self.metrics.observe(
                "strata_ttft_seconds",
                &[],
                LATENCY_BUCKETS,
                (now - live.started).as_secs_f64(),
            ),
            Some(t) => self.metrics.observe(
                "strata_inter_token_seconds",
                &[],
                LATENCY_BUCKETS,
                (now - t).as_secs_f64(),
            ),
        }
        live.last_token = Some(now);
        live.n_generated += 1;
        if is_end {
            let _ = live.events.send(SessionEvent::Token {
                token,
                text: String::new(),
                logprob,
            });
            self.scheduler.finish(id);
            self.finish(id, "stop");
            return;
        }
        let piece: String = live
            .decoder
            .push(&self.tokenizer, token)
            .unwrap_or_default();
        match live.stops.push(&piece) {
            StopStep::Continue(text) => {
                let _ = live.events.send(SessionEvent::Token {
                    token,
                    text,
                    logprob,
                });
            }
            StopStep::Stop(text) => {
                let _ = live.events.send(SessionEvent::Token {
                    token,
                    text,
                    logprob,
                });
                self.scheduler.finish(id);
                if let Some(l) = self.forget(id, "done") {
                    self.done(l, "stop");
                }
            }
        }
    }

    fn finish(&mut self, id: SessionId, reason: &'static str) {
        let Some(mut live) = self.forget(id, "done") else {
            return;
        };
        if reason == "length" {
            let tail = live.decoder.finish();
            let text = match live.stops.push(&tail) {
                StopStep::Continue(t) => t + &live.stops.finish(),
                StopStep::Stop(t) => t,
            };
            if !text.is_empty() {
                let _ = live.events.send(SessionEvent::Text(text));
            }
        }
        self.done(live, reason);
    }

    fn done(&self, live: Live, reason: &'static str) {
        self.metrics
            .inc("strata_requests_total", &[("status", "ok")], 1.0);
        let _ = live.events.send(SessionEvent::Done {
            finish_reason: reason,
            prompt_tokens: live.n_prompt,
            completion_tokens: live.n_generated,
        });
    }

    /// Per step: the route's messaging time (the round trip less the time the shards held the
    /// step), each seam's bytes and the round trips its sending shard measured, each shard's
    /// compute.
    fn record_hops(&self, reply: &RouteReply, round_trip: Duration) {
        let hops = &reply.hops;
        if hops.is_empty() {
            return;
        }
        let held: u64 = hops.iter().map(|h| h.held_micros).sum();
        self.metrics.observe(
            "strata_route_overhead_seconds",
            &[],
            LATENCY_BUCKETS,
            (round_trip.as_secs_f64() - held as f64 / 1e6).max(0.0),
        );
        for pair in hops.windows(2) {
            let hop = format!("{}->{}", pair[0].shard, pair[1].shard);
            for &rtt in &pair[0].seam_rtt_micros {
                self.metrics.observe(
                    "strata_seam_latency_seconds",
                    &[("hop", &hop)],
                    LATENCY_BUCKETS,
                    rtt as f64 / 1e6,
                );
            }
            self.metrics.inc(
                "strata_seam_bytes_total",
                &[("hop", &hop)],
                pair[0].seam_bytes as f64,
            );
        }
        for h in hops {
            self.metrics.observe(
                "strata_shard_step_seconds",
                &[("shard", &h.shard)],
                LATENCY_BUCKETS,
                h.compute_micros as f64 / 1e6,
            );
        }
    }
}
