//! `strata bench --url`: time to first token, per-stream and aggregate decode rates, and seam
//! latency per hop, measured against a running tracker over its HTTP API.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use client::SseStream;
use serde_json::{json, Value};

/// One streamed request's timings.
struct Sample {
    start: Instant,
    first: Instant,
    last: Instant,
    n_tokens: usize,
    n_prompt: usize,
    /// Seconds between consecutive tokens.
    gaps: Vec<f64>,
}

fn one_request(addr: &str, prompt: &str, gen_tokens: usize) -> Result<Sample> {
    let body = json!({"prompt": prompt, "max_tokens": gen_tokens, "temperature": 0, "stream": true, "ignore_eos": true});
    let start = Instant::now();
    let mut s = SseStream::open(addr, "/v1/completions", &body)?;
    if s.status != 200 {
        bail!("the tracker answered {}", s.status);
    }
    let (mut first, mut last, mut n, mut n_prompt, mut gaps) = (None, start, 0, 0, Vec::new());
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&d)?;
        if v.get("error").is_some() {
            bail!("the request failed: {d}");
        }
        if v["choices"][0]["finish_reason"].is_null() {
            let now = Instant::now();
            if first.is_some() {
                gaps.push((now - last).as_secs_f64());
            }
            first.get_or_insert(now);
            last = now;
            n += 1;
        }
        if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
            n_prompt = p as usize;
        }
    }
    Ok(Sample {
        start,
        first: first.unwrap_or(last),
        last,
        n_tokens: n,
        n_prompt,
        gaps,
    })
}

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
}

/// The value of a per-shard gauge from the metrics text.
fn shard_gauge(metrics: &str, name: &str, shard: &str) -> f64 {
    let key = format!("{name}{{shard=\"{shard}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// p50 and p99 of histogram `name` per `hop` label ("route" where it has none), from the
/// buckets.
fn quantiles(metrics: &str, name: &str) -> Vec<(String, f64, f64, u64)> {
    let prefix = format!("{name}_bucket{{");
    let mut hops: Vec<(String, Vec<(f64, u64)>)> = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(prefix.as_str()) else {
            continue;
        };
        let Some((labels, count)) = rest.split_once("} ") else {
            continue;
        };
        let label = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(k)?.strip_prefix("=\"")?.strip_suffix('"'))
        };
        let Some(le) = label("le") else {
            continue;
        };
        let hop = label("hop").unwrap_or("route");
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::INFINITY)
        };
        let count = count.trim().parse().unwrap_or(0);
        match hops.iter_mut().find(|(h, _)| h == hop) {
            Some((_, b)) => b.push((le, count)),
            None => hops.push((hop.to_string(), vec![(le, count)])),
        }
    }
    hops.into_iter()
        .map(|(hop, buckets)| {
            let total = buckets.iter().map(|b| b.1).max().unwrap_or(0);
            let q = |q: f64| {
                let target = (q * total as f64).ceil() as u64;
                buckets
                    .iter()
                    .find(|b| b.1 >= target)
                    .map_or(f64::INFINITY, |b| b.0)
            };
            (hop, q(0.5), q(0.99), total)
        })
        .collect()
}

pub fn run(
    url: &str,
    concurrency: &[usize],
    requests: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    as_json: bool,
) -> Result<()> {
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    // About `prompt_tokens` tokens of ordinary text.
    let prompt =
        "The quick brown fox jumps over the lazy dog. ".repeat(prompt_tokens.div_ceil(10).max(1));
    one_request(&addr, &prompt, 4)?; // warm-up
    let mut rows = Vec::new();
    for &c in concurrency {
        let t0 = Instant::now();
        let handles: Vec<_> = (0..c.max(1))
            .map(|_| {
                let (addr, prompt) = (addr.clone(), prompt.clone());
                std::thread::spawn(move || {
                    (0..requests.max(1))
                        .map(|_| one_request(&addr, &prompt, gen_tokens))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        let mut samples = Vec::new();
        for h in handles {
            samples.extend(
                h.join()
                    .map_err(|_| anyhow::anyhow!("a bench client panicked"))??,
            );
        }
        let wall = t0.elapsed();
        let ttft: Vec<f64> = samples
            .iter()
            .map(|s| (s.first - s.start).as_secs_f64() * 1e3)
            .collect();
        let per_stream: Vec<f64> = samples
            .iter()
            .filter(|s| s.n_tokens > 1)
            .map(|s| {
                (s.n_tokens - 1) as f64
                    / (s.last - s.first)
                        .max(Duration::from_micros(1))
                        .as_secs_f64()
            })
            .collect();
        let total_tokens: usize = samples.iter().map(|s| s.n_tokens).sum();
        let gaps: Vec<f64> = samples
            .iter()
            .flat_map(|s| s.gaps.iter().map(|g| g * 1e3))
            .collect();
        let prefill: Vec<f64> = samples
            .iter()
            .map(|s| {
                s.n_prompt as f64
                    / (s.first - s.start)
                        .max(Duration::from_micros(1))
                        .as_secs_f64()
            })
            .collect();
        rows.push(json!({
            "itl_ms_p50": quantile(gaps.clone(), 0.5),
            "itl_ms_p99": quantile(gaps, 0.99),
            "prefill_tps_p50": quantile(prefill, 0.5),
            "concurrency": c,
            "requests": samples.len(),
            "ttft_ms_p50": quantile(ttft.clone(), 0.5),
            "ttft_ms_p99": quantile(ttft, 0.99),
            "decode_tps_per_stream_p50": quantile(per_stream, 0.5),
            "aggregate_tps": total_tokens as f64 / wall.as_secs_f64(),
        }));
    }
    let metrics = client::get(&addr, "/metrics").body;
    let summary = |name: &str| -> Vec<Value> {
        quantiles(&metrics, name)
            .into_iter()
            .map(|(hop, p50, p99, n)| json!({"hop": hop, "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "n": n}))
            .collect()
    };
    let hops = summary("strata_seam_latency_seconds");
    let overhead = summary("strata_route_overhead_seconds");
    let health = client::get(&addr, "/health").json();
    if as_json {
        println!(
            "{}",
            json!({"url": url, "gen_tokens": gen_tokens, "runs": rows, "seam": hops, "route_overhead": overhead, "shards": health["shards"]})
        );
        return Ok(());
    }
    println!("| concurrency | requests | ttft p50 ms | ttft p99 ms | prefill t/s (p50, from ttft) | itl p50 ms | itl p99 ms | decode t/s per stream (p50) | aggregate t/s |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r["concurrency"],
            r["requests"],
            r["ttft_ms_p50"].as_f64().unwrap_or(0.0),
            r["ttft_ms_p99"].as_f64().unwrap_or(0.0),
            r["prefill_tps_p50"].as_f64().unwrap_or(0.0),
            r["itl_ms_p50"].as_f64().unwrap_or(0.0),
            r["itl_ms_p99"].as_f64().unwrap_or(0.0),
            r["decode_tps_per_stream_p50"].as_f64().unwrap_or(0.0),
            r["aggregate_tps"].as_f64().unwrap_or(0.0)
        );
    }
    println!("\nmessaging per step: the route's round trip less the time shards held the step, and each seam's round trip (bucket bounds, from the tracker's histograms):");
    for h in overhead.iter().chain(&hops) {
        println!(
            "  {}: p50 <= {:.2} ms, p99 <= {:.2} ms over {} samples",
            h["hop"].as_str().unwrap_or(""),
            h["p50_ms"].as_f64().unwrap_or(0.0),
            h["p99_ms"].as_f64().unwrap_or(0.0),
            h["n"]
        );
    }
    let mib = |b: f64| b / (1 << 20) as f64;
    for s in health["shards"].as_array().into_iter().flatten() {
        let a = s["address"].as_str().unwrap_or("");
        println!(
            "  shard {a} layers {}: {}, rss {:.1} MiB, weights {:.1} MiB, kv in use {:.1} MiB, prefill {} / decode {} tokens",
            s["layers"].as_str().unwrap_or(""),
            s["status"].as_str().unwrap_or(""),
            mib(shard_gauge(&metrics, "strata_shard_rss_bytes", a)),
            mib(shard_gauge(&metrics, "strata_shard_weight_bytes", a)),
            mib(shard_gauge(&metrics, "strata_shard_kv_bytes", a)),
            shard_gauge(&metrics, "strata_shard_prefill_tokens_total", a),
            shard_gauge(&metrics, "strata_shard_decode_tokens_total", a),
        );
    }
    let counter = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    println!(
        "  queue depth now {}, route failures {}, refusals {}",
        counter("strata_queue_depth"),
        counter("strata_failures_total"),
        counter("strata_refusals_total")
    );
    let tracker_rss = metrics
        .lines()
        .find_map(|l| l.strip_prefix("strata_tracker_rss_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    println!("  tracker rss {:.1} MiB", mib(tracker_rss));
    Ok(())
}
