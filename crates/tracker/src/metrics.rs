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

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

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
