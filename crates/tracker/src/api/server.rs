//! The HTTP server under the API: its own accept loop, so that every connection is bounded.
//!
//! A connection must send a request's headers within the header timeout (counted from when
//! the server starts waiting for them: on a kept-alive connection that is its idle time, so
//! idle connections close too), its body within the body timeout, and at most
//! `max_connections` are open at once; one over the limit is answered with a typed 503
//! `capacity` (`max_connections`) and closed, never left to use up the process's descriptors.
//! A failed accept (out of descriptors) is retried after a pause, never a busy loop or an exit.
//! With TLS configured every connection is TLS (the handshake under the header timeout too).
//! A request with more than [`MAX_HEADERS`] headers or [`MAX_HEADER_BYTES`] of them is a typed
//! 431 with a JSON body (hyper's own bare 431 is left only for a head over its read buffer,
//! about 400 KiB).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use engine::Refusal;

use crate::api::error::Answer;

/// The most headers a request may carry (hyper is allowed more, so that ours answers).
pub const MAX_HEADERS: usize = 100;
/// The most bytes of header names and values a request may carry.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// What hyper itself accepts: past it hyper answers 431 with no body.
const HYPER_MAX_HEADERS: usize = 1024;

/// Refuses a request whose headers are over [`MAX_HEADERS`] or [`MAX_HEADER_BYTES`], typed.
async fn header_limits(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let headers = req.headers();
    let bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if headers.len() > MAX_HEADERS {
        return Refusal::headers_too_large(
            "max_headers",
            format!(
                "the request has {} headers, more than the {MAX_HEADERS} accepted",
                headers.len()
            ),
        )
        .into_response();
    }
    if bytes > MAX_HEADER_BYTES {
        return Refusal::headers_too_large(
            "max_header_bytes",
            format!(
                "the request's headers take {bytes} bytes, more than the {MAX_HEADER_BYTES} accepted"
            ),
        )
        .into_response();
    }
    next.run(req).await
}

/// Limits of the HTTP server, validated by the binary.
#[derive(Clone)]
pub struct HttpConfig {
    /// The longest a connection may take to send a request's headers (and, between requests,
    /// stay idle); also bounds a TLS handshake.
    pub header_timeout: Duration,
    /// The longest a request's body may take to arrive once its headers are in.
    pub body_timeout: Duration,
    /// Connections open at once; more are refused with a typed 503.
    pub max_connections: usize,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// TLS on every connection, when set.
    pub tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: default_max_connections(),
            max_body_bytes: 4 << 20,
            tls: None,
        }
    }
}

/// Connections the process can hold beside what else it needs descriptors for (shard links,
/// the ledger, files): the soft descriptor limit less 64, at least 8, at most 4096.
pub fn default_max_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur as usize
    } else {
        1024
    };
    soft.saturating_sub(64).clamp(8, 4096)
}

/// Serves `router` on `listener` until `shutdown` completes; connections then get up to five
/// seconds to finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(config.header_timeout)
        .max_headers(HYPER_MAX_HEADERS)
        .keep_alive(true);
    let router = router.layer(axum::middleware::from_fn(header_limits));
    let http = Arc::new(http);
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let tls = config.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted: pause,
                    // so that closing connections free some, and go on.
                    tracing::warn!(error = %e, "accepting an HTTP connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Tokens stream as small SSE writes: never let Nagle hold one back waiting for an ACK.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY on an HTTP connection");
        }
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tokio::spawn(refuse(tcp, config.max_connections));
            continue;
        };
        let (http, router, tls, header_timeout) = (
            Arc::clone(&http),
            router.clone(),
            tls.clone(),
            config.header_timeout,
        );
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let service = TowerToHyperService::new(router);
            match tls {
                None => {
                    let conn = http.serve_connection(TokioIo::new(tcp), service);
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(error = %e, "HTTP connection ended");
                    }
                }
                Some(acceptor) => {
                    let Ok(Ok(stream)) =
                        tokio::time::timeout(header_timeout, acceptor.accept(tcp)).await
                    else {
                        tracing::debug!("TLS handshake failed or timed out");
                        return;
                    };
                    let conn = http.serve_connection(TokioIo::new(stream), service);
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(error = %e, "HTTPS connection ended");
                    }
                }
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(Duration::from_secs(5), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("HTTP connections still open 5 s after shutdown began; stopping anyway");
    }
    Ok(())
}

/// Answers a connection over the limit with a typed 503 and closes it. The request is read
/// (briefly) after the answer so that closing does not reset the connection under the answer.
async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(mut conn: S, limit: usize) {
    let err = Refusal::capacity(
        "max_connections",
        format!(
            "the API holds {limit} connections, its limit (`--max-connections`); retry shortly"
        ),
    );
    let body = err.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let answer = async {
        conn.write_all(head.as_bytes()).await?;
        conn.write_all(body.as_bytes()).await?;
        conn.shutdown().await?;
        let mut sink = [0u8; 4096];
        while conn.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_millis(500), answer).await;
}

/// How much of an over-limit body is read and dropped after the limit, so that the 413 reaches
/// a client still sending instead of a connection reset under its write.
const OVERFLOW_DRAIN_BYTES: usize = 16 << 20;
/// How long an over-limit body is drained at most.
const OVERFLOW_DRAIN_TIME: Duration = Duration::from_secs(1);

/// Memory for request bodies being read and parsed, all requests together: a body holds
/// [`PARSED_FACTOR`] times its bytes (its JSON tree can take that much more than its text) from
/// its first byte until it has been parsed and checked. Past the budget a request is refused
/// `capacity` (503, limit `body_memory`, retryable), so a flood of large bodies never outgrows
/// the tracker's memory, however many connections send them. With several API keys each key
/// holds at most its share ([`BodyBudget::share_kib`]): one key's slow bodies never take the
/// room another key's requests need.
pub struct BodyBudget {
    kib: Semaphore,
    total_kib: usize,
    /// The most one key's bodies hold at once.
    share_kib: usize,
    /// What each key's bodies hold now (keys holding nothing are absent).
    held: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// Bodies of the largest size the budget always holds at once, whatever `max_body_bytes`.
const LARGEST_BODIES: usize = 4;

/// What a body is counted at, per byte of its text.
pub const PARSED_FACTOR: usize = 8;

/// The tracker's budget for request bodies in flight: 512 MiB, sixteen bodies of the largest
/// size (4 MiB) at once, or thousands of an agent's usual size.
pub const BODY_MEMORY_BYTES: usize = 512 << 20;

/// The fewest keys the budget is shared by: with `n` API keys each holds at most `1/n` of it,
/// and with more, a quarter (at least one body of the largest size).
const MAX_SHARES: usize = LARGEST_BODIES;

impl BodyBudget {
    /// [`BODY_MEMORY_BYTES`], or room for [`LARGEST_BODIES`] bodies of `max_body_bytes` if that
    /// is more (so a body the size limit admits always fits an idle tracker's budget), shared
    /// by `keys` API keys (0 or 1: one owner holds it all).
    pub fn for_bodies_of(max_body_bytes: usize, keys: usize) -> Self {
        let bytes = BODY_MEMORY_BYTES.max(LARGEST_BODIES * PARSED_FACTOR * max_body_bytes);
        let total_kib = bytes.div_ceil(1024);
        BodyBudget {
            kib: Semaphore::new(total_kib),
            total_kib,
            share_kib: total_kib / keys.clamp(1, MAX_SHARES),
            held: Default::default(),
        }
    }

    /// Takes `kib` more for `owner`'s body, within its share and the whole budget.
    fn take(&self, owner: &str, kib: usize) -> Result<(), Refusal> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let has = held.get(owner).copied().unwrap_or(0);
        if has + kib > self.share_kib {
            return Err(self.full(format!(
                "this key's request bodies in flight hold its {} MiB share of",
                self.share_kib / 1024
            )));
        }
        let more = u32::try_from(kib).unwrap_or(u32::MAX);
        let permits = self
            .kib
            .try_acquire_many(more)
            .map_err(|_| self.full("request bodies in flight hold".to_string()))?;
        permits.forget();
        held.insert(owner.to_string(), has + kib);
        Ok(())
    }

    /// The refusal of a body past the budget: `what` holds the tracker's memory for bodies.
    fn full(&self, what: String) -> Refusal {
        Refusal::capacity(
            "body_memory",
            format!(
                "{what} the tracker's {} MiB for them (each counted at {PARSED_FACTOR}x its size while it is read and parsed)",
                self.total_kib / 1024
            ),
        )
    }

    fn give_back(&self, owner: &str, kib: usize) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(has) = held.get_mut(owner) {
            *has -= kib.min(*has);
            if *has == 0 {
                held.remove(owner);
            }
        }
        self.kib.add_permits(kib);
    }
}

/// A body's share of the [`BodyBudget`], given back when dropped (it may move to the thread
/// that parses the body, so it owns its budget's handle).
pub struct BodyHold {
    budget: Arc<BodyBudget>,
    /// The API key whose share it is part of ("" without keys).
    owner: String,
    kib: usize,
}

impl BodyHold {
    /// Grows the hold to cover a body of `bytes`, or refuses.
    fn cover(&mut self, bytes: usize) -> Result<(), Refusal> {
        let want = (bytes * PARSED_FACTOR).div_ceil(1024);
        if want <= self.kib {
            return Ok(());
        }
        self.budget.take(&self.owner, want - self.kib)?;
        self.kib = want;
        Ok(())
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.budget.give_back(&self.owner, self.kib);
    }
}

/// Reads a request body within the limits: 413 past `max_body_bytes`, 408 when it does not
/// arrive within `body_timeout`, 503 `capacity` when the bodies in flight hold the whole
/// `budget`. Past the size limit the rest is read and dropped, bounded in bytes and time,
/// before the 413 is answered. The body's share of the budget (part of `owner`'s, the API
/// key's name) is held until the hold returned with it is dropped (once the body is parsed).
pub async fn read_body(
    body: axum::body::Body,
    config: &HttpConfig,
    budget: &Arc<BodyBudget>,
    owner: &str,
) -> Result<(axum::body::Bytes, BodyHold), Refusal> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut bytes = Vec::new();
    let mut hold = BodyHold {
        budget: Arc::clone(budget),
        owner: owner.to_string(),
        kib: 0,
    };
    let read = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                Refusal::invalid("body", format!("reading the request body failed: {e}"))
            })?;
            if let Ok(data) = frame.into_data() {
                if bytes.len() + data.len() > config.max_body_bytes {
                    return Ok(false);
                }
                hold.cover(bytes.len() + data.len())?;
                bytes.extend_from_slice(&data);
            }
        }
        Ok::<_, Refusal>(true)
    };
    match tokio::time::timeout(config.body_timeout, read).await {
        Ok(Ok(true)) => Ok((bytes.into(), hold)),
        Ok(Ok(false)) => {
            let mut drained = 0usize;
            let drain = async {
                while let Some(Ok(frame)) = body.frame().await {
                    drained += frame.data_ref().map_or(0, |d| d.len());
                    if drained > OVERFLOW_DRAIN_BYTES {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(OVERFLOW_DRAIN_TIME, drain).await;
            Err(Refusal::body_too_large(config.max_body_bytes))
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Refusal::body_timeout(config.body_timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(budget: &Arc<BodyBudget>, owner: &str, bytes: usize) -> Result<BodyHold, Refusal> {
        let mut h = BodyHold {
            budget: Arc::clone(budget),
            owner: owner.to_string(),
            kib: 0,
        };
        h.cover(bytes)?;
        Ok(h)
    }

    /// With two keys each holds at most half the budget: alice's bodies filling her half
    /// leave bob's whole, and hers come back when they are dropped. Without keys one owner
    /// holds it all.
    #[test]
    fn each_key_holds_at_most_its_share_of_the_body_budget() {
        let max_body = 4 << 20;
        let budget = Arc::new(BodyBudget::for_bodies_of(max_body, 2));
        let body = max_body - 1024;
        // 512 MiB at 8x: 16 bodies of 4 MiB in all, 8 per key.
        let alice: Vec<BodyHold> = (0..8)
            .map(|_| hold(&budget, "alice", body).unwrap())
            .collect();
        let e = hold(&budget, "alice", body)
            .err()
            .expect("alice's share is full");
        assert_eq!(e.limit.as_deref(), Some("body_memory"));
        assert!(e.message.contains("this key's"), "{}", e.message);
        let bob: Vec<BodyHold> = (0..8)
            .map(|_| hold(&budget, "bob", body).unwrap())
            .collect();
        let e = hold(&budget, "carol", body)
            .err()
            .expect("the whole budget is held");
        assert!(e.message.contains("the tracker's"), "{}", e.message);
        drop(alice);
        assert!(hold(&budget, "alice", body).is_ok(), "her share came back");
        drop(bob);
        assert!(budget.held.lock().unwrap().is_empty());
        assert_eq!(budget.kib.available_permits(), budget.total_kib);

        let open = Arc::new(BodyBudget::for_bodies_of(max_body, 0));
        let all: Vec<BodyHold> = (0..16).map(|_| hold(&open, "", body).unwrap()).collect();
        assert!(hold(&open, "", body).is_err());
        drop(all);
    }
}
