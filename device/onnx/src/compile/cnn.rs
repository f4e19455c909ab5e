//! Convolutional networks: channels-last storage, convolutions (grouped and
//! depthwise), batch normalization folded into them, pooling, and the
//! per-channel arithmetic around them.
//!
//! ONNX describes images as `[N, C, H, W]`. The vNPU's convolution and
//! pooling instructions read and write channels-last (`[N][H][W][C]`), so
//! a rank-4 tensor written by one of them stays channels-last ([`Dyn::nhwc`])
//! until an operation needs ONNX's own order (a reshape, a matrix product,
//! a model output); then strided DMA copies transpose it. When `H*W` or `C`
//! is 1 the two orders are the same bytes and nothing moves.

use npu_workloads::graph::{Act, Init, Op, PoolOp, Spatial, View};

use super::seq::dense_strides;
use super::{elems, Compiler, Dyn, NodeResult, Val};
use crate::load::{Const, Data, Node};

/// `x` (row-major in `[N, C, H, W]`) reordered to `[N][H][W][C]`.
pub(super) fn nchw_to_nhwc<T: Copy>(x: &[T], shape: &[usize]) -> Vec<T> {
    let [n, c, h, w] = [shape[0], shape[1], shape[2], shape[3]];
    let hw = h * w;
    let mut out = Vec::with_capacity(x.len());
    for img in 0..n {
        for p in 0..hw {
            for ch in 0..c {
                out.push(x[(img * c + ch) * hw + p]);
            }
        }
    }
    out
}

/// The values of constant `v` (shape `cshape`, broadcast to `d`'s shape)
/// when they vary along `d`'s channel axis only: one per channel. The
/// channel axis is 1 for a channels-last tensor, the last axis otherwise.
pub(super) fn channel_vec(v: &[f32], cshape: &[usize], d: &Dyn) -> Option<Vec<f32>> {
    let rank = d.shape.len();
    if cshape.len() > rank || rank == 0 {
        return None;
    }
    let axis = if d.nhwc { 1 } else { rank - 1 };
    let channels = d.shape[axis];
    let off = rank - cshape.len();
    for (i, &dim) in cshape.iter().enumerate() {
        if i + off != axis && dim != 1 {
            return None;
        }
    }
    match v.len() {
        1 => Some(vec![v[0]; channels]),
        l if l == channels => Some(v.to_vec()),
        _ => None,
    }
}

/// `b` applied after `a`, as one activation, when the two compose.
pub(super) fn then(a: Act, b: Act) -> Option<Act> {
    let affine = |s: f32, c: f32| s.is_finite() && c.is_finite();
    match (a, b) {
        (Act::None, b) => Some(b),
        (a, Act::Clamp { scale: 1.0, bias: 0.0, lo: f32::MIN, hi: f32::MAX }) => Some(a),
        // affine, then clamp(affine): one clamp of the composed affine map.
        (
            Act::Clamp { scale: s1, bias: b1, lo: f32::MIN, hi: f32::MAX },
            Act::Clamp { scale, bias, lo, hi },
        ) => {
            let (s, c) = (s1 * scale, b1 * scale + bias);
            affine(s, c).then_some(Act::Clamp { scale: s, bias: c, lo, hi })
        }
        // clamp, then a positive affine map: the map moves the bounds.
        (
            Act::Clamp { scale, bias, lo, hi },
            Act::Clamp { scale: s2, bias: b2, lo: f32::MIN, hi: f32::MAX },
        ) if s2 > 0.0 => {
            let (s, c, l, h) = (scale * s2, bias * s2 + b2, lo * s2 + b2, hi * s2 + b2);
            (affine(s, c) && affine(l, h)).then_some(Act::Clamp { scale: s, bias: c, lo: l, hi: h })
        }
        // ReLU then a clamp from at least 0 (ReLU6 written as Relu + Clip).
        (Act::Relu, Act::Clamp { scale: 1.0, bias: 0.0, lo, hi }) if lo >= 0.0 => {
            Some(Act::Clamp { scale: 1.0, bias: 0.0, lo, hi })
        }
        _ => None,
    }
}

fn u16_of(v: i64, what: &str) -> Result<u16, String> {
    u16::try_from(v).map_err(|_| format!("{what} {v} is out of range (0..=65535)"))
}

impl Compiler<'_> {
    /// `d` stored channels-last (a rank-4 tensor).
    pub(super) fn channels_last(&mut self, name: &str, d: &Dyn) -> Result<Dyn, String> {
        self.stored(name, d, true)
    }

    /// `d` stored dense in ONNX's order.
    pub(super) fn onnx_order(&mut self, name: &str, d: &Dyn) -> Result<Dyn, String> {
        self.stored(name, d, false)
    }

    /// `d` stored channels-last (`nhwc`) or in ONNX's order, transposed by
    /// DMA when the bytes differ.
    fn stored(&mut self, name: &str, d: &Dyn, nhwc: bool) -> Result<Dyn, String> {
        let d = &self.materialize(name, d)?;
        if d.nhwc == nhwc {
            return Ok(d.clone());
        }
        let [c, h, w] = match d.shape[..] {
            [_, c, h, w] => [c, h, w],
            _ => return Err(format!("an image tensor [N, C, H, W] is expected, not {:?}", d.shape)),
        };
        if h * w == 1 || c == 1 {
            return Ok(Dyn { nhwc, ..d.clone() });
        }
        let y = self.act_tensor(&format!("{name}.{}", if nhwc { "nhwc" } else { "nchw" }), elems(&d.shape));
        let (onnx, last) = (dense_strides(&d.shape), Self::strides_of(&Dyn { nhwc: true, ..d.clone() }));
        let (src, dst) = if nhwc { (onnx, last) } else { (last, onnx) };
        self.strided_copy(name, d.t, y, &d.shape, &src, &dst)?;
        Ok(Dyn::new(y, d.shape.clone(), None, nhwc))
    }

    /// Folds `y = x * scale[c] + shift[c]` (per output channel) into the
    /// matrix product or convolution that wrote `d`, when nothing else
    /// reads its output and no activation follows it yet.
    pub(super) fn fold_affine(
        &mut self,
        input: &str,
        d: &Dyn,
        scale: Option<&[f32]>,
        shift: Option<&[f32]>,
    ) -> Option<Dyn> {
        let i = self.fusable(input, d)?;
        let (w, b, cout) = match self.g.ops[i] {
            Op::Linear { w, b, n, act: Act::None, .. } => (w, b, n),
            Op::Conv { w, b, cout, act: Act::None, .. } => (w, b, cout),
            Op::Depthwise { w, b, c, act: Act::None, .. } => (w, b, c),
            _ => return None,
        };
        let cout = cout as usize;
        if scale.is_some_and(|s| s.len() != cout) || shift.is_some_and(|s| s.len() != cout) {
            return None;
        }
        // Weights of every kind keep the output channel fastest.
        if let Some(s) = scale {
            let wd = self.data.get_mut(w)?.as_mut()?;
            wd.iter_mut().enumerate().for_each(|(j, x)| *x *= s[j % cout]);
            let bd = self.data.get_mut(b)?.as_mut()?;
            bd.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
        }
        if let Some(t) = shift {
            let bd = self.data.get_mut(b)?.as_mut()?;
            bd.iter_mut().zip(t).for_each(|(x, t)| *x += t);
        }
        Some(Dyn { op: Some(i), ..d.clone() })
    }

    /// `x[N,C,H,W] * s[N,C,1,1]`.
    pub(super) fn scale_channels(&mut self, n: &Node, x: &Dyn, s: &Dyn) -> Result<Dyn, String> {
        let x = self.channels_last(&n.name, x)?;
        let [b, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
        let y = self.act_tensor(&n.name, elems(&x.shape));
        self.g.ops.push(Op::ScaleChannels {
            name: n.name.clone(),
            x: x.t,
            s: s.t,
            y,
            batch: b as u32,
            hw: (h * w) as u32,
            c: c as u32,
        });
        Ok(Dyn::new(y, x.shape.clone(), None, true))
    }

    /// The activation of a `Clip` node (bounds from inputs, or before
    /// opset 11 from attributes).
    pub(super) fn clip(&self, n: &Node) -> Result<Act, String> {
        let bound = |i: usize, attr: &str, default: f32| -> Result<f32, String> {
            if let Some(v) = n.attrs.get(attr) {
                return match v {
                    crate::load::Attr::Float(f) => Ok(*f),
                    _ => Err(format!("attribute `{attr}` must be a float")),
                };
            }
            match self.opt(n, i) {
                None => Ok(default),
                Some(Val::C(c)) => {
                    let v = c.data.to_f32();
                    (v.len() == 1).then(|| v[0]).ok_or(format!("input {i} of Clip must be a scalar"))
                }
                Some(Val::D(_)) => Err(format!("input {i} of Clip must be a constant")),
            }
        };
        Self::only_attrs(n, &["min", "max"])?;
        let lo = bound(1, "min", f32::MIN)?.max(f32::MIN);
        let hi = bound(2, "max", f32::MAX)?.min(f32::MAX);
        if lo.is_nan() || hi.is_nan() || lo > hi {
            return Err(format!("bounds [{lo}, {hi}] are not an interval"));
        }
        Ok(Act::Clamp { scale: 1.0, bias: 0.0, lo, hi })
    }

    /// Kernel, strides and padding of a `Conv` or pooling node over `h x w`.
    fn window(n: &Node, h: usize, w: usize, kernel: Option<[usize; 2]>) -> Result<Spatial, String> {
        let ints = |k: &str| Self::ints_attr(n, k);
        let k = match (ints("kernel_shape")?, kernel) {
            (Some(v), _) if v.len() == 2 => [v[0], v[1]],
            (Some(v), _) => return Err(format!("kernel_shape {v:?} (only 2-D windows are supported)")),
            (None, Some(k)) => [k[0] as i64, k[1] as i64],
            (None, None) => return Err("kernel_shape is missing".into()),
        };
        if let Some(d) = ints("dilations")? {
            if d.iter().any(|&x| x != 1) {
                return Err(format!("dilations {d:?} (only 1 is supported)"));
            }
        }
        let s = ints("strides")?.unwrap_or(vec![1, 1]);
        if s.len() != 2 {
            return Err(format!("strides {s:?} (2 expected)"));
        }
        let (kh, kw) = (u16_of(k[0], "kernel height")?, u16_of(k[1], "kernel width")?);
        let (sh, sw) = (u16_of(s[0], "stride")?, u16_of(s[1], "stride")?);
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 {
            return Err("kernel and strides must be positive".into());
        }
        let auto = match n.attrs.get("auto_pad") {
            None => "NOTSET".to_string(),
            Some(crate::load::Attr::Str(s)) => s.clone(),
            Some(_) => return Err("attribute `auto_pad` must be a string".into()),
        };
        let (h16, w16) = (
            u32::try_from(h).map_err(|_| "image too tall")?,
            u32::try_from(w).map_err(|_| "image too wide")?,
        );
        // ONNX pads: [top, left, bottom, right].
        let pads: [u16; 4] = match auto.as_str() {
            "NOTSET" => match ints("pads")? {
                None => [0; 4],
                Some(p) if p.len() == 4 => {
                    [u16_of(p[0], "pad")?, u16_of(p[2], "pad")?, u16_of(p[1], "pad")?, u16_of(p[3], "pad")?]
                }
                Some(p) => return Err(format!("pads {p:?} (4 expected)")),
            },
            "VALID" => [0; 4],
            "SAME_UPPER" | "SAME_LOWER" => {
                let same = |x: u32, k: u16, s: u16| -> (u16, u16) {
                    let out = x.div_ceil(u32::from(s));
                    let total = ((out - 1) * u32::from(s) + u32::from(k)).saturating_sub(x);
                    let small = (total / 2) as u16;
                    let big = (total - total / 2) as u16;
                    if auto == "SAME_UPPER" {
                        (small, big)
                    } else {
                        (big, small)
                    }
                };
                let (t, b) = same(h16, kh, sh);
                let (l, r) = same(w16, kw, sw);
                [t, b, l, r]
            }
            other => return Err(format!("auto_pad `{other}` is not supported")),
        };
        let s = Spatial { h: h16, w: w16, kh, kw, sh, sw, pad: pads };
        if !s.valid() {
            return Err(format!("a {kh}x{kw} window does not fit the padded {h}x{w} image"));
        }
        Ok(s)
    }

    pub(super) fn conv(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"])?;
        let x = self.computed(n, 0)?;
        let wc = self.konst(n, 1).map_err(|_| "the weights must be a constant".to_string())?;
        let [b, c, h, w] = match x.shape[..] {
            [b, c, h, w] => [b, c, h, w],
            _ => return Err(format!("input of shape {:?} (only 2-D convolutions: [N, C, H, W])", x.shape)),
        };
        let [m, cg, kh, kw] = match wc.shape[..] {
            [m, cg, kh, kw] => [m, cg, kh, kw],
            _ => return Err(format!("weights of shape {:?} ([M, C/group, kH, kW] expected)", wc.shape)),
        };
        let g = usize::try_from(Self::int_attr(n, "group", 1)?).map_err(|_| "negative group")?;
        if g == 0 || c % g != 0 || m % g != 0 || cg * g != c {
            return Err(format!(
                "group {g} does not divide {c} input and {m} output channels into [{cg}] each"
            ));
        }
        let s = Self::window(n, h, w, Some([kh, kw]))?;
        if usize::from(s.kh) != kh || usize::from(s.kw) != kw {
            return Err("kernel_shape contradicts the weights".into());
        }
        let bias = match self.opt(n, 2) {
            None => vec![0.0; m],
            Some(Val::C(bc)) if elems(&bc.shape) == m => bc.data.to_f32(),
            Some(Val::C(bc)) => return Err(format!("bias of shape {:?} ({m} expected)", bc.shape)),
            Some(Val::D(_)) => return Err("the bias must be a constant".into()),
        };
        let wv = wc.data.to_f32();
        let x = self.channels_last(&n.name, &x)?;
        let (ho, wo) = s.out();
        let out_shape = vec![b, m, ho as usize, wo as usize];
        let y = self.act_tensor(&n.name, elems(&out_shape));
        let bt = self.weight(&format!("{}.b", n.name), bias, Init::Bias);
        let name = n.name.clone();
        let pointwise = kh == 1 && kw == 1 && s.sh == 1 && s.sw == 1 && s.pad == [0; 4];
        if g == 1 && pointwise {
            // A 1x1 convolution of channels-last pixels is a matrix product.
            let mut wt = vec![0.0; c * m];
            for o in 0..m {
                for i in 0..c {
                    wt[i * m + o] = wv[o * c + i];
                }
            }
            let wt = self.weight(&format!("{}.w", n.name), wt, Init::Weights { fan_in: c as u32 });
            let rows = (b * h * w) as u32;
            self.g.ops.push(Op::Linear {
                name,
                x: View::dense(x.t, c as u32),
                w: wt,
                b: bt,
                y: View::dense(y, m as u32),
                rows,
                k: c as u32,
                n: m as u32,
                act: Act::None,
            });
        } else if g == c && m == c && cg == 1 {
            // Depthwise: [kh][kw][c].
            let mut wt = vec![0.0; kh * kw * c];
            for ch in 0..c {
                for t in 0..kh * kw {
                    wt[t * c + ch] = wv[ch * kh * kw + t];
                }
            }
            let wt = self.weight(&format!("{}.w", n.name), wt, Init::Weights { fan_in: (kh * kw) as u32 });
            let batch = b as u32;
            self.g.ops.push(Op::Depthwise {
                name,
                x: x.t,
                w: wt,
                b: bt,
                y,
                batch,
                s,
                c: c as u32,
                act: Act::None,
            });
        } else {
            // HWIO; a grouped convolution as a dense one whose weights are
            // zero between groups (g times the work of the grouped one).
            let mg = m / g;
            let mut wt = vec![0.0; kh * kw * c * m];
            for o in 0..m {
                let grp = o / mg;
                for i in 0..cg {
                    for t in 0..kh * kw {
                        wt[(t * c + grp * cg + i) * m + o] = wv[(o * cg + i) * kh * kw + t];
                    }
                }
            }
            let fan_in = (kh * kw * cg) as u32;
            let wt = self.weight(&format!("{}.w", n.name), wt, Init::Weights { fan_in });
            let (batch, cin, cout) = (b as u32, c as u32, m as u32);
            self.g.ops.push(Op::Conv { name, x: x.t, w: wt, b: bt, y, batch, s, cin, cout, act: Act::None });
        }
        Ok(vec![Val::D(Dyn::new(y, out_shape, Some(self.g.ops.len() - 1), true))])
    }

    pub(super) fn batch_norm(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["epsilon", "momentum", "training_mode", "spatial"])?;
        if Self::int_attr(n, "training_mode", 0)? != 0 || n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return Err("training mode (running statistics as outputs) is not supported".into());
        }
        let x = self.computed(n, 0)?;
        let eps = Self::float_attr(n, "epsilon", 1e-5)?;
        let p: Vec<Vec<f32>> =
            (1..5).map(|i| self.konst(n, i).map(|c| c.data.to_f32())).collect::<Result<_, _>>()?;
        let ch = *x.shape.get(1).ok_or("input of rank below 2")?;
        if p.iter().any(|v| v.len() != ch) {
            return Err(format!("scale, bias, mean and variance must have {ch} values"));
        }
        let scale: Vec<f32> = (0..ch)
            .map(|c| (f64::from(p[0][c]) / (f64::from(p[3][c]) + f64::from(eps)).sqrt()) as f32)
            .collect();
        let shift: Vec<f32> =
            (0..ch).map(|c| (f64::from(p[1][c]) - f64::from(p[2][c]) * f64::from(scale[c])) as f32).collect();
        // The channel axis is 1; stored channels-last or as [N, C] it is
        // also the fastest one.
        if x.nhwc || x.shape.len() == 2 {
            if let Some(r) = self.fold_affine(&n.inputs[0], &x, Some(&scale), Some(&shift)) {
                self.report.fused += 1;
                return Ok(vec![Val::D(r)]);
            }
        }
        // Otherwise x * scale + shift with both broadcast.
        let mut cshape = vec![1; x.shape.len()];
        cshape[1] = ch;
        let full = |v: &[f32], this: &mut Self| {
            let e = super::expand(v, &cshape, &x.shape);
            let e = if x.nhwc { nchw_to_nhwc(&e, &x.shape) } else { e };
            this.weight(&format!("{}.bn", n.name), e, Init::Bias)
        };
        let st = full(&scale, self);
        let tt = full(&shift, self);
        let y = self.eltwise(n, false, &x, st);
        Ok(vec![Val::D(self.eltwise(n, true, &y, tt))])
    }

    pub(super) fn pool(&mut self, n: &Node) -> NodeResult {
        let avg = n.op == "AveragePool";
        Self::only_attrs(
            n,
            &[
                "auto_pad",
                "ceil_mode",
                "count_include_pad",
                "dilations",
                "kernel_shape",
                "pads",
                "storage_order",
                "strides",
            ],
        )?;
        if Self::int_attr(n, "ceil_mode", 0)? != 0 {
            return Err("ceil_mode = 1 is not supported".into());
        }
        if n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return Err("the Indices output is not supported".into());
        }
        let x = self.computed(n, 0)?;
        let [b, c, h, w] = match x.shape[..] {
            [b, c, h, w] => [b, c, h, w],
            _ => return Err(format!("input of shape {:?} (only 2-D pooling: [N, C, H, W])", x.shape)),
        };
        let s = Self::window(n, h, w, None)?;
        if avg && Self::int_attr(n, "count_include_pad", 0)? != 0 && s.pad != [0; 4] {
            return Err("count_include_pad = 1 with padding is not supported".into());
        }
        if !s.uniform() || usize::from(s.pad[0]) >= usize::from(s.kh.min(s.kw)) {
            return Err(
                "pooling takes one stride, the same padding on every side and padding below the window"
                    .into(),
            );
        }
        let x = self.channels_last(&n.name, &x)?;
        let (ho, wo) = s.out();
        let out_shape = vec![b, c, ho as usize, wo as usize];
        let y = self.act_tensor(&n.name, elems(&out_shape));
        let op = if avg { PoolOp::Avg } else { PoolOp::Max };
        self.g.ops.push(Op::Pool { name: n.name.clone(), x: x.t, y, batch: b as u32, s, c: c as u32, op });
        Ok(vec![Val::D(Dyn::new(y, out_shape, None, true))])
    }

    pub(super) fn global_pool(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let x = self.computed(n, 0)?;
        let [b, c, h, w] = match x.shape[..] {
            [b, c, h, w] => [b, c, h, w],
            _ => return Err(format!("input of shape {:?} ([N, C, H, W] expected)", x.shape)),
        };
        let x = self.channels_last(&n.name, &x)?;
        let y = self.act_tensor(&n.name, b * c);
        let (batch, hw, c32) = (b as u32, (h * w) as u32, c as u32);
        self.g.ops.push(Op::GlobalPool { name: n.name.clone(), x: x.t, y, batch, hw, c: c32 });
        Ok(vec![Val::D(Dyn::new(y, vec![b, c, 1, 1], None, true))])
    }

    /// `Slice` of a constant.
    pub(super) fn slice_const(&self, n: &Node) -> Result<Const, String> {
        let data = self.konst(n, 0)?;
        let rank = data.shape.len();
        let ints = |i: usize| -> Result<Option<Vec<i64>>, String> {
            match self.opt(n, i) {
                None => Ok(None),
                Some(Val::C(c)) => Ok(Some(c.data.to_i64())),
                Some(Val::D(_)) => Err(format!("input {i} must be a constant")),
            }
        };
        let (starts, ends) = match (Self::ints_attr(n, "starts")?, Self::ints_attr(n, "ends")?) {
            (Some(s), Some(e)) => (s, e),
            _ => (ints(1)?.ok_or("starts missing")?, ints(2)?.ok_or("ends missing")?),
        };
        let axes = match Self::ints_attr(n, "axes")? {
            Some(a) => a,
            None => ints(3)?.unwrap_or_else(|| (0..starts.len() as i64).collect()),
        };
        let steps = ints(4)?.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
            return Err("starts, ends, axes and steps differ in length".into());
        }
        let mut ranges: Vec<Vec<usize>> = data.shape.iter().map(|&d| (0..d).collect()).collect();
        for i in 0..starts.len() {
            let a = super::axis(axes[i], rank).ok_or("axis out of range")?;
            let dim = data.shape[a] as i64;
            let step = steps[i];
            if step == 0 {
                return Err("step 0".into());
            }
            let clampi = |v: i64, lo: i64, hi: i64| (if v < 0 { v + dim } else { v }).clamp(lo, hi);
            let picked: Vec<usize> = if step > 0 {
                let (s, e) = (clampi(starts[i], 0, dim), clampi(ends[i], 0, dim));
                (s..e).step_by(step as usize).map(|v| v as usize).collect()
            } else {
                let (s, e) = (clampi(starts[i], -1, dim - 1), clampi(ends[i], -1, dim - 1));
                let mut v = Vec::new();
                let mut k = s;
                while k > e {
                    v.push(k as usize);
                    k += step;
                }
                v
            };
            ranges[a] = picked;
        }
        let shape: Vec<usize> = ranges.iter().map(Vec::len).collect();
        let mut strides = vec![1usize; rank];
        for i in (0..rank.saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * data.shape[i + 1];
        }
        let total = elems(&shape);
        let mut idx = vec![0usize; rank];
        let mut picks = Vec::with_capacity(total);
        for _ in 0..total {
            picks.push(idx.iter().enumerate().map(|(d, &i)| ranges[d][i] * strides[d]).sum::<usize>());
            for d in (0..rank).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(match &data.data {
            Data::I64(v) => Const { shape, data: Data::I64(picks.iter().map(|&p| v[p]).collect()) },
            Data::F32(v) => Const { shape, data: Data::F32(picks.iter().map(|&p| v[p]).collect()) },
        })
    }
}
