//! The software NPU behind every vNPU.
//!
//! - [`config`]: the physical board, from TOML.
//! - [`memory`]: SRAM, lazily backed HBM, guest memory views.
//! - [`kernels`]: functional execution of each instruction (the SA's
//!   arithmetic is the `gemm` crate).
//! - [`timing`]: cycle cost of each instruction.
//! - [`sim`]: event-driven execution of programs on a core, with
//!   semaphores, HBM contention and counters.
//! - [`verify`]: static bounds checking against a vNPU's segments.

pub mod config;
pub mod kernels;
pub mod memory;
pub mod sim;
pub mod timing;
pub mod verify;

pub use config::BoardConfig;
pub use kernels::CoreMemory;
pub use memory::{LazyHbm, Memory, Sram, VecGuestMemory};
pub use sim::{
    run_core, run_program, run_program_on, BoardSim, Contention, CoreReport, CoreSim, EngineStats, ExecError,
    Finished, SimTenant, Tenant, TenantReport, Totals,
};
pub use verify::{verify, VerifyError, VnpuLimits};
