//! Where a shard that places itself goes (`strata shard --layers auto`): from the live records
//! of its model, the layers no shard serves first, then the layers the fewest shards serve, as
//! many as its weights budget holds; and the routes (chains of shards covering every layer once)
//! that trackers and `strata plan` find among the live records.

use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use crate::etcd::{self, kv_client::KvClient, lease_client::LeaseClient};
use crate::{
    call, channel, prefix_end, read_range, snapshot, Connect, Error, Etcd, ShardRecord,
    MAX_RECORD_BYTES,
};

/// Per layer of the model `of` is a shard of, how many live shards of its swarm
/// ([`ShardRecord::same_swarm`]: the same file, layer count and arithmetic) that take new
/// sessions (not draining) serve it. Records of other models or arithmetic (a shard storing K
/// and V otherwise never chains with it), or whose range does not fit the model, count for
/// nothing.
pub fn coverage<'a>(
    records: impl IntoIterator<Item = &'a ShardRecord>,
    of: &ShardRecord,
) -> Vec<u32> {
    let mut cover = vec![0u32; of.n_layers as usize];
    for r in records {
        if !r.same_swarm(of) || r.draining || !r.plausible() {
            continue;
        }
        for c in &mut cover[r.layer_start as usize..r.layer_end as usize] {
            *c += 1;
        }
    }
    cover
}

/// The range a shard placing itself takes, given each layer's `coverage`: it starts at the
/// first of the least-served layers (the first layer no shard serves, when there is one) and
/// goes on over the following layers served as little, as far as `fits(start, end)` allows:
/// so it ends where the next layers are served more (where another shard's range starts, and
/// the ranges chain into a route) or where its budget ends. `None` when not even one layer
/// fits the budget, or the model has no layers.
pub fn place(coverage: &[u32], fits: impl Fn(usize, usize) -> bool) -> Option<Range<usize>> {
    let least = *coverage.iter().min()?;
    let start = coverage.iter().position(|&c| c == least)?;
    if !fits(start, start + 1) {
        return None;
    }
    let mut end = start + 1;
    while end < coverage.len() && coverage[end] == least && fits(start, end + 1) {
        end += 1;
    }
    Some(start..end)
}

/// Up to `max` disjoint chains of `free` shards (one model's, none draining) that each cover `[0, n_layers)`
/// exactly once, found greedily; linear in the shards for each chain (positions that lead
/// nowhere are remembered). At each layer the longest range goes first, and between shards
/// of the same range the one with the least measured time per token
/// (`ShardRecord::token_step_micros`; unmeasured ones after the measured), so the first chains
/// are the fastest: fast replicas are stitched with fast ones, and the route sessions go to
/// first is the quickest there is.
pub fn chains(mut free: Vec<&ShardRecord>, max: usize) -> Vec<Vec<&ShardRecord>> {
    let speed = |r: &ShardRecord| match r.token_step_micros {
        0 => u64::MAX,
        m => m,
    };
    free.sort_by(|a, b| {
        (
            a.layer_start,
            std::cmp::Reverse(a.layer_end),
            speed(a),
            &a.address,
        )
            .cmp(&(
                b.layer_start,
                std::cmp::Reverse(b.layer_end),
                speed(b),
                &b.address,
            ))
    });
    let mut out = Vec::new();
    while out.len() < max {
        // A model of no layers has no route (and an empty chain would never end the loop).
        let Some(n) = free.first().map(|r| r.n_layers).filter(|&n| n > 0) else {
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
    out
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

/// The most shards that placed themselves [`should_move`] weighs as movers, in address order:
/// each costs a few route searches, and a registry may hold thousands of records.
pub const MOVERS_WEIGHED: usize = 32;

/// Where the shard at `me`, which placed itself, should move to, if anywhere: the range it
/// would take were it placing itself now among the others ([`place`], within its
/// `weights_budget_bytes` by `size(start, end)`, the bytes a range's weights take), when
/// taking it gives the model more than a quarter more disjoint complete routes than it has
/// (Petals moves a server when the swarm gains more than 25%; any route where there is none).
///
/// Never while another shard of the model drains or one places itself (`claims`: a move, a
/// stop or a join under way; the swarm is judged once it is over: a moving shard stays in the
/// registry, draining, until its sessions are gone, and claims its new range as it starts
/// again), never when the model's routes without this shard would be none while it has some
/// (its sessions would have nowhere to go while it moves), and one shard at a time: of the
/// shards that placed themselves (the first [`MOVERS_WEIGHED`] by address) and would gain by
/// moving, only the first moves; the others see the swarm again once it has. `records` are the
/// live records under the registry's prefix, this shard's among them.
///
/// The records are taken as they are: a registry open to writers who are not shards can make
/// a shard move for routes that do not exist (as it can make `--layers auto` place one badly).
pub fn should_move(
    records: &[ShardRecord],
    claims: &[ShardRecord],
    me: &str,
    size: impl Fn(usize, usize) -> u64,
) -> Option<Range<usize>> {
    let mine = records.iter().find(|r| r.address == me)?;
    let same = |r: &&ShardRecord| r.same_swarm(mine);
    let live: Vec<&ShardRecord> = records
        .iter()
        .filter(|r| same(r) && r.plausible())
        .collect();
    if live.iter().any(|r| r.draining) || claims.iter().any(|r| same(&r)) {
        return None;
    }
    let mut movers: Vec<&ShardRecord> = live
        .iter()
        .copied()
        .filter(|r| r.weights_budget_bytes > 0)
        .collect();
    movers.sort_by(|a, b| a.address.cmp(&b.address));
    let now = chains(live.clone(), usize::MAX).len();
    let (first, range) = movers
        .into_iter()
        .take(MOVERS_WEIGHED)
        .find_map(|r| gain(&live, now, r, &size).map(|range| (r, range)))?;
    (first.address == me).then_some(range)
}

/// The range `s` would move to, if moving it gives more than a quarter more routes than `now`
/// (the routes of `live`).
fn gain(
    live: &[&ShardRecord],
    now: usize,
    s: &ShardRecord,
    size: impl Fn(usize, usize) -> u64,
) -> Option<Range<usize>> {
    let others: Vec<&ShardRecord> = live
        .iter()
        .copied()
        .filter(|r| r.address != s.address)
        .collect();
    if now > 0 && chains(others.clone(), 1).is_empty() {
        return None;
    }
    let cover = coverage(others.iter().copied(), s);
    let to = place(&cover, |a, b| size(a, b) <= s.weights_budget_bytes)?;
    if to == (s.layer_start as usize..s.layer_end as usize) {
        return None;
    }
    let moved = ShardRecord {
        layer_start: to.start as u32,
        layer_end: to.end as u32,
        ..s.clone()
    };
    // Enough routes to tell whether there are more than a quarter more.
    let enough = now + now / 4 + 1;
    let after = chains(others.into_iter().chain([&moved]).collect(), enough).len();
    (after * 4 > now * 5).then_some(to)
}

/// The key under which a shard claims a range while it places itself and loads.
pub fn claim_key(prefix: &str, address: &str) -> String {
    format!("{prefix}placing/{address}")
}

/// A shard's claim on the range it chose, kept in etcd under a lease while it loads the range,
/// so that shards placing themselves meanwhile count it as served. Released (the lease revoked)
/// once the shard is announced; a shard that dies while loading leaves it to expire.
pub struct Claim {
    channel: Etcd,
    lease: i64,
}

impl Claim {
    /// Takes the claim out of etcd now.
    pub async fn release(self) {
        let mut lease = LeaseClient::new(self.channel.svc());
        let _ = call(lease.lease_revoke(etcd::LeaseRevokeRequest { id: self.lease })).await;
    }
}

/// The live records and the claims (with their revisions) of shards other than `me`.
async fn read_swarm(
    channel: &Etcd,
    prefix: &str,
    me: &str,
) -> Result<(Vec<ShardRecord>, Vec<(ShardRecord, i64)>), Error> {
    let key = format!("{prefix}shards/").into_bytes();
    let (shards, _, _) = snapshot(channel, prefix, &key, &prefix_end(&key)).await?;
    let shards = shards.into_values().filter(|r| r.address != me).collect();
    let key = format!("{prefix}placing/").into_bytes();
    let (entries, _) = read_range(channel, &key, &prefix_end(&key)).await?;
    let claims = entries
        .into_iter()
        .filter(|e| e.value.len() <= MAX_RECORD_BYTES)
        .filter_map(|e| {
            let r: ShardRecord = serde_json::from_slice(&e.value).ok()?;
            (r.plausible() && claim_key(prefix, &r.address).as_bytes() == e.key && r.address != me)
                .then_some((r, e.mod_revision))
        })
        .collect();
    Ok((shards, claims))
}

/// What `strata plan` reads: every live shard record under `prefix` and the claims of shards
/// placing themselves now (as records of the range each claims).
pub async fn read_live(
    connect: &Connect,
    prefix: &str,
) -> Result<(Vec<ShardRecord>, Vec<ShardRecord>), Error> {
    let channel = channel(connect)?;
    channel.login().await?;
    let (shards, claims) = read_swarm(&channel, prefix, "").await?;
    Ok((shards, claims.into_iter().map(|(r, _)| r).collect()))
}

/// Places a shard (`me`: its address, model digest and layer count, and its arithmetic as its
/// recipe, [`crate::arithmetic`]; the range is filled in)
/// among the live shards and the claims of shards placing themselves at the same time, and
/// claims the range under a lease of `ttl`. Two shards that claim overlapping ranges before
/// seeing each other's claim both see them after `settle`: the later claim (the higher etcd
/// revision) places itself again, counting the earlier one, so shards started together take
/// different layers. `Ok(None)` when not even one layer fits; else the range, the coverage it
/// was placed by, the claim, and how many live shards of the model computing otherwise
/// (another [`ShardRecord::arithmetic`]) it saw, which never chain with it.
pub async fn place_and_claim(
    connect: &Connect,
    prefix: &str,
    me: &ShardRecord,
    ttl: Duration,
    settle: Duration,
    fits: impl Fn(usize, usize) -> bool,
) -> Result<Option<(Range<usize>, Vec<u32>, Claim, usize)>, Error> {
    let channel = channel(connect)?;
    channel.login().await?;
    let mut lease = LeaseClient::new(channel.svc());
    let granted = call(lease.lease_grant(etcd::LeaseGrantRequest {
        ttl: ttl.as_secs().max(1) as i64,
        id: 0,
    }))
    .await?;
    if !granted.error.is_empty() {
        return Err(Error(format!("etcd refused a lease: {}", granted.error)));
    }
    let claim = Claim {
        channel: channel.clone(),
        lease: granted.id,
    };
    let mut kv = KvClient::new(channel.svc());
    let key = claim_key(prefix, &me.address);
    // Each round's claim is later than every claim it saw, so some claim keeps its range every
    // round; a bound on rounds only guards against a swarm that keeps changing.
    for _ in 0..16 {
        let (shards, claims) = read_swarm(&channel, prefix, &me.address).await?;
        let cover = coverage(shards.iter().chain(claims.iter().map(|(r, _)| r)), me);
        let apart = shards
            .iter()
            .filter(|r| r.digest == me.digest && !r.same_swarm(me))
            .count();
        let Some(range) = place(&cover, &fits) else {
            claim.release().await;
            return Ok(None);
        };
        let mine = ShardRecord {
            layer_start: range.start as u32,
            layer_end: range.end as u32,
            ..me.clone()
        };
        let put = call(kv.put(etcd::PutRequest {
            key: key.clone().into_bytes(),
            value: serde_json::to_vec(&mine).expect("a record serializes"),
            lease: claim.lease,
        }))
        .await?;
        let my_revision = put.header.map_or(0, |h| h.revision);
        tokio::time::sleep(settle).await;
        let (_, claims) = read_swarm(&channel, prefix, &me.address).await?;
        let overlaps = |r: &ShardRecord| {
            r.same_swarm(me)
                && (r.layer_start as usize) < range.end
                && range.start < r.layer_end as usize
        };
        match claims
            .iter()
            .find(|(r, rev)| *rev < my_revision && overlaps(r))
        {
            None => return Ok(Some((range, cover, claim, apart))),
            Some((earlier, _)) => tracing::info!(
                layers = ?range,
                earlier = %earlier.address,
                "registry: an earlier claim overlaps the range placed; placing again"
            ),
        }
    }
    claim.release().await;
    Err(Error(
        "the swarm kept changing while this shard placed itself (16 rounds)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(address: &str, layers: Range<u32>, n_layers: u32, digest: &str) -> ShardRecord {
        ShardRecord::placing(address, "1", "m", digest, layers, n_layers, "")
    }

    /// A shard of the model `digest` names about to place itself.
    fn new_of(digest: &str, n_layers: u32) -> ShardRecord {
        record("new:1", 0..n_layers, n_layers, digest)
    }

    /// Three shards that each hold 45% of a 24-layer model (10 layers) arrive one after
    /// another: the first takes 0..10, the second 10..20, the third the rest (a complete
    /// route); a fourth starts a second route at layer 0, and a fifth continues it.
    #[test]
    fn shards_fill_the_uncovered_layers_then_the_least_served() {
        let fits = |s: usize, e: usize| e - s <= 10;
        let mut records = Vec::new();
        let mut got = Vec::new();
        for i in 0..5 {
            let cover = coverage(&records, &new_of("d", 24));
            let r = place(&cover, fits).expect("a range");
            records.push(record(
                &format!("h{i}:1"),
                r.start as u32..r.end as u32,
                24,
                "d",
            ));
            got.push(r);
        }
        assert_eq!(got, [0..10, 10..20, 20..24, 0..10, 10..20]);
    }

    #[test]
    fn other_models_draining_and_impossible_records_count_for_nothing() {
        let mut draining = record("a:1", 0..4, 8, "d");
        draining.draining = true;
        let mut reversed = record("e:1", 0..1, 8, "d");
        (reversed.layer_start, reversed.layer_end) = (5, 3);
        let records = [
            record("b:1", 0..4, 8, "other"),
            record("c:1", 0..4, 9, "d"),
            draining,
            reversed,
            record("f:1", 2..6, 8, "d"),
        ];
        assert_eq!(
            coverage(&records, &new_of("d", 8)),
            [0, 0, 1, 1, 1, 1, 0, 0]
        );
        // The first uncovered layer, as far as the layers stay uncovered.
        assert_eq!(
            place(&coverage(&records, &new_of("d", 8)), |_, _| true),
            Some(0..2)
        );
    }

    /// A shard that stores K and V otherwise (or computes under another numeric contract)
    /// never chains with the others, so it places itself as if they were not there, and
    /// theirs do not count it.
    #[test]
    fn shards_of_another_arithmetic_are_another_swarm() {
        let as_ = |r: ShardRecord, kv: &str| ShardRecord {
            recipe: format!("block 16 {} ctx 4096", crate::arithmetic(kv, 1)),
            ..r
        };
        let records = [
            as_(record("a:1", 0..4, 8, "d"), "f16"),
            as_(record("b:1", 4..8, 8, "d"), "f16"),
            as_(record("c:1", 0..2, 8, "d"), "q8_0"),
        ];
        let q8 = as_(new_of("d", 8), "q8_0");
        assert_eq!(coverage(&records, &q8), [1, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(place(&coverage(&records, &q8), |_, _| true), Some(2..8));
        let f16 = as_(new_of("d", 8), "f16");
        assert_eq!(coverage(&records, &f16), [1; 8]);
        // A claim carries the arithmetic alone, and counts as the full recipe does.
        let claim = record("e:1", 2..8, 8, "d");
        let claim = ShardRecord {
            recipe: crate::arithmetic("q8_0", 1),
            ..claim
        };
        assert_eq!(coverage([&records[2], &claim], &q8), [1; 8]);
        assert_eq!(coverage([&claim], &f16), [0; 8]);
    }

    #[test]
    fn a_budget_that_holds_no_layer_places_nothing() {
        assert_eq!(place(&[0, 0, 0], |_, _| false), None);
        assert_eq!(place(&[], |_, _| true), None);
        // The budget's limit depends on where the range starts (the embedding, the head).
        let fits = |s: usize, e: usize| (e - s) + usize::from(s == 0) * 2 <= 3;
        assert_eq!(place(&[0, 0, 0, 0], fits), Some(0..1));
        assert_eq!(place(&[1, 0, 0, 0], fits), Some(1..4));
    }

    fn names(c: &[Vec<&ShardRecord>]) -> Vec<Vec<String>> {
        c.iter()
            .map(|ch| ch.iter().map(|r| r.address.clone()).collect())
            .collect()
    }

    fn rec(address: &str, a: u32, b: u32) -> ShardRecord {
        record(address, a..b, 28, "d")
    }

    #[test]
    fn replicas_cut_differently_make_two_routes() {
        let s = [
            rec("a", 0, 10),
            rec("b", 10, 28),
            rec("c", 0, 14),
            rec("d", 14, 28),
        ];
        let c = chains(s.iter().collect(), usize::MAX);
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
        assert!(chains(s.iter().collect(), usize::MAX).is_empty());
        // A dead end is left for a shard that completes the chain.
        let s = [rec("a", 0, 10), rec("c", 0, 14), rec("d", 14, 28)];
        assert_eq!(names(&chains(s.iter().collect(), usize::MAX)), [["c", "d"]]);
        // A whole-model shard is a route of one.
        let s = [rec("w", 0, 28), rec("x", 0, 5)];
        assert_eq!(names(&chains(s.iter().collect(), usize::MAX)), [["w"]]);
    }

    /// Shards of 10 layers each (a 45% budget of a 24-layer model, say) that placed
    /// themselves.
    fn placed(address: &str, a: u32, b: u32) -> ShardRecord {
        ShardRecord {
            weights_budget_bytes: 10,
            ..record(address, a..b, 24, "d")
        }
    }

    /// A layer a byte: a shard of budget 10 holds 10 layers.
    fn layers(a: usize, b: usize) -> u64 {
        (b - a) as u64
    }

    /// The last range's shard is lost: the model has no route; of the two shards on the first
    /// layers (which the other alone covers), the first by address moves to the layers no one
    /// serves, and only it.
    #[test]
    fn a_lost_range_is_taken_over_by_the_first_shard_that_can_spare_its_own() {
        let s = [placed("a", 0, 10), placed("b", 10, 20), placed("c", 0, 10)];
        assert_eq!(should_move(&s, &[], "a", layers), Some(20..24));
        assert_eq!(should_move(&s, &[], "b", layers), None);
        assert_eq!(should_move(&s, &[], "c", layers), None);
        // A shard storing K and V otherwise on the lost layers completes no route of these
        // (nor does its claim hold them back).
        let as_ = |r: &ShardRecord, kv: &str| ShardRecord {
            recipe: crate::arithmetic(kv, 1),
            ..r.clone()
        };
        let f16 = s.each_ref().map(|r| as_(r, "f16"));
        let q8 = as_(&placed("d", 20, 24), "q8_0");
        let with_q8 = [f16[0].clone(), f16[1].clone(), f16[2].clone(), q8.clone()];
        assert_eq!(should_move(&with_q8, &[], "a", layers), Some(20..24));
        assert_eq!(should_move(&f16, &[q8], "a", layers), Some(20..24));
        // An older shard's claim, naming no arithmetic, holds the move back.
        let old_claim = placed("e", 20, 24);
        assert_eq!(should_move(&f16, &[old_claim], "a", layers), None);
    }

    /// Nothing moves where moving gains no route, where the gain is a quarter or less, while a
    /// shard drains, or when the only movers' ranges were given by hand.
    #[test]
    fn no_move_without_a_gain_of_more_than_a_quarter_or_while_one_drains() {
        // One route and a spare first range: moving the spare gains nothing.
        let s = [
            placed("a", 0, 10),
            placed("b", 10, 20),
            placed("c", 20, 24),
            placed("d", 0, 10),
        ];
        for me in ["a", "b", "c", "d"] {
            assert_eq!(should_move(&s, &[], me, layers), None, "{me}");
        }
        // A route's only last shard must not leave it for a second route that cannot form.
        let s = [placed("a", 0, 12), placed("b", 12, 24)];
        assert_eq!(should_move(&s, &[], "b", layers), None);
        // While one drains, nobody moves.
        let mut d = placed("b", 10, 20);
        d.draining = true;
        let s = [placed("a", 0, 10), d, placed("c", 0, 10)];
        assert_eq!(should_move(&s, &[], "a", layers), None);
        // While a shard of the model places itself (a claim), nobody moves.
        let s = [placed("a", 0, 10), placed("b", 10, 20), placed("c", 0, 10)];
        assert_eq!(should_move(&s, &[placed("z", 20, 24)], "a", layers), None);
        // Ranges given by hand never move.
        let fixed = |a: &str, x: u32, y: u32| record(a, x..y, 24, "d");
        let s = [fixed("a", 0, 10), fixed("b", 10, 20), fixed("c", 0, 10)];
        assert_eq!(should_move(&s, &[], "a", layers), None);
        // Four routes and a fifth possible: 5 against 4 is exactly a quarter more, not over.
        let mut s = Vec::new();
        for r in 0..4 {
            s.push(placed(&format!("r{r}a"), 0, 12));
            s.push(placed(&format!("r{r}b"), 12, 24));
        }
        s.push(placed("x", 0, 12));
        s.push(placed("y", 0, 12));
        assert_eq!(chains(s.iter().collect(), usize::MAX).len(), 4);
        for r in &s {
            assert_eq!(
                should_move(&s, &[], &r.address, |a, b| (b - a) as u64 + 2),
                None,
                "{}",
                r.address
            );
        }
    }

    /// Where no route exists, a shard moves only if its move makes one.
    #[test]
    fn where_no_route_exists_a_shard_moves_only_if_that_makes_one() {
        let s = [placed("a", 0, 10), placed("b", 14, 24)];
        // a covers 0..10, b 14..24: 10..14 is served by no one and no route exists; a moving
        // cannot help (b's 14..24 needs 0..14); b moving to 10..20 cannot either; nobody can
        // complete a route of 24 layers with two shards of 10 layers.
        assert_eq!(should_move(&s, &[], "a", layers), None);
        assert_eq!(should_move(&s, &[], "b", layers), None);
        // With budgets of 14 either could close the gap; the first by address, a, grows to
        // 0..14 and the two chain; b stays.
        let s = [
            ShardRecord {
                weights_budget_bytes: 14,
                ..placed("a", 0, 10)
            },
            ShardRecord {
                weights_budget_bytes: 14,
                ..placed("b", 14, 24)
            },
        ];
        assert_eq!(should_move(&s, &[], "a", layers), Some(0..14));
        assert_eq!(should_move(&s, &[], "b", layers), None);
    }

    /// Between replicas of a range, the fastest measured goes first (unmeasured ones last,
    /// by address): the first chain stitches the fast replicas of every range.
    #[test]
    fn the_first_chain_takes_the_fastest_replica_of_each_range() {
        let timed = |address: &str, layers: Range<u32>, micros: u64| ShardRecord {
            token_step_micros: micros,
            ..record(address, layers, 24, "d")
        };
        let s = [
            timed("a-slow", 0..12, 40_000),
            timed("a-fast", 0..12, 10_000),
            timed("a-new", 0..12, 0),
            timed("b-new", 12..24, 0),
            timed("b-slow", 12..24, 30_000),
            timed("b-fast", 12..24, 12_000),
        ];
        let got: Vec<Vec<&str>> = chains(s.iter().collect(), usize::MAX)
            .iter()
            .map(|c| c.iter().map(|r| r.address.as_str()).collect())
            .collect();
        assert_eq!(
            got,
            [
                ["a-fast", "b-fast"],
                ["a-slow", "b-slow"],
                ["a-new", "b-new"]
            ]
        );
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
        assert!(chains(s.iter().collect(), usize::MAX).is_empty());
        // Records of a model of no layers (never plausible, yet given) make no route, and
        // the search ends.
        let empty = record("z", 0..0, 0, "d");
        assert!(chains(vec![&empty], usize::MAX).is_empty());
    }
}
