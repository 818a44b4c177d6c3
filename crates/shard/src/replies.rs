//! Replies streams the tracker opens on the last shard of a route, each waiting (under a key
//! of the tracker's choosing) for the route whose setup names it.

use std::collections::HashMap;
use std::sync::Mutex;

use proto::v1::RouteReply;
use proto::ReplyStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

pub(crate) type ReplyTx = mpsc::Sender<Result<RouteReply, Status>>;

/// Replies streams by key, until a route takes one.
#[derive(Default)]
pub(crate) struct ReplySinks(Mutex<HashMap<u64, ReplyTx>>);

impl ReplySinks {
    /// Registers a Replies stream under `key`; streams whose reader went away are forgotten.
    pub(crate) fn open(&self, key: u64) -> Result<ReplyStream, Status> {
        if key == 0 {
            return Err(Status::invalid_argument(
                "a replies stream needs a nonzero key",
            ));
        }
        let mut sinks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        sinks.retain(|_, tx| !tx.is_closed());
        if sinks.contains_key(&key) {
            return Err(Status::already_exists(format!(
                "a replies stream with key {key} is already open"
            )));
        }
        let (tx, rx) = mpsc::channel(256);
        sinks.insert(key, tx);
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    /// The stream registered under `key`, taken once.
    pub(crate) fn take(&self, key: u64) -> Option<ReplyTx> {
        let mut sinks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        sinks.remove(&key).filter(|tx| !tx.is_closed())
    }
}
