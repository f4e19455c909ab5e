//! The board daemon (`docs/vfio-user.md`): one process owns one modelled
//! NPU board and serves each started vNPU instance to a VMM in another
//! process as a vfio-user PCI device, as a mediated device's parent
//! driver serves its instances.

// Everything here handles what a client sent: no silent narrowing casts.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

mod accept;
pub mod backend;
pub mod daemon;
pub mod dma;
pub mod fault;
mod http;
pub mod metrics;
pub mod migration;
pub mod peer;
pub mod seccomp;
pub mod serve;
mod slots;

pub use backend::{irqs, regions, BackendError, ReleaseRequest, VnpuBackend};
pub use daemon::{
    run, stop_on_signals, DaemonError, DaemonOptions, DEFAULT_CONTROL_IDLE, DEFAULT_RELEASE_TIMEOUT,
};
pub use serve::{InstanceServer, ServeError};
