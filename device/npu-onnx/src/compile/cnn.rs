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

use crate::refusal::{invalid, unsupported, Refusal};
use npu_graph::{Act, Init, Op, PoolOp, Spatial, View};

use super::layout::str_attr;
use super::seq::{dense_strides, Place};
use super::{elems, Compiler, Dyn, NodeResult, Val};
use crate::load::{Attr, Const, Data, Node};
use std::collections::HashMap;

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

fn u16_of(v: i64, what: &str) -> Result<u16, Refusal> {
    u16::try_from(v).map_err(|_| unsupported(format!("{what} {v} is out of range (0..=65535)")))
}

impl Compiler<'_> {
    /// `d` stored channels-last (a rank-4 tensor).
    pub(super) fn channels_last(&mut self, name: &str, d: &Dyn) -> Result<Dyn, Refusal> {
        self.stored(name, d, true)
    }

    /// `d` stored dense in ONNX's order.
    pub(super) fn onnx_order(&mut self, name: &str, d: &Dyn) -> Result<Dyn, Refusal> {
        self.stored(name, d, false)
    }

    /// `d` stored channels-last (`nhwc`) or in ONNX's order, transposed by
    /// DMA when the bytes differ.
    fn stored(&mut self, name: &str, d: &Dyn, nhwc: bool) -> Result<Dyn, Refusal> {
        let d = &self.materialize(name, d)?;
        if d.nhwc == nhwc {
            return Ok(d.clone());
        }
        let [c, h, w] = match d.shape[..] {
            [_, c, h, w] => [c, h, w],
            _ => {
                return Err(unsupported(format!(
                    "an image tensor [N, C, H, W] is expected, not {:?}",
                    d.shape
                )))
            }
        };
        if h * w == 1 || c == 1 {
            return Ok(Dyn { nhwc, ..d.clone() });
        }
        let y = self.act_tensor(&format!("{name}.{}", if nhwc { "nhwc" } else { "nchw" }), elems(&d.shape));
        let (onnx, last) = (dense_strides(&d.shape), Self::strides_of(&Dyn { nhwc: true, ..d.clone() }));
        let (src, dst) = if nhwc { (onnx, last) } else { (last, onnx) };
        self.strided_copy(name, &d.shape, Place::new(d.t, 0, &src), Place::new(y, 0, &dst))?;
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
    pub(super) fn scale_channels(&mut self, n: &Node, x: &Dyn, s: &Dyn) -> Result<Dyn, Refusal> {
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
    pub(super) fn clip(&self, n: &Node) -> Result<Act, Refusal> {
        let bound = |i: usize, attr: &str, default: f32| -> Result<f32, Refusal> {
            if let Some(v) = n.attrs.get(attr) {
                return match v {
                    crate::load::Attr::Float(f) => Ok(*f),
                    _ => Err(invalid(format!("attribute `{attr}` must be a float"))),
                };
            }
            match self.opt(n, i) {
                None => Ok(default),
                Some(Val::C(c)) => {
                    let v = c.data.to_f32();
                    (v.len() == 1)
                        .then(|| v[0])
                        .ok_or_else(|| invalid(format!("input {i} of Clip must be a scalar")))
                }
                Some(Val::D(_) | Val::I(_)) => {
                    Err(unsupported(format!("input {i} of Clip must be a constant")))
                }
            }
        };
        Self::only_attrs(n, &["min", "max"])?;
        let lo = bound(1, "min", f32::MIN)?.max(f32::MIN);
        let hi = bound(2, "max", f32::MAX)?.min(f32::MAX);
        if lo.is_nan() || hi.is_nan() || lo > hi {
            return Err(invalid(format!("bounds [{lo}, {hi}] are not an interval")));
        }
        Ok(Act::Clamp { scale: 1.0, bias: 0.0, lo, hi })
    }

    /// Kernel, strides and padding of a `Conv` or pooling node over `h x w`.
    fn window(n: &Node, h: usize, w: usize, kernel: Option<[usize; 2]>) -> Result<Spatial, Refusal> {
        let ints = |k: &str| Self::ints_attr(n, k);
        let k = match (ints("kernel_shape")?, kernel) {
            (Some(v), _) if v.len() == 2 => [v[0], v[1]],
            (Some(v), _) => {
                return Err(unsupported(format!("kernel_shape {v:?} (only 2-D windows are supported)")))
            }
            (None, Some(k)) => [k[0] as i64, k[1] as i64],
            (None, None) => return Err(invalid("kernel_shape is missing")),
        };
        if let Some(d) = ints("dilations")? {
            if d.iter().any(|&x| x != 1) {
                return Err(unsupported(format!("dilations {d:?} (only 1 is supported)")));
            }
        }
        let s = ints("strides")?.unwrap_or(vec![1, 1]);
        if s.len() != 2 {
            return Err(invalid(format!("strides {s:?} (2 expected)")));
        }
        let (kh, kw) = (u16_of(k[0], "kernel height")?, u16_of(k[1], "kernel width")?);
        let (sh, sw) = (u16_of(s[0], "stride")?, u16_of(s[1], "stride")?);
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 {
            return Err(invalid("kernel and strides must be positive"));
        }
        let auto = match n.attrs.get("auto_pad") {
            None => "NOTSET".to_string(),
            Some(crate::load::Attr::Str(s)) => s.clone(),
            Some(_) => return Err(invalid("attribute `auto_pad` must be a string")),
        };
        let (h16, w16) = (
            u32::try_from(h).map_err(|_| unsupported("image too tall"))?,
            u32::try_from(w).map_err(|_| unsupported("image too wide"))?,
        );
        // ONNX pads: [top, left, bottom, right].
        let pads: [u16; 4] = match auto.as_str() {
            "NOTSET" => match ints("pads")? {
                None => [0; 4],
                Some(p) if p.len() == 4 => {
                    [u16_of(p[0], "pad")?, u16_of(p[2], "pad")?, u16_of(p[1], "pad")?, u16_of(p[3], "pad")?]
                }
                Some(p) => return Err(invalid(format!("pads {p:?} (4 expected)"))),
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
            other => return Err(unsupported(format!("auto_pad `{other}` is not supported"))),
        };
        let s = Spatial { h: h16, w: w16, kh, kw, sh, sw, pad: pads };
        if !s.valid() {
            return Err(invalid(format!("a {kh}x{kw} window does not fit the padded {h}x{w} image")));
        }
        Ok(s)
    }

    /// The image input and the constant rank-4 weights (laid out as
    /// `layout` says) of a `Conv` or `ConvTranspose`, with their dimensions.
    #[allow(clippy::type_complexity)]
    fn conv_operands(
        &mut self,
        n: &Node,
        layout: &str,
    ) -> Result<(Dyn, [usize; 4], Const, [usize; 4]), Refusal> {
        let x = self.computed(n, 0)?;
        let wc = self.konst(n, 1).map_err(|_| unsupported("the weights must be a constant"))?;
        let xd = match x.shape[..] {
            [b, c, h, w] => [b, c, h, w],
            _ => {
                return Err(unsupported(format!(
                    "input of shape {:?} (only 2-D convolutions: [N, C, H, W])",
                    x.shape
                )))
            }
        };
        let wd = match wc.shape[..] {
            [a, b, kh, kw] => [a, b, kh, kw],
            _ => return Err(invalid(format!("weights of shape {:?} ({layout} expected)", wc.shape))),
        };
        Ok((x, xd, wc, wd))
    }

    /// The constant bias of a convolution with `m` output channels (input
    /// 2; zeros when absent).
    fn conv_bias(&self, n: &Node, m: usize) -> Result<Vec<f32>, Refusal> {
        match self.opt(n, 2) {
            None => Ok(vec![0.0; m]),
            Some(Val::C(bc)) if elems(&bc.shape) == m => Ok(bc.data.to_f32()),
            Some(Val::C(bc)) => Err(invalid(format!("bias of shape {:?} ({m} expected)", bc.shape))),
            Some(Val::D(_) | Val::I(_)) => Err(unsupported("the bias must be a constant")),
        }
    }

    pub(super) fn conv(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"])?;
        let (x, [_, c, h, w], wc, [m, cg, kh, kw]) = self.conv_operands(n, "[M, C/group, kH, kW]")?;
        let g = usize::try_from(Self::int_attr(n, "group", 1)?).map_err(|_| invalid("negative group"))?;
        if g == 0 || c % g != 0 || m % g != 0 || cg * g != c {
            return Err(invalid(format!(
                "group {g} does not divide {c} input and {m} output channels into [{cg}] each"
            )));
        }
        let s = Self::window(n, h, w, Some([kh, kw]))?;
        if usize::from(s.kh) != kh || usize::from(s.kw) != kw {
            return Err(invalid("kernel_shape contradicts the weights"));
        }
        let bias = self.conv_bias(n, m)?;
        let y = self.conv_op(&n.name, &x, &wc.data.to_f32(), [m, cg, kh, kw], g, s, bias)?;
        Ok(vec![Val::D(y)])
    }

    /// A convolution of `x` (`[N, C, H, W]`) with weights `wv` (ONNX's
    /// `[M, C/group, kH, kW]`, row-major) and `bias` (M values): one SA
    /// matrix product (1x1), VU depthwise convolution, or SA convolution
    /// (grouped ones with zeros between the groups). The result is
    /// channels-last.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv_op(
        &mut self,
        name: &str,
        x: &Dyn,
        wv: &[f32],
        [m, cg, kh, kw]: [usize; 4],
        g: usize,
        s: Spatial,
        bias: Vec<f32>,
    ) -> Result<Dyn, Refusal> {
        let [b, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
        let x = self.channels_last(name, x)?;
        let (ho, wo) = s.out();
        let out_shape = vec![b, m, ho as usize, wo as usize];
        super::check_size(&out_shape)?;
        let y = self.act_tensor(name, elems(&out_shape));
        let bt = self.weight(&format!("{name}.b"), bias, Init::Bias);
        let wname = format!("{name}.w");
        let name = name.to_string();
        let pointwise = kh == 1 && kw == 1 && s.sh == 1 && s.sw == 1 && s.pad == [0; 4];
        if g == 1 && pointwise {
            // A 1x1 convolution of channels-last pixels is a matrix product.
            let mut wt = vec![0.0; c * m];
            for o in 0..m {
                for i in 0..c {
                    wt[i * m + o] = wv[o * c + i];
                }
            }
            let wt = self.weight(&wname, wt, Init::Weights { fan_in: c as u32 });
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
            let wt = self.weight(&wname, wt, Init::Weights { fan_in: (kh * kw) as u32 });
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
            let wt = self.weight(&wname, wt, Init::Weights { fan_in });
            let (batch, cin, cout) = (b as u32, c as u32, m as u32);
            self.g.ops.push(Op::Conv {
                name,
                x: x.t,
                w: wt,
                b: bt,
                y: View::dense(y, cout),
                batch,
                s,
                cin,
                cout,
                act: Act::None,
                residual: None,
            });
        }
        Ok(Dyn::new(y, out_shape, Some(self.g.ops.len() - 1), true))
    }

    /// `ConvTranspose` as `stride_h x stride_w` ordinary convolutions,
    /// one per output phase (the outputs whose padded position is `r`
    /// modulo the stride), each with the kernel taps of its phase flipped;
    /// strided copies interleave their results into the output.
    pub(super) fn conv_transpose(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(
            n,
            &["auto_pad", "dilations", "group", "kernel_shape", "output_padding", "pads", "strides"],
        )?;
        let (x, [b, c, h, w], wc, [ci, mg, kh, kw]) = self.conv_operands(n, "[C, M/group, kH, kW]")?;
        if elems(&x.shape) == 0 {
            return Err(unsupported("an empty input is not supported"));
        }
        let g = usize::try_from(Self::int_attr(n, "group", 1)?).map_err(|_| invalid("negative group"))?;
        if g == 0 || ci != c || c % g != 0 || kh == 0 || kw == 0 {
            return Err(invalid(format!(
                "weights {:?} do not fit {c} input channels in group {g}",
                wc.shape
            )));
        }
        let (cg, m) = (c / g, mg.saturating_mul(g));
        if let Some(k) = Self::ints_attr(n, "kernel_shape")? {
            if k.len() != 2 || k[0] != kh as i64 || k[1] != kw as i64 {
                return Err(invalid(format!("kernel_shape {k:?} contradicts the weights")));
            }
        }
        if let Some(d) = Self::ints_attr(n, "dilations")? {
            if d.iter().any(|&x| x != 1) {
                return Err(unsupported(format!("dilations {d:?} (only 1 is supported)")));
            }
        }
        match n.attrs.get("auto_pad") {
            None => {}
            Some(crate::load::Attr::Str(s)) if s == "NOTSET" || s == "VALID" => {}
            Some(_) => return Err(unsupported("auto_pad other than NOTSET and VALID is not supported")),
        }
        let two = |k: &str, default: i64| -> Result<[usize; 2], Refusal> {
            match Self::ints_attr(n, k)? {
                None => Ok([default as usize; 2]),
                Some(v) if v.len() == 2 && v.iter().all(|&x| (0..=4096).contains(&x)) => {
                    Ok([v[0] as usize, v[1] as usize])
                }
                Some(v) => Err(unsupported(format!("{k} {v:?} (two values in 0..=4096 expected)"))),
            }
        };
        let [sh, sw] = two("strides", 1)?;
        let [oph, opw] = two("output_padding", 0)?;
        let pads = match Self::ints_attr(n, "pads")? {
            None => [0; 4],
            Some(p) if p.len() == 4 && p.iter().all(|&x| (0..=4096).contains(&x)) => {
                [p[0] as usize, p[1] as usize, p[2] as usize, p[3] as usize]
            }
            Some(p) => return Err(unsupported(format!("pads {p:?} (four values in 0..=4096 expected)"))),
        };
        if sh == 0 || sw == 0 || oph >= sh || opw >= sw {
            return Err(invalid("strides must be positive and output_padding below them"));
        }
        let bias = self.conv_bias(n, m)?;
        let (oh, phases_h) = transpose_phases(h, kh, sh, pads[0], pads[2], oph)?;
        let (ow, phases_w) = transpose_phases(w, kw, sw, pads[1], pads[3], opw)?;
        let out_shape = vec![b, m, oh, ow];
        super::check_size(&out_shape)?;
        let wv = wc.data.to_f32();
        let single = phases_h.len() == 1 && phases_w.len() == 1;
        let y = self.act_tensor(&n.name, elems(&out_shape));
        let ydyn = Dyn::new(y, out_shape.clone(), None, true);
        let dst = Self::strides_of(&ydyn);
        for ph in &phases_h {
            for pw in &phases_w {
                if ph.count == 0 || pw.count == 0 {
                    continue;
                }
                if ph.taps == 0 || pw.taps == 0 {
                    return Err(unsupported(
                        "a kernel smaller than the stride (outputs that are the bias alone) is not supported",
                    ));
                }
                let (th, tw) = (ph.taps, pw.taps);
                let mut w2 = vec![0.0; m * cg * th * tw];
                for oc in 0..m {
                    let (gi, o) = (oc / mg, oc % mg);
                    for ic in 0..cg {
                        for j in 0..th {
                            for l in 0..tw {
                                let (ky, kx) = (ph.r + sh * (th - 1 - j), pw.r + sw * (tw - 1 - l));
                                w2[((oc * cg + ic) * th + j) * tw + l] =
                                    wv[(((gi * cg + ic) * mg + o) * kh + ky) * kw + kx];
                            }
                        }
                    }
                }
                let s = Spatial {
                    h: u32::try_from(h).map_err(|_| unsupported("image too tall"))?,
                    w: u32::try_from(w).map_err(|_| unsupported("image too wide"))?,
                    kh: u16_of(th as i64, "kernel height")?,
                    kw: u16_of(tw as i64, "kernel width")?,
                    sh: 1,
                    sw: 1,
                    pad: [
                        u16_of(ph.pad.0 as i64, "pad")?,
                        u16_of(ph.pad.1 as i64, "pad")?,
                        u16_of(pw.pad.0 as i64, "pad")?,
                        u16_of(pw.pad.1 as i64, "pad")?,
                    ],
                };
                let name = format!("{}.phase{}{}", n.name, ph.r, pw.r);
                let part = self.conv_op(&name, &x, &w2, [m, cg, th, tw], g, s, bias.clone())?;
                let (lh, lw) = (part.shape[2], part.shape[3]);
                if single && ph.crop == 0 && pw.crop == 0 && (lh, lw) == (oh, ow) {
                    // Stride 1: the one phase is the output.
                    self.report.aliases += 1;
                    return Ok(vec![Val::D(part)]);
                }
                let src = Self::strides_of(&part);
                let from = super::seq::Place::new(part.t, (ph.crop * lw + pw.crop) * m, &src);
                let ystrides = [dst[0], dst[1], dst[2] * sh, dst[3] * sw];
                let to = super::seq::Place::new(y, ph.first * dst[2] + pw.first * dst[3], &ystrides);
                self.strided_copy(&name, &[b, m, ph.count, pw.count], from, to)?;
            }
        }
        Ok(vec![Val::D(ydyn)])
    }

    pub(super) fn batch_norm(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &["epsilon", "momentum", "training_mode", "spatial"])?;
        if Self::int_attr(n, "training_mode", 0)? != 0 || n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return Err(unsupported("training mode (running statistics as outputs) is not supported"));
        }
        let x = self.computed(n, 0)?;
        let eps = Self::float_attr(n, "epsilon", 1e-5)?;
        let p: Vec<Vec<f32>> =
            (1..5).map(|i| self.konst(n, i).map(|c| c.data.to_f32())).collect::<Result<_, _>>()?;
        let ch = *x.shape.get(1).ok_or_else(|| invalid("input of rank below 2"))?;
        if p.iter().any(|v| v.len() != ch) {
            return Err(invalid(format!("scale, bias, mean and variance must have {ch} values")));
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
        let ceil = Self::int_attr(n, "ceil_mode", 0)? != 0;
        if n.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return Err(unsupported("the Indices output is not supported"));
        }
        let x = self.computed(n, 0)?;
        let [b, c, h, w] = match x.shape[..] {
            [b, c, h, w] => [b, c, h, w],
            _ => {
                return Err(unsupported(format!(
                    "input of shape {:?} (only 2-D pooling: [N, C, H, W])",
                    x.shape
                )))
            }
        };
        let mut s = Self::window(n, h, w, None)?;
        let extra = if ceil { self.ceil_rows(n, &s)? } else { (0, 0) };
        let x = match (ceil, extra) {
            (false, _) | (true, (0, 0)) => x,
            (true, _) if avg => {
                return Err(unsupported("ceil_mode = 1 with a last window past the padding (AveragePool)"))
            }
            (true, (eh, ew)) => {
                // The extra windows of ceil mode read past the padded input:
                // pad it there with -inf, which no maximum takes (each
                // window starts inside the input or its leading padding).
                let attrs = HashMap::from([
                    ("pads".to_string(), Attr::Ints(vec![0, 0, 0, 0, 0, 0, eh as i64, ew as i64])),
                    ("value".to_string(), Attr::Float(f32::NEG_INFINITY)),
                ]);
                let Val::D(xp) = self.run_part(n, "ceil", "Pad", vec![n.inputs[0].clone()], attrs)? else {
                    return Err(unsupported("the padded input folded to a constant"));
                };
                s = Self::window(n, h + eh, w + ew, None)?;
                xp
            }
        };
        let include_pad = Self::int_attr(n, "count_include_pad", 0)? != 0;
        // An average whose every window has kh*kw terms (no padding, or
        // padding counted) is a depthwise convolution with weights
        // 1/(kh*kw): any strides and padding.
        if avg && (include_pad || (s.pad == [0; 4] && !s.uniform())) {
            let k = usize::from(s.kh) * usize::from(s.kw);
            let wv = vec![1.0 / k as f32; c * k];
            let (kh, kw) = (usize::from(s.kh), usize::from(s.kw));
            let y = self.conv_op(&n.name, &x, &wv, [c, 1, kh, kw], c, s, vec![0.0; c])?;
            return Ok(vec![Val::D(y)]);
        }
        if !s.uniform() || usize::from(s.pad[0]) >= usize::from(s.kh.min(s.kw)) {
            return Err(unsupported(
                "pooling takes one stride, the same padding on every side and padding below the window",
            ));
        }
        let x = self.channels_last(&n.name, &x)?;
        let (ho, wo) = s.out();
        let out_shape = vec![b, c, ho as usize, wo as usize];
        let y = self.act_tensor(&n.name, elems(&out_shape));
        let op = if avg { PoolOp::Avg } else { PoolOp::Max };
        self.g.ops.push(Op::Pool { name: n.name.clone(), x: x.t, y, batch: b as u32, s, c: c as u32, op });
        Ok(vec![Val::D(Dyn::new(y, out_shape, None, true))])
    }

    /// Rows and columns that ceil mode's last windows read beyond the
    /// padded input (`(0, 0)`: ceil mode changes nothing). ONNX's output
    /// size is `ceil((in + pads - k) / stride) + 1`, less one where that
    /// window would start past the input and its leading padding.
    fn ceil_rows(&self, n: &Node, s: &Spatial) -> Result<(usize, usize), Refusal> {
        if str_attr(n, "auto_pad", "NOTSET")? != "NOTSET" {
            return Err(unsupported("ceil_mode = 1 with auto_pad is not supported"));
        }
        let extra = |inp: u32, k: u16, st: u16, p0: u16, p1: u16| -> usize {
            let (inp, k, st, p0, p1) =
                (inp as usize, usize::from(k), usize::from(st).max(1), usize::from(p0), usize::from(p1));
            let span = (inp + p0 + p1).saturating_sub(k);
            let mut out = span.div_ceil(st) + 1;
            if (out - 1) * st >= inp + p0 {
                out -= 1;
            }
            ((out - 1) * st + k).saturating_sub(inp + p0 + p1)
        };
        Ok((extra(s.h, s.kh, s.sh, s.pad[0], s.pad[1]), extra(s.w, s.kw, s.sw, s.pad[2], s.pad[3])))
    }

    pub(super) fn global_pool(&mut self, n: &Node) -> NodeResult {
        Self::only_attrs(n, &[])?;
        let x = self.computed(n, 0)?;
        let [b, c, h, w] = match x.shape[..] {
            [b, c, h, w] => [b, c, h, w],
            _ => return Err(unsupported(format!("input of shape {:?} ([N, C, H, W] expected)", x.shape))),
        };
        let x = self.channels_last(&n.name, &x)?;
        let y = self.act_tensor(&n.name, b * c);
        let (batch, hw, c32) = (b as u32, (h * w) as u32, c as u32);
        self.g.ops.push(Op::GlobalPool { name: n.name.clone(), x: x.t, y, batch, hw, c: c32 });
        Ok(vec![Val::D(Dyn::new(y, vec![b, c, 1, 1], None, true))])
    }

    /// The indices `Slice` picks along each axis of a `shape` tensor.
    pub(super) fn slice_picks(&self, n: &Node, shape: &[usize]) -> Result<Vec<Vec<usize>>, Refusal> {
        let rank = shape.len();
        let ints = |i: usize| self.const_ints(n, i, &format!("input {i}"));
        let (starts, ends) = match (Self::ints_attr(n, "starts")?, Self::ints_attr(n, "ends")?) {
            (Some(s), Some(e)) => (s, e),
            _ => (
                ints(1)?.ok_or_else(|| invalid("starts missing"))?,
                ints(2)?.ok_or_else(|| invalid("ends missing"))?,
            ),
        };
        let axes = match Self::ints_attr(n, "axes")? {
            Some(a) => a,
            None => ints(3)?.unwrap_or_else(|| (0..starts.len() as i64).collect()),
        };
        let steps = ints(4)?.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
            return Err(invalid("starts, ends, axes and steps differ in length"));
        }
        let mut ranges: Vec<Vec<usize>> = shape.iter().map(|&d| (0..d).collect()).collect();
        for i in 0..starts.len() {
            let a = super::axis(axes[i], rank).ok_or_else(|| invalid("axis out of range"))?;
            let dim = shape[a] as i64;
            let step = steps[i];
            if step == 0 {
                return Err(invalid("step 0"));
            }
            let clampi =
                |v: i64, lo: i64, hi: i64| (if v < 0 { v.saturating_add(dim) } else { v }).clamp(lo, hi);
            let picked: Vec<usize> = if step > 0 {
                let (s, e) = (clampi(starts[i], 0, dim), clampi(ends[i], 0, dim));
                (s..e).step_by(usize::try_from(step).unwrap_or(usize::MAX)).map(|v| v as usize).collect()
            } else {
                let (s, e) = (clampi(starts[i], -1, dim - 1), clampi(ends[i], -1, dim - 1));
                let mut v = Vec::new();
                let mut k = s;
                while k > e {
                    v.push(k as usize);
                    k = k.saturating_add(step);
                }
                v
            };
            ranges[a] = picked;
        }
        Ok(ranges)
    }

    /// `Slice` of a constant.
    pub(super) fn slice_const(&self, n: &Node) -> Result<Const, Refusal> {
        let data = self.konst(n, 0)?;
        let rank = data.shape.len();
        let ranges = self.slice_picks(n, &data.shape)?;
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

/// The outputs of one `ConvTranspose` axis with residue `r` modulo the
/// stride: `count` of them, the first at `first`, every `stride`-th after
/// it. They are a stride-1 convolution of the input with the `taps`
/// kernel taps `r, r + stride, ...` (flipped) and padding `pad`, whose
/// first `crop` outputs are not needed.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Phase {
    r: usize,
    taps: usize,
    pad: (usize, usize),
    crop: usize,
    count: usize,
    first: usize,
}

/// Output length and phases of one axis of a transposed convolution of
/// `len` inputs, kernel `k`, stride `s`, padding `pb`/`pe`, output padding
/// `op` (ONNX: output `o` sums `x[i] * w[t]` over `o = i*s - pb + t`).
fn transpose_phases(
    len: usize,
    k: usize,
    s: usize,
    pb: usize,
    pe: usize,
    op: usize,
) -> Result<(usize, Vec<Phase>), Refusal> {
    let (len, k, s, pb, pe, op) = (len as i64, k as i64, s as i64, pb as i64, pe as i64, op as i64);
    let out = s.saturating_mul(len - 1).saturating_add(op + k - pb - pe);
    if out <= 0 || out > 1 << 28 {
        return Err(invalid(format!("the output length {out} is not positive or too large")));
    }
    let mut phases = Vec::new();
    for r in 0..s {
        let taps = if r < k { (k - r + s - 1) / s } else { 0 };
        // Outputs o = s*q + r - pb for q in q_lo..=q_hi, inside 0..out.
        let q_lo = -(r - pb).div_euclid(s);
        let q_hi = (out - 1 + pb - r).div_euclid(s);
        let count = (q_hi - q_lo + 1).max(0);
        // Output q of the phase reads x[q - taps + 1 ..= q].
        let pad_lo = taps - 1 - q_lo;
        let pad_hi = count + taps - 1 - len - pad_lo;
        phases.push(Phase {
            r: r as usize,
            taps: taps as usize,
            pad: (pad_lo.max(0) as usize, pad_hi.max(0) as usize),
            crop: (-pad_lo).max(0) as usize,
            count: count as usize,
            first: (s * q_lo + r - pb).max(0) as usize,
        });
    }
    Ok((out as usize, phases))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1-D transposed convolution computed directly, and from the phases.
    fn both(x: &[f32], w: &[f32], s: usize, pb: usize, pe: usize, op: usize) -> (Vec<f32>, Vec<f32>) {
        let (out, phases) = transpose_phases(x.len(), w.len(), s, pb, pe, op).unwrap();
        let mut direct = vec![0.0; out];
        for (i, xi) in x.iter().enumerate() {
            for (t, wt) in w.iter().enumerate() {
                let o = (i * s + t) as i64 - pb as i64;
                if (0..out as i64).contains(&o) {
                    direct[o as usize] += xi * wt;
                }
            }
        }
        let mut phased = vec![f32::NAN; out];
        for p in phases.iter().filter(|p| p.count > 0) {
            let flipped: Vec<f32> = (0..p.taps).map(|j| w[p.r + s * (p.taps - 1 - j)]).collect();
            let padded: Vec<f32> = std::iter::repeat_n(0.0, p.pad.0)
                .chain(x.iter().copied())
                .chain(std::iter::repeat_n(0.0, p.pad.1))
                .collect();
            for q in 0..p.count {
                let t = q + p.crop;
                let v: f32 = (0..p.taps).map(|j| padded[t + j] * flipped[j]).sum();
                phased[p.first + q * s] = v;
            }
        }
        (direct, phased)
    }

    #[test]
    fn transposed_convolution_phases_match_the_definition() {
        let x = [1.0, -2.0, 3.5, 0.25, 5.0];
        for (k, s) in [(2, 2), (3, 2), (4, 2), (3, 1), (5, 3), (3, 3)] {
            let w: Vec<f32> = (0..k).map(|t| 0.5 + t as f32).collect();
            for pb in 0..k {
                for pe in 0..k {
                    for op in 0..s {
                        let (d, p) = both(&x, &w, s, pb, pe, op);
                        assert_eq!(d, p, "k {k} s {s} pads {pb},{pe} output_padding {op}");
                    }
                }
            }
        }
    }
}
