//! Answers to completion requests: one JSON body, or an SSE stream of chunks ending in
//! `data: [DONE]`, built from a session's events. The request's record is finished here, as
//! the answer ends.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::answer::{Part, Shape, Splitter};
use engine::{FinishReason, Refusal};

use crate::api::error::Answer;
use crate::api::record::{Outcome, RequestRecord};
use crate::api::request::{Endpoint, ValidRequest};
use crate::route::driver::{Command, SessionEvent, TokenLogprob};

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One choice of an accepted request: its session and what it sends.
pub struct Choice {
    pub events: mpsc::UnboundedReceiver<SessionEvent>,
    pub guard: CancelOnDrop,
    /// An event taken off `events` already (the first choice's first, awaited before the
    /// other choices are submitted), to be handled first.
    pub first: Option<SessionEvent>,
}

impl Choice {
    pub async fn next(&mut self) -> Option<SessionEvent> {
        match self.first.take() {
            Some(e) => Some(e),
            None => self.events.recv().await,
        }
    }
}

/// A request accepted by a route: what its response needs.
pub struct Accepted {
    pub req: ValidRequest,
    pub model_id: String,
    /// The response's id (the first choice's session).
    pub id: String,
    pub choices: Vec<Choice>,
    /// `echo`: the prompt's text, put before each choice's answer.
    pub echo: Option<String>,
    /// What the answer is split into (thinking, tool calls).
    pub shape: Shape,
}

/// Cancels the session when the response is dropped before it finished (client went away).
pub struct CancelOnDrop {
    id: engine::SessionId,
    commands: mpsc::Sender<Command>,
    pub armed: bool,
}

impl CancelOnDrop {
    pub fn new(id: engine::SessionId, commands: mpsc::Sender<Command>) -> Self {
        CancelOnDrop {
            id,
            commands,
            armed: true,
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.try_send(Command::Cancel(self.id));
        }
    }
}

fn logprob_json(endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat | Endpoint::Responses | Endpoint::Messages => json!({
            "content": lps.iter().map(|l| json!({
                "token": l.token,
                "logprob": l.logprob,
                "bytes": l.token.as_bytes(),
                "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()
        }),
        Endpoint::Completions => json!({
            "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        }),
    }
}

/// Usage as OpenAI reports it: the prompt tokens (those taken from the prefix cache among
/// them, `cached`), the completion tokens.
fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// How a choice ended.
struct Ended {
    finish: FinishReason,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
}

/// The id of a choice's `k`th tool call: unique across the tracker's responses.
fn call_id(response: &str, choice: usize, k: usize) -> String {
    format!("call_{response}_{choice}_{k}")
}

pub async fn whole_response(mut a: Accepted, mut record: RequestRecord) -> Response {
    let mut out = Vec::with_capacity(a.choices.len());
    let mut prompt_tokens = 0;
    let mut completion_tokens = 0;
    // The prompt's cached tokens: what every choice took from the cache (each choice is a
    // session of its own).
    let mut cached_tokens = usize::MAX;
    let mut first_finish = None;
    for (index, c) in a.choices.iter_mut().enumerate() {
        let mut text = a.echo.clone().unwrap_or_default();
        let mut lps = Vec::new();
        let mut ids = Vec::new();
        let ended = loop {
            match c.next().await {
                Some(SessionEvent::Token {
                    token,
                    text: t,
                    logprob,
                }) => {
                    record.token();
                    text.push_str(&t);
                    lps.extend(logprob);
                    ids.push(token);
                }
                Some(SessionEvent::Text(t)) => text.push_str(&t),
                Some(SessionEvent::Done {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    ..
                }) => {
                    break Ended {
                        finish: finish_reason,
                        prompt_tokens,
                        cached_tokens,
                        completion_tokens,
                    }
                }
                Some(SessionEvent::Error(e)) => {
                    c.guard.armed = false;
                    record.finish(Outcome::Failed(&e));
                    return e.into_response();
                }
                None => {
                    c.guard.armed = false;
                    let e = Refusal::unavailable("the session ended without a result");
                    record.finish(Outcome::Failed(&e));
                    return e.into_response();
                }
            }
        };
        c.guard.armed = false;
        prompt_tokens = ended.prompt_tokens;
        cached_tokens = cached_tokens.min(ended.cached_tokens);
        completion_tokens += ended.completion_tokens;
        let (choice, finish) = choice_json(
            (&a.req, &a.id, &a.shape),
            index,
            text,
            &lps,
            &ids,
            ended.finish,
        );
        first_finish.get_or_insert(finish);
        out.push(choice);
    }
    record.finish(Outcome::Done {
        finish_reason: first_finish.unwrap_or(FinishReason::Stop),
        completion_tokens,
    });
    let object = match a.req.endpoint {
        Endpoint::Completions => "text_completion",
        _ => "chat.completion",
    };
    let body = json!({
        "id": a.id, "object": object, "created": now_secs(), "model": a.model_id,
        "choices": out,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens.min(prompt_tokens)),
    });
    (StatusCode::OK, Json(body)).into_response()
}

/// One choice of a whole answer, and how it finished (a chat answer that called tools and
/// ended by itself: `tool_calls`).
fn choice_json(
    (req, id, shape): (&ValidRequest, &str, &Shape),
    index: usize,
    text: String,
    lps: &[TokenLogprob],
    ids: &[u32],
    finish: FinishReason,
) -> (Value, FinishReason) {
    let logprobs = req.logprobs.map(|_| logprob_json(req.endpoint, lps));
    let (mut choice, finish) = match req.endpoint {
        Endpoint::Completions => (
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish.name()}),
            finish,
        ),
        _ => {
            let answer = Splitter::split(shape, &text);
            let finish = finish.with_calls(answer.calls.len());
            let content = if answer.text.is_empty() && !answer.calls.is_empty() {
                Value::Null
            } else {
                json!(answer.text)
            };
            let mut message = json!({"role": "assistant", "content": content});
            if shape.thinking.is_some() {
                message["reasoning_content"] = json!(answer.reasoning);
            }
            if !answer.calls.is_empty() {
                message["tool_calls"] = answer
                    .calls
                    .iter()
                    .enumerate()
                    .map(|(k, call)| {
                        let mut v = call.json(&call_id(id, index, k), k);
                        v.as_object_mut().map(|o| o.remove("index"));
                        v
                    })
                    .collect();
            }
            (
                json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish.name()}),
                finish,
            )
        }
    };
    if req.return_token_ids {
        choice["token_ids"] = json!(ids);
    }
    (choice, finish)
}

/// A choice's stream of events, tagged with its index; the choice's guard is disarmed once
/// its session has ended (an answer dropped before that cancels it).
fn choice_events(index: usize, c: Choice) -> impl Stream<Item = (usize, SessionEvent)> + Send {
    stream::unfold(Some(c), move |c| async move {
        let mut c = c?;
        let ev = c.next().await;
        let ended = !matches!(ev, Some(SessionEvent::Token { .. } | SessionEvent::Text(_)));
        if ended {
            c.guard.armed = false;
        }
        let ev = ev.unwrap_or_else(|| {
            SessionEvent::Error(Refusal::unavailable("the session ended without a result"))
        });
        Some(((index, ev), (!ended).then_some(c)))
    })
}

/// One choice's streaming state.
struct ChoiceStream {
    /// The role was sent (chat: the first delta carries it).
    started: bool,
    /// The answer's splitter, when it has parts to split out (thinking, tool calls).
    splitter: Option<Splitter>,
    n_calls: usize,
    /// `echo`: the prompt's text, sent before the first token.
    echo: Option<String>,
}

/// Every choice's events, merged.
type ChoiceStreams =
    stream::SelectAll<std::pin::Pin<Box<dyn Stream<Item = (usize, SessionEvent)> + Send>>>;

struct StreamState {
    model_id: String,
    req: ValidRequest,
    id: String,
    events: ChoiceStreams,
    choices: Vec<ChoiceStream>,
    record: RequestRecord,
    running: usize,
    prompt_tokens: usize,
    /// What every choice ended so far took from the prefix cache.
    cached_tokens: usize,
    completion_tokens: usize,
    /// SSE data lines ready to send, in order.
    ready: std::collections::VecDeque<String>,
    finished: bool,
}

impl StreamState {
    fn envelope(&self, choices: Value) -> Value {
        let object = match self.req.endpoint {
            Endpoint::Completions => "text_completion",
            _ => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": now_secs(), "model": self.model_id, "choices": choices})
    }

    /// A chunk of choice `index`: a part of the answer, a logprob, a finish reason.
    fn chunk(
        &mut self,
        index: usize,
        part: Option<&Part>,
        lp: Option<&TokenLogprob>,
        finish: Option<&str>,
        token: Option<u32>,
    ) -> String {
        let logprobs = match (self.req.logprobs, lp) {
            (Some(_), Some(l)) => logprob_json(self.req.endpoint, std::slice::from_ref(l)),
            _ => Value::Null,
        };
        let mut choice = match self.req.endpoint {
            Endpoint::Completions => {
                let text = match part {
                    Some(Part::Text(t)) => t.as_str(),
                    _ => "",
                };
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            _ => {
                let mut delta = json!({});
                if !self.choices[index].started {
                    delta["role"] = json!("assistant");
                }
                match part {
                    Some(Part::Text(t)) => delta["content"] = json!(t),
                    Some(Part::Reasoning(t)) => delta["reasoning_content"] = json!(t),
                    Some(Part::Call(call)) => {
                        let k = self.choices[index].n_calls;
                        self.choices[index].n_calls += 1;
                        delta["tool_calls"] = json!([call.json(&call_id(&self.id, index, k), k)]);
                    }
                    None => {}
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        if let (true, Some(t)) = (self.req.return_token_ids, token) {
            choice["token_ids"] = json!([t]);
        }
        self.choices[index].started = true;
        self.envelope(json!([choice])).to_string()
    }

    /// Text of choice `index`, through its splitter when it has one (the token's logprob
    /// goes with the first part it gave).
    fn text(&mut self, index: usize, text: &str, lp: Option<&TokenLogprob>, token: Option<u32>) {
        let parts = match self.choices[index].splitter.as_mut() {
            None => vec![Part::Text(text.to_string())],
            Some(s) => s.push(text),
        };
        self.parts(index, parts, lp, token);
    }

    fn parts(
        &mut self,
        index: usize,
        parts: Vec<Part>,
        lp: Option<&TokenLogprob>,
        token: Option<u32>,
    ) {
        let mut lp = lp;
        for p in parts {
            let c = self.chunk(index, Some(&p), lp.take(), None, token);
            self.ready.push_back(c);
        }
    }

    fn on_event(&mut self, index: usize, ev: SessionEvent) {
        if let Some(e) = self.choices[index].echo.take() {
            let c = self.chunk(index, Some(&Part::Text(e)), None, None, None);
            self.ready.push_back(c);
        }
        match ev {
            SessionEvent::Token {
                token,
                text,
                logprob,
            } => {
                self.record.token();
                self.text(index, &text, logprob.as_ref(), Some(token));
            }
            SessionEvent::Text(text) => self.text(index, &text, None, None),
            SessionEvent::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                if let Some(mut s) = self.choices[index].splitter.take() {
                    let rest = s.finish();
                    self.parts(index, rest, None, None);
                }
                let finish = finish_reason.with_calls(self.choices[index].n_calls);
                let c = self.chunk(index, None, None, Some(finish.name()), None);
                self.ready.push_back(c);
                self.prompt_tokens = prompt_tokens;
                self.cached_tokens = self.cached_tokens.min(cached_tokens);
                self.completion_tokens += completion_tokens;
                self.running -= 1;
                if self.running == 0 {
                    if self.req.include_usage {
                        let mut u = self.envelope(json!([]));
                        u["usage"] = usage(
                            self.prompt_tokens,
                            self.completion_tokens,
                            self.cached_tokens.min(self.prompt_tokens),
                        );
                        self.ready.push_back(u.to_string());
                    }
                    self.record.finish(Outcome::Done {
                        finish_reason: finish,
                        completion_tokens: self.completion_tokens,
                    });
                    self.ready.push_back("[DONE]".to_string());
                    self.finished = true;
                }
            }
            SessionEvent::Error(e) => {
                self.record.finish(Outcome::Failed(&e));
                self.ready.push_back(e.body().to_string());
                self.finished = true;
            }
        }
    }
}

pub fn stream_response(
    a: Accepted,
    record: RequestRecord,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let splits = a.req.endpoint != Endpoint::Completions && a.shape.splits();
    let choices = (0..a.choices.len())
        .map(|_| ChoiceStream {
            started: false,
            splitter: splits.then(|| Splitter::new(&a.shape)),
            n_calls: 0,
            echo: a.echo.clone(),
        })
        .collect();
    let running = a.choices.len();
    let events = stream::select_all(a.choices.into_iter().enumerate().map(|(i, c)| {
        Box::pin(choice_events(i, c))
            as std::pin::Pin<Box<dyn Stream<Item = (usize, SessionEvent)> + Send>>
    }));
    let state = StreamState {
        model_id: a.model_id,
        req: a.req,
        id: a.id,
        events,
        choices,
        record,
        running,
        prompt_tokens: 0,
        cached_tokens: usize::MAX,
        completion_tokens: 0,
        ready: Default::default(),
        finished: false,
    };
    let body = stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.ready.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.finished {
                return None;
            }
            match st.events.next().await {
                Some((index, ev)) => st.on_event(index, ev),
                None => {
                    let e = Refusal::unavailable("the session ended without a result");
                    st.record.finish(Outcome::Failed(&e));
                    st.ready.push_back(e.body().to_string());
                    st.finished = true;
                }
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::default())
}
