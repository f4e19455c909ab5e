//! The generic model runner's device side, shared by the bare-metal runner
//! guest (`guest-images/infer`) and the Linux binary `vnpu-infer`
//! (`docs/inference-guests.md`): check that the vNPU is large enough for a
//! compiled model, place its I/O window in DMA memory, relocate both
//! programs to it, run the load program once, register the infer program
//! (verified once by the hypervisor), and then run one batch at a time.

use alloc::format;
use alloc::string::String;
use vnpu_abi::device::StatusBlock;
use vnpu_abi::model::{relocate, Model, Target};
use vnpu_driver::{Bar, DmaBuf, DmaRegion, Hierarchy, ProgramHandle, RunOptions, Vnpu, Wait};

/// A model whose weights are in the vNPU's memory and whose infer program
/// is registered.
#[derive(Debug)]
pub struct Loaded {
    handle: ProgramHandle,
    /// The I/O window (weight image, inputs, outputs) in DMA memory.
    pub window: DmaBuf,
    opts: RunOptions,
}

/// Why the vNPU cannot take a model compiled for `t`, if it cannot.
pub fn check_target(hw: &Hierarchy, t: &Target) -> Result<(), String> {
    if hw.sa_per_core < t.sa
        || hw.vu_per_core < t.vu
        || hw.sram_per_core < t.sram_bytes
        || hw.hbm_per_core < t.hbm_bytes
    {
        return Err(format!(
            "the model was compiled for {} SA, {} VU, {} KiB SRAM, {} MiB HBM; this vNPU core has {} SA, {} VU, {} KiB, {} MiB",
            t.sa,
            t.vu,
            t.sram_bytes >> 10,
            t.hbm_bytes >> 20,
            hw.sa_per_core,
            hw.vu_per_core,
            hw.sram_per_core >> 10,
            hw.hbm_per_core >> 20
        ));
    }
    Ok(())
}

/// The bytes of one batch's inputs (all of them, in the model's order) and
/// of its outputs, or `None` when a size overflows.
pub fn batch_bytes(model: &Model) -> Option<(u64, u64)> {
    let sum =
        |ts: &[vnpu_abi::model::TensorDesc]| ts.iter().try_fold(0u64, |acc, t| acc.checked_add(t.bytes()?));
    Some((sum(&model.inputs)?, sum(&model.outputs)?))
}

/// Checks the vNPU against the model, takes the I/O window from `dma`,
/// writes the weight image into it, relocates the programs to it (so
/// `model`'s programs change), runs the load program and registers the
/// infer program.
pub fn load<B: Bar>(
    npu: &mut Vnpu<B>,
    dma: &mut DmaRegion,
    model: &mut Model,
    weights: &[u8],
    wait: Wait,
) -> Result<Loaded, String> {
    check_target(&npu.hierarchy(), &model.target)?;
    let window = dma
        .alloc(model.window_bytes as usize, 4096)
        .map_err(|e| format!("the I/O window of {} bytes: {e}", model.window_bytes))?;
    if weights.len() > window.len {
        return Err(format!("{} bytes of weights do not fit the {}-byte window", weights.len(), window.len));
    }
    window.write(0, weights);
    relocate(&mut model.load, window.phys)
        .and_then(|_| relocate(&mut model.infer, window.phys))
        .map_err(|e| format!("{e}"))?;
    let opts = RunOptions { wait, ..Default::default() };
    npu.load(dma, &model.load.encode())
        .and_then(|p| npu.run(&p, &opts))
        .map_err(|e| format!("loading the weights: {e}"))?;
    let handle = npu
        .load(dma, &model.infer.encode())
        .and_then(|p| npu.register(&p))
        .map_err(|e| format!("registering the infer program: {e}"))?;
    Ok(Loaded { handle, window, opts })
}

impl Loaded {
    /// Runs one batch: copies `inputs` (one batch of every input, in the
    /// model's order) into the window, runs the infer program and copies
    /// the outputs into `outputs` (the same layout). `clock` times the
    /// request (whatever unit it counts in); returns that time and the
    /// device's status block.
    pub fn run<B: Bar>(
        &self,
        npu: &mut Vnpu<B>,
        model: &Model,
        inputs: &[u8],
        outputs: &mut [u8],
        clock: &dyn Fn() -> u64,
    ) -> Result<(u64, StatusBlock), String> {
        let (ib, ob) = batch_bytes(model).ok_or("tensor sizes overflow")?;
        if inputs.len() as u64 != ib || outputs.len() as u64 != ob {
            return Err(format!(
                "a batch is {ib} bytes of inputs and {ob} of outputs; got {} and {}",
                inputs.len(),
                outputs.len()
            ));
        }
        let mut at = 0;
        for d in &model.inputs {
            let n = d.bytes().unwrap_or(0) as usize;
            self.window.write(d.offset as usize, &inputs[at..at + n]);
            at += n;
        }
        let t0 = clock();
        let st = npu.run_registered(self.handle, &self.opts).map_err(|e| format!("{e}"))?;
        let took = clock().wrapping_sub(t0);
        let mut at = 0;
        for d in &model.outputs {
            let n = d.bytes().unwrap_or(0) as usize;
            self.window.read(d.offset as usize, &mut outputs[at..at + n]);
            at += n;
        }
        Ok((took, st))
    }
}
