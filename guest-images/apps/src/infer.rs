//! The generic model runner's device side, shared by the bare-metal runner
//! guest (`guest-images/infer`) and the Linux binary `vnpu-infer`
//! (`docs/inference-guests.md`): check that the vNPU is large enough for a
//! compiled model, place its I/O window in DMA memory, relocate both
//! programs to it, run the load program once, register the infer program
//! (verified once by the hypervisor), and then run one batch at a time.

use alloc::format;
use alloc::string::String;
use vnpu_abi::device::StatusBlock;
use vnpu_abi::compiled_model::{guest_span, relocate, relocate_span, Model, Target};
use vnpu_driver::{Bar, DmaBuf, DmaRegion, Hierarchy, ProgramHandle, RunOptions, Vnpu, Wait};

/// A model whose weights are in the vNPU's memory and whose infer program
/// is registered.
#[derive(Debug)]
pub struct Loaded {
    handle: ProgramHandle,
    /// The part of the I/O window the infer program uses (its inputs and
    /// outputs), in DMA memory: window offset `io_start` is its byte 0.
    pub window: DmaBuf,
    /// The window offset where [`Loaded::window`] starts.
    pub io_start: u64,
    opts: RunOptions,
}

/// Where the load program finds the weight image.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    /// These bytes, copied into DMA memory first.
    Copy(&'a [u8]),
    /// Already in guest memory the device may read, physically contiguous
    /// at `phys` (e.g. a VMM's payload): the load program reads it there,
    /// nothing is copied. `bytes` is the same image as the guest sees it.
    InPlace { phys: u64, bytes: &'a [u8] },
}

impl Weights<'_> {
    fn bytes(&self) -> &[u8] {
        match *self {
            Weights::Copy(b) | Weights::InPlace { bytes: b, .. } => b,
        }
    }
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
        |ts: &[vnpu_abi::compiled_model::TensorDesc]| ts.iter().try_fold(0u64, |acc, t| acc.checked_add(t.bytes()?));
    Some((sum(&model.inputs)?, sum(&model.outputs)?))
}

/// Checks the vNPU against the model, places the I/O window in `dma`,
/// relocates the programs to it (so `model`'s programs change), runs the
/// load program and registers the infer program.
///
/// The window's parts go where they cost least: when the infer program
/// and the tensors use only the part of the window past the weight image
/// (as `vnpu compile`'s programs do), DMA memory holds only that part, and
/// the load program reads [`Weights::InPlace`] weights where they are (else
/// from a copy of just the image). Any other model gets the whole window
/// with the image copied to its start, as the format describes.
pub fn load<B: Bar>(
    npu: &mut Vnpu<B>,
    dma: &mut DmaRegion,
    model: &mut Model,
    weights: Weights<'_>,
    wait: Wait,
) -> Result<Loaded, String> {
    check_target(&npu.hierarchy(), &model.target)?;
    let image = weights.bytes();
    let w = image.len() as u64;
    if w > model.window_bytes {
        return Err(format!("{w} bytes of weights do not fit the {}-byte window", model.window_bytes));
    }
    let span = |p: &vnpu_abi::Program| relocate_err(guest_span(p));
    let (load_span, infer_span) = (span(&model.load)?, span(&model.infer)?);
    // The first window byte of the inputs, outputs and infer accesses,
    // 64-byte aligned as the format aligns every tensor.
    let first = model
        .inputs
        .iter()
        .chain(&model.outputs)
        .map(|t| t.offset)
        .chain(infer_span.map(|r| r.start))
        .min()
        .unwrap_or(model.window_bytes);
    let split = (first & !63) >= w && load_span.is_none_or(|r| r.end <= w);
    let io_start = if split { first & !63 } else { 0 };
    let window = dma
        .alloc((model.window_bytes - io_start) as usize, 4096)
        .map_err(|e| format!("the I/O window of {} bytes: {e}", model.window_bytes - io_start))?;
    relocate_err(relocate_span(&mut model.infer, io_start..model.window_bytes, window.phys))?;
    match (split, weights) {
        (true, Weights::InPlace { phys, .. }) => relocate_err(relocate_span(&mut model.load, 0..w, phys))?,
        (true, Weights::Copy(b)) => {
            let buf = dma
                .alloc(b.len(), 4096)
                .map_err(|e| format!("the weight image of {} bytes: {e}", b.len()))?;
            buf.write(0, b);
            relocate_err(relocate_span(&mut model.load, 0..w, buf.phys))?;
        }
        (false, _) => {
            window.write(0, image);
            relocate_err(relocate(&mut model.load, window.phys))?;
        }
    }
    let opts = RunOptions { wait, ..Default::default() };
    npu.load(dma, &model.load.encode())
        .and_then(|p| npu.run(&p, &opts))
        .map_err(|e| format!("loading the weights: {}", why(npu, &e)))?;
    let handle = npu
        .load(dma, &model.infer.encode())
        .and_then(|p| npu.register(&p))
        .map_err(|e| format!("registering the infer program: {}", why(npu, &e)))?;
    Ok(Loaded { handle, window, io_start, opts })
}

/// `e`, with the device's message for the request when it gave one.
fn why<B: Bar>(npu: &Vnpu<B>, e: &vnpu_driver::Error) -> String {
    let mut m = [0u8; vnpu_driver::MESSAGE_BYTES];
    let n = match e {
        vnpu_driver::Error::Request { .. } => npu.last_message(&mut m),
        _ => 0,
    };
    match core::str::from_utf8(&m[..n]) {
        Ok(text) if !text.is_empty() => format!("{e}: {text}"),
        _ => format!("{e}"),
    }
}

fn relocate_err<T>(r: Result<T, vnpu_abi::compiled_model::ModelError>) -> Result<T, String> {
    r.map_err(|e| format!("{e}"))
}

impl Loaded {
    /// How later requests wait for their completion.
    pub fn set_wait(&mut self, wait: Wait) {
        self.opts.wait = wait;
    }

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
            self.window.write((d.offset - self.io_start) as usize, &inputs[at..at + n]);
            at += n;
        }
        let t0 = clock();
        let st = npu.run_registered(self.handle, &self.opts).map_err(|e| why(npu, &e))?;
        let took = clock().wrapping_sub(t0);
        let mut at = 0;
        for d in &model.outputs {
            let n = d.bytes().unwrap_or(0) as usize;
            self.window.read((d.offset - self.io_start) as usize, &mut outputs[at..at + n]);
            at += n;
        }
        Ok((took, st))
    }
}
