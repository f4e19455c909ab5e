//! The vNPU instruction set, program container and guest ABI.
//!
//! This crate is `no_std` (with `alloc`) so that the device model, the
//! hypervisor's verifier and guest drivers share exactly one definition of
//! the ISA. The encoding is written down in `docs/isa.md`.
//!
//! - [`isa`]: instructions, their binary encoding and a total decoder.
//! - [`program`]: the program container (one instruction stream per engine)
//!   and a builder.
//! - [`compiled_model`]: the compiled-model container (`vnpu compile`'s output).
//! - [`footprint`]: the memory ranges each instruction reads and writes,
//!   computed with overflow-checked arithmetic, for static bounds checking.
#![no_std]

extern crate alloc;

pub mod compiled_model;
pub mod device;
pub mod footprint;
pub mod isa;
pub mod program;

pub use footprint::{Access, AccessKind, FootprintError};
pub use isa::{
    Addr, Bcast, BinOp, ConvGeom, DType, DecodeError, Engine, EngineKind, Instr, MatFlags, PoolGeom, PoolOp,
    RedOp, Space, UnOp,
};
pub use program::{Program, ProgramBuilder, ProgramError, Stream};
