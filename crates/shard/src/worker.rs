//! The compute thread's state: the model, every session's KV cache, and the step it runs.
//!
//! Sessions are keyed by who opened them: the route stream and the id the tracker gave the
//! session on it ([`SessionKey`]). Two trackers, or two routes of one tracker, number their
//! sessions independently; keyed by id alone they would read and extend each other's caches.

use std::collections::HashMap;
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

mod admit;
use crate::messages::{Counters, Early, EarlyJob, StepJob, StepOutcome, TokenSteps};
use crate::ShardConfig;

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
