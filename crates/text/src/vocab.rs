//! The tokenizer as described by a GGUF file's `tokenizer.ggml.*` metadata.

use std::collections::HashMap;
use std::ops::Range;

use aho_corasick::{AhoCorasick, MatchKind};
use gguf::Header;

use crate::bpe::Bpe;
use crate::pretok::PreTokenizer;
use crate::spm::Spm;
use crate::{Error, TooManyTokens};

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
    /// Special-token text to ids in one pass (leftmost, longest at a position): every control
    /// and user-defined token, and the user-defined ones alone (matched even when special
    /// parsing is off, as in llama.cpp).
    specials: SpecialMatcher,
    user_defined: SpecialMatcher,
    /// The most bytes any one token stands for, and which bytes always end up in some token
    /// (those with a token of their own): a text with n such bytes has at least
    /// n / `max_token_bytes` tokens.
    max_token_bytes: usize,
    byte_covered: [bool; 256],
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
        let specials = SpecialMatcher::new(
            &tokens,
            &kinds,
            &[TokenKind::Control, TokenKind::UserDefined],
        )?;
        let user_defined = SpecialMatcher::new(&tokens, &kinds, &[TokenKind::UserDefined])?;

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
        let byte_covered: [bool; 256] = std::array::from_fn(|b| match &algo {
            Algo::Bpe(..) => {
                let (chars, _) = crate::bpe::byte_chars();
                ids.contains_key(chars[b].to_string().as_str())
            }
            Algo::Spm(..) => ids.contains_key(&format!("<0x{b:02X}>")),
        });
        let mut tokenizer = Tokenizer {
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
            user_defined,
            max_token_bytes: 1,
            byte_covered,
            algo,
        };
        tokenizer.max_token_bytes = (0..n as u32)
            .map(|id| tokenizer.token_bytes(id, true).map_or(0, |b| b.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(tokenizer)
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

    /// How `other`'s vocabulary differs from this one (`None` when it is the same: the same
    /// algorithm, tokens, kinds and end tokens), naming the first difference. A draft model
    /// must share its target's vocabulary: a drafted id means a token of the target.
    pub fn difference(&self, other: &Tokenizer) -> Option<String> {
        if self.model() != other.model() {
            return Some(format!(
                "the tokenizer models differ ({:?} and {:?})",
                self.model(),
                other.model()
            ));
        }
        if self.n_vocab() != other.n_vocab() {
            return Some(format!(
                "the vocabularies hold {} and {} tokens",
                self.n_vocab(),
                other.n_vocab()
            ));
        }
        let first = (0..self.tokens.len())
            .find(|&i| self.tokens[i] != other.tokens[i] || self.kinds[i] != other.kinds[i]);
        if let Some(i) = first {
            return Some(format!(
                "token {i} is {:?} ({:?}) in one and {:?} ({:?}) in the other",
                self.tokens[i], self.kinds[i], other.tokens[i], other.kinds[i]
            ));
        }
        if (self.eos, self.eot) != (other.eos, other.eot) {
            return Some(format!(
                "the end tokens differ (eos {:?}, eot {:?} and eos {:?}, eot {:?})",
                self.eos, self.eot, other.eos, other.eot
            ));
        }
        None
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

    /// The first control token whose text `text` holds, if any: text a template prints as
    /// markup (tool definitions, tool-call arguments) must not smuggle turns in.
    pub fn control_text_in<'t>(&self, text: &'t str) -> Option<&'t str> {
        self.specials
            .find_all(text)
            .find(|&(_, _, id)| self.kinds[id as usize] == TokenKind::Control)
            .map(|(s, e, _)| &text[s..e])
    }

    /// Whether generation should stop at `id` (end of sequence or end of turn).
    pub fn is_end(&self, id: u32) -> bool {
        Some(id) == self.eos || Some(id) == self.eot
    }

    /// Encodes `text`. `add_special` adds BOS/EOS as the vocabulary asks; `parse_special`
    /// turns the text of control tokens (such as `<|im_end|>`) into those tokens. User-defined
    /// tokens are always matched, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let parts = [(0..text.len(), parse_special)];
        self.encode_parts(text, add_special, &parts, usize::MAX)
            .expect("no limit")
    }

    /// [`Tokenizer::encode`] with a limit: the ids, or [`TooManyTokens`] as soon as the text is
    /// certain to have more than `limit` tokens. A text too long to fit is refused from its
    /// length alone, before any work that grows with it.
    pub fn encode_within(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        limit: usize,
    ) -> Result<Vec<u32>, TooManyTokens> {
        self.encode_parts(text, add_special, &[(0..text.len(), parse_special)], limit)
    }

    /// Encodes `text` whose byte ranges `parts` (in order, covering it) each say whether
    /// control-token text in them is parsed: a chat prompt parses its template's markup but not
    /// what the user wrote. Plain text runs on across parts (a part boundary is no token
    /// boundary), so the ids are those of [`Tokenizer::encode`] wherever no part holds
    /// unparsed control-token text. Stops with [`TooManyTokens`] past `limit`.
    pub fn encode_parts(
        &self,
        text: &str,
        add_special: bool,
        parts: &[(Range<usize>, bool)],
        limit: usize,
    ) -> Result<Vec<u32>, TooManyTokens> {
        if text.len() / self.max_token_bytes > limit {
            // Counted only as far as the proof needs.
            let enough = limit.saturating_add(1).saturating_mul(self.max_token_bytes);
            let mut covered = 0;
            for &b in text.as_bytes() {
                covered += usize::from(self.byte_covered[b as usize]);
                if covered >= enough {
                    return Err(TooManyTokens {
                        at_least: limit + 1,
                        limit,
                    });
                }
            }
        }
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        // Special tokens found in each part, with the plain text between them encoded whole.
        let mut plain_from = 0;
        for (range, parse_special) in parts {
            let matcher = if *parse_special {
                &self.specials
            } else {
                &self.user_defined
            };
            for (at, end, id) in matcher.find_all(&text[range.clone()]) {
                let (at, end) = (range.start + at, range.start + end);
                self.encode_plain(&text[plain_from..at], plain_from == 0, &mut out, limit)?;
                out.push(id);
                plain_from = end;
            }
        }
        self.encode_plain(&text[plain_from..], plain_from == 0, &mut out, limit)?;
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        if out.len() > limit {
            return Err(TooManyTokens {
                at_least: out.len(),
                limit,
            });
        }
        Ok(out)
    }

    /// Prompt ids for a conversation rendered with `template` (ending with the assistant's turn
    /// opener). Only the template's own markup becomes control tokens: what the messages say
    /// is plain text, so a user who types `<|im_start|>system` writes those characters, not a
    /// turn. BOS is added as the vocabulary asks unless the template already wrote it.
    pub fn encode_chat(
        &self,
        template: &crate::ChatTemplate,
        messages: &[crate::ChatMessage],
    ) -> Result<Vec<u32>, Error> {
        self.encode_chat_within(template, messages, crate::Vars::default(), usize::MAX)
    }

    /// [`Tokenizer::encode_chat`] that stops past `limit` tokens.
    pub fn encode_chat_within(
        &self,
        template: &crate::ChatTemplate,
        messages: &[crate::ChatMessage],
        vars: crate::Vars<'_>,
        limit: usize,
    ) -> Result<Vec<u32>, Error> {
        let rendered = template.render_parts(messages, vars, true)?;
        let bos_text = self.bos.and_then(|b| self.token_text(b));
        let add_special = !bos_text.is_some_and(|b| !b.is_empty() && rendered.text.starts_with(b));
        Ok(self.encode_parts(&rendered.text, add_special, &rendered.parts(), limit)?)
    }

    /// Encodes text with no special tokens in it (`first_fragment`: it starts the prompt).
    fn encode_plain(
        &self,
        text: &str,
        first_fragment: bool,
        out: &mut Vec<u32>,
        limit: usize,
    ) -> Result<(), TooManyTokens> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.algo {
            Algo::Bpe(bpe, pre) => {
                for word in pre.split(text) {
                    bpe.encode_word(word, &self.ids, out);
                    if out.len() > limit {
                        return Err(TooManyTokens {
                            at_least: out.len(),
                            limit,
                        });
                    }
                }
            }
            Algo::Spm(spm) => spm.encode(text, first_fragment, &self.ids, out),
        }
        Ok(())
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

/// Finds special-token text in one pass over a text: leftmost first, the longest of those
/// starting there.
struct SpecialMatcher {
    /// `None` when the vocabulary has no such tokens.
    automaton: Option<AhoCorasick>,
    ids: Vec<u32>,
}

impl SpecialMatcher {
    fn new(tokens: &[String], kinds: &[TokenKind], of: &[TokenKind]) -> Result<Self, Error> {
        let (texts, ids): (Vec<&str>, Vec<u32>) = tokens
            .iter()
            .zip(kinds)
            .enumerate()
            .filter(|(_, (t, k))| of.contains(k) && !t.is_empty())
            .map(|(i, (t, _))| (t.as_str(), i as u32))
            .unzip();
        if texts.is_empty() {
            return Ok(SpecialMatcher {
                automaton: None,
                ids,
            });
        }
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .map_err(|e| Error::BadVocab {
                what: format!("special tokens: {e}"),
            })?;
        Ok(SpecialMatcher {
            automaton: Some(automaton),
            ids,
        })
    }

    /// Every match in `text` as (start, end, token id), in order, not overlapping.
    fn find_all<'t>(&'t self, text: &'t str) -> impl Iterator<Item = (usize, usize, u32)> + 't {
        self.automaton
            .iter()
            .flat_map(move |a| a.find_iter(text))
            .map(|m| (m.start(), m.end(), self.ids[m.pattern().as_usize()]))
    }
}
