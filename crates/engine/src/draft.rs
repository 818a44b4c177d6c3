//! Drafting tokens to verify: prompt lookup over a session's own tokens (its prompt and its
//! output), and how many to draft from what the route accepted before.
//!
//! A draft only proposes; the last shard samples every drafted position with the session's own
//! sampler and keeps a drafted token only while it equals that sample, so a draft never
//! changes what a client receives, only how many tokens one trip along the route yields.
//! Agents repeat their context (code they edit, JSON they copy, names they call), where the
//! tokens after an earlier occurrence of the last few tokens are a good guess of what follows.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::SessionId;

/// Where a route's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// Prompt lookup over the session's own tokens ([`NgramIndex`]): free, and ready at once.
    Ngram,
    /// A smaller model with the same vocabulary, running beside the route ([`DraftSource`]):
    /// its drafts take time, so a session whose draft is being computed waits for it, at most
    /// `max_wait`, then decodes without one. Its drafts cost compute, so a route drafts from it
    /// only while it holds at most `max_batch` active sessions (not only decoding ones: the
    /// draft model reads a session's prompt when it first drafts, which would slow the
    /// prompts of the others).
    Model { max_wait: Duration },
}

/// Wakes whoever plans steps (a route's loop) when a draft it waits for is ready.
pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// What a draft source has for a session now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraftPoll {
    /// Tokens drafted to follow the session's known tokens (possibly none: nothing to
    /// propose, or the source could not draft).
    Ready(Vec<u32>),
    /// A draft for these tokens is being computed: `wake` is called when it is ready.
    Pending,
}

/// A drafter that runs beside the route (a draft model): asked without blocking, it drafts in
/// its own time. A draft only proposes, so what it returns never changes what a client
/// receives (the last shard verifies every drafted token), only how many tokens a trip yields.
pub trait DraftSource: Send + Sync {
    /// Up to `k` tokens to follow `tokens`, the session's known tokens (prompt and output
    /// so far: between calls for one session they only grow, unless it was forgotten).
    /// Starts a draft when it has none for them, and calls `wake` once it is ready.
    fn poll(&self, session: SessionId, tokens: &[u32], k: usize, wake: &Wake) -> DraftPoll;
    /// The session ended here: whatever is kept for it goes.
    fn forget(&self, session: SessionId);
}

/// How a route drafts, for every session that does not opt out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftConfig {
    pub kind: DraftKind,
    /// The most tokens drafted for one session in one step; 0 turns speculation off.
    pub max_draft: usize,
    /// Steps whose decode work holds more sessions than this draft for none of them: a full
    /// batch already keeps the weights busy, and verification would cost more than it saves.
    pub max_batch: usize,
    /// The shortest and longest suffix of a session's tokens looked up in its earlier tokens.
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl DraftConfig {
    pub const OFF: DraftConfig = DraftConfig {
        kind: DraftKind::Ngram,
        max_draft: 0,
        max_batch: 0,
        min_ngram: 2,
        max_ngram: 4,
    };

    /// N-gram drafting of at most `max_draft` tokens a step.
    pub fn ngram(max_draft: usize) -> DraftConfig {
        DraftConfig {
            max_draft,
            max_batch: 1,
            ..DraftConfig::OFF
        }
    }

    /// Drafts of at most `max_draft` tokens a step from a draft model ([`DraftSource`]),
    /// waited for at most `max_wait`.
    pub fn model(max_draft: usize, max_wait: Duration) -> DraftConfig {
        DraftConfig {
            kind: DraftKind::Model { max_wait },
            ..DraftConfig::ngram(max_draft)
        }
    }

    pub fn is_on(&self) -> bool {
        self.max_draft > 0 && self.max_ngram >= self.min_ngram && self.min_ngram > 0
    }
}

/// Where each n-gram of a token sequence last occurred, kept up to date as tokens are
/// appended: a lookup and an append cost O(`max_ngram`) whatever the length, so drafting over
/// a long context costs no more than over a short one.
#[derive(Debug, Clone)]
pub struct NgramIndex {
    min_n: usize,
    max_n: usize,
    /// (n, hash of n tokens) -> the end (exclusive) of their latest occurrence that is not
    /// the sequence's current suffix.
    ends: HashMap<(usize, u64), usize>,
    /// How many tokens of the sequence are indexed (every n-gram ending at or before it).
    n_indexed: usize,
}

fn hash(tokens: &[u32]) -> u64 {
    // FNV-1a over the ids: cheap, and a collision only costs a draft that is checked anyway.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl NgramIndex {
    pub fn new(config: &DraftConfig) -> NgramIndex {
        NgramIndex {
            min_n: config.min_ngram.max(1),
            max_n: config.max_ngram.max(config.min_ngram.max(1)),
            ends: HashMap::new(),
            n_indexed: 0,
        }
    }

    /// Indexes `tokens` up to (not including) its current suffix: every n-gram that ends
    /// before its last position. `tokens` must extend the sequence indexed so far.
    fn catch_up(&mut self, tokens: &[u32]) {
        let upto = tokens.len().saturating_sub(1);
        if upto < self.n_indexed {
            // The sequence was cut (never done by the scheduler, whose tokens only grow):
            // start again rather than point past its end.
            self.ends.clear();
            self.n_indexed = 0;
        }
        while self.n_indexed < upto {
            self.n_indexed += 1;
            let end = self.n_indexed;
            for n in self.min_n..=self.max_n.min(end) {
                self.ends.insert((n, hash(&tokens[end - n..end])), end);
            }
        }
    }

    /// Up to `k` tokens following the latest earlier occurrence of the longest suffix of
    /// `tokens` (between `min_ngram` and `max_ngram` long) that occurred before; empty when
    /// none did.
    pub fn draft(&mut self, tokens: &[u32], k: usize) -> Vec<u32> {
        self.catch_up(tokens);
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            let Some(&end) = self.ends.get(&(n, hash(suffix))) else {
                continue;
            };
            if end < n || end >= len || tokens[end - n..end] != *suffix {
                continue;
            }
            return tokens[end..(end + k).min(len)].to_vec();
        }
        Vec::new()
    }
}

/// How many tokens to draft for one session next, from what its route accepted before: more
/// while every drafted token is kept, back to one more than were kept when some are not, and
/// none for a while after drafts keep failing (a session whose text does not repeat costs
/// nothing).
#[derive(Debug, Clone)]
pub struct DraftLength {
    k: usize,
    max: usize,
    /// Verification steps in a row that kept no drafted token.
    misses: u32,
    /// Decode steps to go without drafting.
    cooldown: u32,
}

/// Misses in a row after which a session stops drafting for [`COOLDOWN`] decode steps.
const MAX_MISSES: u32 = 3;
const COOLDOWN: u32 = 16;

impl DraftLength {
    pub fn new(max: usize) -> DraftLength {
        DraftLength {
            k: max.div_ceil(2).max(1),
            max,
            misses: 0,
            cooldown: 0,
        }
    }

    /// What [`DraftLength::take`] will return, without counting a step.
    pub fn next(&self) -> usize {
        if self.cooldown > 0 {
            0
        } else {
            self.k.min(self.max)
        }
    }

    /// The tokens to draft in this decode step (0 while cooling down). Call once per
    /// decode step of the session.
    pub fn take(&mut self) -> usize {
        if self.cooldown > 0 {
            self.cooldown -= 1;
            return 0;
        }
        self.k.min(self.max)
    }

    /// What a verification step kept of `drafted` tokens.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.misses += 1;
            if self.misses >= MAX_MISSES {
                self.misses = 0;
                self.cooldown = COOLDOWN;
            }
        } else {
            self.misses = 0;
        }
        self.k = if accepted == drafted {
            (drafted * 2).min(self.max)
        } else {
            accepted + 1
        }
        .max(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> NgramIndex {
        NgramIndex::new(&DraftConfig::ngram(8))
    }

    #[test]
    fn a_repeated_suffix_drafts_what_followed_it_before() {
        // "fn add ( a , b )" ... "fn add (" -> " a , b )"
        let t = [1, 2, 3, 4, 5, 6, 7, 9, 9, 1, 2, 3];
        assert_eq!(index().draft(&t, 4), vec![4, 5, 6, 7]);
        assert_eq!(index().draft(&t, 2), vec![4, 5]);
        assert_eq!(index().draft(&t, 0), Vec::<u32>::new());
    }

    #[test]
    fn the_longest_suffix_and_then_the_latest_occurrence_win() {
        // [7 8] occurs twice, followed by 1 then by 2; [6 7 8] once, followed by 3.
        let t = [6, 7, 8, 3, 0, 7, 8, 1, 7, 8, 2, 5, 6, 7, 8];
        assert_eq!(index().draft(&t, 1), vec![3], "longest suffix");
        let t = [7, 8, 1, 0, 7, 8, 2, 5, 7, 8];
        assert_eq!(index().draft(&t, 1), vec![2], "latest occurrence");
    }

    #[test]
    fn nothing_repeats_nothing_is_drafted_and_drafts_stop_at_the_end() {
        assert!(index().draft(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(index().draft(&[1], 4).is_empty());
        assert!(index().draft(&[], 4).is_empty());
        // A period-2 pattern drafts into its own suffix, never past the known tokens.
        assert_eq!(index().draft(&[5, 6, 5, 6], 8), vec![5, 6]);
    }

    #[test]
    fn an_index_kept_up_to_date_drafts_as_a_fresh_one() {
        let mut rng = 0x1234_5678_u64;
        let mut tokens = Vec::new();
        let mut kept = index();
        for _ in 0..400 {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            tokens.push((rng >> 60) as u32 % 5);
            assert_eq!(kept.draft(&tokens, 3), index().draft(&tokens, 3));
        }
    }

    #[test]
    fn draft_length_grows_while_kept_shrinks_when_not_and_cools_down_after_misses() {
        let mut d = DraftLength::new(8);
        assert_eq!(d.take(), 4);
        d.verified(4, 4);
        assert_eq!(d.take(), 8);
        d.verified(8, 2);
        assert_eq!(d.take(), 3);
        for _ in 0..MAX_MISSES {
            let k = d.take();
            d.verified(k, 0);
        }
        for _ in 0..COOLDOWN {
            assert_eq!(d.take(), 0, "cooling down");
        }
        assert_eq!(d.take(), 1);
    }
}
