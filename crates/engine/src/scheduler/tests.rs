//! The scheduler's tests: plans, priorities, fairness, replays, drafts.

use super::*;

fn cfg(max_step_tokens: usize, chunk: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_step_tokens,
        max_prefill_chunk: chunk,
        max_active: 64,
        pipeline_depth: 1,
        ..SchedulerConfig::default()
    }
}

/// Runs a step with a fake model that always samples `7`.
fn run(s: &mut Scheduler) -> (StepPlan, Vec<Event>) {
    run_at(s, Instant::now())
}

/// A replay of more known tokens than one chunk holds goes chunk by chunk to the end, then
/// decodes (its later chunks lie past the prompt, where only a decode step used to look:
/// such a session stalled, neither prefilling nor decoding).
#[test]
fn a_replay_longer_than_a_chunk_goes_on_past_the_prompt() {
    let mut s = Scheduler::new(cfg(4, 4));
    s.add(SessionId(1), vec![1, 2], 20, Priority::Agent, 0);
    for _ in 0..7 {
        run(&mut s);
    }
    // 2 prompt tokens and 7 generated: 9 known, recomputed in chunks of 4, 4 and 1.
    assert!(s.replay(SessionId(1)));
    let mut spans = Vec::new();
    for _ in 0..4 {
        let (p, _) = run(&mut s);
        let i = &p.items[0];
        spans.push((i.start_pos, i.tokens.len(), i.want_output));
    }
    assert_eq!(
        spans,
        vec![(0, 4, false), (4, 4, false), (8, 1, true), (9, 1, true)]
    );
}

/// [`run`] at a given time.
fn run_at(s: &mut Scheduler, now: Instant) -> (StepPlan, Vec<Event>) {
    let plan = s.schedule(now).expect("work to do");
    let outputs: Vec<(SessionId, u32)> = plan
        .items
        .iter()
        .filter(|i| i.want_output)
        .map(|i| (i.session, 7))
        .collect();
    let events = s.update_from_output(plan.step_id, &outputs, &[]);
    (plan, events)
}

/// With a pipeline of two, decoders split into two micro-batches that alternate: each step
/// takes the half not in flight, every session advances once per two steps, and no session
/// is ever in two steps at once.
#[test]
fn take_all_says_what_each_session_knows_and_may_still_generate() {
    let mut s = Scheduler::new(cfg(64, 64));
    s.add(SessionId(1), vec![1, 2, 3], 5, Priority::Agent, 0);
    let plan = s.schedule(Instant::now()).unwrap();
    s.update_from_output(plan.step_id, &[(SessionId(1), 9)], &[]);
    let plan = s.schedule(Instant::now()).unwrap();
    s.update_from_output(plan.step_id, &[(SessionId(1), 8)], &[]);
    // Waiting behind the active place limit of none: still pending.
    s.add(SessionId(2), vec![4], 7, Priority::Grading, 0);
    let taken = s.take_all();
    assert_eq!(
        taken,
        vec![
            (SessionId(1), vec![1, 2, 3, 9, 8], 3),
            (SessionId(2), vec![4], 7)
        ]
    );
    assert!(s.is_idle() && s.schedule(Instant::now()).is_none());
}

#[test]
fn a_pipeline_splits_decoders_into_alternating_micro_batches() {
    let mut s = Scheduler::new(SchedulerConfig {
        pipeline_depth: 2,
        ..cfg(64, 64)
    });
    for i in 0..8 {
        s.add(SessionId(i), vec![1, 2], 100, Priority::Agent, 0);
    }
    // Prefill in two micro-batches, then decode.
    let a = s.schedule(Instant::now()).unwrap();
    let b = s.schedule(Instant::now()).unwrap();
    assert_eq!((a.items.len(), b.items.len()), (4, 4));
    assert!(
        s.schedule(Instant::now()).is_none(),
        "everyone is in flight"
    );
    let mut in_flight = std::collections::VecDeque::from([a, b]);
    for _ in 0..10 {
        let done = in_flight.pop_front().unwrap();
        let outs: Vec<(SessionId, u32)> = done.items.iter().map(|i| (i.session, 5)).collect();
        s.update_from_output(done.step_id, &outs, &[]);
        let next = s.schedule(Instant::now()).unwrap();
        let mut got: Vec<SessionId> = next.items.iter().map(|i| i.session).collect();
        let mut want: Vec<SessionId> = done.items.iter().map(|i| i.session).collect();
        got.sort();
        want.sort();
        assert_eq!(got, want, "the returned micro-batch goes again");
        for other in &in_flight {
            assert!(other.items.iter().all(|i| !got.contains(&i.session)));
        }
        in_flight.push_back(next);
    }
}

/// With 392-token steps (a shard's scratch budget allows no more) a 1000-token prompt goes
/// in chunks that end on KV block boundaries (384, 768), the last at the prompt's end;
/// beside a decode token the chunk still ends on a boundary.
#[test]
fn prefill_chunks_short_of_the_end_stop_on_kv_block_boundaries() {
    let mut s = Scheduler::new(cfg(392, 392));
    s.add(SessionId(1), (0..1000).collect(), 2, Priority::Agent, 0);
    let mut ends = Vec::new();
    for _ in 0..3 {
        let (p, _) = run(&mut s);
        ends.push(p.items[0].start_pos + p.items[0].tokens.len());
    }
    assert_eq!(ends, vec![384, 768, 1000]);
    // Session 2 decodes (one token of the step) while session 3 prefills.
    s.add(SessionId(3), (0..500).collect(), 2, Priority::Agent, 0);
    let (p, _) = run(&mut s);
    let chunk = p.items.iter().find(|i| i.session == SessionId(3)).unwrap();
    assert_eq!(p.items.len(), 2, "a decode and a chunk");
    assert_eq!(chunk.start_pos + chunk.tokens.len(), 384);
    // A step of fewer positions than a block still moves on.
    let mut s = Scheduler::new(cfg(5, 5));
    s.add(SessionId(1), (0..12).collect(), 1, Priority::Agent, 0);
    let (p, _) = run(&mut s);
    assert_eq!(p.items[0].tokens.len(), 5);
}

#[test]
fn prompt_is_chunked_then_decoded_until_max_tokens() {
    let mut s = Scheduler::new(cfg(4, 4));
    s.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
    let (p, e) = run(&mut s);
    assert_eq!(
        (
            p.items[0].start_pos,
            p.items[0].tokens.len(),
            p.items[0].want_output
        ),
        (0, 4, false)
    );
    assert!(e.is_empty());
    run(&mut s);
    let (p, e) = run(&mut s);
    assert_eq!(
        (
            p.items[0].start_pos,
            p.items[0].tokens.len(),
            p.items[0].want_output
        ),
        (8, 2, true)
    );
    assert_eq!(
        e,
        vec![Event::Token {
            session: SessionId(1),
            token: 7
        }]
    );
    let (p, _) = run(&mut s);
    assert_eq!(
        (p.items[0].start_pos, p.items[0].tokens.clone()),
        (10, vec![7])
    );
    let (_, e) = run(&mut s);
    assert!(e.contains(&Event::Finished {
        session: SessionId(1),
        reason: FinishReason::Length
    }));
    let p = s.schedule(Instant::now()).unwrap();
    assert_eq!(p.release, vec![SessionId(1)]);
    assert!(p.items.is_empty());
    assert!(s.is_idle());
}

#[test]
fn a_long_prompt_does_not_stop_decoders_from_advancing_every_step() {
    let mut s = Scheduler::new(cfg(8, 8));
    s.add(SessionId(1), vec![1, 2], 100, Priority::Agent, 0);
    run(&mut s);
    s.add(SessionId(2), (0..1000).collect(), 1, Priority::Agent, 0);
    for _ in 0..20 {
        let (p, _) = run(&mut s);
        assert!(
            p.items
                .iter()
                .any(|i| i.session == SessionId(1) && i.tokens.len() == 1),
            "decoder skipped"
        );
        assert!(p.n_tokens() <= 8);
    }
}

#[test]
fn decoders_do_not_stop_a_prompt_from_making_progress() {
    let mut s = Scheduler::new(cfg(8, 8));
    for id in 1..=6 {
        s.add(SessionId(id), vec![1], 1000, Priority::Agent, 0);
    }
    run(&mut s);
    s.add(SessionId(99), (0..40).collect(), 1, Priority::Agent, 0);
    let mut prefilled = 0;
    for _ in 0..30 {
        let (p, _) = run(&mut s);
        prefilled += p
            .items
            .iter()
            .filter(|i| i.session == SessionId(99))
            .map(|i| i.tokens.len())
            .sum::<usize>();
    }
    assert_eq!(prefilled, 40);
}

#[test]
fn aborting_a_running_session_releases_it_on_the_next_plan() {
    let mut s = Scheduler::new(cfg(16, 16));
    s.add(SessionId(1), vec![1, 2, 3], 10, Priority::Agent, 0);
    s.add(SessionId(2), vec![4, 5], 10, Priority::Agent, 0);
    run(&mut s);
    s.abort(SessionId(1));
    let p = s.schedule(Instant::now()).unwrap();
    assert_eq!(p.release, vec![SessionId(1)]);
    assert!(p.items.iter().all(|i| i.session == SessionId(2)));
}

#[test]
fn a_refused_fragment_removes_only_its_session() {
    let mut s = Scheduler::new(cfg(16, 16));
    s.add(SessionId(1), vec![1, 2, 3], 10, Priority::Agent, 0);
    s.add(SessionId(2), vec![4, 5], 10, Priority::Agent, 0);
    let p = s.schedule(Instant::now()).unwrap();
    let ev = s.update_from_output(p.step_id, &[(SessionId(2), 9)], &[SessionId(1)]);
    assert_eq!(
        ev,
        vec![Event::Token {
            session: SessionId(2),
            token: 9
        }]
    );
    assert!(!s.contains(SessionId(1)));
    assert!(s.contains(SessionId(2)));
}

#[test]
fn a_replayed_session_prefills_all_its_known_tokens_then_decodes_on() {
    let mut s = Scheduler::new(cfg(64, 64));
    s.add(SessionId(1), vec![1, 2, 3], 5, Priority::Agent, 0);
    run(&mut s);
    run(&mut s);
    // Known: 3 prompt tokens + 2 generated (7, 7); the shard lost them.
    assert!(s.replay(SessionId(1)));
    let (p, e) = run(&mut s);
    assert_eq!(p.items[0].start_pos, 0);
    assert_eq!(p.items[0].tokens, vec![1, 2, 3, 7, 7]);
    assert!(p.items[0].want_output);
    assert_eq!(
        e,
        vec![Event::Token {
            session: SessionId(1),
            token: 7
        }]
    );
    let (p, _) = run(&mut s);
    assert_eq!((p.items[0].start_pos, p.items[0].tokens.len()), (5, 1));
    assert!(!s.replay(SessionId(99)));
}

/// Runs one step at `now` with a fake model sampling `7`; returns the sessions in it.
fn step_at(s: &mut Scheduler, now: Instant) -> Vec<(SessionId, usize)> {
    let (plan, _) = run_at(s, now);
    plan.items
        .iter()
        .map(|i| (i.session, i.tokens.len()))
        .collect()
}

fn classes() -> SchedulerConfig {
    SchedulerConfig {
        max_active: 4,
        grading_max_active: 3,
        grading_step_tokens: 4,
        agent_guard: Duration::from_secs(2),
        agent_gap: Duration::from_millis(50),
        grading_max_wait: Duration::from_secs(5),
        ..cfg(64, 64)
    }
}

/// Agent work takes the place grading work cannot hold, and while it runs grading work
/// stays out of its steps; grading resumes, capped, once the agent work is done, and at
/// full speed once the guard has passed.
#[test]
fn agent_work_preempts_grading_work_which_waits_and_then_resumes() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(classes());
    for i in 0..5 {
        s.add(SessionId(i), vec![1; 100], 3, Priority::Grading, 0);
    }
    assert_eq!(
        s.n_active_of(Priority::Grading),
        3,
        "grading keeps a place free"
    );
    assert_eq!(s.n_waiting_of(Priority::Grading), 2);
    let first = step_at(&mut s, t0);
    assert_eq!(
        first,
        vec![(SessionId(0), 64)],
        "no agent about: the whole budget"
    );
    s.add(SessionId(10), vec![1; 6], 3, Priority::Agent, 0);
    assert_eq!(
        s.n_active_of(Priority::Agent),
        1,
        "agent work starts at once"
    );
    let mut now = t0;
    // One prefill step and two decode steps: three tokens.
    for _ in 0..3 {
        now += Duration::from_millis(10);
        let items = step_at(&mut s, now);
        assert_eq!(
            items.iter().map(|i| i.0).collect::<Vec<_>>(),
            vec![SessionId(10)]
        );
    }
    assert_eq!(
        s.n_active_of(Priority::Agent),
        0,
        "the agent session finished"
    );
    // Right after agent work, grading waits for the gap (the agent's next call may come).
    now += Duration::from_millis(10);
    let held = s
        .schedule(now)
        .expect("the finished agent session's release");
    assert!(held.items.is_empty(), "{held:?}");
    assert!(s.schedule(now + Duration::from_millis(5)).is_none());
    // Within the guard, grading steps are capped.
    now += Duration::from_millis(100);
    let capped = step_at(&mut s, now);
    assert!(capped.iter().map(|i| i.1).sum::<usize>() <= 4, "{capped:?}");
    // After it, grading takes the whole budget.
    now += Duration::from_secs(3);
    let full = step_at(&mut s, now);
    assert!(full.iter().map(|i| i.1).sum::<usize>() > 4, "{full:?}");
}

/// A stream of agent work never starves grading work: it joins a step (capped) each time
/// it has waited `grading_max_wait`, and every grading session completes.
#[test]
fn grading_work_is_never_starved_by_continuous_agent_work() {
    let mut s = Scheduler::new(classes());
    let mut now = Instant::now();
    s.add(SessionId(1), vec![1; 4], 2, Priority::Grading, 0);
    s.add(SessionId(100), vec![1], 1_000_000, Priority::Agent, 0);
    let mut grading_steps = Vec::new();
    for n in 0..2000 {
        now += Duration::from_millis(20);
        let items = step_at(&mut s, now);
        assert!(
            items.iter().any(|i| i.0 == SessionId(100)),
            "agent decodes every step"
        );
        let grading: usize = items
            .iter()
            .filter(|i| i.0 == SessionId(1))
            .map(|i| i.1)
            .sum();
        assert!(grading <= 4);
        if grading > 0 {
            grading_steps.push(n);
        }
        if !s.contains(SessionId(1)) {
            break;
        }
    }
    assert!(
        !s.contains(SessionId(1)),
        "grading completed: served at steps {grading_steps:?}"
    );
    // Served once per 5 s of waiting (250 steps of 20 ms), not earlier.
    assert!(grading_steps[0] >= 249, "{grading_steps:?}");
}

/// While two owners have prompts waiting, neither takes more than its share of a step;
/// alone, an owner takes the whole step.
#[test]
fn one_owner_cannot_take_more_than_its_share_of_a_step() {
    let mut s = Scheduler::new(cfg(64, 64));
    for i in 0..3 {
        s.add(SessionId(i), vec![1; 100], 1, Priority::Agent, 7);
    }
    s.add(SessionId(10), vec![1; 100], 1, Priority::Agent, 8);
    let plan = s.schedule(Instant::now()).unwrap();
    let by = |owner_ids: &[u64]| -> usize {
        plan.items
            .iter()
            .filter(|i| owner_ids.contains(&i.session.0))
            .map(|i| i.tokens.len())
            .sum()
    };
    assert_eq!(by(&[0, 1, 2]), 32, "owner 7 is held to half: {plan:?}");
    assert_eq!(by(&[10]), 32, "owner 8 gets its half");
    let mut alone = Scheduler::new(cfg(64, 64));
    alone.add(SessionId(1), vec![1; 100], 1, Priority::Agent, 7);
    alone.add(SessionId(2), vec![1; 100], 1, Priority::Agent, 7);
    let plan = alone.schedule(Instant::now()).unwrap();
    assert_eq!(plan.n_tokens(), 64, "alone, an owner uses the whole step");
}

/// On a pipeline (a route of several shards) a long prompt's chunks go one step after
/// another without waiting for the earlier ones' replies, in order and never two in one
/// step; on a one-stage route a session is in one step at a time.
#[test]
fn a_pipeline_sends_a_long_prompts_chunks_without_waiting() {
    let mut s = Scheduler::new(SchedulerConfig {
        pipeline_depth: 2,
        pipelined_prefill: true,
        ..cfg(4, 4)
    });
    s.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
    let a = s.schedule(Instant::now()).unwrap();
    let b = s.schedule(Instant::now()).unwrap();
    let c = s.schedule(Instant::now()).unwrap();
    let span = |p: &StepPlan| {
        let i = &p.items[0];
        (i.start_pos, i.tokens.len(), i.want_output)
    };
    assert_eq!(
        [span(&a), span(&b), span(&c)],
        [(0, 4, false), (4, 4, false), (8, 2, true)]
    );
    assert!(
        s.schedule(Instant::now()).is_none(),
        "the whole prompt is sent; decoding waits for its last chunk"
    );
    assert!(s.update_from_output(a.step_id, &[], &[]).is_empty());
    assert!(s.update_from_output(b.step_id, &[], &[]).is_empty());
    assert!(s.schedule(Instant::now()).is_none());
    let e = s.update_from_output(c.step_id, &[(SessionId(1), 7)], &[]);
    assert_eq!(e.len(), 1);
    let d = s.schedule(Instant::now()).unwrap();
    assert_eq!(span(&d), (10, 1, true));

    let mut one = Scheduler::new(cfg(4, 4));
    one.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
    one.schedule(Instant::now()).unwrap();
    assert!(one.schedule(Instant::now()).is_none());
}

/// A cache miss on chunk k resets the session while chunk k + 1 is in flight: that step
/// is stale for it (whatever a shard answered), its reply changes nothing, and the replay
/// sends every position again from 0.
#[test]
fn a_replay_makes_the_chunks_in_flight_stale() {
    let mut s = Scheduler::new(SchedulerConfig {
        pipeline_depth: 2,
        pipelined_prefill: true,
        ..cfg(4, 4)
    });
    s.add(SessionId(1), (0..10).collect(), 3, Priority::Agent, 0);
    let a = s.schedule(Instant::now()).unwrap();
    let b = s.schedule(Instant::now()).unwrap();
    assert!(!s.is_stale(SessionId(1), a.step_id) && !s.is_stale(SessionId(1), b.step_id));
    s.update_from_output(a.step_id, &[], &[]);
    assert!(s.replay(SessionId(1)));
    assert!(s.is_stale(SessionId(1), b.step_id));
    let r = s.schedule(Instant::now()).unwrap();
    assert_eq!((r.items[0].start_pos, r.items[0].tokens.len()), (0, 4));
    s.update_from_output(b.step_id, &[], &[]);
    let n = s.schedule(Instant::now()).unwrap();
    assert_eq!(
        (n.items[0].start_pos, n.items[0].tokens.len()),
        (4, 4),
        "the stale reply moved nothing"
    );
    assert!(!s.is_stale(SessionId(1), r.step_id));
    assert!(
        !s.is_stale(SessionId(9), r.step_id),
        "unknown sessions are not stale"
    );
}

/// A fake model whose next token is a function of the history alone: mostly it repeats
/// what came 5 tokens before (so n-gram drafts often hold), and now and then it does not
/// (so they are rejected too).
fn next_of(history: &[u32]) -> u32 {
    let n = history.len();
    if n % 7 == 3 {
        return (n as u32 * 31 + 5) % 11;
    }
    history[n.saturating_sub(5)]
}

/// Runs steps to the end with the fake model of [`next_of`], verifying drafted tokens as
/// the last shard does (a sample after the last known token and after every drafted one,
/// drafts kept while they equal the sample before them); `known` holds every session's
/// prompt and gets its output. Returns the drafted and accepted totals.
fn run_to_end(s: &mut Scheduler, known: &mut BTreeMap<SessionId, Vec<u32>>) -> (usize, usize) {
    run_with_drafter(s, known, None)
}

/// [`run_to_end`] with a draft model's drafts: when no step can go, the sessions wait for
/// drafts, which `drafter` then computes.
fn run_with_drafter(
    s: &mut Scheduler,
    known: &mut BTreeMap<SessionId, Vec<u32>>,
    drafter: Option<&FakeDraftModel>,
) -> (usize, usize) {
    let (mut drafted, mut accepted) = (0, 0);
    loop {
        let Some(plan) = s.schedule(Instant::now()) else {
            match drafter {
                Some(d) if !s.is_idle() => {
                    assert!(d.complete() > 0, "only a draft may hold a session back");
                    continue;
                }
                _ => break,
            }
        };
        let mut outputs = Vec::new();
        for item in plan.items.iter().filter(|i| i.want_output) {
            let mut h = known[&item.session].clone();
            assert_eq!(h.len(), item.start_pos + item.tokens.len() - item.n_draft);
            for i in 0..=item.n_draft {
                let t = next_of(&h);
                outputs.push((item.session, t));
                match item.drafts().get(i) {
                    Some(&d) if d == t => h.push(d),
                    _ => break,
                }
            }
        }
        for e in s.update_from_output(plan.step_id, &outputs, &[]) {
            match e {
                Event::Token { session, token } => known.get_mut(&session).unwrap().push(token),
                Event::Verified {
                    drafted: d,
                    accepted: a,
                    ..
                } => {
                    assert!(a <= d);
                    drafted += d;
                    accepted += a;
                }
                Event::Finished { .. } => {}
            }
        }
    }
    (drafted, accepted)
}

/// Sessions decoded with n-gram drafts verified step by step end with exactly the tokens
/// plain decoding gives, at 1, 4 and 16 sessions; drafts were carried, some kept, some
/// not.
#[test]
fn drafted_decoding_gives_exactly_the_tokens_of_plain_decoding() {
    for n_sessions in [1, 4, 16] {
        let mut results = Vec::new();
        for draft in [DraftConfig::OFF, DraftConfig::ngram(8)] {
            let mut s = Scheduler::new(SchedulerConfig {
                draft: DraftConfig {
                    max_batch: 16,
                    ..draft
                },
                ..cfg(64, 16)
            });
            let mut known = BTreeMap::new();
            for i in 0..n_sessions {
                let prompt: Vec<u32> = (0..9).map(|j| (i * 3 + j) % 7).collect();
                s.add(SessionId(i as u64), prompt.clone(), 40, Priority::Agent, 0);
                known.insert(SessionId(i as u64), prompt);
            }
            let (drafted, accepted) = run_to_end(&mut s, &mut known);
            assert!(known.values().all(|t| t.len() == 9 + 40));
            if draft.is_on() {
                assert!(
                    drafted > 0 && accepted > 0 && accepted < drafted,
                    "drafted {drafted}, accepted {accepted}"
                );
            } else {
                assert_eq!(drafted, 0);
            }
            results.push(known);
        }
        assert_eq!(results[0], results[1], "{n_sessions} sessions");
    }
}

/// A draft model for tests: its drafts follow [`next_of`] except every fifth position, and
/// are computed only when [`FakeDraftModel::complete`] is called.
/// A draft asked for: the session, its tokens, how many to draft, whom to wake.
type Asked = (SessionId, Vec<u32>, usize, Wake);

#[derive(Default)]
struct FakeDraftModel {
    asked: std::sync::Mutex<Vec<Asked>>,
    ready: std::sync::Mutex<HashMap<SessionId, (usize, Vec<u32>)>>,
    forgotten: std::sync::Mutex<Vec<SessionId>>,
    wakes: std::sync::atomic::AtomicUsize,
    polled: std::sync::Mutex<Vec<SessionId>>,
}

impl DraftSource for FakeDraftModel {
    fn poll(&self, session: SessionId, tokens: &[u32], k: usize, wake: &Wake) -> DraftPoll {
        self.polled.lock().unwrap().push(session);
        let mut ready = self.ready.lock().unwrap();
        if let Some((base, d)) = ready.remove(&session) {
            if base == tokens.len() {
                return DraftPoll::Ready(d);
            }
        }
        self.asked
            .lock()
            .unwrap()
            .push((session, tokens.to_vec(), k, Arc::clone(wake)));
        DraftPoll::Pending
    }

    fn forget(&self, session: SessionId) {
        self.forgotten.lock().unwrap().push(session);
    }
}

impl FakeDraftModel {
    /// Computes every draft asked for; returns how many.
    fn complete(&self) -> usize {
        let asked = std::mem::take(&mut *self.asked.lock().unwrap());
        for (session, mut h, k, wake) in asked.iter().cloned() {
            let base = h.len();
            for _ in 0..k {
                let t = if h.len() % 5 == 0 { 99 } else { next_of(&h) };
                h.push(t);
            }
            self.ready
                .lock()
                .unwrap()
                .insert(session, (base, h[base..].to_vec()));
            wake();
        }
        asked.len()
    }
}

/// Sessions drafting from a draft model, whose drafts take time and are sometimes wrong,
/// end with exactly the tokens plain decoding gives, at 1, 4 and 16 sessions; each waited
/// for its drafts, was woken when one was ready, and is forgotten by the draft model once
/// it ends.
#[test]
fn draft_model_decoding_gives_exactly_the_tokens_of_plain_decoding() {
    for n_sessions in [1, 4, 16] {
        let mut results = Vec::new();
        for with_model in [false, true] {
            let draft = if with_model {
                DraftConfig::model(6, Duration::from_secs(3600))
            } else {
                DraftConfig::OFF
            };
            let mut s = Scheduler::new(SchedulerConfig {
                draft: DraftConfig {
                    max_batch: 16,
                    ..draft
                },
                ..cfg(64, 16)
            });
            let fake = Arc::new(FakeDraftModel::default());
            let wakes = Arc::clone(&fake);
            s.use_draft_model(
                fake.clone(),
                Arc::new(move || {
                    wakes
                        .wakes
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }),
            );
            let mut known = BTreeMap::new();
            for i in 0..n_sessions {
                let prompt: Vec<u32> = (0..9).map(|j| (i * 3 + j) % 7).collect();
                s.add(SessionId(i as u64), prompt.clone(), 40, Priority::Agent, 0);
                known.insert(SessionId(i as u64), prompt);
            }
            let (drafted, accepted) = run_with_drafter(&mut s, &mut known, Some(&fake));
            assert!(known.values().all(|t| t.len() == 9 + 40));
            let woken = fake.wakes.load(std::sync::atomic::Ordering::Relaxed);
            if with_model {
                assert!(
                    drafted > 0 && accepted > 0 && accepted < drafted && woken > 0,
                    "drafted {drafted}, accepted {accepted}, woken {woken}"
                );
                let mut forgotten = fake.forgotten.lock().unwrap().clone();
                forgotten.sort();
                forgotten.dedup();
                assert_eq!(forgotten.len(), n_sessions as usize);
            } else {
                assert_eq!((drafted, woken), (0, 0));
            }
            results.push(known);
        }
        assert_eq!(results[0], results[1], "{n_sessions} sessions");
    }
}

/// A draft model is asked only while the route holds at most `max_batch` (here 1) active
/// sessions: a session decoding beside another's work asks for nothing; once alone, it
/// drafts.
#[test]
fn a_draft_model_is_asked_only_by_a_session_alone_on_the_route() {
    let mut s = Scheduler::new(SchedulerConfig {
        draft: DraftConfig::model(4, Duration::from_secs(3600)),
        ..cfg(64, 16)
    });
    let fake = Arc::new(FakeDraftModel::default());
    s.use_draft_model(fake.clone(), Arc::new(|| {}));
    let (short, long) = (vec![1, 2, 3], vec![4; 40]);
    s.add(SessionId(1), short.clone(), 3, Priority::Agent, 0);
    s.add(SessionId(2), long.clone(), 30, Priority::Agent, 0);
    let mut known = BTreeMap::from([(SessionId(1), short), (SessionId(2), long)]);
    let (drafted, _) = run_with_drafter(&mut s, &mut known, Some(&fake));
    let polled = fake.polled.lock().unwrap().clone();
    assert!(!polled.contains(&SessionId(1)), "never alone: {polled:?}");
    assert!(
        polled.contains(&SessionId(2)) && drafted > 0,
        "alone after the other ended"
    );
}

/// A session whose draft is not ready waits for it at most the draft kind's `max_wait`,
/// then decodes without one.
#[test]
fn a_late_draft_is_waited_for_at_most_max_wait() {
    let wait = Duration::from_millis(50);
    let mut s = Scheduler::new(SchedulerConfig {
        draft: DraftConfig::model(4, wait),
        ..cfg(64, 16)
    });
    let fake = Arc::new(FakeDraftModel::default());
    s.use_draft_model(fake.clone(), Arc::new(|| {}));
    s.add(SessionId(1), vec![1, 2, 3], 10, Priority::Agent, 0);
    let t0 = Instant::now();
    let plan = s.schedule(t0).unwrap();
    assert_eq!(plan.items[0].tokens, vec![1, 2, 3], "the prompt");
    s.update_from_output(plan.step_id, &[(SessionId(1), 4)], &[]);
    assert!(s.schedule(t0).is_none(), "waits for its draft");
    assert!(s.schedule(t0 + wait / 2).is_none(), "still within max_wait");
    let plan = s.schedule(t0 + wait).unwrap();
    assert_eq!(
        (plan.items[0].tokens.clone(), plan.items[0].n_draft),
        (vec![4], 0)
    );
}

/// A draft never reaches past the positions a session may still generate (its admission
/// reserved no more), nor past what the step has room for.
#[test]
fn drafts_stay_within_what_a_session_may_generate_and_the_step_budget() {
    let mut s = Scheduler::new(SchedulerConfig {
        draft: DraftConfig::ngram(8),
        ..cfg(3, 16)
    });
    // A prompt that repeats: the drafter always has a long continuation to offer.
    let prompt: Vec<u32> = (0..40).map(|i| i % 4).collect();
    s.add(SessionId(1), prompt.clone(), 5, Priority::Agent, 0);
    let mut known = BTreeMap::from([(SessionId(1), prompt)]);
    let mut max_end = 0;
    while let Some(plan) = s.schedule(Instant::now()) {
        for i in &plan.items {
            assert!(i.tokens.len() <= 3, "step budget");
            max_end = max_end.max(i.start_pos + i.tokens.len());
        }
        let outputs: Vec<(SessionId, u32)> = plan
            .items
            .iter()
            .filter(|i| i.want_output)
            .flat_map(|i| {
                let h = &known[&i.session];
                // The model continues the period: every draft is kept.
                (0..=i.n_draft).map(move |k| (i.session, ((h.len() + k) % 4) as u32))
            })
            .collect();
        for e in s.update_from_output(plan.step_id, &outputs, &[]) {
            if let Event::Token { session, token } = e {
                known.get_mut(&session).unwrap().push(token);
            }
        }
    }
    assert_eq!(known[&SessionId(1)].len(), 45);
    assert!(
        max_end <= 44,
        "positions up to prompt + max_new - 1, got {max_end}"
    );
}

/// A step whose decode work holds more sessions than `max_batch` drafts for none.
#[test]
fn a_full_batch_drafts_nothing() {
    let mut s = Scheduler::new(SchedulerConfig {
        draft: DraftConfig {
            max_batch: 4,
            ..DraftConfig::ngram(8)
        },
        ..cfg(64, 16)
    });
    let mut known = BTreeMap::new();
    for i in 0..8 {
        let prompt: Vec<u32> = (0..12).map(|j| j % 3).collect();
        s.add(SessionId(i), prompt.clone(), 10, Priority::Agent, 0);
        known.insert(SessionId(i), prompt);
    }
    let (drafted, _) = run_to_end(&mut s, &mut known);
    assert_eq!(drafted, 0);
}

proptest::proptest! {
    #[test]
    fn the_token_budget_is_never_exceeded(
        budget in 1usize..64,
        chunk in 1usize..64,
        prompts in proptest::collection::vec(1usize..200, 1..12),
    ) {
        let mut s = Scheduler::new(cfg(budget, chunk));
        for (i, n) in prompts.iter().enumerate() {
            let class = if i % 3 == 0 { Priority::Grading } else { Priority::Agent };
            s.add(SessionId(i as u64), vec![1; *n], 5, class, i as u64 % 2);
        }
        // Simulated time, 10 ms per step: held-back grading work resumes after the gap.
        let mut now = Instant::now();
        let mut steps = 0;
        while !s.is_idle() {
            now += Duration::from_millis(10);
            steps += 1;
            proptest::prop_assert!(steps < 100_000);
            let Some(p) = s.schedule(now) else {
                continue;
            };
            proptest::prop_assert!(p.n_tokens() <= budget);
            for i in &p.items {
                proptest::prop_assert!(i.tokens.len() <= chunk.max(1));
            }
            let outputs: Vec<(SessionId, u32)> = p.items.iter().filter(|i| i.want_output).map(|i| (i.session, 1)).collect();
            s.update_from_output(p.step_id, &outputs, &[]);
        }
    }
}
