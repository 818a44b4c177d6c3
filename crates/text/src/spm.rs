//! SentencePiece-style tokenization (llama.cpp's `llm_tokenizer_spm`): spaces become U+2581,
//! adjacent symbols merge by highest vocabulary score, unknown characters fall back to
//! `<0xXX>` byte tokens.

use std::collections::{BinaryHeap, HashMap};

const SPACE: char = '\u{2581}';

pub struct Spm {
    scores: Vec<f32>,
    add_space_prefix: bool,
}

impl Spm {
    pub fn new(scores: Vec<f32>, add_space_prefix: bool) -> Spm {
        Spm {
            scores,
            add_space_prefix,
        }
    }

    /// Encodes `text` (the first fragment of a prompt gets the space prefix when the
    /// vocabulary asks for it), appending ids to `out`.
    ///
    /// Adjacent symbols whose concatenation is a token merge, the highest score first and the
    /// leftmost among equals (llama.cpp's order). Candidate pairs wait in a heap and a merged
    /// symbol is unlinked, so the cost is O(n log n) in the characters, and a pair is looked
    /// up as a slice of the text, never built as a new string.
    pub fn encode(
        &self,
        text: &str,
        first_fragment: bool,
        ids: &HashMap<String, u32>,
        out: &mut Vec<u32>,
    ) {
        let mut s = String::with_capacity(text.len() + 3);
        if self.add_space_prefix && first_fragment {
            s.push(SPACE);
        }
        s.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let mut syms: Vec<Sym> = s
            .char_indices()
            .enumerate()
            .map(|(i, (at, c))| Sym {
                start: at as u32,
                end: (at + c.len_utf8()) as u32,
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: i as u32 + 1,
            })
            .collect();
        let Some(last) = syms.last_mut() else { return };
        last.next = NONE;
        let mut heap = BinaryHeap::new();
        let candidate = |syms: &[Sym], l: u32, heap: &mut BinaryHeap<Pair>| {
            let r = syms[l as usize].next;
            if r == NONE {
                return;
            }
            let (a, b) = (syms[l as usize], syms[r as usize]);
            if let Some(&id) = ids.get(&s[a.start as usize..b.end as usize]) {
                heap.push(Pair {
                    score: self.scores[id as usize],
                    left: l,
                    len: b.end - a.start,
                });
            }
        };
        for l in 0..syms.len() as u32 {
            candidate(&syms, l, &mut heap);
        }
        while let Some(p) = heap.pop() {
            let l = p.left as usize;
            let r = syms[l].next;
            // Stale: one side was merged since the pair was queued (the pair's text length
            // no longer matches its two symbols).
            if r == NONE || syms[r as usize].end - syms[l].start != p.len {
                continue;
            }
            let after = syms[r as usize].next;
            syms[l].end = syms[r as usize].end;
            syms[l].next = after;
            if after != NONE {
                syms[after as usize].prev = p.left;
            }
            syms[r as usize].next = NONE;
            let before = syms[l].prev;
            if before != NONE {
                candidate(&syms, before, &mut heap);
            }
            candidate(&syms, p.left, &mut heap);
        }
        let mut i = 0;
        while i != NONE {
            let sym = syms[i as usize];
            let piece = &s[sym.start as usize..sym.end as usize];
            match ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        if let Some(&id) = ids.get(&format!("<0x{b:02X}>")) {
                            out.push(id);
                        }
                    }
                }
            }
            i = sym.next;
        }
    }
}

/// No symbol (the end of the list).
const NONE: u32 = u32::MAX;

/// A run of the normalized text, in the linked list of the symbols still alive.
#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    end: u32,
    prev: u32,
    next: u32,
}

/// A candidate merge of the symbol at `left` with the one after it, whose text is `len` bytes.
struct Pair {
    score: f32,
    left: u32,
    len: u32,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for Pair {}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Pair {
    /// The heap's top is the highest score, then the leftmost pair.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Bytes of an SPM piece: U+2581 is a space, `<0xXX>` is one raw byte.
pub fn decode_piece(text: &str) -> Vec<u8> {
    if text.len() == 6 && text.starts_with("<0x") && text.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&text[3..5], 16) {
            return vec![b];
        }
    }
    text.replace(SPACE, " ").into_bytes()
}
