//! `strata bench --url`: time to first token, per-stream and aggregate decode rates, and seam
//! latency per hop, measured against a running tracker over its HTTP API. Every figure is of
//! this run: the tracker's counters and histograms are read before and after, and the report
//! gives their differences. Progress goes to stderr as the run goes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use client::SseStream;
use serde_json::{json, Value};

/// What `strata bench --url` measures.
pub struct UrlBench<'a> {
    pub url: &'a str,
    /// Bearer key, when the tracker requires one (its `/metrics` and `/health` too).
    pub api_key: Option<&'a str>,
    pub concurrency: &'a [usize],
    pub requests: usize,
    pub prompt_tokens: &'a [usize],
    pub gen_tokens: usize,
    pub json: bool,
}

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

/// A scrape of `/metrics`: every series' value by its name and labels as written.
type Scrape = BTreeMap<String, f64>;

impl UrlBench<'_> {
    fn addr(&self) -> String {
        self.url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string()
    }

    fn headers(&self) -> Vec<(&'static str, String)> {
        self.api_key
            .map(|k| vec![("authorization", format!("Bearer {k}"))])
            .unwrap_or_default()
    }

    fn get(&self, path: &str) -> Result<client::Response> {
        let headers = self.headers();
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = client::request("GET", &self.addr(), path, None, &h)
            .with_context(|| format!("GET {path}"))?;
        if r.status != 200 && r.status != 503 {
            bail!("GET {path} answered {}: {}", r.status, r.body);
        }
        Ok(r)
    }

    fn scrape(&self) -> Result<Scrape> {
        Ok(parse_metrics(&self.get("/metrics")?.body))
    }

    /// A scrape whose shard series have caught up: the tracker polls each shard's counters
    /// (every health period, 500 ms by default), so a scrape right after a request can miss
    /// that request's last steps, which would then count in the next run. Scrapes 600 ms
    /// apart until the shard series agree (at most about 5 s).
    fn settled_scrape(&self) -> Result<Scrape> {
        let shard_series = |s: &Scrape| -> Vec<(String, f64)> {
            s.iter()
                .filter(|(k, _)| k.starts_with("strata_shard_"))
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        };
        let mut last = self.scrape()?;
        for _ in 0..8 {
            std::thread::sleep(Duration::from_millis(600));
            let now = self.scrape()?;
            if shard_series(&now) == shard_series(&last) {
                return Ok(now);
            }
            last = now;
        }
        Ok(last)
    }

    fn one_request(&self, prompt: &str) -> Result<Sample> {
        let body = json!({"prompt": prompt, "max_tokens": self.gen_tokens, "temperature": 0, "stream": true, "ignore_eos": true,
                          "stream_options": {"include_usage": true}});
        let headers = self.headers();
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let start = Instant::now();
        let mut s = SseStream::open_with(&self.addr(), "/v1/completions", &body, &h)?;
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
            // The usage chunk comes last, with no choices.
            let is_token = v["choices"]
                .get(0)
                .is_some_and(|c| c["finish_reason"].is_null());
            if is_token {
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

    /// `c` clients sending `requests` requests each, one after another.
    fn round(&self, prompt: &str, c: usize) -> Result<(Vec<Sample>, Duration)> {
        let t0 = Instant::now();
        let samples = std::thread::scope(|s| {
            let handles: Vec<_> = (0..c.max(1))
                .map(|_| {
                    s.spawn(|| {
                        (0..self.requests.max(1))
                            .map(|_| self.one_request(prompt))
                            .collect::<Result<Vec<_>>>()
                    })
                })
                .collect();
            let mut all = Vec::new();
            for h in handles {
                all.extend(
                    h.join()
                        .map_err(|_| anyhow::anyhow!("a bench client panicked"))??,
                );
            }
            Ok::<_, anyhow::Error>(all)
        })?;
        Ok((samples, t0.elapsed()))
    }
}

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)]
}

fn parse_metrics(text: &str) -> Scrape {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The value of one label in a series key.
fn label<'a>(series: &'a str, key: &str) -> Option<&'a str> {
    let labels = series.split_once('{')?.1.strip_suffix('}')?;
    labels
        .split(',')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"'))
}

/// What this run added to every series (counters and histograms; gauges as after).
fn delta(before: &Scrape, after: &Scrape) -> Scrape {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .collect()
}

/// The sum over every series of `name` (all labels).
fn total(s: &Scrape, name: &str) -> f64 {
    s.iter()
        .filter(|(k, _)| k.as_str() == name || k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

/// p50 and p99 (bucket bounds) of histogram `name` per `hop` label ("route" where it has
/// none), and the number of observations, from bucket counts.
fn quantiles(s: &Scrape, name: &str) -> Vec<(String, f64, f64, u64)> {
    let prefix = format!("{name}_bucket{{");
    let mut hops: BTreeMap<String, Vec<(f64, u64)>> = BTreeMap::new();
    for (series, count) in s {
        if !series.starts_with(&prefix) {
            continue;
        }
        let Some(le) = label(series, "le") else {
            continue;
        };
        let hop = label(series, "hop").unwrap_or("route").to_string();
        let le = le.parse().unwrap_or(f64::INFINITY);
        hops.entry(hop).or_default().push((le, *count as u64));
    }
    hops.into_iter()
        .map(|(hop, mut buckets)| {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            let n = buckets.iter().map(|b| b.1).max().unwrap_or(0);
            let q = |q: f64| {
                let target = (q * n as f64).ceil() as u64;
                buckets
                    .iter()
                    .find(|b| b.1 >= target)
                    .map_or(f64::INFINITY, |b| b.0)
            };
            (hop, q(0.5), q(0.99), n)
        })
        .collect()
}

fn row(prompt_tokens: usize, c: usize, samples: &[Sample], wall: Duration) -> Value {
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
    json!({
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_measured": samples.first().map_or(0, |s| s.n_prompt),
        "concurrency": c,
        "requests": samples.len(),
        "ttft_ms_p50": quantile(ttft.clone(), 0.5),
        "ttft_ms_p99": quantile(ttft, 0.99),
        "prefill_tps_p50": quantile(prefill, 0.5),
        "itl_ms_p50": quantile(gaps.clone(), 0.5),
        "itl_ms_p99": quantile(gaps, 0.99),
        "decode_tps_per_stream_p50": quantile(per_stream, 0.5),
        "aggregate_tps": total_tokens as f64 / wall.as_secs_f64(),
    })
}

pub fn run(b: UrlBench<'_>) -> Result<()> {
    let mut rows = Vec::new();
    let before = b.settled_scrape()?;
    for &n in b.prompt_tokens {
        // About `n` tokens of ordinary text.
        let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(n.div_ceil(10).max(1));
        eprintln!("bench: {n}-token prompts: warm-up request");
        b.one_request(&prompt)?;
        for &c in b.concurrency {
            eprintln!(
                "bench: {n}-token prompts, {c} concurrent, {} requests each, {} tokens per request ...",
                b.requests.max(1),
                b.gen_tokens
            );
            let (samples, wall) = b.round(&prompt, c)?;
            let r = row(n, c, &samples, wall);
            eprintln!(
                "bench:   done in {:.1} s: {:.1} t/s aggregate, ttft p50 {:.1} ms",
                wall.as_secs_f64(),
                r["aggregate_tps"].as_f64().unwrap_or(0.0),
                r["ttft_ms_p50"].as_f64().unwrap_or(0.0)
            );
            rows.push(r);
        }
    }
    let after = b.settled_scrape()?;
    let run = delta(&before, &after);
    let health = b.get("/health")?.json();
    report(&b, &rows, &run, &after, &health);
    Ok(())
}

/// Prints the rows and what the run added to the tracker's series (as a table, or JSON).
fn report(b: &UrlBench<'_>, rows: &[Value], run: &Scrape, now: &Scrape, health: &Value) {
    let summary = |name: &str| -> Vec<Value> {
        quantiles(run, name)
            .into_iter()
            .map(|(hop, p50, p99, n)| json!({"hop": hop, "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "n": n}))
            .collect()
    };
    let hops = summary("strata_seam_latency_seconds");
    let overhead = summary("strata_route_overhead_seconds");
    let shard_of = |s: &Scrape, name: &str, shard: &str| {
        s.get(&format!("{name}{{shard=\"{shard}\"}}"))
            .copied()
            .unwrap_or(0.0)
    };
    let shards: Vec<Value> = health["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let a = s["address"].as_str().unwrap_or("");
            json!({
                "address": a,
                "layers": s["layers"],
                "status": s["status"],
                "rss_bytes": shard_of(now, "strata_shard_rss_bytes", a),
                "weight_bytes": shard_of(now, "strata_shard_weight_bytes", a),
                "kv_bytes": shard_of(now, "strata_shard_kv_bytes", a),
                "run_prefill_tokens": shard_of(run, "strata_shard_prefill_tokens_total", a),
                "run_decode_tokens": shard_of(run, "strata_shard_decode_tokens_total", a),
            })
        })
        .collect();
    let counts = json!({
        "route_failures": total(run, "strata_failures_total"),
        "refusals": total(run, "strata_refusals_total"),
        "request_failures": total(run, "strata_request_failures_total"),
        "requests": total(run, "strata_requests_total"),
        "drafted_tokens": total(run, "strata_spec_drafted_tokens_total"),
        "accepted_tokens": total(run, "strata_spec_accepted_tokens_total"),
        "verification_steps": total(run, "strata_spec_accepted_length_count"),
    });
    if b.json {
        println!(
            "{}",
            json!({"url": b.url, "gen_tokens": b.gen_tokens, "runs": rows, "seam": hops, "route_overhead": overhead, "shards": shards, "run_counts": counts})
        );
        return;
    }
    println!("| prompt tokens | concurrency | requests | ttft p50 ms | ttft p99 ms | prefill t/s (p50, from ttft) | itl p50 ms | itl p99 ms | decode t/s per stream (p50) | aggregate t/s |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    for r in rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r["prompt_tokens_measured"],
            r["concurrency"],
            r["requests"],
            f(r, "ttft_ms_p50"),
            f(r, "ttft_ms_p99"),
            f(r, "prefill_tps_p50"),
            f(r, "itl_ms_p50"),
            f(r, "itl_ms_p99"),
            f(r, "decode_tps_per_stream_p50"),
            f(r, "aggregate_tps")
        );
    }
    println!("\nmessaging per step during this run: the route's round trip less the time shards held the step, and each seam's round trip (bucket bounds, from the tracker's histograms):");
    for h in overhead.iter().chain(&hops) {
        println!(
            "  {}: p50 <= {:.2} ms, p99 <= {:.2} ms over {} samples",
            h["hop"].as_str().unwrap_or(""),
            f(h, "p50_ms"),
            f(h, "p99_ms"),
            h["n"]
        );
    }
    let mib = |b: f64| b / (1 << 20) as f64;
    for s in &shards {
        println!(
            "  shard {} layers {}: {}, rss {:.1} MiB, weights {:.1} MiB, kv in use {:.1} MiB; this run: prefill {} / decode {} tokens",
            s["address"].as_str().unwrap_or(""),
            s["layers"].as_str().unwrap_or(""),
            s["status"].as_str().unwrap_or(""),
            mib(f(s, "rss_bytes")),
            mib(f(s, "weight_bytes")),
            mib(f(s, "kv_bytes")),
            f(s, "run_prefill_tokens"),
            f(s, "run_decode_tokens"),
        );
    }
    print_speculation(&counts);
    println!(
        "  this run: {} requests, {} refusals, {} request failures, {} route failures; queue depth now {}; tracker rss {:.1} MiB",
        f(&counts, "requests"),
        f(&counts, "refusals"),
        f(&counts, "request_failures"),
        f(&counts, "route_failures"),
        total(now, "strata_queue_depth"),
        mib(total(now, "process_resident_memory_bytes")),
    );
}

/// What speculation drafted and kept during the run, when the route speculated.
fn print_speculation(counts: &Value) {
    let f = |k: &str| counts[k].as_f64().unwrap_or(0.0);
    let drafted = f("drafted_tokens");
    if drafted > 0.0 {
        let accepted = f("accepted_tokens");
        let steps = f("verification_steps").max(1.0);
        println!(
            "  speculation this run: {drafted} tokens drafted, {accepted} kept ({:.0}%), {:.2} kept per verification step",
            100.0 * accepted / drafted,
            accepted / steps,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_reports_what_it_added_to_counters_and_histograms() {
        let before = parse_metrics(
            "# TYPE x counter\nx_total{shard=\"a\"} 5\nh_bucket{hop=\"a->b\",le=\"0.001\"} 2\nh_bucket{hop=\"a->b\",le=\"0.01\"} 4\nh_bucket{hop=\"a->b\",le=\"+Inf\"} 4\n",
        );
        let after = parse_metrics(
            "x_total{shard=\"a\"} 9\nh_bucket{hop=\"a->b\",le=\"0.001\"} 2\nh_bucket{hop=\"a->b\",le=\"0.01\"} 7\nh_bucket{hop=\"a->b\",le=\"+Inf\"} 8\n",
        );
        let run = delta(&before, &after);
        assert_eq!(total(&run, "x_total"), 4.0);
        // This run's four observations: three at most 10 ms, one above.
        assert_eq!(
            quantiles(&run, "h"),
            vec![("a->b".to_string(), 0.01, f64::INFINITY, 4)]
        );
    }
}
