//! The layer-graph IR: what the workload library builds its networks in,
//! what the ONNX compiler translates a model into, and what `npu-lower`
//! turns into vNPU programs; and a plain CPU interpreter of it
//! ([`reference`]) that the lowered programs are checked against.
//!
//! A graph is a list of operations over tensors that live in the vNPU's
//! HBM. Activations are NHWC for CNNs and `[rows][cols]` for everything
//! else; the batch is part of every activation's leading dimension.

pub mod reference;

pub use vnpu_abi::{PoolOp, RedOp};

/// Index of a tensor in [`Graph::tensors`].
pub type TensorId = usize;

/// How the runner fills a tensor before a functional run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in `±1/sqrt(fan_in)`.
    Weights {
        fan_in: u32,
    },
    /// Uniform in `±0.1`.
    Bias,
    Ones,
    Zeros,
    /// Uniform in `±1`: the network's input.
    Input,
    /// u32 indices uniform in `0..max`.
    Indices {
        max: u32,
    },
    /// Written by the program.
    Activation,
    /// State that stays in HBM between requests, such as a decoder's K/V
    /// cache: read before this program writes it, so never given to
    /// another tensor's space or kept on chip. Zeros in a synthetic run.
    State,
    /// The additive causal mask of [`Op::CachedAttention`] for `q_len`
    /// queries over `kv_len` positions: element `(i, j)` is 0 when
    /// `j <= kv_len - q_len + i`, else `-inf`.
    CausalMask {
        q_len: u32,
        kv_len: u32,
    },
}

impl Init {
    /// Element `i` of a [`Init::CausalMask`] (`None` for other kinds).
    pub fn causal_mask(&self, i: u64) -> Option<f32> {
        let Init::CausalMask { q_len, kv_len } = *self else { return None };
        let (row, col) = (i / u64::from(kv_len.max(1)), i % u64::from(kv_len.max(1)));
        let last = u64::from(kv_len.saturating_sub(q_len)) + row;
        Some(if col <= last { 0.0 } else { f32::NEG_INFINITY })
    }
}

/// A tensor: its size in 4-byte elements and how it is initialised.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub elems: u64,
    pub init: Init,
}

/// A row-major matrix view into a tensor: `rows x cols` elements starting
/// at column `col` of rows `ld` elements long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    pub t: TensorId,
    pub ld: u32,
    pub col: u32,
}

impl View {
    pub fn dense(t: TensorId, cols: u32) -> Self {
        Self { t, ld: cols, col: 0 }
    }
}

/// A residual add fused into the convolution that produces one of its
/// operands: `y = act(conv_act(conv + bias) + r)`, `r` having the
/// convolution's output shape (see `npu_lower::fuse_residual_adds`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Residual {
    pub r: TensorId,
    pub act: Act,
}

/// Activation applied on the VU after an operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    None,
    Relu,
    /// The tanh approximation of GELU (BERT's).
    Gelu,
    /// The exact GELU `x (1 + erf(x / sqrt 2)) / 2` (ONNX `Gelu`).
    GeluErf,
    /// The error function.
    Erf,
    /// The square root (NaN below 0).
    Sqrt,
    /// `1 / x`.
    Recip,
    /// `e^x`.
    Exp,
    Sigmoid,
    /// `x * sigmoid(x)` (SiLU), EfficientNet's activation.
    Swish,
    Tanh,
    /// `min(max(x * scale + bias, lo), hi)`: an affine map (`lo`/`hi` at
    /// `-/+f32::MAX`), `Clip`/ReLU6 (`scale` 1, `bias` 0), the hard
    /// sigmoid (`lo` 0, `hi` 1). All four finite.
    Clamp {
        scale: f32,
        bias: f32,
        lo: f32,
        hi: f32,
    },
    /// `x * min(max(x / 6 + 1/2, 0), 1)`, MobileNetV3's activation.
    HardSwish,
    /// `|x|`.
    Abs,
    /// The natural logarithm.
    Log,
    /// Rounding toward `-inf`.
    Floor,
    /// Rounding toward `+inf`.
    Ceil,
    /// Sine.
    Sin,
    /// Cosine.
    Cos,
    /// The input's elements are `i32` (an integer model input): each is
    /// converted to the nearest `f32` (ONNX `Cast` to float).
    I32ToF32,
    /// Each `f32` rounded toward zero to an `i32`, stored as its bits (an
    /// integer result: `ArgMax`'s indices).
    F32ToI32,
}

impl Act {
    /// An affine map with no clamping.
    pub fn affine(scale: f32, bias: f32) -> Self {
        Act::Clamp { scale, bias, lo: f32::MIN, hi: f32::MAX }
    }

    /// Whether applying it needs a scratch copy of the values.
    pub fn needs_scratch(self) -> bool {
        matches!(self, Act::Swish | Act::HardSwish)
    }
}

/// Spatial geometry of a convolution or pooling window over `h x w`
/// images: kernel `kh x kw`, strides `sh` (rows) and `sw` (columns),
/// zero padding `pad = [top, bottom, left, right]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spatial {
    pub h: u32,
    pub w: u32,
    pub kh: u16,
    pub kw: u16,
    pub sh: u16,
    pub sw: u16,
    pub pad: [u16; 4],
}

impl Spatial {
    /// A square `k x k` window, one stride, the same padding on every side.
    pub fn square(h: u32, w: u32, k: u16, stride: u16, pad: u16) -> Self {
        Self { h, w, kh: k, kw: k, sh: stride, sw: stride, pad: [pad; 4] }
    }

    /// Output height and width (the window must fit the padded image and
    /// strides must be positive: callers check with [`Self::valid`]).
    pub fn out(&self) -> (u32, u32) {
        let f = |x: u32, a: u16, b: u16, k: u16, s: u16| {
            (x + u32::from(a) + u32::from(b)).saturating_sub(u32::from(k)) / u32::from(s.max(1)) + 1
        };
        let [t, b, l, r] = self.pad;
        (f(self.h, t, b, self.kh, self.sh), f(self.w, l, r, self.kw, self.sw))
    }

    /// Whether the window fits the padded image with positive strides.
    pub fn valid(&self) -> bool {
        let [t, b, l, r] = self.pad;
        self.sh > 0
            && self.sw > 0
            && self.kh > 0
            && self.kw > 0
            && u64::from(self.h) + u64::from(t) + u64::from(b) >= u64::from(self.kh)
            && u64::from(self.w) + u64::from(l) + u64::from(r) >= u64::from(self.kw)
    }

    /// The same window on both axes, the same padding on every side (what
    /// `vu.pool` takes).
    pub fn uniform(&self) -> bool {
        self.sh == self.sw && self.pad.iter().all(|&p| p == self.pad[0])
    }
}

/// One operation.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// SA: `y = act(x * w + b)` over `rows` rows.
    Linear { name: String, x: View, w: TensorId, b: TensorId, y: View, rows: u32, k: u32, n: u32, act: Act },
    /// SA: NHWC convolution (`batch` images), HWIO weights, bias, activation,
    /// and optionally a residual added after the activation. `y` holds one
    /// row per output pixel: `View::dense(t, cout)` for an NHWC tensor of
    /// its own, or columns `col..col + cout` of rows `ld` long (the slice
    /// of a channel concatenation's output, written in place). The
    /// residual is a dense NHWC tensor of the output's shape.
    Conv {
        name: String,
        x: TensorId,
        w: TensorId,
        b: TensorId,
        y: View,
        batch: u32,
        s: Spatial,
        cin: u32,
        cout: u32,
        act: Act,
        residual: Option<Residual>,
    },
    /// VU: depthwise convolution with bias and activation.
    Depthwise {
        name: String,
        x: TensorId,
        w: TensorId,
        b: TensorId,
        y: TensorId,
        batch: u32,
        s: Spatial,
        c: u32,
        act: Act,
    },
    /// VU: max or average pooling (an average counts in-bounds elements only).
    Pool { name: String, x: TensorId, y: TensorId, batch: u32, s: Spatial, c: u32, op: PoolOp },
    /// VU: mean over all pixels of each image: `[batch][hw][c] -> [batch][c]`.
    GlobalPool { name: String, x: TensorId, y: TensorId, batch: u32, hw: u32, c: u32 },
    /// VU: the sum, maximum or mean over the middle axis,
    /// `[outer][reduce][inner] -> [outer][inner]` (a maximum is NaN if
    /// any element is).
    Reduce { name: String, op: RedOp, x: TensorId, y: TensorId, outer: u32, reduce: u32, inner: u32 },
    /// VU: `y = act(a + b)`, element-wise over `rows x cols`.
    Add { name: String, a: View, b: View, y: View, rows: u32, cols: u32, act: Act },
    /// VU: `y = act(a * b)`, element-wise over `rows x cols`.
    Mul { name: String, a: View, b: View, y: View, rows: u32, cols: u32, act: Act },
    /// VU: `y = act(max(a, b))`, element-wise over `rows x cols` (NaN if
    /// either is NaN).
    Max { name: String, a: View, b: View, y: View, rows: u32, cols: u32, act: Act },
    /// VU: `y = act(min(a, b))`, element-wise, NaN as for `Max`.
    Min { name: String, a: View, b: View, y: View, rows: u32, cols: u32, act: Act },
    /// VU: `y = a op b` element-wise for a comparison (`1.0` or `0.0`, as
    /// IEEE compares) or `keep` (`b` where `a` is not zero, else `+0.0`):
    /// the booleans of ONNX's comparisons, logic and `Where`.
    Compare { name: String, op: vnpu_abi::BinOp, a: View, b: View, y: View, rows: u32, cols: u32 },
    /// VU: `y = layernorm(a + b) * gamma + beta` (or `layernorm(a)` when
    /// `b` is `None`), row-wise, `eps` added to the variance.
    AddNorm {
        name: String,
        a: TensorId,
        b: Option<TensorId>,
        gamma: TensorId,
        beta: TensorId,
        y: TensorId,
        rows: u32,
        cols: u32,
        eps: f32,
    },
    /// VU: `y = x / sqrt(mean(x^2) + eps) * gamma`, row-wise (RMSNorm, as
    /// Llama, Gemma and Qwen2 normalize).
    RmsNorm { name: String, x: TensorId, gamma: TensorId, y: TensorId, rows: u32, cols: u32, eps: f32 },
    /// VU: `y[img] = x[img] * s[img]` per channel: `x` is `[batch][hw][c]`, `s` is `[batch][c]`.
    ScaleChannels { name: String, x: TensorId, s: TensorId, y: TensorId, batch: u32, hw: u32, c: u32 },
    /// SA + VU: multi-head self-attention over `qkv` (`[batch*seq][3*heads*dh]`,
    /// Q, K, V side by side), writing the context `[batch*seq][heads*dh]`.
    Attention { name: String, qkv: TensorId, y: TensorId, batch: u32, seq: u32, heads: u32, dh: u32 },
    /// SA + VU: a decoder's attention over a K/V cache, heads grouped
    /// over `kv_heads` K/V heads (multi-head when equal, multi-query at
    /// 1). `q` is `[batch][q_len][heads][dh]`; `k` and `v` are caches
    /// `[batch][kv_heads][cap][dh]` of which positions `0..kv_len` are
    /// read, the last `q_len` of them the queries' own; `y` is
    /// `[batch][q_len][heads * dh]`. Query `i` attends to positions
    /// `0..=kv_len - q_len + i` (causal), head `h` to K/V head
    /// `h / (heads / kv_heads)`, scores scaled by `1/sqrt(dh)`. With more
    /// than one query, `mask` is their [`Init::CausalMask`].
    CachedAttention {
        name: String,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        mask: Option<TensorId>,
        y: TensorId,
        batch: u32,
        q_len: u32,
        kv_len: u32,
        cap: u32,
        heads: u32,
        kv_heads: u32,
        dh: u32,
    },
    /// DMA gather + VU sum: an embedding bag of `pool` rows per sample.
    Embedding {
        name: String,
        table: TensorId,
        idx: TensorId,
        y: View,
        batch: u32,
        rows: u32,
        dim: u32,
        pool: u32,
    },
    /// VU: DLRM's dot interaction: per sample, `Z Z^T` of its `f x d` features.
    Interaction { name: String, z: TensorId, y: View, batch: u32, f: u32, d: u32 },
    /// DMA: copy `rows x cols` between views.
    Copy { name: String, x: View, y: View, rows: u32, cols: u32 },
    /// VU: `y = act(x)`, element-wise over `rows x cols`.
    Unary { name: String, x: View, y: View, rows: u32, cols: u32, act: Act },
    /// VU: row-wise softmax of `rows x cols`.
    Softmax { name: String, x: View, y: View, rows: u32, cols: u32 },
    /// SA: a batch of products of two computed matrices,
    /// `y_i = act(a_i b_i)` (`a_i b_i^T` when `trans_b`), `a_i` being
    /// `m x k`, `b_i` `k x n` (`n x k` when transposed), `y_i` `m x n`.
    /// Matrix `i` of each operand starts at element `offs[i]` (of `a`, `b`,
    /// `y`) of its tensor and its rows are `lda`, `ldb`, `ldy` elements
    /// apart, so strided views (a transposed or head-split tensor) are
    /// read and written in place: attention's `Q K^T` and `P V`.
    /// VU: class-aware Fast NMS (Bolya et al. 2019, YOLACT) over `n`
    /// candidate boxes per image, for every class at once, with the
    /// semantics written out in `docs/workloads.md` ("RetinaNet"):
    /// `boxes` is `[batch][n][4]` (centre y, centre x, height, width),
    /// `scores` `[batch][n][classes]`, `y` (same shape) the scores of the
    /// boxes kept (0 where suppressed). `corners` (`[5][batch][n]`:
    /// y1, x1, y2, x2, area) is the operation's scratch. A box `i` is
    /// suppressed in class `c` when a box `j` whose IoU with it exceeds
    /// `iou` scores higher in `c`. The comparisons are steps of slope
    /// [`NMS_STEP`] (clamped to 0..1), so the ISA's arithmetic computes
    /// them; no sort.
    FastNms {
        name: String,
        boxes: TensorId,
        scores: TensorId,
        corners: TensorId,
        y: TensorId,
        batch: u32,
        n: u32,
        classes: u32,
        iou: f32,
    },
    BatchMatMul {
        name: String,
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
        offs: Vec<[u64; 3]>,
        act: Act,
    },
}

impl Op {
    /// The operation's kind, as its variant is named.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Linear { .. } => "Linear",
            Op::Conv { .. } => "Conv",
            Op::Depthwise { .. } => "Depthwise",
            Op::Pool { op: PoolOp::Max, .. } => "MaxPool",
            Op::Pool { op: PoolOp::Avg, .. } => "AvgPool",
            Op::GlobalPool { .. } => "GlobalPool",
            Op::Reduce { .. } => "Reduce",
            Op::Add { .. } => "Add",
            Op::Mul { .. } => "Mul",
            Op::Max { .. } => "Max",
            Op::Min { .. } => "Min",
            Op::Compare { .. } => "Compare",
            Op::AddNorm { .. } => "AddNorm",
            Op::RmsNorm { .. } => "RmsNorm",
            Op::ScaleChannels { .. } => "ScaleChannels",
            Op::Attention { .. } => "Attention",
            Op::CachedAttention { .. } => "CachedAttention",
            Op::Embedding { .. } => "Embedding",
            Op::Interaction { .. } => "Interaction",
            Op::Copy { .. } => "Copy",
            Op::Unary { .. } => "Unary",
            Op::Softmax { .. } => "Softmax",
            Op::BatchMatMul { .. } => "BatchMatMul",
            Op::FastNms { .. } => "FastNms",
        }
    }

    /// The weight tensor the SA reads as its second operand, when the
    /// operation is a product with stored weights (Linear, Conv).
    pub fn sa_weight(&self) -> Option<TensorId> {
        match *self {
            Op::Linear { w, .. } | Op::Conv { w, .. } => Some(w),
            _ => None,
        }
    }

    /// Every tensor the operation reads or writes (a tensor used twice is
    /// listed twice).
    pub fn tensors(&self) -> Vec<TensorId> {
        match *self {
            Op::Linear { x, w, b, y, .. } => vec![x.t, w, b, y.t],
            Op::Conv { x, w, b, y, residual, .. } => {
                [Some(x), Some(w), Some(b), residual.map(|r| r.r), Some(y.t)].into_iter().flatten().collect()
            }
            Op::Depthwise { x, w, b, y, .. } => vec![x, w, b, y],
            Op::Pool { x, y, .. } | Op::GlobalPool { x, y, .. } | Op::Reduce { x, y, .. } => vec![x, y],
            Op::Add { a, b, y, .. }
            | Op::Mul { a, b, y, .. }
            | Op::Max { a, b, y, .. }
            | Op::Min { a, b, y, .. }
            | Op::Compare { a, b, y, .. } => vec![a.t, b.t, y.t],
            Op::AddNorm { a, b, gamma, beta, y, .. } => {
                [Some(a), b, Some(gamma), Some(beta), Some(y)].into_iter().flatten().collect()
            }
            Op::RmsNorm { x, gamma, y, .. } => vec![x, gamma, y],
            Op::ScaleChannels { x, s, y, .. } => vec![x, s, y],
            Op::Attention { qkv, y, .. } => vec![qkv, y],
            Op::CachedAttention { q, k, v, mask, y, .. } => {
                [Some(q), Some(k), Some(v), mask, Some(y)].into_iter().flatten().collect()
            }
            Op::Embedding { table, idx, y, .. } => vec![table, idx, y.t],
            Op::Interaction { z, y, .. } => vec![z, y.t],
            Op::Copy { x, y, .. } | Op::Unary { x, y, .. } | Op::Softmax { x, y, .. } => vec![x.t, y.t],
            Op::BatchMatMul { a, b, y, .. } => vec![a, b, y],
            Op::FastNms { boxes, scores, corners, y, .. } => vec![boxes, scores, corners, y],
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Op::Linear { name, .. }
            | Op::Conv { name, .. }
            | Op::Depthwise { name, .. }
            | Op::Pool { name, .. }
            | Op::GlobalPool { name, .. }
            | Op::Reduce { name, .. }
            | Op::Add { name, .. }
            | Op::Mul { name, .. }
            | Op::Max { name, .. }
            | Op::Min { name, .. }
            | Op::Compare { name, .. }
            | Op::AddNorm { name, .. }
            | Op::RmsNorm { name, .. }
            | Op::ScaleChannels { name, .. }
            | Op::Attention { name, .. }
            | Op::CachedAttention { name, .. }
            | Op::Embedding { name, .. }
            | Op::Interaction { name, .. }
            | Op::Copy { name, .. }
            | Op::Unary { name, .. }
            | Op::Softmax { name, .. }
            | Op::BatchMatMul { name, .. }
            | Op::FastNms { name, .. } => name,
        }
    }
}

/// The slope of the steps [`Op::FastNms`] compares with: a difference
/// `d` counts as `clamp(d * NMS_STEP, 0, 1)` (IoU above the threshold)
/// or `clamp(d * NMS_STEP + 1, 0, 1)` (a score not below the highest
/// overlapping one): a true step for `|d| >= 2^-20`.
pub const NMS_STEP: f32 = 1_048_576.0;

/// A model at a batch size.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub name: String,
    pub batch: u32,
    pub tensors: Vec<Tensor>,
    pub ops: Vec<Op>,
    pub input: TensorId,
    pub output: TensorId,
}

impl Graph {
    pub fn new(name: &str, batch: u32) -> Self {
        Self { name: name.into(), batch, tensors: Vec::new(), ops: Vec::new(), input: 0, output: 0 }
    }

    pub fn tensor(&mut self, name: impl Into<String>, elems: u64, init: Init) -> TensorId {
        self.tensors.push(Tensor { name: name.into(), elems, init });
        self.tensors.len() - 1
    }

    pub fn act(&mut self, name: &str, elems: u64) -> TensorId {
        self.tensor(name, elems, Init::Activation)
    }

    /// Multiply-accumulates of the whole graph (x2 for FLOPs).
    pub fn macs(&self) -> u64 {
        self.ops
            .iter()
            .map(|op| match *op {
                Op::Linear { rows, k, n, .. } => u64::from(rows) * u64::from(k) * u64::from(n),
                Op::Conv { batch, s, cin, cout, .. } => {
                    let (ho, wo) = s.out();
                    u64::from(batch)
                        * u64::from(ho * wo)
                        * u64::from(s.kh)
                        * u64::from(s.kw)
                        * u64::from(cin)
                        * u64::from(cout)
                }
                Op::BatchMatMul { m, k, n, ref offs, .. } => {
                    offs.len() as u64 * u64::from(m) * u64::from(k) * u64::from(n)
                }
                Op::Attention { batch, seq, heads, dh, .. } => {
                    2 * u64::from(batch) * u64::from(heads) * u64::from(seq).pow(2) * u64::from(dh)
                }
                Op::CachedAttention { batch, q_len, kv_len, heads, dh, .. } => {
                    2 * u64::from(batch)
                        * u64::from(heads)
                        * u64::from(q_len)
                        * u64::from(kv_len)
                        * u64::from(dh)
                }
                _ => 0,
            })
            .sum()
    }

    // ---- building blocks (public so tests and users can build their own graphs) ----

    pub fn linear(
        &mut self,
        name: &str,
        x: View,
        rows: u32,
        k: u32,
        n: u32,
        act: Act,
        y: Option<View>,
    ) -> View {
        let w = self.tensor(format!("{name}.w"), u64::from(k) * u64::from(n), Init::Weights { fan_in: k });
        let b = self.tensor(format!("{name}.b"), n.into(), Init::Bias);
        let y = y.unwrap_or_else(|| View::dense(self.act(name, u64::from(rows) * u64::from(n)), n));
        self.ops.push(Op::Linear { name: name.into(), x, w, b, y, rows, k, n, act });
        y
    }

    /// The weights and bias of a `k x n` product, for products that share
    /// them ([`Graph::linear_using`]: an RNN's steps).
    pub fn linear_weights(&mut self, name: &str, k: u32, n: u32) -> (TensorId, TensorId) {
        let w = self.tensor(format!("{name}.w"), u64::from(k) * u64::from(n), Init::Weights { fan_in: k });
        let b = self.tensor(format!("{name}.b"), n.into(), Init::Bias);
        (w, b)
    }

    /// [`Graph::linear`] with weights made by [`Graph::linear_weights`].
    pub fn linear_using(
        &mut self,
        name: &str,
        x: View,
        rows: u32,
        wb: (TensorId, TensorId),
        k: u32,
        n: u32,
    ) -> View {
        let y = View::dense(self.act(name, u64::from(rows) * u64::from(n)), n);
        self.ops.push(Op::Linear { name: name.into(), x, w: wb.0, b: wb.1, y, rows, k, n, act: Act::None });
        y
    }

    pub fn conv(
        &mut self,
        name: &str,
        x: TensorId,
        h: u32,
        w: u32,
        cin: u32,
        cout: u32,
        k: u16,
        stride: u16,
        act: Act,
    ) -> (TensorId, u32, u32) {
        self.conv_spatial(name, x, Spatial::square(h, w, k, stride, k / 2), cin, cout, act)
    }

    /// A convolution over the window `s` (any kernel, strides and padding).
    pub fn conv_spatial(
        &mut self,
        name: &str,
        x: TensorId,
        s: Spatial,
        cin: u32,
        cout: u32,
        act: Act,
    ) -> (TensorId, u32, u32) {
        let (ho, wo) = s.out();
        let fan_in = u32::from(s.kh) * u32::from(s.kw) * cin;
        let wt =
            self.tensor(format!("{name}.w"), u64::from(fan_in) * u64::from(cout), Init::Weights { fan_in });
        let b = self.tensor(format!("{name}.b"), cout.into(), Init::Bias);
        let y = self.act(name, u64::from(self.batch) * u64::from(ho * wo) * u64::from(cout));
        self.ops.push(Op::Conv {
            name: name.into(),
            x,
            w: wt,
            b,
            y: View::dense(y, cout),
            batch: self.batch,
            s,
            cin,
            cout,
            act,
            residual: None,
        });
        (y, ho, wo)
    }

    pub fn depthwise(
        &mut self,
        name: &str,
        x: TensorId,
        h: u32,
        w: u32,
        c: u32,
        k: u16,
        stride: u16,
        act: Act,
    ) -> (TensorId, u32, u32) {
        let s = Spatial::square(h, w, k, stride, k / 2);
        let (ho, wo) = s.out();
        let fan_in = u32::from(k) * u32::from(k);
        let wt = self.tensor(format!("{name}.w"), u64::from(fan_in) * u64::from(c), Init::Weights { fan_in });
        let b = self.tensor(format!("{name}.b"), c.into(), Init::Bias);
        let y = self.act(name, u64::from(self.batch) * u64::from(ho * wo) * u64::from(c));
        self.ops.push(Op::Depthwise { name: name.into(), x, w: wt, b, y, batch: self.batch, s, c, act });
        (y, ho, wo)
    }

    pub fn add(&mut self, name: &str, a: TensorId, b: TensorId, elems: u64, cols: u32, act: Act) -> TensorId {
        let y = self.act(name, elems);
        let rows = (elems / u64::from(cols)) as u32;
        self.ops.push(Op::Add {
            name: name.into(),
            a: View::dense(a, cols),
            b: View::dense(b, cols),
            y: View::dense(y, cols),
            rows,
            cols,
            act,
        });
        y
    }

    pub fn global_pool(&mut self, x: TensorId, hw: u32, c: u32) -> TensorId {
        let y = self.act("avgpool", u64::from(self.batch) * u64::from(c));
        self.ops.push(Op::GlobalPool { name: "avgpool".into(), x, y, batch: self.batch, hw, c });
        y
    }

    pub fn classifier(&mut self, x: TensorId, c: u32, classes: u32) -> TensorId {
        let b = self.batch;
        self.linear("fc", View::dense(x, c), b, c, classes, Act::None, None).t
    }

    pub fn encoder_layer(
        &mut self,
        l: u32,
        x: TensorId,
        seq: u32,
        d: u32,
        heads: u32,
        ffn: u32,
        act: Act,
    ) -> TensorId {
        let rows = self.batch * seq;
        let p = format!("layer{l}");
        let qkv = self.linear(&format!("{p}.qkv"), View::dense(x, d), rows, d, 3 * d, Act::None, None).t;
        let ctx = self.act(&format!("{p}.attn"), u64::from(rows) * u64::from(d));
        self.ops.push(Op::Attention {
            name: format!("{p}.attn"),
            qkv,
            y: ctx,
            batch: self.batch,
            seq,
            heads,
            dh: d / heads,
        });
        let o = self.linear(&format!("{p}.out"), View::dense(ctx, d), rows, d, d, Act::None, None).t;
        let h1 = self.add_norm(&format!("{p}.norm1"), x, o, rows, d);
        let f1 = self.linear(&format!("{p}.ffn1"), View::dense(h1, d), rows, d, ffn, act, None).t;
        let f2 = self.linear(&format!("{p}.ffn2"), View::dense(f1, ffn), rows, ffn, d, Act::None, None).t;
        self.add_norm(&format!("{p}.norm2"), h1, f2, rows, d)
    }

    pub fn add_norm(&mut self, name: &str, a: TensorId, b: TensorId, rows: u32, cols: u32) -> TensorId {
        let gamma = self.tensor(format!("{name}.gamma"), cols.into(), Init::Ones);
        let beta = self.tensor(format!("{name}.beta"), cols.into(), Init::Zeros);
        let y = self.act(name, u64::from(rows) * u64::from(cols));
        self.ops.push(Op::AddNorm {
            name: name.into(),
            a,
            b: Some(b),
            gamma,
            beta,
            y,
            rows,
            cols,
            eps: 1e-5,
        });
        y
    }

    pub fn image_input(&mut self, hw: u32, c: u32) -> TensorId {
        let x = self.tensor("input", u64::from(self.batch) * u64::from(hw * hw) * u64::from(c), Init::Input);
        self.input = x;
        x
    }
}
