//! Sessions coming and going: a new request admitted or refused (typed), a session another
//! route lost taken up, and a session's end: its admission released, its usage settled, a
//! cancelled one aborted in the scheduler (a client that went away counts as cancelled).

use std::time::Instant;

use engine::{Demand, Refusal, SessionId};
use text::{StopMatcher, StreamDecoder};
use tokio::sync::{mpsc, oneshot};

use super::{health_refusal, new_session_id, owner_of, Job, Live, Moved, Runner, SessionEvent};

impl Runner {
    /// A new session: refused (typed) while the route is retired, down or not serving, or
    /// when admission has no room; else queued.
    pub(super) fn submit(
        &mut self,
        job: Job,
        prefix_keys: Vec<u64>,
        events: mpsc::UnboundedSender<SessionEvent>,
        accepted: oneshot::Sender<Result<SessionId, Refusal>>,
    ) {
        // Refusals are counted where they are answered (the HTTP handler).
        if self.retired {
            let _ = accepted.send(Err(Refusal::draining(format!(
                "route {} has left",
                self.name
            ))));
            return;
        }
        if let Some(reason) = &self.down_reason {
            let _ = accepted.send(Err(reason.clone()));
            return;
        }
        // The route is open but a shard stopped answering its probes (frozen, or
        // replaced by one holding something else): work sent now would only wait for
        // the route's silence to run out.
        let health = self.health.borrow().clone();
        if !health.serving() {
            let _ = accepted.send(Err(health_refusal(&health)));
            return;
        }
        let id = new_session_id();
        let demand = Demand {
            n_positions: job.prompt_ids.len() + job.max_tokens,
            priority: job.priority,
            key: &job.key,
        };
        let queued = self.scheduler.n_waiting_of(job.priority);
        if let Err(r) = self.admission.admit(id, &demand, queued) {
            let _ = accepted.send(Err(r));
            return;
        }
        let owner = owner_of(&job.key);
        self.scheduler.add(
            id,
            job.prompt_ids.clone(),
            job.max_tokens,
            job.priority,
            owner,
        );
        let speculative = job.speculative && job.sampling.grammar.is_empty();
        if !speculative {
            self.scheduler.no_drafts(id);
        }
        self.live.insert(
            id,
            Live {
                n_replays: 0,
                n_moves: 0,
                frontier: 0,
                moved_at: None,
                key: job.key.clone(),
                tenant: job.tenant,
                prefix_keys,
                events,
                decoder: StreamDecoder::new(),
                stops: StopMatcher::new(job.stop),
                n_prompt: job.prompt_ids.len(),
                n_cached: 0,
                n_generated: 0,
                started: Instant::now(),
                last_token: None,
                logprobs: job.logprobs,
                sampling: job.sampling,
                ignore_eos: job.ignore_eos,
                speculative,
                priority: job.priority,
                queued: true,
                ledger_row: job.ledger_row,
                billed_prompt: job.billed_prompt,
            },
        );
        self.publish_load();
        let _ = accepted.send(Ok(id));
    }

    /// A session another route lost: taken when the route serves and admission has room,
    /// else handed back.
    pub(super) fn resume(
        &mut self,
        moved: Box<Moved>,
        accepted: oneshot::Sender<Result<SessionId, Box<Moved>>>,
    ) {
        let refused = self.retired || self.down_reason.is_some() || !self.health.borrow().serving();
        let id = new_session_id();
        let demand = Demand {
            n_positions: moved.tokens.len() + moved.max_new,
            priority: moved.live.priority,
            key: &moved.live.key,
        };
        let queued = self.scheduler.n_waiting_of(moved.live.priority);
        if refused || self.admission.admit(id, &demand, queued).is_err() {
            let _ = accepted.send(Err(moved));
            return;
        }
        let Moved {
            mut live,
            tokens,
            max_new,
            ..
        } = *moved;
        live.queued = true;
        live.n_replays = 0;
        self.metrics
            .inc("strata_migrated_tokens_total", &[], tokens.len() as f64);
        let owner = owner_of(&live.key);
        self.scheduler
            .add(id, tokens, max_new, live.priority, owner);
        if !live.speculative {
            self.scheduler.no_drafts(id);
        }
        self.live.insert(id, live);
        self.publish_load();
        let _ = accepted.send(Ok(id));
    }

    /// Removes a session from the live set, returns what it reserved at admission and settles
    /// its usage (`status`: done, cancelled or failed).
    pub(super) fn forget(&mut self, id: SessionId, status: &'static str) -> Option<Live> {
        self.admission.release(id);
        let live = self.live.remove(&id)?;
        self.settle(&live, status);
        Some(live)
    }

    pub(super) fn settle(&self, live: &Live, status: &'static str) {
        if let (Some(ledger), Some(row)) = (&self.ledger, live.ledger_row) {
            ledger.settle(
                row,
                live.billed_prompt as u64,
                live.n_generated as u64,
                status,
            );
        }
    }

    pub(super) fn cancel(&mut self, id: SessionId) {
        if self.forget(id, "cancelled").is_some() {
            self.scheduler.abort(id);
            self.metrics.inc("strata_cancelled_total", &[], 1.0);
        }
    }

    /// Sessions whose client went away are cancelled (their KV is released with the next plan).
    pub(super) fn drop_disconnected(&mut self) {
        let gone: Vec<SessionId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.cancel(id);
        }
    }
}
