//! The shard's handle on its compute thread: what the shard is (its description and vocabulary),
//! the jobs the thread takes (steps, early steps, stream releases), its counters, and whether
//! it still runs. The thread's own state is in [`crate::worker`].

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gguf::{GgufFile, Value, Writer};
use model::{LayerRange, Model, ModelOptions};
use proto::v1::{Budgets, CacheRecipe, ShardInfo, ShardStats};
use sha2::{Digest, Sha256};
use tokio::sync::{oneshot, watch};

use crate::messages::{Counters, Early, EarlyJob, StepJob, StepOutcome};
use crate::worker::Worker;
use crate::{mib, Error, ShardConfig};

enum Job {
    Step(StepJob, oneshot::Sender<StepOutcome>),
    Early(EarlyJob, oneshot::Sender<Option<Early>>),
    ReleaseStream(u64),
    /// Fault injection for tests: the compute thread panics as a bug in it would.
    #[cfg(feature = "fault-injection")]
    Panic,
}

/// The compute thread stopped (it panicked, or the model file could not be read): the shard
/// can run no step again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComputeStopped(pub String);

impl std::error::Error for ComputeStopped {}

impl std::fmt::Display for ComputeStopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the compute thread stopped: {}", self.0)
    }
}

/// The shard's loaded model and the handle to its compute thread.
pub struct ShardCore {
    pub config: ShardConfig,
    /// The kernels in use and the context length chosen and why, for the operator (the binary
    /// prints it).
    pub context: String,
    pub info: ShardInfo,
    pub vocab_gguf: Vec<u8>,
    pub counters: Arc<Counters>,
    jobs: std::sync::mpsc::Sender<Job>,
    next_stream: AtomicU64,
    /// Replies streams the tracker opened on this shard, until the route naming them starts.
    pub(crate) reply_sinks: crate::replies::ReplySinks,
    /// Set once, when the compute thread stops: why. The shard then answers nothing as if
    /// it were alive (every RPC is refused, every route stream fails).
    stopped: watch::Sender<Option<ComputeStopped>>,
    /// Set when the process is shutting down: route streams end with a typed failure.
    shutdown: watch::Sender<bool>,
    /// Set when the shard is draining (going away): it reports so in its stats, and trackers
    /// give it no new sessions while its sessions finish or move.
    draining: std::sync::atomic::AtomicBool,
}

/// Resolves an automatic context (`n_ctx` 0): the model's trained context, or fewer
/// positions when one session of that many would not fit the KV budget; a context given is
/// kept. Says what was chosen and why.
fn choose_context(config: &mut ShardConfig, trained: usize, pool: &model::KvPool) -> String {
    let block = model::BLOCK_POSITIONS;
    let per_block = pool.block_bytes().max(1);
    let window =
        model::KvPool::blocks_for(pool.window_keep_positions() + block) * pool.window_block_bytes();
    let fits = pool.budget_bytes().saturating_sub(window) / per_block * block;
    let mib = |positions: usize| {
        (model::KvPool::blocks_for(positions) * per_block + window.min(pool.budget_bytes())) as f64
            / (1 << 20) as f64
    };
    let budget = pool.budget_bytes() as f64 / (1 << 20) as f64;
    if config.n_ctx > 0 {
        return format!(
            "context {} positions (as given; one session that long holds {:.1} MiB of the {budget:.0} MiB KV budget)",
            config.n_ctx,
            mib(config.n_ctx)
        );
    }
    let trained = trained.max(block);
    if fits >= trained {
        config.n_ctx = trained;
        format!(
            "context {trained} positions (the model's trained context; one session that long holds {:.1} MiB of the {budget:.0} MiB KV budget)",
            mib(trained)
        )
    } else {
        config.n_ctx = fits.max(block);
        format!(
            "context {} positions (the model was trained for {trained}, but the {budget:.0} MiB KV budget holds one session of {} positions; give --kv-budget-mib to raise it)",
            config.n_ctx, config.n_ctx
        )
    }
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

/// The SHA-256 of a model file, in hex: the digest shards and trackers match models by.
pub fn file_digest(path: &std::path::Path) -> Result<String, Error> {
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

/// A GGUF holding only the metadata a tokenizer and chat template need (no tensors): what
/// `Vocab` answers.
pub fn vocab_file(f: &GgufFile) -> Vec<u8> {
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
    pub fn load(mut config: ShardConfig) -> Result<Arc<ShardCore>, Error> {
        let digest = file_digest(&config.model_path)?;
        let file = GgufFile::open(&config.model_path)?;
        let range = config.layers.map(|(start, end)| LayerRange { start, end });
        let model = Model::load(
            &file,
            range,
            ModelOptions {
                n_threads: config.n_threads,
                isa: config.isa,
                kv_type: config.kv_type,
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
        let n_threads = config.n_threads;
        let context = format!(
            "{} kernels on 16-row weight panels (numeric contract {}), {n_threads} threads; {}",
            model.isa().name(),
            model::NUMERIC_CONTRACT,
            choose_context(&mut config, c.n_ctx_train, &kv_pool)
        );
        let info = ShardInfo {
            protocol_version: proto::PROTOCOL_VERSION,
            version: env!("CARGO_PKG_VERSION").into(),
            model_digest: digest.clone(),
            model_name,
            architecture: c.family.name().into(),
            layer_start: range.start as u32,
            layer_end: range.end as u32,
            n_layers: c.n_layers as u32,
            n_embd: c.n_embd as u32,
            n_vocab: c.n_vocab as u32,
            recipe: Some(CacheRecipe {
                model_digest: digest,
                layer_start: range.start as u32,
                layer_end: range.end as u32,
                kv_dtype: model.kv_type().name().into(),
                rope_base: c.rope_base,
                rope_dim: c.rope_dim as u32,
                rope_freq_scale: c.rope_freq_scale,
                block_size: model::BLOCK_POSITIONS as u32,
                n_ctx: config.n_ctx as u32,
                numeric_contract: model::NUMERIC_CONTRACT,
            }),
            budgets: Some(Budgets {
                weight_bytes: model.weight_bytes() as u64,
                kv_bytes: kv_pool.budget_bytes() as u64,
                max_sessions: config.max_sessions as u32,
                // Every row of a step may produce logits (a decode step), so this is the most a
                // step of that many tokens can need.
                max_step_tokens: (config.scratch_budget_bytes / scratch_per_token) as u32,
                kv_block_bytes: kv_pool.block_bytes() as u64,
                scratch_bytes: config.scratch_budget_bytes as u64,
                scratch_bytes_per_token: scratch_per_token as u64,
                inflight_bytes: config.inflight_budget_bytes as u64,
                weights_budget_bytes: config.weights_budget_bytes as u64,
                kv_window_block_bytes: kv_pool.window_block_bytes() as u64,
                kv_window_keep_positions: kv_pool.window_keep_positions() as u64,
            }),
            listen: config.label.clone(),
            pinned: config.pinned,
        };
        let vocab_gguf = vocab_file(&file);
        // The shard that samples compiles grammars; its vocabulary for them is built in the
        // background now (about half a second for 150k tokens), not at the first request.
        let grammars = if model.is_last() {
            text::Tokenizer::from_header(file.header())
                .ok()
                .map(|t| constrain::LazyVocabulary::new(Arc::new(t), constrain::Purpose::Masks))
        } else {
            None
        };
        if let Some(g) = &grammars {
            g.warm(proto::release_freed_memory);
        }
        drop(file);
        proto::release_freed_memory();
        let counters = Arc::new(Counters::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = Worker::new(
            model,
            kv_pool,
            Arc::clone(&counters),
            config.clone(),
            grammars,
        );
        let (stopped, _) = watch::channel(None);
        let on_stop = stopped.clone();
        std::thread::Builder::new()
            .name("strata-compute".into())
            .spawn(move || compute_thread(worker, rx, on_stop))
            .map_err(|source| Error::Io {
                path: "compute thread".into(),
                source,
            })?;
        let (shutdown, _) = watch::channel(false);
        Ok(Arc::new(ShardCore {
            config,
            context,
            info,
            vocab_gguf,
            counters,
            jobs: tx,
            next_stream: AtomicU64::new(1),
            reply_sinks: Default::default(),
            stopped,
            shutdown,
            draining: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// Starts draining: no new sessions from now on (trackers read it in the stats).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
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

    /// Runs one step on the compute thread; an error when the thread has stopped.
    pub async fn step(&self, job: StepJob) -> Result<StepOutcome, ComputeStopped> {
        let (tx, rx) = oneshot::channel();
        if self.jobs.send(Job::Step(job, tx)).is_err() {
            return Err(self.stop_reason());
        }
        rx.await.map_err(|_| self.stop_reason())
    }

    /// Why the compute thread stopped (once it has).
    fn stop_reason(&self) -> ComputeStopped {
        self.stopped
            .borrow()
            .clone()
            .unwrap_or_else(|| ComputeStopped("it ended".into()))
    }

    /// `Err` once the compute thread has stopped: the shard must not look alive.
    pub fn check_alive(&self) -> Result<(), ComputeStopped> {
        match &*self.stopped.borrow() {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// Resolves when the compute thread stops, with the reason.
    pub async fn stopped(&self) -> ComputeStopped {
        let mut rx = self.stopped.subscribe();
        let why = rx
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|w| w.clone());
        why.unwrap_or_else(|| ComputeStopped("it ended".into()))
    }

    /// Tells every route stream to end (with a typed failure to its tracker): the process is
    /// shutting down.
    pub fn shut_down(&self) {
        self.shutdown.send_replace(true);
    }

    /// Resolves once [`ShardCore::shut_down`] was called.
    pub(crate) async fn shutting_down(&self) {
        let mut rx = self.shutdown.subscribe();
        let _ = rx.wait_for(|down| *down).await;
    }

    /// Makes the compute thread panic (fault injection for tests).
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self) {
        let _ = self.jobs.send(Job::Panic);
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
            draining: self.is_draining(),
            token_step_micros: c.token_step_micros.load(Ordering::Relaxed),
        }
    }
}

/// The compute thread: runs jobs one at a time until every handle is gone. A job that panics
/// leaves the thread's state unknown, so the thread stops there, saying why: its queued and
/// later jobs are answered with an error, never left waiting, and the shard stops looking alive.
fn compute_thread(
    mut worker: Worker,
    jobs: std::sync::mpsc::Receiver<Job>,
    stopped: watch::Sender<Option<ComputeStopped>>,
) {
    while let Ok(job) = jobs.recv() {
        let ran = std::panic::catch_unwind(AssertUnwindSafe(|| handle(&mut worker, job)));
        if let Ok(Err(why)) = ran {
            tracing::error!(error = %why, "the shard can compute nothing more; it stops serving");
            stopped.send_replace(Some(ComputeStopped(why)));
            return;
        }
        if let Err(panic) = ran {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            tracing::error!(error = %why, "the compute thread panicked; the shard stops serving");
            stopped.send_replace(Some(ComputeStopped(format!("it panicked: {why}"))));
            return;
        }
    }
}

/// Runs one job; `Err` (the reason, the job unanswered) when the worker found it can compute
/// nothing more ([`Worker::fatal`]).
fn handle(worker: &mut Worker, job: Job) -> Result<(), String> {
    match job {
        Job::Step(step, reply) => {
            let out = worker.step(step, false);
            if let Some(why) = worker.fatal.take() {
                return Err(why);
            }
            let _ = reply.send(out);
        }
        Job::Early(job, reply) => {
            let out = worker.early(job);
            if let Some(why) = worker.fatal.take() {
                return Err(why);
            }
            let _ = reply.send(out);
        }
        Job::ReleaseStream(id) => worker.release_stream(id),
        #[cfg(feature = "fault-injection")]
        Job::Panic => panic!("injected fault"),
    }
    Ok(())
}
