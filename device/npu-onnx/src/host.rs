//! Running a compiled model in-process on the NPU model (no VM): the
//! reference the VM path is compared with, and the functional model that
//! `vnpu infer --in-process` and the benchmark time.

use npu_model::memory::{read_f32s, write_f32s, FileMemory, Memory, MemoryError};
use npu_model::{
    run_program, run_program_on, BoardConfig, CoreMemory, ExecError, LazyHbm, Sram, TenantReport,
    VecGuestMemory,
};
use thiserror::Error;
use vnpu_abi::compiled_model::Model;

/// Why an in-process run failed.
#[derive(Debug, Error)]
pub enum HostError {
    #[error("the model's {which} program failed: {error}")]
    Exec { which: &'static str, error: ExecError },
    #[error("input `{name}` has {got} elements, the model takes {want}")]
    InputSize { name: String, got: usize, want: u64 },
    #[error("{want} inputs expected, {got} given")]
    InputCount { got: usize, want: usize },
    #[error("input `{name}` is an integer tensor: element {index} ({value}) is not an integer of at most 2^24 in size")]
    NotAnInteger { name: String, index: usize, value: f32 },
    #[error("guest memory: {0}")]
    Memory(#[source] MemoryError),
}

/// `model` but its weight image (in guest memory or HBM by then: a
/// second copy would only cost time and memory).
fn without_weights(model: &Model) -> Model {
    Model {
        target: model.target,
        window_bytes: model.window_bytes,
        inputs: model.inputs.clone(),
        outputs: model.outputs.clone(),
        load: model.load.clone(),
        infer: model.infer.clone(),
        weights: Vec::new(),
    }
}

/// A compiled model with its weights loaded into a private vNPU core.
#[derive(Debug)]
pub struct HostRunner {
    board: BoardConfig,
    model: Model,
    sram: Sram,
    hbm: LazyHbm,
    guest: VecGuestMemory,
    /// The engines a spread model's programs run on (SAs, VUs; `None`:
    /// every engine of the core, as a lone tenant).
    engines: Option<[u32; 2]>,
}

impl HostRunner {
    /// Loads the weights (runs the load program once).
    pub fn new(board: &BoardConfig, model: &Model) -> Result<Self, HostError> {
        Self::with_weights(board, model, &model.weights)
    }

    /// [`HostRunner::new`] with the weight image given apart from the
    /// model (whose own [`Model::weights`] are ignored): e.g. borrowed
    /// from a mapped model file by [`Model::decode_parts`], so it is not
    /// copied once more on the way to HBM.
    pub fn with_weights(board: &BoardConfig, model: &Model, weights: &[u8]) -> Result<Self, HostError> {
        let mut guest = VecGuestMemory::new(0, model.window_bytes as usize);
        let too_large = HostError::Memory(npu_model::memory::MemoryError::OutOfRange {
            space: "guest (the I/O window)",
            start: 0,
            len: weights.len() as u64,
            size: model.window_bytes,
        });
        let image = guest.bytes.get_mut(..weights.len()).ok_or(too_large)?;
        image.copy_from_slice(weights);
        // The weights are in guest memory now: the load program reads them
        // from the window.
        Self::loaded(board, model, guest, None)
    }

    /// A runner of `model` with `guest` as its I/O window, after its load
    /// program ran with the weight image read from `image` (else from
    /// the window). It keeps the model but its weight image.
    fn loaded(
        board: &BoardConfig,
        model: &Model,
        guest: VecGuestMemory,
        image: Option<&mut FileMemory>,
    ) -> Result<Self, HostError> {
        let mut r = Self {
            board: board.clone(),
            model: without_weights(model),
            sram: Sram::new(model.target.sram_bytes),
            hbm: LazyHbm::new(model.target.hbm_bytes),
            guest,
            engines: None,
        };
        let guest: &mut dyn Memory = match image {
            Some(image) => image,
            None => &mut r.guest,
        };
        let mem = CoreMemory { sram: &mut r.sram, hbm: &mut r.hbm, guest };
        run_program(&r.board, &r.model.load, Some(mem), None)
            .map_err(|error| HostError::Exec { which: "load", error })?;
        Ok(r)
    }

    /// [`HostRunner::with_weights`] for a weight image that lies in `file`
    /// from `offset` on (a mapped model file): the load program reads the
    /// image from a private mapping of the file, so its DMA maps the
    /// file's pages into whole HBM chunks instead of copying them
    /// (`npu_model::memory::FileMemory`), and the I/O window holds no copy
    /// of it. As [`HostRunner::with_weights`] when the infer program also
    /// reads the image from the window, or when the file cannot be mapped.
    pub fn with_weights_file(
        board: &BoardConfig,
        model: &Model,
        weights: &[u8],
        file: &std::fs::File,
        offset: u64,
    ) -> Result<Self, HostError> {
        let image = 0..weights.len() as u64;
        let inside = |p: &vnpu_abi::Program| vnpu_abi::compiled_model::guest_span(p).ok().flatten();
        let load_in_image = inside(&model.load).is_some_and(|r| r.start >= image.start && r.end <= image.end);
        let infer_apart = inside(&model.infer).is_none_or(|r| r.start >= image.end);
        let mapped = file.try_clone().and_then(|f| FileMemory::map(f, offset, weights.len()));
        let (true, true, Ok(mut from)) = (load_in_image, infer_apart, mapped) else {
            return Self::with_weights(board, model, weights);
        };
        // The image's part of the window stays zero: nothing reads it.
        let window = VecGuestMemory::new(0, model.window_bytes as usize);
        Self::loaded(board, model, window, Some(&mut from))
    }

    /// Bytes of HBM that are mappings of the model file's pages rather
    /// than copies ([`HostRunner::with_weights_file`]).
    pub fn mapped_weight_bytes(&self) -> u64 {
        self.hbm.mapped_chunks() as u64 * npu_model::memory::HBM_CHUNK
    }

    /// Runs a spread model's infer program on `engines` (SAs, VUs) from
    /// now on, of which the model's target shape is its own
    /// (`npu_model::CoreSim::set_engines`): what the board runtime gives
    /// it with that many engines lent.
    pub fn on_engines(&mut self, engines: [u32; 2]) {
        self.engines = Some(engines);
    }

    /// One batch: `inputs` in the model's order, row-major f32 (an integer
    /// input's values too: each must be an integer of at most 2^24 in
    /// size, which f32 holds exactly; it is written as the i32 the device
    /// reads). Returns the outputs and the simulation's report.
    pub fn infer(&mut self, inputs: &[&[f32]]) -> Result<(Vec<Vec<f32>>, TenantReport), HostError> {
        if inputs.len() != self.model.inputs.len() {
            return Err(HostError::InputCount { got: inputs.len(), want: self.model.inputs.len() });
        }
        for (d, x) in self.model.inputs.iter().zip(inputs) {
            let want = d.elems().unwrap_or(0);
            if x.len() as u64 != want {
                return Err(HostError::InputSize { name: d.name.clone(), got: x.len(), want });
            }
            if d.elem.is_int() {
                let bad =
                    x.iter().position(|&v| v.fract() != 0.0 || v.abs() > (1 << 24) as f32 || v.is_nan());
                if let Some(index) = bad {
                    return Err(HostError::NotAnInteger { name: d.name.clone(), index, value: x[index] });
                }
                // Exact: integral and within +-2^24.
                let bytes: Vec<u8> = x.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect();
                self.guest.write(d.offset, &bytes).map_err(HostError::Memory)?;
            } else {
                write_f32s(&mut self.guest, d.offset, x).map_err(HostError::Memory)?;
            }
        }
        let mem = CoreMemory { sram: &mut self.sram, hbm: &mut self.hbm, guest: &mut self.guest };
        let report = match self.engines {
            Some(w) => {
                let own = [self.model.target.sa, self.model.target.vu];
                run_program_on(&self.board, &self.model.infer, Some(mem), None, own, w)
            }
            None => run_program(&self.board, &self.model.infer, Some(mem), None),
        }
        .map_err(|error| HostError::Exec { which: "infer", error })?;
        let outs = self
            .model
            .outputs
            .iter()
            .map(|d| {
                let v = read_f32s(&self.guest, d.offset, d.elems().unwrap_or(0) as usize)?;
                // An integer output's i32s, as values.
                Ok(if d.elem.is_int() {
                    v.iter().map(|x| x.to_bits().cast_signed() as f32).collect()
                } else {
                    v
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(HostError::Memory)?;
        Ok((outs, report))
    }
}
