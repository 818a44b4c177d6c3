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

/// A session whose known tokens are more than this many ahead of what the draft model has read
/// (a long new prompt) decodes without drafts while the thread reads them, instead of waiting
/// (it would wait `--draft-wait-ms` for every token until the thread is done); a shorter read
/// is waited for, like a draft.
const CATCH_UP: usize = 512;

/// The draft model and the thread that runs it.
pub struct DraftModel {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    tokenizer: Tokenizer,
    name: String,
    /// Most positions a session's draft KV may hold.
    n_ctx: usize,
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
    /// The thread stopped after a panic: no session waits for a draft any more.
    dead: bool,
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
    /// How many of `tokens` the thread's KV of the session holds, as of its last draft.
    read: usize,
    /// The session alone does not fit the draft KV budget: it gets no drafts (until its
    /// tokens are replaced).
    unable: bool,
}

impl Slot {
    /// Up to `k` tokens of the latest draft that follow the session's tokens now: the draft
    /// follows them, or the tokens past its base are its own first tokens (what the route
    /// kept of a longer draft, and a next token that agreed).
    fn ready(&self, k: usize) -> Option<Vec<u32>> {
        let (base, draft) = self.draft.as_ref()?;
        let past = self.tokens.len().checked_sub(*base)?;
        let fits = past == 0 || past < draft.len() && self.tokens[*base..] == draft[..past];
        fits.then(|| draft[past..(past + k).min(draft.len())].to_vec())
    }
}

/// The thread's own state of one session: its KV and the tokens in it.
struct Run {
    cache: KvCache,
    /// The tokens whose K and V the cache holds, in order.
    computed: Vec<u32>,
    /// The leading tokens of `computed` known to equal the slot's tokens of `epoch`.
    agreed: usize,
    epoch: u64,
    /// When it last drafted (the thread's count of jobs): the least recent run's KV goes
    /// first when the pool is full.
    used: u64,
}

impl DraftModel {
    /// Loads the model at `path` with `n_threads` kernel threads and a KV budget of
    /// `kv_bytes` for every session's draft KV together; `n_ctx` caps a session's positions;
    /// `ahead` tokens are drafted past each handed-out draft while the route verifies it.
    pub fn load(
        path: &Path,
        n_threads: usize,
        kv_bytes: usize,
        n_ctx: usize,
        ahead: usize,
    ) -> Result<Self> {
        let file =
            gguf::GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
        let tokenizer = Tokenizer::from_header(file.header())
            .with_context(|| format!("reading the vocabulary of {}", path.display()))?;
        let model = Model::load(
            &file,
            None,
            ModelOptions {
                n_threads: n_threads.max(1),
                ..ModelOptions::default()
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
                        jobs: 0,
                        evicted: Vec::new(),
                        ahead,
                    }
                    .serve(&shared)
                })
                .context("starting the draft thread")?
        };
        Ok(DraftModel {
            shared,
            thread: Some(thread),
            n_ctx,
            tokenizer,
            name: path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into(),
            ),
        })
    }

    /// Token ids of its vocabulary are below this.
    pub fn n_vocab(&self) -> usize {
        self.tokenizer.n_vocab()
    }

    /// Most tokens of a session it drafts for.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
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
        if state.dead || tokens.is_empty() || tokens.len() + k > self.n_ctx {
            return DraftPoll::Ready(Vec::new());
        }
        let slot = state.sessions.entry(session).or_default();
        // The session's tokens only grow while it stays here: extend them, or take them anew
        // when they do not continue what the slot holds.
        let n = slot.tokens.len();
        let continues = n <= tokens.len() && (n == 0 || slot.tokens[n - 1] == tokens[n - 1]);
        if continues {
            slot.tokens.extend_from_slice(&tokens[n..]);
        } else {
            *slot = Slot {
                tokens: tokens.to_vec(),
                epoch: slot.epoch + 1,
                ..Slot::default()
            };
        }
        if slot.unable {
            return DraftPoll::Ready(Vec::new());
        }
        if let Some(draft) = slot.ready(k) {
            return DraftPoll::Ready(draft);
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
        if tokens.len() - slot.read.min(tokens.len()) > CATCH_UP {
            // A prompt the draft model has not read: decode without a draft meanwhile.
            return DraftPoll::Ready(Vec::new());
        }
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
    /// Jobs taken so far (the runs' clock).
    jobs: u64,
    /// Sessions whose KV went to make room, since the last job ended.
    evicted: Vec<SessionId>,
    /// Tokens drafted past a handed-out draft while the route verifies it.
    ahead: usize,
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
        let lock = || shared.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let job = {
                let mut state = lock();
                loop {
                    for s in std::mem::take(&mut state.forgotten) {
                        self.runs.remove(&s);
                    }
                    if state.shutdown {
                        return;
                    }
                    let mut answered = Vec::new();
                    let job = self.next_job(&mut state, &mut answered);
                    if !answered.is_empty() {
                        drop(state);
                        for wake in answered {
                            wake();
                        }
                        state = lock();
                    }
                    if let Some(job) = job {
                        break job;
                    }
                    if !state.asked.is_empty() || !state.forgotten.is_empty() || state.shutdown {
                        continue;
                    }
                    state = shared.work.wait(state).unwrap_or_else(|e| e.into_inner());
                }
            };
            let drafted =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.draft(&job)));
            let mut state = lock();
            let Ok((draft, outcome)) = drafted else {
                tracing::error!("the draft model's thread failed: sessions decode without drafts");
                state.dead = true;
                drop(state);
                (job.wake)();
                return;
            };
            for s in std::mem::take(&mut self.evicted) {
                if let Some(slot) = state.sessions.get_mut(&s) {
                    slot.read = 0;
                }
            }
            // A draft of tokens the session no longer has (they were replaced meanwhile) is
            // dropped.
            if let Some(slot) = state.sessions.get_mut(&job.session) {
                if slot.epoch == job.epoch {
                    slot.draft = Some((job.len, draft));
                    slot.computing = None;
                    slot.read = if outcome == Outcome::Drafted {
                        job.len
                    } else {
                        0
                    };
                    slot.unable = outcome == Outcome::Unable;
                }
            }
            drop(state);
            (job.wake)();
            if outcome == Outcome::Drafted && self.ahead > 0 {
                let ahead = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.ahead(shared, &job)
                }));
                if ahead.is_err() {
                    tracing::error!(
                        "the draft model's thread failed: sessions decode without drafts"
                    );
                    lock().dead = true;
                    return;
                }
            }
        }
    }

    /// Drafts on past a draft it handed out, up to `ahead` tokens, while no session asks for
    /// anything and the session's tokens are still the draft's base: when the route keeps the
    /// whole draft and its own next token equals the draft's, the next draft is ready at once.
    /// The thread does this while the route verifies, so on cores of its own it costs the
    /// route nothing.
    fn ahead(&mut self, shared: &Shared, job: &Job) {
        let lock = || shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut run) = self.runs.remove(&job.session) else {
            return;
        };
        for _ in 0..self.ahead {
            let last = {
                let state = lock();
                let Some(slot) = state.sessions.get(&job.session) else {
                    break;
                };
                match &slot.draft {
                    Some((base, d))
                        if state.asked.is_empty()
                            && !state.shutdown
                            && slot.epoch == job.epoch
                            && *base == job.len
                            && slot.tokens.len() == job.len
                            && !d.is_empty()
                            && run.computed.len() + 1 == job.len + d.len() =>
                    {
                        d[d.len() - 1]
                    }
                    _ => break,
                }
            };
            let Ok(next) = self.step(&mut run, &[last]) else {
                break;
            };
            if next as usize >= self.n_vocab {
                break;
            }
            let mut state = lock();
            for s in std::mem::take(&mut self.evicted) {
                if let Some(slot) = state.sessions.get_mut(&s) {
                    slot.read = 0;
                }
            }
            match state.sessions.get_mut(&job.session) {
                Some(slot) if slot.epoch == job.epoch => match &mut slot.draft {
                    Some((base, d)) if *base == job.len => d.push(next),
                    _ => break,
                },
                _ => break,
            }
        }
        self.runs.insert(job.session, run);
    }

    /// The oldest session that asked and is still here, with the tokens its run lacks. An ask
    /// answered meanwhile (drafting ahead made its draft) is skipped, its waker put in
    /// `answered`: whoever asked is woken, or it would wait for nothing.
    fn next_job(&mut self, state: &mut State, answered: &mut Vec<Wake>) -> Option<Job> {
        while let Some(session) = state.asked.pop_front() {
            let Some(slot) = state.sessions.get_mut(&session) else {
                continue;
            };
            let Some((k, wake)) = slot.ask.take() else {
                continue;
            };
            if slot.unable || slot.ready(k).is_some() {
                // Answered already: the route finds the draft when it asks again.
                answered.push(wake);
                continue;
            }
            self.jobs += 1;
            let run = self.runs.entry(session).or_insert_with(|| Run {
                cache: self.pool.new_cache(self.n_ctx),
                computed: Vec::new(),
                agreed: 0,
                epoch: slot.epoch,
                used: 0,
            });
            run.used = self.jobs;
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
    /// when the context runs out, none after a failure), and how it went.
    fn draft(&mut self, job: &Job) -> (Vec<u32>, Outcome) {
        if job.len == 0 || job.len + job.k > self.n_ctx {
            return (Vec::new(), Outcome::Failed);
        }
        let Some(mut run) = self.runs.remove(&job.session) else {
            return (Vec::new(), Outcome::Failed);
        };
        let out = match self.extend(&mut run, job) {
            Ok(draft) => (draft, Outcome::Drafted),
            Err(e) => {
                tracing::debug!(session = job.session.0, "no draft: {e}");
                run.cache.truncate(0);
                run.computed.clear();
                run.agreed = 0;
                // Alone in the pool and still short of room: it never fits.
                let unable = matches!(e, model::Error::KvExhausted(_));
                (
                    Vec::new(),
                    if unable {
                        Outcome::Unable
                    } else {
                        Outcome::Failed
                    },
                )
            }
        };
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
        let rows = Row::of_session(run.cache.len(), tokens, false);
        let batch = Batch {
            rows: &rows,
            hidden: None,
        };
        // When the pool is full, the least recently drafting sessions' KV makes room, one at
        // a time (they read their tokens again when they draft next).
        while let Err(e) = self
            .model
            .forward_into(batch, &mut [&mut run.cache], &mut self.logits)
        {
            let lru = self
                .runs
                .iter()
                .min_by_key(|(_, r)| r.used)
                .map(|(&s, _)| s);
            match (e, lru) {
                (model::Error::KvExhausted(_), Some(s)) => {
                    self.runs.remove(&s);
                    self.evicted.push(s);
                }
                (e, _) => return Err(e),
            }
        }
        run.computed.extend_from_slice(tokens);
        let n = self.model.config().n_vocab.min(self.n_vocab);
        Ok(argmax(&self.logits[..n]))
    }
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Drafted,
    /// The session alone does not fit the draft KV budget.
    Unable,
    /// Anything else: nothing drafted this time.
    Failed,
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    fn slot(tokens: &[u32], base: usize, draft: &[u32]) -> Slot {
        Slot {
            tokens: tokens.to_vec(),
            draft: Some((base, draft.to_vec())),
            ..Slot::default()
        }
    }

    #[test]
    fn a_draft_is_ready_for_its_base_and_for_what_the_route_kept_of_it() {
        let d = [7, 8, 9, 10];
        assert_eq!(slot(&[1, 2], 2, &d).ready(3), Some(vec![7, 8, 9]));
        // The route kept 7 and its own next token was 8: the rest follows.
        assert_eq!(slot(&[1, 2, 7, 8], 2, &d).ready(8), Some(vec![9, 10]));
        assert_eq!(
            slot(&[1, 2, 7, 5], 2, &d).ready(8),
            None,
            "a token that differs"
        );
        assert_eq!(slot(&[1, 2, 7, 8, 9, 10], 2, &d).ready(8), None, "all used");
        assert_eq!(slot(&[1], 2, &d).ready(8), None, "a base past the tokens");
        assert_eq!(
            slot(&[1, 2], 2, &[]).ready(8),
            Some(vec![]),
            "nothing to propose"
        );
    }

    /// Polls until the draft is ready, waiting for the thread's wake-ups.
    fn drafted(d: &DraftModel, session: u64, tokens: &[u32], k: usize) -> Vec<u32> {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let wake: Wake = Arc::new(move || {
            let _ = tx.lock().unwrap().send(());
        });
        loop {
            match d.poll(SessionId(session), tokens, k, &wake) {
                DraftPoll::Ready(t) if !t.is_empty() => return t,
                DraftPoll::Ready(_) | DraftPoll::Pending => {
                    rx.recv_timeout(Duration::from_secs(60))
                        .expect("the draft thread wakes whoever asked");
                }
            }
        }
    }

    /// The model's greedy continuation, computed the plain way.
    fn greedy(path: &Path, tokens: &[u32], k: usize) -> Vec<u32> {
        let file = gguf::GgufFile::open(path).unwrap();
        let model = Model::load(&file, None, ModelOptions::default()).unwrap();
        let mut cache = model.new_cache(4096);
        let mut out = Vec::new();
        let mut next = tokens.to_vec();
        for _ in 0..k {
            let rows = Row::of_session(cache.len(), &next, false);
            let logits = match model
                .forward(
                    Batch {
                        rows: &rows,
                        hidden: None,
                    },
                    &mut [&mut cache],
                )
                .unwrap()
            {
                model::Output::Logits(l) => l,
                model::Output::Hidden(_) => unreachable!("a whole model"),
            };
            let t = argmax(&logits);
            out.push(t);
            next = vec![t];
        }
        out
    }

    /// With `ahead`, the thread drafts on past a handed-out draft: when the route keeps it
    /// whole and its next token is the draft's, the next draft is ready without waiting, and
    /// it is the model's greedy continuation still.
    #[test]
    fn drafting_ahead_has_the_next_draft_ready_when_the_route_keeps_the_whole_draft() {
        let m = testkit::real_model();
        let d = DraftModel::load(&m, 1, 64 << 20, 4096, 4).unwrap();
        let a: Vec<u32> = (0..20).map(|i| 100 + i * 7).collect();
        let want = greedy(&m, &a, 6);
        assert_eq!(drafted(&d, 1, &a, 2), want[..2]);
        let waited = std::time::Instant::now();
        while d.lock().sessions[&SessionId(1)]
            .draft
            .as_ref()
            .unwrap()
            .1
            .len()
            < 6
        {
            assert!(
                waited.elapsed() < Duration::from_secs(60),
                "never drafted ahead"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // The route kept both drafted tokens and sampled the draft's third as its own.
        let mut kept = a.clone();
        kept.extend(&want[..3]);
        let wake: Wake = Arc::new(|| {});
        assert_eq!(
            d.poll(SessionId(1), &kept, 2, &wake),
            DraftPoll::Ready(want[3..5].to_vec())
        );
    }

    /// Drafts are the model's greedy continuation, for a new session, for one that goes on
    /// (what it read is reused) and for one whose KV was evicted to make room for another's
    /// (two sessions in a pool that holds one); a prompt far ahead of what the thread read
    /// gets no draft at once (it decodes without while the thread reads it), and a session
    /// that alone does not fit gets none at all.
    #[test]
    fn drafts_are_the_greedy_continuation_and_room_is_made_least_recent_first() {
        let m = testkit::real_model();
        let a: Vec<u32> = (0..20).map(|i| 100 + i * 7).collect();
        let b: Vec<u32> = (0..20).map(|i| 300 + i * 5).collect();
        // A pool of three KV blocks of 16 positions (f16 K and V of every layer) holds one
        // session of these lengths (two blocks), not two.
        let c =
            model::ModelConfig::from_header(gguf::GgufFile::open(&m).unwrap().header()).unwrap();
        let block = 16 * c.n_layers * c.kv_dim() * 2 * 2;
        let d = DraftModel::load(&m, 1, 3 * block, 4096, 0).unwrap();
        let da = drafted(&d, 1, &a, 4);
        assert_eq!(da, greedy(&m, &a, 4));
        let mut a2 = a.clone();
        a2.extend([da[0], 55]);
        assert_eq!(drafted(&d, 1, &a2, 3), greedy(&m, &a2, 3), "going on");
        assert_eq!(drafted(&d, 2, &b, 3), greedy(&m, &b, 3), "another session");
        assert_eq!(d.lock().sessions[&SessionId(1)].read, 0, "its KV went");
        a2.push(66);
        assert_eq!(
            drafted(&d, 1, &a2, 3),
            greedy(&m, &a2, 3),
            "after its KV went"
        );

        let long: Vec<u32> = (0..600).map(|i| 500 + i).collect();
        let (tx, _rx) = mpsc::channel::<()>();
        let tx = Mutex::new(tx);
        let wake: Wake = Arc::new(move || {
            let _ = tx.lock().unwrap().send(());
        });
        assert_eq!(
            d.poll(SessionId(3), &long, 4, &wake),
            DraftPoll::Ready(Vec::new()),
            "a prompt not read yet"
        );
        let small = DraftModel::load(&m, 1, block, 4096, 0).unwrap();
        let waited = std::time::Instant::now();
        loop {
            match small.poll(SessionId(1), &long, 4, &wake) {
                DraftPoll::Ready(t) if small.lock().sessions[&SessionId(1)].unable => {
                    assert!(t.is_empty());
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
            assert!(
                waited.elapsed() < Duration::from_secs(60),
                "never marked unable"
            );
        }
    }
}
