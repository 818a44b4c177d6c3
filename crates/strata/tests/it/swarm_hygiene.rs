//! What a swarm leaves behind (issue 27), with real shards, trackers and etcd on 127.0.0.1:
//! routes retired by restarts and rogue registry writes leave no metric series and no frozen
//! gauges behind (`/metrics` holds about what a fresh tracker shows for the same live routes,
//! and no session is counted active when none is); a deleted or overwritten shard key comes
//! back on its own and so does the route; thousands of fake records cost a bounded number of
//! joins, counted by reason, while a real route still joins among them.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::etcd::Etcd;
use testkit::observe::{tracker_metric as metric, tracker_metric_with};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const TOKEN: &str = "test-hygiene-token-0123456789";
const PREFIX: &str = "/strata/";

fn announced(etcd: &Etcd, range: &str, listen: &str) -> Proc {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    procs::announced(exe(), &m, range, &token, listen, &etcd.endpoint(), &[])
}

fn registry_tracker(etcd: &Etcd) -> Proc {
    let token = procs::token_file(TOKEN);
    procs::registry_tracker(exe(), &token, &etcd.endpoint(), &[])
}

fn within(limit: Duration, what: &str, f: impl Fn() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

fn answers(addr: &str) -> bool {
    let r = testkit::http::post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    );
    r.status == 200
}

/// Sample lines in `/metrics` (one per series and bucket).
fn n_series(addr: &str) -> usize {
    testkit::http::get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .count()
}

fn route_up(addr: &str) -> bool {
    metric(addr, "strata_route_up") == 1.0 && answers(addr)
}

fn key_of(shard: &Proc) -> String {
    format!("{PREFIX}shards/{}", shard.addr)
}

/// Whether the record `v` is `own`'s, its measured figures aside (free KV and sessions move
/// with every request, the time per token with every step's pace, and a record restored after
/// a request may carry new ones).
fn same_record(v: &[u8], own: &[u8]) -> bool {
    let member = |b: &[u8]| {
        let mut r: Value = serde_json::from_slice(b).unwrap_or(Value::Null);
        if let Some(o) = r.as_object_mut() {
            o.remove("kv_free_bytes");
            o.remove("sessions");
            o.remove("token_step_micros");
        }
        r
    };
    let (v, own) = (member(v), member(own));
    !own.is_null() && v == own
}

#[test]
fn retired_routes_leave_no_series_and_rewritten_keys_come_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start();
    let tracker = registry_tracker(&etcd);
    let addr = tracker.addr.clone();
    let mut shards = [
        announced(&etcd, "0..15", "127.0.0.1:0"),
        announced(&etcd, "15..30", "127.0.0.1:0"),
    ];
    within(Duration::from_secs(30), "first route", || route_up(&addr));
    // Restarts: each is a new instance on the same address, so a new route.
    for i in 0..4 {
        let listen = shards[1].addr.clone();
        shards[1].signal(9);
        let _ = shards[1].child.wait();
        shards[1] = announced(&etcd, "15..30", &listen);
        within(
            Duration::from_secs(30),
            &format!("route back after restart {i}"),
            || route_up(&addr),
        );
    }
    // Rogue writes under a live shard's key (another instance, draining, no lease): the route
    // retires, the shard restores its own record within two TTLs, the route comes back.
    let key = key_of(&shards[0]);
    let own = etcd.get(&key).expect("announced").0;
    let mut rogue: Value = serde_json::from_slice(&own).unwrap();
    for i in 0..3 {
        rogue["instance"] = json!(format!("rogue-{i}"));
        rogue["draining"] = json!(i % 2 == 0);
        etcd.put(&key, rogue.to_string().as_bytes());
        let back = within(Duration::from_secs(4), "own record restored", || {
            etcd.get(&key)
                .is_some_and(|(v, lease)| same_record(&v, &own) && lease != 0)
        });
        eprintln!("rogue write {i}: the shard's own record was back after {back:?}");
        within(
            Duration::from_secs(30),
            "route back after a rogue write",
            || route_up(&addr),
        );
    }
    // Deleted: the same.
    etcd.delete(&key);
    within(Duration::from_secs(4), "deleted record restored", || {
        etcd.get(&key).is_some_and(|(v, _)| same_record(&v, &own))
    });
    within(Duration::from_secs(30), "route back after a delete", || {
        route_up(&addr)
    });
    // Idle: no session is active anywhere, and retired routes' series are gone. A fresh
    // tracker on the same live route, after the same one request, is the yardstick.
    within(Duration::from_secs(10), "idle gauges", || {
        metric(&addr, "strata_active_sessions") == 0.0 && metric(&addr, "strata_queue_depth") == 0.0
    });
    let fresh = registry_tracker(&etcd);
    within(Duration::from_secs(30), "fresh tracker's route", || {
        route_up(&fresh.addr)
    });
    // Let both scrape their shards at least once more.
    std::thread::sleep(Duration::from_millis(500));
    let (old, new) = (n_series(&addr), n_series(&fresh.addr));
    eprintln!("series after 7 route retirements: {old}; fresh tracker: {new}");
    assert!(
        old as f64 <= new as f64 * 1.1,
        "{old} series against a fresh tracker's {new}"
    );
    assert!(metric(&addr, "strata_route_up") == 1.0);
}

#[test]
fn fake_records_cost_bounded_joins_and_a_real_route_still_joins() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start();
    let whole = announced(&etcd, "0..30", "127.0.0.1:0");
    within(Duration::from_secs(10), "announced", || {
        etcd.get(&key_of(&whole)).is_some()
    });
    let real: Value = serde_json::from_slice(&etcd.get(&key_of(&whole)).unwrap().0).unwrap();
    // 2000 records with the right digest and the whole model, at addresses nobody serves.
    let n_fakes = 2000;
    for i in 0..n_fakes {
        let address = format!("127.0.{}.{}:9", 1 + i / 250, 1 + i % 250);
        let mut fake = real.clone();
        fake["address"] = json!(address);
        fake["instance"] = json!(format!("fake-{i}"));
        etcd.put(
            &format!("{PREFIX}shards/{address}"),
            fake.to_string().as_bytes(),
        );
    }
    // And entries that are not records at all.
    etcd.put(&format!("{PREFIX}shards/junk"), b"{not json");
    let tracker = registry_tracker(&etcd);
    let addr = tracker.addr.clone();
    within(
        Duration::from_secs(60),
        "the real route among the fakes",
        || route_up(&addr),
    );
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(12));
    let failed = tracker_metric_with(&addr, "strata_registry_rejected_total", "join_failed");
    let malformed = tracker_metric_with(&addr, "strata_registry_rejected_total", "malformed");
    let took = t0.elapsed().as_secs_f64() + 5.0;
    eprintln!(
        "{failed} failed joins of fakes in about {took:.0} s; {malformed} malformed entries read"
    );
    assert!(failed >= 1.0, "failed joins are counted");
    assert!(malformed >= 1.0, "rejected entries are counted");
    // Each fake fails at its first refused connection and then backs off (3 s, 6 s, 12 s,
    // ...): in about 17 s each is tried at most four times, however many there are (before,
    // every fake was retried every 3 s after a 10 s wait, forever).
    assert!(
        failed <= 4.0 * n_fakes as f64,
        "{failed} failed joins in {took:.0} s"
    );
    // The tracker still serves, and a second real route joins among the fakes.
    assert!(answers(&addr));
    let _second = announced(&etcd, "0..30", "127.0.0.1:0");
    within(Duration::from_secs(30), "a second real route", || {
        metric(&addr, "strata_route_up") == 2.0
    });
}
