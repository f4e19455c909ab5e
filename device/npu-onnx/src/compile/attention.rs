//! `Attention` (opset 23): scaled dot-product attention compiled as the
//! nodes it is made of, in the order ONNX's reference computes it
//! (`onnx/reference/ops/op_attention.py`): 3-D inputs split into heads
//! (`Reshape`, `Transpose`), the past key and value cache prepended
//! (`Concat`), grouped-query heads repeated (`Slice`, `Concat`), `Q` and `K`
//! each scaled by the square root of the scale, `Q K'` (`MatMul`), the soft
//! cap (`Div`, `Tanh`, `Mul`), the additive bias (`Add`), `Softmax`, and
//! the product with `V`.
//!
//! The bias must be known when compiling: `is_causal`, a constant
//! `attn_mask` (boolean or float), a constant `nonpad_kv_seqlen`, the
//! sliding window, or any of them together. A computed mask is refused: a
//! query row it masks entirely softmaxes to zeros in ONNX (its guard looks
//! at the bias), which the element-wise operations here cannot tell from
//! a row of very negative scores. For the same reason a constant bias
//! that masks a whole row is refused, and a `softmax_precision` other than
//! float.

use std::collections::HashMap;

use crate::load::{Attr, Const, Data, Node};
use crate::refusal::{invalid, unsupported, Refusal};

use super::{Compiler, NodeResult, Val, MAX_FOLDED};

/// What hides a key from a query besides the mask.
#[derive(Clone, Copy)]
struct Hide<'a> {
    causal: bool,
    /// Keys at most this far before / after the query's position (-1: any).
    window: (i64, i64),
    /// Keys in the past cache (the queries' offset without `nonpad`).
    past: usize,
    /// Valid keys per batch (an external cache).
    nonpad: Option<&'a [i64]>,
}

/// `TensorProto.FLOAT`: the only `softmax_precision` taken.
const FLOAT: i64 = 1;

impl Compiler<'_> {
    pub(super) fn attention(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(
            n,
            &[
                "is_causal",
                "kv_num_heads",
                "left_window_size",
                "right_window_size",
                "q_num_heads",
                "qk_matmul_output_mode",
                "scale",
                "softcap",
                "softmax_precision",
            ],
        )?;
        // Valid keys per batch (an external cache): a constant only.
        let nonpad = match self.opt(n, 6) {
            None => None,
            Some(Val::C(c)) => Some(c.data.to_i64()),
            Some(Val::D(_) | Val::I(_)) => {
                return Err(unsupported("a computed nonpad_kv_seqlen (only a constant)"))
            }
        };
        if let Some(p) = n.attrs.get("softmax_precision") {
            if !matches!(p, Attr::Int(FLOAT)) {
                return Err(unsupported("a `softmax_precision` other than float (1) is not supported"));
            }
        }
        let causal = Self::int_attr(n, "is_causal", 0)? != 0;
        let mode = Self::int_attr(n, "qk_matmul_output_mode", 0)?;
        if !(0..=3).contains(&mode) {
            return Err(invalid(format!("qk_matmul_output_mode {mode} (0 to 3)")));
        }
        let softcap = Self::float_attr(n, "softcap", 0.0)?;
        let window =
            (Self::int_attr(n, "left_window_size", -1)?, Self::int_attr(n, "right_window_size", -1)?);
        if window.0 < -1 || window.1 < -1 {
            return Err(invalid(format!("window sizes {window:?} (-1 or more)")));
        }
        let (qs, ks, vs) = (self.shape_of(n, 0)?, self.shape_of(n, 1)?, self.shape_of(n, 2)?);
        let rank = qs.len();
        if !(rank == 3 || rank == 4) || ks.len() != rank || vs.len() != rank {
            return Err(invalid(format!("Q, K and V of shapes {qs:?}, {ks:?}, {vs:?} (all 3-D or all 4-D)")));
        }
        let b = qs[0];
        if ks[0] != b || vs[0] != b {
            return Err(invalid(format!("Q, K and V of batches {}, {}, {}", qs[0], ks[0], vs[0])));
        }
        let input =
            |i: usize| n.inputs.get(i).cloned().ok_or_else(|| invalid(format!("input {i} is missing")));
        let (mut q, mut k, mut v) = (input(0)?, input(1)?, input(2)?);
        let heads = |what: &str| -> Result<Option<usize>, Refusal> {
            match Self::int_attr(n, what, 0)? {
                0 => Ok(None),
                h if h > 0 => Ok(Some(h as usize)),
                h => Err(invalid(format!("{what} {h}"))),
            }
        };
        let (hq, hkv, sq, d, dv);
        if rank == 3 {
            let (Some(qh), Some(kh)) = (heads("q_num_heads")?, heads("kv_num_heads")?) else {
                return Err(invalid("3-D inputs need q_num_heads and kv_num_heads"));
            };
            if qs[2] % qh != 0 || ks[2] % kh != 0 || vs[2] % kh != 0 || ks[1] != vs[1] {
                return Err(invalid(format!(
                    "Q, K and V of shapes {qs:?}, {ks:?}, {vs:?} do not split into {qh} and {kh} heads"
                )));
            }
            (hq, hkv, sq, d, dv) = (qh, kh, qs[1], qs[2] / qh, vs[2] / kh);
            q = self.split_heads(n, "q", q, [b, qs[1], qh, d])?;
            k = self.split_heads(n, "k", k, [b, ks[1], kh, ks[2] / kh])?;
            v = self.split_heads(n, "v", v, [b, vs[1], kh, dv])?;
        } else {
            if heads("q_num_heads")?.is_some() || heads("kv_num_heads")?.is_some() {
                return Err(invalid("q_num_heads and kv_num_heads are for 3-D inputs only"));
            }
            if vs[1] != ks[1] || vs[2] != ks[2] {
                return Err(invalid(format!("K and V of shapes {ks:?}, {vs:?}")));
            }
            (hq, hkv, sq, d, dv) = (qs[1], ks[1], qs[2], qs[3], vs[3]);
        }
        let kd = if rank == 3 { ks[2] / hkv } else { ks[3] };
        if kd != d {
            return Err(invalid(format!("Q's head size {d} and K's {kd} differ")));
        }
        // The cache: past keys and values come first.
        let mut past = 0;
        match (self.opt(n, 4).is_some(), self.opt(n, 5).is_some()) {
            (false, false) => {}
            (true, true) if nonpad.is_some() => {
                return Err(invalid("nonpad_kv_seqlen cannot come with past_key and past_value"))
            }
            (true, true) => {
                let (pk, pv) = (self.shape_of(n, 4)?, self.shape_of(n, 5)?);
                if pk.len() != 4 || pv.len() != 4 || pk[2] != pv[2] {
                    return Err(invalid(format!("past_key and past_value of shapes {pk:?}, {pv:?}")));
                }
                past = pk[2];
                let axis2 = || HashMap::from([("axis".to_string(), Attr::Int(2))]);
                k = self.step(n, "present_key", "Concat", vec![input(4)?, k], axis2())?;
                v = self.step(n, "present_value", "Concat", vec![input(5)?, v], axis2())?;
            }
            _ => return Err(invalid("past_key and past_value come together")),
        }
        let skv = self.value_shape(&k)?[2];
        let (present_k, present_v) = (k.clone(), v.clone());
        // Grouped-query attention: each K and V head repeated in place
        // ([h0, h0, h1, h1, ...]).
        if hq != hkv {
            if hkv == 0 || hq % hkv != 0 {
                return Err(invalid(format!("{hq} query heads do not group over {hkv} key heads")));
            }
            k = self.repeat_heads(n, "k", &k, hkv, hq / hkv)?;
            v = self.repeat_heads(n, "v", &v, hkv, hq / hkv)?;
        }
        // Scale: Q and K each by its square root, in f32 (as ONNX's
        // reference and its function body compute it).
        let scale = match n.attrs.get("scale") {
            None => 1.0 / (d as f64).sqrt(),
            Some(Attr::Float(s)) => f64::from(*s),
            Some(_) => return Err(invalid("attribute `scale` must be a float")),
        };
        let root = self.stash_scalar(n, "scale", scale.sqrt() as f32);
        let none = HashMap::new;
        let qs_ = self.step(n, "q_scaled", "Mul", vec![q, root.clone()], none())?;
        let ks_ = self.step(n, "k_scaled", "Mul", vec![k, root], none())?;
        let perm = HashMap::from([("perm".to_string(), Attr::Ints(vec![0, 1, 3, 2]))]);
        let kt = self.step(n, "k_t", "Transpose", vec![ks_], perm)?;
        let mut scores = self.step(n, "qk", "MatMul", vec![qs_, kt], none())?;
        if softcap > 0.0 {
            let c = self.stash_scalar(n, "softcap", softcap);
            let x = self.step(n, "capped_in", "Div", vec![scores, c.clone()], none())?;
            let t = self.step(n, "capped_tanh", "Tanh", vec![x], none())?;
            scores = self.step(n, "capped", "Mul", vec![t, c], none())?;
        }
        let qk = scores.clone();
        if nonpad.as_ref().is_some_and(|v| v.len() != b) {
            return Err(invalid(format!(
                "nonpad_kv_seqlen of {} values for a batch of {b}",
                nonpad.map_or(0, |v| v.len())
            )));
        }
        let with_bias = match self.attention_bias(
            n,
            Hide { causal, window, past, nonpad: nonpad.as_deref() },
            [b, hq, sq, skv],
        )? {
            Some(bias) => self.step(n, "biased", "Add", vec![scores, bias], none())?,
            None => scores,
        };
        let axis = HashMap::from([("axis".to_string(), Attr::Int(-1))]);
        let p = self.step(n, "softmax", "Softmax", vec![with_bias.clone()], axis)?;
        let mut y = self.step(n, "pv", "MatMul", vec![p.clone(), v], none())?;
        if rank == 3 {
            let perm = HashMap::from([("perm".to_string(), Attr::Ints(vec![0, 2, 1, 3]))]);
            y = self.step(n, "y_t", "Transpose", vec![y], perm)?;
            let shape = self.sizes(n, "y_shape", &[b, sq, hq * dv]);
            y = self.step(n, "y", "Reshape", vec![y, shape], none())?;
        }
        let qk_out = match mode {
            0 | 1 => qk,
            2 => with_bias,
            _ => p,
        };
        let names = [y, present_k, present_v, qk_out];
        names
            .iter()
            .take(n.outputs.len().max(1))
            .map(|name| self.vals.get(name).cloned().ok_or_else(|| invalid(format!("no value `{name}`"))))
            .collect()
    }

    /// `[B, S, H * D]` as `[B, H, S, D]`.
    fn split_heads(&mut self, n: &Node, tag: &str, x: String, split: [usize; 4]) -> Result<String, Refusal> {
        let shape = self.sizes(n, &format!("{tag}_split"), &split);
        let r = self.step(n, &format!("{tag}_heads"), "Reshape", vec![x, shape], HashMap::new())?;
        let perm = HashMap::from([("perm".to_string(), Attr::Ints(vec![0, 2, 1, 3]))]);
        self.step(n, &format!("{tag}_bhsd"), "Transpose", vec![r], perm)
    }

    /// Each of the `heads` heads (axis 1) of `x` repeated `reps` times in
    /// place.
    fn repeat_heads(
        &mut self,
        n: &Node,
        tag: &str,
        x: &str,
        heads: usize,
        reps: usize,
    ) -> Result<String, Refusal> {
        let mut parts = Vec::with_capacity(heads * reps);
        let axes = self.sizes(n, &format!("{tag}_rep_axes"), &[1]);
        for h in 0..heads {
            let starts = self.sizes(n, &format!("{tag}_rep_s{h}"), &[h]);
            let ends = self.sizes(n, &format!("{tag}_rep_e{h}"), &[h + 1]);
            let one = self.step(
                n,
                &format!("{tag}_head{h}"),
                "Slice",
                vec![x.to_string(), starts, ends, axes.clone()],
                HashMap::new(),
            )?;
            parts.extend(std::iter::repeat_n(one, reps));
        }
        let axis = HashMap::from([("axis".to_string(), Attr::Int(1))]);
        self.step(n, &format!("{tag}_repeated"), "Concat", parts, axis)
    }

    /// The additive bias of the scores `[B, H, Sq, Skv]`, as a constant:
    /// the mask (a boolean one as 0 / -inf; padded with masked keys up to
    /// `Skv`) plus the causal mask (query `i` sees key `j` iff
    /// `j <= i + offset`, the offset being `past`, or with `nonpad` (valid
    /// keys per batch) `nonpad[b] - Sq`), plus, with `nonpad`, keys past
    /// each batch's valid ones masked. `None` when there is none of them.
    fn attention_bias(
        &mut self,
        n: &Node,
        hide: Hide,
        [b, h, sq, skv]: [usize; 4],
    ) -> Result<Option<String>, Refusal> {
        let Hide { causal, window, past, nonpad } = hide;
        let mask = match self.opt(n, 3) {
            None => None,
            Some(Val::D(_) | Val::I(_)) => {
                return Err(unsupported(
                    "a computed attn_mask (only a constant mask or is_causal: a row a mask hides \
                     entirely gives zeros in ONNX, which is not compiled exactly)",
                ))
            }
            Some(Val::C(c)) => Some(c.clone()),
        };
        if mask.is_none() && !causal && nonpad.is_none() && window == (-1, -1) {
            return Ok(None);
        }
        let total = [b, h, sq, skv].iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        let total = total.filter(|&t| t <= MAX_FOLDED).ok_or_else(|| {
            unsupported(format!(
                "an attention bias of shape {:?} (more than {MAX_FOLDED} elements)",
                [b, h, sq, skv]
            ))
        })?;
        let mut bias = vec![0f32; total];
        if let Some(m) = mask {
            let vals: Vec<f32> = match &m.data {
                // Booleans (and integers) load as integers: true attends.
                Data::I64(v) => v.iter().map(|&x| if x != 0 { 0.0 } else { f32::NEG_INFINITY }).collect(),
                Data::F32(v) => v.clone(),
            };
            let r = m.shape.len();
            if r == 0 || r > 4 || m.shape[r - 1] > skv {
                return Err(invalid(format!(
                    "attn_mask of shape {:?} for scores {:?}",
                    m.shape,
                    [b, h, sq, skv]
                )));
            }
            // Right-aligned broadcasting; keys past the mask are masked.
            let mut full = [1usize; 4];
            full[4 - r..].copy_from_slice(&m.shape);
            let dims = [b, h, sq, skv];
            for (i, (&f, &dd)) in full.iter().zip(&dims).enumerate().take(3) {
                if f != 1 && f != dd {
                    return Err(invalid(format!(
                        "attn_mask of shape {:?} does not broadcast to {dims:?} (axis {i})",
                        m.shape
                    )));
                }
            }
            let mstr = [full[1] * full[2] * full[3], full[2] * full[3], full[3]];
            for bi in 0..b {
                for hi in 0..h {
                    for i in 0..sq {
                        for j in 0..skv {
                            let at = ((bi * h + hi) * sq + i) * skv + j;
                            bias[at] = if j >= full[3] {
                                f32::NEG_INFINITY
                            } else {
                                let src = (if full[0] == 1 { 0 } else { bi }) * mstr[0]
                                    + (if full[1] == 1 { 0 } else { hi }) * mstr[1]
                                    + (if full[2] == 1 { 0 } else { i }) * mstr[2]
                                    + j;
                                vals[src]
                            };
                        }
                    }
                }
            }
        }
        for (at, x) in bias.iter_mut().enumerate() {
            let (bi, i, j) = (at / (h * sq * skv), (at / skv) % sq, at % skv);
            let (i, j) = (i as i64, j as i64);
            let offset = match nonpad {
                Some(v) => v[bi] - sq as i64,
                None => past as i64,
            };
            // Query i sits at position i + offset among the keys.
            let diff = i + offset - j;
            let hidden = (causal && diff < 0)
                || (window.0 >= 0 && diff > window.0)
                || (window.1 >= 0 && -diff > window.1)
                || nonpad.is_some_and(|v| j >= v[bi]);
            if hidden {
                *x += f32::NEG_INFINITY;
            }
        }
        if let Some(row) = bias.chunks(skv.max(1)).position(|r| r.iter().all(|&x| x == f32::NEG_INFINITY)) {
            return Err(unsupported(format!(
                "the attention mask hides every key from query row {row} (ONNX gives that row zeros, which is \
                 not compiled)"
            )));
        }
        let name = self.stash(n, "bias", Val::C(Const { shape: vec![b, h, sq, skv], data: Data::F32(bias) }));
        Ok(Some(name))
    }
}
