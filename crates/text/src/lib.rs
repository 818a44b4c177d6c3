//! Text in and out of a GGUF model: a tokenizer built from the file's own vocabulary, a
//! streaming detokenizer, chat templates, and stop strings.
//!
//! The key design decision: the tokenizer is reconstructed from the GGUF metadata alone and
//! follows llama.cpp's algorithms (byte-level BPE with its named pre-tokenizer regexes, and
//! SentencePiece-style score merges with byte fallback), because agreeing with llama.cpp token
//! for token is what makes outputs comparable. A pre-tokenizer name strata does not know is an
//! error, not a guess.

mod bpe;
mod detok;
mod error;
mod pretok;
mod spm;
mod stop;
mod template;
mod vocab;

pub use detok::StreamDecoder;
pub use error::{Error, TooManyTokens};
pub use stop::{StopMatcher, StopStep};
pub use template::{ChatMessage, ChatTemplate, Rendered, ToolSyntax, Vars};
pub use vocab::{TokenKind, Tokenizer, TokenizerModel};
