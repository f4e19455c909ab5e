//! Runs a workload on one vNPU core of the NPU model.

use std::time::Instant;

use serde::Serialize;
use thiserror::Error;
use vnpu_abi::{DType, EngineKind};

use npu_graph::Init;
use npu_lower::{lower_ops_with, LowerError, LowerOptions, Lowered, Placed, VnpuShape};

use crate::zoo::build;
use npu_model::config::NumType;
use npu_model::memory::{write_f32s, Memory};
use npu_model::{
    run_program, verify, BoardConfig, CoreMemory, ExecError, LazyHbm, Sram, VecGuestMemory, VerifyError,
    VnpuLimits,
};

/// What to run and on what.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub workload: String,
    pub batch: u32,
    pub sa: u32,
    pub vu: u32,
    /// SRAM of the vNPU core; the board's SRAM per core when `None`.
    pub sram_bytes: Option<u64>,
    /// HBM of the vNPU core; the board's HBM per core when `None`.
    pub hbm_bytes: Option<u64>,
    /// Also compute real results on random data (seeded).
    pub functional: bool,
    pub seed: u64,
    /// The SAs' operand type: with bf16 the weights of products are
    /// stored as bf16 and operands rounded to bf16 (f32 accumulation;
    /// `npu_lower::lower_as`).
    pub dtype: DType,
    /// Intermediate tensors share HBM by liveness
    /// (`npu_lower::LowerOptions::reuse_hbm`).
    pub reuse_hbm: bool,
    /// With bf16 operands, intermediate activations are stored as bf16
    /// (`npu_lower::LowerOptions::bf16_activations`).
    pub bf16_activations: bool,
    /// Residual adds fused into the convolution producing an operand
    /// (`npu_lower::LowerOptions::fuse_residual`).
    pub fuse_residual: bool,
    /// A product's weights streamed within the operation
    /// (`npu_lower::LowerOptions::stream_weights`).
    pub stream_weights: bool,
    /// Intermediate activations kept on chip when they fit
    /// (`npu_lower::LowerOptions::keep_on_chip`).
    pub keep_on_chip: bool,
}

impl RunOptions {
    /// `workload` at `batch` on 1 SA + 1 VU with the board's SRAM and HBM
    /// per core, timing only (seed 1): the profiling run, and the base the
    /// other shapes are written against (`RunOptions { sa, vu, ..timing }`).
    pub fn timing(workload: impl Into<String>, batch: u32) -> Self {
        Self {
            workload: workload.into(),
            batch,
            sa: 1,
            vu: 1,
            sram_bytes: None,
            hbm_bytes: None,
            functional: false,
            seed: 1,
            dtype: DType::F32,
            reuse_hbm: false,
            bf16_activations: false,
            fuse_residual: false,
            stream_weights: false,
            keep_on_chip: false,
        }
    }
}

impl RunOptions {
    /// [`RunOptions::timing`] lowered as `board` says programs for it are
    /// lowered unless told otherwise (its `[lowering]` table: operand type,
    /// activations, residual fusion, HBM reuse; `docs/board-config.md`).
    pub fn on_board(board: &BoardConfig, workload: impl Into<String>, batch: u32) -> Self {
        let l = &board.lowering;
        Self {
            dtype: match l.dtype {
                NumType::F32 => DType::F32,
                NumType::Bf16 => DType::Bf16,
            },
            bf16_activations: l.bf16_activations(),
            fuse_residual: l.fuse_residual,
            reuse_hbm: l.reuse_hbm,
            stream_weights: l.stream_weights,
            keep_on_chip: l.keep_on_chip,
            ..Self::timing(workload, batch)
        }
    }
}

/// A failed run.
#[derive(Debug, Error)]
pub enum RunError {
    #[error("unknown workload `{0}` (see `vnpu workload list`)")]
    Unknown(String),
    #[error(
        "vNPU asks for {sa} SAs and {vu} VUs; a core of this board has {board_sa} SAs and {board_vu} VUs"
    )]
    TooBig { sa: u32, vu: u32, board_sa: u32, board_vu: u32 },
    #[error(transparent)]
    Lower(#[from] LowerError),
    #[error("verifier refused the lowered program (a lowering bug): {0}")]
    Verify(#[from] VerifyError),
    #[error("execution failed: {0}")]
    Exec(#[from] ExecError),
    #[error("initialising HBM: {0}")]
    Memory(#[from] npu_model::memory::MemoryError),
}

/// Counters of one engine, for reports.
#[derive(Clone, Debug, Serialize)]
pub struct EngineReport {
    pub engine: String,
    pub instructions: u64,
    pub active_cycles: u64,
    pub stall_cycles: u64,
    pub flops: u64,
    pub bytes: u64,
}

/// The outcome of a run. Cycles and `simulated_seconds` are simulated NPU
/// time; `wall_*` fields are host time.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub workload: String,
    pub batch: u32,
    pub sa: u32,
    pub vu: u32,
    pub sram_bytes: u64,
    pub hbm_bytes: u64,
    pub instructions: usize,
    pub simulated_cycles: u64,
    pub simulated_seconds: f64,
    pub clock_mhz: u32,
    pub sa_active_cycles: u64,
    pub vu_active_cycles: u64,
    pub dma_active_cycles: u64,
    pub stall_cycles: u64,
    /// SA-active time over elapsed time, averaged over the vNPU's SAs.
    pub sa_utilization: f64,
    /// VU-active time over elapsed time, averaged over the vNPU's VUs.
    pub vu_utilization: f64,
    /// SA FLOPs over the SAs' peak FLOPs in the elapsed time.
    pub flops_utilization: f64,
    pub sa_flops: u64,
    pub vu_flops: u64,
    pub dma_bytes: u64,
    pub engines: Vec<EngineReport>,
    pub functional: bool,
    /// Sum of the output tensor (functional runs only).
    pub output_checksum: Option<f64>,
    /// Whether every output element is finite (functional runs only).
    pub output_finite: Option<bool>,
    pub wall_lower_seconds: f64,
    pub wall_run_seconds: f64,
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn init_tensor(hbm: &mut LazyHbm, p: &Placed, rng: &mut Rng) -> Result<(), RunError> {
    const CHUNK: u64 = 1 << 16;
    let (offset, elems, init) = (p.offset, p.elems, p.init);
    let mut done = 0;
    while done < elems {
        let n = CHUNK.min(elems - done);
        let at = offset + done * p.dtype.size();
        match init {
            Init::Activation | Init::Zeros | Init::State => {}
            Init::CausalMask { .. } => {
                let v: Vec<f32> = (done..done + n).map(|i| init.causal_mask(i).unwrap_or(0.0)).collect();
                write_f32s(hbm, at, &v)?;
            }
            Init::Indices { max } => {
                let v: Vec<u8> = (0..n)
                    .flat_map(|_| ((rng.next() % u64::from(max.max(1))) as u32).to_le_bytes())
                    .collect();
                hbm.write(at, &v)?;
            }
            _ => {
                let scale = match init {
                    Init::Weights { fan_in } => 1.0 / (fan_in.max(1) as f32).sqrt(),
                    Init::Bias => 0.1,
                    _ => 1.0,
                };
                let v: Vec<f32> =
                    (0..n).map(|_| if init == Init::Ones { 1.0 } else { rng.unit() * scale }).collect();
                match p.dtype {
                    DType::F32 => write_f32s(hbm, at, &v)?,
                    DType::Bf16 => {
                        let b: Vec<u8> =
                            v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
                        hbm.write(at, &b)?;
                    }
                }
            }
        }
        done += n;
    }
    Ok(())
}

/// Fills every tensor of `lowered` in `hbm` as its [`Init`] says, from a
/// generator seeded with `seed`.
pub fn init_hbm(lowered: &Lowered, hbm: &mut LazyHbm, seed: u64) -> Result<(), RunError> {
    let mut rng = Rng(seed);
    for p in &lowered.tensors {
        init_tensor(hbm, p, &mut rng)?;
    }
    Ok(())
}

/// Lowers workload `o.workload` for one vNPU core of `board` and verifies
/// the program against that core's limits.
pub fn lower_workload(board: &BoardConfig, o: &RunOptions) -> Result<(Lowered, VnpuShape, u32), RunError> {
    let graph = build(&o.workload, o.batch).ok_or_else(|| RunError::Unknown(o.workload.clone()))?;
    if o.sa > board.core.sa_count || o.vu > board.core.vu_count {
        return Err(RunError::TooBig {
            sa: o.sa,
            vu: o.vu,
            board_sa: board.core.sa_count,
            board_vu: board.core.vu_count,
        });
    }
    let sram_bytes = o.sram_bytes.unwrap_or(board.sram_bytes());
    let hbm_bytes = o.hbm_bytes.unwrap_or(board.hbm_bytes_per_chip() / u64::from(board.cores_per_chip));
    let shape = VnpuShape::on_board(board, o.sa, o.vu, sram_bytes, hbm_bytes);
    let options = LowerOptions {
        dtype: o.dtype,
        reuse_hbm: o.reuse_hbm,
        bf16_activations: o.bf16_activations,
        fuse_residual: o.fuse_residual,
        stream_weights: o.stream_weights,
        keep_on_chip: o.keep_on_chip,
        // Workload graphs are lowered op by op, as their calibrations were.
        fuse_blocks: false,
    };
    let lowered = lower_ops_with(&graph, 0..graph.ops.len(), shape, options)?;
    verify(
        &lowered.program,
        &VnpuLimits {
            sa: o.sa,
            vu: o.vu,
            sram_bytes,
            hbm_bytes,
            guest: Vec::new(),
            borrow_sa: 0,
            borrow_vu: 0,
        },
    )?;
    Ok((lowered, shape, graph.batch))
}

/// Lowers, verifies and runs a workload on one vNPU core of `board`.
pub fn run_workload(board: &BoardConfig, o: &RunOptions) -> Result<RunReport, RunError> {
    let t0 = Instant::now();
    let (lowered, VnpuShape { sram_bytes, hbm_bytes, .. }, batch) = lower_workload(board, o)?;
    let wall_lower_seconds = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let (report, checksum, finite) = if o.functional {
        let mut sram = Sram::new(sram_bytes);
        let mut hbm = LazyHbm::new(hbm_bytes);
        let mut guest = VecGuestMemory::new(0, 0);
        init_hbm(&lowered, &mut hbm, o.seed)?;
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
        let r = run_program(board, &lowered.program, Some(mem), None)?;
        let out = &lowered.tensors[lowered.output];
        let v = npu_model::memory::read_f32s(&hbm, out.offset, out.elems as usize)?;
        let sum: f64 = v.iter().map(|x| f64::from(*x)).sum();
        (r, Some(sum), Some(v.iter().all(|x| x.is_finite())))
    } else {
        (run_program(board, &lowered.program, None, None)?, None, None)
    };
    let wall_run_seconds = t1.elapsed().as_secs_f64();

    let t = report.totals();
    let cycles = report.cycles.max(1.0);
    let (mut sa_flops, mut vu_flops) = (0u64, 0u64);
    for e in &report.engines {
        match e.engine.kind {
            EngineKind::Sa => sa_flops += e.flops,
            EngineKind::Vu => vu_flops += e.flops,
            EngineKind::Dma => {}
        }
    }
    let peak = board.sa_peak_flops_per_cycle() * f64::from(o.sa) * cycles;
    Ok(RunReport {
        workload: o.workload.clone(),
        batch,
        sa: o.sa,
        vu: o.vu,
        sram_bytes,
        hbm_bytes,
        instructions: lowered.program.instruction_count(),
        simulated_cycles: report.cycles.ceil() as u64,
        simulated_seconds: report.cycles / (f64::from(board.clock_mhz) * 1e6),
        clock_mhz: board.clock_mhz,
        sa_active_cycles: t.sa_active_cycles.round() as u64,
        vu_active_cycles: t.vu_active_cycles.round() as u64,
        dma_active_cycles: t.dma_active_cycles.round() as u64,
        stall_cycles: t.stall_cycles.round() as u64,
        sa_utilization: t.sa_active_cycles / (cycles * f64::from(o.sa)),
        vu_utilization: t.vu_active_cycles / (cycles * f64::from(o.vu)),
        flops_utilization: sa_flops as f64 / peak,
        sa_flops,
        vu_flops,
        dma_bytes: t.bytes,
        engines: report
            .engines
            .iter()
            .map(|e| EngineReport {
                engine: e.engine.to_string(),
                instructions: e.instructions,
                active_cycles: e.active_cycles.round() as u64,
                stall_cycles: e.stall_cycles.round() as u64,
                flops: e.flops,
                bytes: e.bytes,
            })
            .collect(),
        functional: o.functional,
        output_checksum: checksum,
        output_finite: finite,
        wall_lower_seconds,
        wall_run_seconds,
    })
}
