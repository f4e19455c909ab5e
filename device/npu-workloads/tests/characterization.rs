//! The workload library reproduces the design's characterization, and
//! every real workload runs functionally to finite results.
#![allow(clippy::unwrap_used)]

use npu_model::BoardConfig;
use npu_workloads::{run_workload, RunOptions, WORKLOADS};

fn opts(w: &str, batch: u32, functional: bool) -> RunOptions {
    RunOptions { functional, seed: 3, ..RunOptions::timing(w, batch) }
}

/// On 1 SA + 1 VU of the default board (`tpu-v4-derived`: a VU of 256
/// lanes, a quarter of the v4 core's vector unit), f32: BERT, ResNet-50
/// and the Transformer keep their SA busy 2.5-3.8 times as long as their
/// VU (`docs/workloads.md`, "Characterization"; the design's "often by
/// 10x" was the 1024-lane VU of the old built-in board), DLRM its VU
/// longer than its SA.
#[test]
fn sa_heavy_and_vu_heavy_workloads_on_one_sa_and_one_vu() {
    let b = BoardConfig::default();
    for batch in [1, 8, 32] {
        for w in ["bert", "resnet50", "transformer"] {
            let r = run_workload(&b, &opts(w, batch, false)).unwrap();
            assert!(
                r.sa_active_cycles > 2 * r.vu_active_cycles,
                "{w} b{batch}: SA {} VU {}",
                r.sa_active_cycles,
                r.vu_active_cycles
            );
        }
        let r = run_workload(&b, &opts("dlrm", batch, false)).unwrap();
        assert!(
            r.vu_active_cycles > r.sa_active_cycles,
            "dlrm b{batch}: SA {} VU {}",
            r.sa_active_cycles,
            r.vu_active_cycles
        );
    }
}

#[test]
fn more_engines_never_slow_a_workload_down() {
    let b = BoardConfig::default();
    for (w, _) in WORKLOADS {
        let one = run_workload(&b, &opts(w, 8, false)).unwrap();
        let four = run_workload(&b, &RunOptions { sa: 4, vu: 4, ..opts(w, 8, false) }).unwrap();
        assert!(
            four.simulated_cycles <= one.simulated_cycles,
            "{w}: 1+1 {} cycles, 4+4 {}",
            one.simulated_cycles,
            four.simulated_cycles
        );
    }
}

#[test]
fn every_workload_runs_functionally() {
    let b = BoardConfig::default();
    for (w, _) in WORKLOADS {
        let r = run_workload(&b, &RunOptions { sa: 2, vu: 2, ..opts(w, 1, true) }).unwrap();
        assert_eq!(r.output_finite, Some(true), "{w}");
        // Timing does not depend on whether arithmetic is done.
        let t = run_workload(&b, &RunOptions { sa: 2, vu: 2, ..opts(w, 1, false) }).unwrap();
        assert_eq!(t.simulated_cycles, r.simulated_cycles, "{w}");
    }
}
