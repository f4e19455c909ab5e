//! The vNPU manager's bookkeeping, modelled on `mdevctl`
//! (`docs/management.md`): named types per physical board, instances
//! named by UUID that are defined (persistent) and/or active (started and
//! placed on physical cores), and a state file written atomically so a
//! crash mid-write loses nothing and corrupts nothing.

// Everything here handles what a client sent: no silent narrowing casts.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

pub mod control;
mod store;

pub use control::{
    shape_text, ControlClient, ControlError, CoreUse, Outcome, PlaceOptions, Request, TenantUse,
};
pub use store::{Store, StoreError};
// What the manager's requests and replies carry, from the crates that own it.
pub use vnpu_placement::{InterferenceError, PlacementError, Policy};
pub use vnpu_spec::{split_for_ratio, Borrow, Instance, Qos, Shape, Workload, TYPES};
