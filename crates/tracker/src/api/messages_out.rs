//! Answers of the Messages API: the message object (content blocks `thinking`, `text`,
//! `tool_use`; `stop_reason` `end_turn`, `max_tokens`, `stop_sequence` or `tool_use`), or
//! Anthropic's event stream: `message_start`, `ping`, per block `content_block_start`, its
//! deltas (`thinking_delta` and `signature_delta`, `text_delta`, `input_json_delta`) and
//! `content_block_stop`, then `message_delta` with the stop reason and `message_stop`; a
//! failure mid-stream is an `error` event.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::{FinishReason, Refusal};
use futures::stream::Stream;
use serde_json::{json, Value};

use super::answer::Part;
use super::error::{anthropic, anthropic_body};
use super::parts::{events, Ended, Events, Item, PartStream};
use super::record::RequestRecord;
use super::respond::Accepted;

/// Anthropic's `stop_reason` for how the answer ended.
fn stop_reason(e: &Ended) -> &'static str {
    match e.finish {
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::Stop if e.stop_sequence.is_some() => "stop_sequence",
        FinishReason::Stop => "end_turn",
    }
}

/// One content block as it is built.
#[derive(Debug, Clone)]
enum Block {
    Thinking(String),
    Text(String),
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

impl Block {
    fn json(&self) -> Value {
        match self {
            Block::Thinking(t) => json!({"type": "thinking", "thinking": t, "signature": ""}),
            Block::Text(t) => json!({"type": "text", "text": t}),
            Block::ToolUse { id, name, input } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    /// The block as `content_block_start` announces it: empty.
    fn start_json(&self) -> Value {
        match self {
            Block::Thinking(_) => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Block::Text(_) => json!({"type": "text", "text": ""}),
            Block::ToolUse { id, name, .. } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": {}})
            }
        }
    }
}

/// The answer so far.
struct Build {
    id: String,
    model: String,
    blocks: Vec<Block>,
    n_calls: usize,
}

impl Build {
    /// Adds a part: reasoning and text extend the last block of their kind; a call is a
    /// block of its own. Says which block and whether it is new.
    fn add(&mut self, p: Part) -> (usize, bool, Value) {
        let last = self.blocks.last_mut();
        match (p, last) {
            (Part::Reasoning(t), Some(Block::Thinking(b))) => {
                b.push_str(&t);
                (
                    self.blocks.len() - 1,
                    false,
                    json!({"type": "thinking_delta", "thinking": t}),
                )
            }
            (Part::Text(t), Some(Block::Text(b))) => {
                b.push_str(&t);
                (
                    self.blocks.len() - 1,
                    false,
                    json!({"type": "text_delta", "text": t}),
                )
            }
            (Part::Reasoning(t), _) => {
                self.blocks.push(Block::Thinking(t.clone()));
                (
                    self.blocks.len() - 1,
                    true,
                    json!({"type": "thinking_delta", "thinking": t}),
                )
            }
            (Part::Text(t), _) => {
                self.blocks.push(Block::Text(t.clone()));
                (
                    self.blocks.len() - 1,
                    true,
                    json!({"type": "text_delta", "text": t}),
                )
            }
            (Part::Call(c), _) => {
                let id = format!(
                    "toolu_{}_{}",
                    self.id.trim_start_matches("msg_"),
                    self.n_calls
                );
                self.n_calls += 1;
                let input: Value = serde_json::from_str(&c.arguments).unwrap_or(json!({}));
                let delta = json!({"type": "input_json_delta", "partial_json": c.arguments});
                self.blocks.push(Block::ToolUse {
                    id,
                    name: c.name,
                    input,
                });
                (self.blocks.len() - 1, true, delta)
            }
        }
    }

    fn message(&self, ended: Option<&Ended>, input_tokens: usize) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": if ended.is_some() { self.blocks.iter().map(Block::json).collect::<Vec<_>>() } else { Vec::new() },
            "stop_reason": ended.map(stop_reason),
            "stop_sequence": ended.and_then(|e| e.stop_sequence.clone()),
            // As Anthropic counts: `input_tokens` are those not read from the cache.
            "usage": {
                "input_tokens": input_tokens - ended.map_or(0, |e| e.cached_tokens),
                "output_tokens": ended.map_or(0, |e| e.completion_tokens),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": ended.map_or(0, |e| e.cached_tokens),
            },
        })
    }
}

pub async fn whole_response(a: Accepted, record: RequestRecord) -> Response {
    let (mut parts, _req, model, id) = PartStream::new(a, record);
    let mut b = Build {
        id,
        model,
        blocks: Vec::new(),
        n_calls: 0,
    };
    loop {
        match parts.next().await {
            Some(Item::Part(p, _)) => {
                b.add(p);
            }
            Some(Item::Done(e)) => {
                return axum::Json(b.message(Some(&e), e.prompt_tokens)).into_response()
            }
            Some(Item::Failed(e)) => return anthropic(&e),
            None => return anthropic(&Refusal::unavailable("the session ended without a result")),
        }
    }
}

struct StreamState {
    b: Build,
    /// The block whose deltas are being sent, if it is still open.
    open: Option<usize>,
    ready: std::collections::VecDeque<SseEvent>,
    finished: bool,
}

impl StreamState {
    fn event(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        self.ready
            .push_back(SseEvent::default().event(kind).data(data.to_string()));
    }

    fn close(&mut self) {
        let Some(k) = self.open.take() else {
            return;
        };
        if let Block::Thinking(_) = self.b.blocks[k] {
            self.event(
                "content_block_delta",
                json!({"index": k, "delta": {"type": "signature_delta", "signature": ""}}),
            );
        }
        self.event("content_block_stop", json!({"index": k}));
    }

    fn handle(&mut self, item: Option<Item>) {
        match item {
            Some(Item::Part(p, _)) => {
                let (k, new, delta) = self.b.add(p);
                if new {
                    self.close();
                    let block = self.b.blocks[k].start_json();
                    self.event(
                        "content_block_start",
                        json!({"index": k, "content_block": block}),
                    );
                    self.open = Some(k);
                }
                self.event("content_block_delta", json!({"index": k, "delta": delta}));
                if let Block::ToolUse { .. } = self.b.blocks[k] {
                    // A call arrives whole.
                    self.close();
                }
            }
            Some(Item::Done(e)) => {
                self.close();
                self.event(
                    "message_delta",
                    json!({"delta": {"stop_reason": stop_reason(&e), "stop_sequence": e.stop_sequence},
                           "usage": {"output_tokens": e.completion_tokens,
                                     "input_tokens": e.prompt_tokens - e.cached_tokens,
                                     "cache_read_input_tokens": e.cached_tokens}}),
                );
                self.event("message_stop", json!({}));
                self.finished = true;
            }
            Some(Item::Failed(e)) => self.fail(&e),
            None => self.fail(&Refusal::unavailable("the session ended without a result")),
        }
    }

    fn fail(&mut self, e: &Refusal) {
        self.event("error", anthropic_body(e));
        self.finished = true;
    }
}

pub fn stream_response(
    a: Accepted,
    record: RequestRecord,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (parts, _req, model, id) = PartStream::new(a, record);
    let mut st = StreamState {
        b: Build {
            id,
            model,
            blocks: Vec::new(),
            n_calls: 0,
        },
        open: None,
        ready: Default::default(),
        finished: false,
    };
    let start = st.b.message(None, parts.prompt_tokens());
    st.event("message_start", json!({"message": start}));
    st.event("ping", json!({}));
    let body = events(parts, st);
    Sse::new(body).keep_alive(
        KeepAlive::new().event(
            SseEvent::default()
                .event("ping")
                .data("{\"type\": \"ping\"}"),
        ),
    )
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
