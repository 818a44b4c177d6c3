//! What a step's reply does to its sessions: refusals and replays, positions taken from the
//! prefix cache, tokens verified and sent as events (with their logprobs), stop strings and
//! ends; and the hops' timings as metrics.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use engine::{Event, FinishReason, SessionId};
use proto::v1::RouteReply;
use text::StopStep;

use super::{Live, Runner, SessionEvent, TokenLogprob};
use crate::metrics::{COUNT_BUCKETS, LATENCY_BUCKETS};
use crate::session;

impl Runner {
    /// A step's reply: refusals, replays, cached positions, tokens and timings.
    pub(super) fn apply(&mut self, plan: engine::StepPlan, reply: RouteReply, sent: Instant) {
        self.record_hops(&reply, sent.elapsed());
        let mut failed = Vec::new();
        let mut replays = Vec::new();
        for e in &reply.errors {
            let id = SessionId(e.session_id);
            // A later chunk of a pipelined prompt, sent before an earlier one's cache miss
            // reset the session: its positions go again with the replay.
            if self.scheduler.is_stale(id, plan.step_id) {
                tracing::debug!(
                    session = id.0,
                    step = plan.step_id,
                    "stale fragment refused"
                );
                continue;
            }
            // A shard forgot the session (eviction): recompute it from its known tokens, a few
            // times at most, instead of failing the client.
            if let Some(l) = self.live.get_mut(&id) {
                if session::replays(e.kind(), l.n_replays) {
                    l.n_replays += 1;
                    replays.push(id);
                    self.metrics.inc("strata_replays_total", &[], 1.0);
                    continue;
                }
            }
            failed.push(id);
            let err = e.refusal();
            // Counted where the client is answered (the request's record).
            if let Some(l) = self.forget(id, "failed") {
                let _ = l.events.send(SessionEvent::Error(err));
            }
        }
        let mut n_cached = 0;
        for c in &reply.cached {
            if let Some(l) = self.live.get_mut(&SessionId(c.session_id)) {
                l.n_cached += c.positions as usize;
                n_cached += c.positions as usize;
            }
        }
        self.metrics
            .inc("strata_prompt_cached_tokens_total", &[], n_cached as f64);
        let outputs: Vec<(SessionId, u32)> = reply
            .outputs
            .iter()
            .map(|o| (SessionId(o.session_id), o.token))
            .collect();
        // A verification step answers one output per sample, in order: each token's event
        // takes the next of its session's.
        let mut logprobs: HashMap<u64, VecDeque<&proto::v1::SessionOutput>> = HashMap::new();
        for o in &reply.outputs {
            logprobs.entry(o.session_id).or_default().push_back(o);
        }
        let refused: HashSet<u64> = reply.errors.iter().map(|e| e.session_id).collect();
        let (mut n_prefill, mut n_decode) = (0usize, 0usize);
        for item in &plan.items {
            // Computed and answered (not refused): what a failure later cannot blame on it.
            if let Some(l) = self.live.get_mut(&item.session) {
                let end = item.start_pos + item.tokens.len() - item.n_draft;
                if end > l.frontier && !refused.contains(&item.session.0) {
                    l.frontier = end;
                    l.n_moves = 0;
                }
            }
            // A verification step is a decode step that computes its drafted positions too.
            if item.start_pos > 0 && item.tokens.len() == 1 + item.n_draft {
                n_decode += item.tokens.len();
            } else {
                n_prefill += item.tokens.len();
            }
        }
        // Positions taken from the prefix cache were planned but not computed.
        self.metrics.inc(
            "strata_prefill_tokens_total",
            &[],
            n_prefill.saturating_sub(n_cached) as f64,
        );
        self.metrics
            .inc("strata_decode_tokens_total", &[], n_decode as f64);
        let events = self
            .scheduler
            .update_from_output(plan.step_id, &outputs, &failed);
        for id in replays {
            self.scheduler.replay(id);
        }
        for event in events {
            match event {
                Event::Token { session, token } => {
                    let lp = logprobs.get_mut(&session.0).and_then(VecDeque::pop_front);
                    self.on_token(session, token, lp);
                }
                Event::Finished { session, reason } => self.finish(session, reason),
                Event::Verified {
                    drafted, accepted, ..
                } => self.count_verified(drafted, accepted),
            }
        }
    }

    /// Drafted and accepted tokens of one verification step, per drafter.
    fn count_verified(&self, drafted: usize, accepted: usize) {
        let drafter = match self.config.scheduler.draft.kind {
            engine::DraftKind::Ngram => "ngram",
            engine::DraftKind::Model { .. } => "model",
        };
        let labels = [("drafter", drafter)];
        self.metrics
            .inc("strata_spec_drafted_tokens_total", &labels, drafted as f64);
        self.metrics.inc(
            "strata_spec_accepted_tokens_total",
            &labels,
            accepted as f64,
        );
        self.metrics.observe(
            "strata_spec_accepted_length",
            &labels,
            COUNT_BUCKETS,
            accepted as f64,
        );
    }

    fn piece(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.tokenizer.token_bytes(id, true).unwrap_or_default())
            .into_owned()
    }

    /// The token's log-probabilities as text, when its session asked for them.
    fn logprob(
        &self,
        id: SessionId,
        token: u32,
        out: Option<&proto::v1::SessionOutput>,
    ) -> Option<TokenLogprob> {
        match (self.live.get(&id).and_then(|l| l.logprobs), out) {
            (Some(_), Some(o)) => Some(TokenLogprob {
                token: self.piece(token),
                logprob: o.logprob,
                top: o
                    .top
                    .iter()
                    .map(|t| (self.piece(t.token), t.logprob))
                    .collect(),
            }),
            _ => None,
        }
    }

    fn on_token(&mut self, id: SessionId, token: u32, out: Option<&proto::v1::SessionOutput>) {
        let now = Instant::now();
        let logprob = self.logprob(id, token, out);
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        let is_end = self.tokenizer.is_end(token) && !live.ignore_eos;
        // Its prompt is in the route's caches now: later prompts starting with it may come here.
        if !live.prefix_keys.is_empty() {
            self.prefixes.record(&std::mem::take(&mut live.prefix_keys));
        }
        match live.last_token {
            None => self.metrics.observe(
                "strata_ttft_seconds",
                &[],
                LATENCY_BUCKETS,
                (now - live.started).as_secs_f64(),
            ),
            Some(t) => self.metrics.observe(
                "strata_inter_token_seconds",
                &[],
                LATENCY_BUCKETS,
                (now - t).as_secs_f64(),
            ),
        }
        live.last_token = Some(now);
        if let Some(t) = live.moved_at.take() {
            self.metrics.observe(
                "strata_migration_seconds",
                &[],
                LATENCY_BUCKETS,
                (now - t).as_secs_f64(),
            );
        }
        live.n_generated += 1;
        // What a crash of this process would bill it (see the ledger's policy).
        if let (Some(l), Some(row)) = (&self.ledger, live.ledger_row) {
            l.progress(row, live.n_generated as u64);
        }
        if is_end {
            let _ = live.events.send(SessionEvent::Token {
                token,
                text: String::new(),
                logprob,
            });
            self.scheduler.finish(id);
            self.finish(id, FinishReason::Stop);
            return;
        }
        let piece: String = live
            .decoder
            .push(&self.tokenizer, token)
            .unwrap_or_default();
        match live.stops.push(&piece) {
            StopStep::Continue(text) => {
                let _ = live.events.send(SessionEvent::Token {
                    token,
                    text,
                    logprob,
                });
            }
            StopStep::Stop(text) => {
                let _ = live.events.send(SessionEvent::Token {
                    token,
                    text,
                    logprob,
                });
                self.scheduler.finish(id);
                if let Some(l) = self.forget(id, "done") {
                    self.done(l, FinishReason::Stop);
                }
            }
        }
    }

    fn finish(&mut self, id: SessionId, reason: FinishReason) {
        let Some(mut live) = self.forget(id, "done") else {
            return;
        };
        if reason == FinishReason::Length {
            let tail = live.decoder.finish();
            let text = session::tail_at_length(&tail, &mut live.stops);
            if !text.is_empty() {
                let _ = live.events.send(SessionEvent::Text(text));
            }
        }
        self.done(live, reason);
    }

    fn done(&self, live: Live, reason: FinishReason) {
        // A prompt longer than a block could start on cached blocks (its last position is
        // always computed): it either did or computed them all.
        if live.n_prompt > engine::KV_BLOCK_POSITIONS {
            let outcome = if live.n_cached > 0 { "hit" } else { "miss" };
            self.metrics
                .inc("strata_prefix_lookups_total", &[("outcome", outcome)], 1.0);
        }
        let _ = live.events.send(SessionEvent::Done {
            finish_reason: reason,
            stop_sequence: live.stops.matched().map(str::to_string),
            prompt_tokens: live.n_prompt,
            completion_tokens: live.n_generated,
            cached_tokens: live.n_cached.min(live.n_prompt),
        });
    }

    /// Per step: the route's messaging time (the round trip less the time the shards held the
    /// step), each seam's bytes and the round trips its sending shard measured, each shard's
    /// compute.
    fn record_hops(&self, reply: &RouteReply, round_trip: Duration) {
        let hops = &reply.hops;
        if hops.is_empty() {
            return;
        }
        let held: u64 = hops.iter().map(|h| h.held_micros).sum();
        self.metrics.observe(
            "strata_route_overhead_seconds",
            &[],
            LATENCY_BUCKETS,
            (round_trip.as_secs_f64() - held as f64 / 1e6).max(0.0),
        );
        for pair in hops.windows(2) {
            let hop = format!("{}->{}", pair[0].shard, pair[1].shard);
            for &rtt in &pair[0].seam_rtt_micros {
                self.metrics.observe(
                    "strata_seam_latency_seconds",
                    &[("hop", &hop)],
                    LATENCY_BUCKETS,
                    rtt as f64 / 1e6,
                );
            }
            self.metrics.inc(
                "strata_seam_bytes_total",
                &[("hop", &hop)],
                pair[0].seam_bytes as f64,
            );
        }
        for h in hops {
            self.metrics.observe(
                "strata_shard_step_seconds",
                &[("shard", &h.shard)],
                LATENCY_BUCKETS,
                h.compute_micros as f64 / 1e6,
            );
        }
    }
}
