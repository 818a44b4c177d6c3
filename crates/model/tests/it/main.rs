//! The integration tests of `model`, one test binary (one link) with a module per scenario.

mod hostile_families;
mod invariants;
mod isa_contract;
mod kv_q8_0;
mod real_families;
mod real_model;
mod split_files;
