//! The route driver on a tiny model's shard in this process (the in-memory transport, with
//! faults injected): replay after a cache miss, the choice between moving a session and
//! failing it, stop strings, cancellation. No process is started and nothing is downloaded.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use engine::{FinishReason, Priority, Reason, Refusal};
use proto::v1::{SessionError, StepError};
use shard::{Fault, FaultyShard};
use tokio::sync::{mpsc, oneshot, watch};

use super::*;
use crate::config::TrackerConfig;
use crate::route::cluster::{monitor, Cluster, Health};
use crate::route::start::admission_of;

/// No other route: a draining shard's sessions stay.
struct Alone;

impl Replicas for Alone {
    fn another_takes_work(&self, _: &str, _: &str) -> bool {
        false
    }
}

/// A running driver over one tiny-model shard.
struct Route {
    shard: FaultyShard,
    commands: mpsc::Sender<Command>,
    moved: mpsc::UnboundedReceiver<Box<Moved>>,
    load: Arc<std::sync::atomic::AtomicUsize>,
    digest: String,
}

fn core(name: &str) -> Arc<shard::ShardCore> {
    shard::ShardCore::load(shard::ShardConfig::in_process(testkit::write_tiny_model(
        &testkit::TinySpec::default(),
        name,
    )))
    .unwrap()
}

async fn start(name: &str) -> Route {
    let shard = FaultyShard::new(core(name));
    let cluster = Arc::new(
        Cluster::connect(vec![Arc::new(shard.clone())], Duration::from_secs(10))
            .await
            .unwrap(),
    );
    let vocab = cluster.shards[0].vocab().await.unwrap();
    let vocab = gguf::GgufFile::from_bytes(vocab.gguf).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_header(vocab.header()).unwrap());
    let config = TrackerConfig::default();
    let metrics = Arc::new(Metrics::default());
    let (health_tx, health) = watch::channel(Health::default());
    let period = Duration::from_millis(50);
    tokio::spawn(monitor(
        Arc::clone(&cluster),
        period,
        health_tx,
        Arc::clone(&metrics),
    ));
    let (route_up, mut up) = watch::channel(false);
    let (failover, moved) = mpsc::unbounded_channel();
    let load = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let runner = Runner::new(RunnerParts {
        config: RunnerConfig {
            scheduler: engine::SchedulerConfig {
                pipeline_depth: 1,
                ..config.scheduler
            },
            seam: config.seam,
            liveness: Duration::from_secs(5),
            prefix_scope: config.prefix_scope,
        },
        name: "local".into(),
        admission: admission_of(&config, &cluster),
        cluster: Arc::clone(&cluster),
        tokenizer,
        metrics,
        health,
        route_up,
        ledger: None,
        failover: Some(failover),
        replicas: Arc::new(Alone),
        load: Arc::clone(&load),
        prefixes: Arc::new(crate::route::prefixes::PrefixIndex::new(64)),
        pace: Default::default(),
        draft: None,
    });
    let (commands, rx) = mpsc::channel(16);
    tokio::spawn(runner.run(rx));
    tokio::time::timeout(Duration::from_secs(10), up.wait_for(|u| *u))
        .await
        .unwrap()
        .unwrap();
    Route {
        shard,
        commands,
        moved,
        load,
        digest: cluster.model_digest.clone(),
    }
}

const PROMPT: [u32; 3] = [10, 11, 12];

fn job(max_tokens: usize, stop: Vec<String>) -> Job {
    Job {
        prompt_ids: PROMPT.to_vec(),
        max_tokens,
        sampling: proto::v1::Sampling {
            temperature: 0.0,
            top_p: 1.0,
            repeat_penalty: 1.0,
            seed: 1,
            n_prompt: PROMPT.len() as u32,
            ..Default::default()
        },
        stop,
        logprobs: None,
        // Random weights may end early: the tests want their full length.
        ignore_eos: true,
        speculative: true,
        priority: Priority::Agent,
        key: String::new(),
        tenant: CacheTenant { key: 1, group: 0 },
        ledger_row: None,
        billed_prompt: 0,
    }
}

/// A submitted session's id and events.
async fn submit(r: &Route, job: Job) -> (SessionId, mpsc::UnboundedReceiver<SessionEvent>) {
    let (events, rx) = mpsc::unbounded_channel();
    let (accepted, answer) = oneshot::channel();
    r.commands
        .send(Command::Submit {
            prefix_keys: Vec::new(),
            job: Box::new(job),
            events,
            accepted,
        })
        .await
        .unwrap();
    (answer.await.unwrap().unwrap(), rx)
}

/// What a session's client saw, to its end.
#[derive(Debug, Default)]
struct Seen {
    tokens: Vec<u32>,
    text: String,
    end: Option<Result<FinishReason, Refusal>>,
}

async fn next(rx: &mut mpsc::UnboundedReceiver<SessionEvent>) -> Option<SessionEvent> {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("the session went silent")
}

async fn run(r: &Route, job: Job) -> Seen {
    let (_, mut rx) = submit(r, job).await;
    let mut seen = Seen::default();
    while let Some(ev) = next(&mut rx).await {
        match ev {
            SessionEvent::Token { token, text, .. } => {
                seen.tokens.push(token);
                seen.text.push_str(&text);
            }
            SessionEvent::Text(t) => seen.text.push_str(&t),
            SessionEvent::Done { finish_reason, .. } => {
                seen.end = Some(Ok(finish_reason));
                break;
            }
            SessionEvent::Error(e) => {
                seen.end = Some(Err(e));
                break;
            }
        }
    }
    seen
}

fn refusal(reason: Reason) -> SessionError {
    SessionError::new(
        0,
        &Refusal::from_shard(reason, format!("injected {reason}")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_miss_is_replayed_without_changing_a_token_until_the_replays_run_out() {
    let r = start("driver-replay").await;
    let clean = run(&r, job(8, Vec::new())).await;
    assert_eq!(clean.tokens.len(), 8);
    assert!(matches!(clean.end, Some(Ok(FinishReason::Length))));
    r.shard
        .set_for(Fault::Refuse(refusal(Reason::CacheMiss)), 2);
    let replayed = run(&r, job(8, Vec::new())).await;
    assert_eq!(replayed.tokens, clean.tokens, "a replay changed the tokens");
    r.shard.set(Fault::Refuse(refusal(Reason::CacheMiss)));
    let lost = run(&r, job(8, Vec::new())).await;
    let Some(Err(e)) = lost.end else {
        panic!("{lost:?}")
    };
    assert_eq!(e.reason, Reason::CacheMiss);
    r.shard.set(Fault::None);
    assert_eq!(run(&r, job(8, Vec::new())).await.tokens, clean.tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_text_before_it() {
    let r = start("driver-stop").await;
    let clean = run(&r, job(24, Vec::new())).await;
    // A stop string cut from the middle of what the session says.
    let chars: Vec<char> = clean.text.chars().collect();
    assert!(chars.len() >= 8, "{:?}", clean.text);
    let stop: String = chars[4..6].iter().collect();
    let before = &clean.text[..clean.text.find(&stop).unwrap()];
    let stopped = run(&r, job(24, vec![stop.clone()])).await;
    assert_eq!(stopped.text, before, "stop {stop:?}");
    assert!(matches!(stopped.end, Some(Ok(FinishReason::Stop))));
    assert!(stopped.tokens.len() < clean.tokens.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_session_ends_without_an_answer_and_frees_its_place() {
    let r = start("driver-cancel").await;
    let (id, mut rx) = submit(&r, job(200, Vec::new())).await;
    assert!(matches!(
        next(&mut rx).await,
        Some(SessionEvent::Token { .. })
    ));
    r.commands.send(Command::Cancel(id)).await.unwrap();
    while let Some(ev) = next(&mut rx).await {
        assert!(
            matches!(ev, SessionEvent::Token { .. }),
            "a cancelled session answered: {ev:?}"
        );
    }
    // The loop publishes what it holds once per pass.
    let t = tokio::time::Instant::now();
    while r.load.load(Ordering::Relaxed) != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the place stayed taken"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_shard_moves_its_sessions_and_a_changed_one_fails_them() {
    let mut r = start("driver-failover").await;
    let (_, mut rx) = submit(&r, job(200, Vec::new())).await;
    assert!(matches!(
        next(&mut rx).await,
        Some(SessionEvent::Token { .. })
    ));
    let lost = Refusal::new(Reason::ShardFailed, "injected");
    r.shard
        .set_for(Fault::FailStep(StepError::new("embedded", &lost)), 1);
    let moved = tokio::time::timeout(Duration::from_secs(30), r.moved.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (moved.digest.as_str(), moved.from.as_str()),
        (r.digest.as_str(), "local")
    );
    assert_eq!(moved.error.reason, Reason::ShardFailed);
    // The tokens to replay: the prompt and every token the client has seen, no more.
    let mut seen = 1;
    while let Ok(ev) = rx.try_recv() {
        assert!(matches!(ev, SessionEvent::Token { .. }), "{ev:?}");
        seen += 1;
    }
    assert_eq!(&moved.tokens[..PROMPT.len()], PROMPT);
    assert_eq!(moved.tokens.len(), PROMPT.len() + seen);
    assert_eq!(moved.max_new, 200 - seen);
    drop(moved);
    // A shard that now holds something else: terminal, the session fails where it is.
    let up = tokio::time::Instant::now();
    let (_, mut rx) = loop {
        let (events, rx) = mpsc::unbounded_channel();
        let (accepted, answer) = oneshot::channel();
        let job = Box::new(job(200, Vec::new()));
        r.commands
            .send(Command::Submit {
                prefix_keys: Vec::new(),
                job,
                events,
                accepted,
            })
            .await
            .unwrap();
        if let Ok(id) = answer.await.unwrap() {
            break (id, rx);
        }
        assert!(
            up.elapsed() < Duration::from_secs(10),
            "the route stayed down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(matches!(
        next(&mut rx).await,
        Some(SessionEvent::Token { .. })
    ));
    let changed = Refusal::recipe_mismatch("injected");
    r.shard
        .set_for(Fault::FailStep(StepError::new("embedded", &changed)), 1);
    let end = loop {
        match next(&mut rx).await {
            Some(SessionEvent::Token { .. }) => continue,
            other => break other,
        }
    };
    let Some(SessionEvent::Error(e)) = end else {
        panic!("{end:?}")
    };
    assert_eq!(e.reason, Reason::RecipeMismatch);
    assert!(
        r.moved.try_recv().is_err(),
        "a terminal failure moved a session"
    );
}
