//! A draft model in a process of its own (`strata drafter`, a tracker's `--drafter`): the
//! answers are plain decoding's through it, across its loss and its return, and the drafter
//! refuses what a stream must not send.

use std::path::Path;
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
    procs::spawn(
        exe(),
        &[
            "drafter".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--listen".into(),
            listen.into(),
            "--cluster-token-file".into(),
            token.display().to_string(),
            "--threads".into(),
            "1".into(),
        ],
        "strata drafter listening on ",
        "drafter",
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
    let refs: Vec<&Proc> = shards.iter().collect();
    let tracker = procs::tracker(
        exe(),
        &refs,
        &token,
        &[
            "--drafter",
            &at,
            "--draft-max",
            "6",
            "--draft-max-batch",
            "16",
        ],
    );
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
/// goes on serving other streams; a connection without the cluster token is refused.
#[test]
fn a_drafter_refuses_garbage_and_strangers_and_keeps_serving() {
    let token = procs::token_file(TOKEN);
    let m = testkit::real_model();
    let d = drafter(&m, &token, "127.0.0.1:0");
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
        };
        // One bad ask after a good one ends the stream, naming what was wrong.
        for (bad, why) in [
            (
                ask(2, 0, vec![1, 2, u32::MAX], 4),
                "not in the draft model's vocabulary",
            ),
            (ask(2, 5, vec![1, 2], 4), "starts at token 5"),
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
        // The same session goes on from what it sent: the draft follows all of its tokens.
        tx.send(ask(7, 3, first.draft[..2].to_vec(), 2)).unwrap();
        let next = offers.message().await.unwrap().unwrap();
        assert_eq!((next.session, next.len), (7, 5));
        assert_eq!(next.draft, first.draft[2..4]);
    });
}
