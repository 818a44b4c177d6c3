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

#[tonic::async_trait]
impl Shard for ShardService {
    async fn describe(&self, _: Request<DescribeRequest>) -> Result<Response<ShardInfo>, Status> {
        Ok(Response::new(self.core.info.clone()))
    }

    async fn vocab(&self, _: Request<VocabRequest>) -> Result<Response<VocabReply>, Status> {
        Ok(Response::new(VocabReply {
            gguf: self.core.vocab_gguf.clone(),
        }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<ShardStats>, Status> {
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
        self.core
            .reply_sinks
            .open(req.into_inner().key)
            .map(Response::new)
    }
}

/// Serves `core` on `listener` until `shutdown` completes.
pub async fn serve(
    core: Arc<ShardCore>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), crate::Error> {
    let token = core.config.cluster_token.clone();
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
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(2)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
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
        Ok(self.core.info.clone())
    }

    async fn vocab(&self) -> Result<VocabReply, Status> {
        Ok(VocabReply {
            gguf: self.core.vocab_gguf.clone(),
        })
    }

    async fn stats(&self, _: Duration) -> Result<ShardStats, Status> {
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
        self.core.reply_sinks.open(key)
    }
}
