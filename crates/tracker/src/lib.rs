//! The tracker: the scheduler of record. It validates and tokenizes OpenAI-style requests,
//! drives sessions along the route of shards, streams tokens back, and exports metrics.
//!
//! The key design decision: one owner for all session state, the [`runner`] loop, which asks the
//! pure `engine::Scheduler` for each step's plan and sends it down the route; HTTP handlers
//! talk to it only by message. The tracker never touches weights: it depends on `engine`,
//! `text` and `proto`, never on `model`.

mod agent;
mod cluster;
mod error;
mod failover;
mod http;
pub mod ledger;
mod membership;
mod metrics;
mod ops;
mod record;
mod request;
mod respond;
mod runner;
mod server;
mod table;

use std::sync::Arc;
use std::time::Duration;

use proto::v1::SeamDtype;
use proto::ShardTransport;
use text::{ChatTemplate, Tokenizer};
use tokio::sync::{mpsc, watch};

pub use cluster::{validate_route, Cluster, Health};
pub use error::ApiError;
pub use metrics::Metrics;
pub use server::{default_max_connections, HttpConfig};

/// Tracker settings, validated by the binary.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    pub scheduler: engine::SchedulerConfig,
    pub seam: SeamDtype,
    /// How long to wait for shards to answer at start.
    pub startup_wait: Duration,
    pub health_period: Duration,
    pub default_chat_max_tokens: usize,
    /// Queue places per class, key share and retry hint; the active places per class are the
    /// scheduler's `max_active` and `grading_max_active`.
    pub admission: engine::AdmissionConfig,
    /// The durable usage ledger with API keys and budgets, when one is configured.
    pub ledger: Option<Arc<ledger::Ledger>>,
    /// Bearer token of the admin API (evicting a model from a route); `None` disables it.
    pub admin_token: Option<String>,
    /// How long a route may stay silent while it holds a step before it is declared failed
    /// (shards working on a long step say so at a quarter of this).
    pub liveness: Duration,
    /// The HTTP server's timeouts, connection limit, body limit and TLS.
    pub http: HttpConfig,
    /// The one API key every request must present (`--api-key`), when set.
    pub api_key: Option<String>,
    /// `/health` and `/metrics` stay open to anyone although API keys are on.
    pub public_metrics: bool,
    /// How long a session a failed route lost may wait for another route of its model to take
    /// it before it fails with the route's error.
    pub failover_wait: Duration,
    /// The registry whose shards this tracker builds routes from, besides its static routes.
    pub registry: Option<RegistryConfig>,
}

/// Following a registry: where it is, this cluster's prefix in it, and how to reach the shards
/// it announces.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    pub endpoints: String,
    pub prefix: String,
    pub link: proto::Link,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            scheduler: engine::SchedulerConfig {
                pipeline_depth: 0,
                ..engine::SchedulerConfig::default()
            },
            seam: SeamDtype::SeamF32,
            startup_wait: Duration::from_secs(60),
            health_period: Duration::from_millis(500),
            default_chat_max_tokens: 512,
            admission: engine::AdmissionConfig::default(),
            ledger: None,
            admin_token: None,
            liveness: Duration::from_secs(2),
            http: HttpConfig::default(),
            api_key: None,
            public_metrics: false,
            failover_wait: Duration::from_secs(3),
            registry: None,
        }
    }
}

/// A tracker whose routes were validated, ready to serve HTTP.
pub struct Tracker {
    state: Arc<http::AppState>,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let models = self.state.table.models();
        let ids: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
        write!(f, "Tracker({})", ids.join(", "))
    }
}

/// A started route as the binary reports it.
#[derive(Debug, Clone)]
pub struct RouteSummary {
    pub name: String,
    pub model: String,
    /// Shard addresses with their layer ranges, in layer order.
    pub shards: Vec<(String, u32, u32)>,
}

/// The shards of one route (one node's copy of one model), named.
pub struct RouteSpec {
    pub name: String,
    pub shards: Vec<Arc<dyn ShardTransport>>,
}

impl Tracker {
    /// Connects to every route's shards, validates each route (coverage, model digest,
    /// recipes), groups the routes by the model they hold (residency is per route: a model is
    /// served only by the routes whose shards hold it), builds each model's tokenizer from its
    /// first shard's vocabulary and starts one scheduling loop per route. The error says which
    /// route, shard and range is wrong. With a registry, routes may also be none at start:
    /// they are built from the shards announced there as they come and go.
    pub async fn start(config: TrackerConfig, routes: Vec<RouteSpec>) -> Result<Tracker, String> {
        if routes.is_empty() && config.registry.is_none() {
            return Err("no route given".into());
        }
        let metrics = Arc::new(Metrics::default());
        metrics::declare(&metrics);
        let members = match &config.registry {
            Some(r) => Some(
                registry::follow(&r.endpoints, &r.prefix)
                    .map_err(|e| format!("the registry: {e}"))?,
            ),
            None => None,
        };
        let table = Arc::new(table::RouteTable::new(members.clone()));
        // Sessions of a failed route go to another route of their model (none: they fail).
        let (moved_tx, moved_rx) = mpsc::unbounded_channel();
        tokio::spawn(failover::dispatch(
            moved_rx,
            Arc::clone(&table),
            config.ledger.clone(),
            config.failover_wait,
        ));
        let starter = Arc::new(RouteStarter {
            config: config.clone(),
            metrics: Arc::clone(&metrics),
            moved: moved_tx,
            table: Arc::clone(&table),
        });
        for spec in routes {
            starter
                .add(&spec.name, spec.shards, config.startup_wait)
                .await?;
        }
        if let (Some(members), Some(r)) = (members, &config.registry) {
            tokio::spawn(membership::follow(
                Arc::clone(&starter),
                members,
                r.link.clone(),
            ));
        }
        let n_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let state = Arc::new(http::AppState {
            table,
            metrics,
            default_chat_max_tokens: config.default_chat_max_tokens,
            ledger: config.ledger,
            api_key: config.api_key,
            public_metrics: config.public_metrics,
            admin_token: config.admin_token,
            http: config.http,
            tokenizing: tokio::sync::Semaphore::new(n_cores.saturating_sub(1).max(1)),
            responses: std::sync::atomic::AtomicU64::new(0),
        });
        Ok(Tracker { state })
    }

    /// The registry behind `/metrics` (for the binary's own series, such as restarts of the
    /// shards `strata serve` supervises).
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.state.metrics)
    }

    /// Every route: its name, model, and shards in layer order with their ranges.
    pub fn routes(&self) -> Vec<RouteSummary> {
        let mut out = Vec::new();
        for m in self.state.table.models().iter() {
            for r in &m.routes {
                let shards = r
                    .cluster
                    .infos
                    .iter()
                    .map(|i| (i.listen.clone(), i.layer_start, i.layer_end))
                    .collect();
                out.push(RouteSummary {
                    name: r.name.clone(),
                    model: m.id.clone(),
                    shards,
                });
            }
        }
        out
    }

    /// Serves HTTP on `listener` until `shutdown` completes.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), String> {
        let config = self.state.http.clone();
        server::serve(listener, http::router(self.state), config, shutdown).await
    }
}

/// Starts routes and puts them in the table: the static ones at start, the registry's as
/// their shards come.
pub(crate) struct RouteStarter {
    config: TrackerConfig,
    metrics: Arc<Metrics>,
    moved: mpsc::UnboundedSender<Box<runner::Moved>>,
    pub(crate) table: Arc<table::RouteTable>,
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
            &self.metrics,
            self.moved.clone(),
            Arc::clone(&self.table),
            wait,
        )
        .await?;
        self.metrics.set(
            "strata_model_resident",
            &[("model", &cluster.model_name), ("route", name)],
            1.0,
        );
        self.table.add_route(&entry, Arc::new(handle));
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
            .send(runner::Command::Retire { move_sessions })
            .await;
    }
}

/// A model the tracker meets for the first time: its tokenizer and template from the first
/// shard's vocabulary, and the vocabulary request grammars are checked against (built in the
/// background now).
async fn model_entry(cluster: &Cluster) -> Result<http::ModelEntry, String> {
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
    let grammars = constrain::LazyVocabulary::new(Arc::clone(&tokenizer));
    grammars.warm();
    Ok(http::ModelEntry {
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
    let seam_width = if config.seam == SeamDtype::SeamF16 {
        2
    } else {
        4
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
            limit = limit.min(b.inflight_bytes as usize / (depth * n_embd * seam_width));
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

/// Starts one route's health monitor and scheduling loop and waits until the route is open.
async fn start_route(
    config: &TrackerConfig,
    name: &str,
    cluster: Arc<Cluster>,
    tokenizer: Arc<Tokenizer>,
    metrics: &Arc<Metrics>,
    moved: mpsc::UnboundedSender<Box<runner::Moved>>,
    table: Arc<table::RouteTable>,
    wait: Duration,
) -> Result<http::RouteHandle, String> {
    let scoped = Arc::new(metrics.scoped(&[("model", &cluster.model_name), ("route", name)]));
    let (health_tx, health_rx) = watch::channel(Health::default());
    tokio::spawn(cluster::monitor(
        Arc::clone(&cluster),
        config.health_period,
        health_tx,
        Arc::clone(metrics),
    ));
    let admission = engine::Admission::new(
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
    );
    let scheduler = step_limits(config, name, &cluster);
    let (cmd_tx, cmd_rx) = mpsc::channel(1024);
    let (route_tx, mut route_rx) = watch::channel(false);
    let load = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let runner = runner::Runner::new(
        runner::RunnerConfig {
            scheduler,
            seam: config.seam,
            liveness: config.liveness,
        },
        Arc::clone(&cluster),
        tokenizer,
        scoped,
        health_rx.clone(),
        route_tx,
        admission,
        config.ledger.clone(),
        name.to_string(),
        Some(moved),
        table,
        Arc::clone(&load),
    );
    tokio::spawn(runner.run(cmd_rx));
    // Ready means the route is open end to end, not just that the shards answered.
    tokio::time::timeout(wait, route_rx.wait_for(|up| *up))
        .await
        .map_err(|_| format!("route {name}: the route did not open within {wait:?}"))?
        .map_err(|_| "the scheduling loop stopped".to_string())?;
    Ok(http::RouteHandle {
        name: name.to_string(),
        pinned: cluster.infos.iter().any(|i| i.pinned),
        cluster,
        commands: cmd_tx,
        health: health_rx,
        up: route_rx,
        evicted: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        load,
        submitting: std::sync::atomic::AtomicUsize::new(0),
    })
}
