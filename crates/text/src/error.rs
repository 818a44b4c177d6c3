//! The one error type of the `text` crate.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error("unsupported tokenizer model `{model}` (supported: gpt2, llama)")]
    UnsupportedModel { model: String },
    #[error("unsupported pre-tokenizer `{pre}` (supported: {supported})")]
    UnsupportedPreTokenizer {
        pre: String,
        supported: &'static str,
    },
    #[error("vocabulary: {what}")]
    BadVocab { what: String },
    #[error("token id {id} is out of range (vocabulary has {n_vocab} tokens)")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error("the model has no chat template (`tokenizer.chat_template` is missing)")]
    NoChatTemplate,
    #[error("chat template: {message}")]
    Template { message: String },
    #[error(transparent)]
    TooManyTokens(#[from] TooManyTokens),
}

/// A text that tokenizes to more than the limit it was given: tokenizing stopped (or never
/// started, when its length alone proved it) once that was certain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the text has at least {at_least} tokens, more than the limit of {limit}")]
pub struct TooManyTokens {
    pub at_least: usize,
    pub limit: usize,
}
