//! Recent responses of the Responses API (`store: true`, its default), for
//! `previous_response_id` and `GET /v1/responses/{id}`: bounded in number and bytes, least
//! recently stored first out, and keyed by the API key that made them, so one key never reads
//! another's conversation.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use text::ChatMessage;

/// One stored response: the conversation it ends (every message but the instructions,
/// which a later response does not inherit) and the response object as it was answered.
#[derive(Debug)]
pub struct Stored {
    pub conversation: Arc<Vec<ChatMessage>>,
    pub response: Value,
}

/// The bounded store.
#[derive(Debug)]
pub struct ResponseStore {
    max_entries: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, Entry>,
    order: VecDeque<String>,
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    /// The API key name that made it ("" without keys).
    key: String,
    stored: Arc<Stored>,
    bytes: usize,
}

/// What an entry costs: its messages' text and its response object.
fn bytes_of(s: &Stored) -> usize {
    let messages: usize = s
        .conversation
        .iter()
        .map(|m| {
            m.content.len()
                + m.reasoning_content.as_ref().map_or(0, String::len)
                + m.tool_calls.as_ref().map_or(0, |c| c.to_string().len())
                + 64
        })
        .sum();
    messages + s.response.to_string().len()
}

impl ResponseStore {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        ResponseStore {
            max_entries,
            max_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `stored` under `id` for `key`; one larger than the whole store is not kept.
    pub fn put(&self, key: &str, id: &str, stored: Stored) {
        let bytes = bytes_of(&stored);
        if bytes > self.max_bytes || self.max_entries == 0 {
            return;
        }
        let mut g = self.lock();
        while g.order.len() >= self.max_entries || g.bytes + bytes > self.max_bytes {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some(e) = g.by_id.remove(&old) {
                g.bytes -= e.bytes;
            }
        }
        g.bytes += bytes;
        g.order.push_back(id.to_string());
        g.by_id.insert(
            id.to_string(),
            Entry {
                key: key.to_string(),
                stored: Arc::new(stored),
                bytes,
            },
        );
    }

    /// The response `id` if `key` made it and it is still kept.
    pub fn get(&self, key: &str, id: &str) -> Option<Arc<Stored>> {
        let g = self.lock();
        g.by_id
            .get(id)
            .filter(|e| proto::secrets_equal(&e.key, key))
            .map(|e| Arc::clone(&e.stored))
    }

    /// Forgets `id` if `key` made it; whether it was there.
    pub fn delete(&self, key: &str, id: &str) -> bool {
        let mut g = self.lock();
        if g.by_id.get(id).is_none_or(|e| e.key != key) {
            return false;
        }
        if let Some(e) = g.by_id.remove(id) {
            g.bytes -= e.bytes;
        }
        g.order.retain(|x| x != id);
        true
    }

    /// Entries and bytes kept.
    #[cfg(test)]
    pub fn usage(&self) -> (usize, usize) {
        let g = self.lock();
        (g.order.len(), g.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> Stored {
        Stored {
            conversation: Arc::new(vec![ChatMessage::new("user", text)]),
            response: json!({"id": "x"}),
        }
    }

    #[test]
    fn the_store_is_bounded_and_keyed_by_who_stored() {
        let s = ResponseStore::new(2, 10_000);
        s.put("a", "r1", stored("one"));
        s.put("a", "r2", stored("two"));
        assert!(s.get("a", "r1").is_some());
        assert!(s.get("b", "r1").is_none(), "another key never reads it");
        s.put("a", "r3", stored("three"));
        assert!(s.get("a", "r1").is_none(), "the oldest went first");
        assert_eq!(s.usage().0, 2);
        let small = ResponseStore::new(100, 400);
        for i in 0..50 {
            small.put("", &format!("r{i}"), stored(&"x".repeat(50)));
        }
        assert!(small.usage().1 <= 400);
        assert!(small.get("", "r49").is_some());
        small.put("", "huge", stored(&"x".repeat(1000)));
        assert!(
            small.get("", "huge").is_none(),
            "larger than the store: not kept"
        );
        assert!(!small.delete("other", "r49"));
        assert!(small.delete("", "r49"));
        assert!(small.get("", "r49").is_none());
    }
}
