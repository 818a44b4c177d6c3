//! Probes for orchestrators on a real 2-shard route with an API key: `/livez` answers 200
//! without a key whatever the routes do; `/readyz` answers without a key, 200 while the model
//! has an open route and 503 once its route is down, 200 again after the shard is back, and
//! names the models (and takes `?model=`) only for a caller with the key; `/v1/models` and
//! `/health` need the key, and every other endpoint refuses a caller without one from its
//! headers alone, before reading its body or resolving its model.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::http::{get, request};
use testkit::observe::wait_until;
use testkit::procs::{self, Proc};

const KEY: &str = "probe-test-key-0123456789";

fn exe() -> &'static Path {
    procs::strata_bin(env!("CARGO_BIN_EXE_strata"))
}

fn with_key(addr: &str, path: &str) -> u16 {
    keyed(addr, path).status
}

fn keyed(addr: &str, path: &str) -> testkit::http::Response {
    let auth = format!("Bearer {KEY}");
    request("GET", addr, path, None, &[("authorization", &auth)]).unwrap()
}

#[test]
fn livez_answers_without_a_key_and_readyz_names_the_model_whose_route_is_down() {
    let model = testkit::real_model();
    let token = procs::token_file("probe-test-token-0123456789");
    let a = procs::shard(exe(), &model, "0..15", &token, &["--threads", "1"]);
    let b = procs::shard(exe(), &model, "15..30", &token, &["--threads", "1"]);
    let tracker = procs::tracker(
        exe(),
        &[&a, &b],
        &token,
        &["--api-key", KEY, "--health-period-ms", "100"],
    );
    let addr = tracker.addr.clone();

    // Keys on: the cluster's state needs one, the probes do not.
    assert_eq!(get(&addr, "/v1/models").status, 401);
    assert_eq!(get(&addr, "/health").status, 401);
    assert_eq!(with_key(&addr, "/v1/models"), 200);
    let id = {
        let auth = format!("Bearer {KEY}");
        let r = request(
            "GET",
            &addr,
            "/v1/models",
            None,
            &[("authorization", &auth)],
        )
        .unwrap();
        r.json()["data"][0]["id"].as_str().unwrap().to_string()
    };
    assert_eq!(get(&addr, &format!("/v1/models/{id}")).status, 401);
    // Without a key, a completion naming an unknown model learns nothing of the models and
    // an empty Responses body is not validated: 401, both.
    let unknown_model = request(
        "POST",
        &addr,
        "/v1/chat/completions",
        Some(&json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})),
        &[],
    )
    .unwrap();
    assert_eq!(unknown_model.status, 401, "{}", unknown_model.body);
    assert!(
        !unknown_model.body.contains(&id) && !unknown_model.body.contains("127.0.0.1"),
        "a refusal to a caller without a key names nothing of the cluster: {}",
        unknown_model.body
    );
    for path in [
        "/v1/responses",
        "/v1/messages",
        "/tokenize",
        "/v1/completions",
    ] {
        let r = request("POST", &addr, path, Some(&json!({})), &[]).unwrap();
        assert_eq!(r.status, 401, "{path}: {}", r.body);
    }
    assert_eq!(get(&addr, "/v1/usage").status, 401);
    assert_eq!(get(&addr, "/v1/responses/resp_0").status, 401);
    // A caller announcing a megabyte and sending none of it is answered from its headers, at
    // once (a handler would wait out the body timeout reading it).
    let t = Instant::now();
    let mut c = TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: 1048576\r\n\r\n"
    )
    .unwrap();
    let mut head = [0u8; 12];
    c.read_exact(&mut head).unwrap();
    assert_eq!(
        &head,
        b"HTTP/1.1 401",
        "{:?}",
        String::from_utf8_lossy(&head)
    );
    eprintln!("401 from the headers alone after {:?}", t.elapsed());
    let live = get(&addr, "/livez");
    assert_eq!(
        (live.status, live.json()["status"].clone()),
        (200, "alive".into())
    );
    assert!(wait_until(Duration::from_secs(10), || get(
        &addr, "/readyz"
    )
    .status
        == 200));
    // Without the key: the verdict only, no model named, no question about one answered.
    let ready = get(&addr, "/readyz");
    assert_eq!(ready.json(), json!({"status": "ready"}), "{}", ready.body);
    assert_eq!(get(&addr, &format!("/readyz?model={id}")).status, 401);
    assert_eq!(get(&addr, "/readyz?model=no-such-model").status, 401);
    let ready = keyed(&addr, "/readyz").json();
    assert_eq!(ready["models"][&id], "ready", "{ready}");
    assert_eq!(with_key(&addr, &format!("/readyz?model={id}")), 200);
    let unknown = keyed(&addr, "/readyz?model=no-such-model");
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    let bad = get(&addr, "/readyz?verbose=1");
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(bad.json()["error"]["param"], "verbose", "{}", bad.body);

    // The route's second shard dies: not ready, naming the model; alive all the same.
    let b_addr = b.addr.clone();
    drop(b);
    assert!(
        wait_until(Duration::from_secs(10), || get(&addr, "/readyz").status
            == 503),
        "readyz stayed {}",
        get(&addr, "/readyz").body
    );
    assert_eq!(get(&addr, "/readyz").json(), json!({"status": "not ready"}));
    let down: Value = keyed(&addr, "/readyz").json();
    assert_eq!(down["models"][&id], "not ready", "{down}");
    assert!(
        down["reason"].as_str().unwrap().contains(&id),
        "the reason names the model: {down}"
    );
    assert_eq!(with_key(&addr, &format!("/readyz?model={id}")), 503);
    assert_eq!(get(&addr, "/livez").status, 200);
    assert_eq!(with_key(&addr, "/health"), 503);

    // Back where it was: ready again.
    let b = procs::shard_on(
        exe(),
        &model,
        "15..30",
        &token,
        &b_addr,
        &["--threads", "1"],
    );
    assert!(
        wait_until(Duration::from_secs(20), || get(&addr, "/readyz").status
            == 200),
        "readyz stayed {}",
        get(&addr, "/readyz").body
    );
    assert_eq!(get(&addr, "/livez").status, 200);
    let _keep: Vec<Proc> = vec![a, b, tracker];
}
