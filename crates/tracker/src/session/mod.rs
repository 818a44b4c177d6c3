//! The session layer: the decisions about one session that are pure functions of plain
//! values (replay or fail, move or fail, the text a finished session still owes its client),
//! tested without a route, a clock or a socket. The route driver calls them.

use engine::{Reason, Refusal};
use text::{StopMatcher, StopStep};

/// Times one session may be recomputed after a shard lost its cache before it fails.
pub const MAX_REPLAYS: u32 = 3;

/// Times one session may move to another route without generating a token there before a
/// route failure fails it. A session that makes progress between failures moves again, as
/// often as its faults come (each move then costs at least one token of its length limit, so
/// the moves stay bounded); one that every route fails before it gets anything does not
/// travel the swarm forever.
pub const MAX_MOVES: u32 = 3;

/// Whether a shard's refusal of a session's fragment is answered by recomputing the session
/// from its known tokens (a cache miss, a few times at most) rather than failing its client.
pub fn replays(reason: Reason, n_replays: u32) -> bool {
    reason == Reason::CacheMiss && n_replays < MAX_REPLAYS
}

/// Whether a session a failed route held moves to another route (when the model has one):
/// the failure is one that may pass (a lost or draining shard, not a terminal refusal), it has
/// not moved too often since its last token (`n_moves`), and it may still generate.
pub fn moves(err: &Refusal, n_moves: u32, max_new: usize) -> bool {
    err.retryable() && n_moves < MAX_MOVES && max_new > 0
}

/// The text a session cut at its length limit still owes its client: what its decoder held
/// back (an incomplete character) and what its stop matcher held back (a possible stop
/// string that cannot complete now), up to a stop string if the held text completes one.
pub fn tail_at_length(decoder_tail: &str, stops: &mut StopMatcher) -> String {
    match stops.push(decoder_tail) {
        StopStep::Continue(t) => t + &stops.finish(),
        StopStep::Stop(t) => t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_miss_replays_three_times_and_nothing_else_replays() {
        assert!((0..MAX_REPLAYS).all(|n| replays(Reason::CacheMiss, n)));
        assert!(!replays(Reason::CacheMiss, MAX_REPLAYS));
        for r in Reason::ALL.into_iter().filter(|&r| r != Reason::CacheMiss) {
            assert!(!replays(r, 0), "{r}");
        }
    }

    #[test]
    fn only_retryable_failures_move_and_only_while_tokens_are_left() {
        let lost = Refusal::shard_failed("a", "gone");
        assert!(moves(&lost, 0, 5));
        assert!(!moves(&lost, MAX_MOVES, 5));
        assert!(!moves(&lost, 0, 0));
        assert!(!moves(&Refusal::recipe_mismatch("x"), 0, 5));
        assert!(moves(&Refusal::draining("x"), 2, 1));
    }

    #[test]
    fn a_cut_session_gets_what_was_held_back_up_to_a_stop_string() {
        let mut stops = StopMatcher::new(vec!["END".to_string()]);
        // "EN" is held back: it may begin the stop string.
        assert_eq!(stops.push("abc EN"), StopStep::Continue("abc ".to_string()));
        assert_eq!(tail_at_length("", &mut stops), "EN");
        let mut stops = StopMatcher::new(vec!["END".to_string()]);
        assert_eq!(stops.push("x EN"), StopStep::Continue("x ".to_string()));
        assert_eq!(tail_at_length("D and more", &mut stops), "");
    }
}
