//! Answers to completion requests: one JSON body, or an SSE stream of chunks ending in
//! `data: [DONE]`, built from a session's events. The request's record is finished here, as
//! the answer ends.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::http::response_id;
use crate::record::{Outcome, RequestRecord};
use crate::request::{Endpoint, ValidRequest};
use crate::runner::{Command, SessionEvent, TokenLogprob};

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Cancels the session when the response is dropped before it finished (client went away).
pub struct CancelOnDrop {
    id: engine::SessionId,
    commands: mpsc::Sender<Command>,
    armed: bool,
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
        Endpoint::Chat => json!({
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

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub async fn whole_response(
    model_id: String,
    req: ValidRequest,
    mut events: mpsc::UnboundedReceiver<SessionEvent>,
    mut guard: CancelOnDrop,
    mut record: RequestRecord,
) -> Response {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut ids = Vec::new();
    let (finish, p, c) = loop {
        match events.recv().await {
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
            }) => break (finish_reason, prompt_tokens, completion_tokens),
            Some(SessionEvent::Error(e)) => {
                guard.armed = false;
                record.finish(Outcome::Failed(&e));
                return e.into_response();
            }
            None => {
                guard.armed = false;
                let e = ApiError::unavailable("the session ended without a result");
                record.finish(Outcome::Failed(&e));
                return e.into_response();
            }
        }
    };
    guard.armed = false;
    record.finish(Outcome::Done {
        finish_reason: finish,
        completion_tokens: c,
    });
    let id = response_id(req.endpoint, guard.id);
    let logprobs = req.logprobs.map(|_| logprob_json(req.endpoint, &lps));
    let mut body = match req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": now_secs(), "model": model_id,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(p, c),
        }),
        Endpoint::Chat => json!({
            "id": id, "object": "chat.completion", "created": now_secs(), "model": model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage(p, c),
        }),
    };
    if req.return_token_ids {
        body["choices"][0]["token_ids"] = json!(ids);
    }
    (StatusCode::OK, Json(body)).into_response()
}

struct StreamState {
    model_id: String,
    req: ValidRequest,
    events: mpsc::UnboundedReceiver<SessionEvent>,
    guard: CancelOnDrop,
    record: RequestRecord,
    first: bool,
    /// The final chunk was sent; `[DONE]` is next.
    done_next: bool,
    finished: bool,
}

fn chunk(
    st: &StreamState,
    delta_text: Option<&str>,
    lp: Option<&TokenLogprob>,
    finish: Option<&str>,
    usage_v: Option<Value>,
) -> Value {
    let id = response_id(st.req.endpoint, st.guard.id);
    let logprobs = match (st.req.logprobs, lp) {
        (Some(_), Some(l)) => logprob_json(st.req.endpoint, std::slice::from_ref(l)),
        _ => Value::Null,
    };
    let mut v = match st.req.endpoint {
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": now_secs(), "model": st.model_id,
            "choices": [{"index": 0, "text": delta_text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}],
        }),
        Endpoint::Chat => {
            let mut delta = json!({});
            if st.first {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = delta_text {
                delta["content"] = json!(t);
            }
            json!({
                "id": id, "object": "chat.completion.chunk", "created": now_secs(), "model": st.model_id,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    };
    if let Some(u) = usage_v {
        v["usage"] = u;
    }
    v
}

pub fn stream_response(
    model_id: String,
    req: ValidRequest,
    events: mpsc::UnboundedReceiver<SessionEvent>,
    guard: CancelOnDrop,
    record: RequestRecord,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let state = StreamState {
        model_id,
        req,
        events,
        guard,
        record,
        first: true,
        done_next: false,
        finished: false,
    };
    let body = stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        if st.done_next {
            st.finished = true;
            return Some((Ok(SseEvent::default().data("[DONE]")), st));
        }
        let ev = match st.events.recv().await {
            Some(SessionEvent::Token {
                token,
                text,
                logprob,
            }) => {
                st.record.token();
                let mut c = chunk(&st, Some(&text), logprob.as_ref(), None, None);
                if st.req.return_token_ids {
                    c["choices"][0]["token_ids"] = json!([token]);
                }
                st.first = false;
                SseEvent::default().data(c.to_string())
            }
            Some(SessionEvent::Text(text)) => {
                let c = chunk(&st, Some(&text), None, None, None);
                st.first = false;
                SseEvent::default().data(c.to_string())
            }
            Some(SessionEvent::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                let c = chunk(
                    &st,
                    None,
                    None,
                    Some(finish_reason),
                    Some(usage(prompt_tokens, completion_tokens)),
                );
                st.guard.armed = false;
                st.record.finish(Outcome::Done {
                    finish_reason,
                    completion_tokens,
                });
                st.done_next = true;
                SseEvent::default().data(c.to_string())
            }
            Some(SessionEvent::Error(e)) => {
                st.guard.armed = false;
                st.finished = true;
                st.record.finish(Outcome::Failed(&e));
                SseEvent::default().data(e.body().to_string())
            }
            None => {
                st.guard.armed = false;
                st.finished = true;
                let e = ApiError::unavailable("the session ended without a result");
                st.record.finish(Outcome::Failed(&e));
                SseEvent::default().data(e.body().to_string())
            }
        };
        Some((Ok(ev), st))
    });
    Sse::new(body).keep_alive(KeepAlive::default())
}
