//! The compute thread's state: the model, every session's KV cache, and the step it runs.
//!
//! Sessions are keyed by who opened them: the route stream and the id the tracker gave the
//! session on it ([`SessionKey`]). Two trackers, or two routes of one tracker, number their
//! sessions independently; keyed by id alone they would read and extend each other's caches.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use constrain::LazyVocabulary;
use engine::{Reason, Refusal};
use model::sampling::{log_probs, top_k, Sampler, SamplingParams};
use model::{Batch, KvCache, KvPool, Model, Row, BLOCK_POSITIONS};

// The tracker cuts prefill chunks on the blocks the prefix cache shares.
const _: () = assert!(engine::KV_BLOCK_POSITIONS == BLOCK_POSITIONS);
use proto::v1::{Fragment, SessionError, SessionOutput, TopLogprob};

use crate::grammar::{Done, Grammar, GrammarThreads, Pending};
use crate::messages::{Counters, Early, EarlyJob, StepJob, StepOutcome, TokenSteps};
use crate::{mib, ShardConfig};

/// A session as a shard knows it: the route stream that opened it and its id there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct SessionKey {
    pub stream: u64,
    pub id: u64,
}

struct Session {
    epoch: u64,
    kv: KvCache,
    tokens: Vec<u32>,
    sampler: Option<Sampler>,
    /// How many of `tokens` are the prompt: the constraint sees the tokens after them.
    n_prompt: usize,
    /// The grammar the generated tokens are held to (last shard only).
    grammar: Grammar,
    n_top: u32,
    last_used: Instant,
    /// Its prefix-cache partition (the tracker's `cache_salt`): the blocks it registers and
    /// attaches are keyed under it.
    cache_salt: u64,
}

impl Session {
    /// The key root of its prefix blocks: the step's `root` within its partition. Salt 0 is
    /// the shared partition, whose root is the step's own.
    fn prefix_root(&self, root: u64) -> u64 {
        if self.cache_salt == 0 {
            return root;
        }
        KvPool::prefix_root(splitmix64(root ^ splitmix64(self.cache_salt)))
    }

    /// Cuts the session back to `len` positions (whole blocks past the end go back to the
    /// pool); the sampler's counts and the constraint follow.
    fn rewind(&mut self, len: usize) {
        self.kv.truncate(len);
        self.tokens.truncate(self.kv.len());
        if let Some(s) = &mut self.sampler {
            s.rewind(self.tokens.len());
        }
        self.grammar
            .rewind(self.tokens.len().saturating_sub(self.n_prompt));
    }
}

/// The state owned by the compute thread.
pub(crate) struct Worker {
    pub model: Model,
    /// Every session's KV blocks come from here; its capacity is the KV budget.
    pub kv_pool: KvPool,
    sessions: HashMap<SessionKey, Session>,
    pub counters: Arc<Counters>,
    pub config: ShardConfig,
    /// The last range's logits, reused step after step (16 rows are 3 MiB: a fresh buffer
    /// each step would be zeroed and faulted in again).
    logits: Vec<f32>,
    /// Where grammars compile and masks are computed, against the vocabulary built in the
    /// background at start (the last shard's); `None` when the file has no usable tokenizer.
    grammars: Option<GrammarThreads<SessionKey>>,
    /// Why this shard can compute nothing more (its model file could not be read: cut short,
    /// rewritten, gone bad): set by the step that found it, whose reply is then not sent; the
    /// compute thread stops as on a panic, so routes fail over to replicas.
    pub fatal: Option<String>,
    /// Compute times of steps of one position of one session (the shard's time per token).
    token_steps: TokenSteps,
}

/// One step's masks, by session: the mask, or why there is none.
type Masks = HashMap<SessionKey, Result<Vec<u32>, SessionError>>;

/// The most drafted tokens one fragment may carry: each is a row of logits to sample, and a
/// rewind past rejected drafts stays inside what a sliding-window layer keeps behind its window.
pub const MAX_DRAFT: usize = 16;

/// The logit rows a fragment asks for: one per sample.
fn n_outputs(f: &Fragment) -> usize {
    if f.want_output {
        1 + f.n_draft as usize
    } else {
        0
    }
}

fn refusal(session_id: u64, reason: Reason, message: String) -> SessionError {
    SessionError::new(session_id, &Refusal::from_shard(reason, message))
}

/// A grammar over the last shard's time budget for one token.
fn budget_refusal(session_id: u64, message: String) -> SessionError {
    SessionError::new(
        session_id,
        &Refusal::new(Reason::GrammarBudget, message).with_limit("grammar_budget_ms"),
    )
}

/// A refusal for a limit of this shard that frees up (`limit`: its name).
fn over(session_id: u64, limit: &str, message: String) -> SessionError {
    SessionError::new(session_id, &Refusal::capacity(limit, message))
}

/// The step's running totals while fragments are admitted one by one.
#[derive(Default)]
struct Planned {
    /// Bytes of blocks the fragments accepted so far will take when the step runs.
    kv_bytes: usize,
    /// Rows and logit rows of the fragments accepted so far (the step's scratch).
    rows: usize,
    outputs: usize,
}

impl Worker {
    pub fn new(
        model: Model,
        kv_pool: KvPool,
        counters: Arc<Counters>,
        config: ShardConfig,
        grammars: Option<Arc<LazyVocabulary>>,
    ) -> Self {
        let grammars = grammars.and_then(|g| match GrammarThreads::start(g) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "no grammar thread: constrained requests are refused");
                None
            }
        });
        Worker {
            model,
            kv_pool,
            sessions: HashMap::new(),
            counters,
            config,
            logits: Vec::new(),
            grammars,
            fatal: None,
            token_steps: TokenSteps::default(),
        }
    }

    /// Forgets every session a closed route stream created.
    pub fn release_stream(&mut self, stream: u64) {
        self.sessions.retain(|k, _| k.stream != stream);
        self.publish_gauges();
    }

    pub fn publish_gauges(&self) {
        let c = &self.counters;
        let p = &self.kv_pool;
        c.kv_bytes_in_use
            .store(p.bytes_in_use() as u64, Ordering::Relaxed);
        c.kv_blocks_in_use
            .store(p.blocks_in_use() as u64, Ordering::Relaxed);
        c.kv_blocks_total
            .store(p.capacity_blocks() as u64, Ordering::Relaxed);
        c.kv_block_bytes
            .store(p.block_bytes() as u64, Ordering::Relaxed);
        c.kv_blocks_idle
            .store(p.idle_blocks() as u64, Ordering::Relaxed);
        c.kernel_thread_moves
            .store(self.model.kernel_thread_moves(), Ordering::Relaxed);
        c.sessions
            .store(self.sessions.len() as u64, Ordering::Relaxed);
    }

    /// The key root of this shard's cached prefix blocks for `job`'s route.
    fn prefix_root(&self, job: &StepJob) -> u64 {
        // The first range's K and V depend on the tokens alone; later ranges' also on how the
        // hidden states crossed the seams.
        KvPool::prefix_root(if self.model.is_first() {
            0
        } else {
            job.prefix_scope
        })
    }

    fn policy(&self) -> engine::EvictionPolicy {
        engine::EvictionPolicy {
            ttl: self.config.kv_ttl,
        }
    }

    /// Every held session as the eviction policy sees it; those `job` names are in the step.
    fn residents(&self, job: &StepJob) -> Vec<engine::Resident<SessionKey>> {
        self.sessions
            .iter()
            .map(|(&key, s)| engine::Resident {
                session: key,
                last_used: s.last_used,
                bytes: s.kv.releasable_bytes(),
                in_step: key.stream == job.stream_id
                    && job.fragments.iter().any(|f| f.session_id == key.id),
            })
            .collect()
    }

    /// Forgets sessions idle past the TTL (never one this step names).
    fn expire(&mut self, job: &StepJob) {
        let residents = self.residents(job);
        for key in self.policy().expired(&residents, job.now) {
            self.sessions.remove(&key);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Why a fragment cannot run whatever the shard holds, if it cannot: malformed, past the
    /// context, or over the step's scratch budget beside the fragments accepted before it.
    fn check_fragment(&self, f: &Fragment, planned: &Planned) -> Option<SessionError> {
        let (id, label) = (f.session_id, &self.config.label);
        let end = f.start_pos as usize + f.tokens.len();
        if f.prefix.len() > f.start_pos as usize {
            return Some(refusal(
                id,
                Reason::InvalidRequest,
                format!("fragment of session {id} names a prefix longer than its start"),
            ));
        }
        // Only positions taken whole from a prefix cache come without tokens to compute, and
        // such a fragment cannot sample.
        if f.tokens.is_empty() && (f.prefix.is_empty() || f.want_output) {
            return Some(refusal(
                id,
                Reason::InvalidRequest,
                format!("fragment of session {id} has no tokens"),
            ));
        }
        if f.n_draft > 0
            && (!f.want_output
                || f.n_draft as usize >= f.tokens.len()
                || f.n_draft as usize > MAX_DRAFT
                || !f.prefix.is_empty())
        {
            return Some(refusal(
                id,
                Reason::InvalidRequest,
                format!(
                    "fragment of session {id} drafts {} of its {} tokens: a verification needs a known token first, at most {MAX_DRAFT} drafts, a sample and no prefix",
                    f.n_draft,
                    f.tokens.len()
                ),
            ));
        }
        if end > self.config.n_ctx {
            return Some(refusal(
                id,
                Reason::InvalidRequest,
                format!(
                    "session {id} would reach position {end} but `n_ctx` is {} on shard {label}",
                    self.config.n_ctx
                ),
            ));
        }
        let (rows, outputs) = (
            planned.rows + f.tokens.len(),
            planned.outputs + n_outputs(f),
        );
        let scratch = self.model.scratch_bytes(rows, outputs);
        let budget = self.config.scratch_budget_bytes;
        (scratch > budget).then(|| {
            over(
                id,
                "scratch_budget",
                format!(
                    "scratch_budget on shard {label}: a step of {rows} tokens needs {:.1} MiB of activations, the budget is {:.1} MiB",
                    mib(scratch as u64),
                    mib(budget as u64)
                ),
            )
        })
    }

    /// A session's sampling parameters, checked: a peer holding the token may still send
    /// nonsense, and none of it may reach the sampler.
    fn sampling_params(
        &self,
        id: u64,
        s: &proto::v1::Sampling,
    ) -> Result<SamplingParams, SessionError> {
        let n_vocab = self.model.config().n_vocab;
        let bad =
            |what: String| refusal(id, Reason::InvalidRequest, format!("session {id}: {what}"));
        let finite = [
            s.temperature,
            s.top_p,
            s.min_p,
            s.repeat_penalty,
            s.presence_penalty,
            s.frequency_penalty,
        ];
        if finite.iter().any(|x| !x.is_finite()) {
            return Err(bad("sampling parameters must be finite".into()));
        }
        if s.logit_bias.len() > n_vocab {
            return Err(bad(format!(
                "{} logit biases for {n_vocab} tokens",
                s.logit_bias.len()
            )));
        }
        if let Some(b) = s
            .logit_bias
            .iter()
            .find(|b| b.token as usize >= n_vocab || !b.bias.is_finite())
        {
            return Err(bad(format!(
                "logit bias {} for token {} (vocabulary of {n_vocab})",
                b.bias, b.token
            )));
        }
        Ok(SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: if s.top_p > 0.0 { s.top_p } else { 1.0 },
            min_p: s.min_p,
            repeat_penalty: if s.repeat_penalty > 0.0 {
                s.repeat_penalty
            } else {
                1.0
            },
            repeat_last_n: s.repeat_last_n as usize,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: s.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
            n_prompt: s.n_prompt as usize,
            seed: s.seed,
        })
    }

    /// The session's grammar when this shard samples (other shards never look at it); it
    /// compiles on the grammar thread at the session's first mask.
    fn grammar(&self, id: u64, s: &proto::v1::Sampling) -> Result<Grammar, SessionError> {
        if s.grammar.is_empty() || !self.model.is_last() {
            return Ok(Grammar::None);
        }
        if self.grammars.is_none() {
            return Err(refusal(
                id,
                Reason::InvalidRequest,
                format!(
                    "session {id}: this model has no vocabulary for grammars (shard {})",
                    self.config.label
                ),
            ));
        }
        Ok(Grammar::Uncompiled(s.grammar.as_str().into()))
    }

    /// Finds or opens the session a fragment continues, positioned at `base` (where its
    /// positions must end before the fragment): `Ok(created)`, or the refusal.
    fn open_session(
        &mut self,
        key: SessionKey,
        job: &StepJob,
        f: &Fragment,
        base: usize,
    ) -> Result<bool, SessionError> {
        let (id, label) = (key.id, &self.config.label);
        let n_held = self.sessions.len();
        match self.sessions.get_mut(&key) {
            Some(s) if s.epoch != job.epoch => Err(refusal(
                id,
                Reason::StaleEpoch,
                format!(
                    "session {id} belongs to epoch {} but the step is epoch {}",
                    s.epoch, job.epoch
                ),
            )),
            Some(s) if base > s.kv.len() => Err(refusal(
                id,
                Reason::CacheMiss,
                format!(
                    "session {id} holds {} positions on shard {label}; fragment starts at {base}",
                    s.kv.len()
                ),
            )),
            Some(s) => {
                // A fragment that starts inside the cache rewinds it (replay after a retry);
                // whole blocks past the new end go back to the pool. Rewinding behind what a
                // sliding-window layer kept forgets the session.
                s.rewind(base);
                if s.kv.len() < base {
                    return Err(refusal(
                        id,
                        Reason::CacheMiss,
                        format!(
                            "session {id} rewinds to position {base} on shard {label}, behind the sliding window it kept"
                        ),
                    ));
                }
                Ok(false)
            }
            None if base != 0 => Err(refusal(
                id,
                Reason::CacheMiss,
                format!("session {id} is not held on shard {label}"),
            )),
            None if n_held >= self.config.max_sessions => Err(over(
                id,
                "max_sessions",
                format!("max_sessions on shard {label}: {n_held} sessions held"),
            )),
            None => {
                let (sampler, grammar) = match &f.sampling {
                    None => (None, Grammar::None),
                    Some(s) => (
                        Some(Sampler::new(self.sampling_params(id, s)?)),
                        self.grammar(id, s)?,
                    ),
                };
                let session = Session {
                    epoch: job.epoch,
                    kv: self.kv_pool.new_cache(self.config.n_ctx),
                    tokens: Vec::new(),
                    sampler,
                    n_prompt: f.sampling.as_ref().map_or(0, |s| s.n_prompt as usize),
                    grammar,
                    n_top: f.n_top_logprobs,
                    last_used: job.now,
                    cache_salt: f.cache_salt,
                };
                self.sessions.insert(key, session);
                Ok(true)
            }
        }
    }

    /// Takes a fragment's leading positions from the prefix cache where it may: the positions
    /// an upstream shard took (`prefix`, or `cache_miss`), or on the first shard the longest
    /// registered prefix of a prompt fragment (then the fragment is rewritten to name them).
    fn attach_prefix(
        &mut self,
        key: SessionKey,
        f: &mut Fragment,
        base: usize,
        root: u64,
    ) -> Result<(), SessionError> {
        let s = self.sessions.get_mut(&key).expect("opened before");
        let root = s.prefix_root(root);
        if !f.prefix.is_empty() {
            let held = if self.config.prefix_cache {
                self.kv_pool
                    .attach(&mut s.kv, &f.prefix, root, f.prefix.len())
            } else {
                0
            };
            if held != f.prefix.len() {
                s.kv.truncate(base);
                return Err(refusal(
                    key.id,
                    Reason::CacheMiss,
                    format!(
                        "session {} continues at position {base} with a {}-position prefix that is not cached on shard {}",
                        key.id,
                        f.prefix.len(),
                        self.config.label
                    ),
                ));
            }
            s.tokens.extend_from_slice(&f.prefix);
        } else if self.config.prefix_cache
            && f.reuse_prefix
            && f.n_draft == 0
            && self.model.is_first()
        {
            // Continue on the cached positions of the longest registered prefix; a fragment
            // that samples keeps at least one token to compute. The rest of the fragment goes
            // on from there, naming the positions taken.
            let max_positions = f.tokens.len().saturating_sub(usize::from(f.want_output));
            let held = self
                .kv_pool
                .attach(&mut s.kv, &f.tokens, root, max_positions);
            if held > 0 {
                f.prefix = f.tokens.drain(..held).collect();
                f.start_pos += held as u32;
                s.tokens.extend_from_slice(&f.prefix);
            }
        }
        Ok(())
    }

    /// Makes room in the KV budget for `need` more bytes beside what the step already plans,
    /// evicting idle sessions (least recently used first) when that is enough and allowed;
    /// the refusal names the numbers when it is not.
    fn fit_kv(
        &mut self,
        job: &StepJob,
        id: u64,
        need: usize,
        planned: usize,
        may_evict: bool,
    ) -> Result<(), SessionError> {
        let budget = self.kv_pool.budget_bytes();
        let in_use = |w: &Self| w.kv_pool.bytes_in_use() + planned;
        if may_evict && in_use(self) + need > budget {
            let residents = self.residents(job);
            if let Some(victims) = self
                .policy()
                .make_room(&residents, in_use(self), budget, need)
            {
                for v in victims {
                    // Dropping the session returns its blocks to the pool.
                    if self.sessions.remove(&v).is_some() {
                        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let kv_in_use = in_use(self);
        if kv_in_use + need <= budget {
            return Ok(());
        }
        Err(over(
            id,
            "kv_budget",
            format!(
                "kv_budget on shard {}: need {:.1} MiB, free {:.1} MiB of {:.1} MiB",
                self.config.label,
                mib(need as u64),
                mib(budget.saturating_sub(kv_in_use) as u64),
                mib(budget as u64)
            ),
        ))
    }

    /// Decides, fragment by fragment, what can run; creates sessions for new fragments.
    /// `root` is the key root of this step's prefix blocks ([`Worker::prefix_root`]).
    /// An early step evicts no one (`may_evict` false).
    fn admit(
        &mut self,
        job: &mut StepJob,
        root: u64,
        may_evict: bool,
        out: &mut StepOutcome,
    ) -> Vec<usize> {
        let mut planned = Planned::default();
        let mut accepted = Vec::new();
        let mut seen = HashSet::with_capacity(job.fragments.len());
        for i in 0..job.fragments.len() {
            let id = job.fragments[i].session_id;
            let key = SessionKey {
                stream: job.stream_id,
                id,
            };
            // One session computes one run of positions per step: a second fragment of it
            // would need its cache twice.
            if !seen.insert(id) {
                out.errors.push(refusal(
                    id,
                    Reason::InvalidRequest,
                    format!("session {id} has more than one fragment in step"),
                ));
                continue;
            }
            if let Some(e) = self.check_fragment(&job.fragments[i], &planned) {
                out.errors.push(e);
                continue;
            }
            let f = &job.fragments[i];
            let base = f.start_pos as usize - f.prefix.len();
            let created = match self.open_session(key, job, f, base) {
                Ok(created) => created,
                Err(e) => {
                    out.errors.push(e);
                    continue;
                }
            };
            if f.n_draft > 0 && !self.sessions[&key].grammar.is_none() {
                out.errors.push(refusal(
                    id,
                    Reason::InvalidRequest,
                    format!("session {id} is held to a grammar: its drafts cannot be verified"),
                ));
                if created {
                    self.sessions.remove(&key);
                }
                continue;
            }
            let mut f = std::mem::take(&mut job.fragments[i]);
            let attached = self.attach_prefix(key, &mut f, base, root);
            job.fragments[i] = f;
            let f = &job.fragments[i];
            let fit = attached.and_then(|()| {
                let end = f.start_pos as usize + f.tokens.len();
                let need = self.sessions[&key].kv.extra_bytes_for(end);
                self.fit_kv(job, id, need, planned.kv_bytes, may_evict)
                    .map(|()| need)
            });
            match fit {
                Ok(need) => {
                    planned.kv_bytes += need;
                    planned.rows += f.tokens.len();
                    planned.outputs += n_outputs(f);
                    accepted.push(i);
                }
                Err(e) => {
                    out.errors.push(e);
                    // A refused new session is not kept; one kept gives back what the prefix
                    // cache lent it for this fragment (blocks that were idle, counted as free
                    // room when the step's earlier fragments were planned).
                    if created || self.sessions.get(&key).is_some_and(|s| s.kv.is_empty()) {
                        self.sessions.remove(&key);
                    } else if let Some(s) = self.sessions.get_mut(&key) {
                        s.rewind(base);
                    }
                }
            }
        }
        accepted
    }

    /// Runs an early step whole, or rolls back what it did and answers `None`.
    pub fn early(&mut self, job: EarlyJob) -> Option<Early> {
        // Only on the tokens' own sessions, each holding exactly the positions before its token:
        // a hint that a later step of the tracker's overtook is stale.
        let fresh = job.tokens.iter().all(|&(id, _, pos)| {
            let key = SessionKey {
                stream: job.stream_id,
                id,
            };
            self.sessions
                .get(&key)
                .is_some_and(|s| s.epoch == job.epoch && s.kv.len() == pos as usize)
        });
        if job.tokens.is_empty() || !fresh {
            return None;
        }
        self.counters
            .early_steps_started
            .fetch_add(1, Ordering::Relaxed);
        let fragments: Vec<Fragment> = job
            .tokens
            .iter()
            .map(|&(session_id, token, pos)| Fragment {
                session_id,
                start_pos: pos,
                tokens: vec![token],
                want_output: true,
                ..Default::default()
            })
            .collect();
        let outcome = self.step(
            StepJob {
                stream_id: job.stream_id,
                epoch: job.epoch,
                fragments: fragments.clone(),
                release: Vec::new(),
                hidden: None,
                now: job.now,
                prefix_scope: job.prefix_scope,
                rollback: Vec::new(),
            },
            true,
        );
        let early = Early { fragments, outcome };
        if early.outcome.errors.is_empty() && early.outcome.accepted.len() == early.fragments.len()
        {
            return Some(early);
        }
        self.roll_back(job.stream_id, &early.rollback());
        self.counters
            .early_steps_discarded
            .fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Cuts sessions of `stream` back to the given lengths (whole blocks past the end go back
    /// to the pool).
    fn roll_back(&mut self, stream: u64, to: &[(u64, usize)]) {
        for &(id, len) in to {
            if let Some(s) = self.sessions.get_mut(&SessionKey { stream, id }) {
                if s.kv.len() > len {
                    s.rewind(len);
                }
            }
        }
    }

    /// Runs a step; an `early` one evicts no one and leaves the step counters to whoever uses
    /// it.
    pub fn step(&mut self, mut job: StepJob, early: bool) -> StepOutcome {
        let t0 = Instant::now();
        let mut out = StepOutcome::default();
        self.roll_back(job.stream_id, &job.rollback);
        let root = self.prefix_root(&job);
        for &id in &job.release {
            let released = self.sessions.remove(&SessionKey {
                stream: job.stream_id,
                id,
            });
            // A session's last positions may have come from early steps, whose blocks wait
            // for a step of the tracker's: its release is one (the tracker releases a session
            // after its last token, so every shard has computed them).
            if let Some(mut s) = released.filter(|_| self.config.prefix_cache && !early) {
                let root = s.prefix_root(root);
                self.kv_pool.register(&mut s.kv, &s.tokens, root);
            }
        }
        self.expire(&job);
        let accepted = self.admit(&mut job, root, !early, &mut out);
        let (n_rows, n_out) = accepted.iter().fold((0, 0), |(r, o), &i| {
            let f = &job.fragments[i];
            (r + f.tokens.len(), o + n_outputs(f))
        });
        self.counters.scratch_bytes_last_step.store(
            self.model.scratch_bytes(n_rows, n_out) as u64,
            Ordering::Relaxed,
        );
        let keys: Vec<SessionKey> = accepted
            .iter()
            .map(|&i| SessionKey {
                stream: job.stream_id,
                id: job.fragments[i].session_id,
            })
            .collect();
        for key in &keys {
            if let Some(s) = self.sessions.get_mut(key) {
                s.last_used = job.now;
            }
        }
        if !early {
            self.counters
                .rejected_fragments
                .fetch_add(out.errors.len() as u64, Ordering::Relaxed);
        }
        if !accepted.is_empty() {
            self.run_accepted(&job, &accepted, &keys, &mut out);
            if !early {
                self.counters.count_step(&out.accepted);
            }
        }
        if self.config.prefix_cache && !early {
            // Full blocks become shareable as soon as a step of the tracker's wrote them. An
            // early step's positions wait for the tracker's next step of the session (they
            // are registered with it): only this first shard computed them, and a block the
            // later shards lack would make the next prompt that starts on it a cache miss
            // there, recomputed whole.
            for key in &keys {
                if let Some(s) = self.sessions.get_mut(key) {
                    let root = s.prefix_root(root);
                    self.kv_pool.register(&mut s.kv, &s.tokens, root);
                }
            }
        }
        self.publish_gauges();
        out.compute_micros = t0.elapsed().as_micros() as u64;
        if !accepted.is_empty() {
            self.counters
                .compute_micros
                .fetch_add(out.compute_micros, Ordering::Relaxed);
        }
        // Early steps count too: on a route's first shard most decode steps are early ones.
        if let [i] = accepted[..] {
            if job.fragments[i].tokens.len() == 1 {
                let least = self.token_steps.observe(out.compute_micros);
                self.counters
                    .token_step_micros
                    .store(least, Ordering::Relaxed);
            }
        }
        out
    }

    /// Computes the accepted fragments (`keys` are their sessions, in order): hidden states
    /// for the next shard, or on the last shard a sampled token per fragment that asks for one.
    fn run_accepted(
        &mut self,
        job: &StepJob,
        accepted: &[usize],
        keys: &[SessionKey],
        out: &mut StepOutcome,
    ) {
        let (rows, hidden) = self.rows_of(job, accepted);
        let masks = self.start_masks(job, accepted, keys);
        let started = Instant::now();
        let result = if rows.is_empty() {
            // Every accepted fragment was taken whole from the prefix cache: nothing to run.
            Ok(Vec::new())
        } else {
            // Borrow every accepted session's cache at once, in the order of `keys`.
            let mut by_key: HashMap<SessionKey, &mut KvCache> = self
                .sessions
                .iter_mut()
                .filter(|(k, _)| keys.contains(k))
                .map(|(k, s)| (*k, &mut s.kv))
                .collect();
            let mut refs: Vec<&mut KvCache> = keys
                .iter()
                .map(|k| by_key.remove(k).expect("admitted sessions are held"))
                .collect();
            let batch = Batch {
                rows: &rows,
                hidden: job.hidden.as_ref().map(|_| hidden.as_slice()),
            };
            let mut buf = std::mem::take(&mut self.logits);
            self.model
                .forward_into(batch, &mut refs, &mut buf)
                .map(|()| buf)
        };
        let masks = masks.map(|p| self.finish_masks(p, started));
        let computed = match result {
            Err(model::Error::Gguf(e @ gguf::Error::Io { .. })) => {
                self.fatal = Some(format!("reading the model file: {e}"));
                return;
            }
            Err(e) => {
                for key in keys {
                    out.errors
                        .push(refusal(key.id, Reason::InvalidRequest, e.to_string()));
                }
                return;
            }
            Ok(computed) => computed,
        };
        for (&i, key) in accepted.iter().zip(keys) {
            let s = self
                .sessions
                .get_mut(key)
                .expect("admitted sessions are held");
            s.tokens.extend_from_slice(&job.fragments[i].tokens);
        }
        if self.model.is_last() {
            self.sample(
                job,
                accepted,
                keys,
                &computed,
                masks.unwrap_or_default(),
                out,
            );
            self.logits = computed;
        } else {
            out.hidden = computed;
        }
        out.accepted = accepted.iter().map(|&i| job.fragments[i].clone()).collect();
    }

    /// Hands the grammar of every accepted constrained fragment that asks for a token to the
    /// grammar threads, with the tokens its session will have generated once this step's are
    /// in: the step's pending masks and the sessions that need one (`None` when there are none,
    /// or this shard does not sample). A session whose grammar is still away (a late mask of an
    /// earlier step) is not sent; it fails with `grammar_budget`.
    fn start_masks(
        &mut self,
        job: &StepJob,
        accepted: &[usize],
        keys: &[SessionKey],
    ) -> Option<(Pending, Vec<SessionKey>)> {
        let late = self.grammars.as_ref()?.late();
        self.take_back(late);
        let mut work = Vec::new();
        let mut wanted = Vec::new();
        for (&i, key) in accepted.iter().zip(keys) {
            let f = &job.fragments[i];
            let Some(s) = self.sessions.get_mut(key) else {
                continue;
            };
            if !f.want_output || s.grammar.is_none() {
                continue;
            }
            wanted.push(*key);
            if s.grammar.is_away() {
                continue;
            }
            let grammar = std::mem::replace(&mut s.grammar, Grammar::Away);
            let mut generated: Vec<u32> = s.tokens.get(s.n_prompt..).unwrap_or(&[]).to_vec();
            let skip = s.n_prompt.saturating_sub(s.tokens.len());
            generated.extend(f.tokens.iter().skip(skip));
            work.push((*key, grammar, generated));
        }
        let thread = self.grammars.as_mut()?;
        (!wanted.is_empty()).then(|| (thread.start_step(work), wanted))
    }

    /// Gives late answers' grammars back to their sessions (still held, grammar still away),
    /// rolled back to what each session now holds; their masks are stale.
    fn take_back(&mut self, late: Vec<Done<SessionKey>>) {
        for d in late {
            if let Some(s) = self.sessions.get_mut(&d.key) {
                if s.grammar.is_away() {
                    s.grammar = d.grammar;
                    s.grammar.rewind(s.tokens.len().saturating_sub(s.n_prompt));
                }
            }
        }
    }

    /// Takes the grammars back with their masks, waiting at most until the step's grammar
    /// budget has passed since `started` (the forward pass ran meanwhile; a longer pass is
    /// the bound instead). A session of `wanted` whose mask is not back by then fails, typed;
    /// its grammar comes back with its late answer.
    fn finish_masks(
        &mut self,
        (pending, wanted): (Pending, Vec<SessionKey>),
        started: Instant,
    ) -> Masks {
        let budget = self.config.grammar_budget;
        let deadline = started
            .checked_add(budget)
            .unwrap_or(started)
            .max(Instant::now());
        let Some(thread) = self.grammars.as_ref() else {
            return Masks::new();
        };
        let (answers, late) = thread.finish(pending, deadline);
        self.take_back(late);
        let mut masks = Masks::new();
        for d in answers {
            let id = d.key.id;
            let mask = d
                .mask
                .map_err(|e| refusal(id, Reason::InvalidRequest, format!("session {id}: {e}")));
            if let Some(s) = self.sessions.get_mut(&d.key) {
                s.grammar = d.grammar;
            }
            masks.insert(d.key, mask);
        }
        for key in wanted {
            if masks.contains_key(&key) {
                continue;
            }
            let id = key.id;
            let e = budget_refusal(
                id,
                format!(
                    "session {id}: its grammar took longer than the budget of {} ms for one token (`grammar_budget_ms`, shard {})",
                    budget.as_millis(),
                    self.config.label
                ),
            );
            masks.insert(key, Err(e));
        }
        masks
    }

    /// The rows of the accepted fragments, and their slice of the incoming hidden states.
    fn rows_of(&self, job: &StepJob, accepted: &[usize]) -> (Vec<Row>, Vec<f32>) {
        let n_embd = self.model.config().n_embd;
        let mut row_offsets = Vec::with_capacity(job.fragments.len());
        let mut acc = 0;
        for f in &job.fragments {
            row_offsets.push(acc);
            acc += f.tokens.len();
        }
        let mut rows = Vec::new();
        let mut hidden = Vec::new();
        for (seq, &i) in accepted.iter().enumerate() {
            let f = &job.fragments[i];
            // A sample after the last token, and after every token before it that is drafted.
            let first_sampled = f.tokens.len() - n_outputs(f).min(f.tokens.len());
            for (k, &token) in f.tokens.iter().enumerate() {
                rows.push(Row {
                    seq,
                    pos: f.start_pos as usize + k,
                    token,
                    want_logits: f.want_output && k >= first_sampled,
                });
            }
            if let Some(h) = &job.hidden {
                let start = row_offsets[i] * n_embd;
                hidden.extend_from_slice(&h[start..start + f.tokens.len() * n_embd]);
            }
        }
        (rows, hidden)
    }

    /// Samples a token for every accepted fragment that asks for one, from its logit row; a
    /// verification fragment samples after its last known token and after each drafted token
    /// that equals the sample before it, then its session is cut back past the rejected ones.
    fn sample(
        &mut self,
        job: &StepJob,
        accepted: &[usize],
        keys: &[SessionKey],
        logits: &[f32],
        mut masks: Masks,
        out: &mut StepOutcome,
    ) {
        let n_vocab = self.model.config().n_vocab;
        let mut li = 0;
        for (&i, key) in accepted.iter().zip(keys) {
            let f = &job.fragments[i];
            if !f.want_output {
                continue;
            }
            let n_draft = f.n_draft as usize;
            let rows = &logits[li * n_vocab..(li + 1 + n_draft) * n_vocab];
            li += 1 + n_draft;
            let s = self
                .sessions
                .get_mut(key)
                .expect("admitted sessions are held");
            let mask = match masks.remove(key) {
                None => None,
                Some(Ok(m)) => Some(m),
                Some(Err(e)) => {
                    out.errors.push(e);
                    continue;
                }
            };
            // The session's tokens end with the fragment's: the known ones, then the drafts.
            let known_end = s.tokens.len() - n_draft;
            let drafts = &f.tokens[f.tokens.len() - n_draft..];
            let mut kept = 0;
            for (j, l) in rows.chunks_exact(n_vocab).enumerate() {
                let sampler = s
                    .sampler
                    .get_or_insert_with(|| Sampler::new(SamplingParams::default()));
                let token = sampler.sample(l, &s.tokens[..known_end + j], mask.as_deref());
                out.outputs.push(SessionOutput {
                    next_pos: (known_end + j) as u32,
                    ..output(f.session_id, token, l, s.n_top, f.want_logprob)
                });
                if drafts.get(j) != Some(&token) {
                    break;
                }
                kept += 1;
            }
            if kept < n_draft {
                s.rewind(known_end + kept);
            }
        }
    }
}

/// One sampled token with the log-probabilities asked for: its own (`want_logprob`) and the
/// `n_top` best.
fn output(session_id: u64, token: u32, l: &[f32], n_top: u32, want_logprob: bool) -> SessionOutput {
    let n_top = (n_top as usize).min(l.len());
    let top = if n_top > 0 {
        let best: Vec<u32> = top_k(l, n_top).into_iter().map(|(id, _)| id).collect();
        let lp = log_probs(l, &best);
        best.into_iter()
            .zip(lp)
            .map(|(token, logprob)| TopLogprob { token, logprob })
            .collect()
    } else {
        Vec::new()
    };
    SessionOutput {
        session_id,
        token,
        logprob: if want_logprob || n_top > 0 {
            log_probs(l, &[token])[0]
        } else {
            0.0
        },
        top,
        next_pos: 0,
    }
}

/// A 64-bit mix (splitmix64's finalizer): distinct partitions get unrelated roots.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
