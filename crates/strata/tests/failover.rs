//! Transparent failover between two static routes of one model on one tracker: a shard of one
//! route killed (SIGKILL) or frozen (SIGSTOP) mid-generation, and every one of 16 concurrent
//! streaming sessions (greedy and seeded sampling mixed) completes with no error event and
//! exactly the tokens of a fault-free run; the migrations show in `/metrics`. New work goes to
//! the least loaded route, so both routes carry sessions.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::SseStream;
use testkit::observe::{shard_metric, shard_stat, tracker_metric as metric};
use testkit::procs::{self, Proc};

fn sessions_on(addr: &str, shard: &str) -> u64 {
    shard_stat(addr, shard, "sessions").unwrap_or(0)
}

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const N: usize = 16;

/// Two routes of SmolLM2 (two shards each, cut at different layers) on one tracker.
fn two_routes() -> (Vec<Proc>, Proc) {
    two_routes_of(
        &testkit::real_model(),
        ["0..15", "15..30", "0..12", "12..30"],
    )
}

/// Two routes of `m` on one tracker: shards 0 and 1 of `ranges` are route a, 2 and 3 route b.
fn two_routes_of(m: &Path, ranges: [&str; 4]) -> (Vec<Proc>, Proc) {
    let token = procs::token_file("test-failover-token-0123456789");
    let shards: Vec<Proc> = ranges
        .iter()
        .map(|r| procs::shard(exe(), m, r, &token, &["--threads", "1"]))
        .collect();
    let tracker = procs::tracker_routes(
        exe(),
        &[
            ("a", &[&shards[0], &shards[1]]),
            ("b", &[&shards[2], &shards[3]]),
        ],
        &token,
        &["--health-period-ms", "100", "--liveness-ms", "1000"],
    );
    (shards, tracker)
}

fn body(i: usize) -> Value {
    let mut b = json!({
        "prompt": format!("Story number {i}: once upon a time, in a land far away,"),
        "max_tokens": 40,
        "ignore_eos": true,
        "stream": true,
        "return_token_ids": true,
        "temperature": 0,
    });
    if i % 2 == 1 {
        b["temperature"] = json!(0.9);
        b["seed"] = json!(1000 + i);
    }
    b
}

/// One streamed request: its token ids and the longest wait between two of them, or the
/// error event it got.
fn stream_ids(addr: &str, i: usize) -> Result<(Vec<u64>, Duration), String> {
    let mut s = SseStream::open(addr, "/v1/completions", &body(i)).map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    let (mut last, mut longest) = (None::<Instant>, Duration::ZERO);
    while let Some(d) = s.next_data() {
        if let Some(t) = last {
            longest = longest.max(t.elapsed());
        }
        last = Some(Instant::now());
        if d == "[DONE]" {
            return Ok((ids, longest));
        }
        let v: Value = serde_json::from_str(&d).map_err(|e| format!("{e}: {d}"))?;
        if v.get("error").is_some() {
            return Err(d);
        }
        if let Some(t) = v["choices"][0]["token_ids"].as_array() {
            ids.extend(t.iter().filter_map(Value::as_u64));
        }
    }
    Err("the stream ended without [DONE]".into())
}

type Streamed = Result<(Vec<u64>, Duration), String>;

fn all_streams(addr: &str) -> Vec<std::thread::JoinHandle<Streamed>> {
    (0..N)
        .map(|i| {
            let addr = addr.to_string();
            std::thread::spawn(move || stream_ids(&addr, i))
        })
        .collect()
}

/// Runs the 16 streams, hurting `victim` once both routes hold sessions, and checks every
/// stream against `want`.
fn survive(tracker: &Proc, shards: &[Proc], victim: usize, signal: i32, want: &[Vec<u64>]) {
    let addr = &tracker.addr;
    let before = metric(addr, "strata_migrations_total");
    let started = Instant::now();
    let handles = all_streams(addr);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20)
        && !(sessions_on(addr, &shards[1].addr) > 0 && sessions_on(addr, &shards[3].addr) > 0)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    shards[victim].signal(signal);
    let mut stalls = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let (got, stall) = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i} saw an error: {e}"));
        assert_eq!(
            got, want[i],
            "stream {i} after the fault differs from the fault-free run"
        );
        stalls.push(stall);
    }
    let took = started.elapsed();
    stalls.sort();
    let moved = metric(addr, "strata_migrations_total") - before;
    eprintln!(
        "signal {signal} on shard {victim}: {moved} sessions moved; longest wait between tokens per stream: p50 {:?}, max {:?}; {} tokens in {:.2?} ({:.0} tokens/s over the run)",
        stalls[N / 2],
        stalls[N - 1],
        N * want[0].len(),
        took,
        (N * want[0].len()) as f64 / took.as_secs_f64()
    );
    assert!(moved >= 1.0, "sessions of the hurt route should have moved");
    assert!(metric(addr, "strata_migrated_tokens_total") > 0.0);
}

#[test]
fn a_killed_or_frozen_shard_costs_no_client_an_error_with_a_second_route() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Killed.
    let (shards, tracker) = two_routes();
    let started = Instant::now();
    let want: Vec<Vec<u64>> = all_streams(&tracker.addr)
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().0)
        .collect();
    let took = started.elapsed();
    eprintln!(
        "fault-free: {} tokens in {took:.2?} ({:.0} tokens/s over the run)",
        N * 40,
        (N * 40) as f64 / took.as_secs_f64()
    );
    assert!(want.iter().all(|w| w.len() == 40));
    // New sessions go to the least loaded route: each route's shards decoded 25-75% of the
    // tokens (the counters are scraped every health period).
    std::thread::sleep(Duration::from_millis(500));
    let decoded =
        |s: &Proc| shard_metric(&tracker.addr, "strata_shard_decode_tokens_total", &s.addr);
    let (a, b) = (decoded(&shards[0]), decoded(&shards[2]));
    let share = a / (a + b);
    eprintln!("route a decoded {a} tokens, route b {b}: {share:.2} on a");
    assert!(
        (0.25..=0.75).contains(&share),
        "route a carried {share:.2} of the decode tokens"
    );
    survive(&tracker, &shards, 1, 9, &want);
    drop(tracker);
    drop(shards);
    // Frozen: detected by the route's liveness (1 s), then the same.
    let (shards, tracker) = two_routes();
    survive(&tracker, &shards, 2, 19, &want);
    shards[2].signal(18);
}

/// A rolling restart under load: every shard of both routes in turn is sent SIGTERM, waited
/// for, started again on its address, and its route let open again before the next. Eight
/// clients keep sending requests all along: none sees an error, and every answer is the
/// fault-free one (sessions on a stopping shard's route move to the other route).
#[test]
fn a_rolling_restart_of_every_shard_costs_no_client_an_error() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut shards, tracker) = two_routes();
    let addr = tracker.addr.clone();
    let want: Vec<Vec<u64>> = all_streams(&addr)
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().0)
        .collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let (addr, done, want) = (addr.clone(), done.clone(), want.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                let mut i = c;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let (got, _) = stream_ids(&addr, i % N)
                        .unwrap_or_else(|e| panic!("client {c}, request {n}: {e}"));
                    assert_eq!(got, want[i % N], "client {c}, request {n}");
                    n += 1;
                    i += 8;
                }
                n
            })
        })
        .collect();
    let token = procs::token_file("test-failover-token-0123456789");
    let m = testkit::real_model();
    let ranges = ["0..15", "15..30", "0..12", "12..30"];
    let routes_up = || metric(&addr, "strata_route_up") == 2.0;
    for (k, range) in ranges.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(300));
        let listen = shards[k].addr.clone();
        shards[k].signal(15);
        let t = Instant::now();
        while !shards[k].exited() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "shard {k} did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        shards[k] = procs::shard_on(exe(), &m, range, &token, &listen, &["--threads", "1"]);
        let t = Instant::now();
        while !routes_up() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the route of shard {k} did not reopen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let served: usize = clients.into_iter().map(|c| c.join().unwrap()).sum();
    let moved = metric(&addr, "strata_migrations_total");
    eprintln!("rolling restart: {served} requests answered, none failed; {moved} sessions moved");
    assert!(served >= 8);
    assert!(moved >= 1.0, "stopping shards should have moved sessions");
}

/// A constrained session moves with its grammar: 8 JSON-schema answers of Qwen2.5-Coder-0.5B
/// (greedy and seeded sampling) on two routes, a shard of one killed mid-document; every
/// document is the one the fault-free run wrote, and complete.
#[test]
fn a_session_with_a_grammar_continues_the_same_document_on_another_route() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let qwen = testkit::named_model("qwen2.5-coder-0.5b");
    let (shards, tracker) = two_routes_of(&qwen, ["0..12", "12..24", "0..10", "10..24"]);
    let addr = tracker.addr.clone();
    let schema = json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "chapters": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 3, "maxItems": 3},
            "genre": {"enum": ["fantasy", "crime", "poetry"]}
        },
        "required": ["title", "chapters", "genre"],
        "additionalProperties": false
    });
    let run = |addr: String| {
        (0..8)
            .map(|i| {
                let (addr, schema) = (addr.clone(), schema.clone());
                std::thread::spawn(move || {
                    let mut b = json!({
                        "messages": [{"role": "user", "content": format!("Outline book number {i} as JSON.")}],
                        "max_tokens": 120, "stream": true, "temperature": 0,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "book", "schema": schema}},
                    });
                    if i % 2 == 1 {
                        b["temperature"] = json!(1.0);
                        b["seed"] = json!(i);
                    }
                    let mut s = SseStream::open(&addr, "/v1/chat/completions", &b).unwrap();
                    let mut text = String::new();
                    while let Some(d) = s.next_data() {
                        if d == "[DONE]" {
                            return text;
                        }
                        let v: Value = serde_json::from_str(&d).unwrap();
                        assert!(v.get("error").is_none(), "book {i}: {d}");
                        text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
                    }
                    panic!("book {i}: no [DONE]");
                })
            })
            .collect::<Vec<_>>()
    };
    let want: Vec<String> = run(addr.clone())
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    for w in &want {
        let v: Value = serde_json::from_str(w).unwrap_or_else(|e| panic!("{e}: {w}"));
        assert_eq!(v["chapters"].as_array().map(Vec::len), Some(3), "{w}");
    }
    let handles = run(addr.clone());
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20)
        && !(sessions_on(&addr, &shards[1].addr) > 0 && sessions_on(&addr, &shards[3].addr) > 0)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    shards[1].signal(9);
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(
            h.join().unwrap(),
            want[i],
            "book {i} after its route failed"
        );
    }
    assert!(metric(&addr, "strata_migrations_total") >= 1.0);
}
