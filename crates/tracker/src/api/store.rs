//! Recent responses of the Responses API (`store: true`, its default), for
//! `previous_response_id` and `GET /v1/responses/{id}`: bounded in number and bytes, least
//! recently stored first out, and keyed by the API key that made them, so one key never reads
//! another's conversation.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use text::ChatMessage;

/// One stored response: the conversation it ends (every message but the instructions,
/// which a later response does not inherit) and the response object as it was answered, as
/// JSON text (so what it holds in memory is what it is counted: a parsed value of the same
/// text can take ten times as much).
#[derive(Debug)]
pub struct Stored {
    pub conversation: Arc<Vec<ChatMessage>>,
    pub response: String,
}

/// The bounded store: each API key has an equal share of its entries and bytes, and a key
/// over its share forgets its own oldest responses, never another key's.
#[derive(Debug)]
pub struct ResponseStore {
    share_entries: usize,
    share_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, Entry>,
    /// Each key's ids, oldest first, and the bytes they hold.
    by_key: HashMap<String, (VecDeque<String>, usize)>,
}

#[derive(Debug)]
struct Entry {
    /// The API key name that made it ("" without keys).
    key: String,
    stored: Arc<Stored>,
    bytes: usize,
}

/// What an entry costs: its messages' text and its response's JSON text.
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
    messages + s.response.len()
}

impl ResponseStore {
    /// A store of at most `max_entries` responses and `max_bytes` bytes, shared equally by
    /// `tenants` API keys (1 without keys). Every key may keep at least its latest response,
    /// so with more keys than entries the store holds one per key, its bytes still bounded.
    pub fn new(max_entries: usize, max_bytes: usize, tenants: usize) -> Self {
        let tenants = tenants.max(1);
        ResponseStore {
            share_entries: (max_entries / tenants).max(1),
            share_bytes: max_bytes / tenants,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `stored` under `id` for `key`, forgetting `key`'s oldest responses while it is
    /// over its share; one larger than a share is not kept. Whether it was kept.
    pub fn put(&self, key: &str, id: &str, stored: Stored) -> bool {
        let bytes = bytes_of(&stored);
        if bytes > self.share_bytes {
            return false;
        }
        let mut g = self.lock();
        let Inner { by_id, by_key } = &mut *g;
        let (order, held) = by_key.entry(key.to_string()).or_default();
        while order.len() >= self.share_entries || *held + bytes > self.share_bytes {
            let Some(old) = order.pop_front() else {
                break;
            };
            if let Some(e) = by_id.remove(&old) {
                *held -= e.bytes;
            }
        }
        *held += bytes;
        order.push_back(id.to_string());
        by_id.insert(
            id.to_string(),
            Entry {
                key: key.to_string(),
                stored: Arc::new(stored),
                bytes,
            },
        );
        true
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
        let Inner { by_id, by_key } = &mut *g;
        if let (Some(e), Some((order, held))) = (by_id.remove(id), by_key.get_mut(key)) {
            *held -= e.bytes;
            order.retain(|x| x != id);
        }
        true
    }

    /// Entries and bytes kept, all keys together.
    #[cfg(test)]
    pub fn usage(&self) -> (usize, usize) {
        let g = self.lock();
        g.by_key
            .values()
            .fold((0, 0), |(n, b), (order, held)| (n + order.len(), b + held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> Stored {
        Stored {
            conversation: Arc::new(vec![ChatMessage::new("user", text)]),
            response: json!({"id": "x"}).to_string(),
        }
    }

    #[test]
    fn the_store_is_bounded_and_keyed_by_who_stored() {
        let s = ResponseStore::new(2, 10_000, 1);
        s.put("a", "r1", stored("one"));
        s.put("a", "r2", stored("two"));
        assert!(s.get("a", "r1").is_some());
        assert!(s.get("b", "r1").is_none(), "another key never reads it");
        s.put("a", "r3", stored("three"));
        assert!(s.get("a", "r1").is_none(), "the oldest went first");
        assert_eq!(s.usage().0, 2);
        let small = ResponseStore::new(100, 400, 1);
        for i in 0..50 {
            small.put("", &format!("r{i}"), stored(&"x".repeat(50)));
        }
        assert!(small.usage().1 <= 400);
        assert!(small.get("", "r49").is_some());
        assert!(
            !small.put("", "huge", stored(&"x".repeat(1000))),
            "larger than the store: not kept, and put says so"
        );
        assert!(small.get("", "huge").is_none());
        assert!(!small.delete("other", "r49"));
        assert!(small.delete("", "r49"));
        assert!(small.get("", "r49").is_none());
    }

    /// A key storing without end forgets only its own responses: another key's stay.
    #[test]
    fn one_key_never_evicts_another() {
        let s = ResponseStore::new(8, 4000, 2);
        s.put("alice", "a1", stored("alice's plan"));
        for i in 0..100 {
            s.put("bob", &format!("b{i}"), stored(&"x".repeat(300)));
        }
        assert!(
            s.get("alice", "a1").is_some(),
            "bob's flood left alice's response"
        );
        assert!(s.get("bob", "b99").is_some());
        assert!(s.get("bob", "b0").is_none(), "bob forgot his own oldest");
        let (n, bytes) = s.usage();
        assert!(n <= 8 && bytes <= 4000, "{n} entries, {bytes} bytes");
    }

    /// More keys than entries: each key still keeps its latest response, and the bytes stay
    /// within the bound.
    #[test]
    fn with_more_keys_than_entries_each_keeps_its_latest() {
        let s = ResponseStore::new(4, 4000, 10);
        for k in 0..10 {
            for i in 0..3 {
                assert!(s.put(&format!("k{k}"), &format!("k{k}-{i}"), stored("hello")));
            }
        }
        for k in 0..10 {
            assert!(
                s.get(&format!("k{k}"), &format!("k{k}-2")).is_some(),
                "key {k}"
            );
            assert!(
                s.get(&format!("k{k}"), &format!("k{k}-1")).is_none(),
                "key {k}"
            );
        }
        let (n, bytes) = s.usage();
        assert!(n == 10 && bytes <= 4000, "{n} entries, {bytes} bytes");
    }
}
