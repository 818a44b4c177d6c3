//! A tracker's side of a `strata drafter` (`--drafter HOST:PORT`): the draft model in a
//! process of its own, maybe on a host of its own, seen by the routes as any other draft
//! source ([`DraftSource`]).
//!
//! One `Draft` stream carries every session's asks. A session's ask sends only its tokens past
//! what it sent before, so a long conversation costs each round only its new tokens. A route
//! polls without blocking: a draft that has arrived for the session's tokens is used at once;
//! otherwise an ask goes out (one at a time per session) and the route is woken when the draft
//! arrives. While the drafter is unreachable every session decodes without drafts, and the
//! stream is opened again in the background (the drafter's vocabulary checked again first).
//! While it answers nothing at all (frozen, or a network that drops everything) for [`STALL`],
//! no session waits for it: each decodes without drafts, one probe ask going out per `STALL`,
//! until a draft arrives again. A draft is cut at its first token outside the vocabulary and
//! at [`shard::MAX_DRAFT`] tokens: what a drafter sends never reaches a shard unchecked.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use engine::{DraftPoll, DraftSource, SessionId, Wake};
use proto::drafter_client::DrafterClient;
use proto::{Auth, DraftAsk, DraftOffer, Link, VocabRequest};
use text::Tokenizer;
use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

type Client = DrafterClient<InterceptedService<Channel, Auth>>;

/// The most a reconnection waits after the drafter was lost (the wait doubles from 250 ms).
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// An ask unanswered, and no draft at all arriving, for this long: the drafter is stalled, and
/// no session waits for it. An ask of one session unanswered this long is sent again (and not
/// waited for).
const STALL: Duration = Duration::from_secs(1);

/// A session the drafter answered `closed` (no room for it, past its context) asks again, from
/// its first token, after this long: room may have been made.
const CLOSED_RETRY: Duration = Duration::from_secs(5);

/// A drafter process, connected.
pub struct RemoteDraft {
    name: String,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Mutex<Shared>>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    /// Where asks go; `None` while the drafter is unreachable.
    asks: Option<mpsc::UnboundedSender<DraftAsk>>,
    sessions: HashMap<u64, Remote>,
    /// Token ids of the vocabulary are below this.
    n_vocab: usize,
    /// When the first ask since the last offer arrived went out: the drafter has answered
    /// nothing since (a session's end is answered too, so an ask it dropped does not count).
    quiet_since: Option<Instant>,
    /// When the last probe ask went out while the drafter was stalled.
    probed_at: Option<Instant>,
}

impl Shared {
    fn new(n_vocab: usize) -> Self {
        Shared {
            asks: None,
            sessions: HashMap::new(),
            n_vocab,
            quiet_since: None,
            probed_at: None,
        }
    }
}

/// An ask in flight.
struct Asked {
    /// Its number: only the offer carrying it back answers it.
    seq: u64,
    /// How many of the session's tokens it carried.
    len: usize,
    at: Instant,
}

/// What the tracker knows of one session's drafts.
#[derive(Default)]
struct Remote {
    /// How many of its tokens the drafter holds, and the last of them: tokens that do not
    /// continue them are sent again from the start.
    sent: usize,
    last: Option<u32>,
    /// The ask in flight, and whom to wake when its draft arrives.
    asked: Option<Asked>,
    /// The number of its next ask (numbers grow on, across a start over, so that a late
    /// offer of an ask before it never answers a later one).
    next_seq: u64,
    wake: Option<Wake>,
    /// The latest draft: how many tokens it follows, and the drafted tokens.
    offer: Option<(usize, Vec<u32>)>,
    /// When the drafter said it drafts no more for it: no ask goes out until its tokens start
    /// over or [`CLOSED_RETRY`] passed.
    closed: Option<Instant>,
}

impl Remote {
    /// Forgets all but the number of its next ask: its next ask sends every token again.
    fn start_over(&mut self) {
        *self = Remote {
            next_seq: self.next_seq,
            ..Remote::default()
        };
    }

    /// Up to `k` tokens of the latest draft that follow `tokens` (as the draft model's own
    /// [`crate::draft_model`] hands them out: the draft follows them, or the tokens past its
    /// base are its own first tokens).
    fn ready(&self, tokens: &[u32], k: usize) -> Option<Vec<u32>> {
        let (base, draft) = self.offer.as_ref()?;
        let past = tokens.len().checked_sub(*base)?;
        let fits = past == 0 || past < draft.len() && tokens[*base..] == draft[..past];
        fits.then(|| draft[past..(past + k).min(draft.len())].to_vec())
    }
}

impl RemoteDraft {
    /// Connects to the drafter at `address` and reads its vocabulary, trying for at most
    /// `wait`.
    pub async fn connect(address: &str, link: &Link, wait: Duration) -> Result<Self> {
        let client = client(address, link)?;
        let deadline = Instant::now() + wait;
        let tokenizer = loop {
            // Bounded by what is left of `wait`: a frozen drafter answers nothing.
            let left = deadline.saturating_duration_since(Instant::now());
            let answer = tokio::time::timeout(left, vocabulary(&client))
                .await
                .unwrap_or_else(|_| Err(anyhow!("no answer")));
            match answer {
                Ok(t) => break Arc::new(t),
                Err(e) if Instant::now() >= deadline => {
                    return Err(anyhow!(
                        "the drafter at {address} did not answer within {wait:?}: {e}"
                    ))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        let shared = Arc::new(Mutex::new(Shared::new(tokenizer.n_vocab())));
        let name = format!("the drafter at {address}");
        let task = tokio::spawn(keep_stream(
            client,
            Arc::clone(&tokenizer),
            name.clone(),
            Arc::clone(&shared),
        ));
        Ok(RemoteDraft {
            name,
            tokenizer,
            shared,
            task,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for RemoteDraft {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for RemoteDraft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteDraft({})", self.name)
    }
}

impl tracker::DraftModel for RemoteDraft {
    fn vocabulary_difference(&self, target: &Tokenizer) -> Option<String> {
        target.difference(&self.tokenizer)
    }

    fn name(&self) -> &str {
        &self.name
    }
}

impl DraftSource for RemoteDraft {
    fn poll(&self, session: SessionId, tokens: &[u32], k: usize, wake: &Wake) -> DraftPoll {
        let mut shared = self.lock();
        let shared = &mut *shared;
        let Some(asks) = shared.asks.clone() else {
            return DraftPoll::Ready(Vec::new());
        };
        if tokens.is_empty() || k == 0 {
            return DraftPoll::Ready(Vec::new());
        }
        let now = Instant::now();
        let s = shared.sessions.entry(session.0).or_default();
        let continues =
            s.sent <= tokens.len() && (s.sent == 0 || s.last == Some(tokens[s.sent - 1]));
        if !continues {
            // Other tokens than the drafter holds (a session replayed elsewhere): start over.
            s.start_over();
        }
        match s.closed {
            Some(t) if now.duration_since(t) <= CLOSED_RETRY => {
                return DraftPoll::Ready(Vec::new());
            }
            // Asked again from the start: the drafter holds none of its tokens.
            Some(_) => s.start_over(),
            None => {}
        }
        if let Some(draft) = s.ready(tokens, k) {
            return DraftPoll::Ready(draft);
        }
        let stalled = shared
            .quiet_since
            .is_some_and(|t| now.duration_since(t) > STALL);
        // While the drafter answers nothing, one ask per `STALL` still goes out (to learn it is
        // back), and no session waits for it.
        let probe = stalled
            && shared
                .probed_at
                .is_none_or(|t| now.duration_since(t) > STALL);
        if stalled && !probe {
            return DraftPoll::Ready(Vec::new());
        }
        // An ask sent again after `STALL` unanswered is not waited for: the drafter is busy
        // (reading a long prompt, say) or lost it.
        let again = s.asked.is_some();
        if let Some(a) = &s.asked {
            if !probe && now.duration_since(a.at) <= STALL {
                if a.len == tokens.len() {
                    s.wake = Some(Arc::clone(wake));
                    return DraftPoll::Pending;
                }
                // The route stopped waiting for the last draft and went on: no new ask until
                // it is answered (or `STALL` passes), so each token waits for it once.
                return DraftPoll::Ready(Vec::new());
            }
        }
        let ask = DraftAsk {
            session: session.0,
            from: s.sent as u64,
            tokens: tokens[s.sent..].to_vec(),
            k: k as u32,
            forget: false,
            seq: s.next_seq,
        };
        if asks.send(ask).is_err() {
            return DraftPoll::Ready(Vec::new());
        }
        s.sent = tokens.len();
        s.last = tokens.last().copied();
        s.next_seq += 1;
        s.asked = Some(Asked {
            seq: s.next_seq - 1,
            len: tokens.len(),
            at: now,
        });
        shared.quiet_since.get_or_insert(now);
        if probe {
            shared.probed_at = Some(now);
        }
        if probe || again {
            s.wake = None;
            return DraftPoll::Ready(Vec::new());
        }
        s.wake = Some(Arc::clone(wake));
        DraftPoll::Pending
    }

    fn forget(&self, session: SessionId) {
        let mut shared = self.lock();
        if shared.sessions.remove(&session.0).is_none() {
            return;
        }
        if let Some(asks) = &shared.asks {
            let _ = asks.send(DraftAsk {
                session: session.0,
                forget: true,
                ..DraftAsk::default()
            });
        }
    }
}

fn client(address: &str, link: &Link) -> Result<Client> {
    let channel =
        proto::channel(address, link, "drafter").map_err(|e| anyhow!("{}", e.message()))?;
    let auth = Auth::new(&link.token).map_err(|e| anyhow!("{}", e.message()))?;
    Ok(DrafterClient::with_interceptor(channel, auth)
        .max_decoding_message_size(proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(proto::MAX_MESSAGE_BYTES))
}

async fn vocabulary(client: &Client) -> Result<Tokenizer> {
    let mut req = tonic::Request::new(VocabRequest {});
    req.set_timeout(Duration::from_secs(10));
    let reply = client.clone().vocab(req).await?.into_inner();
    let file = gguf::GgufFile::from_bytes(reply.gguf)?;
    Ok(Tokenizer::from_header(file.header())?)
}

/// Keeps the `Draft` stream open: opens it, delivers each draft to its session, and when the
/// drafter is lost, lets every session decode without drafts (waking those that wait) and opens
/// it again, with backoff, once the drafter answers with the same vocabulary.
async fn keep_stream(
    client: Client,
    tokenizer: Arc<Tokenizer>,
    name: String,
    shared: Arc<Mutex<Shared>>,
) {
    let mut backoff = Duration::from_millis(250);
    let mut first = true;
    loop {
        if !first {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            match vocabulary(&client).await {
                Ok(t) => {
                    if let Some(why) = tokenizer.difference(&t) {
                        tracing::error!(drafter = %name, "the drafter now serves another vocabulary ({why}): sessions decode without drafts");
                        continue;
                    }
                }
                Err(_) => continue,
            }
        }
        first = false;
        let (tx, rx) = mpsc::unbounded_channel();
        let opened = client
            .clone()
            .draft(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await;
        let mut offers = match opened {
            Ok(r) => r.into_inner(),
            Err(e) => {
                tracing::warn!(drafter = %name, "opening the draft stream failed: {e}");
                continue;
            }
        };
        lock(&shared).asks = Some(tx);
        let opened_at = Instant::now();
        let why = loop {
            match offers.message().await {
                Ok(Some(offer)) => deliver(&shared, offer),
                Ok(None) => break "the stream ended".to_string(),
                Err(e) => break e.to_string(),
            }
        };
        tracing::warn!(drafter = %name, "lost the drafter ({why}): sessions decode without drafts until it is back");
        let wakes: Vec<Wake> = {
            let mut shared = lock(&shared);
            shared.asks = None;
            shared.quiet_since = None;
            shared.probed_at = None;
            shared
                .sessions
                .drain()
                .filter_map(|(_, s)| s.asked.and(s.wake))
                .collect()
        };
        for wake in wakes {
            wake();
        }
        if opened_at.elapsed() > Duration::from_secs(60) {
            backoff = Duration::from_millis(250);
        }
    }
}

/// A draft arrived: kept for its session (cut at its first token outside the vocabulary and at
/// [`shard::MAX_DRAFT`] tokens), whose route is woken if it waits for it.
fn deliver(shared: &Mutex<Shared>, offer: DraftOffer) {
    let wake = {
        let mut shared = lock(shared);
        let shared = &mut *shared;
        // Any draft shows the drafter is alive.
        shared.quiet_since = None;
        let n_vocab = shared.n_vocab;
        let Some(s) = shared.sessions.get_mut(&offer.session) else {
            return;
        };
        let len = usize::try_from(offer.len).unwrap_or(usize::MAX);
        if len > s.sent {
            return;
        }
        let mut draft = offer.draft;
        draft.truncate(shard::MAX_DRAFT);
        if let Some(i) = draft.iter().position(|&t| t as usize >= n_vocab) {
            draft.truncate(i);
        }
        s.offer = Some((len, draft));
        // One ask is in flight at a time: this answers it (the route may have stopped
        // waiting for it; it asks again when it plans the session next).
        if s.asked.as_ref().is_none_or(|a| a.seq != offer.seq) {
            return;
        }
        s.asked = None;
        if offer.closed {
            s.closed = Some(Instant::now());
        }
        s.wake.take()
    };
    if let Some(wake) = wake {
        wake();
    }
}
