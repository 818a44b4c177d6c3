//! A route's measured time per token, for choosing among a model's routes ([`Pace`]).
//!
//! What a session waits for each token on a route is the round trip of the step carrying it.
//! Measured on every step, that swings with whatever else the step carries (another session's
//! prompt chunk makes it many times longer, more sessions make it longer) and with the steps
//! queued before it, so two equal routes can measure far apart. A [`Pace`] keeps only steps
//! that carried one token of one session, sent while no other step was on the route, and
//! takes the least of the last [`WINDOW`] of them: the route's own speed (its shards' compute
//! and its links), which load only ever adds to. A busy route has no such step and so no pace
//! after [`STALE`]: load alone places sessions there, as it does on an unmeasured route. A
//! route avoided for being slow is likewise measured afresh once its pace is stale. A step
//! refused or failed is no measure. What remains in a sample besides the route is its one
//! session's own cost (its context's attention, its grammar), which a route of long sessions
//! pays on every step too.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Decode steps a pace remembers.
pub const WINDOW: usize = 16;

/// How long a pace stands without a new decode step.
pub const STALE: Duration = Duration::from_secs(30);

/// A route more than this many times slower than the fastest of its model is slow: new
/// sessions go to it only when every faster route refuses them. Three, not less: routes
/// sharing a host's cores measure up to twice apart while one of them computes a prompt, and
/// such routes must keep sharing the load (a link of 20 ms each way makes a 10 ms route's
/// tokens five times slower).
pub const SLOW_FACTOR: f64 = 3.0;

/// ... and more than this many seconds a token slower: between fast routes a few milliseconds
/// are noise (a route of 2 ms against one of 0.5 ms is not worth leaving idle).
pub const SLOW_GAP: f64 = 0.010;

/// One route's recent lone one-token steps' round trips. Written by the route's loop, read by every
/// request choosing a route.
#[derive(Debug, Default)]
pub struct Pace(Mutex<Window>);

#[derive(Debug, Default)]
struct Window {
    seconds: VecDeque<f64>,
    /// The same steps' messaging: each round trip less the time the shards held the step.
    messaging: VecDeque<f64>,
    last: Option<Instant>,
}

fn push(window: &mut VecDeque<f64>, v: f64) {
    if window.len() == WINDOW {
        window.pop_front();
    }
    window.push_back(v);
}

impl Pace {
    /// A lone one-token step's round trip, `seconds`, seen at `now`.
    pub fn observe(&self, seconds: f64, now: Instant) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        push(&mut w.seconds, seconds);
        w.last = Some(now);
    }

    /// The messaging of the same step: its round trip less the time its shards held it.
    pub fn observe_messaging(&self, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        push(&mut w.messaging, seconds);
    }

    /// The least messaging of the last [`WINDOW`] lone one-token steps; `None` as
    /// [`Pace::seconds`] is.
    pub fn messaging(&self, now: Instant) -> Option<f64> {
        self.seconds(now)?;
        let w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        w.messaging.iter().copied().reduce(f64::min)
    }

    /// The least round trip of the last [`WINDOW`] lone one-token steps; `None` before the
    /// first, or once the last is older than [`STALE`].
    pub fn seconds(&self, now: Instant) -> Option<f64> {
        let w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let last = w.last?;
        if now.saturating_duration_since(last) > STALE {
            return None;
        }
        w.seconds.iter().copied().reduce(f64::min)
    }
}

/// A route's time per token predicted from its parts, each measured on its own: what its
/// shards compute a token in (each shard's own least one-position step, from its stats: a
/// shard measures it over every route it serves) and the route's messaging (the least, over
/// its last [`WINDOW`] lone one-token steps, of the round trip less the time the shards held
/// the step). Shown beside the measured pace; the two part where the parts do not add up (a
/// shard slower in this route than in others, messaging that overlaps compute).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub compute: f64,
    pub messaging: Option<f64>,
}

impl Prediction {
    /// From the shards' stats (`None` unless every shard has measured itself) and the pace's
    /// messaging.
    pub fn of(health: &super::cluster::Health, pace: &Pace, now: Instant) -> Option<Prediction> {
        let micros: Option<Vec<u64>> = health
            .shards
            .iter()
            .map(|s| {
                s.stats
                    .as_ref()
                    .map(|st| st.token_step_micros)
                    .filter(|&m| m > 0)
            })
            .collect();
        let micros = micros.filter(|m| !m.is_empty())?;
        Some(Prediction {
            // As floats: the figures are the shards' word, and a sum of u64s could overflow.
            compute: micros.iter().map(|&m| m as f64).sum::<f64>() / 1e6,
            messaging: pace.messaging(now),
        })
    }

    /// Compute and messaging; `None` while the messaging is unmeasured.
    pub fn seconds(&self) -> Option<f64> {
        self.messaging.map(|m| self.compute + m)
    }
}

/// A route this many times slower than the fastest of its model loses even the sessions whose
/// prompt it caches ([`super::prefixes::RouteChoice::order`]): a cached prefix saves its
/// prompt's computation once, seconds at most, while ten times the fastest route's time per
/// token costs more than that within a few hundred tokens (a link gone bad, a host swapping).
pub const CACHE_SLOW_FACTOR: f64 = 10.0;

/// Which of `pace` (each route's, `None` where unmeasured) are slow: over [`SLOW_FACTOR`]
/// times the fastest measured and over [`SLOW_GAP`] slower than it.
pub fn slow(pace: &[Option<f64>]) -> Vec<bool> {
    slow_by(pace, SLOW_FACTOR)
}

/// Which of `pace` are over `factor` times the fastest measured and over [`SLOW_GAP`] slower.
pub fn slow_by(pace: &[Option<f64>], factor: f64) -> Vec<bool> {
    let fastest = pace.iter().flatten().copied().fold(f64::INFINITY, f64::min);
    pace.iter()
        .map(|p| p.is_some_and(|p| p > fastest * factor && p - fastest > SLOW_GAP))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The least of the window: one long step (a stall) changes nothing, a route that became slower shows it once the window has passed, and a pace
    /// with no step for [`STALE`] is forgotten.
    #[test]
    fn a_pace_is_the_least_recent_decode_step_and_is_forgotten_when_stale() {
        let p = Pace::default();
        let t0 = Instant::now();
        assert_eq!(p.seconds(t0), None);
        for s in [0.020, 0.021, 0.300, 0.019, 0.022] {
            p.observe(s, t0);
        }
        p.observe(f64::NAN, t0);
        p.observe(-1.0, t0);
        assert_eq!(p.seconds(t0), Some(0.019));
        for _ in 0..WINDOW {
            p.observe(0.050, t0);
        }
        assert_eq!(p.seconds(t0), Some(0.050));
        assert_eq!(p.seconds(t0 + STALE), Some(0.050));
        assert_eq!(p.seconds(t0 + STALE + Duration::from_millis(1)), None);
    }

    /// A prediction adds the shards' own times per token (every shard's, or none) to the
    /// route's least messaging.
    #[test]
    fn a_prediction_adds_every_shards_time_per_token_to_the_routes_messaging() {
        use super::super::cluster::{Health, ShardHealth};
        let shard = |micros: Option<u64>| ShardHealth {
            address: "a".into(),
            layers: (0, 1),
            up: true,
            last_error: None,
            mismatch: None,
            stats: micros.map(|m| proto::v1::ShardStats {
                token_step_micros: m,
                ..Default::default()
            }),
        };
        let health = |shards| Health { shards };
        let (p, t0) = (Pace::default(), Instant::now());
        let both = health(vec![shard(Some(20_000)), shard(Some(30_000))]);
        assert_eq!(
            Prediction::of(&both, &p, t0),
            Some(Prediction {
                compute: 0.05,
                messaging: None
            })
        );
        assert_eq!(Prediction::of(&both, &p, t0).unwrap().seconds(), None);
        for (round_trip, messaging) in [(0.060, 0.004), (0.058, 0.003), (0.070, 0.009)] {
            p.observe(round_trip, t0);
            p.observe_messaging(messaging);
        }
        let predicted = Prediction::of(&both, &p, t0).unwrap();
        assert_eq!(predicted.messaging, Some(0.003));
        assert!((predicted.seconds().unwrap() - 0.053).abs() < 1e-12);
        // A shard without its own measure, or without stats: no prediction.
        for unmeasured in [Some(0), None] {
            let one = health(vec![shard(Some(20_000)), shard(unmeasured)]);
            assert_eq!(Prediction::of(&one, &p, t0), None);
        }
        assert_eq!(Prediction::of(&health(vec![]), &p, t0), None);
        // Forgotten with the pace.
        assert_eq!(p.messaging(t0 + STALE + Duration::from_millis(1)), None);
    }

    #[test]
    fn routes_over_three_times_the_fastest_are_slow_and_unmeasured_ones_are_not() {
        assert_eq!(
            slow(&[Some(0.010), Some(0.035), None, Some(0.029)]),
            vec![false, true, false, false]
        );
        // Four times slower, but by 1.5 ms: not slow.
        assert_eq!(slow(&[Some(0.0005), Some(0.002)]), vec![false, false]);
        assert_eq!(slow(&[None, None]), vec![false, false]);
    }
}
