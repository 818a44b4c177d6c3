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
    Model { waiting_since: Option<Instant> },
}

impl Drafting {
    fn new(config: &DraftConfig) -> Option<Drafting> {
        config.is_on().then(|| Drafting {
            source: match config.kind {
                DraftKind::Ngram => Source::Ngram(NgramIndex::new(config)),
                DraftKind::Model { .. } => Source::Model {
                    waiting_since: None,
                },
            },
            length: DraftLength::new(config.max_draft),
        })
    }
}

/// The route's draft model, how it wakes the route's loop, and how long a session waits for
/// its draft (the config's [`DraftKind::Model`]).
struct DraftModel {
    source: Arc<dyn DraftSource>,
    wake: Wake,
    max_wait: Duration,
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
            Source::Model { waiting_since } => {
                let poll = match model {
                    Some(m) if k > 0 => m.source.poll(session, &self.tokens, k, &m.wake),
                    _ => DraftPoll::Ready(Vec::new()),
                };
                match (poll, model) {
                    (DraftPoll::Pending, Some(m))
                        if now.saturating_duration_since(*waiting_since.get_or_insert(now))
                            < m.max_wait =>
                    {
                        None
                    }
                    (DraftPoll::Pending, _) => {
                        *waiting_since = None;
                        d.length.take();
                        Some(Vec::new())
                    }
                    (DraftPoll::Ready(mut t), _) => {
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
        let max_wait = match self.config.draft.kind {
            DraftKind::Model { max_wait } => max_wait,
            DraftKind::Ngram => Duration::ZERO,
        };
        self.draft_model = Some(DraftModel {
            source,
            wake,
            max_wait,
        });
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
mod tests;
