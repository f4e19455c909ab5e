//! Published TPU inference figures the timing model is validated against
//! (`docs/npu-model.md`, "Validation against hardware"), each with the
//! conditions it was measured under, and the runner that puts the model
//! beside them on a preset board or the board derived from it.
//!
//! Every anchor runs on one whole core of its board, lowered as the
//! board's `[lowering]` table says (the presets: as XLA lowers for a TPU).
//! No parameter of the model or the boards was fitted to these figures;
//! `docs/npu-model.md` keeps the table of every anchor before and after
//! each change of the model or the lowering.

use npu_model::presets;
use npu_model::BoardConfig;
use serde::Serialize;
use thiserror::Error;

use crate::run::{run_workload, RunError, RunOptions, RunReport};

/// What an anchor's published figure counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Measure {
    /// Items (images, samples) per second of one core: `batch / time`.
    ItemsPerSecond,
    /// Seconds one run of the workload takes.
    Seconds,
}

/// One published figure.
#[derive(Clone, Debug, Serialize)]
pub struct Anchor {
    /// A short stable name (`resnet50-v3-offline`).
    pub id: &'static str,
    /// The library workload (`docs/workloads.md`).
    pub workload: &'static str,
    /// Batch per core, as the submission ran it.
    pub batch: u32,
    /// The preset board of the chip it was measured on (`docs/boards/`).
    pub preset: &'static str,
    pub measure: Measure,
    /// The published figure, per core.
    pub published: f64,
    /// Where it comes from and how the per-core figure follows from it.
    pub source: &'static str,
}

/// The anchors, every published TPU inference figure found with enough
/// detail to reproduce its conditions (what was left out and why:
/// `docs/npu-model.md`).
pub const ANCHORS: &[Anchor] = &[
    Anchor {
        id: "resnet50-v3-offline",
        workload: "resnet50",
        batch: 256,
        preset: "tpu-v3",
        measure: Measure::ItemsPerSecond,
        published: 4089.5,
        source: "MLPerf Inference v0.5, closed, Google, tpu-v3.8 (4 chips, 8 cores), ResNet-50 v1.5 \
                 Offline: 32,716 samples/s (results/tpu-v3.8x1/resnet/offline), bf16, batch 256 \
                 per TPUPartitionedCall, i.e. per core: 32,716 / 8",
    },
    Anchor {
        id: "ssd-resnet34-v3-offline",
        workload: "ssd-resnet34",
        batch: 128,
        preset: "tpu-v3",
        measure: Measure::ItemsPerSecond,
        published: 82.05,
        source: "MLPerf Inference v0.5, closed, Google, tpu-v3.8, SSD-ResNet34 1200x1200 \
                 (ssd-large) Offline: 656.439 samples/s (results/tpu-v3.8x1/ssd-large/offline), \
                 bf16, batch 128 per TPUPartitionedCall (the measurement README's settings), \
                 i.e. per core: 656.439 / 8; top-k and NMS run on the TPU too",
    },
    Anchor {
        id: "gemm-8192-v5e",
        workload: "gemm-8192x8192x8192",
        batch: 1,
        preset: "tpu-v5e",
        measure: Measure::Seconds,
        published: 6.047e-3,
        source: "JAX, Pallas TPU matmul guide (docs/pallas/tpu/matmul), XLA's jnp.matmul, bf16 \
                 8192^3 on one TPU v5e: 6.047 ms (timeit over 100 calls)",
    },
    Anchor {
        id: "gemm-4096-v5e",
        workload: "gemm-4096x4096x4096",
        batch: 1,
        preset: "tpu-v5e",
        measure: Measure::Seconds,
        published: 0.827e-3,
        source: "JAX, Pallas TPU matmul guide, XLA's jnp.matmul, bf16 4096^3 on one TPU v5e: \
                 0.827 ms (timeit over 100 calls; dispatch included)",
    },
];

/// An anchor that could not run.
#[derive(Debug, Error)]
pub enum AnchorError {
    #[error("board `{0}` is not one of npu_model::presets::PRESETS")]
    NoBoard(String),
    #[error("board `{name}`: {source}")]
    Board {
        name: String,
        #[source]
        source: npu_model::config::ConfigError,
    },
    #[error("anchor {id}: {source}")]
    Run {
        id: &'static str,
        #[source]
        source: RunError,
    },
}

/// The model beside one anchor.
#[derive(Clone, Debug, Serialize)]
pub struct AnchorRun {
    pub id: &'static str,
    pub board: String,
    pub measure: Measure,
    pub published: f64,
    /// The model's figure, in the anchor's measure.
    pub model: f64,
    /// The model's figure over the published one (as `docs/npu-model.md`
    /// tabulates it): above 1, the model counts more items per second or
    /// more seconds than the hardware.
    pub ratio: f64,
    /// Seconds the SAs' work would take at their peak, all SAs busy
    /// (the compute roofline).
    pub sa_bound_seconds: f64,
    /// Seconds the DMA bytes would take at the core's DMA rate (the
    /// memory roofline).
    pub dma_bound_seconds: f64,
    pub run: RunReport,
}

impl AnchorRun {
    /// The model's time over the published time: above 1 the model is
    /// slower than the hardware, whichever the measure.
    pub fn time_ratio(&self) -> f64 {
        match self.measure {
            Measure::ItemsPerSecond => self.published / self.model,
            Measure::Seconds => self.model / self.published,
        }
    }
}

/// The board called `name` (`npu_model::presets`).
pub fn board(name: &str) -> Result<BoardConfig, AnchorError> {
    presets::preset(name)
        .ok_or_else(|| AnchorError::NoBoard(name.into()))?
        .map_err(|source| AnchorError::Board { name: name.into(), source })
}

/// Runs `a` on one whole core of `board` (its preset, or a board derived
/// from it), lowered as the board's `[lowering]` table says.
pub fn run_anchor(a: &Anchor, board: &BoardConfig) -> Result<AnchorRun, AnchorError> {
    let o = RunOptions {
        sa: board.core.sa_count,
        vu: board.core.vu_count,
        ..RunOptions::on_board(board, a.workload, a.batch)
    };
    let run = run_workload(board, &o).map_err(|source| AnchorError::Run { id: a.id, source })?;
    let model = match a.measure {
        Measure::ItemsPerSecond => f64::from(a.batch) / run.simulated_seconds,
        Measure::Seconds => run.simulated_seconds,
    };
    let sa_peak =
        board.sa_peak_flops_per_cycle() * f64::from(board.core.sa_count) * f64::from(board.clock_mhz) * 1e6;
    Ok(AnchorRun {
        id: a.id,
        board: board.name.clone(),
        measure: a.measure,
        published: a.published,
        model,
        ratio: model / a.published,
        sa_bound_seconds: run.sa_flops as f64 / sa_peak,
        dma_bound_seconds: run.dma_bytes as f64 / (board.dma.gbps * 1e9),
        run,
    })
}
