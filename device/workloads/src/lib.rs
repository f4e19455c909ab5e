//! The workload library: layer graphs of published DNNs, lowered to
//! vNPU programs for a given vNPU shape, and a runner that executes them
//! on the NPU model (timing only, or functionally on random data).

pub mod graph;
pub mod lower;
pub mod reference;
pub mod run;

pub use graph::{build, Graph, MORE_WORKLOADS, WORKLOADS};
pub use lower::{lower, lower_as, lower_op, lower_ops, lower_ops_as, LowerError, Lowered, VnpuShape};
pub use run::{init_hbm, lower_workload, run_workload, RunError, RunOptions, RunReport};
