//! The HTTP API against hostile clients, with real processes on 127.0.0.1: partial requests
//! and idle connections are closed after the header timeout, connections over the limit get a
//! typed 503 (also when the process is short of descriptors), megabyte prompts are refused
//! without slowing anyone else or growing memory, and `/metrics` passes `promtool check
//! metrics` with counters named and typed as counters.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::http::{get, post_json};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `strata serve` with one embedded shard and `extra` flags.
fn serve(extra: &[&str]) -> Proc {
    procs::serve(exe(), &testkit::real_model(), "1", extra)
}

/// Waits up to `limit` for the server to close `conn`: `Some(elapsed)` if it did.
fn closed_within(conn: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    conn.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return Some(t.elapsed()),
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(t.elapsed()),
            Err(_) => return None,
        }
    }
}

#[test]
fn a_partial_request_and_an_idle_connection_are_closed_after_the_header_timeout() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t = serve(&["--http-header-timeout-ms", "1000"]);
    // One byte of a request, then nothing.
    let mut partial = TcpStream::connect(&t.addr).unwrap();
    partial.write_all(b"P").unwrap();
    let took = closed_within(&mut partial, Duration::from_secs(10));
    assert!(
        took.is_some_and(|d| d < Duration::from_secs(5)),
        "a 1-byte request stayed open: {took:?}"
    );
    // A kept-alive connection that answered one request, then sits idle.
    let mut idle = TcpStream::connect(&t.addr).unwrap();
    write!(idle, "GET /health HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let took = closed_within(&mut idle, Duration::from_secs(10));
    assert!(
        took.is_some_and(|d| d < Duration::from_secs(5)),
        "an idle connection stayed open: {took:?}"
    );
    // A body that never comes: 408 after the body timeout, typed.
    let t = serve(&["--http-body-timeout-ms", "500"]);
    let mut slow = TcpStream::connect(&t.addr).unwrap();
    write!(
        slow,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let _ = slow.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"limit\":\"body_timeout\""), "{answer}");
    // A body over the limit, written out in full before the client reads: the typed 413 comes
    // back every time, not a reset under the client's write.
    for _ in 0..5 {
        let body = json!({"prompt": "x".repeat(5 << 20)}).to_string();
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, answer) = raw(&t.addr, request.as_bytes());
        assert_eq!(status, 413, "{answer}");
        assert!(answer.contains("\"limit\":\"max_body_bytes\""), "{answer}");
    }
}

/// Opens `n` TCP connections that send nothing.
fn idle_connections(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect()
}

/// A GET over a fresh connection: the status and body (status 0 if none came).
fn raw_get(addr: &str, path: &str) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    raw(addr, request.as_bytes())
}

/// Sends a request written out in full over a fresh connection and reads to its end: the
/// status and the whole answer (status 0 if none came).
fn raw(addr: &str, request: &[u8]) -> (u16, String) {
    let Ok(mut c) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    if c.write_all(request).is_err() {
        return (0, String::new());
    }
    let mut s = String::new();
    let _ = c.read_to_string(&mut s);
    let status = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (status, s)
}

#[test]
fn connections_over_the_limit_get_a_typed_refusal_and_the_api_stays_reachable() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t = serve(&[
        "--max-connections",
        "8",
        "--http-header-timeout-ms",
        "60000",
    ]);
    let mut held = idle_connections(&t.addr, 8);
    std::thread::sleep(Duration::from_millis(300));
    let (status, text) = raw_get(&t.addr, "/health");
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("\"reason\":\"capacity\""), "{text}");
    assert!(text.contains("\"limit\":\"max_connections\""), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("retry-after: 1"),
        "{text}"
    );
    // Connections that close free their places.
    held.truncate(6);
    let mut status = 0;
    for _ in 0..50 {
        status = raw_get(&t.addr, "/health").0;
        if status == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(status, 200);
    drop(held);
}

#[test]
fn short_of_descriptors_the_api_refuses_with_a_typed_answer_and_recovers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // 128 descriptors, as in the report this reproduces; the connection limit defaults to
    // what the process can hold beside its other descriptors.
    let model = testkit::real_model();
    let script = format!(
        "ulimit -n 128 && exec {} serve --model {} --shards 1 --threads 1 --listen 127.0.0.1:0 --http-header-timeout-ms 2000",
        exe().display(),
        model.display()
    );
    let t = procs::spawn(
        std::path::Path::new("bash"),
        &["-c".to_string(), script],
        "strata tracker listening on ",
        "serve",
    );
    let held = idle_connections(&t.addr, 116);
    std::thread::sleep(Duration::from_millis(300));
    let (status, text) = raw_get(&t.addr, "/health");
    assert_eq!(status, 503, "while 116 connections are held: {text}");
    assert!(text.contains("\"limit\":\"max_connections\""), "{text}");
    // Idle connections are closed by the server after the header timeout; the API answers.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut status = 0;
    while Instant::now() < deadline {
        status = raw_get(&t.addr, "/health").0;
        if status == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(status, 200, "the API never recovered");
    drop(held);
}

/// Peak RSS (VmHWM) and current RSS of a process, in bytes.
fn rss(pid: i32) -> (f64, f64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0.0, |kib| kib * 1024.0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// [`raw`], with the answer's JSON body.
fn raw_request(addr: &str, request: &[u8]) -> (u16, serde_json::Value) {
    let (status, answer) = raw(addr, request);
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or_default())
}

fn short_request(addr: &str) -> Duration {
    let t = Instant::now();
    let r = post_json(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    t.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn megabyte_prompts_neither_slow_other_requests_nor_grow_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let token = procs::token_file("limits-cluster-token-0123456789");
    let m = testkit::real_model();
    let a = procs::shard(exe(), &m, "0..15", &token, &["--threads", "1"]);
    let b = procs::shard(exe(), &m, "15..30", &token, &["--threads", "1"]);
    let t = procs::tracker(exe(), &[&a, &b], &token, &[]);
    for _ in 0..3 {
        short_request(&t.addr);
    }
    let alone = median((0..7).map(|_| short_request(&t.addr)).collect());
    let idle_rss = rss(t.pid()).1;
    let huge: [(&str, String); 4] = [
        ("dots", ".".repeat(1 << 20)),
        ("spaces", " ".repeat(1 << 20)),
        ("one word", "a".repeat(1 << 20)),
        ("prose", "the cat sat on the mat. ".repeat((1 << 20) / 24)),
    ];
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Each request written out once: the flood costs the tracker, not this test's threads.
    let requests: Vec<(&str, Vec<u8>)> = huge
        .iter()
        .map(|(name, prompt)| {
            let body = json!({"prompt": prompt, "max_tokens": 4}).to_string();
            let head = format!(
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            (*name, [head.into_bytes(), body.into_bytes()].concat())
        })
        .collect();
    let (during, answers) = std::thread::scope(|s| {
        let floods: Vec<_> = requests
            .iter()
            .map(|(name, request)| {
                let (addr, stop) = (&t.addr, &stop);
                s.spawn(move || {
                    let mut answers = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let t0 = Instant::now();
                        let (status, body) = raw_request(addr, request);
                        answers.push((*name, status, body, t0.elapsed()));
                    }
                    answers
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let during: Vec<Duration> = (0..7).map(|_| short_request(&t.addr)).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let answers: Vec<_> = floods.into_iter().flat_map(|h| h.join().unwrap()).collect();
        (median(during), answers)
    });
    let peak_rss = rss(t.pid()).0;
    for (name, status, body, took) in &answers {
        assert_eq!(*status, 400, "{name}: {body}");
        assert_eq!(body["error"]["limit"], "n_ctx", "{name}: {body}");
        assert!(*took < Duration::from_secs(10), "{name} took {took:?}");
    }
    eprintln!(
        "{} megabyte prompts refused; short request median {alone:?} alone, {during:?} during; tracker rss {:.1} MiB idle, peak {:.1} MiB",
        answers.len(),
        idle_rss / 1048576.0,
        peak_rss / 1048576.0
    );
    assert!(
        during.as_secs_f64() <= 2.0 * alone.as_secs_f64(),
        "a short request took {during:?} during the flood, {alone:?} alone"
    );
    assert!(
        peak_rss - idle_rss <= 64.0 * 1048576.0,
        "tracker rss grew from {:.1} to {:.1} MiB",
        idle_rss / 1048576.0,
        peak_rss / 1048576.0
    );
}

/// `promtool check metrics` (Debian's `prometheus` package) on a tracker's `/metrics` after
/// answered, refused and failed requests; without promtool, the same rules it applies that
/// matter here: every series typed and described, counters and only counters end in `_total`.
#[test]
fn metrics_pass_promtool_and_counters_are_typed_as_counters() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let token = procs::token_file("metrics-cluster-token-0123456789");
    let m = testkit::real_model();
    let a = procs::shard(exe(), &m, "0..15", &token, &["--threads", "1"]);
    let b = procs::shard(exe(), &m, "15..30", &token, &["--threads", "1"]);
    let t = procs::tracker(exe(), &[&a, &b], &token, &["--health-period-ms", "100"]);
    short_request(&t.addr);
    let r = post_json(
        &t.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 100000}),
    );
    assert_eq!(r.status, 400);
    std::thread::sleep(Duration::from_millis(400));
    let text = get(&t.addr, "/metrics").body;
    let mut types = std::collections::HashMap::new();
    let mut problems = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            types.insert(name.to_string(), kind.to_string());
            let total = name.ends_with("_total");
            if (kind == "counter") != total {
                problems.push(format!("{name} is a {kind}"));
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| types.get(*f).is_some_and(|k| k == "histogram"))
                })
                .unwrap_or(name);
            if !types.contains_key(family) {
                problems.push(format!("{name} has no TYPE"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Statuses are words, and a request's own refusal is `invalid`, not `capacity`.
    assert!(
        text.contains("strata_requests_total{status=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("strata_requests_total{status=\"invalid_request\"} 1"),
        "{text}"
    );
    assert!(text.contains("strata_build_info{version="), "{text}");
    for family in [
        "strata_request_duration_seconds",
        "strata_request_prompt_tokens",
        "strata_request_generation_tokens",
        "strata_finished_requests_total",
        "strata_shard_kv_usage_ratio",
        "process_cpu_seconds_total",
        "process_open_fds",
    ] {
        assert!(text.contains(&format!("\n{family}")), "{family} missing");
    }
    let promtool = std::env::var_os("STRATA_PROMTOOL")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("promtool"))
                    .find(|p| p.is_file())
            })
        });
    match promtool {
        Some(p) => {
            let mut child = std::process::Command::new(&p)
                .args(["check", "metrics"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool check metrics:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        None => eprintln!(
            "promtool not found (Debian's `prometheus` package; .ci/run installs it): checked with the rules above only"
        ),
    }
}

/// With `STRATA_LOG=info` every request leaves one log line saying how it ended.
#[test]
fn every_request_leaves_a_log_line() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = testkit::real_model();
    let mut child = std::process::Command::new(exe())
        .args([
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--shards",
            "1",
            "--threads",
            "1",
            "--listen",
            "127.0.0.1:0",
        ])
        .env("STRATA_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    use std::io::BufRead;
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .strip_prefix("strata tracker listening on http://")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{line}"))
        .to_string();
    short_request(&addr);
    let r = post_json(&addr, "/v1/completions", &json!({"prompt": 5}));
    assert_eq!(r.status, 400);
    // SIGTERM: the process exits and its stderr ends.
    let _ = std::process::Command::new("kill")
        .arg(child.id().to_string())
        .status();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let _ = child.wait();
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("strata::request"))
        .collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].contains("status=\"ok\"") || lines[0].contains("status=ok"),
        "{}",
        lines[0]
    );
    assert!(lines[0].contains("completion_tokens=8"), "{}", lines[0]);
    assert!(lines[1].contains("invalid_request"), "{}", lines[1]);
}

/// Forty clients each send all but the last bytes of a 3.9 MB body and hold their
/// connections: the bodies in flight never take more than the tracker's budget for them (512
/// MiB, each counted at 8x its size, so about 16 such bodies): the others are refused with a
/// typed 503 `capacity` naming `body_memory`, the tracker's memory grows by less than 256 MiB,
/// and once the clients go the budget is whole again (a request is answered).
#[test]
fn bodies_in_flight_stay_within_their_memory_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t = serve(&["--http-body-timeout-ms", "60000"]);
    let idle_rss = rss(t.pid()).1;
    let body = json!({"prompt": "x".repeat(3_900_000), "max_tokens": 1}).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let sent = &body.as_bytes()[..body.len() - 100];
    // Each client: the head and all but the last 100 bytes, in 64 KiB writes (a refused one
    // stops being read, so its writes stop), then whatever answer comes within 5 s.
    let clients: Vec<(TcpStream, u16, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..40)
            .map(|_| {
                let (addr, head) = (&t.addr, &head);
                s.spawn(move || {
                    let mut c = TcpStream::connect(addr).unwrap();
                    c.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
                    let _ = c.write_all(head.as_bytes());
                    for chunk in sent.chunks(64 << 10) {
                        if c.write_all(chunk).is_err() {
                            break;
                        }
                    }
                    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    let mut answer = vec![0u8; 4096];
                    let n = c.read(&mut answer).unwrap_or(0);
                    let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
                    let status = answer
                        .split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    (c, status, answer)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let peak_rss = rss(t.pid()).0;
    let refused: Vec<&String> = clients
        .iter()
        .filter(|(_, status, _)| *status == 503)
        .map(|(_, _, a)| a)
        .collect();
    let held = clients.iter().filter(|(_, status, _)| *status == 0).count();
    eprintln!(
        "{} bodies refused, {held} held; tracker rss {:.1} MiB idle, peak {:.1} MiB",
        refused.len(),
        idle_rss / 1048576.0,
        peak_rss / 1048576.0
    );
    assert!(
        refused.len() + held == clients.len(),
        "every client is refused or still being read: {:?}",
        clients.iter().map(|c| c.1).collect::<Vec<_>>()
    );
    assert!(
        (1..=17).contains(&held),
        "{held} bodies of 3.9 MB held at once"
    );
    for a in &refused {
        assert!(
            a.contains("\"reason\":\"capacity\"") && a.contains("\"limit\":\"body_memory\""),
            "{a}"
        );
    }
    assert!(
        peak_rss - idle_rss < 256.0 * 1048576.0,
        "tracker rss grew from {:.1} to {:.1} MiB",
        idle_rss / 1048576.0,
        peak_rss / 1048576.0
    );
    // The clients go: their shares come back, and a request of the largest size is read.
    drop(clients);
    let mut status = 0;
    for _ in 0..100 {
        let r = post_json(
            &t.addr,
            "/v1/completions",
            &json!({"prompt": "x".repeat(3_900_000), "max_tokens": 1}),
        );
        status = r.status;
        if status != 503 {
            assert_eq!(r.json()["error"]["limit"], "n_ctx", "{}", r.body);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(status, 400, "a large body once the others left");
}
