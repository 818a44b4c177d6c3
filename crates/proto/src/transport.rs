//! The transport seen by callers: [`ShardTransport`], implemented over gRPC by [`GrpcShard`]
//! and in memory by the shard crate's embedded shard, so the code above it is one path.

use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use tokio::sync::mpsc;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::v1::shard_client::ShardClient;
use crate::v1::{
    DescribeRequest, RepliesRequest, RouteMsg, RouteReply, ShardInfo, ShardStats, StatsRequest,
    VocabReply, VocabRequest,
};
use crate::{MAX_MESSAGE_BYTES, TOKEN_HEADER};

/// Replies of a route stream.
pub type ReplyStream = Pin<Box<dyn Stream<Item = Result<RouteReply, Status>> + Send>>;

/// What a tracker (or an upstream shard) needs from a shard.
#[tonic::async_trait]
pub trait ShardTransport: Send + Sync {
    /// Where the shard is ("host:port", or "embedded").
    fn address(&self) -> &str;
    async fn describe(&self, timeout: Duration) -> Result<ShardInfo, Status>;
    async fn vocab(&self) -> Result<VocabReply, Status>;
    async fn stats(&self, timeout: Duration) -> Result<ShardStats, Status>;
    /// Opens a route stream: messages sent on `outbound` (a `RouteSetup` first) reach the shard;
    /// its replies come back on the returned stream.
    async fn route(&self, outbound: mpsc::Receiver<RouteMsg>) -> Result<ReplyStream, Status>;
    /// Opens the stream on which this shard, as the last of a route whose setup carries `key`,
    /// sends that route's step replies.
    async fn replies(&self, key: u64) -> Result<ReplyStream, Status>;
}

/// Adds the cluster token to every outgoing request.
#[derive(Clone)]
pub struct Auth {
    token: MetadataValue<tonic::metadata::Ascii>,
}

impl Auth {
    pub fn new(token: &str) -> Result<Self, Status> {
        let token = token
            .parse()
            .map_err(|_| Status::invalid_argument("the cluster token must be printable ASCII"))?;
        Ok(Auth { token })
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert(TOKEN_HEADER, self.token.clone());
        Ok(req)
    }
}

/// Refuses every incoming request that does not carry the cluster token.
#[derive(Clone)]
pub struct TokenCheck {
    token: String,
}

impl TokenCheck {
    pub fn new(token: &str) -> Self {
        TokenCheck {
            token: token.to_string(),
        }
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let presented = req
            .metadata()
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if secrets_equal(presented, &self.token) {
            Ok(req)
        } else {
            Err(Status::unauthenticated("missing or wrong cluster token"))
        }
    }
}

/// Whether a presented secret is the expected one, in time that does not depend on where they
/// differ (only on the expected secret's length).
pub fn secrets_equal(presented: &str, expected: &str) -> bool {
    let (a, b) = (presented.as_bytes(), expected.as_bytes());
    let mut diff = a.len() ^ b.len();
    for (i, &x) in b.iter().enumerate() {
        diff |= (x ^ a.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

/// A shard reached over gRPC.
#[derive(Clone)]
pub struct GrpcShard {
    address: String,
    client: ShardClient<InterceptedService<Channel, Auth>>,
}

/// How a process reaches shards: the cluster token every call carries and, on a cluster with
/// TLS, the certificate authority that signed the shards' certificates.
#[derive(Clone, Default)]
pub struct Link {
    pub token: String,
    /// PEM of the CA shard certificates must chain to; `None`: plaintext (loopback only, or a
    /// network the operator trusts).
    pub ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a secret: never printed.
        f.debug_struct("Link")
            .field("tls", &self.ca_pem.is_some())
            .finish()
    }
}

impl Link {
    /// A plaintext link with `token`.
    pub fn plain(token: &str) -> Self {
        Link {
            token: token.to_string(),
            ca_pem: None,
        }
    }
}

/// A lazy channel to `address` ("host:port") of a peer of the cluster (`what` names it in
/// errors: "shard", "drafter"); keepalive pings detect a frozen peer. With a CA in `link` the
/// connection is TLS and the peer's certificate must name the host of `address` (a DNS name or
/// an IP address).
pub fn channel(address: &str, link: &Link, what: &str) -> Result<Channel, Status> {
    let scheme = if link.ca_pem.is_some() {
        "https"
    } else {
        "http"
    };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| Status::invalid_argument(format!("bad {what} address `{address}`: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(2))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    if let Some(ca) = &link.ca_pem {
        let host = address
            .rsplit_once(':')
            .map_or(address, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca))
            .domain_name(host);
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| Status::invalid_argument(format!("TLS for {what} `{address}`: {e}")))?;
    }
    Ok(endpoint.connect_lazy())
}

/// Connects lazily to the shard at `address` ([`channel`]).
pub fn connect(address: &str, link: &Link) -> Result<GrpcShard, Status> {
    let client =
        ShardClient::with_interceptor(channel(address, link, "shard")?, Auth::new(&link.token)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
    Ok(GrpcShard {
        address: address.to_string(),
        client,
    })
}

impl GrpcShard {
    /// Waits up to 5 s for the shard to open the `what` stream of replies.
    async fn opened(
        &self,
        what: &str,
        open: impl std::future::Future<
            Output = Result<tonic::Response<tonic::Streaming<RouteReply>>, Status>,
        >,
    ) -> Result<ReplyStream, Status> {
        let replies = tokio::time::timeout(Duration::from_secs(5), open)
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "{} did not open the {what} stream",
                    self.address
                ))
            })??
            .into_inner();
        Ok(Box::pin(replies))
    }
}

fn with_timeout<T>(msg: T, timeout: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(timeout);
    r
}

#[tonic::async_trait]
impl ShardTransport for GrpcShard {
    fn address(&self) -> &str {
        &self.address
    }

    async fn describe(&self, timeout: Duration) -> Result<ShardInfo, Status> {
        let mut client = self.client.clone();
        let fut = client.describe(with_timeout(DescribeRequest {}, timeout));
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r.map(|r| r.into_inner()),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "{} did not answer within {timeout:?}",
                self.address
            ))),
        }
    }

    async fn vocab(&self) -> Result<VocabReply, Status> {
        let mut client = self.client.clone();
        let fut = client.vocab(with_timeout(VocabRequest {}, Duration::from_secs(10)));
        fut.await.map(|r| r.into_inner())
    }

    async fn stats(&self, timeout: Duration) -> Result<ShardStats, Status> {
        let mut client = self.client.clone();
        let fut = client.stats(with_timeout(StatsRequest {}, timeout));
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r.map(|r| r.into_inner()),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "{} did not answer within {timeout:?}",
                self.address
            ))),
        }
    }

    async fn route(&self, outbound: mpsc::Receiver<RouteMsg>) -> Result<ReplyStream, Status> {
        let stream = tokio_stream::wrappers::ReceiverStream::new(outbound);
        let mut client = self.client.clone();
        self.opened("route", client.route(Request::new(stream)))
            .await
    }

    async fn replies(&self, key: u64) -> Result<ReplyStream, Status> {
        let mut client = self.client.clone();
        self.opened(
            "replies",
            client.replies(Request::new(RepliesRequest { key })),
        )
        .await
    }
}
