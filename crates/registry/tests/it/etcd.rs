//! The announcer and the follower against a real etcd: join, load updates, an etcd outage
//! (membership frozen, then re-announced on the same process), withdrawal.

use std::time::{Duration, Instant};

use registry::{announce, follow, Connect, Members, ShardRecord};
use testkit::etcd::Etcd;
use tokio::sync::watch;

fn record(address: &str) -> ShardRecord {
    ShardRecord {
        address: address.into(),
        instance: "i1".into(),
        model: "tiny".into(),
        digest: "abc".into(),
        layer_start: 0,
        layer_end: 4,
        n_layers: 4,
        recipe: "16/f32".into(),
        kv_budget_bytes: 1 << 20,
        kv_free_bytes: 1 << 20,
        max_sessions: 8,
        sessions: 0,
        draining: false,
        weights_budget_bytes: 0,
        token_step_micros: 0,
    }
}

async fn until(
    rx: &mut watch::Receiver<Members>,
    within: Duration,
    what: &str,
    f: impl Fn(&Members) -> bool,
) {
    let t0 = Instant::now();
    while !f(&rx.borrow()) {
        let left = within.saturating_sub(t0.elapsed());
        assert!(
            !left.is_zero(),
            "{what}: not within {within:?}: {:?}",
            *rx.borrow()
        );
        let _ = tokio::time::timeout(left, rx.changed()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_join_update_survive_an_outage_and_leave() {
    let mut etcd = Etcd::start();
    let (rec_tx, rec_rx) = watch::channel(record("127.0.0.1:7001"));
    let a = announce(
        &Connect::plain(&etcd.endpoint()),
        "/t/",
        Duration::from_secs(2),
        rec_rx,
    )
    .unwrap();
    let mut members = follow(&Connect::plain(&etcd.endpoint()), "/t/").unwrap();
    let key = "/t/shards/127.0.0.1:7001";
    until(&mut members, Duration::from_secs(10), "join", |m| {
        m.connected && m.shards.contains_key(key)
    })
    .await;
    // Live load is re-announced.
    rec_tx.send_modify(|r| r.sessions = 3);
    until(&mut members, Duration::from_secs(5), "update", |m| {
        m.shards.get(key).is_some_and(|r| r.sessions == 3)
    })
    .await;
    // etcd goes away: the follower keeps what it saw.
    etcd.kill();
    until(&mut members, Duration::from_secs(15), "frozen", |m| {
        !m.connected
    })
    .await;
    assert!(members.borrow().shards.contains_key(key));
    // etcd comes back: the same announcer is registered again and the follower resyncs.
    etcd.restart();
    let mut registered = a.registered();
    tokio::time::timeout(Duration::from_secs(20), registered.wait_for(|r| *r))
        .await
        .expect("registered again")
        .unwrap();
    until(&mut members, Duration::from_secs(20), "resync", |m| {
        m.connected && m.shards.contains_key(key)
    })
    .await;
    // A second shard joins after the outage.
    let (_b_tx, b_rx) = watch::channel(record("127.0.0.1:7002"));
    let b = announce(
        &Connect::plain(&etcd.endpoint()),
        "/t/",
        Duration::from_secs(2),
        b_rx,
    )
    .unwrap();
    until(&mut members, Duration::from_secs(10), "second join", |m| {
        m.shards.len() == 2
    })
    .await;
    // Withdrawn: gone at once, not after the TTL.
    let t0 = Instant::now();
    a.withdraw(Duration::from_secs(2)).await;
    until(&mut members, Duration::from_secs(1), "withdrawal", |m| {
        !m.shards.contains_key(key)
    })
    .await;
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Dropped without withdrawing (a killed process): gone once its lease runs out.
    drop(b);
    assert_eq!(etcd.keys("/t/shards/").len(), 1);
    until(&mut members, Duration::from_secs(6), "lease expiry", |m| {
        m.shards.is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_while_etcd_was_up_is_granted_again() {
    let etcd = Etcd::start();
    let (_tx, rx) = watch::channel(record("127.0.0.1:7003"));
    let a = announce(
        &Connect::plain(&etcd.endpoint()),
        "/u/",
        Duration::from_secs(2),
        rx,
    )
    .unwrap();
    let mut registered = a.registered();
    tokio::time::timeout(Duration::from_secs(10), registered.wait_for(|r| *r))
        .await
        .unwrap()
        .unwrap();
    // Revoke every lease behind the announcer's back (as an operator or a compaction might).
    let addr = etcd.endpoint().trim_start_matches("http://").to_string();
    let leases = testkit::http::post_json(&addr, "/v3/lease/leases", &serde_json::json!({}));
    let v: serde_json::Value = serde_json::from_str(&leases.body).unwrap();
    for l in v["leases"].as_array().unwrap() {
        let r = testkit::http::post_json(
            &addr,
            "/v3/lease/revoke",
            &serde_json::json!({"ID": l["ID"]}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(etcd.keys("/u/shards/").is_empty());
    let t0 = Instant::now();
    while etcd.keys("/u/shards/").is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not announced again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An operator's `etcdctl del` of a live shard's key, or a put of another record under it
/// (another instance, draining, no lease), is undone by the shard itself within two TTLs: its
/// own record, bound to its own lease, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_or_overwritten_record_is_restored_under_the_shards_own_lease() {
    let etcd = Etcd::start();
    let ttl = Duration::from_secs(2);
    let (_tx, rx) = watch::channel(record("127.0.0.1:7004"));
    let a = announce(&Connect::plain(&etcd.endpoint()), "/r/", ttl, rx).unwrap();
    let mut registered = a.registered();
    tokio::time::timeout(Duration::from_secs(10), registered.wait_for(|r| *r))
        .await
        .unwrap()
        .unwrap();
    let key = "/r/shards/127.0.0.1:7004";
    let own = etcd.get(key).expect("announced");
    assert_ne!(own.1, 0, "bound to a lease");
    let restored_within = |what: &str| {
        let t0 = Instant::now();
        loop {
            if etcd.get(key).as_ref() == Some(&own) {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < 2 * ttl,
                "{what}: not restored within two TTLs: {:?}",
                etcd.get(key)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // (The shard may put it back before the next read: it answers the watch event at once,
    // and at most once per update tick, so two writers fighting over a key cannot spin.)
    etcd.delete(key);
    restored_within("deleted");
    let rogue = ShardRecord {
        instance: "someone-else".into(),
        draining: true,
        ..record("127.0.0.1:7004")
    };
    etcd.put(key, &serde_json::to_vec(&rogue).unwrap());
    restored_within("overwritten");
    // Its own updates are not mistaken for someone else's: the record stays as written.
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(etcd.get(key).as_ref(), Some(&own));
}

/// Four shards place themselves at the same instant on an empty registry, each holding at most
/// 6 of 24 layers: they all see nothing and claim 0..6 at first; the later overlapping claims
/// place themselves again counting the earlier ones, so the four ranges end up disjoint and
/// cover every layer (a complete route). A released claim is gone from etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_placing_themselves_together_claim_disjoint_ranges() {
    let etcd = Etcd::start();
    let connect = Connect::plain(&etcd.endpoint());
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let connect = connect.clone();
            let me = ShardRecord {
                layer_end: 24,
                n_layers: 24,
                ..record(&format!("10.0.0.{i}:7000"))
            };
            tokio::spawn(async move {
                registry::placement::place_and_claim(
                    &connect,
                    "/strata/",
                    &me,
                    Duration::from_secs(30),
                    Duration::from_millis(300),
                    |s, e| e - s <= 6,
                )
                .await
                .expect("etcd answers")
                .expect("6 layers fit")
            })
        })
        .collect();
    let mut placed = Vec::new();
    for t in tasks {
        placed.push(t.await.unwrap());
    }
    let mut ranges: Vec<_> = placed.iter().map(|(r, _, _, _)| r.clone()).collect();
    ranges.sort_by_key(|r| r.start);
    assert_eq!(ranges, [0..6, 6..12, 12..18, 18..24]);
    assert_eq!(etcd.keys("/strata/placing/").len(), 4);
    for (_, _, claim, _) in placed {
        claim.release().await;
    }
    assert!(etcd.keys("/strata/placing/").is_empty());
}
