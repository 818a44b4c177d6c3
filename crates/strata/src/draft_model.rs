//! A draft model beside the routes: a smaller model with the target's vocabulary
//! (Qwen2.5-Coder-0.5B for the 1.5B) proposing tokens for speculative decoding.
//!
//! It runs on a thread of its own with its own kernel threads and KV pool, so no route's loop
//! computes it: a route asks for a draft ([`DraftSource::poll`]) when it plans a session's
//! decode step, and gets what is ready for the session's tokens, or `Pending` (the thread is
//! computing it and wakes the route when done). The thread keeps each session's draft KV, so
//! a round computes only the tokens the route accepted since the last one and the new draft.
//!
//! A draft is the draft model's greedy continuation of the session's known tokens. It is
//! kept after it was handed out: when the route kept every drafted token it was given and its
//! own next token equals the draft's next one (a draft is longer than what one step takes
//! when the step had less room), the rest is ready without computing anything.
//!
//! What a client receives never depends on the draft: the last shard samples every drafted
//! position with the session's own sampler and keeps a drafted token only while it equals that
//! sample.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use engine::{DraftPoll, DraftSource, SessionId, Wake};
use model::{Batch, KvCache, KvPool, Model, ModelOptions, Row};
use text::Tokenizer;

/// Prompt tokens one forward pass of the draft model takes: a long prompt is computed in
/// chunks, so a round's memory stays bounded whatever the context.
const CHUNK: usize = 256;

/// The draft model and the thread that runs it.
pub struct DraftModel {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    tokenizer: Tokenizer,
    name: String,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
}

#[derive(Default)]
struct State {
    sessions: HashMap<SessionId, Slot>,
    /// Sessions that asked for a draft, in the order they asked.
    asked: VecDeque<SessionId>,
    /// Sessions forgotten since the thread last looked: their KV goes.
    forgotten: Vec<SessionId>,
    shutdown: bool,
}

/// What a route and the thread share about one session.
#[derive(Default)]
struct Slot {
    /// The session's known tokens, as of its last poll.
    tokens: Vec<u32>,
    /// Counts the times `tokens` was replaced rather than extended (a session moved or
    /// replayed with other tokens): the thread then compares its KV from the start.
    epoch: u64,
    /// A draft asked for and not yet computed: how many tokens, and whom to wake.
    ask: Option<(usize, Wake)>,
    /// The thread is computing a draft to follow this many of `tokens`.
    computing: Option<usize>,
    /// The latest draft: how many of `tokens` it follows, and the drafted tokens.
    draft: Option<(usize, Vec<u32>)>,
}

/// The thread's own state of one session: its KV and the tokens in it.
struct Run {
    cache: KvCache,
    /// The tokens whose K and V the cache holds, in order.
    computed: Vec<u32>,
    /// The leading tokens of `computed` known to equal the slot's tokens of `epoch`.
    agreed: usize,
    epoch: u64,
}

impl DraftModel {
    /// Loads the model at `path` with `n_threads` kernel threads and a KV budget of
    /// `kv_bytes` for every session's draft KV together; `n_ctx` caps a session's positions.
    pub fn load(path: &Path, n_threads: usize, kv_bytes: usize, n_ctx: usize) -> Result<Self> {
        let file =
            gguf::GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
        let tokenizer = Tokenizer::from_header(file.header())
            .with_context(|| format!("reading the vocabulary of {}", path.display()))?;
        let model = Model::load(
            &file,
            None,
            ModelOptions {
                n_threads: n_threads.max(1),
                isa: None,
            },
        )
        .with_context(|| format!("loading the draft model {}", path.display()))?;
        let n_ctx = n_ctx.min(model.config().n_ctx_train.max(1));
        let pool = model.new_pool(kv_bytes);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
        });
        let n_vocab = tokenizer.n_vocab();
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("strata-draft".into())
                .spawn(move || {
                    Drafter {
                        model,
                        pool,
                        n_ctx,
                        n_vocab,
                        runs: HashMap::new(),
                        logits: Vec::new(),
                    }
                    .serve(&shared)
                })
                .context("starting the draft thread")?
        };
        Ok(DraftModel {
            shared,
            thread: Some(thread),
            tokenizer,
            name: path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into(),
            ),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for DraftModel {
    fn drop(&mut self) {
        self.lock().shutdown = true;
        self.shared.work.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DraftModel({})", self.name)
    }
}

impl tracker::DraftModel for DraftModel {
    fn vocabulary_difference(&self, target: &Tokenizer) -> Option<String> {
        target.difference(&self.tokenizer)
    }

    fn name(&self) -> &str {
        &self.name
    }
}

impl DraftSource for DraftModel {
    fn poll(&self, session: SessionId, tokens: &[u32], k: usize, wake: &Wake) -> DraftPoll {
        let mut state = self.lock();
        let state = &mut *state;
        let slot = state.sessions.entry(session).or_default();
        // The session's tokens only grow while it stays here: extend them, or take them anew
        // when they do not continue what the slot holds.
        let n = slot.tokens.len();
        let continues = n <= tokens.len() && (n == 0 || slot.tokens[n - 1] == tokens[n - 1]);
        if continues {
            slot.tokens.extend_from_slice(&tokens[n..]);
        } else {
            slot.tokens = tokens.to_vec();
            slot.epoch += 1;
            slot.draft = None;
            slot.computing = None;
        }
        if let Some((base, draft)) = &slot.draft {
            // Ready when the tokens past its base are the draft's own first tokens (nothing
            // past the base, or what the route kept of it and a next token that agreed).
            let past = tokens.len().checked_sub(*base);
            if let Some(past) = past.filter(|&p| p <= draft.len()) {
                if tokens[*base..] == draft[..past] && (past < draft.len() || past == 0) {
                    let rest = &draft[past..];
                    return DraftPoll::Ready(rest[..rest.len().min(k)].to_vec());
                }
            }
        }
        if slot.computing == Some(tokens.len()) {
            // Its draft is on the way (the thread wakes whoever asked).
            return DraftPoll::Pending;
        }
        if slot.ask.is_none() {
            state.asked.push_back(session);
        }
        slot.ask = Some((k, Arc::clone(wake)));
        self.shared.work.notify_one();
        DraftPoll::Pending
    }

    fn forget(&self, session: SessionId) {
        let mut state = self.lock();
        if state.sessions.remove(&session).is_some() {
            state.forgotten.push(session);
            self.shared.work.notify_one();
        }
    }
}

/// The draft thread's side.
struct Drafter {
    model: Model,
    pool: KvPool,
    n_ctx: usize,
    /// Tokens of the shared vocabulary: a draft never proposes an id past them (the model's
    /// output may be padded beyond).
    n_vocab: usize,
    runs: HashMap<SessionId, Run>,
    logits: Vec<f32>,
}

/// One round's work, taken under the lock: the tokens to append past what agrees.
struct Job {
    session: SessionId,
    k: usize,
    wake: Wake,
    /// Tokens of the slot past `start`, where the session's run starts to differ.
    start: usize,
    tail: Vec<u32>,
    len: usize,
    epoch: u64,
}

impl Drafter {
    fn serve(mut self, shared: &Shared) {
        loop {
            let job = {
                let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    for s in std::mem::take(&mut state.forgotten) {
                        self.runs.remove(&s);
                    }
                    if state.shutdown {
                        return;
                    }
                    if let Some(job) = self.next_job(&mut state) {
                        break job;
                    }
                    state = shared.work.wait(state).unwrap_or_else(|e| e.into_inner());
                }
            };
            let draft = self.draft(&job);
            let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            // A draft of tokens the session no longer has (they were replaced meanwhile) is
            // dropped.
            if let Some(slot) = state.sessions.get_mut(&job.session) {
                if slot.epoch == job.epoch {
                    slot.draft = Some((job.len, draft));
                    slot.computing = None;
                }
            }
            drop(state);
            (job.wake)();
        }
    }

    /// The oldest session that asked and is still here, with the tokens its run lacks.
    fn next_job(&mut self, state: &mut State) -> Option<Job> {
        while let Some(session) = state.asked.pop_front() {
            let Some(slot) = state.sessions.get_mut(&session) else {
                continue;
            };
            let Some((k, wake)) = slot.ask.take() else {
                continue;
            };
            let run = self.runs.entry(session).or_insert_with(|| Run {
                cache: self.pool.new_cache(self.n_ctx),
                computed: Vec::new(),
                agreed: 0,
                epoch: slot.epoch,
            });
            if run.epoch != slot.epoch {
                run.epoch = slot.epoch;
                run.agreed = 0;
            }
            // Tokens before `agreed` were compared already and the slot's only grow within
            // an epoch: each token is compared once.
            let upto = run.computed.len().min(slot.tokens.len());
            while run.agreed < upto && run.computed[run.agreed] == slot.tokens[run.agreed] {
                run.agreed += 1;
            }
            let start = run.agreed;
            slot.computing = Some(slot.tokens.len());
            return Some(Job {
                session,
                k,
                wake,
                start,
                tail: slot.tokens[start..].to_vec(),
                len: slot.tokens.len(),
                epoch: slot.epoch,
            });
        }
        None
    }

    /// The draft model's greedy continuation of the job's tokens, `k` tokens long (fewer
    /// when the context or the KV budget runs out, none after a failure).
    fn draft(&mut self, job: &Job) -> Vec<u32> {
        if job.len == 0 || job.len + job.k > self.n_ctx {
            return Vec::new();
        }
        let Some(mut run) = self.runs.remove(&job.session) else {
            return Vec::new();
        };
        let out = self.extend(&mut run, job).unwrap_or_else(|e| {
            tracing::debug!(session = job.session.0, "no draft: {e}");
            run.cache.truncate(0);
            run.computed.clear();
            run.agreed = 0;
            Vec::new()
        });
        self.runs.insert(job.session, run);
        out
    }

    fn extend(&mut self, run: &mut Run, job: &Job) -> Result<Vec<u32>, model::Error> {
        // The run agrees with the session's tokens up to `job.start`. The last known token is
        // computed again when the run holds it already (its logits were not kept); a cache of
        // sliding-window layers may have to start over (`truncate` says how far it went).
        run.cache.truncate(job.start.min(job.len - 1));
        let keep = run.cache.len();
        let mut known = run.computed[keep..job.start].to_vec();
        known.extend_from_slice(&job.tail);
        run.computed.truncate(keep);
        run.agreed = keep;
        let mut next = None;
        for chunk in known.chunks(CHUNK) {
            next = Some(self.step(run, chunk)?);
        }
        run.agreed = job.len;
        let mut draft = Vec::with_capacity(job.k);
        while let Some(t) = next.take() {
            if t as usize >= self.n_vocab {
                break;
            }
            draft.push(t);
            if draft.len() < job.k {
                next = Some(self.step(run, &[t])?);
            }
        }
        Ok(draft)
    }

    /// Runs `tokens` after the run's cache and returns the greedy next token.
    fn step(&mut self, run: &mut Run, tokens: &[u32]) -> Result<u32, model::Error> {
        let start = run.cache.len();
        let rows: Vec<Row> = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                seq: 0,
                pos: start + i,
                token,
                want_logits: i + 1 == tokens.len(),
            })
            .collect();
        let batch = Batch {
            rows: &rows,
            hidden: None,
        };
        if let Err(e) = self
            .model
            .forward_into(batch, &mut [&mut run.cache], &mut self.logits)
        {
            if !matches!(e, model::Error::KvExhausted(_)) || self.runs.is_empty() {
                return Err(e);
            }
            // Other sessions' draft KV makes room (they compute theirs again when asked).
            self.runs.clear();
            self.model
                .forward_into(batch, &mut [&mut run.cache], &mut self.logits)?;
        }
        run.computed.extend_from_slice(tokens);
        let n = self.model.config().n_vocab.min(self.n_vocab);
        Ok(argmax(&self.logits[..n]))
    }
}

/// The first index of the largest value.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
