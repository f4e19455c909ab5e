//! Interference between co-located vNPUs (docs/interference.md):
//! characterized on the board model ([`corun`], [`characterize`]),
//! predicted from each workload's solo counters ([`predict`]), and what
//! a placement costs its tenants over a stream of arrivals ([`stream`]).

pub mod characterize;
pub mod corun;
pub mod plot;
pub mod predict;
pub mod stream;
