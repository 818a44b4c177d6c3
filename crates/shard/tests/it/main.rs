//! The integration tests of `shard`, one test binary (one link) with a module per scenario.

mod common;
mod isolation;
mod refusals;
mod route;
mod step_fuzz;
mod verify;
