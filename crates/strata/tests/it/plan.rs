//! `strata plan` against a real etcd and real shards on 127.0.0.1: what it prints of an empty
//! registry, of shards that form one route and a lone replica of the first layers, and where a
//! new shard of a given budget would go (the range `--layers auto` takes, and the route it
//! completes); a registry that does not answer is an error that says so.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use testkit::etcd::Etcd;
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

const TOKEN: &str = "test-plan-token-0123456789";

fn announced(etcd: &Etcd, range: &str, extra: &[&str]) -> Proc {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    procs::announced(
        exe(),
        &m,
        range,
        &token,
        "127.0.0.1:0",
        &etcd.endpoint(),
        extra,
    )
}

/// `strata plan`'s exit status and standard output (standard error on failure).
fn plan(endpoint: &str, extra: &[&str]) -> (bool, String) {
    let m = testkit::real_model();
    let out = Command::new(exe())
        .args(["plan", "--registry", endpoint, "--model"])
        .arg(&m)
        .args(["--read-gbps", "10"])
        .args(extra)
        .output()
        .expect("strata plan runs");
    let text = if out.status.success() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    (out.status.success(), text)
}

fn line_with<'a>(text: &'a str, start: &str) -> &'a str {
    text.lines()
        .find(|l| l.trim_start().starts_with(start))
        .unwrap_or_else(|| panic!("no line starting {start:?} in:\n{text}"))
}

#[test]
fn plan_prints_the_swarm_its_routes_and_where_a_new_shard_would_go() {
    let etcd = Etcd::start();
    let ep = etcd.endpoint();
    // Nothing announced: no route, and a new shard starts at layer 0.
    let (ok, text) = plan(&ep, &["--weights-budget-mib", "4096"]);
    assert!(ok, "{text}");
    assert!(
        line_with(&text, "registry").contains(": 0 shards of this model"),
        "{text}"
    );
    assert_eq!(
        line_with(&text, "layers served"),
        "layers served (shards taking sessions per layer): 0..30 x0"
    );
    assert!(line_with(&text, "routes").ends_with(": 0"), "{text}");
    assert!(
        line_with(&text, "a new shard").contains("would take layers 0..30"),
        "{text}"
    );
    assert!(line_with(&text, "new route:").contains("(new shard) (0..30)"));

    // One route (0..15, 15..30), a replica of the first ten layers that completes nothing, and
    // a shard storing K and V as q8_0, which never chains with the others.
    let _shards: Vec<Proc> = [
        ("0..15", &[][..]),
        ("15..30", &[]),
        ("0..10", &[]),
        ("15..30", &["--kv-type", "q8_0"]),
    ]
    .iter()
    .map(|(r, extra)| announced(&etcd, r, extra))
    .collect();
    let t = Instant::now();
    while etcd.keys("/strata/shards/").len() < 4 {
        assert!(t.elapsed() < Duration::from_secs(20), "four records");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (ok, text) = plan(&ep, &["--weights-budget-mib", "4096"]);
    assert!(ok, "{text}");
    eprintln!("{text}");
    assert!(
        line_with(&text, "registry").contains(": 3 shards of this model (0 draining)"),
        "{text}"
    );
    assert!(
        line_with(&text, "registry").contains(", 1 of it of another KV type or numeric contract"),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("  shard ")).count(),
        3
    );
    assert_eq!(
        line_with(&text, "layers served"),
        "layers served (shards taking sessions per layer): 0..10 x2, 10..30 x1"
    );
    assert!(line_with(&text, "routes").ends_with(": 1"), "{text}");
    let route = line_with(&text, "route 1:");
    assert!(
        route.contains("(0..15) -> ") && route.contains("(15..30): "),
        "{route}"
    );
    // Both shards answered a ping, so the seams are measured, not unknown; neither has
    // computed a step, so compute comes from the read bandwidth.
    assert!(route.contains("ms a token (compute "), "{route}");
    assert!(route.contains("from the read bandwidth; seams"), "{route}");
    // The least-served layers start at 10: a new shard takes 10..30, and the 0..10 replica
    // then chains with it into a second route.
    let new = line_with(&text, "a new shard");
    assert!(new.contains("would take layers 10..30"), "{new}");
    assert!(new.ends_with("routes then: 2"), "{new}");
    assert!(
        line_with(&text, "new route:").contains("(0..10) -> (new shard) (10..30)"),
        "{text}"
    );
    // The q8_0 swarm: that one shard, no route, and a new q8_0 shard would complete one.
    let (ok, text) = plan(&ep, &["--weights-budget-mib", "4096", "--kv-type", "q8_0"]);
    assert!(ok, "{text}");
    assert!(
        line_with(&text, "registry")
            .contains(": 1 shards of this model (0 draining) storing K and V as q8_0"),
        "{text}"
    );
    assert_eq!(
        line_with(&text, "layers served"),
        "layers served (shards taking sessions per layer): 0..15 x0, 15..30 x1"
    );
    assert!(line_with(&text, "routes").ends_with(": 0"), "{text}");
    let new = line_with(&text, "a new shard");
    assert!(new.contains("would take layers 0..15"), "{new}");
    assert!(new.ends_with("routes then: 1"), "{new}");
    // A budget that holds no layer says so.
    let (ok, text) = plan(&ep, &["--weights-budget-mib", "0"]);
    assert!(ok, "{text}");
    assert!(line_with(&text, "a new shard").contains("holds no layer"));

    // Once the route has decoded, its shards announce their own time per token, and the
    // prediction's compute is theirs.
    let token = procs::token_file(TOKEN);
    let tracker = procs::registry_tracker(exe(), &token, &ep, &[]);
    let body = serde_json::json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0});
    let r =
        testkit::http::request("POST", &tracker.addr, "/v1/completions", Some(&body), &[]).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let t = Instant::now();
    loop {
        let (ok, text) = plan(&ep, &[]);
        assert!(ok, "{text}");
        if line_with(&text, "route 1:").contains("measured by the shards; seams") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{text}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn plan_against_a_registry_that_does_not_answer_fails_saying_so() {
    let (ok, text) = plan("http://127.0.0.1:9", &[]);
    assert!(!ok);
    assert!(text.contains("reading the registry"), "{text}");
}
