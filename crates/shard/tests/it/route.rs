//! A route of two shards over gRPC on 127.0.0.1 (tiny model, both shards in this process): the
//! last shard answers on the replies stream the tracker opened, refusals and timings of the
//! first shard travel with the step, every step is acknowledged upstream (releasing in-flight
//! bytes and measuring the seam's round trip), and a route without a valid reply key is refused.
//! The first shard starts the next decode step on the last shard's token hint, uses it when the
//! tracker's step is that step, and rolls it back otherwise.
//! A 3000-token prompt gives bitwise the same answer whatever its chunking through the route,
//! which is the whole model's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{config, frag};
use futures::{FutureExt, StreamExt};
use proto::v1::{route_msg, Fragment, RouteMsg, RouteReply, RouteSetup, Step};
use proto::{GrpcShard, ReplyStream, ShardTransport};
use shard::{ShardConfig, ShardCore};
use tokio::sync::mpsc;

const TOKEN: &str = "route-test-token-0123456789";

fn load(layers: Option<(usize, usize)>, label: &str) -> Arc<ShardCore> {
    load_long(layers, label, 64)
}

/// A shard whose sessions may hold `n_ctx` positions.
fn load_long(layers: Option<(usize, usize)>, label: &str, n_ctx: usize) -> Arc<ShardCore> {
    ShardCore::load(ShardConfig {
        layers,
        label: label.into(),
        link: proto::Link::plain(TOKEN),
        n_ctx,
        ..config((1 << 20) + n_ctx * 8192, Duration::from_secs(600))
    })
    .unwrap()
}

/// Serves a shard of `layers` on an ephemeral port; returns its core and a client.
async fn serve(layers: (usize, usize)) -> (Arc<ShardCore>, GrpcShard) {
    serve_long(layers, 64).await
}

async fn serve_long(layers: (usize, usize), n_ctx: usize) -> (Arc<ShardCore>, GrpcShard) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let core = load_long(Some(layers), &addr, n_ctx);
    tokio::spawn(shard::serve(
        Arc::clone(&core),
        listener,
        std::future::pending(),
    ));
    (
        core,
        proto::connect(&addr, &proto::Link::plain(TOKEN)).unwrap(),
    )
}

async fn open(
    first: &GrpcShard,
    core: &ShardCore,
    downstream: &str,
    reply_key: u64,
) -> Result<(mpsc::Sender<RouteMsg>, ReplyStream), tonic::Status> {
    let (tx, rx) = mpsc::channel(8);
    let setup = RouteSetup {
        protocol_version: proto::PROTOCOL_VERSION,
        epoch: 1,
        downstream: vec![downstream.to_string()],
        seam_dtype: 0,
        model_digest: core.info.model_digest.clone(),
        recipes: vec![],
        reply_key,
    };
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Setup(setup)),
    })
    .await
    .unwrap();
    let upstream = first.route(rx).await?;
    Ok((tx, upstream))
}

/// A route of one shard holding the whole model, in memory: the split route's reference.
async fn whole_route(whole: &Arc<ShardCore>) -> (mpsc::Sender<RouteMsg>, ReplyStream) {
    let (tx, rx) = mpsc::channel(8);
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Setup(RouteSetup {
            protocol_version: proto::PROTOCOL_VERSION,
            epoch: 1,
            model_digest: whole.info.model_digest.clone(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let replies = shard::LocalShard::new(Arc::clone(whole))
        .route(rx)
        .await
        .unwrap();
    (tx, replies)
}

async fn send(tx: &mpsc::Sender<RouteMsg>, step_id: u64, fragments: Vec<Fragment>) {
    let step = Step {
        step_id,
        epoch: 1,
        fragments,
        liveness_ms: 10_000,
        ..Default::default()
    };
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Step(step)),
    })
    .await
    .unwrap();
}

async fn next(replies: &mut ReplyStream) -> RouteReply {
    tokio::time::timeout(Duration::from_secs(10), replies.next())
        .await
        .expect("a reply in time")
        .expect("the stream is open")
        .expect("a reply, not an error")
}

/// Waits until the first shard holds no activation bytes in flight (its acknowledgements are
/// in), within a bound.
async fn acknowledged(core: &ShardCore) {
    let t = Instant::now();
    while core.stats().inflight_bytes != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no acknowledgement came back"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_shard_answers_on_the_replies_stream_and_acknowledges_every_step_upstream() {
    let (a_core, a) = serve((0, 2)).await;
    let (b_core, b) = serve((2, 4)).await;
    let b_addr = b.address().to_string();

    // Without a reply key, or naming a replies stream that is not open, the route is refused.
    let e = open(&a, &a_core, &b_addr, 0).await.err().unwrap();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("reply_key"), "{e}");
    let e = open(&a, &a_core, &b_addr, 7).await.err().unwrap();
    assert!(
        e.message().contains(&format!(
            "no replies stream with key 7 is open on shard {b_addr}"
        )),
        "{e}"
    );
    // A key is single-use while its stream is open.
    let mut replies = b.replies(9).await.unwrap();
    assert_eq!(
        b.replies(9).await.err().unwrap().code(),
        tonic::Code::AlreadyExists
    );
    let (tx, mut upstream) = open(&a, &a_core, &b_addr, 9).await.unwrap();

    // The answer of the split model is the unsplit model's.
    let whole = load(None, "whole");
    let prompt = [3, 1, 4, 1, 5];
    let n_embd = a_core.info.n_embd as u64;
    send(&tx, 1, vec![frag(1, 0, &prompt)]).await;
    let r1 = next(&mut replies).await;
    assert_eq!(r1.step_id, 1);
    assert_eq!(r1.outputs.len(), 1);
    let shards: Vec<&str> = r1.hops.iter().map(|h| h.shard.as_str()).collect();
    assert_eq!(shards, [a.address(), b_addr.as_str()]);
    assert_eq!(r1.hops[0].seam_bytes, prompt.len() as u64 * n_embd * 4);
    assert_eq!(
        r1.hops[1].seam_bytes, 0,
        "the last shard sends no activations"
    );
    for h in &r1.hops {
        assert!(h.held_micros >= h.compute_micros, "{h:?}");
    }
    assert!(
        r1.hops[0].seam_rtt_micros.is_empty(),
        "nothing was acknowledged before the first step"
    );
    {
        let (wtx, mut wreplies) = whole_route(&whole).await;
        send(&wtx, 1, vec![frag(1, 0, &prompt)]).await;
        let w = next(&mut wreplies).await;
        assert_eq!(w.outputs[0].token, r1.outputs[0].token);
    }

    // The acknowledgement releases the first shard's in-flight bytes; the next step reports the
    // seam round trip it measured. A fragment the first shard refuses (a session it does not
    // hold) reaches the tracker in the last shard's reply.
    acknowledged(&a_core).await;
    let token = r1.outputs[0].token;
    send(
        &tx,
        2,
        vec![frag(1, prompt.len() as u32, &[token]), frag(2, 3, &[7])],
    )
    .await;
    let r2 = next(&mut replies).await;
    assert_eq!(r2.step_id, 2);
    assert_eq!(r2.outputs.len(), 1);
    assert_eq!(r2.outputs[0].session_id, 1);
    let refused: Vec<(u64, &str)> = r2
        .errors
        .iter()
        .map(|e| (e.session_id, e.kind().name()))
        .collect();
    assert_eq!(refused, [(2, "cache_miss")]);
    assert_eq!(r2.hops[0].seam_bytes, n_embd * 4, "only the accepted row");
    assert_eq!(r2.hops[0].seam_rtt_micros.len(), 1);
    acknowledged(&a_core).await;
    assert_eq!(b_core.stats().inflight_bytes, 0);

    // The first shard's stream carried no answers: the tracker gets each reply once, directly.
    assert!(upstream.next().now_or_never().is_none());
    drop(tx);
    // Closing the route ends the replies stream too.
    let end = tokio::time::timeout(Duration::from_secs(10), replies.next())
        .await
        .expect("the replies stream ends");
    assert!(end.is_none());
}

/// Waits until `f` holds on the first shard's stats, within a bound.
async fn until(core: &ShardCore, what: &str, f: impl Fn(&proto::v1::ShardStats) -> bool) {
    let t = Instant::now();
    while !f(&core.stats()) {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A fragment that also asks for the sampled token's log-probability (compared bitwise).
fn lp(session_id: u64, start_pos: u32, tokens: &[u32]) -> Fragment {
    Fragment {
        want_logprob: true,
        ..frag(session_id, start_pos, tokens)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_shard_starts_decode_steps_on_token_hints_and_rolls_back_those_not_sent() {
    let (a_core, a) = serve((0, 2)).await;
    let (_b_core, b) = serve((2, 4)).await;
    let mut replies = b.replies(21).await.unwrap();
    let (tx, _upstream) = open(&a, &a_core, b.address(), 21).await.unwrap();
    let whole = load(None, "whole");
    let (wtx, mut wreplies) = whole_route(&whole).await;
    // Each step goes to the route and to the whole model; the answers must be bitwise equal.
    let mut step_id = 0;
    let mut both = |fragments: Vec<Fragment>| {
        step_id += 1;
        let (tx, wtx) = (tx.clone(), wtx.clone());
        let id = step_id;
        async move {
            send(&tx, id, fragments.clone()).await;
            send(&wtx, id, fragments).await;
        }
    };
    let answer = async |replies: &mut ReplyStream, wreplies: &mut ReplyStream| {
        let (r, w) = (next(replies).await, next(wreplies).await);
        assert_eq!(r.outputs.len(), 1, "{r:?}");
        assert_eq!(r.outputs[0].token, w.outputs[0].token);
        assert_eq!(
            r.outputs[0].logprob.to_bits(),
            w.outputs[0].logprob.to_bits(),
            "split and whole differ"
        );
        r.outputs[0].token
    };
    let n_vocab = a_core.info.n_vocab;
    let prompt = [3, 1, 4, 1, 5];
    both(vec![lp(1, 0, &prompt)]).await;
    let mut token = answer(&mut replies, &mut wreplies).await;
    // The last shard's hint starts the next step early; the tracker's step, being that step,
    // uses it. A step with another token (as when the tracker stops a session and another takes
    // the place) finds the early one discarded and its position rolled back: the session then
    // continues exactly as on the whole model.
    for (round, sent_as_hinted) in [true, true, false, true, false, false, true]
        .into_iter()
        .enumerate()
    {
        let started = round as u64 + 1;
        let pos = prompt.len() as u32 + round as u32;
        until(&a_core, "the early step starts", |s| {
            s.early_steps_started == started
        })
        .await;
        let (used, discarded) = {
            let s = a_core.stats();
            (s.early_steps_used, s.early_steps_discarded)
        };
        let sent = if sent_as_hinted {
            token
        } else {
            (token + 1) % n_vocab
        };
        both(vec![lp(1, pos, &[sent])]).await;
        token = answer(&mut replies, &mut wreplies).await;
        let s = a_core.stats();
        assert_eq!(
            (s.early_steps_used, s.early_steps_discarded),
            if sent_as_hinted {
                (used + 1, discarded)
            } else {
                (used, discarded + 1)
            },
            "round {round}"
        );
    }
    // Counted once, as the steps the tracker sent: a prompt and seven decode tokens.
    let s = a_core.stats();
    assert_eq!((s.steps, s.prefill_tokens, s.decode_tokens), (8, 5, 7));

    // A step that leaves the session out (another session's prompt) rolls the early step
    // back: a session of 16 positions whose early step took a second KV block returns it.
    // (Session 1's early step, on the last answer's hint, must have started first: a hint
    // that comes after the next step is stale and starts nothing that step could undo.)
    until(&a_core, "session 1's last early step starts", |s| {
        s.early_steps_started == 8
    })
    .await;
    let long: Vec<u32> = (0..16).map(|i| (i * 7 + 3) % n_vocab).collect();
    both(vec![lp(3, 0, &long)]).await;
    let t3 = answer(&mut replies, &mut wreplies).await;
    until(&a_core, "the early step of session 3 starts", |s| {
        s.early_steps_started == 9
    })
    .await;
    let blocks = |c: &ShardCore| c.stats().kv_blocks_in_use;
    // Session 1 (13 positions, one block) and session 3 (16 positions and the early 17th).
    until(&a_core, "the early step holds its block", |s| {
        s.kv_blocks_in_use == 3
    })
    .await;
    both(vec![lp(4, 0, &prompt)]).await;
    answer(&mut replies, &mut wreplies).await;
    // Discarded: three in the loop, then session 1's (the step of session 3's prompt left it
    // out) and session 3's.
    assert_eq!(a_core.stats().early_steps_discarded, 5);
    assert_eq!(
        blocks(&a_core),
        3,
        "sessions 1, 3 and 4 hold one block each"
    );
    // Session 3 then continues at position 16 as on the whole model.
    both(vec![lp(3, 16, &[t3])]).await;
    answer(&mut replies, &mut wreplies).await;
}

/// A route can neither loop nor skip layers: a shard checks that the next shard holds the
/// layers right after its own, and a route naming a shard twice is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_loops_or_skips_layers_is_refused() {
    let (a_core, a) = serve((0, 2)).await;
    let (_b_core, b) = serve((2, 4)).await;
    let (_c_core, c) = serve((0, 2)).await;
    let _replies = b.replies(31).await.unwrap();
    for (downstream, want) in [
        // Back to itself: its next layer is 2, it holds 0..2.
        (vec![a.address().to_string()], "recipe_mismatch"),
        // A shard with the same layers again.
        (vec![c.address().to_string()], "recipe_mismatch"),
        // The right shard twice.
        (
            vec![b.address().to_string(), b.address().to_string()],
            "twice",
        ),
    ] {
        let (tx, rx) = mpsc::channel(8);
        let setup = RouteSetup {
            protocol_version: proto::PROTOCOL_VERSION,
            epoch: 1,
            downstream: downstream.clone(),
            model_digest: a_core.info.model_digest.clone(),
            reply_key: 31,
            ..Default::default()
        };
        tx.send(RouteMsg {
            msg: Some(route_msg::Msg::Setup(setup)),
        })
        .await
        .unwrap();
        let e = a.route(rx).await.err().expect("the route is refused");
        assert!(e.message().contains(want), "{downstream:?}: {e}");
    }
}

/// A 3000-token prompt prefilled along a 2-shard route in chunks of 16, 512 or 3000 positions
/// ends in bitwise the same answer (the token, its log-probability and the top 20, all functions
/// of the logits), which is the whole model's in one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_gives_bitwise_the_same_answer_in_any_chunking_through_a_route() {
    let n = 3000usize;
    let (a_core, a) = serve_long((0, 2), n).await;
    let (_b_core, b) = serve_long((2, 4), n).await;
    let mut replies = b.replies(11).await.unwrap();
    let (tx, _upstream) = open(&a, &a_core, b.address(), 11).await.unwrap();
    let prompt: Vec<u32> = (0..n as u32).map(|i| 3 + (i * 37 + i / 7) % 250).collect();

    let answer = |r: &RouteReply| {
        assert!(r.errors.is_empty() && r.step_error.is_none(), "{r:?}");
        let o = &r.outputs[0];
        let top: Vec<(u32, u32)> = o
            .top
            .iter()
            .map(|t| (t.token, t.logprob.to_bits()))
            .collect();
        assert_eq!(top.len(), 20);
        (o.token, o.logprob.to_bits(), top)
    };
    let fragment = |session: u64, start: usize, part: &[u32], last: bool| Fragment {
        want_output: last,
        // The session's number of top log-probabilities is set when it starts.
        n_top_logprobs: 20,
        want_logprob: last,
        ..frag(session, start as u32, part)
    };
    let mut answers = Vec::new();
    let mut step = 0;
    for (session, chunk) in [(1u64, 16usize), (2, 512), (3, n)] {
        let mut got = None;
        for (ci, part) in prompt.chunks(chunk).enumerate() {
            let last = (ci + 1) * chunk >= n;
            step += 1;
            send(&tx, step, vec![fragment(session, ci * chunk, part, last)]).await;
            let mut r = next(&mut replies).await;
            while r.progress.is_some() {
                r = next(&mut replies).await;
            }
            assert_eq!(r.step_id, step);
            if last {
                got = Some(answer(&r));
            } else {
                assert!(r.outputs.is_empty() && r.errors.is_empty(), "{r:?}");
            }
        }
        answers.push(got.unwrap());
    }
    assert_eq!(answers[0], answers[1], "chunks of 16 against 512");
    assert_eq!(answers[1], answers[2], "chunks of 512 against one step");

    let whole = load_long(None, "whole", n);
    let (wtx, mut wreplies) = whole_route(&whole).await;
    send(&wtx, 1, vec![fragment(1, 0, &prompt, true)]).await;
    let mut w = next(&mut wreplies).await;
    while w.progress.is_some() {
        w = next(&mut wreplies).await;
    }
    assert_eq!(answer(&w), answers[2], "split against whole");
}
