//! Transparent failover between two static routes of one model on one tracker: a shard of one
//! route killed (SIGKILL) or frozen (SIGSTOP) mid-generation, and every one of 16 concurrent
//! streaming sessions (greedy and seeded sampling mixed) completes with no error event and
//! exactly the tokens of a fault-free run; the migrations show in `/metrics`. New work goes to
//! the least loaded route, so both routes carry sessions.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::etcd::Etcd;
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

const TOKEN: &str = "test-failover-token-0123456789";

/// Two routes of SmolLM2 (two shards each, cut at different layers) on one tracker.
fn two_routes() -> (Vec<Proc>, Proc) {
    let m = testkit::real_model();
    two_routes_of([(&m, "0..15"), (&m, "15..30"), (&m, "0..12"), (&m, "12..30")])
}

/// Two routes on one tracker, each shard a model file and its range: shards 0 and 1 are route
/// a, 2 and 3 route b. Sessions spread by load alone (`--route-by load`): these tests kill and
/// restart shards that must hold sessions, on routes of one machine whose measured paces a
/// busy machine can set far apart.
fn two_routes_of(shards: [(&Path, &str); 4]) -> (Vec<Proc>, Proc) {
    let token = procs::token_file(TOKEN);
    let shards: Vec<Proc> = shards
        .iter()
        .map(|(m, r)| procs::shard(exe(), m, r, &token, &["--threads", "1"]))
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
            "1000",
            "--route-by",
            "load",
        ],
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

/// One streamed request: its token ids and when each event with tokens arrived, or the error
/// event it got.
fn stream_ids(addr: &str, i: usize) -> Result<(Vec<u64>, Vec<Instant>), String> {
    let mut s = SseStream::open(addr, "/v1/completions", &body(i)).map_err(|e| e.to_string())?;
    let (mut ids, mut at) = (Vec::new(), Vec::new());
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            return Ok((ids, at));
        }
        let v: Value = serde_json::from_str(&d).map_err(|e| format!("{e}: {d}"))?;
        if v.get("error").is_some() {
            return Err(d);
        }
        if let Some(t) = v["choices"][0]["token_ids"].as_array() {
            ids.extend(t.iter().filter_map(Value::as_u64));
            at.push(Instant::now());
        }
    }
    Err("the stream ended without [DONE]".into())
}

type Streamed = Result<(Vec<u64>, Vec<Instant>), String>;

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
    let fault = format!("signal {signal} on shard {victim}");
    survive_fault(
        tracker,
        shards,
        &fault,
        || shards[victim].signal(signal),
        want,
    );
}

/// As [`survive`], the fault (`what`) being `fault`.
fn survive_fault(
    tracker: &Proc,
    shards: &[Proc],
    what: &str,
    fault: impl FnOnce(),
    want: &[Vec<u64>],
) {
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
    let hurt = Instant::now();
    fault();
    // Per stream: from the fault to its next token (on a moved session, the first token on
    // its new route).
    let mut next_token = Vec::new();
    let mut arrivals = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let (got, at) = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i} saw an error: {e}"));
        assert_eq!(
            got, want[i],
            "stream {i} after the fault differs from the fault-free run"
        );
        if let Some(t) = at.iter().find(|&&t| t > hurt) {
            next_token.push(*t - hurt);
        }
        arrivals.extend(at);
    }
    let end = Instant::now();
    assert!(!next_token.is_empty(), "no stream was running at the fault");
    next_token.sort();
    let recovered = hurt + *next_token.last().unwrap_or(&Duration::ZERO);
    let rate = |from: Instant, to: Instant| {
        let n = arrivals.iter().filter(|&&t| t > from && t <= to).count();
        n as f64 / to.saturating_duration_since(from).as_secs_f64().max(1e-3)
    };
    let moved = metric(addr, "strata_migrations_total") - before;
    eprintln!(
        "{what}: {moved} sessions moved; fault to each stream's next token: p50 {:?}, p99 {:?}; token events/s: {:.0} before the fault, {:.0} until every stream had a token again, {:.0} after; {} tokens in {:.2?}",
        next_token[next_token.len() / 2],
        next_token[(next_token.len() * 99 / 100).min(next_token.len() - 1)],
        rate(started, hurt),
        rate(hurt, recovered),
        rate(recovered, end),
        N * want[0].len(),
        end - started,
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

/// A shard whose model file is rewritten in place while it serves (the same bytes written
/// again: its modification time changes) can no longer vouch for the embedding rows it reads
/// from it: its next step stops its compute thread as a panic would, and every stream completes
/// with no error and the fault-free tokens, its sessions moved to the other route.
#[test]
fn a_shard_whose_model_file_is_rewritten_stops_and_its_sessions_move() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let m = testkit::real_model();
    let bytes = std::fs::read(&m).unwrap();
    let dir = std::env::temp_dir().join(format!("strata-rewritten-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The first shard of route a, the one reading the embedding from its file, has a copy.
    let copy = dir.join("model.gguf");
    std::fs::write(&copy, &bytes).unwrap();
    let (mut shards, tracker) = two_routes_of([
        (&copy, "0..15"),
        (&m, "15..30"),
        (&m, "0..12"),
        (&m, "12..30"),
    ]);
    let want: Vec<Vec<u64>> = all_streams(&tracker.addr)
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().0)
        .collect();
    survive_fault(
        &tracker,
        &shards,
        "shard 0's model file rewritten",
        || std::fs::write(&copy, &bytes).unwrap(),
        &want,
    );
    // The shard stopped serving: its process ends, and its route is down.
    let t = Instant::now();
    while !shards[0].exited() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(shards[0].exited(), "the shard kept running");
    let health = testkit::http::request("GET", &tracker.addr, "/health", None, &[])
        .unwrap()
        .json();
    assert_eq!(
        health["models"][0]["routes"][0]["status"], "down",
        "{health}"
    );
    drop(tracker);
    drop(shards);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rolling restart under load: every shard of both routes in turn is sent SIGTERM, waited
/// for, started again on its address, and its route let open again before the next. Eight
/// clients keep sending requests all along: none sees an error, and every answer is the
/// fault-free one (sessions on a stopping shard's route move to the other route).
#[test]
fn a_rolling_restart_of_every_shard_costs_no_client_an_error() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (shards, tracker) = two_routes();
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    rolling_restart(shards, &tracker, |range, listen| {
        procs::shard_on(exe(), &m, range, &token, listen, &["--threads", "1"])
    });
}

/// Restarts every shard in turn (SIGTERM, wait for the exit, `restart` on the same address,
/// wait for both routes) under eight clients that must see no error and the fault-free
/// answers.
fn rolling_restart(mut shards: Vec<Proc>, tracker: &Proc, restart: impl Fn(&str, &str) -> Proc) {
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
                // At least one request each, however quick the restarts.
                while n == 0 || !done.load(std::sync::atomic::Ordering::Relaxed) {
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
    let ranges = ["0..15", "15..30", "0..12", "12..30"];
    let routes_up = || metric(&addr, "strata_route_up") == 2.0;
    for (k, range) in ranges.iter().enumerate() {
        // Under load: the shard holds sessions when it is told to stop.
        within(Duration::from_secs(10), "sessions on the shard", || {
            sessions_on(&addr, &shards[k].addr) > 0
        });
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
        eprintln!("shard {k} drained and exited in {:?}", t.elapsed());
        shards[k] = restart(range, &listen);
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
    // A draining shard's sessions move to the other route rather than hold it up.
    let drained = testkit::observe::tracker_metric_with(
        &addr,
        "strata_migrations_total",
        "reason=\"draining\"",
    );
    assert!(drained >= 1.0, "no session moved off a draining route");
}

/// Document `i` of the grammar test, streamed through chat completions, the Responses API or
/// the Messages API (by `i % 3`), each read as its clients read it.
fn streamed_document(addr: &str, i: usize, schema: &Value) -> String {
    let prompt = format!("Outline book number {i} as JSON.");
    let (path, mut b) = match i % 3 {
        0 => (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 120,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "book", "schema": schema}}}),
        ),
        1 => (
            "/v1/responses",
            json!({"input": prompt, "max_output_tokens": 120, "store": false,
                   "text": {"format": {"type": "json_schema", "name": "book", "schema": schema}}}),
        ),
        _ => (
            "/v1/messages",
            json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 120,
                   "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
        ),
    };
    b["stream"] = json!(true);
    b["temperature"] = json!(0);
    if i % 2 == 1 {
        b["temperature"] = json!(1.0);
        b["seed"] = json!(i);
    }
    let mut s = SseStream::open(addr, path, &b).unwrap();
    let mut text = String::new();
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            return text;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        assert!(v.get("error").is_none(), "book {i}: {d}");
        match v["type"].as_str() {
            Some("response.output_text.delta") => text.push_str(v["delta"].as_str().unwrap()),
            Some("content_block_delta") => text.push_str(v["delta"]["text"].as_str().unwrap_or("")),
            Some("response.completed" | "message_stop") => return text,
            Some("response.failed" | "response.incomplete" | "error") => panic!("book {i}: {d}"),
            _ => text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or("")),
        }
    }
    panic!("book {i}: the stream ended before the answer did");
}

/// A constrained session moves with its grammar: 9 JSON-schema answers of Qwen2.5-Coder-0.5B
/// (greedy and seeded sampling; streamed through chat completions, the Responses API and the
/// Messages API) on two routes, a shard of one killed mid-document; every document is the
/// one the fault-free run wrote, and complete.
#[test]
fn a_session_with_a_grammar_continues_the_same_document_on_another_route() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let qwen = testkit::named_model("qwen2.5-coder-0.5b");
    let (shards, tracker) = two_routes_of([
        (&qwen, "0..12"),
        (&qwen, "12..24"),
        (&qwen, "0..10"),
        (&qwen, "10..24"),
    ]);
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
        (0..9)
            .map(|i| {
                let (addr, schema) = (addr.clone(), schema.clone());
                std::thread::spawn(move || streamed_document(&addr, i, &schema))
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

// ---- on a registry --------------------------------------------------------------------

/// A shard of SmolLM2 announced in `etcd` (lease of 2 s), on `listen`.
fn announced(etcd: &Etcd, range: &str, listen: &str) -> Proc {
    announced_with(etcd, range, listen, &[])
}

fn announced_with(etcd: &Etcd, range: &str, listen: &str, extra: &[&str]) -> Proc {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    procs::announced(exe(), &m, range, &token, listen, &etcd.endpoint(), extra)
}

/// A tracker with no route of its own, building its routes from `etcd`.
fn registry_tracker(etcd: &Etcd) -> Proc {
    let token = procs::token_file(TOKEN);
    let ep = etcd.endpoint();
    procs::registry_tracker(
        exe(),
        &token,
        &ep,
        &["--liveness-ms", "1000", "--route-by", "load"],
    )
}

/// The routes in the tracker's table, by name.
fn route_names(addr: &str) -> Vec<String> {
    let h = testkit::http::get(addr, "/health").json();
    h["models"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|m| m["routes"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect()
}

/// Waits until `f` holds, at most `limit`; how long it took.
fn within(limit: Duration, what: &str, f: impl Fn() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.elapsed()
}

fn greedy_ids(addr: &str) -> (u16, Value) {
    let r = testkit::http::post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "return_token_ids": true}),
    );
    (
        r.status,
        serde_json::from_str(&r.body).unwrap_or(Value::Null),
    )
}

/// Join, replicas, balance and failover on a real etcd: a tracker with no shards refuses with
/// a typed, retryable `no_route`; two shards make it answer, two more (cut elsewhere) are a
/// second route without a restart; 16 sessions share the two routes; a shard killed
/// mid-generation costs no stream an error or a token, its route leaves the table when its
/// lease runs out and comes back when the shard restarts; with one route left, a killed shard
/// that does not come back is a typed `shard_failed` once the failover wait (3 s: a route
/// may rejoin from the registry meanwhile) is over.
#[test]
fn on_a_registry_shards_join_share_the_load_and_fail_over() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start();
    let tracker = registry_tracker(&etcd);
    let addr = tracker.addr.clone();
    let (status, body) = greedy_ids(&addr);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["reason"], "no_route", "{body}");
    assert_eq!(body["error"]["retryable"], true, "{body}");
    let mut shards = vec![
        announced(&etcd, "0..15", "127.0.0.1:0"),
        announced(&etcd, "15..30", "127.0.0.1:0"),
    ];
    let joined = within(Duration::from_secs(20), "first route", || {
        greedy_ids(&addr).0 == 200
    });
    eprintln!("two shards announced: the tracker answered {joined:?} after they were ready");
    let (_, first) = greedy_ids(&addr);
    shards.push(announced(&etcd, "0..12", "127.0.0.1:0"));
    shards.push(announced(&etcd, "12..30", "127.0.0.1:0"));
    let joined = within(Duration::from_secs(20), "replica route", || {
        route_names(&addr).len() == 2 && metric(&addr, "strata_route_up") == 2.0
    });
    eprintln!("a replica route joined the table {joined:?} after its shards were ready");
    assert_eq!(metric(&addr, "strata_registry_members"), 4.0);
    // Same answer on either route (split == unsplit, and the cut does not matter).
    let started = Instant::now();
    let want: Vec<Vec<u64>> = all_streams(&addr)
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().0)
        .collect();
    let took = started.elapsed();
    eprintln!(
        "fault-free on the registry's routes: {} tokens in {took:.2?} ({:.0} tokens/s)",
        N * 40,
        (N * 40) as f64 / took.as_secs_f64()
    );
    assert_eq!(
        greedy_ids(&addr).1["choices"][0]["token_ids"],
        first["choices"][0]["token_ids"]
    );
    std::thread::sleep(Duration::from_millis(500));
    let decoded = |s: &Proc| shard_metric(&addr, "strata_shard_decode_tokens_total", &s.addr);
    let (a, b) = (decoded(&shards[0]), decoded(&shards[2]));
    let share = a / (a + b);
    eprintln!("registry routes: route a decoded {a} tokens, route b {b}: {share:.2} on a");
    assert!((0.25..=0.75).contains(&share), "route a carried {share:.2}");
    // SIGKILL mid-generation: every stream completes with the fault-free tokens.
    survive(&tracker, &shards, 1, 9, &want);
    // The dead shard's lease runs out: its route leaves the table.
    let left = within(Duration::from_secs(10), "route left", || {
        route_names(&addr).len() == 1
    });
    eprintln!("the killed shard's route left the table {left:?} after the streams ended");
    // Restarted on its address (a new instance): the route is back.
    let listen = shards[1].addr.clone();
    shards[1] = announced(&etcd, "15..30", &listen);
    within(Duration::from_secs(20), "route back", || {
        route_names(&addr).len() == 2 && metric(&addr, "strata_route_up") == 2.0
    });
    // Frozen (SIGSTOP): the route's liveness (1 s) moves its sessions; the frozen shard's
    // lease runs out and its route leaves; thawed, it announces itself again and rejoins.
    survive(&tracker, &shards, 2, 19, &want);
    within(Duration::from_secs(10), "frozen route left", || {
        route_names(&addr).len() == 1
    });
    shards[2].signal(18);
    within(Duration::from_secs(20), "thawed route back", || {
        route_names(&addr).len() == 2 && metric(&addr, "strata_route_up") == 2.0
    });
    // One route only (the other's shard drained away), then its shard killed: the session
    // waits out the failover wait for a route to join, then the stream fails typed.
    shards[3].signal(15);
    within(Duration::from_secs(10), "drained route left", || {
        route_names(&addr).len() == 1
    });
    let mut s = SseStream::open(&addr, "/v1/completions", &json!({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": true, "temperature": 0, "stream": true})).unwrap();
    for _ in 0..3 {
        s.next_data().expect("tokens before the fault");
    }
    let t = Instant::now();
    shards[1].signal(9);
    let mut last = String::new();
    while let Some(d) = s.next_data() {
        last = d;
    }
    let failed_in = t.elapsed();
    let v: Value = serde_json::from_str(&last).unwrap_or(Value::Null);
    assert_eq!(v["error"]["reason"], "shard_failed", "{last}");
    assert!(
        failed_in < Duration::from_secs(6),
        "failed after {failed_in:?}"
    );
    eprintln!("one route, its shard killed: typed shard_failed after {failed_in:?}");
}

/// A rolling restart on a registry: SIGTERM drains each shard in turn (it leaves the registry,
/// its route's sessions move to the other route, it exits once it holds none) and it is
/// started again; eight clients see no error and the fault-free answers.
#[test]
fn on_a_registry_a_rolling_restart_drains_each_shard() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start();
    let tracker = registry_tracker(&etcd);
    let shards: Vec<Proc> = ["0..15", "15..30", "0..12", "12..30"]
        .iter()
        .map(|r| announced(&etcd, r, "127.0.0.1:0"))
        .collect();
    let addr = tracker.addr.clone();
    within(Duration::from_secs(20), "two routes", || {
        metric(&addr, "strata_route_up") == 2.0
    });
    rolling_restart(shards, &tracker, |range, listen| {
        announced(&etcd, range, listen)
    });
}

/// etcd killed: both trackers keep serving the routes they have (membership frozen); etcd
/// back: the shards' leases come back and a newly started pair joins both trackers. Two
/// trackers serve the same shards, and killing one leaves the other's streams intact.
#[test]
fn an_etcd_outage_freezes_membership_and_two_trackers_share_the_shards() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut etcd = Etcd::start();
    let mut shards = vec![
        announced(&etcd, "0..15", "127.0.0.1:0"),
        announced(&etcd, "15..30", "127.0.0.1:0"),
    ];
    let mut one = registry_tracker(&etcd);
    let two = registry_tracker(&etcd);
    for t in [&one, &two] {
        within(Duration::from_secs(20), "a route on each tracker", || {
            greedy_ids(&t.addr).0 == 200
        });
    }
    let (_, want) = greedy_ids(&one.addr);
    assert_eq!(
        greedy_ids(&two.addr).1["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    etcd.kill();
    within(Duration::from_secs(15), "watch lost", || {
        metric(&one.addr, "strata_registry_connected") == 0.0
    });
    // Past the shards' 2 s leases: nothing is torn down while etcd is away.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(4) {
        for tr in [&one, &two] {
            let (status, body) = greedy_ids(&tr.addr);
            assert_eq!(status, 200, "during the outage: {body}");
            assert_eq!(
                body["choices"][0]["token_ids"],
                want["choices"][0]["token_ids"]
            );
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    etcd.restart();
    within(Duration::from_secs(20), "watch back", || {
        metric(&one.addr, "strata_registry_connected") == 1.0
            && metric(&two.addr, "strata_registry_connected") == 1.0
    });
    shards.push(announced(&etcd, "0..12", "127.0.0.1:0"));
    shards.push(announced(&etcd, "12..30", "127.0.0.1:0"));
    for t in [&one, &two] {
        within(
            Duration::from_secs(20),
            "the new pair on both trackers",
            || route_names(&t.addr).len() == 2 && metric(&t.addr, "strata_route_up") == 2.0,
        );
    }
    // The first pair's leases came back with etcd: all four are members.
    assert_eq!(etcd.keys("/strata/shards/").len(), 4);
    assert_eq!(metric(&one.addr, "strata_registry_members"), 4.0);
    // Both trackers stream through the same shards; one is killed mid-way.
    let base: Vec<Vec<u64>> = all_streams(&two.addr)
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().0)
        .collect();
    let on_one = all_streams(&one.addr);
    let on_two = all_streams(&two.addr);
    std::thread::sleep(Duration::from_millis(300));
    one.signal(9);
    for (i, h) in on_two.into_iter().enumerate() {
        let (got, _) = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i} on the surviving tracker: {e}"));
        assert_eq!(got, base[i], "stream {i} on the surviving tracker");
    }
    for h in on_one {
        let _ = h.join();
    }
    let _ = one.exited();
}

/// Each shard enforces its own limits whoever sends the work: two trackers on one registry
/// share a shard that holds one session; while one tracker's session runs there, the other's
/// request gets the shard's refusal as the same typed, retryable `capacity` a tracker gives.
#[test]
fn two_trackers_on_one_registry_get_a_full_shards_typed_capacity_refusal() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = Etcd::start();
    let _shard = announced_with(&etcd, "0..30", "127.0.0.1:0", &["--max-sessions", "1"]);
    let (one, two) = (registry_tracker(&etcd), registry_tracker(&etcd));
    for t in [&one, &two] {
        within(Duration::from_secs(20), "a route on each tracker", || {
            greedy_ids(&t.addr).0 == 200
        });
    }
    // The shard's one session is free once the warm-up requests' sessions are released
    // there, which the trackers do not wait for: the first tracker's stream is opened until
    // it runs (a refusal ends it at once).
    let t0 = Instant::now();
    let s = loop {
        let mut s = SseStream::open(&one.addr, "/v1/completions", &json!({"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": true, "stream": true})).unwrap();
        let runs = s.status == 200
            && (0..3).all(|_| s.next_data().is_some_and(|d| !d.contains("\"error\"")));
        if runs {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the first tracker's session never ran"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let (status, body) = greedy_ids(&two.addr);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["reason"], "capacity", "{body}");
    assert_eq!(body["error"]["retryable"], true, "{body}");
    assert_eq!(body["error"]["limit"], "max_sessions", "{body}");
    eprintln!("the other tracker's refusal: {body}");
    drop(s);
}
