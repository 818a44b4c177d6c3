//! The route layer: routes of shards and the sessions driven along them. It knows shards,
//! steps and refusals, never HTTP: the API layer above offers it jobs and reads its events.
//!
//! - [`cluster`]: a route's shards, validated, probed for health, streams opened;
//! - [`driver`]: one route's loop (the scheduler's plans down the route, replies back);
//! - [`table`]: the resident models and the routes holding each;
//! - [`offer`]: a new job offered to the model's routes in turn;
//! - [`prefixes`]: what each route's prefix caches hold, as the tracker saw it, for choosing;
//! - [`pace`]: each route's measured time per token, for choosing;
//! - [`failover`]: sessions of a failed route placed on another;
//! - [`membership`]: routes built from the registry's shards as they come and go;
//! - [`start`]: starting a route (validation, model, monitor, driver).

pub mod cluster;
pub mod driver;
pub mod failover;
pub mod membership;
pub mod offer;
pub mod pace;
pub mod prefixes;
pub mod start;
pub mod table;
