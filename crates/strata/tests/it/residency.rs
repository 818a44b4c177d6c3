//! Residency: one tracker fronting two nodes (shard sets) that hold different models. A request
//! goes only to a route holding its model; a model no node holds is refused, never loaded.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, post_json, request};
use testkit::procs;
use testkit::TinySpec;

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

fn shard_prefill(addr: &str, shard: &str) -> f64 {
    let key = format!("strata_shard_prefill_tokens_total{{shard=\"{shard}\"}} ");
    get(addr, "/metrics")
        .body
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn metric_lines(addr: &str, prefix: &str) -> Vec<String> {
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

/// Waits until the tracker's probes have seen `shard` compute at least `at_least` prompt
/// tokens, then returns the count.
fn settled_prefill(addr: &str, shard: &str, at_least: f64) -> f64 {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        let v = shard_prefill(addr, shard);
        if v >= at_least {
            // One more probe period, so nothing is still on its way.
            std::thread::sleep(Duration::from_millis(700));
            return shard_prefill(addr, shard);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    shard_prefill(addr, shard)
}

#[test]
fn requests_go_only_to_nodes_holding_their_model_and_others_are_not_resident() {
    let token = procs::token_file("residency-test-token-0123456789");
    let real = testkit::real_model();
    let tiny = testkit::write_tiny_model(&TinySpec::default(), "residency");
    let a = procs::shard(exe(), &real, "0..30", &token, &["--threads", "1", "--pin"]);
    let b = procs::shard(exe(), &tiny, "0..4", &token, &["--threads", "1"]);
    let admin = procs::token_file("residency-admin-token-0123456789");
    let args: Vec<String> = [
        "tracker".to_string(),
        "--route".into(),
        format!("node-a={}", a.addr),
        "--route".into(),
        format!("node-b={}", b.addr),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--cluster-token-file".into(),
        token.display().to_string(),
        "--admin-token-file".into(),
        admin.display().to_string(),
    ]
    .to_vec();
    let t = procs::spawn(exe(), &args, "strata tracker listening on ", "tracker");

    let models = get(&t.addr, "/v1/models").json();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 2, "{models}");
    let on = |id: &str| -> Value { data.iter().find(|m| m["id"] == id).unwrap()["routes"].clone() };
    // Models are named after their files.
    let id_with = |layers: u64| -> String {
        data.iter().find(|m| m["n_layers"] == layers).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (real_id, tiny_id) = (id_with(30), id_with(4));
    assert_eq!(tiny_id, "residency");
    assert_eq!(on(&tiny_id), json!(["node-b"]));
    assert_eq!(on(&real_id), json!(["node-a"]));

    for _ in 0..3 {
        let r = post_json(
            &t.addr,
            "/v1/completions",
            &json!({"model": real_id, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let a_after_real = settled_prefill(&t.addr, &a.addr, 1.0);
    assert!(a_after_real > 0.0);
    assert_eq!(
        shard_prefill(&t.addr, &b.addr),
        0.0,
        "node B never computed node A's model"
    );

    let r = post_json(
        &t.addr,
        "/v1/completions",
        &json!({"model": tiny_id, "prompt": "the world", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(settled_prefill(&t.addr, &b.addr, 1.0) > 0.0);
    assert_eq!(
        shard_prefill(&t.addr, &a.addr),
        a_after_real,
        "node A never computed node B's model"
    );

    let r = post_json(
        &t.addr,
        "/v1/completions",
        &json!({"model": "llama-70b", "prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["reason"], "not_resident");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("`residency` on node-b")
            && message.contains(&format!("`{real_id}` on node-a")),
        "{message}"
    );
    let r = post_json(
        &t.addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(
        r.status, 400,
        "two models: the request must name one: {}",
        r.body
    );

    assert_eq!(
        metric_lines(&t.addr, "strata_swaps_total"),
        vec!["strata_swaps_total 0".to_string()],
        "no model was ever loaded to serve a request"
    );
    assert_eq!(metric_lines(&t.addr, "strata_model_resident{").len(), 2);
    let h = get(&t.addr, "/health").json();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["models"].as_array().unwrap().len(), 2);

    // Eviction is an operator action, refused for the pinned model even though it would free
    // its node; the unpinned one leaves its route and is then not resident anywhere.
    let evict = |route: &str, auth: &[(&str, &str)]| {
        request(
            "POST",
            &t.addr,
            &format!("/admin/routes/{route}/evict"),
            Some(&json!({})),
            auth,
        )
        .unwrap()
    };
    let bearer = [("authorization", "Bearer residency-admin-token-0123456789")];
    assert_eq!(evict("node-a", &[]).status, 401);
    let r = evict("node-a", &bearer);
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["reason"], "pinned");
    let r = post_json(
        &t.addr,
        "/v1/completions",
        &json!({"model": real_id, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "the pinned model still serves: {}", r.body);
    let r = evict("node-b", &bearer);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post_json(
        &t.addr,
        "/v1/completions",
        &json!({"model": tiny_id, "prompt": "the world", "max_tokens": 4}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["error"]["reason"], "not_resident");
    let models = get(&t.addr, "/v1/models").json();
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{models}");
    assert_eq!(models["data"][0]["pinned_on"], json!(["node-a"]));
    assert_eq!(
        metric_lines(&t.addr, "strata_swaps_total"),
        vec!["strata_swaps_total 0".to_string()]
    );
}
