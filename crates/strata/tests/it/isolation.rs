//! Isolation between clients of the same shards, with real processes on 127.0.0.1: two
//! trackers on the same two shards, and one tracker whose two routes share a shard, each
//! number their sessions from 1; every answer must still be its own prompt's answer alone.
//!
//! `STRATA_ISOLATION_ROUNDS` (default 2) sets how many concurrent rounds each test runs.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use testkit::http::{get, post_json};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

fn rounds() -> usize {
    std::env::var("STRATA_ISOLATION_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const PROMPTS: [&str; 8] = [
    "Once upon a time there was a dragon who",
    "The recipe for bread starts with",
    "In 1969 the first people on the moon",
    "My favourite programming language is",
    "The capital of France is",
    "Water boils at a temperature of",
    "A good way to learn the piano is",
    "The quick brown fox jumps over",
];

/// Greedy text of one prompt through a tracker.
fn answer(addr: &str, prompt: &str) -> String {
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Every (tracker, prompt) pair at once, each on its own thread; the answers in that order.
fn all_at_once(jobs: &[(String, &'static str)]) -> Vec<String> {
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(addr, p)| s.spawn(move || answer(addr, p)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn shards(ranges: &[&str]) -> (PathBuf, Vec<Proc>) {
    let token = procs::token_file("isolation-cluster-token-0123456789");
    let m = testkit::real_model();
    let shards = ranges
        .iter()
        .map(|r| procs::shard(exe(), &m, r, &token, &["--threads", "1"]))
        .collect();
    (token, shards)
}

#[test]
fn two_trackers_on_the_same_shards_each_get_their_own_prompts_answers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (token, shards) = shards(&["0..15", "15..30"]);
    let refs: Vec<&Proc> = shards.iter().collect();
    // Each prompt alone, one request at a time, through a tracker of its own.
    let alone = alone_answers(&refs, &token);
    let t1 = procs::tracker(exe(), &refs, &token, &[]);
    let t2 = procs::tracker(exe(), &refs, &token, &[]);
    // Tracker 1 takes the prompts in order and tracker 2 in reverse, all at once: both number
    // their sessions 1, 2, ... on the same shards.
    let mut jobs = Vec::new();
    for (i, p) in PROMPTS.iter().enumerate() {
        jobs.push((t1.addr.clone(), *p));
        jobs.push((t2.addr.clone(), PROMPTS[PROMPTS.len() - 1 - i]));
    }
    for round in 0..rounds() {
        let got = all_at_once(&jobs);
        for ((_, p), text) in jobs.iter().zip(&got) {
            let want = &alone[PROMPTS.iter().position(|q| q == p).unwrap()];
            assert_eq!(text, want, "round {round}: prompt {p:?}");
        }
    }
}

/// Each prompt's answer alone, through a tracker started for that and stopped after, so the
/// trackers under test number their sessions from 1 alike.
fn alone_answers(shards: &[&Proc], token: &std::path::Path) -> Vec<String> {
    let t = procs::tracker(exe(), shards, token, &[]);
    PROMPTS.iter().map(|p| answer(&t.addr, p)).collect()
}

/// The value of a tracker's counter for one route.
fn route_counter(addr: &str, name: &str, route: &str) -> f64 {
    let text = get(addr, "/metrics").body;
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("route=\"{route}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn two_routes_of_one_tracker_that_share_a_shard_keep_their_sessions_apart() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (token, shards) = shards(&["0..15", "0..15", "15..30"]);
    let (a, a2, b) = (&shards[0].addr, &shards[1].addr, &shards[2].addr);
    let alone = alone_answers(&[&shards[0], &shards[2]], &token);
    // Room for four sessions per route and no queue: the tracker spills onto the second
    // route, so both routes' streams hold sessions on the shared last shard at once.
    let t = procs::spawn(
        exe(),
        &[
            "tracker".into(),
            "--route".into(),
            format!("r1={a},{b}"),
            "--route".into(),
            format!("r2={a2},{b}"),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--cluster-token-file".into(),
            token.display().to_string(),
            "--max-active".into(),
            "4".into(),
            "--agent-queue".into(),
            "0".into(),
            "--key-share".into(),
            "1".into(),
        ],
        "strata tracker listening on ",
        "tracker",
    );
    let jobs: Vec<(String, &str)> = PROMPTS.iter().map(|p| (t.addr.clone(), *p)).collect();
    for round in 0..rounds() {
        let got = all_at_once(&jobs);
        assert_eq!(got, alone, "round {round}");
    }
    for route in ["r1", "r2"] {
        let n = route_counter(&t.addr, "strata_prefill_tokens_total", route);
        assert!(n > 0.0, "route {route} served nothing: {n}");
    }
    let h: Value = get(&t.addr, "/health").json();
    assert_eq!(h["status"], "ok", "{h}");
}
