//! The integration tests of `registry`, one test binary (one link) with a module per scenario.

mod etcd;
