//! The scheduling loop: a thin actor around `engine::Scheduler`. It owns the sessions, sends
//! each plan down the route, turns replies into per-session events, and fails sessions with
//! typed errors when the route breaks. Policy lives in the scheduler, not here.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{
    Admission, FinishReason, PlanItem, Priority, Refusal, Scheduler, SchedulerConfig, SessionId,
};
use futures::StreamExt;
use proto::v1::{route_msg, Fragment, RouteMsg, RouteReply, Sampling, SeamDtype, Step};
use proto::ReplyStream;
use text::{StopMatcher, StreamDecoder, Tokenizer};
use tokio::sync::{mpsc, oneshot, watch};

use crate::metrics::{Metrics, COUNT_BUCKETS, LATENCY_BUCKETS};
use crate::route::cluster::{link_refusal, Cluster, Health};
use crate::session;

mod outputs;
mod sessions;

/// A session ready to run: tokenized prompt and sampling.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub logprobs: Option<u32>,
    pub ignore_eos: bool,
    /// Its decode steps may carry drafted tokens when the route speculates.
    pub speculative: bool,
    pub priority: Priority,
    /// The caller's API key name ("" when there is no ledger).
    pub key: String,
    /// The caller's prefix-cache partitions (`AppState::tenant`).
    pub tenant: CacheTenant,
    /// The request's row in the usage ledger, settled when the session ends.
    pub ledger_row: Option<i64>,
    /// Prompt tokens its ledger row is charged (the first of `n` choices carries the prompt,
    /// the others none).
    pub billed_prompt: usize,
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
        finish_reason: FinishReason,
        /// The stop string that ended the text, when one did.
        stop_sequence: Option<String>,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Of the prompt tokens, those the route took from its prefix cache.
        cached_tokens: usize,
    },
    Error(Refusal),
}

pub enum Command {
    Submit {
        job: Box<Job>,
        /// The chain keys of its prompt's full blocks ([`super::prefixes::chain`], computed
        /// once to choose the route), recorded in the route's prefix index once it prefilled.
        prefix_keys: Vec<u64>,
        events: mpsc::UnboundedSender<SessionEvent>,
        accepted: oneshot::Sender<Result<SessionId, Refusal>>,
    },
    /// A session another route lost, to continue here; refused, it comes back.
    Resume {
        moved: Box<Moved>,
        accepted: oneshot::Sender<Result<SessionId, Box<Moved>>>,
    },
    Cancel(SessionId),
    /// The route left the table (a shard left the registry): it takes no new session, moves
    /// its sessions to other routes when `move_sessions` (another route of the model takes
    /// work), else lets them finish, then its loop ends.
    Retire {
        move_sessions: bool,
    },
}

/// A session leaving a failed route for another route of the same model: the client's stream
/// and its decoder and stop state (so the text goes on exactly where it was), and the tokens
/// to replay there. The sampler's state is the seed and the position (the draws are keyed by
/// position) and the constraint's is the tokens, so the continuation is the one the failed
/// route would have produced.
pub struct Moved {
    live: Live,
    /// Prompt and generated tokens so far, replayed on the new route.
    tokens: Vec<u32>,
    /// Tokens it may still generate.
    max_new: usize,
    /// The model (digest) and the route it left.
    pub digest: String,
    pub from: String,
    /// Why it left: what the client gets if no route takes it.
    pub error: Refusal,
}

impl Moved {
    /// The chain keys of the full blocks of its tokens in its key's partition
    /// ([`super::prefixes::chain`]): where it would find them cached.
    pub fn prefix_keys(&self) -> Vec<u64> {
        super::prefixes::chain(self.live.tenant.key, &self.tokens)
    }

    /// No route took it: the client gets the error the route failed with.
    pub fn fail(self, ledger: Option<&crate::ledger::Ledger>) {
        if let (Some(l), Some(row)) = (ledger, self.live.ledger_row) {
            l.settle(
                row,
                self.live.billed_prompt as u64,
                self.live.n_generated as u64,
                "failed",
            );
        }
        let _ = self.live.events.send(SessionEvent::Error(self.error));
    }

    /// The client went away while it was between routes.
    pub fn abandoned(&self) -> bool {
        self.live.events.is_closed()
    }
}

/// Settings of the loop.
#[derive(Debug, Clone, Copy)]
pub struct RunnerConfig {
    pub scheduler: SchedulerConfig,
    pub seam: SeamDtype,
    /// The longest the route may stay silent (no reply, acknowledgement or progress) while a
    /// step is in flight before it is declared failed; shards working on a long step say so
    /// at a quarter of this.
    pub liveness: Duration,
    /// Whose sessions share cached prefix blocks on the shards.
    pub prefix_scope: PrefixScope,
}

/// A session's prefix-cache partitions, of which the route's [`PrefixScope`] picks one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheTenant {
    /// Under [`PrefixScope::Key`]: a hash of the secret the caller presented and of the
    /// group its request named, never 0.
    pub key: u64,
    /// Under [`PrefixScope::Global`]: a hash of the group the request named
    /// (`prompt_cache_key`, `cache_salt`), 0 (the partition every session shares) when it
    /// named none.
    pub group: u64,
}

/// Whose sessions share cached prefix blocks on the shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixScope {
    /// The sessions of one API key (the default): no key's prompts speed up, and so reveal
    /// themselves to, another's.
    #[default]
    Key,
    /// Every session: for a deployment with one tenant only.
    Global,
}

/// Whether another route of a model takes work now (the route table answers): where a
/// draining route's sessions could go.
pub trait Replicas: Send + Sync {
    fn another_takes_work(&self, digest: &str, name: &str) -> bool;
}

/// What a route's loop is made of.
pub struct RunnerParts {
    pub config: RunnerConfig,
    /// The route's name.
    pub name: String,
    pub cluster: Arc<Cluster>,
    pub tokenizer: Arc<Tokenizer>,
    /// The route's scoped metrics.
    pub metrics: Arc<Metrics>,
    pub health: watch::Receiver<Health>,
    /// Published: whether the route is open.
    pub route_up: watch::Sender<bool>,
    pub admission: Admission,
    pub ledger: Option<Arc<crate::ledger::Ledger>>,
    /// Where its sessions go when it fails (`None`: they fail).
    pub failover: Option<mpsc::UnboundedSender<Box<Moved>>>,
    pub replicas: Arc<dyn Replicas>,
    /// Sessions it holds, published for choosing routes.
    pub load: Arc<std::sync::atomic::AtomicUsize>,
    /// The prompt prefixes its shards cache, for choosing routes: a session's prompt blocks
    /// go in once its prefill is done.
    pub prefixes: Arc<super::prefixes::PrefixIndex>,
    /// Its time per token, from its decode steps, published for choosing routes.
    pub pace: Arc<super::pace::Pace>,
    /// Where its sessions' drafts come from when they come from a draft model.
    pub draft: Option<Arc<dyn engine::DraftSource>>,
}

/// A new session's id, unique in this process: routes share the draft model, which keys its
/// state by session.
fn new_session_id() -> SessionId {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    SessionId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// The prefix-cache partition of a session of tenant `tenant` (0 is the partition every
/// session shares).
fn cache_salt(scope: PrefixScope, tenant: CacheTenant) -> u64 {
    match scope {
        PrefixScope::Key => tenant.key,
        PrefixScope::Global => tenant.group,
    }
}

/// The per-owner fairness id of an API key's name.
fn owner_of(key: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

struct Live {
    n_replays: u32,
    /// Moves blamed on it (see [`session::blames`]) since its frontier last advanced.
    n_moves: u32,
    /// Positions of it some route has computed and answered, on any route it was on: a
    /// failure while recomputing positions below this cannot be its doing.
    frontier: usize,
    /// When it last moved (until its first token on the new route).
    moved_at: Option<Instant>,
    /// The API key's name, for admission on another route.
    key: String,
    /// Its prefix-cache partitions ([`Job::tenant`]).
    tenant: CacheTenant,
    /// The chain keys of its prompt's full blocks, recorded in the route's prefix index once
    /// its prefill is done (then empty).
    prefix_keys: Vec<u64>,
    events: mpsc::UnboundedSender<SessionEvent>,
    decoder: StreamDecoder,
    stops: StopMatcher,
    n_prompt: usize,
    /// Prompt positions taken from the prefix cache instead of computed, on every route it
    /// was on (usage reports at most `n_prompt`).
    n_cached: usize,
    n_generated: usize,
    started: Instant,
    last_token: Option<Instant>,
    logprobs: Option<u32>,
    sampling: Sampling,
    ignore_eos: bool,
    /// Its decode steps may carry drafted tokens (it did not opt out, and no grammar holds
    /// it: a shard verifies drafts only for unconstrained sessions).
    speculative: bool,
    priority: Priority,
    /// Admitted and not yet part of any step.
    queued: bool,
    ledger_row: Option<i64>,
    billed_prompt: usize,
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
    /// Notified by the draft model when a draft a session waits for is ready.
    draft_ready: Arc<tokio::sync::Notify>,
    /// The route's name, and where its sessions go when it fails (`None`: they fail).
    name: String,
    failover: Option<mpsc::UnboundedSender<Box<Moved>>>,
    /// The route table: whether another route of the model could take this one's sessions
    /// when a shard of it drains.
    table: Arc<dyn Replicas>,
    /// Sessions it holds, published for choosing routes (new work goes to the least loaded).
    load: Arc<std::sync::atomic::AtomicUsize>,
    /// The prompt prefixes its shards cache ([`RunnerParts::prefixes`]).
    prefixes: Arc<super::prefixes::PrefixIndex>,
    /// Its time per token ([`RunnerParts::pace`]): `strata_route_token_interval_seconds`.
    pace: Arc<super::pace::Pace>,
    /// Retired: no new session; the loop ends once it holds none.
    retired: bool,
    /// Nothing can send it commands any more (the route left the table and every handle
    /// went): retired, and its command channel is no longer read.
    commands_closed: bool,
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
    epoch: u64,
    link: Option<Link>,
    /// Steps sent and not yet answered, oldest first (replies come back in order).
    in_flight: VecDeque<InFlight>,
    /// Why the route is down, for refusals.
    down_reason: Option<Refusal>,
    next_attempt: Instant,
    /// When the route last said anything (reply, acknowledgement, progress).
    last_heard: Instant,
}

/// A step sent down the route whose reply has not come back yet.
struct InFlight {
    plan: engine::StepPlan,
    sent: Instant,
    /// Sent while no other step was on the route: its round trip is the route's alone.
    alone: bool,
}

/// What the loop woke up for.
enum Waited {
    Upstream(Option<Result<RouteReply, tonic::Status>>),
    Direct(Option<Result<RouteReply, tonic::Status>>),
    Command(Command),
    /// The route was silent for its liveness while steps were in flight.
    Timeout,
    /// Nothing in flight: a health change or a short sleep.
    Idle,
    /// Every command sender is gone: the tracker is shutting down.
    Closed,
}

/// The next item of a stream, or never when there is none.
async fn next_of(stream: Option<&mut ReplyStream>) -> Option<Result<RouteReply, tonic::Status>> {
    match stream {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

/// Why the route refuses work while the health monitor reports some shard down (or holding
/// something other than what the route was validated with).
fn health_refusal(health: &Health) -> Refusal {
    let draining = health.draining();
    match health.mismatched() {
        Some(why) => Refusal::recipe_mismatch(why),
        None if health.all_up() && !draining.is_empty() => Refusal::draining(format!(
            "shard {} is draining (going away) and takes no new session",
            draining.join(", ")
        )),
        None => Refusal::shard_failed(
            &health.down().join(", "),
            "the shard is down; retry when it is back",
        ),
    }
}

impl Runner {
    pub fn new(p: RunnerParts) -> Runner {
        let mut scheduler = Scheduler::new(p.config.scheduler);
        let draft_ready = Arc::new(tokio::sync::Notify::new());
        if let Some(draft) = p.draft {
            let ready = Arc::clone(&draft_ready);
            scheduler.use_draft_model(draft, Arc::new(move || ready.notify_one()));
        }
        Runner {
            draft_ready,
            table: p.replicas,
            retired: false,
            commands_closed: false,
            name: p.name,
            failover: p.failover,
            load: p.load,
            prefixes: p.prefixes,
            pace: p.pace,
            route_up: p.route_up,
            admission: p.admission,
            ledger: p.ledger,
            scheduler,
            config: p.config,
            cluster: p.cluster,
            tokenizer: p.tokenizer,
            metrics: p.metrics,
            health: p.health,
            live: HashMap::new(),
            epoch: 0,
            link: None,
            in_flight: VecDeque::new(),
            down_reason: Some(Refusal::unavailable("the route is starting")),
            next_attempt: Instant::now(),
            last_heard: Instant::now(),
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
            while !self.commands_closed {
                match commands.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => self.close_commands(),
                }
            }
            self.drop_disconnected();
            self.leave_draining_shard();
            // Retired and empty: stop once the shards were told to release (or the link is
            // gone, whose close releases everything it opened).
            if self.retired
                && self.live.is_empty()
                && (self.scheduler.is_idle() || self.link.is_none())
            {
                tracing::info!(route = %self.name, "retired route stopped");
                // Its gauges read zero first (nothing is active, nothing waits), then every
                // series of the route goes.
                self.publish_gauges();
                self.metrics.set("strata_route_up", &[], 0.0);
                self.metrics.forget_scope();
                return;
            }
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
            self.publish_gauges();
            self.publish_route_state();
            match self.wait(&mut commands).await {
                Waited::Closed => self.close_commands(),
                Waited::Command(c) => self.handle(c),
                Waited::Idle => {}
                Waited::Timeout => self.silent_route().await,
                Waited::Upstream(reply) => self.on_upstream(reply),
                Waited::Direct(reply) => self.on_direct(reply),
            }
        }
    }

    /// A shard of the route drains (SIGTERM): while another route of the model takes work,
    /// the sessions move there now instead of holding the shard until they finish.
    fn leave_draining_shard(&mut self) {
        if self.live.is_empty() || self.failover.is_none() || !self.health.borrow().any_draining() {
            return;
        }
        if self
            .table
            .another_takes_work(&self.cluster.model_digest, &self.name)
        {
            let draining = self.health.borrow().draining();
            self.route_failed(Refusal::draining(format!(
                "shard {} is draining",
                draining.join(", ")
            )));
        }
    }

    /// No handle can send commands any more: the sessions it holds finish, then it stops.
    fn close_commands(&mut self) {
        self.commands_closed = true;
        self.retired = true;
    }

    /// Whether the route can take work: open end to end and every shard answering its
    /// probes as what it was validated to be. `/health`, `strata_route_up` and the start-up
    /// wait all read this one value.
    fn publish_route_state(&self) {
        let up = self.link.is_some() && self.health.borrow().serving();
        self.metrics
            .set("strata_route_up", &[], if up { 1.0 } else { 0.0 });
        self.route_up
            .send_if_modified(|was| std::mem::replace(was, up) != up);
    }

    fn publish_gauges(&self) {
        self.publish_load();
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
    }

    fn publish_load(&self) {
        self.load
            .store(self.live.len(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits for the next thing to do: a command, a message on the route's streams, the
    /// route's silence running out while steps are in flight, or (idle) a health change or a
    /// short sleep. Messages come first: a reply that is in must never lose to a deadline.
    async fn wait(&mut self, commands: &mut mpsc::Receiver<Command>) -> Waited {
        // Liveness, not speed: the oldest step fails only when nothing has come back from the
        // route (reply, acknowledgement or progress) for `liveness`.
        let due = self
            .in_flight
            .front()
            .map(|oldest| oldest.sent.max(self.last_heard) + self.config.liveness);
        let idle_sleep = if self.scheduler.is_idle() {
            Duration::from_millis(100)
        } else {
            // Work held back (grading waiting out the gap after agent work) is looked at
            // again soon.
            Duration::from_millis(5)
        };
        let (upstream, direct) = match self.link.as_mut() {
            Some(link) => (Some(&mut link.upstream), link.direct.as_mut()),
            None => (None, None),
        };
        tokio::select! {
            biased;
            reply = next_of(upstream) => Waited::Upstream(reply),
            reply = next_of(direct) => Waited::Direct(reply),
            cmd = commands.recv(), if !self.commands_closed => cmd.map_or(Waited::Closed, Waited::Command),
            _ = sleep_until(due) => Waited::Timeout,
            _ = self.draft_ready.notified() => Waited::Idle,
            _ = self.health.changed(), if due.is_none() => Waited::Idle,
            _ = tokio::time::sleep(idle_sleep), if due.is_none() => Waited::Idle,
        }
    }

    /// The route said nothing for its liveness while a step was in flight: the shard that does
    /// not answer a probe is the one that failed.
    async fn silent_route(&mut self) {
        let culprit = self
            .cluster
            .first_unresponsive(Duration::from_millis(300))
            .await
            .unwrap_or_else(|| "on the route".to_string());
        let n_tokens = self.in_flight.front().map_or(0, |f| f.plan.n_tokens());
        self.route_failed(Refusal::shard_failed(
            &culprit,
            format!(
                "the route was silent for {} ms while a {n_tokens}-token step was in flight",
                self.config.liveness.as_millis()
            ),
        ));
    }

    /// A message on the first shard's stream: on a route of one shard the replies, else only
    /// failures and progress. An end or error of the stream is the first shard's failure.
    fn on_upstream(&mut self, reply: Option<Result<RouteReply, tonic::Status>>) {
        self.last_heard = Instant::now();
        let first = self.cluster.addresses()[0].clone();
        let replies_upstream = self.link.as_ref().is_some_and(|l| l.replies_upstream);
        match reply {
            Some(Ok(r)) if r.progress.is_some() => {}
            Some(Ok(r)) if r.step_error.is_some() || replies_upstream => self.on_reply(r),
            Some(Ok(r)) => self.route_failed(Refusal::shard_failed(
                &first,
                format!(
                    "an unexpected answer to step {} on the route stream",
                    r.step_id
                ),
            )),
            Some(Err(status)) => self.route_failed(link_refusal(&first, &status)),
            // The first shard closed the route stream (also when no step was in flight: the
            // route must be reopened before it is reported up or used).
            None => self.route_failed(Refusal::shard_failed(&first, "the route stream ended")),
        }
    }

    /// A message on the last shard's replies stream (a route of several shards).
    fn on_direct(&mut self, reply: Option<Result<RouteReply, tonic::Status>>) {
        self.last_heard = Instant::now();
        let last = self.cluster.addresses().last().cloned().unwrap_or_default();
        match reply {
            Some(Ok(r)) if r.progress.is_some() => {}
            Some(Ok(r)) => self.on_reply(r),
            Some(Err(status)) => self.route_failed(link_refusal(&last, &status)),
            None => {
                // The last shard's route ended because a shard before it closed it: the
                // upstream stream names that shard (or the route's silence runs out).
                if let Some(link) = self.link.as_mut() {
                    link.direct = None;
                }
            }
        }
    }

    /// A step's reply, or a failure of the whole route.
    fn on_reply(&mut self, reply: RouteReply) {
        if let Some(e) = &reply.step_error {
            // The route is broken: every session on it fails (route_failed resets them all).
            self.route_failed(e.refusal());
            return;
        }
        let Some(f) = self.in_flight.pop_front() else {
            let last = self.cluster.addresses().last().cloned().unwrap_or_default();
            self.route_failed(Refusal::shard_failed(
                &last,
                format!("a reply for step {} with no step in flight", reply.step_id),
            ));
            return;
        };
        if reply.step_id != f.plan.step_id {
            let last = self.cluster.addresses().last().cloned().unwrap_or_default();
            self.route_failed(Refusal::shard_failed(
                &last,
                format!(
                    "reply for step {} while step {} was the oldest in flight",
                    reply.step_id, f.plan.step_id
                ),
            ));
            return;
        }
        // One token of one session, alone on the route and answered: the route's time per
        // token, whatever else it may be asked to carry (a refused step answers sooner than a
        // computed one, and says nothing of the route's speed).
        let answered = |id: SessionId| {
            reply.errors.is_empty() && reply.outputs.iter().any(|o| o.session_id == id.0)
        };
        if f.alone
            && f.plan.items.len() == 1
            && f.plan.items[0].tokens.len() == 1
            && answered(f.plan.items[0].session)
        {
            let now = Instant::now();
            let round_trip = (now - f.sent).as_secs_f64();
            self.pace.observe(round_trip, now);
            if !reply.hops.is_empty() {
                let held: u64 = reply.hops.iter().map(|h| h.held_micros).sum();
                self.pace
                    .observe_messaging((round_trip - held as f64 / 1e6).max(0.0));
            }
            if let Some(pace) = self.pace.seconds(now) {
                self.metrics
                    .set("strata_route_token_interval_seconds", &[], pace);
            }
            let predicted = super::pace::Prediction::of(&self.health.borrow(), &self.pace, now);
            if let Some(p) = predicted.and_then(|p| p.seconds()) {
                self.metrics
                    .set("strata_route_predicted_token_seconds", &[], p);
            }
        }
        self.apply(f.plan, reply, f.sent);
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
        let step = self.to_wire(&plan);
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
            self.route_failed(Refusal::shard_failed(&shard, "the route stream closed"));
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
        // Prompt chunks sent while an earlier chunk of their session is still on the route
        // (pipelined prefill, the default).
        let pipelined = plan
            .items
            .iter()
            .filter(|i| {
                self.in_flight
                    .iter()
                    .any(|f| f.plan.items.iter().any(|o| o.session == i.session))
            })
            .count();
        if pipelined > 0 {
            self.metrics
                .inc("strata_pipelined_chunks_total", &[], pipelined as f64);
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
        if self.in_flight.is_empty() {
            // Silence is measured from the first step of a busy spell, not from long ago.
            self.last_heard = Instant::now();
        }
        self.in_flight.push_back(InFlight {
            alone: self.in_flight.is_empty(),
            plan,
            sent: Instant::now(),
        });
    }

    /// Opens the route when it is down and every shard answers again.
    async fn ensure_route(&mut self) {
        // A retired route is never reopened: it only finishes what it holds.
        if self.retired || self.link.is_some() || Instant::now() < self.next_attempt {
            return;
        }
        let health = self.health.borrow().clone();
        if !health.all_up() {
            if !health.shards.is_empty() {
                self.down_reason = Some(health_refusal(&health));
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
            }
            Err(e) => {
                self.down_reason = Some(e);
                self.next_attempt = Instant::now() + Duration::from_millis(250);
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                job,
                prefix_keys,
                events,
                accepted,
            } => self.submit(*job, prefix_keys, events, accepted),
            Command::Resume { moved, accepted } => self.resume(moved, accepted),
            Command::Cancel(id) => self.cancel(id),
            Command::Retire { move_sessions } => {
                tracing::info!(
                    route = %self.name,
                    sessions = self.live.len(),
                    move_sessions,
                    "route retired"
                );
                self.retired = true;
                if move_sessions && !self.live.is_empty() {
                    self.route_failed(Refusal::draining(format!(
                        "route {} left the registry",
                        self.name
                    )));
                }
            }
        }
    }

    fn to_wire(&self, plan: &engine::StepPlan) -> Step {
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
                        live.map(|l| l.sampling.clone())
                    } else {
                        None
                    },
                    n_top_logprobs: live.and_then(|l| l.logprobs).unwrap_or(0),
                    want_logprob: live.is_some_and(|l| l.logprobs.is_some()),
                    // Shards may take a prompt's positions from cached blocks of a shared
                    // prefix; a session being recomputed after a cache miss computes them.
                    reuse_prefix: item.tokens.len() > 1
                        && item.n_draft == 0
                        && live.is_some_and(|l| l.n_replays == 0),
                    prefix: Vec::new(),
                    n_draft: item.n_draft as u32,
                    cache_salt: live.map_or(0, |l| cache_salt(self.config.prefix_scope, l.tenant)),
                }
            })
            .collect();
        Step {
            step_id: plan.step_id,
            epoch: self.epoch,
            fragments,
            release: plan.release.iter().map(|s| s.0).collect(),
            activations: Vec::new(),
            liveness_ms: self.config.liveness.as_millis().min(u128::from(u32::MAX)) as u32,
            errors: Vec::new(),
            hops: Vec::new(),
        }
    }

    fn route_failed(&mut self, err: Refusal) {
        tracing::warn!(error = %err.message, "route failed");
        self.link = None;
        // The sessions the route was computing new positions of when it failed: only their
        // moves can be their own doing (a session that kills every route computing it).
        let new_ground: HashSet<SessionId> = self
            .in_flight
            .drain(..)
            .flat_map(|f| f.plan.items)
            .filter(|i| {
                self.live
                    .get(&i.session)
                    .is_some_and(|l| i.start_pos + i.tokens.len() > l.frontier)
            })
            .map(|i| i.session)
            .collect();
        self.publish_route_state();
        self.metrics
            .inc("strata_failures_total", &[("kind", err.reason.name())], 1.0);
        let mut known: HashMap<SessionId, (Vec<u32>, usize)> = self
            .scheduler
            .take_all()
            .into_iter()
            .map(|(id, tokens, left)| (id, (tokens, left)))
            .collect();
        let blamed = |id: SessionId| session::blames(&err, new_ground.contains(&id));
        for (id, mut l) in std::mem::take(&mut self.live) {
            self.admission.release(id);
            // With another route for the model, the session moves there and the client sees
            // nothing; a route failure is not the session's fault, a non-retryable refusal is
            // not a failure at all.
            match (&self.failover, known.remove(&id)) {
                (Some(tx), Some((tokens, max_new)))
                    if session::moves(&err, l.n_moves, blamed(id), max_new) =>
                {
                    l.n_moves += u32::from(blamed(id));
                    l.moved_at = Some(Instant::now());
                    self.metrics.inc(
                        "strata_migrations_total",
                        &[("reason", err.reason.name())],
                        1.0,
                    );
                    let moved = Moved {
                        live: l,
                        tokens,
                        max_new,
                        digest: self.cluster.model_digest.clone(),
                        from: self.name.clone(),
                        error: err.clone(),
                    };
                    if let Err(back) = tx.send(Box::new(moved)) {
                        back.0.fail(self.ledger.as_deref());
                    }
                }
                (failover, known) => {
                    tracing::warn!(
                        session = id.0,
                        replicas = failover.is_some(),
                        known = known.is_some(),
                        blamed_moves = l.n_moves,
                        "a session of the failed route fails with it"
                    );
                    let why = if !err.retryable() {
                        "final"
                    } else if blamed(id) && l.n_moves >= session::MAX_MOVES {
                        "moves_spent"
                    } else {
                        "unplaced"
                    };
                    self.metrics
                        .inc("strata_sessions_lost_total", &[("why", why)], 1.0);
                    self.settle(&l, "failed");
                    let _ = l.events.send(SessionEvent::Error(err.clone()));
                }
            }
        }
        self.down_reason = Some(err);
        self.next_attempt = Instant::now() + Duration::from_millis(200);
    }
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
