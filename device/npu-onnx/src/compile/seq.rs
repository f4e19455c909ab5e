//! Sequence and transformer operators: `Transpose` as a strided view,
//! products of two computed tensors (attention), `LayerNormalization`,
//! `ReduceMean`, `Gelu`.
//!
//! A `Transpose` moves no data: it gives a *view*, the same tensor with
//! permuted strides ([`Dyn::strides`]). A batched `MatMul` reads views in
//! place (a head split `[N,S,H,D] -> [N,H,S,D]` is a row stride, `K^T` is
//! the product's `transpose_b`), a transpose of a product's result is
//! written by the product itself, and anything else that needs dense data
//! gets it from [`Compiler::materialize`] (strided DMA copies).

use crate::refusal::{invalid, unsupported, Refusal};
use std::collections::HashMap;

use npu_graph::{Act, Init, Op, RedOp, TensorId, View};

use super::{axis, elems, Compiler, Dyn, NodeResult, Val};
use crate::load::{Attr, Node};

/// Row-major element strides of `shape`.
pub(super) fn dense_strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * shape[i + 1];
    }
    st
}

/// Whether `strides` lay `shape` out densely (axes of extent 1 may have any stride).
fn is_dense(shape: &[usize], strides: &[usize]) -> bool {
    let d = dense_strides(shape);
    shape.iter().zip(strides.iter().zip(&d)).all(|(&s, (a, b))| s == 1 || a == b)
}

/// The multi-index of flat row-major position `i` in `shape`.
fn unflatten(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d].max(1);
        i /= shape[d].max(1);
    }
    idx
}

fn dot(a: &[usize], b: &[usize]) -> u64 {
    a.iter().zip(b).map(|(&x, &y)| (x * y) as u64).sum()
}

/// More DMA transfers than this for one materialised view is refused.
const MAX_COPIES: usize = 1 << 16;

/// Where a strided copy reads or writes: a tensor, the element offset of
/// index 0 in it, and the element stride of each axis.
#[derive(Clone, Copy)]
pub(super) struct Place<'a> {
    t: TensorId,
    off: usize,
    strides: &'a [usize],
}

impl<'a> Place<'a> {
    pub(super) fn new(t: TensorId, off: usize, strides: &'a [usize]) -> Self {
        Self { t, off, strides }
    }
}

pub(super) fn u32_of(v: usize, what: &str) -> Result<u32, Refusal> {
    u32::try_from(v).map_err(|_| unsupported(format!("{what} {v} does not fit 32 bits")))
}

impl Compiler<'_> {
    /// Element strides of each logical axis of `d` as it is stored.
    pub(super) fn strides_of(d: &Dyn) -> Vec<usize> {
        if let Some(s) = &d.strides {
            return s.clone();
        }
        match (d.nhwc, &d.shape[..]) {
            (true, &[_, c, h, w]) => vec![h * w * c, 1, w * c, c],
            _ => dense_strides(&d.shape),
        }
    }

    /// `d` stored densely in ONNX's order when it is a view.
    pub(super) fn materialize(&mut self, name: &str, d: &Dyn) -> Result<Dyn, Refusal> {
        let Some(st) = d.strides.clone() else { return Ok(d.clone()) };
        let y = self.act_tensor(&format!("{name}.dense"), elems(&d.shape));
        let dst = dense_strides(&d.shape);
        self.strided_copy(name, &d.shape, Place::new(d.t, 0, &st), Place::new(y, 0, &dst))?;
        Ok(Dyn::new(y, d.shape.clone(), None, false))
    }

    /// Copies the elements of a `shape` tensor from `from` to `to` by
    /// strided DMA transfers: axes that are adjacent in both layouts are
    /// merged, the innermost axis moves as one run when it is contiguous
    /// in both, and each transfer moves the rows of the longest remaining
    /// axis. A source stride may be 0 (a broadcast: the same elements are
    /// read again).
    pub(super) fn strided_copy(
        &mut self,
        name: &str,
        shape: &[usize],
        from: Place,
        to: Place,
    ) -> Result<(), Refusal> {
        let (x, y) = (from.t, to.t);
        if shape.contains(&0) {
            return Ok(());
        }
        // The axes in the destination's storage order (outermost first;
        // the order of the axes does not change what is copied), so that
        // a channels-last image's channels are the innermost run.
        let mut order: Vec<usize> = (0..shape.len()).filter(|&a| shape[a] > 1).collect();
        order.sort_by_key(|&a| std::cmp::Reverse((to.strides[a], from.strides[a])));
        // (extent, src stride, dst stride), extent-1 axes dropped, adjacent ones merged.
        let mut axes: Vec<(usize, usize, usize)> = Vec::new();
        for (e, s, d) in order.into_iter().map(|a| (shape[a], from.strides[a], to.strides[a])) {
            match axes.last_mut() {
                Some(p) if p.1 == s * e && p.2 == d * e => *p = (p.0 * e, s, d),
                _ => axes.push((e, s, d)),
            }
        }
        let run = match axes.last() {
            Some(&(e, 1, 1)) => {
                axes.pop();
                e
            }
            _ => 1,
        };
        let row = (0..axes.len()).max_by_key(|&a| axes[a].0);
        let (rows, src_ld, dst_ld) = row.map_or((1, 0, 0), |a| axes[a]);
        let loops: Vec<(usize, usize, usize)> =
            axes.iter().enumerate().filter(|&(a, _)| Some(a) != row).map(|(_, &v)| v).collect();
        let extents: Vec<usize> = loops.iter().map(|l| l.0).collect();
        let n = elems(&extents);
        if n > MAX_COPIES {
            return Err(invalid(format!(
                "re-laying out a {shape:?} tensor takes {n} DMA transfers (at most {MAX_COPIES})"
            )));
        }
        let name = format!("{name}.copy");
        let (rows, cols) = (u32_of(rows, "rows")?, u32_of(run, "columns")?);
        let (src_ld, dst_ld) = (u32_of(src_ld, "stride")?, u32_of(dst_ld, "stride")?);
        let (ss, ds): (Vec<usize>, Vec<usize>) = loops.iter().map(|l| (l.1, l.2)).unzip();
        for i in 0..n {
            let idx = unflatten(i, &extents);
            self.g.ops.push(Op::Copy {
                name: name.clone(),
                x: View { t: x, ld: src_ld, col: u32_of(from.off + dot(&idx, &ss) as usize, "offset")? },
                y: View { t: y, ld: dst_ld, col: u32_of(to.off + dot(&idx, &ds) as usize, "offset")? },
                rows,
                cols,
            });
        }
        Ok(())
    }

    /// `Transpose`: a view, or the product that wrote the input writes
    /// the transposed layout directly.
    /// `Transpose`'s `perm` for a tensor of `rank` axes (reversed when
    /// absent), checked to be a permutation.
    fn perm(n: &Node, rank: usize) -> Result<Vec<usize>, Refusal> {
        let perm: Vec<usize> = match Self::ints_attr(n, "perm")? {
            None => (0..rank).rev().collect(),
            Some(p) => p
                .iter()
                .map(|&a| axis(a, rank).ok_or_else(|| invalid("perm names a missing axis")))
                .collect::<Result<_, _>>()?,
        };
        let mut seen = vec![false; rank];
        if perm.len() != rank || perm.iter().any(|&a| std::mem::replace(&mut seen[a], true)) {
            return Err(invalid(format!("perm {perm:?} is not a permutation of {rank} axes")));
        }
        Ok(perm)
    }

    pub(super) fn transpose(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["perm"])?;
        if let Val::C(c) = self.get(n, 0)?.clone() {
            // A constant (a tied weight, transposed by the exporter): folded.
            let perm = Self::perm(n, c.shape.len())?;
            let st = dense_strides(&c.shape);
            let shape: Vec<usize> = perm.iter().map(|&a| c.shape[a]).collect();
            let src: Vec<usize> = perm.iter().map(|&a| st[a]).collect();
            let at: Vec<usize> = (0..elems(&shape))
                .map(|mut flat| {
                    let mut off = 0;
                    for (d, s) in shape.iter().zip(&src).rev() {
                        off += (flat % d) * s;
                        flat /= d;
                    }
                    off
                })
                .collect();
            self.report.folded += 1;
            let data = match &c.data {
                crate::load::Data::F32(v) => crate::load::Data::F32(at.iter().map(|&o| v[o]).collect()),
                crate::load::Data::I64(v) => crate::load::Data::I64(at.iter().map(|&o| v[o]).collect()),
            };
            return Ok(vec![Val::C(crate::load::Const { shape, data })]);
        }
        let d = self.computed_view(n, 0)?;
        let perm = Self::perm(n, d.shape.len())?;
        self.report.aliases += 1;
        let st = Self::strides_of(&d);
        let shape: Vec<usize> = perm.iter().map(|&a| d.shape[a]).collect();
        let strides: Vec<usize> = perm.iter().map(|&a| st[a]).collect();
        if is_dense(&shape, &strides) {
            return Ok(vec![Val::D(Dyn::new(d.t, shape, None, false))]);
        }
        if let Some(r) = self.transpose_into_product(&n.inputs[0], &d, &perm, &shape) {
            return Ok(vec![Val::D(r)]);
        }
        Ok(vec![Val::D(Dyn { t: d.t, shape, op: None, nhwc: false, strides: Some(strides) })])
    }

    /// Rewrites the batched product that wrote `d` (dense, read by nothing
    /// else) to store its result permuted by `perm`, when the product's
    /// columns stay the innermost axis.
    fn transpose_into_product(
        &mut self,
        input: &str,
        d: &Dyn,
        perm: &[usize],
        shape: &[usize],
    ) -> Option<Dyn> {
        if d.strides.is_some() || d.nhwc {
            return None;
        }
        let i = self.fusable(input, d)?;
        let rank = d.shape.len();
        // New dense stride of every old axis.
        let nd = dense_strides(shape);
        let mut old = vec![0; rank];
        for (new_axis, &a) in perm.iter().enumerate() {
            old[a] = nd[new_axis];
        }
        let batch = &d.shape[..rank - 2];
        let Op::BatchMatMul { ldy, offs, n, .. } = &mut self.g.ops[i] else { return None };
        if old[rank - 1] != 1 && *n > 1 {
            return None;
        }
        let new_ldy = u32::try_from(old[rank - 2]).ok()?;
        let new_offs: Vec<u64> =
            (0..offs.len()).map(|b| dot(&unflatten(b, batch), &old[..rank - 2])).collect();
        *ldy = new_ldy;
        for (o, y) in offs.iter_mut().zip(new_offs) {
            o[2] = y;
        }
        self.report.fused += 1;
        Some(Dyn::new(d.t, shape.to_vec(), None, false))
    }

    /// `MatMul` of two computed tensors: one batched product over the
    /// leading axes, operands read in place when their rows are strided
    /// and `B` read transposed when its columns are.
    pub(super) fn batch_matmul(&mut self, n: &Node) -> NodeResult {
        let mut a = self.computed_view(n, 0)?;
        let mut b = self.computed_view(n, 1)?;
        let (ra, rb) = (a.shape.len(), b.shape.len());
        if ra < 2 || rb < 2 {
            return Err(unsupported(format!(
                "products of {:?} and {:?} (both operands need 2 axes or more)",
                a.shape, b.shape
            )));
        }
        let batch = broadcast_batch(&a.shape[..ra - 2], &b.shape[..rb - 2]).ok_or_else(|| {
            invalid(format!(
                "the leading axes of {:?} and {:?} do not broadcast (numpy's rules)",
                a.shape, b.shape
            ))
        })?;
        let (m, k, kb, nn) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 2], b.shape[rb - 1]);
        if k != kb {
            return Err(invalid(format!("inner dimensions differ: {:?} x {:?}", a.shape, b.shape)));
        }
        // Broadcasting multiplies the leading axes of the two operands: the
        // result is refused before its per-matrix offsets are built.
        super::check_size(&[batch.as_slice(), &[m, nn]].concat())?;
        let mut sa = Self::strides_of(&a);
        if k > 1 && sa[ra - 1] != 1 {
            a = self.onnx_order(&n.name, &a)?;
            sa = dense_strides(&a.shape);
        }
        let mut sb = Self::strides_of(&b);
        if !(nn == 1 || sb[rb - 1] == 1 || k == 1 || sb[rb - 2] == 1) {
            b = self.onnx_order(&n.name, &b)?;
            sb = dense_strides(&b.shape);
        }
        let trans_b = !(nn == 1 || sb[rb - 1] == 1);
        let lda = if m == 1 { k } else { sa[ra - 2] };
        let ldb = match (trans_b, k == 1) {
            (true, _) => sb[rb - 1],
            (false, true) => nn,
            (false, false) => sb[rb - 2],
        };
        let count = elems(&batch);
        // Each operand's element stride per output batch axis: 0 where it
        // has no such axis or broadcasts a size of 1.
        let (wa, wb) = (
            batch_strides(&a.shape[..ra - 2], &sa[..ra - 2], &batch),
            batch_strides(&b.shape[..rb - 2], &sb[..rb - 2], &batch),
        );
        let offs = (0..count)
            .map(|i| {
                let idx = unflatten(i, &batch);
                [dot(&idx, &wa), dot(&idx, &wb), (i * m * nn) as u64]
            })
            .collect();
        let mut shape = batch;
        shape.extend([m, nn]);
        let y = self.act_tensor(&n.name, elems(&shape));
        self.g.ops.push(Op::BatchMatMul {
            name: n.name.clone(),
            a: a.t,
            b: b.t,
            y,
            lda: u32_of(lda, "row stride")?,
            ldb: u32_of(ldb, "row stride")?,
            ldy: u32_of(nn, "columns")?,
            trans_b,
            m: u32_of(m, "rows")?,
            k: u32_of(k, "inner dimension")?,
            n: u32_of(nn, "columns")?,
            offs,
            act: Act::None,
        });
        Ok(vec![Val::D(Dyn::new(y, shape, Some(self.g.ops.len() - 1), false))])
    }

    /// The attributes `LayerNormalization` and `RMSNormalization` share
    /// checked (`axis`, `stash_type` 1), and their `epsilon`.
    fn norm_epsilon(n: &Node) -> Result<f32, Refusal> {
        Self::only_attrs(n, &["axis", "epsilon", "stash_type"])?;
        if Self::int_attr(n, "stash_type", 1)? != 1 {
            return Err(unsupported("stash_type other than 1 (f32) is not supported"));
        }
        let eps = Self::float_attr(n, "epsilon", 1e-5)?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(invalid(format!("epsilon {eps} must be finite and not negative")));
        }
        Ok(eps)
    }

    /// `LayerNormalization` over the trailing axes from `axis`; the
    /// residual `Add` before it (its only reader) is fused in.
    pub(super) fn layer_norm(&mut self, n: &Node) -> NodeResult {
        let eps = Self::norm_epsilon(n)?;
        let x = self.dense(n, 0)?;
        let rank = x.shape.len();
        let ax = axis(Self::int_attr(n, "axis", -1)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let cols = elems(&x.shape[ax..]);
        let rows = elems(&x.shape[..ax]);
        // The Mean and InvStdDev outputs, when asked for: computed apart,
        // as ONNX defines them (the mean over the normalised axes, and
        // 1 / sqrt(mean((x - mean)^2) + epsilon)). They read `x`, so `x`
        // must stay what it is: the operations they add also keep the
        // residual sum below from being fused away (it must be the last).
        let stats = if n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            let (r32, c32) = (u32_of(rows, "rows")?, u32_of(cols, "columns")?);
            let kept: Vec<usize> = (0..rank).map(|i| if i < ax { x.shape[i] } else { 1 }).collect();
            let mean_of = |c: &mut Self, t: TensorId| {
                let m = c.act_tensor(&n.name, rows);
                c.g.ops.push(Op::GlobalPool { name: n.name.clone(), x: t, y: m, batch: r32, hw: c32, c: 1 });
                Dyn::new(m, kept.clone(), None, false)
            };
            let mean = mean_of(self, x.t);
            let wide = self.broadcast_to(&n.name, &mean, &x.shape, false)?;
            let neg = self.act_op(n, &wide, Act::affine(-1.0, 0.0));
            let centered = self.eltwise(n, true, &x, neg.t);
            let sq = self.eltwise(n, false, &centered, centered.t);
            let var = mean_of(self, sq.t);
            let v = self.act_op(n, &var, Act::affine(1.0, eps));
            let v = self.act_op(n, &v, Act::Sqrt);
            Some((mean, self.act_op(n, &v, Act::Recip)))
        } else {
            None
        };
        let param = |c: Option<&Val>, what: &str, fill: f32| -> Result<Vec<f32>, Refusal> {
            match c {
                None => Ok(vec![fill; cols]),
                Some(Val::C(c)) => {
                    let v = c.data.to_f32();
                    match v.len() {
                        1 => Ok(vec![v[0]; cols]),
                        l if l == cols => Ok(v),
                        _ => Err(invalid(format!(
                            "{what} of shape {:?} does not match the normalised {cols} values",
                            c.shape
                        ))),
                    }
                }
                Some(Val::D(_) | Val::I(_)) => {
                    Err(unsupported(format!("a computed {what} is not supported (only constants)")))
                }
            }
        };
        // A computed scale or bias is applied after the normalisation, as
        // a `Mul` / `Add` node would (numpy broadcasting).
        let computed_scale = matches!(self.get(n, 1)?, Val::D(_));
        let computed_bias = matches!(self.opt(n, 2), Some(Val::D(_)));
        let gamma =
            if computed_scale { vec![1.0; cols] } else { param(Some(self.get(n, 1)?), "scale", 1.0)? };
        let beta = if computed_bias { vec![0.0; cols] } else { param(self.opt(n, 2), "bias", 0.0)? };
        if computed_scale || computed_bias {
            let y = self.act_tensor(&n.name, elems(&x.shape));
            let (r32, c32) = (u32_of(rows, "rows")?, u32_of(cols, "columns")?);
            let gt = self.weight(&format!("{}.gamma", n.name), gamma, Init::Ones);
            let bt = self.weight(&format!("{}.beta", n.name), beta, Init::Zeros);
            self.g.ops.push(Op::AddNorm {
                name: n.name.clone(),
                a: x.t,
                b: None,
                gamma: gt,
                beta: bt,
                y,
                rows: r32,
                cols: c32,
                eps,
            });
            let mut v = Val::D(Dyn::new(y, x.shape.clone(), None, false));
            for (i, op) in [(1usize, "Mul"), (2, "Add")] {
                let Some(input) = n.inputs.get(i).filter(|s| !s.is_empty()) else { continue };
                let name = self.stash(n, &format!("{op}.in"), v);
                v = self.run_part(n, op, op, vec![name, input.clone()], HashMap::new())?;
            }
            let Val::D(y) = v else { return Err(unsupported("the layer norm folded to a constant")) };
            if y.shape != x.shape {
                return Err(invalid(format!("a scale or bias broadcasting the output to {:?}", y.shape)));
            }
            return Ok(with_stats(y, stats));
        }
        let gt = self.weight(&format!("{}.gamma", n.name), gamma, Init::Ones);
        let bt = self.weight(&format!("{}.beta", n.name), beta, Init::Zeros);
        let (r32, c32) = (u32_of(rows, "rows")?, u32_of(cols, "columns")?);
        // The residual sum that only this node reads: one operation.
        if let Some(i) = self.fusable(&n.inputs[0], &x) {
            if let Op::Add { a, b, y, cols: ac, act: Act::None, .. } = self.g.ops[i] {
                // Dense operands (the sum's own rows may be shorter).
                let dense = |v: View| v.col == 0 && v.ld == ac;
                if dense(a) && dense(b) && dense(y) {
                    self.g.ops[i] = Op::AddNorm {
                        name: n.name.clone(),
                        a: a.t,
                        b: Some(b.t),
                        gamma: gt,
                        beta: bt,
                        y: y.t,
                        rows: r32,
                        cols: c32,
                        eps,
                    };
                    self.report.fused += 1;
                    let y = Dyn::new(y.t, x.shape.clone(), None, false);
                    return Ok(with_stats(y, stats));
                }
            }
        }
        let y = self.act_tensor(&n.name, elems(&x.shape));
        self.g.ops.push(Op::AddNorm {
            name: n.name.clone(),
            a: x.t,
            b: None,
            gamma: gt,
            beta: bt,
            y,
            rows: r32,
            cols: c32,
            eps,
        });
        Ok(with_stats(Dyn::new(y, x.shape.clone(), None, false), stats))
    }
}

impl Compiler<'_> {
    /// `red` over the axes `first..=last` of the dense `x` (ONNX order),
    /// the reduced axes kept as ones.
    fn reduce_keep(
        &mut self,
        n: &Node,
        x: &Dyn,
        first: usize,
        last: usize,
        red: RedOp,
    ) -> Result<Dyn, Refusal> {
        let s = &x.shape;
        let (outer, reduce, inner) = (elems(&s[..first]), elems(&s[first..=last]), elems(&s[last + 1..]));
        let kept: Vec<usize> =
            s.iter().enumerate().map(|(i, &d)| if (first..=last).contains(&i) { 1 } else { d }).collect();
        let y = self.act_tensor(&n.name, outer * inner);
        self.g.ops.push(Op::Reduce {
            name: n.name.clone(),
            op: red,
            x: x.t,
            y,
            outer: u32_of(outer, "rows")?,
            reduce: u32_of(reduce, "reduced elements")?,
            inner: u32_of(inner, "columns")?,
        });
        Ok(Dyn::new(y, kept, None, false))
    }

    /// `x + b` (`add`) or `x * b` with `b`, of kept axes, broadcast to `x`.
    fn with_broadcast(&mut self, n: &Node, x: &Dyn, b: &Dyn, add: bool) -> Result<Dyn, Refusal> {
        let wide = self.broadcast_to(&n.name, b, &x.shape, false)?;
        Ok(self.eltwise(n, add, x, wide.t))
    }

    /// `LogSoftmax` as ONNX defines it, `x - max - log(sum(exp(x - max)))`
    /// over `axis` (from opset 13; before it, over the axes from `axis` to
    /// the last, as one).
    pub(super) fn log_softmax(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis"])?;
        let x = self.dense(n, 0)?;
        let rank = x.shape.len();
        let default = if self.m.opset >= 13 { -1 } else { 1 };
        let ax =
            axis(Self::int_attr(n, "axis", default)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let last = if self.m.opset >= 13 { ax } else { rank - 1 };
        let m = self.reduce_keep(n, &x, ax, last, RedOp::Max)?;
        let m = self.act_op(n, &m, Act::affine(-1.0, 0.0));
        let xm = self.with_broadcast(n, &x, &m, true)?;
        let e = self.act_op(n, &xm, Act::Exp);
        let s = self.reduce_keep(n, &e, ax, last, RedOp::Sum)?;
        let l = self.act_op(n, &s, Act::Log);
        let l = self.act_op(n, &l, Act::affine(-1.0, 0.0));
        Ok(vec![Val::D(self.with_broadcast(n, &xm, &l, true)?)])
    }

    /// `RMSNormalization`: `x / sqrt(mean(x^2) + epsilon) * scale` over the
    /// axes from `axis` to the last (`stash_type` 1), the scale broadcast
    /// as `Mul` broadcasts it.
    pub(super) fn rms_norm(&mut self, n: &Node) -> NodeResult {
        let eps = Self::norm_epsilon(n)?;
        let x = self.dense(n, 0)?;
        let rank = x.shape.len();
        let ax = axis(Self::int_attr(n, "axis", -1)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let sq = self.eltwise(n, false, &x, x.t);
        let ms = self.reduce_keep(n, &sq, ax, rank - 1, RedOp::Mean)?;
        let r = self.act_op(n, &ms, Act::affine(1.0, eps));
        let r = self.act_op(n, &r, Act::Sqrt);
        let r = self.act_op(n, &r, Act::Recip);
        let y = self.with_broadcast(n, &x, &r, false)?;
        let name = self.stash(n, "normed", Val::D(y));
        let scale = n
            .inputs
            .get(1)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| invalid("input 1 (the scale) is missing"))?;
        match self.run_part(n, "scale", "Mul", vec![name, scale.clone()], HashMap::new())? {
            Val::D(d) if d.shape == x.shape => Ok(vec![Val::D(d)]),
            _ => Err(invalid("a scale that broadcasts the output beyond the input's shape")),
        }
    }
}

/// A layer norm's outputs: `Y`, then `Mean` and `InvStdDev` when computed.
fn with_stats(y: Dyn, stats: Option<(Dyn, Dyn)>) -> Vec<Val> {
    let mut out = vec![Val::D(y)];
    if let Some((m, s)) = stats {
        out.push(Val::D(m));
        out.push(Val::D(s));
    }
    out
}

impl Compiler<'_> {
    /// `ReduceMean` over one run of adjacent axes (the pixels of a
    /// channels-last image, or any adjacent axes of a dense tensor).
    /// `ReduceMean`, `ReduceSum`, `ReduceMax`, `ReduceMin`, `ReduceL1`,
    /// `ReduceL2`, `ReduceSumSquare`, `ReduceLogSum`, `ReduceLogSumExp`
    /// over adjacent axes: a `vu.reduce` (mean, sum or max) with the
    /// element-wise steps around it that make the others (`min = -max(-x)`,
    /// `|x|`, `x * x`, `exp` before; `sqrt`, `log`, negation after).
    pub(super) fn reduce_mean(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axes", "keepdims", "noop_with_empty_axes"])?;
        let x = self.computed_view(n, 0)?;
        let rank = x.shape.len();
        let keep = Self::int_attr(n, "keepdims", 1)? != 0;
        let Some(axes) = self.reduce_axes(n, rank)? else {
            self.report.aliases += 1;
            return Ok(vec![Val::D(x)]);
        };
        let (first, last) = match (axes.first(), axes.last()) {
            (Some(&f), Some(&l)) if l - f + 1 == axes.len() => (f, l),
            _ => return Err(unsupported(format!("the reduced axes {axes:?} are not adjacent"))),
        };
        let out_shape: Vec<usize> = (0..rank)
            .filter_map(|i| if (first..=last).contains(&i) { keep.then_some(1) } else { Some(x.shape[i]) })
            .collect();
        // Channels-last images keep their storage: the pixels are adjacent there.
        let (x, outer, hw, inner, nhwc) = if x.nhwc && rank == 4 && (first, last) == (2, 3) {
            let [b, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
            (x, b, h * w, c, keep)
        } else {
            let x = self.onnx_order(&n.name, &x)?;
            let s = x.shape.clone();
            (x, elems(&s[..first]), elems(&s[first..=last]), elems(&s[last + 1..]), false)
        };
        let (outer, hw, inner) =
            (u32_of(outer, "rows")?, u32_of(hw, "reduced elements")?, u32_of(inner, "columns")?);
        let op = n.op.as_str();
        // The element-wise step before the reduction, the reduction, the step after.
        let (pre, red, post) = match op {
            "ReduceMean" => (None, RedOp::Mean, None),
            "ReduceSum" => (None, RedOp::Sum, None),
            "ReduceMax" => (None, RedOp::Max, None),
            "ReduceMin" => (Some(Act::affine(-1.0, 0.0)), RedOp::Max, Some(Act::affine(-1.0, 0.0))),
            "ReduceL1" => (Some(Act::Abs), RedOp::Sum, None),
            "ReduceL2" => (None, RedOp::Sum, Some(Act::Sqrt)),
            "ReduceSumSquare" => (None, RedOp::Sum, None),
            "ReduceLogSum" => (None, RedOp::Sum, Some(Act::Log)),
            _ => (Some(Act::Exp), RedOp::Sum, Some(Act::Log)),
        };
        let x = match pre {
            Some(a) => self.act_op(n, &x, a),
            None if matches!(op, "ReduceL2" | "ReduceSumSquare") => self.eltwise(n, false, &x, x.t),
            None => x,
        };
        let y = self.act_tensor(&n.name, outer as usize * inner as usize);
        let name = n.name.clone();
        self.g.ops.push(if red == RedOp::Mean {
            Op::GlobalPool { name, x: x.t, y, batch: outer, hw, c: inner }
        } else {
            Op::Reduce { name, op: red, x: x.t, y, outer, reduce: hw, inner }
        });
        let y = Dyn::new(y, out_shape, None, nhwc);
        Ok(vec![Val::D(match post {
            Some(a) => self.act_op(n, &y, a),
            None => y,
        })])
    }

    /// `Gelu`'s activation: exact (`approximate = "none"`) or tanh.
    pub(super) fn gelu(n: &Node) -> Result<Act, Refusal> {
        Self::only_attrs(n, &["approximate"])?;
        match n.attrs.get("approximate") {
            None => Ok(Act::GeluErf),
            Some(Attr::Str(s)) if s == "none" => Ok(Act::GeluErf),
            Some(Attr::Str(s)) if s == "tanh" => Ok(Act::Gelu),
            Some(Attr::Str(s)) => {
                Err(unsupported(format!("approximate `{s}` is not supported (none or tanh)")))
            }
            Some(_) => Err(invalid("attribute `approximate` must be a string")),
        }
    }
}

/// The batch axes of a product of operands with leading axes `a` and `b`
/// under numpy's broadcasting rules (axes aligned from the last, a missing
/// axis or a size of 1 takes the other's size), or `None` when two sizes
/// differ and neither is 1.
fn broadcast_batch(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let at = |s: &[usize], i: usize| if i + s.len() >= rank { s[i + s.len() - rank] } else { 1 };
    (0..rank)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y || y == 1 => Some(x),
            (1, y) => Some(y),
            _ => None,
        })
        .collect()
}

/// The element strides, per axis of the broadcast `batch`, of an operand
/// whose leading axes are `shape` with strides `strides`: 0 on the axes it
/// lacks or broadcasts.
fn batch_strides(shape: &[usize], strides: &[usize], batch: &[usize]) -> Vec<usize> {
    let skip = batch.len() - shape.len();
    (0..batch.len()).map(|i| if i < skip || shape[i - skip] == 1 { 0 } else { strides[i - skip] }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_indices() {
        assert_eq!(dense_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert!(is_dense(&[2, 1, 4], &[4, 99, 1]));
        assert!(!is_dense(&[2, 3], &[1, 2]));
        assert_eq!(unflatten(5, &[2, 3]), vec![1, 2]);
        assert_eq!(dot(&[1, 2], &[10, 1]), 12);
    }

    #[test]
    fn batch_axes_broadcast_by_numpy_rules() {
        assert_eq!(broadcast_batch(&[3, 4], &[3, 1]), Some(vec![3, 4]));
        assert_eq!(broadcast_batch(&[3, 1], &[3, 4]), Some(vec![3, 4]));
        assert_eq!(broadcast_batch(&[2, 3, 4], &[4]), Some(vec![2, 3, 4]));
        assert_eq!(broadcast_batch(&[], &[5]), Some(vec![5]));
        assert_eq!(broadcast_batch(&[3, 4], &[3, 2]), None);
        // An operand's strides on the broadcast batch: 0 where it lacks
        // the axis or has a size of 1.
        assert_eq!(batch_strides(&[3, 1], &[24, 24], &[3, 4]), vec![24, 0]);
        assert_eq!(batch_strides(&[4], &[6], &[2, 3, 4]), vec![0, 0, 6]);
    }
}
