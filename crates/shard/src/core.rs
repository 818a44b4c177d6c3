//! The compute owner: weights, sessions and their KV caches, one step at a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use gguf::{GgufFile, Value, Writer};
use model::sampling::{log_probs, top_k, Sampler, SamplingParams};
use model::{Batch, KvCache, KvPool, LayerRange, Model, ModelOptions, Row, BLOCK_POSITIONS};
use proto::v1::{
    Budgets, CacheRecipe, Fragment, SessionError, SessionOutput, ShardInfo, ShardStats, TopLogprob,
};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use crate::{mib, Error, ShardConfig};

/// Counters shared with the stats RPC (written by the compute thread only).
#[derive(Debug, Default)]
pub struct Counters {
    pub prefill_tokens: AtomicU64,
    pub decode_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub sessions: AtomicU64,
    pub kv_bytes_in_use: AtomicU64,
    pub seam_bytes_out: AtomicU64,
    pub compute_micros: AtomicU64,
    pub rejected_fragments: AtomicU64,
    pub evictions: AtomicU64,
    pub kv_blocks_in_use: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub kv_block_bytes: AtomicU64,
    pub scratch_bytes_last_step: AtomicU64,
    /// Activation bytes sent downstream and not yet answered (route streams add and subtract).
    pub inflight_bytes: AtomicU64,
    /// Positions sessions started on from the prefix cache instead of computing them.
    pub prefix_reused_tokens: AtomicU64,
    pub kv_blocks_idle: AtomicU64,
    /// Early decode steps (see [`EarlyJob`]): started, used as the tracker's step, discarded.
    pub early_steps_started: AtomicU64,
    pub early_steps_used: AtomicU64,
    pub early_steps_discarded: AtomicU64,
    pub kernel_thread_moves: AtomicU64,
}

impl Counters {
    /// Counts a step that ran these fragments.
    pub fn count_step(&self, fragments: &[Fragment]) {
        for f in fragments {
            let counter = if f.start_pos > 0 && f.tokens.len() == 1 && f.prefix.is_empty() {
                &self.decode_tokens
            } else {
                &self.prefill_tokens
            };
            counter.fetch_add(f.tokens.len() as u64, Ordering::Relaxed);
            self.prefix_reused_tokens
                .fetch_add(f.prefix.len() as u64, Ordering::Relaxed);
        }
        self.steps.fetch_add(1, Ordering::Relaxed);
    }
}

/// One step as the compute thread sees it.
pub struct StepJob {
    pub stream_id: u64,
    pub epoch: u64,
    pub fragments: Vec<Fragment>,
    pub release: Vec<u64>,
    /// Incoming hidden states (rows of every fragment, in order) for a shard past layer 0.
    pub hidden: Option<Vec<f32>>,
    /// When the step arrived (the policy's clock; the compute thread never reads one).
    pub now: Instant,
    /// Sessions whose K and V are the same function of their tokens share cached prefix
    /// blocks: 0 where the incoming hidden states are exact (f32 seams), the route stream
    /// where a lossy seam encoding makes them depend on the route's cut points.
    pub prefix_scope: u64,
    /// Sessions to cut back to a length before anything else (an early step the tracker's
    /// step did not confirm).
    pub rollback: Vec<(u64, usize)>,
}

/// A decode step the first shard starts before the tracker's step arrives: the last shard
/// named the tokens it sampled (a token hint), and the tracker's next step for those sessions
/// is usually exactly them, one position further each. Run like a step, but all or nothing,
/// evicting no one and counted only once used.
pub struct EarlyJob {
    pub stream_id: u64,
    pub epoch: u64,
    /// `(session, token, position)` in the order the step would name them.
    pub tokens: Vec<(u64, u32, u32)>,
    pub now: Instant,
    pub prefix_scope: u64,
}

/// An early step that ran: its fragments and what it produced.
#[derive(Debug)]
pub struct Early {
    pub fragments: Vec<Fragment>,
    pub outcome: StepOutcome,
}

impl Early {
    /// Whether a step of the tracker's (of the epoch the early step ran under) is exactly this
    /// early step: the same sessions at the same positions with the same tokens, in order,
    /// releasing no one and naming no cached prefix.
    pub fn matches(&self, fragments: &[Fragment], release: &[u64]) -> bool {
        release.is_empty()
            && self.fragments.len() == fragments.len()
            && self.fragments.iter().zip(fragments).all(|(e, f)| {
                e.session_id == f.session_id
                    && e.start_pos == f.start_pos
                    && e.tokens == f.tokens
                    && f.prefix.is_empty()
            })
    }

    /// Where each of its sessions stood before it: the rollback that undoes it.
    pub fn rollback(&self) -> Vec<(u64, usize)> {
        self.fragments
            .iter()
            .map(|f| (f.session_id, f.start_pos as usize))
            .collect()
    }
}

/// What a step produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// The fragments that were executed (forwarded downstream), in order.
    pub accepted: Vec<Fragment>,
    /// Hidden states of the accepted rows (when this is not the last shard).
    pub hidden: Vec<f32>,
    /// Sampled tokens (when this is the last shard).
    pub outputs: Vec<SessionOutput>,
    /// Typed refusals of single fragments.
    pub errors: Vec<SessionError>,
    pub compute_micros: u64,
}

enum Job {
    Step(StepJob, oneshot::Sender<StepOutcome>),
    Early(EarlyJob, oneshot::Sender<Option<Early>>),
    ReleaseStream(u64),
}

struct Session {
    epoch: u64,
    stream_id: u64,
    kv: KvCache,
    tokens: Vec<u32>,
    sampler: Option<Sampler>,
    n_top: u32,
    last_used: Instant,
}

/// The shard's loaded model and the handle to its compute thread.
pub struct ShardCore {
    pub config: ShardConfig,
    pub info: ShardInfo,
    pub vocab_gguf: Vec<u8>,
    pub counters: Arc<Counters>,
    jobs: std::sync::mpsc::Sender<Job>,
    next_stream: AtomicU64,
    /// Replies streams the tracker opened on this shard, until the route naming them starts.
    pub(crate) reply_sinks: crate::route::ReplySinks,
}

impl std::fmt::Debug for ShardCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ShardCore({} layers {}..{})",
            self.config.label, self.info.layer_start, self.info.layer_end
        )
    }
}

fn sha256_file(path: &std::path::Path) -> Result<String, Error> {
    let mut f = std::fs::File::open(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// A GGUF holding only the metadata a tokenizer and chat template need (no tensors).
fn vocab_file(f: &GgufFile) -> Vec<u8> {
    let mut w = Writer::new(3);
    for (k, v) in f.header().metadata() {
        if k.starts_with("tokenizer.") || k == "general.architecture" || k == "general.name" {
            w.metadata(k, v.clone());
        }
    }
    w.metadata("strata.vocab_only", Value::Bool(true));
    w.to_bytes()
}

impl ShardCore {
    /// Loads the range and starts the compute thread.
    pub fn load(config: ShardConfig) -> Result<Arc<ShardCore>, Error> {
        let digest = sha256_file(&config.model_path)?;
        let file = GgufFile::open(&config.model_path)?;
        let range = config.layers.map(|(start, end)| LayerRange { start, end });
        let model = Model::load(
            &file,
            range,
            ModelOptions {
                n_threads: config.n_threads,
                isa: None,
            },
        )?;
        let c = model.config().clone();
        let range = model.range();
        if model.weight_bytes() > config.weights_budget_bytes {
            return Err(Error::Budget(format!(
                "weights_budget on shard {}: layers {}..{} hold {:.1} MiB, more than the budget of {:.1} MiB",
                config.label,
                range.start,
                range.end,
                mib(model.weight_bytes() as u64),
                mib(config.weights_budget_bytes as u64)
            )));
        }
        let scratch_per_token = model.scratch_bytes(1, usize::from(model.is_last()));
        // The file name says what the model is more usefully than `general.name` usually does.
        let model_name = config
            .model_path
            .file_stem()
            .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
        let kv_pool = model.new_pool(config.kv_budget_bytes);
        let info = ShardInfo {
            protocol_version: proto::PROTOCOL_VERSION,
            model_digest: digest.clone(),
            model_name,
            architecture: "llama".into(),
            layer_start: range.start as u32,
            layer_end: range.end as u32,
            n_layers: c.n_layers as u32,
            n_embd: c.n_embd as u32,
            n_vocab: c.n_vocab as u32,
            recipe: Some(CacheRecipe {
                model_digest: digest,
                layer_start: range.start as u32,
                layer_end: range.end as u32,
                kv_dtype: "f16".into(),
                rope_base: c.rope_base,
                rope_dim: c.rope_dim as u32,
                rope_freq_scale: c.rope_freq_scale,
                block_size: model::BLOCK_POSITIONS as u32,
                n_ctx: config.n_ctx as u32,
            }),
            budgets: Some(Budgets {
                weight_bytes: model.weight_bytes() as u64,
                kv_bytes: config.kv_budget_bytes as u64,
                max_sessions: config.max_sessions as u32,
                // Every row of a step may produce logits (a decode step), so this is the most a
                // step of that many tokens can need.
                max_step_tokens: (config.scratch_budget_bytes / scratch_per_token) as u32,
                kv_block_bytes: kv_pool.block_bytes() as u64,
                scratch_bytes: config.scratch_budget_bytes as u64,
                scratch_bytes_per_token: scratch_per_token as u64,
                inflight_bytes: config.inflight_budget_bytes as u64,
                weights_budget_bytes: config.weights_budget_bytes as u64,
            }),
            listen: config.label.clone(),
            pinned: config.pinned,
        };
        let vocab_gguf = vocab_file(&file);
        drop(file);
        let counters = Arc::new(Counters::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let mut worker = Worker {
            kv_pool,
            model,
            sessions: HashMap::new(),
            counters: Arc::clone(&counters),
            config: config.clone(),
            logits: Vec::new(),
        };
        std::thread::Builder::new()
            .name("strata-compute".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    worker.handle(job);
                }
            })
            .map_err(|source| Error::Io {
                path: "compute thread".into(),
                source,
            })?;
        Ok(Arc::new(ShardCore {
            config,
            info,
            vocab_gguf,
            counters,
            jobs: tx,
            next_stream: AtomicU64::new(1),
            reply_sinks: Default::default(),
        }))
    }

    pub fn is_first(&self) -> bool {
        self.info.layer_start == 0
    }

    pub fn is_last(&self) -> bool {
        self.info.layer_end == self.info.n_layers
    }

    pub fn new_stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs one step on the compute thread.
    pub async fn step(&self, job: StepJob) -> StepOutcome {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send(Job::Step(job, tx)).is_err() {
            return StepOutcome::default();
        }
        rx.await.unwrap_or_default()
    }

    /// Starts an early step on the compute thread (after whatever it is running); the answer
    /// is `None` when it could not run whole.
    pub fn early(&self, job: EarlyJob) -> oneshot::Receiver<Option<Early>> {
        let (tx, rx) = oneshot::channel();
        let _ = self.jobs.send(Job::Early(job, tx));
        rx
    }

    /// Forgets every session a closed route stream created.
    pub fn release_stream(&self, stream_id: u64) {
        let _ = self.jobs.send(Job::ReleaseStream(stream_id));
    }

    pub fn stats(&self) -> ShardStats {
        let c = &self.counters;
        let (_, rss) = proto::rss_bytes();
        ShardStats {
            prefill_tokens: c.prefill_tokens.load(Ordering::Relaxed),
            decode_tokens: c.decode_tokens.load(Ordering::Relaxed),
            steps: c.steps.load(Ordering::Relaxed),
            sessions: c.sessions.load(Ordering::Relaxed),
            kv_bytes_in_use: c.kv_bytes_in_use.load(Ordering::Relaxed),
            kv_bytes_budget: self.config.kv_budget_bytes as u64,
            rss_bytes: rss,
            seam_bytes_out: c.seam_bytes_out.load(Ordering::Relaxed),
            compute_micros: c.compute_micros.load(Ordering::Relaxed),
            weight_bytes: self.info.budgets.as_ref().map_or(0, |b| b.weight_bytes),
            rejected_fragments: c.rejected_fragments.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            kv_blocks_in_use: c.kv_blocks_in_use.load(Ordering::Relaxed),
            kv_blocks_total: c.kv_blocks_total.load(Ordering::Relaxed),
            kv_block_bytes: c.kv_block_bytes.load(Ordering::Relaxed),
            scratch_bytes_last_step: c.scratch_bytes_last_step.load(Ordering::Relaxed),
            scratch_bytes_budget: self.config.scratch_budget_bytes as u64,
            inflight_bytes: c.inflight_bytes.load(Ordering::Relaxed),
            inflight_bytes_budget: self.config.inflight_budget_bytes as u64,
            weights_bytes_budget: self.config.weights_budget_bytes as u64,
            prefix_reused_tokens: c.prefix_reused_tokens.load(Ordering::Relaxed),
            kv_blocks_idle: c.kv_blocks_idle.load(Ordering::Relaxed),
            early_steps_started: c.early_steps_started.load(Ordering::Relaxed),
            early_steps_used: c.early_steps_used.load(Ordering::Relaxed),
            early_steps_discarded: c.early_steps_discarded.load(Ordering::Relaxed),
            kernel_thread_moves: c.kernel_thread_moves.load(Ordering::Relaxed),
        }
    }
}

/// The state owned by the compute thread.
struct Worker {
    model: Model,
    /// Every session's KV blocks come from here; its capacity is the KV budget.
    kv_pool: KvPool,
    sessions: HashMap<u64, Session>,
    counters: Arc<Counters>,
    config: ShardConfig,
    /// The last range's logits, reused step after step (16 rows are 3 MiB: a fresh buffer
    /// each step would be zeroed and faulted in again).
    logits: Vec<f32>,
}

fn refusal(session_id: u64, reason: &str, message: String) -> SessionError {
    SessionError {
        session_id,
        reason: reason.into(),
        message,
    }
}

fn sampling_params(s: &proto::v1::Sampling) -> SamplingParams {
    SamplingParams {
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
        seed: s.seed,
    }
}

impl Worker {
    fn handle(&mut self, job: Job) {
        match job {
            Job::Step(step, reply) => {
                let out = self.step(step, false);
                let _ = reply.send(out);
            }
            Job::Early(job, reply) => {
                let _ = reply.send(self.early(job));
            }
            Job::ReleaseStream(id) => {
                self.sessions.retain(|_, s| s.stream_id != id);
                self.publish_gauges();
            }
        }
    }

    fn publish_gauges(&self) {
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
        self.counters
            .sessions
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
    fn residents(&self, job: &StepJob) -> Vec<engine::Resident> {
        self.sessions
            .iter()
            .map(|(&session, s)| engine::Resident {
                session,
                last_used: s.last_used,
                bytes: s.kv.releasable_bytes(),
                in_step: job.fragments.iter().any(|f| f.session_id == session),
            })
            .collect()
    }

    /// Forgets sessions idle past the TTL (never one this step names).
    fn expire(&mut self, job: &StepJob) {
        let residents = self.residents(job);
        for id in self.policy().expired(&residents, job.now) {
            self.sessions.remove(&id);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        }
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
        let label = &self.config.label;
        let budget = self.kv_pool.budget_bytes();
        // Bytes of blocks the fragments accepted so far will take when the step runs.
        let mut planned = 0usize;
        // Rows and logit rows of the fragments accepted so far (the step's scratch).
        let (mut rows, mut outputs) = (0usize, 0usize);
        let scratch_budget = self.config.scratch_budget_bytes;
        let mut accepted = Vec::new();
        for i in 0..job.fragments.len() {
            let f = &job.fragments[i];
            let id = f.session_id;
            let start = f.start_pos as usize;
            let end = start + f.tokens.len();
            // Where the session's positions must end before this fragment: an upstream shard
            // may have taken `prefix` (the positions just before `start_pos`) from its cache.
            let Some(base) = start.checked_sub(f.prefix.len()) else {
                out.errors.push(refusal(
                    id,
                    "invalid_request",
                    format!("fragment of session {id} names a prefix longer than its start"),
                ));
                continue;
            };
            // Only positions taken whole from a prefix cache come without tokens to compute, and
            // such a fragment cannot sample.
            if f.tokens.is_empty() && (f.prefix.is_empty() || f.want_output) {
                out.errors.push(refusal(
                    id,
                    "invalid_request",
                    format!("fragment of session {id} has no tokens"),
                ));
                continue;
            }
            if end > self.config.n_ctx {
                out.errors.push(refusal(
                    id,
                    "invalid_request",
                    format!("session {id} would reach position {end} but `n_ctx` is {} on shard {label}", self.config.n_ctx),
                ));
                continue;
            }
            let (n_rows, n_outputs) = (rows + f.tokens.len(), outputs + usize::from(f.want_output));
            let scratch = self.model.scratch_bytes(n_rows, n_outputs);
            if scratch > scratch_budget {
                out.errors.push(refusal(
                    id,
                    "capacity",
                    format!(
                        "scratch_budget on shard {label}: a step of {n_rows} tokens needs {:.1} MiB of activations, the budget is {:.1} MiB",
                        mib(scratch as u64),
                        mib(scratch_budget as u64)
                    ),
                ));
                continue;
            }
            let mut created = false;
            match self.sessions.get_mut(&id) {
                Some(s) if s.epoch != job.epoch => {
                    out.errors.push(refusal(
                        id,
                        "stale_epoch",
                        format!(
                            "session {id} belongs to epoch {} but the step is epoch {}",
                            s.epoch, job.epoch
                        ),
                    ));
                    continue;
                }
                Some(s) if base > s.kv.len() => {
                    out.errors.push(refusal(
                        id,
                        "cache_miss",
                        format!("session {id} holds {} positions on shard {label}; fragment starts at {base}", s.kv.len()),
                    ));
                    continue;
                }
                Some(s) => {
                    // A fragment that starts inside the cache rewinds it (replay after a retry);
                    // whole blocks past the new end go back to the pool.
                    s.kv.truncate(base);
                    s.tokens.truncate(base);
                }
                None if base != 0 => {
                    out.errors.push(refusal(
                        id,
                        "cache_miss",
                        format!("session {id} is not held on shard {label}"),
                    ));
                    continue;
                }
                None => {
                    if self.sessions.len() >= self.config.max_sessions {
                        out.errors.push(refusal(
                            id,
                            "capacity",
                            format!(
                                "max_sessions on shard {label}: {} sessions held",
                                self.sessions.len()
                            ),
                        ));
                        continue;
                    }
                    let sampler = f
                        .sampling
                        .as_ref()
                        .map(|s| Sampler::new(sampling_params(s)));
                    self.sessions.insert(
                        id,
                        Session {
                            epoch: job.epoch,
                            stream_id: job.stream_id,
                            kv: self.kv_pool.new_cache(self.config.n_ctx),
                            tokens: Vec::new(),
                            sampler,
                            n_top: f.n_top_logprobs,
                            last_used: job.now,
                        },
                    );
                    created = true;
                }
            }
            let s = self.sessions.get_mut(&id).expect("held or created above");
            if !f.prefix.is_empty() {
                // An upstream shard took these positions from its prefix cache: take the same
                // ones here, or the route must compute them.
                let held = if self.config.prefix_cache {
                    self.kv_pool.attach(
                        &mut s.kv,
                        &f.prefix,
                        root,
                        f.prefix.len() / BLOCK_POSITIONS,
                    )
                } else {
                    0
                };
                if held != f.prefix.len() {
                    s.kv.truncate(base);
                    if created {
                        self.sessions.remove(&id);
                    }
                    out.errors.push(refusal(
                        id,
                        "cache_miss",
                        format!("session {id} continues at position {base} with a {}-position prefix that is not cached on shard {label}", f.prefix.len()),
                    ));
                    continue;
                }
                s.tokens.extend_from_slice(&f.prefix);
            } else if self.config.prefix_cache && f.reuse_prefix && self.model.is_first() {
                // Continue on the cached blocks of the longest registered prefix; a fragment
                // that samples keeps at least one token to compute. The rest of the fragment
                // goes on from there, naming the positions taken.
                let max_blocks = if f.want_output {
                    f.tokens.len().saturating_sub(1) / BLOCK_POSITIONS
                } else {
                    f.tokens.len() / BLOCK_POSITIONS
                };
                let held = self.kv_pool.attach(&mut s.kv, &f.tokens, root, max_blocks);
                if held > 0 {
                    let f = &mut job.fragments[i];
                    f.prefix = f.tokens.drain(..held).collect();
                    f.start_pos += held as u32;
                    s.tokens.extend_from_slice(&f.prefix);
                }
            }
            let f = &job.fragments[i];
            let end = f.start_pos as usize + f.tokens.len();
            let need = self.sessions[&id].kv.extra_bytes_for(end);
            let in_use = |w: &Self| w.kv_pool.bytes_in_use() + planned;
            if may_evict && in_use(self) + need > budget {
                // Make room from idle sessions, least recently used first, if that is enough.
                let residents = self.residents(job);
                if let Some(victims) =
                    self.policy()
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
            if kv_in_use + need > budget {
                out.errors.push(refusal(
                    id,
                    "capacity",
                    format!(
                        "kv_budget on shard {label}: need {:.1} MiB, free {:.1} MiB of {:.1} MiB",
                        mib(need as u64),
                        mib(budget.saturating_sub(kv_in_use) as u64),
                        mib(budget as u64)
                    ),
                ));
                if created || self.sessions.get(&id).is_some_and(|s| s.kv.is_empty()) {
                    self.sessions.remove(&id);
                }
                continue;
            }
            planned += need;
            (rows, outputs) = (rows + f.tokens.len(), n_outputs);
            accepted.push(i);
        }
        accepted
    }

    /// Runs an early step whole, or rolls back what it did and answers `None`.
    fn early(&mut self, job: EarlyJob) -> Option<Early> {
        // Only on the tokens' own sessions, each holding exactly the positions before its token:
        // a hint that a later step of the tracker's overtook is stale.
        let fresh = job.tokens.iter().all(|&(id, _, pos)| {
            self.sessions.get(&id).is_some_and(|s| {
                s.epoch == job.epoch && s.stream_id == job.stream_id && s.kv.len() == pos as usize
            })
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
        self.roll_back(&early.rollback());
        self.counters
            .early_steps_discarded
            .fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Cuts sessions back to the given lengths (whole blocks past the end go back to the pool).
    fn roll_back(&mut self, to: &[(u64, usize)]) {
        for &(id, len) in to {
            if let Some(s) = self.sessions.get_mut(&id) {
                if s.kv.len() > len {
                    s.kv.truncate(len);
                    s.tokens.truncate(len);
                }
            }
        }
    }

    /// Runs a step; an `early` one evicts no one and leaves the step counters to whoever uses
    /// it.
    fn step(&mut self, mut job: StepJob, early: bool) -> StepOutcome {
        let t0 = Instant::now();
        let mut out = StepOutcome::default();
        self.roll_back(&job.rollback);
        for id in &job.release {
            self.sessions.remove(id);
        }
        self.expire(&job);
        let root = self.prefix_root(&job);
        let accepted = self.admit(&mut job, root, !early, &mut out);
        let (n_rows, n_outputs) = accepted.iter().fold((0, 0), |(r, o), &i| {
            let f = &job.fragments[i];
            (r + f.tokens.len(), o + usize::from(f.want_output))
        });
        self.counters.scratch_bytes_last_step.store(
            self.model.scratch_bytes(n_rows, n_outputs) as u64,
            Ordering::Relaxed,
        );
        for &i in &accepted {
            if let Some(s) = self.sessions.get_mut(&job.fragments[i].session_id) {
                s.last_used = job.now;
            }
        }
        if !early {
            self.counters
                .rejected_fragments
                .fetch_add(out.errors.len() as u64, Ordering::Relaxed);
        }
        if accepted.is_empty() {
            self.publish_gauges();
            out.compute_micros = t0.elapsed().as_micros() as u64;
            return out;
        }
        // Rows of the accepted fragments, and their slice of the incoming hidden states.
        let n_embd = self.model.config().n_embd;
        let mut row_offsets = Vec::with_capacity(job.fragments.len());
        let mut acc = 0;
        for f in &job.fragments {
            row_offsets.push(acc);
            acc += f.tokens.len();
        }
        let ids: Vec<u64> = accepted
            .iter()
            .map(|&i| job.fragments[i].session_id)
            .collect();
        let mut rows = Vec::new();
        let mut hidden = Vec::new();
        for (seq, &i) in accepted.iter().enumerate() {
            let f = &job.fragments[i];
            for (k, &token) in f.tokens.iter().enumerate() {
                rows.push(Row {
                    seq,
                    pos: f.start_pos as usize + k,
                    token,
                    want_logits: f.want_output && k + 1 == f.tokens.len(),
                });
            }
            if let Some(h) = &job.hidden {
                let start = row_offsets[i] * n_embd;
                hidden.extend_from_slice(&h[start..start + f.tokens.len() * n_embd]);
            }
        }
        // Borrow every accepted session's cache at once, in the order of `ids`.
        let result = if rows.is_empty() {
            // Every accepted fragment was taken whole from the prefix cache: nothing to run.
            Ok(Vec::new())
        } else {
            let mut by_id: HashMap<u64, &mut KvCache> = self
                .sessions
                .iter_mut()
                .filter(|(id, _)| ids.contains(id))
                .map(|(id, s)| (*id, &mut s.kv))
                .collect();
            let mut refs: Vec<&mut KvCache> = ids
                .iter()
                .map(|id| by_id.remove(id).expect("admitted"))
                .collect();
            let batch = Batch {
                rows: &rows,
                hidden: job.hidden.as_ref().map(|_| hidden.as_slice()),
            };
            let mut out = std::mem::take(&mut self.logits);
            self.model
                .forward_into(batch, &mut refs, &mut out)
                .map(|()| out)
        };
        match result {
            Err(e) => {
                for id in &ids {
                    out.errors
                        .push(refusal(*id, "invalid_request", e.to_string()));
                }
            }
            Ok(h) if !self.model.is_last() => {
                out.hidden = h;
                out.accepted = accepted.iter().map(|&i| job.fragments[i].clone()).collect();
            }
            Ok(logits) => {
                let n_vocab = self.model.config().n_vocab;
                let mut li = 0;
                for &i in &accepted {
                    let f = &job.fragments[i];
                    let s = self.sessions.get_mut(&f.session_id).expect("admitted");
                    s.tokens.extend_from_slice(&f.tokens);
                    if !f.want_output {
                        continue;
                    }
                    let l = &logits[li * n_vocab..(li + 1) * n_vocab];
                    li += 1;
                    let sampler = s
                        .sampler
                        .get_or_insert_with(|| Sampler::new(SamplingParams::default()));
                    let token = sampler.sample(l, &s.tokens);
                    let top = if s.n_top > 0 {
                        let best: Vec<u32> = top_k(l, s.n_top as usize)
                            .into_iter()
                            .map(|(id, _)| id)
                            .collect();
                        let lp = log_probs(l, &best);
                        best.into_iter()
                            .zip(lp)
                            .map(|(token, logprob)| TopLogprob { token, logprob })
                            .collect()
                    } else {
                        Vec::new()
                    };
                    out.outputs.push(SessionOutput {
                        session_id: f.session_id,
                        token,
                        logprob: if f.want_logprob || s.n_top > 0 {
                            log_probs(l, &[token])[0]
                        } else {
                            0.0
                        },
                        top,
                        next_pos: f.start_pos + f.tokens.len() as u32,
                    });
                }
                out.accepted = accepted.iter().map(|&i| job.fragments[i].clone()).collect();
                self.logits = logits;
            }
        }
        if !self.model.is_last() {
            for &i in &accepted {
                let f = &job.fragments[i];
                self.sessions
                    .get_mut(&f.session_id)
                    .expect("admitted")
                    .tokens
                    .extend_from_slice(&f.tokens);
            }
        }
        if self.config.prefix_cache {
            // Full blocks become shareable as soon as they are written.
            for &i in &accepted {
                if let Some(s) = self.sessions.get_mut(&job.fragments[i].session_id) {
                    self.kv_pool.register(&mut s.kv, &s.tokens, root);
                }
            }
        }
        if !early {
            self.counters.count_step(&out.accepted);
        }
        self.publish_gauges();
        out.compute_micros = t0.elapsed().as_micros() as u64;
        self.counters
            .compute_micros
            .fetch_add(out.compute_micros, Ordering::Relaxed);
        out
    }
}
