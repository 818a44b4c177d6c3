//! The tokenizer as described by a GGUF file's `tokenizer.ggml.*` metadata.

use std::collections::HashMap;

use gguf::Header;

use crate::bpe::Bpe;
use crate::pretok::PreTokenizer;
use crate::spm::Spm;
use crate::Error;

/// `tokenizer.ggml.token_type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_i64(v: i64) -> TokenKind {
        match v {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Normal,
        }
    }
}

/// Which algorithm the vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerModel {
    /// Byte-level BPE (`gpt2`).
    Bpe,
    /// SentencePiece-style (`llama`).
    Spm,
}

enum Algo {
    Bpe(Bpe, PreTokenizer),
    Spm(Spm),
}

/// A tokenizer reconstructed from GGUF metadata.
pub struct Tokenizer {
    tokens: Vec<String>,
    kinds: Vec<TokenKind>,
    ids: HashMap<String, u32>,
    /// Control and user-defined tokens, longest first, for special-token parsing.
    specials: Vec<(String, u32, TokenKind)>,
    algo: Algo,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End-of-turn token when the vocabulary names one (`tokenizer.ggml.eot_token_id`).
    pub eot: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({} tokens)", self.tokens.len())
    }
}

fn opt_id(h: &Header, key: &str) -> Result<Option<u32>, Error> {
    Ok(h.opt(key, |h, k| h.u64(k))?.map(|v| v as u32))
}

impl Tokenizer {
    pub fn from_header(h: &Header) -> Result<Tokenizer, Error> {
        let model = h.str("tokenizer.ggml.model")?;
        let tokens: Vec<String> = h
            .array("tokenizer.ggml.tokens")?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Error::BadVocab {
                        what: format!("token {i} is not a string"),
                    })
            })
            .collect::<Result<_, _>>()?;
        let n = tokens.len();
        let kinds: Vec<TokenKind> = match h.get("tokenizer.ggml.token_type") {
            Some(v) => {
                let arr = v.as_array().unwrap_or_default();
                if arr.len() != n {
                    return Err(Error::BadVocab {
                        what: format!("{} token types for {n} tokens", arr.len()),
                    });
                }
                arr.iter()
                    .map(|t| TokenKind::from_i64(t.as_i64().unwrap_or(1)))
                    .collect()
            }
            None => vec![TokenKind::Normal; n],
        };
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut specials: Vec<(String, u32, TokenKind)> = tokens
            .iter()
            .zip(&kinds)
            .enumerate()
            .filter(|(_, (t, k))| {
                matches!(k, TokenKind::Control | TokenKind::UserDefined) && !t.is_empty()
            })
            .map(|(i, (t, k))| (t.clone(), i as u32, *k))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));

        let (algo, default_bos) = match model {
            "gpt2" => {
                let pre = h.opt("tokenizer.ggml.pre", |h, k| h.str(k).map(str::to_string))?;
                let pre = PreTokenizer::named(pre.as_deref().unwrap_or("default"))?;
                let merges: Vec<&str> = h
                    .array("tokenizer.ggml.merges")?
                    .iter()
                    .filter_map(|v| v.as_str())
                    .collect();
                (Algo::Bpe(Bpe::new(&ids, &merges), pre), false)
            }
            "llama" => {
                let scores: Vec<f32> = match h.get("tokenizer.ggml.scores") {
                    Some(v) => v
                        .as_array()
                        .unwrap_or_default()
                        .iter()
                        .map(|s| s.as_f64().unwrap_or(0.0) as f32)
                        .collect(),
                    None => vec![0.0; n],
                };
                if scores.len() != n {
                    return Err(Error::BadVocab {
                        what: format!("{} scores for {n} tokens", scores.len()),
                    });
                }
                let add_space_prefix = h
                    .opt("tokenizer.ggml.add_space_prefix", |h, k| h.bool(k))?
                    .unwrap_or(true);
                (Algo::Spm(Spm::new(scores, add_space_prefix)), true)
            }
            other => {
                return Err(Error::UnsupportedModel {
                    model: other.to_string(),
                })
            }
        };
        let check = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        Ok(Tokenizer {
            bos: check(opt_id(h, "tokenizer.ggml.bos_token_id")?),
            eos: check(opt_id(h, "tokenizer.ggml.eos_token_id")?),
            eot: check(opt_id(h, "tokenizer.ggml.eot_token_id")?),
            add_bos: h
                .opt("tokenizer.ggml.add_bos_token", |h, k| h.bool(k))?
                .unwrap_or(default_bos),
            add_eos: h
                .opt("tokenizer.ggml.add_eos_token", |h, k| h.bool(k))?
                .unwrap_or(false),
            tokens,
            kinds,
            ids,
            specials,
            algo,
        })
    }

    pub fn model(&self) -> TokenizerModel {
        match self.algo {
            Algo::Bpe(..) => TokenizerModel::Bpe,
            Algo::Spm(..) => TokenizerModel::Spm,
        }
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Whether generation should stop at `id` (end of sequence or end of turn).
    pub fn is_end(&self, id: u32) -> bool {
        Some(id) == self.eos || Some(id) == self.eot
    }

    /// Encodes `text`. `add_special` adds BOS/EOS as the vocabulary asks; `parse_special`
    /// turns the text of control tokens (such as `<|im_end|>`) into those tokens. User-defined
    /// tokens are always matched, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let mut first_fragment = true;
        let mut rest = text;
        while !rest.is_empty() {
            let found = self.next_special(rest, parse_special);
            let (plain, special) = match found {
                Some((at, tok_len, id)) => (&rest[..at], Some((tok_len, id, at))),
                None => (rest, None),
            };
            if !plain.is_empty() {
                self.encode_plain(plain, first_fragment, &mut out);
            }
            first_fragment = false;
            match special {
                Some((tok_len, id, at)) => {
                    out.push(id);
                    rest = &rest[at + tok_len..];
                }
                None => rest = "",
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// Prompt ids for a conversation rendered with `template` (ending with the assistant's turn
    /// opener). Special tokens in the rendered text are parsed; BOS is added as the vocabulary
    /// asks unless the template already wrote it.
    pub fn encode_chat(
        &self,
        template: &crate::ChatTemplate,
        messages: &[crate::ChatMessage],
    ) -> Result<Vec<u32>, Error> {
        let rendered = template.render(messages, true)?;
        let bos_text = self.bos.and_then(|b| self.token_text(b));
        let add_special = !bos_text.is_some_and(|b| !b.is_empty() && rendered.starts_with(b));
        Ok(self.encode(&rendered, add_special, true))
    }

    /// The leftmost special token in `text` (longest at that position): (offset, length, id).
    fn next_special(&self, text: &str, parse_special: bool) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        for (tok, id, kind) in &self.specials {
            if !parse_special && *kind == TokenKind::Control {
                continue;
            }
            if let Some(at) = text.find(tok.as_str()) {
                let better = match best {
                    None => true,
                    Some((b_at, b_len, _)) => at < b_at || (at == b_at && tok.len() > b_len),
                };
                if better {
                    best = Some((at, tok.len(), *id));
                }
            }
        }
        best
    }

    fn encode_plain(&self, text: &str, first_fragment: bool, out: &mut Vec<u32>) {
        match &self.algo {
            Algo::Bpe(bpe, pre) => {
                for word in pre.split(text) {
                    bpe.encode_word(word, &self.ids, out);
                }
            }
            Algo::Spm(spm) => spm.encode(text, first_fragment, &self.ids, out),
        }
    }

    /// The bytes token `id` stands for. Control tokens render as their text only when
    /// `render_special` is set; out-of-range ids are an error.
    pub fn token_bytes(&self, id: u32, render_special: bool) -> Result<Vec<u8>, Error> {
        let text = self.token_text(id).ok_or(Error::TokenOutOfRange {
            id,
            n_vocab: self.tokens.len(),
        })?;
        Ok(match self.kinds[id as usize] {
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused => {
                if render_special {
                    text.as_bytes().to_vec()
                } else {
                    Vec::new()
                }
            }
            TokenKind::UserDefined => text.as_bytes().to_vec(),
            TokenKind::Byte | TokenKind::Normal => match &self.algo {
                Algo::Bpe(..) => crate::bpe::decode_byte_level(text),
                Algo::Spm(..) => crate::spm::decode_piece(text),
            },
        })
    }

    /// Decodes `ids` to text (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32], render_special: bool) -> Result<String, Error> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend(self.token_bytes(id, render_special)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}
