//! The gRPC face of a shard, and the same shard embedded in-process behind the same trait.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use proto::v1::shard_server::{Shard, ShardServer};
use proto::v1::{
    DescribeRequest, RepliesRequest, RouteMsg, ShardInfo, ShardStats, StatsRequest, VocabReply,
    VocabRequest,
};
use proto::{ReplyStream, ShardTransport, TokenCheck};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use crate::core::ShardCore;
use crate::route::run_route;

/// The tonic service.
#[derive(Debug, Clone)]
pub struct ShardService {
    core: Arc<ShardCore>,
}

/// `unavailable` once the compute thread has stopped: a shard that can run no step never
/// answers as if it were healthy.
fn alive(core: &ShardCore) -> Result<(), Status> {
    core.check_alive().map_err(|e| {
        Status::unavailable(format!(
            "{}: shard {}: {e}",
            engine::Reason::ShardFailed,
            core.config.label
        ))
    })
}

#[tonic::async_trait]
impl Shard for ShardService {
    async fn describe(&self, _: Request<DescribeRequest>) -> Result<Response<ShardInfo>, Status> {
        alive(&self.core)?;
        Ok(Response::new(self.core.info.clone()))
    }

    async fn vocab(&self, _: Request<VocabRequest>) -> Result<Response<VocabReply>, Status> {
        alive(&self.core)?;
        Ok(Response::new(VocabReply {
            gguf: self.core.vocab_gguf.clone(),
        }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<ShardStats>, Status> {
        alive(&self.core)?;
        Ok(Response::new(self.core.stats()))
    }

    type RouteStream = ReplyStream;

    async fn route(
        &self,
        req: Request<Streaming<RouteMsg>>,
    ) -> Result<Response<ReplyStream>, Status> {
        run_route(Arc::clone(&self.core), req.into_inner())
            .await
            .map(Response::new)
    }

    type RepliesStream = ReplyStream;

    async fn replies(&self, req: Request<RepliesRequest>) -> Result<Response<ReplyStream>, Status> {
        alive(&self.core)?;
        self.core
            .reply_sinks
            .open(req.into_inner().key)
            .map(Response::new)
    }
}

/// How long a shard that was told to stop waits for its route streams to close after telling
/// their trackers, before it stops anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// Serves `core` on `listener` until `shutdown` completes or the compute thread stops. On
/// shutdown every route stream ends with a typed failure to its tracker and the server stops
/// within [`SHUTDOWN_GRACE`] even if a peer keeps its connection open. A stopped compute
/// thread is an error: the process must not stay up looking alive.
pub async fn serve(
    core: Arc<ShardCore>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), crate::Error> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watcher = Arc::clone(&core);
    let stopped = tokio::spawn(async move {
        let why = tokio::select! {
            _ = shutdown => None,
            why = watcher.stopped() => Some(why),
        };
        watcher.shut_down();
        let _ = stop_tx.send(());
        why
    });
    let token = core.config.link.token.clone();
    let identity = core.config.tls_identity.clone();
    let server = ShardServer::new(ShardService { core })
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
    let svc = tonic::service::interceptor::InterceptedService::new(server, TokenCheck::new(&token));
    // The builder's `tcp_nodelay` applies only to listeners tonic opens itself: set it on each
    // accepted connection, or replies (small writes) wait for the peer's delayed ACK (~40 ms).
    let incoming = TcpListenerStream::new(listener).map(|conn| {
        let conn = conn?;
        conn.set_nodelay(true)?;
        Ok::<_, std::io::Error>(conn)
    });
    let (grace_tx, grace_rx) = tokio::sync::oneshot::channel::<()>();
    let mut builder = tonic::transport::Server::builder();
    if let Some(id) = identity {
        let tls = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(id.cert_pem, id.key_pem),
        );
        builder = builder.tls_config(tls)?;
    }
    let server = builder
        .http2_keepalive_interval(Some(Duration::from_secs(2)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stop_rx.await;
            let _ = grace_tx.send(());
        });
    tokio::pin!(server);
    // Graceful shutdown waits for every open stream; a peer may keep one open forever.
    let grace = async {
        if grace_rx.await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = &mut server => served?,
        _ = grace => tracing::warn!("route streams still open {SHUTDOWN_GRACE:?} after shutdown began; stopping anyway"),
    }
    match stopped.await {
        Ok(Some(why)) => Err(crate::Error::Stopped(why)),
        _ => Ok(()),
    }
}

/// A shard in the same process: the in-memory transport.
#[derive(Debug, Clone)]
pub struct LocalShard {
    core: Arc<ShardCore>,
}

impl LocalShard {
    pub fn new(core: Arc<ShardCore>) -> Self {
        LocalShard { core }
    }
}

#[tonic::async_trait]
impl ShardTransport for LocalShard {
    fn address(&self) -> &str {
        &self.core.config.label
    }

    async fn describe(&self, _: Duration) -> Result<ShardInfo, Status> {
        alive(&self.core)?;
        Ok(self.core.info.clone())
    }

    async fn vocab(&self) -> Result<VocabReply, Status> {
        alive(&self.core)?;
        Ok(VocabReply {
            gguf: self.core.vocab_gguf.clone(),
        })
    }

    async fn stats(&self, _: Duration) -> Result<ShardStats, Status> {
        alive(&self.core)?;
        Ok(self.core.stats())
    }

    async fn route(&self, outbound: mpsc::Receiver<RouteMsg>) -> Result<ReplyStream, Status> {
        run_route(
            Arc::clone(&self.core),
            ReceiverStream::new(outbound).map(Ok),
        )
        .await
    }

    async fn replies(&self, key: u64) -> Result<ReplyStream, Status> {
        alive(&self.core)?;
        self.core.reply_sinks.open(key)
    }
}
