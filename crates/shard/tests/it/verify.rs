//! Verification steps (speculative decoding) on the last shard, through the in-memory
//! transport on a tiny model: a fragment carrying drafted tokens after its last known one
//! answers the samples that single steps give, up to and including the first that differs
//! from its draft, with the same log-probabilities; the session goes on from the kept
//! positions; malformed drafts and drafts of a session held to a grammar are refused, typed.

use std::time::Duration;

use proto::v1::{Fragment, SessionOutput};
use shard::ShardCore;

use crate::common::{config, frag};
use crate::refusals::{open, reasons};

/// A session's first fragment with the log-probabilities of its samples asked for.
fn start(session: u64, prompt: &[u32]) -> Fragment {
    Fragment {
        n_top_logprobs: 2,
        want_logprob: true,
        ..frag(session, 0, prompt)
    }
}

fn next(session: u64, pos: usize, tokens: &[u32], n_draft: usize) -> Fragment {
    Fragment {
        want_logprob: true,
        n_draft: n_draft as u32,
        ..frag(session, pos as u32, tokens)
    }
}

/// What a client sees of a sample: its token, position and log-probabilities, bitwise.
fn seen(o: &SessionOutput) -> (u32, u32, u32, Vec<(u32, u32)>) {
    let top = o
        .top
        .iter()
        .map(|t| (t.token, t.logprob.to_bits()))
        .collect();
    (o.token, o.next_pos, o.logprob.to_bits(), top)
}

#[tokio::test]
async fn a_verification_step_answers_what_single_steps_give_up_to_the_first_rejected_draft() {
    let core = ShardCore::load(config(16 << 20, Duration::from_secs(600))).unwrap();
    let digest = core.info.model_digest.clone();
    let mut r = open(&core, 1, &digest).await.unwrap();
    let prompt = [5, 6, 7];

    // Session 1 decodes one token a step: x[0] after the prompt, then x[1..8].
    let mut single = Vec::new();
    let reply = r.step(1, vec![start(1, &prompt)], vec![]).await;
    single.push(seen(&reply.outputs[0]));
    for k in 0..7 {
        let pos = prompt.len() + k;
        let reply = r
            .step(1, vec![next(1, pos, &[single[k].0], 0)], vec![])
            .await;
        assert!(reply.errors.is_empty(), "{reply:?}");
        single.push(seen(&reply.outputs[0]));
    }
    let x: Vec<u32> = single.iter().map(|s| s.0).collect();

    // Session 2 verifies x[1], x[2] and a wrong third draft after x[0] (and one more draft
    // past it): three samples come back, the single steps' own, the last differing from
    // its draft.
    let reply = r.step(1, vec![start(2, &prompt)], vec![]).await;
    assert_eq!(seen(&reply.outputs[0]), single[0]);
    let wrong = if x[3] == 1 { 2 } else { 1 };
    let tokens = [x[0], x[1], x[2], wrong, x[4]];
    let reply = r
        .step(1, vec![next(2, prompt.len(), &tokens, 4)], vec![])
        .await;
    assert!(reply.errors.is_empty(), "{reply:?}");
    let got: Vec<_> = reply.outputs.iter().map(seen).collect();
    assert_eq!(got, single[1..4], "samples after x0, x1, x2");

    // It goes on from the 3 + 3 positions kept (x0, x1, x2) with x3, verifying x4 and x5
    // (both right): every sample is kept, and the one after the last draft comes too.
    let reply = r
        .step(1, vec![next(2, prompt.len() + 3, &x[3..6], 2)], vec![])
        .await;
    assert!(reply.errors.is_empty(), "{reply:?}");
    let got: Vec<_> = reply.outputs.iter().map(seen).collect();
    assert_eq!(got, single[4..7], "samples after x3, x4, x5");
    // And as plain steps after that.
    let reply = r
        .step(1, vec![next(2, prompt.len() + 6, &x[6..7], 0)], vec![])
        .await;
    assert_eq!(seen(&reply.outputs[0]), single[7]);
}

#[tokio::test]
async fn malformed_drafts_and_drafts_of_a_constrained_session_are_refused_typed() {
    let core = ShardCore::load(config(16 << 20, Duration::from_secs(600))).unwrap();
    let digest = core.info.model_digest.clone();
    let mut r = open(&core, 1, &digest).await.unwrap();
    let bad = [
        // Nothing known before the drafts.
        next(1, 0, &[5, 6], 2),
        // More drafts than a fragment may carry.
        next(2, 0, &[5; 20], shard::MAX_DRAFT + 1),
        // Drafts with no sample to check them against.
        Fragment {
            want_output: false,
            ..next(3, 0, &[5, 6, 7], 1)
        },
    ];
    let reply = r.step(1, bad.to_vec(), vec![]).await;
    assert!(reply.outputs.is_empty(), "{reply:?}");
    assert_eq!(
        reasons(&reply),
        [1, 2, 3].map(|id| (id, "invalid_request".to_string()))
    );
    // A session held to a grammar (a JSON document) samples under its mask, which a drafted
    // position's sample cannot have yet: refused, and nothing of it kept.
    let grammar = constrain::grammar::json_schema(&serde_json::json!({"type": "object"})).unwrap();
    let constrained = Fragment {
        sampling: Some(proto::v1::Sampling {
            grammar,
            n_prompt: 2,
            ..Default::default()
        }),
        ..next(4, 0, &[5, 6, 7], 1)
    };
    let reply = r.step(1, vec![constrained], vec![]).await;
    assert_eq!(reasons(&reply), [(4, "invalid_request".to_string())]);
    assert!(
        reply.errors[0].message.contains("held to a grammar"),
        "{}",
        reply.errors[0].message
    );
    assert_eq!(core.stats().sessions, 0, "no refused session is kept");
}
