//! The integration tests of `constrain`, one test binary (one link) with a module per scenario.

mod documents;
mod limits;
