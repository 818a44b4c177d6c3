//! Chaos: random faults under a mixed load on two replicated routes of SmolLM2 (two shards
//! each, announced in etcd) behind two trackers that build their routes from the registry, each
//! with its own usage ledger. For `STRATA_CHAOS_SECS` seconds (default 105, what CI runs, so
//! that with the swarm's start and the checks after it the test stays within 120 s; the
//! 10-minute soak is `long_random_faults_for_ten_minutes`: `STRATA_LONG=1 scripts/test.sh
//! chaos::long_ --no-capture`)
//! a fault thread picks, at random, one of:
//!
//! - a shard, and kills it (SIGKILL, then restarts it on its address), freezes it (SIGSTOP for
//!   0.5 to 4 s, the longer ones past the routes' 2 s liveness) or drains it (SIGTERM: its
//!   sessions move, it exits, it is restarted);
//! - etcd, killed and restarted after up to 3 s (membership freezes meanwhile);
//! - the second tracker, killed (SIGKILL) and restarted on its ledger after up to 1.5 s.
//!
//! It waits for both routes to be up on both trackers before the next fault, so a replica is
//! always up when one strikes. Meanwhile six clients send agent and grading requests, streamed
//! and not, alternately to the two trackers: greedy completions, seeded sampling with `n` = 2,
//! a JSON-schema chat answer, a required tool call. A killed tracker's clients lose their
//! connection (no tracker can answer for a dead process); they resend to the other tracker, as
//! a load balancer in front of two trackers does, and such resends are counted and allowed only
//! for requests the second tracker held when it was killed.
//!
//! Then: every request was answered with 200 and no error event; every output equals its
//! fault-free output (greedy and seeded alike); the first tracker's ledger holds exactly the
//! requests it answered (one row per choice, `done`, charged exactly the usage the clients
//! were told), the killed one's those plus, for the requests cut by its deaths, at most their
//! rows, each `interrupted` at its restart or `done` (settled just before the kill); the session and KV gauges are back to idle; the
//! surviving tracker's RSS grew by less than 64 MiB.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::etcd::Etcd;
use testkit::http::{get, request, SseStream};
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
/// (`procs::announced` gives each shard one kernel thread.)
const SHARD_FLAGS: [&str; 2] = ["--grammar-budget-ms", "5000"];

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

/// What went wrong with one request.
enum Failure {
    /// The connection failed or ended before the answer was complete: the tracker died.
    Cut(String),
    /// An answer that is an error (a status other than 200, an error event).
    Error(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Cut(e) => write!(f, "cut: {e}"),
            Failure::Error(e) => write!(f, "error: {e}"),
        }
    }
}

/// What a client saw of one request: its output (texts, tool calls, finish reasons, in order)
/// and the tokens its usage reported, or what went wrong.
fn send(addr: &str, path: &str, body: &Value, priority: &str) -> Result<(String, u64), Failure> {
    let auth = format!("Bearer {SECRET}");
    let headers = [
        ("authorization", auth.as_str()),
        ("x-strata-priority", priority),
    ];
    if body["stream"] == true {
        let mut s = SseStream::open_with(addr, path, body, &headers)
            .map_err(|e| Failure::Cut(e.to_string()))?;
        if s.status != 200 {
            return Err(Failure::Error(format!("status {}", s.status)));
        }
        let (mut out, mut used) = (String::new(), 0);
        while let Some(d) = s.next_data() {
            if d == "[DONE]" {
                return Ok((out, used));
            }
            let v: Value =
                serde_json::from_str(&d).map_err(|e| Failure::Error(format!("{e}: {d}")))?;
            if v.get("error").is_some() {
                return Err(Failure::Error(format!("error event: {d}")));
            }
            used += v["usage"]["total_tokens"].as_u64().unwrap_or(0);
            for c in v["choices"].as_array().into_iter().flatten() {
                out.push_str(&output_of(c));
            }
        }
        Err(Failure::Cut(format!(
            "the stream ended without [DONE] after {out:?}"
        )))
    } else {
        let r = request("POST", addr, path, Some(body), &headers)
            .map_err(|e| Failure::Cut(e.to_string()))?;
        if r.status != 200 {
            return Err(Failure::Error(format!("status {}: {}", r.status, r.body)));
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

/// Whether the tracker at `addr` has both routes up (`/health` 200 with two routes).
fn both_routes_up(addr: &str) -> bool {
    let auth = format!("Bearer {SECRET}");
    request("GET", addr, "/health", None, &[("authorization", &auth)]).is_ok_and(|r| {
        r.status == 200
            && r.json()["models"][0]["routes"]
                .as_array()
                .is_some_and(|r| r.len() == 2)
    })
}

/// A ledger's rows by status: (status, rows, charged tokens).
fn ledger_rows(path: &Path) -> Vec<(String, u64, u64)> {
    let db = rusqlite::Connection::open(path).unwrap();
    let mut q = db
        .prepare(
            "SELECT status, COUNT(*), SUM(charged_tokens) FROM requests \
             GROUP BY status ORDER BY status",
        )
        .unwrap();
    let rows = q
        .query_map([], |r| {
            let (n, charged): (i64, i64) = (r.get(1)?, r.get(2)?);
            Ok((r.get(0)?, n as u64, charged as u64))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    rows
}

/// The swarm: etcd, four announced shards, two registry trackers (each with its own ledger).
struct Swarm {
    model: PathBuf,
    token: PathBuf,
    etcd: Etcd,
    shards: Vec<Proc>,
    trackers: [Proc; 2],
    /// Where each tracker listens (the second moves when it restarts) and how many times
    /// each was started, for the clients.
    addrs: Arc<Mutex<[(String, u64); 2]>>,
    dir: PathBuf,
}

impl Swarm {
    fn shard(&self, i: usize, listen: &str) -> Proc {
        let ep = self.etcd.endpoint();
        procs::announced(
            exe(),
            &self.model,
            RANGES[i],
            &self.token,
            listen,
            &ep,
            &SHARD_FLAGS,
        )
    }

    fn tracker(etcd: &Etcd, token: &Path, dir: &Path, t: usize) -> Proc {
        let keys = dir.join("keys").display().to_string();
        let ledger = dir.join(format!("usage-{t}.sqlite")).display().to_string();
        procs::registry_tracker(
            exe(),
            token,
            &etcd.endpoint(),
            &[
                "--liveness-ms",
                "2000",
                "--api-keys",
                &keys,
                "--ledger",
                &ledger,
                // `/health` and `/metrics` open, for testkit's observers.
                "--public-metrics",
            ],
        )
    }

    fn restart_shard(&mut self, i: usize) {
        let addr = self.shards[i].addr.clone();
        self.shards[i] = self.shard(i, &addr);
    }

    /// Restarts tracker `t`; its clients are sent there once it is ready (both routes up), as
    /// a load balancer that reads `/readyz` does.
    fn restart_tracker(&mut self, t: usize) {
        self.trackers[t] = Swarm::tracker(&self.etcd, &self.token, &self.dir, t);
        let fresh = &self.trackers[t].addr;
        assert!(
            wait_until(Duration::from_secs(30), || both_routes_up(fresh)),
            "the restarted tracker built no routes"
        );
        let mut a = self.addrs.lock().unwrap();
        a[t] = (self.trackers[t].addr.clone(), a[t].1 + 1);
    }

    fn up(&self) -> bool {
        self.trackers.iter().all(|t| both_routes_up(&t.addr))
    }

    /// No session on either tracker or any shard, no more KV than `kv0`.
    fn idle(&self, kv0: &[u64]) -> bool {
        self.trackers.iter().all(|t| {
            tracker_metric(&t.addr, "strata_active_sessions") == 0.0
                && tracker_metric(&t.addr, "strata_queue_depth") == 0.0
        }) && self.shards.iter().zip(kv0).all(|(s, &kv)| {
            let via = &self.trackers[0].addr;
            shard_stat(via, &s.addr, "sessions") == Some(0)
                && shard_stat(via, &s.addr, "kv_blocks_in_use").is_some_and(|k| k <= kv)
        })
    }
}

/// One client's requests, alternately to the two trackers, until `stop`.
struct Client {
    stop: Arc<AtomicBool>,
    addrs: Arc<Mutex<[(String, u64); 2]>>,
    expected: Arc<Vec<String>>,
    kinds: Arc<Vec<(&'static str, Value, &'static str)>>,
    tally: Arc<Mutex<Tally>>,
    /// When the load began (failures say when they happened, to read beside the logs).
    started: Instant,
}

#[derive(Default)]
struct Tally {
    /// Per tracker: choices answered, tokens their usage told.
    told: [(u64, u64); 2],
    answered: u64,
    /// Requests resent after the second tracker died holding them, and their choices.
    resent: u64,
    cut_choices: u64,
    failures: Vec<String>,
}

impl Client {
    fn run(self, c: usize) {
        let mut k = c;
        while !self.stop.load(Ordering::Relaxed) {
            let (path, body, priority) = &self.kinds[k % self.kinds.len()];
            let want = &self.expected[k % self.kinds.len()];
            let n = body["n"].as_u64().unwrap_or(1);
            let mut t = k % 2;
            let result = loop {
                let (addr, generation) = self.addrs.lock().unwrap()[t].clone();
                match send(&addr, path, body, priority) {
                    // The second tracker died holding it (it was restarted since, or it does
                    // not answer now): resent to the first, which is never killed.
                    Err(cut @ Failure::Cut(_))
                        if t == 1
                            && (self.addrs.lock().unwrap()[1].1 != generation
                                || !both_routes_up(&addr)) =>
                    {
                        eprintln!("chaos: resent after the second tracker died ({cut})");
                        let mut tl = self.tally.lock().unwrap();
                        tl.resent += 1;
                        tl.cut_choices += n;
                        t = 0;
                    }
                    r => break r,
                }
            };
            let mut tl = self.tally.lock().unwrap();
            match result {
                Ok((out, used)) => {
                    if out != *want {
                        tl.failures
                            .push(format!("{path} {body}: {out:?}, fault-free {want:?}"));
                    }
                    tl.told[t].0 += n;
                    tl.told[t].1 += used;
                    tl.answered += 1;
                }
                Err(e) => tl.failures.push(format!(
                    "{path} on tracker {t} at {:.1} s: {e}",
                    self.started.elapsed().as_secs_f64()
                )),
            }
            k += 1;
        }
    }
}

#[test]
fn random_faults_under_a_mixed_load_cost_no_client_an_error() {
    chaos(105);
}

/// The soak: ten minutes of the same (`STRATA_LONG=1 scripts/test.sh long_`).
#[test]
fn long_random_faults_for_ten_minutes() {
    chaos(600);
}

/// `secs` seconds of faults under load, or `STRATA_CHAOS_SECS`.
fn chaos(secs: u64) {
    let secs: u64 = std::env::var("STRATA_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(secs);
    let seed: u64 = std::env::var("STRATA_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261203);
    let token = procs::token_file("chaos-cluster-token-0123456789");
    let dir = std::env::temp_dir().join(format!("strata-chaos-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keys"), format!("chaos {SECRET} 1000000000\n")).unwrap();
    let etcd = Etcd::start();
    let trackers = [0, 1].map(|t| Swarm::tracker(&etcd, &token, &dir, t));
    let addrs = Arc::new(Mutex::new([0, 1].map(|t| (trackers[t].addr.clone(), 1))));
    let mut swarm = Swarm {
        model: testkit::real_model(),
        token,
        etcd,
        shards: Vec::new(),
        trackers,
        addrs: Arc::clone(&addrs),
        dir: dir.clone(),
    };
    swarm.shards = (0..RANGES.len())
        .map(|i| swarm.shard(i, "127.0.0.1:0"))
        .collect();
    assert!(wait_until(Duration::from_secs(30), || swarm.up()));

    // Fault-free outputs, twice from each tracker (so both routes have served every kind).
    let kinds = kinds();
    let mut expected = Vec::new();
    let mut tally = Tally::default();
    for (path, body, priority) in &kinds {
        let mut outs = Vec::new();
        for (t, tr) in swarm.trackers.iter().enumerate() {
            for _ in 0..2 {
                let (out, used) = send(&tr.addr, path, body, priority)
                    .unwrap_or_else(|e| panic!("fault-free run: {e}"));
                outs.push(out);
                tally.told[t].0 += body["n"].as_u64().unwrap_or(1);
                tally.told[t].1 += used;
            }
        }
        assert!(
            outs.windows(2).all(|w| w[0] == w[1]),
            "{path} {body}: not reproducible without faults: {outs:#?}"
        );
        expected.push(outs.swap_remove(0));
    }
    let rss0 = rss_kib(swarm.trackers[0].pid());
    let kv0: Vec<u64> = swarm
        .shards
        .iter()
        .map(|s| shard_stat(&swarm.trackers[0].addr, &s.addr, "kv_blocks_in_use").unwrap_or(0))
        .collect();
    eprintln!(
        "chaos: {secs} s, seed {seed}; first tracker's RSS {} MiB",
        rss0 / 1024
    );

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(tally));
    let (expected, kinds) = (Arc::new(expected), Arc::new(kinds));
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let client = Client {
                stop: Arc::clone(&stop),
                addrs: Arc::clone(&addrs),
                expected: Arc::clone(&expected),
                kinds: Arc::clone(&kinds),
                tally: Arc::clone(&tally),
                started: Instant::now(),
            };
            std::thread::spawn(move || client.run(c))
        })
        .collect();

    let mut rng = Lcg(seed);
    let started = Instant::now();
    let mut faults = Vec::new();
    while started.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(200 + rng.below(1500)));
        let i = rng.below(4) as usize;
        let what = match rng.below(11) {
            0..=2 => {
                swarm.shards[i].signal(SIGKILL);
                while !swarm.shards[i].exited() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::thread::sleep(Duration::from_millis(rng.below(1500)));
                swarm.restart_shard(i);
                format!("kill {}", RANGES[i])
            }
            3..=5 => {
                // Up to twice the liveness: half the freezes fail the route over.
                let frozen = 500 + rng.below(3500);
                swarm.shards[i].signal(SIGSTOP);
                std::thread::sleep(Duration::from_millis(frozen));
                swarm.shards[i].signal(SIGCONT);
                format!("freeze {}", RANGES[i])
            }
            6..=8 => {
                swarm.shards[i].signal(SIGTERM);
                let drained = wait_until(Duration::from_secs(60), || swarm.shards[i].exited());
                assert!(drained, "shard {i} did not drain within 60 s");
                swarm.restart_shard(i);
                format!("drain {}", RANGES[i])
            }
            9 => {
                swarm.etcd.kill();
                std::thread::sleep(Duration::from_millis(rng.below(3000)));
                swarm.etcd.restart();
                "etcd restart".to_string()
            }
            _ => {
                swarm.trackers[1].signal(SIGKILL);
                while !swarm.trackers[1].exited() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::thread::sleep(Duration::from_millis(rng.below(1500)));
                swarm.restart_tracker(1);
                "tracker kill".to_string()
            }
        };
        assert!(
            wait_until(Duration::from_secs(30), || swarm.up()),
            "the routes did not come back after {what}"
        );
        faults.push(format!(
            "{what} at {:.1} s",
            started.elapsed().as_secs_f64()
        ));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let tally = std::mem::take(&mut *tally.lock().unwrap());
    eprintln!(
        "chaos: {} faults ({}), {} requests answered ({} resent after a tracker kill), {} failed",
        faults.len(),
        faults.join(", "),
        tally.answered,
        tally.resent,
        tally.failures.len()
    );
    // Why sessions were lost, as each tracker counts it (for a failure's diagnosis).
    let lost: Vec<String> = swarm
        .trackers
        .iter()
        .flat_map(|t| {
            get(&t.addr, "/metrics")
                .body
                .lines()
                .filter(|l| {
                    l.starts_with("strata_sessions_lost_total")
                        || l.starts_with("strata_failures_total")
                })
                .map(|l| format!("{}: {l}", t.addr))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        tally.failures.is_empty(),
        "client errors or changed outputs: {:#?}\nlost sessions and route failures by kind: {lost:#?}",
        tally.failures
    );
    assert!(tally.answered > 0 && !faults.is_empty());

    // Idle again: no session anywhere, no more KV than after the fault-free run.
    assert!(
        wait_until(Duration::from_secs(20), || swarm.idle(&kv0)),
        "not idle at the end"
    );

    // The ledgers: every choice a row, done, charged what the clients were told; the second
    // tracker's also at most the rows its deaths cut, interrupted at its restarts. (Read once
    // every settlement is committed: the writer thread commits them after the answers.)
    let auth = format!("Bearer {SECRET}");
    for (t, tr) in swarm.trackers.iter().enumerate() {
        let settled = wait_until(Duration::from_secs(10), || {
            request(
                "GET",
                &tr.addr,
                "/v1/usage",
                None,
                &[("authorization", &auth)],
            )
            .is_ok_and(|u| u.json()["reserved_tokens"] == 0)
        });
        assert!(settled, "tracker {t} still holds reservations");
        let rows = ledger_rows(&dir.join(format!("usage-{t}.sqlite")));
        eprintln!("chaos: ledger {t}: {rows:?}");
        let count = |status: &str| {
            let r = rows.iter().find(|r| r.0 == status);
            r.map(|r| (r.1, r.2)).unwrap_or_default()
        };
        let (done, interrupted) = (count("done"), count("interrupted"));
        let n_rows: u64 = rows.iter().map(|r| r.1).sum();
        let told = tally.told[t];
        if t == 0 {
            assert_eq!(done, told, "ledger 0: {rows:?}");
            assert_eq!(n_rows, done.0, "ledger 0: {rows:?}");
        } else {
            // A cut request's rows are `interrupted` (cut while it ran), `done` (cut after
            // the tracker settled it, before its answer reached the client) or absent (cut
            // before its row was committed); nothing else.
            assert!(
                done.0 >= told.0 && done.1 >= told.1,
                "ledger 1: {rows:?}, told {told:?}"
            );
            assert!(
                n_rows == done.0 + interrupted.0
                    && done.0 - told.0 + interrupted.0 <= tally.cut_choices,
                "ledger 1: {rows:?}, told {told:?}, {} choices cut",
                tally.cut_choices
            );
        }
    }
    let rss1 = rss_kib(swarm.trackers[0].pid());
    eprintln!(
        "chaos: first tracker's RSS {} MiB -> {} MiB",
        rss0 / 1024,
        rss1 / 1024
    );
    assert!(
        rss1 < rss0 + 64 * 1024,
        "the first tracker's RSS grew from {rss0} KiB to {rss1} KiB"
    );
}
