//! Every error the API answers, one request per reason, over HTTP against trackers in this
//! process (tiny model, in-memory shards), held against a snapshot: status, `retry-after`,
//! `connection: close` and the whole JSON body (addresses and ports written as `ADDR`).
//!
//! Refusals that a shard sends (cache miss, stale epoch, a shard's capacity or budget, a
//! grammar over its budget, a failed step) are injected by `shard::FaultyShard`, which rewrites
//! the shard's replies, so each reaches the client exactly as a real one would.
//!
//! The snapshot is `tests/snapshots/error_bodies.txt`; `UPDATE_SNAPSHOTS=1` rewrites it (a
//! change to it is a change of the API every client sees: review it as one).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Reason, Refusal};
use proto::v1::{SessionError, StepError};
use serde_json::{json, Value};
use shard::Fault;
use testkit::http::{get, post_json, request, Response, SseStream};
use tonic::Status;

/// One tracker with one shard of the tiny model, serving HTTP on 127.0.0.1.
struct Node {
    addr: String,
    core: Arc<shard::ShardCore>,
    shard: shard::FaultyShard,
}

fn shard_config(name: &str) -> shard::ShardConfig {
    shard::ShardConfig::in_process(testkit::write_tiny_model(
        &testkit::TinySpec::default(),
        name,
    ))
}

fn tracker_config() -> tracker::TrackerConfig {
    let mut c = tracker::TrackerConfig {
        health_period: Duration::from_millis(50),
        ..tracker::TrackerConfig::default()
    };
    c.http.max_body_bytes = 4096;
    c.http.body_timeout = Duration::from_millis(300);
    c
}

fn start(
    rt: &tokio::runtime::Runtime,
    name: &str,
    config: tracker::TrackerConfig,
    shard: impl FnOnce(&mut shard::ShardConfig),
) -> Node {
    let mut sc = shard_config(name);
    shard(&mut sc);
    let core = shard::ShardCore::load(sc).unwrap();
    let shard = shard::FaultyShard::new(Arc::clone(&core));
    let routes = vec![tracker::RouteSpec {
        name: "local".into(),
        shards: vec![Arc::new(shard.clone())],
    }];
    let addr = serve(rt, config, routes);
    Node { addr, core, shard }
}

fn serve(
    rt: &tokio::runtime::Runtime,
    config: tracker::TrackerConfig,
    routes: Vec<tracker::RouteSpec>,
) -> String {
    rt.block_on(async {
        let t = tracker::Tracker::start(config, routes).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(t.serve(listener, std::future::pending()));
        addr
    })
}

/// `127.0.0.1:PORT` (and any other dotted address with a port) as `ADDR`.
fn normalize(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let start = i;
        let mut j = i;
        let mut dots = 0;
        while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'.') {
            dots += usize::from(b[j] == b'.');
            j += 1;
        }
        if dots == 3 && j < b.len() && b[j] == b':' && b.get(j + 1).is_some_and(u8::is_ascii_digit)
        {
            j += 1;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            out.push_str("ADDR");
            i = j;
        } else {
            let step = text[start..].chars().next().map_or(1, char::len_utf8);
            out.push_str(&text[start..start + step]);
            i = start + step;
        }
    }
    out
}

/// The snapshot line of one answer.
fn line(name: &str, r: &Response) -> String {
    let body: Value = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body.clone()));
    format!(
        "{name} | {} | retry-after: {} | close: {} | {}",
        r.status,
        r.header("retry-after").unwrap_or("-"),
        r.header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close") && r.status >= 400),
        normalize(&body.to_string())
    )
}

fn completion(addr: &str, body: Value) -> Response {
    post_json(addr, "/v1/completions", &body)
}

fn prompt() -> Value {
    json!({"prompt": "the", "max_tokens": 4, "temperature": 0})
}

/// Polls until `/health` answers 200 (the route is up and serving).
fn wait_up(addr: &str) {
    let t = Instant::now();
    while get(addr, "/health").status != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the route stayed down"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `body` until the answer's reason is `reason` (a health change takes a probe or two
/// to be seen), and returns that answer.
fn until_reason(addr: &str, body: &Value, reason: &str) -> Response {
    let t = Instant::now();
    loop {
        let r = completion(addr, body.clone());
        if r.status != 200
            && serde_json::from_str::<Value>(&r.body).is_ok_and(|v| v["error"]["reason"] == reason)
        {
            return r;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "never refused as {reason}: {} {}",
            r.status,
            r.body
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A request whose body never arrives in full.
fn slow_body(addr: &str) -> Response {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    read_raw(s)
}

fn read_raw(mut s: TcpStream) -> Response {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Response {
        status,
        headers,
        body: body.to_string(),
    }
}

/// A shard's refusal of every session, as the wire carries it: the reason by its name (one
/// no reason has is sent as a number this tracker does not know), the limit when one is hit.
fn refusal(reason: &str, limit: Option<&str>, message: &str) -> Fault {
    let mut e = SessionError {
        session_id: 0,
        message: message.into(),
        limit: limit.unwrap_or_default().into(),
        reason: 9999,
    };
    if let Some(r) = engine::Reason::ALL.into_iter().find(|r| r.name() == reason) {
        e.reason = proto::reason_to_wire(r) as i32;
    }
    Fault::Refuse(e)
}

/// The API's own refusals: validation, limits of the HTTP server, routing, admission.
fn api_refusals(rt: &tokio::runtime::Runtime, out: &mut Vec<String>) {
    let a = start(rt, "errors-a", tracker_config(), |s| {
        s.kv_budget_bytes = 256 << 10;
    });
    let addr = &a.addr;
    wait_up(addr);
    let bad_json = request("POST", addr, "/v1/completions", None, &[]).unwrap();
    out.push(line("no body", &bad_json));
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 1\r\n\r\n{{"
    )
    .unwrap();
    out.push(line("invalid JSON", &read_raw(s)));
    let typo = json!({"prompt": "the", "temperature": "hot"});
    out.push(line("a field of the wrong type", &completion(addr, typo)));
    let unknown = json!({"prompt": "the", "best_of": 3});
    out.push(line("an unsupported field", &completion(addr, unknown)));
    let long = json!({"prompt": "the", "max_tokens": 1000});
    out.push(line(
        "prompt and max_tokens over n_ctx",
        &completion(addr, long),
    ));
    let kv = json!({"prompt": "the", "max_tokens": 200});
    out.push(line("more KV than the whole budget", &completion(addr, kv)));
    let other = json!({"prompt": "the", "model": "nope"});
    out.push(line("a model no route holds", &completion(addr, other)));
    out.push(line("an unknown path", &get(addr, "/nope")));
    out.push(line("a wrong method", &get(addr, "/v1/completions")));
    out.push(line("an unknown model id", &get(addr, "/v1/models/nope")));
    let big = json!({"prompt": "x".repeat(5000)});
    out.push(line("a body over max_body_bytes", &completion(addr, big)));
    let names: Vec<String> = (0..101).map(|i| format!("x-h{i}")).collect();
    let many: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "1")).collect();
    let headers = request("GET", addr, "/health", None, &many).unwrap();
    out.push(line("more than 100 headers", &headers));
    let value = "v".repeat(70_000);
    let heavy = request("GET", addr, "/health", None, &[("x-big", &value)]).unwrap();
    out.push(line("more than 64 KiB of headers", &heavy));
    out.push(line("a body that never arrives", &slow_body(addr)));
    let bad_priority = request(
        "POST",
        addr,
        "/v1/completions",
        Some(&prompt()),
        &[("x-strata-priority", "urgent")],
    )
    .unwrap();
    out.push(line("an unknown priority header", &bad_priority));
    let schema = json!({"prompt": "the", "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": (0..60).fold(json!({"type": "string"}), |s, _| json!({"type": "array", "items": s}))}}});
    out.push(line("a schema over a limit", &completion(addr, schema)));
    let usage = get(addr, "/v1/usage");
    out.push(line("usage without a ledger", &usage));
    let evict = request("POST", addr, "/admin/routes/local/evict", None, &[]).unwrap();
    out.push(line("an admin call without the admin API", &evict));
    agent_api_refusals(addr, out);
}

/// The Responses API (OpenAI's shape) and the Messages API (Anthropic's).
fn agent_api_refusals(addr: &str, out: &mut Vec<String>) {
    let r = post_json(
        addr,
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": "resp_404"}),
    );
    out.push(line("responses: an unknown previous_response_id", &r));
    let r = post_json(
        addr,
        "/v1/responses",
        &json!({"input": "x", "background": true}),
    );
    out.push(line("responses: background", &r));
    let r = post_json(
        addr,
        "/v1/responses",
        &json!({"input": [{"type": "computer_call"}]}),
    );
    out.push(line("responses: an input item it does not take", &r));
    let r = request("GET", addr, "/v1/responses/resp_404", None, &[]).unwrap();
    out.push(line("responses: get an unknown response", &r));
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let r = post_json(addr, "/v1/messages", &json!({"messages": msgs}));
    out.push(line("messages: no max_tokens", &r));
    let r = post_json(
        addr,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 4}),
    );
    out.push(line("messages: an image block", &r));
    let r = post_json(
        addr,
        "/v1/messages",
        &json!({"messages": msgs, "max_tokens": 4, "model": "nope"}),
    );
    out.push(line("messages: a model no route holds", &r));
    let r = post_json(
        addr,
        "/v1/messages",
        &json!({"messages": msgs, "max_tokens": 4, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}}),
    );
    out.push(line("messages: a tool_choice naming no tool", &r));
}

/// Keys, budgets, pins, queues, connections and a registry with no route.
fn access_refusals(rt: &tokio::runtime::Runtime, out: &mut Vec<String>) {
    let keyed = start(
        rt,
        "errors-key",
        tracker::TrackerConfig {
            api_key: Some("sekret".into()),
            ..tracker_config()
        },
        |_| {},
    );
    out.push(line("no API key", &completion(&keyed.addr, prompt())));
    let m = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    out.push(line(
        "messages: no API key",
        &post_json(&keyed.addr, "/v1/messages", &m),
    ));
    let dir = std::env::temp_dir().join(format!("strata-errors-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let keys = tracker::ledger::parse_keys("alice a-secret 5\n").unwrap();
    let ledger = tracker::ledger::Ledger::open(&dir.join("usage.db"), keys).unwrap();
    let budgeted = start(
        rt,
        "errors-budget",
        tracker::TrackerConfig {
            ledger: Some(Arc::new(ledger)),
            ..tracker_config()
        },
        |_| {},
    );
    let auth = [("authorization", "Bearer a-secret")];
    let spent = request(
        "POST",
        &budgeted.addr,
        "/v1/completions",
        Some(&json!({"prompt": "the", "max_tokens": 50})),
        &auth,
    )
    .unwrap();
    out.push(line("over the key's token budget", &spent));
    let wrong = request(
        "GET",
        &budgeted.addr,
        "/v1/usage",
        None,
        &[("authorization", "Bearer nope")],
    )
    .unwrap();
    out.push(line("an unknown ledger key", &wrong));
    let pinned = start(
        rt,
        "errors-pinned",
        tracker::TrackerConfig {
            admin_token: Some("root".into()),
            ..tracker_config()
        },
        |s| s.pinned = true,
    );
    let admin = [("authorization", "Bearer root")];
    let evict = |route: &str| {
        let path = format!("/admin/routes/{route}/evict");
        request("POST", &pinned.addr, &path, None, &admin).unwrap()
    };
    out.push(line("evicting a pinned model", &evict("local")));
    out.push(line("evicting an unknown route", &evict("elsewhere")));
    let mut full = tracker_config();
    full.scheduler.max_active = 0;
    full.admission.queue_slots = [0, 0];
    let full = start(rt, "errors-full", full, |_| {});
    out.push(line("no queue place", &completion(&full.addr, prompt())));
    let mut one = tracker_config();
    one.http.max_connections = 1;
    let one = start(rt, "errors-one", one, |_| {});
    let held = TcpStream::connect(&one.addr).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let refused = request("GET", &one.addr, "/health", None, &[]).unwrap();
    out.push(line("over max_connections", &refused));
    drop(held);
    let etcd = testkit::etcd::Etcd::start();
    let followed = serve(
        rt,
        tracker::TrackerConfig {
            registry: Some(tracker::RegistryConfig {
                connect: registry::Connect::plain(&etcd.endpoint()),
                prefix: "/errors".into(),
                link: proto::Link::plain("t"),
            }),
            ..tracker_config()
        },
        Vec::new(),
    );
    out.push(line(
        "no route has joined",
        &completion(&followed, prompt()),
    ));
}

/// What shards say about one session or one step, and what health probes find.
fn shard_refusals(rt: &tokio::runtime::Runtime, out: &mut Vec<String>) {
    let n = start(rt, "errors-shard", tracker_config(), |_| {});
    let addr = n.addr.clone();
    wait_up(&addr);
    let session_faults = [
        (
            "cache_miss",
            None,
            "session 1 is not cached on shard embedded",
        ),
        (
            "stale_epoch",
            None,
            "epoch 1 is older than the route's epoch 2",
        ),
        (
            "capacity",
            Some("kv_budget"),
            "kv_budget on shard embedded: need 1.0 MiB, free 0.5 MiB of 16.0 MiB",
        ),
        ("capacity", None, "Out of something on shard embedded"),
        ("budget", None, "the shard's token budget is spent"),
        (
            "invalid_request",
            None,
            "session 1: start_pos 9 is past its 3 positions",
        ),
        (
            "grammar_budget",
            Some("grammar_budget_ms"),
            "session 1: the grammar took longer than `grammar_budget_ms` (200 ms)",
        ),
        ("recipe_mismatch", None, "shard embedded holds layers 0..3"),
        (
            "shard_failed",
            None,
            "shard embedded: the compute thread stopped",
        ),
        ("no_such_reason", None, "something new"),
    ];
    for (reason, limit, message) in session_faults {
        n.shard.set(refusal(reason, limit, message));
        let name = format!("a shard's {reason} refusal ({message})");
        out.push(line(&name, &completion(&addr, prompt())));
    }
    let mut stream = SseStream::open(
        &addr,
        "/v1/completions",
        &json!({"prompt": "the", "max_tokens": 4, "stream": true}),
    )
    .unwrap();
    let mut data = Vec::new();
    while let Some(d) = stream.next_data() {
        data.push(d);
    }
    out.push(format!(
        "a shard's refusal while streaming | {} | events: {}",
        stream.status,
        normalize(&data.join(" / "))
    ));
    n.shard.set(Fault::FailStep(StepError::new(
        "embedded",
        &Refusal::new(Reason::ShardFailed, "the compute thread stopped"),
    )));
    out.push(line("a failed step", &completion(&addr, prompt())));
    n.shard.set(Fault::RefuseRoute(proto::refusal_status(
        tonic::Code::FailedPrecondition,
        &Refusal::recipe_mismatch(
            "recipe_mismatch: shard embedded has layer_end 3 but the route expects 4",
        ),
    )));
    let r = until_reason(&addr, &prompt(), "recipe_mismatch");
    out.push(line("a route refused for its recipe", &r));
    n.shard.set(Fault::RefuseRoute(Status::unavailable(
        "connection refused",
    )));
    let r = until_reason(&addr, &prompt(), "shard_failed");
    out.push(line("a route whose shard does not answer", &r));
    n.shard.set(Fault::FailStep(StepError::new(
        "embedded",
        &Refusal::capacity(
            "inflight_bytes",
            "inflight_bytes on shard embedded: 70 MiB in flight",
        ),
    )));
    wait_up(&addr);
    out.push(line(
        "a step refused for capacity",
        &completion(&addr, prompt()),
    ));
    n.shard.set(Fault::OtherLayers);
    let r = until_reason(&addr, &prompt(), "recipe_mismatch");
    out.push(line("a shard holding other layers", &r));
    n.shard.set(Fault::None);
    wait_up(&addr);
    n.core.drain();
    let r = until_reason(&addr, &prompt(), "draining");
    out.push(line("a draining shard", &r));
    n.core.inject_panic();
    let r = until_reason(&addr, &prompt(), "shard_failed");
    out.push(line("a shard whose compute thread died", &r));
}

#[test]
fn every_error_body_matches_the_snapshot() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut out = Vec::new();
    api_refusals(&rt, &mut out);
    access_refusals(&rt, &mut out);
    shard_refusals(&rt, &mut out);
    let got = out.join("\n") + "\n";
    let path = testkit::repo_root().join("crates/strata/tests/snapshots/error_bodies.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &got).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_SNAPSHOTS=1 writes it)", path.display()));
    for (w, g) in want.lines().zip(got.lines()) {
        assert_eq!(w, g, "an error body changed");
    }
    assert_eq!(want, got, "the snapshot has other rows");
    drop(rt);
}
