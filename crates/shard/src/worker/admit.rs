//! Admitting a step's fragments one by one: each checked (prefix, empty, drafts, context,
//! scratch, sampling parameters), its session opened or found (a stale epoch, a cache miss, the
//! session limit), a cached prefix attached, room made in the KV pool; refusals typed.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use engine::{Reason, Refusal};
use model::sampling::{Sampler, SamplingParams};
use proto::v1::{Fragment, SessionError};

use super::{n_outputs, refusal, Session, SessionKey, Worker, MAX_DRAFT};
use crate::grammar::Grammar;
use crate::messages::{StepJob, StepOutcome};
use crate::mib;

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
    pub(super) fn admit(
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
}
