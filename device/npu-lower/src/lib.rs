//! Lowering a layer graph to one program for a vNPU core.
//!
//! Every tensor lives in the vNPU's HBM. Each operation becomes a tiled
//! pipeline: the DMA engine loads a tile into one of several SRAM slots,
//! the tile passes through a chain of SA and VU stages, and the DMA engine
//! stores the result. Stages are ordered by per-slot semaphores; slots are
//! spread over the vNPU's SAs and VUs and double-buffered (two slots per
//! engine where SRAM allows), so loads, stores and compute overlap.
//!
//! The DMA stream is in order and waits for every tile of an operation
//! before it stores the last one, so it doubles as the barrier between
//! operations: SRAM is re-partitioned per operation. Weights that do not
//! fit half the SRAM are split into column chunks, each its own pipeline.

use std::collections::VecDeque;

use thiserror::Error;
use vnpu_abi::isa::NUM_SEMAPHORES;
use vnpu_abi::{
    Addr, Bcast, BinOp, ConvGeom, DType, Engine, Instr, MatFlags, PoolGeom, Program, ProgramBuilder, RedOp,
    Space, UnOp,
};

use npu_graph::{Act, Graph, Init, Op, PoolOp, Residual, Spatial, TensorId, View, NMS_STEP};

mod chain;

/// The vNPU core a program is lowered for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VnpuShape {
    pub sa: u32,
    pub vu: u32,
    pub sram_bytes: u64,
    pub hbm_bytes: u64,
    /// Systolic array rows and columns (weight chunks are rounded to the
    /// columns; both decide how a matrix product is split over SAs).
    pub sa_rows: u32,
    pub sa_cols: u32,
}

impl VnpuShape {
    /// `sa` SAs and `vu` VUs with this SRAM and HBM, on `board`'s
    /// systolic arrays.
    pub fn on_board(
        board: &npu_model::BoardConfig,
        sa: u32,
        vu: u32,
        sram_bytes: u64,
        hbm_bytes: u64,
    ) -> Self {
        Self { sa, vu, sram_bytes, hbm_bytes, sa_rows: board.core.sa_rows, sa_cols: board.core.sa_cols }
    }
}

/// Why a graph cannot be lowered for a vNPU.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LowerError {
    #[error("a vNPU core needs at least one SA and one VU (got {sa} SAs, {vu} VUs)")]
    Shape { sa: u32, vu: u32 },
    #[error("operation `{op}` needs {need} bytes of SRAM for one tile, the vNPU core has {have}")]
    Sram { op: String, need: u64, have: u64 },
    #[error("the model's tensors need {need} bytes of HBM, the vNPU core has {have}")]
    Hbm { need: u64, have: u64 },
    #[error("operation `{op}`: {reason}")]
    Geometry { op: String, reason: &'static str },
    #[error("the lowering ran out of semaphores (a lowering bug)")]
    Semaphores,
    #[error(
        "the program has {have} instructions, more than one request may carry ({limit}): run the batch as several requests"
    )]
    Instructions { have: usize, limit: usize },
}

impl LowerError {
    /// Whether the graph is too large for the vNPU (its tensors exceed the
    /// HBM, or its program the instructions one request may carry): an
    /// item a study leaves out by name, not a failure.
    pub fn is_capacity(&self) -> bool {
        matches!(self, LowerError::Hbm { .. } | LowerError::Instructions { .. })
    }
}

/// A tensor's place in HBM.
#[derive(Clone, Debug, PartialEq)]
pub struct Placed {
    pub offset: u64,
    pub elems: u64,
    pub init: Init,
    /// How its elements are stored: f32, or bf16 for the weights of SA
    /// products lowered with bf16 operands ([`lower_as`]).
    pub dtype: DType,
    /// Kept on chip ([`LowerOptions::keep_on_chip`]): the SRAM offset the
    /// program keeps it at while it is live; its HBM space is never
    /// written, and it is not in SRAM after the program.
    pub on_chip: Option<u64>,
}

/// The lowered program and where everything lives.
#[derive(Debug, Clone)]
pub struct Lowered {
    pub program: Program,
    pub tensors: Vec<Placed>,
    /// HBM bytes the tensors occupy.
    pub hbm_bytes: u64,
    pub input: TensorId,
    pub output: TensorId,
    /// Inverted-residual blocks lowered as one pipeline each
    /// ([`LowerOptions::fuse_blocks`]).
    pub blocks: usize,
}

const ALIGN: u64 = 4096;
/// Smallest tile (SRAM bytes) worth splitting work into.
const MIN_TILE_BYTES: u64 = 32 << 10;

/// Small matrices of a batched product are grouped into tiles, but into at
/// least this many tiles per slot, so loads, products and stores overlap.
const GROUP_TILES: u32 = 32;
/// Most engines of one kind a lowered program spreads work over.
pub const MAX_ENGINES: u32 = 8;
const F: u64 = 4;
/// With weights streamed ([`LowerOptions::stream_weights`]), each column
/// block of a weight chunk loads in at most this many pieces.
const STREAM_PIECES: u32 = 4;

enum Stage {
    Sa(Vec<Instr>),
    /// SA work split by the weight piece it reads: the engine waits for
    /// piece `p` to land before running its code (weights streamed).
    SaPieces(Vec<(usize, Vec<Instr>)>),
    Vu(Vec<Instr>),
}

/// `stages` without the VU stages that have nothing to run (no tokens are
/// passed for them).
fn without_empty_vu(stages: impl IntoIterator<Item = Stage>) -> Vec<Stage> {
    stages.into_iter().filter(|st| !matches!(st, Stage::Vu(c) if c.is_empty())).collect()
}

/// One tile: the DMA engine loads it once, then each lane runs its chain
/// of stages and the DMA engine stores that lane's result. A tile of one
/// lane runs on the engines of its slot; lane `i` of an `L`-lane tile in
/// slot `p` runs on SA `(p L + i) % sa` and VU `(p L + i) % vu` (a matrix
/// product split by weight columns).
struct Tile {
    load: Vec<Instr>,
    /// VU work on the loaded tile that every lane needs (converting SA
    /// operands to bf16), run once on the slot's first VU before the lanes
    /// start. Empty: the lanes start right after the load.
    prep: Vec<Instr>,
    lanes: Vec<Lane>,
}

struct Lane {
    stages: Vec<Stage>,
    store: Vec<Instr>,
    /// The lane's first (SA) stage split by weight piece, for a tile that
    /// starts before all weights have landed (empty: not splittable).
    split: Vec<(usize, Vec<Instr>)>,
}

/// Per lane of a tile: the semaphore its last engine signals the DMA
/// engine on, and the lane's store.
type Posts = Vec<(u8, Vec<Instr>)>;

/// A tile whose lanes [`Lowerer::pipeline`] emits after the next tile's
/// prep: its index, slot, lane count, the engine that started it, and
/// each lane with its start semaphore.
struct Held {
    tile: usize,
    slot: u32,
    n_lanes: usize,
    start: Engine,
    lanes: Vec<(Lane, Option<u8>)>,
}

impl Tile {
    fn single(load: Vec<Instr>, stages: Vec<Stage>, store: Vec<Instr>) -> Self {
        Tile { load, prep: vec![], lanes: vec![Lane { stages, store, split: vec![] }] }
    }
}

/// Where a pipeline's preloaded data (`fixed` bytes at `wbase`) and its
/// slots (`used` bytes at `sbase`) sit in SRAM.
#[derive(Clone, Copy, Debug)]
struct Layout {
    wbase: u64,
    fixed: u64,
    sbase: u64,
    used: u64,
}

impl Layout {
    /// Preloaded data at the bottom of SRAM, slots right above it.
    fn low(fixed: u64, used: u64) -> Self {
        Layout { wbase: 0, fixed, sbase: fixed, used }
    }

    fn preload(&self) -> (u64, u64) {
        (self.wbase, self.wbase + self.fixed)
    }

    fn live(&self) -> [(u64, u64); 2] {
        [self.preload(), (self.sbase, self.sbase + self.used)]
    }
}

/// The fields of `i` that hold SRAM addresses.
fn sram_fields(i: &mut Instr) -> Vec<&mut u64> {
    match i {
        Instr::DmaCopy { src, dst, .. } => {
            [src, dst].into_iter().filter(|a| a.space == Space::Sram).map(|a| &mut a.offset).collect()
        }
        Instr::DmaGather { table, indices, dst, .. } => {
            let mut v = vec![indices, dst];
            if table.space == Space::Sram {
                v.push(&mut table.offset);
            }
            v
        }
        Instr::MatMul { a, b, c, .. } => vec![a, b, c],
        Instr::Conv2d { input, weights, output, .. } => vec![input, weights, output],
        Instr::VBinary { a, b, dst, .. } => vec![a, b, dst],
        Instr::VUnary { src, dst, .. }
        | Instr::VAffine { src, dst, .. }
        | Instr::VClamp { src, dst, .. }
        | Instr::VReduce { src, dst, .. }
        | Instr::VSoftmax { src, dst, .. }
        | Instr::VPool { src, dst, .. }
        | Instr::VConvert { src, dst, .. } => vec![src, dst],
        Instr::VLayerNorm { src, dst, gamma, beta, .. } => vec![src, dst, gamma, beta],
        Instr::VRmsNorm { src, dst, gamma, .. } => vec![src, dst, gamma],
        Instr::VDepthwise { src, weights, dst, .. } => vec![src, weights, dst],
        Instr::Signal { .. } | Instr::Wait { .. } | Instr::Halt => vec![],
    }
}

impl Tile {
    /// Every instruction of the tile but its loads.
    fn compute_mut(&mut self) -> impl Iterator<Item = &mut Instr> {
        self.prep.iter_mut().chain(self.lanes.iter_mut().flat_map(|l| {
            l.stages
                .iter_mut()
                .flat_map(|st| match st {
                    Stage::Sa(c) | Stage::Vu(c) => c.iter_mut().collect::<Vec<_>>(),
                    Stage::SaPieces(p) => p.iter_mut().flat_map(|(_, c)| c.iter_mut()).collect(),
                })
                .chain(l.split.iter_mut().flat_map(|(_, c)| c.iter_mut()))
                .chain(l.store.iter_mut())
        }))
    }

    /// Drops the loads that copy a tensor kept on chip (at or above
    /// `resident`) into the tile's slot, and points what reads the copy at
    /// the tensor itself: only a one-row SRAM-to-SRAM copy whose
    /// destination nothing else in the tile writes, and that every access
    /// either covers from inside or leaves alone (else the copy stays).
    fn read_in_place(&mut self, resident: u64) {
        let mut i = 0;
        while i < self.load.len() {
            let Instr::DmaCopy { src, dst, rows: 1, row_bytes, .. } = self.load[i] else {
                i += 1;
                continue;
            };
            let len = u64::from(row_bytes);
            if src.space != Space::Sram || dst.space != Space::Sram || src.offset < resident || len == 0 {
                i += 1;
                continue;
            }
            let d = (dst.offset, dst.offset + len);
            let others = self.load.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, x)| *x);
            let mut all: Vec<Instr> = others.collect();
            all.extend(self.compute_mut().map(|x| *x));
            let safe = all.iter().all(|x| {
                x.footprint().is_ok_and(|f| {
                    f.iter().all(|a| {
                        let (s, e) = (a.start, a.end());
                        a.space != Space::Sram
                            || e <= d.0
                            || s >= d.1
                            || (s >= d.0 && e <= d.1 && a.kind == vnpu_abi::AccessKind::Read)
                    })
                })
            });
            if !safe {
                if self.convert_in_place(i, d, src.offset) {
                    self.load.remove(i);
                } else {
                    i += 1;
                }
                continue;
            }
            for x in self.compute_mut() {
                for f in sram_fields(x) {
                    if (d.0..d.1).contains(f) {
                        *f = src.offset + (*f - d.0);
                    }
                }
            }
            self.load.remove(i);
        }
    }

    /// The other case [`Tile::read_in_place`] takes: the first instruction
    /// touching the copy `d` is a `vu.convert` reading within it (a VU
    /// operation widening a bf16 input, or the prep rounding an f32 SA
    /// operand to bf16), in the prep (which runs before every lane) or in
    /// the one lane's stages in order, and everything else in the tile
    /// touches `d` only within what that convert writes. The convert then
    /// reads the tensor at `src`, and nothing else saw the copy.
    fn convert_in_place(&mut self, load: usize, d: (u64, u64), src: u64) -> bool {
        let touches = |x: &Instr| {
            x.footprint()
                .map_or(true, |f| f.iter().any(|a| a.space == Space::Sram && a.start < d.1 && a.end() > d.0))
        };
        if self.load.iter().enumerate().any(|(j, x)| j != load && touches(x)) {
            return false;
        }
        let in_prep = self.prep.iter().any(touches);
        if !in_prep && self.lanes.len() != 1 {
            return false;
        }
        // The convert: where it is in `ordered` (the prep, then the one
        // lane's stages), and what it writes.
        let ordered: Vec<&Instr> = if in_prep {
            self.prep.iter().collect()
        } else {
            let lane = &self.lanes[0];
            let mut v: Vec<&Instr> = self.prep.iter().collect();
            for st in &lane.stages {
                match st {
                    Stage::Sa(c) | Stage::Vu(c) => v.extend(c.iter()),
                    Stage::SaPieces(_) => return false,
                }
            }
            v
        };
        let Some(first) = ordered.iter().position(|x| touches(x)) else { return false };
        let Instr::VConvert { from, to, src: s, dst, len } = *ordered[first] else { return false };
        let (read, written) = (u64::from(len) * from.size(), u64::from(len) * to.size());
        if s < d.0 || s + read > d.1 {
            return false;
        }
        let w = (dst, dst + written);
        let within = |x: &Instr| {
            x.footprint().is_ok_and(|f| {
                f.iter().all(|a| {
                    a.space != Space::Sram
                        || a.end() <= d.0
                        || a.start >= d.1
                        || (a.start >= w.0 && a.end() <= w.1)
                })
            })
        };
        let target: *const Instr = ordered[first];
        let rest_ok = self.compute_mut().all(|x| std::ptr::eq(x, target) || within(x));
        if !rest_ok {
            return false;
        }
        for x in self.compute_mut() {
            if std::ptr::eq(x, target) {
                if let Instr::VConvert { src: s, .. } = x {
                    *s = src + (*s - d.0);
                }
                return true;
            }
        }
        false
    }
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < a.1 && b.0 < b.1 && a.0 < b.1 && b.0 < a.1
}

/// Which convolution [`Lowerer::conv`] lowers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Conv {
    /// On the SA, with its fused residual add if any.
    Sa(Option<Residual>),
    /// Depthwise, on the VU.
    Depthwise,
}

/// A column block of a weight chunk: first column (within the chunk) and width.
#[derive(Clone, Copy, Debug)]
struct Block {
    c0: u32,
    cols: u32,
}

struct Lowerer {
    b: ProgramBuilder,
    shape: VnpuShape,
    hbm: Vec<u64>,
    chans: Vec<((Engine, Engine), u8)>,
    /// The last pipeline's final waits and stores, not yet emitted: the
    /// next pipeline's preload goes first when it does not touch `live`.
    deferred: VecDeque<Vec<(u8, Vec<Instr>)>>,
    /// SRAM ranges the last pipeline still uses until `deferred` is emitted.
    live: Vec<(u64, u64)>,
    /// The SA's operand type: with bf16, stored weights are bf16 in HBM and
    /// computed operands are converted to bf16 in SRAM on a VU first.
    dtype: DType,
    /// Bytes per element of each tensor in HBM.
    esize: Vec<u64>,
    /// Weights streamed within an operation ([`LowerOptions::stream_weights`]).
    stream: bool,
    /// Where each tensor kept on chip lives in SRAM
    /// ([`LowerOptions::keep_on_chip`]), above `shape.sram_bytes`.
    on_chip: Vec<Option<u64>>,
}

fn copy(src: Addr, dst: Addr, rows: u64, row_bytes: u64, src_stride: u64, dst_stride: u64) -> Instr {
    if rows > 1
        && src_stride == row_bytes
        && dst_stride == row_bytes
        && rows * row_bytes <= u64::from(u32::MAX)
    {
        return Instr::DmaCopy {
            src,
            dst,
            rows: 1,
            row_bytes: (rows * row_bytes) as u32,
            src_stride: 0,
            dst_stride: 0,
        };
    }
    Instr::DmaCopy { src, dst, rows: rows as u32, row_bytes: row_bytes as u32, src_stride, dst_stride }
}

/// `first = first op second` over the `rows x cols` block at `base` and
/// the one right after it (two operands loaded one after the other).
fn second_into_first(op: BinOp, base: u64, rows: u32, cols: u32) -> Instr {
    let b = base + u64::from(rows) * u64::from(cols) * F;
    Instr::VBinary { op, bcast: Bcast::None, a: base, b, dst: base, rows, cols }
}

/// VU instructions for `y = act(y + bias)` over `rows x cols` at `y`.
fn bias_act(y: u64, bias: Option<u64>, rows: u32, cols: u32, act: Act, tmp: u64) -> Vec<Instr> {
    let mut v = Vec::new();
    if let Some(b) = bias {
        v.push(Instr::VBinary { op: BinOp::Add, bcast: Bcast::Row, a: y, b, dst: y, rows, cols });
    }
    let len = rows * cols;
    match act {
        Act::None => {}
        Act::Relu => v.push(Instr::VUnary { op: UnOp::Relu, src: y, dst: y, len }),
        Act::Gelu => v.push(Instr::VUnary { op: UnOp::Gelu, src: y, dst: y, len }),
        Act::GeluErf => v.push(Instr::VUnary { op: UnOp::GeluErf, src: y, dst: y, len }),
        Act::Erf => v.push(Instr::VUnary { op: UnOp::Erf, src: y, dst: y, len }),
        Act::Sqrt => v.push(Instr::VUnary { op: UnOp::Sqrt, src: y, dst: y, len }),
        Act::Recip => v.push(Instr::VUnary { op: UnOp::Recip, src: y, dst: y, len }),
        Act::Exp => v.push(Instr::VUnary { op: UnOp::Exp, src: y, dst: y, len }),
        Act::Sigmoid => v.push(Instr::VUnary { op: UnOp::Sigmoid, src: y, dst: y, len }),
        Act::Tanh => v.push(Instr::VUnary { op: UnOp::Tanh, src: y, dst: y, len }),
        Act::Abs => v.push(Instr::VUnary { op: UnOp::Abs, src: y, dst: y, len }),
        Act::Log => v.push(Instr::VUnary { op: UnOp::Log, src: y, dst: y, len }),
        Act::Floor => v.push(Instr::VUnary { op: UnOp::Floor, src: y, dst: y, len }),
        Act::Ceil => v.push(Instr::VUnary { op: UnOp::Ceil, src: y, dst: y, len }),
        Act::Sin => v.push(Instr::VUnary { op: UnOp::Sin, src: y, dst: y, len }),
        Act::Cos => v.push(Instr::VUnary { op: UnOp::Cos, src: y, dst: y, len }),
        Act::I32ToF32 => v.push(Instr::VUnary { op: UnOp::I32ToF32, src: y, dst: y, len }),
        Act::F32ToI32 => v.push(Instr::VUnary { op: UnOp::F32ToI32, src: y, dst: y, len }),
        Act::Swish | Act::HardSwish => {
            if act == Act::Swish {
                v.push(Instr::VUnary { op: UnOp::Sigmoid, src: y, dst: tmp, len });
            } else {
                v.push(Instr::VAffine { src: y, dst: tmp, len, scale: 1.0 / 6.0, bias: 0.5 });
                v.push(Instr::VClamp { src: tmp, dst: tmp, len, lo: 0.0, hi: 1.0 });
            }
            v.push(Instr::VBinary {
                op: BinOp::Mul,
                bcast: Bcast::None,
                a: y,
                b: tmp,
                dst: y,
                rows: 1,
                cols: len,
            });
        }
        Act::Clamp { scale, bias, lo, hi } => {
            if scale != 1.0 || bias != 0.0 {
                v.push(Instr::VAffine { src: y, dst: y, len, scale, bias });
            }
            if lo > f32::MIN || hi < f32::MAX {
                v.push(Instr::VClamp { src: y, dst: y, len, lo, hi });
            }
        }
    }
    v
}

/// VU instructions converting the f32 operands at `(sram, elems)` to the
/// SA operand type `dtype` in place (none for f32): the bf16 values take
/// the first half of each range.
fn to_sa_type(dtype: DType, ranges: &[(u64, u64)]) -> Vec<Instr> {
    if dtype == DType::F32 {
        return vec![];
    }
    ranges
        .iter()
        .map(|&(at, len)| Instr::VConvert { from: DType::F32, to: dtype, src: at, dst: at, len: len as u32 })
        .collect()
}

/// The VU instruction rounding the `len` f32 values at `at` to bf16 in
/// place before they are stored to a tensor of `esize` bytes per element
/// (none for an f32 tensor): the bf16 values take the first half.
fn narrow(esize: u64, at: u64, len: u64) -> Option<Instr> {
    (esize == 2).then_some(Instr::VConvert {
        from: DType::F32,
        to: DType::Bf16,
        src: at,
        dst: at,
        len: len as u32,
    })
}

/// Where a tile's `len` elements of a tensor of `esize` bytes per element
/// are loaded so that they end up as f32 at `at`, and the VU instruction
/// that widens them there (none for an f32 tensor): bf16 values are loaded
/// into the second half of the f32 range and widened in place.
fn widen(esize: u64, at: u64, len: u64) -> (u64, Option<Instr>) {
    if esize == 2 {
        let src = at + len * 2;
        (src, Some(Instr::VConvert { from: DType::Bf16, to: DType::F32, src, dst: at, len: len as u32 }))
    } else {
        (at, None)
    }
}

/// Whether two strided byte sets `(start, rows, len, stride)` (rows of
/// `len` bytes, `stride` apart) may share a byte: exact when the strides
/// are equal and cover their rows, else by bounding ranges (never a false
/// "no").
fn strided_meet(a: (u64, u64, u64, u64), b: (u64, u64, u64, u64)) -> bool {
    let end =
        |(s, r, l, st): (u64, u64, u64, u64)| s.saturating_add((r - 1).saturating_mul(st)).saturating_add(l);
    if a.1 == 0 || b.1 == 0 || a.2 == 0 || b.2 == 0 || end(a) <= b.0 || end(b) <= a.0 {
        return false;
    }
    let p = a.3;
    if p == 0 || p != b.3 || a.2 > p || b.2 > p {
        return true;
    }
    // Same period: the column intervals must meet on the circle of length p.
    let (pa, pb) = (a.0 % p, b.0 % p);
    (pb + p - pa) % p < a.2 || (pa + p - pb) % p < b.2
}

/// Largest `r` in `1..=hi` with `bytes(r) <= budget`, or 0.
fn max_rows(budget: u64, hi: u32, bytes: impl Fn(u32) -> u64) -> u32 {
    let (mut lo, mut hi) = (0u32, hi);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if bytes(mid) <= budget {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

impl Lowerer {
    fn addr(&self, t: TensorId, elem: u64) -> Addr {
        match self.on_chip[t] {
            Some(at) => Addr::sram(at + elem * self.esize[t]),
            None => Addr::hbm(self.hbm[t] + elem * self.esize[t]),
        }
    }

    /// Picks slot count and rows per tile: as many slots as engines allow
    /// (two per engine), each holding a tile of at most `units` rows whose
    /// SRAM need is `bytes(r)`, spread so every slot gets work.
    fn plan(
        &self,
        op: &str,
        fixed: u64,
        engines: u32,
        units: u32,
        bytes: impl Fn(u32) -> u64,
    ) -> Result<(u32, u32), LowerError> {
        let mut slots = (2 * engines).max(1);
        let avail = self.shape.sram_bytes.saturating_sub(fixed);
        loop {
            let per_slot = avail / u64::from(slots);
            // Spread over the engines, but never into tiles so small that
            // per-tile DMA and synchronisation outweigh the parallelism.
            let min_rows = max_rows(MIN_TILE_BYTES, units, &bytes).max(1);
            let want = units.div_ceil(engines.max(1)).max(min_rows).min(units).max(1);
            let r = max_rows(per_slot, want, |r| bytes(r).next_multiple_of(64));
            if r > 0 {
                return Ok((slots, r));
            }
            if slots == 1 {
                return Err(LowerError::Sram {
                    op: op.into(),
                    need: fixed + bytes(1),
                    have: self.shape.sram_bytes,
                });
            }
            slots -= 1;
        }
    }

    /// The semaphore of the channel `from -> to`: every token `from`
    /// signals on it is consumed by `to`, in program order, so tokens of
    /// different operations can never be confused.
    fn chan(&mut self, from: Engine, to: Engine) -> Result<u8, LowerError> {
        if let Some((_, s)) = self.chans.iter().find(|(k, _)| *k == (from, to)) {
            return Ok(*s);
        }
        let id = self.chans.len();
        if id >= usize::from(NUM_SEMAPHORES) {
            return Err(LowerError::Semaphores);
        }
        self.chans.push(((from, to), id as u8));
        Ok(id as u8)
    }

    /// Emits a pipeline of `n` tiles over `slots` slots laid out as
    /// `layout` says. Slot `p` runs its SA stages on SA `p % sa` and its VU
    /// stages on VU `p % vu` (see [`Tile`] for tiles of several lanes).
    ///
    /// The preload (weights and other parameters: never data an earlier
    /// operation writes) is issued before the previous pipeline's final
    /// waits and stores when it lands outside the SRAM that pipeline still
    /// uses, so the DMA engine loads the next weights while the SAs and VUs
    /// finish the previous operation. The pipeline's own final waits and
    /// stores are deferred the same way ([`Lowerer::flush`]).
    fn pipeline(
        &mut self,
        layout: Layout,
        preload: Vec<Instr>,
        slots: u32,
        n: usize,
        tile: impl FnMut(usize, u32) -> Tile,
    ) -> Result<(), LowerError> {
        self.pipeline_pieces(layout, preload, vec![], slots, n, tile)
    }

    /// [`Lowerer::pipeline`] whose preload ends with weight `pieces`. When
    /// the preload cannot overlap the previous pipeline and weights are
    /// streamed, the first tile of each SA (its "wave": tiles on distinct
    /// SAs) loads before the pieces and runs its lanes' `split` SA code
    /// piece by piece, each part as soon as its piece has landed, while the
    /// rest load. Otherwise the pieces are part of the preload.
    fn pipeline_pieces(
        &mut self,
        layout: Layout,
        preload: Vec<Instr>,
        pieces: Vec<Vec<Instr>>,
        slots: u32,
        n: usize,
        mut tile: impl FnMut(usize, u32) -> Tile,
    ) -> Result<(), LowerError> {
        let nothing = preload.is_empty() && pieces.is_empty();
        // Hoisted: the preload runs while the previous pipeline finishes
        // (with no previous pipeline, it overlaps nothing).
        let hoist = !nothing
            && !self.deferred.is_empty()
            && !self.live.iter().any(|r| overlaps(*r, layout.preload()));
        if !hoist {
            self.flush();
        }
        for i in preload {
            self.b.push(Engine::DMA, i);
        }
        let mut pieces = Some(pieces);
        if hoist || !self.stream || pieces.as_ref().is_some_and(|p| p.len() < 2) {
            for i in pieces.take().into_iter().flatten().flatten() {
                self.b.push(Engine::DMA, i);
            }
        }
        self.flush();
        // Streamed: the tiles before `wave` start on the first piece;
        // `waiting[p]` are the SAs to signal once piece `p` has landed.
        let mut wave = 0;
        let mut waiting: Vec<Vec<Engine>> = Vec::new();
        // Stores not yet emitted, with their tile's index.
        let mut pending: VecDeque<(usize, Posts)> = VecDeque::new();
        // The lanes of the last tile, held back while the next tile's prep
        // is emitted (see below).
        let mut held: Option<Held> = None;
        for t in 0..n {
            let slot = (t as u32) % slots;
            let mut tl = tile(t, slot);
            if self.on_chip.iter().any(Option::is_some) {
                tl.read_in_place(self.shape.sram_bytes);
            }
            let n_lanes = tl.lanes.len();
            if t == 0 && pieces.is_some() {
                let groups = (self.shape.sa as usize / n_lanes.max(1)).max(1);
                wave = n.min(slots as usize).min(groups);
                waiting = vec![Vec::new(); pieces.as_ref().map_or(0, Vec::len)];
            }
            if t < wave {
                for (li, lane) in tl.lanes.iter_mut().enumerate() {
                    let split = std::mem::take(&mut lane.split);
                    let Some(first) = lane.stages.first_mut() else { continue };
                    if split.is_empty()
                        || !matches!(first, Stage::Sa(_))
                        || split.iter().any(|(p, _)| *p >= waiting.len())
                    {
                        continue;
                    }
                    let engine = self.lane_engine(slot, n_lanes, li, first);
                    for (p, _) in &split {
                        if let Some(w) = waiting.get_mut(*p) {
                            w.push(engine);
                        }
                    }
                    *first = Stage::SaPieces(split);
                }
            }
            // Slot `slot` is free once the tile `slots` before this one is
            // stored.
            while pending.front().is_some_and(|(i, _)| i + slots as usize <= t) {
                if let Some((_, lanes)) = pending.pop_front() {
                    self.drain(lanes);
                }
            }
            for i in tl.load {
                self.b.push(Engine::DMA, i);
            }
            let wide = tl.lanes.len() > 1;
            let n_lanes = tl.lanes.len() as u32;
            let mut start = Engine::DMA;
            let has_prep = !tl.prep.is_empty();
            if has_prep {
                let e = if wide { slot * n_lanes } else { slot };
                start = Engine::vu((e % self.shape.vu) as u8);
                let sem = self.chan(Engine::DMA, start)?;
                self.b.push(Engine::DMA, Instr::Signal { sem });
                self.b.push(start, Instr::Wait { sem });
                for i in tl.prep {
                    self.b.push(start, i);
                }
            }
            // A VU stream is in order: if it post-processed tile `t - 1`
            // before preparing tile `t`, tile `t`'s SAs would wait for tile
            // `t - 1`'s SAs to finish, and the SAs would run one after the
            // other. So the last tile's lanes (its post-processing) go after
            // this tile's prep. A slot is reused only after its tile is
            // stored, so this needs two slots.
            let lanes = self.start_lanes(slot, start, tl.lanes)?;
            if let Some(h) = held.take() {
                let posts = self.lanes(h.slot, h.n_lanes, h.start, h.lanes)?;
                pending.push_back((h.tile, posts));
            }
            if has_prep && slots >= 2 {
                held = Some(Held { tile: t, slot, n_lanes: n_lanes as usize, start, lanes });
            } else {
                let posts = self.lanes(slot, n_lanes as usize, start, lanes)?;
                pending.push_back((t, posts));
            }
            if t + 1 == wave {
                self.land(pieces.take().unwrap_or_default(), &waiting)?;
            }
        }
        self.land(pieces.take().unwrap_or_default(), &waiting)?;
        if let Some(h) = held.take() {
            let posts = self.lanes(h.slot, h.n_lanes, h.start, h.lanes)?;
            pending.push_back((h.tile, posts));
        }
        let pending: VecDeque<_> = pending.into_iter().map(|(_, lanes)| lanes).collect();
        self.deferred = pending;
        self.live = layout.live().to_vec();
        Ok(())
    }

    /// The DMA engine loads each weight piece and then signals every SA
    /// whose streamed stage waits for it (`waiting[p]`).
    fn land(&mut self, pieces: Vec<Vec<Instr>>, waiting: &[Vec<Engine>]) -> Result<(), LowerError> {
        for (p, copies) in pieces.into_iter().enumerate() {
            for i in copies {
                self.b.push(Engine::DMA, i);
            }
            for &e in waiting.get(p).map_or(&[][..], Vec::as_slice) {
                let sem = self.chan(Engine::DMA, e)?;
                self.b.push(Engine::DMA, Instr::Signal { sem });
            }
        }
        Ok(())
    }

    /// The engine that runs stage `st` of lane `lane` of a tile of
    /// `n_lanes` lanes in slot `slot` (see [`Tile`]).
    fn lane_engine(&self, slot: u32, n_lanes: usize, lane: usize, st: &Stage) -> Engine {
        let e = if n_lanes > 1 { slot * n_lanes as u32 + lane as u32 } else { slot };
        match st {
            Stage::Sa(_) | Stage::SaPieces(_) => Engine::sa((e % self.shape.sa) as u8),
            Stage::Vu(_) => Engine::vu((e % self.shape.vu) as u8),
        }
    }

    /// When a VU prepared the tile (`start` is not the DMA engine), it
    /// signals every lane's first engine at once, before any lane's later
    /// stages: that VU may also post-process lane 0, and a lane's start
    /// signal queued behind that (which waits for lane 0's SA) would run
    /// the lanes' SAs one after the other instead of side by side. Returns
    /// each lane with the semaphore its first engine waits on, if any.
    fn start_lanes(
        &mut self,
        slot: u32,
        start: Engine,
        lanes: Vec<Lane>,
    ) -> Result<Vec<(Lane, Option<u8>)>, LowerError> {
        let n_lanes = lanes.len();
        let mut out = Vec::with_capacity(n_lanes);
        for (lane, l) in lanes.into_iter().enumerate() {
            let mut started = None;
            if start != Engine::DMA {
                if let Some(first) = l.stages.first().map(|st| self.lane_engine(slot, n_lanes, lane, st)) {
                    if first != start {
                        let sem = self.chan(start, first)?;
                        self.b.push(start, Instr::Signal { sem });
                        started = Some(sem);
                    }
                }
            }
            out.push((l, started));
        }
        Ok(out)
    }

    /// Emits each lane's chain of stages of a tile in slot `slot` whose
    /// first stages `start` starts; returns, per lane, the semaphore its
    /// last engine signals the DMA engine on and the lane's store.
    fn lanes(
        &mut self,
        slot: u32,
        n_lanes: usize,
        start: Engine,
        lanes: Vec<(Lane, Option<u8>)>,
    ) -> Result<Posts, LowerError> {
        let mut posts = Vec::with_capacity(lanes.len());
        for (lane, (l, mut started)) in lanes.into_iter().enumerate() {
            let mut prev = start;
            for st in l.stages {
                let engine = self.lane_engine(slot, n_lanes, lane, &st);
                let parts = match st {
                    Stage::Sa(c) | Stage::Vu(c) => vec![(None, c)],
                    Stage::SaPieces(parts) => parts.into_iter().map(|(p, c)| (Some(p), c)).collect(),
                };
                // One engine's stream is in order: no token needed.
                if let (Some(sem), true) = (started.take(), prev == start) {
                    self.b.push(engine, Instr::Wait { sem });
                } else if engine != prev {
                    let sem = self.chan(prev, engine)?;
                    self.b.push(prev, Instr::Signal { sem });
                    self.b.push(engine, Instr::Wait { sem });
                }
                for (piece, code) in parts {
                    if piece.is_some() {
                        // Its piece has landed ([`Lowerer::land`]).
                        let sem = self.chan(Engine::DMA, engine)?;
                        self.b.push(engine, Instr::Wait { sem });
                    }
                    for i in code {
                        self.b.push(engine, i);
                    }
                }
                prev = engine;
            }
            // Without a compute stage the DMA stream orders itself.
            let post = self.chan(prev, Engine::DMA)?;
            self.b.push(prev, Instr::Signal { sem: post });
            posts.push((post, l.store));
        }
        Ok(posts)
    }

    /// Whether a deferred store writes bytes of `space` in the `rows` rows of
    /// `len` bytes, `stride` apart, from `start`.
    fn deferred_meets(&self, space: Space, start: u64, rows: u64, len: u64, stride: u64) -> bool {
        self.deferred.iter().flatten().flat_map(|(_, store)| store).any(|i| match *i {
            Instr::DmaCopy { dst, rows: r, row_bytes, dst_stride, .. } if dst.space == space => {
                strided_meet((dst.offset, r.into(), row_bytes.into(), dst_stride), (start, rows, len, stride))
            }
            _ => false,
        })
    }

    /// Emits the deferred final waits and stores of the last pipeline.
    fn flush(&mut self) {
        while let Some(lanes) = self.deferred.pop_front() {
            self.drain(lanes);
        }
        self.live.clear();
    }

    /// Where a pipeline with `fixed` preloaded bytes and `used` bytes of
    /// slots goes: preload at the top of SRAM with the slots right below
    /// when that misses what the last pipeline still uses (so its preload
    /// can overlap that pipeline's end), else at the bottom.
    fn bank(&self, fixed: u64, used: u64) -> Layout {
        let wbase = self.shape.sram_bytes.saturating_sub(fixed) / 64 * 64;
        let high = Layout { wbase, fixed, sbase: wbase.saturating_sub(used), used };
        if fixed > 0 && wbase >= used && !self.live.iter().any(|r| overlaps(*r, high.preload())) {
            high
        } else {
            Layout::low(fixed, used)
        }
    }

    /// The DMA engine waits for each lane of a tile and stores its result.
    fn drain(&mut self, lanes: Vec<(u8, Vec<Instr>)>) {
        for (post, store) in lanes {
            self.b.push(Engine::DMA, Instr::Wait { sem: post });
            for i in store {
                self.b.push(Engine::DMA, i);
            }
        }
    }

    /// SA cycles of an `m x k x n` product (weight-stationary estimate,
    /// used only to choose how to split work).
    fn sa_estimate(&self, m: u32, k: u64, n: u32) -> u64 {
        let (r, c) = (u64::from(self.shape.sa_rows.max(1)), u64::from(self.shape.sa_cols.max(1)));
        k.div_ceil(r) * u64::from(n).div_ceil(c) * (2 * r + c - 2 + u64::from(m))
    }

    /// How to spread a product of `units` row units (`m_per_unit` GEMM rows
    /// each) by `k` by a weight chunk of `nt` columns over the SAs. The
    /// candidates: row tiles spread over all slots (every SA holds all `nt`
    /// columns, so each one loads every weight fold), for products shorter
    /// than an array's rows one tile as large as SRAM allows, and tiles
    /// split into column blocks (one lane per block,
    /// `sa / lanes` groups of SAs working on different row tiles). The
    /// shortest by a weight-stationary cycle estimate wins; among those
    /// within 10% of it, the one with the least SA work (no SA reloads
    /// weights for a few percent of time). Returns the slots, units per
    /// tile and the column blocks (one block = no column split).
    #[allow(clippy::too_many_arguments)]
    fn split(
        &self,
        op: &str,
        fixed: u64,
        units: u32,
        m_per_unit: u32,
        k: u64,
        nt: u32,
        bytes: impl Fn(u32) -> u64,
    ) -> Result<(u32, u32, Vec<Block>), LowerError> {
        let sa = self.shape.sa;
        let engines = sa.max(self.shape.vu);
        // (time per SA, total SA work, slots, units per tile, blocks)
        let mut cands: Vec<(u64, u64, u32, u32, Vec<Block>)> = Vec::new();
        let mut add = |slots: u32, rt: u32, blocks: Vec<Block>| {
            let lanes = blocks.len() as u32;
            let groups = (sa / lanes).max(1);
            let tiles = units.div_ceil(rt.max(1));
            let widest = blocks.iter().map(|b| b.cols).max().unwrap_or(nt);
            let per_tile = self.sa_estimate(rt.saturating_mul(m_per_unit), k, widest);
            let work: u64 = blocks
                .iter()
                .map(|b| u64::from(tiles) * self.sa_estimate(rt.saturating_mul(m_per_unit), k, b.cols))
                .sum();
            cands.push((u64::from(tiles.div_ceil(groups)) * per_tile, work, slots, rt, blocks));
        };
        let whole = vec![Block { c0: 0, cols: nt }];
        let (slots, rt) = self.plan(op, fixed, engines, units, &bytes)?;
        add(slots, rt, whole.clone());
        if u64::from(units) * u64::from(m_per_unit) <= u64::from(self.shape.sa_rows) {
            // Fewer rows than an array fold streams: splitting them only
            // multiplies weight loads.
            let (s2, r2) = self.plan(op, fixed, 1, units, &bytes)?;
            add(s2, r2, whole);
        }
        let c = self.shape.sa_cols.max(1);
        let folds = nt.div_ceil(c);
        let lanes = sa.min(folds);
        if lanes >= 2 {
            let mut blocks = Vec::with_capacity(lanes as usize);
            let mut c0 = 0;
            for i in 0..lanes {
                let f = folds / lanes + u32::from(i < folds % lanes);
                let cols = (f * c).min(nt - c0);
                blocks.push(Block { c0, cols });
                c0 += cols;
            }
            let (slots, rt) = self.plan(op, fixed, engines.div_ceil(lanes), units, &bytes)?;
            add(slots, rt, blocks);
        }
        let best = cands.iter().map(|c| c.0).min().unwrap_or(0);
        let pick = cands.into_iter().filter(|c| c.0 * 10 <= best * 11).min_by_key(|c| (c.1, c.0));
        Ok(pick.map_or((slots, rt, vec![Block { c0: 0, cols: nt }]), |p| (p.2, p.3, p.4)))
    }

    /// Loads a weight chunk (columns `n0..n0 + nt` of a `krows x n` matrix)
    /// into SRAM at `dst`, block by block, each block contiguous with its
    /// width as leading dimension.
    fn load_weights(
        &self,
        w: TensorId,
        krows: u64,
        n: u32,
        n0: u32,
        blocks: &[Block],
        dst: u64,
    ) -> Vec<Instr> {
        self.weight_pieces(w, krows, n, n0, blocks, dst, 1).into_iter().map(|p| p.3).collect()
    }

    /// [`Lowerer::load_weights`] in pieces, for weights streamed: each
    /// block in at most `pieces` column ranges of whole SA folds (one: the
    /// whole block),
    /// ordered piece by piece across the blocks (so every block's lane can
    /// start on its first piece). Each: block index, first column within
    /// the block, columns, and the copy.
    fn weight_pieces(
        &self,
        w: TensorId,
        krows: u64,
        n: u32,
        n0: u32,
        blocks: &[Block],
        dst: u64,
        pieces: u32,
    ) -> Vec<(usize, u32, u32, Instr)> {
        let e = self.esize[w];
        let sc = self.shape.sa_cols.max(1);
        let per: Vec<u32> =
            blocks.iter().map(|bl| bl.cols.div_ceil(sc).div_ceil(pieces).max(1) * sc).collect();
        let mut out = Vec::new();
        for j in 0..pieces {
            for (bi, bl) in blocks.iter().enumerate() {
                let pc0 = j * per[bi];
                if pc0 >= bl.cols {
                    continue;
                }
                let pw = per[bi].min(bl.cols - pc0);
                let copy = copy(
                    self.addr(w, u64::from(n0 + bl.c0 + pc0)),
                    Addr::sram(dst + krows * u64::from(bl.c0) * e + u64::from(pc0) * e),
                    krows,
                    u64::from(pw) * e,
                    u64::from(n) * e,
                    u64::from(bl.cols) * e,
                );
                out.push((bi, pc0, pw, copy));
            }
        }
        out
    }

    /// Column chunk of weights (`esize` bytes per element) that fits half
    /// the SRAM with its bias.
    fn weight_chunk(&self, k: u64, n: u32, esize: u64) -> u32 {
        let half = self.shape.sram_bytes / 2;
        let per_col = k * esize + F;
        if per_col * u64::from(n) <= half {
            return n;
        }
        let cols = (half / per_col) as u32;
        let sc = self.shape.sa_cols.max(1);
        if cols >= sc {
            cols / sc * sc
        } else {
            cols.max(1)
        }
    }

    fn linear(
        &mut self,
        name: &str,
        x: View,
        w: TensorId,
        b: TensorId,
        y: View,
        rows: u32,
        k: u32,
        n: u32,
        act: Act,
    ) -> Result<(), LowerError> {
        let we = self.esize[w];
        let nt_max = self.weight_chunk(k.into(), n, we);
        let mut n0 = 0;
        while n0 < n {
            let nt = nt_max.min(n - n0);
            let wbytes = u64::from(k) * u64::from(nt) * we;
            // The bias after the weights, 4-byte aligned (bf16 weights may
            // end mid-word).
            let wbytes = wbytes.next_multiple_of(4);
            let fixed = (wbytes + u64::from(nt) * F).next_multiple_of(64);
            let tmp_cols = if act.needs_scratch() { u64::from(nt) } else { 0 };
            let row_bytes = |r: u32| u64::from(r) * (u64::from(k) + u64::from(nt) + tmp_cols) * F;
            let (slots, rt, blocks) = self.split(name, fixed, rows, 1, k.into(), nt, row_bytes)?;
            let slot_bytes = row_bytes(rt).next_multiple_of(64);
            let tiles = rows.div_ceil(rt) as usize;
            let layout = self.bank(fixed, u64::from(slots.min(tiles as u32)) * slot_bytes);
            let (w_s, b_s) = (layout.wbase, layout.wbase + wbytes);
            let bias = copy(self.addr(b, n0.into()), Addr::sram(b_s), 1, u64::from(nt) * F, 0, 0);
            // Streamed: the bias first, then the weights piece by piece.
            let (preload, parts, pieces) = if self.stream {
                let parts = self.weight_pieces(w, k.into(), n, n0, &blocks, w_s, STREAM_PIECES);
                let pieces = parts.iter().map(|p| vec![p.3]).collect();
                (vec![bias], parts, pieces)
            } else {
                let mut preload = self.load_weights(w, k.into(), n, n0, &blocks, w_s);
                preload.push(bias);
                (preload, vec![], vec![])
            };
            let stream_tiles = if self.stream { self.shape.sa as usize } else { 0 };
            let at = self.elem_addr();
            let dtype = self.dtype;
            let (xe, ye) = (self.esize[x.t], self.esize[y.t]);
            // A bf16 input is the SA's operand as loaded.
            let prep = |inb: u64, len: u64| if xe == 2 { vec![] } else { to_sa_type(dtype, &[(inb, len)]) };
            self.pipeline_pieces(layout, preload, pieces, slots, tiles, |t, slot| {
                let m0 = t as u32 * rt;
                let r = rt.min(rows - m0);
                let base = layout.sbase + u64::from(slot) * slot_bytes;
                let (inb, outb) = (base, base + u64::from(r) * u64::from(k) * F);
                let tmpb = outb + u64::from(r) * u64::from(nt) * F;
                let lanes = blocks
                    .iter()
                    .enumerate()
                    .map(|(bi, bl)| {
                        // Block `bl` of the output: `r x cols`, contiguous.
                        let off = u64::from(r) * u64::from(bl.c0) * F;
                        let wb = w_s + u64::from(k) * u64::from(bl.c0) * we;
                        let mm = |c0: u32, cols: u32| Instr::MatMul {
                            dtype,
                            flags: MatFlags::default(),
                            a: inb,
                            b: wb + u64::from(c0) * we,
                            c: outb + off + u64::from(c0) * F,
                            m: r,
                            k,
                            n: cols,
                            lda: k,
                            ldb: bl.cols,
                            ldc: bl.cols,
                        };
                        // Columns are independent: the parts compute
                        // exactly what the whole product does.
                        let split = if t < stream_tiles {
                            parts
                                .iter()
                                .enumerate()
                                .filter(|(_, part)| part.0 == bi)
                                .map(|(p, part)| (p, vec![mm(part.1, part.2)]))
                                .collect()
                        } else {
                            vec![]
                        };
                        let mut post = bias_act(
                            outb + off,
                            Some(b_s + u64::from(bl.c0) * F),
                            r,
                            bl.cols,
                            act,
                            tmpb + off,
                        );
                        post.extend(narrow(ye, outb + off, u64::from(r) * u64::from(bl.cols)));
                        Lane {
                            stages: vec![Stage::Sa(vec![mm(0, bl.cols)]), Stage::Vu(post)],
                            split,
                            store: vec![copy(
                                Addr::sram(outb + off),
                                at(y.t, u64::from(m0) * u64::from(y.ld) + u64::from(y.col + n0 + bl.c0)),
                                r.into(),
                                u64::from(bl.cols) * ye,
                                u64::from(bl.cols) * ye,
                                u64::from(y.ld) * ye,
                            )],
                        }
                    })
                    .collect();
                Tile {
                    load: vec![copy(
                        at(x.t, u64::from(m0) * u64::from(x.ld) + u64::from(x.col)),
                        Addr::sram(inb),
                        r.into(),
                        u64::from(k) * xe,
                        u64::from(x.ld) * xe,
                        u64::from(k) * xe,
                    )],
                    prep: prep(inb, u64::from(r) * u64::from(k)),
                    lanes,
                }
            })?;
            n0 += nt;
        }
        Ok(())
    }

    /// Input rows of an output band `[oy0, oy0 + r)`: (first row, rows, pad top, pad bottom).
    fn band(s: &Spatial, oy0: u32, r: u32) -> (u32, u32, u16, u16) {
        let (st, k, p, h) = (i64::from(s.sh), i64::from(s.kh), i64::from(s.pad[0]), i64::from(s.h));
        let start = i64::from(oy0) * st - p;
        let end = (i64::from(oy0) + i64::from(r) - 1) * st - p + k;
        let lo = start.max(0);
        let hi = end.min(h);
        ((lo) as u32, (hi - lo).max(0) as u32, (-start).max(0) as u16, (end - h).max(0) as u16)
    }

    /// Convolution (on the SA, with its fused residual add if any) or
    /// depthwise convolution (on the VU). Output pixel `p`'s channels go
    /// to row `p` of the view `y` (rows `y.ld` elements apart, from
    /// column `y.col`); a residual is dense, `cout` per pixel.
    fn conv(
        &mut self,
        name: &str,
        x: TensorId,
        w: TensorId,
        b: TensorId,
        y: View,
        batch: u32,
        s: Spatial,
        cin: u32,
        cout: u32,
        act: Act,
        kind: Conv,
    ) -> Result<(), LowerError> {
        let depthwise = kind == Conv::Depthwise;
        let residual = match kind {
            Conv::Sa(r) => r,
            Conv::Depthwise => None,
        };
        let (ho, wo) = s.out();
        let kk = u64::from(s.kh) * u64::from(s.kw);
        let krows = if depthwise { kk } else { kk * u64::from(cin) };
        let we = self.esize[w];
        let nt_max = if depthwise { cout } else { self.weight_chunk(krows, cout, we) };
        let mut n0 = 0;
        while n0 < cout {
            let nt = nt_max.min(cout - n0);
            let wbytes = krows * u64::from(nt) * we;
            // The bias after the weights, 4-byte aligned (bf16 weights may
            // end mid-word).
            let wbytes = wbytes.next_multiple_of(4);
            let fixed = (wbytes + u64::from(nt) * F).next_multiple_of(64);
            let tmp = u64::from(act.needs_scratch() || residual.is_some_and(|r| r.act.needs_scratch()));
            // The residual's tile beside the output's.
            let res = u64::from(residual.is_some());
            let bytes = |r: u32| {
                let (_, bh, _, _) = Self::band(&s, 0, r.min(ho));
                let in_rows = u64::from(bh.max(((r - 1) * u32::from(s.sh) + u32::from(s.kh)).min(s.h)));
                in_rows * u64::from(s.w) * u64::from(cin) * F
                    + (1 + tmp + res) * u64::from(r) * u64::from(wo) * u64::from(nt) * F
            };
            let (slots, rt, blocks) = if depthwise {
                let (slots, rt) = self.plan(name, fixed, self.shape.vu, ho * batch, bytes)?;
                (slots, rt, vec![Block { c0: 0, cols: nt }])
            } else {
                self.split(name, fixed, ho * batch, wo, krows, nt, bytes)?
            };
            let rt = rt.min(ho);
            let slot_bytes = bytes(rt).next_multiple_of(64);
            let bands = ho.div_ceil(rt);
            let tiles = (batch * bands) as usize;
            let layout = self.bank(fixed, u64::from(slots.min(tiles as u32)) * slot_bytes);
            let (w_s, b_s) = (layout.wbase, layout.wbase + wbytes);
            let mut preload = self.load_weights(w, krows, cout, n0, &blocks, w_s);
            preload.push(copy(self.addr(b, n0.into()), Addr::sram(b_s), 1, u64::from(nt) * F, 0, 0));
            let at = self.elem_addr();
            let esize = self.esize.clone();
            let dtype = self.dtype;
            let (xe, ye) = (self.esize[x], self.esize[y.t]);
            // A bf16 input is the SA's operand as loaded.
            let prep = |inb: u64, len: u64| {
                if depthwise || xe == 2 {
                    vec![]
                } else {
                    to_sa_type(dtype, &[(inb, len)])
                }
            };
            self.pipeline(layout, preload, slots, tiles, |t, slot| {
                let img = t as u32 / bands;
                let oy0 = (t as u32 % bands) * rt;
                let r = rt.min(ho - oy0);
                let (lo, bh, pt, pb) = Self::band(&s, oy0, r);
                let in_elems = u64::from(bh) * u64::from(s.w) * u64::from(cin);
                let base = layout.sbase + u64::from(slot) * slot_bytes;
                let inb = base;
                let outb = base + in_elems * F;
                let out_rows = r * wo;
                let tmpb = outb + u64::from(out_rows) * u64::from(nt) * F;
                let resb = tmpb + tmp * u64::from(out_rows) * u64::from(nt) * F;
                let mut res_load = Vec::new();
                let src_e =
                    (u64::from(img) * u64::from(s.h) + u64::from(lo)) * u64::from(s.w) * u64::from(cin);
                // The band's first output pixel: its element in the
                // (dense) residual and in the output view.
                let pixel0 = (u64::from(img) * u64::from(ho) + u64::from(oy0)) * u64::from(wo);
                let res_e = pixel0 * u64::from(cout) + u64::from(n0);
                let dst_e = pixel0 * u64::from(y.ld) + u64::from(y.col) + u64::from(n0);
                let lanes = blocks
                    .iter()
                    .map(|bl| {
                        // Block `bl` of the output: `out_rows x cols`, contiguous.
                        let off = u64::from(out_rows) * u64::from(bl.c0) * F;
                        let geom = ConvGeom {
                            n: 1,
                            h: bh,
                            w: s.w,
                            cin,
                            cout: bl.cols,
                            kh: s.kh,
                            kw: s.kw,
                            stride_h: s.sh,
                            stride_w: s.sw,
                            pad_top: pt,
                            pad_bottom: pb,
                            pad_left: s.pad[2],
                            pad_right: s.pad[3],
                        };
                        let (wb, ob) = (w_s + krows * u64::from(bl.c0) * we, outb + off);
                        let mut post = bias_act(
                            ob,
                            Some(b_s + u64::from(bl.c0) * F),
                            out_rows,
                            bl.cols,
                            act,
                            tmpb + off,
                        );
                        if let Some(rs) = residual {
                            // The residual's block, laid out as the output's.
                            let len = u64::from(out_rows) * u64::from(bl.cols);
                            let re = esize[rs.r];
                            let (at_r, wide) = widen(re, resb + off, len);
                            res_load.push(copy(
                                at(rs.r, res_e + u64::from(bl.c0)),
                                Addr::sram(at_r),
                                out_rows.into(),
                                u64::from(bl.cols) * re,
                                u64::from(cout) * re,
                                u64::from(bl.cols) * re,
                            ));
                            post.extend(wide);
                            post.push(Instr::VBinary {
                                op: BinOp::Add,
                                bcast: Bcast::None,
                                a: ob,
                                b: resb + off,
                                dst: ob,
                                rows: out_rows,
                                cols: bl.cols,
                            });
                            post.extend(bias_act(ob, None, out_rows, bl.cols, rs.act, tmpb + off));
                        }
                        post.extend(narrow(ye, ob, u64::from(out_rows) * u64::from(bl.cols)));
                        let stages = if depthwise {
                            let mut v = vec![Instr::VDepthwise { src: inb, weights: wb, dst: ob, geom }];
                            v.extend(post);
                            vec![Stage::Vu(v)]
                        } else {
                            vec![
                                Stage::Sa(vec![Instr::Conv2d {
                                    dtype,
                                    flags: MatFlags::default(),
                                    input: inb,
                                    weights: wb,
                                    output: ob,
                                    geom,
                                }]),
                                Stage::Vu(post),
                            ]
                        };
                        Lane {
                            stages,
                            // Conv2d has no weight leading dimension to
                            // split by columns: not streamed.
                            split: vec![],
                            store: vec![copy(
                                Addr::sram(ob),
                                at(y.t, dst_e + u64::from(bl.c0)),
                                out_rows.into(),
                                u64::from(bl.cols) * ye,
                                u64::from(bl.cols) * ye,
                                u64::from(y.ld) * ye,
                            )],
                        }
                    })
                    .collect();
                Tile {
                    load: std::iter::once(copy(at(x, src_e), Addr::sram(inb), 1, in_elems * xe, 0, 0))
                        .chain(res_load)
                        .collect(),
                    prep: prep(inb, in_elems),
                    lanes,
                }
            })?;
            n0 += nt;
        }
        Ok(())
    }

    /// A VU-only pipeline over `units` units of work: `load`, `compute` and
    /// `store` build one tile of `r` units starting at unit `u0` whose SRAM
    /// slot starts at `base`.
    #[allow(clippy::type_complexity)]
    fn vu_tiles(
        &mut self,
        name: &str,
        preload: Vec<Instr>,
        fixed: u64,
        units: u32,
        bytes: impl Fn(u32) -> u64,
        make: impl FnMut(u32, u32, u64) -> (Vec<Instr>, Vec<Instr>, Vec<Instr>),
    ) -> Result<(), LowerError> {
        let (slots, rt) = self.plan(name, fixed, self.shape.vu, units, &bytes)?;
        self.vu_tiles_planned(preload, fixed, units, (slots, rt, bytes(rt)), make)
    }

    /// [`Lowerer::vu_tiles`] with the plan made: `slots` slots of tiles of
    /// `rt` units taking `tile_bytes` each.
    #[allow(clippy::type_complexity)]
    fn vu_tiles_planned(
        &mut self,
        preload: Vec<Instr>,
        fixed: u64,
        units: u32,
        (slots, rt, tile_bytes): (u32, u32, u64),
        mut make: impl FnMut(u32, u32, u64) -> (Vec<Instr>, Vec<Instr>, Vec<Instr>),
    ) -> Result<(), LowerError> {
        let slot_bytes = tile_bytes.next_multiple_of(64);
        let tiles = units.div_ceil(rt) as usize;
        let layout = Layout::low(fixed, u64::from(slots.min(tiles as u32)) * slot_bytes);
        self.pipeline(layout, preload, slots, tiles, |t, slot| {
            let u0 = t as u32 * rt;
            let r = rt.min(units - u0);
            let (load, compute, store) = make(u0, r, fixed + u64::from(slot) * slot_bytes);
            Tile::single(load, vec![Stage::Vu(compute)], store)
        })
    }

    /// A VU-only pipeline over whole images: each tile loads `r` images of
    /// `inn` elements contiguously, `compute(r, src, dst)` turns them into
    /// `r` outputs of `out` elements, which are stored contiguously.
    fn image_tiles(
        &mut self,
        name: &str,
        x: TensorId,
        y: TensorId,
        batch: u32,
        inn: u64,
        out: u64,
        compute: impl Fn(u32, u64, u64) -> Vec<Instr>,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let (xe, ye) = (self.esize[x], self.esize[y]);
        self.vu_tiles(
            name,
            vec![],
            0,
            batch,
            |r| u64::from(r) * (inn + out) * F,
            |u0, r, base| {
                let outb = base + u64::from(r) * inn * F;
                let (img, n) = (u64::from(u0), u64::from(r));
                let (inb, wide) = widen(xe, base, n * inn);
                let mut code: Vec<Instr> = wide.into_iter().collect();
                code.extend(compute(r, base, outb));
                code.extend(narrow(ye, outb, n * out));
                (
                    vec![copy(at(x, img * inn), Addr::sram(inb), 1, n * inn * xe, 0, 0)],
                    code,
                    vec![copy(Addr::sram(outb), at(y, img * out), 1, n * out * ye, 0, 0)],
                )
            },
        )
    }

    /// A pooling whose whole image does not fit SRAM (SSD-ResNet34's
    /// 600 x 600 x 64 max pool): channels pool independently, so each
    /// tile gathers a group of `r` channels of one image (a strided DMA of
    /// one `r`-channel row per pixel), `compute(r, src, dst)` pools them as
    /// an `r`-channel image, and the result is scattered back the same way.
    #[allow(clippy::too_many_arguments)]
    fn pool_channel_tiles(
        &mut self,
        name: &str,
        x: TensorId,
        y: TensorId,
        batch: u32,
        s: Spatial,
        c: u32,
        compute: impl Fn(u32, u64, u64) -> Vec<Instr>,
    ) -> Result<(), LowerError> {
        let (ho, wo) = s.out();
        let at = self.elem_addr();
        let (xe, ye) = (self.esize[x], self.esize[y]);
        let (hw, ohw) = (u64::from(s.h) * u64::from(s.w), u64::from(ho) * u64::from(wo));
        for img in 0..u64::from(batch) {
            let at = at.clone();
            self.vu_tiles(
                name,
                vec![],
                0,
                c,
                |r| u64::from(r) * (hw + ohw) * F,
                |c0, r, base| {
                    let (c0, r64) = (u64::from(c0), u64::from(r));
                    let outb = base + hw * r64 * F;
                    let (inb, wide) = widen(xe, base, hw * r64);
                    let mut code: Vec<Instr> = wide.into_iter().collect();
                    code.extend(compute(r, base, outb));
                    code.extend(narrow(ye, outb, ohw * r64));
                    (
                        vec![copy(
                            at(x, img * hw * u64::from(c) + c0),
                            Addr::sram(inb),
                            hw,
                            r64 * xe,
                            u64::from(c) * xe,
                            r64 * xe,
                        )],
                        code,
                        vec![copy(
                            Addr::sram(outb),
                            at(y, img * ohw * u64::from(c) + c0),
                            ohw,
                            r64 * ye,
                            r64 * ye,
                            u64::from(c) * ye,
                        )],
                    )
                },
            )?;
        }
        Ok(())
    }

    fn eltwise(
        &mut self,
        name: &str,
        binop: BinOp,
        a: View,
        b: View,
        y: View,
        rows: u32,
        cols: u32,
        act: Act,
    ) -> Result<(), LowerError> {
        let row = u64::from(cols) * F;
        let scratch = u64::from(act.needs_scratch());
        self.rows_pipeline(name, (vec![], 0), &[a, b], scratch, y, rows, cols, |base, r| {
            let mut compute = vec![second_into_first(binop, base, r, cols)];
            compute.extend(bias_act(base, None, r, cols, act, base + u64::from(r) * row));
            compute
        })
    }

    /// The HBM address of row `r0` of a view.
    fn row_addr(&self) -> impl Fn(View, u32) -> Addr + Clone {
        let at = self.elem_addr();
        move |v: View, r0: u32| at(v.t, u64::from(r0) * u64::from(v.ld) + u64::from(v.col))
    }

    /// The HBM address of element `e` of tensor `t`, as a closure that
    /// owns its copy of the placement (so it can live inside a tile closure).
    fn elem_addr(&self) -> impl Fn(TensorId, u64) -> Addr + Clone {
        let (hbm, esize, on_chip) = (self.hbm.clone(), self.esize.clone(), self.on_chip.clone());
        move |t: TensorId, e: u64| match on_chip[t] {
            Some(at) => Addr::sram(at + e * esize[t]),
            None => Addr::hbm(hbm[t] + e * esize[t]),
        }
    }

    /// A copy of `r` rows of `cols` f32 elements from SRAM at `sram` into
    /// view `v` from its row `r0`.
    fn rows_store(&self) -> impl Fn(View, u32, u32, u32, u64) -> Instr + Clone {
        let row_at = self.row_addr();
        move |v: View, r0: u32, r: u32, cols: u32, sram: u64| {
            copy(
                Addr::sram(sram),
                row_at(v, r0),
                r.into(),
                u64::from(cols) * F,
                u64::from(cols) * F,
                u64::from(v.ld) * F,
            )
        }
    }

    /// A VU pipeline over whole rows of `cols` elements: each tile of `r`
    /// rows loads the rows of every view of `ins` into consecutive slots of
    /// `r` rows from `base` (`scratch` more slots after them), runs
    /// `compute(base, r)`, and stores the first slot to `y`.
    #[allow(clippy::too_many_arguments)]
    fn rows_pipeline(
        &mut self,
        name: &str,
        (preload, fixed): (Vec<Instr>, u64),
        ins: &[View],
        scratch: u64,
        y: View,
        rows: u32,
        cols: u32,
        compute: impl Fn(u64, u32) -> Vec<Instr>,
    ) -> Result<(), LowerError> {
        let row = u64::from(cols) * F;
        let at = self.row_addr();
        let esize = self.esize.clone();
        let slots = ins.len() as u64 + scratch;
        self.vu_tiles(
            name,
            preload,
            fixed,
            rows,
            |r| u64::from(r) * row * slots,
            |u0, r, base| {
                let slot = |i: u64| base + i * u64::from(r) * row;
                let len = u64::from(r) * u64::from(cols);
                let mut load = Vec::with_capacity(ins.len());
                let mut code = Vec::new();
                for (i, v) in (0u64..).zip(ins) {
                    let e = esize[v.t];
                    let (dst, wide) = widen(e, slot(i), len);
                    let bytes = u64::from(cols) * e;
                    load.push(copy(at(*v, u0), Addr::sram(dst), r.into(), bytes, u64::from(v.ld) * e, bytes));
                    code.extend(wide);
                }
                code.extend(compute(base, r));
                code.extend(narrow(esize[y.t], base, len));
                let out = u64::from(cols) * esize[y.t];
                (
                    load,
                    code,
                    vec![copy(Addr::sram(base), at(y, u0), r.into(), out, out, u64::from(y.ld) * esize[y.t])],
                )
            },
        )
    }

    /// Slots, boxes per tile, classes per product and bytes per tile for
    /// Fast NMS's second pipeline: every class in one product per box where SRAM
    /// allows (instructions per box grow with the number of class chunks,
    /// and a request may carry only so many), one slot per VU (two when
    /// they fit), tiles of at least 16 boxes (each tile adds 19
    /// instructions; smaller tiles only when not even that fits). Fewer
    /// slots before smaller class chunks only when not even one class
    /// fits beside a tile on every VU.
    fn nms_plan(
        &self,
        name: &str,
        fixed: u64,
        n: u32,
        classes: u32,
    ) -> Result<(u32, u32, u32, u64), LowerError> {
        let nb = u64::from(n) * F;
        let bytes = |cc: u32, r: u32| {
            F * (5 * u64::from(r) * u64::from(n) + 2 * u64::from(r) * u64::from(classes)) + u64::from(cc) * nb
        };
        let avail = self.shape.sram_bytes.saturating_sub(fixed);
        let vu = self.shape.vu.max(1);
        for min_r in [n.min(16), 1] {
            let fit = |slots: u32, cc: u32| {
                let r = max_rows(avail / u64::from(slots), n.div_ceil(slots).max(min_r), |r| {
                    bytes(cc, r).next_multiple_of(64)
                });
                (r >= min_r).then_some(r)
            };
            for slots in (1..=vu).rev() {
                let mut chunks = 1;
                while chunks <= classes {
                    let cc = classes.div_ceil(chunks);
                    if let Some(r) = fit(slots, cc) {
                        let (slots, r) = fit(2 * slots, cc).map_or((slots, r), |r2| (2 * slots, r2));
                        return Ok((slots, r, cc, bytes(cc, r)));
                    }
                    if cc == 1 {
                        break;
                    }
                    // The next chunk count that makes the chunks smaller.
                    chunks = classes.div_ceil(cc - 1).max(chunks + 1);
                }
            }
        }
        Err(LowerError::Sram { op: name.into(), need: fixed + bytes(1, 1), have: self.shape.sram_bytes })
    }

    /// [`Op::FastNms`] in two VU pipelines. First the corners and area
    /// of every box (`corners`, five planes of `batch * n`): the boxes'
    /// four coordinates are loaded as planes by strided copies. Then,
    /// per image, the five planes of its boxes and its scores as one
    /// plane per class are preloaded, and each tile of `r` boxes `i`:
    /// five scalar-broadcast operations per box build its rows of
    /// overlap terms against all `n` boxes `j`, ten operations over the
    /// tile turn them into the "IoU above the threshold" steps `T`, then
    /// per box and chunk of classes one row-broadcast product of the
    /// score planes with its row of `T` and one max-reduction give the
    /// highest overlapping score `M` of every class, and four operations
    /// over the tile's `[r][classes]` scores keep the boxes whose score
    /// is not below `M`. Work and instructions grow with `n^2 * classes`
    /// and `n` per image.
    fn fast_nms(
        &mut self,
        name: &str,
        [boxes, scores, corners, y]: [TensorId; 4],
        batch: u32,
        n: u32,
        classes: u32,
        iou: f32,
    ) -> Result<(), LowerError> {
        if n == 0 || classes == 0 || batch == 0 {
            return Ok(());
        }
        let (nb, cb) = (u64::from(n) * F, u64::from(classes) * F);
        let bn = u64::from(batch) * u64::from(n);
        let (ba, ca, sa, ya) = (self.hbm[boxes], self.hbm[corners], self.hbm[scores], self.hbm[y]);
        // 1. Corners: tiles of whole images, 4 input planes, 5 output
        // planes and 2 scratch planes of `r * n` each.
        self.vu_tiles(
            &format!("{name}.corners"),
            vec![],
            0,
            batch,
            |r| u64::from(r) * nb * 11,
            |u0, r, base| {
                let len = r * n;
                let plane = |k: u64| base + k * u64::from(len) * F;
                let first = u64::from(u0) * nb;
                let load = (0..4u64)
                    .map(|k| {
                        copy(Addr::hbm(ba + first * 4 + k * F), Addr::sram(plane(k)), len.into(), F, 4 * F, F)
                    })
                    .collect();
                let (cy, cx, h, w) = (plane(0), plane(1), plane(2), plane(3));
                let [y1, x1, y2, x2, area] = [4, 5, 6, 7, 8].map(plane);
                let (t0, t1) = (plane(9), plane(10));
                let bin =
                    |op, a, b, dst| Instr::VBinary { op, bcast: Bcast::None, a, b, dst, rows: 1, cols: len };
                let compute = vec![
                    Instr::VAffine { src: h, dst: t0, len, scale: 0.5, bias: 0.0 },
                    bin(BinOp::Sub, cy, t0, y1),
                    bin(BinOp::Add, cy, t0, y2),
                    Instr::VAffine { src: w, dst: t0, len, scale: 0.5, bias: 0.0 },
                    bin(BinOp::Sub, cx, t0, x1),
                    bin(BinOp::Add, cx, t0, x2),
                    bin(BinOp::Sub, y2, y1, t0),
                    bin(BinOp::Sub, x2, x1, t1),
                    bin(BinOp::Mul, t0, t1, area),
                ];
                let store = (0..5u64)
                    .map(|k| {
                        copy(
                            Addr::sram(plane(4 + k)),
                            Addr::hbm(ca + (k * bn) * F + first),
                            1,
                            u64::from(len) * F,
                            0,
                            0,
                        )
                    })
                    .collect();
                (load, compute, store)
            },
        )?;
        // 2. Per image: the steps and the suppression. Classes go in
        // chunks of `cc` when one product row of all of them does not fit.
        let fixed = (5 + u64::from(classes)) * nb;
        let (slots, rt, cc, tile_bytes) = self.nms_plan(name, fixed, n, classes)?;
        let chunks: Vec<(u32, u32)> =
            (0..classes).step_by(cc as usize).map(|c0| (c0, cc.min(classes - c0))).collect();
        // The first image's preload reads what the corners pipeline and
        // the operations before stored; each later one lands where the
        // image before still works, which makes the pipeline flush first.
        self.flush();
        for img in 0..u64::from(batch) {
            let mut preload: Vec<Instr> = (0..5u64)
                .map(|k| {
                    copy(Addr::hbm(ca + (k * bn + img * u64::from(n)) * F), Addr::sram(k * nb), 1, nb, 0, 0)
                })
                .collect();
            preload.extend((0..u64::from(classes)).map(|c| {
                copy(
                    Addr::hbm(sa + (img * u64::from(n) * u64::from(classes) + c) * F),
                    Addr::sram((5 + c) * nb),
                    n.into(),
                    F,
                    cb,
                    F,
                )
            }));
            let [py1, px1, py2, px2, parea] = [0u64, 1, 2, 3, 4].map(|k| k * nb);
            let splane = |c: u32| (5 + u64::from(c)) * nb;
            self.vu_tiles_planned(preload, fixed, n, (slots, rt, tile_bytes), |i0, r, base| {
                let rn = u64::from(r) * nb;
                let [x1, x2, y1, y2, u] = [0u64, 1, 2, 3, 4].map(|k| base + k * rn);
                let st = base + 5 * rn;
                let m = st + u64::from(r) * cb;
                let tmp = m + u64::from(r) * cb;
                let row = |mat: u64, q: u32| mat + u64::from(q) * nb;
                let len = r * n;
                let scalar = |op, plane: u64, q: u32, dst| Instr::VBinary {
                    op,
                    bcast: Bcast::Scalar,
                    a: plane,
                    b: plane + u64::from(i0 + q) * F,
                    dst,
                    rows: 1,
                    cols: n,
                };
                let whole =
                    |op, a, b, dst| Instr::VBinary { op, bcast: Bcast::None, a, b, dst, rows: 1, cols: len };
                let mut c = Vec::new();
                for q in 0..r {
                    c.push(scalar(BinOp::Max, px1, q, row(x1, q)));
                    c.push(scalar(BinOp::Min, px2, q, row(x2, q)));
                    c.push(scalar(BinOp::Max, py1, q, row(y1, q)));
                    c.push(scalar(BinOp::Min, py2, q, row(y2, q)));
                    c.push(scalar(BinOp::Add, parea, q, row(u, q)));
                }
                c.extend([
                    whole(BinOp::Sub, x2, x1, x2),
                    Instr::VUnary { op: UnOp::Relu, src: x2, dst: x2, len },
                    whole(BinOp::Sub, y2, y1, y2),
                    Instr::VUnary { op: UnOp::Relu, src: y2, dst: y2, len },
                    whole(BinOp::Mul, x2, y2, x2),
                    whole(BinOp::Sub, u, x2, u),
                    Instr::VAffine { src: u, dst: u, len, scale: -iou, bias: 0.0 },
                    whole(BinOp::Add, u, x2, u),
                    Instr::VAffine { src: u, dst: u, len, scale: NMS_STEP, bias: 0.0 },
                    Instr::VClamp { src: u, dst: u, len, lo: 0.0, hi: 1.0 },
                ]);
                for q in 0..r {
                    for &(c0, k) in &chunks {
                        c.push(Instr::VBinary {
                            op: BinOp::Mul,
                            bcast: Bcast::Row,
                            a: splane(c0),
                            b: row(u, q),
                            dst: tmp,
                            rows: k,
                            cols: n,
                        });
                        c.push(Instr::VReduce {
                            op: RedOp::Max,
                            src: tmp,
                            dst: m + (u64::from(q) * u64::from(classes) + u64::from(c0)) * F,
                            outer: k,
                            reduce: n,
                            inner: 1,
                        });
                    }
                }
                let rc = r * classes;
                c.extend([
                    Instr::VBinary {
                        op: BinOp::Sub,
                        bcast: Bcast::None,
                        a: st,
                        b: m,
                        dst: m,
                        rows: 1,
                        cols: rc,
                    },
                    Instr::VAffine { src: m, dst: m, len: rc, scale: NMS_STEP, bias: 1.0 },
                    Instr::VClamp { src: m, dst: m, len: rc, lo: 0.0, hi: 1.0 },
                    Instr::VBinary {
                        op: BinOp::Mul,
                        bcast: Bcast::None,
                        a: m,
                        b: st,
                        dst: m,
                        rows: 1,
                        cols: rc,
                    },
                ]);
                let first = (img * u64::from(n) + u64::from(i0)) * cb;
                (
                    vec![copy(Addr::hbm(sa + first), Addr::sram(st), 1, u64::from(r) * cb, 0, 0)],
                    c,
                    vec![copy(Addr::sram(m), Addr::hbm(ya + first), 1, u64::from(r) * cb, 0, 0)],
                )
            })?;
        }
        Ok(())
    }

    /// Lowers one operation: checks the geometry every spatial operation
    /// needs, then hands it to the step for its kind.
    fn op(&mut self, op: &Op) -> Result<(), LowerError> {
        match *op {
            Op::Linear { ref name, x, w, b, y, rows, k, n, act } => {
                self.linear(name, x, w, b, y, rows, k, n, act)?
            }
            Op::Conv { ref name, s, .. }
            | Op::Depthwise { ref name, s, .. }
            | Op::Pool { ref name, s, .. }
                if !s.valid() =>
            {
                return Err(LowerError::Geometry {
                    op: name.clone(),
                    reason: "the window does not fit the padded image, or a stride is zero",
                });
            }
            Op::Pool { ref name, s, .. } if !s.uniform() => {
                return Err(LowerError::Geometry {
                    op: name.clone(),
                    reason: "pooling takes one stride and the same padding on every side",
                });
            }
            Op::Conv { ref name, x, w, b, y, batch, s, cin, cout, act, residual } => {
                self.conv(name, x, w, b, y, batch, s, cin, cout, act, Conv::Sa(residual))?
            }
            Op::Depthwise { ref name, x, w, b, y, batch, s, c, act } => {
                self.conv(name, x, w, b, View::dense(y, c), batch, s, c, c, act, Conv::Depthwise)?
            }
            Op::Pool { ref name, x, y, batch, s, c, op } => self.pool_op(name, x, y, batch, s, c, op)?,
            Op::GlobalPool { ref name, x, y, batch, hw, c } => {
                self.global_pool(name, RedOp::Mean, x, y, batch, hw, c)?
            }
            Op::Reduce { ref name, op, x, y, outer, reduce, inner } => {
                self.global_pool(name, op, x, y, outer, reduce, inner)?
            }
            Op::Add { ref name, a, b, y, rows, cols, act } => {
                self.eltwise(name, BinOp::Add, a, b, y, rows, cols, act)?
            }
            Op::Mul { ref name, a, b, y, rows, cols, act } => {
                self.eltwise(name, BinOp::Mul, a, b, y, rows, cols, act)?
            }
            Op::Max { ref name, a, b, y, rows, cols, act } => {
                self.eltwise(name, BinOp::Max, a, b, y, rows, cols, act)?
            }
            Op::Min { ref name, a, b, y, rows, cols, act } => {
                self.eltwise(name, BinOp::Min, a, b, y, rows, cols, act)?
            }
            Op::Compare { ref name, op, a, b, y, rows, cols } => {
                self.eltwise(name, op, a, b, y, rows, cols, Act::None)?
            }
            Op::AddNorm { ref name, a, b, gamma, beta, y, rows, cols, eps } => {
                self.add_norm(name, a, b, gamma, beta, y, rows, cols, eps)?
            }
            Op::RmsNorm { ref name, x, gamma, y, rows, cols, eps } => {
                self.rms_norm(name, x, gamma, y, rows, cols, eps)?
            }
            Op::ScaleChannels { ref name, x, s, y, batch, hw, c } => {
                self.scale_channels(name, x, s, y, batch, hw, c)?
            }
            Op::Attention { ref name, qkv, y, batch, seq, heads, dh } => {
                self.attention(name, qkv, y, batch, seq, heads, dh)?
            }
            Op::Embedding { ref name, table, idx, y, batch, rows, dim, pool } => {
                self.embedding(name, table, idx, y, batch, rows, dim, pool)?
            }
            Op::CachedAttention { .. } => self.cached_attention(op)?,
            Op::Interaction { ref name, z, y, batch, f, d } => self.interaction(name, z, y, batch, f, d)?,
            Op::Unary { ref name, x, y, rows, cols, act } => {
                // One scratch slot (Swish's sigmoid).
                let row = u64::from(cols) * F;
                self.rows_pipeline(name, (vec![], 0), &[x], 1, y, rows, cols, |base, r| {
                    bias_act(base, None, r, cols, act, base + u64::from(r) * row)
                })?
            }
            Op::Softmax { ref name, x, y, rows, cols } => {
                // A scratch slot too: the tiles of Unary's size.
                self.rows_pipeline(name, (vec![], 0), &[x], 1, y, rows, cols, |base, r| {
                    vec![Instr::VSoftmax { src: base, dst: base, rows: r, cols }]
                })?
            }
            Op::BatchMatMul { ref name, a, b, y, lda, ldb, ldy, trans_b, m, k, n, ref offs, act } => {
                self.batch_matmul(name, a, b, y, lda, ldb, ldy, trans_b, m, k, n, offs, act)?
            }
            Op::FastNms { ref name, boxes, scores, corners, y, batch, n, classes, iou } => {
                self.fast_nms(name, [boxes, scores, corners, y], batch, n, classes, iou)?
            }
            Op::Copy { x, y, rows, cols, .. } => self.copy_op(x, y, rows, cols)?,
        }
        Ok(())
    }

    /// Lowers one `Pool` operation.
    fn pool_op(
        &mut self,
        name: &str,
        x: TensorId,
        y: TensorId,
        batch: u32,
        s: Spatial,
        c: u32,
        op: PoolOp,
    ) -> Result<(), LowerError> {
        let (ho, wo) = s.out();
        let (inn, out) = (u64::from(s.h * s.w * c), u64::from(ho * wo * c));
        let geom = |n, c| PoolGeom { n, h: s.h, w: s.w, c, kh: s.kh, kw: s.kw, stride: s.sh, pad: s.pad[0] };
        if self.plan(name, 0, self.shape.vu, batch, |r| u64::from(r) * (inn + out) * F).is_ok() {
            self.image_tiles(name, x, y, batch, inn, out, |r, src, dst| {
                vec![Instr::VPool { op, src, dst, geom: geom(r, c) }]
            })?;
        } else {
            self.pool_channel_tiles(name, x, y, batch, s, c, |r, src, dst| {
                vec![Instr::VPool { op, src, dst, geom: geom(1, r) }]
            })?;
        }
        Ok(())
    }

    /// Lowers one `GlobalPool` operation.
    #[allow(clippy::too_many_arguments)]
    fn global_pool(
        &mut self,
        name: &str,
        op: RedOp,
        x: TensorId,
        y: TensorId,
        batch: u32,
        hw: u32,
        c: u32,
    ) -> Result<(), LowerError> {
        self.image_tiles(name, x, y, batch, u64::from(hw) * u64::from(c), c.into(), |r, src, dst| {
            vec![Instr::VReduce { op, src, dst, outer: r, reduce: hw, inner: c }]
        })?;
        Ok(())
    }

    /// Lowers one `AddNorm` operation.
    #[allow(clippy::too_many_arguments)]
    fn add_norm(
        &mut self,
        name: &str,
        a: TensorId,
        b: Option<TensorId>,
        gamma: TensorId,
        beta: TensorId,
        y: TensorId,
        rows: u32,
        cols: u32,
        eps: f32,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let row = u64::from(cols) * F;
        let preload = vec![
            copy(at(gamma, 0), Addr::sram(0), 1, row, 0, 0),
            copy(at(beta, 0), Addr::sram(row), 1, row, 0, 0),
        ];
        let fixed = (2 * row).next_multiple_of(64);
        let ins: Vec<View> = [Some(a), b].into_iter().flatten().map(|t| View::dense(t, cols)).collect();
        let yv = View::dense(y, cols);
        self.rows_pipeline(name, (preload, fixed), &ins, 0, yv, rows, cols, |base, r| {
            let mut compute: Vec<Instr> =
                b.iter().map(|_| second_into_first(BinOp::Add, base, r, cols)).collect();
            compute.push(Instr::VLayerNorm { src: base, dst: base, gamma: 0, beta: row, rows: r, cols, eps });
            compute
        })?;
        Ok(())
    }

    /// Lowers one `RmsNorm` operation: as `AddNorm` without the add, its
    /// rows through `vu.rmsnorm` with `gamma` preloaded.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &mut self,
        name: &str,
        x: TensorId,
        gamma: TensorId,
        y: TensorId,
        rows: u32,
        cols: u32,
        eps: f32,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let row = u64::from(cols) * F;
        let preload = vec![copy(at(gamma, 0), Addr::sram(0), 1, row, 0, 0)];
        let fixed = row.next_multiple_of(64);
        let yv = View::dense(y, cols);
        self.rows_pipeline(name, (preload, fixed), &[View::dense(x, cols)], 0, yv, rows, cols, |base, r| {
            vec![Instr::VRmsNorm { src: base, dst: base, gamma: 0, rows: r, cols, eps }]
        })?;
        Ok(())
    }

    /// Lowers one `ScaleChannels` operation.
    fn scale_channels(
        &mut self,
        name: &str,
        x: TensorId,
        s: TensorId,
        y: TensorId,
        batch: u32,
        hw: u32,
        c: u32,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        // Units are (image, pixel-row) pairs flattened; a tile never
        // crosses an image so one scale vector serves it.
        let row = u64::from(c) * F;
        let chunk = hw.min(((self.shape.sram_bytes / 4) / (row * 2)).max(1) as u32);
        let per_img = hw.div_ceil(chunk);
        self.vu_tiles(
            name,
            vec![],
            0,
            batch * per_img,
            |r| u64::from(r) * (u64::from(chunk) + 1) * row,
            |u0, r, base| {
                let (mut load, mut comp, mut store) = (vec![], vec![], vec![]);
                for u in u0..u0 + r {
                    let (img, part) = (u / per_img, u % per_img);
                    let p0 = part * chunk;
                    let n = chunk.min(hw - p0);
                    let slot = base + u64::from(u - u0) * (u64::from(chunk) + 1) * row;
                    let sb = slot + u64::from(chunk) * row;
                    let first = u64::from(img) * u64::from(hw) + u64::from(p0);
                    load.push(copy(
                        at(x, first * u64::from(c)),
                        Addr::sram(slot),
                        1,
                        u64::from(n) * row,
                        0,
                        0,
                    ));
                    load.push(copy(at(s, u64::from(img) * u64::from(c)), Addr::sram(sb), 1, row, 0, 0));
                    comp.push(Instr::VBinary {
                        op: BinOp::Mul,
                        bcast: Bcast::Row,
                        a: slot,
                        b: sb,
                        dst: slot,
                        rows: n,
                        cols: c,
                    });
                    store.push(copy(
                        Addr::sram(slot),
                        at(y, first * u64::from(c)),
                        1,
                        u64::from(n) * row,
                        0,
                        0,
                    ));
                }
                (load, comp, store)
            },
        )?;
        Ok(())
    }

    /// Lowers one `Attention` operation.
    fn attention(
        &mut self,
        name: &str,
        qkv: TensorId,
        y: TensorId,
        batch: u32,
        seq: u32,
        heads: u32,
        dh: u32,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let hid = heads * dh;
        let (sd, ss) = (u64::from(seq) * u64::from(dh) * F, u64::from(seq) * u64::from(seq) * F);
        let bytes = 4 * sd + ss;
        let (slots, _) = self.plan(name, 0, self.shape.sa.max(self.shape.vu), 1, |_| bytes)?;
        let slot_bytes = bytes.next_multiple_of(64);
        let scale = 1.0 / (dh as f32).sqrt();
        let n = (batch * heads) as usize;
        let layout = Layout::low(0, u64::from(slots.min(n as u32)) * slot_bytes);
        let dtype = self.dtype;
        self.pipeline(layout, vec![], slots, n, |t, slot| {
            let (bi, h) = (t as u32 / heads, t as u32 % heads);
            let base = u64::from(slot) * slot_bytes;
            let (q, k, v, o, sc) = (base, base + sd, base + 2 * sd, base + 3 * sd, base + 4 * sd);
            let row0 = u64::from(bi) * u64::from(seq) * u64::from(3 * hid);
            let ld = u64::from(3 * hid) * F;
            let part = |which: u32| at(qkv, row0 + u64::from(which * hid + h * dh));
            let dst = at(y, u64::from(bi) * u64::from(seq) * u64::from(hid) + u64::from(h * dh));
            let rowb = u64::from(dh) * F;
            let (sdh, sseq) = (u64::from(seq) * u64::from(dh), u64::from(seq) * u64::from(seq));
            let mut softmax = vec![
                Instr::VAffine { src: sc, dst: sc, len: seq * seq, scale, bias: 0.0 },
                Instr::VSoftmax { src: sc, dst: sc, rows: seq, cols: seq },
            ];
            softmax.extend(to_sa_type(dtype, &[(sc, sseq)]));
            let stages = without_empty_vu([
                Stage::Vu(to_sa_type(dtype, &[(q, sdh), (k, sdh), (v, sdh)])),
                Stage::Sa(vec![Instr::MatMul {
                    dtype,
                    flags: MatFlags { accumulate: false, transpose_b: true },
                    a: q,
                    b: k,
                    c: sc,
                    m: seq,
                    k: dh,
                    n: seq,
                    lda: dh,
                    ldb: dh,
                    ldc: seq,
                }]),
                Stage::Vu(softmax),
                Stage::Sa(vec![Instr::MatMul {
                    dtype,
                    flags: MatFlags::default(),
                    a: sc,
                    b: v,
                    c: o,
                    m: seq,
                    k: seq,
                    n: dh,
                    lda: seq,
                    ldb: dh,
                    ldc: dh,
                }]),
            ]);
            Tile::single(
                vec![
                    copy(part(0), Addr::sram(q), seq.into(), rowb, ld, rowb),
                    copy(part(1), Addr::sram(k), seq.into(), rowb, ld, rowb),
                    copy(part(2), Addr::sram(v), seq.into(), rowb, ld, rowb),
                ],
                stages,
                vec![copy(Addr::sram(o), dst, seq.into(), rowb, rowb, u64::from(hid) * F)],
            )
        })?;
        Ok(())
    }

    /// Lowers one `CachedAttention` operation. A tile is one K/V head of
    /// one sequence with its queries: with one query per sequence (a
    /// decode step) the group's heads, `heads / kv_heads` rows side by
    /// side in `q`; with more (a prefill) one head's `q_len` rows. The
    /// tile loads its rows of `q` and the `kv_len` cached positions of K
    /// and V (contiguous in the cache), multiplies `q K^T` on an SA,
    /// scales, adds the causal mask (preloaded once, `[q_len][kv_len]`),
    /// takes the softmax on a VU, multiplies by V and stores its rows of
    /// `y`. Operands stored as bf16 are the SA's operands as loaded.
    fn cached_attention(&mut self, op: &Op) -> Result<(), LowerError> {
        let Op::CachedAttention {
            ref name,
            q,
            k,
            v,
            mask,
            y,
            batch,
            q_len,
            kv_len,
            cap,
            heads,
            kv_heads,
            dh,
        } = *op
        else {
            return Ok(());
        };
        let bad = |reason| LowerError::Geometry { op: name.clone(), reason };
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(bad("heads is not a multiple of kv_heads"));
        }
        if q_len == 0 || kv_len < q_len || kv_len > cap || dh == 0 {
            return Err(bad("queries, positions and cache do not fit (0 < q_len <= kv_len <= cap)"));
        }
        if (q_len > 1) != mask.is_some() {
            return Err(bad("a causal mask is needed exactly when there is more than one query"));
        }
        let group = heads / kv_heads;
        let at = self.elem_addr();
        let es = self.esize.clone();
        let dtype = self.dtype;
        let m = if q_len == 1 { group } else { q_len };
        let (md, kd) = (u64::from(m) * u64::from(dh), u64::from(kv_len) * u64::from(dh));
        let sc_elems = u64::from(m) * u64::from(kv_len);
        let bytes = (2 * md + 2 * kd + sc_elems) * F;
        let fixed = mask.map_or(0, |_| (u64::from(q_len) * u64::from(kv_len) * F).next_multiple_of(64));
        let (slots, _) = self.plan(name, fixed, self.shape.sa.max(self.shape.vu), 1, |_| bytes)?;
        let slot_bytes = bytes.next_multiple_of(64);
        // (q offset, q row stride, cache offset) in elements; `y` is laid
        // out as `q`.
        let (hs, kvs, dhu, capu) = (u64::from(heads), u64::from(kv_heads), u64::from(dh), u64::from(cap));
        let mut tiles: Vec<(u64, u64, u64)> = Vec::new();
        for b in 0..u64::from(batch) {
            if q_len == 1 {
                for kh in 0..kvs {
                    tiles.push(((b * hs + kh * u64::from(group)) * dhu, dhu, (b * kvs + kh) * capu * dhu));
                }
            } else {
                for h in 0..hs {
                    let kh = h / u64::from(group);
                    tiles.push((
                        (b * u64::from(q_len) * hs + h) * dhu,
                        hs * dhu,
                        (b * kvs + kh) * capu * dhu,
                    ));
                }
            }
        }
        let preload: Vec<Instr> = mask
            .map(|t| copy(at(t, 0), Addr::sram(0), 1, u64::from(q_len) * u64::from(kv_len) * F, 0, 0))
            .into_iter()
            .collect();
        let layout = Layout::low(fixed, u64::from(slots.min(tiles.len() as u32).max(1)) * slot_bytes);
        let scale = 1.0 / (dh as f32).sqrt();
        self.pipeline(layout, preload, slots, tiles.len(), |t, slot| {
            let (qo, ldq, co) = tiles[t];
            let base = fixed + u64::from(slot) * slot_bytes;
            let (qs, ks) = (base, base + md * F);
            let (vs, sc) = (ks + kd * F, ks + 2 * kd * F);
            let o = sc + sc_elems * F;
            let (mut load, mut pre) = (vec![], vec![]);
            // `rows` rows of `cols` elements, `ld` apart, into `sram`.
            let mut fetch = |tensor: TensorId, off: u64, rows: u64, cols: u64, ld: u64, sram: u64| {
                let e = es[tensor];
                load.push(copy(at(tensor, off), Addr::sram(sram), rows, cols * e, ld * e, cols * e));
                if e == 4 {
                    pre.extend(to_sa_type(dtype, &[(sram, rows * cols)]));
                }
            };
            fetch(q, qo, m.into(), dhu, ldq, qs);
            fetch(k, co, 1, kd, kd, ks);
            fetch(v, co, 1, kd, kd, vs);
            let mut softmax = vec![Instr::VAffine { src: sc, dst: sc, len: m * kv_len, scale, bias: 0.0 }];
            if mask.is_some() {
                softmax.push(Instr::VBinary {
                    op: BinOp::Add,
                    bcast: Bcast::None,
                    a: sc,
                    b: 0,
                    dst: sc,
                    rows: m,
                    cols: kv_len,
                });
            }
            softmax.push(Instr::VSoftmax { src: sc, dst: sc, rows: m, cols: kv_len });
            softmax.extend(to_sa_type(dtype, &[(sc, sc_elems)]));
            let ye = es[y];
            let stages = without_empty_vu([
                Stage::Vu(pre),
                Stage::Sa(vec![Instr::MatMul {
                    dtype,
                    flags: MatFlags { accumulate: false, transpose_b: true },
                    a: qs,
                    b: ks,
                    c: sc,
                    m,
                    k: dh,
                    n: kv_len,
                    lda: dh,
                    ldb: dh,
                    ldc: kv_len,
                }]),
                Stage::Vu(softmax),
                Stage::Sa(vec![Instr::MatMul {
                    dtype,
                    flags: MatFlags::default(),
                    a: sc,
                    b: vs,
                    c: o,
                    m,
                    k: kv_len,
                    n: dh,
                    lda: kv_len,
                    ldb: dh,
                    ldc: dh,
                }]),
                Stage::Vu(narrow(ye, o, md).into_iter().collect()),
            ]);
            let store = copy(Addr::sram(o), at(y, qo), m.into(), dhu * ye, dhu * ye, ldq * ye);
            Tile::single(load, stages, vec![store])
        })?;
        Ok(())
    }

    /// Lowers one `Embedding` operation.
    #[allow(clippy::too_many_arguments)]
    fn embedding(
        &mut self,
        name: &str,
        table: TensorId,
        idx: TensorId,
        y: View,
        batch: u32,
        rows: u32,
        dim: u32,
        pool: u32,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let rows_to = self.rows_store();
        let row = u64::from(dim) * F;
        let per = u64::from(pool) * (4 + row) + row;
        let table_addr = at(table, 0);
        self.vu_tiles(
            name,
            vec![],
            0,
            batch,
            |r| u64::from(r) * per,
            |u0, r, base| {
                let n = r * pool;
                let rowsb = base + u64::from(n) * 4;
                let outb = rowsb + u64::from(n) * row;
                (
                    vec![
                        copy(
                            at(idx, u64::from(u0) * u64::from(pool)),
                            Addr::sram(base),
                            1,
                            u64::from(n) * 4,
                            0,
                            0,
                        ),
                        Instr::DmaGather {
                            table: table_addr,
                            indices: base,
                            dst: rowsb,
                            count: n,
                            row_bytes: row as u32,
                            table_rows: rows,
                        },
                    ],
                    vec![Instr::VReduce {
                        op: RedOp::Sum,
                        src: rowsb,
                        dst: outb,
                        outer: r,
                        reduce: pool,
                        inner: dim,
                    }],
                    vec![rows_to(y, u0, r, dim, outb)],
                )
            },
        )?;
        Ok(())
    }

    /// Lowers one `Interaction` operation.
    fn interaction(
        &mut self,
        name: &str,
        z: TensorId,
        y: View,
        batch: u32,
        f: u32,
        d: u32,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let rows_to = self.rows_store();
        let zrow = u64::from(f) * u64::from(d) * F;
        let orow = u64::from(f) * u64::from(f) * F;
        self.vu_tiles(
            name,
            vec![],
            0,
            batch,
            |r| u64::from(r) * (zrow + orow) + zrow,
            |u0, r, base| {
                let outb = base + u64::from(r) * zrow;
                let tmp = outb + u64::from(r) * orow;
                let mut comp = Vec::new();
                for s in 0..u64::from(r) {
                    let zs = base + s * zrow;
                    for i in 0..f {
                        comp.push(Instr::VBinary {
                            op: BinOp::Mul,
                            bcast: Bcast::Row,
                            a: zs,
                            b: zs + u64::from(i) * u64::from(d) * F,
                            dst: tmp,
                            rows: f,
                            cols: d,
                        });
                        comp.push(Instr::VReduce {
                            op: RedOp::Sum,
                            src: tmp,
                            dst: outb + s * orow + u64::from(i * f) * F,
                            outer: f,
                            reduce: d,
                            inner: 1,
                        });
                    }
                }
                (
                    vec![copy(
                        at(z, u64::from(u0) * u64::from(f * d)),
                        Addr::sram(base),
                        1,
                        u64::from(r) * zrow,
                        0,
                        0,
                    )],
                    comp,
                    vec![rows_to(y, u0, r, f * f, outb)],
                )
            },
        )?;
        Ok(())
    }

    /// Lowers one `BatchMatMul` operation.
    #[allow(clippy::too_many_arguments)]
    fn batch_matmul(
        &mut self,
        name: &str,
        a: TensorId,
        b: TensorId,
        y: TensorId,
        lda: u32,
        ldb: u32,
        ldy: u32,
        trans_b: bool,
        m: u32,
        k: u32,
        n: u32,
        offs: &[[u64; 3]],
        act: Act,
    ) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let (ab, bb) = (u64::from(k) * F, u64::from(n) * F);
        let wb = u64::from(k) * bb;
        let tmp = if act.needs_scratch() { bb } else { 0 };
        // An item holds one whole `b_i` and `r` rows of `a_i` and `y_i`.
        let bytes = |r: u32| wb + u64::from(r) * (ab + bb + tmp);
        let engines = self.shape.sa.max(self.shape.vu);
        let count = u32::try_from(offs.len()).map_err(|_| LowerError::Geometry {
            op: name.to_string(),
            reason: "more than 2^32 matrices in one batched product",
        })?;
        // Small matrices go several to a tile (fewer synchronisations);
        // a matrix too large for a slot is split by rows.
        let whole = bytes(m).next_multiple_of(64);
        let (slots, group, rt) = match self.plan(name, 0, engines, count, |g| u64::from(g) * whole) {
            Ok((slots, g)) => (slots, g.min(count.div_ceil(GROUP_TILES * slots)).max(1), m),
            Err(_) => {
                let (slots, rt) = self.plan(name, 0, engines, m, bytes)?;
                (slots, 1, rt)
            }
        };
        let item = bytes(rt).next_multiple_of(64);
        let slot_bytes = u64::from(group) * item;
        let per = m.div_ceil(rt) as usize;
        let n_tiles = if group > 1 { count.div_ceil(group) as usize } else { offs.len() * per };
        let layout = Layout::low(0, u64::from(slots.min(n_tiles as u32)) * slot_bytes);
        let dtype = self.dtype;
        self.pipeline(layout, vec![], slots, n_tiles, |t, slot| {
            // (matrix, first row) of each item of the tile.
            let items: Vec<(usize, u32)> = if group > 1 {
                let g = group as usize;
                (t * g..((t + 1) * g).min(offs.len())).map(|i| (i, 0)).collect()
            } else {
                vec![(t / per, (t % per) as u32 * rt)]
            };
            let (mut load, mut pre, mut sa, mut vu, mut store) = (vec![], vec![], vec![], vec![], vec![]);
            for (j, &(i, m0)) in items.iter().enumerate() {
                let [oa, ob, oy] = offs[i];
                let r = rt.min(m - m0);
                let base = u64::from(slot) * slot_bytes + j as u64 * item;
                let (bs, as_, ys) = (base, base + wb, base + wb + u64::from(r) * ab);
                let (brows, brow) = if trans_b { (n, ab) } else { (k, bb) };
                let row0 = u64::from(m0);
                load.push(copy(at(b, ob), Addr::sram(bs), brows.into(), brow, u64::from(ldb) * F, brow));
                load.push(copy(
                    at(a, oa + row0 * u64::from(lda)),
                    Addr::sram(as_),
                    r.into(),
                    ab,
                    u64::from(lda) * F,
                    ab,
                ));
                pre.extend(to_sa_type(
                    dtype,
                    &[(bs, u64::from(k) * u64::from(n)), (as_, u64::from(r) * u64::from(k))],
                ));
                sa.push(Instr::MatMul {
                    dtype,
                    flags: MatFlags { accumulate: false, transpose_b: trans_b },
                    a: as_,
                    b: bs,
                    c: ys,
                    m: r,
                    k,
                    n,
                    lda: k,
                    ldb: if trans_b { k } else { n },
                    ldc: n,
                });
                vu.extend(bias_act(ys, None, r, n, act, ys + u64::from(r) * bb));
                store.push(copy(
                    Addr::sram(ys),
                    at(y, oy + row0 * u64::from(ldy)),
                    r.into(),
                    bb,
                    bb,
                    u64::from(ldy) * F,
                ));
            }
            Tile::single(load, without_empty_vu([Stage::Vu(pre), Stage::Sa(sa), Stage::Vu(vu)]), store)
        })?;
        Ok(())
    }

    /// Lowers one `Copy` operation.
    fn copy_op(&mut self, x: View, y: View, rows: u32, cols: u32) -> Result<(), LowerError> {
        let at = self.elem_addr();
        let src = at(x.t, u64::from(x.col));
        let dst = at(y.t, u64::from(y.col));
        // The previous operation's deferred stores first when the
        // copy reads or overwrites what they write.
        let row = u64::from(cols) * F;
        if self.deferred_meets(src.space, src.offset, rows.into(), row, u64::from(x.ld) * F)
            || self.deferred_meets(dst.space, dst.offset, rows.into(), row, u64::from(y.ld) * F)
        {
            self.flush();
        }
        self.b.push(
            Engine::DMA,
            copy(src, dst, rows.into(), u64::from(cols) * F, u64::from(x.ld) * F, u64::from(y.ld) * F),
        );
        Ok(())
    }
}

/// Lowers `graph` for a vNPU core of `shape`.
pub fn lower(graph: &Graph, shape: VnpuShape) -> Result<Lowered, LowerError> {
    lower_ops(graph, 0..graph.ops.len(), shape)
}

/// Lowers operation `index` of `graph` alone for a vNPU core of `shape`:
/// an operator-level task. Tensors are placed in HBM exactly as [`lower`]
/// places them whatever the shape, and a task leaves nothing in SRAM for
/// the next one (its outputs are in HBM when it ends), so the tasks of one
/// request can run one after the other on different shapes: the engines a
/// scheduler hands out at each operation boundary (`docs/workloads.md`).
/// An index past the last operation gives an empty program.
pub fn lower_op(graph: &Graph, index: usize, shape: VnpuShape) -> Result<Lowered, LowerError> {
    let end = index.saturating_add(1).min(graph.ops.len());
    lower_ops(graph, index.min(end)..end, shape)
}

/// Lowers the operations `ops` of `graph` (in order) for `shape`, with
/// every tensor of the graph placed as [`lower`] places it: a task of
/// several operations, which leaves its outputs in HBM (as [`lower_op`]),
/// so consecutive ranges of one request can run on different shapes. An
/// empty or out-of-range `ops` gives an empty program.
pub fn lower_ops(
    graph: &Graph,
    ops: std::ops::Range<usize>,
    shape: VnpuShape,
) -> Result<Lowered, LowerError> {
    lower_ops_as(graph, ops, shape, DType::F32)
}

/// [`lower`] with the SA's operands in `dtype`. With bf16, every tensor
/// that is used only as the stored weights of SA products (Linear, Conv)
/// and is not written by the program is placed in HBM as bf16 (half the
/// bytes; the runner stores it rounded to nearest even), and each product's
/// computed operands are converted to bf16 in SRAM by a VU before the SA
/// reads them. The SA accumulates and writes f32, so every activation
/// stays f32 (`docs/compiled-model-format.md` gives the error bound);
/// [`LowerOptions::bf16_activations`] stores them as bf16 instead.
pub fn lower_as(graph: &Graph, shape: VnpuShape, dtype: DType) -> Result<Lowered, LowerError> {
    lower_ops_as(graph, 0..graph.ops.len(), shape, dtype)
}

/// The tensors stored as `dtype` when `graph` is lowered with SA operands
/// of `dtype` (see [`lower_as`]) and, with `bf16_activations`, the
/// intermediate tensors every operation touching them can read and write
/// as bf16 ([`bf16_activation`]).
fn stored_types(graph: &Graph, dtype: DType, bf16_activations: bool, keep_f32: &[TensorId]) -> Vec<DType> {
    let n = graph.tensors.len();
    let mut uses = vec![0u32; n];
    let mut weight = vec![0u32; n];
    let mut bf16_io = vec![0u32; n];
    for op in &graph.ops {
        for t in op.tensors() {
            if let Some(u) = uses.get_mut(t) {
                *u += 1;
            }
            if bf16_activation(op, t) {
                if let Some(u) = bf16_io.get_mut(t) {
                    *u += 1;
                }
            }
        }
        if let Some(w) = op.sa_weight().and_then(|w| weight.get_mut(w)) {
            *w += 1;
        }
    }
    let activations = bf16_activations && dtype == DType::Bf16;
    graph
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let stored = t.init != Init::Activation && weight[i] > 0 && weight[i] == uses[i];
            let activation = activations
                && matches!(t.init, Init::Activation | Init::State)
                && i != graph.input
                && i != graph.output
                && !keep_f32.contains(&i)
                && uses[i] > 0
                && bf16_io[i] == uses[i];
            if stored || activation {
                dtype
            } else {
                DType::F32
            }
        })
        .collect()
}

/// Whether `op` reads or writes tensor `t` through a path that takes bf16
/// activations: the input and output of a product (Linear, Conv: loaded as
/// the SA's bf16 operand, stored after a VU rounds the f32 result) and of
/// the VU operations lowered as row, image or channel tiles (loaded as
/// bf16, widened to f32 by a VU, computed in f32, narrowed before the
/// store). Weights, biases and the operands of every other operation stay
/// f32.
pub fn bf16_activation(op: &Op, t: TensorId) -> bool {
    match *op {
        Op::Linear { x, y, .. } => x.t == t || y.t == t,
        Op::Conv { x, y, residual, .. } => x == t || y.t == t || residual.is_some_and(|r| r.r == t),
        Op::Pool { x, y, .. } | Op::GlobalPool { x, y, .. } | Op::Reduce { x, y, .. } => x == t || y == t,
        Op::Add { a, b, y, .. }
        | Op::Mul { a, b, y, .. }
        | Op::Max { a, b, y, .. }
        | Op::Min { a, b, y, .. } => a.t == t || b.t == t || y.t == t,
        // An integer tensor (read or written by a conversion) keeps its
        // 4 bytes.
        Op::Unary { act: Act::I32ToF32 | Act::F32ToI32, .. } => false,
        Op::Unary { x, y, .. } | Op::Softmax { x, y, .. } => x.t == t || y.t == t,
        // Read as the SA's operands (bf16 as loaded), written after a VU
        // rounds the result.
        Op::CachedAttention { q, k, v, y, .. } => q == t || k == t || v == t || y == t,
        _ => false,
    }
}

/// `graph` with each residual add fused into the convolution that
/// produces one of its operands (as XLA fuses a ResNet block's add into
/// its last convolution): the convolution adds the other operand `r` to
/// its result and applies the add's activation in the same VU pass, so
/// its own output never goes to HBM and the add's three tensor passes
/// (two loads, one store) become one load of `r`.
///
/// An `Add` of operands `a` and `b` into `y` is fused into the `Conv` at
/// index `k` that writes `a` (or `b`) when: the views are dense and the
/// add is over the convolution's whole output (`rows x cols` its
/// elements, split into rows any way);
/// `a` has no other reader and is neither the graph's input nor output;
/// `r` is not `a`, `y` is neither; the convolution does not touch `y`; and
/// no operation between them touches `r` or `y` (so `r` is complete when
/// the convolution runs, which may read it as its input too). The fused convolution writes
/// `y`; `a` keeps its index but no elements (nothing stores it). Tensor
/// indices are unchanged, so a program lowered from the result reads and
/// writes the same tensors as one lowered from `graph`.
pub fn fuse_residual_adds(graph: &Graph) -> Graph {
    fuse_residual_adds_keeping(graph, &[])
}

/// [`fuse_residual_adds`], leaving every tensor of `keep` stored (a
/// compiled model's further outputs, which a guest reads after the
/// program): an add whose operand is one of them is not fused.
pub fn fuse_residual_adds_keeping(graph: &Graph, keep: &[TensorId]) -> Graph {
    let mut g = graph.clone();
    let mut uses = vec![0u32; g.tensors.len()];
    for op in &g.ops {
        for t in op.tensors() {
            if let Some(u) = uses.get_mut(t) {
                *u += 1;
            }
        }
    }
    let mut removed = vec![false; g.ops.len()];
    for j in 0..g.ops.len() {
        let Op::Add { a, b, y, rows, cols, act, .. } = g.ops[j] else { continue };
        let dense = |v: View| v.col == 0 && v.ld == cols;
        if !(dense(a) && dense(b) && dense(y)) || a.t == b.t {
            continue;
        }
        for (c, r) in [(a.t, b.t), (b.t, a.t)] {
            if uses[c] != 2 || c == g.input || c == g.output || keep.contains(&c) || r == y.t || c == y.t {
                continue;
            }
            // The convolution writing `c`.
            let Some(k) = (0..j).rev().find(|&k| !removed[k] && g.ops[k].tensors().contains(&c)) else {
                continue;
            };
            let Op::Conv { y: cy, cout, batch, s, residual: None, .. } = g.ops[k] else { continue };
            let (ho, wo) = s.out();
            let out = u64::from(batch) * u64::from(ho) * u64::from(wo) * u64::from(cout);
            // Dense views over the whole output: the same elements in the
            // same order, however the add splits them into rows.
            if cy != View::dense(c, cout) || u64::from(rows) * u64::from(cols) != out {
                continue;
            }
            let between = (k + 1..j).filter(|&i| !removed[i]).any(|i| {
                let ts = g.ops[i].tensors();
                ts.contains(&r) || ts.contains(&y.t)
            });
            if between || g.ops[k].tensors().contains(&y.t) {
                continue;
            }
            if let Op::Conv { y: cy, residual, .. } = &mut g.ops[k] {
                *cy = View::dense(y.t, cout);
                *residual = Some(Residual { r, act });
            }
            g.tensors[c].elems = 0;
            removed[j] = true;
            break;
        }
    }
    let mut i = 0;
    g.ops.retain(|_| {
        i += 1;
        !removed[i - 1]
    });
    g
}

/// How a graph is lowered, beyond the vNPU's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowerOptions {
    /// The SAs' operand type (see [`lower_as`]).
    pub dtype: DType,
    /// Intermediate tensors share HBM by liveness: a tensor's space is
    /// free for another once the last operation that touches it has run
    /// (see [`place_tensors`]). Off: every tensor has HBM of its own for
    /// the whole request.
    pub reuse_hbm: bool,
    /// With bf16 SA operands, intermediate activations are stored as bf16
    /// in HBM (half the DMA bytes) where every operation touching them can
    /// take it ([`bf16_activation`]); VUs still compute in f32. Off: every
    /// activation is f32 in HBM.
    pub bf16_activations: bool,
    /// Residual adds are fused into the convolution that produces one of
    /// their operands ([`fuse_residual_adds`]; whole graphs only, not an
    /// operator-level range).
    pub fuse_residual: bool,
    /// Weights streamed within an operation: when a product's weights
    /// cannot load while the previous operation runs, the first tile on
    /// each SA starts on the first columns while the rest load (products
    /// only: a convolution's weights have no leading dimension to split).
    /// Off: every tile waits for the whole weight chunk.
    pub stream_weights: bool,
    /// Intermediate activations stay on chip between operations when they
    /// fit (whole graphs only): a quarter of the SRAM holds them, placed by
    /// liveness ([`plan_on_chip`]); the rest goes to HBM. A tile whose
    /// input is on chip reads it where it is instead of copying it into
    /// its slot. Off: every activation goes to HBM and back.
    pub keep_on_chip: bool,
    /// Inverted-residual blocks (a 1x1 expansion, a depthwise convolution,
    /// a 1x1 projection, and the residual add of the block's input) are
    /// lowered as one pipeline whose tiles keep the expanded and filtered
    /// activations in SRAM ([`chain`]; whole graphs with f32 operands and
    /// activations only, and not with `keep_on_chip`). Off: operation by
    /// operation.
    pub fuse_blocks: bool,
}

/// With [`LowerOptions::keep_on_chip`], one SRAM byte in this many holds
/// the activations kept on chip.
pub const ON_CHIP_SHARE: u64 = 4;

/// The operations whose tensors may stay on chip: they address every
/// tensor through the lowering's one address map (the others compute HBM
/// addresses of their own).
fn on_chip_capable(op: &Op) -> bool {
    !matches!(op, Op::FastNms { .. } | Op::Embedding { .. } | Op::Copy { .. })
}

/// The first and last operation that touches each tensor of `graph`
/// (`None`: no operation does).
fn live_ranges(graph: &Graph) -> Vec<Option<(usize, usize)>> {
    let mut range: Vec<Option<(usize, usize)>> = vec![None; graph.tensors.len()];
    for (i, op) in graph.ops.iter().enumerate() {
        for t in op.tensors() {
            if let Some(r) = range.get_mut(t) {
                *r = Some(r.map_or((i, i), |(a, _)| (a, i)));
            }
        }
    }
    range
}

/// Offsets from `base` of the tensors `live` (tensor, first and last
/// operation, bytes) placed in order of first use, each first fit in the
/// space no tensor still live holds; and the end of the space they span.
fn place_by_first_use(live: &[(TensorId, (usize, usize), u64)], base: u64) -> (Vec<(TensorId, u64)>, u64) {
    let mut order: Vec<_> = live.to_vec();
    order.sort_by_key(|&(t, (first, _), _)| (first, t));
    // (start, end, last use) of the space held now, by start.
    let mut held: Vec<(u64, u64, usize)> = Vec::new();
    let (mut placed, mut end) = (Vec::with_capacity(order.len()), base);
    for (t, (first, last), need) in order {
        let at = first_fit(&mut held, base, first, need);
        held.push((at, at + need, last));
        placed.push((t, at));
        end = end.max(at + need);
    }
    (placed, end)
}

/// [`place_by_first_use`]'s result with the tensors placed largest first
/// (ties by first use), each at the lowest offset where it meets no
/// tensor placed before whose live range overlaps its own.
fn place_by_size(live: &[(TensorId, (usize, usize), u64)], base: u64) -> (Vec<(TensorId, u64)>, u64) {
    let mut order: Vec<_> = live.to_vec();
    order.sort_by_key(|&(t, (first, _), need)| (std::cmp::Reverse(need), first, t));
    // (start, end, first use, last use) of every tensor placed.
    let mut done: Vec<(u64, u64, usize, usize)> = Vec::with_capacity(order.len());
    let (mut placed, mut end) = (Vec::with_capacity(order.len()), base);
    for (t, (first, last), need) in order {
        let mut clash: Vec<(u64, u64)> =
            done.iter().filter(|d| d.2 <= last && first <= d.3).map(|d| (d.0, d.1)).collect();
        clash.sort_unstable();
        let at = lowest_gap(clash.into_iter(), base, need);
        done.push((at, at + need, first, last));
        placed.push((t, at));
        end = end.max(at + need);
    }
    (placed, end)
}

/// The lowest offset from `base` where `need` bytes meet none of `held`
/// (start, end, last use) still live at operation `first`; drops from
/// `held` what is no longer live. The caller records what it places.
fn first_fit(held: &mut Vec<(u64, u64, usize)>, base: u64, first: usize, need: u64) -> u64 {
    held.retain(|&(_, _, end)| end >= first);
    held.sort_unstable();
    lowest_gap(held.iter().map(|&(s, e, _)| (s, e)), base, need)
}

/// The lowest offset from `base` where `need` bytes meet none of the
/// spans `taken` (start, end), given in order of start.
fn lowest_gap(taken: impl Iterator<Item = (u64, u64)>, base: u64, need: u64) -> u64 {
    let mut at = base;
    for (s, e) in taken {
        if s >= at + need {
            break;
        }
        at = at.max(e);
    }
    at
}

/// Which intermediate tensors of `graph` (stored as `types`) stay on chip
/// within `budget` bytes, and where (offsets from the region's start):
/// activations other than the graph's input and output and `keep_f32`,
/// touched only by [`on_chip_capable`] operations, each live from the
/// first to the last operation that touches it and placed first fit
/// (64-byte aligned) in order of first use where no tensor live at the
/// same time is; one that does not fit stays in HBM.
pub fn plan_on_chip(graph: &Graph, types: &[DType], keep_f32: &[TensorId], budget: u64) -> Vec<Option<u64>> {
    let n = graph.tensors.len();
    let range = live_ranges(graph);
    let mut capable = vec![true; n];
    for op in graph.ops.iter().filter(|op| !on_chip_capable(op)) {
        for t in op.tensors() {
            if let Some(c) = capable.get_mut(t) {
                *c = false;
            }
        }
    }
    let mut out = vec![None; n];
    let mut order: Vec<usize> = (0..n)
        .filter(|&t| {
            graph.tensors[t].init == Init::Activation
                && t != graph.input
                && t != graph.output
                && !keep_f32.contains(&t)
                && capable[t]
                && range[t].is_some()
        })
        .collect();
    order.sort_by_key(|&t| (range[t].map_or(usize::MAX, |r| r.0), t));
    // (start, end, last use) of the space held now.
    let mut held: Vec<(u64, u64, usize)> = Vec::new();
    for t in order {
        let Some((first, last)) = range[t] else { continue };
        let need = (graph.tensors[t].elems * types[t].size()).next_multiple_of(64);
        let at = first_fit(&mut held, 0, first, need);
        if at + need <= budget {
            out[t] = Some(at);
            held.push((at, at + need, last));
        }
    }
    out
}

impl Default for LowerOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            reuse_hbm: false,
            bf16_activations: false,
            fuse_residual: false,
            stream_weights: false,
            keep_on_chip: false,
            fuse_blocks: false,
        }
    }
}

/// HBM offsets of every tensor of `graph` stored as `types`, and the bytes
/// they span. Without `reuse`, one after the other in tensor order. With
/// `reuse`, the tensors the program does not write (weights, inputs,
/// constants), the graph's input and output and the tensors `pinned` (a
/// compiled model's further inputs and outputs, which a guest writes
/// before the program and reads after it) come first in tensor order and
/// keep their space; every other intermediate tensor (`Init::Activation`)
/// is live from the first to the last operation that touches it, and takes
/// the lowest free space (aligned) that no tensor live at the same time
/// holds: placed in two orders, by first use and by size (largest first,
/// as TensorFlow Lite's arena planner does), keeping the one that spans
/// fewer bytes. Two tensors one operation both touches never share.
pub fn place_tensors(graph: &Graph, types: &[DType], reuse: bool, pinned: &[TensorId]) -> (Vec<Placed>, u64) {
    let bytes = |t: usize| (graph.tensors[t].elems * types[t].size()).next_multiple_of(ALIGN);
    let mut offsets = vec![0u64; graph.tensors.len()];
    let shared = |t: usize| {
        reuse
            && graph.tensors[t].init == Init::Activation
            && t != graph.input
            && t != graph.output
            && !pinned.contains(&t)
    };
    let mut off = 0u64;
    for t in (0..graph.tensors.len()).filter(|&t| !shared(t)) {
        offsets[t] = off;
        off += bytes(t);
    }
    if reuse {
        let range = live_ranges(graph);
        let mut live = Vec::new();
        for t in (0..graph.tensors.len()).filter(|&t| shared(t)) {
            match range[t] {
                Some(r) => live.push((t, r, bytes(t))),
                None => {
                    // Touched by no operation: space of its own.
                    offsets[t] = off;
                    off += bytes(t);
                }
            }
        }
        let by_first_use = place_by_first_use(&live, off);
        let by_size = place_by_size(&live, off);
        let (placed, end) = if by_size.1 < by_first_use.1 { by_size } else { by_first_use };
        for (t, at) in placed {
            offsets[t] = at;
        }
        off = end;
    }
    let placed = graph
        .tensors
        .iter()
        .zip(types)
        .zip(offsets)
        .map(|((t, &dtype), offset)| Placed { offset, elems: t.elems, init: t.init, dtype, on_chip: None })
        .collect();
    (placed, off)
}

/// [`lower_ops`] with the SA's operands in `dtype` (see [`lower_as`]).
pub fn lower_ops_as(
    graph: &Graph,
    ops: std::ops::Range<usize>,
    shape: VnpuShape,
    dtype: DType,
) -> Result<Lowered, LowerError> {
    lower_ops_with(graph, ops, shape, LowerOptions { dtype, ..LowerOptions::default() })
}

/// [`lower_ops`] with `options`.
pub fn lower_ops_with(
    graph: &Graph,
    ops: std::ops::Range<usize>,
    shape: VnpuShape,
    options: LowerOptions,
) -> Result<Lowered, LowerError> {
    lower_ops_keeping(graph, ops, shape, options, &[])
}

/// [`lower_ops_with`], with the tensors `keep_f32` stored as f32 whatever
/// `options.bf16_activations` says (a compiled model's inputs and outputs
/// beyond the graph's one input and output, which guests read and write
/// as f32); with `options.reuse_hbm` they also keep HBM of their own for
/// the whole request, as the graph's input and output do.
pub fn lower_ops_keeping(
    graph: &Graph,
    ops: std::ops::Range<usize>,
    shape: VnpuShape,
    options: LowerOptions,
    keep_f32: &[TensorId],
) -> Result<Lowered, LowerError> {
    let dtype = options.dtype;
    if shape.sa == 0 || shape.vu == 0 {
        return Err(LowerError::Shape { sa: shape.sa, vu: shape.vu });
    }
    // Spread work over at most MAX_ENGINES engines of each kind, so that
    // the channels between them fit the ISA's semaphores.
    let shape = VnpuShape { sa: shape.sa.min(MAX_ENGINES), vu: shape.vu.min(MAX_ENGINES), ..shape };
    let fused;
    let (graph, ops) = if options.fuse_residual && ops == (0..graph.ops.len()) {
        fused = fuse_residual_adds_keeping(graph, keep_f32);
        (&fused, 0..fused.ops.len())
    } else {
        (graph, ops)
    };
    let chained;
    let (graph, chains) = if options.fuse_blocks
        && !options.keep_on_chip
        && !options.bf16_activations
        && dtype == DType::F32
        && ops == (0..graph.ops.len())
    {
        let chains = chain::find_chains(graph, keep_f32, shape.sram_bytes);
        // The tensors a block keeps in SRAM take no HBM.
        let mut g = graph.clone();
        for t in chains.iter().flat_map(|ch| ch.internal(graph)) {
            g.tensors[t].elems = 0;
        }
        chained = g;
        (&chained, chains)
    } else {
        (graph, Vec::new())
    };
    let types = stored_types(graph, dtype, options.bf16_activations, keep_f32);
    let (mut placed, off) = place_tensors(graph, &types, options.reuse_hbm, keep_f32);
    if off > shape.hbm_bytes {
        return Err(LowerError::Hbm { need: off, have: shape.hbm_bytes });
    }
    // Activations kept on chip: the top of SRAM, out of the operations'
    // working SRAM (whole graphs only: operator-level tasks leave their
    // outputs in HBM for the next task).
    // They are placed from the top of SRAM down; an operation works in
    // the SRAM below every tensor kept on chip that is live during it or
    // the operation before (whose last stores and this operation's
    // preload may overlap).
    let total_sram = shape.sram_bytes;
    let mut on_chip = vec![None; graph.tensors.len()];
    let mut work_sram = vec![total_sram; graph.ops.len()];
    if options.keep_on_chip && ops == (0..graph.ops.len()) {
        let budget = (total_sram / ON_CHIP_SHARE) / 64 * 64;
        let plan = plan_on_chip(graph, &types, keep_f32, budget);
        let need = |t: usize| (graph.tensors[t].elems * types[t].size()).next_multiple_of(64);
        let range = live_ranges(graph);
        for (t, at) in plan.iter().enumerate() {
            let (Some(at), Some((first, last))) = (*at, range[t]) else { continue };
            let top = at + need(t);
            on_chip[t] = Some(total_sram - top);
            for w in &mut work_sram[first..(last + 2).min(graph.ops.len())] {
                *w = (*w).min(total_sram - top);
            }
        }
        for (p, o) in placed.iter_mut().zip(&on_chip) {
            p.on_chip = *o;
        }
    }
    let mut l = Lowerer {
        b: ProgramBuilder::new(),
        shape,
        hbm: placed.iter().map(|p| p.offset).collect(),
        chans: Vec::new(),
        deferred: VecDeque::new(),
        live: Vec::new(),
        dtype,
        esize: placed.iter().map(|p| p.dtype.size()).collect(),
        stream: options.stream_weights,
        on_chip,
    };
    let blocks = chains.len();
    let mut chains = chains.iter().peekable();
    for (i, op) in graph.ops.iter().enumerate().skip(ops.start).take(ops.len()) {
        l.shape.sram_bytes = work_sram[i];
        match chains.peek() {
            Some(ch) if ch.first() == i => l.chain(graph, ch)?,
            Some(ch) if ch.first() < i && i <= ch.last() => {
                if i == ch.last() {
                    chains.next();
                }
            }
            _ => l.op(op)?,
        }
    }
    l.flush();
    let program = l.b.finish();
    let limit = vnpu_abi::program::MAX_INSTRUCTIONS;
    if program.instruction_count() > limit {
        return Err(LowerError::Instructions { have: program.instruction_count(), limit });
    }
    Ok(Lowered { program, tensors: placed, hbm_bytes: off, input: graph.input, output: graph.output, blocks })
}

#[cfg(test)]
mod strided_tests {
    use super::strided_meet;

    #[test]
    fn strided_sets_meet_only_where_bytes_are_shared() {
        // Columns 0..16 and 16..32 of rows 64 bytes apart: disjoint.
        assert!(!strided_meet((0, 8, 16, 64), (16, 8, 16, 64)));
        // Columns 0..16 and 8..24: shared.
        assert!(strided_meet((0, 8, 16, 64), (8, 8, 16, 64)));
        // Wrapping: columns 56..64 (+ next row's start) and 0..4 of the next row.
        assert!(strided_meet((56, 2, 12, 64), (64, 1, 4, 64)));
        // Disjoint bounding ranges.
        assert!(!strided_meet((0, 2, 16, 64), (200, 1, 4, 4)));
        // Different strides inside one range: assumed to meet.
        assert!(strided_meet((0, 8, 16, 64), (16, 8, 4, 4)));
        // Empty sets never meet.
        assert!(!strided_meet((0, 0, 16, 64), (0, 8, 16, 64)));
    }
}

#[cfg(test)]
mod placement_tests {
    use super::{place_by_first_use, place_by_size};

    type Live = Vec<(usize, (usize, usize), u64)>;

    /// No two tensors live at once share a byte; every one lies at or
    /// after `base` and inside the span returned.
    fn check(live: &Live, base: u64, (placed, end): &(Vec<(usize, u64)>, u64)) {
        assert_eq!(placed.len(), live.len());
        let at = |t: usize| placed.iter().find(|p| p.0 == t).unwrap().1;
        for (i, &(a, (af, al), an)) in live.iter().enumerate() {
            assert!(at(a) >= base && at(a) + an <= *end);
            for &(b, (bf, bl), bn) in &live[i + 1..] {
                if af <= bl && bf <= al {
                    let (x, y) = (at(a), at(b));
                    assert!(x + an <= y || y + bn <= x, "tensors {a} and {b} are live at once and overlap");
                }
            }
        }
    }

    #[test]
    fn both_orders_never_overlap_tensors_live_at_once() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..200 {
            let n = 1 + next(60) as usize;
            let live: Live = (0..n)
                .map(|t| {
                    let first = next(40) as usize;
                    (t, (first, first + next(10) as usize), (1 + next(16)) * 4096)
                })
                .collect();
            let base = next(4) * 4096;
            check(&live, base, &place_by_first_use(&live, base));
            check(&live, base, &place_by_size(&live, base));
        }
    }

    /// Two small tensors one after the other, then one of both their
    /// sizes: by first use the large one cannot take the first's space
    /// while the second is live and goes after both (4 pages); largest
    /// first, it goes at the start and the small ones around it (3).
    #[test]
    fn largest_first_packs_what_first_use_fragments() {
        let page = 4096;
        let live: Live = vec![(0, (0, 1), page), (1, (1, 2), page), (2, (2, 3), 2 * page)];
        assert_eq!(place_by_first_use(&live, 0).1, 4 * page);
        assert_eq!(place_by_size(&live, 0).1, 3 * page);
    }
}
