//! Inverted-residual blocks lowered as one pipeline
//! ([`LowerOptions::fuse_blocks`](crate::LowerOptions::fuse_blocks)).
//!
//! MobileNetV2-style networks chain a 1x1 expansion (`Linear` over the
//! pixels of an NHWC tensor), a depthwise convolution and a 1x1
//! projection, often with a residual add of the block's input. The
//! expanded tensors are the largest of the network, and lowered op by op
//! each goes to HBM and back twice. Lowered as one chain, each tile (one
//! or more whole images) is loaded once, expanded, filtered and projected
//! in SRAM, the residual added from the loaded input, and only the
//! block's output stored: what NPU compilers call layer fusion or
//! cascading (Arm's Vela "cascading", TVM's fused blocks).
//!
//! Every element is computed by the same instructions on the same
//! operands as op by op, so the results are the same bits. A block is
//! fused only when two tiles of one whole image fit SRAM beside its
//! weights: bands of rows would compute the expansion of the rows two
//! bands share twice, and on this lowering's serial chain of engines per
//! tile they cost more cycles than op by op.

use npu_graph::{Act, Graph, Op, Spatial, TensorId, View};
use vnpu_abi::isa::{Addr, Bcast, BinOp, ConvGeom, DType, Instr, MatFlags};

use crate::{bias_act, copy, LowerError, Lowerer, Stage, Tile, F};

/// One block: the operations (indices into the graph's ops, consecutive)
/// it replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chain {
    /// The 1x1 expansion, if the block has one.
    pub expand: Option<usize>,
    pub depthwise: usize,
    pub project: usize,
    /// The residual add of the block's input, if fused.
    pub add: Option<usize>,
}

impl Chain {
    /// The first operation of the block.
    pub fn first(&self) -> usize {
        self.expand.unwrap_or(self.depthwise)
    }

    /// The last operation of the block.
    pub fn last(&self) -> usize {
        self.add.unwrap_or(self.project)
    }

    /// The tensors only the block's own operations read and write: they
    /// never leave SRAM.
    pub fn internal(&self, graph: &Graph) -> Vec<TensorId> {
        let mut v = Vec::new();
        if let Op::Depthwise { x, y, .. } = graph.ops[self.depthwise] {
            if self.expand.is_some() {
                v.push(x);
            }
            v.push(y);
        }
        if let (Some(_), Op::Linear { y, .. }) = (self.add, &graph.ops[self.project]) {
            v.push(y.t);
        }
        v
    }
}

/// The parts of a [`Chain`] the lowering needs, read from the graph.
struct Parts<'a> {
    name: &'a str,
    /// The block's input: `batch * h * w` rows of `cin` elements.
    x: View,
    cin: u32,
    /// Expansion weights, bias and activation.
    expand: Option<(TensorId, TensorId, Act)>,
    /// Depthwise weights, bias, activation; its geometry and channels.
    dw: (TensorId, TensorId, Act),
    batch: u32,
    s: Spatial,
    c: u32,
    /// Projection weights, bias, activation, output columns.
    project: (TensorId, TensorId, Act, u32),
    /// The residual add's activation, if fused.
    add: Option<Act>,
    /// Where the block's result goes.
    y: View,
}

fn parts<'a>(graph: &'a Graph, ch: &Chain) -> Option<Parts<'a>> {
    let Op::Depthwise { ref name, x: xd, w: wd, b: bd, batch, s, c, act: ad, .. } = graph.ops[ch.depthwise]
    else {
        return None;
    };
    let (x, cin, expand) = match ch.expand.map(|i| &graph.ops[i]) {
        Some(&Op::Linear { x, w, b, k, act, .. }) => (x, k, Some((w, b, act))),
        Some(_) => return None,
        None => (View::dense(xd, c), c, None),
    };
    let Op::Linear { w: wp, b: bp, y: yp, n, act: ap, .. } = graph.ops[ch.project] else { return None };
    let (add, y) = match ch.add.map(|i| &graph.ops[i]) {
        // Dense (`find_chains`): one row per output pixel.
        Some(&Op::Add { y, act, .. }) => (Some(act), View::dense(y.t, n)),
        Some(_) => return None,
        None => (None, yp),
    };
    Some(Parts { name, x, cin, expand, dw: (wd, bd, ad), batch, s, c, project: (wp, bp, ap, n), add, y })
}

/// How many ops touch each tensor.
fn uses(graph: &Graph) -> Vec<u32> {
    let mut uses = vec![0u32; graph.tensors.len()];
    for op in &graph.ops {
        for t in op.tensors() {
            if let Some(u) = uses.get_mut(t) {
                *u += 1;
            }
        }
    }
    uses
}

/// The blocks of `graph` that can be lowered as one chain: a depthwise
/// convolution whose input only a 1x1 expansion right before it writes
/// (optional), whose output only a 1x1 projection right after it reads,
/// and optionally a residual add right after that, of the projection's
/// output and the block's input, which nothing else reads. No tensor
/// that leaves the block is internal: not the graph's input or output,
/// not one of `keep`. Each block's weights must fit a quarter of
/// `sram_bytes`, and two tiles of one whole image the rest.
pub(crate) fn find_chains(graph: &Graph, keep: &[TensorId], sram_bytes: u64) -> Vec<Chain> {
    let uses = uses(graph);
    let internal_ok =
        |t: TensorId| uses[t] == 2 && t != graph.input && t != graph.output && !keep.contains(&t);
    let mut out: Vec<Chain> = Vec::new();
    for i in 0..graph.ops.len() {
        let Op::Depthwise { x: xd, y: yd, batch, s, c, .. } = graph.ops[i] else { continue };
        if !s.valid() {
            continue;
        }
        let (ho, wo) = s.out();
        // Saturating: a hostile model's shapes may be near 2^32 each.
        let pixels =
            |h: u32, w: u32| u64::from(batch).saturating_mul(u64::from(h)).saturating_mul(u64::from(w));
        let free = |j: usize| out.last().is_none_or(|ch| ch.last() < j);
        let expand = match i.checked_sub(1).map(|j| (j, &graph.ops[j])) {
            Some((j, &Op::Linear { y, rows, n, .. }))
                if free(j)
                    && y == View::dense(xd, c)
                    && n == c
                    && u64::from(rows) == pixels(s.h, s.w)
                    && internal_ok(xd) =>
            {
                Some(j)
            }
            _ => None,
        };
        let Some(&Op::Linear { x: xp, y: yp, rows, k, n, .. }) = graph.ops.get(i + 1) else { continue };
        if xp != View::dense(yd, c) || k != c || u64::from(rows) != pixels(ho, wo) || !internal_ok(yd) {
            continue;
        }
        // The block's input and its channels, as the lowering reads them.
        let Some(Parts { x: input, cin, .. }) =
            parts(graph, &Chain { expand, depthwise: i, project: i + 1, add: None })
        else {
            continue;
        };
        // An add of dense views over the whole tensors: the same
        // elements in the same order however it splits them into rows
        // (ONNX adds split along the last logical axis).
        let add = match graph.ops.get(i + 2) {
            Some(&Op::Add { a, b, y, rows, cols, .. })
                if (ho, wo) == (s.h, s.w)
                    && s.sh == 1
                    && s.sw == 1
                    && cin == n
                    && [a, b, y].iter().all(|v| *v == View::dense(v.t, cols))
                    && u64::from(rows) * u64::from(cols) == pixels(ho, wo).saturating_mul(u64::from(n))
                    && yp == View::dense(yp.t, n)
                    && input == View::dense(input.t, n)
                    && internal_ok(yp.t)
                    && y.t != input.t
                    && ((a.t == yp.t && b.t == input.t) || (b.t == yp.t && a.t == input.t)) =>
            {
                Some(i + 2)
            }
            _ => None,
        };
        let ch = Chain { expand, depthwise: i, project: i + 1, add };
        let Some(p) = parts(graph, &ch) else { continue };
        let (fixed, image) = budget(&p);
        let need = image
            .checked_next_multiple_of(64)
            .and_then(|i| i.checked_mul(2))
            .and_then(|i| i.checked_add(fixed));
        if fixed <= sram_bytes / 4 && need.is_some_and(|need| need <= sram_bytes) {
            out.push(ch);
        }
    }
    out
}

/// Preloaded bytes (three weight matrices and biases, each 64-aligned)
/// and the SRAM one image's tile needs: its input, expanded, filtered and
/// projected tensors, and scratch for activations that need it.
fn budget(p: &Parts<'_>) -> (u64, u64) {
    // Saturating throughout: a hostile model's shapes may be near 2^32
    // each, and a saturated need never fits.
    let (c, n, cin) = (u64::from(p.c), u64::from(p.project.3), u64::from(p.cin));
    let kk = u64::from(p.s.kh) * u64::from(p.s.kw);
    let mat = |k: u64, n: u64| {
        k.saturating_mul(n)
            .saturating_add(n)
            .saturating_mul(F)
            .checked_next_multiple_of(64)
            .unwrap_or(u64::MAX)
    };
    let fixed = p.expand.map_or(0, |_| mat(cin, c)).saturating_add(mat(kk, c)).saturating_add(mat(c, n));
    let scratch = p.expand.is_some_and(|e| e.2.needs_scratch())
        || p.dw.2.needs_scratch()
        || p.project.2.needs_scratch()
        || p.add.is_some_and(|a| a.needs_scratch());
    let (ho, wo) = p.s.out();
    let pixels = u64::from(p.s.h) * u64::from(p.s.w);
    let out = u64::from(ho) * u64::from(wo);
    let expanded = if p.expand.is_some() { pixels.saturating_mul(c) } else { 0 };
    let tmp = if scratch { expanded.max(out.saturating_mul(c.max(n))) } else { 0 };
    let elems = [pixels.saturating_mul(cin), expanded, out.saturating_mul(c), out.saturating_mul(n), tmp]
        .into_iter()
        .fold(0u64, u64::saturating_add);
    (fixed, elems.saturating_mul(F))
}

impl Lowerer {
    /// Lowers `ch` of `graph` as one pipeline (see the module's doc).
    pub(crate) fn chain(&mut self, graph: &Graph, ch: &Chain) -> Result<(), LowerError> {
        let p = parts(graph, ch).ok_or(LowerError::Geometry {
            op: String::new(),
            reason: "a fused block's operations changed kind",
        })?;
        let (fixed, image) = budget(&p);
        let s = p.s;
        let (ho, wo) = s.out();
        let (c, n, cin) = (p.c, p.project.3, p.cin);
        let engines = self.shape.sa.max(self.shape.vu);
        // As many whole images per tile as keep the SA's fixed cost per
        // weight fold (`2R + C - 2` cycles) under a quarter of its
        // streaming, and fit.
        let (slots, most) = self.plan(p.name, fixed, engines, p.batch, |g| u64::from(g) * image)?;
        let fold = 2 * self.shape.sa_rows.max(1) + self.shape.sa_cols.max(1);
        let group = (4 * fold).div_ceil((ho * wo).max(1)).min(most).max(1);
        let slot_bytes = (u64::from(group) * image).next_multiple_of(64);
        let tiles = p.batch.div_ceil(group) as usize;
        let layout = self.bank(fixed, u64::from(slots.min(tiles as u32)) * slot_bytes);
        let kk = u64::from(s.kh) * u64::from(s.kw);
        let one = |cols: u32| vec![crate::Block { c0: 0, cols }];
        // Weights then bias, matrix by matrix, each 64-aligned.
        let mut preload = Vec::new();
        let mut at = layout.wbase;
        let mut place = |l: &Self, w: TensorId, b: TensorId, krows: u64, cols: u32, pre: &mut Vec<Instr>| {
            let (ws, bs) = (at, at + krows * u64::from(cols) * F);
            pre.extend(l.load_weights(w, krows, cols, 0, &one(cols), ws));
            pre.push(copy(l.addr(b, 0), Addr::sram(bs), 1, u64::from(cols) * F, 0, 0));
            at = (bs + u64::from(cols) * F).next_multiple_of(64);
            (ws, bs)
        };
        let ex = p.expand.map(|(w, b, _)| place(self, w, b, u64::from(cin), c, &mut preload));
        let dw = place(self, p.dw.0, p.dw.1, kk, c, &mut preload);
        let pr = place(self, p.project.0, p.project.1, u64::from(c), n, &mut preload);
        let addr = self.elem_addr();
        let (x, y) = (p.x, p.y);
        let (ae, ad, ap) = (p.expand.map_or(Act::None, |e| e.2), p.dw.2, p.project.2);
        self.pipeline(layout, preload, slots, tiles, |t, slot| {
            // Images `img..img + imgs`.
            let img = t as u32 * group;
            let imgs = group.min(p.batch - img);
            let band = u64::from(imgs) * u64::from(s.h) * u64::from(s.w);
            let out = u64::from(imgs) * u64::from(ho) * u64::from(wo);
            let inb = layout.sbase + u64::from(slot) * slot_bytes;
            let eb = inb + band * u64::from(cin) * F;
            let db = eb + if ex.is_some() { band * u64::from(c) * F } else { 0 };
            let pb_ = db + out * u64::from(c) * F;
            let tmp = pb_ + out * u64::from(n) * F;
            let (band32, out32) = (band as u32, out as u32);
            let first_px = u64::from(img) * u64::from(s.h) * u64::from(s.w);
            let load = copy(
                addr(x.t, first_px * u64::from(x.ld) + u64::from(x.col)),
                Addr::sram(inb),
                band,
                u64::from(cin) * F,
                u64::from(x.ld) * F,
                u64::from(cin) * F,
            );
            let mut stages = Vec::new();
            let mut vu = Vec::new();
            let src = if let Some((ws, bs)) = ex {
                stages.push(Stage::Sa(vec![Instr::MatMul {
                    dtype: DType::F32,
                    flags: MatFlags::default(),
                    a: inb,
                    b: ws,
                    c: eb,
                    m: band32,
                    k: cin,
                    n: c,
                    lda: cin,
                    ldb: c,
                    ldc: c,
                }]));
                vu.extend(bias_act(eb, Some(bs), band32, c, ae, tmp));
                eb
            } else {
                inb
            };
            let geom = ConvGeom {
                n: imgs,
                h: s.h,
                w: s.w,
                cin: c,
                cout: c,
                kh: s.kh,
                kw: s.kw,
                stride_h: s.sh,
                stride_w: s.sw,
                pad_top: s.pad[0],
                pad_bottom: s.pad[1],
                pad_left: s.pad[2],
                pad_right: s.pad[3],
            };
            vu.push(Instr::VDepthwise { src, weights: dw.0, dst: db, geom });
            vu.extend(bias_act(db, Some(dw.1), out32, c, ad, tmp));
            stages.push(Stage::Vu(vu));
            stages.push(Stage::Sa(vec![Instr::MatMul {
                dtype: DType::F32,
                flags: MatFlags::default(),
                a: db,
                b: pr.0,
                c: pb_,
                m: out32,
                k: c,
                n,
                lda: c,
                ldb: n,
                ldc: n,
            }]));
            let mut post = bias_act(pb_, Some(pr.1), out32, n, ap, tmp);
            if let Some(act) = p.add {
                // The loaded input, pixel for pixel (stride 1, the
                // output as large as the input).
                let res = inb;
                post.push(Instr::VBinary {
                    op: BinOp::Add,
                    bcast: Bcast::None,
                    a: pb_,
                    b: res,
                    dst: pb_,
                    rows: out32,
                    cols: n,
                });
                post.extend(bias_act(pb_, None, out32, n, act, tmp));
            }
            stages.push(Stage::Vu(post));
            let pixel0 = u64::from(img) * u64::from(ho) * u64::from(wo);
            Tile {
                load: vec![load],
                prep: vec![],
                lanes: vec![crate::Lane {
                    stages: crate::without_empty_vu(stages),
                    split: vec![],
                    store: vec![copy(
                        Addr::sram(pb_),
                        addr(y.t, pixel0 * u64::from(y.ld) + u64::from(y.col)),
                        out,
                        u64::from(n) * F,
                        u64::from(n) * F,
                        u64::from(y.ld) * F,
                    )],
                }],
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use npu_graph::{Act, Graph, View};
    use vnpu_abi::isa::{Instr, Space};

    use crate::{lower_ops_with, LowerOptions, VnpuShape};

    const RELU6: Act = Act::Clamp { scale: 1.0, bias: 0.0, lo: 0.0, hi: 6.0 };

    /// A stem and two blocks (stride 1 with its residual add, then
    /// stride 2) on `batch` images of `hw x hw`, 8 channels.
    fn blocks(batch: u32, hw: u32) -> Graph {
        let mut g = Graph::new("blocks", batch);
        let x = g.image_input(hw, 8);
        let px = batch * hw * hw;
        let s = g.linear("stem", View::dense(x, 8), px, 8, 8, RELU6, None);
        let e = g.linear("e0", s, px, 8, 48, RELU6, None);
        let (d, _, _) = g.depthwise("d0", e.t, hw, hw, 48, 3, 1, RELU6);
        let p = g.linear("p0", View::dense(d, 48), px, 48, 8, Act::None, None);
        let a = g.add("a0", p.t, s.t, u64::from(px) * 8, 8, Act::None);
        let e = g.linear("e1", View::dense(a, 8), px, 8, 48, RELU6, None);
        let (d, ho, wo) = g.depthwise("d1", e.t, hw, hw, 48, 3, 2, RELU6);
        let y = g.linear("p1", View::dense(d, 48), batch * ho * wo, 48, 16, Act::None, None);
        g.output = y.t;
        g
    }

    fn shape(sram_bytes: u64) -> VnpuShape {
        VnpuShape { sa: 1, vu: 1, sram_bytes, hbm_bytes: 64 << 20, sa_rows: 16, sa_cols: 16 }
    }

    /// Every HBM byte a DMA of the fused program touches lies in one
    /// tensor (so no tile reads or writes past its images), and tiles
    /// group whole images: on a 16x16 SA, 12x12 images go two to a tile
    /// (144 rows against 4 x 48 cycles of fixed cost per fold), so 5
    /// images make tiles of 2, 2 and 1.
    #[test]
    fn fused_tiles_stay_inside_their_tensors() {
        let g = blocks(5, 12);
        let o = LowerOptions { fuse_blocks: true, reuse_hbm: true, ..LowerOptions::default() };
        let l = lower_ops_with(&g, 0..g.ops.len(), shape(1 << 20), o).unwrap();
        assert_eq!(l.blocks, 2);
        let extents: Vec<(u64, u64)> =
            l.tensors.iter().map(|t| (t.offset, t.offset + t.elems * t.dtype.size())).collect();
        for ins in l.program.streams.iter().flat_map(|s| &s.code) {
            let Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride } = *ins else { continue };
            for (a, stride) in [(src, src_stride), (dst, dst_stride)] {
                if a.space != Space::Hbm {
                    continue;
                }
                let end = a.offset + u64::from(rows.max(1) - 1) * stride + u64::from(row_bytes);
                assert!(
                    extents.iter().any(|&(s, e)| s <= a.offset && end <= e && s < e),
                    "{ins:?} touches HBM {}..{end} outside every tensor",
                    a.offset
                );
            }
        }
        // The first block's input loads: 2, 2 and 1 images of 12x12x8.
        let image = 12 * 12 * 8 * 4;
        let stem = extents[g.tensors.iter().position(|t| t.name == "stem").unwrap()];
        let sizes: Vec<u64> = l
            .program
            .streams
            .iter()
            .flat_map(|s| &s.code)
            .filter_map(|i| match *i {
                Instr::DmaCopy { src, dst, rows, row_bytes, .. }
                    if src.space == Space::Hbm
                        && dst.space == Space::Sram
                        && src.offset >= stem.0
                        && src.offset < stem.1 =>
                {
                    Some(u64::from(rows) * u64::from(row_bytes))
                }
                _ => None,
            })
            .collect();
        assert_eq!(sizes, [2 * image, 2 * image, image]);
    }

    /// Shapes near the limits of their types (a hostile model's) are
    /// not fused, and finding blocks does not overflow.
    #[test]
    fn huge_blocks_are_not_fused() {
        use npu_graph::{Init, Op, Spatial};
        for (hw, c) in [(65_535u32, u32::MAX), (65_535, 1 << 20), (3, u32::MAX)] {
            let mut g = Graph::new("huge", 1);
            let t: Vec<_> = (0..9).map(|i| g.tensor(format!("t{i}"), 0, Init::Activation)).collect();
            g.input = t[0];
            let s = Spatial::square(hw, hw, 3, 1, 1);
            let px = hw * hw;
            g.ops.push(Op::Linear {
                name: "e".into(),
                x: View::dense(t[0], 1),
                w: t[1],
                b: t[2],
                y: View::dense(t[3], c),
                rows: px,
                k: 1,
                n: c,
                act: Act::None,
            });
            g.ops.push(Op::Depthwise {
                name: "d".into(),
                x: t[3],
                w: t[4],
                b: t[5],
                y: t[6],
                batch: 1,
                s,
                c,
                act: Act::None,
            });
            g.ops.push(Op::Linear {
                name: "p".into(),
                x: View::dense(t[6], c),
                w: t[7],
                b: t[8],
                y: View::dense(t[0], 1),
                rows: px,
                k: c,
                n: 1,
                act: Act::None,
            });
            g.output = t[8];
            assert!(super::find_chains(&g, &[], 1 << 30).is_empty(), "{hw} {c}");
        }
    }

    /// Fused and unfused programs of the same graph: fewer DMA bytes,
    /// less HBM.
    #[test]
    fn fusion_saves_dma_bytes_and_hbm() {
        let g = blocks(4, 12);
        let dma = |fuse_blocks| {
            let o = LowerOptions { fuse_blocks, reuse_hbm: true, ..LowerOptions::default() };
            let l = lower_ops_with(&g, 0..g.ops.len(), shape(1 << 20), o).unwrap();
            let bytes: u64 = l
                .program
                .streams
                .iter()
                .flat_map(|s| &s.code)
                .map(|i| match *i {
                    Instr::DmaCopy { rows, row_bytes, .. } => u64::from(rows) * u64::from(row_bytes),
                    _ => 0,
                })
                .sum();
            (bytes, l.hbm_bytes, l.blocks)
        };
        let (fused, apart) = (dma(true), dma(false));
        assert_eq!((fused.2, apart.2), (2, 0));
        assert!(fused.0 < apart.0 && fused.1 < apart.1, "{fused:?} against {apart:?}");
    }
}
