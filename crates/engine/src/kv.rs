//! KV residency policy: which idle sessions a shard forgets, by idle time (TTL) and, under
//! memory pressure, least recently used first. Pure: the caller passes the clock in.

use std::time::{Duration, Instant};

/// One session's KV as the policy sees it; `K` is whatever names a session where the caller
/// keeps it (a shard: the route stream that opened it and its id there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident<K = u64> {
    pub session: K,
    pub last_used: Instant,
    pub bytes: usize,
    /// Part of the step being admitted: never evicted.
    pub in_step: bool,
}

/// Sessions idle for `ttl` or longer are evicted; under pressure the least recently used idle
/// sessions go first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictionPolicy {
    pub ttl: Duration,
}

impl EvictionPolicy {
    /// Sessions idle past the TTL at `now`.
    pub fn expired<K: Copy>(&self, residents: &[Resident<K>], now: Instant) -> Vec<K> {
        residents
            .iter()
            .filter(|r| !r.in_step && now.saturating_duration_since(r.last_used) >= self.ttl)
            .map(|r| r.session)
            .collect()
    }

    /// The least recently used idle sessions whose eviction makes `need` more bytes fit in
    /// `budget` (with `in_use` held now), or `None` when evicting every idle session would not
    /// be enough (then nothing should be evicted).
    pub fn make_room<K: Copy + Ord>(
        &self,
        residents: &[Resident<K>],
        in_use: usize,
        budget: usize,
        need: usize,
    ) -> Option<Vec<K>> {
        if in_use + need <= budget {
            return Some(Vec::new());
        }
        let mut idle: Vec<&Resident<K>> = residents.iter().filter(|r| !r.in_step).collect();
        idle.sort_by_key(|r| (r.last_used, r.session));
        let mut freed = 0;
        let mut chosen = Vec::new();
        for r in idle {
            if in_use.saturating_sub(freed) + need <= budget {
                break;
            }
            freed += r.bytes;
            chosen.push(r.session);
        }
        (in_use.saturating_sub(freed) + need <= budget).then_some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    fn r(session: u64, last_used: Instant, bytes: usize, in_step: bool) -> Resident {
        Resident {
            session,
            last_used,
            bytes,
            in_step,
        }
    }

    #[test]
    fn sessions_idle_past_the_ttl_expire_unless_in_the_step() {
        let t0 = Instant::now();
        let p = EvictionPolicy {
            ttl: Duration::from_secs(10),
        };
        let rs = [
            r(1, t0, 10, false),
            r(2, at(t0, 5_000), 10, false),
            r(3, t0, 10, true),
        ];
        assert!(p.expired(&rs, at(t0, 9_999)).is_empty());
        assert_eq!(p.expired(&rs, at(t0, 10_000)), vec![1]);
        assert_eq!(p.expired(&rs, at(t0, 15_000)), vec![1, 2]);
    }

    #[test]
    fn pressure_evicts_least_recently_used_idle_sessions_just_enough() {
        let t0 = Instant::now();
        let p = EvictionPolicy {
            ttl: Duration::from_secs(60),
        };
        let rs = [
            r(1, at(t0, 30), 40, false),
            r(2, at(t0, 10), 40, false),
            r(3, at(t0, 0), 40, true),
            r(4, at(t0, 20), 40, false),
        ];
        assert_eq!(p.make_room(&rs, 160, 200, 40), Some(vec![]));
        assert_eq!(p.make_room(&rs, 160, 200, 50), Some(vec![2]));
        assert_eq!(p.make_room(&rs, 160, 200, 100), Some(vec![2, 4]));
        // Even evicting every idle session (120 bytes) leaves 40 + 200 > 200: evict nothing.
        assert_eq!(p.make_room(&rs, 160, 200, 200), None);
    }

    proptest::proptest! {
        #[test]
        fn make_room_frees_enough_and_never_touches_sessions_in_the_step(
            sizes in proptest::collection::vec((1usize..100, proptest::bool::ANY), 0..20),
            need in 0usize..300,
            budget in 100usize..2000,
        ) {
            let t0 = Instant::now();
            let rs: Vec<Resident> = sizes.iter().enumerate().map(|(i, (b, s))| r(i as u64, at(t0, (i * 7 % 13) as u64), *b, *s)).collect();
            let in_use: usize = rs.iter().map(|r| r.bytes).sum();
            let p = EvictionPolicy { ttl: Duration::from_secs(1) };
            if let Some(chosen) = p.make_room(&rs, in_use, budget, need) {
                let freed: usize = rs.iter().filter(|r| chosen.contains(&r.session)).map(|r| r.bytes).sum();
                proptest::prop_assert!(in_use - freed + need <= budget);
                proptest::prop_assert!(rs.iter().filter(|r| r.in_step).all(|r| !chosen.contains(&r.session)));
            }
        }
    }
}
