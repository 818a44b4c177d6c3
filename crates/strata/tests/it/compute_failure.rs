//! A shard whose compute thread dies (fault injection: a panic, as a bug would cause) in a
//! tracker's process: `/health` stops saying ok, requests get a typed `shard_failed` at once
//! instead of hanging, and the route's metric agrees.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::http::{get, post_json};

#[test]
fn a_dead_compute_thread_turns_health_down_and_requests_into_typed_failures() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let path = testkit::write_tiny_model(&testkit::TinySpec::default(), "compute-failure");
    let core = shard::ShardCore::load(shard::ShardConfig::in_process(path)).unwrap();
    let addr = rt.block_on(async {
        let config = tracker::TrackerConfig {
            health_period: Duration::from_millis(50),
            ..tracker::TrackerConfig::default()
        };
        let routes = vec![tracker::RouteSpec {
            name: "local".into(),
            shards: vec![Arc::new(shard::LocalShard::new(Arc::clone(&core)))],
        }];
        let t = tracker::Tracker::start(config, routes).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(t.serve(listener, std::future::pending()));
        addr
    });
    let body = json!({"prompt": "the", "max_tokens": 4, "temperature": 0});
    assert_eq!(post_json(&addr, "/v1/completions", &body).status, 200);
    assert_eq!(get(&addr, "/health").status, 200);
    core.inject_panic();
    let t = Instant::now();
    while get(&addr, "/health").status == 200 {
        assert!(t.elapsed() < Duration::from_secs(5), "health stayed ok");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = Instant::now();
    let r = post_json(&addr, "/v1/completions", &body);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["reason"], "shard_failed", "{}", r.body);
    let metrics = get(&addr, "/metrics").body;
    assert!(metrics.contains("strata_route_up{model="), "{metrics}");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("strata_route_up{") && l.ends_with(" 0")),
        "{metrics}"
    );
    drop(rt);
}
