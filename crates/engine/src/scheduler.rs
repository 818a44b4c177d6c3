//! The step scheduler.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::draft::{DraftConfig, DraftKind, DraftLength, DraftPoll, DraftSource, NgramIndex, Wake};

/// Positions of a shard's KV block: the unit its prefix cache shares (`model::BLOCK_POSITIONS`;
/// the shard checks that they agree). A prefill chunk that stops before the prompt's end stops
/// on a multiple of it, so the next chunk starts where cached blocks can continue the session.
pub const KV_BLOCK_POSITIONS: usize = 16;

/// A session's id (unique per tracker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub u64);

/// Limits of one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens (decode + prefill) one step may carry.
    pub max_step_tokens: usize,
    /// Prefill tokens one session may take in one step.
    pub max_prefill_chunk: usize,
    /// Sessions that may be active (admitted to the route) at once.
    pub max_active: usize,
    /// Steps the caller keeps in flight at once (the route's length: while shard 2 computes one
    /// micro-batch, shard 1 computes the next). With more than one, a step takes at most its
    /// share (`active / depth`, rounded up) of the active sessions, so the sessions form that
    /// many micro-batches instead of one batch that leaves the other shards idle.
    pub pipeline_depth: usize,
    /// Active sessions grading work may hold; the rest of `max_active` stays free for agent work.
    pub grading_max_active: usize,
    /// Tokens grading work may take in one step while agent work runs or ran within
    /// `agent_guard`: a step agent work may have to wait behind stays short.
    pub grading_step_tokens: usize,
    pub agent_guard: Duration,
    /// For this long after agent work took part in a step, grading work is not started at
    /// all: an agent client's next call (typically milliseconds later) finds the route free.
    pub agent_gap: Duration,
    /// Grading work that got nothing for this long joins the next step even beside agent work
    /// (within `grading_step_tokens`), so it is never starved.
    pub grading_max_wait: Duration,
    /// While several owners (API keys) have prompts to prefill, one owner's prompts take at
    /// most this share of a step's tokens; what is left is then open to anyone.
    pub owner_step_share: f64,
    /// Speculation: decode steps carry tokens drafted from a session's own tokens, which the
    /// last shard verifies (see [`crate::draft`]).
    pub draft: DraftConfig,
    /// With more than one step in flight (`pipeline_depth` > 1), a prompt's next chunk goes
    /// while its earlier ones are still on the route: the first shard computes chunk k + 1
    /// while the second computes chunk k (shards take steps in order, so each chunk finds the
    /// KV of the ones before it).
    pub pipelined_prefill: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_step_tokens: 512,
            max_prefill_chunk: 512,
            max_active: 64,
            pipeline_depth: 1,
            grading_max_active: 48,
            grading_step_tokens: 8,
            agent_guard: Duration::from_secs(2),
            agent_gap: Duration::from_millis(50),
            grading_max_wait: Duration::from_secs(2),
            owner_step_share: 0.5,
            draft: DraftConfig::OFF,
            pipelined_prefill: false,
        }
    }
}

/// Priority class of a session: latency-critical agent work or background grading work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Agent,
    Grading,
}

impl Priority {
    pub const ALL: [Priority; 2] = [Priority::Agent, Priority::Grading];

    pub fn name(self) -> &'static str {
        match self {
            Priority::Agent => "agent",
            Priority::Grading => "grading",
        }
    }

    pub fn parse(s: &str) -> Option<Priority> {
        match s {
            "agent" => Some(Priority::Agent),
            "grading" => Some(Priority::Grading),
            _ => None,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One session's share of a step: tokens `start_pos..start_pos + tokens.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanItem {
    pub session: SessionId,
    pub start_pos: usize,
    pub tokens: Vec<u32>,
    /// The step ends this session's known tokens: sample the next one.
    pub want_output: bool,
    /// The last `n_draft` tokens are drafted, not known: the last shard samples after every
    /// position from the session's last known token on and keeps each drafted token only
    /// while it equals its own sample (a verification step).
    pub n_draft: usize,
}

impl PlanItem {
    /// The drafted tokens this item carries for verification.
    pub fn drafts(&self) -> &[u32] {
        &self.tokens[self.tokens.len() - self.n_draft.min(self.tokens.len())..]
    }
}

/// What to send down the route.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepPlan {
    pub step_id: u64,
    pub items: Vec<PlanItem>,
    /// Sessions every shard should forget.
    pub release: Vec<SessionId>,
}

impl StepPlan {
    pub fn n_tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens.len()).sum()
    }
}

/// Why a session ended: the one finish reason from the scheduler to the API's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// The caller ended it (end-of-sequence token, stop string).
    Stop,
    /// It ended by itself after calling tools (the API's reading of a `Stop` whose text held
    /// tool calls).
    ToolCalls,
}

impl FinishReason {
    /// The OpenAI spelling (`finish_reason`, metric labels).
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
        }
    }

    /// A session that called tools and ended by itself finished for `tool_calls`; one cut at
    /// its length stays `length`.
    pub fn with_calls(self, n_calls: usize) -> FinishReason {
        match self {
            FinishReason::Stop if n_calls > 0 => FinishReason::ToolCalls,
            other => other,
        }
    }
}

/// What happened to sessions as a result of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Token {
        session: SessionId,
        token: u32,
    },
    Finished {
        session: SessionId,
        reason: FinishReason,
    },
    /// A verification step kept `accepted` of the `drafted` tokens it carried (its tokens
    /// follow as `Token` events).
    Verified {
        session: SessionId,
        drafted: usize,
        accepted: usize,
    },
}

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    /// Positions whose results came back.
    n_computed: usize,
    /// Positions sent in some step (`n_computed` plus those in flight).
    n_planned: usize,
    n_prompt: usize,
    max_new: usize,
    /// The steps carrying this session, oldest first: one, except while consecutive chunks of
    /// its prompt are pipelined along the route.
    in_flight: VecDeque<u64>,
    priority: Priority,
    /// Who asked (an API key's id), for per-owner fairness.
    owner: u64,
    /// Its drafting state while it speculates.
    draft: Option<Drafting>,
}

/// A speculating session's drafting state: where its drafts come from and its next draft
/// length.
#[derive(Debug)]
struct Drafting {
    source: Source,
    length: DraftLength,
}

#[derive(Debug)]
enum Source {
    /// An n-gram index over its tokens.
    Ngram(NgramIndex),
    /// The route's draft model; since when the session waits for its draft.
    Model {
        waiting_since: Option<Instant>,
        max_wait: Duration,
    },
}

impl Drafting {
    fn new(config: &DraftConfig) -> Option<Drafting> {
        config.is_on().then(|| Drafting {
            source: match config.kind {
                DraftKind::Ngram => Source::Ngram(NgramIndex::new(config)),
                DraftKind::Model { max_wait } => Source::Model {
                    waiting_since: None,
                    max_wait,
                },
            },
            length: DraftLength::new(config.max_draft),
        })
    }
}

/// The route's draft model, and how it wakes the route's loop.
struct DraftModel {
    source: Arc<dyn DraftSource>,
    wake: Wake,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DraftModel")
    }
}

impl Entry {
    fn n_generated(&self) -> usize {
        self.tokens.len() - self.n_prompt
    }

    /// Tokens drafted to follow its last known token in its next decode step: at most
    /// `room` (what the step has left), and never past what it may still generate (its
    /// admission reserved that many positions). `None` while the draft model computes its
    /// draft (for at most the draft kind's `max_wait`): it decodes in a later step.
    fn drafts(
        &mut self,
        session: SessionId,
        room: usize,
        now: Instant,
        model: Option<&DraftModel>,
    ) -> Option<Vec<u32>> {
        let left = self.max_new.saturating_sub(self.n_generated() + 1);
        let Some(d) = &mut self.draft else {
            return Some(Vec::new());
        };
        let k = d.length.next().min(room).min(left);
        match &mut d.source {
            Source::Ngram(index) => {
                d.length.take();
                Some(index.draft(&self.tokens, k))
            }
            Source::Model {
                waiting_since,
                max_wait,
            } => {
                let poll = match model {
                    Some(m) if k > 0 => m.source.poll(session, &self.tokens, k, &m.wake),
                    _ => DraftPoll::Ready(Vec::new()),
                };
                match poll {
                    DraftPoll::Pending
                        if now.saturating_duration_since(*waiting_since.get_or_insert(now))
                            < *max_wait =>
                    {
                        None
                    }
                    DraftPoll::Pending => {
                        *waiting_since = None;
                        d.length.take();
                        Some(Vec::new())
                    }
                    DraftPoll::Ready(mut t) => {
                        *waiting_since = None;
                        d.length.take();
                        t.truncate(k);
                        Some(t)
                    }
                }
            }
        }
    }

    /// Ends a wait for a draft model's draft (the session decodes without, or starts over).
    fn end_wait(&mut self) {
        if let Some(Drafting {
            source: Source::Model { waiting_since, .. },
            ..
        }) = &mut self.draft
        {
            *waiting_since = None;
        }
    }

    /// Its last known token awaits its one-position decode step.
    fn decodes(&self) -> bool {
        self.in_flight.is_empty()
            && self.n_computed >= self.n_prompt
            && self.n_computed + 1 == self.tokens.len()
    }

    /// Positions before its last known token remain to be computed: a prompt, or the known
    /// tokens of a replay, which may reach past the prompt (output recomputed after a cache
    /// miss goes chunk by chunk like a prompt).
    ///
    /// `step` may carry its next chunk: a session is never twice in one step, and with
    /// `pipelined` its next chunk may go while earlier ones are in flight.
    fn prefills(&self, step: u64, pipelined: bool) -> bool {
        self.n_planned < self.tokens.len()
            && !self.decodes()
            && (self.in_flight.is_empty() || pipelined && self.in_flight.back() != Some(&step))
    }
}

/// What every class's share of one step is held to.
#[derive(Debug, Clone, Copy)]
struct StepLimits {
    step_id: u64,
    max_sessions: usize,
    /// Decode items may carry drafted tokens (speculation is on and the batch is not full).
    draft: bool,
    now: Instant,
}

/// The scheduler: waiting sessions in arrival order per priority class, active sessions, steps
/// in flight.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    /// Indexed by [`Priority`].
    waiting: [VecDeque<SessionId>; 2],
    /// When agent work last took part in a step.
    last_agent: Option<Instant>,
    /// Since when grading work has been runnable without being served.
    grading_unserved_since: Option<Instant>,
    active: BTreeMap<SessionId, Entry>,
    pending_new: BTreeMap<SessionId, Entry>,
    in_flight: BTreeMap<u64, Vec<PlanItem>>,
    to_release: Vec<SessionId>,
    next_step: u64,
    /// Where drafts come from when the config's kind is [`DraftKind::Model`].
    draft_model: Option<DraftModel>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler {
            config,
            waiting: [VecDeque::new(), VecDeque::new()],
            last_agent: None,
            grading_unserved_since: None,
            active: BTreeMap::new(),
            pending_new: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            to_release: Vec::new(),
            next_step: 1,
            draft_model: None,
        }
    }

    /// Drafts of sessions come from `source` (with a [`DraftKind::Model`] config); `wake`
    /// is called when a draft a session waits for is ready.
    pub fn use_draft_model(&mut self, source: Arc<dyn DraftSource>, wake: Wake) {
        self.draft_model = Some(DraftModel { source, wake });
    }

    /// A session left: the draft model forgets it.
    fn forget_draft(&self, session: SessionId) {
        if let Some(m) = &self.draft_model {
            m.source.forget(session);
        }
    }

    /// Queues a session of `owner` with its prompt; it generates at most `max_new` tokens.
    pub fn add(
        &mut self,
        session: SessionId,
        prompt: Vec<u32>,
        max_new: usize,
        priority: Priority,
        owner: u64,
    ) {
        let n_prompt = prompt.len();
        self.pending_new.insert(
            session,
            Entry {
                tokens: prompt,
                n_computed: 0,
                n_planned: 0,
                n_prompt,
                max_new,
                in_flight: VecDeque::new(),
                priority,
                owner,
                draft: Drafting::new(&self.config.draft),
            },
        );
        self.waiting[priority.index()].push_back(session);
        self.activate();
    }

    /// Sessions waiting to become active, in every class.
    pub fn n_waiting(&self) -> usize {
        self.waiting.iter().map(VecDeque::len).sum()
    }

    /// Sessions of one class waiting to become active.
    pub fn n_waiting_of(&self, priority: Priority) -> usize {
        self.waiting[priority.index()].len()
    }

    /// Active sessions of one class.
    pub fn n_active_of(&self, priority: Priority) -> usize {
        self.active
            .values()
            .filter(|e| e.priority == priority)
            .count()
    }

    /// Moves waiting sessions to active while there is room: agent work first; grading work
    /// only within its own limit, so agent work always finds a free place.
    fn activate(&mut self) {
        while self.active.len() < self.config.max_active {
            let Some(id) = self.waiting[Priority::Agent.index()].pop_front() else {
                break;
            };
            if let Some(e) = self.pending_new.remove(&id) {
                self.active.insert(id, e);
            }
        }
        let mut n_grading = self.n_active_of(Priority::Grading);
        while self.active.len() < self.config.max_active
            && n_grading < self.config.grading_max_active
        {
            let Some(id) = self.waiting[Priority::Grading.index()].pop_front() else {
                break;
            };
            if let Some(e) = self.pending_new.remove(&id) {
                self.active.insert(id, e);
                n_grading += 1;
            }
        }
    }

    pub fn n_active(&self) -> usize {
        self.active.len()
    }

    pub fn is_idle(&self) -> bool {
        self.n_waiting() == 0 && self.active.is_empty() && self.to_release.is_empty()
    }

    /// Sessions known to the scheduler (waiting or active).
    pub fn contains(&self, session: SessionId) -> bool {
        self.active.contains_key(&session) || self.pending_new.contains_key(&session)
    }

    /// The next step at time `now`. Agent work first: its running sessions' decode tokens
    /// (each gets its one token), then its prefill chunks in arrival order within what is left
    /// of the token budget. Grading work then fills the step in the same order, except that
    /// it stays out of steps that carry agent work and out of the `agent_gap` after them
    /// (unless it has waited `grading_max_wait`), and takes at most `grading_step_tokens`
    /// while agent work is about. `None` when there is nothing to send now.
    pub fn schedule(&mut self, now: Instant) -> Option<StepPlan> {
        self.activate();
        let step_id = self.next_step;
        let mut budget = self.config.max_step_tokens;
        let mut items = Vec::new();
        let max_sessions = self
            .active
            .len()
            .div_ceil(self.config.pipeline_depth.max(1))
            .max(1);
        // A step whose decode work fills more than `max_batch` sessions drafts for none: a
        // full batch keeps the weights busy already.
        let n_decoding = self.active.values().filter(|e| e.decodes()).count();
        let limits = StepLimits {
            step_id,
            max_sessions,
            draft: self.config.draft.is_on()
                && n_decoding.min(max_sessions) <= self.config.draft.max_batch
                && (self.config.draft.kind == DraftKind::Ngram
                    || self.active.len() <= self.config.draft.max_batch),
            now,
        };
        self.take(Priority::Agent, limits, &mut budget, &mut items);
        let with_agent = !items.is_empty();
        if with_agent {
            self.last_agent = Some(now);
        }
        let agent_about = self.n_waiting_of(Priority::Agent) > 0
            || self.active.values().any(|e| e.priority == Priority::Agent)
            || self
                .last_agent
                .is_some_and(|t| now.saturating_duration_since(t) < self.config.agent_guard);
        let starving = self
            .grading_unserved_since
            .is_some_and(|t| now.saturating_duration_since(t) >= self.config.grading_max_wait);
        let in_gap = self
            .last_agent
            .is_some_and(|t| now.saturating_duration_since(t) < self.config.agent_gap);
        let n_before = items.len();
        if (!with_agent && !in_gap) || starving {
            let mut grading_budget = if agent_about {
                budget.min(self.config.grading_step_tokens)
            } else {
                budget
            };
            self.take(Priority::Grading, limits, &mut grading_budget, &mut items);
        }
        let grading_runnable = self.active.values().any(|e| {
            e.priority == Priority::Grading
                && (e.decodes() || e.prefills(step_id, self.pipelined()))
        }) || self.n_waiting_of(Priority::Grading) > 0;
        if items.len() > n_before || !grading_runnable {
            self.grading_unserved_since = None;
        } else if self.grading_unserved_since.is_none() {
            self.grading_unserved_since = Some(now);
        }
        let release = std::mem::take(&mut self.to_release);
        if items.is_empty() && release.is_empty() {
            return None;
        }
        self.next_step += 1;
        self.in_flight.insert(step_id, items.clone());
        Some(StepPlan {
            step_id,
            items,
            release,
        })
    }

    /// A prompt's chunks may go along the route one after another without waiting.
    fn pipelined(&self) -> bool {
        self.config.pipelined_prefill && self.config.pipeline_depth > 1
    }

    /// Adds one class's decode work to a step: every session whose prompt is computed and
    /// whose last token awaits computing, with drafted tokens after it when the step drafts.
    fn take_decodes(
        &mut self,
        priority: Priority,
        limits: StepLimits,
        budget: &mut usize,
        items: &mut Vec<PlanItem>,
    ) {
        let model = self.draft_model.as_ref();
        for (&id, e) in self.active.iter_mut() {
            if *budget == 0 || items.len() >= limits.max_sessions {
                break;
            }
            if e.priority != priority || !e.decodes() {
                continue;
            }
            let mut tokens = vec![e.tokens[e.n_computed]];
            if limits.draft {
                let Some(drafts) = e.drafts(id, *budget - 1, limits.now, model) else {
                    continue;
                };
                tokens.extend(drafts);
            } else {
                e.end_wait();
            }
            *budget -= tokens.len();
            items.push(PlanItem {
                session: id,
                start_pos: e.n_computed,
                n_draft: tokens.len() - 1,
                tokens,
                want_output: true,
            });
            e.in_flight.push_back(limits.step_id);
            e.n_planned = e.tokens.len();
        }
    }

    /// Adds one class's work to a step: decode tokens first (with drafted tokens when the
    /// step drafts), then prefill chunks oldest first, within `budget` tokens and the limits'
    /// `max_sessions` items in all.
    fn take(
        &mut self,
        priority: Priority,
        limits: StepLimits,
        budget: &mut usize,
        items: &mut Vec<PlanItem>,
    ) {
        self.take_decodes(priority, limits, budget, items);
        let StepLimits {
            step_id,
            max_sessions,
            ..
        } = limits;
        // Prefill, oldest first (ids grow with arrival). While several owners have prompts
        // waiting, a first pass holds each to its share of the step; a second pass hands what
        // is left to anyone, so no token of the budget is wasted.
        let pipelined = self.pipelined();
        let prefill: Vec<SessionId> = self
            .active
            .iter()
            .filter(|(_, e)| e.priority == priority && e.prefills(step_id, pipelined))
            .map(|(&id, _)| id)
            .collect();
        let mut owners: Vec<u64> = prefill.iter().map(|id| self.active[id].owner).collect();
        owners.sort_unstable();
        owners.dedup();
        let share = ((self.config.max_step_tokens as f64 * self.config.owner_step_share).ceil()
            as usize)
            .max(1);
        let mut used: HashMap<u64, usize> = HashMap::new();
        for item in items.iter() {
            if let Some(e) = self.active.get(&item.session) {
                *used.entry(e.owner).or_default() += item.tokens.len();
            }
        }
        let passes: &[bool] = if owners.len() > 1 {
            &[true, false]
        } else {
            &[false]
        };
        for &capped in passes {
            for &id in &prefill {
                if *budget == 0 || items.len() >= max_sessions {
                    break;
                }
                let e = self.active.get_mut(&id).expect("listed above");
                if !e.prefills(step_id, pipelined) {
                    continue;
                }
                let room = if capped {
                    share.saturating_sub(used.get(&e.owner).copied().unwrap_or(0))
                } else {
                    usize::MAX
                };
                let mut n = (e.tokens.len() - e.n_planned)
                    .min(*budget)
                    .min(self.config.max_prefill_chunk)
                    .min(room);
                // A chunk short of the prompt's end ends on a KV block's boundary where it
                // can: a cached prefix is taken whole blocks at a time. One that cannot (less
                // budget than a block) takes the leading positions of a cached block, and the
                // next chunk takes that block up again (the model's `KvPool::attach`).
                let aligned = (e.n_planned + n) / KV_BLOCK_POSITIONS * KV_BLOCK_POSITIONS;
                if e.n_planned + n < e.tokens.len() && aligned > e.n_planned {
                    n = aligned - e.n_planned;
                }
                if n == 0 {
                    continue;
                }
                let end = e.n_planned + n;
                items.push(PlanItem {
                    session: id,
                    start_pos: e.n_planned,
                    tokens: e.tokens[e.n_planned..end].to_vec(),
                    want_output: end == e.tokens.len(),
                    n_draft: 0,
                });
                e.in_flight.push_back(step_id);
                e.n_planned = end;
                *used.entry(e.owner).or_default() += n;
                *budget -= n;
            }
        }
    }

    /// Applies a step's result: `outputs` are sampled tokens in the order they were sampled
    /// (a verification step's session has one per position sampled), `failed` the sessions
    /// whose fragment was refused (they are removed; the caller reports why). Returns the
    /// events.
    pub fn update_from_output(
        &mut self,
        step_id: u64,
        outputs: &[(SessionId, u32)],
        failed: &[SessionId],
    ) -> Vec<Event> {
        let mut events = Vec::new();
        let Some(items) = self.in_flight.remove(&step_id) else {
            return events;
        };
        for item in items {
            if failed.contains(&item.session) {
                self.remove(item.session);
                continue;
            }
            let Some(e) = self.active.get_mut(&item.session) else {
                continue;
            };
            // Replies come in order, so a step the session still counts is its oldest; one it
            // no longer counts was sent before a replay reset it.
            if e.in_flight.front() != Some(&step_id) {
                continue;
            }
            e.in_flight.pop_front();
            let drafts = item.drafts();
            let sampled: Vec<u32> = outputs
                .iter()
                .filter(|(s, _)| *s == item.session)
                .map(|&(_, t)| t)
                .collect();
            // Drafted positions count while their token equals the sample before it; the
            // samples past the first that differs mean nothing.
            let accepted = sampled
                .iter()
                .zip(drafts)
                .take_while(|(s, d)| s == d)
                .count();
            e.n_computed = item.start_pos + item.tokens.len() - drafts.len() + accepted;
            if !item.want_output || sampled.is_empty() {
                continue;
            }
            if !drafts.is_empty() {
                if let Some(d) = &mut e.draft {
                    d.length.verified(drafts.len(), accepted);
                }
                events.push(Event::Verified {
                    session: item.session,
                    drafted: drafts.len(),
                    accepted,
                });
            }
            for &token in &sampled[..=accepted.min(sampled.len() - 1)] {
                e.tokens.push(token);
                events.push(Event::Token {
                    session: item.session,
                    token,
                });
                if e.n_generated() >= e.max_new {
                    events.push(Event::Finished {
                        session: item.session,
                        reason: FinishReason::Length,
                    });
                    self.finish(item.session);
                    break;
                }
            }
        }
        events
    }

    /// Stops drafting for one session (it opted out, or its sampling needs what a
    /// verification step cannot do).
    pub fn no_drafts(&mut self, session: SessionId) {
        for e in [
            self.active.get_mut(&session),
            self.pending_new.get_mut(&session),
        ]
        .into_iter()
        .flatten()
        {
            e.draft = None;
        }
        self.forget_draft(session);
    }

    /// Whether `step` carried a fragment of `session` that no longer counts: the session was
    /// reset by [`Scheduler::replay`] while the step was in flight, so what a shard answered
    /// for it (typically `cache_miss` again, for the positions after the forgotten ones) is
    /// about positions that will be sent again.
    pub fn is_stale(&self, session: SessionId, step: u64) -> bool {
        self.active
            .get(&session)
            .is_some_and(|e| !e.in_flight.contains(&step))
    }

    /// Recomputes a session from position 0: its known tokens (prompt and output so far) are
    /// prefilled again, then decoding resumes. Used when a shard lost its cache (`cache_miss`).
    /// Returns false for a session that is not active.
    pub fn replay(&mut self, session: SessionId) -> bool {
        match self.active.get_mut(&session) {
            Some(e) => {
                e.n_computed = 0;
                e.n_planned = 0;
                e.in_flight.clear();
                e.end_wait();
                true
            }
            None => false,
        }
    }

    /// Ends a session normally; shards are told to release it with the next plan.
    pub fn finish(&mut self, session: SessionId) {
        if self.active.remove(&session).is_some() {
            self.to_release.push(session);
            self.forget_draft(session);
        }
    }

    /// Cancels a session wherever it is.
    pub fn abort(&mut self, session: SessionId) {
        if let Some(e) = self.pending_new.remove(&session) {
            self.waiting[e.priority.index()].retain(|s| *s != session);
            self.forget_draft(session);
            return;
        }
        self.finish(session);
    }

    fn remove(&mut self, session: SessionId) {
        self.active.remove(&session);
        self.to_release.push(session);
        self.forget_draft(session);
    }

    /// Drops everything (the route broke) and says, for every session that was waiting or
    /// active, the tokens it knows (prompt and generated, in order) and how many it may still
    /// generate: what another route needs to continue it.
    pub fn take_all(&mut self) -> Vec<(SessionId, Vec<u32>, usize)> {
        let mut out: Vec<(SessionId, Vec<u32>, usize)> = std::mem::take(&mut self.active)
            .into_iter()
            .chain(std::mem::take(&mut self.pending_new))
            .map(|(id, e)| {
                let left = e.max_new.saturating_sub(e.n_generated());
                (id, e.tokens, left)
            })
            .collect();
        out.sort_by_key(|(id, _, _)| *id);
        for (id, _, _) in &out {
            self.forget_draft(*id);
        }
        self.reset();
        out
    }

    /// Drops everything (the route broke): returns every session that was waiting or active.
    pub fn reset(&mut self) -> Vec<SessionId> {
        let mut all: Vec<SessionId> = self.active.keys().copied().collect();
        for w in &mut self.waiting {
            all.extend(w.drain(..));
        }
        for &session in &all {
            self.forget_draft(session);
        }
        self.active.clear();
        self.pending_new.clear();
        self.in_flight.clear();
        self.to_release.clear();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_step_tokens: usize, chunk: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_step_tokens,
            max_prefill_chunk: chunk,
            max_active: 64,
            pipeline_depth: 1,
            ..SchedulerConfig::default()
        }
    }

    /// Runs a step with a fake model that always samples `7`.
    fn run(s: &mut Scheduler) -> (StepPlan, Vec<Event>) {
        run_at(s, Instant::now())
    }

    /// A replay of more known tokens than one chunk holds goes chunk by chunk to the end, then
    /// decodes (its later chunks lie past the prompt, where only a decode step used to look:
    /// such a session stalled, neither prefilling nor decoding).
    #[test]
    fn a_replay_longer_than_a_chunk_goes_on_past_the_prompt() {
        let mut s = Scheduler::new(cfg(4, 4));
        s.add(SessionId(1), vec![1, 2], 20, Priority::Agent, 0);
        for _ in 0..7 {
            run(&mut s);
        }
        // 2 prompt tokens and 7 generated: 9 known, recomputed in chunks of 4, 4 and 1.
        assert!(s.replay(SessionId(1)));
        let mut spans = Vec::new();
        for _ in 0..4 {
            let (p, _) = run(&mut s);
            let i = &p.items[0];
            spans.push((i.start_pos, i.tokens.len(), i.want_output));
        }
        assert_eq!(
            spans,
            vec![(0, 4, false), (4, 4, false), (8, 1, true), (9, 1, true)]
        );
    }

    /// [`run`] at a given time.
    fn run_at(s: &mut Scheduler, now: Instant) -> (StepPlan, Vec<Event>) {
        let plan = s.schedule(now).expect("work to do");
        let outputs: Vec<(SessionId, u32)> = plan
            .items
            .iter()
            .filter(|i| i.want_output)
            .map(|i| (i.session, 7))
            .collect();
        let events = s.update_from_output(plan.step_id, &outputs, &[]);
        (plan, events)
    }

    /// With a pipeline of two, decoders split into two micro-batches that alternate: each step
    /// takes the half not in flight, every session advances once per two steps, and no session
    /// is ever in two steps at once.
    #[test]
    fn take_all_says_what_each_session_knows_and_may_still_generate() {
        let mut s = Scheduler::new(cfg(64, 64));
        s.add(SessionId(1), vec![1, 2, 3], 5, Priority::Agent, 0);
        let plan = s.schedule(Instant::now()).unwrap();
        s.update_from_output(plan.step_id, &[(SessionId(1), 9)], &[]);
        let plan = s.schedule(Instant::now()).unwrap();
        s.update_from_output(plan.step_id, &[(SessionId(1), 8)], &[]);
        // Waiting behind the active place limit of none: still pending.
        s.add(SessionId(2), vec![4], 7, Priority::Grading, 0);
        let taken = s.take_all();
        assert_eq!(
            taken,
            vec![
                (SessionId(1), vec![1, 2, 3, 9, 8], 3),
                (SessionId(2), vec![4], 7)
            ]
        );
        assert!(s.is_idle() && s.schedule(Instant::now()).is_none());
    }

    #[test]
    fn a_pipeline_splits_decoders_into_alternating_micro_batches() {
        let mut s = Scheduler::new(SchedulerConfig {
            pipeline_depth: 2,
            ..cfg(64, 64)
        });
        for i in 0..8 {
            s.add(SessionId(i), vec![1, 2], 100, Priority::Agent, 0);
        }
        // Prefill in two micro-batches, then decode.
        let a = s.schedule(Instant::now()).unwrap();
        let b = s.schedule(Instant::now()).unwrap();
        assert_eq!((a.items.len(), b.items.len()), (4, 4));
        assert!(
            s.schedule(Instant::now()).is_none(),
            "everyone is in flight"
        );
        let mut in_flight = std::collections::VecDeque::from([a, b]);
        for _ in 0..10 {
            let done = in_flight.pop_front().unwrap();
            let outs: Vec<(SessionId, u32)> = done.items.iter().map(|i| (i.session, 5)).collect();
            s.update_from_output(done.step_id, &outs, &[]);
            let next = s.schedule(Instant::now()).unwrap();
            let mut got: Vec<SessionId> = next.items.iter().map(|i| i.session).collect();
            let mut want: Vec<SessionId> = done.items.iter().map(|i| i.session).collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "the returned micro-batch goes again");
            for other in &in_flight {
                assert!(other.items.iter().all(|i| !got.contains(&i.session)));
            }
            in_flight.push_back(next);
        }
    }

    /// With 392-token steps (a shard's scratch budget allows no more) a 1000-token prompt goes
    /// in chunks that end on KV block boundaries (384, 768), the last at the prompt's end;
    /// beside a decode token the chunk still ends on a boundary.
    #[test]
    fn prefill_chunks_short_of_the_end_stop_on_kv_block_boundaries() {
        let mut s = Scheduler::new(cfg(392, 392));
        s.add(SessionId(1), (0..1000).collect(), 2, Priority::Agent, 0);
        let mut ends = Vec::new();
        for _ in 0..3 {
            let (p, _) = run(&mut s);
            ends.push(p.items[0].start_pos + p.items[0].tokens.len());
        }
        assert_eq!(ends, vec![384, 768, 1000]);
        // Session 2 decodes (one token of the step) while session 3 prefills.
        s.add(SessionId(3), (0..500).collect(), 2, Priority::Agent, 0);
        let (p, _) = run(&mut s);
        let chunk = p.items.iter().find(|i| i.session == SessionId(3)).unwrap();
        assert_eq!(p.items.len(), 2, "a decode and a chunk");
        assert_eq!(chunk.start_pos + chunk.tokens.len(), 384);
        // A step of fewer positions than a block still moves on.
        let mut s = Scheduler::new(cfg(5, 5));
        s.add(SessionId(1), (0..12).collect(), 1, Priority::Agent, 0);
        let (p, _) = run(&mut s);
        assert_eq!(p.items[0].tokens.len(), 5);
    }

    #[test]
    fn prompt_is_chunked_then_decoded_until_max_tokens() {
        let mut s = Scheduler::new(cfg(4, 4));
        s.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
        let (p, e) = run(&mut s);
        assert_eq!(
            (
                p.items[0].start_pos,
                p.items[0].tokens.len(),
                p.items[0].want_output
            ),
            (0, 4, false)
        );
        assert!(e.is_empty());
        run(&mut s);
        let (p, e) = run(&mut s);
        assert_eq!(
            (
                p.items[0].start_pos,
                p.items[0].tokens.len(),
                p.items[0].want_output
            ),
            (8, 2, true)
        );
        assert_eq!(
            e,
            vec![Event::Token {
                session: SessionId(1),
                token: 7
            }]
        );
        let (p, _) = run(&mut s);
        assert_eq!(
            (p.items[0].start_pos, p.items[0].tokens.clone()),
            (10, vec![7])
        );
        let (_, e) = run(&mut s);
        assert!(e.contains(&Event::Finished {
            session: SessionId(1),
            reason: FinishReason::Length
        }));
        let p = s.schedule(Instant::now()).unwrap();
        assert_eq!(p.release, vec![SessionId(1)]);
        assert!(p.items.is_empty());
        assert!(s.is_idle());
    }

    #[test]
    fn a_long_prompt_does_not_stop_decoders_from_advancing_every_step() {
        let mut s = Scheduler::new(cfg(8, 8));
        s.add(SessionId(1), vec![1, 2], 100, Priority::Agent, 0);
        run(&mut s);
        s.add(SessionId(2), (0..1000).collect(), 1, Priority::Agent, 0);
        for _ in 0..20 {
            let (p, _) = run(&mut s);
            assert!(
                p.items
                    .iter()
                    .any(|i| i.session == SessionId(1) && i.tokens.len() == 1),
                "decoder skipped"
            );
            assert!(p.n_tokens() <= 8);
        }
    }

    #[test]
    fn decoders_do_not_stop_a_prompt_from_making_progress() {
        let mut s = Scheduler::new(cfg(8, 8));
        for id in 1..=6 {
            s.add(SessionId(id), vec![1], 1000, Priority::Agent, 0);
        }
        run(&mut s);
        s.add(SessionId(99), (0..40).collect(), 1, Priority::Agent, 0);
        let mut prefilled = 0;
        for _ in 0..30 {
            let (p, _) = run(&mut s);
            prefilled += p
                .items
                .iter()
                .filter(|i| i.session == SessionId(99))
                .map(|i| i.tokens.len())
                .sum::<usize>();
        }
        assert_eq!(prefilled, 40);
    }

    #[test]
    fn aborting_a_running_session_releases_it_on_the_next_plan() {
        let mut s = Scheduler::new(cfg(16, 16));
        s.add(SessionId(1), vec![1, 2, 3], 10, Priority::Agent, 0);
        s.add(SessionId(2), vec![4, 5], 10, Priority::Agent, 0);
        run(&mut s);
        s.abort(SessionId(1));
        let p = s.schedule(Instant::now()).unwrap();
        assert_eq!(p.release, vec![SessionId(1)]);
        assert!(p.items.iter().all(|i| i.session == SessionId(2)));
    }

    #[test]
    fn a_refused_fragment_removes_only_its_session() {
        let mut s = Scheduler::new(cfg(16, 16));
        s.add(SessionId(1), vec![1, 2, 3], 10, Priority::Agent, 0);
        s.add(SessionId(2), vec![4, 5], 10, Priority::Agent, 0);
        let p = s.schedule(Instant::now()).unwrap();
        let ev = s.update_from_output(p.step_id, &[(SessionId(2), 9)], &[SessionId(1)]);
        assert_eq!(
            ev,
            vec![Event::Token {
                session: SessionId(2),
                token: 9
            }]
        );
        assert!(!s.contains(SessionId(1)));
        assert!(s.contains(SessionId(2)));
    }

    #[test]
    fn a_replayed_session_prefills_all_its_known_tokens_then_decodes_on() {
        let mut s = Scheduler::new(cfg(64, 64));
        s.add(SessionId(1), vec![1, 2, 3], 5, Priority::Agent, 0);
        run(&mut s);
        run(&mut s);
        // Known: 3 prompt tokens + 2 generated (7, 7); the shard lost them.
        assert!(s.replay(SessionId(1)));
        let (p, e) = run(&mut s);
        assert_eq!(p.items[0].start_pos, 0);
        assert_eq!(p.items[0].tokens, vec![1, 2, 3, 7, 7]);
        assert!(p.items[0].want_output);
        assert_eq!(
            e,
            vec![Event::Token {
                session: SessionId(1),
                token: 7
            }]
        );
        let (p, _) = run(&mut s);
        assert_eq!((p.items[0].start_pos, p.items[0].tokens.len()), (5, 1));
        assert!(!s.replay(SessionId(99)));
    }

    /// Runs one step at `now` with a fake model sampling `7`; returns the sessions in it.
    fn step_at(s: &mut Scheduler, now: Instant) -> Vec<(SessionId, usize)> {
        let (plan, _) = run_at(s, now);
        plan.items
            .iter()
            .map(|i| (i.session, i.tokens.len()))
            .collect()
    }

    fn classes() -> SchedulerConfig {
        SchedulerConfig {
            max_active: 4,
            grading_max_active: 3,
            grading_step_tokens: 4,
            agent_guard: Duration::from_secs(2),
            agent_gap: Duration::from_millis(50),
            grading_max_wait: Duration::from_secs(5),
            ..cfg(64, 64)
        }
    }

    /// Agent work takes the place grading work cannot hold, and while it runs grading work
    /// stays out of its steps; grading resumes, capped, once the agent work is done, and at
    /// full speed once the guard has passed.
    #[test]
    fn agent_work_preempts_grading_work_which_waits_and_then_resumes() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(classes());
        for i in 0..5 {
            s.add(SessionId(i), vec![1; 100], 3, Priority::Grading, 0);
        }
        assert_eq!(
            s.n_active_of(Priority::Grading),
            3,
            "grading keeps a place free"
        );
        assert_eq!(s.n_waiting_of(Priority::Grading), 2);
        let first = step_at(&mut s, t0);
        assert_eq!(
            first,
            vec![(SessionId(0), 64)],
            "no agent about: the whole budget"
        );
        s.add(SessionId(10), vec![1; 6], 3, Priority::Agent, 0);
        assert_eq!(
            s.n_active_of(Priority::Agent),
            1,
            "agent work starts at once"
        );
        let mut now = t0;
        // One prefill step and two decode steps: three tokens.
        for _ in 0..3 {
            now += Duration::from_millis(10);
            let items = step_at(&mut s, now);
            assert_eq!(
                items.iter().map(|i| i.0).collect::<Vec<_>>(),
                vec![SessionId(10)]
            );
        }
        assert_eq!(
            s.n_active_of(Priority::Agent),
            0,
            "the agent session finished"
        );
        // Right after agent work, grading waits for the gap (the agent's next call may come).
        now += Duration::from_millis(10);
        let held = s
            .schedule(now)
            .expect("the finished agent session's release");
        assert!(held.items.is_empty(), "{held:?}");
        assert!(s.schedule(now + Duration::from_millis(5)).is_none());
        // Within the guard, grading steps are capped.
        now += Duration::from_millis(100);
        let capped = step_at(&mut s, now);
        assert!(capped.iter().map(|i| i.1).sum::<usize>() <= 4, "{capped:?}");
        // After it, grading takes the whole budget.
        now += Duration::from_secs(3);
        let full = step_at(&mut s, now);
        assert!(full.iter().map(|i| i.1).sum::<usize>() > 4, "{full:?}");
    }

    /// A stream of agent work never starves grading work: it joins a step (capped) each time
    /// it has waited `grading_max_wait`, and every grading session completes.
    #[test]
    fn grading_work_is_never_starved_by_continuous_agent_work() {
        let mut s = Scheduler::new(classes());
        let mut now = Instant::now();
        s.add(SessionId(1), vec![1; 4], 2, Priority::Grading, 0);
        s.add(SessionId(100), vec![1], 1_000_000, Priority::Agent, 0);
        let mut grading_steps = Vec::new();
        for n in 0..2000 {
            now += Duration::from_millis(20);
            let items = step_at(&mut s, now);
            assert!(
                items.iter().any(|i| i.0 == SessionId(100)),
                "agent decodes every step"
            );
            let grading: usize = items
                .iter()
                .filter(|i| i.0 == SessionId(1))
                .map(|i| i.1)
                .sum();
            assert!(grading <= 4);
            if grading > 0 {
                grading_steps.push(n);
            }
            if !s.contains(SessionId(1)) {
                break;
            }
        }
        assert!(
            !s.contains(SessionId(1)),
            "grading completed: served at steps {grading_steps:?}"
        );
        // Served once per 5 s of waiting (250 steps of 20 ms), not earlier.
        assert!(grading_steps[0] >= 249, "{grading_steps:?}");
    }

    /// While two owners have prompts waiting, neither takes more than its share of a step;
    /// alone, an owner takes the whole step.
    #[test]
    fn one_owner_cannot_take_more_than_its_share_of_a_step() {
        let mut s = Scheduler::new(cfg(64, 64));
        for i in 0..3 {
            s.add(SessionId(i), vec![1; 100], 1, Priority::Agent, 7);
        }
        s.add(SessionId(10), vec![1; 100], 1, Priority::Agent, 8);
        let plan = s.schedule(Instant::now()).unwrap();
        let by = |owner_ids: &[u64]| -> usize {
            plan.items
                .iter()
                .filter(|i| owner_ids.contains(&i.session.0))
                .map(|i| i.tokens.len())
                .sum()
        };
        assert_eq!(by(&[0, 1, 2]), 32, "owner 7 is held to half: {plan:?}");
        assert_eq!(by(&[10]), 32, "owner 8 gets its half");
        let mut alone = Scheduler::new(cfg(64, 64));
        alone.add(SessionId(1), vec![1; 100], 1, Priority::Agent, 7);
        alone.add(SessionId(2), vec![1; 100], 1, Priority::Agent, 7);
        let plan = alone.schedule(Instant::now()).unwrap();
        assert_eq!(plan.n_tokens(), 64, "alone, an owner uses the whole step");
    }

    /// On a pipeline (a route of several shards) a long prompt's chunks go one step after
    /// another without waiting for the earlier ones' replies, in order and never two in one
    /// step; on a one-stage route a session is in one step at a time.
    #[test]
    fn a_pipeline_sends_a_long_prompts_chunks_without_waiting() {
        let mut s = Scheduler::new(SchedulerConfig {
            pipeline_depth: 2,
            pipelined_prefill: true,
            ..cfg(4, 4)
        });
        s.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
        let a = s.schedule(Instant::now()).unwrap();
        let b = s.schedule(Instant::now()).unwrap();
        let c = s.schedule(Instant::now()).unwrap();
        let span = |p: &StepPlan| {
            let i = &p.items[0];
            (i.start_pos, i.tokens.len(), i.want_output)
        };
        assert_eq!(
            [span(&a), span(&b), span(&c)],
            [(0, 4, false), (4, 4, false), (8, 2, true)]
        );
        assert!(
            s.schedule(Instant::now()).is_none(),
            "the whole prompt is sent; decoding waits for its last chunk"
        );
        assert!(s.update_from_output(a.step_id, &[], &[]).is_empty());
        assert!(s.update_from_output(b.step_id, &[], &[]).is_empty());
        assert!(s.schedule(Instant::now()).is_none());
        let e = s.update_from_output(c.step_id, &[(SessionId(1), 7)], &[]);
        assert_eq!(e.len(), 1);
        let d = s.schedule(Instant::now()).unwrap();
        assert_eq!(span(&d), (10, 1, true));

        let mut one = Scheduler::new(cfg(4, 4));
        one.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
        one.schedule(Instant::now()).unwrap();
        assert!(one.schedule(Instant::now()).is_none());
    }

    /// A cache miss on chunk k resets the session while chunk k + 1 is in flight: that step
    /// is stale for it (whatever a shard answered), its reply changes nothing, and the replay
    /// sends every position again from 0.
    #[test]
    fn a_replay_makes_the_chunks_in_flight_stale() {
        let mut s = Scheduler::new(SchedulerConfig {
            pipeline_depth: 2,
            pipelined_prefill: true,
            ..cfg(4, 4)
        });
        s.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
        let a = s.schedule(Instant::now()).unwrap();
        let b = s.schedule(Instant::now()).unwrap();
        assert!(!s.is_stale(SessionId(1), a.step_id) && !s.is_stale(SessionId(1), b.step_id));
        s.update_from_output(a.step_id, &[], &[]);
        assert!(s.replay(SessionId(1)));
        assert!(s.is_stale(SessionId(1), b.step_id));
        let r = s.schedule(Instant::now()).unwrap();
        assert_eq!((r.items[0].start_pos, r.items[0].tokens.len()), (0, 4));
        s.update_from_output(b.step_id, &[], &[]);
        let n = s.schedule(Instant::now()).unwrap();
        assert_eq!(
            (n.items[0].start_pos, n.items[0].tokens.len()),
            (4, 4),
            "the stale reply moved nothing"
        );
        assert!(!s.is_stale(SessionId(1), r.step_id));
        assert!(
            !s.is_stale(SessionId(9), r.step_id),
            "unknown sessions are not stale"
        );
    }

    /// A fake model whose next token is a function of the history alone: mostly it repeats
    /// what came 5 tokens before (so n-gram drafts often hold), and now and then it does not
    /// (so they are rejected too).
    fn next_of(history: &[u32]) -> u32 {
        let n = history.len();
        if n % 7 == 3 {
            return (n as u32 * 31 + 5) % 11;
        }
        history[n.saturating_sub(5)]
    }

    /// Runs steps to the end with the fake model of [`next_of`], verifying drafted tokens as
    /// the last shard does (a sample after the last known token and after every drafted one,
    /// drafts kept while they equal the sample before them); `known` holds every session's
    /// prompt and gets its output. Returns the drafted and accepted totals.
    fn run_to_end(s: &mut Scheduler, known: &mut BTreeMap<SessionId, Vec<u32>>) -> (usize, usize) {
        run_with_drafter(s, known, None)
    }

    /// [`run_to_end`] with a draft model's drafts: when no step can go, the sessions wait for
    /// drafts, which `drafter` then computes.
    fn run_with_drafter(
        s: &mut Scheduler,
        known: &mut BTreeMap<SessionId, Vec<u32>>,
        drafter: Option<&FakeDraftModel>,
    ) -> (usize, usize) {
        let (mut drafted, mut accepted) = (0, 0);
        loop {
            let Some(plan) = s.schedule(Instant::now()) else {
                match drafter {
                    Some(d) if !s.is_idle() => {
                        assert!(d.complete() > 0, "only a draft may hold a session back");
                        continue;
                    }
                    _ => break,
                }
            };
            let mut outputs = Vec::new();
            for item in plan.items.iter().filter(|i| i.want_output) {
                let mut h = known[&item.session].clone();
                assert_eq!(h.len(), item.start_pos + item.tokens.len() - item.n_draft);
                for i in 0..=item.n_draft {
                    let t = next_of(&h);
                    outputs.push((item.session, t));
                    match item.drafts().get(i) {
                        Some(&d) if d == t => h.push(d),
                        _ => break,
                    }
                }
            }
            for e in s.update_from_output(plan.step_id, &outputs, &[]) {
                match e {
                    Event::Token { session, token } => known.get_mut(&session).unwrap().push(token),
                    Event::Verified {
                        drafted: d,
                        accepted: a,
                        ..
                    } => {
                        assert!(a <= d);
                        drafted += d;
                        accepted += a;
                    }
                    Event::Finished { .. } => {}
                }
            }
        }
        (drafted, accepted)
    }

    /// Sessions decoded with n-gram drafts verified step by step end with exactly the tokens
    /// plain decoding gives, at 1, 4 and 16 sessions; drafts were carried, some kept, some
    /// not.
    #[test]
    fn drafted_decoding_gives_exactly_the_tokens_of_plain_decoding() {
        for n_sessions in [1, 4, 16] {
            let mut results = Vec::new();
            for draft in [DraftConfig::OFF, DraftConfig::ngram(8)] {
                let mut s = Scheduler::new(SchedulerConfig {
                    draft: DraftConfig {
                        max_batch: 16,
                        ..draft
                    },
                    ..cfg(64, 16)
                });
                let mut known = BTreeMap::new();
                for i in 0..n_sessions {
                    let prompt: Vec<u32> = (0..9).map(|j| (i * 3 + j) % 7).collect();
                    s.add(SessionId(i as u64), prompt.clone(), 40, Priority::Agent, 0);
                    known.insert(SessionId(i as u64), prompt);
                }
                let (drafted, accepted) = run_to_end(&mut s, &mut known);
                assert!(known.values().all(|t| t.len() == 9 + 40));
                if draft.is_on() {
                    assert!(
                        drafted > 0 && accepted > 0 && accepted < drafted,
                        "drafted {drafted}, accepted {accepted}"
                    );
                } else {
                    assert_eq!(drafted, 0);
                }
                results.push(known);
            }
            assert_eq!(results[0], results[1], "{n_sessions} sessions");
        }
    }

    /// A draft model for tests: its drafts follow [`next_of`] except every fifth position, and
    /// are computed only when [`FakeDraftModel::complete`] is called.
    /// A draft asked for: the session, its tokens, how many to draft, whom to wake.
    type Asked = (SessionId, Vec<u32>, usize, Wake);

    #[derive(Default)]
    struct FakeDraftModel {
        asked: std::sync::Mutex<Vec<Asked>>,
        ready: std::sync::Mutex<HashMap<SessionId, (usize, Vec<u32>)>>,
        forgotten: std::sync::Mutex<Vec<SessionId>>,
        wakes: std::sync::atomic::AtomicUsize,
        polled: std::sync::Mutex<Vec<SessionId>>,
    }

    impl DraftSource for FakeDraftModel {
        fn poll(&self, session: SessionId, tokens: &[u32], k: usize, wake: &Wake) -> DraftPoll {
            self.polled.lock().unwrap().push(session);
            let mut ready = self.ready.lock().unwrap();
            if let Some((base, d)) = ready.remove(&session) {
                if base == tokens.len() {
                    return DraftPoll::Ready(d);
                }
            }
            self.asked
                .lock()
                .unwrap()
                .push((session, tokens.to_vec(), k, Arc::clone(wake)));
            DraftPoll::Pending
        }

        fn forget(&self, session: SessionId) {
            self.forgotten.lock().unwrap().push(session);
        }
    }

    impl FakeDraftModel {
        /// Computes every draft asked for; returns how many.
        fn complete(&self) -> usize {
            let asked = std::mem::take(&mut *self.asked.lock().unwrap());
            for (session, mut h, k, wake) in asked.iter().cloned() {
                let base = h.len();
                for _ in 0..k {
                    let t = if h.len() % 5 == 0 { 99 } else { next_of(&h) };
                    h.push(t);
                }
                self.ready
                    .lock()
                    .unwrap()
                    .insert(session, (base, h[base..].to_vec()));
                wake();
            }
            asked.len()
        }
    }

    /// Sessions drafting from a draft model, whose drafts take time and are sometimes wrong,
    /// end with exactly the tokens plain decoding gives, at 1, 4 and 16 sessions; each waited
    /// for its drafts, was woken when one was ready, and is forgotten by the draft model once
    /// it ends.
    #[test]
    fn draft_model_decoding_gives_exactly_the_tokens_of_plain_decoding() {
        for n_sessions in [1, 4, 16] {
            let mut results = Vec::new();
            for with_model in [false, true] {
                let draft = if with_model {
                    DraftConfig::model(6, Duration::from_secs(3600))
                } else {
                    DraftConfig::OFF
                };
                let mut s = Scheduler::new(SchedulerConfig {
                    draft: DraftConfig {
                        max_batch: 16,
                        ..draft
                    },
                    ..cfg(64, 16)
                });
                let fake = Arc::new(FakeDraftModel::default());
                let wakes = Arc::clone(&fake);
                s.use_draft_model(
                    fake.clone(),
                    Arc::new(move || {
                        wakes
                            .wakes
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }),
                );
                let mut known = BTreeMap::new();
                for i in 0..n_sessions {
                    let prompt: Vec<u32> = (0..9).map(|j| (i * 3 + j) % 7).collect();
                    s.add(SessionId(i as u64), prompt.clone(), 40, Priority::Agent, 0);
                    known.insert(SessionId(i as u64), prompt);
                }
                let (drafted, accepted) = run_with_drafter(&mut s, &mut known, Some(&fake));
                assert!(known.values().all(|t| t.len() == 9 + 40));
                let woken = fake.wakes.load(std::sync::atomic::Ordering::Relaxed);
                if with_model {
                    assert!(
                        drafted > 0 && accepted > 0 && accepted < drafted && woken > 0,
                        "drafted {drafted}, accepted {accepted}, woken {woken}"
                    );
                    let mut forgotten = fake.forgotten.lock().unwrap().clone();
                    forgotten.sort();
                    forgotten.dedup();
                    assert_eq!(forgotten.len(), n_sessions as usize);
                } else {
                    assert_eq!((drafted, woken), (0, 0));
                }
                results.push(known);
            }
            assert_eq!(results[0], results[1], "{n_sessions} sessions");
        }
    }

    /// A draft model is asked only while the route holds at most `max_batch` (here 1) active
    /// sessions: a session decoding beside another's work asks for nothing; once alone, it
    /// drafts.
    #[test]
    fn a_draft_model_is_asked_only_by_a_session_alone_on_the_route() {
        let mut s = Scheduler::new(SchedulerConfig {
            draft: DraftConfig::model(4, Duration::from_secs(3600)),
            ..cfg(64, 16)
        });
        let fake = Arc::new(FakeDraftModel::default());
        s.use_draft_model(fake.clone(), Arc::new(|| {}));
        let (short, long) = (vec![1, 2, 3], vec![4; 40]);
        s.add(SessionId(1), short.clone(), 3, Priority::Agent, 0);
        s.add(SessionId(2), long.clone(), 30, Priority::Agent, 0);
        let mut known = BTreeMap::from([(SessionId(1), short), (SessionId(2), long)]);
        let (drafted, _) = run_with_drafter(&mut s, &mut known, Some(&fake));
        let polled = fake.polled.lock().unwrap().clone();
        assert!(!polled.contains(&SessionId(1)), "never alone: {polled:?}");
        assert!(
            polled.contains(&SessionId(2)) && drafted > 0,
            "alone after the other ended"
        );
    }

    /// A session whose draft is not ready waits for it at most the draft kind's `max_wait`,
    /// then decodes without one.
    #[test]
    fn a_late_draft_is_waited_for_at_most_max_wait() {
        let wait = Duration::from_millis(50);
        let mut s = Scheduler::new(SchedulerConfig {
            draft: DraftConfig::model(4, wait),
            ..cfg(64, 16)
        });
        let fake = Arc::new(FakeDraftModel::default());
        s.use_draft_model(fake.clone(), Arc::new(|| {}));
        s.add(SessionId(1), vec![1, 2, 3], 10, Priority::Agent, 0);
        let t0 = Instant::now();
        let plan = s.schedule(t0).unwrap();
        assert_eq!(plan.items[0].tokens, vec![1, 2, 3], "the prompt");
        s.update_from_output(plan.step_id, &[(SessionId(1), 4)], &[]);
        assert!(s.schedule(t0).is_none(), "waits for its draft");
        assert!(s.schedule(t0 + wait / 2).is_none(), "still within max_wait");
        let plan = s.schedule(t0 + wait).unwrap();
        assert_eq!(
            (plan.items[0].tokens.clone(), plan.items[0].n_draft),
            (vec![4], 0)
        );
    }

    /// A draft never reaches past the positions a session may still generate (its admission
    /// reserved no more), nor past what the step has room for.
    #[test]
    fn drafts_stay_within_what_a_session_may_generate_and_the_step_budget() {
        let mut s = Scheduler::new(SchedulerConfig {
            draft: DraftConfig::ngram(8),
            ..cfg(3, 16)
        });
        // A prompt that repeats: the drafter always has a long continuation to offer.
        let prompt: Vec<u32> = (0..40).map(|i| i % 4).collect();
        s.add(SessionId(1), prompt.clone(), 5, Priority::Agent, 0);
        let mut known = BTreeMap::from([(SessionId(1), prompt)]);
        let mut max_end = 0;
        while let Some(plan) = s.schedule(Instant::now()) {
            for i in &plan.items {
                assert!(i.tokens.len() <= 3, "step budget");
                max_end = max_end.max(i.start_pos + i.tokens.len());
            }
            let outputs: Vec<(SessionId, u32)> = plan
                .items
                .iter()
                .filter(|i| i.want_output)
                .flat_map(|i| {
                    let h = &known[&i.session];
                    // The model continues the period: every draft is kept.
                    (0..=i.n_draft).map(move |k| (i.session, ((h.len() + k) % 4) as u32))
                })
                .collect();
            for e in s.update_from_output(plan.step_id, &outputs, &[]) {
                if let Event::Token { session, token } = e {
                    known.get_mut(&session).unwrap().push(token);
                }
            }
        }
        assert_eq!(known[&SessionId(1)].len(), 45);
        assert!(
            max_end <= 44,
            "positions up to prompt + max_new - 1, got {max_end}"
        );
    }

    /// A step whose decode work holds more sessions than `max_batch` drafts for none.
    #[test]
    fn a_full_batch_drafts_nothing() {
        let mut s = Scheduler::new(SchedulerConfig {
            draft: DraftConfig {
                max_batch: 4,
                ..DraftConfig::ngram(8)
            },
            ..cfg(64, 16)
        });
        let mut known = BTreeMap::new();
        for i in 0..8 {
            let prompt: Vec<u32> = (0..12).map(|j| j % 3).collect();
            s.add(SessionId(i), prompt.clone(), 10, Priority::Agent, 0);
            known.insert(SessionId(i), prompt);
        }
        let (drafted, _) = run_to_end(&mut s, &mut known);
        assert_eq!(drafted, 0);
    }

    proptest::proptest! {
        #[test]
        fn the_token_budget_is_never_exceeded(
            budget in 1usize..64,
            chunk in 1usize..64,
            prompts in proptest::collection::vec(1usize..200, 1..12),
        ) {
            let mut s = Scheduler::new(cfg(budget, chunk));
            for (i, n) in prompts.iter().enumerate() {
                let class = if i % 3 == 0 { Priority::Grading } else { Priority::Agent };
                s.add(SessionId(i as u64), vec![1; *n], 5, class, i as u64 % 2);
            }
            // Simulated time, 10 ms per step: held-back grading work resumes after the gap.
            let mut now = Instant::now();
            let mut steps = 0;
            while !s.is_idle() {
                now += Duration::from_millis(10);
                steps += 1;
                proptest::prop_assert!(steps < 100_000);
                let Some(p) = s.schedule(now) else {
                    continue;
                };
                proptest::prop_assert!(p.n_tokens() <= budget);
                for i in &p.items {
                    proptest::prop_assert!(i.tokens.len() <= chunk.max(1));
                }
                let outputs: Vec<(SessionId, u32)> = p.items.iter().filter(|i| i.want_output).map(|i| (i.session, 1)).collect();
                s.update_from_output(p.step_id, &outputs, &[]);
            }
        }
    }
}
