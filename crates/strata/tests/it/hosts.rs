//! A swarm spread over "hosts": etcd, each shard and the tracker in a network namespace of its
//! own (`testkit::net`), talking over veth links on a private bridge instead of one loopback,
//! a shard's link limited in bandwidth. Needs root (CI runs as root); elsewhere it says so and
//! stops.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::etcd::Etcd;
use testkit::net::{Host, Net};
use testkit::observe::{shard_stat, tracker_metric, wait_until};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

const TOKEN: &str = "test-hosts-token-0123456789abcdef";

/// A shard of `model` on `host` for `layers` (a range, or `auto`), announced in `etcd` under
/// a 2 s lease, with `extra` flags.
fn shard_on(host: &Host, etcd: &Etcd, model: &Path, layers: &str, extra: &[&str]) -> Proc {
    let token = procs::token_file(TOKEN);
    let mut args: Vec<String> = [
        "shard",
        "--model",
        &model.display().to_string(),
        "--layers",
        layers,
        "--listen",
        &format!("{}:0", host.ip),
        "--cluster-token-file",
        &token.display().to_string(),
        "--threads",
        "1",
        "--registry",
        &etcd.endpoint(),
        "--registry-ttl-s",
        "2",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    host.spawn(
        exe(),
        &args,
        "strata shard listening on ",
        &format!("shard {layers}"),
    )
}

/// A tracker on `host` building its routes from `etcd`, returned once it answers a completion
/// (a route is up), within 30 s.
fn tracker_on(host: &Host, etcd: &Etcd) -> Proc {
    let token = procs::token_file(TOKEN);
    let args: Vec<String> = [
        "tracker",
        "--listen",
        &format!("{}:0", host.ip),
        "--cluster-token-file",
        &token.display().to_string(),
        "--registry",
        &etcd.endpoint(),
        "--health-period-ms",
        "100",
        // Sessions spread by load alone: the shards a test kills must hold some, and the
        // paces of routes on one busy machine can be far apart.
        "--route-by",
        "load",
    ]
    .map(String::from)
    .to_vec();
    let tracker = host.spawn(exe(), &args, "strata tracker listening on ", "tracker");
    let t0 = Instant::now();
    loop {
        let r = testkit::http::post_json(
            &tracker.addr,
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 1, "temperature": 0}),
        );
        if r.status == 200 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no route over the hosts within 30 s: {} {}",
            r.status,
            r.body
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "the route over the hosts answered {:?} after the tracker started",
        t0.elapsed()
    );
    tracker
}

/// Greedy completions of a few prompts, each with its token ids.
fn answers(addr: &str) -> Vec<Value> {
    ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        .iter()
        .map(|prompt| {
            let r = testkit::http::post_json(
                addr,
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": true}),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            let v: Value = serde_json::from_str(&r.body).expect("a JSON body");
            v["choices"][0]["token_ids"].clone()
        })
        .collect()
}

/// etcd, two shards and a tracker on four hosts: the shards announce their own hosts'
/// addresses, the tracker builds the route from the registry and reaches them across the
/// bridge, and the answers equal one process's on loopback, also with one shard's link cut
/// to 20 Mbit/s.
#[test]
fn a_route_over_hosts_gives_one_processs_tokens() {
    let mut net = match Net::new() {
        Ok(net) => net,
        Err(why) => {
            eprintln!("a_route_over_hosts_gives_one_processs_tokens: not run here: {why}");
            return;
        }
    };
    let hosts: Vec<Host> = (0..4).map(|_| net.host().expect("a host")).collect();
    let etcd = Etcd::start_on(&hosts[0]);
    let model = testkit::real_model();
    let shards = [
        shard_on(&hosts[1], &etcd, &model, "0..15", &[]),
        shard_on(&hosts[2], &etcd, &model, "15..30", &[]),
    ];
    for (shard, host) in shards.iter().zip(&hosts[1..3]) {
        assert!(
            shard.addr.starts_with(&format!("{}:", host.ip)),
            "{} listens on {}, not on its host {}",
            shard.name,
            shard.addr,
            host.ip
        );
    }
    let tracker = tracker_on(&hosts[3], &etcd);
    let over_hosts = answers(&tracker.addr);
    let one = procs::serve(exe(), &model, "1", &[]);
    let want = answers(&one.addr);
    assert_eq!(over_hosts, want, "a route over hosts against one process");

    // The second shard's link at 20 Mbit/s each way: slower seams, the same tokens.
    net.limit(&hosts[2], 20).expect("a bandwidth limit");
    assert_eq!(answers(&tracker.addr), want, "with a 20 Mbit/s link");

    // Processes go before the net that holds their namespaces.
    drop((tracker, shards, etcd, one));
}

/// Three shards of Qwen2.5-Coder-0.5B on three hosts, started together with `--layers auto`
/// and a weights budget of 45% of the file each: each takes the layers least served or claimed
/// by the others, their ranges chain into a complete route with no range given by hand (a shard
/// starting at layer 0 holds no embedding, so two such shards can cover the model; the third
/// then replicates the least served layers), and a tracker on a fifth host answers exactly as
/// one process does. Then a fourth shard joins the same way: it takes the layers that complete
/// a second route, the tracker builds that route within 10 s of the shard's announcement and
/// sends sessions through it; and the first three's shard of the last layers is killed under
/// eight streams: every stream finishes with one process's tokens and no error, on the route
/// left. Last, the fourth is killed too: a shard of the first layers moves to the last ones by
/// itself (rebalancing), and a complete route is back within 20 s, answering as one process.
#[test]
fn shards_placing_themselves_form_routes_survive_a_loss_and_rebalance() {
    let mut net = match Net::new() {
        Ok(net) => net,
        Err(why) => {
            eprintln!("shards_placing_themselves_form_routes_survive_a_loss_and_rebalance: not run here: {why}");
            return;
        }
    };
    let hosts: Vec<Host> = (0..6).map(|_| net.host().expect("a host")).collect();
    let model = testkit::named_model("qwen2.5-coder-0.5b");
    let budget = ((std::fs::metadata(&model).unwrap().len() * 45 / 100) >> 20).to_string();
    let etcd = Etcd::start_on(&hosts[0]);
    // All three at once: each claims the range it chose while it loads, and the later of two
    // overlapping claims places itself again.
    let shards: Vec<Proc> = std::thread::scope(|scope| {
        let started: Vec<_> = hosts[1..4]
            .iter()
            .map(|host| {
                let (etcd, model, budget) = (&etcd, &model, &budget);
                scope.spawn(move || {
                    shard_on(host, etcd, model, "auto", &["--weights-budget-mib", budget])
                })
            })
            .collect();
        started.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut ranges: Vec<((u64, u64), u64)> = shards.iter().map(|s| range_of(&etcd, s)).collect();
    ranges.sort();
    // Some of the ranges chain from layer 0 to the last: a complete route, placed by the
    // shards; every shard took layers.
    let n_layers = ranges[0].1;
    assert!(ranges.iter().all(|((a, b), _)| a < b), "{ranges:?}");
    let mut end = 0;
    while end < n_layers {
        let Some(((_, next), _)) = ranges.iter().find(|((start, _), _)| *start == end) else {
            panic!("no range starts at layer {end}: {ranges:?}");
        };
        end = *next;
    }

    let tracker = tracker_on(&hosts[4], &etcd);
    let t = tracker.addr.clone();
    let one = procs::serve(exe(), &model, "1", &[]);
    assert_eq!(
        answers(&t),
        answers(&one.addr),
        "placed route against one process"
    );
    assert_eq!(tracker_metric(&t, "strata_route_up"), 1.0);

    // A fourth shard: the layers served least now are those only one shard serves, and taking
    // them completes a second route.
    let spawned = Instant::now();
    let fourth = shard_on(
        &hosts[5],
        &etcd,
        &model,
        "auto",
        &["--weights-budget-mib", &budget],
    );
    let announced = Instant::now();
    let ((start, end), _) = range_of(&etcd, &fourth);
    eprintln!(
        "the fourth shard took layers {start}..{end}, announced {:?} after it started",
        announced - spawned
    );
    let coverage = |(a, b): (u64, u64)| {
        ranges
            .iter()
            .filter(|((s, e), _)| *s <= a && b <= *e)
            .count()
    };
    assert_eq!(
        coverage((start, end)),
        1,
        "it took layers served once: {ranges:?}"
    );
    assert!(
        wait_until(Duration::from_secs(10), || tracker_metric(
            &t,
            "strata_route_up"
        ) == 2.0),
        "no second route within 10 s of the fourth shard's announcement"
    );
    eprintln!(
        "two routes up {:?} after the fourth shard's announcement",
        announced.elapsed()
    );
    ranges.push(((start, end), ranges[0].1));

    // Eight streams at once over both routes; the fourth shard takes sessions, then a shard of
    // the first three holding some is killed.
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Write a short story about lighthouse number {i}:"))
        .collect();
    let want = streams(&one.addr, &prompts);
    let (streamed, killed) = std::thread::scope(|scope| {
        let running = scope.spawn(|| streams(&t, &prompts));
        assert!(
            wait_until(Duration::from_secs(20), || sessions_on(&t, &fourth.addr)
                > 0),
            "the tracker sent no session through the fourth shard"
        );
        // The first three's shard of the last layers: the fourth replicates it.
        let victim = (0..shards.len())
            .find(|&k| range_of(&etcd, &shards[k]).0 .1 == n_layers)
            .expect("a shard of the first three ends at the last layer");
        assert!(
            wait_until(Duration::from_secs(20), || sessions_on(
                &t,
                &shards[victim].addr
            ) > 0),
            "no session on {}",
            shards[victim].name
        );
        shards[victim].signal(9);
        (running.join().unwrap(), victim)
    });
    eprintln!("killed {} mid-stream", shards[killed].name);
    assert_eq!(
        streamed, want,
        "every stream finished with one process's tokens"
    );
    assert!(tracker_metric(&t, "strata_migrations_total") >= 1.0);
    assert_eq!(
        answers(&t),
        answers(&one.addr),
        "the route left answers as one process"
    );

    // The fourth shard is lost too: no shard serves the last layers and the model has no
    // route. The two shards on the first layers see it; the first of them by address moves
    // (drains, leaves the registry and starts again placing itself) to the layers no one
    // serves, and a complete route is back within 20 s.
    let lost = Instant::now();
    fourth.signal(9);
    assert!(
        wait_until(Duration::from_secs(10), || tracker_metric(
            &t,
            "strata_route_up"
        ) == 0.0),
        "the route of the lost shard stayed up"
    );
    assert!(
        wait_until(
            Duration::from_secs(20).saturating_sub(lost.elapsed()),
            || { tracker_metric(&t, "strata_route_up") == 1.0 }
        ),
        "no complete route within 20 s of losing the last layers' shards"
    );
    eprintln!("a complete route again {:?} after the loss", lost.elapsed());
    let moved: Vec<String> = etcd
        .keys("/strata/shards/")
        .into_iter()
        .filter_map(|k| {
            let (value, _) = etcd.get(&k)?;
            let r: Value = serde_json::from_slice(&value).ok()?;
            (r["layer_end"].as_u64() == Some(n_layers)).then_some(k)
        })
        .collect();
    assert_eq!(
        moved.len(),
        1,
        "one shard serves the last layers: {moved:?}"
    );
    assert_eq!(
        answers(&t),
        answers(&one.addr),
        "the rebalanced route against one process"
    );
    drop((tracker, shards, fourth, etcd, one));
}

/// The layer range `shard`'s record in `etcd` announces, and the model's layer count.
fn range_of(etcd: &Etcd, shard: &Proc) -> ((u64, u64), u64) {
    // Ready means announced: its record is in etcd, with the range it chose.
    let key = format!("/strata/shards/{}", shard.addr);
    let (value, _) = etcd
        .get(&key)
        .unwrap_or_else(|| panic!("{key} not in etcd"));
    let record: Value = serde_json::from_slice(&value).unwrap();
    let range = (
        record["layer_start"].as_u64().unwrap(),
        record["layer_end"].as_u64().unwrap(),
    );
    eprintln!("{} took layers {}..{}", shard.name, range.0, range.1);
    (range, record["n_layers"].as_u64().unwrap())
}

/// Sessions the tracker at `addr` sees on the shard at `shard`.
fn sessions_on(addr: &str, shard: &str) -> u64 {
    shard_stat(addr, shard, "sessions").unwrap_or(0)
}

/// Greedy completions of 128 tokens (the end token ignored) of every prompt at once, each
/// stream's text as it came: long enough to be on their shards when one is killed.
fn streams(addr: &str, prompts: &[String]) -> Vec<String> {
    std::thread::scope(|scope| {
        let running: Vec<_> = prompts
            .iter()
            .map(|p| {
                scope.spawn(move || {
                    let body =
                        json!({"prompt": p, "max_tokens": 128, "ignore_eos": true, "temperature": 0, "stream": true});
                    let mut s = testkit::http::SseStream::open(addr, "/v1/completions", &body)
                        .unwrap_or_else(|e| panic!("{p}: {e}"));
                    let mut text = String::new();
                    while let Some(d) = s.next_data() {
                        if d == "[DONE]" {
                            return text;
                        }
                        let v: Value = serde_json::from_str(&d).unwrap();
                        assert!(v.get("error").is_none(), "{p}: {d}");
                        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
                    }
                    panic!("{p}: the stream ended before [DONE]");
                })
            })
            .collect();
        running.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
