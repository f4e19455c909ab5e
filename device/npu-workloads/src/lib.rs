//! The workload library: layer graphs of published DNNs ([`zoo`]), and a
//! runner that lowers one by name for a vNPU shape and executes it on the
//! NPU model (timing only, or functionally on seeded random data).
//!
//! The IR the networks are written in is `npu-graph`; the code generator
//! is `npu-lower`.

pub mod anchors;
pub mod run;
pub mod zoo;

pub use run::{init_hbm, lower_workload, run_workload, RunError, RunOptions, RunReport};
pub use zoo::{build, MORE_WORKLOADS, WORKLOADS};
