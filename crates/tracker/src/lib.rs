//! The tracker: the scheduler of record. It validates and tokenizes OpenAI-style requests,
//! drives sessions along the route of shards, streams tokens back, and exports metrics.
//!
//! The key design decision: one owner for all session state, the [`runner`] loop, which asks the
//! pure `engine::Scheduler` for each step's plan and sends it down the route; HTTP handlers
//! talk to it only by message. The tracker never touches weights: it depends on `engine`,
//! `text` and `proto`, never on `model`.

mod api;
mod config;
pub mod ledger;
mod metrics;
mod route;
mod session;

use std::sync::Arc;

use proto::ShardTransport;
use tokio::sync::mpsc;

pub use api::fields::NO_EFFECT;
pub use api::server::{default_max_connections, HttpConfig};
pub use config::{DraftModel, RegistryConfig, TrackerConfig};
pub use metrics::Metrics;
pub use route::cluster::{validate_route, Cluster, Health};
pub use route::driver::PrefixScope;
pub use route::prefixes::RouteChoice;

/// A tracker whose routes were validated, ready to serve HTTP.
pub struct Tracker {
    state: Arc<api::state::AppState>,
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
                registry::follow(&r.connect, &r.prefix)
                    .map_err(|e| format!("the registry: {e}"))?,
            ),
            None => None,
        };
        let table = Arc::new(route::table::RouteTable::new(
            members.clone(),
            config.route_choice,
        ));
        // Sessions of a failed route go to another route of their model (none: they fail).
        let (moved_tx, moved_rx) = mpsc::unbounded_channel();
        tokio::spawn(route::failover::dispatch(
            moved_rx,
            Arc::clone(&table),
            config.ledger.clone(),
            Arc::clone(&metrics),
            config.failover_wait,
        ));
        let starter = Arc::new(route::start::RouteStarter {
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
            tokio::spawn(route::membership::follow(
                Arc::clone(&starter),
                members,
                r.link.clone(),
            ));
        }
        let n_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // The stored responses are shared equally by the API keys (one share without keys).
        let tenants = config.ledger.as_ref().map_or(1, |l| l.n_keys());
        let bodies = Arc::new(api::server::BodyBudget::for_bodies_of(
            config.http.max_body_bytes,
            tenants,
        ));
        let state = Arc::new(api::state::AppState {
            table,
            metrics,
            default_chat_max_tokens: config.default_chat_max_tokens,
            default_temperature: config.default_temperature,
            ledger: config.ledger,
            api_key: config.api_key,
            public_metrics: config.public_metrics,
            admin_token: config.admin_token,
            http: config.http,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(
                n_cores.saturating_sub(1).max(1),
            )),
            bodies,
            responses: std::sync::atomic::AtomicU64::new(0),
            failover_wait: config.failover_wait,
            stored_responses: api::store::ResponseStore::new(
                config.stored_responses,
                config.stored_response_bytes,
                tenants,
            ),
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
        api::server::serve(listener, api::router(self.state), config, shutdown).await
    }
}
