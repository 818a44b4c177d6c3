//! Offering a job to a model's routes: the one holding the longest cached prefix of its prompt
//! or the least loaded first, other slow routes last ([`RouteChoice`]), the next when one refuses for
//! a reason another route may not have; when all refuse for a reason that passes (failing
//! over, draining, restarting, rejoining), again until one takes it or a bounded wait is over.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Reason, Refusal};
use tokio::sync::{mpsc, oneshot};

use super::driver::{Command, Job, SessionEvent};
use super::prefixes::{self, RouteChoice};
use super::table::{ModelEntry, RouteHandle, RouteTable};

/// Whether a route's refusal leaves the job to the model's next route: this route is full,
/// failed, draining or changed, and another may not be; anything about the request itself is
/// the answer.
fn another_may_take(e: &Refusal) -> bool {
    match e.reason {
        Reason::Capacity
        | Reason::NoRoute
        | Reason::Draining
        | Reason::ShardFailed
        | Reason::RecipeMismatch
        | Reason::CacheMiss
        | Reason::ProtocolMismatch => true,
        Reason::InvalidRequest
        | Reason::TooLarge
        | Reason::Timeout
        | Reason::Unauthorized
        | Reason::NotFound
        | Reason::MethodNotAllowed
        | Reason::ModelNotFound
        | Reason::NotResident
        | Reason::Budget
        | Reason::Pinned
        | Reason::StaleEpoch
        | Reason::GrammarBudget => false,
    }
}

/// A job a route took: the route, the session's id there and its events.
type Admitted = (
    Arc<RouteHandle>,
    engine::SessionId,
    mpsc::UnboundedReceiver<SessionEvent>,
);

/// Whether every route refusing for this reason is a moment of change (a route failing over,
/// draining, or a shard restarting and its route rejoining) rather than an answer: not a full route (admission refuses at once, typed) nor anything about the request.
fn passes(e: &Refusal) -> bool {
    matches!(
        e.reason,
        Reason::NoRoute | Reason::Draining | Reason::ShardFailed
    )
}

/// What the model's routes answer when the job is offered to them ([`submit`]); when all
/// refuse for a reason that passes, offered again every 50 ms, with the routes read afresh
/// from `table` (one that joined meanwhile included), until one takes it or `deadline` has passed. A
/// client thus gets no error for a moment in which no route of its model was open (a replica
/// failing over, a shard restarting, a route rejoining from the registry), as a session moved
/// off a failed route gets none; past `deadline` the refusal is the client's, typed.
pub async fn submit_within(
    table: &RouteTable,
    model: &ModelEntry,
    job: Job,
    deadline: Instant,
) -> Result<Admitted, Refusal> {
    loop {
        // The routes as the table holds them now: the caller's entry may list a route that
        // has left since (its loop stopped), and never one that joined.
        let entry = table.model(&model.digest);
        let m = entry.as_deref().unwrap_or(model);
        match submit(m, job.clone(), table.choice).await {
            // A model that left the table altogether is not a moment of change.
            Err(e) if passes(&e) && entry.is_some() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            answer => return answer,
        }
    }
}

/// Offers the job to the model's routes in turn; the first that admits it runs it. When every
/// route refuses for capacity the last refusal is returned; any other refusal is final.
pub async fn submit(
    model: &ModelEntry,
    job: Job,
    choice: RouteChoice,
) -> Result<Admitted, Refusal> {
    use std::sync::atomic::Ordering::Relaxed;
    let mut last = Refusal::no_route("the model has no route now; retry shortly");
    // The least loaded route first (sessions held and requests on their way; between equals,
    // the one whose tightest shard has the most free KV), unless a route holding a cached
    // prefix of the prompt is within the choice's slack of it (slow or not); other routes
    // measured more than three times as slow as the fastest last; the others in turn when one
    // refuses for capacity.
    let mut routes: Vec<&Arc<RouteHandle>> = model.routes.iter().filter(|r| r.resident()).collect();
    routes.sort_by_key(|r| std::cmp::Reverse(r.health.borrow().kv_headroom()));
    let keys = prefixes::chain(job.tenant.key, &job.prompt_ids);
    let load: Vec<usize> = routes
        .iter()
        .map(|r| r.load.load(Relaxed) + r.submitting.load(Relaxed))
        .collect();
    let matched: Vec<usize> = routes.iter().map(|r| r.prefixes.matched(&keys)).collect();
    let now = std::time::Instant::now();
    let pace: Vec<Option<f64>> = routes.iter().map(|r| r.pace.seconds(now)).collect();
    for i in choice.order(&load, &matched, &pace) {
        let route = routes[i];
        route.submitting.fetch_add(1, Relaxed);
        let answer = offer(route, &job, &keys).await;
        route.submitting.fetch_sub(1, Relaxed);
        match answer {
            Ok((id, events)) => return Ok((Arc::clone(route), id, events)),
            Err(e) if another_may_take(&e) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Offers the job to one route: its session id and events, or its refusal.
async fn offer(
    route: &RouteHandle,
    job: &Job,
    prefix_keys: &[u64],
) -> Result<(engine::SessionId, mpsc::UnboundedReceiver<SessionEvent>), Refusal> {
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (acc_tx, acc_rx) = oneshot::channel();
    route
        .commands
        .send(Command::Submit {
            job: Box::new(job.clone()),
            prefix_keys: prefix_keys.to_vec(),
            events: events_tx,
            accepted: acc_tx,
        })
        .await
        .map_err(|_| Refusal::unavailable("the scheduler is shutting down"))?;
    match acc_rx.await {
        Ok(Ok(id)) => Ok((id, events_rx)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Refusal::unavailable("the scheduler is shutting down")),
    }
}
