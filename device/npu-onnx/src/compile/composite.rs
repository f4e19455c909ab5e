//! Operators written as the operations ONNX defines them with, each
//! exactly (the same formula, in f32): `Swish`, `Tan`, `Sinh`, `Cosh`
//! (element-wise chains on the VU), `GlobalMaxPool`, `LpNormalization`,
//! `InstanceNormalization`, `GroupNormalization` (reductions and
//! broadcast arithmetic) and
//! `DepthToSpace`, `SpaceToDepth` (a reshape, a 6-axis transpose and a
//! reshape: one strided copy).

use std::collections::HashMap;

use npu_graph::Act;

use crate::load::{Attr, Node};
use crate::refusal::{invalid, unsupported, Refusal};

use super::{Compiler, NodeResult, Val};

impl Compiler<'_> {
    /// `Swish` (`x * sigmoid(alpha * x)`), `Tan` (`sin / cos`), `Sinh`
    /// and `Cosh` (`(exp(x) -+ exp(-x)) / 2`).
    pub(super) fn unary_chain(&mut self, n: &Node) -> NodeResult {
        let op = n.op.as_str();
        Self::only_attrs(n, if op == "Swish" { &["alpha"] } else { &[] })?;
        let x = self.computed(n, 0)?;
        let y = match op {
            "Swish" => {
                let alpha = Self::float_attr(n, "alpha", 1.0)?;
                let a = self.act_op(n, &x, Act::affine(alpha, 0.0));
                let s = self.act_op(n, &a, Act::Sigmoid);
                self.eltwise(n, false, &x, s.t)
            }
            "Tan" => {
                let s = self.act_op(n, &x, Act::Sin);
                let c = self.act_op(n, &x, Act::Cos);
                let r = self.act_op(n, &c, Act::Recip);
                self.eltwise(n, false, &s, r.t)
            }
            _ => {
                let sign = if op == "Sinh" { -0.5 } else { 0.5 };
                let e = self.act_op(n, &x, Act::Exp);
                let e = self.act_op(n, &e, Act::affine(0.5, 0.0));
                let m = self.act_op(n, &x, Act::affine(-1.0, 0.0));
                let m = self.act_op(n, &m, Act::Exp);
                let m = self.act_op(n, &m, Act::affine(sign, 0.0));
                self.eltwise(n, true, &e, m.t)
            }
        };
        Ok(vec![Val::D(y)])
    }

    /// `GlobalMaxPool`: the maximum over every axis after the channels.
    pub(super) fn global_max_pool(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let rank = self.shape_of(n, 0)?.len();
        if rank < 3 {
            return Err(invalid(format!("an input of rank {rank} (at least N, C and one more axis)")));
        }
        let x = n.inputs[0].clone();
        let axes = (2..rank as i64).collect();
        let attrs =
            HashMap::from([("axes".to_string(), Attr::Ints(axes)), ("keepdims".to_string(), Attr::Int(1))]);
        let y = self.step(n, "max", "ReduceMax", vec![x], attrs)?;
        self.result(&y)
    }

    /// `LpNormalization`: `x / norm_p(x)` along `axis` (`p` 1 or 2); a
    /// zero norm gives zeros, as ONNX defines it: the norm is first raised
    /// to the smallest normal f32 (1.2e-38), which changes no other norm
    /// but a subnormal one (and the division, a product with the
    /// reciprocal, would overflow on that anyway).
    pub(super) fn lp_normalization(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis", "p"])?;
        let reduce = match Self::int_attr(n, "p", 2)? {
            1 => "ReduceL1",
            2 => "ReduceL2",
            p => return Err(invalid(format!("p = {p} (1 or 2)"))),
        };
        let ax = Self::int_attr(n, "axis", -1)?;
        let x = n.inputs[0].clone();
        let attrs = HashMap::from([
            ("axes".to_string(), Attr::Ints(vec![ax])),
            ("keepdims".to_string(), Attr::Int(1)),
        ]);
        let norm = self.step(n, "norm", reduce, vec![x.clone()], attrs)?;
        let floor = self.stash_scalar(n, "floor", f32::MIN_POSITIVE);
        let norm = self.step(n, "norm_floor", "Max", vec![norm, floor], HashMap::new())?;
        let y = self.step(n, "y", "Div", vec![x, norm], HashMap::new())?;
        self.result(&y)
    }

    /// `InstanceNormalization` (each sample's channels normalized over
    /// their other axes) and `GroupNormalization` (opset 21: groups of
    /// channels normalized together):
    /// `(x - mean) / sqrt(var + epsilon) * scale + bias`, `scale` and
    /// `bias` per channel.
    pub(super) fn group_normalization(&mut self, n: &Node) -> NodeResult {
        let instance = n.op == "InstanceNormalization";
        Self::only_attrs(n, if instance { &["epsilon"] } else { &["epsilon", "num_groups", "stash_type"] })?;
        let eps = Self::float_attr(n, "epsilon", 1e-5)?;
        let shape = self.shape_of(n, 0)?;
        let rank = shape.len();
        if rank < 3 {
            return Err(invalid(format!("an input of rank {rank} (at least N, C and one more axis)")));
        }
        let c = shape[1];
        let groups = if instance {
            c
        } else {
            if self.m.opset < 21 {
                return Err(unsupported("GroupNormalization before opset 21 (a scale per group)"));
            }
            if Self::int_attr(n, "stash_type", 1)? != 1 {
                return Err(unsupported("a stash_type other than float (1)"));
            }
            match Self::int_attr(n, "num_groups", 0)? {
                g if g > 0 && c % g as usize == 0 => g as usize,
                g => return Err(invalid(format!("num_groups {g} for {c} channels"))),
            }
        };
        // `[C]` as `[C, 1, ...]`, to broadcast over the other axes.
        let mut per = vec![1usize; rank - 1];
        per[0] = c;
        let per_channel = |me: &mut Self, i: usize, tag: &str| -> Result<String, Refusal> {
            if me.shape_of(n, i)? != [c] {
                return Err(invalid(format!("input {i} of shape {:?} for {c} channels", me.shape_of(n, i)?)));
            }
            let shape = me.sizes(n, &format!("{tag}_shape"), &per);
            let v = n.inputs.get(i).cloned().ok_or_else(|| invalid(format!("input {i} is missing")))?;
            me.step(n, tag, "Reshape", vec![v, shape], HashMap::new())
        };
        let scale = per_channel(self, 1, "scale")?;
        let bias = per_channel(self, 2, "bias")?;
        let rest = shape[1..].iter().product::<usize>() / groups;
        let grouped = self.sizes(n, "grouped_shape", &[shape[0], groups, rest]);
        let x = n.inputs[0].clone();
        let none = HashMap::new;
        let xg = self.step(n, "grouped", "Reshape", vec![x, grouped], none())?;
        let last = || {
            HashMap::from([("axes".to_string(), Attr::Ints(vec![2])), ("keepdims".to_string(), Attr::Int(1))])
        };
        let mean = self.step(n, "mean", "ReduceMean", vec![xg.clone()], last())?;
        let d = self.step(n, "centered", "Sub", vec![xg, mean], none())?;
        let sq = self.step(n, "squared", "Mul", vec![d.clone(), d.clone()], none())?;
        let var = self.step(n, "var", "ReduceMean", vec![sq], last())?;
        let e = self.stash_scalar(n, "epsilon", eps);
        let ve = self.step(n, "var_eps", "Add", vec![var, e], none())?;
        let sd = self.step(n, "std", "Sqrt", vec![ve], none())?;
        let z = self.step(n, "normalized", "Div", vec![d, sd], none())?;
        let back = self.sizes(n, "shape", &shape);
        let z = self.step(n, "ungrouped", "Reshape", vec![z, back], none())?;
        let zs = self.step(n, "scaled", "Mul", vec![z, scale], none())?;
        let y = self.step(n, "y", "Add", vec![zs, bias], none())?;
        self.result(&y)
    }

    /// `DepthToSpace` (`DCR` or `CRD` mode) and `SpaceToDepth` of an
    /// `[N, C, H, W]` input: a reshape to six axes, a transpose, a reshape.
    pub(super) fn depth_space(&mut self, n: &Node) -> NodeResult {
        let to_space = n.op == "DepthToSpace";
        Self::only_attrs(n, &["blocksize", "mode"])?;
        let s = self.shape_of(n, 0)?;
        let [b0, c, h, w] = s[..] else {
            return Err(invalid(format!("an input of shape {s:?} (only [N, C, H, W])")));
        };
        let bs = Self::int_attr(n, "blocksize", 0)?;
        if bs < 1 {
            return Err(invalid(format!("blocksize {bs}")));
        }
        let k = bs as usize;
        let mode = match n.attrs.get("mode") {
            None => "DCR".to_string(),
            Some(Attr::Str(m)) => m.clone(),
            Some(_) => return Err(invalid("attribute `mode` must be a string")),
        };
        let (split, perm, out): (Vec<usize>, Vec<i64>, Vec<usize>) = if to_space {
            if c % (k * k) != 0 {
                return Err(invalid(format!("{c} channels for blocks of {k} x {k}")));
            }
            let cc = c / (k * k);
            match mode.as_str() {
                "DCR" => (vec![b0, k, k, cc, h, w], vec![0, 3, 4, 1, 5, 2], vec![b0, cc, h * k, w * k]),
                "CRD" => (vec![b0, cc, k, k, h, w], vec![0, 1, 4, 2, 5, 3], vec![b0, cc, h * k, w * k]),
                m => return Err(unsupported(format!("mode `{m}` (DCR or CRD)"))),
            }
        } else {
            if h % k != 0 || w % k != 0 {
                return Err(invalid(format!("{h} x {w} pixels for blocks of {k} x {k}")));
            }
            let perm = match mode.as_str() {
                "DCR" => vec![0, 3, 5, 1, 2, 4],
                "CRD" => vec![0, 1, 3, 5, 2, 4],
                m => return Err(unsupported(format!("mode `{m}` (DCR or CRD)"))),
            };
            (vec![b0, c, h / k, k, w / k, k], perm, vec![b0, c * k * k, h / k, w / k])
        };
        let s6 = self.sizes(n, "split", &split);
        let x = n.inputs[0].clone();
        let r = self.step(n, "six", "Reshape", vec![x, s6], HashMap::new())?;
        let t = self.step(
            n,
            "moved",
            "Transpose",
            vec![r],
            HashMap::from([("perm".to_string(), Attr::Ints(perm))]),
        )?;
        let s4 = self.sizes(n, "shape", &out);
        let y = self.step(n, "y", "Reshape", vec![t, s4], HashMap::new())?;
        self.result(&y)
    }

    /// `LpPool` as ONNX's reference computes it: the average pool of
    /// `|x|^p` (padding counted as zeros) times the window's size, to the power
    /// `1 / p` (`p` 1 and 2 by products and a square root, others as
    /// `exp(p log |x|)` and `exp(log(s) / p)`).
    pub(super) fn lp_pool(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["auto_pad", "ceil_mode", "dilations", "kernel_shape", "p", "pads", "strides"])?;
        let p = Self::int_attr(n, "p", 2)?;
        if p < 1 {
            return Err(invalid(format!("p = {p}")));
        }
        let kernel = Self::ints_attr(n, "kernel_shape")?.ok_or_else(|| invalid("kernel_shape is missing"))?;
        let k = kernel.iter().try_fold(1i64, |a, &d| a.checked_mul(d)).filter(|&k| k > 0);
        let k = k.ok_or_else(|| invalid(format!("kernel_shape {kernel:?}")))?;
        let none = HashMap::new;
        let x = n.inputs[0].clone();
        let a = self.step(n, "abs", "Abs", vec![x], none())?;
        // `exp(k log(v))` of the value named `v`.
        let power = |me: &mut Self, tag: &str, v: String, k: f32| -> Result<String, Refusal> {
            let l = me.step(n, &format!("{tag}_log"), "Log", vec![v], HashMap::new())?;
            let c = me.stash_scalar(n, &format!("{tag}_k"), k);
            let m = me.step(n, &format!("{tag}_scaled"), "Mul", vec![l, c], HashMap::new())?;
            me.step(n, tag, "Exp", vec![m], HashMap::new())
        };
        let powered = match p {
            1 => a,
            2 => self.step(n, "squared", "Mul", vec![a.clone(), a], none())?,
            _ => power(self, "powered", a, p as f32)?,
        };
        // Padding counts as zeros: the average is over the whole window.
        let mut attrs: HashMap<String, Attr> = n
            .attrs
            .iter()
            .filter(|(key, _)| key.as_str() != "p")
            .map(|(key, v)| (key.clone(), v.clone()))
            .collect();
        attrs.insert("count_include_pad".into(), Attr::Int(1));
        let avg = self.step(n, "average", "AveragePool", vec![powered], attrs)?;
        let kc = self.stash_scalar(n, "window", k as f32);
        let sum = self.step(n, "sum", "Mul", vec![avg, kc], none())?;
        let y = match p {
            1 => sum,
            2 => self.step(n, "y", "Sqrt", vec![sum], none())?,
            _ => power(self, "y", sum, 1.0 / p as f32)?,
        };
        self.result(&y)
    }

    /// `MaxPool` and `AveragePool` of any input the 2-D pooling takes, and
    /// of a 1-D `[N, C, L]` one as a `[N, C, 1, L]` image (its window,
    /// strides, pads and dilations given a first axis of 1).
    pub(super) fn pool_any(&mut self, n: &Node) -> NodeResult {
        let s = self.shape_of(n, 0)?;
        let [b, c, l] = s[..] else { return self.pool(n) };
        if n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return Err(unsupported("the Indices output is not supported"));
        }
        let mut attrs = HashMap::new();
        for (key, v) in &n.attrs {
            let widened = match (key.as_str(), v) {
                ("kernel_shape" | "strides" | "dilations", Attr::Ints(x)) if x.len() == 1 => {
                    Attr::Ints(vec![1, x[0]])
                }
                ("pads", Attr::Ints(x)) if x.len() == 2 => Attr::Ints(vec![0, x[0], 0, x[1]]),
                ("kernel_shape" | "strides" | "dilations" | "pads", _) => {
                    return Err(invalid(format!("attribute `{key}` does not fit a 1-D input")))
                }
                _ => v.clone(),
            };
            attrs.insert(key.clone(), widened);
        }
        let image = self.sizes(n, "image_shape", &[b, c, 1, l]);
        let x = n.inputs[0].clone();
        let r = self.step(n, "image", "Reshape", vec![x, image], HashMap::new())?;
        let pooled = self.step(n, "pooled", &n.op, vec![r], attrs)?;
        let out = self.value_shape(&pooled)?;
        let back = self.sizes(n, "shape", &[b, c, out[3]]);
        let y = self.step(n, "y", "Reshape", vec![pooled, back], HashMap::new())?;
        self.result(&y)
    }

    /// `Softmax` over any axis (opset 13 on): the axis moved last, the
    /// softmax, moved back.
    pub(super) fn softmax_any(&mut self, n: &Node) -> NodeResult {
        let rank = self.shape_of(n, 0)?.len();
        let default = if self.m.opset >= 13 { -1 } else { 1 };
        let a = Self::int_attr(n, "axis", default)?;
        let ax = super::axis(a, rank);
        match ax {
            Some(ax) if self.m.opset >= 13 && ax + 1 != rank && n.attrs.keys().all(|k| k == "axis") => {
                let mut perm: Vec<i64> = (0..rank as i64).collect();
                perm.swap(ax, rank - 1);
                let p = || HashMap::from([("perm".to_string(), Attr::Ints(perm.clone()))]);
                let x = n.inputs[0].clone();
                let t = self.step(n, "moved", "Transpose", vec![x], p())?;
                let last = HashMap::from([("axis".to_string(), Attr::Int(-1))]);
                let s = self.step(n, "softmax", "Softmax", vec![t], last)?;
                let y = self.step(n, "y", "Transpose", vec![s], p())?;
                self.result(&y)
            }
            _ => self.softmax(n),
        }
    }

    /// `MatMul` with a 1-D operand, as numpy takes it: a vector on the
    /// right is a column (its axis dropped from the product), on the left
    /// a row.
    pub(super) fn matmul_any(&mut self, n: &Node) -> NodeResult {
        let (sa, sb) = (self.shape_of(n, 0)?, self.shape_of(n, 1)?);
        if sa.len() != 1 && sb.len() != 1 {
            return self.matmul(n);
        }
        if sa.len() == 1 && sb.len() == 1 {
            return Err(unsupported("the product of two vectors (a scalar result)"));
        }
        let (mut a, mut b) = (n.inputs[0].clone(), n.inputs[1].clone());
        let none = HashMap::new;
        let out: Vec<usize> = if sb.len() == 1 {
            let col = self.sizes(n, "column", &[sb[0], 1]);
            b = self.step(n, "b", "Reshape", vec![b, col], none())?;
            sa[..sa.len() - 1].to_vec()
        } else {
            let row = self.sizes(n, "row", &[1, sa[0]]);
            a = self.step(n, "a", "Reshape", vec![a, row], none())?;
            let mut o = sb[..sb.len() - 2].to_vec();
            o.push(sb[sb.len() - 1]);
            o
        };
        let c = self.step(n, "product", "MatMul", vec![a, b], none())?;
        let shape = self.sizes(n, "shape", &out);
        let y = self.step(n, "y", "Reshape", vec![c, shape], none())?;
        self.result(&y)
    }

    /// `BatchNormalization` (inference) whose scale, bias, mean or
    /// variance is computed: `(x - mean) / sqrt(var + epsilon) * scale +
    /// bias`, each per channel (constant ones fold into one affine map:
    /// `Compiler::batch_norm`).
    pub(super) fn batch_norm_any(&mut self, n: &Node) -> NodeResult {
        let computed = (1..5).any(|i| matches!(self.opt(n, i), Some(Val::D(_))));
        if !computed {
            return self.batch_norm(n);
        }
        Self::only_attrs(n, &["epsilon", "momentum", "training_mode", "spatial"])?;
        if Self::int_attr(n, "training_mode", 0)? != 0 || n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return Err(unsupported("training mode (running statistics as outputs) is not supported"));
        }
        if n.attrs.contains_key("spatial") {
            return Err(unsupported("attribute `spatial` with computed statistics"));
        }
        let eps = Self::float_attr(n, "epsilon", 1e-5)?;
        let shape = self.shape_of(n, 0)?;
        let rank = shape.len();
        let c = *shape.get(1).ok_or_else(|| invalid("input of rank below 2"))?;
        let mut per = vec![1usize; rank - 1];
        per[0] = c;
        let per_shape = self.sizes(n, "per_channel", &per);
        let mut p = Vec::with_capacity(4);
        for (i, tag) in [(1, "scale"), (2, "bias"), (3, "mean"), (4, "var")] {
            if self.shape_of(n, i)? != [c] {
                return Err(invalid(format!(
                    "input {i} of shape {:?} for {c} channels",
                    self.shape_of(n, i)?
                )));
            }
            let v = n.inputs[i].clone();
            p.push(self.step(n, tag, "Reshape", vec![v, per_shape.clone()], HashMap::new())?);
        }
        let none = HashMap::new;
        let x = n.inputs[0].clone();
        let d = self.step(n, "centered", "Sub", vec![x, p[2].clone()], none())?;
        let e = self.stash_scalar(n, "epsilon", eps);
        let ve = self.step(n, "var_eps", "Add", vec![p[3].clone(), e], none())?;
        let sd = self.step(n, "std", "Sqrt", vec![ve], none())?;
        let z = self.step(n, "normalized", "Div", vec![d, sd], none())?;
        let zs = self.step(n, "scaled", "Mul", vec![z, p[0].clone()], none())?;
        let y = self.step(n, "y", "Add", vec![zs, p[1].clone()], none())?;
        self.result(&y)
    }

    /// `SwiGLU`: `a * sigmoid(alpha * a) * b` (`a` and `b` of one shape).
    pub(super) fn swiglu(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["alpha"])?;
        let alpha = Self::float_attr(n, "alpha", 1.0)?;
        let (sa, sb) = (self.shape_of(n, 0)?, self.shape_of(n, 1)?);
        if sa != sb {
            return Err(invalid(format!("A of shape {sa:?} and B of shape {sb:?} (one shape)")));
        }
        let a = self.computed(n, 0)?;
        let z = self.act_op(n, &a, Act::affine(alpha, 0.0));
        let g = self.act_op(n, &z, Act::Sigmoid);
        let swish = self.eltwise(n, false, &a, g.t);
        let name = self.stash(n, "swish", Val::D(swish));
        let b = n.inputs[1].clone();
        let y = self.step(n, "y", "Mul", vec![name, b], HashMap::new())?;
        self.result(&y)
    }

    /// `ReduceProd` over one axis of at most 64 elements (skl2onnx's
    /// PolynomialFeatures multiplies the columns of each term so): the
    /// product of the slices along it, taken in order, then kept as a
    /// dimension of 1 with `keepdims`. Folded on constants.
    pub(super) fn reduce_prod(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axes", "keepdims", "noop_with_empty_axes"])?;
        let shape = self.shape_of(n, 0)?;
        let rank = shape.len();
        let keep = Self::int_attr(n, "keepdims", 1)? != 0;
        let Some(axes) = self.reduce_axes(n, rank)? else { return self.result(&n.inputs[0]) };
        let [ax] = axes[..] else {
            return Err(unsupported("ReduceProd over more than one axis of a computed tensor"));
        };
        let r = shape[ax];
        if r == 0 || r > 64 {
            return Err(unsupported(format!(
                "ReduceProd over an axis of {r} elements (1 to 64 are compiled)"
            )));
        }
        let none = HashMap::new;
        let x = n.inputs[0].clone();
        // Slice j keeps the axis (of size 1), so the products keep it.
        let slice = |c: &mut Self, j: usize| -> Result<String, Refusal> {
            let j = j as i64;
            let attrs = HashMap::from([
                ("starts".to_string(), Attr::Ints(vec![j])),
                ("ends".to_string(), Attr::Ints(vec![j + 1])),
                ("axes".to_string(), Attr::Ints(vec![ax as i64])),
            ]);
            c.step(n, &format!("slice{j}"), "Slice", vec![x.clone()], attrs)
        };
        let mut p = slice(self, 0)?;
        for j in 1..r {
            let s = slice(self, j)?;
            p = self.step(n, &format!("product{j}"), "Mul", vec![p, s], none())?;
        }
        if !keep {
            let mut out = shape.clone();
            out.remove(ax);
            let dims = self.sizes(n, "shape", &out);
            p = self.step(n, "squeezed", "Reshape", vec![p, dims], none())?;
        }
        self.result(&p)
    }

    /// `Shrink` with `bias` equal to `lambd` (soft shrinkage):
    /// `relu(x - lambd) - relu(-x - lambd)`. Another bias needs a select.
    pub(super) fn shrink(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["bias", "lambd"])?;
        let bias = Self::float_attr(n, "bias", 0.0)?;
        let lambd = Self::float_attr(n, "lambd", 0.5)?;
        if bias != lambd {
            return Err(unsupported(format!(
                "bias {bias} other than lambd {lambd} (only soft shrinkage, bias = lambd)"
            )));
        }
        let x = self.computed(n, 0)?;
        let hi = self.act_op(n, &x, Act::affine(1.0, -lambd));
        let hi = self.act_op(n, &hi, Act::Relu);
        let lo = self.act_op(n, &x, Act::affine(-1.0, -lambd));
        let lo = self.act_op(n, &lo, Act::Relu);
        let lo = self.act_op(n, &lo, Act::affine(-1.0, 0.0));
        Ok(vec![Val::D(self.eltwise(n, true, &hi, lo.t))])
    }

    /// `LRN`: `x / (bias + alpha / size * s)^beta`, `s` the sum of squares
    /// over `size` neighbouring channels (a 1-D average pool over the
    /// channels, padding counted as zeros, times `size`).
    pub(super) fn lrn(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["alpha", "beta", "bias", "size"])?;
        let alpha = Self::float_attr(n, "alpha", 1e-4)?;
        let beta = Self::float_attr(n, "beta", 0.75)?;
        let bias = Self::float_attr(n, "bias", 1.0)?;
        let size = Self::int_attr(n, "size", 0)?;
        if size < 1 {
            return Err(invalid(format!("size {size}")));
        }
        let s = self.shape_of(n, 0)?;
        let [b, c, h, w] = s[..] else {
            return Err(invalid(format!("an input of shape {s:?} (only [N, C, H, W])")));
        };
        let none = HashMap::new;
        let perm = |p: Vec<i64>| HashMap::from([("perm".to_string(), Attr::Ints(p))]);
        let x = n.inputs[0].clone();
        let sq = self.step(n, "sq", "Mul", vec![x.clone(), x.clone()], none())?;
        let t = self.step(n, "channels_last", "Transpose", vec![sq], perm(vec![0, 2, 3, 1]))?;
        let rows = self.sizes(n, "rows", &[b * h * w, 1, c]);
        let r = self.step(n, "rows", "Reshape", vec![t, rows], none())?;
        let (before, after) = ((size - 1) / 2, size / 2);
        let pool = HashMap::from([
            ("kernel_shape".to_string(), Attr::Ints(vec![size])),
            ("pads".to_string(), Attr::Ints(vec![before, after])),
            ("count_include_pad".to_string(), Attr::Int(1)),
        ]);
        let avg = self.step(n, "window", "AveragePool", vec![r], pool)?;
        let k = self.stash_scalar(n, "size", size as f32);
        let sum = self.step(n, "sum", "Mul", vec![avg, k], none())?;
        let back = self.sizes(n, "image", &[b, h, w, c]);
        let sum = self.step(n, "image", "Reshape", vec![sum, back], none())?;
        let sum = self.step(n, "channels_first", "Transpose", vec![sum], perm(vec![0, 3, 1, 2]))?;
        let a = self.stash_scalar(n, "alpha", alpha / size as f32);
        let t = self.step(n, "scaled", "Mul", vec![sum, a], none())?;
        let bb = self.stash_scalar(n, "bias", bias);
        let t = self.step(n, "biased", "Add", vec![t, bb], none())?;
        let l = self.step(n, "log", "Log", vec![t], none())?;
        let be = self.stash_scalar(n, "beta", beta);
        let l = self.step(n, "log_beta", "Mul", vec![l, be], none())?;
        let d = self.step(n, "denominator", "Exp", vec![l], none())?;
        let y = self.step(n, "y", "Div", vec![x, d], none())?;
        self.result(&y)
    }

    /// `RotaryEmbedding` (opset 23) without `position_ids` (the caches
    /// given per batch and position, `[B, S, rotary_dim / 2]`): the first
    /// `rotary_embedding_dim` features of each head (split in halves, or
    /// even and odd ones when `interleaved`) rotated,
    /// `(x1 cos - x2 sin, x1 sin + x2 cos)`, the rest kept.
    pub(super) fn rotary_embedding(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["interleaved", "num_heads", "rotary_embedding_dim"])?;
        if self.opt(n, 3).is_some() {
            return Err(unsupported(
                "input `position_ids` is not supported (only caches per batch and position)",
            ));
        }
        let interleaved = Self::int_attr(n, "interleaved", 0)? != 0;
        let s = self.shape_of(n, 0)?;
        let (b, seq) = match s[..] {
            [b, _, sq, _] => (b, sq),
            [b, sq, _] => (b, sq),
            _ => return Err(invalid(format!("an input of shape {s:?} (3-D or 4-D)"))),
        };
        let none = HashMap::new;
        let x = n.inputs[0].clone();
        // [B, H, S, D] (4-D), or [B, S, H, D] from [B, S, H * D].
        let (x, d, cache_shape) = if s.len() == 4 {
            (x, s[3], vec![b as i64, 1, seq as i64, -1])
        } else {
            let h = match Self::int_attr(n, "num_heads", 0)? {
                h if h > 0 && s[2] % h as usize == 0 => h as usize,
                h => return Err(invalid(format!("num_heads {h} for a hidden size of {}", s[2]))),
            };
            let split = self.stash_ints(n, "heads", &[b as i64, seq as i64, h as i64, (s[2] / h) as i64]);
            let x = self.step(n, "heads", "Reshape", vec![x, split], none())?;
            (x, s[2] / h, vec![b as i64, seq as i64, 1, -1])
        };
        let rd = match Self::int_attr(n, "rotary_embedding_dim", 0)? {
            0 => d,
            r if r > 0 && r as usize <= d && r % 2 == 0 => r as usize,
            r => return Err(invalid(format!("rotary_embedding_dim {r} for heads of {d}"))),
        };
        let half = rd / 2;
        let mut caches = Vec::new();
        for (i, tag) in [(1, "cos"), (2, "sin")] {
            let cs = self.shape_of(n, i)?;
            if cs != [b, seq, half] {
                return Err(invalid(format!("{tag}_cache of shape {cs:?} (expected {:?})", [b, seq, half])));
            }
            let shape = self.stash_ints(n, &format!("{tag}_shape"), &cache_shape);
            let c = n.inputs[i].clone();
            caches.push(self.step(n, tag, "Reshape", vec![c, shape], none())?);
        }
        let (cos, sin) = (caches[0].clone(), caches[1].clone());
        let last = self.stash_ints(n, "last", &[-1]);
        let slice = |me: &mut Self, tag: &str, v: &str, from: usize, to: usize, step: usize| {
            let (a, e, st) = (
                me.stash_ints(n, &format!("{tag}_from"), &[from as i64]),
                me.stash_ints(n, &format!("{tag}_to"), &[to as i64]),
                me.stash_ints(n, &format!("{tag}_step"), &[step as i64]),
            );
            me.step(n, tag, "Slice", vec![v.to_string(), a, e, last.clone(), st], HashMap::new())
        };
        let (x1, x2) = if interleaved {
            (slice(self, "x1", &x, 0, rd, 2)?, slice(self, "x2", &x, 1, rd, 2)?)
        } else {
            (slice(self, "x1", &x, 0, half, 1)?, slice(self, "x2", &x, half, rd, 1)?)
        };
        let mul = |me: &mut Self, tag: &str, a: &str, b: &str| {
            me.step(n, tag, "Mul", vec![a.to_string(), b.to_string()], HashMap::new())
        };
        let (c1, s2) = (mul(self, "c1", &cos, &x1)?, mul(self, "s2", &sin, &x2)?);
        let real = self.step(n, "real", "Sub", vec![c1, s2], none())?;
        let (s1, c2) = (mul(self, "s1", &sin, &x1)?, mul(self, "c2", &cos, &x2)?);
        let imag = self.step(n, "imag", "Add", vec![s1, c2], none())?;
        let axis = |a: i64| HashMap::from([("axis".to_string(), Attr::Int(a))]);
        let xs = self.value_shape(&x)?;
        let mut rotated = if interleaved {
            // (real, imag) pairs: each as [..., half, 1], side by side.
            let mut pair = xs.iter().map(|&v| v as i64).collect::<Vec<_>>();
            pair[3] = half as i64;
            pair.push(1);
            let p = self.stash_ints(n, "pair", &pair);
            let r = self.step(n, "real_col", "Reshape", vec![real, p.clone()], none())?;
            let i = self.step(n, "imag_col", "Reshape", vec![imag, p], none())?;
            let both = self.step(n, "pairs", "Concat", vec![r, i], axis(-1))?;
            let mut flat = xs.iter().map(|&v| v as i64).collect::<Vec<_>>();
            flat[3] = rd as i64;
            let f = self.stash_ints(n, "flat", &flat);
            self.step(n, "rotated", "Reshape", vec![both, f], none())?
        } else {
            self.step(n, "rotated", "Concat", vec![real, imag], axis(-1))?
        };
        if rd < d {
            let kept = slice(self, "kept", &x, rd, d, 1)?;
            rotated = self.step(n, "whole", "Concat", vec![rotated, kept], axis(-1))?;
        }
        let y = if s.len() == 3 {
            let back = self.stash_ints(n, "shape", &s.iter().map(|&v| v as i64).collect::<Vec<_>>());
            self.step(n, "y", "Reshape", vec![rotated, back], none())?
        } else {
            rotated
        };
        self.result(&y)
    }
}
