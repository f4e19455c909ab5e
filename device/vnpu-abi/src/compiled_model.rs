//! The compiled-model container (`.vnpu` files written by `vnpu compile`,
//! `docs/compiled-model-format.md`).
//!
//! A compiled model is two programs and a weight image for one vNPU shape:
//!
//! - the **load** program copies the weight image from guest memory into the
//!   vNPU's HBM (run once);
//! - the **infer** program copies the inputs from guest memory into HBM,
//!   computes, and copies the outputs back to guest memory (run per batch).
//!
//! Every `guest` address in both programs is an offset into the model's
//! **I/O window**: `window_bytes` of guest memory holding the weight image
//! at offset 0 and each input and output at its tensor's `offset`. A runner
//! places the window anywhere in guest-physical memory and adds its base to
//! every guest operand ([`relocate`]) before it submits the programs.
//!
//! [`Model::decode`] checks everything a hostile file could get wrong and
//! never panics: it is what a guest runs on a file it was handed.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use crate::isa::{Addr, DType, Instr, Space};
use crate::program::{le_u16, le_u32, le_u64, Program, ProgramError};

/// `"VNPM"`.
pub const MAGIC: [u8; 4] = *b"VNPM";
/// Container version.
pub const VERSION: u16 = 1;
/// Bytes of the fixed header.
pub const HEADER_BYTES: usize = 72;
/// Most inputs or outputs a model may have.
pub const MAX_TENSORS: u16 = 64;
/// Most dimensions of one tensor.
pub const MAX_RANK: u8 = 8;
/// Largest model file accepted (1 GiB).
pub const MAX_MODEL_BYTES: usize = 1 << 30;

/// Element type of an input or output. Every element takes 4 bytes in the
/// I/O window: an integer tensor travels as little-endian `i32`, whatever
/// its type in the source model (which a runner reads and writes, and
/// converts with a range check: a value outside `i32` is an error, never
/// wrapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    F32 = 0,
    /// `int64` in the source model (token ids, indices).
    I64 = 1,
    /// `int32` in the source model.
    I32 = 2,
}

impl ElemType {
    /// The type a code names (`None` for an unknown one).
    pub fn from_u8(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::F32),
            1 => Some(Self::I64),
            2 => Some(Self::I32),
            _ => None,
        }
    }

    /// Whether it is an integer type (`i32` in the window).
    pub fn is_int(self) -> bool {
        !matches!(self, Self::F32)
    }

    /// NumPy's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::I64 => "int64",
            Self::I32 => "int32",
        }
    }
}

/// An input or output of the model, as laid out in the I/O window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// The name in the source model.
    pub name: String,
    pub elem: ElemType,
    /// Shape, batch included (row-major, as in the source model).
    pub dims: Vec<u64>,
    /// Byte offset in the I/O window.
    pub offset: u64,
}

impl TensorDesc {
    /// Elements (`None` on overflow).
    pub fn elems(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// Bytes (`None` on overflow).
    pub fn bytes(&self) -> Option<u64> {
        self.elems()?.checked_mul(4)
    }
}

/// What the programs were compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// Batch the infer program runs per request.
    pub batch: u32,
    /// SAs and VUs of the vNPU core the programs use.
    pub sa: u32,
    pub vu: u32,
    /// SRAM and HBM bytes the programs need on that core.
    pub sram_bytes: u64,
    pub hbm_bytes: u64,
    /// The type of the SA's operands (`vnpu compile --dtype`): with bf16
    /// the stored weights of products are bf16 and activations are rounded
    /// to bf16 before each product (informational: a runner runs both the
    /// same way).
    pub sa_dtype: DType,
}

/// A decoded compiled model.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub target: Target,
    /// Guest bytes the programs address: weights, inputs and outputs.
    pub window_bytes: u64,
    pub inputs: Vec<TensorDesc>,
    pub outputs: Vec<TensorDesc>,
    pub load: Program,
    pub infer: Program,
    /// The weight image (at window offset 0).
    pub weights: Vec<u8>,
}

/// Why a byte sequence is not a valid compiled model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelError {
    TooShort {
        len: usize,
    },
    TooLarge {
        len: usize,
    },
    BadMagic,
    BadVersion(u16),
    NonZero {
        field: &'static str,
    },
    BadTensorCount {
        what: &'static str,
        count: u16,
    },
    /// The tensor table or a section runs past the end of the file.
    Truncated {
        what: &'static str,
    },
    LengthMismatch {
        expected: u64,
        actual: usize,
    },
    BadName {
        index: usize,
    },
    BadElemType {
        name: String,
        code: u8,
    },
    BadRank {
        name: String,
        rank: u8,
    },
    Overflow {
        what: &'static str,
    },
    /// A tensor (or the weight image) does not lie inside the window.
    OutsideWindow {
        name: String,
    },
    /// Two of the window's regions (weights, inputs, outputs) overlap.
    Overlap {
        a: String,
        b: String,
    },
    Program {
        which: &'static str,
        error: ProgramError,
    },
    /// An instruction reaches guest memory outside the window.
    GuestAccess {
        which: &'static str,
        stream: usize,
        index: usize,
    },
    BadShape {
        field: &'static str,
    },
    /// The SA operand type byte is not a known type.
    BadSaType(u8),
    /// [`relocate_span`]: an instruction reaches guest memory outside the
    /// part of the window being moved.
    OutsideSpan {
        stream: usize,
        index: usize,
        start: u64,
        end: u64,
    },
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { len } => {
                write!(f, "model of {len} bytes is shorter than its {HEADER_BYTES}-byte header")
            }
            Self::TooLarge { len } => {
                write!(f, "model of {len} bytes exceeds the limit of {MAX_MODEL_BYTES}")
            }
            Self::BadMagic => write!(f, "bad magic (expected \"VNPM\": not a compiled vNPU model)"),
            Self::BadVersion(v) => write!(f, "unsupported model version {v} (expected {VERSION})"),
            Self::NonZero { field } => write!(f, "header field `{field}` must be zero"),
            Self::BadTensorCount { what, count } => {
                write!(f, "{count} {what}: a model has 1..={MAX_TENSORS}")
            }
            Self::Truncated { what } => write!(f, "the {what} runs past the end of the file"),
            Self::LengthMismatch { expected, actual } => {
                write!(f, "the sections add up to {expected} bytes, the file has {actual}")
            }
            Self::BadName { index } => write!(f, "tensor {index}: name is empty or not UTF-8"),
            Self::BadElemType { name, code } => write!(f, "tensor `{name}`: unknown element type {code}"),
            Self::BadRank { name, rank } => write!(f, "tensor `{name}`: rank {rank} outside 1..={MAX_RANK}"),
            Self::Overflow { what } => write!(f, "{what} overflows 64 bits"),
            Self::OutsideWindow { name } => write!(f, "`{name}` does not lie inside the I/O window"),
            Self::Overlap { a, b } => write!(f, "`{a}` and `{b}` overlap in the I/O window"),
            Self::Program { which, error } => write!(f, "{which} program: {error}"),
            Self::GuestAccess { which, stream, index } => write!(
                f,
                "{which} program stream {stream} instruction {index}: guest access outside the I/O window"
            ),
            Self::BadShape { field } => write!(f, "target `{field}` must be positive"),
            Self::BadSaType(t) => write!(f, "unknown SA operand type {t} (0 f32, 1 bf16)"),
            Self::OutsideSpan { stream, index, start, end } => write!(
                f,
                "program stream {stream} instruction {index}: guest access outside window bytes {start}..{end}"
            ),
        }
    }
}

impl core::error::Error for ModelError {}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ModelError> {
        let end = self.at.checked_add(n).ok_or(ModelError::Truncated { what })?;
        let s = self.b.get(self.at..end).ok_or(ModelError::Truncated { what })?;
        self.at = end;
        Ok(s)
    }
}

fn tensor(r: &mut Reader<'_>, index: usize) -> Result<TensorDesc, ModelError> {
    let what = "tensor table";
    let len = usize::from(le_u16(r.take(2, what)?, 0));
    let name = core::str::from_utf8(r.take(len, what)?).map_err(|_| ModelError::BadName { index })?;
    if name.is_empty() {
        return Err(ModelError::BadName { index });
    }
    let name = String::from(name);
    let t = r.take(2, what)?;
    let (code, rank) = (t[0], t[1]);
    let Some(elem) = ElemType::from_u8(code) else {
        return Err(ModelError::BadElemType { name, code });
    };
    if rank == 0 || rank > MAX_RANK {
        return Err(ModelError::BadRank { name, rank });
    }
    let mut dims = Vec::with_capacity(usize::from(rank));
    for _ in 0..rank {
        dims.push(le_u64(r.take(8, what)?, 0));
    }
    let offset = le_u64(r.take(8, what)?, 0);
    Ok(TensorDesc { name, elem, dims, offset })
}

/// Checks that every guest operand of `p` lies in `0..window`.
fn check_guest(p: &Program, window: u64, which: &'static str) -> Result<(), ModelError> {
    for (s, stream) in p.streams.iter().enumerate() {
        for (i, instr) in stream.code.iter().enumerate() {
            let bad = ModelError::GuestAccess { which, stream: s, index: i };
            let accesses = instr.footprint().map_err(|_| bad.clone())?;
            if accesses.iter().any(|a| a.space == Space::Guest && a.end() > window) {
                return Err(bad);
            }
        }
    }
    Ok(())
}

impl Model {
    /// Decodes and checks a model file.
    pub fn decode(bytes: &[u8]) -> Result<Self, ModelError> {
        let (mut m, weights) = Self::decode_parts(bytes)?;
        m.weights = weights.to_vec();
        Ok(m)
    }

    /// Decodes and checks a model file as [`Model::decode`] does, but
    /// leaves the weight image where it is: [`Model::weights`] is empty
    /// and the image is returned beside the model, borrowed from `bytes`
    /// (a guest writes it straight into DMA memory instead of holding a
    /// second copy of megabytes of weights in its heap).
    pub fn decode_parts(bytes: &[u8]) -> Result<(Self, &[u8]), ModelError> {
        if bytes.len() > MAX_MODEL_BYTES {
            return Err(ModelError::TooLarge { len: bytes.len() });
        }
        if bytes.len() < HEADER_BYTES {
            return Err(ModelError::TooShort { len: bytes.len() });
        }
        if bytes[0..4] != MAGIC {
            return Err(ModelError::BadMagic);
        }
        let version = le_u16(bytes, 4);
        if version != VERSION {
            return Err(ModelError::BadVersion(version));
        }
        if le_u16(bytes, 6) != 0 {
            return Err(ModelError::NonZero { field: "flags" });
        }
        let sa_dtype = DType::from_u8(bytes[20]).ok_or(ModelError::BadSaType(bytes[20]))?;
        if bytes[21..24] != [0; 3] {
            return Err(ModelError::NonZero { field: "reserved" });
        }
        let target = Target {
            batch: le_u32(bytes, 8),
            sa: le_u32(bytes, 12),
            vu: le_u32(bytes, 16),
            sram_bytes: le_u64(bytes, 24),
            hbm_bytes: le_u64(bytes, 32),
            sa_dtype,
        };
        for (field, v) in [("batch", target.batch), ("sa", target.sa), ("vu", target.vu)] {
            if v == 0 {
                return Err(ModelError::BadShape { field });
            }
        }
        let window_bytes = le_u64(bytes, 40);
        let weights_bytes = le_u64(bytes, 48);
        let (load_len, infer_len) = (le_u32(bytes, 56), le_u32(bytes, 60));
        let (n_in, n_out) = (le_u16(bytes, 64), le_u16(bytes, 66));
        let table_len = le_u32(bytes, 68);
        for (what, count) in [("inputs", n_in), ("outputs", n_out)] {
            if count == 0 || count > MAX_TENSORS {
                return Err(ModelError::BadTensorCount { what, count });
            }
        }
        let expected = [u64::from(table_len), u64::from(load_len), u64::from(infer_len), weights_bytes]
            .iter()
            .try_fold(HEADER_BYTES as u64, |a, &b| a.checked_add(b))
            .ok_or(ModelError::Overflow { what: "the model's size" })?;
        if expected != bytes.len() as u64 {
            return Err(ModelError::LengthMismatch { expected, actual: bytes.len() });
        }
        let mut r = Reader { b: bytes, at: HEADER_BYTES };
        let table = r.take(table_len as usize, "tensor table")?;
        let mut tr = Reader { b: table, at: 0 };
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        for i in 0..usize::from(n_in) + usize::from(n_out) {
            let t = tensor(&mut tr, i)?;
            if i < usize::from(n_in) {
                inputs.push(t);
            } else {
                outputs.push(t);
            }
        }
        if tr.at != table.len() {
            return Err(ModelError::LengthMismatch { expected: tr.at as u64, actual: table.len() });
        }
        let load = Program::decode(r.take(load_len as usize, "load program")?)
            .map_err(|error| ModelError::Program { which: "load", error })?;
        let infer = Program::decode(r.take(infer_len as usize, "infer program")?)
            .map_err(|error| ModelError::Program { which: "infer", error })?;
        let weights = r.take(weights_bytes as usize, "weight image")?;
        // The window's regions: inside it and disjoint.
        let mut regions: Vec<(String, u64, u64)> = Vec::new();
        regions.push((String::from("weight image"), 0, weights_bytes));
        for t in inputs.iter().chain(&outputs) {
            let len = t.bytes().ok_or(ModelError::Overflow { what: "a tensor's size" })?;
            let end = t.offset.checked_add(len).ok_or(ModelError::Overflow { what: "a tensor's end" })?;
            regions.push((t.name.clone(), t.offset, end));
        }
        for (i, (name, start, end)) in regions.iter().enumerate() {
            if *end > window_bytes {
                return Err(ModelError::OutsideWindow { name: name.clone() });
            }
            for (other, s2, e2) in &regions[..i] {
                if start < e2 && s2 < end && start < end && s2 < e2 {
                    return Err(ModelError::Overlap { a: other.clone(), b: name.clone() });
                }
            }
        }
        check_guest(&load, window_bytes, "load")?;
        check_guest(&infer, window_bytes, "infer")?;
        Ok((Model { target, window_bytes, inputs, outputs, load, infer, weights: Vec::new() }, weights))
    }

    /// Offset of the weight image in the file [`Model::encode`] writes.
    pub fn weights_offset(&self) -> usize {
        weights_offset(self.inputs.iter().chain(&self.outputs), &self.load, &self.infer)
    }

    /// The file bytes.
    pub fn encode(&self) -> Vec<u8> {
        let load = self.load.encode();
        let infer = self.infer.encode();
        let mut table = Vec::new();
        for t in self.inputs.iter().chain(&self.outputs) {
            table.extend_from_slice(&(t.name.len() as u16).to_le_bytes());
            table.extend_from_slice(t.name.as_bytes());
            table.push(t.elem as u8);
            table.push(t.dims.len() as u8);
            for d in &t.dims {
                table.extend_from_slice(&d.to_le_bytes());
            }
            table.extend_from_slice(&t.offset.to_le_bytes());
        }
        let mut b =
            Vec::with_capacity(HEADER_BYTES + table.len() + load.len() + infer.len() + self.weights.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.target.batch.to_le_bytes());
        b.extend_from_slice(&self.target.sa.to_le_bytes());
        b.extend_from_slice(&self.target.vu.to_le_bytes());
        b.extend_from_slice(&[self.target.sa_dtype as u8, 0, 0, 0]);
        b.extend_from_slice(&self.target.sram_bytes.to_le_bytes());
        b.extend_from_slice(&self.target.hbm_bytes.to_le_bytes());
        b.extend_from_slice(&self.window_bytes.to_le_bytes());
        b.extend_from_slice(&(self.weights.len() as u64).to_le_bytes());
        b.extend_from_slice(&(load.len() as u32).to_le_bytes());
        b.extend_from_slice(&(infer.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.inputs.len() as u16).to_le_bytes());
        b.extend_from_slice(&(self.outputs.len() as u16).to_le_bytes());
        b.extend_from_slice(&(table.len() as u32).to_le_bytes());
        b.extend_from_slice(&table);
        b.extend_from_slice(&load);
        b.extend_from_slice(&infer);
        b.extend_from_slice(&self.weights);
        b
    }
}

/// Offset of the weight image in a model file of these tensors (inputs
/// then outputs) and programs, before the image itself is known.
pub fn weights_offset<'a>(
    tensors: impl IntoIterator<Item = &'a TensorDesc>,
    load: &Program,
    infer: &Program,
) -> usize {
    let table: usize = tensors.into_iter().map(|t| 2 + t.name.len() + 2 + 8 * t.dims.len() + 8).sum();
    HEADER_BYTES + table + load.encoded_len() + infer.encoded_len()
}

/// The window bytes `p`'s guest accesses cover, from the lowest first byte
/// to the highest last one (`None` when it touches no guest memory).
pub fn guest_span(p: &Program) -> Result<Option<core::ops::Range<u64>>, ModelError> {
    let mut span: Option<core::ops::Range<u64>> = None;
    for (s, stream) in p.streams.iter().enumerate() {
        for (i, instr) in stream.code.iter().enumerate() {
            let bad = ModelError::GuestAccess { which: "a", stream: s, index: i };
            for a in instr.footprint().map_err(|_| bad)?.iter().filter(|a| a.space == Space::Guest) {
                span = Some(match span {
                    Some(r) => r.start.min(a.start)..r.end.max(a.end()),
                    None => a.start..a.end(),
                });
            }
        }
    }
    Ok(span)
}

/// Places the part `from` of the window at guest-physical `base`: every
/// guest operand of `p` at window offset `o` becomes `base + o -
/// from.start`. Every guest access must lie wholly inside `from` (so a
/// runner may put the weight image and the inputs and outputs in separate
/// buffers); fails, leaving `p` unchanged, when one does not or an address
/// would overflow.
pub fn relocate_span(p: &mut Program, from: core::ops::Range<u64>, base: u64) -> Result<(), ModelError> {
    for (s, stream) in p.streams.iter().enumerate() {
        for (i, instr) in stream.code.iter().enumerate() {
            let outside = ModelError::OutsideSpan { stream: s, index: i, start: from.start, end: from.end };
            let accesses = instr.footprint().map_err(|_| outside.clone())?;
            for a in accesses.iter().filter(|a| a.space == Space::Guest) {
                if a.start < from.start || a.end() > from.end {
                    return Err(outside);
                }
                // The access's last byte lands at base + (end - 1 - from.start).
                base.checked_add(a.end() - 1 - from.start)
                    .ok_or(ModelError::Overflow { what: "a relocated address" })?;
            }
        }
    }
    // Zero-sized operands touch nothing (no footprint) but move too: the
    // moves are checked and made on a copy, so `p` is unchanged on error.
    let mut q = p.clone();
    for_guest_operands(&mut q, |offset| offset.checked_sub(from.start).and_then(|o| base.checked_add(o)))?;
    *p = q;
    Ok(())
}

/// Replaces the offset of every guest-memory operand of `p` by `f` of it;
/// fails at the first operand for which `f` gives `None` (an overflow).
fn for_guest_operands(p: &mut Program, f: impl Fn(u64) -> Option<u64>) -> Result<(), ModelError> {
    let shift = |a: &mut Addr| -> Result<(), ModelError> {
        if a.space == Space::Guest {
            a.offset = f(a.offset).ok_or(ModelError::Overflow { what: "a relocated address" })?;
        }
        Ok(())
    };
    for s in &mut p.streams {
        for i in &mut s.code {
            match i {
                Instr::DmaCopy { src, dst, .. } => {
                    shift(src)?;
                    shift(dst)?;
                }
                Instr::DmaGather { table, .. } => shift(table)?,
                _ => {}
            }
        }
    }
    Ok(())
}

/// Adds `base` to every guest-memory operand of `p`: the window was placed
/// at guest-physical `base`. Fails (leaving `p` partly relocated) when an
/// address would overflow.
pub fn relocate(p: &mut Program, base: u64) -> Result<(), ModelError> {
    for_guest_operands(p, |offset| offset.checked_add(base))
}

/// The inference job `vnpu infer` hands a runner guest as its payload
/// (`docs/compiled-model-format.md`, "Inference jobs"): a compiled model, the
/// inputs of `runs` batches, and room for the outputs and per-run
/// statistics the guest writes back. Little-endian.
///
/// | offset | size | field |
/// | --- | --- | --- |
/// | 0 | 4 | magic `"VNPJ"` |
/// | 4 | 4 | version, 1 |
/// | 8 | 4 | `runs` |
/// | 12 | 4 | status (guest writes: 0 pending, 1 done, 2 failed) |
/// | 16 | 16 | model: offset, length (u64 each) |
/// | 32 | 16 | inputs: per run, each input in the model's order, f32 |
/// | 48 | 16 | outputs (guest writes): per run, each output, f32 |
/// | 64 | 16 | statistics (guest writes): per run [`STAT_WORDS`] u64 |
/// | 80 | 176 | message (guest writes on failure; UTF-8, NUL-padded) |
pub mod job {
    use super::le_u64;
    use crate::program::le_u32;

    pub const MAGIC: [u8; 4] = *b"VNPJ";
    pub const VERSION: u32 = 1;
    pub const HEADER_BYTES: usize = 256;
    pub const MESSAGE_AT: usize = 80;
    pub const STATUS_AT: usize = 12;
    pub const PENDING: u32 = 0;
    pub const DONE: u32 = 1;
    pub const FAILED: u32 = 2;
    /// Statistics per run: guest wall ns (TSC), simulated cycles, SA, VU
    /// and DMA active cycles, FLOPs, host ns spent on the request, 0.
    pub const STAT_WORDS: usize = 8;

    /// A job's header.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct Header {
        pub runs: u32,
        pub status: u32,
        pub model: (u64, u64),
        pub inputs: (u64, u64),
        pub outputs: (u64, u64),
        pub stats: (u64, u64),
    }

    /// Why a payload is not a job.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum JobError {
        BadMagic,
        BadVersion(u32),
        /// A section lies outside the payload or over the header.
        BadSection(&'static str),
    }

    impl core::fmt::Display for JobError {
        fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
            match self {
                Self::BadMagic => write!(f, "the payload is not an inference job (bad magic)"),
                Self::BadVersion(v) => write!(f, "job version {v} (expected {VERSION})"),
                Self::BadSection(s) => write!(f, "the job's {s} section lies outside the payload"),
            }
        }
    }

    impl Header {
        /// Reads and checks the header of a payload of `b.len()` bytes.
        pub fn decode(b: &[u8]) -> Result<Self, JobError> {
            if b.len() < HEADER_BYTES || b[0..4] != MAGIC {
                return Err(JobError::BadMagic);
            }
            let v = le_u32(b, 4);
            if v != VERSION {
                return Err(JobError::BadVersion(v));
            }
            let sec = |at: usize| (le_u64(b, at), le_u64(b, at + 8));
            let h = Header {
                runs: le_u32(b, 8),
                status: le_u32(b, STATUS_AT),
                model: sec(16),
                inputs: sec(32),
                outputs: sec(48),
                stats: sec(64),
            };
            for (name, (off, len)) in
                [("model", h.model), ("inputs", h.inputs), ("outputs", h.outputs), ("statistics", h.stats)]
            {
                let end = off.checked_add(len).ok_or(JobError::BadSection(name))?;
                if off < HEADER_BYTES as u64 || end > b.len() as u64 {
                    return Err(JobError::BadSection(name));
                }
            }
            Ok(h)
        }

        /// The header bytes (message empty).
        pub fn encode(&self) -> [u8; HEADER_BYTES] {
            let mut b = [0u8; HEADER_BYTES];
            b[0..4].copy_from_slice(&MAGIC);
            b[4..8].copy_from_slice(&VERSION.to_le_bytes());
            b[8..12].copy_from_slice(&self.runs.to_le_bytes());
            b[12..16].copy_from_slice(&self.status.to_le_bytes());
            for (at, (off, len)) in
                [(16, self.model), (32, self.inputs), (48, self.outputs), (64, self.stats)]
            {
                b[at..at + 8].copy_from_slice(&off.to_le_bytes());
                b[at + 8..at + 16].copy_from_slice(&len.to_le_bytes());
            }
            b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Engine, ProgramBuilder};
    use alloc::vec;

    fn model() -> Model {
        let mut l = ProgramBuilder::new();
        l.push(Engine::DMA, Instr::copy(Addr::guest(0), Addr::hbm(0), 64));
        let mut i = ProgramBuilder::new();
        i.push(Engine::DMA, Instr::copy(Addr::guest(64), Addr::hbm(64), 16));
        i.push(Engine::DMA, Instr::copy(Addr::hbm(64), Addr::guest(128), 16));
        Model {
            target: Target {
                batch: 1,
                sa: 1,
                vu: 1,
                sram_bytes: 1 << 20,
                hbm_bytes: 1 << 20,
                sa_dtype: DType::F32,
            },
            window_bytes: 192,
            inputs: vec![TensorDesc { name: "x".into(), elem: ElemType::F32, dims: vec![1, 4], offset: 64 }],
            outputs: vec![TensorDesc {
                name: "y".into(),
                elem: ElemType::F32,
                dims: vec![1, 4],
                offset: 128,
            }],
            load: l.finish(),
            infer: i.finish(),
            weights: vec![7; 64],
        }
    }

    #[test]
    fn round_trip_and_relocation() {
        let m = model();
        assert_eq!(Model::decode(&m.encode()), Ok(m.clone()));
        let b = m.encode();
        assert_eq!(b[m.weights_offset()..], m.weights[..], "the image starts at weights_offset");
        let (_, image) = Model::decode_parts(&b).unwrap();
        assert_eq!(image.as_ptr(), b[m.weights_offset()..].as_ptr());
        let mut p = m.infer.clone();
        relocate(&mut p, 0x100_0000).unwrap();
        assert_eq!(p.streams[0].code[0], Instr::copy(Addr::guest(0x100_0040), Addr::hbm(64), 16));
        assert!(relocate(&mut m.infer.clone(), u64::MAX).is_err());
    }

    /// The weight image and the inputs and outputs placed apart: each
    /// operand lands at its span's base plus its offset in the span, and an
    /// access reaching outside the span (or an address that would
    /// overflow) is refused with the program left as it was.
    #[test]
    fn a_span_of_the_window_moves_alone() {
        let m = model();
        assert_eq!(guest_span(&m.load), Ok(Some(0..64)));
        assert_eq!(guest_span(&m.infer), Ok(Some(64..144)));
        assert_eq!(guest_span(&Program::default()), Ok(None));
        let mut load = m.load.clone();
        relocate_span(&mut load, 0..64, 0x7000_0000).unwrap();
        assert_eq!(load.streams[0].code[0], Instr::copy(Addr::guest(0x7000_0000), Addr::hbm(0), 64));
        let mut infer = m.infer.clone();
        relocate_span(&mut infer, 64..192, 0x20_0000).unwrap();
        assert_eq!(infer.streams[0].code[0], Instr::copy(Addr::guest(0x20_0000), Addr::hbm(64), 16));
        assert_eq!(infer.streams[0].code[1], Instr::copy(Addr::hbm(64), Addr::guest(0x20_0040), 16));
        for (from, base) in [(0..63, 0), (65..192, 0), (64..143, 0), (64..192, u64::MAX - 70)] {
            let mut p = m.infer.clone();
            assert!(relocate_span(&mut p, from.clone(), base).is_err(), "{from:?} at {base:#x}");
            assert_eq!(p, m.infer);
        }
    }

    #[test]
    fn hostile_files_are_refused_by_name() {
        let good = model().encode();
        assert!(matches!(Model::decode(&good[..good.len() - 1]), Err(ModelError::LengthMismatch { .. })));
        assert!(matches!(Model::decode(&good[..10]), Err(ModelError::TooShort { .. })));
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(Model::decode(&b), Err(ModelError::BadMagic));
        // A tensor outside the window.
        let mut m = model();
        m.outputs[0].offset = 180;
        assert!(matches!(Model::decode(&m.encode()), Err(ModelError::OutsideWindow { .. })));
        // An input over the weight image.
        let mut m = model();
        m.inputs[0].offset = 32;
        assert!(matches!(Model::decode(&m.encode()), Err(ModelError::Overlap { .. })));
        // A program reaching guest memory past the window.
        let mut m = model();
        let mut i = ProgramBuilder::new();
        i.push(Engine::DMA, Instr::copy(Addr::hbm(0), Addr::guest(190), 16));
        m.infer = i.finish();
        assert!(matches!(Model::decode(&m.encode()), Err(ModelError::GuestAccess { which: "infer", .. })));
        // Zero batch, rank 0.
        let mut m = model();
        m.target.batch = 0;
        assert_eq!(Model::decode(&m.encode()), Err(ModelError::BadShape { field: "batch" }));
        let mut m = model();
        m.inputs[0].dims.clear();
        assert!(matches!(Model::decode(&m.encode()), Err(ModelError::BadRank { .. })));
        // The SA operand type: bf16 round-trips, an unknown byte or a
        // non-zero reserved byte after it is refused.
        let mut m = model();
        m.target.sa_dtype = DType::Bf16;
        assert_eq!(Model::decode(&m.encode()), Ok(m.clone()));
        let mut b = m.encode();
        b[20] = 2;
        assert_eq!(Model::decode(&b), Err(ModelError::BadSaType(2)));
        let mut b = m.encode();
        b[23] = 1;
        assert_eq!(Model::decode(&b), Err(ModelError::NonZero { field: "reserved" }));
    }

    #[test]
    fn job_sections_must_lie_in_the_payload() {
        let h = job::Header {
            runs: 1,
            status: 0,
            model: (256, 10),
            inputs: (266, 4),
            outputs: (270, 4),
            stats: (274, 64),
        };
        let mut p = vec![0u8; 338];
        p[..job::HEADER_BYTES].copy_from_slice(&h.encode());
        assert_eq!(job::Header::decode(&p), Ok(h));
        assert_eq!(job::Header::decode(&p[..337]), Err(job::JobError::BadSection("statistics")));
        let bad = job::Header { model: (0, 10), ..h };
        p[..job::HEADER_BYTES].copy_from_slice(&bad.encode());
        assert_eq!(job::Header::decode(&p), Err(job::JobError::BadSection("model")));
    }
}
