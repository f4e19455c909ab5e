//! Lowered programs compute what the plain CPU reference computes, for
//! every operation kind, on vNPU shapes and SRAM sizes that force many
//! tiles, weight chunks and slot counts.
#![allow(clippy::unwrap_used)]

use npu_graph::reference;
use npu_graph::{Act, Graph, Init, Op, PoolOp, Spatial, View};
use npu_lower::Placed;
use npu_lower::{lower, lower_as, Lowered, VnpuShape};
use npu_model::memory::read_f32s;
use npu_model::Memory;
use npu_model::{run_program, verify, BoardConfig, CoreMemory, LazyHbm, Sram, VecGuestMemory, VnpuLimits};
use npu_workloads::{build, init_hbm};
use vnpu_abi::{DType, Engine, Instr, Space};

/// A vNPU core of `sa` SAs, `vu` VUs, `sram` bytes of SRAM and 1 GiB of
/// HBM, without guest memory.
fn limits(sa: u32, vu: u32, sram: u64) -> VnpuLimits {
    VnpuLimits { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, guest: vec![], borrow_sa: 0, borrow_vu: 0 }
}

/// A tiny board for the small graphs below: the test board
/// (single-buffered weights, so that a weight load nothing hides shows)
/// with 16 x 16 SAs.
fn board() -> BoardConfig {
    let mut b = BoardConfig::test_board();
    b.name = "test-16x16".into();
    b.core.sa_rows = 16;
    b.core.sa_cols = 16;
    b
}

/// Lowers `g` for `shape`, runs it functionally, and compares every
/// tensor with the reference interpreter.
fn check(g: &Graph, sa: u32, vu: u32, sram: u64) {
    check_as(g, sa, vu, sram, DType::F32);
}

/// A placed tensor's values (bf16 ones widened).
fn read_tensor(hbm: &LazyHbm, p: &Placed) -> Vec<f32> {
    match p.dtype {
        DType::F32 => read_f32s(hbm, p.offset, p.elems as usize).unwrap(),
        DType::Bf16 => {
            let mut b = vec![0u8; p.elems as usize * 2];
            hbm.read(p.offset, &mut b).unwrap();
            b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        }
    }
}

/// Verifies `l` for `sa` SAs, `vu` VUs and `sram` bytes of SRAM, fills a
/// 1 GiB HBM with its seeded data and runs it there. Returns the HBM after
/// the run, the tensors as they were before it (the reference's start) and
/// the simulated cycles.
fn run_lowered(l: &Lowered, sa: u32, vu: u32, sram: u64) -> (LazyHbm, Vec<Vec<f32>>, f64) {
    verify(&l.program, &limits(sa, vu, sram)).unwrap();
    assert_race_free(&l.program, &format!("{sa} SA, {vu} VU, {sram} B"));
    let mut hbm = LazyHbm::new(1 << 30);
    init_hbm(l, &mut hbm, 7).unwrap();
    let before: Vec<Vec<f32>> = l.tensors.iter().map(|p| read_tensor(&hbm, p)).collect();
    let mut sram_m = Sram::new(sram);
    let mut guest = VecGuestMemory::new(0, 0);
    let mem = CoreMemory { sram: &mut sram_m, hbm: &mut hbm, guest: &mut guest };
    let cycles = run_program(&board(), &l.program, Some(mem), None).unwrap().cycles;
    (hbm, before, cycles)
}

/// [`check`] with the SA's operands in `dtype`, against the reference
/// that rounds them the same way. Returns the lowered program with the
/// tensors it computed.
fn check_as(g: &Graph, sa: u32, vu: u32, sram: u64, dtype: DType) -> (Lowered, Vec<Vec<f32>>) {
    let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
    let l = lower_as(g, shape, dtype).unwrap();
    let (hbm, mut tensors, cycles) = run_lowered(&l, sa, vu, sram);
    assert!(cycles > 0.0);
    reference::run_as(g, &mut tensors, dtype);
    compare(g, &l.tensors, &hbm, &tensors, &format!("{sa} SA, {vu} VU, {sram} B SRAM, {dtype:?}"));
    let got = l.tensors.iter().map(|p| read_tensor(&hbm, p)).collect();
    (l, got)
}

/// Every tensor in `hbm` against the reference's `tensors`.
fn compare(g: &Graph, placed: &[Placed], hbm: &LazyHbm, tensors: &[Vec<f32>], what: &str) {
    for (i, p) in placed.iter().enumerate() {
        let got = read_tensor(hbm, p);
        for (j, (a, b)) in got.iter().zip(&tensors[i]).enumerate() {
            let ok = if matches!(p.init, Init::Indices { .. }) {
                a.to_bits() == b.to_bits()
            } else {
                (a - b).abs() <= 2e-4 * (1.0 + b.abs())
            };
            assert!(
                ok,
                "{} ({what}): tensor {} `{}` element {j}: model {a}, reference {b}",
                g.name, i, g.tensors[i].name
            );
        }
    }
}

/// Operator-level tasks: each operation of `g` lowered alone
/// ([`npu_lower::lower_op`]) for the next shape of `shapes` in turn,
/// run on an SRAM full of NaNs (nothing may survive in SRAM from one task
/// to the next), each verified against its own shape; together they
/// compute what the reference computes.
fn check_tasks(g: &Graph, shapes: &[(u32, u32)], sram: u64) {
    let shape = |(sa, vu): (u32, u32)| VnpuShape {
        sa,
        vu,
        sram_bytes: sram,
        hbm_bytes: 1 << 30,
        sa_rows: 16,
        sa_cols: 16,
    };
    let whole = lower(g, shape(shapes[0])).unwrap();
    let mut hbm = LazyHbm::new(1 << 30);
    init_hbm(&whole, &mut hbm, 7).unwrap();
    let mut tensors: Vec<Vec<f32>> =
        whole.tensors.iter().map(|p| read_f32s(&hbm, p.offset, p.elems as usize).unwrap()).collect();
    for k in 0..g.ops.len() {
        let (sa, vu) = shapes[k % shapes.len()];
        let task = npu_lower::lower_op(g, k, shape((sa, vu))).unwrap();
        assert_eq!(task.tensors, whole.tensors, "task {k}: tensors placed elsewhere");
        verify(&task.program, &limits(sa, vu, sram)).unwrap();
        let mut sram_m = Sram::new(sram);
        sram_m.bytes_mut().fill(0xff);
        let mut guest = VecGuestMemory::new(0, 0);
        let mem = CoreMemory { sram: &mut sram_m, hbm: &mut hbm, guest: &mut guest };
        run_program(&board(), &task.program, Some(mem), None).unwrap();
    }
    reference::run(g, &mut tensors);
    compare(g, &whole.tensors, &hbm, &tensors, &format!("tasks on {shapes:?}, {sram} B SRAM"));
}

#[test]
fn operator_tasks_on_changing_shapes_match_reference() {
    let shapes = [(1, 1), (4, 4), (2, 3), (3, 1), (1, 4)];
    check_tasks(&mini_cnn(2), &shapes, 96 << 10);
    check_tasks(&mini_encoder(2), &shapes, 64 << 10);
    check_tasks(&mini_dlrm(3), &shapes, 32 << 10);
    check_tasks(&build("ncf", 5).unwrap(), &[(2, 2), (1, 1)], 1 << 20);
    // Past the last operation: nothing to do.
    let g = mini_cnn(1);
    let none = npu_lower::lower_op(
        &g,
        g.ops.len(),
        VnpuShape { sa: 1, vu: 1, sram_bytes: 1 << 20, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 },
    )
    .unwrap();
    assert!(none.program.streams.iter().all(|s| s.code.iter().all(|i| *i == Instr::Halt)));
}

fn mini_cnn(batch: u32) -> Graph {
    let mut g = Graph::new("mini-cnn", batch);
    let x = g.tensor("input", u64::from(batch) * 9 * 11 * 3, Init::Input);
    g.input = x;
    let conv = |g: &mut Graph,
                name: &str,
                x: usize,
                h: u32,
                w: u32,
                cin: u32,
                cout: u32,
                k: u16,
                stride: u16,
                act: Act| {
        let s = Spatial::square(h, w, k, stride, k / 2);
        let (ho, wo) = s.out();
        let fan_in = u32::from(k) * u32::from(k) * cin;
        let wt = g.tensor(format!("{name}.w"), u64::from(fan_in * cout), Init::Weights { fan_in });
        let b = g.tensor(format!("{name}.b"), cout.into(), Init::Bias);
        let y = g.act(name, u64::from(batch * ho * wo * cout));
        g.ops.push(Op::Conv {
            name: name.into(),
            x,
            w: wt,
            b,
            y: View::dense(y, cout),
            batch,
            s,
            cin,
            cout,
            act,
            residual: None,
        });
        (y, ho, wo)
    };
    let (a, h, w) = conv(&mut g, "c1", x, 9, 11, 3, 37, 3, 2, Act::Swish);
    let (d, h, w) = g.depthwise("dw", a, h, w, 37, 5, 1, Act::Relu);
    let s = Spatial::square(h, w, 3, 2, 1);
    let (ph, pw) = s.out();
    let p = g.act("pool", u64::from(batch * ph * pw * 37));
    g.ops.push(Op::Pool { name: "pool".into(), x: d, y: p, batch, s, c: 37, op: PoolOp::Max });
    let (c2, _, _) = conv(&mut g, "c2", p, ph, pw, 37, 37, 1, 1, Act::None);
    let sum = g.add("res", c2, p, u64::from(batch * ph * pw * 37), 37, Act::Gelu);
    // Squeeze-excite.
    let gp = g.global_pool(sum, ph * pw, 37);
    let s1 = g.linear("se1", View::dense(gp, 37), batch, 37, 9, Act::Swish, None);
    let s2 = g.linear("se2", s1, batch, 9, 37, Act::Sigmoid, None);
    let sc = g.act("scale", u64::from(batch * ph * pw * 37));
    g.ops.push(Op::ScaleChannels { name: "scale".into(), x: sum, s: s2.t, y: sc, batch, hw: ph * pw, c: 37 });
    let gp2 = g.global_pool(sc, ph * pw, 37);
    g.output = g.classifier(gp2, 37, 10);
    g
}

fn mini_encoder(batch: u32) -> Graph {
    let mut g = Graph::new("mini-encoder", batch);
    let x = g.tensor("input", u64::from(batch * 12 * 16), Init::Input);
    g.input = x;
    let y = g.encoder_layer(0, x, 12, 16, 2, 24, Act::Gelu);
    g.output = g.encoder_layer(1, y, 12, 16, 4, 20, Act::Relu);
    g
}

fn mini_dlrm(batch: u32) -> Graph {
    let mut g = Graph::new("mini-dlrm", batch);
    let (tables, dim, pool, rows) = (3u32, 8u32, 5u32, 50u32);
    let dense = g.tensor("dense", u64::from(batch * 13), Init::Input);
    g.input = dense;
    let f = tables + 1;
    let z = g.act("z", u64::from(batch * f * dim));
    let zv = |col| View { t: z, ld: f * dim, col };
    let b1 = g.linear("bot0", View::dense(dense, 13), batch, 13, 20, Act::Relu, None);
    g.linear("bot1", b1, batch, 20, dim, Act::Relu, Some(zv(0)));
    for t in 0..tables {
        let table = g.tensor(format!("t{t}"), u64::from(rows * dim), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("i{t}"), u64::from(batch * pool), Init::Indices { max: rows });
        g.ops.push(Op::Embedding {
            name: format!("e{t}"),
            table,
            idx,
            y: zv((t + 1) * dim),
            batch,
            rows,
            dim,
            pool,
        });
    }
    let top = f * f + dim;
    let t_in = g.act("top", u64::from(batch * top));
    g.ops.push(Op::Copy {
        name: "cat".into(),
        x: zv(0),
        y: View { t: t_in, ld: top, col: 0 },
        rows: batch,
        cols: dim,
    });
    g.ops.push(Op::Interaction {
        name: "int".into(),
        z,
        y: View { t: t_in, ld: top, col: dim },
        batch,
        f,
        d: dim,
    });
    let prod = g.act("prod", u64::from(batch * dim));
    g.ops.push(Op::Mul {
        name: "mul".into(),
        a: zv(0),
        b: zv(dim),
        y: View::dense(prod, dim),
        rows: batch,
        cols: dim,
        act: Act::None,
    });
    let t1 = g.linear("top0", View::dense(t_in, top), batch, top, 19, Act::Relu, None);
    g.output = g.linear("top1", t1, batch, 19, 1, Act::Sigmoid, None).t;
    g
}

#[test]
fn cnn_ops_match_reference() {
    for (sa, vu, sram) in [(1, 1, 4 << 20), (2, 3, 96 << 10), (4, 1, 40 << 10), (3, 2, 24 << 10)] {
        check(&mini_cnn(2), sa, vu, sram);
    }
}

#[test]
fn encoder_ops_match_reference() {
    for (sa, vu, sram) in [(1, 1, 4 << 20), (2, 2, 64 << 10), (3, 1, 16 << 10)] {
        check(&mini_encoder(2), sa, vu, sram);
    }
}

#[test]
fn recommendation_ops_match_reference() {
    for (sa, vu, sram) in [(1, 1, 4 << 20), (2, 4, 32 << 10), (1, 2, 12 << 10)] {
        check(&mini_dlrm(3), sa, vu, sram);
    }
    check(&build("ncf", 5).unwrap(), 2, 2, 1 << 20);
}

/// The whole of GoogLeNet (Inception modules: four branches concatenated
/// along the channels by copies into column views, 3x3 stride-1 max pools)
/// and Tiny YOLOv2 (with its per-box softmax and sigmoid over strided
/// views of the detection tensor) at batch 1, every tensor against the
/// reference interpreter.
#[test]
fn googlenet_and_tiny_yolo_match_reference() {
    for name in ["googlenet", "tiny-yolo"] {
        check(&build(name, 1).unwrap(), 2, 2, 32 << 20);
    }
}

/// SSD-MobileNet (sigmoid scores and box decoding over strided views of
/// each predictor's output, against per-map anchors), Wide & Deep (26
/// embeddings written into column views of the deep input, a wide bag of
/// 40 one-dimensional weights) and DIN (the activation unit's
/// concatenation built by gathers and binary operations into column
/// views, attention pooling as one 1 x 50 by 50 x 36 product per sample)
/// at batch 2, every tensor against the reference interpreter.
#[test]
fn ssd_mobilenet_wide_deep_and_din_match_reference() {
    for name in ["ssd-mobilenet", "wide-deep", "din"] {
        check(&build(name, 2).unwrap(), 2, 2, 32 << 20);
    }
}

/// YOLOv3 on 128x128 images at batch 1 (the library's at 416x416 is 10x
/// the work for the same operations: 2x upsampling by strided copies, concatenations,
/// the logistic and exponential of three detection maps over strided
/// views) and a GNMT of the MLPerf structure at small sizes (a
/// bidirectional first layer writing both directions into column views
/// of one output, recurrent products that share their weights across
/// tokens and read the previous token's `h` in place, residual layers,
/// attention over the encoder as per-sample batched products into the
/// decoder's input rows), every tensor against the reference
/// interpreter.
/// A pooling whose image does not fit the vNPU's SRAM (as SSD-ResNet34's
/// 600 x 600 x 64 max pool does not fit 1 SA + 1 VU) is tiled over groups
/// of channels, each gathered by a strided DMA: max and average, two
/// images, 37 channels (groups that do not divide them).
#[test]
fn a_pool_larger_than_sram_is_tiled_over_channels() {
    for op in [PoolOp::Max, PoolOp::Avg] {
        let (batch, h, w, c) = (2u32, 40u32, 36u32, 37u32);
        let mut g = Graph::new("big-pool", batch);
        let x = g.tensor("x", u64::from(batch * h * w * c), Init::Input);
        g.input = x;
        let s = Spatial::square(h, w, 3, 2, 1);
        let (ph, pw) = s.out();
        let y = g.act("pool", u64::from(batch * ph * pw * c));
        g.ops.push(Op::Pool { name: "pool".into(), x, y, batch, s, c, op });
        g.output = y;
        // One image and its output: 266 KB; 64 KiB of SRAM holds 9 channels.
        let (l, _) = check_as(&g, 1, 1, 64 << 10, DType::F32);
        let gathers = l
            .program
            .streams
            .iter()
            .flat_map(|st| &st.code)
            .filter(|i| matches!(i, Instr::DmaCopy { rows, .. } if *rows == h * w))
            .count();
        assert!(gathers >= 2 * 5, "{op:?}: {gathers} channel-group gathers");
        // With room for the whole image it stays one tile per image.
        check(&g, 1, 1, 4 << 20);
    }
}

/// SSD-ResNet34 at 420 x 420 and a quarter of its channels (the smallest
/// input its unpadded last blocks take; 1.7 GMACs): stride-3 heads,
/// unpadded and strided 3x3 extras, softmax over 81 classes per box, box
/// decoding, every tensor against the reference interpreter.
#[test]
fn a_small_ssd_resnet34_matches_reference() {
    let size = npu_workloads::zoo::SsdR34Size { side: 420, width_div: 4 };
    check(&npu_workloads::zoo::ssd_resnet34(1, &size), 2, 2, 32 << 20);
}

#[test]
fn yolov3_and_a_small_gnmt_match_reference() {
    check(&npu_workloads::zoo::yolov3(1, 128), 2, 2, 32 << 20);
    let small = npu_workloads::zoo::GnmtSize { layers: 4, hidden: 24, vocab: 50, src: 5, tgt: 4 };
    check(&npu_workloads::zoo::gnmt(2, &small), 2, 2, 32 << 20);
}

/// Attention written out as ONNX exports it: `Q K^T` and `P V` as batched
/// products of strided head views of one `qkv` tensor (`K` read
/// transposed in place), a scale and softmax between them; the fused
/// `Attention` operation computes the same context from the same `qkv`.
fn written_out_attention(batch: u32, fused: bool) -> Graph {
    let (seq, heads, dh) = (11u32, 3u32, 7u32);
    let hid = heads * dh;
    let mut g = Graph::new("written-out-attention", batch);
    let qkv = g.tensor("qkv", u64::from(batch * seq * 3 * hid), Init::Input);
    g.input = qkv;
    let n = batch * heads;
    let scores = g.act("scores", u64::from(n * seq * seq));
    let ctx = g.act("ctx", u64::from(batch * seq * hid));
    let head = |i: u32, part: u32| u64::from((i / heads) * seq * 3 * hid + part * hid + (i % heads) * dh);
    let score_offs = (0..n).map(|i| [head(i, 0), head(i, 1), u64::from(i * seq * seq)]).collect();
    g.ops.push(Op::BatchMatMul {
        name: "qk".into(),
        a: qkv,
        b: qkv,
        y: scores,
        lda: 3 * hid,
        ldb: 3 * hid,
        ldy: seq,
        trans_b: true,
        m: seq,
        k: dh,
        n: seq,
        offs: score_offs,
        act: Act::affine(1.0 / (dh as f32).sqrt(), 0.0),
    });
    let p = g.act("p", u64::from(n * seq * seq));
    g.ops.push(Op::Softmax {
        name: "softmax".into(),
        x: View::dense(scores, seq),
        y: View::dense(p, seq),
        rows: n * seq,
        cols: seq,
    });
    // The context goes straight to [batch][seq][heads * dh].
    let ctx_offs = (0..n)
        .map(|i| {
            [u64::from(i * seq * seq), head(i, 2), u64::from((i / heads) * seq * hid + (i % heads) * dh)]
        })
        .collect();
    g.ops.push(Op::BatchMatMul {
        name: "pv".into(),
        a: p,
        b: qkv,
        y: ctx,
        lda: seq,
        ldb: 3 * hid,
        ldy: hid,
        trans_b: false,
        m: seq,
        k: seq,
        n: dh,
        offs: ctx_offs,
        act: Act::None,
    });
    let out = g.act("fused", u64::from(batch * seq * hid));
    if fused {
        g.ops.push(Op::Attention { name: "attention".into(), qkv, y: out, batch, seq, heads, dh });
    }
    let gelu = g.act("gelu", u64::from(batch * seq * hid));
    g.ops.push(Op::Unary {
        name: "gelu".into(),
        x: View::dense(ctx, hid),
        y: View::dense(gelu, hid),
        rows: batch * seq,
        cols: hid,
        act: Act::GeluErf,
    });
    g.output = gelu;
    g
}

#[test]
fn written_out_attention_matches_reference_and_the_fused_operation() {
    // Many matrices to a tile (4 MiB), one (8 KiB, 2 KiB), one split by
    // rows (1 KiB: too small for the fused operation).
    for (sa, vu, sram) in [(1, 1, 4 << 20), (2, 3, 8 << 10), (3, 1, 2 << 10), (1, 1, 1 << 10)] {
        // 64 sequences (192 matrices a product) where they are grouped.
        let batch = if sram == 4 << 20 { 64 } else { 2 };
        let g = written_out_attention(batch, sram > 1 << 10);
        check(&g, sa, vu, sram);
        let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        // The products alone: how they are tiled.
        let p = lower(&written_out_attention(batch, false), shape).unwrap().program;
        let sa_code = || (0..sa).filter_map(|i| p.stream(Engine::sa(i as u8))).flat_map(|s| s.code.iter());
        let rows: Vec<u32> =
            sa_code().filter_map(|i| if let Instr::MatMul { m, .. } = i { Some(*m) } else { None }).collect();
        let waits = sa_code().filter(|i| matches!(i, Instr::Wait { .. })).count();
        if sram == 4 << 20 {
            assert!(waits < rows.len() / 2, "{waits} SA waits for {} products: not grouped", rows.len());
        }
        if sram == 1 << 10 {
            assert!(rows.iter().any(|&m| m < 11), "products not split by rows: {rows:?}");
            continue;
        }
        // The fused operation and the written-out one agree (reference).
        let mut hbm = LazyHbm::new(1 << 30);
        let l = lower(&g, shape).unwrap();
        init_hbm(&l, &mut hbm, 3).unwrap();
        let mut t: Vec<Vec<f32>> =
            l.tensors.iter().map(|p| read_f32s(&hbm, p.offset, p.elems as usize).unwrap()).collect();
        reference::run(&g, &mut t);
        let (ctx, fused) = (g.tensors.iter().position(|x| x.name == "ctx").unwrap(), g.tensors.len() - 2);
        for (i, (a, b)) in t[ctx].iter().zip(&t[fused]).enumerate() {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "ctx[{i}]: written out {a}, fused {b}");
        }
    }
}

/// Few rows against many weight columns: the weight loads of a
/// weight-stationary SA dominate, so the lowering splits each tile by
/// column blocks over the SAs instead of by rows.
/// The element-wise functions the ONNX compiler uses for `Sqrt`,
/// `Reciprocal` and `Exp` (after a sigmoid, so every value is in their
/// domain), and a copy whose source stride is 0 (a broadcast row).
#[test]
fn sqrt_recip_exp_and_broadcast_copy_match_reference() {
    let (rows, cols) = (37u32, 24u32);
    let mut g = Graph::new("unary", 1);
    let x = g.tensor("input", u64::from(rows * cols), Init::Input);
    g.input = x;
    let mut prev = x;
    for (name, act) in
        [("sigmoid", Act::Sigmoid), ("sqrt", Act::Sqrt), ("recip", Act::Recip), ("exp", Act::Exp)]
    {
        let y = g.act(name, u64::from(rows * cols));
        g.ops.push(Op::Unary {
            name: name.into(),
            x: View::dense(prev, cols),
            y: View::dense(y, cols),
            rows,
            cols,
            act,
        });
        prev = y;
    }
    let bcast = g.act("bcast", u64::from(rows * cols));
    g.ops.push(Op::Copy {
        name: "bcast".into(),
        x: View { t: prev, ld: 0, col: cols },
        y: View::dense(bcast, cols),
        rows,
        cols,
    });
    g.output = bcast;
    for (sa, vu, sram) in [(1, 1, 1 << 20), (1, 2, 4 << 10)] {
        check(&g, sa, vu, sram);
    }
}

fn wide_products(batch: u32) -> Graph {
    let mut g = Graph::new("wide-products", batch);
    let x = g.tensor("input", u64::from(batch * 5 * 5 * 8), Init::Input);
    g.input = x;
    let (c, h, w) = g.conv("conv", x, 5, 5, 8, 70, 3, 1, Act::Swish);
    let flat = View::dense(c, h * w * 70);
    let y = g.linear("fc1", flat, batch, h * w * 70, 70, Act::Swish, None);
    // Into a column range of a wider tensor: strided stores per block.
    let wide = g.act("wide", u64::from(batch * 90));
    g.linear("fc2", y, batch, 70, 50, Act::Relu, Some(View { t: wide, ld: 90, col: 20 }));
    g.output = wide;
    g
}

#[test]
fn wide_products_are_split_by_columns_and_match_reference() {
    for (sa, vu, sram) in [(4, 2, 4 << 20), (3, 1, 1 << 20), (2, 3, 2 << 20)] {
        let g = wide_products(2);
        check(&g, sa, vu, sram);
        let l =
            lower(&g, VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 })
                .unwrap();
        // Some weights go to the top of SRAM, so they load while the
        // previous operation finishes (and the results above still match).
        let dma = l.program.stream(Engine::DMA).unwrap();
        assert!(
            dma.code.iter().any(
                |c| matches!(c, Instr::DmaCopy { dst, .. } if dst.space == Space::Sram && dst.offset >= sram / 2)
            ),
            "no weights prefetched into the upper bank ({sa} SA, {sram} B)"
        );
        // Every SA computes products narrower than the layer.
        for i in 0..sa {
            let s = l.program.stream(Engine::sa(i as u8)).unwrap();
            assert!(
                s.code.iter().any(|c| matches!(c, Instr::MatMul { k: 1750, n, .. } if *n < 70)),
                "SA {i} of {sa}"
            );
            assert!(
                s.code.iter().any(|c| matches!(c, Instr::Conv2d { geom, .. } if geom.cout < 70)),
                "SA {i} of {sa}"
            );
        }
    }
}

#[test]
fn too_little_sram_is_a_clear_error() {
    let g = mini_cnn(1);
    let e =
        lower(&g, VnpuShape { sa: 1, vu: 1, sram_bytes: 1024, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 })
            .unwrap_err();
    assert!(e.to_string().contains("needs") && e.to_string().contains("SRAM"), "{e}");
    let e =
        lower(&g, VnpuShape { sa: 1, vu: 1, sram_bytes: 1 << 20, hbm_bytes: 4096, sa_rows: 16, sa_cols: 16 })
            .unwrap_err();
    assert!(e.to_string().contains("HBM"), "{e}");
    let e = lower(
        &g,
        VnpuShape { sa: 0, vu: 1, sram_bytes: 1 << 20, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 },
    )
    .unwrap_err();
    assert!(e.to_string().contains("at least one SA"), "{e}");
}

/// What operator-level tasks cost in simulated time: the sum of the tasks'
/// times (each task waits for the previous one; no overlap across an
/// operation boundary) against the whole program's, on the default board.
/// Prints a table (`docs/workloads.md`); asserts only that tasks are never
/// faster than the whole program by more than rounding.
/// `cargo test --release -p npu-workloads --test lowering task_granularity -- --ignored --nocapture`
#[test]
#[ignore = "a measurement: prints the cost of operator-level tasks for library workloads"]
fn task_granularity_cost() {
    let b = BoardConfig::default();
    println!(
        "{:<12} {:>5} {:>8} {:>12} {:>12} {:>7}",
        "workload", "shape", "ops", "whole us", "tasks us", "ratio"
    );
    for (w, batch) in [("bert", 1), ("resnet50", 1), ("dlrm", 8), ("ncf", 8), ("mobilenet", 1)] {
        let g = build(w, batch).unwrap();
        for k in [1u32, 4] {
            // k SA + k VU with k quarters of the core's SRAM.
            let shape = VnpuShape::on_board(&b, k, k, u64::from(k) * b.sram_bytes() / 4, 8 << 30);
            let whole = run_program(&b, &lower(&g, shape).unwrap().program, None, None).unwrap().cycles;
            let tasks: f64 = (0..g.ops.len())
                .map(|i| {
                    let t = npu_lower::lower_op(&g, i, shape).unwrap();
                    run_program(&b, &t.program, None, None).unwrap().cycles
                })
                .sum();
            let us = |c: f64| c / f64::from(b.clock_mhz);
            println!(
                "{:<12} {:>5} {:>8} {:>12.1} {:>12.1} {:>6.3}x",
                format!("{w} b{batch}"),
                format!("{k}+{k}"),
                g.ops.len(),
                us(whole),
                us(tasks),
                tasks / whole
            );
            assert!(tasks >= whole * (1.0 - 1e-9), "{w} {k}+{k}: tasks {tasks} < whole {whole}");
        }
    }
}

/// With bf16 SA operands every product (Linear, Conv, BatchMatMul,
/// Attention) computes what the reference computes with both operands
/// rounded to bf16; stored weights take half the HBM; the results are not
/// the f32 results (the rounding really happens).
#[test]
fn bf16_products_match_the_reference_with_bf16_operands() {
    let graphs = [
        (mini_cnn(2), vec![(1, 1, 4 << 20), (2, 3, 96 << 10), (3, 2, 24 << 10)]),
        (mini_encoder(2), vec![(1, 1, 4 << 20), (2, 2, 64 << 10)]),
        (written_out_attention(2, true), vec![(1, 1, 4 << 20), (2, 3, 8 << 10)]),
        (wide_products(3), vec![(4, 2, 1 << 20)]),
    ];
    for (g, shapes) in graphs {
        let f32_shape =
            VnpuShape { sa: 1, vu: 1, sram_bytes: 4 << 20, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        let whole = lower(&g, f32_shape).unwrap();
        for (sa, vu, sram) in shapes {
            let (l, got) = check_as(&g, sa, vu, sram, DType::Bf16);
            let what = format!("{} on {sa} SA, {vu} VU, {sram} B", g.name);
            let ops = l.program.streams.iter().flat_map(|s| &s.code);
            assert!(
                ops.clone().all(|i| !matches!(
                    i,
                    Instr::MatMul { dtype: DType::F32, .. } | Instr::Conv2d { dtype: DType::F32, .. }
                )),
                "{what}: an f32 product"
            );
            assert!(ops.clone().any(|i| matches!(i, Instr::VConvert { .. })), "{what}: no conversion");
            // Stored weights of products are bf16, nothing else is.
            for (i, (p, t)) in l.tensors.iter().zip(&g.tensors).enumerate() {
                let weight = g.ops.iter().any(|op| op.sa_weight() == Some(i));
                assert_eq!(
                    p.dtype == DType::Bf16,
                    weight,
                    "{what}: tensor `{}` stored as {:?}",
                    t.name,
                    p.dtype
                );
            }
            // Their bytes: half of f32's.
            let bytes = |l: &Lowered| l.tensors.iter().map(|p| p.elems * p.dtype.size()).sum::<u64>();
            let wbytes: u64 = l.tensors.iter().filter(|p| p.dtype == DType::Bf16).map(|p| p.elems * 2).sum();
            assert_eq!(bytes(&l) + wbytes, bytes(&whole), "{what}: bytes in HBM");
            // Against the f32 reference the computed tensors differ by more
            // than the f32 check allows: the operands were rounded.
            let mut f32_ref: Vec<Vec<f32>> = got.clone();
            for (t, p) in f32_ref.iter_mut().zip(&l.tensors) {
                if p.init == Init::Activation {
                    t.iter_mut().for_each(|x| *x = 0.0);
                }
            }
            reference::run(&g, &mut f32_ref);
            let d = got
                .iter()
                .zip(&f32_ref)
                .flat_map(|(a, b)| a.iter().zip(b))
                .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                .fold(0.0f32, f32::max);
            assert!(d > 2e-4, "{what}: bf16 results within {d} of the f32 reference");
        }
    }
}

/// A Fast NMS graph over `n` boxes and `classes` classes of `batch`
/// images: (graph, boxes, scores, output).
fn nms_graph(batch: u32, n: u32, classes: u32) -> (Graph, usize, usize, usize) {
    let mut g = Graph::new("nms", batch);
    let boxes = g.tensor("boxes", u64::from(batch * n * 4), Init::Input);
    let scores = g.tensor("scores", u64::from(batch * n * classes), Init::Input);
    let corners = g.act("corners", u64::from(5 * batch * n));
    let y = g.act("kept", u64::from(batch * n * classes));
    g.input = boxes;
    g.output = y;
    g.ops.push(Op::FastNms { name: "nms".into(), boxes, scores, corners, y, batch, n, classes, iou: 0.5 });
    (g, boxes, scores, y)
}

/// Runs `l` on `hbm` (already initialised) on 1 SA + 1 VU with `sram` bytes.
fn run_on(l: &Lowered, hbm: &mut LazyHbm, sram: u64) {
    verify(&l.program, &limits(1, 1, sram)).unwrap();
    let mut sram_m = Sram::new(sram);
    let mut guest = VecGuestMemory::new(0, 0);
    let mem = CoreMemory { sram: &mut sram_m, hbm, guest: &mut guest };
    run_program(&board(), &l.program, Some(mem), None).unwrap();
}

/// Fast NMS on hand-placed boxes, against what suppression means (not
/// against the reference interpreter): per class, a box is dropped when
/// a box overlapping it by IoU > 0.5 scores higher in that class. Boxes
/// (centre y, centre x, height, width), all 10 x 10: 0 at (5, 5); 1 at
/// (6, 5), IoU 0.82 with 0; 2 at (30, 30), far from all; 3 at (5, 12),
/// IoU 0.18 with 0; 4 the same as 2; 5, 6, 7 at x = 105, 108, 111 (a
/// chain: 5-6 and 6-7 IoU 0.54, 5-7 0.25). Two images, the second with
/// every score halved. Run with an SRAM that holds every class at once
/// and with one so small that each tile is one box and the classes go in
/// two chunks.
#[test]
fn fast_nms_drops_exactly_the_boxes_a_higher_scoring_overlapping_box_covers() {
    let boxes: [[f32; 4]; 8] = [
        [5.0, 5.0, 10.0, 10.0],
        [6.0, 5.0, 10.0, 10.0],
        [30.0, 30.0, 10.0, 10.0],
        [5.0, 12.0, 10.0, 10.0],
        [30.0, 30.0, 10.0, 10.0],
        [5.0, 105.0, 10.0, 10.0],
        [5.0, 108.0, 10.0, 10.0],
        [5.0, 111.0, 10.0, 10.0],
    ];
    // Scores [box][class] and the scores expected kept, by case.
    let scores: [[f32; 3]; 8] = [
        [0.9, 0.2, 0.0],
        [0.8, 0.6, 0.0],
        [0.3, 0.1, 0.0],
        [0.7, 0.05, 0.0],
        [0.3, 0.5, 0.0],
        [0.0, 0.0, 0.9],
        [0.0, 0.0, 0.8],
        [0.0, 0.0, 0.7],
    ];
    let cases: [(&str, usize, usize, f32); 12] = [
        ("class 0: the best of an overlapping pair stays", 0, 0, 0.9),
        ("class 0: the lower of an overlapping pair goes", 1, 0, 0.0),
        ("class 0: a box overlapping by IoU 0.18 stays", 3, 0, 0.7),
        ("class 0: two identical boxes with equal scores both stay", 2, 0, 0.3),
        ("class 0: the other of the tie stays too", 4, 0, 0.3),
        ("class 1: the pair's order is per class (box 1 wins)", 1, 1, 0.6),
        ("class 1: box 0, lower in this class, goes", 0, 1, 0.0),
        ("class 1: of two identical boxes the lower goes", 2, 1, 0.0),
        ("class 1: of two identical boxes the higher stays", 4, 1, 0.5),
        ("class 2: the head of a chain stays", 5, 2, 0.9),
        ("class 2: the middle of a chain goes", 6, 2, 0.0),
        ("class 2: the end of a chain goes too (Fast NMS, unlike greedy NMS)", 7, 2, 0.0),
    ];
    let (batch, n, classes) = (2u32, 8u32, 3u32);
    let (g, bt, st, yt) = nms_graph(batch, n, classes);
    for sram in [1 << 20, 512] {
        let shape =
            VnpuShape { sa: 1, vu: 1, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        let l = lower(&g, shape).unwrap();
        // One max-reduction per box, image and chunk of classes: all
        // three classes in one chunk with 1 MiB; with 512 B, chunks of
        // two and one class, one box per tile.
        let reductions = l
            .program
            .streams
            .iter()
            .flat_map(|s| &s.code)
            .filter(|i| matches!(i, Instr::VReduce { .. }))
            .count();
        let chunks = if sram == 512 { 2 } else { 1 };
        assert_eq!(reductions, (batch * n * chunks) as usize, "SRAM {sram} B: {chunks} class chunks");
        let mut hbm = LazyHbm::new(1 << 30);
        init_hbm(&l, &mut hbm, 3).unwrap();
        let b: Vec<f32> = (0..2).flat_map(|_| boxes.iter().flatten().copied()).collect();
        let s: Vec<f32> = (0..2)
            .flat_map(|img| scores.iter().flatten().map(move |v| v * if img == 0 { 1.0 } else { 0.5 }))
            .collect();
        npu_model::memory::write_f32s(&mut hbm, l.tensors[bt].offset, &b).unwrap();
        npu_model::memory::write_f32s(&mut hbm, l.tensors[st].offset, &s).unwrap();
        run_on(&l, &mut hbm, sram);
        let got = read_f32s(&hbm, l.tensors[yt].offset, (batch * n * classes) as usize).unwrap();
        for img in 0..2usize {
            let scale = if img == 0 { 1.0 } else { 0.5 };
            for &(case, i, c, want) in &cases {
                let v = got[(img * n as usize + i) * classes as usize + c];
                assert!(
                    v == want * scale,
                    "{case} (image {img}, SRAM {sram} B): kept {v}, expected {}",
                    want * scale
                );
            }
        }
        // Every box scoring 0 in a class stays 0.
        assert!(got.iter().all(|v| !v.is_nan()), "SRAM {sram} B: a NaN came out of clean inputs");
    }
}

/// A NaN score or coordinate must not vanish in NMS: it reaches the
/// kept scores of every box it is compared with.
#[test]
fn fast_nms_propagates_nan() {
    let (g, bt, st, yt) = nms_graph(1, 4, 2);
    let shape = VnpuShape { sa: 1, vu: 1, sram_bytes: 1 << 20, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
    let l = lower(&g, shape).unwrap();
    for (case, tensor, at) in [("a NaN score", st, 3usize), ("a NaN box height", bt, 2)] {
        let mut hbm = LazyHbm::new(1 << 30);
        init_hbm(&l, &mut hbm, 5).unwrap();
        npu_model::memory::write_f32s(&mut hbm, l.tensors[tensor].offset + 4 * at as u64, &[f32::NAN])
            .unwrap();
        run_on(&l, &mut hbm, 1 << 20);
        let got = read_f32s(&hbm, l.tensors[yt].offset, 8).unwrap();
        assert!(got.iter().any(|v| v.is_nan()), "{case}: no NaN in the kept scores {got:?}");
    }
}

/// RetinaNet on 128x128 images (the library's is 640: 25x the work for
/// the same operations; 341 boxes here): every tensor against the
/// reference interpreter, except the NMS output, which is checked bit for
/// bit against the reference's NMS run on the boxes and scores the
/// program computed (its steps turn the last-bit differences of the
/// convolutions, f32 here and f64 there, into whole-score differences for
/// the rare box pairs near a threshold).
#[test]
fn retinanet_matches_reference() {
    let g = npu_workloads::zoo::retinanet(1, 128);
    let nms = g.ops.iter().position(|op| op.kind() == "FastNms").unwrap();
    assert_eq!(nms, g.ops.len() - 1, "NMS is the last operation");
    let sram = 32 << 20;
    let shape = VnpuShape { sa: 2, vu: 2, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
    let l = lower(&g, shape).unwrap();
    let (hbm, mut tensors, _) = run_lowered(&l, 2, 2, sram);
    let got: Vec<Vec<f32>> = l.tensors.iter().map(|p| read_tensor(&hbm, p)).collect();
    // The NMS on the program's own inputs.
    let mut own = got.clone();
    let only_nms = Graph { ops: vec![g.ops[nms].clone()], ..g.clone() };
    reference::run(&only_nms, &mut own);
    let Op::FastNms { y, corners, .. } = g.ops[nms] else { unreachable!() };
    for t in [y, corners] {
        for (j, (a, b)) in got[t].iter().zip(&own[t]).enumerate() {
            assert!(
                a.to_bits() == b.to_bits(),
                "`{}` element {j}: model {a}, reference {b}",
                g.tensors[t].name
            );
        }
    }
    let kept = got[y].iter().filter(|v| **v > 0.0).count();
    let candidates = got[y].len();
    assert!(
        kept > 0 && kept < candidates,
        "NMS kept {kept} of {candidates} scores: it must drop some and keep some"
    );
    // Everything else against the reference run from the inputs.
    reference::run(&Graph { ops: g.ops[..nms].to_vec(), ..g.clone() }, &mut tensors);
    for (i, p) in l.tensors.iter().enumerate() {
        if i == y || i == corners {
            continue;
        }
        for (j, (a, b)) in got[i].iter().zip(&tensors[i]).enumerate() {
            let _ = p;
            assert!(
                (a - b).abs() <= 2e-4 * (1.0 + b.abs()),
                "retinanet: tensor {i} `{}` element {j}: model {a}, reference {b}",
                g.tensors[i].name
            );
        }
    }
}

/// A program longer than one request may carry is refused by the
/// lowering as a capacity limit (a study leaves the item out by name),
/// not built for the verifier to refuse: RetinaNet at batch 32 (about
/// 2 M instructions, 7 per box and image in its NMS).
#[test]
fn a_program_over_the_instruction_limit_is_a_capacity_error() {
    let g = build("retinanet", 32).unwrap();
    let shape =
        VnpuShape { sa: 1, vu: 1, sram_bytes: 32 << 20, hbm_bytes: 32 << 30, sa_rows: 128, sa_cols: 128 };
    match lower(&g, shape) {
        Err(e @ npu_lower::LowerError::Instructions { have, limit }) => {
            assert!(have > limit, "{e}");
            assert!(e.is_capacity());
        }
        Err(e) => panic!("expected the instruction limit, got {e}"),
        Ok(l) => panic!("lowered to {} instructions", l.program.instruction_count()),
    }
}

/// Slots are laid out 64-byte aligned, so the tile size a lowering picks
/// must fit SRAM after that rounding: an addition of 20 rows of 3 (24
/// bytes per row of its two operands) with 480 bytes of SRAM fits 10 rows
/// per slot before rounding, but two slots of 256 bytes do not fit 480.
/// It must lower to tiles that do, verify and compute the sum.
#[test]
fn tiles_fit_sram_after_slot_alignment() {
    let (rows, cols) = (20u32, 3u32);
    let mut g = Graph::new("aligned", 1);
    let a = g.tensor("a", u64::from(rows * cols), Init::Input);
    let b = g.tensor("b", u64::from(rows * cols), Init::Input);
    g.input = a;
    let y = g.add("sum", a, b, u64::from(rows * cols), cols, Act::None);
    g.output = y;
    check(&g, 1, 1, 480);
}

/// HBM reused by liveness (`LowerOptions::reuse_hbm`): the graph's output
/// is bit for bit what the program computes with every tensor in HBM of
/// its own (the same arithmetic, other addresses), it matches the
/// reference, and the program needs less HBM.
#[test]
fn hbm_reused_by_liveness_changes_no_result() {
    use npu_lower::{lower_ops_with, LowerOptions};
    for g in [mini_cnn(2), mini_encoder(2), mini_dlrm(3)] {
        let (sa, vu, sram) = (2, 2, 256 << 10);
        let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        let run = |reuse_hbm: bool| {
            let o = LowerOptions { reuse_hbm, ..LowerOptions::default() };
            let l = lower_ops_with(&g, 0..g.ops.len(), shape, o).unwrap();
            verify(&l.program, &limits(sa, vu, sram)).unwrap();
            let mut hbm = LazyHbm::new(1 << 30);
            init_hbm(&l, &mut hbm, 7).unwrap();
            let inputs: Vec<Vec<f32>> = l.tensors.iter().map(|p| read_tensor(&hbm, p)).collect();
            let mut sram_m = Sram::new(sram);
            let mut guest = VecGuestMemory::new(0, 0);
            let mem = CoreMemory { sram: &mut sram_m, hbm: &mut hbm, guest: &mut guest };
            run_program(&board(), &l.program, Some(mem), None).unwrap();
            let out = read_tensor(&hbm, &l.tensors[g.output]);
            (l.hbm_bytes, inputs, out)
        };
        let (own_bytes, mut tensors, own) = run(false);
        let (shared_bytes, _, shared) = run(true);
        assert!(shared_bytes < own_bytes, "{}: {shared_bytes} of HBM against {own_bytes}", g.name);
        assert_eq!(
            own.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            shared.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{}: the output depends on where the intermediate tensors are",
            g.name
        );
        reference::run(&g, &mut tensors);
        for (j, (a, b)) in shared.iter().zip(&tensors[g.output]).enumerate() {
            assert!(
                (a - b).abs() <= 2e-4 * (1.0 + b.abs()),
                "{} element {j}: model {a}, reference {b}",
                g.name
            );
        }
    }
}

/// No two tensors that are live at once share HBM, over every network
/// of the library; and liveness pays: ResNet-50 at batch 256 needs less
/// than a TPU v3 core's 16 GiB with it, more without.
#[test]
fn tensors_live_at_once_never_share_hbm() {
    use npu_lower::place_tensors;
    let names: Vec<&str> =
        npu_workloads::WORKLOADS.iter().chain(npu_workloads::MORE_WORKLOADS).map(|w| w.0).collect();
    for name in names {
        let g = build(name, 2).unwrap();
        let types = vec![DType::F32; g.tensors.len()];
        let mut range: Vec<Option<(usize, usize)>> = vec![None; g.tensors.len()];
        for (i, op) in g.ops.iter().enumerate() {
            for t in op.tensors() {
                range[t] = Some(range[t].map_or((i, i), |(a, _)| (a, i)));
            }
        }
        // Nothing pinned, then every third activation pinned (as a compiled
        // model pins its further inputs and outputs).
        let some: Vec<usize> =
            (0..g.tensors.len()).filter(|&t| g.tensors[t].init == Init::Activation).step_by(3).collect();
        for pinned in [&[][..], &some[..]] {
            let (placed, _) = place_tensors(&g, &types, true, pinned);
            // A tensor the program does not write, the input or output, or a
            // pinned one is live for the whole request.
            let live = |t: usize| match range[t] {
                Some(r)
                    if g.tensors[t].init == Init::Activation
                        && t != g.input
                        && t != g.output
                        && !pinned.contains(&t) =>
                {
                    r
                }
                _ => (0, usize::MAX),
            };
            for a in 0..g.tensors.len() {
                for b in a + 1..g.tensors.len() {
                    let ((a0, a1), (b0, b1)) = (live(a), live(b));
                    if a1 < b0 || b1 < a0 {
                        continue;
                    }
                    let (pa, pb) = (&placed[a], &placed[b]);
                    let (ea, eb) = (pa.offset + pa.elems * 4, pb.offset + pb.elems * 4);
                    assert!(
                        ea <= pb.offset || eb <= pa.offset || pa.elems == 0 || pb.elems == 0,
                        "{name}: `{}` and `{}` are live at once and overlap",
                        g.tensors[a].name,
                        g.tensors[b].name
                    );
                }
            }
        }
    }
    let g = build("resnet50", 256).unwrap();
    let v3_core =
        VnpuShape { sa: 2, vu: 1, sram_bytes: 16 << 20, hbm_bytes: 16 << 30, sa_rows: 128, sa_cols: 128 };
    let with = |reuse_hbm| {
        let o = npu_lower::LowerOptions { dtype: DType::Bf16, reuse_hbm, ..Default::default() };
        npu_lower::lower_ops_with(&g, 0..g.ops.len(), v3_core, o)
    };
    assert!(matches!(with(false), Err(npu_lower::LowerError::Hbm { .. })));
    assert!(with(true).unwrap().hbm_bytes < 16 << 30);
}

/// Every path that takes bf16 activations, in one chain whose
/// intermediate tensors are all stored as bf16: convolution, a pooling
/// larger than SRAM (tiled over channels) and one that fits (image
/// tiles), element-wise add, unary, softmax, global pooling and products.
fn bf16_chain(batch: u32) -> Graph {
    let (h, w, c) = (20u32, 18u32, 37u32);
    let mut g = Graph::new("bf16-chain", batch);
    let x = g.tensor("input", u64::from(batch * h * w * 3), Init::Input);
    g.input = x;
    let (a, h, w) = g.conv("c1", x, h, w, 3, c, 3, 1, Act::Relu);
    let s = Spatial::square(h, w, 3, 2, 1);
    let (ph, pw) = s.out();
    let p = g.act("pool", u64::from(batch * ph * pw * c));
    g.ops.push(Op::Pool { name: "pool".into(), x: a, y: p, batch, s, c, op: PoolOp::Max });
    let (b, _, _) = g.conv("c2", p, ph, pw, c, c, 1, 1, Act::None);
    let elems = u64::from(batch * ph * pw * c);
    let sum = g.add("res", b, p, elems, c, Act::None);
    let rows = (elems / u64::from(c)) as u32;
    let u = g.act("gelu", elems);
    g.ops.push(Op::Unary {
        name: "gelu".into(),
        x: View::dense(sum, c),
        y: View::dense(u, c),
        rows,
        cols: c,
        act: Act::Gelu,
    });
    let sm = g.act("softmax", elems);
    g.ops.push(Op::Softmax {
        name: "softmax".into(),
        x: View::dense(u, c),
        y: View::dense(sm, c),
        rows,
        cols: c,
    });
    let gp = g.global_pool(sm, ph * pw, c);
    let s1 = g.linear("fc1", View::dense(gp, c), batch, c, 21, Act::Relu, None);
    g.output = g.linear("fc2", s1, batch, 21, 10, Act::None, None).t;
    g
}

/// Lowers `g` with bf16 operands and bf16 activations, runs it, and
/// compares every tensor with the reference that rounds the same tensors
/// when it writes them. The model and the reference sum in different
/// orders, so a value near a bf16 rounding boundary may round the other
/// way: such an element may be one bf16 step off (2^-7 relative), and
/// its readers a little more; the rest must meet the f32 tolerance.
fn check_bf16_activations(g: &Graph, sa: u32, vu: u32, sram: u64) -> Lowered {
    let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
    let o = npu_lower::LowerOptions { dtype: DType::Bf16, bf16_activations: true, ..Default::default() };
    let l = npu_lower::lower_ops_with(g, 0..g.ops.len(), shape, o).unwrap();
    let (hbm, mut tensors, _) = run_lowered(&l, sa, vu, sram);
    let stored: Vec<DType> = l.tensors.iter().map(|p| p.dtype).collect();
    reference::run_stored(g, &mut tensors, DType::Bf16, &stored);
    let what = format!("{} on {sa} SA, {vu} VU, {sram} B SRAM", g.name);
    for (i, p) in l.tensors.iter().enumerate() {
        let got = read_tensor(&hbm, p);
        let mut off = 0usize;
        for (j, (a, b)) in got.iter().zip(&tensors[i]).enumerate() {
            let close = (a - b).abs() <= 2e-4 * (1.0 + b.abs());
            let step = (a - b).abs() <= 2f32.powi(-6) * b.abs() + 1e-3;
            assert!(
                close || step,
                "{what}: tensor `{}` element {j}: model {a}, reference {b}",
                g.tensors[i].name
            );
            off += usize::from(!close);
        }
        assert!(
            off * 50 <= got.len().max(50),
            "{what}: tensor `{}`: {off} of {} elements off",
            g.tensors[i].name,
            got.len()
        );
    }
    l
}

/// bf16 activations (`LowerOptions::bf16_activations`): the intermediate
/// tensors of the paths that take them are stored as bf16 (the graph's
/// input and output, weights' biases and the tensors of other operations
/// stay f32), the program computes what the reference that rounds them
/// computes, and it moves fewer DMA bytes than with f32 activations.
#[test]
fn bf16_activations_match_the_reference_that_rounds_them() {
    let g = bf16_chain(2);
    // 48 KiB: the pooling is tiled over channels; 4 MiB: whole images.
    for (sa, vu, sram) in [(1, 1, 4 << 20), (2, 1, 48 << 10), (3, 2, 4 << 20)] {
        let l = check_bf16_activations(&g, sa, vu, sram);
        for (i, (p, t)) in l.tensors.iter().zip(&g.tensors).enumerate() {
            let activation = t.init == Init::Activation && i != g.input && i != g.output;
            let weight = g.ops.iter().any(|op| op.sa_weight() == Some(i));
            assert_eq!(
                p.dtype == DType::Bf16,
                activation || weight,
                "tensor `{}` stored as {:?}",
                t.name,
                p.dtype
            );
        }
        let dma_bytes = |l: &Lowered| -> u64 {
            l.program
                .streams
                .iter()
                .flat_map(|s| &s.code)
                .map(|i| match *i {
                    Instr::DmaCopy { rows, row_bytes, .. } => u64::from(rows) * u64::from(row_bytes),
                    _ => 0,
                })
                .sum()
        };
        let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        let f32_acts = lower_as(&g, shape, DType::Bf16).unwrap();
        assert!(
            dma_bytes(&l) * 10 < dma_bytes(&f32_acts) * 7,
            "{} against {} DMA bytes",
            dma_bytes(&l),
            dma_bytes(&f32_acts)
        );
    }
    // Graphs mixing the paths with operations that keep f32 (depthwise,
    // scaling, attention, layer norm): only the tensors every reader and
    // writer takes as bf16 are.
    check_bf16_activations(&mini_cnn(2), 2, 3, 96 << 10);
    check_bf16_activations(&mini_encoder(2), 2, 2, 64 << 10);
    check_bf16_activations(&written_out_attention(2, true), 2, 3, 8 << 10);
}

/// Two residual blocks: one whose shortcut is a projection convolution
/// run after the block's last convolution (the add fuses into the
/// projection), one with an identity shortcut (it fuses into the last
/// convolution), and an add whose operand has a second reader (no fusion).
fn residual_blocks(batch: u32) -> Graph {
    let (h, w) = (9u32, 7u32);
    let mut g = Graph::new("residual-blocks", batch);
    let x = g.tensor("input", u64::from(batch * h * w * 5), Init::Input);
    g.input = x;
    let (stem, h, w) = g.conv("stem", x, h, w, 5, 19, 3, 1, Act::Relu);
    let (c1, _, _) = g.conv("b1.conv1", stem, h, w, 19, 11, 1, 1, Act::Relu);
    let (c2, _, _) = g.conv("b1.conv2", c1, h, w, 11, 23, 3, 1, Act::None);
    let (proj, _, _) = g.conv("b1.proj", stem, h, w, 19, 23, 1, 1, Act::None);
    let elems = u64::from(batch * h * w * 23);
    let s1 = g.add("b1.add", c2, proj, elems, 23, Act::Relu);
    let (c3, _, _) = g.conv("b2.conv1", s1, h, w, 23, 23, 3, 1, Act::Gelu);
    let s2 = g.add("b2.add", c3, s1, elems, 23, Act::None);
    let (c4, _, _) = g.conv("b3.conv", s2, h, w, 23, 23, 1, 1, Act::None);
    let s3 = g.add("b3.add", c4, s2, elems, 23, Act::Relu);
    // `c4`'s second reader: this add may not be fused.
    let s4 = g.add("b3.add2", s3, c4, elems, 23, Act::None);
    let gp = g.global_pool(s4, h * w, 23);
    g.output = g.classifier(gp, 23, 7);
    g
}

/// Residual adds fused into convolutions (`fuse_residual_adds`): the
/// right adds are fused (into the convolution that runs last of the two
/// producers; never where the operand has another reader), the fused
/// graph computes what the original computes (the reference runs both),
/// and the lowered fused program computes what the reference computes on
/// the fused graph, with f32 and with bf16 activations.
#[test]
fn residual_adds_fused_into_convolutions_change_no_result() {
    let g = residual_blocks(2);
    let f = npu_lower::fuse_residual_adds(&g);
    let fused: Vec<(&str, &str)> = f
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Conv { name, residual: Some(r), .. } => Some((name.as_str(), g.tensors[r.r].name.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(fused, [("b1.proj", "b1.conv2"), ("b2.conv1", "b1.add")]);
    assert_eq!(f.ops.len(), g.ops.len() - 2);
    assert!(f.ops.iter().any(|op| op.name() == "b3.add"), "an add whose operand has a second reader");
    // The same results, by the reference on both graphs.
    let shape = VnpuShape { sa: 2, vu: 2, sram_bytes: 4 << 20, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
    let l = lower(&g, shape).unwrap();
    let mut hbm = LazyHbm::new(1 << 30);
    init_hbm(&l, &mut hbm, 7).unwrap();
    let start: Vec<Vec<f32>> = l.tensors.iter().map(|p| read_tensor(&hbm, p)).collect();
    let (mut a, mut b) = (start.clone(), start);
    reference::run(&g, &mut a);
    reference::run(&f, &mut b);
    for (x, y) in a[g.output].iter().zip(&b[g.output]) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "fused {y} against {x}");
    }
    // The lowered fused program against the reference on the fused graph.
    for (sa, vu, sram) in [(1, 1, 4 << 20), (2, 3, 24 << 10)] {
        let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        let o = npu_lower::LowerOptions { fuse_residual: true, ..Default::default() };
        let l = npu_lower::lower_ops_with(&g, 0..g.ops.len(), shape, o).unwrap();
        let (hbm, mut tensors, _) = run_lowered(&l, sa, vu, sram);
        reference::run(&f, &mut tensors);
        compare(&f, &l.tensors, &hbm, &tensors, &format!("fused, {sa} SA, {vu} VU, {sram} B"));
        check_bf16_activations(&f, sa, vu, sram);
    }
}

/// One product whose weights dominate: nothing runs before it, so its
/// weights' load is exposed unless it is streamed.
fn weight_bound_product(batch: u32) -> Graph {
    let mut g = Graph::new("weight-bound-product", batch);
    let x = g.tensor("input", u64::from(batch * 384), Init::Input);
    g.input = x;
    let y = g.linear("fc1", View::dense(x, 384), batch, 384, 200, Act::Relu, None);
    g.output = g.linear("fc2", y, batch, 200, 72, Act::None, None).t;
    g
}

/// Weights streamed within an operation (`LowerOptions::stream_weights`):
/// the streamed program computes bit for bit what the program that waits
/// for whole weight chunks computes, and what the reference computes,
/// with f32 and bf16 operands, on shapes with one lane, several lanes and
/// several weight chunks; some SA starts a part of a product after a
/// wait for its piece; and a product whose weight load nothing else
/// hides finishes sooner.
#[test]
fn streamed_weights_change_no_result_and_start_products_early() {
    let graphs = [weight_bound_product(8), wide_products(2), mini_encoder(2)];
    for g in &graphs {
        let mut started = 0;
        for (sa, vu, sram) in [(1, 1, 1 << 20), (4, 2, 4 << 20), (3, 1, 160 << 10), (2, 3, 2 << 20)] {
            for dtype in [DType::F32, DType::Bf16] {
                let shape =
                    VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
                let lowered = |stream_weights| {
                    let o = npu_lower::LowerOptions { dtype, stream_weights, ..Default::default() };
                    npu_lower::lower_ops_with(g, 0..g.ops.len(), shape, o).unwrap()
                };
                let what = format!("{} on {sa} SA, {vu} VU, {sram} B SRAM, {dtype:?}", g.name);
                let (whole, streamed) = (lowered(false), lowered(true));
                let (hbm_w, _, cycles_w) = run_lowered(&whole, sa, vu, sram);
                let (hbm_s, mut tensors, cycles_s) = run_lowered(&streamed, sa, vu, sram);
                for (i, p) in streamed.tensors.iter().enumerate() {
                    let (a, b) = (read_tensor(&hbm_s, p), read_tensor(&hbm_w, p));
                    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{what}: tensor `{}` differs when streamed", g.tensors[i].name);
                }
                reference::run_as(g, &mut tensors, dtype);
                compare(g, &streamed.tensors, &hbm_s, &tensors, &what);
                // A part of a product: fewer columns than its leading
                // dimension, right after a wait.
                let parts = (0..sa).any(|i| {
                    let code = &streamed.program.stream(Engine::sa(i as u8)).unwrap().code;
                    code.windows(2)
                        .any(|w| matches!(w, [Instr::Wait { .. }, Instr::MatMul { n, ldb, .. }] if n < ldb))
                });
                started += usize::from(parts);
                if g.name == "weight-bound-product" {
                    assert!(cycles_s < cycles_w, "{what}: streamed {cycles_s} cycles, whole {cycles_w}");
                }
            }
        }
        // wide-products' products follow a convolution: their weights
        // load while it runs (hoisted), so nothing is streamed there.
        if g.name != "wide-products" {
            assert!(started >= 4, "{}: {started} cases started a product on a piece of its weights", g.name);
        }
    }
}

/// A set of byte rows in one memory space: `rows` rows of `len` bytes,
/// `stride` apart, from `start`.
#[derive(Clone, Copy, Debug)]
struct Rows {
    space: Space,
    start: u64,
    rows: u64,
    len: u64,
    stride: u64,
    write: bool,
}

impl Rows {
    fn end(&self) -> u64 {
        self.start + self.rows.saturating_sub(1) * self.stride + self.len
    }

    /// Whether some byte is in both sets (exact for strided rows).
    fn meets(&self, o: &Rows) -> bool {
        if self.space != o.space || self.len == 0 || o.len == 0 {
            return false;
        }
        if self.start >= o.end() || o.start >= self.end() {
            return false;
        }
        let (a, b) = if self.rows <= o.rows { (self, o) } else { (o, self) };
        (0..a.rows).any(|r| {
            let x = i128::from(a.start + r * a.stride);
            let (s, st, l, x1) =
                (i128::from(b.start), i128::from(b.stride), i128::from(b.len), x + i128::from(a.len));
            if b.rows == 1 || st == 0 {
                return s < x1 && s + l > x;
            }
            // Rows i of `b` with s + i st < x1 and s + i st + l > x.
            let hi = (x1 - s - 1).div_euclid(st).min(i128::from(b.rows) - 1);
            let lo = (x - l - s).div_euclid(st) + 1;
            lo.max(0) <= hi
        })
    }
}

/// The byte rows `i` reads and writes: exact rows for copies and
/// products, the verifier's bounding ranges for the rest.
fn accesses(i: &Instr) -> Vec<Rows> {
    let rows = |space, start, rows: u64, len: u64, stride: u64, write| Rows {
        space,
        start,
        rows,
        len,
        stride,
        write,
    };
    match *i {
        Instr::DmaCopy { src, dst, rows: r, row_bytes, src_stride, dst_stride } => {
            let (r, b) = (u64::from(r), u64::from(row_bytes));
            let src_rows = if src_stride == 0 { r.min(1) } else { r };
            vec![
                rows(src.space, src.offset, src_rows, b, src_stride, false),
                rows(dst.space, dst.offset, r, b, dst_stride, true),
            ]
        }
        Instr::MatMul { dtype, flags, a, b, c, m, k, n, lda, ldb, ldc } => {
            let s = dtype.size();
            let (m, k, n) = (u64::from(m), u64::from(k), u64::from(n));
            let (br, bc) = if flags.transpose_b { (n, k) } else { (k, n) };
            vec![
                rows(Space::Sram, a, m, k * s, u64::from(lda) * s, false),
                rows(Space::Sram, b, br, bc * s, u64::from(ldb) * s, false),
                rows(Space::Sram, c, m, n * 4, u64::from(ldc) * 4, true),
            ]
        }
        _ => i
            .footprint()
            .unwrap()
            .iter()
            .map(|a| rows(a.space, a.start, 1, a.len, 0, a.kind == vnpu_abi::AccessKind::Write))
            .collect(),
    }
}

/// Every two instructions of different streams that touch a common byte,
/// one of them writing it, are ordered by the program's signals and waits
/// (the model applies an instruction when it starts, so a missing wait
/// would not change its results: this finds it). Each semaphore must have
/// one signalling and one waiting stream, as the lowering's channels do.
fn assert_race_free(p: &vnpu_abi::Program, what: &str) {
    let n = p.streams.len();
    let mut vc = vec![vec![0u32; n]; n];
    let mut pc = vec![0usize; n];
    let mut signals: Vec<Vec<Vec<u32>>> = vec![Vec::new(); 256];
    let mut consumed = vec![0usize; 256];
    let mut ends: Vec<(Option<usize>, Option<usize>)> = vec![(None, None); 256];
    // (stream, clock, accesses) of every memory instruction.
    let mut done: Vec<(usize, Vec<u32>, Vec<Rows>)> = Vec::new();
    loop {
        let mut progress = false;
        for s in 0..n {
            while let Some(i) = p.streams[s].code.get(pc[s]) {
                match *i {
                    Instr::Wait { sem } => {
                        let e = &mut ends[usize::from(sem)].1;
                        assert!(e.is_none_or(|w| w == s), "{what}: semaphore {sem} has two waiting streams");
                        *e = Some(s);
                        let Some(c) = signals[usize::from(sem)].get(consumed[usize::from(sem)]) else {
                            break;
                        };
                        vc[s] = vc[s].iter().zip(c).map(|(a, b)| *a.max(b)).collect();
                        consumed[usize::from(sem)] += 1;
                    }
                    Instr::Signal { sem } => {
                        let e = &mut ends[usize::from(sem)].0;
                        assert!(
                            e.is_none_or(|w| w == s),
                            "{what}: semaphore {sem} has two signalling streams"
                        );
                        *e = Some(s);
                        vc[s][s] += 1;
                        signals[usize::from(sem)].push(vc[s].clone());
                    }
                    Instr::Halt => {}
                    _ => {
                        vc[s][s] += 1;
                        done.push((s, vc[s].clone(), accesses(i)));
                    }
                }
                pc[s] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    for (s, (at, stream)) in pc.iter().zip(&p.streams).enumerate() {
        assert_eq!(*at, stream.code.len(), "{what}: stream {s} never finishes");
    }
    for (x, (s1, c1, a1)) in done.iter().enumerate() {
        for (s2, c2, a2) in &done[x + 1..] {
            if s1 == s2 || c1[*s1] <= c2[*s1] || c2[*s2] <= c1[*s2] {
                continue;
            }
            let hit = a1.iter().any(|a| a2.iter().any(|b| (a.write || b.write) && a.meets(b)));
            assert!(
                !hit,
                "{what}: unordered accesses: stream {s1} at {} and stream {s2} at {}",
                c1[*s1], c2[*s2]
            );
        }
    }
}

/// HBM bytes a program's DMA copies move (SRAM-to-SRAM copies excluded).
fn hbm_bytes(p: &vnpu_abi::Program) -> u64 {
    p.streams
        .iter()
        .flat_map(|s| &s.code)
        .map(|i| match *i {
            Instr::DmaCopy { src, dst, rows, row_bytes, .. }
                if src.space == Space::Hbm || dst.space == Space::Hbm =>
            {
                u64::from(rows) * u64::from(row_bytes)
            }
            _ => 0,
        })
        .sum()
}

/// Activations kept on chip (`LowerOptions::keep_on_chip`): the program
/// computes bit for bit what the one that sends every activation to HBM
/// computes (the graph's output, and every tensor that is in HBM in both),
/// and the output matches the reference; with f32 and bf16 operands and
/// bf16 activations, on one and several engines. Some tensors of every
/// graph stay on chip, the programs move fewer HBM bytes, and some tile
/// reads its input where it is kept (fewer DMA copies); every program is
/// checked free of unordered accesses (`run_lowered`).
#[test]
fn activations_kept_on_chip_change_no_result() {
    let graphs =
        [mini_cnn(2), mini_encoder(2), residual_blocks(2), bf16_chain(2), wide_products(2), mini_dlrm(4)];
    for g in &graphs {
        let (mut kept, mut fewer_copies) = (false, false);
        for (sa, vu, sram) in [(1, 1, 1 << 20), (2, 2, 2 << 20), (4, 1, 512 << 10)] {
            for (dtype, bf16_activations) in [(DType::F32, false), (DType::Bf16, false), (DType::Bf16, true)]
            {
                let shape =
                    VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
                let lowered = |keep_on_chip| {
                    let o = npu_lower::LowerOptions {
                        dtype,
                        bf16_activations,
                        keep_on_chip,
                        ..Default::default()
                    };
                    npu_lower::lower_ops_with(g, 0..g.ops.len(), shape, o).unwrap()
                };
                let what = format!(
                    "{} on {sa} SA, {vu} VU, {sram} B, {dtype:?}, bf16 activations {bf16_activations}",
                    g.name
                );
                let (off, on) = (lowered(false), lowered(true));
                assert!(off.tensors.iter().all(|p| p.on_chip.is_none()));
                let (hbm_off, _, _) = run_lowered(&off, sa, vu, sram);
                let (hbm_on, mut tensors, _) = run_lowered(&on, sa, vu, sram);
                for (i, p) in on.tensors.iter().enumerate().filter(|(_, p)| p.on_chip.is_none()) {
                    let (a, b) = (read_tensor(&hbm_on, p), read_tensor(&hbm_off, &off.tensors[i]));
                    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{what}: tensor `{}` differs with activations on chip", g.tensors[i].name);
                }
                if !bf16_activations {
                    reference::run_as(g, &mut tensors, dtype);
                    let out = &on.tensors[g.output];
                    for (j, (a, b)) in read_tensor(&hbm_on, out).iter().zip(&tensors[g.output]).enumerate() {
                        assert!(
                            (a - b).abs() <= 2e-4 * (1.0 + b.abs()),
                            "{what}: output {j}: {a} against {b}"
                        );
                    }
                }
                if on.tensors.iter().any(|p| p.on_chip.is_some()) {
                    kept = true;
                    assert!(hbm_bytes(&on.program) < hbm_bytes(&off.program), "{what}: no HBM bytes saved");
                    let copies = |l: &Lowered| {
                        l.program
                            .streams
                            .iter()
                            .flat_map(|s| &s.code)
                            .filter(|i| matches!(i, Instr::DmaCopy { .. }))
                            .count()
                    };
                    fewer_copies |= copies(&on) < copies(&off);
                }
            }
        }
        assert!(kept, "{}: nothing kept on chip", g.name);
        assert!(fewer_copies, "{}: no tile read its input where it is kept", g.name);
    }
}

/// Inverted-residual blocks (`LowerOptions::fuse_blocks`): a stem and
/// three blocks (expansion with Hard-Swish and a residual add with an
/// activation after it; expansion with stride 2 and a 5x5 window; no
/// expansion, with a residual add), odd channel counts.
fn inverted_residuals(batch: u32) -> Graph {
    let mut g = Graph::new("inverted-residuals", batch);
    let (hw, c) = (9, 11);
    let x = g.image_input(hw, c);
    let px = batch * hw * hw;
    let relu6 = Act::Clamp { scale: 1.0, bias: 0.0, lo: 0.0, hi: 6.0 };
    let s = g.linear("stem", View::dense(x, c), px, c, c, relu6, None);
    let e = g.linear("b0.expand", s, px, c, 5 * c, Act::HardSwish, None);
    let (d, _, _) = g.depthwise("b0.dw", e.t, hw, hw, 5 * c, 3, 1, Act::HardSwish);
    let p = g.linear("b0.project", View::dense(d, 5 * c), px, 5 * c, c, Act::None, None);
    let a = g.add("b0.add", p.t, s.t, u64::from(px * c), c, Act::Relu);
    let e = g.linear("b1.expand", View::dense(a, c), px, c, 3 * c, relu6, None);
    let (d, h, w) = g.depthwise("b1.dw", e.t, hw, hw, 3 * c, 5, 2, relu6);
    let px = batch * h * w;
    let p = g.linear("b1.project", View::dense(d, 3 * c), px, 3 * c, 13, Act::None, None);
    let (d, _, _) = g.depthwise("b2.dw", p.t, h, w, 13, 3, 1, relu6);
    let q = g.linear("b2.project", View::dense(d, 13), px, 13, 13, Act::None, None);
    g.output = g.add("b2.add", q.t, p.t, u64::from(px * 13), 13, Act::None);
    g
}

/// Blocks lowered as one pipeline compute what the reference computes
/// (the tensors they keep in SRAM take no HBM and are not compared), the
/// same bits on every shape as the one-engine program op by op, race
/// free, on one and several engines and on SRAM sizes that give several
/// images per tile and one, and take fewer cycles than op by op.
#[test]
fn fused_blocks_compute_what_the_reference_computes() {
    let g = inverted_residuals(5);
    let mut first: Option<Vec<u32>> = None;
    for (sa, vu, sram) in [(1, 1, 1 << 20), (2, 3, 1 << 20), (3, 2, 160 << 10)] {
        let shape = VnpuShape { sa, vu, sram_bytes: sram, hbm_bytes: 1 << 30, sa_rows: 16, sa_cols: 16 };
        let lowered = |fuse_blocks| {
            // Every tensor keeps its HBM, so all can be compared.
            let o = npu_lower::LowerOptions { fuse_blocks, ..Default::default() };
            npu_lower::lower_ops_with(&g, 0..g.ops.len(), shape, o).unwrap()
        };
        let what = format!("{sa} SA, {vu} VU, {sram} B SRAM");
        let (fused, apart) = (lowered(true), lowered(false));
        assert_eq!((fused.blocks, apart.blocks), (3, 0), "{what}");
        let (hbm_f, mut tensors, cycles_f) = run_lowered(&fused, sa, vu, sram);
        let (hbm_a, _, cycles_a) = run_lowered(&apart, sa, vu, sram);
        // The tensors kept in SRAM, full size for the reference to write.
        for (t, v) in tensors.iter_mut().enumerate() {
            v.resize(g.tensors[t].elems as usize, 0.0);
        }
        reference::run(&g, &mut tensors);
        compare(&g, &fused.tensors, &hbm_f, &tensors, &what);
        let out = |l: &Lowered, hbm: &LazyHbm| read_tensor(hbm, &l.tensors[g.output]);
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        // Fused, every shape computes the bits of the one-engine program
        // op by op. Op by op on several engines differs from it in the
        // last bit of a few elements: a product split into column blocks
        // over SAs runs the GEMM library's kernels on other shapes.
        let got = bits(out(&fused, &hbm_f));
        let want = first.get_or_insert_with(|| bits(out(&apart, &hbm_a)));
        assert_eq!(&got, want, "{what}");
        assert!(cycles_f < cycles_a, "{what}: {cycles_f} cycles fused against {cycles_a}");
    }
}
