//! The tracker's settings, as the binary validated them.

use std::sync::Arc;
use std::time::Duration;

use proto::v1::SeamDtype;

use crate::api::server::HttpConfig;
use crate::ledger;

/// Tracker settings, validated by the binary.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    pub scheduler: engine::SchedulerConfig,
    pub seam: SeamDtype,
    /// How long to wait for shards to answer at start.
    pub startup_wait: Duration,
    pub health_period: Duration,
    pub default_chat_max_tokens: usize,
    /// The temperature of a generation request that gives none (`--default-temperature`);
    /// `None`: the APIs' own default, 1.
    pub default_temperature: Option<f64>,
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
    /// Responses the Responses API keeps for `previous_response_id`: at most this many, and
    /// this many bytes of their conversations.
    pub stored_responses: usize,
    pub stored_response_bytes: usize,
    /// Whose sessions share cached prefix blocks (`--prefix-cache-scope`).
    pub prefix_scope: crate::route::driver::PrefixScope,
    /// How a new session's route is picked (`--route-by`, `--cache-route-slack`).
    pub route_choice: crate::route::prefixes::RouteChoice,
    /// The draft model the routes of every model with its vocabulary draft from, when the
    /// scheduler's drafts are [`engine::DraftKind::Model`] (`--draft-model`).
    pub draft_model: Option<Arc<dyn DraftModel>>,
}

/// A draft model running beside the routes (see [`engine::DraftSource`]).
pub trait DraftModel: engine::DraftSource + std::fmt::Debug {
    /// Why it cannot draft for a model of vocabulary `target` (`None`: it can).
    fn vocabulary_difference(&self, target: &text::Tokenizer) -> Option<String>;
    fn name(&self) -> &str;
}

/// Following a registry: where it is, this cluster's prefix in it, and how to reach the shards
/// it announces.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    pub connect: registry::Connect,
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
            default_temperature: None,
            admission: engine::AdmissionConfig::default(),
            ledger: None,
            admin_token: None,
            liveness: Duration::from_secs(2),
            http: HttpConfig::default(),
            api_key: None,
            public_metrics: false,
            failover_wait: Duration::from_secs(3),
            registry: None,
            stored_responses: 1024,
            stored_response_bytes: 64 << 20,
            prefix_scope: crate::route::driver::PrefixScope::Key,
            route_choice: crate::route::prefixes::RouteChoice::default(),
            draft_model: None,
        }
    }
}
