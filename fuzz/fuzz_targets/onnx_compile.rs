//! The ONNX compiler (`vnpu compile`, docs/compiled-model-format.md) on any bytes:
//! reading the protobuf, shape inference, constant folding, fusion and
//! lowering never panic and never allocate past the compiler's tensor
//! limit; whatever compiles is accepted by the verifier (the compiler
//! checks) and its file decodes to the same model, with f32 and with bf16
//! SA operands, and as spread programs (`--spread 1,1`); with residual
//! adds fused and not.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use npu_onnx::{compile, CompileOptions};
use npu_lower::VnpuShape;
use vnpu_abi::compiled_model::Model;
use vnpu_abi::DType;

fuzz_target!(|data: &[u8]| {
    let cases = [
        (DType::F32, false, None, true, true, true),
        (DType::F32, false, None, false, false, false),
        (DType::Bf16, false, None, true, true, true),
        (DType::Bf16, true, None, true, true, true),
        (DType::F32, false, Some((1, 1)), true, true, true),
    ];
    for (dtype, bf16_activations, spread, reuse_hbm, fuse_residual, fuse_blocks) in cases {
        let opts = CompileOptions {
            shape: VnpuShape { sa: 2, vu: 2, sram_bytes: 1 << 20, hbm_bytes: 64 << 20, sa_rows: 16, sa_cols: 16 },
            batch: 2,
            shapes: HashMap::new(),
            outputs: None,
            dtype,
            bf16_activations,
            spread,
            reuse_hbm,
            fuse_residual,
            fuse_blocks,
        };
        let Ok(c) = compile(data, &opts) else { break };
        let again = Model::decode(&c.model.encode()).expect("a compiled model encodes to a valid file");
        assert_eq!(again, c.model);
    }
});
