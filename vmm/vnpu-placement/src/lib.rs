//! Placement of vNPUs on a board's physical cores (`docs/management.md`,
//! "Placement"): the board's free execution units and memory per core,
//! the packing policies, oversubscription and remapping, and the
//! interference-aware policy that prices each candidate core with a
//! predictor trained on a characterization of the board
//! (`docs/interference.md`).
//!
//! The manager's store calls it on `start`, `remap` and placement changes;
//! the placement evaluation (`eval/placement-eval`) drives the same
//! policies over simulated streams of vNPUs.

mod interference;
mod placement;

pub use interference::{predicted_slowdowns, spec_of, InterferenceError, InterferenceModel};
/// The learners [`InterferenceModel`] takes: the daemon prices with [`Linear`].
pub use npu_interference::predict::{Learner, Linear};
pub use placement::{Board, CoreLoad, Placement, PlacementError, Policy};
