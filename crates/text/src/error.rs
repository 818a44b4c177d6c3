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
}
