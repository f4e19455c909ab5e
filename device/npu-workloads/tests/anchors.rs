//! The timing model against published hardware figures (docs/npu-model.md,
//! "Validation"), on the board presets of `docs/boards/`, whose every value
//! comes from a published source named in the file. Simulated time is
//! deterministic, so these hold the model, not the machine running them.
#![allow(clippy::unwrap_used)]

use npu_model::presets;
use npu_model::BoardConfig;
use npu_workloads::anchors::{self, Anchor, ANCHORS};
use npu_workloads::{run_workload, RunOptions};
use vnpu_abi::DType;

fn preset(name: &str) -> BoardConfig {
    presets::preset(name).unwrap().unwrap()
}

/// `|model / reference - 1| <= band`, NaN failing.
fn within(what: &str, model: f64, reference: f64, band: f64) {
    let ratio = model / reference;
    assert!((ratio - 1.0).abs() <= band, "{what}: {model:.4e} against {reference:.4e}: ratio {ratio:.3}");
}

/// Every anchor's model / published ratio on its preset, whole core,
/// lowered as XLA runs it (the preset's `[lowering]`).
fn ratios_on(boards: impl Fn(&Anchor) -> String) -> Vec<(&'static str, f64, f64)> {
    ANCHORS
        .iter()
        .map(|a| {
            let b = anchors::board(&boards(a)).unwrap();
            let r = anchors::run_anchor(a, &b).unwrap();
            (a.id, r.ratio, r.run.simulated_seconds)
        })
        .collect()
}

/// The anchors that meet the +-15% target (docs/npu-model.md,
/// "Validation"); the others are findings, listed there with the
/// mechanism that the model lacks.
const HELD: &[&str] = &["resnet50-v3-offline", "gemm-8192-v5e", "gemm-4096-v5e"];

/// The held anchors within 15% of the published figure on their presets,
/// with no fitted parameter: XLA's bf16 GEMMs on a v5e core (JAX's Pallas
/// matmul guide) and MLPerf Inference v0.5's ResNet-50 Offline on a v3
/// core.
#[test]
fn anchors_hold_their_band_on_the_presets() {
    let board = preset("tpu-v5e");
    // The preset's `[lowering]`: bf16, weights streamed.
    let o = RunOptions::on_board(&board, "gemm-4096x4096x4096", 1);
    assert!(o.dtype == DType::Bf16 && o.stream_weights);
    let v3 = preset("tpu-v3");
    let o = RunOptions::on_board(&v3, "resnet50", 256);
    assert!(o.bf16_activations && o.fuse_residual && o.reuse_hbm && o.keep_on_chip);
    for (id, ratio, _) in ratios_on(|a| a.preset.to_string()) {
        if HELD.contains(&id) {
            within(id, ratio, 1.0, 0.15);
        }
    }
}

/// The derived boards are neutral for one tenant: a tenant holding the
/// whole derived core (its VUs together have the preset VU's lanes) runs
/// every anchor within 3% of the preset's time.
#[test]
fn a_whole_derived_core_runs_every_anchor_as_its_preset_does() {
    let on_preset = ratios_on(|a| a.preset.to_string());
    let on_derived = ratios_on(|a| presets::derived_of(a.preset).unwrap().to_string());
    for ((id, _, p), (_, _, d)) in on_preset.iter().zip(&on_derived) {
        within(&format!("{id}: derived / preset time"), *d, *p, 0.03);
    }
}

/// bf16 products on several SAs run side by side: the VU that converts a
/// tile's operands also post-processes one lane, and must not hold the
/// other lanes' SAs back behind that lane (they once waited, one after the
/// other: BERT on 4 SA + 4 VU took 2.38 ms in bf16 against 1.89 ms in f32).
#[test]
fn bf16_lanes_do_not_wait_for_each_other() {
    // The four-core test board's 1024-lane VUs, where it was seen failing.
    let board = BoardConfig::test_board();
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
