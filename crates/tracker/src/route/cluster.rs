//! The shards of the route: checking that they fit together, watching their health, opening
//! route streams.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::v1::{route_msg, RouteMsg, RouteSetup, SeamDtype, ShardInfo, ShardStats};
use proto::{ReplyStream, ShardTransport};
use tokio::sync::{mpsc, watch};

use crate::metrics::Metrics;
use engine::{Reason, Refusal};

/// The validated route: shards in layer order with what they said about themselves.
pub struct Cluster {
    pub shards: Vec<Arc<dyn ShardTransport>>,
    pub infos: Vec<ShardInfo>,
    pub model_digest: String,
    pub model_name: String,
    pub n_layers: u32,
    /// The smallest per-session context any shard allows.
    pub n_ctx: usize,
}

/// Health of one shard as last probed.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardHealth {
    pub address: String,
    pub layers: (u32, u32),
    /// Answering, and as the route was validated with.
    pub up: bool,
    pub last_error: Option<String>,
    /// The shard answers but is no longer what the route was validated with (restarted with
    /// another model, range or recipe): terminal until an operator acts.
    pub mismatch: Option<String>,
    pub stats: Option<ShardStats>,
}

/// A snapshot of every shard's health.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Health {
    pub shards: Vec<ShardHealth>,
}

impl Health {
    pub fn all_up(&self) -> bool {
        !self.shards.is_empty() && self.shards.iter().all(|s| s.up)
    }

    /// Shards going away (SIGTERM): they take no new sessions.
    pub fn draining(&self) -> Vec<String> {
        if !self.any_draining() {
            return Vec::new();
        }
        self.shards
            .iter()
            .filter(|s| s.stats.as_ref().is_some_and(|st| st.draining))
            .map(|s| s.address.clone())
            .collect()
    }

    /// Free KV bytes on the route's tightest shard, as last probed (0 when unknown).
    pub fn kv_headroom(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.stats.as_ref().map_or(0, |st| {
                    st.kv_bytes_budget.saturating_sub(st.kv_bytes_in_use)
                })
            })
            .min()
            .unwrap_or(0)
    }

    /// Every shard up and none draining: the route takes new sessions.
    pub fn serving(&self) -> bool {
        self.all_up() && !self.any_draining()
    }

    /// Whether a shard drains (read every pass of the route's loop: allocates nothing).
    pub fn any_draining(&self) -> bool {
        self.shards
            .iter()
            .any(|s| s.stats.as_ref().is_some_and(|st| st.draining))
    }

    /// The first shard that answers as something other than what the route was validated
    /// with, said as a refusal message.
    pub fn mismatched(&self) -> Option<String> {
        self.shards.iter().find_map(|s| s.mismatch.clone())
    }

    pub fn down(&self) -> Vec<String> {
        self.shards
            .iter()
            .filter(|s| !s.up)
            .map(|s| s.address.clone())
            .collect()
    }
}

/// A route stream a shard refused or broke: the refusal it sent typed (a recipe or protocol it
/// does not hold), else that shard failing.
pub fn link_refusal(shard: &str, status: &tonic::Status) -> Refusal {
    proto::status_refusal(status).unwrap_or_else(|| Refusal::shard_failed(shard, status.message()))
}

fn range(i: &ShardInfo) -> String {
    format!("{}..{}", i.layer_start, i.layer_end)
}

/// Orders shards by layer and checks that they cover `[0, n_layers)` exactly once with one
/// model and compatible recipes; the error names the shard and range at fault.
pub fn validate_route(infos: &[(String, ShardInfo)]) -> Result<Vec<usize>, String> {
    if infos.is_empty() {
        return Err("no shards given".into());
    }
    let (first_addr, first) = &infos[0];
    for (addr, i) in infos {
        if i.protocol_version != proto::PROTOCOL_VERSION {
            return Err(format!(
                "shard {addr} speaks protocol {} but this tracker speaks {}",
                i.protocol_version,
                proto::PROTOCOL_VERSION
            ));
        }
        if i.model_digest != first.model_digest {
            return Err(format!(
                "shard {addr} (layers {}) serves model {} but shard {first_addr} serves {}",
                range(i),
                i.model_digest,
                first.model_digest
            ));
        }
        if i.n_layers != first.n_layers {
            return Err(format!(
                "shard {addr} says the model has {} layers, shard {first_addr} says {}",
                i.n_layers, first.n_layers
            ));
        }
        let (a, b) = (
            i.recipe.clone().unwrap_or_default(),
            first.recipe.clone().unwrap_or_default(),
        );
        if a.kv_dtype != b.kv_dtype {
            return Err(format!(
                "shard {addr} (layers {}) stores K and V as {} but shard {first_addr} as {}: start every shard of a route with the same --kv-type",
                range(i),
                a.kv_dtype,
                b.kv_dtype
            ));
        }
        if a.rope_base != b.rope_base
            || a.rope_dim != b.rope_dim
            || a.rope_freq_scale != b.rope_freq_scale
        {
            return Err(format!(
                "shard {addr} (layers {}) has a cache recipe incompatible with shard {first_addr}",
                range(i)
            ));
        }
        if a.numeric_contract != b.numeric_contract {
            return Err(format!(
                "shard {addr} (layers {}) computes under numeric contract {} but shard {first_addr} under {}: their activations do not chain bitwise",
                range(i),
                a.numeric_contract,
                b.numeric_contract
            ));
        }
    }
    let mut order: Vec<usize> = (0..infos.len()).collect();
    order.sort_by_key(|&k| infos[k].1.layer_start);
    let mut next = 0u32;
    for &k in &order {
        let (addr, i) = &infos[k];
        if i.layer_start != next {
            return Err(if i.layer_start < next {
                format!(
                    "shard {addr} (layers {}) overlaps layers already covered up to {next}",
                    range(i)
                )
            } else {
                format!("layers {next}..{} are not covered (the next shard, {addr}, starts at layer {})", i.layer_start, i.layer_start)
            });
        }
        next = i.layer_end;
    }
    if next != first.n_layers {
        return Err(format!(
            "layers {next}..{} are not covered by any shard",
            first.n_layers
        ));
    }
    Ok(order)
}

impl Cluster {
    /// How the route's shards store K and V (one type for all, validated): `f16` or `q8_0`.
    pub fn kv_dtype(&self) -> &str {
        self.infos
            .first()
            .and_then(|i| i.recipe.as_ref())
            .map_or("f16", |r| r.kv_dtype.as_str())
    }

    /// The numeric contract the route's shards compute under (one for all, validated).
    pub fn numeric_contract(&self) -> u32 {
        self.infos
            .first()
            .and_then(|i| i.recipe.as_ref())
            .map_or(0, |r| r.numeric_contract)
    }

    /// Describes every shard (retrying until `wait`), then validates the route.
    pub async fn connect(
        shards: Vec<Arc<dyn ShardTransport>>,
        wait: Duration,
    ) -> Result<Cluster, String> {
        let start = Instant::now();
        let mut infos = Vec::with_capacity(shards.len());
        for s in &shards {
            let info = loop {
                match s.describe(Duration::from_secs(2)).await {
                    Ok(i) => break i,
                    Err(e) if e.code() == tonic::Code::Unauthenticated => {
                        return Err(format!(
                            "shard {} refused the cluster token: {}",
                            s.address(),
                            e.message()
                        ));
                    }
                    Err(e) if start.elapsed() >= wait => {
                        return Err(format!(
                            "shard {} did not answer within {wait:?}: {}",
                            s.address(),
                            e.message()
                        ));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            };
            infos.push((s.address().to_string(), info));
        }
        let order = validate_route(&infos)?;
        let shards: Vec<_> = order.iter().map(|&k| Arc::clone(&shards[k])).collect();
        let infos: Vec<ShardInfo> = order.iter().map(|&k| infos[k].1.clone()).collect();
        let first = &infos[0];
        Ok(Cluster {
            model_digest: first.model_digest.clone(),
            model_name: first.model_name.clone(),
            n_layers: first.n_layers,
            n_ctx: infos
                .iter()
                .filter_map(|i| i.recipe.as_ref().map(|r| r.n_ctx as usize))
                .min()
                .unwrap_or(4096),
            shards,
            infos,
        })
    }

    pub fn addresses(&self) -> Vec<String> {
        self.shards
            .iter()
            .map(|s| s.address().to_string())
            .collect()
    }

    /// Opens a route stream through every shard for `epoch`; the refusal says whether a retry
    /// may help (a shard down) or not (a recipe mismatch).
    pub async fn open_route(&self, epoch: u64, seam: SeamDtype) -> Result<RouteLink, Refusal> {
        // On a route of several shards the last one answers here directly: its replies stream
        // is opened first, under a key the route's setup then names.
        let (reply_key, direct) = match self.shards.len() {
            1 => (0, None),
            _ => {
                let key = std::hash::BuildHasher::hash_one(
                    &std::collections::hash_map::RandomState::new(),
                    (epoch, std::time::SystemTime::now()),
                )
                .max(1);
                let last = &self.shards[self.shards.len() - 1];
                let direct = last
                    .replies(key)
                    .await
                    .map_err(|e| link_refusal(last.address(), &e))?;
                (key, Some(direct))
            }
        };
        let (tx, rx) = mpsc::channel(64);
        let setup = RouteSetup {
            protocol_version: proto::PROTOCOL_VERSION,
            epoch,
            downstream: self.addresses()[1..].to_vec(),
            seam_dtype: seam as i32,
            model_digest: self.model_digest.clone(),
            recipes: self
                .infos
                .iter()
                .map(|i| i.recipe.clone().unwrap_or_default())
                .collect(),
            reply_key,
        };
        tx.send(RouteMsg {
            msg: Some(route_msg::Msg::Setup(setup)),
        })
        .await
        .map_err(|_| Refusal::unavailable("the route channel closed"))?;
        let first = &self.shards[0];
        let upstream = first
            .route(rx)
            .await
            .map_err(|e| link_refusal(first.address(), &e))?;
        Ok(RouteLink {
            tx,
            upstream,
            direct,
        })
    }

    /// Probes every shard with a short deadline and returns the first that does not answer.
    pub async fn first_unresponsive(&self, timeout: Duration) -> Option<String> {
        for s in &self.shards {
            if s.describe(timeout).await.is_err() {
                return Some(s.address().to_string());
            }
        }
        None
    }
}

/// An open route: steps go in on `tx`. On a route of one shard its replies come back on
/// `upstream`; on a longer route they come from the last shard on `direct`, and `upstream` (the
/// first shard's stream) carries only failures.
pub struct RouteLink {
    pub tx: mpsc::Sender<RouteMsg>,
    pub upstream: ReplyStream,
    pub direct: Option<ReplyStream>,
}

/// How a shard that answers now differs from what the route was validated with, if it does.
fn identity_change(addr: &str, validated: &ShardInfo, now: &ShardInfo) -> Option<String> {
    let (a, b) = (validated, now);
    if a.model_digest != b.model_digest
        || a.layer_start != b.layer_start
        || a.layer_end != b.layer_end
        || a.recipe != b.recipe
        || a.protocol_version != b.protocol_version
    {
        return Some(format!(
            "{}: shard {addr} now serves layers {}..{} of model {}, but the route was validated with layers {}..{} of model {} (and its cache recipe); restart it as it was, or restart the tracker",
            Reason::RecipeMismatch,
            b.layer_start, b.layer_end, b.model_digest, a.layer_start, a.layer_end, a.model_digest
        ));
    }
    None
}

/// Probes every shard every `period`, publishing health snapshots and per-shard metrics.
pub async fn monitor(
    cluster: Arc<Cluster>,
    period: Duration,
    tx: watch::Sender<Health>,
    metrics: Arc<Metrics>,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut snapshot = Health::default();
        for (s, info) in cluster.shards.iter().zip(&cluster.infos) {
            let timeout = period.max(Duration::from_millis(800));
            let addr = s.address().to_string();
            let l = [("shard", addr.as_str())];
            // A shard restarted on its address may hold something else now.
            let mismatch = match s.describe(timeout).await {
                Ok(now) => identity_change(&addr, info, &now),
                Err(_) => None,
            };
            let probe = s.stats(timeout).await;
            let (up, last_error, stats) = match probe {
                Ok(st) => {
                    publish_stats(&metrics, &addr, &st);
                    (mismatch.is_none(), mismatch.clone(), Some(st))
                }
                Err(e) => (false, Some(e.message().to_string()), None),
            };
            metrics.set("strata_shard_up", &l, if up { 1.0 } else { 0.0 });
            snapshot.shards.push(ShardHealth {
                address: addr,
                layers: (info.layer_start, info.layer_end),
                up,
                last_error,
                mismatch,
                stats,
            });
        }
        if tx.send(snapshot).is_err() {
            // The route is gone: so are the series of its shards (a shard that serves on,
            // in a route of its own, has them set again by that route's monitor at its next
            // probe; no route's own series are touched).
            for s in &cluster.shards {
                metrics.forget_unscoped("shard", s.address());
            }
            return;
        }
    }
}

/// A shard's probed counters and gauges as metric series of that shard.
fn publish_stats(metrics: &Metrics, addr: &str, st: &ShardStats) {
    let l = [("shard", addr)];
    metrics.set(
        "strata_shard_prefill_tokens_total",
        &l,
        st.prefill_tokens as f64,
    );
    metrics.set(
        "strata_shard_decode_tokens_total",
        &l,
        st.decode_tokens as f64,
    );
    metrics.set("strata_shard_steps_total", &l, st.steps as f64);
    metrics.set(
        "strata_shard_prefix_reused_tokens_total",
        &l,
        st.prefix_reused_tokens as f64,
    );
    metrics.set("strata_shard_kv_blocks_idle", &l, st.kv_blocks_idle as f64);
    metrics.set(
        "strata_shard_kernel_thread_moves_total",
        &l,
        st.kernel_thread_moves as f64,
    );
    for (outcome, n) in [
        ("started", st.early_steps_started),
        ("used", st.early_steps_used),
        ("discarded", st.early_steps_discarded),
    ] {
        metrics.set(
            "strata_shard_early_steps_total",
            &[("shard", addr), ("outcome", outcome)],
            n as f64,
        );
    }
    metrics.set("strata_shard_kv_bytes", &l, st.kv_bytes_in_use as f64);
    metrics.set(
        "strata_shard_kv_budget_bytes",
        &l,
        st.kv_bytes_budget as f64,
    );
    metrics.set("strata_shard_kv_blocks", &l, st.kv_blocks_in_use as f64);
    metrics.set(
        "strata_shard_kv_blocks_capacity",
        &l,
        st.kv_blocks_total as f64,
    );
    if st.kv_bytes_budget > 0 {
        metrics.set(
            "strata_shard_kv_usage_ratio",
            &l,
            st.kv_bytes_in_use as f64 / st.kv_bytes_budget as f64,
        );
    }
    metrics.set("strata_shard_sessions", &l, st.sessions as f64);
    metrics.set("strata_shard_rss_bytes", &l, st.rss_bytes as f64);
    metrics.set("strata_shard_weight_bytes", &l, st.weight_bytes as f64);
    metrics.set(
        "strata_shard_seam_bytes_out_total",
        &l,
        st.seam_bytes_out as f64,
    );
    // Every pool's use and budget (memory pressure per pool per shard).
    for (pool, used, budget) in [
        ("weights", st.weight_bytes, st.weights_bytes_budget),
        ("kv", st.kv_bytes_in_use, st.kv_bytes_budget),
        (
            "scratch",
            st.scratch_bytes_last_step,
            st.scratch_bytes_budget,
        ),
        ("inflight", st.inflight_bytes, st.inflight_bytes_budget),
    ] {
        let pl = [("shard", addr), ("pool", pool)];
        metrics.set("strata_shard_pool_bytes", &pl, used as f64);
        metrics.set("strata_shard_pool_budget_bytes", &pl, budget as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::CacheRecipe;

    fn info(a: u32, b: u32, digest: &str) -> ShardInfo {
        ShardInfo {
            protocol_version: proto::PROTOCOL_VERSION,
            model_digest: digest.into(),
            layer_start: a,
            layer_end: b,
            n_layers: 30,
            recipe: Some(CacheRecipe {
                kv_dtype: "f16".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn shards_in_any_order_that_cover_every_layer_once_are_accepted() {
        let infos = vec![
            ("b".to_string(), info(15, 30, "d")),
            ("a".to_string(), info(0, 15, "d")),
        ];
        assert_eq!(validate_route(&infos).unwrap(), vec![1, 0]);
    }

    #[test]
    fn gaps_overlaps_and_other_models_are_refused_naming_the_shard() {
        let gap = vec![
            ("a".to_string(), info(0, 10, "d")),
            ("b".to_string(), info(15, 30, "d")),
        ];
        assert!(validate_route(&gap)
            .unwrap_err()
            .contains("layers 10..15 are not covered"));
        let overlap = vec![
            ("a".to_string(), info(0, 16, "d")),
            ("b".to_string(), info(15, 30, "d")),
        ];
        assert!(validate_route(&overlap)
            .unwrap_err()
            .contains("shard b (layers 15..30) overlaps"));
        let short = vec![("a".to_string(), info(0, 20, "d"))];
        assert!(validate_route(&short)
            .unwrap_err()
            .contains("layers 20..30 are not covered"));
        let other = vec![
            ("a".to_string(), info(0, 15, "d")),
            ("b".to_string(), info(15, 30, "e")),
        ];
        assert!(validate_route(&other)
            .unwrap_err()
            .contains("shard b (layers 15..30) serves model e"));
    }

    /// Shards whose kernels follow different numeric contracts do not chain: their
    /// activations would not be what one process computes.
    #[test]
    fn shards_of_different_numeric_contracts_are_refused_naming_both() {
        let with = |start, end, contract| {
            let mut i = info(start, end, "d");
            if let Some(r) = i.recipe.as_mut() {
                r.numeric_contract = contract;
            }
            i
        };
        let mixed = [
            ("a".to_string(), with(0, 15, 1)),
            ("b".to_string(), with(15, 30, 2)),
        ];
        let e = validate_route(&mixed).unwrap_err();
        assert!(
            e.contains(
                "shard b (layers 15..30) computes under numeric contract 2 but shard a under 1"
            ),
            "{e}"
        );
        let same = [
            ("a".to_string(), with(0, 15, 1)),
            ("b".to_string(), with(15, 30, 1)),
        ];
        assert_eq!(validate_route(&same), Ok(vec![0, 1]));
    }
}
