//! Byte-level BPE (GPT-2 style): bytes map to printable characters, then ranked merges.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

/// The GPT-2 byte-to-character table: printable bytes map to themselves, the rest to
/// code points from U+0100 on.
pub(crate) fn byte_chars() -> &'static ([char; 256], HashMap<char, u8>) {
    static TABLE: OnceLock<([char; 256], HashMap<char, u8>)> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut chars = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..=255u8 {
            let printable = (b'!'..=b'~').contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            chars[b as usize] = if printable {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("valid code point");
                next += 1;
                c
            };
        }
        let back = chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        (chars, back)
    })
}

/// Bytes of a byte-level token text (characters outside the table are kept as UTF-8).
pub fn decode_byte_level(text: &str) -> Vec<u8> {
    let (_, back) = byte_chars();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match back.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Ranked merges over token ids.
pub struct Bpe {
    /// (left id, right id) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
}

/// No symbol (the end of the list).
const NONE: u32 = u32::MAX;

/// Candidate merges, lowest first: (rank, left symbol, left id, right id, merged id).
type Candidates = BinaryHeap<Reverse<(u32, u32, u32, u32, u32)>>;

/// One symbol of a word being merged: a run of the mapped text, in a linked list of the
/// symbols still alive.
#[derive(Clone, Copy)]
struct Sym {
    /// Its token, or `None` for a character the vocabulary lacks (or a symbol merged away).
    id: Option<u32>,
    prev: u32,
    next: u32,
}

impl Bpe {
    pub fn new(ids: &HashMap<String, u32>, merges: &[&str]) -> Bpe {
        let mut map = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            let Some((l, r)) = m.split_once(' ') else {
                continue;
            };
            let (Some(&li), Some(&ri), Some(&mi)) =
                (ids.get(l), ids.get(r), ids.get(&format!("{l}{r}")))
            else {
                continue;
            };
            map.entry((li, ri)).or_insert((rank as u32, mi));
        }
        Bpe { merges: map }
    }

    /// Encodes one pre-tokenized word, appending ids to `out`.
    ///
    /// The merge of lowest rank among adjacent symbols goes first, the leftmost among equals
    /// (llama.cpp's order). Candidate pairs wait in a heap and a symbol merged away is
    /// unlinked, so a word of n characters costs O(n log n), never a rescan per merge: a
    /// megabyte of one character is a long word, not a hang.
    pub fn encode_word(&self, word: &str, ids: &HashMap<String, u32>, out: &mut Vec<u32>) {
        let (chars, _) = byte_chars();
        let mut buf = [0u8; 4];
        let mut syms: Vec<Sym> = word
            .bytes()
            .enumerate()
            .map(|(i, b)| Sym {
                id: ids
                    .get(chars[b as usize].encode_utf8(&mut buf) as &str)
                    .copied(),
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: i as u32 + 1,
            })
            .collect();
        let Some(last) = syms.last_mut() else { return };
        last.next = NONE;
        let mut heap = Candidates::new();
        let candidate = |syms: &[Sym], l: u32, heap: &mut Candidates| {
            let r = syms[l as usize].next;
            if r == NONE {
                return;
            }
            if let (Some(a), Some(b)) = (syms[l as usize].id, syms[r as usize].id) {
                if let Some(&(rank, merged)) = self.merges.get(&(a, b)) {
                    heap.push(Reverse((rank, l, a, b, merged)));
                }
            }
        };
        for l in 0..syms.len() as u32 {
            candidate(&syms, l, &mut heap);
        }
        while let Some(Reverse((_, l, a, b, merged))) = heap.pop() {
            let r = syms[l as usize].next;
            // Stale: one side was merged since the pair was queued.
            if r == NONE || syms[l as usize].id != Some(a) || syms[r as usize].id != Some(b) {
                continue;
            }
            let after = syms[r as usize].next;
            syms[l as usize].id = Some(merged);
            syms[l as usize].next = after;
            if after != NONE {
                syms[after as usize].prev = l;
            }
            syms[r as usize] = Sym {
                id: None,
                prev: NONE,
                next: NONE,
            };
            let before = syms[l as usize].prev;
            if before != NONE {
                candidate(&syms, before, &mut heap);
            }
            candidate(&syms, l, &mut heap);
        }
        // A character the vocabulary lacks has no token: it is dropped, as before merging.
        let mut i = 0;
        while i != NONE {
            out.extend(syms[i as usize].id);
            i = syms[i as usize].next;
        }
    }
}
