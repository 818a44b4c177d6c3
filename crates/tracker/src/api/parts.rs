//! One choice's answer as the parts the Responses and Messages APIs render (reasoning, text,
//! tool calls) and its end, read from the session's events. The request's record counts
//! the tokens and is finished here, whichever way the answer ends.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::Event as SseEvent;
use futures::stream::{self, Stream};

use engine::{FinishReason, Refusal};

use crate::api::answer::{Part, Splitter};
use crate::api::record::{Outcome, RequestRecord};
use crate::api::respond::{Accepted, Choice};
use crate::route::driver::{SessionEvent, TokenLogprob};

/// How an answer ended.
#[derive(Debug, Clone)]
pub struct Ended {
    /// `stop` or `length` as the session ended; `tool_calls` when it called tools and
    /// ended by itself.
    pub finish: FinishReason,
    pub stop_sequence: Option<String>,
    pub prompt_tokens: usize,
    /// Of the prompt tokens, those taken from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Of the completion tokens, those of the thinking section.
    pub reasoning_tokens: usize,
}

/// What the renderer gets next.
#[derive(Debug)]
pub enum Item {
    /// A part of the answer, with the logprob of the token that completed it when asked.
    Part(Part, Option<TokenLogprob>),
    Done(Ended),
    Failed(Refusal),
}

/// The single choice of an accepted request, as parts.
pub struct PartStream {
    choice: Choice,
    splitter: Splitter,
    record: RequestRecord,
    ready: VecDeque<Item>,
    n_calls: usize,
    reasoning_tokens: usize,
    ended: bool,
}

impl PartStream {
    /// The first choice of `a` (the Responses and Messages APIs have one).
    pub fn new(
        a: Accepted,
        record: RequestRecord,
    ) -> (
        PartStream,
        crate::api::request::ValidRequest,
        String,
        String,
    ) {
        let Accepted {
            req,
            model_id,
            id,
            choices,
            shape,
            ..
        } = a;
        let choice = choices
            .into_iter()
            .next()
            .expect("an accepted request has a choice");
        let s = PartStream {
            choice,
            splitter: Splitter::new(&shape),
            record,
            ready: VecDeque::new(),
            n_calls: 0,
            reasoning_tokens: 0,
            ended: false,
        };
        (s, req, model_id, id)
    }

    /// The prompt's tokens (known once the request was admitted).
    pub fn prompt_tokens(&self) -> usize {
        self.record.prompt_tokens
    }

    pub async fn next(&mut self) -> Option<Item> {
        loop {
            if let Some(i) = self.ready.pop_front() {
                return Some(i);
            }
            if self.ended {
                return None;
            }
            let ev = self.choice.next().await;
            self.on_event(ev);
        }
    }

    fn on_event(&mut self, ev: Option<SessionEvent>) {
        match ev {
            Some(SessionEvent::Token { text, logprob, .. }) => {
                self.record.token();
                let was_thinking = self.splitter.thinking();
                let mut lp = logprob;
                for p in self.splitter.push(&text) {
                    self.part(p, lp.take());
                }
                if was_thinking || self.splitter.thinking() {
                    self.reasoning_tokens += 1;
                }
            }
            Some(SessionEvent::Text(text)) => {
                for p in self.splitter.push(&text) {
                    self.part(p, None);
                }
            }
            Some(SessionEvent::Done {
                finish_reason,
                stop_sequence,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                self.choice.guard.armed = false;
                for p in self.splitter.finish() {
                    self.part(p, None);
                }
                let finish = finish_reason.with_calls(self.n_calls);
                self.record.finish(Outcome::Done {
                    finish_reason: finish,
                    completion_tokens,
                });
                self.ready.push_back(Item::Done(Ended {
                    finish,
                    stop_sequence,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    reasoning_tokens: self.reasoning_tokens,
                }));
                self.ended = true;
            }
            Some(SessionEvent::Error(e)) => self.fail(e),
            None => self.fail(Refusal::unavailable("the session ended without a result")),
        }
    }

    fn part(&mut self, p: Part, lp: Option<TokenLogprob>) {
        if matches!(p, Part::Call(_)) {
            self.n_calls += 1;
        }
        self.ready.push_back(Item::Part(p, lp));
    }

    fn fail(&mut self, e: Refusal) {
        self.choice.guard.armed = false;
        self.record.finish(Outcome::Failed(&e));
        self.ready.push_back(Item::Failed(e));
        self.ended = true;
    }
}

/// An API's rendering of one answer as server-sent events: the events each item gives, held
/// until they are sent.
pub trait Events: Send + 'static {
    fn on_item(&mut self, item: Option<Item>);
    /// Events ready to send, in order.
    fn ready(&mut self) -> &mut VecDeque<SseEvent>;
    /// Whether the answer is over (once what is ready is sent).
    fn finished(&self) -> bool;
}

/// The events of `render` as the parts of `parts` come.
pub fn events<E: Events>(
    parts: PartStream,
    render: E,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send {
    stream::unfold((parts, render), |(mut parts, mut r)| async move {
        loop {
            if let Some(e) = r.ready().pop_front() {
                return Some((Ok(e), (parts, r)));
            }
            if r.finished() {
                return None;
            }
            let item = parts.next().await;
            r.on_item(item);
        }
    })
}
