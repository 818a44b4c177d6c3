//! Byte-level BPE (GPT-2 style): bytes map to printable characters, then ranked merges.

use std::collections::HashMap;
use std::sync::OnceLock;

/// The GPT-2 byte-to-character table: printable bytes map to themselves, the rest to
/// code points from U+0100 on.
fn byte_chars() -> &'static ([char; 256], HashMap<char, u8>) {
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
    pub fn encode_word(&self, word: &str, ids: &HashMap<String, u32>, out: &mut Vec<u32>) {
        let (chars, _) = byte_chars();
        let mapped: String = word.bytes().map(|b| chars[b as usize]).collect();
        // Symbols: token ids, or None for a character the vocabulary lacks.
        let mut syms: Vec<(Option<u32>, String)> = mapped
            .chars()
            .map(|c| {
                let s = c.to_string();
                (ids.get(&s).copied(), s)
            })
            .collect();
        loop {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let (Some(l), Some(r)) = (syms[i].0, syms[i + 1].0) {
                    if let Some(&(rank, merged)) = self.merges.get(&(l, r)) {
                        if best.is_none_or(|b| rank < b.0) {
                            best = Some((rank, i, merged));
                        }
                    }
                }
            }
            let Some((_, i, merged)) = best else { break };
            let right = syms.remove(i + 1);
            syms[i].0 = Some(merged);
            syms[i].1.push_str(&right.1);
        }
        for (id, text) in syms {
            match id {
                Some(id) => out.push(id),
                // Unknown symbol: fall back to its single characters if they are tokens.
                None => out.extend(
                    text.chars()
                        .filter_map(|c| ids.get(&c.to_string()).copied()),
                ),
            }
        }
    }
}
