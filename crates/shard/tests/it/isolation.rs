//! What one client of a shard can and cannot do to another: sessions are keyed by the route
//! stream that opened them, a malformed step is refused without harming anyone, a compute thread
//! that dies takes its streams down with a typed failure (the shard stops looking alive), and a
//! shard told to stop ends its streams and stops even while a tracker holds them open.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{config, frag};
use futures::StreamExt;
use proto::v1::{route_msg, Fragment, RouteMsg, RouteReply, RouteSetup, Step};
use proto::{ReplyStream, ShardTransport};
use shard::{LocalShard, ShardConfig, ShardCore};
use tokio::sync::mpsc;

fn core() -> Arc<ShardCore> {
    ShardCore::load(config(64 << 20, Duration::from_secs(600))).unwrap()
}

/// A route stream of one whole-model shard, as one tracker's runner opens it.
struct Route {
    tx: mpsc::Sender<RouteMsg>,
    replies: ReplyStream,
    next_step: u64,
}

async fn open(transport: &dyn ShardTransport, digest: &str) -> Result<Route, tonic::Status> {
    let (tx, rx) = mpsc::channel(8);
    let setup = RouteSetup {
        protocol_version: proto::PROTOCOL_VERSION,
        epoch: 1,
        model_digest: digest.into(),
        ..Default::default()
    };
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Setup(setup)),
    })
    .await
    .unwrap();
    let replies = transport.route(rx).await?;
    Ok(Route {
        tx,
        replies,
        next_step: 1,
    })
}

impl Route {
    async fn send(&mut self, fragments: Vec<Fragment>, release: Vec<u64>) {
        let step = Step {
            step_id: self.next_step,
            epoch: 1,
            fragments,
            release,
            liveness_ms: 10_000,
            ..Default::default()
        };
        self.next_step += 1;
        self.tx
            .send(RouteMsg {
                msg: Some(route_msg::Msg::Step(step)),
            })
            .await
            .unwrap();
    }

    /// The next message that is not progress.
    async fn reply(&mut self) -> RouteReply {
        loop {
            let r = tokio::time::timeout(Duration::from_secs(10), self.replies.next())
                .await
                .expect("a reply in time")
                .expect("the stream is open")
                .expect("a reply, not an error");
            if r.progress.is_none() {
                return r;
            }
        }
    }

    async fn step(&mut self, fragments: Vec<Fragment>, release: Vec<u64>) -> RouteReply {
        self.send(fragments, release).await;
        self.reply().await
    }

    /// The token sampled for one fragment.
    async fn token(&mut self, f: Fragment) -> u32 {
        let r = self.step(vec![f], vec![]).await;
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        r.outputs[0].token
    }
}

/// Greedy tokens of `prompt` continued `n` times on a fresh shard: what a session gives alone.
async fn alone(prompt: &[u32], n: usize) -> Vec<u32> {
    let c = core();
    let mut r = open(&LocalShard::new(Arc::clone(&c)), &c.info.model_digest)
        .await
        .unwrap();
    let mut out = vec![r.token(frag(1, 0, prompt)).await];
    for i in 1..n {
        let pos = (prompt.len() + i - 1) as u32;
        out.push(r.token(frag(1, pos, &[out[i - 1]])).await);
    }
    out
}

/// Two route streams (two trackers, or two routes of one tracker) both number their first
/// session 1: each continues on its own cache, and one releasing its session 1 leaves the
/// other's alone.
#[tokio::test]
async fn two_route_streams_that_number_their_sessions_alike_never_share_a_cache() {
    let c = core();
    let local = LocalShard::new(Arc::clone(&c));
    let digest = c.info.model_digest.clone();
    let mut a = open(&local, &digest).await.unwrap();
    let mut b = open(&local, &digest).await.unwrap();
    let (pa, pb): (Vec<u32>, Vec<u32>) = ((10..16).collect(), (40..49).collect());
    let (want_a, want_b) = (alone(&pa, 4).await, alone(&pb, 4).await);
    let mut got_a = vec![a.token(frag(1, 0, &pa)).await];
    let mut got_b = vec![b.token(frag(1, 0, &pb)).await];
    for i in 1..4 {
        let (qa, qb) = ((pa.len() + i - 1) as u32, (pb.len() + i - 1) as u32);
        got_a.push(a.token(frag(1, qa, &[got_a[i - 1]])).await);
        got_b.push(b.token(frag(1, qb, &[got_b[i - 1]])).await);
    }
    assert_eq!(got_a, want_a, "stream a's session 1");
    assert_eq!(got_b, want_b, "stream b's session 1");
    assert_eq!(c.stats().sessions, 2, "one session per stream");
    // b forgets its session 1; a's continues where it was.
    b.step(vec![], vec![1]).await;
    assert_eq!(c.stats().sessions, 1);
    let pos = (pa.len() + 3) as u32;
    let r = a.step(vec![frag(1, pos, &[got_a[3]])], vec![]).await;
    assert!(r.errors.is_empty() && r.outputs.len() == 1, "{r:?}");
    // b cannot continue a's session under the same number: to b it does not exist.
    let r = b.step(vec![frag(1, pos + 1, &[7])], vec![]).await;
    let reasons: Vec<&str> = r.errors.iter().map(|e| e.kind().name()).collect();
    assert_eq!(reasons, ["cache_miss"]);
}

/// A step naming one session twice (which would borrow its cache twice) has the second
/// fragment refused as `invalid_request`; the shard goes on serving this stream and others.
#[tokio::test]
async fn a_step_naming_one_session_twice_is_refused_and_the_shard_keeps_serving() {
    let c = core();
    let local = LocalShard::new(Arc::clone(&c));
    let digest = c.info.model_digest.clone();
    let mut a = open(&local, &digest).await.unwrap();
    let r = a
        .step(vec![frag(1, 0, &[1, 2, 3]), frag(1, 0, &[4, 5])], vec![])
        .await;
    assert_eq!(r.outputs.len(), 1, "{r:?}");
    let refused: Vec<(u64, &str)> = r
        .errors
        .iter()
        .map(|e| (e.session_id, e.kind().name()))
        .collect();
    assert_eq!(refused, [(1, "invalid_request")]);
    assert!(
        r.errors[0].message.contains("more than one fragment"),
        "{}",
        r.errors[0].message
    );
    // The first fragment ran as it would alone, and the session continues.
    assert_eq!(r.outputs[0].token, alone(&[1, 2, 3], 1).await[0]);
    let next = a.token(frag(1, 3, &[r.outputs[0].token])).await;
    assert_eq!(next, alone(&[1, 2, 3], 2).await[1]);
    // Another stream is served as usual.
    let mut b = open(&local, &digest).await.unwrap();
    assert_eq!(
        b.token(frag(1, 0, &[9, 9])).await,
        alone(&[9, 9], 1).await[0]
    );
    assert!(local.stats(Duration::from_secs(1)).await.is_ok());
}

/// A compute thread that panics (here by fault injection, as a bug would) fails the step in
/// flight and every open stream with `shard_failed` naming the shard, and from then on the
/// shard refuses every RPC: it never answers Describe or Stats as if it were alive.
#[tokio::test]
async fn a_compute_thread_that_panics_fails_its_streams_and_the_shard_stops_looking_alive() {
    let c = core();
    let local = LocalShard::new(Arc::clone(&c));
    let digest = c.info.model_digest.clone();
    let mut a = open(&local, &digest).await.unwrap();
    let mut b = open(&local, &digest).await.unwrap();
    a.token(frag(1, 0, &[1, 2, 3])).await;
    c.inject_panic();
    let why = tokio::time::timeout(Duration::from_secs(5), c.stopped())
        .await
        .expect("the stop is announced");
    assert!(why.to_string().contains("panicked"), "{why}");
    for route in [&mut a, &mut b] {
        let r = route.step(vec![frag(2, 0, &[4, 5])], vec![]).await;
        let e = r.step_error.expect("a step error, not a hang");
        assert_eq!(
            (e.kind().name(), e.shard.as_str()),
            ("shard_failed", "test-shard")
        );
        assert!(
            e.message.contains("compute thread stopped"),
            "{}",
            e.message
        );
    }
    let d = local.describe(Duration::from_secs(1)).await.unwrap_err();
    assert_eq!(d.code(), tonic::Code::Unavailable, "{d}");
    assert!(local.stats(Duration::from_secs(1)).await.is_err());
    assert!(open(&local, &digest).await.is_err(), "no new route opens");
}

const TOKEN: &str = "isolation-test-token-0123456789";

/// Serves a whole tiny model on an ephemeral port; the server task ends on `stop` or when the
/// compute thread stops.
async fn serve_whole(
    label_of: impl FnOnce(&str) -> ShardConfig,
) -> (
    Arc<ShardCore>,
    proto::GrpcShard,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), shard::Error>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let c = ShardCore::load(label_of(&addr)).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(shard::serve(Arc::clone(&c), listener, async move {
        let _ = stop_rx.await;
    }));
    (
        c,
        proto::connect(&addr, &proto::Link::plain(TOKEN)).unwrap(),
        stop_tx,
        served,
    )
}

fn grpc_config(addr: &str) -> ShardConfig {
    ShardConfig {
        label: addr.to_string(),
        link: proto::Link::plain(TOKEN),
        ..config(64 << 20, Duration::from_secs(600))
    }
}

/// Told to stop while a tracker holds a route stream open, the shard sends that stream a
/// typed `shard_failed` ("shutting down") and its server ends within the grace period; a
/// stopped compute thread ends the server with an error (the process exits, not lingers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_told_to_stop_ends_its_streams_and_stops_though_a_tracker_holds_them() {
    let (c, client, stop, served) = serve_whole(grpc_config).await;
    let mut r = open(&client, &c.info.model_digest).await.unwrap();
    r.token(frag(1, 0, &[1, 2, 3])).await;
    let t0 = Instant::now();
    stop.send(()).unwrap();
    let e = r.reply().await.step_error.expect("a typed failure");
    assert_eq!(e.kind().name(), "shard_failed");
    assert!(e.message.contains("shutting down"), "{}", e.message);
    let result = tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("the server stops")
        .unwrap();
    assert!(result.is_ok(), "{result:?}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());

    let (c, client, _stop, served) = serve_whole(grpc_config).await;
    let mut r = open(&client, &c.info.model_digest).await.unwrap();
    r.token(frag(1, 0, &[1, 2, 3])).await;
    c.inject_panic();
    let result = tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("the server stops when the compute thread does")
        .unwrap();
    assert!(
        matches!(result, Err(shard::Error::Stopped(_))),
        "{result:?}"
    );
}

/// A step that takes longer than its liveness is not a lost shard: while it waits for the
/// compute thread and computes, the shard sends progress at a fraction of the liveness.
#[tokio::test]
async fn a_shard_holding_a_long_step_says_it_is_still_working_on_it() {
    let c = ShardCore::load(ShardConfig {
        n_ctx: 4096,
        ..config(256 << 20, Duration::from_secs(600))
    })
    .unwrap();
    let local = LocalShard::new(Arc::clone(&c));
    let mut a = open(&local, &c.info.model_digest).await.unwrap();
    // A step much longer than its liveness: long prompts (attention grows with their square).
    let liveness_ms = 40;
    let fragments: Vec<Fragment> = (1..=2)
        .map(|s| {
            frag(
                s,
                0,
                &(0..2000)
                    .map(|i| (i * 13 + s as u32) % 200)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let step = Step {
        step_id: 1,
        epoch: 1,
        fragments,
        liveness_ms,
        ..Default::default()
    };
    let t0 = Instant::now();
    a.tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Step(step)),
    })
    .await
    .unwrap();
    let mut progress = Vec::new();
    let reply = loop {
        let r = tokio::time::timeout(Duration::from_secs(60), a.replies.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match &r.progress {
            Some(p) => progress.push((t0.elapsed(), p.shard.clone())),
            None => break r,
        }
    };
    let took = t0.elapsed();
    assert_eq!(reply.outputs.len(), 2, "{:?}", reply.errors);
    eprintln!(
        "a step of {took:?} with {} progress messages",
        progress.len()
    );
    assert!(
        took > Duration::from_millis(8 * u64::from(liveness_ms)),
        "the step took only {took:?}; make it longer"
    );
    assert!(progress.iter().all(|(_, s)| s == "test-shard"));
    // Progress every quarter of the liveness: no silence near the step's length. (Bounded
    // loosely, at three times the liveness, so a busy machine's scheduling does not matter.)
    let mut marks: Vec<Duration> = progress.iter().map(|(t, _)| *t).collect();
    marks.push(took);
    let mut last = Duration::ZERO;
    for t in marks {
        assert!(
            t - last <= Duration::from_millis(u64::from(liveness_ms) * 3),
            "silent from {last:?} to {t:?} ({} progress messages)",
            progress.len()
        );
        last = t;
    }
}
