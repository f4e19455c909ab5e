//! Data movement of computed tensors: `Slice`, `Concat`, `Pad`, `Resize`
//! (and the older `Upsample`), and the broadcast of a computed operand to
//! a larger shape.
//!
//! All of them are strided DMA copies ([`Compiler::strided_copy`]) between
//! tensors in HBM, in whatever layout the input has (channels-last images
//! stay channels-last), except `Resize` in `linear` and `cubic` modes:
//! those are separable, so each resized axis is one batch of products with
//! a constant interpolation matrix (two or four non-zero weights a row)
//! on the SA.

use crate::refusal::{invalid, unsupported, Refusal};
use npu_graph::{Init, Op, View};

use super::seq::{dense_strides, u32_of, Place};
use super::{axis, check_size, elems, int_refused, Compiler, Dyn, NodeResult, Val};
use crate::load::{Attr, Node};

/// How `Resize` maps an output coordinate to the input
/// (`coordinate_transformation_mode`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Coord {
    HalfPixel,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    TfHalfPixelForNn,
}

impl Coord {
    /// The input coordinate of output index `x` (ONNX's formulas, in f32
    /// as ONNX Runtime computes them).
    fn original(self, x: usize, scale: f32, len_in: usize, len_out: usize) -> f32 {
        let x = x as f32;
        match self {
            Coord::HalfPixel => (x + 0.5) / scale - 0.5,
            Coord::PytorchHalfPixel if len_out > 1 => (x + 0.5) / scale - 0.5,
            Coord::PytorchHalfPixel => 0.0,
            Coord::AlignCorners if len_out > 1 => x * (len_in as f32 - 1.0) / (len_out as f32 - 1.0),
            Coord::AlignCorners => 0.0,
            Coord::Asymmetric => x / scale,
            Coord::TfHalfPixelForNn => (x + 0.5) / scale,
        }
    }
}

/// `Resize`'s interpolation.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Interp {
    /// `nearest_mode`: round half down, round half up, floor, ceil.
    Nearest(Rounding),
    Linear,
    /// `cubic_coeff_a`, `exclude_outside`.
    Cubic(f32, bool),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Rounding {
    PreferFloor,
    PreferCeil,
    Floor,
    Ceil,
}

impl Rounding {
    fn apply(self, x: f32) -> f32 {
        match self {
            Rounding::PreferFloor if x == x.floor() + 0.5 => x.floor(),
            Rounding::PreferCeil if x == x.floor() + 0.5 => x.ceil(),
            Rounding::PreferFloor | Rounding::PreferCeil => x.round(),
            Rounding::Floor => x.floor(),
            Rounding::Ceil => x.ceil(),
        }
    }
}

/// The input index each output index of one axis copies (nearest).
fn nearest_map(r: Rounding, coord: Coord, scale: f32, len_in: usize, len_out: usize) -> Vec<usize> {
    (0..len_out)
        .map(|o| {
            let x = r.apply(coord.original(o, scale, len_in, len_out));
            if x.is_nan() || x < 0.0 {
                0
            } else {
                (x as usize).min(len_in - 1)
            }
        })
        .collect()
}

/// The `len_out x len_in` matrix (row-major) of one axis' linear or
/// cubic interpolation: neighbours outside the input repeat its edge
/// (or, with `exclude_outside`, weigh 0 and the rest is renormalised).
fn interp_matrix(i: Interp, coord: Coord, scale: f32, len_in: usize, len_out: usize) -> Vec<f32> {
    let mut m = vec![0.0f32; len_out * len_in];
    let clamp = |k: i64| k.clamp(0, len_in as i64 - 1) as usize;
    for o in 0..len_out {
        let x = coord.original(o, scale, len_in, len_out);
        let row = &mut m[o * len_in..(o + 1) * len_in];
        match i {
            Interp::Linear => {
                let x = x.clamp(0.0, len_in as f32 - 1.0);
                let f = x.floor();
                let r = x - f;
                let k = f as i64;
                row[clamp(k)] += 1.0 - r;
                row[clamp(k + 1)] += r;
            }
            Interp::Cubic(a, exclude) => {
                let f = x.floor();
                let r = x - f;
                let k = f as i64;
                let w = [
                    ((a * (r + 1.0) - 5.0 * a) * (r + 1.0) + 8.0 * a) * (r + 1.0) - 4.0 * a,
                    ((a + 2.0) * r - (a + 3.0)) * r * r + 1.0,
                    ((a + 2.0) * (1.0 - r) - (a + 3.0)) * (1.0 - r) * (1.0 - r) + 1.0,
                    ((a * (2.0 - r) - 5.0 * a) * (2.0 - r) + 8.0 * a) * (2.0 - r) - 4.0 * a,
                ];
                let inside = |t: i64| (0..len_in as i64).contains(&t);
                let total: f32 =
                    (0..4).filter(|&j| !exclude || inside(k - 1 + j)).map(|j| w[j as usize]).sum();
                for j in 0..4i64 {
                    let t = k - 1 + j;
                    if exclude && !inside(t) {
                        continue;
                    }
                    let wj = if exclude { w[j as usize] / total } else { w[j as usize] };
                    row[clamp(t)] += wj;
                }
            }
            Interp::Nearest(_) => {}
        }
    }
    m
}

/// Most DMA copies one reversing `Slice`, or one `Pad` in `edge`,
/// `reflect` or `wrap` mode, is lowered to (one per reversed index or
/// padded slab).
pub(super) const MAX_REVERSED_SLABS: usize = 4096;

pub(super) fn str_attr(n: &Node, k: &str, default: &str) -> Result<String, Refusal> {
    match n.attrs.get(k) {
        None => Ok(default.to_string()),
        Some(Attr::Str(s)) => Ok(s.clone()),
        Some(_) => Err(invalid(format!("attribute `{k}` must be a string"))),
    }
}

impl Compiler<'_> {
    /// A new tensor of `shape`, stored channels-last when `nhwc` (rank 4)
    /// or dense, and its element strides.
    fn new_stored(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        nhwc: bool,
    ) -> Result<(Dyn, Vec<usize>), Refusal> {
        check_size(&shape)?;
        let y = self.act_tensor(name, elems(&shape));
        let nhwc = nhwc && shape.len() == 4;
        let d = Dyn::new(y, shape, None, nhwc);
        let st = Self::strides_of(&d);
        Ok((d, st))
    }

    /// `Slice` of a computed tensor: one strided copy when every step is
    /// positive (the steps multiply the source strides). A negative step
    /// (reversing an axis) cannot be a DMA stride, so each picked index of
    /// such an axis is copied on its own: one strided copy per combination
    /// of picked indices of the reversed axes, at most
    /// [`MAX_REVERSED_SLABS`].
    pub(super) fn slice(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axes", "ends", "starts"])?;
        let x = self.computed_view(n, 0)?;
        let picks = self.slice_picks(n, &x.shape)?;
        let st = Self::strides_of(&x);
        let mut src = Vec::with_capacity(st.len());
        let mut off = 0usize;
        let mut reversed = Vec::new();
        for (a, p) in picks.iter().enumerate() {
            let step = match p[..] {
                [] => {
                    return Err(unsupported(format!(
                        "the slice of axis {a} is empty (empty tensors are not supported)"
                    )))
                }
                [_] => 1,
                [first, second, ..] if second > first => second - first,
                _ => {
                    reversed.push(a);
                    0
                }
            };
            if step > 0 {
                off += p[0] * st[a];
            }
            src.push(st[a] * step);
        }
        let shape: Vec<usize> = picks.iter().map(Vec::len).collect();
        let slabs = reversed.iter().try_fold(1usize, |acc, &a| acc.checked_mul(picks[a].len()));
        match slabs {
            Some(k) if k <= MAX_REVERSED_SLABS => {}
            _ => {
                return Err(unsupported(format!(
                    "negative steps on axes {reversed:?} need one copy per picked index; more than \
                     {MAX_REVERSED_SLABS} are not supported"
                )))
            }
        }
        let (y, dst) = self.new_stored(&n.name, shape, x.nhwc)?;
        if reversed.is_empty() {
            self.strided_copy(&n.name, &y.shape, Place::new(x.t, off, &src), Place::new(y.t, 0, &dst))?;
            return Ok(vec![Val::D(y)]);
        }
        // Every combination of output positions along the reversed axes.
        let mut slab = y.shape.clone();
        for &a in &reversed {
            slab[a] = 1;
        }
        let mut at = vec![0usize; reversed.len()];
        loop {
            let (mut s_off, mut d_off) = (off, 0usize);
            for (i, &a) in reversed.iter().enumerate() {
                s_off += picks[a][at[i]] * st[a];
                d_off += at[i] * dst[a];
            }
            self.strided_copy(&n.name, &slab, Place::new(x.t, s_off, &src), Place::new(y.t, d_off, &dst))?;
            // Next combination (the last reversed axis fastest).
            let mut i = reversed.len();
            loop {
                if i == 0 {
                    return Ok(vec![Val::D(y)]);
                }
                i -= 1;
                at[i] += 1;
                if at[i] < y.shape[reversed[i]] {
                    break;
                }
                at[i] = 0;
            }
        }
    }

    /// `Concat` with at least one computed input: each input copied into
    /// its place (constants become weights first).
    pub(super) fn concat(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["axis"])?;
        let parts: Vec<Val> =
            (0..n.inputs.len()).map(|i| self.get(n, i).cloned()).collect::<Result<_, _>>()?;
        let shapes: Vec<Vec<usize>> =
            (0..parts.len()).map(|i| self.shape_of(n, i)).collect::<Result<_, _>>()?;
        let first = shapes.first().cloned().ok_or_else(|| invalid("no inputs"))?;
        let rank = first.len();
        let ax = axis(Self::int_attr(n, "axis", 0)?, rank).ok_or_else(|| invalid("axis out of range"))?;
        let mut shape = first.clone();
        shape[ax] = 0;
        for s in &shapes {
            if s.len() != rank || (0..rank).any(|i| i != ax && s[i] != first[i]) {
                return Err(invalid(format!("concatenated shapes {first:?} and {s:?} differ off axis {ax}")));
            }
            shape[ax] = shape[ax].saturating_add(s[ax]);
        }
        let nhwc = parts.iter().any(|p| matches!(p, Val::D(d) if d.nhwc));
        let (y, dst) = self.new_stored(&n.name, shape, nhwc)?;
        let mut at = 0;
        let mut in_place = 0;
        for (i, p) in parts.into_iter().enumerate() {
            if let Val::D(d) = &p {
                if self.concat_in_place(&n.inputs[i], d, &y, ax, at) {
                    in_place += 1;
                    at += d.shape[ax];
                    continue;
                }
            }
            let (t, shape, src) = match p {
                Val::D(d) => (d.t, d.shape.clone(), Self::strides_of(&d)),
                Val::I(_) => return Err(int_refused(n, i)),
                Val::C(c) => {
                    let t = self.weight(&format!("{}.c{i}", n.name), c.data.to_f32(), Init::Bias);
                    (t, c.shape.clone(), dense_strides(&c.shape))
                }
            };
            self.strided_copy(&n.name, &shape, Place::new(t, 0, &src), Place::new(y.t, at * dst[ax], &dst))?;
            at += shape[ax];
        }
        if in_place == n.inputs.len() {
            self.report.aliases += 1;
        }
        Ok(vec![Val::D(y)])
    }

    /// Rewrites the product that wrote the concatenation's input `d`
    /// (named `input`) to write its result straight into `y`, the
    /// concatenation's output, from index `at` of axis `ax`: no copy.
    /// Only along the axis that is innermost in both tensors' storage (an
    /// image's channels, channels-last; a dense tensor's last axis), so
    /// that `d`'s rows become the columns `at..` of `y`'s rows; and only
    /// when a `Linear` or `Conv` wrote all of `d` and nothing else reads
    /// or writes it (one use, not a graph output). `d`'s tensor keeps its
    /// index but no elements (nothing stores it).
    fn concat_in_place(&mut self, input: &str, d: &Dyn, y: &Dyn, ax: usize, at: usize) -> bool {
        let rank = d.shape.len();
        let innermost = if y.nhwc { d.nhwc && ax == 1 } else { !d.nhwc && ax + 1 == rank };
        if !innermost || d.strides.is_some() || y.strides.is_some() {
            return false;
        }
        let Some(i) = d.op else { return false };
        if self.uses.get(input) != Some(&1) || self.outputs.contains(input) {
            return false;
        }
        if self.g.ops.iter().enumerate().any(|(j, op)| j != i && op.tensors().contains(&d.t)) {
            return false;
        }
        let (cols, ld, col) = (d.shape[ax], y.shape[ax], at);
        let (Ok(cols), Ok(ld), Ok(col)) = (u32::try_from(cols), u32::try_from(ld), u32::try_from(col)) else {
            return false;
        };
        let total = elems(&d.shape) as u64;
        let yv = match &mut self.g.ops[i] {
            Op::Linear { y, rows, n, .. } if *n == cols && u64::from(*rows) * u64::from(*n) == total => y,
            Op::Conv { y, batch, s, cout, .. } if *cout == cols => {
                let (ho, wo) = s.out();
                let out = u64::from(*batch) * u64::from(ho) * u64::from(wo) * u64::from(*cout);
                if out != total {
                    return false;
                }
                y
            }
            _ => return false,
        };
        if *yv != View::dense(d.t, cols) {
            return false;
        }
        *yv = View { t: y.t, ld, col };
        self.g.tensors[d.t].elems = 0;
        true
    }

    /// `Pad`: the input copied into the output's interior, and the border:
    /// in `constant` mode the output is first filled with the value (one
    /// transfer that reads one constant row again and again); in `edge`,
    /// `reflect` and `wrap` mode each padded slab of each axis in turn is a
    /// copy of the slab of the output that mode names (axes already padded
    /// at their full extent, so corners come out right).
    pub(super) fn pad(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["mode", "pads", "value"])?;
        let mode = str_attr(n, "mode", "constant")?;
        if !["constant", "edge", "reflect", "wrap"].contains(&mode.as_str()) {
            return Err(unsupported(format!(
                "mode `{mode}` is not supported (constant, edge, reflect, wrap)"
            )));
        }
        let x = self.computed_view(n, 0)?;
        let rank = x.shape.len();
        let listed = match Self::ints_attr(n, "pads")? {
            Some(p) => p,
            None => self.const_ints(n, 1, "pads")?.ok_or_else(|| invalid("pads missing"))?,
        };
        let value = match self.opt(n, 2) {
            None => Self::float_attr(n, "value", 0.0)?,
            Some(Val::C(c)) => match c.data.to_f32()[..] {
                [v] => v,
                _ => return Err(invalid("constant_value must be one value")),
            },
            Some(Val::D(_) | Val::I(_)) => return Err(unsupported("constant_value must be a constant")),
        };
        let axes: Vec<usize> = match self.const_ints(n, 3, "axes")? {
            None => (0..rank).collect(),
            Some(a) => a
                .iter()
                .map(|&v| axis(v, rank).ok_or_else(|| invalid("axis out of range")))
                .collect::<Result<_, _>>()?,
        };
        if listed.len() != 2 * axes.len() {
            return Err(invalid(format!("{} pads for {} axes", listed.len(), axes.len())));
        }
        let (mut begin, mut end) = (vec![0usize; rank], vec![0usize; rank]);
        for (i, &a) in axes.iter().enumerate() {
            let (b, e) = (listed[i], listed[i + axes.len()]);
            begin[a] = usize::try_from(b)
                .map_err(|_| unsupported(format!("negative pad {b} (cropping) is not supported")))?;
            end[a] = usize::try_from(e)
                .map_err(|_| unsupported(format!("negative pad {e} (cropping) is not supported")))?;
        }
        if begin.iter().chain(&end).all(|&p| p == 0) {
            self.report.aliases += 1;
            return Ok(vec![Val::D(x)]);
        }
        let shape: Vec<usize> =
            (0..rank).map(|a| x.shape[a].saturating_add(begin[a]).saturating_add(end[a])).collect();
        if mode != "constant" {
            for a in 0..rank {
                let len = x.shape[a];
                let most = begin[a].max(end[a]);
                if (begin[a] > 0 || end[a] > 0) && len == 0 {
                    return Err(unsupported(format!("axis {a} is empty: nothing to pad it with")));
                }
                if mode == "reflect" && most >= len {
                    return Err(invalid(format!(
                        "reflect pad {most} on axis {a} of length {len} (at most {})",
                        len - 1
                    )));
                }
            }
            // Saturating: a hostile model's pads may be near 2^63 each.
            let slabs = (0..rank).fold(0usize, |s, a| s.saturating_add(begin[a].saturating_add(end[a])));
            if slabs > MAX_REVERSED_SLABS {
                return Err(unsupported(format!(
                    "{slabs} padded slabs; more than {MAX_REVERSED_SLABS} are not supported"
                )));
            }
        }
        let (y, dst) = self.new_stored(&n.name, shape.clone(), x.nhwc)?;
        if mode == "constant" {
            // The innermost stored extent: channels for channels-last.
            let cols = if y.nhwc { y.shape[1] } else { *y.shape.last().unwrap_or(&1) }.max(1);
            let rows = elems(&y.shape) / cols;
            let fill = self.weight(&format!("{}.value", n.name), vec![value; cols], Init::Bias);
            let cols32 = u32_of(cols, "columns")?;
            self.g.ops.push(Op::Copy {
                name: format!("{}.fill", n.name),
                x: View { t: fill, ld: 0, col: 0 },
                y: View::dense(y.t, cols32),
                rows: u32_of(rows, "rows")?,
                cols: cols32,
            });
        }
        let off = begin.iter().zip(&dst).map(|(b, s)| b * s).sum();
        let src = Self::strides_of(&x);
        self.strided_copy(&n.name, &x.shape, Place::new(x.t, 0, &src), Place::new(y.t, off, &dst))?;
        if mode == "constant" {
            return Ok(vec![Val::D(y)]);
        }
        // Axis by axis: the slab covers axes before `a` at their full
        // (padded) extent, axes after it at their interior only.
        for a in 0..rank {
            let len = x.shape[a];
            let mut slab: Vec<usize> = (0..rank).map(|b| if b < a { shape[b] } else { x.shape[b] }).collect();
            slab[a] = 1;
            let base: usize = (0..rank).filter(|&b| b > a).map(|b| begin[b] * dst[b]).sum();
            for o in (0..begin[a]).chain(begin[a] + len..shape[a]) {
                let t = o as i64 - begin[a] as i64;
                let l = len as i64;
                let from = match mode.as_str() {
                    "edge" => t.clamp(0, l - 1),
                    "reflect" if t < 0 => -t,
                    "reflect" => 2 * (l - 1) - t,
                    _ => t.rem_euclid(l),
                };
                let from = begin[a] + from as usize;
                self.strided_copy(
                    &n.name,
                    &slab,
                    Place::new(y.t, base + from * dst[a], &dst),
                    Place::new(y.t, base + o * dst[a], &dst),
                )?;
            }
        }
        Ok(vec![Val::D(y)])
    }

    /// `Resize` (and `Upsample`) of the two spatial axes of an image.
    pub(super) fn resize(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(
            n,
            &[
                "antialias",
                "axes",
                "coordinate_transformation_mode",
                "cubic_coeff_a",
                "exclude_outside",
                "extrapolation_value",
                "keep_aspect_ratio_policy",
                "mode",
                "nearest_mode",
            ],
        )?;
        if Self::int_attr(n, "antialias", 0)? != 0 {
            return Err(unsupported("antialias is not supported"));
        }
        let axes = Self::ints_attr(n, "axes")?;
        let policy = str_attr(n, "keep_aspect_ratio_policy", "stretch")?;
        if policy != "stretch" {
            return Err(unsupported(format!(
                "keep_aspect_ratio_policy `{policy}` is not supported (only stretch)"
            )));
        }
        let x = self.computed(n, 0)?;
        let [b, c] = match x.shape[..] {
            [b, c, _, _] => [b, c],
            _ => {
                return Err(unsupported(format!(
                    "input of shape {:?} (only images [N, C, H, W] are resized)",
                    x.shape
                )))
            }
        };
        if elems(&x.shape) == 0 {
            return Err(unsupported("an empty input is not supported"));
        }
        let floats = |v: Option<&Val>| -> Result<Option<Vec<f32>>, Refusal> {
            match v {
                Some(Val::C(c)) if elems(&c.shape) > 0 => Ok(Some(c.data.to_f32())),
                Some(Val::D(_) | Val::I(_)) => Err(unsupported("scales and sizes must be constants")),
                _ => Ok(None),
            }
        };
        // Upsample and Resize-10: (X, scales); from opset 11: (X, roi, scales, sizes).
        let (scales, sizes) = if n.op == "Upsample" || self.m.opset < 11 {
            (floats(self.opt(n, 1))?, None)
        } else {
            let sizes = match self.opt(n, 3) {
                Some(Val::C(c)) if elems(&c.shape) > 0 => Some(c.data.to_i64()),
                Some(Val::D(_) | Val::I(_)) => return Err(unsupported("sizes must be a constant")),
                _ => None,
            };
            (floats(self.opt(n, 2))?, sizes)
        };
        // `axes` (opset 18): scales or sizes for those axes only; the
        // others keep their size.
        let (scales, sizes) = match &axes {
            None => (scales, sizes),
            Some(a) => {
                let rank = x.shape.len();
                let ax: Vec<usize> = a
                    .iter()
                    .map(|&v| axis(v, rank).ok_or_else(|| invalid("axis out of range")))
                    .collect::<Result<_, _>>()?;
                let mut seen = ax.clone();
                seen.sort_unstable();
                seen.dedup();
                if seen.len() != ax.len() {
                    return Err(invalid(format!("axes {a:?} repeat an axis")));
                }
                let spread = |given: &[f32], fill: Vec<f32>| -> Result<Vec<f32>, Refusal> {
                    if given.len() != ax.len() {
                        return Err(invalid(format!("{} values for {} axes", given.len(), ax.len())));
                    }
                    let mut full = fill;
                    for (i, &k) in ax.iter().enumerate() {
                        full[k] = given[i];
                    }
                    Ok(full)
                };
                let scales = match scales {
                    Some(s) => Some(spread(&s, vec![1.0; rank])?),
                    None => None,
                };
                let sizes = match sizes {
                    Some(s) => {
                        let given: Vec<f32> = s.iter().map(|&v| v as f32).collect();
                        let full = spread(&given, x.shape.iter().map(|&d| d as f32).collect())?;
                        Some(full.iter().map(|&v| v as i64).collect())
                    }
                    None => None,
                };
                (scales, sizes)
            }
        };
        let (out, scale): (Vec<usize>, Vec<f32>) = match (sizes, scales) {
            (Some(s), _) if s.len() == 4 => {
                let out: Vec<usize> = s
                    .iter()
                    .map(|&v| usize::try_from(v).map_err(|_| invalid(format!("size {v}"))))
                    .collect::<Result<_, _>>()?;
                let scale = out.iter().zip(&x.shape).map(|(&o, &i)| o as f32 / i as f32).collect();
                (out, scale)
            }
            (None, Some(s)) if s.len() == 4 => {
                if s.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
                    return Err(invalid(format!("scales {s:?} must be positive")));
                }
                let out = s.iter().zip(&x.shape).map(|(&f, &i)| (i as f32 * f).floor() as usize).collect();
                (out, s)
            }
            _ => return Err(invalid("scales or sizes with one value per axis (4) are needed")),
        };
        if out[0] != b || out[1] != c {
            return Err(unsupported(format!(
                "resizing the batch or channel axis ({:?} to {out:?}) is not supported",
                x.shape
            )));
        }
        let [ho, wo] = [out[2], out[3]];
        if ho == 0 || wo == 0 {
            return Err(unsupported("an empty output is not supported"));
        }
        check_size(&out)?;
        let mode = str_attr(n, "mode", "nearest")?;
        // Upsample (opsets 7-9) and Resize-10 have no `nearest_mode` or
        // `coordinate_transformation_mode`: their nearest neighbour is the
        // input index floor(out / scale), asymmetric.
        let old = n.op == "Upsample" || self.m.opset < 11;
        if old {
            for a in ["nearest_mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside"] {
                if n.attrs.contains_key(a) {
                    return Err(invalid(format!("attribute `{a}` does not exist before opset 11")));
                }
            }
        }
        let interp = match mode.as_str() {
            "nearest" if old => Interp::Nearest(Rounding::Floor),
            "nearest" => Interp::Nearest(match str_attr(n, "nearest_mode", "round_prefer_floor")?.as_str() {
                "round_prefer_floor" => Rounding::PreferFloor,
                "round_prefer_ceil" => Rounding::PreferCeil,
                "floor" => Rounding::Floor,
                "ceil" => Rounding::Ceil,
                m => return Err(unsupported(format!("nearest_mode `{m}` is not supported"))),
            }),
            "linear" | "bilinear" => Interp::Linear,
            "cubic" => Interp::Cubic(
                Self::float_attr(n, "cubic_coeff_a", -0.75)?,
                Self::int_attr(n, "exclude_outside", 0)? != 0,
            ),
            m => return Err(unsupported(format!("mode `{m}` is not supported (nearest, linear, cubic)"))),
        };
        // Upsample and Resize-10 are asymmetric.
        let default = if n.op == "Upsample" || self.m.opset < 11 { "asymmetric" } else { "half_pixel" };
        let coord = match str_attr(n, "coordinate_transformation_mode", default)?.as_str() {
            "half_pixel" => Coord::HalfPixel,
            "pytorch_half_pixel" => Coord::PytorchHalfPixel,
            "align_corners" => Coord::AlignCorners,
            "asymmetric" => Coord::Asymmetric,
            "tf_half_pixel_for_nn" => Coord::TfHalfPixelForNn,
            m => return Err(unsupported(format!("coordinate_transformation_mode `{m}` is not supported"))),
        };
        let x = self.channels_last(&n.name, &x)?;
        // The width first, then the height; an axis that keeps its size
        // under a mapping that is the identity moves nothing.
        let mid = self.resize_axis(n, &x, 3, wo, scale[3], interp, coord)?;
        let y = self.resize_axis(n, &mid, 2, ho, scale[2], interp, coord)?;
        Ok(vec![Val::D(y)])
    }

    /// Resizes axis `a` (2 = height, 3 = width) of the channels-last
    /// image `x` to `len_out`.
    #[allow(clippy::too_many_arguments)]
    fn resize_axis(
        &mut self,
        n: &Node,
        x: &Dyn,
        a: usize,
        len_out: usize,
        scale: f32,
        interp: Interp,
        coord: Coord,
    ) -> Result<Dyn, Refusal> {
        let len_in = x.shape[a];
        let mut shape = x.shape.clone();
        shape[a] = len_out;
        let name = format!("{}.{}", n.name, if a == 2 { "h" } else { "w" });
        if let Interp::Nearest(r) = interp {
            let map = nearest_map(r, coord, scale, len_in, len_out);
            if len_out == len_in && map.iter().enumerate().all(|(i, &j)| i == j) {
                return Ok(x.clone());
            }
            let (y, dst) = self.new_stored(&name, shape, true)?;
            let src = Self::strides_of(x);
            // One slice of the axis at a time: N x (the other axis) rows of C.
            let mut one = x.shape.clone();
            one[a] = 1;
            for (o, &i) in map.iter().enumerate() {
                self.strided_copy(
                    &name,
                    &one,
                    Place::new(x.t, i * src[a], &src),
                    Place::new(y.t, o * dst[a], &dst),
                )?;
            }
            return Ok(y);
        }
        let m = interp_matrix(interp, coord, scale, len_in, len_out);
        let identity = len_out == len_in
            && (0..len_in).all(|i| (0..len_in).all(|j| m[i * len_in + j] == f32::from(i == j)));
        if identity {
            return Ok(x.clone());
        }
        let (y, _) = self.new_stored(&name, shape, true)?;
        let mt = self.weight(&format!("{name}.interp"), m, Init::Bias);
        // Channels-last [N][H][W][C]: along the width, image row (n, h) is a
        // W x C matrix; along the height, column w of image n is an H x C
        // matrix whose rows are W*C apart.
        let [nb, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
        let (items, ld_in, ld_out): (Vec<[u64; 3]>, usize, usize) = if a == 3 {
            let items = (0..nb * h).map(|r| [0, (r * w * c) as u64, (r * len_out * c) as u64]).collect();
            (items, c, c)
        } else {
            let items = (0..nb)
                .flat_map(|img| {
                    (0..w).map(move |col| {
                        [0, ((img * h * w + col) * c) as u64, ((img * len_out * w + col) * c) as u64]
                    })
                })
                .collect();
            (items, w * c, w * c)
        };
        self.g.ops.push(Op::BatchMatMul {
            name,
            a: mt,
            b: x.t,
            y: y.t,
            lda: u32_of(len_in, "columns")?,
            ldb: u32_of(ld_in, "stride")?,
            ldy: u32_of(ld_out, "stride")?,
            trans_b: false,
            m: u32_of(len_out, "rows")?,
            k: u32_of(len_in, "columns")?,
            n: u32_of(c, "channels")?,
            offs: items,
            act: npu_graph::Act::None,
        });
        Ok(y)
    }

    /// `d` broadcast to `shape` (numpy's rules, which the caller checked)
    /// and stored like `like` (channels-last or dense): one strided copy
    /// that reads broadcast axes with stride 0.
    pub(super) fn broadcast_to(
        &mut self,
        name: &str,
        d: &Dyn,
        shape: &[usize],
        nhwc: bool,
    ) -> Result<Dyn, Refusal> {
        let st = Self::strides_of(d);
        let off = shape.len() - d.shape.len();
        let src: Vec<usize> = (0..shape.len())
            .map(|i| if i < off || d.shape[i - off] == 1 { 0 } else { st[i - off] })
            .collect();
        let (y, dst) = self.new_stored(&format!("{name}.bcast"), shape.to_vec(), nhwc)?;
        self.strided_copy(name, shape, Place::new(d.t, 0, &src), Place::new(y.t, 0, &dst))?;
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_maps_follow_onnx() {
        // Twice the size, half_pixel + round_prefer_floor: 0 0 1 1 2 2.
        assert_eq!(nearest_map(Rounding::PreferFloor, Coord::HalfPixel, 2.0, 3, 6), vec![0, 0, 1, 1, 2, 2]);
        // asymmetric + floor (PyTorch's nearest): 5 -> 3 picks 0 1 3.
        assert_eq!(nearest_map(Rounding::Floor, Coord::Asymmetric, 0.6, 5, 3), vec![0, 1, 3]);
        // align_corners 3 -> 5: 0 0.5 1 1.5 2, halves rounded down.
        assert_eq!(
            nearest_map(Rounding::PreferFloor, Coord::AlignCorners, 5.0 / 3.0, 3, 5),
            vec![0, 0, 1, 1, 2]
        );
        assert_eq!(
            nearest_map(Rounding::PreferCeil, Coord::AlignCorners, 5.0 / 3.0, 3, 5),
            vec![0, 1, 1, 2, 2]
        );
    }

    #[test]
    fn interpolation_rows_sum_to_one() {
        for interp in [Interp::Linear, Interp::Cubic(-0.75, false), Interp::Cubic(-0.5, true)] {
            for coord in [Coord::HalfPixel, Coord::AlignCorners, Coord::Asymmetric, Coord::PytorchHalfPixel] {
                let m = interp_matrix(interp, coord, 7.0 / 3.0, 3, 7);
                for r in 0..7 {
                    let s: f32 = m[r * 3..r * 3 + 3].iter().sum();
                    assert!((s - 1.0).abs() < 1e-6, "{interp:?} {coord:?} row {r}: {s}");
                }
            }
        }
        // Linear, half_pixel, 2 -> 4: 0.25 past each edge is the edge.
        let m = interp_matrix(Interp::Linear, Coord::HalfPixel, 2.0, 2, 4);
        assert_eq!(m, vec![1.0, 0.0, 0.75, 0.25, 0.25, 0.75, 0.0, 1.0]);
    }
}
