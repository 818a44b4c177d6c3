//! An agent's conversation stays warm over replica routes (issue 46): each turn goes to the
//! route whose shards hold the last turn's prompt in their prefix cache, so it computes only
//! what is new; conversations still spread over the routes, a route's loss costs one cold
//! turn, and a key is routed by its own blocks only. New sessions go to a fast route before one
//! measured more than three times as slow, while the fast one has room (issue 32).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use testkit::http::request;
use testkit::observe::tracker_metric_with;
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

fn model() -> PathBuf {
    testkit::real_model()
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `n` whole-model shards, one route each (`r0`, `r1`, ...), one tracker over them with
/// API keys alice and bob.
struct Replicas {
    shards: Vec<Proc>,
    tracker: Proc,
    _keys: procs::ApiKeys,
}

fn replicas(n: usize, extra: &[&str]) -> Replicas {
    let keys = procs::ApiKeys::new(
        &format!("warm-{n}"),
        &[("alice", "sk-alice-0123"), ("bob", "sk-bob-4567")],
    );
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    let shards: Vec<Proc> = (0..n)
        .map(|_| procs::shard(exe(), &m, "0..30", &token, &["--threads", "1"]))
        .collect();
    let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    let routes: Vec<(&str, Vec<&Proc>)> = names
        .iter()
        .zip(&shards)
        .map(|(name, s)| (name.as_str(), vec![s]))
        .collect();
    let routes: Vec<(&str, &[&Proc])> = routes.iter().map(|(n, s)| (*n, s.as_slice())).collect();
    let mut flags = vec!["--health-period-ms", "100", "--public-metrics"];
    flags.extend(keys.flags());
    flags.extend_from_slice(extra);
    let tracker = procs::tracker_routes(exe(), &routes, &token, &flags);
    Replicas {
        shards,
        tracker,
        _keys: keys,
    }
}

/// One conversation: a system prompt of about 150 tokens, then turns of a user message and
/// the model's greedy answer.
struct Conversation {
    secret: &'static str,
    messages: Vec<Value>,
    /// The last turn's prompt tokens.
    last_prompt: u64,
}

/// One turn's prompt tokens and those usage says came from the cache.
struct Turn {
    prompt: u64,
    cached: u64,
}

impl Conversation {
    fn new(secret: &'static str, topic: usize) -> Conversation {
        let system = format!(
            "You are the assistant of project {topic}. {}",
            "Answer briefly and precisely, quoting the files you read and the commands you ran. "
                .repeat(8)
        );
        Conversation {
            secret,
            messages: vec![json!({"role": "system", "content": system})],
            last_prompt: 0,
        }
    }

    fn turn(&mut self, addr: &str, i: usize) -> Turn {
        self.messages.push(json!({"role": "user", "content": format!("Step {i}: list what is left to do and why.")}));
        let body = json!({"messages": self.messages, "max_tokens": 8, "temperature": 0});
        let auth = format!("Bearer {}", self.secret);
        let r = request(
            "POST",
            addr,
            "/v1/chat/completions",
            Some(&body),
            &[("authorization", &auth)],
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        self.messages
            .push(json!({"role": "assistant", "content": v["choices"][0]["message"]["content"]}));
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        self.last_prompt = prompt;
        Turn { prompt, cached }
    }

    /// Runs turn `i` and checks that it started on every full block of the last turn's
    /// prompt (which its own prompt begins with).
    fn warm_turn(&mut self, addr: &str, i: usize) -> Turn {
        let shared = self.last_prompt / 16 * 16;
        let t = self.turn(addr, i);
        // The routes as the tracker saw them then (up, load, pace), to tell why a turn went cold.
        let routes = || testkit::http::get(addr, "/health").json()["models"].to_string();
        assert!(
            t.cached >= shared,
            "turn {i} ({} prompt tokens) took {} from the cache; the last turn's prompt had {shared} in full blocks; routes: {}",
            t.prompt,
            t.cached,
            routes()
        );
        t
    }
}

/// Finished sessions of route `route` (every prompt here holds whole blocks).
fn sessions_of(addr: &str, route: &str) -> f64 {
    tracker_metric_with(
        addr,
        "strata_prefix_lookups_total",
        &format!("route=\"{route}\""),
    )
}

/// Three replica routes, one conversation of six turns: every turn after the first starts on
/// the cached blocks of the last one's prompt (by load alone the second turn would go to a
/// route that never saw it). A key is routed by its own blocks only: bob sending alice's first
/// prompt finds nothing cached, wherever he goes.
#[test]
fn a_conversation_s_turns_follow_its_cached_prefix_over_three_replicas() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let r = replicas(3, &[]);
    let t = &r.tracker.addr;
    let mut alice = Conversation::new("sk-alice-0123", 1);
    let first = alice.turn(t, 0);
    assert_eq!(first.cached, 0);
    let mut bob = Conversation::new("sk-bob-4567", 1);
    for i in 1..6 {
        alice.warm_turn(t, i);
    }
    let bobs = bob.turn(t, 0);
    assert_eq!(
        bobs.cached, 0,
        "bob's identical first prompt reused none of alice's"
    );
    let per_route: Vec<f64> = (0..3).map(|i| sessions_of(t, &format!("r{i}"))).collect();
    eprintln!("sessions per route {per_route:?}");
    assert_eq!(
        per_route.iter().filter(|&&n| n >= 6.0).count(),
        1,
        "alice's six turns on one route: {per_route:?}"
    );
}

/// Eight conversations at once over two routes spread over both (neither takes over 60% of
/// the sessions) and every turn after the first starts on the last one's blocks. Then the
/// route of one conversation is killed: its next turn goes to the other route, cold, and the
/// turns after it are warm there.
#[test]
fn eight_conversations_spread_over_two_routes_and_a_lost_route_costs_one_cold_turn() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let r = replicas(2, &[]);
    let t = r.tracker.addr.clone();
    let conversations: Vec<Conversation> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|c| {
                let t = t.clone();
                s.spawn(move || {
                    let mut conv = Conversation::new("sk-alice-0123", c);
                    conv.turn(&t, 0);
                    for i in 1..4 {
                        conv.warm_turn(&t, i);
                    }
                    conv
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let per_route: Vec<f64> = (0..2).map(|i| sessions_of(&t, &format!("r{i}"))).collect();
    eprintln!("sessions per route {per_route:?}");
    let total: f64 = per_route.iter().sum();
    assert_eq!(total, 32.0, "8 conversations of 4 turns");
    for n in &per_route {
        assert!(
            (0.4..=0.6).contains(&(n / total)),
            "sessions per route {per_route:?}"
        );
    }
    // The route conversation 0 is on loses its shard.
    let mut conv = conversations.into_iter().next().unwrap();
    let before: Vec<f64> = (0..2).map(|i| sessions_of(&t, &format!("r{i}"))).collect();
    let probe = conv.warm_turn(&t, 4);
    let after: Vec<f64> = (0..2).map(|i| sessions_of(&t, &format!("r{i}"))).collect();
    let home = (0..2).find(|&i| after[i] > before[i]).unwrap();
    assert!(probe.cached > 0);
    // Whether or not the tracker has seen the route go down when the next turn comes, the
    // turn ends on the other route (offered there, or moved there when the dead route fails).
    r.shards[home].signal(9);
    let cold = conv.turn(&t, 5);
    // At most the leading tokens of the first block come from the cache there: those the key's
    // other conversations share (the chat template and the system prompt before its topic).
    assert!(
        cold.cached < 16,
        "the other route never saw this conversation, yet it took {} tokens from its cache",
        cold.cached
    );
    for i in 6..8 {
        conv.warm_turn(&t, i);
    }
}

/// A completion's token ids through `addr`.
fn completion_ids(addr: &str, prompt: &str) -> Vec<u64> {
    let body =
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": true});
    let r = request("POST", addr, "/v1/completions", Some(&body), &[]).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Speed-aware choice (issue 32): two replica routes of one thread each, the slow one reached
/// through a link that delays every message 20 ms each way (`testkit::delay`). Of ten requests
/// one after another, at most two go to the slow route (an unmeasured route counts as fast, so
/// the first ones measure both), and every answer is the same; while the fast route is full
/// (one session at most), a request at the same time goes to the slow one instead of waiting.
#[test]
fn new_sessions_go_to_the_fast_route_while_it_has_room() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let token = procs::token_file("test-cluster-token-0123456789");
    let m = model();
    let fast = procs::shard(
        exe(),
        &m,
        "0..30",
        &token,
        &["--threads", "1", "--max-sessions", "1"],
    );
    let slow = procs::shard(exe(), &m, "0..30", &token, &["--threads", "1"]);
    let link = testkit::delay::DelayProxy::start(&slow.addr, std::time::Duration::from_millis(20));
    let args: Vec<String> = [
        "tracker",
        "--listen",
        "127.0.0.1:0",
        "--cluster-token-file",
        token.to_str().unwrap(),
        "--route",
        &format!("fast={}", fast.addr),
        "--route",
        &format!("slow={}", link.addr),
        "--health-period-ms",
        "100",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let tracker = procs::spawn(exe(), &args, "strata tracker listening on ", "tracker");
    let t = tracker.addr.clone();
    let sessions = |route: &str| {
        tracker_metric_with(
            &t,
            "strata_ttft_seconds_count",
            &format!("route=\"{route}\""),
        )
    };
    let pace = |route: &str| {
        tracker_metric_with(
            &t,
            "strata_route_token_interval_seconds",
            &format!("route=\"{route}\""),
        )
    };
    let prompt = "The quick brown fox jumps over the lazy dog. Write the next sentence:";
    let want = completion_ids(&t, prompt);
    for _ in 0..9 {
        assert_eq!(completion_ids(&t, prompt), want);
    }
    let (on_fast, on_slow) = (sessions("fast"), sessions("slow"));
    eprintln!(
        "sessions: fast {on_fast}, slow {on_slow}; pace: fast {} s, slow {} s",
        pace("fast"),
        pace("slow")
    );
    assert_eq!(on_fast + on_slow, 10.0);
    assert!(on_slow <= 2.0, "fast {on_fast}, slow {on_slow}");
    // /health shows each route's measured time per token, as the metric does.
    let health = request("GET", &t, "/health", None, &[]).unwrap().json();
    let routes = health["models"][0]["routes"].as_array().unwrap().clone();
    let fast_seconds = routes.iter().find(|r| r["name"] == "fast").unwrap()["token_seconds"]
        .as_f64()
        .unwrap();
    assert_eq!(fast_seconds, pace("fast"));
    // Two at once: the fast route holds one session at most, so the other goes to the slow one.
    let both: Vec<Vec<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|_| s.spawn(|| completion_ids(&t, prompt)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(both.iter().all(|ids| *ids == want));
    assert_eq!(sessions("fast") + sessions("slow"), 12.0);
    assert!(
        sessions("slow") > on_slow,
        "the second went to the slow route"
    );
    // Beside each route's measured time per token, the one its parts predict: its shard's own
    // time per token (from the shard's stats, polled every 100 ms) and its messaging, which
    // on the slow route holds the link's 20 ms each way.
    let t0 = std::time::Instant::now();
    let predicted = loop {
        let health = request("GET", &t, "/health", None, &[]).unwrap().json();
        let routes = health["models"][0]["routes"].as_array().unwrap().clone();
        if routes
            .iter()
            .all(|r| r["predicted_token_seconds"].as_f64().is_some())
        {
            break routes;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "{routes:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let part = |name: &str, field: &str| {
        predicted.iter().find(|r| r["name"] == name).unwrap()[field]
            .as_f64()
            .unwrap()
    };
    for name in ["fast", "slow"] {
        let (compute, messaging) = (
            part(name, "compute_seconds"),
            part(name, "messaging_seconds"),
        );
        assert!(compute > 0.0 && messaging >= 0.0, "{predicted:?}");
        assert!((part(name, "predicted_token_seconds") - (compute + messaging)).abs() < 1e-9);
    }
    assert!(part("slow", "messaging_seconds") >= 0.040, "{predicted:?}");
    assert!(part("fast", "messaging_seconds") < part("slow", "messaging_seconds"));
    assert!(
        tracker_metric_with(&t, "strata_route_predicted_token_seconds", "route=\"fast\"") > 0.0
    );
}
