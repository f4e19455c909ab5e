//! The timing model against published hardware figures (docs/npu-model.md,
//! "Validation"), on the board presets of `docs/boards/`, whose every value
//! comes from a published source named in the file. Simulated time is
//! deterministic, so these hold the model, not the machine running them.
#![allow(clippy::unwrap_used)]

use npu_model::BoardConfig;
use npu_workloads::{run_workload, RunOptions};
use vnpu_abi::DType;

fn preset(name: &str) -> BoardConfig {
    let path = format!("{}/../../docs/boards/{name}.toml", env!("CARGO_MANIFEST_DIR"));
    BoardConfig::load(std::path::Path::new(&path)).unwrap()
}

/// `|model / published - 1| <= band`, NaN failing.
fn within(what: &str, model: f64, published: f64, band: f64) {
    let ratio = model / published;
    assert!(
        (ratio - 1.0).abs() <= band,
        "{what}: model {model:.4e} against published {published:.4e}: ratio {ratio:.3}"
    );
}

/// XLA's bf16 matrix products on one TPU v5e core, as JAX's Pallas TPU
/// matmul guide reports them: 8192^3 in 6.047 ms (92.3% of the v5e's
/// peak) and 4096^3 in 0.827 ms (84.3%). The model, on the whole core
/// (4 MXUs, its one vector unit), bf16 operands, weights streamed within
/// the product: within 15%.
#[test]
fn bf16_matrix_products_on_a_v5e_core_take_what_xla_takes() {
    let board = preset("tpu-v5e");
    for (size, published_s) in [(8192u32, 6.047e-3), (4096, 0.827e-3)] {
        // The preset's `[lowering]`: bf16, weights streamed.
        let o = RunOptions {
            sa: board.core.sa_count,
            vu: board.core.vu_count,
            ..RunOptions::on_board(&board, format!("gemm-{size}x{size}x{size}"), 1)
        };
        assert!(o.dtype == DType::Bf16 && o.stream_weights);
        let r = run_workload(&board, &o).unwrap();
        within(&format!("gemm {size}^3 bf16 on tpu-v5e"), r.simulated_seconds, published_s, 0.15);
    }
}

/// MLPerf Inference v0.5, closed division, Google: ResNet-50 Offline on
/// TPU v3 at 4,089.5 images/s per TensorCore (bf16, batch 256 per core,
/// one model copy per core). The model, on one whole core of the v3
/// preset, as XLA runs it: bf16 weights and activations, residual adds
/// fused into the convolutions, HBM reused by liveness, weights streamed,
/// activations that fit kept on chip: within 15%.
#[test]
fn resnet50_on_a_v3_core_runs_what_mlperf_measured() {
    let board = preset("tpu-v3");
    // The preset's `[lowering]` says exactly that.
    let o = RunOptions {
        sa: board.core.sa_count,
        vu: board.core.vu_count,
        ..RunOptions::on_board(&board, "resnet50", 256)
    };
    assert!(
        o.dtype == DType::Bf16
            && o.bf16_activations
            && o.fuse_residual
            && o.reuse_hbm
            && o.stream_weights
            && o.keep_on_chip
    );
    let r = run_workload(&board, &o).unwrap();
    within("ResNet-50 b256 bf16 on tpu-v3 (images/s)", 256.0 / r.simulated_seconds, 4089.5, 0.15);
}

/// bf16 products on several SAs run side by side: the VU that converts a
/// tile's operands also post-processes one lane, and must not hold the
/// other lanes' SAs back behind that lane (they once waited, one after the
/// other: BERT on 4 SA + 4 VU took 2.38 ms in bf16 against 1.89 ms in f32).
#[test]
fn bf16_lanes_do_not_wait_for_each_other() {
    let board = BoardConfig::default();
    let run = |dtype| {
        let o = RunOptions { sa: 4, vu: 4, dtype, ..RunOptions::timing("bert", 1) };
        run_workload(&board, &o).unwrap()
    };
    let (f32_run, bf16_run) = (run(DType::F32), run(DType::Bf16));
    assert!(
        bf16_run.simulated_seconds <= f32_run.simulated_seconds,
        "bf16 {} s against f32 {} s",
        bf16_run.simulated_seconds,
        f32_run.simulated_seconds
    );
    let v5e = preset("tpu-v5e");
    let o = RunOptions { sa: 4, vu: 1, dtype: DType::Bf16, ..RunOptions::timing("gemm-4096x4096x4096", 1) };
    let r = run_workload(&v5e, &o).unwrap();
    assert!(r.sa_utilization > 0.8, "four SAs fed by one VU: utilization {}", r.sa_utilization);
}

/// Row tiles of one bf16 product alternate between two SAs, and the one
/// VU both converts each tile's operands and post-processes each result.
/// The VU converts tile `t + 1` before it post-processes tile `t` (which
/// waits for tile `t`'s SA); in the other order each SA's next tile
/// waited for the other SA, and the two ran one after the other (SA
/// utilization 44%, with HBM fast enough that only the SAs could limit).
#[test]
fn one_vu_feeds_two_sas_side_by_side() {
    let mut board = preset("tpu-v3");
    board.dma.gbps *= 100.0;
    board.hbm.channel_gbps *= 100.0;
    let o = RunOptions { sa: 2, vu: 1, dtype: DType::Bf16, ..RunOptions::timing("gemm-16384x1024x128", 1) };
    let r = run_workload(&board, &o).unwrap();
    assert!(r.sa_utilization > 0.8, "two SAs fed by one VU: utilization {}", r.sa_utilization);
}
