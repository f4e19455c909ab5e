//! Calibrates the host-work units (`npu_model::timing::host_work`) on this
//! machine: each instruction kind four times on the functional model,
//! wall time per unit. `cargo run --release -p npu-model --example host_work`
//! (`docs/isolation.md`).
use npu_model::timing::host_work;
use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Sram, VecGuestMemory};
use vnpu_abi::*;
/// A 3x3, stride-1, padding-1 geometry over an `hw` x `hw` image of `c` channels.
fn same_3x3(hw: u32, c: u32) -> ConvGeom {
    ConvGeom {
        n: 1,
        h: hw,
        w: hw,
        cin: c,
        cout: c,
        kh: 3,
        kw: 3,
        stride_h: 1,
        stride_w: 1,
        pad_top: 1,
        pad_bottom: 1,
        pad_left: 1,
        pad_right: 1,
    }
}

fn main() {
    let cfg = BoardConfig::default();
    let cases: Vec<(&str, Instr, Engine)> = vec![
        ("exp 2^20", Instr::VUnary { op: UnOp::Exp, src: 0, dst: 8 << 20, len: 1 << 20 }, Engine::vu(0)),
        ("relu 2^20", Instr::VUnary { op: UnOp::Relu, src: 0, dst: 8 << 20, len: 1 << 20 }, Engine::vu(0)),
        (
            "softmax 1024x1024",
            Instr::VSoftmax { src: 0, dst: 8 << 20, rows: 1024, cols: 1024 },
            Engine::vu(0),
        ),
        (
            "matmul 512^3",
            Instr::MatMul {
                dtype: DType::F32,
                flags: MatFlags::default(),
                a: 0,
                b: 1 << 20,
                c: 2 << 20,
                m: 512,
                k: 512,
                n: 512,
                lda: 512,
                ldb: 512,
                ldc: 512,
            },
            Engine::sa(0),
        ),
        (
            "matmul 1024x64x1024 bf16",
            Instr::MatMul {
                dtype: DType::Bf16,
                flags: MatFlags::default(),
                a: 0,
                b: 1 << 20,
                c: 2 << 20,
                m: 1024,
                k: 64,
                n: 1024,
                lda: 64,
                ldb: 1024,
                ldc: 1024,
            },
            Engine::sa(0),
        ),
        (
            "dma 16MiB",
            Instr::DmaCopy {
                src: Addr::hbm(0),
                dst: Addr::sram(0),
                rows: 1,
                row_bytes: 16 << 20,
                src_stride: 0,
                dst_stride: 0,
            },
            Engine::DMA,
        ),
        (
            "dma 64K rows of 64B",
            Instr::DmaCopy {
                src: Addr::hbm(0),
                dst: Addr::sram(0),
                rows: 65536,
                row_bytes: 64,
                src_stride: 128,
                dst_stride: 64,
            },
            Engine::DMA,
        ),
        (
            "pool 3x3",
            Instr::VPool {
                op: PoolOp::Max,
                src: 0,
                dst: 8 << 20,
                geom: PoolGeom { n: 1, h: 256, w: 256, c: 16, kh: 3, kw: 3, stride: 1, pad: 1 },
            },
            Engine::vu(0),
        ),
        (
            "depthwise 3x3",
            Instr::VDepthwise { src: 0, weights: 7 << 20, dst: 8 << 20, geom: same_3x3(256, 16) },
            Engine::vu(0),
        ),
        (
            "conv 3x3 64->64 64x64",
            Instr::Conv2d {
                dtype: DType::F32,
                flags: MatFlags::default(),
                input: 0,
                weights: 2 << 20,
                output: 4 << 20,
                geom: same_3x3(64, 64),
            },
            Engine::sa(0),
        ),
        (
            "reduce 1024x1024",
            Instr::VReduce { op: RedOp::Sum, src: 0, dst: 8 << 20, outer: 1024, reduce: 1024, inner: 1 },
            Engine::vu(0),
        ),
        (
            "layernorm 1024x1024",
            Instr::VLayerNorm {
                src: 0,
                dst: 8 << 20,
                gamma: 12 << 20,
                beta: 13 << 20,
                rows: 1024,
                cols: 1024,
                eps: 1e-5,
            },
            Engine::vu(0),
        ),
    ];
    for (name, i, e) in cases {
        let mut p = ProgramBuilder::new();
        for _ in 0..4 {
            p.push(e, i);
        }
        let prog = p.finish();
        let (mut sram, mut hbm, mut guest) =
            (Sram::new(32 << 20), LazyHbm::new(1 << 30), VecGuestMemory::new(0, 4096));
        let t0 = std::time::Instant::now();
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
        let r = run_program(&cfg, &prog, Some(mem), None);
        let dt = t0.elapsed().as_secs_f64();
        let units = 4 * host_work(&i);
        println!(
            "{name:<28} {:>12} units {:>9.3} ms {:>8.3} ns/unit ok={}",
            units,
            dt * 1e3,
            dt * 1e9 / units as f64,
            r.is_ok()
        );
    }
}
