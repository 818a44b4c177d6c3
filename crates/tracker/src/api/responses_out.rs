//! Answers of the Responses API: the response object (output items: `reasoning`,
//! `message` with `output_text`, `function_call`), or its event stream in the documented
//! order (`response.created`, `response.in_progress`, per item `response.output_item.added`,
//! its deltas, its `.done` events and `response.output_item.done`, then
//! `response.completed`, `response.incomplete` when the output was cut at its length, or
//! `response.failed`). A stored response keeps its conversation for `previous_response_id`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::{FinishReason, Refusal};
use futures::stream::Stream;
use serde_json::{json, Value};
use text::ChatMessage;

use super::answer::{Part, ToolCall};
use super::error::Answer;
use super::parts::{events, Ended, Events, Item, PartStream};
use super::record::RequestRecord;
use super::respond::Accepted;
use super::state::AppState;
use super::store::Stored;
use crate::route::driver::TokenLogprob;

/// What a response needs beside its answer: who asked (the store's key), the conversation to
/// store after it, and the request fields it echoes.
pub struct Turn {
    pub key: String,
    /// The conversation before the answer (without the instructions), when it is stored.
    pub conversation: Option<Vec<ChatMessage>>,
    pub echo: serde_json::Map<String, Value>,
    pub store: bool,
}

/// One output item as it is built.
#[derive(Debug, Clone)]
enum Output {
    Reasoning(String),
    Message(String, Vec<TokenLogprob>),
    Call(ToolCall),
}

/// The answer so far, and how to name its items.
struct Build {
    id: String,
    model: String,
    created: u64,
    turn: Turn,
    items: Vec<Output>,
    /// The Responses `namespace` of each tool that came in one.
    namespaces: Vec<(String, String)>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn logprobs_json(lps: &[TokenLogprob]) -> Value {
    lps.iter()
        .map(|l| {
            json!({
                "token": l.token, "logprob": l.logprob, "bytes": l.token.as_bytes(),
                "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
            })
        })
        .collect()
}

impl Build {
    fn new(id: String, model: String, turn: Turn, req: &super::request::ValidRequest) -> Self {
        let namespaces = req
            .tools
            .as_ref()
            .map(|t| {
                t.tools
                    .iter()
                    .filter_map(|x| {
                        t.namespace_of(&x.name)
                            .map(|n| (x.name.clone(), n.to_string()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        Build {
            id,
            model,
            created: now_secs(),
            turn,
            items: Vec::new(),
            namespaces,
        }
    }

    /// The number in this response's id, for its items' ids.
    fn n(&self) -> &str {
        self.id.trim_start_matches("resp_")
    }

    fn item_id(&self, k: usize) -> String {
        match &self.items[k] {
            Output::Reasoning(_) => format!("rs_{}_{k}", self.n()),
            Output::Message(..) => format!("msg_{}_{k}", self.n()),
            Output::Call(_) => format!("fc_{}_{k}", self.n()),
        }
    }

    fn call_id(&self, k: usize) -> String {
        format!("call_{}_{k}", self.n())
    }

    /// Item `k` as it stands (`done`: complete).
    fn item_json(&self, k: usize, done: bool) -> Value {
        let id = self.item_id(k);
        let status = if done { "completed" } else { "in_progress" };
        match &self.items[k] {
            Output::Reasoning(t) => {
                let content = if done {
                    json!([{"type": "reasoning_text", "text": t}])
                } else {
                    json!([])
                };
                json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
            }
            Output::Message(t, lps) => {
                let content = if done {
                    json!([self.text_part(t, lps)])
                } else {
                    json!([])
                };
                json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
            }
            Output::Call(c) => {
                let mut v = json!({
                    "type": "function_call", "id": id, "call_id": self.call_id(k), "name": c.name,
                    "arguments": if done { c.arguments.as_str() } else { "" }, "status": status,
                });
                if let Some((_, ns)) = self.namespaces.iter().find(|(n, _)| *n == c.name) {
                    v["namespace"] = json!(ns);
                }
                v
            }
        }
    }

    fn text_part(&self, t: &str, lps: &[TokenLogprob]) -> Value {
        json!({"type": "output_text", "text": t, "annotations": [], "logprobs": logprobs_json(lps)})
    }

    /// The response object: `status` and, once ended, its usage and why it is incomplete.
    fn response(&self, status: &str, ended: Option<&Ended>, error: Option<&Refusal>) -> Value {
        let output: Vec<Value> = (0..self.items.len())
            .map(|k| self.item_json(k, ended.is_some()))
            .collect();
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": Value::Null,
            "incomplete_details": Value::Null, "store": self.turn.store,
            "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
            "instructions": Value::Null, "metadata": {}, "temperature": 1.0, "top_p": 1.0,
            "max_output_tokens": Value::Null, "previous_response_id": Value::Null,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": Value::Null,
        });
        for (k, v) in &self.turn.echo {
            r[k] = v.clone();
        }
        if let Some(e) = ended {
            let reasoning_tokens = e.reasoning_tokens;
            r["usage"] = json!({
                "input_tokens": e.prompt_tokens, "input_tokens_details": {"cached_tokens": e.cached_tokens},
                "output_tokens": e.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": e.prompt_tokens + e.completion_tokens,
            });
            if e.finish == FinishReason::Length {
                r["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
        }
        if let Some(e) = error {
            r["error"] = json!({"code": e.reason.name(), "message": e.message});
        }
        r
    }

    /// The assistant's turn as a chat message, for the store.
    fn as_message(&self) -> ChatMessage {
        let mut m = ChatMessage::new("assistant", "");
        let mut calls = Vec::new();
        for (k, it) in self.items.iter().enumerate() {
            match it {
                Output::Reasoning(t) => m.reasoning_content = Some(t.clone()),
                Output::Message(t, _) => m.content.push_str(t),
                Output::Call(c) => {
                    let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
                    calls.push(json!({"id": self.call_id(k), "type": "function", "function": {"name": c.name, "arguments": arguments}}));
                }
            }
        }
        if !calls.is_empty() {
            m.tool_calls = Some(Value::Array(calls));
        }
        m
    }

    /// Stores the response and its conversation when the request asked to. One larger than
    /// its key's share of the store is not kept, and says so: its `store` is false.
    fn store(&mut self, s: &AppState, response: &mut Value) {
        let Some(mut conversation) = self.turn.conversation.take() else {
            return;
        };
        conversation.push(self.as_message());
        let kept = s.stored_responses.put(
            &self.turn.key,
            &self.id,
            Stored {
                conversation: Arc::new(conversation),
                response: response.to_string(),
            },
        );
        if !kept {
            response["store"] = json!(false);
        }
    }

    /// Adds `part` to the items: text and reasoning extend the last item of their kind when
    /// it is the last item; a call is an item of its own.
    fn add(&mut self, part: Part, lp: Option<TokenLogprob>) -> (usize, bool) {
        let last = self.items.len().checked_sub(1);
        match (part, last.map(|k| &mut self.items[k])) {
            (Part::Reasoning(t), Some(Output::Reasoning(r))) => {
                r.push_str(&t);
                (self.items.len() - 1, false)
            }
            (Part::Text(t), Some(Output::Message(m, lps))) => {
                m.push_str(&t);
                lps.extend(lp);
                (self.items.len() - 1, false)
            }
            (Part::Reasoning(t), _) => {
                self.items.push(Output::Reasoning(t));
                (self.items.len() - 1, true)
            }
            (Part::Text(t), _) => {
                self.items
                    .push(Output::Message(t, lp.into_iter().collect()));
                (self.items.len() - 1, true)
            }
            (Part::Call(c), _) => {
                self.items.push(Output::Call(c));
                (self.items.len() - 1, true)
            }
        }
    }
}

fn status_of(e: &Ended) -> &'static str {
    if e.finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

pub async fn whole_response(
    a: Accepted,
    record: RequestRecord,
    turn: Turn,
    s: &AppState,
) -> Response {
    let (mut parts, req, model, id) = PartStream::new(a, record);
    let mut b = Build::new(id, model, turn, &req);
    loop {
        match parts.next().await {
            Some(Item::Part(p, lp)) => {
                b.add(p, lp);
            }
            Some(Item::Done(e)) => {
                let mut r = b.response(status_of(&e), Some(&e), None);
                b.store(s, &mut r);
                return axum::Json(r).into_response();
            }
            Some(Item::Failed(e)) => return e.into_response(),
            None => {
                return Refusal::unavailable("the session ended without a result").into_response()
            }
        }
    }
}

/// The stream's state: the answer so far and the events ready to send.
struct StreamState {
    b: Build,
    s: Arc<AppState>,
    seq: u64,
    /// The item whose deltas are being sent, if it is still open.
    open: Option<usize>,
    ready: std::collections::VecDeque<SseEvent>,
    finished: bool,
}

impl StreamState {
    fn event(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.ready
            .push_back(SseEvent::default().event(kind).data(data.to_string()));
    }

    /// Ends the open item: its `.done` events and `response.output_item.done`.
    fn close(&mut self) {
        let Some(k) = self.open.take() else {
            return;
        };
        let id = self.b.item_id(k);
        let item = self.b.item_json(k, true);
        match self.b.items[k].clone() {
            Output::Reasoning(t) => {
                self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": k, "content_index": 0, "text": t}),
                );
            }
            Output::Message(t, lps) => {
                self.event("response.output_text.done", json!({"item_id": id, "output_index": k, "content_index": 0, "text": t, "logprobs": logprobs_json(&lps)}));
                let part = self.b.text_part(&t, &lps);
                self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": k, "content_index": 0, "part": part}),
                );
            }
            Output::Call(c) => {
                self.event("response.function_call_arguments.done", json!({"item_id": id, "output_index": k, "name": c.name, "arguments": c.arguments}));
            }
        }
        self.event(
            "response.output_item.done",
            json!({"output_index": k, "item": item}),
        );
    }

    fn on_part(&mut self, p: Part, lp: Option<TokenLogprob>) {
        let delta = match &p {
            Part::Reasoning(t) | Part::Text(t) => t.clone(),
            Part::Call(c) => c.arguments.clone(),
        };
        let delta_lps = lp.iter().cloned().collect::<Vec<_>>();
        let last = self.b.items.len();
        let (k, new) = self.b.add(p, lp);
        if new {
            if last > 0 {
                self.close();
            }
            let item = self.b.item_json(k, false);
            self.event(
                "response.output_item.added",
                json!({"output_index": k, "item": item}),
            );
            if let Output::Message(..) = self.b.items[k] {
                let part = self.b.text_part("", &[]);
                let id = self.b.item_id(k);
                self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": k, "content_index": 0, "part": part}),
                );
            }
            self.open = Some(k);
        }
        let id = self.b.item_id(k);
        match &self.b.items[k] {
            Output::Reasoning(_) => self.event("response.reasoning_text.delta", json!({"item_id": id, "output_index": k, "content_index": 0, "delta": delta})),
            Output::Message(..) => self.event("response.output_text.delta", json!({"item_id": id, "output_index": k, "content_index": 0, "delta": delta, "logprobs": logprobs_json(&delta_lps)})),
            Output::Call(_) => {
                self.event("response.function_call_arguments.delta", json!({"item_id": id, "output_index": k, "delta": delta}));
                // A call arrives whole: it is done as soon as it is added.
                self.close();
            }
        }
    }

    fn handle(&mut self, item: Option<Item>) {
        match item {
            Some(Item::Part(p, lp)) => self.on_part(p, lp),
            Some(Item::Done(e)) => {
                self.close();
                let status = status_of(&e);
                let mut r = self.b.response(status, Some(&e), None);
                let s = Arc::clone(&self.s);
                self.b.store(&s, &mut r);
                let kind = if status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                self.event(kind, json!({"response": r}));
                self.finished = true;
            }
            Some(Item::Failed(e)) => self.fail(e),
            None => self.fail(Refusal::unavailable("the session ended without a result")),
        }
    }

    fn fail(&mut self, e: Refusal) {
        let r = self.b.response("failed", None, Some(&e));
        self.event("response.failed", json!({"response": r}));
        self.finished = true;
    }
}

pub fn stream_response(
    a: Accepted,
    record: RequestRecord,
    turn: Turn,
    s: Arc<AppState>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (parts, req, model, id) = PartStream::new(a, record);
    let b = Build::new(id, model, turn, &req);
    let mut st = StreamState {
        b,
        s,
        seq: 0,
        open: None,
        ready: Default::default(),
        finished: false,
    };
    let r = st.b.response("in_progress", None, None);
    st.event("response.created", json!({"response": r.clone()}));
    st.event("response.in_progress", json!({"response": r}));
    let body = events(parts, st);
    Sse::new(body).keep_alive(KeepAlive::default())
}

impl Events for StreamState {
    fn on_item(&mut self, item: Option<Item>) {
        self.handle(item);
    }

    fn ready(&mut self) -> &mut std::collections::VecDeque<SseEvent> {
        &mut self.ready
    }

    fn finished(&self) -> bool {
        self.finished
    }
}
