//! The session layer: the decisions about one session that are pure functions of plain
//! values (replay or fail, move or fail, the text a finished session still owes its client),
//! tested without a route, a clock or a socket. The route driver calls them.

use engine::{Reason, Refusal};
use text::{StopMatcher, StopStep};

/// Times one session may be recomputed after a shard lost its cache before it fails.
pub const MAX_REPLAYS: u32 = 3;

/// Times one session may move to another route because a route failed while computing
/// positions of it that no route had computed before, with no route computing new positions
/// of it in between, before such a failure fails it. A session whose computation kills every
/// shard that runs it fails at the same positions each time, so it does not travel the swarm
/// forever; one that makes progress between failures moves again, as often as its faults
/// come. Moves it cannot have caused (its route drained or left the registry, or failed while
/// the session only waited or recomputed positions computed before) do not count.
pub const MAX_MOVES: u32 = 3;

/// Whether a shard's refusal of a session's fragment is answered by recomputing the session
/// from its known tokens (a cache miss, a few times at most) rather than failing its client.
pub fn replays(reason: Reason, n_replays: u32) -> bool {
    reason == Reason::CacheMiss && n_replays < MAX_REPLAYS
}

/// Whether a route's failure can be a session's doing, and so counts against its
/// [`MAX_MOVES`]: the route failed (rather than drained or left the registry, an operator's or
/// the swarm's decision) while a step carrying positions of the session past its frontier
/// (positions no route had computed yet) was in flight (`new_ground`).
pub fn blames(err: &Refusal, new_ground: bool) -> bool {
    new_ground && err.reason != Reason::Draining
}

/// Whether a session a failed route held moves to another route (when the model has one):
/// the failure is one that may pass (a lost or draining shard, not a terminal refusal), it
/// may still generate, and when the failure `blamed` it, it has not been blamed too often
/// since its frontier last advanced (`n_moves`).
pub fn moves(err: &Refusal, n_moves: u32, blamed: bool, max_new: usize) -> bool {
    err.retryable() && max_new > 0 && (!blamed || n_moves < MAX_MOVES)
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
        assert!(moves(&lost, 0, true, 5));
        assert!(!moves(&lost, MAX_MOVES, true, 5));
        assert!(!moves(&lost, 0, true, 0));
        assert!(!moves(&Refusal::recipe_mismatch("x"), 0, true, 5));
        assert!(moves(&Refusal::draining("x"), 2, false, 1));
    }

    /// A session that every route computing new positions of it loses stops after MAX_MOVES;
    /// routes that drain, leave the registry or fail while it only waits or recomputes known
    /// positions move it however often that happens.
    #[test]
    fn only_failures_while_computing_a_session_count_against_its_moves() {
        let lost = Refusal::shard_failed("a", "gone");
        let drained = Refusal::draining("route r left the registry");
        assert!(blames(&lost, true));
        assert!(
            !blames(&lost, false),
            "it waited or recomputed known positions"
        );
        assert!(!blames(&drained, true), "a drain is nobody's fault");
        assert!(moves(&drained, MAX_MOVES, blames(&drained, true), 5));
        assert!(moves(&lost, MAX_MOVES, blames(&lost, false), 5));
        assert!(!moves(&lost, MAX_MOVES, blames(&lost, true), 5));
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
