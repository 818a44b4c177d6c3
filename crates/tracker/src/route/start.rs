//! Starting routes: connecting to their shards, validating them, learning their model, and
//! starting each route's health monitor and driver.

use std::sync::Arc;
use std::time::Duration;

use proto::ShardTransport;
use text::{ChatTemplate, Tokenizer};
use tokio::sync::{mpsc, watch};

use super::cluster::{self, Cluster, Health};
use super::driver;
use super::table::{ModelEntry, RouteHandle, RouteTable};
use crate::config::TrackerConfig;
use crate::metrics::Metrics;

/// Starts routes and puts them in the table: the static ones at start, the registry's as
/// their shards come.
pub(crate) struct RouteStarter {
    pub(crate) config: TrackerConfig,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) moved: mpsc::UnboundedSender<Box<driver::Moved>>,
    pub(crate) table: Arc<RouteTable>,
}

impl RouteStarter {
    /// Connects to the shards (waiting at most `wait` for them), validates the route, learns
    /// its model when it is new (tokenizer and template from the first shard's vocabulary),
    /// starts its loop and, once it is open, adds it to the table.
    pub(crate) async fn add(
        &self,
        name: &str,
        shards: Vec<Arc<dyn ShardTransport>>,
        wait: Duration,
    ) -> Result<(), String> {
        let config = &self.config;
        let cluster = Arc::new(
            Cluster::connect(shards, wait)
                .await
                .map_err(|e| format!("route {name}: {e}"))?,
        );
        let entry = match self.table.model(&cluster.model_digest) {
            Some(m) => m.as_ref().clone(),
            None => {
                if self
                    .table
                    .models()
                    .iter()
                    .any(|m| m.id == cluster.model_name)
                {
                    return Err(format!(
                        "route {name}: another model with a different digest is also named `{}`",
                        cluster.model_name
                    ));
                }
                model_entry(&cluster).await?
            }
        };
        let handle = start_route(
            config,
            name,
            Arc::clone(&cluster),
            Arc::clone(&entry.tokenizer),
            draft_for(config, name, &entry),
            &self.metrics,
            self.moved.clone(),
            Arc::clone(&self.table),
            wait,
        )
        .await?;
        let handle = Arc::new(handle);
        if let Err(e) = self.table.add_route(&entry, Arc::clone(&handle)) {
            // Never in the table: its loop ends at once (it holds no session).
            let _ = handle
                .commands
                .send(driver::Command::Retire {
                    move_sessions: false,
                })
                .await;
            return Err(format!("route {name}: {e}"));
        }
        self.metrics.set(
            "strata_model_resident",
            &[("model", &cluster.model_name), ("route", name)],
            1.0,
        );
        Ok(())
    }

    /// Takes a route out of the table and retires its loop: its sessions move to another
    /// route of the model when one takes work, else finish where they are.
    pub(crate) async fn retire(&self, name: &str) {
        let Some(route) = self.table.remove_route(name) else {
            return;
        };
        // It is out of the table already: any route of the model left is another one.
        let move_sessions = self
            .table
            .another_takes_work(&route.cluster.model_digest, name);
        self.metrics.set(
            "strata_model_resident",
            &[("model", &route.cluster.model_name), ("route", name)],
            0.0,
        );
        let _ = route
            .commands
            .send(driver::Command::Retire { move_sessions })
            .await;
    }
}

/// A model the tracker meets for the first time: its tokenizer and template from the first
/// shard's vocabulary, and the vocabulary request grammars are checked against (built in the
/// background now).
async fn model_entry(cluster: &Cluster) -> Result<ModelEntry, String> {
    let vocab = cluster.shards[0]
        .vocab()
        .await
        .map_err(|e| format!("fetching the vocabulary: {}", e.message()))?;
    let vocab = gguf::GgufFile::from_bytes(vocab.gguf)
        .map_err(|e| format!("the vocabulary is not valid GGUF: {e}"))?;
    let tokenizer = Arc::new(Tokenizer::from_header(vocab.header()).map_err(|e| e.to_string())?);
    let template = ChatTemplate::from_header(vocab.header(), &tokenizer)
        .map_err(|e| e.to_string())?
        .map(Arc::new);
    // Request grammars are compiled here first, so a schema llguidance cannot take is a 400
    // before anything is queued.
    let grammars =
        constrain::LazyVocabulary::new(Arc::clone(&tokenizer), constrain::Purpose::Checks);
    grammars.warm(proto::release_freed_memory);
    Ok(ModelEntry {
        id: cluster.model_name.clone(),
        digest: cluster.model_digest.clone(),
        n_layers: cluster.n_layers,
        n_ctx: cluster.n_ctx,
        tokenizer,
        grammars,
        template,
        routes: Vec::new(),
    })
}

/// The route's scheduler settings: pipeline depth 0 means one micro-batch per shard, and a
/// step never carries more tokens than every shard's scratch budget allows, nor more
/// activations than its in-flight budget holds for the steps in flight at once.
fn step_limits(config: &TrackerConfig, name: &str, cluster: &Cluster) -> engine::SchedulerConfig {
    let depth = match config.scheduler.pipeline_depth {
        0 => cluster.shards.len(),
        n => n,
    };
    let n_embd = cluster
        .infos
        .first()
        .map_or(1, |i| i.n_embd.max(1) as usize);
    let mut limit = config.scheduler.max_step_tokens;
    for (i, b) in cluster
        .infos
        .iter()
        .filter_map(|i| i.budgets.map(|b| (i, b)))
    {
        if b.max_step_tokens > 0 {
            limit = limit.min(b.max_step_tokens as usize);
        }
        if b.inflight_bytes > 0 && i.layer_end < i.n_layers {
            let row = proto::seam_bytes(config.seam, n_embd);
            limit = limit.min(b.inflight_bytes as usize / (depth * row));
        }
    }
    let limit = limit.max(1);
    if limit < config.scheduler.max_step_tokens {
        tracing::warn!(
            route = name,
            requested = config.scheduler.max_step_tokens,
            limit,
            "steps carry at most {limit} tokens: the shards' scratch or in-flight budgets allow no more"
        );
    }
    engine::SchedulerConfig {
        pipeline_depth: depth,
        max_step_tokens: limit,
        max_prefill_chunk: config.scheduler.max_prefill_chunk.min(limit),
        ..config.scheduler
    }
}

/// The route's admission ledger: every shard's KV budget and session places, and the
/// configured queue and active places per class.
pub(crate) fn admission_of(config: &TrackerConfig, cluster: &Cluster) -> engine::Admission {
    engine::Admission::new(
        cluster
            .infos
            .iter()
            .map(|i| {
                let b = i.budgets.unwrap_or_default();
                let block_positions = i.recipe.as_ref().map_or(16, |r| r.block_size).max(1);
                // A session's step appends at most a prefill chunk (or one decode position).
                let step = config.scheduler.max_prefill_chunk.max(1) as u64;
                engine::ShardBudget {
                    address: i.listen.clone(),
                    kv_budget_bytes: b.kv_bytes,
                    kv_block_bytes: b.kv_block_bytes,
                    block_positions,
                    kv_window_block_bytes: b.kv_window_block_bytes,
                    kv_window_blocks_max: (b.kv_window_keep_positions + step)
                        .div_ceil(block_positions as u64)
                        + 1,
                    max_sessions: b.max_sessions,
                }
            })
            .collect(),
        engine::AdmissionConfig {
            active_slots: [
                config.scheduler.max_active,
                config.scheduler.grading_max_active,
            ],
            ..config.admission.clone()
        },
    )
}

/// The draft model a route of `entry`'s model drafts from: the tracker's, when its drafts come
/// from a draft model and it shares the model's vocabulary (a route of another vocabulary
/// runs without drafts, and says why).
fn draft_for(
    config: &TrackerConfig,
    name: &str,
    entry: &ModelEntry,
) -> Option<Arc<dyn engine::DraftSource>> {
    let draft = config.draft_model.as_ref()?;
    if let Some(why) = draft.vocabulary_difference(&entry.tokenizer) {
        tracing::warn!(
            route = name,
            model = %entry.id,
            draft = draft.name(),
            "the draft model cannot draft for this model, whose vocabulary differs ({why}): the route decodes without drafts"
        );
        return None;
    }
    let source: Arc<dyn engine::DraftSource> = draft.clone();
    Some(source)
}

/// Starts one route's health monitor and scheduling loop and waits until the route is open.
#[allow(clippy::too_many_arguments)]
async fn start_route(
    config: &TrackerConfig,
    name: &str,
    cluster: Arc<Cluster>,
    tokenizer: Arc<Tokenizer>,
    draft: Option<Arc<dyn engine::DraftSource>>,
    metrics: &Arc<Metrics>,
    moved: mpsc::UnboundedSender<Box<driver::Moved>>,
    table: Arc<RouteTable>,
    wait: Duration,
) -> Result<RouteHandle, String> {
    let scoped = Arc::new(metrics.scoped(&[("model", &cluster.model_name), ("route", name)]));
    let (health_tx, health_rx) = watch::channel(Health::default());
    tokio::spawn(cluster::monitor(
        Arc::clone(&cluster),
        config.health_period,
        health_tx,
        Arc::clone(metrics),
    ));
    let admission = admission_of(config, &cluster);
    let scheduler = step_limits(config, name, &cluster);
    let (cmd_tx, cmd_rx) = mpsc::channel(1024);
    let (route_tx, mut route_rx) = watch::channel(false);
    let load = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let prefixes = Arc::new(super::prefixes::PrefixIndex::new(
        super::prefixes::DEFAULT_CAPACITY,
    ));
    let pace = Arc::new(super::pace::Pace::default());
    let runner = driver::Runner::new(driver::RunnerParts {
        config: driver::RunnerConfig {
            scheduler,
            seam: config.seam,
            liveness: config.liveness,
            prefix_scope: config.prefix_scope,
        },
        name: name.to_string(),
        cluster: Arc::clone(&cluster),
        tokenizer,
        metrics: scoped,
        health: health_rx.clone(),
        route_up: route_tx,
        admission,
        ledger: config.ledger.clone(),
        failover: Some(moved),
        replicas: table,
        load: Arc::clone(&load),
        prefixes: Arc::clone(&prefixes),
        pace: Arc::clone(&pace),
        draft,
    });
    tokio::spawn(runner.run(cmd_rx));
    // Ready means the route is open end to end, not just that the shards answered.
    tokio::time::timeout(wait, route_rx.wait_for(|up| *up))
        .await
        .map_err(|_| format!("route {name}: the route did not open within {wait:?}"))?
        .map_err(|_| "the scheduling loop stopped".to_string())?;
    Ok(RouteHandle {
        name: name.to_string(),
        pinned: cluster.infos.iter().any(|i| i.pinned),
        cluster,
        commands: cmd_tx,
        health: health_rx,
        up: route_rx,
        evicted: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        load,
        submitting: std::sync::atomic::AtomicUsize::new(0),
        prefixes,
        pace,
    })
}
