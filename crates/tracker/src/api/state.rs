//! What the API's handlers share, and the questions they ask of it: which model a request
//! names, whether it must present a key and which key it presented.

use std::sync::Arc;

use axum::http::HeaderMap;
use engine::Refusal;
use tokio::sync::Semaphore;

use super::auth::bearer;
use super::server::HttpConfig;
use crate::ledger::{ApiKey, Ledger};
use crate::metrics::Metrics;
use crate::route::driver::CacheTenant;
use crate::route::table::{ModelEntry, RouteTable};

/// What the handlers share (all immutable or internally synchronized).
pub struct AppState {
    /// The resident models, each with the routes (nodes) that hold it; routes join and leave
    /// while the tracker runs when it follows a registry.
    pub table: Arc<RouteTable>,
    pub metrics: Arc<Metrics>,
    /// `max_tokens` when a chat request gives none.
    pub default_chat_max_tokens: usize,
    /// The temperature put into a generation request that gives none (see
    /// [`crate::TrackerConfig::default_temperature`]).
    pub default_temperature: Option<f64>,
    pub ledger: Option<Arc<Ledger>>,
    /// The one API key every request must present, when configured (`--api-key`).
    pub api_key: Option<String>,
    /// Whether `/health` and `/metrics` are open to anyone although API keys are on.
    pub public_metrics: bool,
    /// Bearer token of the admin API (`None`: no admin API).
    pub admin_token: Option<String>,
    pub http: HttpConfig,
    /// Memory for request bodies being read and parsed, all requests together.
    pub bodies: Arc<super::server::BodyBudget>,
    /// Long bodies parsed and prompts tokenized at once (each on a blocking thread): all cores
    /// but one, so a flood of long prompts waits here instead of taking the cores that shards
    /// and other requests need.
    pub tokenizing: Arc<Semaphore>,
    /// Numbers the responses (ids unique across routes: each route numbers its sessions).
    pub responses: std::sync::atomic::AtomicU64,
    /// How long a request of a replicated model waits for one of its routes to take it while
    /// they fail over, restart or rejoin (what a moved session waits too).
    pub failover_wait: std::time::Duration,
    /// Recent responses of the Responses API, for `previous_response_id`.
    pub stored_responses: super::store::ResponseStore,
}

impl AppState {
    /// Runs `f` on a blocking thread under one of the [`AppState::tokenizing`] permits, held
    /// until `f` returns even when the request that asked is gone (a cancelled request's work
    /// still takes its place); `None` if the thread panicked.
    pub async fn run_blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let permit = Arc::clone(&self.tokenizing).acquire_owned().await.ok()?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f()
        })
        .await
        .ok()
    }

    /// [`AppState::model`], waiting until `deadline` while the answer is `no_route`: a request
    /// that comes in the moment its model's routes leave and rejoin the table (a registry
    /// blip, the last route failing over) waits for them as a moved session does; past the
    /// deadline the refusal is the client's.
    pub async fn model_within(
        &self,
        requested: Option<&str>,
        deadline: std::time::Instant,
    ) -> Result<Arc<ModelEntry>, Refusal> {
        loop {
            match self.model(requested) {
                Err(e)
                    if e.reason == engine::Reason::NoRoute
                        && std::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                answer => return answer,
            }
        }
    }

    /// The model a request names (or the only one, when it names none). A model no route
    /// holds is refused as `not_resident`: nothing is ever loaded to answer a request. With
    /// no route at all (none joined yet, or the model's routes all left), the refusal is a
    /// retryable `no_route`.
    pub fn model(&self, requested: Option<&str>) -> Result<Arc<ModelEntry>, Refusal> {
        let models = self.table.models();
        let resident: Vec<&Arc<ModelEntry>> = models.iter().filter(|m| m.resident()).collect();
        let no_route = |what: &str| {
            Refusal::no_route(format!(
                "no route serves {what} now; shards join the registry at any time, retry shortly"
            ))
        };
        // Known, but every route of it left (an evicted route is still there: that model is
        // not resident, which only an operator changes).
        let departed = |e: &ModelEntry| e.routes.is_empty();
        match requested {
            Some(m) => match resident.iter().find(|e| e.id == m || e.digest == m) {
                Some(e) => Ok(Arc::clone(e)),
                None if models.is_empty() => Err(no_route(&format!("`{m}`"))),
                None if models
                    .iter()
                    .any(|e| (e.id == m || e.digest == m) && departed(e)) =>
                {
                    Err(no_route(&format!("`{m}`")))
                }
                None => Err(Refusal::not_resident(m, &self.residency())),
            },
            None if resident.len() == 1 => Ok(Arc::clone(resident[0])),
            None if resident.is_empty() && models.iter().all(|e| departed(e)) => {
                Err(no_route("any model"))
            }
            None => Err(Refusal::invalid(
                "model",
                format!(
                    "`model` is required: this tracker serves {}",
                    self.residency()
                ),
            )),
        }
    }

    /// "model on route, route; model on route" for messages.
    pub fn residency(&self) -> String {
        self.table
            .models()
            .iter()
            .filter(|m| m.resident())
            .map(|m| {
                let routes: Vec<&str> = m
                    .routes
                    .iter()
                    .filter(|r| r.resident())
                    .map(|r| r.name.as_str())
                    .collect();
                format!("`{}` on {}", m.id, routes.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Whether requests must present an API key.
    pub fn keys_on(&self) -> bool {
        self.api_key.is_some() || self.ledger.as_ref().is_some_and(|l| l.has_keys())
    }

    /// The caller's key for a completion: checked against `--api-key`, or looked up in the
    /// ledger (which then records the request's usage under it).
    pub fn key(&self, headers: &HeaderMap) -> Result<Option<ApiKey>, Refusal> {
        let secret = bearer(headers);
        if let Some(expected) = &self.api_key {
            if !proto::secrets_equal(&secret, expected) {
                return Err(Refusal::unauthorized());
            }
        }
        self.ledger
            .as_ref()
            .map(|l| l.authenticate(&secret))
            .transpose()
    }

    /// The prefix-cache partitions of a caller with `key` ([`AppState::key`]'s answer) whose
    /// request names the cache group `group` ([`super::fields::cache_group`]): under the
    /// default scope a hash of the secret it presented (its ledger key's, else `--api-key`,
    /// else the empty secret of an open tracker) and of the group, so callers share cached
    /// prompt prefixes only when they hold the same secret and name the same group, also
    /// across trackers on the same shards; under `--prefix-cache-scope global` a hash of the
    /// group alone (0, shared by all, when it names none).
    pub fn tenant(&self, key: Option<&ApiKey>, group: Option<&str>) -> CacheTenant {
        let secret = match (key, &self.api_key) {
            (Some(k), _) if !k.secret.is_empty() => k.secret.as_str(),
            (_, Some(s)) => s.as_str(),
            _ => "",
        };
        CacheTenant {
            key: partition_of(Some(secret), group),
            group: group.map_or(0, |g| partition_of(None, Some(g))),
        }
    }

    /// `/health` and `/metrics` tell an operator about the cluster: with API keys on they
    /// need a valid key, unless the tracker was started with `--public-metrics`.
    pub fn may_observe(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        if self.public_metrics || !self.keys_on() {
            return Ok(());
        }
        self.key(headers).map(|_| ())
    }
}

/// The partition of a caller holding `secret` (`None`: any caller) naming cache group
/// `group`: SHA-256 of them under this use's own prefix, each part length-prefixed so no two
/// pairs hash alike, as a nonzero u64. A shard sees only this value; it reveals neither.
fn partition_of(secret: Option<&str>, group: Option<&str>) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"strata prefix-cache tenant\0");
    for part in [secret, group] {
        match part {
            None => h.update([0u8]),
            Some(p) => {
                h.update([1u8]);
                h.update((p.len() as u64).to_le_bytes());
                h.update(p.as_bytes());
            }
        }
    }
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes")).max(1)
}

#[cfg(test)]
mod tenant_tests {
    use super::partition_of;

    #[test]
    fn partitions_are_nonzero_stable_and_apart() {
        let p = |secret: &str, group: Option<&str>| partition_of(Some(secret), group);
        let (a, b, open) = (p("sk-alice", None), p("sk-bob", None), p("", None));
        assert!(a != 0 && b != 0 && open != 0);
        assert_ne!(a, b);
        assert_ne!(a, open);
        assert_eq!(a, p("sk-alice", None), "the same secret, the same tenant");
        // A group narrows a key's partition; it never reaches another key's.
        let ag = p("sk-alice", Some("g"));
        assert!(ag != a && ag != p("sk-bob", Some("g")));
        assert_eq!(ag, p("sk-alice", Some("g")));
        // Parts are length-prefixed: moving bytes between secret and group changes it.
        assert_ne!(p("ab", Some("c")), p("a", Some("bc")));
        // A group alone (the global scope's) is none of the keys' partitions.
        let g = partition_of(None, Some("g"));
        assert!(g != 0 && g != ag && g != p("", Some("g")));
    }
}
