//! The route table: the resident models and the routes holding each. Readers take a snapshot
//! (an `Arc` of the whole table, never a lock held across an await); a route joining or
//! leaving swaps in a new table. The static routes of `--route` are in it from the start;
//! with a registry, [`crate::membership`] adds and retires routes while the tracker runs.

use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use text::{ChatTemplate, Tokenizer};
use tokio::sync::mpsc;

use super::cluster::{Cluster, Health};
use super::driver::Command;

/// One resident model: its tokenizer and the routes whose shards hold it.
#[derive(Clone)]
pub struct ModelEntry {
    pub id: String,
    pub digest: String,
    pub n_layers: u32,
    /// The smallest context any of its routes allows.
    pub n_ctx: usize,
    pub tokenizer: Arc<Tokenizer>,
    /// The vocabulary request grammars are checked against before they are queued.
    pub grammars: Arc<constrain::LazyVocabulary>,
    pub template: Option<Arc<ChatTemplate>>,
    pub routes: Vec<Arc<RouteHandle>>,
}

/// One route's scheduling loop.
pub struct RouteHandle {
    pub name: String,
    pub cluster: Arc<Cluster>,
    pub commands: mpsc::Sender<Command>,
    pub health: watch::Receiver<Health>,
    /// Whether the route can take work (open end to end, every shard answering as validated):
    /// published by the route's runner.
    pub up: watch::Receiver<bool>,
    /// A shard of the route was started with `--pin`: the model is never evicted from it.
    pub pinned: bool,
    /// An operator evicted the model from this route: no new request goes to it.
    pub evicted: Arc<std::sync::atomic::AtomicBool>,
    /// Sessions its loop holds (published by it) and requests on their way to it: new work
    /// goes to the route with the fewest.
    pub load: Arc<std::sync::atomic::AtomicUsize>,
    pub submitting: std::sync::atomic::AtomicUsize,
    /// The prompt prefixes its shards' caches hold, as far as this tracker saw.
    pub prefixes: Arc<super::prefixes::PrefixIndex>,
    /// Its measured time per token (published by its loop).
    pub pace: Arc<super::pace::Pace>,
}

impl RouteHandle {
    pub fn resident(&self) -> bool {
        !self.evicted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Open, serving and resident: it takes new sessions and moved ones.
    pub fn takes_work(&self) -> bool {
        *self.up.borrow() && self.resident()
    }
}

impl ModelEntry {
    pub fn resident(&self) -> bool {
        self.routes.iter().any(|r| r.resident())
    }
}

pub struct RouteTable {
    models: RwLock<Arc<Vec<Arc<ModelEntry>>>>,
    /// The registry's membership as last seen, when the tracker follows one.
    pub registry: Option<watch::Receiver<registry::Members>>,
    /// How a new session's route is picked among its model's.
    pub choice: super::prefixes::RouteChoice,
}

impl RouteTable {
    pub fn new(
        registry: Option<watch::Receiver<registry::Members>>,
        choice: super::prefixes::RouteChoice,
    ) -> RouteTable {
        RouteTable {
            models: RwLock::new(Arc::new(Vec::new())),
            registry,
            choice,
        }
    }

    /// The table as it is now.
    pub fn models(&self) -> Arc<Vec<Arc<ModelEntry>>> {
        Arc::clone(&self.models.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The model of `digest`, if the tracker knows it (its routes may all have left).
    pub fn model(&self, digest: &str) -> Option<Arc<ModelEntry>> {
        self.models().iter().find(|m| m.digest == digest).cloned()
    }

    fn update(&self, f: impl FnOnce(&mut Vec<Arc<ModelEntry>>)) {
        let mut guard = self.models.write().unwrap_or_else(|e| e.into_inner());
        let mut next: Vec<Arc<ModelEntry>> = guard.as_ref().clone();
        f(&mut next);
        *guard = Arc::new(next);
    }

    /// Adds a route to its model, or the model with it (`entry`, whose routes are ignored)
    /// when the table has none of that digest. Sessions move between a model's routes and
    /// must go on bitwise as they would have: a route computing under another numeric contract
    /// than the model's routes, or storing K and V as another type, is refused (naming one of
    /// them), not added.
    pub fn add_route(&self, entry: &ModelEntry, route: Arc<RouteHandle>) -> Result<(), String> {
        let mut result = Ok(());
        self.update(|models| {
            let mut m = match models.iter().position(|m| m.digest == entry.digest) {
                Some(i) => models[i].as_ref().clone(),
                None => ModelEntry {
                    routes: Vec::new(),
                    ..entry.clone()
                },
            };
            let contract = route.cluster.numeric_contract();
            if let Some(other) = m
                .routes
                .iter()
                .find(|r| r.cluster.numeric_contract() != contract)
            {
                result = Err(format!(
                    "its shards compute under numeric contract {contract} but route {} of the same model under {}: sessions moving between them would change tokens",
                    other.name,
                    other.cluster.numeric_contract()
                ));
                return;
            }
            let kv = route.cluster.kv_dtype();
            if let Some(other) = m.routes.iter().find(|r| r.cluster.kv_dtype() != kv) {
                result = Err(format!(
                    "its shards store K and V as {kv} but route {} of the same model as {}: sessions moving between them would change tokens",
                    other.name,
                    other.cluster.kv_dtype()
                ));
                return;
            }
            models.retain(|x| x.digest != entry.digest);
            m.routes.push(route);
            m.n_ctx = context_of(&m);
            models.push(Arc::new(m));
            models.sort_by(|a, b| a.id.cmp(&b.id));
        });
        result
    }

    /// Takes a route out of the table (its model stays known); the route, if it was there.
    pub fn remove_route(&self, name: &str) -> Option<Arc<RouteHandle>> {
        let mut removed = None;
        self.update(|models| {
            for m in models.iter_mut() {
                if let Some(i) = m.routes.iter().position(|r| r.name == name) {
                    let mut next = m.as_ref().clone();
                    removed = Some(next.routes.remove(i));
                    if !next.routes.is_empty() {
                        next.n_ctx = context_of(&next);
                    }
                    *m = Arc::new(next);
                    return;
                }
            }
        });
        removed
    }

    /// The routes of a model, as the table holds them now.
    pub fn routes_of(&self, digest: &str) -> Vec<Arc<RouteHandle>> {
        self.model(digest)
            .map(|m| m.routes.clone())
            .unwrap_or_default()
    }

    /// Whether a route of the model other than `name` takes work now.
    pub fn another_takes_work(&self, digest: &str, name: &str) -> bool {
        self.routes_of(digest)
            .iter()
            .any(|r| r.name != name && r.takes_work())
    }

    /// Every route's shard addresses (in layer order), by route name.
    pub fn shard_addresses(&self) -> Vec<(String, Vec<String>)> {
        self.models()
            .iter()
            .flat_map(|m| {
                m.routes
                    .iter()
                    .map(|r| (r.name.clone(), r.cluster.addresses().to_vec()))
            })
            .collect()
    }
}

impl super::driver::Replicas for RouteTable {
    fn another_takes_work(&self, digest: &str, name: &str) -> bool {
        RouteTable::another_takes_work(self, digest, name)
    }
}

/// The smallest context of a model's routes.
fn context_of(m: &ModelEntry) -> usize {
    m.routes
        .iter()
        .map(|r| r.cluster.n_ctx)
        .min()
        .unwrap_or(m.n_ctx)
}
