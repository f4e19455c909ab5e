//! Instructions and their binary encoding.
//!
//! Every instruction is one opcode byte followed by a payload whose length
//! is fixed by the opcode. All integers are little-endian. Every address is
//! an immediate field, so the memory each instruction touches is known
//! before anything runs (see [`crate::footprint`]).
//!
//! The decoder is total: any byte sequence gives an instruction or a
//! [`DecodeError`], never a panic.

use core::fmt;

/// Number of counting semaphores a program may use (ids `0..NUM_SEMAPHORES`).
pub const NUM_SEMAPHORES: u8 = 64;

/// An address space an instruction can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Space {
    /// The vNPU core's on-chip SRAM segment.
    Sram = 0,
    /// The vNPU core's HBM segment.
    Hbm = 1,
    /// Guest physical memory (DMA only).
    Guest = 2,
}

impl Space {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Sram),
            1 => Some(Self::Hbm),
            2 => Some(Self::Guest),
            _ => None,
        }
    }

    /// A short lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sram => "sram",
            Self::Hbm => "hbm",
            Self::Guest => "guest",
        }
    }
}

/// A byte address in a named space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Addr {
    pub space: Space,
    pub offset: u64,
}

impl Addr {
    pub const fn sram(offset: u64) -> Self {
        Self { space: Space::Sram, offset }
    }
    pub const fn hbm(offset: u64) -> Self {
        Self { space: Space::Hbm, offset }
    }
    pub const fn guest(offset: u64) -> Self {
        Self { space: Space::Guest, offset }
    }
}

/// Element type of SA operands and of conversions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE-754 binary32.
    F32 = 0,
    /// bfloat16 (the upper half of an f32); products accumulate in f32.
    Bf16 = 1,
}

impl DType {
    /// The type a byte names (`None` for an unknown one).
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::F32),
            1 => Some(Self::Bf16),
            _ => None,
        }
    }

    /// How the tools spell it (`vnpu compile --dtype`, reports).
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }

    /// The type a tool's spelling names ([`Self::name`]).
    pub fn from_name(s: &str) -> Option<Self> {
        [Self::F32, Self::Bf16].into_iter().find(|d| d.name() == s)
    }

    /// Size of one element in bytes.
    pub const fn size(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

macro_rules! small_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $n:expr),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum $name { $($(#[$vm])* $v = $n),* }
        impl $name {
            /// Every variant, in encoding order.
            pub const ALL: &'static [Self] = &[$(Self::$v),*];
            fn from_u8(v: u8) -> Option<Self> {
                match v { $($n => Some(Self::$v),)* _ => None }
            }
        }
    };
}

small_enum!(
    /// Element-wise binary operations of the vector unit. The comparisons
    /// give `1.0` when `a op b` holds and `0.0` otherwise, as IEEE compares
    /// (every comparison with a NaN is false, but `Ne`); `Keep` gives `b`
    /// where `a` is not zero and `+0.0` elsewhere (a NaN `a` keeps `b`).
    BinOp {
        Add = 0,
        Sub = 1,
        Mul = 2,
        Max = 3,
        Min = 4,
        Eq = 5,
        Ne = 6,
        Lt = 7,
        Le = 8,
        Gt = 9,
        Ge = 10,
        Keep = 11,
    }
);
small_enum!(
    /// How the second operand of a [`Instr::VBinary`] is broadcast.
    Bcast {
        /// `b` has `rows x cols` elements, like `a`.
        None = 0,
        /// `b` has `cols` elements, added to every row (a bias).
        Row = 1,
        /// `b` has one element.
        Scalar = 2,
    }
);
small_enum!(
    /// Element-wise unary operations of the vector unit.
    UnOp {
        Copy = 0,
        Relu = 1,
        /// The tanh approximation (BERT's).
        Gelu = 2,
        Exp = 3,
        Tanh = 4,
        Sigmoid = 5,
        Neg = 6,
        Recip = 7,
        Sqrt = 8,
        /// The error function.
        Erf = 9,
        /// The exact GELU, `x * (1 + erf(x / sqrt 2)) / 2` (ONNX `Gelu`,
        /// PyTorch's default).
        GeluErf = 10,
        /// `|x|`.
        Abs = 11,
        /// The natural logarithm (NaN below 0, `-inf` at 0).
        Log = 12,
        /// Rounding toward `-inf`.
        Floor = 13,
        /// Rounding toward `+inf`.
        Ceil = 14,
        /// Sine (radians).
        Sin = 15,
        /// Cosine (radians).
        Cos = 16,
        /// Each element's four bytes read as a little-endian `i32`, written
        /// as the nearest `f32` (ties to even: exact up to `2^24`), as ONNX's
        /// `Cast` from an integer to float.
        I32ToF32 = 17,
        /// Each `f32` rounded toward zero to an `i32` (saturating at the
        /// `i32` range; NaN gives 0), written as the `i32`'s four
        /// little-endian bytes: an integer result (an index) for a runner
        /// to read as one.
        F32ToI32 = 18,
    }
);
small_enum!(
    /// Reductions of the vector unit.
    RedOp { Sum = 0, Max = 1, Mean = 2 }
);
small_enum!(
    /// Pooling operations of the vector unit.
    PoolOp { Max = 0, Avg = 1 }
);
small_enum!(
    /// Kinds of engines on a core.
    EngineKind { Dma = 0, Sa = 1, Vu = 2 }
);

/// An engine of a vNPU core: its kind and its index among engines of that kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Engine {
    pub kind: EngineKind,
    pub index: u8,
}

impl PartialOrd for EngineKind {
    fn partial_cmp(&self, other: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for EngineKind {
    fn cmp(&self, other: &Self) -> core::cmp::Ordering {
        (*self as u8).cmp(&(*other as u8))
    }
}

impl Engine {
    pub const DMA: Self = Self { kind: EngineKind::Dma, index: 0 };
    pub const fn sa(index: u8) -> Self {
        Self { kind: EngineKind::Sa, index }
    }
    pub const fn vu(index: u8) -> Self {
        Self { kind: EngineKind::Vu, index }
    }
    pub const fn dma(index: u8) -> Self {
        Self { kind: EngineKind::Dma, index }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = match self.kind {
            EngineKind::Dma => "dma",
            EngineKind::Sa => "sa",
            EngineKind::Vu => "vu",
        };
        write!(f, "{k}{}", self.index)
    }
}

/// Flags of SA instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MatFlags {
    /// Add the product to the existing contents of the output (else overwrite).
    pub accumulate: bool,
    /// `b` is stored transposed (`n x k`, leading dimension `ldb`).
    pub transpose_b: bool,
}

impl MatFlags {
    fn bits(self) -> u8 {
        u8::from(self.accumulate) | (u8::from(self.transpose_b) << 1)
    }
    fn from_bits(b: u8) -> Option<Self> {
        (b & !0b11 == 0).then_some(Self { accumulate: b & 1 != 0, transpose_b: b & 2 != 0 })
    }
}

/// Geometry of an SA convolution. Input is NHWC, weights HWIO
/// (`kh x kw x cin x cout`), output NHWC f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ConvGeom {
    pub n: u32,
    pub h: u32,
    pub w: u32,
    pub cin: u32,
    pub cout: u32,
    pub kh: u16,
    pub kw: u16,
    /// Vertical stride (between output rows).
    pub stride_h: u16,
    /// Horizontal stride (between output columns).
    pub stride_w: u16,
    pub pad_top: u16,
    pub pad_bottom: u16,
    pub pad_left: u16,
    pub pad_right: u16,
}

impl ConvGeom {
    /// Output height and width, or `None` when the geometry is empty or
    /// the kernel does not fit the padded input.
    pub fn out_hw(&self) -> Option<(u32, u32)> {
        if self.stride_h == 0 || self.stride_w == 0 || self.kh == 0 || self.kw == 0 {
            return None;
        }
        let ph = u64::from(self.h) + u64::from(self.pad_top) + u64::from(self.pad_bottom);
        let pw = u64::from(self.w) + u64::from(self.pad_left) + u64::from(self.pad_right);
        let (kh, kw) = (u64::from(self.kh), u64::from(self.kw));
        let (sh, sw) = (u64::from(self.stride_h), u64::from(self.stride_w));
        if ph < kh || pw < kw {
            return None;
        }
        let ho = u32::try_from((ph - kh) / sh + 1).ok()?;
        let wo = u32::try_from((pw - kw) / sw + 1).ok()?;
        Some((ho, wo))
    }
}

/// Geometry of a VU pooling window over an NHWC f32 tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PoolGeom {
    pub n: u32,
    pub h: u32,
    pub w: u32,
    pub c: u32,
    pub kh: u16,
    pub kw: u16,
    pub stride: u16,
    pub pad: u16,
}

impl PoolGeom {
    /// Output height and width, or `None` when the geometry is invalid.
    pub fn out_hw(&self) -> Option<(u32, u32)> {
        if self.stride == 0 || self.kh == 0 || self.kw == 0 {
            return None;
        }
        let ph = u64::from(self.h) + 2 * u64::from(self.pad);
        let pw = u64::from(self.w) + 2 * u64::from(self.pad);
        let (kh, kw, s) = (u64::from(self.kh), u64::from(self.kw), u64::from(self.stride));
        if ph < kh || pw < kw {
            return None;
        }
        Some((u32::try_from((ph - kh) / s + 1).ok()?, u32::try_from((pw - kw) / s + 1).ok()?))
    }
}

/// One instruction. SRAM operands are byte offsets into the core's SRAM
/// segment; VU operands are f32 unless stated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Instr {
    /// DMA engine: copy `rows` rows of `row_bytes` bytes; row `i` goes from
    /// `src + i*src_stride` to `dst + i*dst_stride`.
    DmaCopy { src: Addr, dst: Addr, rows: u32, row_bytes: u32, src_stride: u64, dst_stride: u64 },
    /// DMA engine: gather rows of a table. For `j < count`, reads index
    /// `idx = u32 at sram[indices + 4j]` and copies `row_bytes` bytes from
    /// `table + idx*row_bytes` to `sram[dst + j*row_bytes]`. The table range
    /// (`table_rows * row_bytes`) is checked statically; an index
    /// `>= table_rows` fails the request at run time.
    DmaGather { table: Addr, indices: u64, dst: u64, count: u32, row_bytes: u32, table_rows: u32 },
    /// SA: `C[m x n] (+)= A[m x k] * B[k x n]` (or `B^T` when
    /// `flags.transpose_b`, stored `n x k`). A and B are `dtype`, C is f32.
    /// Leading dimensions are in elements.
    MatMul {
        dtype: DType,
        flags: MatFlags,
        a: u64,
        b: u64,
        c: u64,
        m: u32,
        k: u32,
        n: u32,
        lda: u32,
        ldb: u32,
        ldc: u32,
    },
    /// SA: 2-D convolution, input and weights `dtype`, output f32.
    Conv2d { dtype: DType, flags: MatFlags, input: u64, weights: u64, output: u64, geom: ConvGeom },
    /// VU: `dst = a op b` over a `rows x cols` f32 matrix.
    VBinary { op: BinOp, bcast: Bcast, a: u64, b: u64, dst: u64, rows: u32, cols: u32 },
    /// VU: `dst = op(src)` over `len` f32 elements.
    VUnary { op: UnOp, src: u64, dst: u64, len: u32 },
    /// VU: `dst = src * scale + bias` over `len` f32 elements.
    VAffine { src: u64, dst: u64, len: u32, scale: f32, bias: f32 },
    /// VU: `dst = min(max(src, lo), hi)` over `len` f32 elements
    /// (`lo <= hi`; a NaN element stays NaN).
    VClamp { src: u64, dst: u64, len: u32, lo: f32, hi: f32 },
    /// VU: `src` is `[outer][reduce][inner]`; `dst[outer][inner]` is the
    /// reduction over the middle axis.
    VReduce { op: RedOp, src: u64, dst: u64, outer: u32, reduce: u32, inner: u32 },
    /// VU: row-wise softmax of a `rows x cols` matrix.
    VSoftmax { src: u64, dst: u64, rows: u32, cols: u32 },
    /// VU: row-wise layer norm with per-column `gamma` and `beta`.
    VLayerNorm { src: u64, dst: u64, gamma: u64, beta: u64, rows: u32, cols: u32, eps: f32 },
    /// VU: row-wise RMS norm with per-column `gamma`:
    /// `x / sqrt(mean(x^2) + eps) * gamma` (the decoders' RMSNorm).
    VRmsNorm { src: u64, dst: u64, gamma: u64, rows: u32, cols: u32, eps: f32 },
    /// VU: max or average pooling (average counts only in-bounds elements).
    VPool { op: PoolOp, src: u64, dst: u64, geom: PoolGeom },
    /// VU: depthwise 2-D convolution of an NHWC f32 input with `kh x kw x c`
    /// f32 weights (`geom.cin == geom.cout == c`), f32 output.
    VDepthwise { src: u64, weights: u64, dst: u64, geom: ConvGeom },
    /// VU: convert `len` elements between f32 and bf16 (round to nearest even).
    VConvert { from: DType, to: DType, src: u64, dst: u64, len: u32 },
    /// Any engine: increment semaphore `sem`.
    Signal { sem: u8 },
    /// Any engine: wait until semaphore `sem` is positive, then decrement it.
    Wait { sem: u8 },
    /// Any engine: end of this stream.
    Halt,
}

/// Opcode bytes.
pub mod opcode {
    pub const DMA_COPY: u8 = 0x01;
    pub const DMA_GATHER: u8 = 0x02;
    pub const MATMUL: u8 = 0x10;
    pub const CONV2D: u8 = 0x11;
    pub const VBINARY: u8 = 0x20;
    pub const VUNARY: u8 = 0x21;
    pub const VAFFINE: u8 = 0x22;
    pub const VREDUCE: u8 = 0x23;
    pub const VSOFTMAX: u8 = 0x24;
    pub const VLAYERNORM: u8 = 0x25;
    pub const VPOOL: u8 = 0x26;
    pub const VCONVERT: u8 = 0x27;
    pub const VDEPTHWISE: u8 = 0x28;
    pub const VCLAMP: u8 = 0x29;
    pub const VRMSNORM: u8 = 0x2a;
    pub const SIGNAL: u8 = 0x30;
    pub const WAIT: u8 = 0x31;
    pub const HALT: u8 = 0x3f;
}

/// Why a byte sequence is not an instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The input ended inside an instruction.
    Truncated { opcode: u8, need: usize, have: usize },
    /// The opcode byte names no instruction.
    UnknownOpcode(u8),
    /// A field holds a value outside its range.
    BadField { opcode: u8, field: &'static str, value: u64 },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated { opcode, need, have } => {
                write!(f, "instruction 0x{opcode:02x} truncated: needs {need} bytes, {have} left")
            }
            Self::UnknownOpcode(op) => write!(f, "unknown opcode 0x{op:02x}"),
            Self::BadField { opcode, field, value } => {
                write!(f, "instruction 0x{opcode:02x}: field `{field}` has invalid value {value}")
            }
        }
    }
}

impl core::error::Error for DecodeError {}

impl Instr {
    /// `dma.copy` of `bytes` contiguous bytes from `src` to `dst`.
    pub const fn copy(src: Addr, dst: Addr, bytes: u32) -> Self {
        Self::DmaCopy { src, dst, rows: 1, row_bytes: bytes, src_stride: 0, dst_stride: 0 }
    }

    /// The opcode byte.
    pub fn opcode(&self) -> u8 {
        use opcode::*;
        match self {
            Self::DmaCopy { .. } => DMA_COPY,
            Self::DmaGather { .. } => DMA_GATHER,
            Self::MatMul { .. } => MATMUL,
            Self::Conv2d { .. } => CONV2D,
            Self::VBinary { .. } => VBINARY,
            Self::VUnary { .. } => VUNARY,
            Self::VAffine { .. } => VAFFINE,
            Self::VReduce { .. } => VREDUCE,
            Self::VSoftmax { .. } => VSOFTMAX,
            Self::VLayerNorm { .. } => VLAYERNORM,
            Self::VPool { .. } => VPOOL,
            Self::VConvert { .. } => VCONVERT,
            Self::VDepthwise { .. } => VDEPTHWISE,
            Self::VClamp { .. } => VCLAMP,
            Self::VRmsNorm { .. } => VRMSNORM,
            Self::Signal { .. } => SIGNAL,
            Self::Wait { .. } => WAIT,
            Self::Halt => HALT,
        }
    }

    /// A short mnemonic.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Self::DmaCopy { .. } => "dma.copy",
            Self::DmaGather { .. } => "dma.gather",
            Self::MatMul { .. } => "sa.matmul",
            Self::Conv2d { .. } => "sa.conv2d",
            Self::VBinary { .. } => "vu.binary",
            Self::VUnary { .. } => "vu.unary",
            Self::VAffine { .. } => "vu.affine",
            Self::VReduce { .. } => "vu.reduce",
            Self::VSoftmax { .. } => "vu.softmax",
            Self::VLayerNorm { .. } => "vu.layernorm",
            Self::VPool { .. } => "vu.pool",
            Self::VConvert { .. } => "vu.convert",
            Self::VDepthwise { .. } => "vu.depthwise",
            Self::VClamp { .. } => "vu.clamp",
            Self::VRmsNorm { .. } => "vu.rmsnorm",
            Self::Signal { .. } => "signal",
            Self::Wait { .. } => "wait",
            Self::Halt => "halt",
        }
    }

    /// The engine kind that executes this instruction, or `None` for
    /// instructions every engine executes (signal, wait, halt).
    pub fn engine_kind(&self) -> Option<EngineKind> {
        match self {
            Self::DmaCopy { .. } | Self::DmaGather { .. } => Some(EngineKind::Dma),
            Self::MatMul { .. } | Self::Conv2d { .. } => Some(EngineKind::Sa),
            Self::Signal { .. } | Self::Wait { .. } | Self::Halt => None,
            _ => Some(EngineKind::Vu),
        }
    }

    /// Payload length in bytes (without the opcode byte) for an opcode.
    pub fn payload_len(opcode: u8) -> Option<usize> {
        use opcode::*;
        Some(match opcode {
            DMA_COPY => 2 + 8 + 8 + 4 + 4 + 8 + 8,
            DMA_GATHER => 1 + 8 + 8 + 8 + 4 + 4 + 4,
            MATMUL => 2 + 3 * 8 + 6 * 4,
            CONV2D => 2 + 3 * 8 + 5 * 4 + 8 * 2,
            VBINARY => 2 + 3 * 8 + 2 * 4,
            VUNARY => 1 + 2 * 8 + 4,
            VAFFINE => 2 * 8 + 4 + 4 + 4,
            VREDUCE => 1 + 2 * 8 + 3 * 4,
            VSOFTMAX => 2 * 8 + 2 * 4,
            VLAYERNORM => 4 * 8 + 2 * 4 + 4,
            VPOOL => 1 + 2 * 8 + 4 * 4 + 4 * 2,
            VCONVERT => 2 + 2 * 8 + 4,
            VDEPTHWISE => 3 * 8 + 5 * 4 + 8 * 2,
            VCLAMP => 2 * 8 + 4 + 4 + 4,
            VRMSNORM => 3 * 8 + 2 * 4 + 4,
            SIGNAL | WAIT => 1,
            HALT => 0,
            _ => return None,
        })
    }

    /// Encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        1 + Self::payload_len(self.opcode()).unwrap_or(0)
    }

    /// Appends the encoding of `self` to `out`.
    pub fn encode_into(&self, out: &mut alloc::vec::Vec<u8>) {
        let mut w = Writer(out);
        w.u8(self.opcode());
        match *self {
            Self::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride } => {
                w.u8(src.space as u8);
                w.u8(dst.space as u8);
                w.u64(src.offset);
                w.u64(dst.offset);
                w.u32(rows);
                w.u32(row_bytes);
                w.u64(src_stride);
                w.u64(dst_stride);
            }
            Self::DmaGather { table, indices, dst, count, row_bytes, table_rows } => {
                w.u8(table.space as u8);
                w.u64(table.offset);
                w.u64(indices);
                w.u64(dst);
                w.u32(count);
                w.u32(row_bytes);
                w.u32(table_rows);
            }
            Self::MatMul { dtype, flags, a, b, c, m, k, n, lda, ldb, ldc } => {
                w.u8(dtype as u8);
                w.u8(flags.bits());
                for v in [a, b, c] {
                    w.u64(v);
                }
                for v in [m, k, n, lda, ldb, ldc] {
                    w.u32(v);
                }
            }
            Self::Conv2d { dtype, flags, input, weights, output, geom: g } => {
                w.u8(dtype as u8);
                w.u8(flags.bits());
                for v in [input, weights, output] {
                    w.u64(v);
                }
                w.conv_geom(&g);
            }
            Self::VBinary { op, bcast, a, b, dst, rows, cols } => {
                w.u8(op as u8);
                w.u8(bcast as u8);
                for v in [a, b, dst] {
                    w.u64(v);
                }
                w.u32(rows);
                w.u32(cols);
            }
            Self::VUnary { op, src, dst, len } => {
                w.u8(op as u8);
                w.u64(src);
                w.u64(dst);
                w.u32(len);
            }
            Self::VAffine { src, dst, len, scale, bias } => {
                w.u64(src);
                w.u64(dst);
                w.u32(len);
                w.u32(scale.to_bits());
                w.u32(bias.to_bits());
            }
            Self::VClamp { src, dst, len, lo, hi } => {
                w.u64(src);
                w.u64(dst);
                w.u32(len);
                w.u32(lo.to_bits());
                w.u32(hi.to_bits());
            }
            Self::VReduce { op, src, dst, outer, reduce, inner } => {
                w.u8(op as u8);
                w.u64(src);
                w.u64(dst);
                for v in [outer, reduce, inner] {
                    w.u32(v);
                }
            }
            Self::VSoftmax { src, dst, rows, cols } => {
                w.u64(src);
                w.u64(dst);
                w.u32(rows);
                w.u32(cols);
            }
            Self::VLayerNorm { src, dst, gamma, beta, rows, cols, eps } => {
                for v in [src, dst, gamma, beta] {
                    w.u64(v);
                }
                w.u32(rows);
                w.u32(cols);
                w.u32(eps.to_bits());
            }
            Self::VRmsNorm { src, dst, gamma, rows, cols, eps } => {
                for v in [src, dst, gamma] {
                    w.u64(v);
                }
                w.u32(rows);
                w.u32(cols);
                w.u32(eps.to_bits());
            }
            Self::VPool { op, src, dst, geom: g } => {
                w.u8(op as u8);
                w.u64(src);
                w.u64(dst);
                for v in [g.n, g.h, g.w, g.c] {
                    w.u32(v);
                }
                for v in [g.kh, g.kw, g.stride, g.pad] {
                    w.u16(v);
                }
            }
            Self::VDepthwise { src, weights, dst, geom: g } => {
                for v in [src, weights, dst] {
                    w.u64(v);
                }
                w.conv_geom(&g);
            }
            Self::VConvert { from, to, src, dst, len } => {
                w.u8(from as u8);
                w.u8(to as u8);
                w.u64(src);
                w.u64(dst);
                w.u32(len);
            }
            Self::Signal { sem } | Self::Wait { sem } => w.u8(sem),
            Self::Halt => {}
        }
    }

    /// Decodes one instruction from the start of `bytes`; returns it and
    /// the number of bytes it used.
    pub fn decode(bytes: &[u8]) -> Result<(Self, usize), DecodeError> {
        use opcode::*;
        let Some((&op, rest)) = bytes.split_first() else {
            return Err(DecodeError::Truncated { opcode: 0, need: 1, have: 0 });
        };
        let len = Self::payload_len(op).ok_or(DecodeError::UnknownOpcode(op))?;
        if rest.len() < len {
            return Err(DecodeError::Truncated { opcode: op, need: len + 1, have: bytes.len() });
        }
        let mut r = Reader { b: &rest[..len], op };
        let instr = match op {
            DMA_COPY => {
                let ss = r.space("src.space")?;
                let ds = r.space("dst.space")?;
                Self::DmaCopy {
                    src: Addr { space: ss, offset: r.u64() },
                    dst: Addr { space: ds, offset: r.u64() },
                    rows: r.u32(),
                    row_bytes: r.u32(),
                    src_stride: r.u64(),
                    dst_stride: r.u64(),
                }
            }
            DMA_GATHER => {
                let ts = r.space("table.space")?;
                Self::DmaGather {
                    table: Addr { space: ts, offset: r.u64() },
                    indices: r.u64(),
                    dst: r.u64(),
                    count: r.u32(),
                    row_bytes: r.u32(),
                    table_rows: r.u32(),
                }
            }
            MATMUL => {
                let dtype = r.dtype("dtype")?;
                let flags = r.flags()?;
                Self::MatMul {
                    dtype,
                    flags,
                    a: r.u64(),
                    b: r.u64(),
                    c: r.u64(),
                    m: r.u32(),
                    k: r.u32(),
                    n: r.u32(),
                    lda: r.u32(),
                    ldb: r.u32(),
                    ldc: r.u32(),
                }
            }
            CONV2D => {
                let dtype = r.dtype("dtype")?;
                let flags = r.flags()?;
                if flags.transpose_b {
                    return Err(r.bad("flags", 2));
                }
                Self::Conv2d {
                    dtype,
                    flags,
                    input: r.u64(),
                    weights: r.u64(),
                    output: r.u64(),
                    geom: r.conv_geom(),
                }
            }
            VDEPTHWISE => {
                let (src, weights, dst) = (r.u64(), r.u64(), r.u64());
                let geom = r.conv_geom();
                if geom.cin != geom.cout {
                    return Err(r.bad("cout", geom.cout.into()));
                }
                Self::VDepthwise { src, weights, dst, geom }
            }
            VBINARY => {
                let v = r.u8();
                let op = BinOp::from_u8(v).ok_or(r.bad("op", v.into()))?;
                let v = r.u8();
                let bcast = Bcast::from_u8(v).ok_or(r.bad("bcast", v.into()))?;
                Self::VBinary {
                    op,
                    bcast,
                    a: r.u64(),
                    b: r.u64(),
                    dst: r.u64(),
                    rows: r.u32(),
                    cols: r.u32(),
                }
            }
            VUNARY => {
                let v = r.u8();
                let op = UnOp::from_u8(v).ok_or(r.bad("op", v.into()))?;
                Self::VUnary { op, src: r.u64(), dst: r.u64(), len: r.u32() }
            }
            VAFFINE => Self::VAffine {
                src: r.u64(),
                dst: r.u64(),
                len: r.u32(),
                scale: r.f32("scale")?,
                bias: r.f32("bias")?,
            },
            VCLAMP => {
                let (src, dst, len) = (r.u64(), r.u64(), r.u32());
                let lo = r.f32("lo")?;
                let hi = r.f32("hi")?;
                if lo > hi {
                    return Err(r.bad("hi", hi.to_bits().into()));
                }
                Self::VClamp { src, dst, len, lo, hi }
            }
            VREDUCE => {
                let v = r.u8();
                let op = RedOp::from_u8(v).ok_or(r.bad("op", v.into()))?;
                Self::VReduce {
                    op,
                    src: r.u64(),
                    dst: r.u64(),
                    outer: r.u32(),
                    reduce: r.u32(),
                    inner: r.u32(),
                }
            }
            VSOFTMAX => Self::VSoftmax { src: r.u64(), dst: r.u64(), rows: r.u32(), cols: r.u32() },
            VLAYERNORM => Self::VLayerNorm {
                src: r.u64(),
                dst: r.u64(),
                gamma: r.u64(),
                beta: r.u64(),
                rows: r.u32(),
                cols: r.u32(),
                eps: r.f32("eps")?,
            },
            VRMSNORM => Self::VRmsNorm {
                src: r.u64(),
                dst: r.u64(),
                gamma: r.u64(),
                rows: r.u32(),
                cols: r.u32(),
                eps: r.f32("eps")?,
            },
            VPOOL => {
                let v = r.u8();
                let op = PoolOp::from_u8(v).ok_or(r.bad("op", v.into()))?;
                Self::VPool {
                    op,
                    src: r.u64(),
                    dst: r.u64(),
                    geom: PoolGeom {
                        n: r.u32(),
                        h: r.u32(),
                        w: r.u32(),
                        c: r.u32(),
                        kh: r.u16(),
                        kw: r.u16(),
                        stride: r.u16(),
                        pad: r.u16(),
                    },
                }
            }
            VCONVERT => {
                let from = r.dtype("from")?;
                let to = r.dtype("to")?;
                Self::VConvert { from, to, src: r.u64(), dst: r.u64(), len: r.u32() }
            }
            SIGNAL | WAIT => {
                let sem = r.u8();
                if sem >= NUM_SEMAPHORES {
                    return Err(r.bad("sem", sem.into()));
                }
                if op == SIGNAL {
                    Self::Signal { sem }
                } else {
                    Self::Wait { sem }
                }
            }
            HALT => Self::Halt,
            other => return Err(DecodeError::UnknownOpcode(other)),
        };
        Ok((instr, len + 1))
    }
}

struct Writer<'a>(&'a mut alloc::vec::Vec<u8>);

impl Writer<'_> {
    fn conv_geom(&mut self, g: &ConvGeom) {
        for v in [g.n, g.h, g.w, g.cin, g.cout] {
            self.u32(v);
        }
        for v in [g.kh, g.kw, g.stride_h, g.stride_w, g.pad_top, g.pad_bottom, g.pad_left, g.pad_right] {
            self.u16(v);
        }
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

/// Reads fields from a payload whose length was checked up front, so the
/// getters cannot run past the end; they return zero if they ever did.
struct Reader<'a> {
    b: &'a [u8],
    op: u8,
}

impl Reader<'_> {
    fn conv_geom(&mut self) -> ConvGeom {
        ConvGeom {
            n: self.u32(),
            h: self.u32(),
            w: self.u32(),
            cin: self.u32(),
            cout: self.u32(),
            kh: self.u16(),
            kw: self.u16(),
            stride_h: self.u16(),
            stride_w: self.u16(),
            pad_top: self.u16(),
            pad_bottom: self.u16(),
            pad_left: self.u16(),
            pad_right: self.u16(),
        }
    }
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        if let Some((head, tail)) = self.b.split_at_checked(N) {
            out.copy_from_slice(head);
            self.b = tail;
        }
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    fn bad(&self, field: &'static str, value: u64) -> DecodeError {
        DecodeError::BadField { opcode: self.op, field, value }
    }
    fn f32(&mut self, field: &'static str) -> Result<f32, DecodeError> {
        let bits = self.u32();
        let v = f32::from_bits(bits);
        if v.is_finite() {
            Ok(v)
        } else {
            Err(self.bad(field, bits.into()))
        }
    }
    fn space(&mut self, field: &'static str) -> Result<Space, DecodeError> {
        let v = self.u8();
        Space::from_u8(v).ok_or(self.bad(field, v.into()))
    }
    fn dtype(&mut self, field: &'static str) -> Result<DType, DecodeError> {
        let v = self.u8();
        DType::from_u8(v).ok_or(self.bad(field, v.into()))
    }
    fn flags(&mut self) -> Result<MatFlags, DecodeError> {
        let v = self.u8();
        MatFlags::from_bits(v).ok_or(self.bad("flags", v.into()))
    }
}

impl EngineKind {
    /// Decodes an engine kind byte.
    pub fn from_byte(v: u8) -> Option<Self> {
        Self::from_u8(v)
    }
}
