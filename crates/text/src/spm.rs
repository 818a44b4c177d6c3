//! SentencePiece-style tokenization (llama.cpp's `llm_tokenizer_spm`): spaces become U+2581,
//! adjacent symbols merge by highest vocabulary score, unknown characters fall back to
//! `<0xXX>` byte tokens.

use std::collections::HashMap;

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
        let mut syms: Vec<String> = s.chars().map(|c| c.to_string()).collect();
        loop {
            let mut best: Option<(f32, usize, u32)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                let joined = format!("{}{}", syms[i], syms[i + 1]);
                if let Some(&id) = ids.get(&joined) {
                    let score = self.scores[id as usize];
                    if best.is_none_or(|b| score > b.0) {
                        best = Some((score, i, id));
                    }
                }
            }
            let Some((_, i, _)) = best else { break };
            let right = syms.remove(i + 1);
            syms[i].push_str(&right);
        }
        for sym in syms {
            match ids.get(&sym) {
                Some(&id) => out.push(id),
                None => {
                    for b in sym.bytes() {
                        if let Some(&id) = ids.get(&format!("<0x{b:02X}>")) {
                            out.push(id);
                        }
                    }
                }
            }
        }
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
