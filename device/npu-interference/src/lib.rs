//! Interference between co-located vNPUs (docs/interference.md):
//! characterized on the board model ([`corun`], [`characterize`]),
//! predicted from each workload's solo counters ([`predict`]), and what
//! a placement costs its tenants over a stream of arrivals ([`stream`]).
//! The command, the random forest and the plots are in `eval/interference-eval`.

pub mod characterize;
pub mod corun;
pub mod matrix_file;
pub mod predict;
pub mod stream;
