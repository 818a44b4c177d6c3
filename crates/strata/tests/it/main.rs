//! The integration tests of `strata`, one test binary (one link) with a module per scenario.

mod admission;
mod agent_api;
mod agent_endpoints;
mod api_limits;
mod chaos;
mod cli;
mod cluster;
mod compute_failure;
mod drafter;
mod error_bodies;
mod failover;
mod families;
mod faults;
mod hardening;
mod hosts;
mod isolation;
mod mixed_isa;
mod pipelined_prefill;
mod plan;
mod probes;
mod residency;
mod serve;
mod speculation;
mod swarm_hygiene;
mod tls;
mod warm_routes;
