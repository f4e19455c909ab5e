//! Interference between co-located vNPUs (docs/interference.md):
//! characterized on the board model ([`corun`], [`characterize`]),
//! predicted from each workload's solo counters ([`predict`]).

pub mod characterize;
pub mod corun;
pub mod plot;
pub mod predict;
