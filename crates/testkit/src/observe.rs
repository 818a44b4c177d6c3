//! Reading a running tracker the way an operator does: `/metrics` and `/health`.

use crate::http::get;

/// A tracker metric summed over its series (each route's carries model and route labels).
pub fn tracker_metric(addr: &str, name: &str) -> f64 {
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .sum()
}

/// A tracker metric summed over the series whose labels contain `label` (`key="value"`).
pub fn tracker_metric_with(addr: &str, name: &str, label: &str) -> f64 {
    get(addr, "/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .sum()
}

/// A shard metric (labelled with the shard's address) summed over its series.
pub fn shard_metric(addr: &str, name: &str, shard: &str) -> f64 {
    tracker_metric_with(addr, name, &format!("shard=\"{shard}\""))
}

/// A numeric field of one shard's entry in `/health` (`None` when the shard or field is
/// missing).
pub fn shard_stat(addr: &str, shard: &str, field: &str) -> Option<u64> {
    get(addr, "/health").json()["shards"]
        .as_array()?
        .iter()
        .find(|s| s["address"] == shard)
        .and_then(|s| s[field].as_u64())
}

/// Whether `f` holds within `limit`, asked every 50 ms.
pub fn wait_until(limit: std::time::Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = std::time::Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    false
}
