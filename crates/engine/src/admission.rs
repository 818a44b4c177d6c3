//! Admission: whether a request's resource profile fits every pool of every shard on its
//! route, and the bounded queue of each priority class. Pure bookkeeping, no I/O and no clock.
//!
//! The tracker reserves a request's whole profile (prompt plus `max_tokens` positions of KV on
//! each shard, and a session slot) when it admits it and returns it when the session ends, so
//! what admitted sessions may ever hold never exceeds a budget: nothing is queued that cannot
//! fit, and no admitted session can be cut short by another's growth.

use std::collections::{BTreeMap, HashMap};

use crate::refusal::Refusal;
use crate::scheduler::{Priority, SessionId};

/// One shard's pools as the tracker sees them (from the shard's advertised budgets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardBudget {
    pub address: String,
    /// KV budget, in bytes, and the pool's unit: blocks of `block_positions` positions.
    pub kv_budget_bytes: u64,
    pub kv_block_bytes: u64,
    pub block_positions: u32,
    /// The part of a block that sliding-window layers hold (0 when none is windowed), and
    /// the most blocks one session keeps that part for.
    pub kv_window_block_bytes: u64,
    pub kv_window_blocks_max: u64,
    /// Sessions the shard holds at once.
    pub max_sessions: u32,
}

impl ShardBudget {
    /// KV bytes a session of `n_positions` positions can hold at most on this shard: every
    /// block's global part, and the windowed part only of the blocks a window spans.
    pub fn kv_bytes_for(&self, n_positions: usize) -> u64 {
        let blocks = (n_positions as u64).div_ceil(self.block_positions.max(1) as u64);
        let window = self.kv_window_block_bytes.min(self.kv_block_bytes);
        let windowed = if window == 0 {
            0
        } else {
            blocks.min(self.kv_window_blocks_max)
        };
        blocks * (self.kv_block_bytes - window) + windowed * window
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Sessions of each class (indexed agent, grading) that may wait for a place on the route.
    pub queue_slots: [usize; 2],
    /// Sessions of each class that may be active on the route at once.
    pub active_slots: [usize; 2],
    /// Largest share of a class's places (active plus queued) one API key may hold.
    pub key_share: f64,
    /// Seconds a client refused for capacity is told to wait.
    pub retry_after_secs: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            queue_slots: [64, 256],
            active_slots: [64, 48],
            key_share: 0.5,
            retry_after_secs: 1,
        }
    }
}

/// What one request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand<'a> {
    /// Prompt tokens plus the most it may generate.
    pub n_positions: usize,
    pub priority: Priority,
    /// The API key, or "" for anonymous requests.
    pub key: &'a str,
}

#[derive(Debug, Clone)]
struct Reservation {
    /// KV bytes on each shard.
    bytes: Vec<u64>,
    priority: Priority,
    key: String,
}

/// The admission ledger: reserved KV bytes and sessions per shard, places per class and key.
#[derive(Debug, Clone)]
pub struct Admission {
    shards: Vec<ShardBudget>,
    config: AdmissionConfig,
    reserved_bytes: Vec<u64>,
    sessions: BTreeMap<SessionId, Reservation>,
    per_key: HashMap<(String, Priority), usize>,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl Admission {
    pub fn new(shards: Vec<ShardBudget>, config: AdmissionConfig) -> Admission {
        Admission {
            reserved_bytes: vec![0; shards.len()],
            shards,
            config,
            sessions: BTreeMap::new(),
            per_key: HashMap::new(),
        }
    }

    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    pub fn shards(&self) -> &[ShardBudget] {
        &self.shards
    }

    /// KV bytes reserved on each shard.
    pub fn reserved_kv_bytes(&self) -> Vec<u64> {
        self.reserved_bytes.clone()
    }

    /// Admitted sessions (queued or active).
    pub fn n_admitted(&self) -> usize {
        self.sessions.len()
    }

    /// Checks `demand` against every limit; `n_queued` is how many sessions of its class wait
    /// for a place now. The first limit hit is named; limits that can never be met come first.
    pub fn check(&self, demand: &Demand, n_queued: usize) -> Result<Vec<u64>, Refusal> {
        let bytes: Vec<u64> = self
            .shards
            .iter()
            .map(|s| s.kv_bytes_for(demand.n_positions))
            .collect();
        for (s, &need) in self.shards.iter().zip(&bytes) {
            if need > s.kv_budget_bytes {
                return Err(Refusal::too_large(
                    &format!("kv_budget on shard {}", s.address),
                    format!(
                        "kv_budget on shard {}: {} positions need {}, more than the whole budget of {}",
                        s.address,
                        demand.n_positions,
                        mib(need),
                        mib(s.kv_budget_bytes)
                    ),
                ));
            }
        }
        let class = demand.priority;
        let ci = class as usize;
        let capacity = |limit: String, message: String| {
            Refusal::capacity(&limit, message).retry_after(Some(self.config.retry_after_secs))
        };
        let places = self.config.queue_slots[ci] + self.config.active_slots[ci];
        let n_class = self
            .sessions
            .values()
            .filter(|r| r.priority == class)
            .count();
        if n_class >= self.config.active_slots[ci] && n_queued >= self.config.queue_slots[ci] {
            return Err(capacity(
                format!("queue_slots[{}]", class.name()),
                format!(
                    "queue_slots[{}]: all {} places in the {} queue are taken",
                    class.name(),
                    self.config.queue_slots[ci],
                    class.name()
                ),
            ));
        }
        let key_limit = ((places as f64 * self.config.key_share).ceil() as usize).max(1);
        let held = self
            .per_key
            .get(&(demand.key.to_string(), class))
            .copied()
            .unwrap_or(0);
        if held >= key_limit {
            return Err(capacity(
                format!("key_share[{}]", class.name()),
                format!(
                    "key_share[{}]: this API key already holds {held} of the {places} {} places (its share is {key_limit})",
                    class.name(),
                    class.name()
                ),
            ));
        }
        let n_sessions = self.sessions.len() as u64;
        for (s, (&need, &reserved)) in self
            .shards
            .iter()
            .zip(bytes.iter().zip(&self.reserved_bytes))
        {
            if n_sessions >= s.max_sessions as u64 {
                return Err(capacity(
                    format!("max_sessions on shard {}", s.address),
                    format!(
                        "max_sessions on shard {}: all {} session places are taken",
                        s.address, s.max_sessions
                    ),
                ));
            }
            let free = s.kv_budget_bytes.saturating_sub(reserved);
            if need > free {
                return Err(capacity(
                    format!("kv_budget on shard {}", s.address),
                    format!(
                        "kv_budget on shard {}: need {}, free {} of {}",
                        s.address,
                        mib(need),
                        mib(free),
                        mib(s.kv_budget_bytes)
                    ),
                ));
            }
        }
        Ok(bytes)
    }

    /// Checks and, when it fits, reserves the demand for `session`.
    pub fn admit(
        &mut self,
        session: SessionId,
        demand: &Demand,
        n_queued: usize,
    ) -> Result<(), Refusal> {
        let bytes = self.check(demand, n_queued)?;
        for (r, b) in self.reserved_bytes.iter_mut().zip(&bytes) {
            *r += b;
        }
        *self
            .per_key
            .entry((demand.key.to_string(), demand.priority))
            .or_default() += 1;
        self.sessions.insert(
            session,
            Reservation {
                bytes,
                priority: demand.priority,
                key: demand.key.to_string(),
            },
        );
        Ok(())
    }

    /// Returns a session's reservation (it finished, failed or was cancelled). Unknown
    /// sessions are ignored, so releasing twice is harmless.
    pub fn release(&mut self, session: SessionId) {
        let Some(r) = self.sessions.remove(&session) else {
            return;
        };
        for (total, b) in self.reserved_bytes.iter_mut().zip(&r.bytes) {
            *total -= b;
        }
        let k = (r.key, r.priority);
        if let Some(n) = self.per_key.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                self.per_key.remove(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Reason;

    const BLOCK: u64 = 1 << 20;

    fn shard(addr: &str, blocks: u64) -> ShardBudget {
        ShardBudget {
            address: addr.into(),
            kv_budget_bytes: blocks * BLOCK,
            kv_block_bytes: BLOCK,
            block_positions: 16,
            kv_window_block_bytes: 0,
            kv_window_blocks_max: 0,
            max_sessions: 100,
        }
    }

    fn demand(n: usize, key: &str) -> Demand<'_> {
        Demand {
            n_positions: n,
            priority: Priority::Agent,
            key,
        }
    }

    #[test]
    fn a_profile_that_does_not_fit_names_the_shard_and_the_numbers() {
        let mut a = Admission::new(
            vec![shard("127.0.0.1:7001", 64), shard("127.0.0.1:7002", 8)],
            AdmissionConfig::default(),
        );
        // 100 positions = 7 blocks of 16 on each shard.
        a.admit(SessionId(1), &demand(100, ""), 0).unwrap();
        let r = a.check(&demand(100, ""), 0).unwrap_err();
        assert_eq!(r.reason, Reason::Capacity);
        assert_eq!(
            r.limit.as_deref(),
            Some("kv_budget on shard 127.0.0.1:7002")
        );
        assert_eq!(
            r.message,
            "kv_budget on shard 127.0.0.1:7002: need 7.0 MiB, free 1.0 MiB of 8.0 MiB"
        );
        assert_eq!(r.retry_after, Some(1));
        a.release(SessionId(1));
        assert_eq!(a.reserved_kv_bytes(), vec![0, 0]);
        a.admit(SessionId(2), &demand(100, ""), 0).unwrap();
    }

    #[test]
    fn a_request_larger_than_any_budget_is_terminal() {
        let a = Admission::new(vec![shard("a", 4)], AdmissionConfig::default());
        let r = a.check(&demand(65, ""), 0).unwrap_err();
        assert_eq!(r.reason, Reason::TooLarge);
        assert_eq!(r.retry_after, None);
        assert!(a.check(&demand(64, ""), 0).is_ok());
    }

    #[test]
    fn a_windowed_shard_reserves_its_window_not_the_whole_context() {
        // Blocks of 1 MiB, 3/4 of which windowed layers hold for at most 4 blocks.
        let windowed = ShardBudget {
            kv_window_block_bytes: 3 * BLOCK / 4,
            kv_window_blocks_max: 4,
            ..shard("127.0.0.1:7001", 16)
        };
        assert_eq!(windowed.kv_bytes_for(16 * 3), 3 * BLOCK);
        // 40 blocks: every global part, and 4 windowed parts.
        assert_eq!(windowed.kv_bytes_for(16 * 40), 40 * BLOCK / 4 + 3 * BLOCK);
        let mut a = Admission::new(vec![windowed], AdmissionConfig::default());
        // Twice the budget's positions fit once windows are counted as they are held...
        a.admit(SessionId(1), &demand(16 * 32, ""), 0).unwrap();
        assert_eq!(a.reserved_kv_bytes(), vec![8 * BLOCK + 3 * BLOCK]);
        // ...and the rest of the budget is still reserved exactly.
        let r = a.check(&demand(16 * 30, ""), 0).unwrap_err();
        assert_eq!(
            r.message,
            "kv_budget on shard 127.0.0.1:7001: need 10.5 MiB, free 5.0 MiB of 16.0 MiB"
        );
        a.admit(SessionId(2), &demand(16 * 8, ""), 0).unwrap();
    }

    #[test]
    fn a_full_queue_and_a_key_over_its_share_are_refused() {
        let config = AdmissionConfig {
            queue_slots: [2, 2],
            active_slots: [2, 2],
            key_share: 0.5,
            retry_after_secs: 3,
        };
        let mut a = Admission::new(vec![shard("a", 1000)], config);
        for i in 0..2 {
            a.admit(SessionId(i), &demand(10, "k1"), 0).unwrap();
        }
        let r = a.check(&demand(10, "k1"), 0).unwrap_err();
        assert_eq!(r.limit.as_deref(), Some("key_share[agent]"));
        assert_eq!(r.retry_after, Some(3));
        a.admit(SessionId(5), &demand(10, "k2"), 1).unwrap();
        let r = a.check(&demand(10, "k3"), 2).unwrap_err();
        assert_eq!(r.limit.as_deref(), Some("queue_slots[agent]"));
        // Grading has its own queue.
        let g = Demand {
            priority: Priority::Grading,
            ..demand(10, "k3")
        };
        assert!(a.check(&g, 0).is_ok());
    }

    proptest::proptest! {
        /// Whatever is admitted and released, reservations never exceed a budget and return to
        /// zero when everything is released.
        #[test]
        fn reservations_never_exceed_a_budget(
            ops in proptest::collection::vec((1usize..400, proptest::bool::ANY), 1..200),
        ) {
            let mut a = Admission::new(vec![shard("a", 40), shard("b", 25)], AdmissionConfig::default());
            let mut held = Vec::new();
            for (i, (n, release)) in ops.into_iter().enumerate() {
                if release && !held.is_empty() {
                    a.release(held.remove(i % held.len()));
                } else if a.admit(SessionId(i as u64), &demand(n, ""), 0).is_ok() {
                    held.push(SessionId(i as u64));
                }
                let r = a.reserved_kv_bytes();
                proptest::prop_assert!(r[0] <= 40 * BLOCK && r[1] <= 25 * BLOCK);
            }
            for s in held {
                a.release(s);
            }
            proptest::prop_assert_eq!(a.reserved_kv_bytes(), vec![0, 0]);
            proptest::prop_assert_eq!(a.n_admitted(), 0);
        }
    }
}
