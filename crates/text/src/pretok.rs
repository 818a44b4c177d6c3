//! Pre-tokenizers: the regex splits llama.cpp applies before BPE, by `tokenizer.ggml.pre` name.
//!
//! Each regex of a variant is applied in turn to every piece produced so far; both the matches
//! and the text between them become pieces (as in llama.cpp's `unicode_regex_split`).

use fancy_regex::Regex;

use crate::Error;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"];

pub const SUPPORTED: &str =
    "default, gpt2, gpt-2, smollm, starcoder, refact, llama3, llama-v3, llama-bpe, qwen2";

/// A compiled pre-tokenizer.
#[derive(Debug)]
pub struct PreTokenizer {
    regexes: Vec<Regex>,
}

impl PreTokenizer {
    pub fn named(pre: &str) -> Result<Self, Error> {
        let sources: Vec<&str> = match pre {
            "default" => DEFAULT.to_vec(),
            "gpt2" | "gpt-2" => vec![GPT2],
            "smollm" | "starcoder" | "refact" => vec![r"\p{N}", GPT2],
            "llama3" | "llama-v3" | "llama-bpe" => vec![LLAMA3],
            "qwen2" => vec![QWEN2],
            other => {
                return Err(Error::UnsupportedPreTokenizer {
                    pre: other.to_string(),
                    supported: SUPPORTED,
                })
            }
        };
        let regexes = sources
            .into_iter()
            .map(|s| Regex::new(s).expect("built-in pre-tokenizer regex compiles"))
            .collect();
        Ok(PreTokenizer { regexes })
    }

    /// Splits `text` into pieces whose concatenation is `text`.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut last = 0;
                for m in re.find_iter(piece) {
                    // The built-in patterns cannot hit the backtracking limit on ordinary text;
                    // if one ever does, the rest of the piece is kept whole.
                    let Ok(m) = m else { break };
                    if m.start() > last {
                        next.push(&piece[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push(&piece[last..]);
                }
            }
            pieces = next;
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm_splits_digits_and_keeps_spaces_with_words() {
        let p = PreTokenizer::named("smollm").unwrap();
        assert_eq!(
            p.split("Hello  world 123!"),
            ["Hello", " ", " world", " ", "1", "2", "3", "!"]
        );
    }

    #[test]
    fn unknown_variant_is_an_error_naming_it() {
        let err = PreTokenizer::named("mystery").unwrap_err();
        assert!(err.to_string().contains("`mystery`"), "{err}");
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        let p = PreTokenizer::named("llama3").unwrap();
        assert_eq!(p.split("12345 ok"), ["123", "45", " ok"]);
    }
}
