//! `strata drafter`: a draft model in a process of its own, drafting for the speculating
//! sessions of the trackers that connect to it (`strata tracker --drafter HOST:PORT`).
//!
//! Each tracker opens one `Draft` stream. It sends an ask when a session needs a draft: the
//! session's tokens past what it sent before, and how many tokens to draft. The drafter runs
//! the same [`DraftModel`] a tracker runs in its own process with `--draft-model` (its thread,
//! its KV of every session, its greedy continuation), and sends each draft back when it is
//! ready, in whatever order they finish. A session it cannot draft for (no room, past the
//! draft model's context) is answered `closed`, and its tracker stops asking for a while. A
//! draft only proposes: the routes verify every token, so nothing the drafter sends changes
//! what a client receives, only how many tokens a trip yields. What a stream holds goes when it closes; on SIGTERM or SIGINT every stream is ended
//! (the trackers go on without drafts) and the process exits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use engine::{DraftPoll, DraftSource, SessionId, Wake};
use futures::Stream;
use proto::drafter_server::{Drafter, DrafterServer};
use proto::{DraftAsk, DraftOffer, TokenCheck, VocabReply, VocabRequest};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use crate::cluster_cmd::{listen_addr, loopback, read_file, read_token, runtime, shutdown_signal};
use crate::draft_model::DraftModel;

#[derive(Args)]
pub struct DrafterArgs {
    /// Path of the GGUF draft model, or a known model name (fetched and cached:
    /// qwen2.5-coder-0.5b drafts for qwen2.5-coder-1.5b).
    #[arg(long, value_parser = crate::models::model_path)]
    model: PathBuf,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:0", value_parser = listen_addr)]
    listen: String,
    /// File holding the shared cluster token (at least 16 characters) every connection must
    /// present: the trackers' own.
    #[arg(long)]
    cluster_token_file: PathBuf,
    /// This drafter's TLS certificate chain (PEM): with `--tls-key`, it serves TLS only.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Kernel threads of the draft model.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// MiB of draft KV for every session together (when it is full, the draft KV of the
    /// sessions that drafted least recently goes; they read their tokens again when they
    /// draft next, decoding without drafts meanwhile).
    #[arg(long, default_value_t = 256)]
    kv_mib: usize,
    /// Tokens drafted past each draft sent, while the route verifies it (0 to 16): when the
    /// route keeps the whole draft, the next one is ready at once. Worth it where the drafter
    /// has cores of its own.
    #[arg(long, default_value_t = 0)]
    ahead: usize,
    /// Sessions this drafter holds at once, over every tracker's stream (each holds up to the
    /// draft model's context of tokens, 4 bytes each); a session past them gets no drafts (it
    /// decodes without).
    #[arg(long, default_value_t = 1024)]
    max_sessions: usize,
}

pub fn drafter(a: DrafterArgs) -> Result<()> {
    if a.threads == 0 || a.kv_mib == 0 || a.max_sessions == 0 {
        bail!("`--threads`, `--kv-mib` and `--max-sessions` must be at least 1");
    }
    if a.ahead > shard::MAX_DRAFT {
        bail!(
            "`--ahead` must be 0 to {}, got {}",
            shard::MAX_DRAFT,
            a.ahead
        );
    }
    let token = read_token(&a.cluster_token_file)?;
    let identity = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some(tonic::transport::Identity::from_pem(
            read_file(c, "the drafter certificate")?,
            read_file(k, "the drafter key")?,
        )),
        _ => None,
    };
    let vocab = {
        let file = gguf::GgufFile::open(&a.model)
            .with_context(|| format!("opening {}", a.model.display()))?;
        shard::vocab_file(&file)
    };
    let model = DraftModel::load(&a.model, a.threads, a.kv_mib << 20, usize::MAX, a.ahead)?;
    let limits = Limits {
        n_vocab: model.n_vocab(),
        n_ctx: model.n_ctx(),
    };
    let (stop_tx, stop) = watch::channel(false);
    let model = Arc::new(model);
    let service = DrafterService {
        model: Arc::clone(&model),
        vocab,
        limits,
        places: Arc::new(Places {
            held: AtomicUsize::new(0),
            max: a.max_sessions,
        }),
        stop: stop.clone(),
    };
    let rt = runtime(1)?;
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let local = listener.local_addr()?;
        if identity.is_none() && !loopback(&local) {
            eprintln!(
                "strata drafter: warning: listening on {local} without TLS: the cluster token and every session's tokens cross the network in clear (give --tls-cert and --tls-key)"
            );
        }
        let server = DrafterServer::new(service)
            .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(proto::MAX_MESSAGE_BYTES);
        let svc =
            tonic::service::interceptor::InterceptedService::new(server, TokenCheck::new(&token));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let mut builder = tonic::transport::Server::builder();
        if let Some(id) = identity {
            builder = builder.tls_config(tonic::transport::ServerTlsConfig::new().identity(id))?;
        }
        {
            use std::io::Write;
            println!("strata drafter listening on {local}");
            std::io::stdout().flush()?;
        }
        // On the signal every stream ends (the trackers go on without drafts), then the server
        // stops; it waits for nothing else longer than `STOP_GRACE`.
        let serve = builder
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(Duration::from_secs(2)))
            .http2_keepalive_timeout(Some(Duration::from_secs(5)))
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                shutdown_signal().await;
                let _ = stop_tx.send(true);
            });
        let mut stopped = stop;
        tokio::select! {
            r = serve => r?,
            _ = async {
                let _ = stopped.wait_for(|&s| s).await;
                tokio::time::sleep(STOP_GRACE).await;
            } => {}
        }
        Ok(())
    });
    // The draft thread may be reading a long prompt: the process ends without waiting for it
    // (the last handle on the model, dropped, would join the thread).
    std::mem::forget(model);
    served
}

/// How long a drafter told to stop waits for its connections to close.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The sessions the drafter holds, over every stream.
struct Places {
    held: AtomicUsize,
    max: usize,
}

impl Places {
    fn take(&self) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok()
    }

    fn give_back(&self) {
        self.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a stream's asks may hold.
#[derive(Clone, Copy)]
struct Limits {
    /// Token ids are below this.
    n_vocab: usize,
    /// Most tokens of one session: past them the session gets no drafts.
    n_ctx: usize,
}

struct DrafterService {
    model: Arc<DraftModel>,
    vocab: Vec<u8>,
    limits: Limits,
    places: Arc<Places>,
    /// Becomes true when the process is told to stop.
    stop: watch::Receiver<bool>,
}

type OfferStream = Pin<Box<dyn Stream<Item = Result<DraftOffer, Status>> + Send>>;

#[tonic::async_trait]
impl Drafter for DrafterService {
    async fn vocab(&self, _: Request<VocabRequest>) -> Result<Response<VocabReply>, Status> {
        Ok(Response::new(VocabReply {
            gguf: self.vocab.clone(),
        }))
    }

    type DraftStream = OfferStream;

    async fn draft(
        &self,
        req: Request<Streaming<DraftAsk>>,
    ) -> Result<Response<OfferStream>, Status> {
        let (tx, rx) = mpsc::channel(64);
        let stream = TrackerStream {
            model: Arc::clone(&self.model) as Arc<dyn DraftSource>,
            limits: self.limits,
            places: Arc::clone(&self.places),
            sessions: HashMap::new(),
        };
        tokio::spawn(stream.run(req.into_inner(), tx, self.stop.clone()));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Ids of the draft model's sessions, unique in this process (every stream's sessions share
/// the model).
fn new_session_id() -> SessionId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    SessionId(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One tracker's stream.
struct TrackerStream {
    model: Arc<dyn DraftSource>,
    limits: Limits,
    places: Arc<Places>,
    /// By the tracker's session id; each holds one of `places`.
    sessions: HashMap<u64, Session>,
}

/// One of the tracker's sessions, as its asks told it.
struct Session {
    /// The draft model's id of it.
    id: SessionId,
    /// Its known tokens.
    tokens: Vec<u32>,
    k: usize,
    /// An ask not answered yet (the draft model is computing it), and the number of the
    /// latest ask, which its offer carries back.
    waiting: bool,
    seq: u64,
    wake: Wake,
}

impl TrackerStream {
    async fn run(
        mut self,
        mut asks: Streaming<DraftAsk>,
        out: mpsc::Sender<Result<DraftOffer, Status>>,
        mut stop: watch::Receiver<bool>,
    ) {
        let (woke_tx, mut woke) = mpsc::unbounded_channel::<u64>();
        loop {
            let offer = tokio::select! {
                // The process is stopping: the stream ends, and the tracker goes on without.
                _ = async { drop(stop.wait_for(|&s| s).await) } => break,
                ask = asks.message() => match ask {
                    Ok(Some(ask)) => match self.ask(ask, &woke_tx) {
                        Ok(offer) => offer,
                        Err(status) => {
                            let _ = out.send(Err(status)).await;
                            break;
                        }
                    },
                    // The tracker closed its side or went away.
                    _ => break,
                },
                Some(session) = woke.recv() => self.poll(session),
                _ = out.closed() => break,
            };
            if let Some(offer) = offer {
                if out.send(Ok(offer)).await.is_err() {
                    break;
                }
            }
        }
        for (_, s) in self.sessions.drain() {
            self.model.forget(s.id);
            self.places.give_back();
        }
    }

    /// The session goes, with its place.
    fn remove(&mut self, session: u64) {
        if let Some(s) = self.sessions.remove(&session) {
            self.model.forget(s.id);
            self.places.give_back();
        }
    }

    /// Takes one ask; a draft ready at once is the offer to send.
    fn ask(
        &mut self,
        ask: DraftAsk,
        woke: &mpsc::UnboundedSender<u64>,
    ) -> Result<Option<DraftOffer>, Status> {
        if ask.forget {
            self.remove(ask.session);
            return Ok(Some(DraftOffer {
                session: ask.session,
                closed: true,
                ..DraftOffer::default()
            }));
        }
        if ask.k == 0 || ask.k as usize > shard::MAX_DRAFT {
            return Err(Status::invalid_argument(format!(
                "session {}: k must be 1 to {}, got {}",
                ask.session,
                shard::MAX_DRAFT,
                ask.k
            )));
        }
        if let Some(t) = ask
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.limits.n_vocab)
        {
            return Err(Status::invalid_argument(format!(
                "session {}: token {t} is not in the draft model's vocabulary of {}",
                ask.session, self.limits.n_vocab
            )));
        }
        let from = usize::try_from(ask.from).unwrap_or(usize::MAX);
        let len = from.saturating_add(ask.tokens.len());
        // No drafts for it, and the tracker asks no more: a session this stream does not hold
        // past its first ask (it had no room, or outgrew the context), one without room now,
        // one past the draft model's context.
        let closed = Some(DraftOffer {
            session: ask.session,
            len: len as u64,
            draft: Vec::new(),
            closed: true,
            seq: ask.seq,
        });
        if !self.sessions.contains_key(&ask.session) {
            if from != 0 || !self.places.take() {
                return Ok(closed);
            }
            let session = ask.session;
            let woke = woke.clone();
            self.sessions.insert(
                ask.session,
                Session {
                    id: new_session_id(),
                    tokens: Vec::new(),
                    k: 1,
                    waiting: false,
                    seq: 0,
                    wake: Arc::new(move || {
                        let _ = woke.send(session);
                    }),
                },
            );
        }
        let s = self.sessions.get_mut(&ask.session).expect("inserted above");
        if from > s.tokens.len() {
            return Err(Status::invalid_argument(format!(
                "session {}: an ask starts at token {from}, past the {} held",
                ask.session,
                s.tokens.len()
            )));
        }
        if len > self.limits.n_ctx {
            self.remove(ask.session);
            return Ok(closed);
        }
        s.tokens.truncate(from);
        s.tokens.extend_from_slice(&ask.tokens);
        s.k = ask.k as usize;
        s.waiting = true;
        s.seq = ask.seq;
        Ok(self.poll(ask.session))
    }

    /// Asks the draft model for a waiting session's draft: the offer when it is ready.
    fn poll(&mut self, session: u64) -> Option<DraftOffer> {
        let s = self.sessions.get_mut(&session)?;
        if !s.waiting {
            return None;
        }
        let draft = match self.model.poll(s.id, &s.tokens, s.k, &s.wake) {
            DraftPoll::Ready(draft) => draft,
            DraftPoll::Pending => return None,
        };
        s.waiting = false;
        Some(DraftOffer {
            session,
            len: s.tokens.len() as u64,
            draft,
            closed: false,
            seq: s.seq,
        })
    }
}
