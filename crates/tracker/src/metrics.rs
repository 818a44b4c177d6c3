//! A small Prometheus registry: counters, gauges and fixed-bucket histograms, rendered in the
//! text exposition format. One lock around the whole registry; updates are rare and tiny.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

type Labels = Vec<(&'static str, String)>;

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    /// The smallest bucket bound below which `q` of the observations fall.
    fn quantile(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let target = (q * self.count as f64).ceil() as u64;
        for (i, c) in self.counts.iter().enumerate() {
            if *c >= target {
                return self.bounds[i];
            }
        }
        f64::INFINITY
    }
}

#[derive(Debug, Default)]
struct Inner {
    help: BTreeMap<&'static str, (&'static str, &'static str)>,
    counters: BTreeMap<(&'static str, Labels), f64>,
    gauges: BTreeMap<(&'static str, Labels), f64>,
    histograms: BTreeMap<(&'static str, Labels), Histogram>,
}

/// Buckets for latencies in seconds.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
];
/// Buckets for token counts of a request (prompt or generation).
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    32768.0,
];
/// Buckets for counts (rows or sessions per step).
pub const COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

/// The registry, or a scoped view of it whose every series carries extra labels.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Arc<Mutex<Inner>>,
    /// Labels appended to every series updated through this view.
    scope: Labels,
}

impl Metrics {
    /// A view of the same registry that appends `extra` labels (e.g. model and route) to
    /// every series it updates.
    pub fn scoped(&self, extra: &[(&'static str, &str)]) -> Metrics {
        let mut scope = self.scope.clone();
        scope.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        Metrics {
            inner: Arc::clone(&self.inner),
            scope,
        }
    }

    fn labels(&self, l: &[(&'static str, &str)]) -> Labels {
        let mut v: Labels = l.iter().map(|(k, v)| (*k, v.to_string())).collect();
        v.extend(self.scope.iter().cloned());
        v
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g)
    }

    /// Declares a metric so it is exported (at zero) before its first update.
    pub fn describe(&self, name: &'static str, kind: &'static str, help: &'static str) {
        self.with(|m| {
            m.help.insert(name, (kind, help));
        });
    }

    pub fn inc(&self, name: &'static str, l: &[(&'static str, &str)], by: f64) {
        let l = self.labels(l);
        self.with(|m| *m.counters.entry((name, l)).or_insert(0.0) += by);
    }

    pub fn set(&self, name: &'static str, l: &[(&'static str, &str)], v: f64) {
        let l = self.labels(l);
        self.with(|m| {
            m.gauges.insert((name, l), v);
        });
    }

    pub fn observe(
        &self,
        name: &'static str,
        l: &[(&'static str, &str)],
        bounds: &'static [f64],
        v: f64,
    ) {
        let l = self.labels(l);
        self.with(|m| {
            m.histograms
                .entry((name, l))
                .or_insert_with(|| Histogram {
                    bounds,
                    counts: vec![0; bounds.len()],
                    sum: 0.0,
                    count: 0,
                })
                .observe(v)
        });
    }

    /// Drops the series that carry all of this view's scope labels (a retired route's), so
    /// `/metrics` holds what is live, not every route there ever was. Its counters are not
    /// lost: each is added into the same series without the `route` label (one per model and
    /// other labels, however many routes come and go), so totals never go back.
    pub fn forget_scope(&self) {
        let scope = self.scope.clone();
        let ours = move |l: &Labels| scope.iter().all(|p| l.contains(p));
        self.with(|m| {
            let mut folded: Vec<((&'static str, Labels), f64)> = Vec::new();
            m.counters.retain(|(name, l), v| {
                if !ours(l) {
                    return true;
                }
                let rest: Labels = l.iter().filter(|(k, _)| *k != "route").cloned().collect();
                folded.push(((*name, rest), *v));
                false
            });
            for (key, v) in folded {
                *m.counters.entry(key).or_insert(0.0) += v;
            }
        });
        let scope = self.scope.clone();
        self.forget_where(move |l| scope.iter().all(|p| l.contains(p)));
    }

    /// Removes every series labelled `key="value"` that no route's scope labels (a departed
    /// shard's, as its route's health monitor set them; a route's own series go with
    /// [`Metrics::forget_scope`]).
    pub fn forget_unscoped(&self, key: &'static str, value: &str) {
        let pair = (key, value.to_string());
        self.forget_where(move |l| l.contains(&pair) && !l.iter().any(|(k, _)| *k == "route"));
    }

    fn forget_where(&self, gone: impl Fn(&Labels) -> bool) {
        self.with(|m| {
            m.counters.retain(|(_, l), _| !gone(l));
            m.gauges.retain(|(_, l), _| !gone(l));
            m.histograms.retain(|(_, l), _| !gone(l));
        });
    }

    /// How many series the registry holds (every label set of every metric).
    pub fn n_series(&self) -> usize {
        self.with(|m| m.counters.len() + m.gauges.len() + m.histograms.len())
    }

    /// Quantile `q` of a histogram (bucket upper bound), or `None` if it has no observations.
    pub fn quantile(&self, name: &'static str, l: &[(&'static str, &str)], q: f64) -> Option<f64> {
        let l = self.labels(l);
        self.with(|m| {
            m.histograms
                .get(&(name, l))
                .filter(|h| h.count > 0)
                .map(|h| h.quantile(q))
        })
    }

    pub fn render(&self) -> String {
        self.with(|m| {
            let mut out = String::new();
            let fmt_labels = |l: &Labels, extra: Option<(&str, String)>| {
                let mut parts: Vec<String> = l
                    .iter()
                    .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                    .collect();
                if let Some((k, v)) = extra {
                    parts.push(format!("{k}=\"{v}\""));
                }
                if parts.is_empty() {
                    String::new()
                } else {
                    format!("{{{}}}", parts.join(","))
                }
            };
            for (name, (kind, help)) in &m.help {
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} {kind}");
                let mut any = false;
                for ((n, l), v) in m.counters.iter().chain(m.gauges.iter()) {
                    if n == name {
                        any = true;
                        let _ = writeln!(out, "{name}{} {v}", fmt_labels(l, None));
                    }
                }
                for ((n, l), h) in &m.histograms {
                    if n != name {
                        continue;
                    }
                    any = true;
                    for (b, c) in h.bounds.iter().zip(&h.counts) {
                        let _ = writeln!(
                            out,
                            "{name}_bucket{} {c}",
                            fmt_labels(l, Some(("le", b.to_string())))
                        );
                    }
                    let _ = writeln!(
                        out,
                        "{name}_bucket{} {}",
                        fmt_labels(l, Some(("le", "+Inf".into()))),
                        h.count
                    );
                    let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(l, None), h.sum);
                    let _ = writeln!(out, "{name}_count{} {}", fmt_labels(l, None), h.count);
                }
                if !any && *kind != "histogram" {
                    let _ = writeln!(out, "{name} 0");
                }
            }
            out
        })
    }
}

/// Declares every metric the tracker exports (with its type and help), so each is exported
/// from the start, and sets the ones known at start.
///
/// A data table, one entry per metric, left whole on purpose: split across functions it would
/// be harder to see which metrics exist, and it has no logic to test in parts.
pub fn declare(m: &Metrics) {
    for (name, kind, help) in [
        (
            "strata_requests_total",
            "counter",
            "requests by how they ended: status ok, cancelled (the client went away), or the reason of the refusal or failure",
        ),
        (
            "strata_request_duration_seconds",
            "histogram",
            "end-to-end time of a request, from its arrival to the end of its answer, by status and priority",
        ),
        (
            "strata_request_prompt_tokens",
            "histogram",
            "prompt tokens of answered requests",
        ),
        (
            "strata_request_generation_tokens",
            "histogram",
            "generated tokens of answered requests",
        ),
        (
            "strata_finished_requests_total",
            "counter",
            "answered requests by finish_reason",
        ),
        (
            "strata_refusals_total",
            "counter",
            "refusals by reason and class",
        ),
        ("strata_failures_total", "counter", "route failures by kind"),
        (
            "strata_request_failures_total",
            "counter",
            "requests that failed (not refused) by reason and priority: a shard lost, a recipe that no longer matches",
        ),
        (
            "strata_cancelled_total",
            "counter",
            "sessions cancelled by their client",
        ),
        (
            "strata_replays_total",
            "counter",
            "sessions recomputed after a shard lost their cache",
        ),
        (
            "strata_prefill_tokens_total",
            "counter",
            "prompt tokens computed",
        ),
        (
            "strata_decode_tokens_total",
            "counter",
            "positions computed in decode steps (with the drafted ones of verification steps)",
        ),
        (
            "strata_pipelined_chunks_total",
            "counter",
            "prompt chunks sent down a route while an earlier chunk of their session was still on it (pipelined prefill, the default; --no-pipeline-prefill turns it off)",
        ),
        (
            "strata_spec_drafted_tokens_total",
            "counter",
            "tokens drafted for verification steps, by drafter",
        ),
        (
            "strata_spec_accepted_tokens_total",
            "counter",
            "drafted tokens verification kept (equal to the route's own samples), by drafter",
        ),
        (
            "strata_spec_accepted_length",
            "histogram",
            "drafted tokens kept per verification step, by drafter",
        ),
        (
            "strata_prompt_cached_tokens_total",
            "counter",
            "prompt tokens a route took from its shards' prefix cache instead of computing them",
        ),
        (
            "strata_prefix_lookups_total",
            "counter",
            "finished sessions whose prompt held a whole KV block, by whether they started on cached blocks (hit) or computed every one (miss)",
        ),
        ("strata_ttft_seconds", "histogram", "time to first token"),
        (
            "strata_migrations_total",
            "counter",
            "sessions moved off a failed, draining or departed route to another route of their model, by reason",
        ),
        (
            "strata_sessions_lost_total",
            "counter",
            "sessions of a failed route whose clients got its error, by why: no route of their model took them within the failover wait (no_route_in_time), it could not move (unplaced: no replica, or nothing more to generate), a session blamed for too many route failures (moves_spent), or a failure that is not one to move on (final)",
        ),
        (
            "strata_registry_connected",
            "gauge",
            "1 while the tracker's watch on the registry is live (0: membership frozen as last seen)",
        ),
        (
            "strata_registry_members",
            "gauge",
            "shards announced in the registry, as last seen",
        ),
        (
            "strata_registry_rejected_total",
            "counter",
            "registry entries not taken as members, by reason: too_long, malformed, impossible_range, wrong_key (counted each time one is read), or join_failed (a chain of announced shards that did not become a route)",
        ),
        (
            "strata_migrated_tokens_total",
            "counter",
            "tokens replayed on the route a session moved to (its prompt and what it had generated)",
        ),
        (
            "strata_migration_seconds",
            "histogram",
            "time from a route's failure to a moved session's first token on its new route",
        ),
        (
            "strata_inter_token_seconds",
            "histogram",
            "time between consecutive tokens of a session",
        ),
        ("strata_batch_tokens", "histogram", "tokens per step"),
        (
            "strata_batch_sessions",
            "histogram",
            "sessions per step (batch occupancy)",
        ),
        (
            "strata_seam_latency_seconds",
            "histogram",
            "round trip across a seam as its sending shard measured it: a step to the next shard and back its acknowledgement, less the time the next shard held the step",
        ),
        (
            "strata_route_token_interval_seconds",
            "gauge",
            "the route's measured time per token, by which new sessions choose among routes: the least round trip of its last 16 answered steps that carried one token of one session, alone on the route (its last value; route choice forgets it 30 s after the last such step)",
        ),
        (
            "strata_route_predicted_token_seconds",
            "gauge",
            "the route's time per token predicted from its parts, beside the measured strata_route_token_interval_seconds: the sum of its shards' own times per token (each shard's least compute of its recent one-position steps, over every route it serves) and the route's least messaging of the same steps (round trip less the time the shards held them)",
        ),
        (
            "strata_route_overhead_seconds",
            "histogram",
            "messaging time of a step: its round trip from the tracker less the time the shards held it",
        ),
        (
            "strata_seam_bytes_total",
            "counter",
            "activation bytes sent per hop",
        ),
        (
            "strata_shard_step_seconds",
            "histogram",
            "compute time per shard and step",
        ),
        (
            "strata_queue_depth",
            "gauge",
            "sessions admitted and waiting for a place on the route, by priority",
        ),
        (
            "strata_queue_wait_seconds",
            "histogram",
            "time from admission to a session's first step, by priority",
        ),
        (
            "strata_active_sessions",
            "gauge",
            "sessions on the route, by priority",
        ),
        (
            "strata_admission_kv_reserved_bytes",
            "gauge",
            "KV bytes admitted sessions reserved on each shard",
        ),
        (
            "strata_admission_kv_budget_bytes",
            "gauge",
            "KV budget of each shard as admission counts it",
        ),
        (
            "strata_steps_in_flight",
            "gauge",
            "steps (micro-batches) sent down the route and not yet answered",
        ),
        (
            "strata_route_up",
            "gauge",
            "1 when the route takes work: open end to end and every shard answering as validated (what /health reports)",
        ),
        (
            "strata_shard_kv_usage_ratio",
            "gauge",
            "KV bytes in use over the KV budget, per shard",
        ),
        (
            "strata_build_info",
            "gauge",
            "1, labelled with the build's version and wire protocol",
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "resident memory of the tracker process",
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "virtual memory of the tracker process",
        ),
        (
            "process_cpu_seconds_total",
            "counter",
            "CPU time (user and system) the tracker process used",
        ),
        (
            "process_open_fds",
            "gauge",
            "file descriptors the tracker process holds",
        ),
        (
            "process_max_fds",
            "gauge",
            "the tracker process's soft limit of file descriptors",
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "when the tracker process started, in seconds since the Unix epoch",
        ),
        (
            "strata_shard_pool_bytes",
            "gauge",
            "use of each shard pool (weights, kv, scratch of the last step, inflight)",
        ),
        (
            "strata_shard_pool_budget_bytes",
            "gauge",
            "budget of each shard pool",
        ),
        (
            "strata_model_resident",
            "gauge",
            "1 for each model resident on a route (models load only at start)",
        ),
        (
            "strata_evictions_total",
            "counter",
            "models evicted from a route by the operator (pinned models never are)",
        ),
        ("strata_route_epoch", "gauge", "current route epoch"),
        (
            "strata_swaps_total",
            "counter",
            "model loads triggered while serving (always 0)",
        ),
        (
            "strata_tracker_rss_bytes",
            "gauge",
            "tracker resident memory",
        ),
        ("strata_shard_up", "gauge", "1 when the shard answers"),
        (
            "strata_shard_prefill_tokens_total",
            "counter",
            "prompt tokens a shard computed",
        ),
        (
            "strata_shard_decode_tokens_total",
            "counter",
            "tokens a shard decoded",
        ),
        ("strata_shard_steps_total", "counter", "steps a shard ran"),
        (
            "strata_shard_prefix_reused_tokens_total",
            "counter",
            "prompt positions a shard took from its prefix cache instead of computing them",
        ),
        (
            "strata_shard_kernel_thread_moves_total",
            "counter",
            "times a shard's kernel thread was woken onto the CPU of the thread handing it work and moved to another",
        ),
        (
            "strata_shard_early_steps_total",
            "counter",
            "decode steps a route's first shard started on the last shard's token hint before the tracker's step arrived (outcome: started, used as the tracker's step, discarded)",
        ),
        (
            "strata_shard_kv_blocks_idle",
            "gauge",
            "cached prefix blocks no session holds (free room, kept for later prompts)",
        ),
        (
            "strata_shard_kv_bytes",
            "gauge",
            "KV bytes in use per shard",
        ),
        (
            "strata_shard_kv_budget_bytes",
            "gauge",
            "KV byte budget per shard",
        ),
        (
            "strata_shard_kv_blocks",
            "gauge",
            "KV blocks held by sessions per shard",
        ),
        (
            "strata_shard_kv_blocks_capacity",
            "gauge",
            "KV blocks the pool's budget holds per shard",
        ),
        ("strata_shard_sessions", "gauge", "sessions held per shard"),
        (
            "strata_shard_rss_bytes",
            "gauge",
            "resident memory per shard",
        ),
        (
            "strata_shard_weight_bytes",
            "gauge",
            "weight bytes per shard",
        ),
        (
            "strata_shard_seam_bytes_out_total",
            "counter",
            "activation bytes a shard sent downstream",
        ),
    ] {
        m.describe(name, kind, help);
    }
    m.set(
        "strata_build_info",
        &[
            ("version", env!("CARGO_PKG_VERSION")),
            ("protocol", &proto::PROTOCOL_VERSION.to_string()),
        ],
        1.0,
    );
    // Both refusal classes exist from the start, for every priority class.
    for p in engine::Priority::ALL {
        for reason in [engine::Reason::Capacity, engine::Reason::Budget] {
            m.inc(
                "strata_refusals_total",
                &[
                    ("reason", reason.name()),
                    ("class", reason.class().name()),
                    ("priority", p.name()),
                ],
                0.0,
            );
        }
    }
}

/// Sets the standard `process_*` metrics of this process from Linux's `/proc/self` (nothing
/// elsewhere).
pub fn observe_process(m: &Metrics) {
    let (_, rss) = proto::rss_bytes();
    m.set("process_resident_memory_bytes", &[], rss as f64);
    m.set("strata_tracker_rss_bytes", &[], rss as f64);
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command name (which is in parentheses and may hold spaces).
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        let field = |n: usize| fields.get(n).and_then(|v| v.parse::<f64>().ok());
        // utime and stime are fields 14 and 15 of stat(5), the start time 22, vsize 23;
        // `fields` starts at field 3.
        if let (Some(user), Some(system)) = (field(11), field(12)) {
            m.set("process_cpu_seconds_total", &[], (user + system) / ticks);
        }
        if let Some(vsize) = field(20) {
            m.set("process_virtual_memory_bytes", &[], vsize);
        }
        let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        });
        if let (Some(start), Some(boot)) = (field(19), boot) {
            m.set("process_start_time_seconds", &[], boot + start / ticks);
        }
    }
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        m.set("process_open_fds", &[], dir.count() as f64);
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        m.set("process_max_fds", &[], lim.rlim_cur as f64);
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forgotten_route_leaves_its_counts_to_its_model_and_nothing_else() {
        let m = Metrics::default();
        for route in ["a~1", "a~2", "a~3"] {
            let r = m.scoped(&[("model", "m"), ("route", route)]);
            r.inc("strata_migrations_total", &[("reason", "draining")], 2.0);
            r.set("strata_route_up", &[], 1.0);
            r.observe("strata_ttft_seconds", &[], LATENCY_BUCKETS, 0.1);
            r.forget_scope();
        }
        let live = m.scoped(&[("model", "m"), ("route", "a~4")]);
        live.set("strata_route_up", &[], 1.0);
        // Three retired routes: one folded counter, no gauge or histogram of theirs.
        assert_eq!(m.n_series(), 2);
        let text = {
            m.describe("strata_migrations_total", "counter", "x");
            m.describe("strata_route_up", "gauge", "x");
            m.render()
        };
        assert!(
            text.contains("strata_migrations_total{reason=\"draining\",model=\"m\"} 6"),
            "{text}"
        );
        assert!(!text.contains("a~1") && text.contains("a~4"), "{text}");
    }

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let m = Metrics::default();
        m.describe("strata_x_total", "counter", "x");
        m.describe("strata_lat_seconds", "histogram", "lat");
        m.describe("strata_never_total", "counter", "declared only");
        m.inc("strata_x_total", &[("reason", "capacity")], 2.0);
        for v in [0.001, 0.002, 0.5] {
            m.observe("strata_lat_seconds", &[], LATENCY_BUCKETS, v);
        }
        let text = m.render();
        assert!(
            text.contains("strata_x_total{reason=\"capacity\"} 2"),
            "{text}"
        );
        assert!(text.contains("strata_lat_seconds_count 3"));
        assert!(text.contains("strata_lat_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("strata_never_total 0"));
        assert_eq!(m.quantile("strata_lat_seconds", &[], 0.5), Some(0.002));
    }
}
