//! Routes from what is alive: the tracker follows the shards announced in the registry and
//! keeps one route for every chain of them that covers a model's layers `[0, n)` exactly
//! once. Replicas may be cut differently (0..10 + 10..28 beside 0..14 + 14..28): chains are
//! found among the shards no route uses yet. A route whose shard left (withdrew, its lease ran
//! out, or it restarted as a new instance) is retired; a new chain becomes a route once it is
//! connected, validated and open. An etcd outage freezes the membership, so it never tears a
//! route down.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::ShardTransport;
use registry::{Members, ShardRecord};
use tokio::sync::watch;

use super::start::RouteStarter;

/// How long a new route may take to connect and open (an announced shard is serving
/// already: one that does not answer in this time is not what its record says).
const JOIN_WAIT: Duration = Duration::from_secs(5);
/// How long a shard whose chain failed to become a route waits before it is tried again, the
/// first time; each further failure doubles it, up to [`MAX_RETRY_AFTER`].
const RETRY_AFTER: Duration = Duration::from_secs(3);
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Joins in progress at once: records that lead nowhere (a registry full of fakes) cost a
/// bounded amount of work, and the chains with the fewest failures go first.
const MAX_JOINS: usize = 8;

/// A route's members: (address, instance) in layer order.
type Chain = Vec<(String, String)>;

/// A join in progress or done: the chain, its route's name, and how it went.
type Joined = (Chain, String, Result<(), JoinFailure>);

/// Why a chain did not become a route, and which member is to blame when one is known (a
/// shard that did not answer its probe): only that one backs off, so a fake record chained
/// with a real shard does not keep the real one out.
#[derive(Debug)]
struct JoinFailure {
    message: String,
    culprit: Option<usize>,
}

pub(crate) async fn follow(
    starter: Arc<RouteStarter>,
    mut members: watch::Receiver<Members>,
    link: proto::Link,
) {
    let mut state = State::default();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Joined>();
    // Copied only when it changes: a join ending or the retry tick reuses it.
    let mut now = members.borrow_and_update().clone();
    loop {
        publish(&starter, &now);
        state.retire_departed(&starter, &now).await;
        state.start_joins(&starter, &now, &link, &done_tx);
        tokio::select! {
            changed = members.changed() => match changed {
                Ok(()) => now = members.borrow_and_update().clone(),
                Err(_) => return,
            },
            Some((chain, name, result)) = done_rx.recv() => state.joined(&starter, chain, name, result),
            // Chains that failed are tried again.
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[derive(Default)]
struct State {
    /// Routes built from the registry, by name.
    built: BTreeMap<String, Chain>,
    /// Chains being connected and opened (each on its own task, so a slow or unreachable
    /// shard never holds up anything else).
    joining: HashSet<Chain>,
    /// Members whose chain failed to become a route, by (address, instance): how many times
    /// in a row, and when they may be tried again (exponential back-off; a shard restarted as
    /// another instance starts afresh).
    failed: HashMap<(String, String), (u32, Instant)>,
    /// Numbers route names: a shard restarted on its address makes a new route, never one
    /// named like the route it left (whose loop may still be finishing sessions).
    next: u64,
}

impl State {
    /// Routes with a member gone (withdrawn, lease run out, or restarted as another instance)
    /// leave the table.
    async fn retire_departed(&mut self, starter: &RouteStarter, m: &Members) {
        let alive = alive(m);
        let gone: Vec<String> = self
            .built
            .iter()
            .filter(|(_, chain)| {
                chain
                    .iter()
                    .any(|(a, i)| alive.get(a.as_str()).is_none_or(|r| r.instance != *i))
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            tracing::info!(route = %name, "a shard of the route left the registry: retiring it");
            self.built.remove(&name);
            starter.retire(&name).await;
        }
    }

    /// Shards no route uses (static routes and joins in progress included) and not backing
    /// off form new chains; at most [`MAX_JOINS`] are joined at once, each on a task of its
    /// own, those whose members failed least first.
    fn start_joins(
        &mut self,
        starter: &Arc<RouteStarter>,
        m: &Members,
        link: &proto::Link,
        done: &tokio::sync::mpsc::UnboundedSender<Joined>,
    ) {
        let alive = alive(m);
        let now = Instant::now();
        // Back-offs of members that left are forgotten with them.
        self.failed
            .retain(|(a, i), _| alive.get(a.as_str()).is_some_and(|r| r.instance == *i));
        if self.joining.len() >= MAX_JOINS {
            return;
        }
        let used: HashSet<String> = starter
            .table
            .shard_addresses()
            .into_iter()
            .flat_map(|(_, a)| a)
            .chain(self.built.values().flatten().map(|(a, _)| a.clone()))
            .chain(self.joining.iter().flatten().map(|(a, _)| a.clone()))
            .collect();
        let waiting = |r: &ShardRecord| {
            self.failed
                .get(&(r.address.clone(), r.instance.clone()))
                .is_some_and(|(_, until)| *until > now)
        };
        // Only shards that store K and V alike and share a numeric contract chain.
        let mut by_model: BTreeMap<(&str, u32, String), Vec<&ShardRecord>> = BTreeMap::new();
        for r in alive
            .values()
            .filter(|r| !used.contains(&r.address) && !waiting(r))
        {
            by_model
                .entry((r.digest.as_str(), r.n_layers, r.arithmetic()))
                .or_default()
                .push(r);
        }
        let room = MAX_JOINS - self.joining.len();
        let mut found: Vec<(u32, Chain)> = by_model
            .into_values()
            .flat_map(|free| registry::placement::chains(free, room))
            .map(|chain| {
                let key: Chain = chain
                    .iter()
                    .map(|r| (r.address.clone(), r.instance.clone()))
                    .collect();
                let failures = key
                    .iter()
                    .map(|m| self.failed.get(m).map_or(0, |(n, _)| *n))
                    .sum();
                (failures, key)
            })
            .collect();
        found.sort_by_key(|(failures, _)| *failures);
        for (_, key) in found.into_iter().take(room) {
            self.next += 1;
            let addrs: Vec<&str> = key.iter().map(|(a, _)| a.as_str()).collect();
            let name = format!("{}~{}", addrs.join("+"), self.next);
            self.joining.insert(key.clone());
            let (starter, link, done) = (Arc::clone(starter), link.clone(), done.clone());
            tokio::spawn(async move {
                let result = join(&starter, &name, &key, &link).await;
                let _ = done.send((key, name, result));
            });
        }
    }

    fn joined(
        &mut self,
        starter: &RouteStarter,
        chain: Chain,
        name: String,
        result: Result<(), JoinFailure>,
    ) {
        self.joining.remove(&chain);
        match result {
            Ok(()) => {
                tracing::info!(route = %name, "route joined from the registry");
                for m in &chain {
                    self.failed.remove(m);
                }
                // If a member left meanwhile, the next pass retires it.
                self.built.insert(name, chain);
            }
            Err(JoinFailure {
                message: e,
                culprit,
            }) => {
                starter.metrics.inc(
                    "strata_registry_rejected_total",
                    &[("reason", "join_failed")],
                    1.0,
                );
                let now = Instant::now();
                let mut longest = Duration::ZERO;
                let blamed: Vec<(String, String)> = match culprit {
                    Some(i) => chain.into_iter().skip(i).take(1).collect(),
                    None => chain,
                };
                for m in blamed {
                    let n = self.failed.get(&m).map_or(0, |(n, _)| *n) + 1;
                    let wait = jittered(back_off(n), &m.0);
                    longest = longest.max(wait);
                    self.failed.insert(m, (n, now + wait));
                }
                // The first failure is worth a warning; a record that keeps failing, less.
                if longest <= RETRY_AFTER {
                    tracing::warn!(route = %name, error = %e, "shards announced in the registry do not make a route (yet)");
                } else {
                    tracing::debug!(route = %name, error = %e, retry_in = ?longest, "shards announced in the registry still do not make a route");
                }
            }
        }
    }
}

/// How long a member waits after its `n`-th failure in a row.
fn back_off(n: u32) -> Duration {
    RETRY_AFTER
        .saturating_mul(1 << n.saturating_sub(1).min(16))
        .min(MAX_RETRY_AFTER)
}

/// `wait` stretched by up to a quarter, differently for each address and time: members that
/// failed together (a registry filled with fakes at once) are not all tried again together.
fn jittered(wait: Duration, address: &str) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(address.as_bytes());
    let quarter = wait / 4;
    let extra = h.finish() % (quarter.as_millis() as u64 + 1);
    wait + Duration::from_millis(extra)
}

/// The members that take work, by address.
fn alive(m: &Members) -> HashMap<&str, &ShardRecord> {
    m.shards
        .values()
        .filter(|r| !r.draining)
        .map(|r| (r.address.as_str(), r))
        .collect()
}

/// How long a shard of a new chain may take to answer its first probe.
const PROBE_WAIT: Duration = Duration::from_secs(2);

/// Connects to a chain's shards and makes it a route. Each shard is probed once first: an
/// announced shard serves already, so one that refuses or does not answer fails the join at
/// once instead of being retried for the whole join wait (a registry full of records that
/// lead nowhere costs one refused connection each).
async fn join(
    starter: &RouteStarter,
    name: &str,
    chain: &Chain,
    link: &proto::Link,
) -> Result<(), JoinFailure> {
    let mut shards = Vec::with_capacity(chain.len());
    for (i, (a, _)) in chain.iter().enumerate() {
        let blame = |message: String| JoinFailure {
            message,
            culprit: Some(i),
        };
        // A plain TCP connection first: an address nobody serves refuses it in microseconds,
        // where a gRPC channel's attempt costs a couple of milliseconds of CPU.
        match tokio::time::timeout(PROBE_WAIT, tokio::net::TcpStream::connect(a.as_str())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(blame(format!("shard {a} does not answer: {e}"))),
            Err(_) => {
                return Err(blame(format!(
                    "shard {a} does not answer within {PROBE_WAIT:?}"
                )))
            }
        }
        let s = proto::connect(a, link).map_err(|e| blame(e.message().to_string()))?;
        s.describe(PROBE_WAIT)
            .await
            .map_err(|e| blame(format!("shard {a} does not answer: {}", e.message())))?;
        shards.push(Arc::new(s) as Arc<dyn ShardTransport>);
    }
    starter
        .add(name, shards, JOIN_WAIT)
        .await
        .map_err(|message| JoinFailure {
            message,
            culprit: None,
        })
}

fn publish(starter: &RouteStarter, m: &Members) {
    let metrics = &starter.metrics;
    metrics.set(
        "strata_registry_connected",
        &[],
        if m.connected { 1.0 } else { 0.0 },
    );
    metrics.set("strata_registry_members", &[], m.shards.len() as f64);
    for (reason, n) in &m.rejected {
        metrics.set(
            "strata_registry_rejected_total",
            &[("reason", reason)],
            *n as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_member_backs_off_exponentially_up_to_a_bound() {
        for a in ["127.0.0.1:9", "10.0.0.1:1"] {
            let j = jittered(RETRY_AFTER * 4, a);
            assert!(j >= RETRY_AFTER * 4 && j <= RETRY_AFTER * 5, "{j:?}");
        }
        assert_eq!(back_off(1), RETRY_AFTER);
        assert_eq!(back_off(2), RETRY_AFTER * 2);
        assert_eq!(back_off(4), RETRY_AFTER * 8);
        assert_eq!(back_off(50), MAX_RETRY_AFTER);
        assert_eq!(back_off(u32::MAX), MAX_RETRY_AFTER);
    }
}
