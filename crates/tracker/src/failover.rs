//! Moving sessions off a failed route: every session a route loses goes to another route of
//! the same model that takes it (open, its shards answering, room for the session's tokens
//! and what it may still generate), which replays the session's known tokens and continues.
//! The client's stream goes on with no error and no token lost or repeated. A session no route
//! takes within `wait` fails with the route's own error, as it would have without a replica.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::ledger::Ledger;
use crate::runner::{Command, Moved};

/// A route sessions may move to.
#[derive(Clone)]
pub struct Target {
    pub digest: String,
    pub name: String,
    pub commands: mpsc::Sender<Command>,
    pub up: watch::Receiver<bool>,
    /// An operator evicted the model from it: it takes no sessions.
    pub evicted: Arc<std::sync::atomic::AtomicBool>,
}

impl Target {
    fn takes_work(&self) -> bool {
        *self.up.borrow() && !self.evicted.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Places every moved session, each on its own task.
pub async fn dispatch(
    mut moved: mpsc::UnboundedReceiver<Box<Moved>>,
    targets: Arc<Vec<Target>>,
    ledger: Option<Arc<Ledger>>,
    wait: Duration,
) {
    while let Some(m) = moved.recv().await {
        tokio::spawn(place(m, Arc::clone(&targets), ledger.clone(), wait));
    }
}

async fn place(
    mut m: Box<Moved>,
    targets: Arc<Vec<Target>>,
    ledger: Option<Arc<Ledger>>,
    wait: Duration,
) {
    let deadline = Instant::now() + wait;
    // The other routes of the model first; the one it left too, once it is back.
    let mut others: Vec<&Target> = targets.iter().filter(|t| t.digest == m.digest).collect();
    others.sort_by_key(|t| t.name == m.from);
    let replicas = others.iter().filter(|t| t.name != m.from).count();
    loop {
        if m.abandoned() {
            m.fail(ledger.as_deref());
            return;
        }
        for t in others.iter().filter(|t| t.takes_work()) {
            let (tx, rx) = oneshot::channel();
            if let Err(e) = t
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
                Ok(Ok(_)) => return,
                Ok(Err(back)) => m = back,
                // The runner stopped holding it: the tracker is shutting down.
                Err(_) => return,
            }
        }
        // With no other route the failure is the client's at once, as without failover.
        if replicas == 0 || Instant::now() >= deadline {
            m.fail(ledger.as_deref());
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
