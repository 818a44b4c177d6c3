//! The integration tests of `text`, one test binary (one link) with a module per scenario.

mod chat_injection;
mod real_tokenizers;
mod reference_tokenizer;
mod spm_tokenizer;
mod tokenizer_cost;
