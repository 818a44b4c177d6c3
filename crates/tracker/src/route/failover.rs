//! Moving sessions off a failed route: every session a route loses goes to another route of
//! the same model that takes it (open, its shards answering, room for the session's tokens
//! and what it may still generate), which replays the session's known tokens and continues.
//! The client's stream goes on with no error and no token lost or repeated. A session no route
//! takes within `wait` fails with the route's own error, as it would have without a replica.
//! The routes are read from the route table at every try, so a route that joined meanwhile
//! (a shard announced in the registry) takes sessions too. Without another route the session
//! fails at once on a tracker of static routes (nothing can join), and waits out `wait` on one
//! following a registry (the chain of a restarted or resumed shard joins within it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::route::driver::{Command, Moved};
use crate::route::table::RouteTable;

/// Places every moved session, each on its own task.
pub async fn dispatch(
    mut moved: mpsc::UnboundedReceiver<Box<Moved>>,
    table: Arc<RouteTable>,
    ledger: Option<Arc<Ledger>>,
    metrics: Arc<Metrics>,
    wait: Duration,
) {
    while let Some(m) = moved.recv().await {
        tokio::spawn(place(
            m,
            Arc::clone(&table),
            ledger.clone(),
            Arc::clone(&metrics),
            wait,
        ));
    }
}

async fn place(
    mut m: Box<Moved>,
    table: Arc<RouteTable>,
    ledger: Option<Arc<Ledger>>,
    metrics: Arc<Metrics>,
    wait: Duration,
) {
    let deadline = Instant::now() + wait;
    loop {
        if m.abandoned() {
            m.fail(ledger.as_deref());
            return;
        }
        // The other routes of the model first, the one holding most of its tokens' blocks
        // (as far as this tracker saw) first among them; the one it left too, once it is back.
        let keys = m.prefix_keys();
        let mut routes = table.routes_of(&m.digest);
        routes.sort_by_key(|r| {
            (
                r.name == m.from,
                std::cmp::Reverse(r.prefixes.matched(&keys)),
            )
        });
        let replicas = routes.iter().filter(|r| r.name != m.from).count();
        for r in routes.iter().filter(|r| r.takes_work()) {
            let (tx, rx) = oneshot::channel();
            if let Err(e) = r
                .commands
                .send(Command::Resume {
                    moved: m,
                    accepted: tx,
                })
                .await
            {
                // That route's loop has stopped: the session comes back with the command.
                let Command::Resume { moved, .. } = e.0 else {
                    return;
                };
                m = moved;
                continue;
            }
            match rx.await {
                Ok(Ok(_)) => {
                    r.prefixes.record(&keys);
                    return;
                }
                Ok(Err(back)) => m = back,
                // The runner stopped holding it: the tracker is shutting down.
                Err(_) => return,
            }
        }
        // With no other route and nothing that can join, the failure is the client's at once,
        // as without failover.
        let none_can_come = replicas == 0 && table.registry.is_none();
        if none_can_come || Instant::now() >= deadline {
            tracing::warn!(
                from = %m.from,
                replicas,
                error = %m.error.message,
                "no route took a moved session in time: it fails"
            );
            metrics.inc(
                "strata_sessions_lost_total",
                &[("why", "no_route_in_time")],
                1.0,
            );
            m.fail(ledger.as_deref());
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
