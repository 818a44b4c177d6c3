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

use crate::RouteStarter;

/// How long a new route may take to connect and open.
const JOIN_WAIT: Duration = Duration::from_secs(10);
/// How long a chain that failed to become a route waits before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(3);

/// A route's members: (address, instance) in layer order.
type Chain = Vec<(String, String)>;

/// A join in progress or done: the chain, its route's name, and how it went.
type Joined = (Chain, String, Result<(), String>);

pub(crate) async fn follow(
    starter: Arc<RouteStarter>,
    mut members: watch::Receiver<Members>,
    link: proto::Link,
) {
    let mut state = State::default();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Joined>();
    loop {
        let now = members.borrow_and_update().clone();
        publish(&starter, &now);
        state.retire_departed(&starter, &now).await;
        state.start_joins(&starter, &now, &link, &done_tx);
        tokio::select! {
            changed = members.changed() => if changed.is_err() { return },
            Some((chain, name, result)) = done_rx.recv() => state.joined(chain, name, result),
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
    /// Chains that failed to become a route, and when: tried again after [`RETRY_AFTER`].
    failed: HashMap<Chain, Instant>,
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

    /// Shards no route uses (static routes and joins in progress included) form new chains;
    /// each is joined on a task of its own.
    fn start_joins(
        &mut self,
        starter: &Arc<RouteStarter>,
        m: &Members,
        link: &proto::Link,
        done: &tokio::sync::mpsc::UnboundedSender<Joined>,
    ) {
        let alive = alive(m);
        let used: HashSet<String> = starter
            .table
            .shard_addresses()
            .into_iter()
            .flat_map(|(_, a)| a)
            .chain(self.built.values().flatten().map(|(a, _)| a.clone()))
            .chain(self.joining.iter().flatten().map(|(a, _)| a.clone()))
            .collect();
        let mut by_model: BTreeMap<(&str, u32), Vec<&ShardRecord>> = BTreeMap::new();
        for r in alive.values().filter(|r| !used.contains(&r.address)) {
            by_model
                .entry((r.digest.as_str(), r.n_layers))
                .or_default()
                .push(r);
        }
        self.failed.retain(|_, at| at.elapsed() < RETRY_AFTER);
        for free in by_model.into_values() {
            for chain in chains(free) {
                let key: Chain = chain
                    .iter()
                    .map(|r| (r.address.clone(), r.instance.clone()))
                    .collect();
                if self.failed.contains_key(&key) {
                    continue;
                }
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
    }

    fn joined(&mut self, chain: Chain, name: String, result: Result<(), String>) {
        self.joining.remove(&chain);
        match result {
            Ok(()) => {
                tracing::info!(route = %name, "route joined from the registry");
                // If a member left meanwhile, the next pass retires it.
                self.built.insert(name, chain);
            }
            Err(e) => {
                tracing::warn!(route = %name, error = %e, "shards announced in the registry do not make a route (yet)");
                self.failed.insert(chain, Instant::now());
            }
        }
    }
}

/// The members that take work, by address.
fn alive(m: &Members) -> HashMap<&str, &ShardRecord> {
    m.shards
        .values()
        .filter(|r| !r.draining)
        .map(|r| (r.address.as_str(), r))
        .collect()
}

/// Connects to a chain's shards and makes it a route.
async fn join(
    starter: &RouteStarter,
    name: &str,
    chain: &Chain,
    link: &proto::Link,
) -> Result<(), String> {
    let shards = chain
        .iter()
        .map(|(a, _)| {
            proto::connect(a, link)
                .map(|s| Arc::new(s) as Arc<dyn ShardTransport>)
                .map_err(|e| e.message().to_string())
        })
        .collect::<Result<Vec<_>, String>>()?;
    starter.add(name, shards, JOIN_WAIT).await
}

fn publish(starter: &RouteStarter, m: &Members) {
    let metrics = &starter.metrics;
    metrics.set(
        "strata_registry_connected",
        &[],
        if m.connected { 1.0 } else { 0.0 },
    );
    metrics.set("strata_registry_members", &[], m.shards.len() as f64);
}

/// Disjoint chains of `free` shards (one model's) that each cover `[0, n_layers)` exactly
/// once, found greedily; linear in the shards for each chain (positions that lead nowhere are
/// remembered).
fn chains(mut free: Vec<&ShardRecord>) -> Vec<Vec<&ShardRecord>> {
    free.sort_by(|a, b| {
        (a.layer_start, std::cmp::Reverse(a.layer_end), &a.address).cmp(&(
            b.layer_start,
            std::cmp::Reverse(b.layer_end),
            &b.address,
        ))
    });
    let mut out = Vec::new();
    loop {
        let Some(n) = free.first().map(|r| r.n_layers) else {
            return out;
        };
        let mut dead = HashSet::new();
        let mut path = Vec::new();
        if !cover(&free, 0, n, &mut dead, &mut path) {
            return out;
        }
        let chain: Vec<&ShardRecord> = path.iter().map(|&i| free[i]).collect();
        let mut taken: Vec<usize> = path;
        taken.sort_unstable();
        for i in taken.into_iter().rev() {
            free.remove(i);
        }
        out.push(chain);
    }
}

/// Depth first from `pos` to `n` over shards starting where the last ended.
fn cover(
    free: &[&ShardRecord],
    pos: u32,
    n: u32,
    dead: &mut HashSet<u32>,
    path: &mut Vec<usize>,
) -> bool {
    if pos == n {
        return true;
    }
    if dead.contains(&pos) {
        return false;
    }
    for (i, r) in free.iter().enumerate() {
        let fits = r.layer_start == pos && r.layer_end > pos && r.layer_end <= n && r.n_layers == n;
        if fits {
            path.push(i);
            if cover(free, r.layer_end, n, dead, path) {
                return true;
            }
            path.pop();
        }
    }
    dead.insert(pos);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(addr: &str, a: u32, b: u32) -> ShardRecord {
        ShardRecord {
            address: addr.into(),
            instance: "1".into(),
            model: "m".into(),
            digest: "d".into(),
            layer_start: a,
            layer_end: b,
            n_layers: 28,
            recipe: String::new(),
            kv_budget_bytes: 0,
            kv_free_bytes: 0,
            max_sessions: 0,
            sessions: 0,
            draining: false,
        }
    }

    fn names(c: &[Vec<&ShardRecord>]) -> Vec<Vec<String>> {
        c.iter()
            .map(|ch| ch.iter().map(|r| r.address.clone()).collect())
            .collect()
    }

    #[test]
    fn replicas_cut_differently_make_two_routes() {
        let s = [
            rec("a", 0, 10),
            rec("b", 10, 28),
            rec("c", 0, 14),
            rec("d", 14, 28),
        ];
        let c = chains(s.iter().collect());
        assert_eq!(names(&c), [["c", "d"], ["a", "b"]]);
    }

    #[test]
    fn a_gap_an_overlap_or_a_lone_half_makes_no_route() {
        let s = [
            rec("a", 0, 10),
            rec("b", 12, 28),
            rec("c", 0, 14),
            rec("d", 9, 28),
        ];
        assert!(chains(s.iter().collect()).is_empty());
        // A dead end is left for a shard that completes the chain.
        let s = [rec("a", 0, 10), rec("c", 0, 14), rec("d", 14, 28)];
        assert_eq!(names(&chains(s.iter().collect())), [["c", "d"]]);
        // A whole-model shard is a route of one.
        let s = [rec("w", 0, 28), rec("x", 0, 5)];
        assert_eq!(names(&chains(s.iter().collect())), [["w"]]);
    }

    #[test]
    fn many_shards_are_chained_without_blowing_up() {
        // 40 one-layer shards at each of positions 0..27 but none at 27: no chain, and the
        // search ends (dead positions are remembered; without that it would try 40^27 paths).
        let mut s = Vec::new();
        for i in 0..27u32 {
            for k in 0..40 {
                s.push(rec(&format!("{i}-{k}"), i, i + 1));
            }
        }
        assert!(chains(s.iter().collect()).is_empty());
    }
}
