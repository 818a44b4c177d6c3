//! Streaming detokenization that never emits half a UTF-8 character.

use crate::{Error, Tokenizer};

/// Turns a stream of token ids into text pieces. Bytes of an incomplete UTF-8 sequence are held
/// back until the next token completes them; invalid bytes become U+FFFD.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, Error> {
        self.pending.extend(tok.token_bytes(id, false)?);
        Ok(self.take_complete())
    }

    /// Adds raw bytes (for tests and callers with their own token bytes).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Whatever is left at the end of the stream (an incomplete tail becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"),
                    );
                    match e.error_len() {
                        // Incomplete sequence at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_multibyte_characters_are_held_until_complete() {
        let mut d = StreamDecoder::new();
        let bytes = "é🙂".as_bytes();
        let mut out = String::new();
        for b in bytes {
            let piece = d.push_bytes(&[*b]);
            assert!(piece.is_empty() || piece == "é" || piece == "🙂");
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, "é🙂");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(d.push_bytes(&[0xE2, 0x82]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
