//! Comparisons, logic and selection on computed tensors: `Equal`,
//! `Less`, `LessOrEqual`, `Greater`, `GreaterOrEqual`, `Not`, `And`, `Or`,
//! `Xor`, `Where`, `IsNaN`, `IsInf`, and `Cast` to bool. A boolean is
//! stored as an f32 `0.0` or `1.0` (what `vu.binary`'s comparisons
//! write), so every boolean the compiler makes is exactly 0 or 1: a
//! comparison's result, a cast to bool (`x != 0`), a constant. `Where` is
//! `keep(c, x) + keep(not c, y)`: one of the two terms is `+0.0`, so the
//! other goes through unchanged, infinities and NaN included.

use npu_graph::{Act, Op, View};
use vnpu_abi::BinOp;

use crate::load::Node;
use crate::refusal::{invalid, unsupported, Refusal};

use super::{bcast_shape, check_size, elems, expand, Compiler, Dyn, NodeResult, Val};
use crate::load::{Const, Data};

/// Largest integer an f32 holds exactly: integer constants compared on
/// the device must be within it.
const EXACT_INT: i64 = 1 << 24;

impl Compiler<'_> {
    /// Input `i` of `n` as a dense f32 tensor of `shape` (broadcast to it
    /// by numpy's rules): a constant becomes a tensor of the compiled
    /// model; an integer tensor computed on the device is refused.
    fn operand(&mut self, n: &Node, i: usize, shape: &[usize]) -> Result<Dyn, Refusal> {
        match self.get(n, i)?.clone() {
            Val::C(c) => {
                if let Data::I64(v) = &c.data {
                    if v.iter().any(|x| x.abs() > EXACT_INT) {
                        return Err(unsupported(format!(
                            "input {i} holds integers beyond 2^24, which the device compares as f32"
                        )));
                    }
                }
                if bcast_shape(&c.shape, shape).as_deref() != Some(shape) {
                    return Err(invalid(format!("shapes {:?} and {shape:?} do not broadcast", c.shape)));
                }
                let data = expand(&c.data.to_f32(), &c.shape, shape);
                let t = self.weight(&format!("{}.c{i}", n.name), data, npu_graph::Init::Bias);
                Ok(Dyn::new(t, shape.to_vec(), None, false))
            }
            Val::D(_) | Val::I(_) => {
                // An integer tensor (a model's integer input, an ArgMax) is
                // compared as the f32 of its values: exact, as device
                // integers stay within +-2^24 (`vu.unary i32_to_f32`).
                let d = match self.get(n, i)?.clone() {
                    Val::I(int) => {
                        let dense = self.onnx_order(&n.name, &int)?;
                        self.act_op(n, &dense, npu_graph::Act::I32ToF32)
                    }
                    _ => self.dense(n, i)?,
                };
                if d.shape == shape {
                    return Ok(d);
                }
                if bcast_shape(&d.shape, shape).as_deref() != Some(shape) {
                    return Err(invalid(format!("shapes {:?} and {shape:?} do not broadcast", d.shape)));
                }
                let b = self.broadcast_to(&n.name, &d, shape, false)?;
                self.onnx_order(&n.name, &b)
            }
        }
    }

    /// `y = a op b` element-wise over dense tensors of one shape.
    fn compare_op(&mut self, n: &Node, op: BinOp, a: &Dyn, b: &Dyn) -> Dyn {
        let cols = (*a.shape.last().unwrap_or(&1)).max(1);
        let rows = elems(&a.shape) / cols;
        let y = self.act_tensor(&n.name, elems(&a.shape));
        let c32 = cols as u32;
        self.g.ops.push(Op::Compare {
            name: n.name.clone(),
            op,
            a: View::dense(a.t, c32),
            b: View::dense(b.t, c32),
            y: View::dense(y, c32),
            rows: rows as u32,
            cols: c32,
        });
        Dyn::new(y, a.shape.clone(), None, false)
    }

    /// A constant tensor of `shape` holding each element's index along
    /// axis `ax`.
    fn iota(&mut self, n: &Node, shape: &[usize], ax: usize) -> Dyn {
        let (outer, dim, inner) = (elems(&shape[..ax]), shape[ax], elems(&shape[ax + 1..]));
        let mut v = Vec::with_capacity(elems(shape));
        for _ in 0..outer {
            for j in 0..dim {
                v.extend(std::iter::repeat_n(j as f32, inner));
            }
        }
        let t = self.weight(&format!("{}.iota", n.name), v, npu_graph::Init::Bias);
        Dyn::new(t, shape.to_vec(), None, false)
    }

    /// A scalar constant tensor of `shape`, all `v`.
    fn filled(&mut self, n: &Node, tag: &str, shape: &[usize], v: f32) -> Dyn {
        let t = self.weight(&format!("{}.{tag}", n.name), vec![v; elems(shape)], npu_graph::Init::Bias);
        Dyn::new(t, shape.to_vec(), None, false)
    }

    /// The shape inputs `ins` of `n` broadcast to (numpy's rules).
    fn out_shape(&self, n: &Node, ins: &[usize]) -> Result<Vec<usize>, Refusal> {
        let mut shape: Vec<usize> = Vec::new();
        for &i in ins {
            let s = self.shape_of(n, i)?;
            shape = bcast_shape(&shape, &s)
                .ok_or_else(|| invalid(format!("shapes {shape:?} and {s:?} do not broadcast")))?;
        }
        check_size(&shape)?;
        Ok(shape)
    }

    /// `Equal`, `Less`, `LessOrEqual`, `Greater`, `GreaterOrEqual`, `And`,
    /// `Or`, `Xor` with a computed input.
    pub(super) fn compare(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let shape = self.out_shape(n, &[0, 1])?;
        let (a, b) = (self.operand(n, 0, &shape)?, self.operand(n, 1, &shape)?);
        let op = match n.op.as_str() {
            "Equal" => BinOp::Eq,
            "Less" => BinOp::Lt,
            "LessOrEqual" => BinOp::Le,
            "Greater" => BinOp::Gt,
            "GreaterOrEqual" => BinOp::Ge,
            // Booleans are 0 or 1: `and` keeps b where a holds, `or` is the
            // larger, `xor` is "differ".
            "And" => BinOp::Keep,
            "Xor" => BinOp::Ne,
            "Or" => {
                let y = self.pair(n, false, &a, &b);
                return Ok(vec![Val::D(y)]);
            }
            op => return Err(unsupported(format!("`{op}` is not a comparison"))),
        };
        Ok(vec![Val::D(self.compare_op(n, op, &a, &b))])
    }

    /// `Not` of a computed boolean: `x == 0`.
    pub(super) fn not(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let shape = self.shape_of(n, 0)?;
        let x = self.operand(n, 0, &shape)?;
        let zero = self.filled(n, "zero", &shape, 0.0);
        Ok(vec![Val::D(self.compare_op(n, BinOp::Eq, &x, &zero))])
    }

    /// `Where(c, x, y)` with a computed input: `keep(c, x) + keep(c == 0,
    /// y)`. Integer branches (a selection of indices) are refused: the
    /// result would be an integer tensor, which is not computed here.
    pub(super) fn select(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        for i in [1, 2] {
            let int = matches!(self.get(n, i)?, Val::C(Const { data: Data::I64(_), .. }) | Val::I(_));
            if int {
                return Err(unsupported(format!(
                    "input {i} is an integer tensor: Where of integer branches is not computed on the device"
                )));
            }
        }
        let shape = self.out_shape(n, &[0, 1, 2])?;
        let c = self.operand(n, 0, &shape)?;
        let x = self.operand(n, 1, &shape)?;
        let y = self.operand(n, 2, &shape)?;
        let kx = self.compare_op(n, BinOp::Keep, &c, &x);
        let zero = self.filled(n, "zero", &shape, 0.0);
        let not_c = self.compare_op(n, BinOp::Eq, &c, &zero);
        let ky = self.compare_op(n, BinOp::Keep, &not_c, &y);
        let out = self.pair(n, true, &kx, &ky);
        Ok(vec![Val::D(out)])
    }

    /// `IsNaN` (`x != x`) and `IsInf` (`|x| == inf`, or `x == +inf` or
    /// `x == -inf` when only one sign is detected).
    pub(super) fn is_special(&mut self, n: &Node) -> NodeResult {
        let shape = self.shape_of(n, 0)?;
        if n.op == "IsNaN" {
            Self::only_attrs(n, &[])?;
            let x = self.operand(n, 0, &shape)?;
            return Ok(vec![Val::D(self.compare_op(n, BinOp::Ne, &x, &x))]);
        }
        Self::only_attrs(n, &["detect_negative", "detect_positive"])?;
        let neg = Self::int_attr(n, "detect_negative", 1)? != 0;
        let pos = Self::int_attr(n, "detect_positive", 1)? != 0;
        let x = self.operand(n, 0, &shape)?;
        let y = match (neg, pos) {
            (true, true) => {
                let a = self.act_op(n, &x, Act::Abs);
                let inf = self.filled(n, "inf", &shape, f32::INFINITY);
                self.compare_op(n, BinOp::Eq, &a, &inf)
            }
            (false, true) | (true, false) => {
                let inf = self.filled(n, "inf", &shape, if pos { f32::INFINITY } else { f32::NEG_INFINITY });
                self.compare_op(n, BinOp::Eq, &x, &inf)
            }
            (false, false) => {
                // Nothing is detected: all false.
                let zero = self.filled(n, "zero", &shape, 0.0);
                self.compare_op(n, BinOp::Ne, &zero, &zero)
            }
        };
        Ok(vec![Val::D(y)])
    }

    /// A computed tensor cast to bool: `x != 0` (a NaN is true, as ONNX
    /// casts it); an integer tensor is converted to f32 first (no nonzero
    /// i32 converts to zero).
    pub(super) fn cast_to_bool(&mut self, n: &Node, v: &Val) -> Result<Dyn, Refusal> {
        let x = match v {
            Val::I(d) => self.act_op(n, d, Act::I32ToF32),
            Val::D(_) => self.dense(n, 0)?,
            Val::C(_) => return Err(invalid("a constant is folded, not cast on the device")),
        };
        let zero = self.filled(n, "zero", &x.shape, 0.0);
        Ok(self.compare_op(n, BinOp::Ne, &x, &zero))
    }
}

impl Compiler<'_> {
    /// Rows of computed tensor `d`, viewed as `[rows][inner]`, gathered by
    /// the constant row numbers `ids` into a tensor of `shape`: one
    /// `dma.gather` (`Op::Embedding` with a constant index tensor).
    pub(super) fn gather_rows(
        &mut self,
        n: &Node,
        d: &Dyn,
        rows: usize,
        inner: usize,
        ids: &[usize],
        shape: Vec<usize>,
    ) -> NodeResult {
        // The row numbers as the u32s `dma.gather` reads (their bits in an
        // f32 tensor: the weight image keeps them as they are). Numbers past
        // u32 are refused by `gather_op` (the table has fewer rows).
        let bits: Vec<f32> = ids.iter().map(|&i| f32::from_bits(i as u32)).collect();
        let idx = self.weight(&format!("{}.idx", n.name), bits, npu_graph::Init::Bias);
        self.gather_op(n, d.t, rows, inner, idx, ids.len(), shape)
    }

    /// `count` rows of `inner` f32 elements of `table` (`rows` of them)
    /// gathered by the u32 row numbers in `idx` into a new tensor of
    /// `shape`: one `dma.gather` (`Op::Embedding`, a bag of one row),
    /// which checks every number against `rows` when it runs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather_op(
        &mut self,
        n: &Node,
        table: npu_graph::TensorId,
        rows: usize,
        inner: usize,
        idx: npu_graph::TensorId,
        count: usize,
        shape: Vec<usize>,
    ) -> NodeResult {
        check_size(&shape)?;
        let fits = |v: usize| u32::try_from(v).ok();
        let (Some(rows32), Some(inner32), Some(count32)) = (fits(rows), fits(inner), fits(count)) else {
            return Err(unsupported("a table or an index tensor too large for one dma.gather"));
        };
        if rows == 0 || inner == 0 || count == 0 || inner32.checked_mul(4).is_none() {
            return Err(unsupported(format!(
                "a gather of {count} rows of {inner} elements from {rows} (empty, or rows too long for one dma.gather)"
            )));
        }
        let y = self.act_tensor(&n.name, count * inner);
        self.g.ops.push(Op::Embedding {
            name: n.name.clone(),
            table,
            idx,
            y: View::dense(y, inner32),
            batch: count32,
            rows: rows32,
            dim: inner32,
            pool: 1,
        });
        Ok(vec![Val::D(Dyn::new(y, shape, None, false))])
    }

    /// `Gather` of a computed tensor by constant indices, any axis.
    pub(super) fn gather_computed(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis"])?;
        // An integer tensor is gathered as its i32s, moved as they are
        // (skl2onnx's OneHotEncoder export takes each column of an int64
        // input so); the result is an integer tensor again.
        let (d, int) = match self.get(n, 0)?.clone() {
            Val::I(i) => {
                let m = self.materialize(&n.name, &i)?;
                (self.onnx_order(&n.name, &m)?, true)
            }
            _ => (self.dense(n, 0)?, false),
        };
        let idx = self.konst(n, 1)?;
        let rank = d.shape.len();
        let ax =
            super::axis(Self::int_attr(n, "axis", 0)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let (outer, dim, inner) = (elems(&d.shape[..ax]), d.shape[ax], elems(&d.shape[ax + 1..]));
        let mut ids = Vec::new();
        let picks: Vec<usize> =
            idx.data.to_i64().iter().map(|&i| super::index_in(i, dim)).collect::<Result<_, _>>()?;
        for o in 0..outer {
            ids.extend(picks.iter().map(|&i| o * dim + i));
        }
        let mut shape = d.shape[..ax].to_vec();
        shape.extend_from_slice(&idx.shape);
        shape.extend_from_slice(&d.shape[ax + 1..]);
        let r = self.gather_rows(n, &d, outer * dim, inner, &ids, shape)?;
        Ok(if int {
            r.into_iter().map(|v| if let Val::D(g) = v { Val::I(g) } else { v }).collect()
        } else {
            r
        })
    }

    /// `GatherND` of a computed tensor by constant indices (`batch_dims`
    /// 0): each index tuple names a row of the data viewed as
    /// `[rows of the first r axes][the rest]`.
    pub(super) fn gather_nd_computed(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["batch_dims"])?;
        if Self::int_attr(n, "batch_dims", 0)? != 0 {
            return Err(unsupported("GatherND with batch_dims other than 0 on a computed tensor"));
        }
        let d = self.dense(n, 0)?;
        let idx = self.konst(n, 1)?;
        let r = *idx.shape.last().ok_or_else(|| invalid("indices of rank 0"))?;
        if r == 0 || r > d.shape.len() {
            return Err(invalid(format!("index tuples of {r} for data of rank {}", d.shape.len())));
        }
        let (lead, inner) = (&d.shape[..r], elems(&d.shape[r..]));
        let v = idx.data.to_i64();
        let mut ids = Vec::with_capacity(v.len() / r);
        for t in v.chunks(r) {
            let mut row = 0usize;
            for (&i, &dim) in t.iter().zip(lead) {
                row = row * dim + super::index_in(i, dim)?;
            }
            ids.push(row);
        }
        let mut shape = idx.shape[..idx.shape.len() - 1].to_vec();
        shape.extend_from_slice(&d.shape[r..]);
        self.gather_rows(n, &d, elems(lead), inner, &ids, shape)
    }
}

impl Compiler<'_> {
    /// `ArgMax` and `ArgMin` (`axis`, `keepdims`, `select_last_index`):
    /// the candidates are the elements equal to the extreme of their
    /// slice, or NaN (numpy's argmax picks the first NaN, and a slice with
    /// a NaN has a NaN maximum, equal to nothing); each candidate keeps
    /// its index, the others a value past the last, and the smallest (the
    /// largest with `select_last_index`) is the answer, converted to an
    /// integer tensor (`vu.unary f32_to_i32`).
    pub(super) fn arg_extreme(&mut self, n: &Node) -> NodeResult {
        use std::collections::HashMap;

        use crate::load::Attr;
        Self::only_attrs(n, &["axis", "keepdims", "select_last_index"])?;
        let x = self.dense(n, 0)?;
        let rank = x.shape.len();
        let ax =
            super::axis(Self::int_attr(n, "axis", 0)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let keep = Self::int_attr(n, "keepdims", 1)? != 0;
        let last = Self::int_attr(n, "select_last_index", 0)? != 0;
        let dim = x.shape[ax];
        if dim > EXACT_INT as usize {
            return Err(unsupported("an axis longer than 2^24 (its indices are computed as f32)"));
        }
        // ArgMin is ArgMax of -x (NaN stays NaN).
        let x = if n.op == "ArgMin" { self.act_op(n, &x, Act::affine(-1.0, 0.0)) } else { x };
        let xs = self.stash(n, "x", Val::D(x.clone()));
        let attrs = |k: bool| {
            HashMap::from([
                ("axes".to_string(), Attr::Ints(vec![ax as i64])),
                ("keepdims".to_string(), Attr::Int(i64::from(k))),
            ])
        };
        let Val::D(m) = self.run_part(n, "max", "ReduceMax", vec![xs], attrs(true))? else {
            return Err(invalid("the maximum folded to a constant"));
        };
        let m = self.broadcast_to(&n.name, &m, &x.shape, false)?;
        let m = self.onnx_order(&n.name, &m)?;
        let eq = self.compare_op(n, BinOp::Eq, &x, &m);
        let nan = self.compare_op(n, BinOp::Ne, &x, &x);
        let cand = self.pair(n, false, &eq, &nan);
        // Each element's index along the axis, and what a non-candidate gets.
        let iota = self.iota(n, &x.shape, ax);
        let other = self.filled(n, "past", &x.shape, if last { -1.0 } else { dim as f32 });
        let keep_i = self.compare_op(n, BinOp::Keep, &cand, &iota);
        let zero = self.filled(n, "zero", &x.shape, 0.0);
        let not_cand = self.compare_op(n, BinOp::Eq, &cand, &zero);
        let keep_o = self.compare_op(n, BinOp::Keep, &not_cand, &other);
        let picked = self.pair(n, true, &keep_i, &keep_o);
        let ps = self.stash(n, "picked", Val::D(picked));
        let reduce = if last { "ReduceMax" } else { "ReduceMin" };
        let Val::D(r) = self.run_part(n, "pick", reduce, vec![ps], attrs(keep))? else {
            return Err(invalid("the index folded to a constant"));
        };
        let r = self.onnx_order(&n.name, &r)?;
        let i = self.act_op(n, &r, Act::F32ToI32);
        Ok(vec![Val::I(Dyn { op: None, ..i })])
    }
}

/// Most elements `TopK` may return per slice (it is unrolled: a dozen
/// operations each).
const MAX_TOPK: usize = 256;

impl Compiler<'_> {
    /// `Max(a, b)` or `Add(a, b)` of two dense tensors of one shape.
    fn pair(&mut self, n: &Node, add: bool, a: &Dyn, b: &Dyn) -> Dyn {
        let y = self.elementwise(n, a, b.t, |name, a, b, y, rows, cols| {
            if add {
                Op::Add { name, a, b, y, rows, cols, act: Act::None }
            } else {
                Op::Max { name, a, b, y, rows, cols, act: Act::None }
            }
        });
        Dyn { op: None, ..y }
    }

    /// A reduction (`ReduceMax` or `ReduceMin`) of `x` over `axis`, kept.
    fn reduce_axis(&mut self, n: &Node, tag: &str, op: &str, x: &Dyn, ax: usize) -> Result<Dyn, Refusal> {
        use std::collections::HashMap;

        use crate::load::Attr;
        let xs = self.stash(n, tag, Val::D(x.clone()));
        let attrs = HashMap::from([
            ("axes".to_string(), Attr::Ints(vec![ax as i64])),
            ("keepdims".to_string(), Attr::Int(1)),
        ]);
        let Val::D(r) = self.run_part(n, tag, op, vec![xs], attrs)? else {
            return Err(invalid("a reduction folded to a constant"));
        };
        self.onnx_order(&n.name, &r)
    }

    /// `d` (a reduction, kept) broadcast back to `shape`, dense.
    fn spread(&mut self, n: &Node, d: &Dyn, shape: &[usize]) -> Result<Dyn, Refusal> {
        let b = self.broadcast_to(&n.name, d, shape, false)?;
        self.onnx_order(&n.name, &b)
    }

    /// `TopK` with a constant `K` (at most [`MAX_TOPK`]): `K` rounds, each
    /// taking the largest element not taken yet of every slice (a NaN
    /// counts as the largest; the first of equal ones), its value and its
    /// index; `largest = 0` takes the smallest (of `-x`). The values are
    /// sorted, as `sorted = 1` asks and `sorted = 0` allows.
    pub(super) fn top_k(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis", "largest", "sorted", "k"])?;
        let x = self.dense(n, 0)?;
        // K: an input from opset 10, an attribute before.
        let k = match self.opt(n, 1) {
            Some(_) => self.konst(n, 1)?.data.to_i64(),
            None => vec![Self::int_attr(n, "k", -1)?],
        };
        let rank = x.shape.len();
        let ax =
            super::axis(Self::int_attr(n, "axis", -1)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let dim = x.shape[ax];
        let k = match k[..] {
            [k] => usize::try_from(k).map_err(|_| invalid(format!("K = {k}")))?,
            _ => return Err(invalid("K must be one value")),
        };
        if k > dim {
            return Err(invalid(format!("K = {k} is more than the axis's {dim} elements")));
        }
        if k == 0 || k > MAX_TOPK || dim > EXACT_INT as usize {
            return Err(unsupported(format!("K = {k} (1 to {MAX_TOPK}) on an axis of at most 2^24")));
        }
        let neg = Self::int_attr(n, "largest", 1)? == 0;
        let x = if neg { self.act_op(n, &x, Act::affine(-1.0, 0.0)) } else { x };
        let iota = self.iota(n, &x.shape, ax);
        let zero = self.filled(n, "zero", &x.shape, 0.0);
        let ninf = self.filled(n, "ninf", &x.shape, f32::NEG_INFINITY);
        let past = self.filled(n, "past", &x.shape, dim as f32);
        let isnan = self.compare_op(n, BinOp::Ne, &x, &x);
        let mut taken = zero.clone();
        let (mut values, mut indices) = (Vec::new(), Vec::new());
        for r in 0..k {
            // What is left: taken elements as -inf (never a candidate).
            let free = self.compare_op(n, BinOp::Eq, &taken, &zero);
            let kept = self.compare_op(n, BinOp::Keep, &free, &x);
            let gone = self.compare_op(n, BinOp::Keep, &taken, &ninf);
            let left = self.pair(n, true, &kept, &gone);
            let m = self.reduce_axis(n, &format!("max{r}"), "ReduceMax", &left, ax)?;
            let mb = self.spread(n, &m, &x.shape)?;
            let eq = self.compare_op(n, BinOp::Eq, &left, &mb);
            let hit = self.pair(n, false, &eq, &isnan);
            let cand = self.compare_op(n, BinOp::Keep, &free, &hit);
            let not_cand = self.compare_op(n, BinOp::Eq, &cand, &zero);
            let ki = self.compare_op(n, BinOp::Keep, &cand, &iota);
            let kp = self.compare_op(n, BinOp::Keep, &not_cand, &past);
            let picked = self.pair(n, true, &ki, &kp);
            let idx = self.reduce_axis(n, &format!("idx{r}"), "ReduceMin", &picked, ax)?;
            if r + 1 < k {
                let ib = self.spread(n, &idx, &x.shape)?;
                let sel = self.compare_op(n, BinOp::Eq, &iota, &ib);
                taken = self.pair(n, false, &taken, &sel);
            }
            let v = if neg { self.act_op(n, &m, Act::affine(-1.0, 0.0)) } else { m };
            values.push(self.stash(n, &format!("v{r}"), Val::D(v)));
            indices.push(self.stash(n, &format!("i{r}"), Val::D(idx)));
        }
        let values = self.concat_parts(n, "values", values, ax)?;
        let indices = self.concat_parts(n, "indices", indices, ax)?;
        let i = self.act_op(n, &indices, Act::F32ToI32);
        Ok(vec![Val::D(values), Val::I(Dyn { op: None, ..i })])
    }

    /// The values named `parts` (computed) concatenated along `ax`.
    fn concat_parts(&mut self, n: &Node, tag: &str, parts: Vec<String>, ax: usize) -> Result<Dyn, Refusal> {
        if let [one] = &parts[..] {
            let Some(Val::D(d)) = self.vals.get(one).cloned() else { return Err(invalid("no part")) };
            return Ok(d);
        }
        let attrs =
            std::collections::HashMap::from([("axis".to_string(), crate::load::Attr::Int(ax as i64))]);
        match self.run_part(n, tag, "Concat", parts, attrs)? {
            Val::D(d) => self.onnx_order(&n.name, &d),
            _ => Err(invalid("a concatenation folded to a constant")),
        }
    }
}
