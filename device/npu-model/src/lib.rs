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
pub mod erff;
pub mod kernels;
pub mod memory;
pub mod presets;
mod scratch;
pub mod sim;
pub mod tanhf;
pub mod timing;
pub mod verify;

pub use config::BoardConfig;

/// Keeps freed memory in the process (glibc): the model allocates large
/// scratch buffers per instruction (im2col chunks, outputs), and handing
/// them back to the kernel after each one turns the next one's first
/// touches into page faults, which cost microseconds apiece under nested
/// virtualization. Every binary that runs the model calls it first, so
/// that the `vnpu` binary (the VMM, the daemon, `vnpu infer`) and the
/// benchmarks that time the model (`onnx-bench`) run it the same way.
/// Call before any other thread exists.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; the caller runs
    // before any other thread exists, so no allocation races with it.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
pub use kernels::CoreMemory;
pub use memory::{LazyHbm, Memory, Sram, VecGuestMemory};
pub use sim::{
    run_core, run_program, run_program_on, BoardSim, Contention, CoreReport, CoreSim, EngineStats, ExecError,
    Finished, SimTenant, Tenant, TenantReport, Totals,
};
pub use verify::{verify, VerifyError, VnpuLimits};

/// Seeded xorshift generators for unit tests (Marsaglia 2003): the same
/// sequence for the same seed on every run.
#[cfg(test)]
pub(crate) mod test_rng {
    /// 32-bit xorshift (13, 17, 5).
    pub(crate) fn xorshift32(mut seed: u32) -> impl FnMut() -> u32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        }
    }

    /// 64-bit xorshift (13, 7, 17).
    pub(crate) fn xorshift64(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }
}
