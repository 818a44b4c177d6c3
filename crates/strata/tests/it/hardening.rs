//! One hostile request must not take the cluster down (issue 27), over real sockets against
//! `strata serve` on SmolLM2: schemas far over the limits get a typed 400 at once and the
//! process lives on; random schemas up to the body limit never abort it; a `$ref` cycle and a
//! bound the grammar cannot hold are refused up front in a few words; the widest schema
//! accepted answers; over-long headers get a JSON 431; the Bearer scheme is case-insensitive.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, post_json, request};
use testkit::procs::{self, Proc};

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serve(extra: &[&str]) -> Proc {
    procs::serve(exe(), &testkit::real_model(), "2", extra)
}

fn with_schema(schema: Value, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    })
}

fn wide(n: usize, required: bool) -> Value {
    let props: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    let mut s = json!({"type": "object", "properties": props});
    if required {
        s["required"] = json!((0..n).map(|i| format!("p{i}")).collect::<Vec<_>>());
    }
    s
}

fn alive(addr: &str) {
    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn schemas_far_over_the_limits_are_refused_at_once_and_the_process_lives_on() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut t = serve(&["--max-body-mib", "4"]);
    for (n, required) in [(7_000, false), (10_000, true), (50_000, false)] {
        let body = with_schema(wide(n, required), 8);
        let t0 = Instant::now();
        let r = post_json(&t.addr, "/v1/chat/completions", &body);
        let took = t0.elapsed();
        assert_eq!(r.status, 400, "{n}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["limit"], "max_object_properties", "{n}: {}", r.body);
        assert_eq!(e["param"], "response_format.json_schema.schema");
        // A debug build parses a megabyte of JSON in tens of milliseconds; the bound the
        // issue sets (100 ms) is measured on the release build in the closing note.
        assert!(took < Duration::from_secs(3), "{n}: {took:?}");
        eprintln!("{n} properties: refused in {took:?}");
    }
    // The same width as tools: refused the same way, under any tool choice.
    for choice in [json!("auto"), json!("required")] {
        let body = json!({
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": wide(7_000, false)}}],
            "tool_choice": choice,
        });
        let r = post_json(&t.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["limit"], "max_object_properties");
    }
    alive(&t.addr);
    assert!(!t.exited(), "the server exited");
}

#[test]
fn a_ref_cycle_and_unenforceable_bounds_are_refused_up_front_in_a_few_words() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t = serve(&[]);
    let cycle = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
    let r = post_json(&t.addr, "/v1/chat/completions", &with_schema(cycle, 8));
    assert_eq!(r.status, 400, "{}", r.body);
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.len() < 400 && !m.contains('\n'), "{m}");
    for internal in ["Parser Error", "items", "row", "lexer"] {
        assert!(!m.contains(internal), "library internals in {m:?}");
    }
    let huge = json!({"type": "integer", "minimum": 1e300, "maximum": 1e301});
    let r = post_json(&t.addr, "/v1/chat/completions", &with_schema(huge, 8));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["limit"], "max_schema_bound", "{}", r.body);
    alive(&t.addr);
}

/// The widest object the limits admit (every property optional, the case that made the
/// engine give up after one token at 1000 properties) answers through a 2-shard route with a
/// document that parses.
#[test]
fn the_widest_schema_accepted_answers_with_a_valid_document() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t = serve(&[]);
    let n = constrain::limits::LIMITS.max_object_properties;
    let r = post_json(
        &t.addr,
        "/v1/chat/completions",
        &with_schema(wide(n, false), 48),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap();
    if choice["finish_reason"] == "stop" {
        let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(doc.is_object(), "{text}");
    } else {
        assert_eq!(choice["finish_reason"], "length", "{v}");
        assert!(text.starts_with('{'), "{text}");
    }
}

/// Random schemas (objects, arrays, alternatives, literals, nesting, sizes up to the body
/// limit): every one is answered 200 or refused 400, and the process never aborts.
#[test]
fn random_schemas_never_abort_the_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut t = serve(&["--max-body-mib", "2"]);
    let mut rng = Lcg(0x5eed_2702);
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..40 {
        // Sizes from a handful of nodes to about a megabyte of schema.
        let budget = [8usize, 64, 512, 4_096, 30_000][i % 5];
        let schema = random_schema(&mut rng, budget, 0);
        let r = request(
            "POST",
            &t.addr,
            "/v1/chat/completions",
            Some(&with_schema(schema, 6)),
            &[],
        )
        .unwrap_or_else(|e| panic!("schema {i}: the server did not answer: {e}"));
        assert!(
            r.status == 200 || r.status == 400 || r.status == 413,
            "schema {i}: {} {}",
            r.status,
            r.body
        );
        *statuses.entry(r.status).or_insert(0) += 1;
        assert!(!t.exited(), "schema {i}: the server exited");
    }
    eprintln!("statuses: {statuses:?}");
    alive(&t.addr);
}

/// A small deterministic generator (the test must be repeatable).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

fn random_schema(rng: &mut Lcg, budget: usize, depth: usize) -> Value {
    if budget <= 1 || depth > 60 {
        return match rng.next(4) {
            0 => {
                json!({"type": "integer", "minimum": -(rng.next(100) as i64), "maximum": rng.next(1000)})
            }
            1 => json!({"type": "string", "maxLength": rng.next(20) + 1}),
            2 => json!({"const": "c".repeat(rng.next(8) + 1)}),
            _ => json!({"type": "boolean"}),
        };
    }
    match rng.next(5) {
        0 | 1 => {
            let n = rng.next(budget.min(20_000)) + 1;
            let each = budget / n;
            let props: serde_json::Map<String, Value> = (0..n)
                .map(|k| (format!("k{k}"), random_schema(rng, each, depth + 1)))
                .collect();
            let required: Vec<String> = (0..n)
                .filter(|_| rng.next(2) == 0)
                .map(|k| format!("k{k}"))
                .collect();
            json!({"type": "object", "properties": props, "required": required})
        }
        2 => {
            json!({"type": "array", "items": random_schema(rng, budget - 1, depth + 1), "maxItems": rng.next(5) + 1})
        }
        3 => {
            let n = rng.next(budget.min(600)) + 1;
            let each = budget / n;
            let alts: Vec<Value> = (0..n)
                .map(|_| random_schema(rng, each, depth + 1))
                .collect();
            json!({"anyOf": alts})
        }
        _ => {
            let n = rng.next(budget.min(2_000)) + 1;
            json!({"enum": (0..n).map(|k| format!("v{k}")).collect::<Vec<_>>()})
        }
    }
}

fn raw(addr: &str, head: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer
}

#[test]
fn over_long_headers_get_a_json_431_and_the_bearer_scheme_is_case_insensitive() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t = serve(&["--api-key", "sesame-0123456789"]);
    let many: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    let answer = raw(
        &t.addr,
        &format!("GET /health HTTP/1.1\r\nhost: x\r\n{many}\r\n"),
    );
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(answer.contains("\"limit\":\"max_headers\""), "{answer}");
    let long = "v".repeat(70_000);
    let answer = raw(
        &t.addr,
        &format!("GET /health HTTP/1.1\r\nhost: x\r\nx-long: {long}\r\n\r\n"),
    );
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(
        answer.contains("\"limit\":\"max_header_bytes\""),
        "{answer}"
    );
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} sesame-0123456789");
        let r = request("GET", &t.addr, "/health", None, &[("authorization", &auth)]).unwrap();
        assert_eq!(r.status, 200, "{scheme}: {}", r.body);
    }
    let r = get(&t.addr, "/health");
    assert_eq!(r.status, 401);
}
