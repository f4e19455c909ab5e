//! Operators of the `ai.onnx.ml` domain, as skl2onnx exports scikit-learn
//! models, expanded into default-domain nodes before compiling
//! (`docs/compiled-model-format.md`, "scikit-learn models").
//!
//! Each operator becomes a small graph of operators the compiler already
//! lowers, with constants computed here from its attributes, so that the
//! device runs one engine whatever the model's origin:
//! - linear models: one `Gemm`; the label an `ArgMax` (or a comparison of
//!   the one score) looked up in the class labels;
//! - kernel SVMs: the kernel against the support vectors (RBF as the
//!   broadcast squared differences, summed), one product by a matrix that
//!   holds every pair's dual coefficients, the votes as a second product
//!   of the pairs' signs;
//! - tree ensembles as matrix products (the GEMM strategy of Hummingbird,
//!   Nakandala et al., OSDI 2020): per chunk of trees, the branch features
//!   gathered and compared with the thresholds (0/1), a product by the
//!   path matrix (+1 where a leaf lies below a branch's true side, -1
//!   below its false side), equal to the count of true sides on each
//!   leaf's path exactly where that leaf is reached, and a product of that
//!   indicator by the leaves' weights;
//! - `Scaler`, `Normalizer`, `Binarizer`, `Imputer`, `LabelEncoder`,
//!   `OneHotEncoder`, `ArrayFeatureExtractor` as element-wise operations,
//!   reductions, comparisons and gathers;
//! - `ZipMap` as its tensor: the probabilities, one column per key.
//!
//! The semantics are ONNX Runtime's (its CPU kernels, the reference the
//! tests compare with), including its binary-classifier conventions.
//! What cannot be computed on the device (string tensors, maps, the
//! pairwise coupling of `SVC(probability=True)`, the probit transform) is
//! refused with a reason, and only when an output that needs it is
//! compiled: a refused label does not stop a model whose probabilities
//! alone are compiled.

use std::collections::{HashMap, HashSet};

use crate::load::{Attr, Const, Data, Node, OnnxModel};
use crate::refusal::{invalid, unsupported, Refusal};

/// The domain of the operators this module expands.
pub const DOMAIN: &str = "ai.onnx.ml";

/// The domain of a placeholder node that stands for an output this module
/// refused: the compiler reports its `reason` attribute when an output
/// needs it.
pub(crate) const REFUSED_DOMAIN: &str = "vnpu.refused";

/// Most nodes of all the trees of one ensemble.
const MAX_TREE_NODES: usize = 1 << 20;
/// Most branches and leaves the trees of one chunk (one path matrix)
/// gather, unless one tree alone has more. Measured on the forest of 100
/// trees over wine and the boosted regressor at batch 1, in-process: 256
/// gives 79 and 41 us per request; 64 gives 119 and 64 (more, smaller
/// operations), 512 gives 126 and 58 (more dense zeros moved).
const CHUNK: usize = 256;
/// Most entries of one chunk's path matrix (branches times leaves).
const MAX_PATH_ELEMS: usize = 1 << 24;
/// Most support vectors times features of an SVM (and support vectors
/// times class pairs, pairs times classes).
const MAX_SVM_ELEMS: usize = 1 << 24;

/// One `ai.onnx.ml` operator the compiler takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlOperator {
    /// ONNX name.
    pub op: &'static str,
    /// How it is compiled, and what is refused.
    pub notes: &'static str,
}

const fn op(op: &'static str, notes: &'static str) -> MlOperator {
    MlOperator { op, notes }
}

/// Every `ai.onnx.ml` operator the compiler takes, alphabetically
/// (`docs/compiled-model-format.md` lists them).
pub const ML_OPERATORS: &[MlOperator] = &[
    op("ArrayFeatureExtractor", "`Gather` along the last axis: of a computed tensor by constant indices, or of a constant (class labels) by computed indices"),
    op("Binarizer", "`x > threshold` as 0/1; no threshold: 1.0, as ONNX Runtime (the schema says 0.0); a NaN gives 0 (ONNX Runtime fails the request)"),
    op("Imputer", "`Where(IsNaN(x), imputed, x)` (or `x == replaced_value_float`); per feature or one value"),
    op("LabelEncoder", "int64 and float keys and values (opset 1-4 attributes and tensors): one comparison per key and a product; a key not found gives the default; strings refused"),
    op("LinearClassifier", "`Gemm`; label by `ArgMax` (one score: `score > 0`); `post_transform` NONE, LOGISTIC, SOFTMAX, SOFTMAX_ZERO (PROBIT refused); string labels refused"),
    op("LinearRegressor", "`Gemm`; `post_transform` NONE"),
    op("Normalizer", "MAX, L1, L2 per row; a row whose norm is 0 is left as it is, as ONNX Runtime does"),
    op("OneHotEncoder", "int64 categories: one comparison per category; an unknown category gives zeros (ONNX Runtime fails the request when `zeros` is 0); string categories refused"),
    op("SVMClassifier", "LINEAR, POLY, RBF, SIGMOID kernels over the support vectors; one product for every pair's decision value, a second for the votes; label the first class of most votes; the probabilities of `prob_a`/`prob_b` (SVC(probability=True)) refused, its label compiled; the liblinear mode (no support vectors) refused"),
    op("SVMRegressor", "the kernels of SVMClassifier, `one_class`; linear mode too"),
    op("Scaler", "`(x - offset) * scale`"),
    op("TreeEnsemble", "opset 5: as TreeEnsembleRegressor, from `tree_roots`, `nodes_*` and `leaf_*`; BRANCH_MEMBER refused; aggregate SUM or AVERAGE"),
    op("TreeEnsembleClassifier", "as matrix products (path matrices per chunk of trees); every branch mode, `missing_value_tracks_true`, `base_values`; ONNX Runtime's binary conventions; `*_as_tensor` (double) attributes refused"),
    op("TreeEnsembleRegressor", "as TreeEnsembleClassifier; aggregate SUM or AVERAGE (MIN and MAX refused)"),
    op("ZipMap", "emitted as its tensor: the `[N, classes]` probabilities, column k for the k-th key (skl2onnx's `zipmap=False` gives the same tensor)"),
];

/// Whether the compiler takes `ai.onnx.ml` operator `op`.
pub fn listed(op: &str) -> bool {
    ML_OPERATORS.binary_search_by(|o| o.op.cmp(op)).is_ok()
}

/// The markdown table of [`ML_OPERATORS`].
pub fn table() -> String {
    let mut s = String::from("| operator | how it is compiled, and limits |\n| --- | --- |\n");
    for o in ML_OPERATORS {
        s.push_str(&format!("| `{}` | {} |\n", o.op, o.notes));
    }
    s
}

/// Whether `m` has a node of the `ai.onnx.ml` domain.
pub fn has_ml(m: &OnnxModel) -> bool {
    m.nodes.iter().any(|n| n.domain == DOMAIN)
}

/// `m` with every `ai.onnx.ml` node replaced by default-domain nodes and
/// the constants they need (one that cannot be, by a placeholder the
/// compiler refuses with the reason when an output needs it).
pub fn expand(m: &OnnxModel) -> OnnxModel {
    let mut names: HashSet<String> = m.constants.keys().cloned().collect();
    for n in &m.nodes {
        names.extend(n.inputs.iter().chain(&n.outputs).cloned());
    }
    names.extend(m.inputs.iter().chain(&m.outputs).map(|i| i.name.clone()));
    let mut out = m.clone();
    out.nodes.clear();
    let mut ex = Ex {
        opset: m.opset,
        base: String::new(),
        op: String::new(),
        nodes: Vec::new(),
        consts: HashMap::new(),
        names,
    };
    for n in &m.nodes {
        if n.domain != DOMAIN {
            out.nodes.push(n.clone());
            continue;
        }
        ex.base = n.name.clone();
        ex.op = n.op.clone();
        let done = if listed(&n.op) {
            ex.node(n)
        } else {
            Err(unsupported(format!(
                "operator `{}` of domain ai.onnx.ml is not supported (docs/compiled-model-format.md lists what is)",
                n.op
            )))
        };
        // A node that cannot be expanded stands as a placeholder for its
        // outputs: refused, with its reason, only if an output compiled
        // needs it (as the compiler refuses a default-domain node).
        if let Err(reason) = done {
            ex.nodes.clear();
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                ex.refuse_output(o, &reason.to_string());
            }
        }
        out.nodes.append(&mut ex.nodes);
    }
    out.constants.extend(ex.consts);
    out
}

/// The expansion of one node: fresh names, constants, nodes.
struct Ex {
    opset: i64,
    /// The node expanded: its name and op type.
    base: String,
    op: String,
    nodes: Vec<Node>,
    consts: HashMap<String, Const>,
    names: HashSet<String>,
}

type R<T> = Result<T, Refusal>;

/// A branch's comparison, as ONNX Runtime evaluates it (`x` the feature,
/// `v` the threshold; true goes to the true child).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Mode {
    Leq,
    Lt,
    Gte,
    Gt,
    Eq,
    Neq,
}

impl Mode {
    fn parse(s: &str) -> R<Option<Mode>> {
        Ok(Some(match s {
            "BRANCH_LEQ" => Mode::Leq,
            "BRANCH_LT" => Mode::Lt,
            "BRANCH_GTE" => Mode::Gte,
            "BRANCH_GT" => Mode::Gt,
            "BRANCH_EQ" => Mode::Eq,
            "BRANCH_NEQ" => Mode::Neq,
            "LEAF" => return Ok(None),
            "BRANCH_MEMBER" => {
                return Err(unsupported("BRANCH_MEMBER (set membership) branches are not supported"))
            }
            other => return Err(invalid(format!("unknown node mode `{other}`"))),
        }))
    }
}

/// One tree, walked from its root: its branches and, for each leaf, the
/// branches on its path (with the side taken) and its weights.
#[derive(Default)]
struct Tree {
    branches: Vec<Branch>,
    leaves: Vec<Leaf>,
}

struct Branch {
    feature: i64,
    value: f32,
    mode: Mode,
    missing_true: bool,
}

struct Leaf {
    path: Vec<(usize, bool)>,
    weights: Vec<(usize, f32)>,
}

/// How a classifier turns its scores into probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Post {
    None,
    Logistic,
    Softmax,
    SoftmaxZero,
}

impl Post {
    fn parse(s: &str) -> R<Post> {
        Ok(match s {
            "NONE" => Post::None,
            "LOGISTIC" => Post::Logistic,
            "SOFTMAX" => Post::Softmax,
            "SOFTMAX_ZERO" => Post::SoftmaxZero,
            "PROBIT" => {
                return Err(unsupported("post_transform PROBIT (an inverse error function) is not supported"))
            }
            other => return Err(invalid(format!("unknown post_transform `{other}`"))),
        })
    }
}

fn attr_ints(n: &Node, k: &str) -> R<Option<Vec<i64>>> {
    match n.attrs.get(k) {
        None => Ok(None),
        Some(Attr::Ints(v)) => Ok(Some(v.clone())),
        Some(Attr::Int(v)) => Ok(Some(vec![*v])),
        Some(Attr::Tensor(c)) => Ok(Some(c.data.to_i64())),
        Some(_) => Err(invalid(format!("attribute `{k}` must be integers"))),
    }
}

fn attr_floats(n: &Node, k: &str) -> R<Option<Vec<f32>>> {
    match n.attrs.get(k) {
        None => Ok(None),
        Some(Attr::Floats(v)) => Ok(Some(v.clone())),
        Some(Attr::Float(v)) => Ok(Some(vec![*v])),
        Some(Attr::Tensor(c)) => Ok(Some(c.data.to_f32())),
        Some(_) => Err(invalid(format!("attribute `{k}` must be floats"))),
    }
}

fn attr_strings(n: &Node, k: &str) -> R<Option<Vec<String>>> {
    match n.attrs.get(k) {
        None => Ok(None),
        Some(Attr::Strings(v)) => Ok(Some(v.clone())),
        Some(Attr::Str(v)) => Ok(Some(vec![v.clone()])),
        Some(_) => Err(invalid(format!("attribute `{k}` must be strings"))),
    }
}

fn attr_string(n: &Node, k: &str, default: &str) -> R<String> {
    match n.attrs.get(k) {
        None => Ok(default.to_string()),
        Some(Attr::Str(v)) => Ok(v.clone()),
        Some(_) => Err(invalid(format!("attribute `{k}` must be a string"))),
    }
}

fn attr_int(n: &Node, k: &str, default: i64) -> R<i64> {
    match n.attrs.get(k) {
        None => Ok(default),
        Some(Attr::Int(v)) => Ok(*v),
        Some(_) => Err(invalid(format!("attribute `{k}` must be an integer"))),
    }
}

/// Refuses any attribute of `n` in `refused` (with its reason).
fn refuse_attrs(n: &Node, refused: &[(&str, &str)]) -> R<()> {
    for (k, why) in refused {
        if n.attrs.contains_key(*k) {
            return Err(unsupported(format!("attribute `{k}`: {why}")));
        }
    }
    Ok(())
}

const DOUBLE_ATTRS: &str =
    "double-precision attributes (models exported for double inputs) are not supported";

/// The class labels of a classifier: integers, or the reason string labels
/// are refused.
fn class_labels(n: &Node, ints: &str, strings: &str) -> R<Result<Vec<i64>, String>> {
    if let Some(v) = attr_ints(n, ints)? {
        return Ok(Ok(v));
    }
    if let Some(v) = attr_strings(n, strings)? {
        return Ok(Err(format!(
            "string class labels ({} of them) cannot be computed on the device: compile the probabilities \
             output only (--output NAME), or train on integer labels",
            v.len()
        )));
    }
    Err(invalid(format!("neither `{ints}` nor `{strings}` is given")))
}

/// Output `i` of `n`, if the model names one.
fn output(n: &Node, i: usize) -> Option<String> {
    n.outputs.get(i).filter(|o| !o.is_empty()).cloned()
}

/// Refuses a regressor's `post_transform` other than NONE.
fn no_post(post: &str) -> R<()> {
    if post != "NONE" {
        return Err(unsupported(format!("post_transform {post} of a regressor is not supported")));
    }
    Ok(())
}

/// `v` as a `usize`, or a refusal naming `what`.
fn index(v: i64, what: &str) -> R<usize> {
    usize::try_from(v).map_err(|_| invalid(format!("{what} {v} is negative")))
}

impl Ex {
    fn fresh(&mut self, what: &str) -> String {
        let mut i = self.names.len();
        loop {
            let name = format!("{}/ml.{what}.{i}", self.base);
            if self.names.insert(name.clone()) {
                return name;
            }
            i += 1;
        }
    }

    fn konst(&mut self, what: &str, shape: Vec<usize>, data: Data) -> String {
        let name = self.fresh(what);
        self.consts.insert(name.clone(), Const { shape, data });
        name
    }

    fn f32s(&mut self, what: &str, shape: Vec<usize>, v: Vec<f32>) -> String {
        self.konst(what, shape, Data::F32(v))
    }

    fn i64s(&mut self, what: &str, shape: Vec<usize>, v: Vec<i64>) -> String {
        self.konst(what, shape, Data::I64(v))
    }

    fn scalar(&mut self, v: f32) -> String {
        self.f32s("c", vec![], vec![v])
    }

    /// A default-domain node writing `out`.
    fn emit_to(&mut self, op: &str, inputs: &[&str], attrs: Vec<(&str, Attr)>, out: &str) {
        self.nodes.push(Node {
            name: format!("{}/ml.{op}.{}", self.base, self.nodes.len()),
            op: op.to_string(),
            domain: String::new(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: vec![out.to_string()],
            attrs: attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        });
    }

    /// A default-domain node with one fresh output, returned.
    fn emit(&mut self, op: &str, inputs: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        let out = self.fresh(op);
        self.emit_to(op, inputs, attrs, &out);
        out
    }

    /// `x` under a new name `out` (an `Identity`).
    fn alias(&mut self, x: &str, out: &str) {
        self.emit_to("Identity", &[x], vec![], out);
    }

    /// A placeholder for output `out`, refused with `reason` if compiled.
    fn refuse_output(&mut self, out: &str, reason: &str) {
        self.nodes.push(Node {
            name: self.base.clone(),
            op: self.op.clone(),
            domain: REFUSED_DOMAIN.into(),
            inputs: vec![],
            outputs: vec![out.to_string()],
            attrs: HashMap::from([("reason".to_string(), Attr::Str(reason.to_string()))]),
        });
    }

    /// `op` (a reduction, `Squeeze` or `Unsqueeze`) of `x` over `axis`,
    /// with `attrs`: the axes as an input from the opset that made them
    /// one (13 for ReduceSum, Squeeze and Unsqueeze, 18 for the other
    /// reductions), as an attribute before.
    fn on_axis(&mut self, op: &str, x: &str, axis: i64, mut attrs: Vec<(&str, Attr)>) -> String {
        let since = if matches!(op, "ReduceSum" | "Squeeze" | "Unsqueeze") { 13 } else { 18 };
        if self.opset >= since {
            let axes = self.i64s("axes", vec![1], vec![axis]);
            self.emit(op, &[x, &axes], attrs)
        } else {
            attrs.push(("axes", Attr::Ints(vec![axis])));
            self.emit(op, &[x], attrs)
        }
    }

    /// A reduction of `x` over `axis`, kept as a dimension of 1.
    fn reduce_kept(&mut self, op: &str, x: &str, axis: i64) -> String {
        self.on_axis(op, x, axis, vec![("keepdims", Attr::Int(1))])
    }

    /// `[lo, hi]` side by side as output `out` (a binary classifier's two
    /// columns).
    fn two_columns(&mut self, lo: &str, hi: &str, out: &str) {
        self.emit_to("Concat", &[lo, hi], vec![("axis", Attr::Int(1))], out);
    }

    fn reshape(&mut self, x: &str, shape: &[i64]) -> String {
        let s = self.i64s("shape", vec![shape.len()], shape.to_vec());
        self.emit("Reshape", &[x, &s], vec![])
    }

    /// The integer output `out` (shape `[N]`): `labels[idx]` for integer
    /// (or 0/1) indices `idx` computed as f32 (`idx_is_int`: an integer
    /// tensor, from `ArgMax`).
    fn labels_out(&mut self, labels: &[i64], idx: &str, idx_is_int: bool, out: &str) -> R<()> {
        if labels.iter().any(|&l| l.unsigned_abs() > 1 << 24) {
            return Err(unsupported(
                "a class label beyond +-2^24 (f32 on the device holds labels exactly up to there)",
            ));
        }
        let identity = labels.iter().enumerate().all(|(i, &l)| l == i as i64);
        match (identity, idx_is_int) {
            (true, true) => self.alias(idx, out),
            (true, false) => self.emit_to("Cast", &[idx], vec![("to", Attr::Int(7))], out),
            (false, _) => {
                let table =
                    self.f32s("labels", vec![labels.len()], labels.iter().map(|&l| l as f32).collect());
                let i = if idx_is_int {
                    idx.to_string()
                } else {
                    self.emit("Cast", &[idx], vec![("to", Attr::Int(7))])
                };
                let l = self.emit("Gather", &[&table, &i], vec![("axis", Attr::Int(0))]);
                self.emit_to("Cast", &[&l], vec![("to", Attr::Int(7))], out);
            }
        }
        Ok(())
    }

    /// The label of the first largest score of each row of `scores`.
    fn argmax_labels(&mut self, scores: &str, labels: &[i64], out: &str) -> R<()> {
        let a = self.emit("ArgMax", &[scores], vec![("axis", Attr::Int(1)), ("keepdims", Attr::Int(0))]);
        self.labels_out(labels, &a, true, out)
    }

    /// `labels[1]` where `cond` (0/1, `[N, 1]`) is 1, else `labels[0]`.
    fn binary_labels(&mut self, cond: &str, labels: &[i64], out: &str) -> R<()> {
        let flat = self.reshape(cond, &[-1]);
        self.labels_out(labels, &flat, false, out)
    }

    /// `post` applied to the rows of `x` (at least two columns).
    fn post(&mut self, x: &str, post: Post) -> String {
        match post {
            Post::None => x.to_string(),
            Post::Logistic => self.emit("Sigmoid", &[x], vec![]),
            Post::Softmax => self.emit("Softmax", &[x], vec![("axis", Attr::Int(1))]),
            Post::SoftmaxZero => {
                // ONNX Runtime: exp(x - max) where |x| > 1e-7, else
                // x * exp(-max), over the sum of the first kind only.
                let m = self.reduce_kept("ReduceMax", x, 1);
                let d = self.emit("Sub", &[x, &m], vec![]);
                let e = self.emit("Exp", &[&d], vec![]);
                let a = self.emit("Abs", &[x], vec![]);
                let eps = self.scalar(1e-7);
                let keep = self.emit("Greater", &[&a, &eps], vec![]);
                let nm = self.emit("Neg", &[&m], vec![]);
                let en = self.emit("Exp", &[&nm], vec![]);
                let small = self.emit("Mul", &[x, &en], vec![]);
                let num = self.emit("Where", &[&keep, &e, &small], vec![]);
                let kf = self.emit("Cast", &[&keep], vec![("to", Attr::Int(1))]);
                let counted = self.emit("Mul", &[&e, &kf], vec![]);
                let den = self.reduce_kept("ReduceSum", &counted, 1);
                self.emit("Div", &[&num, &den], vec![])
            }
        }
    }

    fn node(&mut self, n: &Node) -> R<()> {
        let x = n.inputs.first().filter(|s| !s.is_empty()).ok_or_else(|| invalid("no input"))?.clone();
        let out = |i: usize| output(n, i);
        match n.op.as_str() {
            "ZipMap" => {
                if let Some(y) = out(0) {
                    self.alias(&x, &y);
                }
                Ok(())
            }
            "Scaler" => {
                let offset = attr_floats(n, "offset")?.unwrap_or_else(|| vec![0.0]);
                let scale = attr_floats(n, "scale")?.unwrap_or_else(|| vec![1.0]);
                let o = self.f32s("offset", vec![offset.len()], offset);
                let s = self.f32s("scale", vec![scale.len()], scale);
                let d = self.emit("Sub", &[&x, &o], vec![]);
                if let Some(y) = out(0) {
                    self.emit_to("Mul", &[&d, &s], vec![], &y);
                }
                Ok(())
            }
            "Binarizer" => {
                // Absent, the threshold is 1.0 as ONNX Runtime reads it (the
                // ONNX schema says 0.0; skl2onnx always writes it).
                let t = attr_floats(n, "threshold")?.and_then(|v| v.first().copied()).unwrap_or(1.0);
                let t = self.scalar(t);
                let g = self.emit("Greater", &[&x, &t], vec![]);
                if let Some(y) = out(0) {
                    self.emit_to("Cast", &[&g], vec![("to", Attr::Int(1))], &y);
                }
                Ok(())
            }
            "Imputer" => {
                refuse_attrs(
                    n,
                    &[
                        ("imputed_value_int64s", "integer imputation is not supported"),
                        ("replaced_value_int64", "integer imputation is not supported"),
                    ],
                )?;
                let v = attr_floats(n, "imputed_value_floats")?
                    .ok_or_else(|| invalid("no imputed_value_floats"))?;
                let r =
                    attr_floats(n, "replaced_value_float")?.and_then(|v| v.first().copied()).unwrap_or(0.0);
                let c = if r.is_nan() {
                    self.emit("IsNaN", &[&x], vec![])
                } else {
                    let r = self.scalar(r);
                    self.emit("Equal", &[&x, &r], vec![])
                };
                let v = self.f32s("imputed", vec![v.len()], v);
                if let Some(y) = out(0) {
                    self.emit_to("Where", &[&c, &v, &x], vec![], &y);
                }
                Ok(())
            }
            "Normalizer" => {
                let norm = attr_string(n, "norm", "MAX")?;
                let z = match norm.as_str() {
                    "MAX" => self.reduce_kept("ReduceMax", &x, 1),
                    "L1" => {
                        let a = self.emit("Abs", &[&x], vec![]);
                        self.reduce_kept("ReduceSum", &a, 1)
                    }
                    "L2" => {
                        let s = self.reduce_kept("ReduceSumSquare", &x, 1);
                        self.emit("Sqrt", &[&s], vec![])
                    }
                    other => return Err(invalid(format!("unknown norm `{other}`"))),
                };
                // A norm of 0 leaves the row as it is.
                let zero = self.scalar(0.0);
                let one = self.scalar(1.0);
                let is0 = self.emit("Equal", &[&z, &zero], vec![]);
                let d = self.emit("Where", &[&is0, &one, &z], vec![]);
                if let Some(y) = out(0) {
                    self.emit_to("Div", &[&x, &d], vec![], &y);
                }
                Ok(())
            }
            "ArrayFeatureExtractor" => {
                let idx =
                    n.inputs.get(1).filter(|s| !s.is_empty()).ok_or_else(|| invalid("no indices"))?.clone();
                let Some(y) = out(0) else { return Ok(()) };
                // A 1-D constant (the class labels of skl2onnx's MLP
                // export) gathered by computed indices; ONNX Runtime's
                // output is then [1, indices].
                let flat = self.reshape(&idx, &[-1]);
                if self.const_rank(&x) == Some(1) {
                    let g = self.emit("Gather", &[&x, &flat], vec![("axis", Attr::Int(0))]);
                    let s = self.i64s("shape", vec![2], vec![1, -1]);
                    self.emit_to("Reshape", &[&g, &s], vec![], &y);
                } else {
                    self.emit_to("Gather", &[&x, &flat], vec![("axis", Attr::Int(-1))], &y);
                }
                Ok(())
            }
            "LabelEncoder" => self.label_encoder(n, &x),
            "OneHotEncoder" => {
                if attr_strings(n, "cats_strings")?.is_some() {
                    return Err(unsupported("string categories cannot be computed on the device"));
                }
                let cats = attr_ints(n, "cats_int64s")?.ok_or_else(|| invalid("no cats_int64s"))?;
                let Some(y) = out(0) else { return Ok(()) };
                let xf = self.emit("Cast", &[&x], vec![("to", Attr::Int(1))]);
                let u = self.unsqueeze_last(&xf);
                let c = self.f32s("cats", vec![cats.len()], cats.iter().map(|&c| c as f32).collect());
                let e = self.emit("Equal", &[&u, &c], vec![]);
                self.emit_to("Cast", &[&e], vec![("to", Attr::Int(1))], &y);
                Ok(())
            }
            "LinearRegressor" => {
                no_post(&attr_string(n, "post_transform", "NONE")?)?;
                let t = index(attr_int(n, "targets", 1)?, "targets")?.max(1);
                let w = attr_floats(n, "coefficients")?.ok_or_else(|| invalid("no coefficients"))?;
                let b = attr_floats(n, "intercepts")?.unwrap_or_else(|| vec![0.0; t]);
                if w.is_empty() || w.len() % t != 0 || (b.len() != t && b.len() != 1) {
                    return Err(invalid("coefficients and intercepts do not match the targets"));
                }
                let f = w.len() / t;
                let wn = self.f32s("coef", vec![t, f], w);
                let bn = self.f32s("intercepts", vec![b.len()], b);
                if let Some(y) = out(0) {
                    self.emit_to("Gemm", &[&x, &wn, &bn], vec![("transB", Attr::Int(1))], &y);
                }
                Ok(())
            }
            "LinearClassifier" => self.linear_classifier(n, &x),
            "SVMClassifier" => self.svm_classifier(n, &x),
            "SVMRegressor" => self.svm_regressor(n, &x),
            "TreeEnsembleClassifier" | "TreeEnsembleRegressor" | "TreeEnsemble" => self.tree_ensemble(n, &x),
            other => Err(unsupported(format!("operator `{other}` of domain ai.onnx.ml is not supported"))),
        }
    }

    /// The rank of `name` if it is a constant (an initializer of the model
    /// or one made here).
    fn const_rank(&self, name: &str) -> Option<usize> {
        self.consts.get(name).map(|c| c.shape.len())
    }

    /// `x` with a trailing axis of 1.
    fn unsqueeze_last(&mut self, x: &str) -> String {
        self.on_axis("Unsqueeze", x, -1, vec![])
    }

    fn label_encoder(&mut self, n: &Node, x: &str) -> R<()> {
        for k in ["keys_strings", "values_strings", "default_string"] {
            if n.attrs.contains_key(k) {
                return Err(unsupported("string keys or values cannot be computed on the device"));
            }
        }
        let keys = match (
            attr_ints(n, "keys_int64s")?,
            attr_floats(n, "keys_floats")?,
            n.attrs.get("keys_tensor"),
        ) {
            (Some(k), None, None) => k.iter().map(|&k| k as f32).collect::<Vec<f32>>(),
            (None, Some(k), None) => k,
            (None, None, Some(Attr::Tensor(c))) => c.data.to_f32(),
            _ => return Err(invalid("exactly one of keys_int64s, keys_floats, keys_tensor must be given")),
        };
        let (vals, int_out) = match (
            attr_ints(n, "values_int64s")?,
            attr_floats(n, "values_floats")?,
            n.attrs.get("values_tensor"),
        ) {
            (Some(v), None, None) => (v.iter().map(|&v| v as f32).collect::<Vec<f32>>(), true),
            (None, Some(v), None) => (v, false),
            (None, None, Some(Attr::Tensor(c))) => (c.data.to_f32(), matches!(c.data, Data::I64(_))),
            _ => {
                return Err(invalid(
                    "exactly one of values_int64s, values_floats, values_tensor must be given",
                ))
            }
        };
        if keys.len() != vals.len() || keys.is_empty() {
            return Err(invalid("keys and values differ in number"));
        }
        let default = match n.attrs.get("default_tensor") {
            Some(Attr::Tensor(c)) => c.data.to_f32().first().copied().unwrap_or(0.0),
            _ if int_out => attr_int(n, "default_int64", -1)? as f32,
            _ => attr_floats(n, "default_float")?.and_then(|v| v.first().copied()).unwrap_or(-0.0),
        };
        let Some(y) = output(n, 0) else { return Ok(()) };
        // The last of equal keys wins in ONNX Runtime's map; keep one.
        let mut seen = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            seen.insert(k.to_bits(), i);
        }
        let mut pairs: Vec<(f32, f32)> = seen.values().map(|&i| (keys[i], vals[i])).collect();
        pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let xf = self.emit("Cast", &[x], vec![("to", Attr::Int(1))]);
        let u = self.unsqueeze_last(&xf);
        let k = self.f32s("keys", vec![pairs.len()], pairs.iter().map(|p| p.0).collect());
        let hit = self.emit("Equal", &[&u, &k], vec![]);
        let hitf = self.emit("Cast", &[&hit], vec![("to", Attr::Int(1))]);
        // value = hit . values + default * (1 - any hit): exact, as at
        // most one key matches.
        let v = self.f32s("values", vec![pairs.len(), 1], pairs.iter().map(|p| p.1).collect());
        let picked = self.emit("MatMul", &[&hitf, &v], vec![]);
        let any = self.reduce_kept("ReduceSum", &hitf, -1);
        let one = self.scalar(1.0);
        let none = self.emit("Sub", &[&one, &any], vec![]);
        let d = self.scalar(default);
        let dv = self.emit("Mul", &[&none, &d], vec![]);
        let sum = self.emit("Add", &[&picked, &dv], vec![]);
        let flat = self.on_axis("Squeeze", &sum, -1, vec![]);
        if int_out {
            self.emit_to("Cast", &[&flat], vec![("to", Attr::Int(7))], &y);
        } else {
            self.alias(&flat, &y);
        }
        Ok(())
    }

    fn linear_classifier(&mut self, n: &Node, x: &str) -> R<()> {
        let labels = class_labels(n, "classlabels_ints", "classlabels_strings")?;
        let post = Post::parse(&attr_string(n, "post_transform", "NONE")?)?;
        let w = attr_floats(n, "coefficients")?.ok_or_else(|| invalid("no coefficients"))?;
        let b = attr_floats(n, "intercepts")?.ok_or_else(|| invalid("no intercepts"))?;
        let c = b.len();
        if c == 0 || w.is_empty() || w.len() % c != 0 {
            return Err(invalid("coefficients do not match the intercepts"));
        }
        let f = w.len() / c;
        let wn = self.f32s("coef", vec![c, f], w);
        let bn = self.f32s("intercepts", vec![c], b);
        let s = self.emit("Gemm", &[x, &wn, &bn], vec![("transB", Attr::Int(1))]);
        let nlabels = labels.as_ref().map_or(0, Vec::len);
        if let Some(y) = &output(n, 0) {
            match &labels {
                Err(why) => self.refuse_output(y, why),
                Ok(l) if c == 1 => {
                    // One score: positive is the second label (or 1).
                    let l = if l.len() == 2 { l.clone() } else { vec![0, 1] };
                    let zero = self.scalar(0.0);
                    let g = self.emit("Greater", &[&s, &zero], vec![]);
                    self.binary_labels(&g, &l, y)?;
                }
                Ok(l) if l.len() == c => self.argmax_labels(&s, l, y)?,
                Ok(_) => return Err(invalid("the class labels do not match the intercepts")),
            }
        }
        if let Some(z) = &output(n, 1) {
            if c == 1 && nlabels == 2 {
                // ONNX Runtime writes [1 - s, s] for a single score with
                // two labels, the transform not applied.
                if post != Post::None {
                    return Err(unsupported("a post_transform on a single-score binary classifier"));
                }
                let one = self.scalar(1.0);
                let neg = self.emit("Sub", &[&one, &s], vec![]);
                self.two_columns(&neg, &s, z);
            } else if c == 1 {
                if post != Post::None {
                    return Err(unsupported("a post_transform on a single score"));
                }
                self.alias(&s, z);
            } else {
                let p = self.post(&s, post);
                self.alias(&p, z);
            }
        }
        Ok(())
    }

    /// The kernel of every row of `x` against the support vectors
    /// `sv` (`v` rows of `f`), `[N, v]`.
    fn kernel(&mut self, n: &Node, x: &str, sv: Vec<f32>, v: usize, f: usize) -> R<String> {
        let kind = attr_string(n, "kernel_type", "LINEAR")?;
        let p = attr_floats(n, "kernel_params")?.unwrap_or_default();
        let gamma = p.first().copied().unwrap_or(0.0);
        let coef0 = p.get(1).copied().unwrap_or(0.0);
        let degree = p.get(2).copied().unwrap_or(0.0);
        if kind == "RBF" {
            // exp(-gamma * sum((x - sv)^2)), each difference as ONNX
            // Runtime takes it (no expansion into dot products, whose
            // cancellation loses digits on unscaled features).
            let xr = self.reshape(x, &[0, 1, -1]);
            let s = self.f32s("sv", vec![v, f], sv);
            let d = self.emit("Sub", &[&xr, &s], vec![]);
            let sq = self.emit("Mul", &[&d, &d], vec![]);
            let sum = self.on_axis("ReduceSum", &sq, 2, vec![("keepdims", Attr::Int(0))]);
            let g = self.scalar(-gamma);
            let e = self.emit("Mul", &[&sum, &g], vec![]);
            return Ok(self.emit("Exp", &[&e], vec![]));
        }
        let s = self.f32s("sv", vec![v, f], sv);
        let dot = self.emit("Gemm", &[x, &s], vec![("transB", Attr::Int(1))]);
        let affine = |ex: &mut Ex| {
            let g = ex.scalar(gamma);
            let m = ex.emit("Mul", &[&dot, &g], vec![]);
            let c = ex.scalar(coef0);
            ex.emit("Add", &[&m, &c], vec![])
        };
        Ok(match kind.as_str() {
            "LINEAR" => dot.clone(),
            "POLY" => {
                let a = affine(self);
                let d = self.scalar(degree);
                self.emit("Pow", &[&a, &d], vec![])
            }
            "SIGMOID" => {
                let a = affine(self);
                self.emit("Tanh", &[&a], vec![])
            }
            other => return Err(invalid(format!("unknown kernel_type `{other}`"))),
        })
    }

    fn svm_classifier(&mut self, n: &Node, x: &str) -> R<()> {
        // SVC(probability=True): its label is the votes' as without, its
        // probabilities a pairwise coupling (an iterative solve).
        let coupled = attr_floats(n, "prob_a")?.is_some_and(|v| !v.is_empty());
        let labels = class_labels(n, "classlabels_ints", "classlabels_strings")?;
        let post = Post::parse(&attr_string(n, "post_transform", "NONE")?)?;
        let per_class: Vec<usize> = attr_ints(n, "vectors_per_class")?
            .unwrap_or_default()
            .iter()
            .map(|&v| index(v, "vectors_per_class"))
            .collect::<R<_>>()?;
        let classes = per_class.len();
        let vcount: usize = per_class.iter().sum();
        if vcount == 0 {
            return Err(unsupported(
                "the liblinear mode of SVMClassifier (no support vectors) is not supported",
            ));
        }
        if labels.as_ref().is_ok_and(|l| l.len() != classes) {
            return Err(invalid("vectors_per_class does not match the class labels"));
        }
        if classes < 2 {
            return Err(invalid("fewer than two classes"));
        }
        let sv = attr_floats(n, "support_vectors")?.ok_or_else(|| invalid("no support_vectors"))?;
        if sv.is_empty() || sv.len() % vcount != 0 || sv.len() > MAX_SVM_ELEMS {
            return Err(invalid("support_vectors do not match vectors_per_class"));
        }
        let f = sv.len() / vcount;
        let coef = attr_floats(n, "coefficients")?.ok_or_else(|| invalid("no coefficients"))?;
        let rho = attr_floats(n, "rho")?.ok_or_else(|| invalid("no rho"))?;
        let pairs = classes * (classes - 1) / 2;
        if vcount.checked_mul(pairs).is_none_or(|e| e > MAX_SVM_ELEMS) || pairs * classes > MAX_SVM_ELEMS {
            return Err(unsupported(format!(
                "{classes} classes over {vcount} support vectors: too many pairs"
            )));
        }
        if coef.len() < (classes - 1) * vcount || rho.len() < pairs {
            return Err(invalid("coefficients or rho are too short for the classes"));
        }
        let k = self.kernel(n, x, sv, vcount, f)?;
        // Pair (i, j), i < j: sum over i's vectors of coef[j-1][m] K[m]
        // plus over j's of coef[i][m] K[m], plus rho.
        let start: Vec<usize> =
            per_class.iter().scan(0, |s, &c| Some(std::mem::replace(s, *s + c))).collect();
        let mut a = vec![0f32; vcount * pairs];
        let mut b = vec![0f32; pairs * classes]; // pair -> +1 to i, -1 to j
        let mut base = vec![0f32; classes]; // each pair's j when no vote for i
        let mut p = 0;
        for i in 0..classes {
            for j in i + 1..classes {
                for m in start[i]..start[i] + per_class[i] {
                    a[m * pairs + p] = coef[(j - 1) * vcount + m];
                }
                for m in start[j]..start[j] + per_class[j] {
                    a[m * pairs + p] = coef[i * vcount + m];
                }
                b[p * classes + i] = 1.0;
                b[p * classes + j] = -1.0;
                base[j] += 1.0;
                p += 1;
            }
        }
        let an = self.f32s("pairs", vec![vcount, pairs], a);
        let rn = self.f32s("rho", vec![pairs], rho[..pairs].to_vec());
        let s = self.emit("Gemm", &[&k, &an, &rn], vec![]);
        if let Some(y) = &output(n, 0) {
            match &labels {
                Err(why) => self.refuse_output(y, why),
                Ok(l) => {
                    // A vote for i where the decision value is positive,
                    // else for j; the label the first class of most votes.
                    let zero = self.scalar(0.0);
                    let pos = self.emit("Greater", &[&s, &zero], vec![]);
                    let posf = self.emit("Cast", &[&pos], vec![("to", Attr::Int(1))]);
                    let bn = self.f32s("votes", vec![pairs, classes], b);
                    let basen = self.f32s("votes0", vec![classes], base);
                    let votes = self.emit("Gemm", &[&posf, &bn, &basen], vec![]);
                    self.argmax_labels(&votes, l, y)?;
                }
            }
        }
        if let Some(z) = &output(n, 1) {
            if coupled {
                self.refuse_output(
                    z,
                    "prob_a/prob_b (SVC(probability=True)): the pairwise coupling of probabilities is an \
                     iterative solve the device does not run; compile the label output only (--output NAME), \
                     or export the SVC without probability=True",
                );
            } else if pairs == 1 {
                // Two classes: [-s, s] (ONNX Runtime's scores without a
                // transform).
                if post != Post::None {
                    return Err(unsupported("a post_transform on a two-class SVM"));
                }
                let neg = self.emit("Neg", &[&s], vec![]);
                self.two_columns(&neg, &s, z);
            } else {
                let p = self.post(&s, post);
                self.alias(&p, z);
            }
        }
        Ok(())
    }

    fn svm_regressor(&mut self, n: &Node, x: &str) -> R<()> {
        no_post(&attr_string(n, "post_transform", "NONE")?)?;
        let nsv = index(attr_int(n, "n_supports", 0)?, "n_supports")?;
        let coef = attr_floats(n, "coefficients")?.ok_or_else(|| invalid("no coefficients"))?;
        let rho = attr_floats(n, "rho")?.and_then(|v| v.first().copied()).unwrap_or(0.0);
        let Some(y) = output(n, 0) else { return Ok(()) };
        let r = self.f32s("rho", vec![1], vec![rho]);
        let score = if nsv > 0 {
            let sv = attr_floats(n, "support_vectors")?.ok_or_else(|| invalid("no support_vectors"))?;
            if sv.is_empty() || sv.len() % nsv != 0 || coef.len() < nsv || sv.len() > MAX_SVM_ELEMS {
                return Err(invalid("support_vectors or coefficients do not match n_supports"));
            }
            let f = sv.len() / nsv;
            let k = self.kernel(n, x, sv, nsv, f)?;
            let c = self.f32s("coef", vec![nsv, 1], coef[..nsv].to_vec());
            self.emit("Gemm", &[&k, &c, &r], vec![])
        } else {
            if coef.is_empty() {
                return Err(invalid("no coefficients"));
            }
            let c = self.f32s("coef", vec![coef.len(), 1], coef);
            self.emit("Gemm", &[x, &c, &r], vec![])
        };
        if attr_int(n, "one_class", 0)? != 0 {
            let zero = self.scalar(0.0);
            let g = self.emit("Greater", &[&score, &zero], vec![]);
            let gf = self.emit("Cast", &[&g], vec![("to", Attr::Int(1))]);
            let two = self.scalar(2.0);
            let m = self.emit("Mul", &[&gf, &two], vec![]);
            let one = self.scalar(1.0);
            self.emit_to("Sub", &[&m, &one], vec![], &y);
        } else {
            self.alias(&score, &y);
        }
        Ok(())
    }

    /// The summed leaf weights of `trees`, `[N, outputs]`, plus `bias`
    /// (the weights of trees that are a single leaf, added here).
    fn forest(&mut self, x: &str, trees: &[Tree], outputs: usize, bias: &mut [f32]) -> R<Option<String>> {
        let mut parts = Vec::new();
        let mut chunk: Vec<&Tree> = Vec::new();
        let (mut nb, mut nl) = (0, 0);
        let mut flush = |ex: &mut Ex, chunk: &mut Vec<&Tree>| -> R<()> {
            if !chunk.is_empty() {
                parts.push(ex.chunk(x, chunk, outputs)?);
                chunk.clear();
            }
            Ok(())
        };
        for t in trees {
            if t.branches.is_empty() {
                for (o, w) in t.leaves.iter().flat_map(|l| &l.weights) {
                    bias[*o] += w;
                }
                continue;
            }
            if !chunk.is_empty() && (nb + t.branches.len() > CHUNK || nl + t.leaves.len() > CHUNK) {
                flush(self, &mut chunk)?;
                (nb, nl) = (0, 0);
            }
            nb += t.branches.len();
            nl += t.leaves.len();
            chunk.push(t);
        }
        flush(self, &mut chunk)?;
        Ok(match parts.len() {
            0 => None,
            1 => parts.pop(),
            _ => {
                let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
                Some(self.emit("Sum", &refs, vec![]))
            }
        })
    }

    /// One chunk of trees as products: the indicator of the leaves each
    /// row reaches, times their weights.
    fn chunk(&mut self, x: &str, trees: &[&Tree], outputs: usize) -> R<String> {
        let branches: Vec<&Branch> = trees.iter().flat_map(|t| &t.branches).collect();
        let nleaves: usize = trees.iter().map(|t| t.leaves.len()).sum();
        let nb = branches.len();
        if nb.checked_mul(nleaves).is_none_or(|e| e > MAX_PATH_ELEMS) {
            return Err(unsupported(format!(
                "a tree of {nb} branches and {nleaves} leaves: its path matrix would pass {MAX_PATH_ELEMS} entries"
            )));
        }
        let feats = self.i64s("features", vec![nb], branches.iter().map(|b| b.feature).collect());
        let xg = self.emit("Gather", &[x, &feats], vec![("axis", Attr::Int(1))]);
        let thr = self.f32s("thresholds", vec![nb], branches.iter().map(|b| b.value).collect());
        let mut modes: Vec<Mode> = branches.iter().map(|b| b.mode).collect();
        modes.sort();
        modes.dedup();
        let cmp = |ex: &mut Ex, m: Mode| {
            let op = match m {
                Mode::Leq => "LessOrEqual",
                Mode::Lt => "Less",
                Mode::Gte => "GreaterOrEqual",
                Mode::Gt => "Greater",
                Mode::Eq | Mode::Neq => "Equal",
            };
            let c = ex.emit(op, &[&xg, &thr], vec![]);
            let c = if m == Mode::Neq { ex.emit("Not", &[&c], vec![]) } else { c };
            ex.emit("Cast", &[&c], vec![("to", Attr::Int(1))])
        };
        let mut cond = if modes.len() == 1 {
            cmp(self, modes[0])
        } else {
            let mut terms = Vec::new();
            for &m in &modes {
                let c = cmp(self, m);
                let mask = self.f32s(
                    "mode",
                    vec![nb],
                    branches.iter().map(|b| f32::from(u8::from(b.mode == m))).collect(),
                );
                terms.push(self.emit("Mul", &[&c, &mask], vec![]));
            }
            let refs: Vec<&str> = terms.iter().map(String::as_str).collect();
            self.emit("Sum", &refs, vec![])
        };
        if branches.iter().any(|b| b.missing_true) {
            let nan = self.emit("IsNaN", &[&xg], vec![]);
            let nanf = self.emit("Cast", &[&nan], vec![("to", Attr::Int(1))]);
            let mask = self.f32s(
                "missing",
                vec![nb],
                branches.iter().map(|b| f32::from(u8::from(b.missing_true))).collect(),
            );
            let t = self.emit("Mul", &[&nanf, &mask], vec![]);
            cond = self.emit("Max", &[&cond, &t], vec![]);
        }
        // Path matrix and each leaf's count of true sides.
        let mut d = vec![0f32; nb * nleaves];
        let mut want = Vec::with_capacity(nleaves);
        let mut w = vec![0f32; nleaves * outputs];
        let (mut b0, mut l) = (0, 0);
        for t in trees {
            for leaf in &t.leaves {
                for &(b, side) in &leaf.path {
                    d[(b0 + b) * nleaves + l] = if side { 1.0 } else { -1.0 };
                }
                want.push(leaf.path.iter().filter(|p| p.1).count() as f32);
                for &(o, v) in &leaf.weights {
                    w[l * outputs + o] += v;
                }
                l += 1;
            }
            b0 += t.branches.len();
        }
        let dn = self.f32s("paths", vec![nb, nleaves], d);
        let s = self.emit("MatMul", &[&cond, &dn], vec![]);
        let wantn = self.f32s("sides", vec![nleaves], want);
        let hit = self.emit("Equal", &[&s, &wantn], vec![]);
        let hitf = self.emit("Cast", &[&hit], vec![("to", Attr::Int(1))]);
        let wn = self.f32s("leaves", vec![nleaves, outputs], w);
        Ok(self.emit("MatMul", &[&hitf, &wn], vec![]))
    }

    fn tree_ensemble(&mut self, n: &Node, x: &str) -> R<()> {
        let classifier = n.op == "TreeEnsembleClassifier";
        let (trees, outputs, post, aggregate, base) = if n.op == "TreeEnsemble" {
            // Opset 5 has no base values.
            let f = parse_v5(n)?;
            (f.trees, f.outputs, f.post, f.aggregate, Vec::new())
        } else {
            refuse_attrs(
                n,
                &[
                    ("nodes_values_as_tensor", DOUBLE_ATTRS),
                    ("base_values_as_tensor", DOUBLE_ATTRS),
                    ("class_weights_as_tensor", DOUBLE_ATTRS),
                    ("target_weights_as_tensor", DOUBLE_ATTRS),
                    ("nodes_hitrates_as_tensor", DOUBLE_ATTRS),
                ],
            )?;
            let outputs = if classifier {
                match (attr_ints(n, "classlabels_int64s")?, attr_strings(n, "classlabels_strings")?) {
                    (Some(l), _) => l.len(),
                    (None, Some(l)) => l.len(),
                    _ => return Err(invalid("neither classlabels_int64s nor classlabels_strings is given")),
                }
            } else {
                index(attr_int(n, "n_targets", 1)?, "n_targets")?
            };
            let prefix = if classifier { "class" } else { "target" };
            let trees = parse_v1(n, prefix, outputs)?;
            let post = attr_string(n, "post_transform", "NONE")?;
            let aggregate = attr_string(n, "aggregate_function", "SUM")?;
            let base = attr_floats(n, "base_values")?.unwrap_or_default();
            (trees, outputs, post, aggregate, base)
        };
        if outputs == 0 {
            return Err(invalid("no classes or targets"));
        }
        if classifier {
            return self.tree_classifier(n, x, &trees, outputs, &post, &base);
        }
        no_post(&post)?;
        let average = match aggregate.as_str() {
            "SUM" => false,
            "AVERAGE" => true,
            "MIN" | "MAX" => {
                return Err(unsupported(format!("aggregate_function {aggregate} is not supported")))
            }
            other => return Err(invalid(format!("unknown aggregate_function `{other}`"))),
        };
        let Some(y) = output(n, 0) else { return Ok(()) };
        // score (/ trees) + base: the base per target, or one for all.
        let base: Vec<f32> = match base.len() {
            0 => vec![0.0; outputs],
            1 => vec![base[0]; outputs],
            l if l == outputs => base,
            _ => return Err(invalid("base_values do not match the targets")),
        };
        let mut bias = vec![0f32; outputs];
        let sum = self.forest(x, &trees, outputs, &mut bias)?;
        let total = self.leaf_sum(x, sum, &bias, outputs)?;
        let scaled = if average {
            let t = self.scalar(trees.len().max(1) as f32);
            self.emit("Div", &[&total, &t], vec![])
        } else {
            total
        };
        let b = self.f32s("base", vec![outputs], base);
        self.emit_to("Add", &[&scaled, &b], vec![], &y);
        Ok(())
    }

    /// The trees' sum plus the single-leaf trees' `bias`; with no tree of
    /// branches, `bias` broadcast over the rows of `x`.
    fn leaf_sum(&mut self, x: &str, sum: Option<String>, bias: &[f32], outputs: usize) -> R<String> {
        match sum {
            Some(s) if bias.iter().all(|&b| b == 0.0) => Ok(s),
            Some(s) => {
                let b = self.f32s("single", vec![outputs], bias.to_vec());
                Ok(self.emit("Add", &[&s, &b], vec![]))
            }
            None => {
                // x[:, :1] * 0 + bias keeps the batch dimension.
                let first = self.i64s("first", vec![1], vec![0]);
                let col = self.emit("Gather", &[x, &first], vec![("axis", Attr::Int(1))]);
                let zero = self.scalar(0.0);
                let z = self.emit("Mul", &[&col, &zero], vec![]);
                let b = self.f32s("single", vec![outputs], bias.to_vec());
                Ok(self.emit("Add", &[&z, &b], vec![]))
            }
        }
    }

    fn tree_classifier(
        &mut self,
        n: &Node,
        x: &str,
        trees: &[Tree],
        c: usize,
        post: &str,
        base: &[f32],
    ) -> R<()> {
        let labels = class_labels(n, "classlabels_int64s", "classlabels_strings")?;
        let post = Post::parse(post)?;
        let weighted: HashSet<usize> =
            trees.iter().flat_map(|t| &t.leaves).flat_map(|l| &l.weights).map(|w| w.0).collect();
        let positive = trees.iter().flat_map(|t| &t.leaves).flat_map(|l| &l.weights).all(|w| w.1 >= 0.0);
        let mut bias = vec![0f32; c];
        let sum = self.forest(x, trees, c, &mut bias)?;
        let scores = self.leaf_sum(x, sum, &bias, c)?;
        let (label_out, prob_out) = (output(n, 0), output(n, 1));
        if c == 2 && weighted.len() <= 1 {
            // ONNX Runtime's binary case: one score s (class 0's weights),
            // plus base_values[0]; the positive label where s > 0.5 with
            // weights all positive, else where s > 0.
            if weighted.contains(&1) {
                return Err(unsupported("a binary tree classifier whose only weighted class is the second"));
            }
            if base.len() > 1 {
                return Err(unsupported(
                    "a binary tree classifier with two base_values and one weighted class",
                ));
            }
            let first = self.i64s("first", vec![1], vec![0]);
            let s0 = self.emit("Gather", &[&scores, &first], vec![("axis", Attr::Int(1))]);
            let s = match base.first() {
                Some(&b) => {
                    let b = self.scalar(b);
                    self.emit("Add", &[&s0, &b], vec![])
                }
                None => s0,
            };
            if let Some(y) = &label_out {
                match &labels {
                    Err(why) => self.refuse_output(y, why),
                    Ok(l) => {
                        let t = self.scalar(if positive { 0.5 } else { 0.0 });
                        let g = self.emit("Greater", &[&s, &t], vec![]);
                        self.binary_labels(&g, l, y)?;
                    }
                }
            }
            if let Some(z) = &prob_out {
                let (lo, hi) = match post {
                    Post::Logistic => {
                        let neg = self.emit("Neg", &[&s], vec![]);
                        (self.emit("Sigmoid", &[&neg], vec![]), self.emit("Sigmoid", &[&s], vec![]))
                    }
                    Post::None if positive => {
                        let one = self.scalar(1.0);
                        (self.emit("Sub", &[&one, &s], vec![]), s.clone())
                    }
                    Post::None => (self.emit("Neg", &[&s], vec![]), s.clone()),
                    _ => return Err(unsupported("a softmax on a binary tree classifier's single score")),
                };
                self.two_columns(&lo, &hi, z);
            }
            return Ok(());
        }
        let scores = match base.len() {
            0 => scores,
            l if l == c => {
                let b = self.f32s("base", vec![c], base.to_vec());
                self.emit("Add", &[&scores, &b], vec![])
            }
            _ => return Err(unsupported("base_values that do not match the classes")),
        };
        if let Some(y) = &label_out {
            match &labels {
                Err(why) => self.refuse_output(y, why),
                Ok(l) => self.argmax_labels(&scores, l, y)?,
            }
        }
        if let Some(z) = &prob_out {
            let p = self.post(&scores, post);
            self.alias(&p, z);
        }
        Ok(())
    }
}

/// A forest read from TreeEnsemble (opset 5) attributes.
struct Forest5 {
    trees: Vec<Tree>,
    outputs: usize,
    post: String,
    aggregate: String,
}

/// The trees of a TreeEnsembleClassifier or TreeEnsembleRegressor (opsets
/// 1 and 3): nodes by (tree, node) id; leaves' weights from
/// `{prefix}_treeids`, `_nodeids`, `_ids`, `_weights`.
fn parse_v1(n: &Node, prefix: &str, outputs: usize) -> R<Vec<Tree>> {
    let get = |k: &str| attr_ints(n, k).map(Option::unwrap_or_default);
    let tree_ids = get("nodes_treeids")?;
    let node_ids = get("nodes_nodeids")?;
    let feats = get("nodes_featureids")?;
    let trues = get("nodes_truenodeids")?;
    let falses = get("nodes_falsenodeids")?;
    let values = attr_floats(n, "nodes_values")?.unwrap_or_default();
    let modes = attr_strings(n, "nodes_modes")?.unwrap_or_default();
    let missing = get("nodes_missing_value_tracks_true")?;
    let count = tree_ids.len();
    if count == 0 || count > MAX_TREE_NODES {
        return Err(invalid(format!("{count} tree nodes (1 to {MAX_TREE_NODES} are taken)")));
    }
    for (k, l) in [
        ("nodes_nodeids", node_ids.len()),
        ("nodes_featureids", feats.len()),
        ("nodes_truenodeids", trues.len()),
        ("nodes_falsenodeids", falses.len()),
        ("nodes_values", values.len()),
        ("nodes_modes", modes.len()),
    ] {
        if l != count {
            return Err(invalid(format!("{k} has {l} entries for {count} nodes")));
        }
    }
    if !missing.is_empty() && missing.len() != count {
        return Err(invalid("nodes_missing_value_tracks_true does not match the nodes"));
    }
    let w_trees = get(&format!("{prefix}_treeids"))?;
    let w_nodes = get(&format!("{prefix}_nodeids"))?;
    let w_ids = get(&format!("{prefix}_ids"))?;
    let w_vals = attr_floats(n, &format!("{prefix}_weights"))?.unwrap_or_default();
    let wc = w_trees.len();
    if w_nodes.len() != wc || w_ids.len() != wc || w_vals.len() != wc {
        return Err(invalid(format!("the {prefix}_* attributes differ in length")));
    }
    // Node index by (tree, node id), trees in order of first appearance.
    let mut at: HashMap<(i64, i64), usize> = HashMap::with_capacity(count);
    let mut order = Vec::new();
    let mut children: HashSet<(i64, i64)> = HashSet::new();
    let mut kinds = Vec::with_capacity(count);
    for i in 0..count {
        let key = (tree_ids[i], node_ids[i]);
        if at.insert(key, i).is_some() {
            return Err(invalid(format!("node {} of tree {} is given twice", key.1, key.0)));
        }
        if !order.contains(&tree_ids[i]) {
            order.push(tree_ids[i]);
        }
        let mode = Mode::parse(&modes[i])?;
        if mode.is_some() {
            children.insert((tree_ids[i], trues[i]));
            children.insert((tree_ids[i], falses[i]));
        }
        kinds.push(mode);
    }
    let mut weights: HashMap<(i64, i64), Vec<(usize, f32)>> = HashMap::new();
    for i in 0..wc {
        let o = index(w_ids[i], "class or target id")?;
        if o >= outputs {
            return Err(invalid(format!("{prefix} id {o} is not below {outputs}")));
        }
        weights.entry((w_trees[i], w_nodes[i])).or_default().push((o, w_vals[i]));
    }
    let mut trees = Vec::with_capacity(order.len());
    for t in order {
        let roots: Vec<usize> =
            (0..count).filter(|&i| tree_ids[i] == t && !children.contains(&(t, node_ids[i]))).collect();
        let [root] = roots[..] else {
            return Err(invalid(format!("tree {t} has {} roots", roots.len())));
        };
        let node = |i: usize| -> R<Walk> {
            Ok(match kinds[i] {
                None => Walk::Leaf(weights.get(&(t, node_ids[i])).cloned().unwrap_or_default()),
                Some(mode) => {
                    let child = |id: i64| {
                        at.get(&(t, id)).copied().ok_or_else(|| invalid(format!("tree {t} has no node {id}")))
                    };
                    Walk::Branch(
                        Branch {
                            feature: feats[i],
                            value: values[i],
                            mode,
                            missing_true: missing.get(i).is_some_and(|&m| m != 0),
                        },
                        child(trues[i])?,
                        child(falses[i])?,
                    )
                }
            })
        };
        trees.push(walk(root, count, node)?);
    }
    Ok(trees)
}

/// One node as [`walk`] reads it: a leaf's weights, or a branch and its
/// true and false children.
enum Walk {
    Leaf(Vec<(usize, f32)>),
    Branch(Branch, usize, usize),
}

/// The tree below `root`: every branch visited once (a cycle, or a branch
/// two others share, is refused), at most `limit` of them. A leaf two
/// branches name (opset 5's leaves are values, not nodes) is a leaf of
/// each path.
fn walk(root: usize, limit: usize, node: impl Fn(usize) -> R<Walk>) -> R<Tree> {
    let mut t = Tree::default();
    let mut seen = HashSet::new();
    let mut stack = vec![(root, Vec::new())];
    while let Some((i, path)) = stack.pop() {
        match node(i)? {
            Walk::Leaf(weights) => t.leaves.push(Leaf { path, weights }),
            Walk::Branch(b, tr, fa) => {
                if !seen.insert(i) || seen.len() > limit {
                    return Err(invalid("a tree's nodes form a cycle or share a child"));
                }
                if b.feature < 0 {
                    return Err(invalid(format!("feature id {} is negative", b.feature)));
                }
                let at = t.branches.len();
                t.branches.push(b);
                let mut pf: Vec<(usize, bool)> = path.clone();
                pf.push((at, false));
                let mut pt = path;
                pt.push((at, true));
                stack.push((fa, pf));
                stack.push((tr, pt));
            }
        }
    }
    Ok(t)
}

/// TreeEnsemble of ai.onnx.ml opset 5.
fn parse_v5(n: &Node) -> R<Forest5> {
    let get = |k: &str| attr_ints(n, k).map(Option::unwrap_or_default);
    let feats = get("nodes_featureids")?;
    let splits = attr_floats(n, "nodes_splits")?.unwrap_or_default();
    let modes = get("nodes_modes")?;
    let trues = get("nodes_truenodeids")?;
    let falses = get("nodes_falsenodeids")?;
    let tleaf = get("nodes_trueleafs")?;
    let fleaf = get("nodes_falseleafs")?;
    let missing = get("nodes_missing_value_tracks_true")?;
    let roots = get("tree_roots")?;
    let leaf_t = get("leaf_targetids")?;
    let leaf_w = attr_floats(n, "leaf_weights")?.unwrap_or_default();
    let outputs = index(attr_int(n, "n_targets", 1)?, "n_targets")?;
    let count = feats.len();
    if count > MAX_TREE_NODES || leaf_t.len() > MAX_TREE_NODES {
        return Err(invalid("too many tree nodes"));
    }
    for (k, l) in [
        ("nodes_splits", splits.len()),
        ("nodes_modes", modes.len()),
        ("nodes_truenodeids", trues.len()),
        ("nodes_falsenodeids", falses.len()),
        ("nodes_trueleafs", tleaf.len()),
        ("nodes_falseleafs", fleaf.len()),
    ] {
        if l != count {
            return Err(invalid(format!("{k} has {l} entries for {count} nodes")));
        }
    }
    if !missing.is_empty() && missing.len() != count {
        return Err(invalid("nodes_missing_value_tracks_true does not match the nodes"));
    }
    if leaf_w.len() != leaf_t.len() {
        return Err(invalid("leaf_weights do not match leaf_targetids"));
    }
    for &t in &leaf_t {
        if index(t, "leaf target id")? >= outputs {
            return Err(invalid(format!("leaf target {t} is not below n_targets {outputs}")));
        }
    }
    let mode = |m: i64| -> R<Mode> {
        Ok(match m {
            0 => Mode::Leq,
            1 => Mode::Lt,
            2 => Mode::Gte,
            3 => Mode::Gt,
            4 => Mode::Eq,
            5 => Mode::Neq,
            6 => return Err(unsupported("BRANCH_MEMBER (set membership) branches are not supported")),
            other => return Err(invalid(format!("unknown node mode {other}"))),
        })
    };
    // Indices: nodes 0..count, leaves count..count + leaves.
    let leaves = leaf_t.len();
    let total = count + leaves;
    let mut trees = Vec::with_capacity(roots.len());
    let target = |is_leaf: i64, id: i64| -> R<usize> {
        let id = index(id, "node or leaf id")?;
        if is_leaf != 0 {
            (id < leaves).then_some(count + id).ok_or_else(|| invalid(format!("no leaf {id}")))
        } else {
            (id < count).then_some(id).ok_or_else(|| invalid(format!("no node {id}")))
        }
    };
    for &r in &roots {
        let r = index(r, "tree root")?;
        // A root past the nodes is refused (a one-leaf tree is given as
        // a branch whose two sides are the same leaf).
        if r >= count {
            return Err(invalid(format!("tree root {r} is not a node")));
        }
        let node = |i: usize| -> R<Walk> {
            if i >= count {
                let l = i - count;
                return Ok(Walk::Leaf(vec![(leaf_t[l] as usize, leaf_w[l])]));
            }
            Ok(Walk::Branch(
                Branch {
                    feature: feats[i],
                    value: splits[i],
                    mode: mode(modes[i])?,
                    missing_true: missing.get(i).is_some_and(|&m| m != 0),
                },
                target(tleaf[i], trues[i])?,
                target(fleaf[i], falses[i])?,
            ))
        };
        trees.push(walk(r, total, node)?);
    }
    let post = match attr_int(n, "post_transform", 0)? {
        0 => "NONE",
        1 => "SOFTMAX",
        2 => "LOGISTIC",
        3 => "SOFTMAX_ZERO",
        4 => "PROBIT",
        other => return Err(invalid(format!("unknown post_transform {other}"))),
    };
    let aggregate = match attr_int(n, "aggregate_function", 1)? {
        0 => "AVERAGE",
        1 => "SUM",
        2 => "MIN",
        3 => "MAX",
        other => return Err(invalid(format!("unknown aggregate_function {other}"))),
    };
    Ok(Forest5 { trees, outputs, post: post.into(), aggregate: aggregate.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_is_sorted() {
        assert!(ML_OPERATORS.windows(2).all(|w| w[0].op < w[1].op));
        assert!(listed("TreeEnsembleClassifier") && !listed("CastMap"));
    }

    /// Every listed operator reaches a handler of its own: with no
    /// attributes it may be refused for them, never as unknown.
    #[test]
    fn every_listed_operator_has_a_handler() {
        for o in ML_OPERATORS {
            let n = Node {
                name: "n".into(),
                op: o.op.into(),
                domain: DOMAIN.into(),
                inputs: vec!["x".into(), "i".into()],
                outputs: vec!["y".into(), "z".into()],
                attrs: HashMap::new(),
            };
            let mut ex = Ex {
                opset: 17,
                base: "n".into(),
                op: o.op.into(),
                nodes: vec![],
                consts: HashMap::new(),
                names: HashSet::new(),
            };
            if let Err(e) = ex.node(&n) {
                assert!(!e.to_string().contains("is not supported (docs"), "{}: {e}", o.op);
            }
        }
    }

    fn tree_node(attrs: Vec<(&str, Attr)>) -> Node {
        Node {
            name: "t".into(),
            op: "TreeEnsembleRegressor".into(),
            domain: DOMAIN.into(),
            inputs: vec!["x".into()],
            outputs: vec!["y".into()],
            attrs: attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        }
    }

    /// A hand-made tree: root x0 <= 1 (true: leaf 1 of weight 10; false:
    /// node 2, x1 < 5: leaf 3 of weight 20, else leaf 4 of weight 30).
    /// The path of each leaf, and the count of true sides.
    #[test]
    fn a_tree_is_walked_into_paths() {
        let s = |v: &[&str]| Attr::Strings(v.iter().map(|s| s.to_string()).collect());
        let n = tree_node(vec![
            ("nodes_treeids", Attr::Ints(vec![0; 5])),
            ("nodes_nodeids", Attr::Ints(vec![0, 1, 2, 3, 4])),
            ("nodes_featureids", Attr::Ints(vec![0, 0, 1, 0, 0])),
            ("nodes_truenodeids", Attr::Ints(vec![1, 0, 3, 0, 0])),
            ("nodes_falsenodeids", Attr::Ints(vec![2, 0, 4, 0, 0])),
            ("nodes_values", Attr::Floats(vec![1.0, 0.0, 5.0, 0.0, 0.0])),
            ("nodes_modes", s(&["BRANCH_LEQ", "LEAF", "BRANCH_LT", "LEAF", "LEAF"])),
            ("target_treeids", Attr::Ints(vec![0; 3])),
            ("target_nodeids", Attr::Ints(vec![1, 3, 4])),
            ("target_ids", Attr::Ints(vec![0; 3])),
            ("target_weights", Attr::Floats(vec![10.0, 20.0, 30.0])),
        ]);
        let trees = parse_v1(&n, "target", 1).unwrap_or_default();
        assert_eq!(trees.len(), 1);
        let t = &trees[0];
        assert_eq!(t.branches.len(), 2);
        let got: Vec<(Vec<(usize, bool)>, f32)> =
            t.leaves.iter().map(|l| (l.path.clone(), l.weights[0].1)).collect();
        assert_eq!(
            got,
            vec![
                (vec![(0, true)], 10.0),
                (vec![(0, false), (1, true)], 20.0),
                (vec![(0, false), (1, false)], 30.0)
            ]
        );
    }

    /// Hostile trees: a cycle, a missing child, a class id past the
    /// classes, lengths that disagree. Each is refused, none panics.
    #[test]
    fn hostile_trees_are_refused() {
        let s = |v: &[&str]| Attr::Strings(v.iter().map(|s| s.to_string()).collect());
        let base = |trues: Vec<i64>, ids: Vec<i64>, w_ids: Vec<i64>| {
            tree_node(vec![
                ("nodes_treeids", Attr::Ints(vec![0; ids.len()])),
                ("nodes_nodeids", Attr::Ints(ids.clone())),
                ("nodes_featureids", Attr::Ints(vec![0; ids.len()])),
                ("nodes_truenodeids", Attr::Ints(trues.clone())),
                ("nodes_falsenodeids", Attr::Ints(trues)),
                ("nodes_values", Attr::Floats(vec![0.0; ids.len()])),
                ("nodes_modes", s(&vec!["BRANCH_LEQ"; ids.len()])),
                ("target_treeids", Attr::Ints(vec![0; w_ids.len()])),
                ("target_nodeids", Attr::Ints(vec![0; w_ids.len()])),
                ("target_ids", Attr::Ints(w_ids.clone())),
                ("target_weights", Attr::Floats(vec![1.0; w_ids.len()])),
            ])
        };
        // 0 -> 1 -> 0: no root.
        assert!(parse_v1(&base(vec![1, 0], vec![0, 1], vec![]), "target", 1).is_err());
        // A child that does not exist.
        assert!(parse_v1(&base(vec![7], vec![0], vec![]), "target", 1).is_err());
        // A target id past n_targets.
        assert!(parse_v1(&base(vec![], vec![], vec![3]), "target", 1).is_err());
        let mut n = base(vec![1, 0], vec![0, 1], vec![]);
        n.attrs.insert("nodes_values".into(), Attr::Floats(vec![0.0]));
        assert!(parse_v1(&n, "target", 1).is_err());
    }
}
