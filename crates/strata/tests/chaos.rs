//! Chaos: random faults under a mixed load on two replicated routes of SmolLM2 (two shards
//! each) behind one tracker with a usage ledger. For `STRATA_CHAOS_SECS` seconds (default 120;
//! run it long with e.g. `STRATA_CHAOS_SECS=600 cargo test -p strata --test chaos -- --ignored
//! --nocapture`) a fault thread picks a shard at random and kills it (SIGKILL, then restarts
//! it on its address), freezes it (SIGSTOP for 0.5 to 4 s, the longer ones past the route's 2 s liveness), or drains
//! it (SIGTERM: its sessions move, it exits, it is restarted); it waits for both routes to be up
//! again before the next fault, so a replica is always up when one strikes. Meanwhile clients
//! send agent and grading requests, streamed and not: greedy completions, seeded sampling with
//! `n` = 2, a JSON-schema chat answer, a required tool call.
//!
//! Then: every request was answered with 200 and no error event; every output equals its
//! fault-free output (greedy and seeded alike); the ledger holds exactly the requests sent
//! (one row per choice, all `done`) and charged exactly the usage the clients were told; the
//! session and KV gauges are back to idle; the tracker's RSS grew by less than 64 MiB.
//!
//! Not yet in the suite: in 10 minutes (seed 20261203, debug build, 248 faults) 2172 requests
//! were answered with their fault-free outputs and 2 got a retryable 503 `shard_failed` ("the
//! route was silent for 2000 ms") instead of moving to the other route; a session moves at most
//! `session::MAX_MOVES` (3) times, and under faults this frequent a slow request can meet more
//! route failures than that, which is the first suspect. Until that is fixed it runs by hand:
//! `cargo test -p strata --test chaos -- --ignored --nocapture`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{request, SseStream};
use testkit::observe::{shard_stat, tracker_metric, wait_until};
use testkit::procs::{self, Proc};

const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;
const SIGCONT: i32 = 18;
const SIGSTOP: i32 = 19;
const SECRET: &str = "chaos-key-secret-0123456789";
const RANGES: [&str; 4] = ["0..15", "15..30", "0..12", "12..30"];
/// Shard flags: one kernel thread; a grammar budget far over what a token's mask takes, so
/// that six clients and four shards on two cores (a debug build in the suite) are never
/// mistaken for a runaway grammar: the test is about faults.
const SHARD_FLAGS: [&str; 4] = ["--threads", "1", "--grammar-budget-ms", "5000"];

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

/// A small deterministic generator (the faults' schedule is printed with its seed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The request kinds of the mixed load: (path, body, priority).
fn kinds() -> Vec<(&'static str, Value, &'static str)> {
    let weather = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city.", "strict": true,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": false}}}]);
    vec![
        (
            "/v1/completions",
            json!({"prompt": "The three laws of robotics are", "max_tokens": 24,
                   "temperature": 0, "ignore_eos": true}),
            "agent",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Once upon a time, in a land far away,", "max_tokens": 32,
                   "temperature": 0, "ignore_eos": true, "stream": true,
                   "stream_options": {"include_usage": true}}),
            "grading",
        ),
        (
            "/v1/completions",
            json!({"prompt": "A list of fruits:", "max_tokens": 20, "temperature": 0.8,
                   "seed": 7, "n": 2, "ignore_eos": true}),
            "grading",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Describe a cat as JSON."}],
                   "max_tokens": 48, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "cat",
                       "schema": {"type": "object", "properties": {"name": {"type": "string"},
                           "age": {"type": "integer"}}, "required": ["name", "age"],
                           "additionalProperties": false}}}}),
            "agent",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
                   "max_tokens": 40, "temperature": 0, "tools": weather,
                   "tool_choice": "required", "stream": true,
                   "stream_options": {"include_usage": true}}),
            "agent",
        ),
    ]
}

/// What a client saw of one request: its output (texts, tool calls, finish reasons, in order)
/// and the tokens its usage reported, or what went wrong.
fn send(addr: &str, path: &str, body: &Value, priority: &str) -> Result<(String, u64), String> {
    let auth = format!("Bearer {SECRET}");
    let headers = [
        ("authorization", auth.as_str()),
        ("x-strata-priority", priority),
    ];
    if body["stream"] == true {
        let mut s = SseStream::open_with(addr, path, body, &headers).map_err(|e| e.to_string())?;
        if s.status != 200 {
            return Err(format!("status {}", s.status));
        }
        let (mut out, mut used) = (String::new(), 0);
        while let Some(d) = s.next_data() {
            if d == "[DONE]" {
                return Ok((out, used));
            }
            let v: Value = serde_json::from_str(&d).map_err(|e| format!("{e}: {d}"))?;
            if v.get("error").is_some() {
                return Err(format!("error event: {d}"));
            }
            used += v["usage"]["total_tokens"].as_u64().unwrap_or(0);
            for c in v["choices"].as_array().into_iter().flatten() {
                out.push_str(&output_of(c));
            }
        }
        Err(format!("the stream ended without [DONE] after {out:?}"))
    } else {
        let r = request("POST", addr, path, Some(body), &headers).map_err(|e| e.to_string())?;
        if r.status != 200 {
            return Err(format!("status {}: {}", r.status, r.body));
        }
        let v = r.json();
        let out: String = v["choices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(output_of)
            .collect();
        Ok((out, v["usage"]["total_tokens"].as_u64().unwrap_or(0)))
    }
}

/// One choice (or chunk of one) as text: its index, text or content, tool calls, finish reason.
fn output_of(c: &Value) -> String {
    let m = if c.get("delta").is_some() {
        &c["delta"]
    } else {
        &c["message"]
    };
    let mut s = format!("[{}]", c["index"]);
    for t in [&c["text"], &m["content"]] {
        s.push_str(t.as_str().unwrap_or(""));
    }
    for t in m["tool_calls"].as_array().into_iter().flatten() {
        s.push_str(t["function"]["name"].as_str().unwrap_or(""));
        s.push_str(t["function"]["arguments"].as_str().unwrap_or(""));
    }
    if let Some(f) = c["finish_reason"].as_str() {
        s.push_str(&format!("<{f}>"));
    }
    s
}

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

fn both_routes_up(addr: &str) -> bool {
    let auth = format!("Bearer {SECRET}");
    request("GET", addr, "/health", None, &[("authorization", &auth)])
        .is_ok_and(|r| r.status == 200)
}

struct Cluster {
    model: PathBuf,
    token: PathBuf,
    shards: Vec<Proc>,
}

impl Cluster {
    fn restart(&mut self, i: usize) {
        let addr = self.shards[i].addr.clone();
        let fresh = procs::shard_on(
            exe(),
            &self.model,
            RANGES[i],
            &self.token,
            &addr,
            &SHARD_FLAGS,
        );
        self.shards[i] = fresh;
    }
}

#[test]
#[ignore = "an open finding: over 10 minutes (248 faults) 2 of 2174 requests got a retryable 503 \
            shard_failed after a freeze; run by hand (see above) until fixed"]
fn random_faults_under_a_mixed_load_cost_no_client_an_error() {
    let secs: u64 = std::env::var("STRATA_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    let seed: u64 = std::env::var("STRATA_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261203);
    let model = testkit::real_model();
    let token = procs::token_file("chaos-cluster-token-0123456789");
    let dir = std::env::temp_dir().join(format!("strata-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, format!("chaos {SECRET} 1000000000\n")).unwrap();
    let ledger = dir.join("usage.sqlite");
    let shards: Vec<Proc> = RANGES
        .iter()
        .map(|r| procs::shard(exe(), &model, r, &token, &SHARD_FLAGS))
        .collect();
    let tracker = procs::tracker_routes(
        exe(),
        &[
            ("a", &[&shards[0], &shards[1]]),
            ("b", &[&shards[2], &shards[3]]),
        ],
        &token,
        &[
            "--health-period-ms",
            "100",
            "--liveness-ms",
            "2000",
            "--api-keys",
            &keys.display().to_string(),
            "--ledger",
            &ledger.display().to_string(),
            // `/health` and `/metrics` open, for testkit's observers.
            "--public-metrics",
        ],
    );
    let addr = tracker.addr.clone();
    assert!(wait_until(Duration::from_secs(20), || both_routes_up(
        &addr
    )));

    // Fault-free outputs, twice each (so both routes have served every kind).
    let kinds = kinds();
    let mut expected = Vec::new();
    let (mut sent, mut told) = (0u64, 0u64);
    for (path, body, priority) in &kinds {
        let (out, used) = send(&addr, path, body, priority).expect("fault-free run");
        let (again, used2) = send(&addr, path, body, priority).expect("fault-free run");
        assert_eq!(out, again, "{path} {body}: not reproducible without faults");
        sent += 2 * body["n"].as_u64().unwrap_or(1);
        told += used + used2;
        expected.push(out);
    }
    let rss0 = rss_kib(tracker.pid());
    let kv0: Vec<u64> = shards
        .iter()
        .map(|s| shard_stat(&addr, &s.addr, "kv_blocks_in_use").unwrap_or(0))
        .collect();
    eprintln!(
        "chaos: {secs} s, seed {seed}; tracker RSS {} MiB",
        rss0 / 1024
    );

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let tally = Arc::new(Mutex::new((0u64, 0u64)));
    let expected = Arc::new(expected);
    let kinds = Arc::new(kinds);
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let (stop, answered, failures, tally, expected, kinds, addr) = (
                Arc::clone(&stop),
                Arc::clone(&answered),
                Arc::clone(&failures),
                Arc::clone(&tally),
                Arc::clone(&expected),
                Arc::clone(&kinds),
                addr.clone(),
            );
            std::thread::spawn(move || {
                let mut k = c;
                while !stop.load(Ordering::Relaxed) {
                    let (path, body, priority) = &kinds[k % kinds.len()];
                    match send(&addr, path, body, priority) {
                        Ok((out, used)) => {
                            if out != expected[k % kinds.len()] {
                                failures.lock().unwrap().push(format!(
                                    "{path} {body}: {out:?}, fault-free {:?}",
                                    expected[k % kinds.len()]
                                ));
                            }
                            let mut t = tally.lock().unwrap();
                            t.0 += body["n"].as_u64().unwrap_or(1);
                            t.1 += used;
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.lock().unwrap().push(format!("{path}: {e}")),
                    }
                    k += 1;
                }
            })
        })
        .collect();

    let mut cluster = Cluster {
        model: model.clone(),
        token: token.clone(),
        shards,
    };
    let mut rng = Lcg(seed);
    let started = Instant::now();
    let mut faults = Vec::new();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(200 + rng.below(1500)));
        let i = rng.below(4) as usize;
        let what = match rng.below(3) {
            0 => {
                cluster.shards[i].signal(SIGKILL);
                while !cluster.shards[i].exited() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::thread::sleep(Duration::from_millis(rng.below(1500)));
                cluster.restart(i);
                "kill"
            }
            1 => {
                // Up to twice the liveness: half the freezes fail the route over.
                let frozen = 500 + rng.below(3500);
                cluster.shards[i].signal(SIGSTOP);
                std::thread::sleep(Duration::from_millis(frozen));
                cluster.shards[i].signal(SIGCONT);
                "freeze"
            }
            _ => {
                cluster.shards[i].signal(SIGTERM);
                let drained = wait_until(Duration::from_secs(60), || cluster.shards[i].exited());
                assert!(drained, "shard {i} did not drain within 60 s");
                cluster.restart(i);
                "drain"
            }
        };
        faults.push(format!("{what} {}", RANGES[i]));
        assert!(
            wait_until(Duration::from_secs(30), || both_routes_up(&addr)),
            "the routes did not come back after {what} of shard {i}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let failures = failures.lock().unwrap().clone();
    let answered = answered.load(Ordering::Relaxed);
    eprintln!(
        "chaos: {} faults ({}), {answered} requests answered, {} failed",
        faults.len(),
        faults.join(", "),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "client errors or changed outputs: {failures:#?}"
    );
    assert!(answered > 0 && !faults.is_empty());

    // The ledger: every choice a row, all done, charged what the clients were told.
    let (rows, used) = *tally.lock().unwrap();
    let auth = format!("Bearer {SECRET}");
    let u = request("GET", &addr, "/v1/usage", None, &[("authorization", &auth)])
        .unwrap()
        .json();
    assert_eq!(u["requests"], json!({"done": sent + rows}), "{u}");
    assert_eq!(u["charged_tokens"], json!(told + used), "{u}");
    assert_eq!(u["reserved_tokens"], 0, "{u}");

    // Idle again: no session anywhere, no more KV than after the fault-free run.
    let idle = wait_until(Duration::from_secs(20), || {
        tracker_metric(&addr, "strata_active_sessions") == 0.0
            && tracker_metric(&addr, "strata_queue_depth") == 0.0
            && cluster.shards.iter().zip(&kv0).all(|(s, &kv)| {
                shard_stat(&addr, &s.addr, "sessions") == Some(0)
                    && shard_stat(&addr, &s.addr, "kv_blocks_in_use").is_some_and(|k| k <= kv)
            })
    });
    let gauges: Vec<String> = request("GET", &addr, "/metrics", None, &[("authorization", &auth)])
        .unwrap()
        .body
        .lines()
        .filter(|l| l.starts_with("strata_active_sessions") || l.starts_with("strata_queue_depth"))
        .map(str::to_string)
        .collect();
    assert!(idle, "not idle: {gauges:#?}");
    let rss1 = rss_kib(tracker.pid());
    eprintln!(
        "chaos: tracker RSS {} MiB -> {} MiB",
        rss0 / 1024,
        rss1 / 1024
    );
    assert!(
        rss1 < rss0 + 64 * 1024,
        "tracker RSS grew from {rss0} KiB to {rss1} KiB"
    );
}
