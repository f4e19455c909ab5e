//! The board daemon (`docs/vfio-user.md`): one process owns one modelled
//! NPU board and serves each started vNPU instance to a VMM in another
//! process as a vfio-user PCI device, as a mediated device's parent
//! driver serves its instances.

pub mod backend;
pub mod serve;

pub use backend::{irqs, regions, BackendError, VnpuBackend};
pub use serve::{InstanceServer, ServeError};
