//! ONNX models compiled to vNPU programs (`vnpu compile`,
//! `docs/compiled-model-format.md`).
//!
//! [`load`] reads the protobuf (through the `onnx-protobuf` crate);
//! [`compile`] folds constants, fuses, lowers with the workload library's
//! tiled lowering and packs a [`vnpu_abi::compiled_model::Model`].

pub mod compile;
pub mod host;
pub mod load;
pub mod ml;
mod refusal;
pub use npu_infer_io::npy;

pub mod operators;
pub use compile::{
    compile, compile_file, compile_model, CompileError, CompileOptions, CompileReport, Compiled,
};
pub use load::{load, load_from, LoadError, OnnxModel};
pub use refusal::Refusal;
