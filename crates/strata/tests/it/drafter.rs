//! A draft model in a process of its own (`strata drafter`, a tracker's `--drafter`): the
//! answers are plain decoding's through it, across its loss, its return and its stop, and
//! whatever a drafter sends; the drafter refuses what a stream must not send, and bounds the
//! sessions it holds.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::drafter_client::DrafterClient;
use proto::{DraftAsk, VocabRequest};
use serde_json::json;
use testkit::observe::{tracker_metric as metric, wait_until};
use testkit::procs::{self, Proc};

use super::speculation::{
    answers, assert_same, assert_verified, cases, exe, route, stream_ids, streamed, TOKEN,
};

fn drafter(model: &Path, token: &Path, listen: &str) -> Proc {
    drafter_with(model, token, listen, &[])
}

fn drafter_with(model: &Path, token: &Path, listen: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "drafter".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--listen".into(),
        listen.into(),
        "--cluster-token-file".into(),
        token.display().to_string(),
        "--threads".into(),
        "1".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    procs::spawn(exe(), &args, "strata drafter listening on ", "drafter")
}

/// A tracker drafting from the drafter at `at` for one route of `shards`.
fn drafting_tracker(shards: &[Proc], token: &Path, at: &str) -> Proc {
    let refs: Vec<&Proc> = shards.iter().collect();
    procs::tracker(
        exe(),
        &refs,
        token,
        &[
            "--drafter",
            at,
            "--draft-max",
            "6",
            "--draft-max-batch",
            "16",
        ],
    )
}

/// Drafts from a drafter process (SmolLM2 drafting for itself) through a route of two shards:
/// every answer equals plain decoding's one and 4 at a time, and drafts were verified under the
/// `model` drafter. A SIGKILL of the drafter while 4 streams decode costs none of them an
/// error or a token; answers go on without drafts, the same; a drafter started again on the
/// same address is used again.
#[test]
fn a_drafter_process_gives_plain_decodings_answers_and_its_loss_costs_no_client_anything() {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    let first = drafter(&m, &token, "127.0.0.1:0");
    let at = first.addr.clone();
    let shards = route(&["0..15", "15..30"], &token);
    let tracker = drafting_tracker(&shards, &token, &at);
    let addr = &tracker.addr;
    let cases = cases(1, 32);
    let plain = answers(addr, &cases, 4, false);
    assert_eq!(metric(addr, "strata_spec_drafted_tokens_total"), 0.0);
    assert_same(&plain, &answers(addr, &cases, 1, true), "one at a time");
    assert_same(&plain, &answers(addr, &cases, 4, true), "4 at once");
    assert!(
        testkit::http::get(addr, "/metrics")
            .body
            .contains("strata_spec_drafted_tokens_total{drafter=\"model\""),
        "drafts counted under the model drafter"
    );
    assert_verified(addr, "a drafter process");

    // Its loss while 4 streams decode, once drafts were kept during them.
    let long = |i: usize| {
        let mut b = streamed(i);
        b["max_tokens"] = json!(256);
        b
    };
    let want: Vec<Vec<u64>> = (0..4)
        .map(|i| {
            let mut b = long(i);
            b["speculative"] = json!(false);
            stream_ids(addr, &b).unwrap()
        })
        .collect();
    let kept = metric(addr, "strata_spec_accepted_tokens_total");
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let addr = addr.clone();
            let body = long(i);
            std::thread::spawn(move || stream_ids(&addr, &body))
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || metric(
            addr,
            "strata_spec_accepted_tokens_total"
        ) > kept),
        "no draft was kept while the streams decoded"
    );
    first.signal(libc::SIGKILL);
    assert!(
        handles.iter().any(|h| !h.is_finished()),
        "every stream ended before the drafter was killed"
    );
    for (i, h) in handles.into_iter().enumerate() {
        let got = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i} saw an error: {e}"));
        assert_eq!(got, want[i], "stream {i} differs from plain decoding");
    }
    assert_same(&plain, &answers(addr, &cases, 4, true), "the drafter lost");

    // Back on the same address: the tracker opens its stream again and drafts.
    let _second = drafter(&m, &token, &at);
    let drafted = metric(addr, "strata_spec_drafted_tokens_total");
    let back = wait_until(Duration::from_secs(60), || {
        assert_same(
            &plain[..1],
            &answers(addr, &cases[..1], 1, true),
            "the drafter back",
        );
        metric(addr, "strata_spec_drafted_tokens_total") > drafted
    });
    assert!(
        back,
        "the tracker never drafted from the drafter started again"
    );
}

/// What a stream must not send ends it with `invalid_argument`, naming why, and the drafter
/// goes on serving other streams; a connection without the cluster token is refused. The
/// drafter holds at most `--max-sessions` sessions over all its streams: a session past them,
/// one it does not hold and one past the draft model's context are answered `closed` (no
/// drafts, ask no more), and a session that ends gives its place back.
#[test]
fn a_drafter_refuses_garbage_and_strangers_and_bounds_its_sessions() {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    let d = drafter_with(&m, &token, "127.0.0.1:0", &["--max-sessions", "2"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let connect = |secret: &str| {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", d.addr))
                .unwrap()
                .connect_lazy();
            DrafterClient::with_interceptor(channel, proto::Auth::new(secret).unwrap())
        };
        let stranger = connect("not-the-cluster-token-at-all")
            .vocab(VocabRequest {})
            .await
            .unwrap_err();
        assert_eq!(stranger.code(), tonic::Code::Unauthenticated);
        let mut client = connect(TOKEN);
        assert!(!client
            .vocab(VocabRequest {})
            .await
            .unwrap()
            .into_inner()
            .gguf
            .is_empty());

        let ask = |session: u64, from: u64, tokens: Vec<u32>, k: u32| DraftAsk {
            session,
            from,
            tokens,
            k,
            forget: false,
            // Each ask's own number: its offer carries it back.
            seq: session * 1000 + from,
        };
        // One bad ask after a good one ends the stream, naming what was wrong.
        for (bad, why) in [
            (
                ask(2, 0, vec![1, 2, u32::MAX], 4),
                "not in the draft model's vocabulary",
            ),
            (ask(1, 9, vec![1, 2], 4), "past the 3 held"),
            (ask(2, 0, vec![1, 2], 0), "k must be 1 to"),
            (ask(2, 0, vec![1, 2], 1000), "k must be 1 to"),
        ] {
            let asks = vec![ask(1, 0, vec![1, 2, 3], 4), bad];
            let mut offers = client
                .draft(futures::stream::iter(asks))
                .await
                .unwrap()
                .into_inner();
            let mut seen = Vec::new();
            let err = loop {
                match offers.message().await {
                    Ok(Some(o)) => seen.push(o),
                    Ok(None) => panic!("the stream ended without refusing {why}"),
                    Err(e) => break e,
                }
            };
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
            assert!(err.message().contains(why), "{}", err.message());
            for o in seen {
                assert_eq!((o.session, o.len), (1, 3));
                assert!(o.draft.len() <= 4);
            }
        }

        // Still serving: a good ask gets its draft, the greedy continuation of 4 tokens.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut offers = client
            .draft(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        tx.send(ask(7, 0, vec![1, 2, 3], 4)).unwrap();
        let first = offers.message().await.unwrap().unwrap();
        assert_eq!((first.session, first.len, first.draft.len()), (7, 3, 4));
        assert_eq!(first.seq, 7000, "the offer names the ask it answers");
        // The same session goes on from what it sent: the draft follows all of its tokens.
        tx.send(ask(7, 3, first.draft[..2].to_vec(), 2)).unwrap();
        let next = offers.message().await.unwrap().unwrap();
        assert_eq!((next.session, next.len, next.seq), (7, 5, 7003));
        assert_eq!(next.draft, first.draft[2..4]);
        assert!(!first.closed && !next.closed);

        // Session 7 holds one of the two places; another stream's session 8 the other.
        let (tx2, rx2) = tokio::sync::mpsc::unbounded_channel();
        let mut offers2 = client
            .draft(tokio_stream::wrappers::UnboundedReceiverStream::new(rx2))
            .await
            .unwrap()
            .into_inner();
        macro_rules! offer {
            ($ask:expr) => {{
                tx2.send($ask).unwrap();
                offers2.message().await.unwrap().unwrap()
            }};
        }
        let o = offer!(ask(8, 0, vec![1, 2, 3], 4));
        assert_eq!(
            (o.session, o.len, o.draft.len(), o.closed),
            (8, 3, 4, false)
        );
        // No place left: closed, and so is what follows for a session not held (no error).
        let o = offer!(ask(9, 0, vec![1, 2, 3], 4));
        assert_eq!((o.session, o.len, o.draft.len(), o.closed), (9, 3, 0, true));
        let o = offer!(ask(9, 3, vec![4, 5], 4));
        assert_eq!((o.session, o.len, o.draft.len(), o.closed), (9, 5, 0, true));
        assert_eq!(o.seq, 9003, "a closed offer names the ask it answers");
        // Session 8 ends: its place is free, and a session past the context does not keep it.
        tx2.send(DraftAsk {
            session: 8,
            forget: true,
            ..DraftAsk::default()
        })
        .unwrap();
        let o = offers2.message().await.unwrap().unwrap();
        assert_eq!(
            (o.session, o.len, o.closed),
            (8, 0, true),
            "a forget is answered"
        );
        let n_ctx = model::ModelConfig::from_header(gguf::GgufFile::open(&m).unwrap().header())
            .unwrap()
            .n_ctx_train;
        let o = offer!(ask(10, 0, vec![1; n_ctx + 1], 4));
        assert_eq!(
            (o.session, o.len as usize, o.draft.len(), o.closed),
            (10, n_ctx + 1, 0, true)
        );
        let o = offer!(ask(11, 0, vec![1, 2, 3], 4));
        assert_eq!(
            (o.session, o.len, o.draft.len(), o.closed),
            (11, 3, 4, false)
        );
    });
}

/// What a fake drafter answers every ask with.
#[derive(Clone, Copy)]
enum Fake {
    /// A token of the session's own, repeated past any step's length, then ids past any
    /// vocabulary.
    Garbage,
    /// `closed`: no drafts for this session.
    Closed,
}

/// A fake `Drafter` service on 127.0.0.1 (serving `m`'s vocabulary and the test token), on
/// `rt`: its address, and how many asks each session sent.
fn fake_drafter(
    rt: &tokio::runtime::Runtime,
    m: &Path,
    fake: Fake,
) -> (String, Arc<Mutex<HashMap<u64, usize>>>) {
    use proto::drafter_server::{Drafter, DrafterServer};
    use proto::{DraftOffer, VocabReply};

    struct Service {
        vocab: Vec<u8>,
        fake: Fake,
        asks: Arc<Mutex<HashMap<u64, usize>>>,
    }

    type Offers =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<DraftOffer, tonic::Status>> + Send>>;

    #[tonic::async_trait]
    impl Drafter for Service {
        async fn vocab(
            &self,
            _: tonic::Request<VocabRequest>,
        ) -> Result<tonic::Response<VocabReply>, tonic::Status> {
            Ok(tonic::Response::new(VocabReply {
                gguf: self.vocab.clone(),
            }))
        }

        type DraftStream = Offers;

        async fn draft(
            &self,
            req: tonic::Request<tonic::Streaming<DraftAsk>>,
        ) -> Result<tonic::Response<Offers>, tonic::Status> {
            let mut asks = req.into_inner();
            let (counts, fake) = (Arc::clone(&self.asks), self.fake);
            let (tx, rx) = tokio::sync::mpsc::channel(64);
            tokio::spawn(async move {
                let mut last = HashMap::new();
                while let Ok(Some(ask)) = asks.message().await {
                    if ask.forget {
                        last.remove(&ask.session);
                        continue;
                    }
                    *counts.lock().unwrap().entry(ask.session).or_default() += 1;
                    if let Some(&t) = ask.tokens.last() {
                        last.insert(ask.session, t);
                    }
                    let (draft, closed) = match fake {
                        Fake::Garbage => {
                            let mut d = vec![last.get(&ask.session).copied().unwrap_or(0); 20];
                            d.extend([u32::MAX, 4_000_000_000, 7]);
                            (d, false)
                        }
                        Fake::Closed => (Vec::new(), true),
                    };
                    let offer = DraftOffer {
                        session: ask.session,
                        len: ask.from + ask.tokens.len() as u64,
                        draft,
                        closed,
                        seq: ask.seq,
                    };
                    if tx.send(Ok(offer)).await.is_err() {
                        break;
                    }
                }
            });
            Ok(tonic::Response::new(Box::pin(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )))
        }
    }

    let asks = Arc::new(Mutex::new(HashMap::new()));
    let service = Service {
        vocab: shard::vocab_file(&gguf::GgufFile::open(m).unwrap()),
        fake,
        asks: Arc::clone(&asks),
    };
    let at = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap().to_string();
        let svc = tonic::service::interceptor::InterceptedService::new(
            DrafterServer::new(service),
            proto::TokenCheck::new(TOKEN),
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        at
    });
    (at, asks)
}

/// A route of one shard process and a tracker drafting from a fake drafter (served on `_rt`).
struct FakeCluster {
    tracker: Proc,
    /// How many asks each session sent the fake.
    asks: Arc<Mutex<HashMap<u64, usize>>>,
    _shards: Vec<Proc>,
    _rt: tokio::runtime::Runtime,
}

impl FakeCluster {
    fn new(fake: Fake) -> FakeCluster {
        let token = procs::token_file(TOKEN);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (at, asks) = fake_drafter(&rt, &testkit::real_model(), fake);
        let shards = route(&["0..30"], &token);
        let tracker = drafting_tracker(&shards, &token, &at);
        FakeCluster {
            tracker,
            asks,
            _shards: shards,
            _rt: rt,
        }
    }
}

/// A drafter that proposes garbage: a token of the session's own, then more tokens than any
/// step takes, then ids past any vocabulary. No client sees it, speculating or not, sharing
/// steps with those that do: the tracker cuts each draft at its first id outside the
/// vocabulary, and the answers are plain decoding's.
#[test]
fn a_drafter_proposing_garbage_changes_no_answer_and_fails_no_step() {
    let fake = FakeCluster::new(Fake::Garbage);
    let (addr, asks) = (&fake.tracker.addr, &fake.asks);
    let cases = cases(1, 32);
    let plain = answers(addr, &cases, 4, false);
    // Speculating and plain requests at once, so that steps hold both.
    let (spec, also_plain) = std::thread::scope(|s| {
        let spec = s.spawn(|| answers(addr, &cases, 4, true));
        let also_plain = s.spawn(|| answers(addr, &cases, 4, false));
        (spec.join().unwrap(), also_plain.join().unwrap())
    });
    assert_same(&plain, &spec, "speculating from garbage");
    assert_same(&plain, &also_plain, "beside those speculating from garbage");
    assert!(
        !asks.lock().unwrap().is_empty(),
        "the drafter was never asked"
    );
    assert!(
        metric(addr, "strata_spec_drafted_tokens_total") > 0.0,
        "the valid head of each draft was verified"
    );
}

/// A session the drafter answers `closed` asks no more (for 5 s, longer than any of these
/// requests takes): one ask a session, and the answers are plain decoding's.
#[test]
fn a_session_the_drafter_closes_asks_no_more() {
    let fake = FakeCluster::new(Fake::Closed);
    let (addr, asks) = (&fake.tracker.addr, &fake.asks);
    let cases = cases(1, 32);
    let plain = answers(addr, &cases, 4, false);
    assert_same(
        &plain,
        &answers(addr, &cases, 4, true),
        "closed by the drafter",
    );
    let asks = asks.lock().unwrap();
    // Sessions held to a grammar (the last two cases) never ask.
    assert_eq!(asks.len(), cases.len() - 2, "{asks:?}");
    assert!(asks.values().all(|&n| n == 1), "{asks:?}");
}

/// With `--ahead`, a drafter drafts past each draft while the route verifies it: every request
/// keeps drafting to its end (a draft made ready by drafting ahead wakes whoever asked for
/// it), the answers are plain decoding's. On SIGTERM the drafter ends its streams and exits
/// with a tracker connected, and the tracker's answers stay the same.
#[test]
fn a_drafter_drafting_ahead_drafts_for_every_token_and_stops_on_sigterm() {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    let mut d = drafter_with(&m, &token, "127.0.0.1:0", &["--ahead", "4"]);
    let shards = route(&["0..30"], &token);
    let tracker = drafting_tracker(&shards, &token, &d.addr);
    let addr = &tracker.addr;
    let cases = cases(1, 48);
    let plain = answers(addr, &cases, 1, false);
    for (i, (case, want)) in cases.iter().zip(&plain).enumerate() {
        let before = metric(addr, "strata_spec_drafted_tokens_total");
        let got = answers(addr, std::slice::from_ref(case), 1, true);
        assert_same(std::slice::from_ref(want), &got, "drafting ahead");
        let drafted = metric(addr, "strata_spec_drafted_tokens_total") - before;
        // SmolLM2 drafts for itself, so most steps draft, unless the answer is short or held
        // to a grammar (the last two cases: a session held to one gets no drafts).
        let tokens = want["ids"].as_array().map_or(0, |a| a.len());
        eprintln!("case {i}: {tokens} tokens, {drafted} drafted");
        if tokens >= 16 && i + 2 < cases.len() {
            assert!(
                drafted >= tokens as f64 / 4.0,
                "case {i}: {drafted} tokens drafted for an answer of {tokens}"
            );
        }
    }

    // It ends its streams at once; only a connection that stays open would hold it for the
    // grace of 10 s.
    d.signal(libc::SIGTERM);
    assert!(
        wait_until(Duration::from_secs(5), || d.exited()),
        "the drafter did not end its streams on SIGTERM with a tracker connected"
    );
    assert_same(
        &plain,
        &answers(addr, &cases, 4, true),
        "the drafter stopped",
    );
}
