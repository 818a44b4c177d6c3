//! Arbitrary steps against a shard (a tiny model): whatever a peer holding the cluster token
//! sends (fragments naming any session at any position with any tokens, sampling of any
//! floats, prefixes, releases, epochs, activations of any bytes), every step is answered or the
//! stream refused with a typed status, the compute thread never dies, and afterwards the shard
//! computes a clean session exactly as a fresh one does.
//!
//! `PROPTEST_CASES=N` sets the number of sequences (default 64; the hardening note quotes a
//! long run).

use std::sync::Arc;
use std::time::Duration;

use crate::common::{config, frag};
use futures::StreamExt;
use proptest::prelude::*;
use proto::v1::{route_msg, Fragment, RouteMsg, RouteReply, RouteSetup, Sampling, Step};
use proto::{ReplyStream, ShardTransport};
use shard::{LocalShard, ShardConfig, ShardCore};
use tokio::sync::mpsc;

/// The tiny model's vocabulary and width (see `testkit::TinySpec::default`).
const N_EMBD: usize = 256;

fn token() -> impl Strategy<Value = u32> {
    prop_oneof![8 => 0u32..300, 1 => any::<u32>()]
}

fn float() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => 0.0f32..2.0,
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(-1.0f32),
        1 => any::<f32>(),
    ]
}

fn sampling() -> impl Strategy<Value = Sampling> {
    (
        float(),
        prop_oneof![3 => 0u32..50, 1 => any::<u32>()],
        float(),
        float(),
        float(),
        prop_oneof![3 => 0u32..100, 1 => any::<u32>()],
        any::<u64>(),
        (
            float(),
            float(),
            prop::collection::vec(
                (prop_oneof![3 => 0u32..300, 1 => any::<u32>()], float()),
                0..4,
            ),
            prop_oneof![3 => 0u32..48, 1 => any::<u32>()],
            prop_oneof![
                4 => Just(String::new()),
                1 => Just(r#"{"grammars": [{"json_schema": {"type": "object"}}]}"#.to_string()),
                1 => Just(r#"{"grammars": [{"lark_grammar": "start: ("}]}"#.to_string()),
                1 => ".{0,40}",
            ],
        ),
    )
        .prop_map(
            |(
                temperature,
                top_k,
                top_p,
                min_p,
                repeat_penalty,
                repeat_last_n,
                seed,
                (presence_penalty, frequency_penalty, bias, n_prompt, grammar),
            )| Sampling {
                temperature,
                top_k,
                top_p,
                min_p,
                repeat_penalty,
                repeat_last_n,
                seed,
                presence_penalty,
                frequency_penalty,
                logit_bias: bias
                    .into_iter()
                    .map(|(token, bias)| proto::v1::LogitBias { token, bias })
                    .collect(),
                n_prompt,
                grammar,
            },
        )
}

fn fragment() -> impl Strategy<Value = Fragment> {
    (
        prop_oneof![8 => 0u64..5, 1 => any::<u64>()],
        prop_oneof![4 => Just(0u32), 4 => 0u32..48, 1 => any::<u32>()],
        prop::collection::vec(token(), 0..24),
        any::<bool>(),
        prop::option::of(sampling()),
        prop_oneof![4 => 0u32..6, 1 => any::<u32>()],
        any::<bool>(),
        any::<bool>(),
        prop_oneof![6 => Just(Vec::new()), 1 => prop::collection::vec(token(), 0..40)],
        // Drafts to verify: none mostly, some, and any number.
        prop_oneof![6 => Just(0u32), 2 => 0u32..20, 1 => any::<u32>()],
    )
        .prop_map(
            |(
                session_id,
                start_pos,
                tokens,
                want_output,
                sampling,
                n_top_logprobs,
                want_logprob,
                reuse_prefix,
                prefix,
                n_draft,
            )| Fragment {
                session_id,
                start_pos,
                tokens,
                want_output,
                sampling,
                n_top_logprobs,
                want_logprob,
                reuse_prefix,
                prefix,
                cache_salt: 0,
                n_draft,
            },
        )
}

/// What the activations of a step past layer 0 are made of.
#[derive(Debug, Clone)]
enum Activations {
    /// The right number of f32 for the step's rows, each of this value.
    Rows(f32),
    /// Any bytes.
    Bytes(Vec<u8>),
}

fn step() -> impl Strategy<Value = (Step, Activations)> {
    (
        prop_oneof![8 => Just(1u64), 1 => any::<u64>()],
        prop::collection::vec(fragment(), 0..5),
        prop::collection::vec(prop_oneof![4 => 0u64..5, 1 => any::<u64>()], 0..3),
        any::<u32>(),
        prop_oneof![
            6 => float().prop_map(Activations::Rows),
            1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Activations::Bytes),
        ],
    )
        .prop_map(|(epoch, fragments, release, liveness_ms, activations)| {
            let step = Step {
                epoch,
                fragments,
                release,
                liveness_ms,
                ..Default::default()
            };
            (step, activations)
        })
}

/// A route stream on `local` as its only shard (`reply_key` 0) or as the last of a longer
/// route (a replies stream opened first): the steps' way in, where answers come, and (on a
/// longer route) the acknowledgements stream, kept open.
type Opened = (mpsc::Sender<RouteMsg>, ReplyStream, Option<ReplyStream>);

async fn open(local: &LocalShard, digest: &str, reply_key: u64) -> Opened {
    let direct = match reply_key {
        0 => None,
        key => Some(local.replies(key).await.unwrap()),
    };
    let (tx, rx) = mpsc::channel(8);
    let setup = RouteSetup {
        protocol_version: proto::PROTOCOL_VERSION,
        epoch: 1,
        model_digest: digest.into(),
        reply_key,
        ..Default::default()
    };
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Setup(setup)),
    })
    .await
    .unwrap();
    let upstream = local.route(rx).await.unwrap();
    match direct {
        Some(d) => (tx, d, Some(upstream)),
        None => (tx, upstream, None),
    }
}

/// The next answer that is not progress: `Ok(reply)`, or `Err` when the shard refused the
/// stream (a malformed step ends it with a status).
async fn answer(replies: &mut ReplyStream) -> Result<RouteReply, tonic::Status> {
    loop {
        let next = tokio::time::timeout(Duration::from_secs(30), replies.next())
            .await
            .expect("every step is answered: no hang");
        match next {
            Some(Ok(r)) if r.progress.is_some() => continue,
            Some(Ok(r)) => return Ok(r),
            Some(Err(status)) => return Err(status),
            None => return Err(tonic::Status::cancelled("the stream ended")),
        }
    }
}

/// The status that ended a stream of acknowledgements.
async fn refusal(acks: &mut ReplyStream) -> Result<RouteReply, tonic::Status> {
    loop {
        answer(acks).await?;
    }
}

/// Drives `steps` through a route stream on `core` (reopened whenever the shard refused one),
/// checking each answer; then a clean session must give what it gives on a fresh shard.
async fn drive(
    core: Arc<ShardCore>,
    first: bool,
    steps: Vec<(Step, Activations)>,
) -> Result<(), TestCaseError> {
    let local = LocalShard::new(Arc::clone(&core));
    let digest = core.info.model_digest.clone();
    let key = |i: u64| if first { 0 } else { 1000 + i };
    let mut opened = 0;
    let (mut tx, mut replies, mut _acks) = open(&local, &digest, key(opened)).await;
    for (i, (mut step, activations)) in steps.into_iter().enumerate() {
        step.step_id = i as u64 + 1;
        if !first {
            let rows: usize = step.fragments.iter().map(|f| f.tokens.len()).sum();
            step.activations = match activations {
                Activations::Rows(v) => proto::encode_activations(
                    &vec![v; rows * N_EMBD],
                    proto::v1::SeamDtype::SeamF32,
                ),
                Activations::Bytes(b) => b,
            };
        }
        let fragments = step.fragments.clone();
        tx.send(RouteMsg {
            msg: Some(route_msg::Msg::Step(step)),
        })
        .await
        .ok();
        let answered = match answer(&mut replies).await {
            // On a longer route a refused stream ends the replies stream; the refusal itself
            // goes upstream, to the shard before.
            Err(e) if e.code() == tonic::Code::Cancelled && _acks.is_some() => {
                refusal(_acks.as_mut().unwrap()).await
            }
            other => other,
        };
        match answered {
            Ok(r) => {
                prop_assert!(r.step_error.is_none(), "{:?}", r.step_error);
                // Every fragment that asked for a token got one or a typed refusal.
                for f in fragments.iter().filter(|f| f.want_output) {
                    let answered = r.outputs.iter().any(|o| o.session_id == f.session_id)
                        || r.errors.iter().any(|e| e.session_id == f.session_id);
                    prop_assert!(answered, "session {} unanswered in {r:?}", f.session_id);
                }
                for e in &r.errors {
                    prop_assert!(
                        ["invalid_request", "cache_miss", "stale_epoch", "capacity"]
                            .contains(&e.kind().name()),
                        "untyped refusal {e:?}"
                    );
                }
            }
            Err(status) => {
                prop_assert_eq!(status.code(), tonic::Code::InvalidArgument, "{}", status);
                opened += 1;
                (tx, replies, _acks) = open(&local, &digest, key(opened)).await;
            }
        }
        prop_assert!(core.check_alive().is_ok(), "{:?}", core.check_alive());
    }
    drop(tx);
    // The shard still computes a clean session exactly as a fresh one does.
    if first {
        let fresh = ShardCore::load(whole()).unwrap();
        let clean = [frag(77, 0, &[5, 6, 7, 8])];
        let mut got = Vec::new();
        for c in [&core, &fresh] {
            let local = LocalShard::new(Arc::clone(c));
            let (tx, mut r, _) = open(&local, &digest, 0).await;
            tx.send(RouteMsg {
                msg: Some(route_msg::Msg::Step(Step {
                    step_id: 1,
                    epoch: 1,
                    fragments: clean.to_vec(),
                    liveness_ms: 10_000,
                    ..Default::default()
                })),
            })
            .await
            .unwrap();
            got.push(answer(&mut r).await.unwrap().outputs[0].token);
        }
        prop_assert_eq!(got[0], got[1]);
    }
    Ok(())
}

fn whole() -> ShardConfig {
    ShardConfig {
        max_sessions: 4,
        ..config(1 << 20, Duration::from_secs(600))
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// The whole model (first and last shard): token ids, positions, prefixes, sampling.
    #[test]
    fn any_steps_to_a_whole_model_shard_are_answered_or_refused(steps in prop::collection::vec(step(), 1..10)) {
        let core = ShardCore::load(whole()).unwrap();
        runtime().block_on(drive(core, true, steps))?;
    }

    /// A last shard past layer 0 (activations in): hidden states of any values or bytes.
    #[test]
    fn any_steps_to_a_later_shard_are_answered_or_refused(steps in prop::collection::vec(step(), 1..10)) {
        let core = ShardCore::load(ShardConfig { layers: Some((2, 4)), ..whole() }).unwrap();
        runtime().block_on(drive(core, false, steps))?;
    }
}
