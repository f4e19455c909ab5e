//! From an ONNX graph to a compiled vNPU model.
//!
//! 1. **Shapes**: every input gets a static shape (free leading dimension =
//!    the batch, others from `--shape`); every node's output shape follows
//!    from its inputs.
//! 2. **Constant folding**: a node whose inputs are all constants is
//!    evaluated here (shape arithmetic, `Constant`, `Shape`, `Cast`,
//!    element-wise math on weights), so only work on data reaches the vNPU.
//! 3. **Fusion**: a bias `Add` and an activation that follow a matrix
//!    product (its only consumer) become the product's bias and activation.
//! 4. **Lowering**: what remains becomes a layer graph of the workload
//!    library (`npu_graph::Graph`), lowered by its tiled, double-buffered
//!    lowering for the vNPU's shape: every tensor in HBM, tiles through SRAM.
//!
//! Computed tensors are dense and row-major in ONNX's own order, so
//! `Reshape`, `Flatten`, `Squeeze`, `Unsqueeze` and `Identity` cost nothing.

use crate::refusal::{invalid, unsupported, Refusal};
use std::collections::{HashMap, HashSet};

use npu_graph::{Act, Graph, Init, Op, TensorId, View};
use npu_lower::{lower_ops_keeping, LowerError, LowerOptions, VnpuShape};
use npu_model::{verify, VerifyError, VnpuLimits};
use thiserror::Error;
use vnpu_abi::compiled_model::{ElemType, Model, Target, TensorDesc};
use vnpu_abi::{Addr, DType, Engine, Instr, ProgramBuilder};

use crate::load::{load, Attr, Const, Data, Dim, LoadError, Node, OnnxModel};

mod attention;
mod cnn;
mod composite;
mod layout;
mod logic;
mod seq;
use cnn::{channel_vec, nchw_to_nhwc, then};

/// What to compile for.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// The vNPU core the programs run on.
    pub shape: VnpuShape,
    /// Value of every free leading (batch) dimension of the inputs.
    pub batch: u32,
    /// Static shapes for inputs (`--shape NAME=D0,D1,...`), batch included.
    pub shapes: HashMap<String, Vec<usize>>,
    /// Outputs to compile (the model's own outputs when `None`); the graph
    /// is pruned to what they need.
    pub outputs: Option<Vec<String>>,
    /// The SA's operand type (`--dtype`): with bf16 the weights of matrix
    /// products and convolutions are stored as bf16 and every product's
    /// operands are rounded to bf16 (f32 accumulation).
    pub dtype: DType,
    /// With bf16 operands, intermediate activations stored as bf16 too
    /// (`--activations bf16`, `npu_lower::LowerOptions::bf16_activations`;
    /// the model's inputs and outputs stay f32).
    pub bf16_activations: bool,
    /// Compile spread programs (`docs/isa.md`, "Spread programs") for
    /// this many SAs and VUs beyond `shape`'s (`vnpu compile --spread`):
    /// lowered for the larger shape, they run on `shape`'s engines alone
    /// and on up to the larger shape's when the vNPU borrows idle ones
    /// (its borrowing cap must allow it). `None`: ordinary programs.
    pub spread: Option<(u32, u32)>,
    /// Intermediate tensors share HBM by liveness (`vnpu compile
    /// --reuse-hbm`, on by default there; `npu_lower::LowerOptions::reuse_hbm`):
    /// the same instructions on other HBM addresses (the same cycles with
    /// one DMA transfer in flight), less HBM, and DMA that touches less
    /// host memory. The model's inputs and outputs keep HBM of their own.
    pub reuse_hbm: bool,
    /// Each residual add fused into the convolution that computes one of
    /// its operands (`npu_lower::fuse_residual_adds`; `vnpu compile
    /// --fuse-residual`, on by default there): the convolution adds the
    /// other operand in its VU pass and its own output never goes to HBM.
    /// The same bits with f32 activations; with bf16 activations the sum
    /// is taken before the convolution's output is rounded to bf16.
    pub fuse_residual: bool,
    /// Inverted-residual blocks (1x1 expansion, depthwise convolution, 1x1
    /// projection, residual add) lowered as one pipeline whose tiles keep
    /// the expanded activations in SRAM (`npu_lower::LowerOptions::fuse_blocks`;
    /// `vnpu compile --fuse-blocks`, on by default there): fewer DMA bytes
    /// and cycles, the same bits. f32 operands and activations only.
    pub fuse_blocks: bool,
}

/// Why a model cannot be compiled.
#[derive(Debug, Error)]
pub enum CompileError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("node `{node}` ({op}): {reason}")]
    Node {
        node: String,
        op: String,
        #[source]
        reason: Refusal,
    },
    #[error("bf16 activations need bf16 operands (--dtype bf16)")]
    Activations,
    #[error("--spread: the vNPU's engines plus the spread overflow")]
    Spread,
    #[error("input `{name}`: {reason}")]
    Input {
        name: String,
        #[source]
        reason: Refusal,
    },
    #[error("output `{name}`: {reason}")]
    Output {
        name: String,
        #[source]
        reason: Refusal,
    },
    #[error("the model does not fit the vNPU: {0}")]
    Fit(#[source] LowerError),
    #[error("the compiled {which} program was refused by the verifier (a compiler bug): {source}")]
    Verify {
        which: &'static str,
        #[source]
        source: VerifyError,
    },
}

impl CompileError {
    /// The refusal of a node, an input or an output, if that is what
    /// stopped the compiler (its kind says whether the model is valid ONNX
    /// the compiler does not handle, or not valid ONNX at all).
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            CompileError::Node { reason, .. }
            | CompileError::Input { reason, .. }
            | CompileError::Output { reason, .. }
            | CompileError::Load(LoadError::Initializer { reason, .. } | LoadError::Input { reason, .. }) => {
                Some(reason)
            }
            _ => None,
        }
    }
}

/// What the compiler did, for the user.
#[derive(Clone, Debug, Default)]
pub struct CompileReport {
    /// Nodes the (pruned) graph has.
    pub nodes: usize,
    /// Nodes evaluated at compile time.
    pub folded: usize,
    /// Nodes fused into a matrix product (bias, activation).
    pub fused: usize,
    /// Nodes that cost nothing (reshapes, identities).
    pub aliases: usize,
    /// vNPU operations, by kind.
    pub ops: Vec<(String, usize)>,
    /// Multiply-accumulates per batch.
    pub macs: u64,
    pub weight_bytes: u64,
    pub hbm_bytes: u64,
    pub load_instructions: usize,
    pub infer_instructions: usize,
    /// Inverted-residual blocks lowered as one pipeline each
    /// ([`CompileOptions::fuse_blocks`]).
    pub blocks: usize,
}

/// The compiled model and the report.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub model: Model,
    pub report: CompileReport,
}

#[derive(Clone, Debug)]
struct Dyn {
    t: TensorId,
    /// ONNX's (logical) shape.
    shape: Vec<usize>,
    /// The graph operation that wrote `t`, when fusion into it is allowed.
    op: Option<usize>,
    /// A rank-4 tensor `[N, C, H, W]` stored channels-last (`[N][H][W][C]`),
    /// as convolutions and pooling read and write it; otherwise the
    /// storage is dense row-major in ONNX's order (or a view).
    nhwc: bool,
    /// A view (a transpose): the element stride of each axis in `t`.
    /// Never together with `nhwc`.
    strides: Option<Vec<usize>>,
}

impl Dyn {
    fn new(t: TensorId, shape: Vec<usize>, op: Option<usize>, nhwc: bool) -> Self {
        Self { t, shape, op, nhwc, strides: None }
    }
}

/// The refusal of input `i` of `n` being a computed integer tensor where
/// the operation takes a float one.
fn int_refused(n: &Node, i: usize) -> Refusal {
    unsupported(format!(
        "input {i} (`{}`) is an integer tensor computed on the device (from an integer model input); {} \
         is compiled only on float tensors (an integer input reaches Gather's indices, and Cast to an \
         integer type)",
        n.inputs.get(i).map_or("", String::as_str),
        n.op
    ))
}

#[derive(Clone, Debug)]
enum Val {
    C(Const),
    D(Dyn),
    /// A computed integer tensor (a model's integer input, `i32` on the
    /// device): only what is written for it takes one (`Gather`'s
    /// indices, `Cast` to an integer type, `Shape`); everything else
    /// refuses it, as a float tensor it is not.
    I(Dyn),
}

/// Elements of `shape` (saturating: a shape past [`MAX_ELEMS`] is refused
/// by [`check_size`] before anything of its size is allocated).
fn elems(shape: &[usize]) -> usize {
    shape.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}

/// The largest tensor the compiler handles: 2^28 elements (1 GiB of f32),
/// more than any vNPU's HBM share here.
const MAX_ELEMS: usize = 1 << 28;

/// Refuses a tensor of `shape` larger than [`MAX_ELEMS`].
fn check_size(shape: &[usize]) -> Result<(), Refusal> {
    if elems(shape) > MAX_ELEMS {
        return Err(unsupported(format!(
            "a tensor of shape {shape:?} is larger than the 2^28 elements a vNPU can hold"
        )));
    }
    Ok(())
}

/// numpy broadcasting of two shapes.
fn bcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let get = |s: &[usize], i: usize| if i + s.len() >= n { s[i + s.len() - n] } else { 1 };
    (0..n)
        .map(|i| {
            let (x, y) = (get(a, i), get(b, i));
            if x == y || y == 1 {
                Some(x)
            } else if x == 1 {
                Some(y)
            } else {
                None
            }
        })
        .collect()
}

/// `c` broadcast to `shape` (which `c` must broadcast to), row-major.
fn expand<T: Copy>(c: &[T], cshape: &[usize], shape: &[usize]) -> Vec<T> {
    let n = shape.len();
    let off = n - cshape.len();
    let mut strides = vec![0usize; n];
    let mut s = 1;
    for i in (0..cshape.len()).rev() {
        strides[i + off] = if cshape[i] == 1 { 0 } else { s };
        s *= cshape[i];
    }
    let total = elems(shape);
    let mut out = Vec::with_capacity(total);
    let mut idx = vec![0usize; n];
    for _ in 0..total {
        out.push(c[idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>()]);
        for d in (0..n).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

fn axis(a: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if a < 0 { a + r } else { a };
    (0..r).contains(&a).then_some(a as usize)
}

struct Compiler<'m> {
    m: &'m OnnxModel,
    g: Graph,
    data: Vec<Option<Vec<f32>>>,
    vals: HashMap<String, Val>,
    uses: HashMap<String, usize>,
    outputs: HashSet<String>,
    report: CompileReport,
}

type NodeResult = Result<Vec<Val>, Refusal>;

impl Compiler<'_> {
    /// A new graph tensor of `n` elements, with its data when it is a constant.
    fn tensor(&mut self, name: &str, n: usize, init: Init, data: Option<Vec<f32>>) -> TensorId {
        let t = self.g.tensor(name, n as u64, init);
        self.data.push(data);
        t
    }

    fn weight(&mut self, name: &str, v: Vec<f32>, init: Init) -> TensorId {
        self.tensor(name, v.len(), init, Some(v))
    }

    fn act_tensor(&mut self, name: &str, n: usize) -> TensorId {
        self.tensor(name, n, Init::Activation, None)
    }

    /// Input `i`, which must be a computed tensor, not a view (a view is
    /// stored densely first).
    fn computed(&mut self, n: &Node, i: usize) -> Result<Dyn, Refusal> {
        let d = self.computed_view(n, i)?;
        self.materialize(&n.name, &d)
    }

    /// Input `i`, which must be a computed tensor, as it is (maybe a view).
    fn computed_view(&self, n: &Node, i: usize) -> Result<Dyn, Refusal> {
        match self.get(n, i)? {
            Val::D(d) => Ok(d.clone()),
            Val::I(_) => Err(int_refused(n, i)),
            Val::C(_) => Err(unsupported(format!(
                "input {i} (`{}`) is a constant: {} is compiled only on computed tensors here",
                n.inputs[i], n.op
            ))),
        }
    }

    /// Input `i`, a computed tensor, stored dense in ONNX's order.
    fn dense(&mut self, n: &Node, i: usize) -> Result<Dyn, Refusal> {
        let d = self.computed(n, i)?;
        self.onnx_order(&n.name, &d)
    }

    fn get(&self, n: &Node, i: usize) -> Result<&Val, Refusal> {
        let name = n
            .inputs
            .get(i)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| invalid(format!("input {i} is missing")))?;
        self.vals.get(name).ok_or_else(|| invalid(format!("input `{name}` is not produced before this node")))
    }

    fn opt(&self, n: &Node, i: usize) -> Option<&Val> {
        n.inputs.get(i).filter(|s| !s.is_empty()).and_then(|s| self.vals.get(s))
    }

    fn konst(&self, n: &Node, i: usize) -> Result<Const, Refusal> {
        match self.get(n, i)? {
            Val::C(c) => Ok(c.clone()),
            Val::D(_) | Val::I(_) => {
                Err(unsupported(format!("input {i} (`{}`) must be a constant", n.inputs[i])))
            }
        }
    }

    /// The axes reduction `n` of a rank-`rank` input reduces (an attribute,
    /// or a constant input from opset 13/18), sorted and each once; every
    /// axis when none are listed, and `None` when the node leaves its input
    /// as it is (`noop_with_empty_axes` with no axes).
    pub(super) fn reduce_axes(&self, n: &Node, rank: usize) -> Result<Option<Vec<usize>>, Refusal> {
        let listed = match Self::ints_attr(n, "axes")? {
            Some(a) => Some(a),
            None => self.const_ints(n, 1, "axes")?,
        };
        let mut axes: Vec<usize> = match listed {
            Some(a) if !a.is_empty() => a
                .iter()
                .map(|&v| axis(v, rank).ok_or_else(|| invalid("axis out of range")))
                .collect::<Result<_, _>>()?,
            _ if Self::int_attr(n, "noop_with_empty_axes", 0)? != 0 => return Ok(None),
            _ => (0..rank).collect(),
        };
        axes.sort_unstable();
        axes.dedup();
        Ok(Some(axes))
    }

    /// A reduction of a constant (skl2onnx's naive Bayes and QDA exports
    /// reduce their constants), folded: in f64 over any axes, rounded to
    /// f32 once; an integer sum, max or min stays an exact integer.
    fn reduce_const(&self, n: &Node) -> Result<Const, Refusal> {
        Self::only_attrs(n, &["axes", "keepdims", "noop_with_empty_axes"])?;
        let c = self.konst(n, 0)?;
        let rank = c.shape.len();
        let keep = Self::int_attr(n, "keepdims", 1)? != 0;
        let Some(axes) = self.reduce_axes(n, rank)? else { return Ok(c) };
        let mut reduced = vec![false; rank];
        for a in axes {
            reduced[a] = true;
        }
        if elems(&c.shape) > MAX_FOLDED {
            return Err(unsupported(format!("a constant of {} elements to reduce", elems(&c.shape))));
        }
        // Each output element's index from an input element's coordinates.
        let kept: Vec<usize> = (0..rank).map(|i| if reduced[i] { 1 } else { c.shape[i] }).collect();
        let count = elems(&c.shape) / elems(&kept).max(1);
        let mut prod = vec![1f64; elems(&kept)];
        let mut acc = vec![(0f64, 0f64, f64::NEG_INFINITY, f64::INFINITY); elems(&kept)];
        let mut ints =
            vec![(0i64, i64::MIN, i64::MAX); if matches!(c.data, Data::I64(_)) { acc.len() } else { 0 }];
        let vals = c.data.to_f32();
        let int_vals = c.data.to_i64();
        // The output element each input element reduces into.
        let outs: Vec<usize> = (0..vals.len())
            .map(|flat| {
                let (mut rest, mut out, mut stride) = (flat, 0usize, 1usize);
                for d in (0..rank).rev() {
                    let coord = rest % c.shape[d].max(1);
                    rest /= c.shape[d].max(1);
                    if !reduced[d] {
                        out += coord * stride;
                    }
                    stride *= kept[d];
                }
                out
            })
            .collect();
        for (flat, (&x, &out)) in vals.iter().zip(&outs).enumerate() {
            let x = f64::from(x);
            prod[out] *= x;
            let a = &mut acc[out];
            *a = (a.0 + x, a.1 + x * x, a.2.max(x), a.3.min(x));
            if let Some(i) = ints.get_mut(out) {
                let v = int_vals[flat];
                *i = (i.0.saturating_add(v), i.1.max(v), i.2.min(v));
            }
        }
        let shape: Vec<usize> =
            (0..rank).filter_map(|i| if reduced[i] { keep.then_some(1) } else { Some(c.shape[i]) }).collect();
        let op = n.op.as_str();
        if !ints.is_empty() && matches!(op, "ReduceSum" | "ReduceMax" | "ReduceMin") {
            let v = ints.iter().map(|&(s, mx, mn)| match op {
                "ReduceSum" => s,
                "ReduceMax" => mx,
                _ => mn,
            });
            return Ok(Const { shape, data: Data::I64(v.collect()) });
        }
        let l1 = if op == "ReduceL1" || op == "ReduceLogSumExp" {
            // |x| sums and exp sums need a pass of their own.
            let mut s = vec![0f64; acc.len()];
            for (&x, &out) in vals.iter().zip(&outs) {
                s[out] += if op == "ReduceL1" { f64::from(x).abs() } else { f64::from(x).exp() };
            }
            s
        } else {
            Vec::new()
        };
        let v: Vec<f32> = acc
            .iter()
            .enumerate()
            .map(|(i, &(sum, sq, mx, mn))| {
                (match op {
                    "ReduceSum" => sum,
                    "ReduceMean" => sum / count.max(1) as f64,
                    "ReduceMax" => mx,
                    "ReduceMin" => mn,
                    "ReduceL1" => l1[i],
                    "ReduceL2" => sq.sqrt(),
                    "ReduceSumSquare" => sq,
                    "ReduceLogSum" => sum.ln(),
                    "ReduceProd" => prod[i],
                    _ => l1[i].ln(),
                }) as f32
            })
            .collect();
        Ok(Const { shape, data: Data::F32(v) })
    }

    /// Constant input `i` as integers, `None` when it is absent; a computed
    /// one is refused as "`what` must be a constant".
    fn const_ints(&self, n: &Node, i: usize, what: &str) -> Result<Option<Vec<i64>>, Refusal> {
        match self.opt(n, i) {
            None => Ok(None),
            Some(Val::C(c)) => Ok(Some(c.data.to_i64())),
            Some(Val::D(_) | Val::I(_)) => Err(unsupported(format!("{what} must be a constant"))),
        }
    }

    /// The last graph operation when `name`'s value may be fused into it:
    /// used once, not a model output, written by the newest operation.
    fn fusable(&self, name: &str, d: &Dyn) -> Option<usize> {
        let op = d.op?;
        (self.uses.get(name) == Some(&1) && !self.outputs.contains(name) && op + 1 == self.g.ops.len())
            .then_some(op)
    }

    fn int_attr(n: &Node, k: &str, default: i64) -> Result<i64, Refusal> {
        match n.attrs.get(k) {
            None => Ok(default),
            Some(Attr::Int(v)) => Ok(*v),
            Some(_) => Err(invalid(format!("attribute `{k}` must be an integer"))),
        }
    }

    fn float_attr(n: &Node, k: &str, default: f32) -> Result<f32, Refusal> {
        match n.attrs.get(k) {
            None => Ok(default),
            Some(Attr::Float(v)) => Ok(*v),
            Some(_) => Err(invalid(format!("attribute `{k}` must be a float"))),
        }
    }

    fn ints_attr(n: &Node, k: &str) -> Result<Option<Vec<i64>>, Refusal> {
        match n.attrs.get(k) {
            None => Ok(None),
            Some(Attr::Ints(v)) => Ok(Some(v.clone())),
            Some(_) => Err(invalid(format!("attribute `{k}` must be a list of integers"))),
        }
    }

    /// Refuses attributes the handler does not read.
    fn only_attrs(n: &Node, known: &[&str]) -> Result<(), Refusal> {
        match n.attrs.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(unsupported(format!("attribute `{k}` is not supported"))),
            None => Ok(()),
        }
    }

    fn shape_of(&self, n: &Node, i: usize) -> Result<Vec<usize>, Refusal> {
        Ok(match self.get(n, i)? {
            Val::C(c) => c.shape.clone(),
            Val::D(d) | Val::I(d) => d.shape.clone(),
        })
    }

    fn node(&mut self, n: &Node) -> NodeResult {
        if n.domain == crate::ml::REFUSED_DOMAIN {
            let why = match n.attrs.get("reason") {
                Some(Attr::Str(s)) => s.clone(),
                _ => "refused".into(),
            };
            return Err(unsupported(why));
        }
        if !(n.domain.is_empty() || n.domain == "ai.onnx") {
            return Err(unsupported(format!(
                "operators of domain `{}` are not supported (the default domain and ai.onnx.ml are)",
                n.domain
            )));
        }
        if !crate::operators::listed(&n.op) {
            return Err(unsupported(format!(
                "operator `{}` is not supported (docs/compiled-model-format.md lists what is)",
                n.op
            )));
        }
        let all_const =
            n.inputs.iter().filter(|s| !s.is_empty()).all(|s| matches!(self.vals.get(s), Some(Val::C(_))));
        match n.op.as_str() {
            "Constant" => {
                let c = match n.attrs.iter().next() {
                    Some((k, Attr::Tensor(t))) if k == "value" => t.clone(),
                    Some((k, Attr::Float(f))) if k == "value_float" => {
                        Const { shape: vec![], data: Data::F32(vec![*f]) }
                    }
                    Some((k, Attr::Floats(f))) if k == "value_floats" => {
                        Const { shape: vec![f.len()], data: Data::F32(f.clone()) }
                    }
                    Some((k, Attr::Int(i))) if k == "value_int" => {
                        Const { shape: vec![], data: Data::I64(vec![*i]) }
                    }
                    Some((k, Attr::Ints(i))) if k == "value_ints" => {
                        Const { shape: vec![i.len()], data: Data::I64(i.clone()) }
                    }
                    _ => {
                        return Err(unsupported(
                            "only value, value_float(s) and value_int(s) constants are supported",
                        ))
                    }
                };
                self.report.folded += 1;
                Ok(vec![Val::C(c)])
            }
            "Identity" | "Dropout" => {
                if n.op == "Dropout" && n.outputs.len() > 1 {
                    return Err(unsupported("the mask output of Dropout is not supported"));
                }
                // Inference is the identity; training mode drops elements
                // at random, which nothing here computes.
                if n.op == "Dropout" {
                    match self.opt(n, 2) {
                        None => {}
                        Some(Val::C(c)) if c.data.to_i64().iter().all(|&v| v == 0) => {}
                        Some(Val::C(_)) => {
                            return Err(unsupported(
                                "training_mode is true: Dropout would drop elements at random",
                            ))
                        }
                        Some(Val::D(_) | Val::I(_)) => {
                            return Err(unsupported("training_mode must be a constant false (inference)"))
                        }
                    }
                    if Self::int_attr(n, "is_test", 1)? == 0 {
                        return Err(unsupported("is_test is 0: Dropout in training mode is not supported"));
                    }
                }
                self.report.aliases += 1;
                Ok(vec![self.get(n, 0)?.clone()])
            }
            "Cast" | "CastLike" => {
                let to = if n.op == "CastLike" {
                    Self::only_attrs(n, &["saturate"])?;
                    // The type of the second input: computed tensors are f32.
                    match self.get(n, 1)? {
                        Val::C(Const { data: Data::I64(_), .. }) | Val::I(_) => 7,
                        _ => 1,
                    }
                } else {
                    Self::int_attr(n, "to", 1)?
                };
                let v = self.get(n, 0)?.clone();
                match &v {
                    Val::C(_) => self.report.folded += 1,
                    Val::D(_) | Val::I(_) => self.report.aliases += 1,
                }
                match (v, to) {
                    // Integer to integer: the values are i32 on the device
                    // (a model input's values were checked to fit).
                    (Val::I(d), 6 | 7) => Ok(vec![Val::I(Dyn { op: None, ..d })]),
                    // `vu.unary i32_to_f32`: round to nearest, as ONNX's
                    // Cast from an integer type to float.
                    (Val::I(d), 1) => Ok(vec![Val::D(self.act_op(n, &d, Act::I32ToF32))]),
                    // To bool: `x != 0`, stored as 0 or 1.
                    (v @ (Val::I(_) | Val::D(_)), 9) => Ok(vec![Val::D(self.cast_to_bool(n, &v)?)]),
                    (Val::C(c), 9) => Ok(vec![Val::C(Const {
                        shape: c.shape,
                        data: Data::I64(c.data.to_f32().iter().map(|&x| i64::from(x != 0.0)).collect()),
                    })]),
                    (Val::I(_), _) => Err(unsupported(format!(
                        "cast of an integer tensor computed on the device to ONNX type {to} is not supported"
                    ))),
                    (Val::C(c), 1) => {
                        Ok(vec![Val::C(Const { shape: c.shape, data: Data::F32(c.data.to_f32()) })])
                    }
                    (Val::C(c), 6 | 7) => {
                        Ok(vec![Val::C(Const { shape: c.shape, data: Data::I64(c.data.to_i64()) })])
                    }
                    (Val::D(d), 1) => Ok(vec![Val::D(Dyn { op: None, ..d })]),
                    // `vu.unary f32_to_i32`: toward zero, as ONNX Runtime's
                    // cast (a value past i32 saturates).
                    (Val::D(d), 6 | 7) => {
                        let i = self.act_op(n, &d, Act::F32ToI32);
                        Ok(vec![Val::I(Dyn { op: None, ..i })])
                    }
                    (_, to) => Err(unsupported(format!(
                        "cast to ONNX type {to} is not supported (computed tensors are f32)"
                    ))),
                }
            }
            "Shape" => {
                let s = self.shape_of(n, 0)?;
                let r = s.len() as i64;
                let start = axis_clamp(Self::int_attr(n, "start", 0)?, r);
                let end = axis_clamp(Self::int_attr(n, "end", r)?, r);
                let v: Vec<i64> = s[start..end.max(start)].iter().map(|&d| d as i64).collect();
                self.report.folded += 1;
                Ok(vec![Val::C(Const { shape: vec![v.len()], data: Data::I64(v) })])
            }
            "Size" => {
                Self::only_attrs(n, &[])?;
                let s = self.shape_of(n, 0)?;
                self.report.folded += 1;
                Ok(vec![Val::C(Const { shape: vec![], data: Data::I64(vec![elems(&s) as i64]) })])
            }
            "ConstantOfShape" => {
                Self::only_attrs(n, &["value"])?;
                let dims = self.konst(n, 0)?.data.to_i64();
                let shape: Vec<usize> = dims
                    .iter()
                    .map(|&d| usize::try_from(d).map_err(|_| invalid(format!("dimension {d} is negative"))))
                    .collect::<Result<_, _>>()?;
                let count =
                    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).filter(|&c| c <= MAX_FOLDED);
                let count = count.ok_or_else(|| {
                    unsupported(format!("a constant of shape {shape:?} (more than {MAX_FOLDED} elements)"))
                })?;
                let data = match n.attrs.get("value") {
                    None => Data::F32(vec![0.0; count]),
                    Some(Attr::Tensor(c)) if c.data.len() == 1 => match &c.data {
                        Data::F32(v) => Data::F32(vec![v[0]; count]),
                        Data::I64(v) => Data::I64(vec![v[0]; count]),
                    },
                    Some(_) => return Err(invalid("attribute `value` must be a one-element tensor")),
                };
                self.report.folded += 1;
                Ok(vec![Val::C(Const { shape, data })])
            }
            "Range" => {
                Self::only_attrs(n, &[])?;
                let (a, b, d) = (self.konst(n, 0)?, self.konst(n, 1)?, self.konst(n, 2)?);
                if [&a, &b, &d].iter().any(|c| c.data.len() != 1) {
                    return Err(invalid("start, limit and delta must be scalars"));
                }
                let ints = [&a, &b, &d].iter().all(|c| matches!(c.data, Data::I64(_)));
                let (s, l, st) =
                    (a.data.to_f32()[0] as f64, b.data.to_f32()[0] as f64, d.data.to_f32()[0] as f64);
                let count = ((l - s) / st).ceil();
                if !(count.is_finite() && st != 0.0) {
                    return Err(invalid("delta is 0, or the range is not finite"));
                }
                let count = count.max(0.0) as usize;
                if count > MAX_FOLDED {
                    return Err(unsupported(format!("a range of {count} elements (more than {MAX_FOLDED})")));
                }
                let data = if ints {
                    let (s, st) = (a.data.to_i64()[0], d.data.to_i64()[0]);
                    Data::I64((0..count as i64).map(|i| s + i * st).collect())
                } else {
                    // As ONNX defines it: start + i * delta, in the input's f32.
                    let (s, st) = (a.data.to_f32()[0], d.data.to_f32()[0]);
                    Data::F32((0..count).map(|i| s + i as f32 * st).collect())
                };
                self.report.folded += 1;
                Ok(vec![Val::C(Const { shape: vec![count], data })])
            }
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => self.reshape(n),
            "Concat" if all_const => {
                let ax = Self::int_attr(n, "axis", 0)?;
                let parts: Vec<Const> =
                    (0..n.inputs.len()).map(|i| self.konst(n, i)).collect::<Result<_, _>>()?;
                self.report.folded += 1;
                Ok(vec![Val::C(concat(&parts, ax)?)])
            }
            "Gather" if matches!(self.get(n, 1)?, Val::I(_)) => self.embedding(n),
            "Gather" if all_const => {
                let data = self.konst(n, 0)?;
                let idx = self.konst(n, 1)?;
                let ax = axis(Self::int_attr(n, "axis", 0)?, data.shape.len())
                    .ok_or_else(|| invalid("axis out of range"))?;
                self.report.folded += 1;
                Ok(vec![Val::C(gather(&data, &idx, ax)?)])
            }
            "Gather" if matches!(self.get(n, 0)?, Val::D(_) | Val::I(_)) => self.gather_computed(n),
            "GatherND" if matches!(self.get(n, 0)?, Val::D(_)) => self.gather_nd_computed(n),
            "GatherElements" if matches!(self.get(n, 0)?, Val::D(_)) => {
                Self::only_attrs(n, &["axis"])?;
                let d = self.dense(n, 0)?;
                let idx = self.konst(n, 1)?;
                let ax = axis(Self::int_attr(n, "axis", 0)?, d.shape.len())
                    .ok_or_else(|| invalid("axis out of range"))?;
                let at = gather_elements_offsets(&d.shape, &idx, ax)?;
                self.gather_rows(n, &d, elems(&d.shape), 1, &at, idx.shape.clone())
            }
            "GatherND" if all_const => {
                Self::only_attrs(n, &["batch_dims"])?;
                let (data, idx) = (self.konst(n, 0)?, self.konst(n, 1)?);
                let b = usize::try_from(Self::int_attr(n, "batch_dims", 0)?)
                    .map_err(|_| invalid("negative batch_dims"))?;
                self.report.folded += 1;
                Ok(vec![Val::C(gather_nd_const(&data, &idx, b)?)])
            }
            "GatherElements" if all_const => {
                Self::only_attrs(n, &["axis"])?;
                let (data, idx) = (self.konst(n, 0)?, self.konst(n, 1)?);
                let ax = axis(Self::int_attr(n, "axis", 0)?, data.shape.len())
                    .ok_or_else(|| invalid("axis out of range"))?;
                self.report.folded += 1;
                Ok(vec![Val::C(gather_elements_const(&data, &idx, ax)?)])
            }
            // (Max and Min take any number of inputs: `variadic` folds them.)
            "Add" | "Sub" | "Mul" | "Div" | "Pow" if all_const => {
                let (a, b) = (self.konst(n, 0)?, self.konst(n, 1)?);
                self.report.folded += 1;
                Ok(vec![Val::C(binary_const(&n.op, &a, &b)?)])
            }
            "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or" | "Xor"
                if all_const =>
            {
                Self::only_attrs(n, &[])?;
                let (a, b) = (self.konst(n, 0)?, self.konst(n, 1)?);
                self.report.folded += 1;
                Ok(vec![Val::C(compare_const(&n.op, &a, &b)?)])
            }
            "Mod" if all_const => {
                Self::only_attrs(n, &["fmod"])?;
                let fmod = Self::int_attr(n, "fmod", 0)? != 0;
                let (a, b) = (self.konst(n, 0)?, self.konst(n, 1)?);
                self.report.folded += 1;
                Ok(vec![Val::C(mod_const(fmod, &a, &b)?)])
            }
            "Not" if all_const => {
                Self::only_attrs(n, &[])?;
                let a = self.konst(n, 0)?;
                self.report.folded += 1;
                let v = a.data.to_i64().iter().map(|&x| i64::from(x == 0)).collect();
                Ok(vec![Val::C(Const { shape: a.shape, data: Data::I64(v) })])
            }
            "Where" if all_const => {
                Self::only_attrs(n, &[])?;
                let (c, x, y) = (self.konst(n, 0)?, self.konst(n, 1)?, self.konst(n, 2)?);
                self.report.folded += 1;
                Ok(vec![Val::C(where_const(&c, &x, &y)?)])
            }
            "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or" | "Xor" => {
                self.compare(n)
            }
            "Not" => self.not(n),
            "Mod" => Err(unsupported("Mod of a computed tensor (folded on constants only)")),
            "ArgMax" | "ArgMin" => self.arg_extreme(n),
            "TopK" => self.top_k(n),
            "Where" => self.select(n),
            "IsNaN" | "IsInf" => self.is_special(n),
            "Sqrt" | "Neg" | "Reciprocal" | "Relu" | "Sigmoid" | "Tanh" | "Exp" | "Erf" | "Abs" | "Log"
            | "Floor" | "Ceil" | "Sin" | "Cos"
                if all_const =>
            {
                let a = self.konst(n, 0)?;
                self.report.folded += 1;
                let f: fn(f32) -> f32 = match n.op.as_str() {
                    "Sqrt" => f32::sqrt,
                    "Neg" => |x| -x,
                    "Reciprocal" => |x| 1.0 / x,
                    "Relu" => |x| if x.is_nan() { x } else { x.max(0.0) },
                    "Sigmoid" => |x| 1.0 / (1.0 + (-x).exp()),
                    "Tanh" => f32::tanh,
                    "Exp" => f32::exp,
                    "Abs" => f32::abs,
                    "Log" => libm::logf,
                    "Floor" => libm::floorf,
                    "Ceil" => libm::ceilf,
                    "Sin" => libm::sinf,
                    "Cos" => libm::cosf,
                    _ => libm::erff,
                };
                Ok(vec![Val::C(Const {
                    shape: a.shape,
                    data: Data::F32(a.data.to_f32().into_iter().map(f).collect()),
                })])
            }
            "MatMul" => self.matmul_any(n),
            "Gemm" => self.gemm(n),
            "Add" | "Sub" | "Mul" | "Div" => self.binary(n),
            "Max" | "Min" | "Sum" | "Mean" => self.variadic(n),
            "Split" => self.split(n),
            "LogSoftmax" => self.log_softmax(n),
            "RMSNormalization" => self.rms_norm(n),
            "Expand" => self.expand_node(n),
            "LeakyRelu" | "Elu" | "Selu" | "Celu" | "Softplus" | "Softsign" | "PRelu" => self.composite(n),
            "Relu" | "Sigmoid" | "Tanh" | "Abs" | "Log" | "Floor" | "Ceil" | "Sin" | "Cos" => {
                Self::only_attrs(n, &[])?;
                let act = match n.op.as_str() {
                    "Relu" => Act::Relu,
                    "Sigmoid" => Act::Sigmoid,
                    "Abs" => Act::Abs,
                    "Log" => Act::Log,
                    "Floor" => Act::Floor,
                    "Ceil" => Act::Ceil,
                    "Sin" => Act::Sin,
                    "Cos" => Act::Cos,
                    _ => Act::Tanh,
                };
                self.activation(n, act)
            }
            "Softmax" => self.softmax_any(n),
            "Attention" => self.attention(n),
            "Swish" | "Tan" | "Sinh" | "Cosh" => self.unary_chain(n),
            "GlobalMaxPool" => self.global_max_pool(n),
            "LpNormalization" => self.lp_normalization(n),
            "InstanceNormalization" | "GroupNormalization" => self.group_normalization(n),
            "DepthToSpace" | "SpaceToDepth" => self.depth_space(n),
            "LpPool" => self.lp_pool(n),
            "SwiGLU" => self.swiglu(n),
            "Shrink" => self.shrink(n),
            "LRN" => self.lrn(n),
            "RotaryEmbedding" => self.rotary_embedding(n),
            "Clip" => {
                let act = self.clip(n)?;
                self.activation(n, act)
            }
            "HardSigmoid" => {
                Self::only_attrs(n, &["alpha", "beta"])?;
                let alpha = Self::float_attr(n, "alpha", 0.2)?;
                let beta = Self::float_attr(n, "beta", 0.5)?;
                self.activation(n, Act::Clamp { scale: alpha, bias: beta, lo: 0.0, hi: 1.0 })
            }
            "HardSwish" => {
                Self::only_attrs(n, &[])?;
                self.activation(n, Act::HardSwish)
            }
            "Gelu" => {
                let act = Self::gelu(n)?;
                self.activation(n, act)
            }
            "Erf" => {
                Self::only_attrs(n, &[])?;
                self.activation(n, Act::Erf)
            }
            "Transpose" => self.transpose(n),
            "LayerNormalization" => self.layer_norm(n),
            "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2"
            | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceProd"
                if all_const =>
            {
                self.report.folded += 1;
                Ok(vec![Val::C(self.reduce_const(n)?)])
            }
            "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2"
            | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" => self.reduce_mean(n),
            "ReduceProd" => self.reduce_prod(n),
            "Conv" => self.conv(n),
            "BatchNormalization" => self.batch_norm_any(n),
            "MaxPool" | "AveragePool" => self.pool_any(n),
            "GlobalAveragePool" => self.global_pool(n),
            "Slice" if all_const => {
                let r = self.slice_const(n)?;
                self.report.folded += 1;
                Ok(vec![Val::C(r)])
            }
            "Slice" => self.slice(n),
            "Concat" => self.concat(n),
            "Pad" => self.pad(n),
            "Resize" | "Upsample" => self.resize(n),
            "ConvTranspose" => self.conv_transpose(n),
            "Sqrt" => self.activation(n, Act::Sqrt),
            "Reciprocal" => self.activation(n, Act::Recip),
            "Exp" => self.activation(n, Act::Exp),
            "Neg" => self.activation(n, Act::affine(-1.0, 0.0)),
            "Pow" => self.pow(n),
            op => Err(unsupported(format!(
                "operator `{op}` is not supported (docs/compiled-model-format.md lists what is)"
            ))),
        }
    }

    /// `Reshape`, `Flatten`, `Squeeze`, `Unsqueeze`: a constant folded, a
    /// computed tensor renamed (in ONNX's order).
    fn reshape(&mut self, n: &Node) -> NodeResult {
        let s = self.shape_of(n, 0)?;
        let new = self.reshaped(n, &s)?;
        if elems(&new) != elems(&s) {
            return Err(invalid(format!("cannot reshape {s:?} to {new:?}")));
        }
        Ok(vec![match self.get(n, 0)?.clone() {
            Val::C(c) => {
                self.report.folded += 1;
                Val::C(Const { shape: new, data: c.data })
            }
            Val::D(d) => {
                self.report.aliases += 1;
                let d = self.onnx_order(&n.name, &d)?;
                Val::D(Dyn::new(d.t, new, None, false))
            }
            // Integer tensors are dense in ONNX's order (model inputs and
            // their renamings): a rename.
            Val::I(d) if d.strides.is_none() && !d.nhwc => {
                self.report.aliases += 1;
                Val::I(Dyn::new(d.t, new, None, false))
            }
            Val::I(_) => return Err(int_refused(n, 0)),
        }])
    }

    /// `Gather` of the rows of a constant table by a computed integer
    /// tensor (an embedding lookup: token ids in): a DMA gather of HBM rows
    /// (`Op::Embedding`, `dma.gather`). An index outside the table (ONNX
    /// allows negative ones; they are refused too) fails the request at
    /// run time: the device checks every index it gathers by.
    fn embedding(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis"])?;
        let table = match self.get(n, 0)? {
            Val::C(c) => c.clone(),
            Val::D(_) => {
                return Err(unsupported(
                    "a computed table gathered by computed indices (only the rows of a constant table)",
                ))
            }
            Val::I(_) => return Err(int_refused(n, 0)),
        };
        let Val::I(idx) = self.get(n, 1)?.clone() else {
            return Err(invalid("indices are not an integer tensor"));
        };
        let rank = table.shape.len();
        if rank == 0 {
            return Err(invalid("a scalar table"));
        }
        if axis(Self::int_attr(n, "axis", 0)?, rank).ok_or_else(|| invalid("axis out of range"))? != 0 {
            return Err(unsupported("a gather by computed indices along an axis other than 0"));
        }
        let (rows, dim) = (table.shape[0], elems(&table.shape[1..]));
        let mut shape = idx.shape.clone();
        shape.extend_from_slice(&table.shape[1..]);
        let t = self.weight(&format!("{}.table", n.name), table.data.to_f32(), Init::Bias);
        self.gather_op(n, t, rows, dim, idx.t, elems(&idx.shape), shape)
    }

    fn reshaped(&self, n: &Node, s: &[usize]) -> Result<Vec<usize>, Refusal> {
        let rank = s.len();
        match n.op.as_str() {
            "Reshape" => {
                let spec = self.konst(n, 1)?.data.to_i64();
                let allowzero = Self::int_attr(n, "allowzero", 0)? != 0;
                let mut out = Vec::with_capacity(spec.len());
                let mut infer = None;
                for (i, &d) in spec.iter().enumerate() {
                    match d {
                        -1 if infer.is_none() => {
                            infer = Some(i);
                            out.push(1);
                        }
                        0 if !allowzero => {
                            out.push(*s.get(i).ok_or_else(|| invalid("0 refers to a missing dimension"))?)
                        }
                        d if d >= 0 => out.push(d as usize),
                        d => return Err(invalid(format!("bad reshape dimension {d}"))),
                    }
                }
                if let Some(i) = infer {
                    let known = elems(&out);
                    if known == 0 || !elems(s).is_multiple_of(known) {
                        return Err(invalid(format!("cannot infer -1 reshaping {s:?} to {spec:?}")));
                    }
                    out[i] = elems(s) / known;
                }
                Ok(out)
            }
            "Flatten" => {
                let a = Self::int_attr(n, "axis", 1)?;
                let a = if a < 0 { a + rank as i64 } else { a };
                if !(0..=rank as i64).contains(&a) {
                    return Err(invalid(format!("axis {a} out of range")));
                }
                let a = a as usize;
                Ok(vec![elems(&s[..a]), elems(&s[a..])])
            }
            "Squeeze" => {
                let axes = match Self::ints_attr(n, "axes")? {
                    Some(a) => Some(a),
                    None => self.const_ints(n, 1, "axes")?,
                };
                let axes: Vec<usize> = match axes {
                    Some(a) => a
                        .iter()
                        .map(|&x| axis(x, rank).ok_or_else(|| invalid("axis out of range")))
                        .collect::<Result<_, _>>()?,
                    None => (0..rank).filter(|&i| s[i] == 1).collect(),
                };
                if axes.iter().any(|&a| s[a] != 1) {
                    return Err(invalid("squeezed axis is not 1"));
                }
                Ok(s.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect())
            }
            _ => {
                let axes = match Self::ints_attr(n, "axes")? {
                    Some(a) => a,
                    None => self.konst(n, 1)?.data.to_i64(),
                };
                let out_rank = rank + axes.len();
                let mut axes: Vec<usize> = axes
                    .iter()
                    .map(|&x| axis(x, out_rank).ok_or_else(|| invalid("axis out of range")))
                    .collect::<Result<_, _>>()?;
                axes.sort_unstable();
                let mut out = s.to_vec();
                for a in axes {
                    out.insert(a.min(out.len()), 1);
                }
                Ok(out)
            }
        }
    }

    fn linear(
        &mut self,
        n: &Node,
        x: &Dyn,
        w: Vec<f32>,
        k: usize,
        nn: usize,
        bias: Option<Vec<f32>>,
    ) -> NodeResult {
        if x.shape.last() != Some(&k) {
            return Err(invalid(format!(
                "input of shape {:?} does not end in the weights' {k} rows",
                x.shape
            )));
        }
        let rows = elems(&x.shape[..x.shape.len() - 1]);
        let mut shape = x.shape.clone();
        *shape.last_mut().unwrap_or(&mut 0) = nn;
        let wt = self.weight(&format!("{}.w", n.name), w, Init::Weights { fan_in: k as u32 });
        let bt = self.weight(&format!("{}.b", n.name), bias.unwrap_or_else(|| vec![0.0; nn]), Init::Bias);
        let y = self.act_tensor(&n.name, rows * nn);
        self.g.ops.push(Op::Linear {
            name: n.name.clone(),
            x: View::dense(x.t, k as u32),
            w: wt,
            b: bt,
            y: View::dense(y, nn as u32),
            rows: rows as u32,
            k: k as u32,
            n: nn as u32,
            act: Act::None,
        });
        Ok(vec![Val::D(Dyn::new(y, shape, Some(self.g.ops.len() - 1), x.nhwc))])
    }

    fn matmul(&mut self, n: &Node) -> NodeResult {
        let w = match self.get(n, 1)? {
            Val::C(c) => c.clone(),
            Val::D(_) => return self.batch_matmul(n),
            Val::I(_) => return Err(int_refused(n, 1)),
        };
        let x = self.dense(n, 0)?;
        if w.shape.len() != 2 {
            return Err(unsupported(format!(
                "weights of rank {} (only 2-D weights are supported)",
                w.shape.len()
            )));
        }
        self.linear(n, &x, w.data.to_f32(), w.shape[0], w.shape[1], None)
    }

    fn gemm(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["alpha", "beta", "transA", "transB"])?;
        let computed_c = matches!(self.opt(n, 2), Some(Val::D(_)));
        let per_sample_c = matches!(self.opt(n, 2), Some(Val::C(c)) if c.shape.len() == 2 && c.shape[0] != 1);
        if matches!(self.get(n, 1)?, Val::D(_))
            || Self::int_attr(n, "transA", 0)? != 0
            || computed_c
            || per_sample_c
        {
            return self.gemm_general(n);
        }
        let x = self.dense(n, 0)?;
        if Self::int_attr(n, "transA", 0)? != 0 {
            return Err(unsupported("transA = 1 is not supported"));
        }
        if x.shape.len() != 2 {
            return Err(invalid(format!("A must be 2-D, it is {:?}", x.shape)));
        }
        let b = self.konst(n, 1).map_err(|_| unsupported("B must be a constant (weights)"))?;
        if b.shape.len() != 2 {
            return Err(invalid("B must be 2-D"));
        }
        let alpha = Self::float_attr(n, "alpha", 1.0)?;
        let beta = Self::float_attr(n, "beta", 1.0)?;
        let (mut k, mut nn) = (b.shape[0], b.shape[1]);
        let mut w = b.data.to_f32();
        if Self::int_attr(n, "transB", 0)? != 0 {
            (k, nn) = (nn, k);
            let src = w.clone();
            for i in 0..k {
                for j in 0..nn {
                    w[i * nn + j] = src[j * k + i];
                }
            }
        }
        if alpha != 1.0 {
            w.iter_mut().for_each(|v| *v *= alpha);
        }
        let bias = match self.opt(n, 2) {
            None => None,
            Some(Val::C(c)) => {
                if bcast_shape(&[x.shape[0], nn], &c.shape) != Some(vec![x.shape[0], nn]) {
                    return Err(invalid(format!(
                        "C of shape {:?} does not broadcast to {:?}",
                        c.shape,
                        [x.shape[0], nn]
                    )));
                }
                if c.shape.len() == 2 && c.shape[0] != 1 {
                    return Err(unsupported(
                        "a C with one row per sample is not supported (only a bias row)",
                    ));
                }
                let v = c.data.to_f32();
                let row = match v.len() {
                    1 => vec![v[0]; nn],
                    l if l == nn => v,
                    _ => return Err(invalid(format!("C of shape {:?} is not a bias row of {nn}", c.shape))),
                };
                Some(row.into_iter().map(|v| v * beta).collect())
            }
            Some(Val::D(_) | Val::I(_)) => {
                return Err(unsupported("a computed C is not supported (only a constant bias)"))
            }
        };
        self.linear(n, &x, w, k, nn, bias)
    }

    fn binary(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let (a, b) = (self.get(n, 0)?.clone(), self.get(n, 1)?.clone());
        for (i, v) in [&a, &b].into_iter().enumerate() {
            if matches!(v, Val::I(_)) {
                return Err(int_refused(n, i));
            }
        }
        let sa = self.shape_of(n, 0)?;
        let sb = self.shape_of(n, 1)?;
        let shape = bcast_shape(&sa, &sb)
            .ok_or_else(|| invalid(format!("shapes {sa:?} and {sb:?} do not broadcast")))?;
        let op = n.op.as_str();
        match (a, b) {
            (Val::I(_), _) => Err(int_refused(n, 0)),
            (_, Val::I(_)) => Err(int_refused(n, 1)),
            (Val::D(_), Val::C(c)) => self.with_const(n, 0, &c, op, false, &shape),
            (Val::C(c), Val::D(_)) => self.with_const(n, 1, &c, op, true, &shape),
            (Val::D(_), Val::D(_)) => {
                // Views (transposes) stored densely: the operations below
                // read their operands as stored.
                let x = self.computed(n, 0)?;
                let y = self.computed(n, 1)?;
                // x[N,C,H,W] * s[N,C,1,1]: squeeze-and-excitation, in place.
                if op == "Mul" && shape.len() == 4 && x.shape != y.shape {
                    let se = [shape[0], shape[1], 1, 1];
                    if x.shape == shape && y.shape == se {
                        return Ok(vec![Val::D(self.scale_channels(n, &x, &y)?)]);
                    }
                    if y.shape == shape && x.shape == se {
                        return Ok(vec![Val::D(self.scale_channels(n, &y, &x)?)]);
                    }
                }
                // Anything else broadcast by a copy that reads the smaller one again.
                let nhwc = x.nhwc || y.nhwc;
                let x = if x.shape == shape { x } else { self.broadcast_to(&n.name, &x, &shape, nhwc)? };
                let y = if y.shape == shape { y } else { self.broadcast_to(&n.name, &y, &shape, nhwc)? };
                let (x, y) = self.same_layout(n, x, y)?;
                let y = match op {
                    "Sub" => self.act_op(n, &y, Act::affine(-1.0, 0.0)),
                    "Div" => self.act_op(n, &y, Act::Recip),
                    _ => y,
                };
                if matches!(op, "Max" | "Min") {
                    return Ok(vec![Val::D(self.extremum(n, op == "Max", &x, y.t))]);
                }
                Ok(vec![Val::D(self.eltwise(n, matches!(op, "Add" | "Sub"), &x, y.t))])
            }
            (Val::C(_), Val::C(_)) => {
                Err(unsupported("both operands are constants (folded before this point)"))
            }
        }
    }

    /// `Gemm` as the nodes it is made of, `alpha * A' B' + beta * C`
    /// (`'`: transposed when `transA`/`transB` say): for a computed `B`,
    /// `transA`, or a `C` that is computed or has a row per sample.
    fn gemm_general(&mut self, n: &Node) -> NodeResult {
        let alpha = Self::float_attr(n, "alpha", 1.0)?;
        let beta = Self::float_attr(n, "beta", 1.0)?;
        let step = |c: &mut Self, tag: &str, op: &str, inputs: Vec<String>, attrs: HashMap<String, Attr>| {
            c.step(n, tag, op, inputs, attrs)
        };
        let perm = || HashMap::from([("perm".to_string(), Attr::Ints(vec![1, 0]))]);
        let mut a = n.inputs.first().cloned().ok_or_else(|| invalid("input A is missing"))?;
        let mut b = n.inputs.get(1).cloned().ok_or_else(|| invalid("input B is missing"))?;
        if Self::int_attr(n, "transA", 0)? != 0 {
            a = step(self, "ta", "Transpose", vec![a], perm())?;
        }
        if Self::int_attr(n, "transB", 0)? != 0 {
            b = step(self, "tb", "Transpose", vec![b], perm())?;
        }
        let mut y = step(self, "mm", "MatMul", vec![a, b], HashMap::new())?;
        let scalar = |c: &mut Self, tag: &str, v: f32| {
            c.stash(n, tag, Val::C(Const { shape: vec![], data: Data::F32(vec![v]) }))
        };
        if alpha != 1.0 {
            let s = scalar(self, "alpha", alpha);
            y = step(self, "scaled", "Mul", vec![y, s], HashMap::new())?;
        }
        if let Some(c) = n.inputs.get(2).filter(|c| !c.is_empty()).cloned() {
            let c = if beta == 1.0 {
                c
            } else {
                let s = scalar(self, "beta", beta);
                step(self, "c", "Mul", vec![c, s], HashMap::new())?
            };
            y = step(self, "bias", "Add", vec![y, c], HashMap::new())?;
        }
        Ok(vec![self.vals.get(&y).cloned().ok_or_else(|| invalid("no output"))?])
    }

    /// A node standing for a part of `n` (named `n#tag`): the compiler
    /// translates it as it translates the model's own nodes.
    pub(super) fn part(
        n: &Node,
        tag: &str,
        op: &str,
        inputs: Vec<String>,
        attrs: HashMap<String, Attr>,
    ) -> Node {
        Node {
            name: format!("{}#{tag}", n.name),
            op: op.into(),
            domain: String::new(),
            inputs,
            outputs: vec![],
            attrs,
        }
    }

    /// The part `op` of `n` on the values named `inputs` (see
    /// [`Self::run_part`]), its output known from now on as `n#tag.out`,
    /// the name returned: how a node made of others is written.
    pub(super) fn step(
        &mut self,
        n: &Node,
        tag: &str,
        op: &str,
        inputs: Vec<String>,
        attrs: HashMap<String, Attr>,
    ) -> Result<String, Refusal> {
        let v = self.run_part(n, tag, op, inputs, attrs)?;
        Ok(self.stash(n, &format!("{tag}.out"), v))
    }

    /// The shape of the value named `name`.
    pub(super) fn value_shape(&self, name: &str) -> Result<Vec<usize>, Refusal> {
        match self.vals.get(name) {
            Some(Val::C(c)) => Ok(c.shape.clone()),
            Some(Val::D(d) | Val::I(d)) => Ok(d.shape.clone()),
            None => Err(invalid(format!("no value `{name}`"))),
        }
    }

    /// The value named `name` as a node's result.
    pub(super) fn result(&self, name: &str) -> NodeResult {
        Ok(vec![self.vals.get(name).cloned().ok_or_else(|| invalid(format!("no value `{name}`")))?])
    }

    /// The integers `v` as a 1-D constant known as `n#tag` (a shape, axes).
    pub(super) fn stash_ints(&mut self, n: &Node, tag: &str, v: &[i64]) -> String {
        self.stash(n, tag, Val::C(Const { shape: vec![v.len()], data: Data::I64(v.to_vec()) }))
    }

    /// The sizes `v` as a 1-D constant known as `n#tag` (a shape).
    pub(super) fn sizes(&mut self, n: &Node, tag: &str, v: &[usize]) -> String {
        let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
        self.stash_ints(n, tag, &v)
    }

    /// The scalar `v` as a constant known as `n#tag`.
    pub(super) fn stash_scalar(&mut self, n: &Node, tag: &str, v: f32) -> String {
        self.stash(n, tag, Val::C(Const { shape: vec![], data: Data::F32(vec![v]) }))
    }

    /// `v`, known from now on as `n#tag` (an input of a [`Self::part`]).
    pub(super) fn stash(&mut self, n: &Node, tag: &str, v: Val) -> String {
        let name = format!("{}#{tag}", n.name);
        self.vals.insert(name.clone(), v);
        name
    }

    /// The first output of the part `op` of `n` on the values named
    /// `inputs`: a `Transpose`, `MatMul`, `Pad`, `Slice`, `Reshape`,
    /// `Concat`, `Softmax`, a reduction (`ReduceMean`, `ReduceMax`,
    /// `ReduceL1`, `ReduceL2`), a pooling (`MaxPool`, `AveragePool`), an
    /// activation (`Tanh`, `Sqrt`, `Abs`, `Log`, `Exp`) or an element-wise
    /// `Add`, `Sub`, `Mul`, `Div`, `Max`, `Min`.
    pub(super) fn run_part(
        &mut self,
        n: &Node,
        tag: &str,
        op: &str,
        inputs: Vec<String>,
        attrs: HashMap<String, Attr>,
    ) -> Result<Val, Refusal> {
        let p = Self::part(n, tag, op, inputs, attrs);
        let out = match op {
            "Transpose" => self.transpose(&p),
            "MatMul" => self.matmul(&p),
            "Pad" => self.pad(&p),
            "Slice" => self.slice(&p),
            "Reshape" => self.reshape(&p),
            "Concat" => self.concat(&p),
            "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2" => self.reduce_mean(&p),
            "Sqrt" => self.activation(&p, Act::Sqrt),
            "Abs" => self.activation(&p, Act::Abs),
            "Log" => self.activation(&p, Act::Log),
            "Exp" => self.activation(&p, Act::Exp),
            "AveragePool" | "MaxPool" => self.pool_any(&p),
            "Softmax" => self.softmax(&p),
            "Tanh" => self.activation(&p, Act::Tanh),
            "Add" | "Sub" | "Mul" | "Div" | "Max" | "Min" => self.binary(&p),
            _ => Err(unsupported(format!("`{op}` is not a part the compiler builds"))),
        }?;
        out.into_iter().next().ok_or_else(|| invalid(format!("`{op}` gave no output")))
    }

    /// `Max`, `Min`, `Sum`, `Mean` of one or more inputs (numpy
    /// broadcasting): folded when all are constants, else a chain of
    /// element-wise operations from the left (`Mean`: the sum scaled by
    /// `1 / inputs`, one affine pass).
    fn variadic(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let k = n.inputs.len();
        if k == 0 || n.inputs.iter().any(String::is_empty) {
            return Err(invalid("needs one or more inputs"));
        }
        let pair_op = match n.op.as_str() {
            "Max" => "Max",
            "Min" => "Min",
            _ => "Add",
        };
        let mut acc = self.get(n, 0)?.clone();
        for i in 1..k {
            let b = self.get(n, i)?.clone();
            acc = match (&acc, &b) {
                (Val::C(x), Val::C(y)) => {
                    self.report.folded += 1;
                    Val::C(binary_const(pair_op, x, y)?)
                }
                _ => {
                    let a = self.stash(n, &format!("acc{i}"), acc);
                    self.run_part(n, &i.to_string(), pair_op, vec![a, n.inputs[i].clone()], HashMap::new())?
                }
            };
        }
        if n.op == "Mean" && k > 1 {
            let scale = 1.0 / k as f32;
            acc = match acc {
                Val::C(c) => Val::C(Const {
                    shape: c.shape.clone(),
                    data: Data::F32(c.data.to_f32().into_iter().map(|x| x * scale).collect()),
                }),
                Val::D(d) => {
                    let name = self.stash(n, &format!("acc{k}"), Val::D(d.clone()));
                    self.activation_of(n, &name, &d, Act::affine(scale, 0.0))
                }
                Val::I(_) => return Err(int_refused(n, 0)),
            };
        }
        if k == 1 {
            self.report.aliases += 1;
        }
        Ok(vec![acc])
    }

    /// Activations the VU has no single operation for, spelled with the
    /// ones it has, each exactly as ONNX defines it for every input:
    /// `LeakyRelu` = `relu(x) + alpha min(x, 0)`; `Elu` = `relu(x) +
    /// alpha (exp(min(x, 0)) - 1)`; `Selu` = `gamma` times Elu's form;
    /// `Celu` = `relu(x) + alpha (exp(min(x, 0) / alpha) - 1)` (only
    /// `alpha` above 0); `Softplus` = `log(exp(x) + 1)`; `Softsign` = `x / (1 + |x|)`
    /// (a reciprocal and a product); `PRelu` = `relu(x) + slope min(x, 0)`
    /// (the slope broadcast as `Mul` broadcasts it).
    fn composite(&mut self, n: &Node) -> NodeResult {
        let op = n.op.as_str();
        let attrs: &[&str] = match op {
            "LeakyRelu" | "Elu" | "Celu" => &["alpha"],
            "Selu" => &["alpha", "gamma"],
            _ => &[],
        };
        Self::only_attrs(n, attrs)?;
        let x = self.computed(n, 0)?;
        let neg = Act::Clamp { scale: 1.0, bias: 0.0, lo: f32::MIN, hi: 0.0 };
        let y = match op {
            "LeakyRelu" => {
                let alpha = Self::float_attr(n, "alpha", 0.01)?;
                let m = self.act_op(n, &x, neg);
                let m = self.act_op(n, &m, Act::affine(alpha, 0.0));
                let p = self.act_op(n, &x, Act::Relu);
                self.eltwise(n, true, &p, m.t)
            }
            "Elu" | "Selu" | "Celu" => {
                let alpha = Self::float_attr(n, "alpha", if op == "Selu" { 1.673_263_2 } else { 1.0 })?;
                let gamma = if op == "Selu" { Self::float_attr(n, "gamma", 1.050_701)? } else { 1.0 };
                if op == "Celu" && alpha.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                    return Err(unsupported(format!("alpha = {alpha} is not supported (only alpha > 0)")));
                }
                let m = self.act_op(n, &x, neg);
                let m = if op == "Celu" { self.act_op(n, &m, Act::affine(1.0 / alpha, 0.0)) } else { m };
                let e = self.act_op(n, &m, Act::Exp);
                let k = alpha * gamma;
                let t = self.act_op(n, &e, Act::affine(k, -k));
                let p = self.act_op(n, &x, Act::Relu);
                let p = if gamma == 1.0 { p } else { self.act_op(n, &p, Act::affine(gamma, 0.0)) };
                self.eltwise(n, true, &p, t.t)
            }
            "Softplus" => {
                let e = self.act_op(n, &x, Act::Exp);
                let e = self.act_op(n, &e, Act::affine(1.0, 1.0));
                self.act_op(n, &e, Act::Log)
            }
            "Softsign" => {
                let a = self.act_op(n, &x, Act::Abs);
                let a = self.act_op(n, &a, Act::affine(1.0, 1.0));
                let r = self.act_op(n, &a, Act::Recip);
                self.eltwise(n, false, &x, r.t)
            }
            _ => {
                // PRelu: `slope * min(x, 0)` as a `Mul` node would compute it.
                let m = self.act_op(n, &x, neg);
                let name = self.stash(n, "neg", Val::D(m));
                let slope =
                    n.inputs.get(1).cloned().ok_or_else(|| invalid("input 1 (the slope) is missing"))?;
                let Val::D(s) = self.run_part(n, "slope", "Mul", vec![name, slope], HashMap::new())? else {
                    return Err(unsupported("the slope product folded to a constant"));
                };
                if s.shape != x.shape {
                    return Err(invalid(format!(
                        "a slope of shape broadcasting x {:?} to {:?}",
                        x.shape, s.shape
                    )));
                }
                let p = self.act_op(n, &x, Act::Relu);
                let (p, s) = self.same_layout(n, p, s)?;
                self.eltwise(n, true, &p, s.t)
            }
        };
        Ok(vec![Val::D(y)])
    }

    /// `Split` along one axis into the outputs' sizes (the `split` input
    /// or attribute; else equal parts, the last smaller when the axis does
    /// not divide, as opset 18's `num_outputs` says): one `Slice` each.
    fn split(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis", "split", "num_outputs"])?;
        let shape = self.shape_of(n, 0)?;
        let ax =
            axis(Self::int_attr(n, "axis", 0)?, shape.len()).ok_or_else(|| invalid("axis out of range"))?;
        let (dim, k) = (shape[ax], n.outputs.len());
        let listed = match Self::ints_attr(n, "split")? {
            Some(s) => Some(s),
            None => self.const_ints(n, 1, "split")?,
        };
        let sizes: Vec<usize> = match listed {
            Some(s) => s
                .iter()
                .map(|&v| usize::try_from(v).map_err(|_| invalid(format!("a negative split size {v}"))))
                .collect::<Result<_, _>>()?,
            None => {
                let part = dim.div_ceil(k.max(1));
                (0..k).map(|i| part.min(dim.saturating_sub(i * part))).collect()
            }
        };
        if sizes.len() != k || sizes.iter().sum::<usize>() != dim {
            return Err(invalid(format!("sizes {sizes:?} do not split an axis of {dim} into {k} outputs")));
        }
        if sizes.contains(&0) {
            return Err(unsupported("an empty output (empty tensors are not supported)"));
        }
        let all_const = matches!(self.get(n, 0)?, Val::C(_));
        let mut out = Vec::with_capacity(k);
        let mut start = 0i64;
        for (i, &sz) in sizes.iter().enumerate() {
            let end = start + sz as i64;
            let attrs = HashMap::from([
                ("starts".to_string(), Attr::Ints(vec![start])),
                ("ends".to_string(), Attr::Ints(vec![end])),
                ("axes".to_string(), Attr::Ints(vec![ax as i64])),
            ]);
            let tag = i.to_string();
            out.push(if all_const {
                self.report.folded += 1;
                Val::C(self.slice_const(&Self::part(n, &tag, "Slice", vec![n.inputs[0].clone()], attrs))?)
            } else {
                self.run_part(n, &tag, "Slice", vec![n.inputs[0].clone()], attrs)?
            });
            start = end;
        }
        Ok(out)
    }

    /// `Expand`: numpy broadcasting of the input to the constant shape.
    fn expand_node(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let want: Vec<usize> = self
            .konst(n, 1)?
            .data
            .to_i64()
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| invalid(format!("dimension {d} is negative"))))
            .collect::<Result<_, _>>()?;
        let s = self.shape_of(n, 0)?;
        let shape =
            bcast_shape(&s, &want).ok_or_else(|| invalid(format!("{s:?} does not broadcast to {want:?}")))?;
        if elems(&shape) > MAX_FOLDED {
            return Err(unsupported(format!(
                "an output of shape {shape:?} (more than {MAX_FOLDED} elements)"
            )));
        }
        Ok(vec![match self.get(n, 0)?.clone() {
            Val::C(c) => {
                self.report.folded += 1;
                let data = match &c.data {
                    Data::F32(v) => Data::F32(expand(v, &c.shape, &shape)),
                    Data::I64(v) => Data::I64(expand(v, &c.shape, &shape)),
                };
                Val::C(Const { shape, data })
            }
            Val::I(_) => return Err(int_refused(n, 0)),
            Val::D(_) => {
                let d = self.computed(n, 0)?;
                if d.shape == shape {
                    self.report.aliases += 1;
                    Val::D(d)
                } else {
                    Val::D(self.broadcast_to(&n.name, &d, &shape, d.nhwc)?)
                }
            }
        }])
    }

    /// `max(a, b)` or `min(a, b)` element-wise (`b` stored as `a`).
    fn extremum(&mut self, n: &Node, max: bool, a: &Dyn, b: TensorId) -> Dyn {
        self.elementwise(n, a, b, |name, a, b, y, rows, cols| {
            if max {
                Op::Max { name, a, b, y, rows, cols, act: Act::None }
            } else {
                Op::Min { name, a, b, y, rows, cols, act: Act::None }
            }
        })
    }

    /// A new tensor of `a`'s shape written by the element-wise operation
    /// `op` of `a` and `b` (stored as `a`), over rows of its last axis.
    fn elementwise(
        &mut self,
        n: &Node,
        a: &Dyn,
        b: TensorId,
        op: impl FnOnce(String, View, View, View, u32, u32) -> Op,
    ) -> Dyn {
        let shape = &a.shape;
        let cols = (*shape.last().unwrap_or(&1)).max(1);
        let rows = elems(shape) / cols;
        let y = self.act_tensor(&n.name, elems(shape));
        let (av, bv, yv) =
            (View::dense(a.t, cols as u32), View::dense(b, cols as u32), View::dense(y, cols as u32));
        self.g.ops.push(op(n.name.clone(), av, bv, yv, rows as u32, cols as u32));
        Dyn::new(y, shape.to_vec(), Some(self.g.ops.len() - 1), a.nhwc)
    }

    /// `Pow` of a computed tensor by a constant scalar exponent that the
    /// VU computes exactly: 1, 2, 3, 0.5, -0.5, -1 (products, square roots
    /// and reciprocals); other exponents are refused.
    fn pow(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let x = self.computed(n, 0)?;
        let e = match self.get(n, 1)? {
            Val::C(c) if elems(&c.shape) == 1 => c.data.to_f32()[0],
            Val::C(c) => {
                return Err(unsupported(format!("an exponent of shape {:?} (only a scalar)", c.shape)))
            }
            Val::D(_) | Val::I(_) => {
                return Err(unsupported("a computed exponent is not supported (only a constant)"))
            }
        };
        Ok(vec![Val::D(match e {
            1.0 => {
                self.report.aliases += 1;
                x
            }
            2.0 => self.eltwise(n, false, &x, x.t),
            3.0 => {
                let sq = self.eltwise(n, false, &x, x.t);
                self.eltwise(n, false, &sq, x.t)
            }
            0.5 => self.act_op(n, &x, Act::Sqrt),
            -0.5 => {
                let r = self.act_op(n, &x, Act::Sqrt);
                self.act_op(n, &r, Act::Recip)
            }
            -1.0 => self.act_op(n, &x, Act::Recip),
            e => return Err(unsupported(format!("exponent {e} is not supported (1, 2, 3, 0.5, -0.5, -1)"))),
        })])
    }

    /// `d op c` (or `c op d` when `swapped`) for the computed input `i`
    /// (`d`, stored densely when it is a view) and a constant `c`.
    fn with_const(
        &mut self,
        n: &Node,
        i: usize,
        c: &Const,
        op: &str,
        swapped: bool,
        shape: &[usize],
    ) -> NodeResult {
        let d = self.computed(n, i)?;
        let d = if d.shape == shape { d } else { self.broadcast_to(&n.name, &d, shape, d.nhwc)? };
        let mut v = c.data.to_f32();
        if matches!(op, "Max" | "Min") {
            // The constant, broadcast and stored as `d` is.
            let full = expand(&v, &c.shape, shape);
            let full = if d.nhwc { nchw_to_nhwc(&full, shape) } else { full };
            let ct = self.weight(&format!("{}.c", n.name), full, Init::Bias);
            return Ok(vec![Val::D(self.extremum(n, op == "Max", &d, ct))]);
        }
        // c - x = (-x) + c, c / x = (1/x) * c
        let d = match op {
            "Sub" if swapped => self.act_op(n, &d, Act::affine(-1.0, 0.0)),
            "Div" if swapped => self.act_op(n, &d, Act::Recip),
            _ => d,
        };
        match op {
            "Sub" if !swapped => v.iter_mut().for_each(|x| *x = -*x),
            "Div" if !swapped => v.iter_mut().for_each(|x| *x = 1.0 / *x),
            _ => {}
        }
        let add = matches!(op, "Add" | "Sub");
        let input = &n.inputs[i];
        // One value per channel: folded into the matrix product or
        // convolution that wrote `d`, when nothing else reads its output.
        if let Some(ch) = channel_vec(&v, &c.shape, &d) {
            let (scale, shift) = if add { (None, Some(ch)) } else { (Some(ch), None) };
            if let Some(r) = self.fold_affine(input, &d, scale.as_deref(), shift.as_deref()) {
                self.report.fused += 1;
                return Ok(vec![Val::D(r)]);
            }
        }
        if v.len() == 1 {
            let act = if add { Act::affine(1.0, v[0]) } else { Act::affine(v[0], 0.0) };
            return Ok(vec![self.activation_of(n, input, &d, act)]);
        }
        let full = expand(&v, &c.shape, shape);
        let full = if d.nhwc { nchw_to_nhwc(&full, shape) } else { full };
        let ct = self.weight(&format!("{}.c", n.name), full, Init::Bias);
        Ok(vec![Val::D(self.eltwise(n, add, &d, ct))])
    }

    /// `x` and `y` stored the same way (channels-last if either is).
    fn same_layout(&mut self, n: &Node, x: Dyn, y: Dyn) -> Result<(Dyn, Dyn), Refusal> {
        Ok(match (x.nhwc, y.nhwc) {
            (true, false) => {
                let y = self.channels_last(&n.name, &y)?;
                (x, y)
            }
            (false, true) => (self.channels_last(&n.name, &x)?, y),
            _ => (x, y),
        })
    }

    /// `a + b` or `a * b` (element-wise, `b` stored as `a`).
    fn eltwise(&mut self, n: &Node, add: bool, a: &Dyn, b: TensorId) -> Dyn {
        self.elementwise(n, a, b, |name, a, b, y, rows, cols| {
            if add {
                Op::Add { name, a, b, y, rows, cols, act: Act::None }
            } else {
                Op::Mul { name, a, b, y, rows, cols, act: Act::None }
            }
        })
    }

    fn activation(&mut self, n: &Node, act: Act) -> NodeResult {
        let d = self.computed(n, 0)?;
        Ok(vec![self.activation_of(n, &n.inputs[0], &d, act)])
    }

    /// `act(d)`: fused into the operation that wrote `d` when it can be,
    /// else a new element-wise operation.
    fn activation_of(&mut self, n: &Node, input: &str, d: &Dyn, act: Act) -> Val {
        if let Some(i) = self.fusable(input, d) {
            let slot = match &mut self.g.ops[i] {
                Op::Linear { act, .. }
                | Op::Add { act, .. }
                | Op::Mul { act, .. }
                | Op::Max { act, .. }
                | Op::Min { act, .. }
                | Op::Conv { act, .. }
                | Op::Depthwise { act, .. }
                | Op::BatchMatMul { act, .. }
                | Op::Unary { act, .. } => Some(act),
                _ => None,
            };
            if let Some(slot) = slot {
                if let Some(both) = then(*slot, act) {
                    *slot = both;
                    self.report.fused += 1;
                    return Val::D(d.clone());
                }
            }
        }
        Val::D(self.act_op(n, d, act))
    }

    /// A new element-wise operation `act(d)`.
    fn act_op(&mut self, n: &Node, d: &Dyn, act: Act) -> Dyn {
        let cols = (*d.shape.last().unwrap_or(&1)).max(1);
        self.rowwise(n, d, cols, |name, x, y, rows, cols| Op::Unary { name, x, y, rows, cols, act })
    }

    /// A new tensor of `d`'s shape written by the row-wise operation `op`
    /// over rows of `cols` elements.
    fn rowwise(
        &mut self,
        n: &Node,
        d: &Dyn,
        cols: usize,
        op: impl Fn(String, View, View, u32, u32) -> Op,
    ) -> Dyn {
        let rows = elems(&d.shape) / cols.max(1);
        let y = self.act_tensor(&n.name, elems(&d.shape));
        let (x, yv) = (View::dense(d.t, cols as u32), View::dense(y, cols as u32));
        self.g.ops.push(op(n.name.clone(), x, yv, rows as u32, cols as u32));
        Dyn::new(y, d.shape.clone(), Some(self.g.ops.len() - 1), d.nhwc)
    }

    fn softmax(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis"])?;
        let d = self.dense(n, 0)?;
        let rank = d.shape.len();
        let default = if self.m.opset >= 13 { -1 } else { 1 };
        let ax =
            axis(Self::int_attr(n, "axis", default)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        // Before opset 13 the input is seen as 2-D at `axis`; from 13 on
        // the axis alone is normalised. Both are rows x cols when the axis
        // is the last one (or, before 13, when everything after it is).
        let cols = if self.m.opset >= 13 {
            if ax != rank - 1 {
                return Err(unsupported(format!(
                    "softmax over axis {ax} of a rank-{rank} tensor (only the last axis)"
                )));
            }
            d.shape[rank - 1]
        } else {
            elems(&d.shape[ax..])
        };
        Ok(vec![Val::D(self.rowwise(n, &d, cols, |name, x, y, rows, cols| Op::Softmax {
            name,
            x,
            y,
            rows,
            cols,
        }))])
    }
}

fn axis_clamp(a: i64, r: i64) -> usize {
    (if a < 0 { a + r } else { a }).clamp(0, r) as usize
}

fn concat(parts: &[Const], ax: i64) -> Result<Const, Refusal> {
    let first = parts.first().ok_or_else(|| invalid("no inputs"))?;
    let rank = first.shape.len();
    let a = axis(ax, rank).ok_or_else(|| invalid("axis out of range"))?;
    let outer = elems(&first.shape[..a]);
    let mut shape = first.shape.clone();
    shape[a] = 0;
    for p in parts {
        if p.shape.len() != rank || (0..rank).any(|i| i != a && p.shape[i] != first.shape[i]) {
            return Err(invalid("concatenated shapes differ"));
        }
        shape[a] += p.shape[a];
    }
    let ints = parts.iter().all(|p| matches!(p.data, Data::I64(_)));
    let mut f = Vec::new();
    let mut i = Vec::new();
    for o in 0..outer {
        for p in parts {
            let chunk = elems(&p.shape[a..]);
            let r = o * chunk..(o + 1) * chunk;
            if ints {
                i.extend_from_slice(&p.data.to_i64()[r]);
            } else {
                f.extend_from_slice(&p.data.to_f32()[r]);
            }
        }
    }
    Ok(Const { shape, data: if ints { Data::I64(i) } else { Data::F32(f) } })
}

fn gather(data: &Const, idx: &Const, ax: usize) -> Result<Const, Refusal> {
    let outer = elems(&data.shape[..ax]);
    let dim = data.shape[ax];
    let inner = elems(&data.shape[ax + 1..]);
    let ids: Vec<usize> = idx.data.to_i64().iter().map(|&i| index_in(i, dim)).collect::<Result<_, _>>()?;
    let mut shape = data.shape[..ax].to_vec();
    shape.extend_from_slice(&idx.shape);
    shape.extend_from_slice(&data.shape[ax + 1..]);
    check_size(&shape)?;
    fn pick<T: Copy>(v: &[T], outer: usize, dim: usize, inner: usize, ids: &[usize]) -> Vec<T> {
        let mut out = Vec::with_capacity(outer * ids.len() * inner);
        for o in 0..outer {
            for &i in ids {
                out.extend_from_slice(&v[(o * dim + i) * inner..(o * dim + i + 1) * inner]);
            }
        }
        out
    }
    Ok(match &data.data {
        Data::I64(v) => Const { shape, data: Data::I64(pick(v, outer, dim, inner, &ids)) },
        Data::F32(v) => Const { shape, data: Data::F32(pick(v, outer, dim, inner, &ids)) },
    })
}

/// Index `i` of an axis of `dim` (a negative one counts from the end), or
/// the refusal of one outside it.
pub(super) fn index_in(i: i64, dim: usize) -> Result<usize, Refusal> {
    let j = if i < 0 { i.saturating_add(dim as i64) } else { i };
    usize::try_from(j).ok().filter(|&j| j < dim).ok_or_else(|| invalid(format!("index {i} out of range")))
}

/// `GatherElements` of constants: `out[i] = data[i with axis ax replaced
/// by idx[i]]` (`idx` of `data`'s rank).
fn gather_elements_const(data: &Const, idx: &Const, ax: usize) -> Result<Const, Refusal> {
    let at = gather_elements_offsets(&data.shape, idx, ax)?;
    let shape = idx.shape.clone();
    Ok(match &data.data {
        Data::I64(v) => Const { shape, data: Data::I64(at.iter().map(|&o| v[o]).collect()) },
        Data::F32(v) => Const { shape, data: Data::F32(at.iter().map(|&o| v[o]).collect()) },
    })
}

/// The element of data (of shape `dshape`, row-major) each element of a
/// `GatherElements` output reads.
fn gather_elements_offsets(dshape: &[usize], idx: &Const, ax: usize) -> Result<Vec<usize>, Refusal> {
    let data_shape = dshape;
    let rank = data_shape.len();
    if idx.shape.len() != rank {
        return Err(invalid("indices of another rank than the data"));
    }
    check_size(&idx.shape)?;
    let ids = idx.data.to_i64();
    let dstride: Vec<usize> = (0..rank).map(|i| elems(&data_shape[i + 1..])).collect();
    let istride: Vec<usize> = (0..rank).map(|i| elems(&idx.shape[i + 1..])).collect();
    let mut at = Vec::with_capacity(ids.len());
    for (flat, &v) in ids.iter().enumerate() {
        let j = index_in(v, data_shape[ax])?;
        let mut off = 0usize;
        for a in 0..rank {
            let c = if a == ax { j } else { (flat / istride[a]) % idx.shape[a] };
            if c >= data_shape[a] {
                return Err(invalid("indices larger than the data"));
            }
            off += c * dstride[a];
        }
        at.push(off);
    }
    Ok(at)
}

/// `GatherND` of constants with `b` batch axes.
fn gather_nd_const(data: &Const, idx: &Const, b: usize) -> Result<Const, Refusal> {
    let r = *idx.shape.last().ok_or_else(|| invalid("indices of rank 0"))?;
    if b >= idx.shape.len() || b + r > data.shape.len() || data.shape[..b] != idx.shape[..b] {
        return Err(invalid("indices and data do not agree"));
    }
    let batches = elems(&data.shape[..b]);
    let lead = &data.shape[b..b + r];
    let inner = elems(&data.shape[b + r..]);
    let per_batch_data = elems(&data.shape[b..]);
    let tuples = elems(&idx.shape[b..idx.shape.len() - 1]);
    let v = idx.data.to_i64();
    let mut at = Vec::new();
    for bi in 0..batches {
        for t in 0..tuples {
            let tuple = &v[(bi * tuples + t) * r..(bi * tuples + t + 1) * r];
            let mut row = 0usize;
            for (&i, &dim) in tuple.iter().zip(lead) {
                row = row * dim + index_in(i, dim)?;
            }
            at.push(bi * per_batch_data + row * inner);
        }
    }
    let mut shape = idx.shape[..idx.shape.len() - 1].to_vec();
    shape.extend_from_slice(&data.shape[b + r..]);
    check_size(&shape)?;
    fn pick<T: Copy>(v: &[T], at: &[usize], inner: usize) -> Vec<T> {
        at.iter().flat_map(|&o| v[o..o + inner].iter().copied()).collect()
    }
    Ok(match &data.data {
        Data::I64(v) => Const { shape, data: Data::I64(pick(v, &at, inner)) },
        Data::F32(v) => Const { shape, data: Data::F32(pick(v, &at, inner)) },
    })
}

/// A comparison or logical operation of two constants (numpy
/// broadcasting; booleans as 0 and 1): integers compared as integers,
/// anything else as f32 (a NaN compares false).
fn compare_const(op: &str, a: &Const, b: &Const) -> Result<Const, Refusal> {
    let shape = bcast_shape(&a.shape, &b.shape).ok_or_else(|| invalid("shapes do not broadcast"))?;
    check_size(&shape)?;
    let cmp = |o: Option<std::cmp::Ordering>| -> bool {
        use std::cmp::Ordering::{Equal, Greater, Less};
        match op {
            "Equal" => o == Some(Equal),
            "Less" => o == Some(Less),
            "Greater" => o == Some(Greater),
            "LessOrEqual" => matches!(o, Some(Less | Equal)),
            _ => matches!(o, Some(Greater | Equal)),
        }
    };
    let v: Vec<i64> = if let (Data::I64(x), Data::I64(y)) = (&a.data, &b.data) {
        let (x, y) = (expand(x, &a.shape, &shape), expand(y, &b.shape, &shape));
        x.iter()
            .zip(&y)
            .map(|(&p, &q)| match op {
                "And" => i64::from(p != 0 && q != 0),
                "Or" => i64::from(p != 0 || q != 0),
                "Xor" => i64::from((p != 0) != (q != 0)),
                _ => i64::from(cmp(p.partial_cmp(&q))),
            })
            .collect()
    } else {
        if matches!(op, "And" | "Or" | "Xor") {
            return Err(invalid(format!("{op} of non-boolean tensors")));
        }
        let (x, y) = (expand(&a.data.to_f32(), &a.shape, &shape), expand(&b.data.to_f32(), &b.shape, &shape));
        x.iter().zip(&y).map(|(p, q)| i64::from(cmp(p.partial_cmp(q)))).collect()
    };
    Ok(Const { shape, data: Data::I64(v) })
}

/// `Mod` of constants: with `fmod` the remainder of truncated division
/// (C's `fmod`, the sign of `a`), else of floored division (Python's `%`,
/// the sign of `b`; integers only, as ONNX says).
fn mod_const(fmod: bool, a: &Const, b: &Const) -> Result<Const, Refusal> {
    let shape = bcast_shape(&a.shape, &b.shape).ok_or_else(|| invalid("shapes do not broadcast"))?;
    check_size(&shape)?;
    if let (Data::I64(x), Data::I64(y)) = (&a.data, &b.data) {
        let (x, y) = (expand(x, &a.shape, &shape), expand(y, &b.shape, &shape));
        let v = x
            .iter()
            .zip(&y)
            .map(|(&p, &q)| {
                let r = p.checked_rem(q).ok_or_else(|| invalid("integer modulo by zero"))?;
                Ok(if !fmod && r != 0 && (r < 0) != (q < 0) { r + q } else { r })
            })
            .collect::<Result<Vec<_>, Refusal>>()?;
        return Ok(Const { shape, data: Data::I64(v) });
    }
    if !fmod {
        return Err(invalid("Mod of floating-point tensors needs fmod = 1"));
    }
    let (x, y) = (expand(&a.data.to_f32(), &a.shape, &shape), expand(&b.data.to_f32(), &b.shape, &shape));
    Ok(Const { shape, data: Data::F32(x.iter().zip(&y).map(|(p, q)| p % q).collect()) })
}

/// `Where` of constants: `x` where `c` is true, else `y` (numpy
/// broadcasting of all three).
fn where_const(c: &Const, x: &Const, y: &Const) -> Result<Const, Refusal> {
    let shape = bcast_shape(&c.shape, &x.shape)
        .and_then(|s| bcast_shape(&s, &y.shape))
        .ok_or_else(|| invalid("shapes do not broadcast"))?;
    check_size(&shape)?;
    let cond = expand(&c.data.to_i64(), &c.shape, &shape);
    let data = if let (Data::I64(a), Data::I64(b)) = (&x.data, &y.data) {
        let (a, b) = (expand(a, &x.shape, &shape), expand(b, &y.shape, &shape));
        Data::I64(
            cond.iter().zip(a.iter().zip(&b)).map(|(&k, (&p, &q))| if k != 0 { p } else { q }).collect(),
        )
    } else {
        let (a, b) = (expand(&x.data.to_f32(), &x.shape, &shape), expand(&y.data.to_f32(), &y.shape, &shape));
        Data::F32(
            cond.iter().zip(a.iter().zip(&b)).map(|(&k, (&p, &q))| if k != 0 { p } else { q }).collect(),
        )
    };
    Ok(Const { shape, data })
}

fn binary_const(op: &str, a: &Const, b: &Const) -> Result<Const, Refusal> {
    let shape = bcast_shape(&a.shape, &b.shape).ok_or_else(|| invalid("shapes do not broadcast"))?;
    check_size(&shape)?;
    if let (Data::I64(x), Data::I64(y)) = (&a.data, &b.data) {
        let x = expand(x, &a.shape, &shape);
        let y = expand(y, &b.shape, &shape);
        let v = x
            .iter()
            .zip(&y)
            .map(|(&p, &q)| match op {
                "Add" => Ok(p.wrapping_add(q)),
                "Sub" => Ok(p.wrapping_sub(q)),
                "Mul" => Ok(p.wrapping_mul(q)),
                "Div" => p.checked_div(q).ok_or_else(|| invalid("integer division by zero")),
                "Max" => Ok(p.max(q)),
                "Min" => Ok(p.min(q)),
                _ => Ok((p as f64).powf(q as f64) as i64),
            })
            .collect::<Result<Vec<_>, Refusal>>()?;
        return Ok(Const { shape, data: Data::I64(v) });
    }
    let x = expand(&a.data.to_f32(), &a.shape, &shape);
    let y = expand(&b.data.to_f32(), &b.shape, &shape);
    let v = x
        .iter()
        .zip(&y)
        .map(|(&p, &q)| match op {
            "Add" => p + q,
            "Sub" => p - q,
            "Mul" => p * q,
            "Div" => p / q,
            "Max" => p.max(q),
            "Min" => p.min(q),
            _ => p.powf(q),
        })
        .collect();
    Ok(Const { shape, data: Data::F32(v) })
}

/// Static shape of model input `io` under the options.
fn input_shape(io: &crate::load::Io, o: &CompileOptions) -> Result<Vec<usize>, CompileError> {
    let bad = |reason: Refusal| CompileError::Input { name: io.name.clone(), reason };
    if !matches!(io.elem, 1 | 6 | 7) {
        return Err(bad(unsupported(format!(
            "element type {} (float, int32 and int64 inputs are supported)",
            io.elem
        ))));
    }
    if let Some(s) = o.shapes.get(&io.name) {
        if let Some(d) = &io.dims {
            if d.len() != s.len() || d.iter().zip(s).any(|(d, &x)| matches!(d, Dim::Fixed(f) if *f != x)) {
                return Err(bad(invalid(format!("--shape {s:?} contradicts the model's {d:?}"))));
            }
        }
        return Ok(s.clone());
    }
    let dims =
        io.dims.as_ref().ok_or_else(|| bad(unsupported("no shape declared: give one with --shape")))?;
    dims.iter()
        .enumerate()
        .map(|(i, d)| match d {
            Dim::Fixed(x) => Ok(*x),
            Dim::Free(_) if i == 0 => Ok(o.batch as usize),
            Dim::Free(p) => {
                Err(bad(unsupported(format!("dimension {i} (`{p}`) is free: give the shape with --shape"))))
            }
        })
        .collect()
}

/// Compiles ONNX model bytes for a vNPU.
pub fn compile(bytes: &[u8], o: &CompileOptions) -> Result<Compiled, CompileError> {
    let m = load(bytes)?;
    compile_model(&m, o)
}

/// Compiles the ONNX model in file `path` (its external data files, if
/// any, read from beside it).
pub fn compile_file(path: &std::path::Path, o: &CompileOptions) -> Result<Compiled, CompileError> {
    let bytes = std::fs::read(path)
        .map_err(|source| crate::load::LoadError::Read { path: path.display().to_string(), source })?;
    let dir = path.parent().map(|p| if p.as_os_str().is_empty() { std::path::Path::new(".") } else { p });
    let m = crate::load::load_from(&bytes, dir)?;
    compile_model(&m, o)
}

/// Most elements a constant computed at compile time (`ConstantOfShape`,
/// `Range`) may have: a model cannot make the compiler allocate more.
const MAX_FOLDED: usize = 1 << 26;

/// A graph input or output: its name, its tensor and its ONNX shape.
type Io = (String, TensorId, Vec<usize>);

/// Compiles a model already read: the options checked, the graph pruned to
/// what the outputs need, every node translated to the layer-graph IR,
/// lowered, and the model file's two programs and I/O window built and
/// verified.
pub fn compile_model(m: &OnnxModel, o: &CompileOptions) -> Result<Compiled, CompileError> {
    let expanded;
    let m = if crate::ml::has_ml(m) {
        expanded = crate::ml::expand(m);
        &expanded
    } else {
        m
    };
    let out_names = checked_outputs(m, o)?;
    let (nodes, need) = needed_nodes(m, &out_names);
    let mut c = Compiler::new(m, o.batch, &nodes, &out_names);
    let inputs = c.declare_inputs(m, o, &need)?;
    c.translate(m, o, &nodes)?;
    let outputs = c.collect_outputs(&out_names)?;
    c.g.input = inputs[0].1;
    c.g.output = outputs[0].1;
    let keep: Vec<TensorId> = inputs.iter().chain(&outputs).map(|io| io.1).collect();
    let mut report = std::mem::take(&mut c.report);
    if o.fuse_residual {
        let before = c.g.ops.len();
        c.g = npu_lower::fuse_residual_adds_keeping(&c.g, &keep);
        report.fused += before - c.g.ops.len();
    }
    report.macs = c.g.macs();
    report.ops = op_counts(&c.g);
    if o.bf16_activations && o.dtype != DType::Bf16 {
        return Err(CompileError::Activations);
    }
    // Spread programs are lowered for the engines they may spread over.
    let (more_sa, more_vu) = o.spread.unwrap_or((0, 0));
    let streams = VnpuShape {
        sa: o.shape.sa.checked_add(more_sa).ok_or(CompileError::Spread)?,
        vu: o.shape.vu.checked_add(more_vu).ok_or(CompileError::Spread)?,
        ..o.shape
    };
    let options = LowerOptions {
        dtype: o.dtype,
        bf16_activations: o.bf16_activations,
        reuse_hbm: o.reuse_hbm,
        fuse_blocks: o.fuse_blocks,
        ..LowerOptions::default()
    };
    let lowered =
        lower_ops_keeping(&c.g, 0..c.g.ops.len(), streams, options, &keep).map_err(CompileError::Fit)?;
    report.hbm_bytes = lowered.hbm_bytes;
    report.blocks = lowered.blocks;
    check_transfers(&inputs, &outputs)?;
    // The weight image is laid out for its offset in the file
    // (`weight_layout`), which the layout itself does not move (the
    // lengths before it do not depend on it): a first layout finds it.
    let place = |phase: u64| {
        let (load, at, len) = weight_layout(&c.data, &lowered, phase);
        let mut window = len.next_multiple_of(WINDOW_ALIGN);
        let mut ins = place_in_window(&inputs, &mut window);
        let mut outs = place_in_window(&outputs, &mut window);
        // Integer inputs (token ids) and outputs (ArgMax's indices) travel as
        // i32; the runner converts.
        for (descs, ios) in [(&mut ins, &m.inputs), (&mut outs, &m.outputs)] {
            for (d, _) in descs.iter_mut() {
                d.elem = match ios.iter().find(|i| i.name == d.name).map(|i| i.elem) {
                    Some(7) => ElemType::I64,
                    Some(6) => ElemType::I32,
                    _ => ElemType::F32,
                };
            }
        }
        let infer = infer_program(&lowered, &ins, &outs);
        (load, at, len, window, ins, outs, infer)
    };
    let first = place(0);
    let descs = first.4.iter().chain(&first.5).map(|(d, _)| d);
    let phase = vnpu_abi::compiled_model::weights_offset(descs, &first.0, &first.6) as u64 % PAGE;
    let (mut load, at, len, window, ins, outs, mut infer) = if phase == 0 { first } else { place(phase) };
    let weights = weight_bytes(&c.data, &lowered, &at, len);
    report.weight_bytes = weights.len() as u64;
    load.spread = o.spread.is_some();
    infer.spread = o.spread.is_some();
    let shape = o.shape;
    let limits = VnpuLimits {
        sa: shape.sa,
        vu: shape.vu,
        sram_bytes: shape.sram_bytes,
        hbm_bytes: shape.hbm_bytes,
        guest: std::iter::once(0..window).collect(),
        borrow_sa: more_sa,
        borrow_vu: more_vu,
    };
    verify(&load, &limits).map_err(|source| CompileError::Verify { which: "load", source })?;
    verify(&infer, &limits).map_err(|source| CompileError::Verify { which: "infer", source })?;
    report.load_instructions = load.instruction_count();
    report.infer_instructions = infer.instruction_count();
    let batch = inputs[0].2.first().copied().unwrap_or(1).max(1) as u32;
    let model = Model {
        target: Target {
            batch,
            sa: shape.sa,
            vu: shape.vu,
            sram_bytes: shape.sram_bytes,
            hbm_bytes: shape.hbm_bytes,
            sa_dtype: o.dtype,
        },
        window_bytes: window,
        inputs: ins.into_iter().map(|(d, _)| d).collect(),
        outputs: outs.into_iter().map(|(d, _)| d).collect(),
        load,
        infer,
        weights,
    };
    Ok(Compiled { model, report })
}

/// The outputs to compile (`--output`, else the model's), after checking
/// that every `--shape` names an input and every `--output` is produced.
fn checked_outputs(m: &OnnxModel, o: &CompileOptions) -> Result<Vec<String>, CompileError> {
    for k in o.shapes.keys() {
        if !m.inputs.iter().any(|i| &i.name == k) {
            return Err(CompileError::Input {
                name: k.clone(),
                reason: invalid("--shape names no input of the model"),
            });
        }
    }
    Ok(match &o.outputs {
        Some(v) => {
            for name in v {
                if !m.outputs.iter().any(|x| &x.name == name)
                    && !m.nodes.iter().any(|n| n.outputs.contains(name))
                {
                    return Err(CompileError::Output {
                        name: name.clone(),
                        reason: invalid("no node produces it"),
                    });
                }
            }
            v.clone()
        }
        None => m.outputs.iter().map(|x| x.name.clone()).collect(),
    })
}

/// The nodes the outputs need, in model order, and every value they read.
fn needed_nodes<'m>(m: &'m OnnxModel, out_names: &[String]) -> (Vec<&'m Node>, HashSet<String>) {
    let mut need: HashSet<String> = out_names.iter().cloned().collect();
    let mut keep = vec![false; m.nodes.len()];
    for (i, n) in m.nodes.iter().enumerate().rev() {
        if n.outputs.iter().any(|x| need.contains(x)) {
            keep[i] = true;
            need.extend(n.inputs.iter().filter(|s| !s.is_empty()).cloned());
        }
    }
    let nodes = m.nodes.iter().zip(&keep).filter(|(_, k)| **k).map(|(n, _)| n).collect();
    (nodes, need)
}

/// How many operations of each kind the graph has, in order of first use.
fn op_counts(g: &Graph) -> Vec<(String, usize)> {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for op in &g.ops {
        let k = op.kind().to_string();
        match kinds.iter_mut().find(|(n, _)| *n == k) {
            Some(e) => e.1 += 1,
            None => kinds.push((k, 1)),
        }
    }
    kinds
}

/// Alignment of everything in the I/O window.
const WINDOW_ALIGN: u64 = 64;

/// Page size of the hosts that map model files.
const PAGE: u64 = 4096;

/// Weight tensors at least this long are placed in the image at the page
/// phase of their place in HBM (`weight_image`).
const MAP_MIN: u64 = 1 << 20;

/// Where each weight tensor goes in the weight image (in its stored
/// type, aligned), the image's length, and the `load` program that copies
/// the image from the I/O window into HBM ([`weight_bytes`] fills it).
///
/// `phase` is the image's offset in the model file modulo the page size.
/// A tensor of at least [`MAP_MIN`] bytes starts at an offset whose place
/// in the file has the page phase of its place in HBM (at most a page of
/// padding before it): where the VMM mapped the file into guest RAM, the
/// load program's DMA can then map the file's pages into HBM chunks
/// instead of copying them (`npu_model::memory::Memory::map_file`). The
/// programs' lengths, the weights and every cycle are the same either way.
fn weight_layout(
    data: &[Option<Vec<f32>>],
    lowered: &npu_lower::Lowered,
    phase: u64,
) -> (vnpu_abi::Program, Vec<(usize, u64)>, u64) {
    let mut load = ProgramBuilder::new();
    let mut places = Vec::new();
    let mut len = 0u64;
    for (t, d) in data.iter().enumerate() {
        let Some(d) = d else { continue };
        let bytes = d.len() as u64 * lowered.tensors[t].dtype.size();
        let mut at = len.next_multiple_of(WINDOW_ALIGN);
        if bytes >= MAP_MIN {
            // (phase + at) % PAGE == hbm % PAGE, at the least such `at`.
            let want = (lowered.tensors[t].offset % PAGE + 2 * PAGE - phase % PAGE - at % PAGE) % PAGE;
            at += want;
        }
        places.push((t, at));
        len = at + bytes;
        let mut done = 0u64;
        while done < bytes {
            let chunk = (bytes - done).min(1 << 30);
            load.push(
                Engine::DMA,
                Instr::copy(
                    Addr::guest(at + done),
                    Addr::hbm(lowered.tensors[t].offset + done),
                    chunk as u32,
                ),
            );
            done += chunk;
        }
    }
    load.push(Engine::DMA, Instr::Halt);
    (load.finish(), places, len)
}

/// The weight image of `len` bytes, each tensor at its place from
/// [`weight_layout`], zeros between.
fn weight_bytes(
    data: &[Option<Vec<f32>>],
    lowered: &npu_lower::Lowered,
    places: &[(usize, u64)],
    len: u64,
) -> Vec<u8> {
    let mut weights: Vec<u8> = Vec::with_capacity(len as usize);
    for &(t, at) in places {
        let Some(d) = &data[t] else { continue };
        weights.resize(at as usize, 0);
        match lowered.tensors[t].dtype {
            DType::F32 => weights.extend(d.iter().flat_map(|x| x.to_le_bytes())),
            // Rounded to nearest, ties to even (as `vu.convert` rounds).
            DType::Bf16 => weights.extend(d.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())),
        }
    }
    weights
}

/// One DMA transfer moves an input or output: at most 4 GiB per batch.
fn check_transfers(inputs: &[Io], outputs: &[Io]) -> Result<(), CompileError> {
    for (i, (name, _, s)) in inputs.iter().chain(outputs).enumerate() {
        let need = elems(s) as u64 * 4;
        if need > u64::from(u32::MAX) {
            let reason =
                unsupported(format!("{need} bytes per batch; one transfer moves at most {} bytes", u32::MAX));
            return Err(if i < inputs.len() {
                CompileError::Input { name: name.clone(), reason }
            } else {
                CompileError::Output { name: name.clone(), reason }
            });
        }
    }
    Ok(())
}

/// Places `list` in the I/O window from `*window` on (f32, aligned).
fn place_in_window(list: &[Io], window: &mut u64) -> Vec<(TensorDesc, TensorId)> {
    list.iter()
        .map(|(name, t, shape)| {
            let d = TensorDesc {
                name: name.clone(),
                elem: ElemType::F32,
                dims: shape.iter().map(|&x| x as u64).collect(),
                offset: *window,
            };
            *window = (*window + elems(shape) as u64 * 4).next_multiple_of(WINDOW_ALIGN);
            (d, *t)
        })
        .collect()
}

/// The `infer` program: the lowered graph with the inputs copied in
/// before its first load and the outputs out after its last store (the
/// DMA stream is in order).
fn infer_program(
    lowered: &npu_lower::Lowered,
    ins: &[(TensorDesc, TensorId)],
    outs: &[(TensorDesc, TensorId)],
) -> vnpu_abi::Program {
    let mut infer = lowered.program.clone();
    let dma = match infer.streams.iter().position(|s| s.engine == Engine::DMA) {
        Some(i) => i,
        None => {
            infer.streams.insert(0, vnpu_abi::Stream { engine: Engine::DMA, code: vec![Instr::Halt] });
            0
        }
    };
    let at = |t: TensorId| Addr::hbm(lowered.tensors[t].offset);
    let bytes = |d: &TensorDesc| d.bytes().unwrap_or(0) as u32;
    let body = std::mem::take(&mut infer.streams[dma].code);
    let body = body.strip_suffix(&[Instr::Halt]).unwrap_or(&body);
    let code = &mut infer.streams[dma].code;
    code.extend(ins.iter().map(|(d, t)| Instr::copy(Addr::guest(d.offset), at(*t), bytes(d))));
    code.extend_from_slice(body);
    code.extend(outs.iter().map(|(d, t)| Instr::copy(at(*t), Addr::guest(d.offset), bytes(d))));
    code.push(Instr::Halt);
    infer
}

impl<'m> Compiler<'m> {
    /// A compiler for `nodes` of `m`, with the model's constants known
    /// and every value's readers counted.
    fn new(m: &'m OnnxModel, batch: u32, nodes: &[&Node], out_names: &[String]) -> Self {
        let mut c = Compiler {
            m,
            g: Graph::new("onnx", batch),
            data: Vec::new(),
            vals: HashMap::new(),
            uses: HashMap::new(),
            outputs: out_names.iter().cloned().collect(),
            report: CompileReport { nodes: nodes.len(), ..Default::default() },
        };
        for n in nodes {
            for i in n.inputs.iter().filter(|s| !s.is_empty()) {
                *c.uses.entry(i.clone()).or_default() += 1;
            }
        }
        for (k, v) in &m.constants {
            c.vals.insert(k.clone(), Val::C(v.clone()));
        }
        c
    }

    /// A tensor for every model input the outputs need, with its shape.
    fn declare_inputs(
        &mut self,
        m: &OnnxModel,
        o: &CompileOptions,
        need: &HashSet<String>,
    ) -> Result<Vec<Io>, CompileError> {
        let mut inputs = Vec::new();
        for io in m.inputs.iter().filter(|i| need.contains(&i.name)) {
            let shape = input_shape(io, o)?;
            if elems(&shape) == 0 {
                return Err(CompileError::Input {
                    name: io.name.clone(),
                    reason: unsupported("has no elements (empty tensors are not supported)"),
                });
            }
            check_size(&shape).map_err(|reason| CompileError::Input { name: io.name.clone(), reason })?;
            if shape.is_empty() {
                return Err(CompileError::Input {
                    name: io.name.clone(),
                    reason: unsupported("is a scalar (rank 0): a model's inputs need at least one axis"),
                });
            }
            let t = self.tensor(&io.name, elems(&shape), Init::Input, None);
            let d = Dyn::new(t, shape.clone(), None, false);
            // Integers (token ids, indices) are i32 on the device.
            self.vals.insert(io.name.clone(), if io.elem == 1 { Val::D(d) } else { Val::I(d) });
            inputs.push((io.name.clone(), t, shape));
        }
        if inputs.is_empty() {
            return Err(CompileError::Input {
                name: String::new(),
                reason: unsupported("the outputs need no model input"),
            });
        }
        Ok(inputs)
    }

    /// Every node in order: constants folded, the rest added to the graph.
    fn translate(&mut self, m: &OnnxModel, o: &CompileOptions, nodes: &[&Node]) -> Result<(), CompileError> {
        for n in nodes {
            let outs = self.node(n).map_err(|mut reason| {
                if o.outputs.is_none() && m.outputs.len() > 1 {
                    let names: Vec<&str> = m.outputs.iter().map(|x| x.name.as_str()).collect();
                    reason = reason.with_hint(&format!(
                        "; to leave it out, compile only the outputs that do not need it (--output NAME; this \
                         model's outputs: {})",
                        names.join(", ")
                    ));
                }
                CompileError::Node { node: n.name.clone(), op: n.op.clone(), reason }
            })?;
            for (name, v) in n.outputs.iter().zip(outs) {
                if let Val::D(d) | Val::I(d) = &v {
                    check_size(&d.shape).map_err(|reason| CompileError::Node {
                        node: n.name.clone(),
                        op: n.op.clone(),
                        reason,
                    })?;
                }
                if !name.is_empty() {
                    self.vals.insert(name.clone(), v);
                }
            }
        }
        Ok(())
    }

    /// The outputs' tensors, in ONNX's element order.
    fn collect_outputs(&mut self, out_names: &[String]) -> Result<Vec<Io>, CompileError> {
        let mut outputs = Vec::new();
        for name in out_names {
            // A boolean output would be written as f32 (booleans are 0.0
            // and 1.0 on the device): refused, not mislabelled. An integer
            // output must be an integer tensor on the device (i32 bits).
            let elem = self.m.outputs.iter().find(|o| &o.name == name).map_or(1, |o| o.elem);
            let int_out = matches!(elem, 6 | 7);
            let refuse = |why: String| CompileError::Output { name: name.clone(), reason: unsupported(why) };
            if !matches!(elem, 0 | 1 | 6 | 7) {
                return Err(refuse(format!(
                    "is of element type {elem} (float, int32 and int64 outputs are written; boolean ones \
                     are not supported yet)"
                )));
            }
            match self.vals.get(name).cloned() {
                Some(Val::D(_)) if int_out => {
                    return Err(refuse(format!(
                        "is declared of integer type {elem} but computed as a float tensor here"
                    )))
                }
                Some(Val::I(d)) if int_out => {
                    if d.shape.is_empty() {
                        return Err(refuse(
                            "is a scalar (rank 0): a model's outputs need at least one axis".into(),
                        ));
                    }
                    outputs.push((name.clone(), d.t, d.shape.clone()))
                }
                Some(Val::D(d)) => {
                    let d = self
                        .onnx_order(name, &d)
                        .map_err(|reason| CompileError::Output { name: name.clone(), reason })?;
                    if d.shape.is_empty() {
                        return Err(CompileError::Output {
                            name: name.clone(),
                            reason: unsupported(
                                "is a scalar (rank 0): a model's outputs need at least one axis \
                                 (e.g. ReduceMean with keepdims=1)",
                            ),
                        });
                    }
                    outputs.push((name.clone(), d.t, d.shape.clone()))
                }
                Some(Val::C(_)) => {
                    return Err(CompileError::Output {
                        name: name.clone(),
                        reason: unsupported("is a constant (it does not depend on the input)"),
                    })
                }
                Some(Val::I(_)) => {
                    return Err(refuse("is an integer tensor on the device but declared float".into()))
                }
                None => {
                    return Err(CompileError::Output {
                        name: name.clone(),
                        reason: invalid("is never computed"),
                    })
                }
            }
        }
        Ok(outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Comparisons, `Where` and `Mod` folded as numpy computes them
    /// (hand-checked values; `Mod` without `fmod` takes the divisor's
    /// sign, with it the dividend's).
    #[test]
    fn comparisons_where_and_mod_fold_as_numpy() {
        let i = |shape: Vec<usize>, v: Vec<i64>| Const { shape, data: Data::I64(v) };
        let f = |shape: Vec<usize>, v: Vec<f32>| Const { shape, data: Data::F32(v) };
        let a = i(vec![2, 2], vec![1, 5, 3, 7]);
        let b = i(vec![2], vec![3, 5]);
        assert_eq!(compare_const("Less", &a, &b).unwrap().data, Data::I64(vec![1, 0, 0, 0]));
        assert_eq!(compare_const("Equal", &a, &b).unwrap().data, Data::I64(vec![0, 1, 1, 0]));
        assert_eq!(compare_const("GreaterOrEqual", &a, &b).unwrap().data, Data::I64(vec![0, 1, 1, 1]));
        let nan = f(vec![2], vec![f32::NAN, 1.0]);
        assert_eq!(compare_const("Equal", &nan, &nan).unwrap().data, Data::I64(vec![0, 1]));
        let t = i(vec![2], vec![1, 0]);
        assert_eq!(compare_const("Xor", &t, &i(vec![1], vec![1])).unwrap().data, Data::I64(vec![0, 1]));
        let w = where_const(&i(vec![2, 1], vec![1, 0]), &f(vec![2], vec![1.0, 2.0]), &f(vec![], vec![-1.0]));
        assert_eq!(w.unwrap().data, Data::F32(vec![1.0, 2.0, -1.0, -1.0]));
        let (x, y) = (i(vec![4], vec![-7, 7, -7, 7]), i(vec![4], vec![3, -3, -3, 3]));
        assert_eq!(mod_const(false, &x, &y).unwrap().data, Data::I64(vec![2, -2, -1, 1]));
        assert_eq!(mod_const(true, &x, &y).unwrap().data, Data::I64(vec![-1, 1, -1, 1]));
        assert!(mod_const(false, &f(vec![1], vec![1.0]), &f(vec![1], vec![2.0])).is_err());
        let m = mod_const(true, &f(vec![2], vec![-7.5, 7.5]), &f(vec![1], vec![2.0])).unwrap();
        assert_eq!(m.data, Data::F32(vec![-1.5, 1.5]));
    }

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(bcast_shape(&[4, 3], &[3]), Some(vec![4, 3]));
        assert_eq!(bcast_shape(&[4, 1], &[1, 3]), Some(vec![4, 3]));
        assert_eq!(bcast_shape(&[4, 2], &[3]), None);
        assert_eq!(expand(&[1.0, 2.0], &[2], &[2, 2]), vec![1.0, 2.0, 1.0, 2.0]);
        assert_eq!(expand(&[1.0, 2.0], &[2, 1], &[2, 2]), vec![1.0, 1.0, 2.0, 2.0]);
    }
}
