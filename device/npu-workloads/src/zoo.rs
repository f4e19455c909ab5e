//! The networks of the workload library, built in the layer-graph IR
//! (`npu-graph`) with published shapes (shapes only; a functional run
//! fills them with seeded random weights).

use npu_graph::{Act, Graph, Init, Op, PoolOp, Spatial, TensorId, View};

/// The workload names, in the order `vnpu workload list` prints them.
pub const WORKLOADS: &[(&str, &str)] = &[
    ("resnet50", "ResNet-50 v1.5, 224x224 ImageNet classifier (He et al. 2016)"),
    ("bert", "BERT-base encoder, 12 layers, hidden 768, 12 heads, sequence 128"),
    ("dlrm", "DLRM: bottom MLP 13-128-64-32, 32 tables x 32 dims, 120 lookups per bag, dot interaction, top MLP 128-64-1"),
    ("ncf", "NCF / NeuMF (MovieLens-1M sizes): GMF dim 8 + MLP 64-32-16-8"),
    ("mobilenet", "MobileNet-v1 1.0, 224x224, depthwise-separable convolutions"),
    ("efficientnet", "EfficientNet-B0, 224x224, MBConv blocks with squeeze-excite"),
    ("transformer", "Transformer-base encoder, 6 layers, d 512, 8 heads, FFN 2048, sequence 128"),
];

/// More workloads (the DNNs of Planaria's scenarios), by name; not in
/// the design's characterization set [`WORKLOADS`].
pub const MORE_WORKLOADS: &[(&str, &str)] = &[
    ("googlenet", "GoogLeNet (Inception v1), 224x224, nine Inception modules (Szegedy et al. 2015)"),
    (
        "tiny-yolo",
        "Tiny YOLOv2 (VOC), 416x416, 9 convolutions, 13x13x125 detections (Redmon and Farhadi 2017)",
    ),
    (
        "ssd-mobilenet",
        "SSD-MobileNet-v1 (COCO, 91 classes), 300x300, 1917 boxes: sigmoid scores and box decoding (Liu et al. 2016)",
    ),
    ("wide-deep", "Wide & Deep (Criteo-like: 13 dense, 26 sparse x 32 dims, deep MLP 1024-512-256, wide 1-dim crosses)"),
    ("din", "DIN: attention over 50 behaviour items (2 x 18 dims), activation unit MLP 144-80-40-1, MLP 108-200-80-2"),
    ("yolov3", "YOLOv3 (COCO), 416x416, Darknet-53 and three detection scales, 10647 boxes (Redmon and Farhadi 2018)"),
    (
        "gnmt",
        "GNMT v2 (MLPerf): 4+4 LSTM layers of 1024, attention, vocabulary 32k, 25 source and 25 target tokens",
    ),
    (
        "ssd-resnet34",
        "SSD-ResNet34 (MLPerf SSD-large, COCO 81 classes), 1200x1200, 15130 boxes: softmax scores and box decoding",
    ),
    (
        "retinanet",
        "RetinaNet ResNet-50-FPN (COCO 80 classes, 1 anchor per cell), 640x640, 8525 boxes: class-aware Fast NMS on the VU",
    ),
];

/// Builds the named model at `batch`.
pub fn build(name: &str, batch: u32) -> Option<Graph> {
    let batch = batch.max(1);
    Some(match name {
        "resnet50" => resnet50(batch),
        "bert" => encoder("bert", batch, 12, 128, 768, 12, 3072, Act::Gelu),
        "transformer" => encoder("transformer", batch, 6, 128, 512, 8, 2048, Act::Relu),
        "mobilenet" => mobilenet(batch),
        "efficientnet" => efficientnet(batch),
        "dlrm" => dlrm(batch),
        "ncf" => ncf(batch),
        "googlenet" => googlenet(batch),
        "tiny-yolo" => tiny_yolo(batch),
        "ssd-mobilenet" => ssd_mobilenet(batch),
        "wide-deep" => wide_deep(batch),
        "din" => din(batch),
        "yolov3" => yolov3(batch, 416),
        "gnmt" => gnmt(batch, &GnmtSize::MLPERF),
        "ssd-resnet34" => ssd_resnet34(batch, &SsdR34Size::MLPERF),
        "retinanet" => retinanet(batch, 640),
        other => {
            let (m, k, n) = gemm_dims(other.strip_prefix("gemm-")?)?;
            gemm(batch, m, k, n)?
        }
    })
}

/// `MxKxN` of a `gemm-MxKxN` workload name: each from 1 to 65536.
fn gemm_dims(dims: &str) -> Option<(u32, u32, u32)> {
    let mut it = dims.split('x').map(|d| d.parse::<u32>().ok().filter(|v| (1..=65_536).contains(v)));
    let dims = (it.next()??, it.next()??, it.next()??);
    it.next().is_none().then_some(dims)
}

/// One matrix product, `gemm-MxKxN`: an `M x K` input (`M` rows per batch
/// element) times `K x N` weights, plus a bias: the shape of the matrix
/// products that published TPU timings measure (e.g. 8192 x 8192 x 8192 in
/// JAX's Pallas TPU matmul guide). Not in [`WORKLOADS`] or
/// [`MORE_WORKLOADS`]: `vnpu workload run gemm-4096x4096x4096` names one.
/// `None` when `M x batch` rows do not fit a `u32`.
pub fn gemm(batch: u32, m: u32, k: u32, n: u32) -> Option<Graph> {
    let rows = m.checked_mul(batch)?;
    let mut g = Graph::new("gemm", batch);
    let x = g.tensor("input", u64::from(rows) * u64::from(k), Init::Input);
    g.input = x;
    let y = g.linear("product", View::dense(x, k), rows, k, n, Act::None, None);
    g.output = y.t;
    Some(g)
}

fn resnet50(batch: u32) -> Graph {
    let mut g = Graph::new("resnet50", batch);
    let x = g.image_input(224, 3);
    let &(x, h, c) = resnet50_stages(&mut g, x, 224).last().expect("four stages");
    let p = g.global_pool(x, h * h, c);
    g.output = g.classifier(p, c, 1000);
    g
}

/// ResNet-50 v1.5's stem and four stages of bottleneck blocks over
/// `side x side` images `x`: each stage's output `(tensor, side, channels)`
/// (strides 4, 8, 16 and 32; 256 to 2048 channels).
fn resnet50_stages(g: &mut Graph, x: TensorId, side: u32) -> Vec<(TensorId, u32, u32)> {
    let batch = g.batch;
    let (x, h, w) = g.conv("conv1", x, side, side, 3, 64, 7, 2, Act::Relu);
    let (mut x_t, h, w) = max_pool(g, "maxpool", x, 64, Spatial::square(h, w, 3, 2, 1));
    let (mut h, mut w, mut c) = (h, w, 64u32);
    let mut stages = Vec::new();
    for (stage, &(blocks, mid, out, stride)) in
        [(3u32, 64u32, 256u32, 1u16), (4, 128, 512, 2), (6, 256, 1024, 2), (3, 512, 2048, 2)]
            .iter()
            .enumerate()
    {
        for blk in 0..blocks {
            let p = format!("res{}.{}", stage + 2, blk);
            let st = if blk == 0 { stride } else { 1 };
            let (a, _, _) = g.conv(&format!("{p}.conv1"), x_t, h, w, c, mid, 1, 1, Act::Relu);
            let (b, ho, wo) = g.conv(&format!("{p}.conv2"), a, h, w, mid, mid, 3, st, Act::Relu);
            let (cc, _, _) = g.conv(&format!("{p}.conv3"), b, ho, wo, mid, out, 1, 1, Act::None);
            let short = if blk == 0 {
                g.conv(&format!("{p}.proj"), x_t, h, w, c, out, 1, st, Act::None).0
            } else {
                x_t
            };
            x_t = g.add(
                &format!("{p}.add"),
                cc,
                short,
                u64::from(batch) * u64::from(ho * wo) * u64::from(out),
                out,
                Act::Relu,
            );
            (h, w, c) = (ho, wo, out);
        }
        stages.push((x_t, h, c));
    }
    stages
}

/// RetinaNet (Lin et al. 2017) with a ResNet-50 FPN on `side x side`
/// images (640 in the library, the TPU reference's size; any multiple of
/// 128), COCO's 80 classes, and one anchor per location (the paper's
/// one-scale, one-ratio ablation of Table 1c: 8,525 boxes at 640): pyramid levels P3-P7 of 256
/// channels (lateral 1x1 convolutions, nearest 2x upsampling by strided
/// copies, 3x3 output convolutions; P6 a stride-2 3x3 on C5, P7 one on
/// ReLU(P6)), and on every level the two subnets, four 3x3 convolutions
/// of 256 channels each, then the class scores (sigmoid) and the box
/// (decoded against the level's anchors as SSD's are), the subnets'
/// weights shared by the levels. Post-processing on the VU: the boxes
/// and scores of all levels are gathered per image and go through a
/// class-aware Fast NMS ([`Op::FastNms`]) at IoU 0.5, every class
/// against all 8,525 boxes (no top-k first: the ISA cannot sort).
pub fn retinanet(batch: u32, side: u32) -> Graph {
    const CLASSES: u32 = 80;
    const CH: u32 = 256;
    let mut g = Graph::new("retinanet", batch);
    let x = g.image_input(side, 3);
    let stages = resnet50_stages(&mut g, x, side);
    let (c3, s3, ch3) = stages[1];
    let (c4, s4, ch4) = stages[2];
    let (c5, s5, ch5) = stages[3];
    let px = |s: u32| u64::from(batch) * u64::from(s * s) * u64::from(CH);
    // Top-down pathway.
    let (l5, _, _) = g.conv("fpn.lat5", c5, s5, s5, ch5, CH, 1, 1, Act::None);
    let (l4, _, _) = g.conv("fpn.lat4", c4, s4, s4, ch4, CH, 1, 1, Act::None);
    let (l3, _, _) = g.conv("fpn.lat3", c3, s3, s3, ch3, CH, 1, 1, Act::None);
    let u5 = upsample2x(&mut g, "fpn.up5", l5, s5, s5, CH);
    let m4 = g.add("fpn.merge4", l4, u5, px(s4), CH, Act::None);
    let u4 = upsample2x(&mut g, "fpn.up4", m4, s4, s4, CH);
    let m3 = g.add("fpn.merge3", l3, u4, px(s3), CH, Act::None);
    let (p3, _, _) = g.conv("fpn.p3", m3, s3, s3, CH, CH, 3, 1, Act::None);
    let (p4, _, _) = g.conv("fpn.p4", m4, s4, s4, CH, CH, 3, 1, Act::None);
    let (p5, _, _) = g.conv("fpn.p5", l5, s5, s5, CH, CH, 3, 1, Act::None);
    let (p6, s6, _) = g.conv("fpn.p6", c5, s5, s5, ch5, CH, 3, 2, Act::None);
    let r6 = g.act("fpn.p6.relu", px(s6));
    let rows6 = batch * s6 * s6;
    g.ops.push(Op::Unary {
        name: "fpn.p6.relu".into(),
        x: View::dense(p6, CH),
        y: View::dense(r6, CH),
        rows: rows6,
        cols: CH,
        act: Act::Relu,
    });
    let (p7, s7, _) = g.conv("fpn.p7", r6, s6, s6, CH, CH, 3, 2, Act::None);
    let levels = [(p3, s3), (p4, s4), (p5, s5), (p6, s6), (p7, s7)];
    let n: u32 = levels.iter().map(|l| l.1 * l.1).sum();
    // The subnets' weights, shared by the levels: (weights, bias, cout).
    let mut subnet = |name: &str, out: u32| -> Vec<(TensorId, TensorId, u32)> {
        (0..5)
            .map(|i| {
                let cout = if i == 4 { out } else { CH };
                let fan_in = 9 * CH;
                let w = g.tensor(
                    format!("{name}.{i}.w"),
                    u64::from(fan_in) * u64::from(cout),
                    Init::Weights { fan_in },
                );
                let b = g.tensor(format!("{name}.{i}.b"), cout.into(), Init::Bias);
                (w, b, cout)
            })
            .collect()
    };
    let cls_w = subnet("cls", CLASSES);
    let box_w = subnet("box", 4);
    let all_scores = g.act("scores", u64::from(batch) * u64::from(n) * u64::from(CLASSES));
    let all_boxes = g.act("boxes", u64::from(batch) * u64::from(n) * 4);
    let mut off = 0u32;
    for (l, &(f, s)) in levels.iter().enumerate() {
        let p = format!("p{}", l + 3);
        let run = |g: &mut Graph, sub: &str, ws: &[(TensorId, TensorId, u32)]| -> TensorId {
            let mut x = f;
            for (i, &(w, b, cout)) in ws.iter().enumerate() {
                let act = if i + 1 == ws.len() { Act::None } else { Act::Relu };
                let y =
                    g.act(&format!("{p}.{sub}.{i}"), u64::from(batch) * u64::from(s * s) * u64::from(cout));
                g.ops.push(Op::Conv {
                    name: format!("{p}.{sub}.{i}"),
                    x,
                    w,
                    b,
                    y,
                    batch,
                    s: Spatial::square(s, s, 3, 1, 1),
                    cin: CH,
                    cout,
                    act,
                });
                x = y;
            }
            x
        };
        let cls = run(&mut g, "cls", &cls_w);
        let reg = run(&mut g, "box", &box_w);
        let (prob, dec) = decode_detections(&mut g, &p, cls, reg, batch * s * s, CLASSES, false);
        // Gather the level into each image's candidates.
        for img in 0..batch {
            for (t, all, cols) in [(prob, all_scores, CLASSES), (dec, all_boxes, 4)] {
                g.ops.push(Op::Copy {
                    name: format!("{p}.gather{}.{img}", if cols == 4 { "boxes" } else { "scores" }),
                    x: View { t, ld: cols, col: img * s * s * cols },
                    y: View { t: all, ld: cols, col: (img * n + off) * cols },
                    rows: s * s,
                    cols,
                });
            }
        }
        off += s * s;
    }
    let corners = g.act("nms.corners", 5 * u64::from(batch) * u64::from(n));
    let y = g.act("detections", u64::from(batch) * u64::from(n) * u64::from(CLASSES));
    g.ops.push(Op::FastNms {
        name: "nms".into(),
        boxes: all_boxes,
        scores: all_scores,
        corners,
        y,
        batch,
        n,
        classes: CLASSES,
        iou: 0.5,
    });
    g.output = y;
    g
}

/// MobileNet-v1's depthwise-separable blocks after the stem: output
/// channels and stride of each (the depthwise 3x3 carries the stride, a
/// pointwise 1x1 follows).
const MOBILENET_V1: [(u32, u16); 13] = [
    (64, 1),
    (128, 2),
    (128, 1),
    (256, 2),
    (256, 1),
    (512, 2),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (1024, 2),
    (1024, 1),
];

fn mobilenet(batch: u32) -> Graph {
    let mut g = Graph::new("mobilenet", batch);
    let x = g.image_input(224, 3);
    let (mut x, mut h, mut w) = g.conv("conv1", x, 224, 224, 3, 32, 3, 2, Act::Relu);
    let mut c = 32;
    for (i, &(out, stride)) in MOBILENET_V1.iter().enumerate() {
        let (d, ho, wo) = g.depthwise(&format!("dw{}", i + 1), x, h, w, c, 3, stride, Act::Relu);
        (x, _, _) = g.conv(&format!("pw{}", i + 1), d, ho, wo, c, out, 1, 1, Act::Relu);
        (h, w, c) = (ho, wo, out);
    }
    let p = g.global_pool(x, h * w, c);
    g.output = g.classifier(p, c, 1000);
    g
}

fn efficientnet(batch: u32) -> Graph {
    let mut g = Graph::new("efficientnet", batch);
    let x = g.image_input(224, 3);
    let (mut x, mut h, mut w) = g.conv("stem", x, 224, 224, 3, 32, 3, 2, Act::Swish);
    let mut c = 32u32;
    // (expand ratio, kernel, stride, output channels, repeats)
    let stages = [
        (1u32, 3u16, 1u16, 16u32, 1u32),
        (6, 3, 2, 24, 2),
        (6, 5, 2, 40, 2),
        (6, 3, 2, 80, 3),
        (6, 5, 1, 112, 3),
        (6, 5, 2, 192, 4),
        (6, 3, 1, 320, 1),
    ];
    let mut blk = 0;
    for &(e, k, stride, out, reps) in &stages {
        for r in 0..reps {
            let p = format!("mb{blk}");
            blk += 1;
            let st = if r == 0 { stride } else { 1 };
            let ce = c * e;
            let xe =
                if e == 1 { x } else { g.conv(&format!("{p}.expand"), x, h, w, c, ce, 1, 1, Act::Swish).0 };
            let (d, ho, wo) = g.depthwise(&format!("{p}.dw"), xe, h, w, ce, k, st, Act::Swish);
            // Squeeze-excite on a quarter of the block's input channels.
            let se = (c / 4).max(1);
            let pooled = g.act(format!("{p}.se.pool").as_str(), u64::from(batch) * u64::from(ce));
            g.ops.push(Op::GlobalPool {
                name: format!("{p}.se.pool"),
                x: d,
                y: pooled,
                batch,
                hw: ho * wo,
                c: ce,
            });
            let s1 =
                g.linear(&format!("{p}.se.reduce"), View::dense(pooled, ce), batch, ce, se, Act::Swish, None);
            let s2 = g.linear(&format!("{p}.se.expand"), s1, batch, se, ce, Act::Sigmoid, None);
            let scaled = g
                .act(format!("{p}.se.scale").as_str(), u64::from(batch) * u64::from(ho * wo) * u64::from(ce));
            g.ops.push(Op::ScaleChannels {
                name: format!("{p}.se.scale"),
                x: d,
                s: s2.t,
                y: scaled,
                batch,
                hw: ho * wo,
                c: ce,
            });
            let (pr, _, _) = g.conv(&format!("{p}.project"), scaled, ho, wo, ce, out, 1, 1, Act::None);
            x = if st == 1 && c == out {
                g.add(
                    &format!("{p}.add"),
                    pr,
                    x,
                    u64::from(batch) * u64::from(ho * wo) * u64::from(out),
                    out,
                    Act::None,
                )
            } else {
                pr
            };
            (h, w, c) = (ho, wo, out);
        }
    }
    let (x, _, _) = g.conv("head", x, h, w, c, 1280, 1, 1, Act::Swish);
    let p = g.global_pool(x, h * w, 1280);
    g.output = g.classifier(p, 1280, 1000);
    g
}

/// A max pool of `c`-channel images (the window `s` says their size).
fn max_pool(g: &mut Graph, name: &str, x: TensorId, c: u32, s: Spatial) -> (TensorId, u32, u32) {
    let (ho, wo) = s.out();
    let y = g.act(name, u64::from(g.batch) * u64::from(ho * wo) * u64::from(c));
    g.ops.push(Op::Pool { name: name.into(), x, y, batch: g.batch, s, c, op: PoolOp::Max });
    (y, ho, wo)
}

/// GoogLeNet (Inception v1) at 224x224. The four branches of a module are
/// concatenated along the channels by DMA copies into the module's output
/// (a compiler that writes each branch in place would save them).
fn googlenet(batch: u32) -> Graph {
    let mut g = Graph::new("googlenet", batch);
    let x = g.image_input(224, 3);
    let (x, h, w) = g.conv("conv1", x, 224, 224, 3, 64, 7, 2, Act::Relu);
    let (x, h, w) = max_pool(&mut g, "pool1", x, 64, Spatial::square(h, w, 3, 2, 1));
    let (x, h, w) = g.conv("conv2.reduce", x, h, w, 64, 64, 1, 1, Act::Relu);
    let (x, h, w) = g.conv("conv2", x, h, w, 64, 192, 3, 1, Act::Relu);
    let (mut x, mut h, mut w) = max_pool(&mut g, "pool2", x, 192, Spatial::square(h, w, 3, 2, 1));
    let mut c = 192u32;
    // (name, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool projection);
    // a max pool (3x3, stride 2) before 4a and 5a.
    let modules: [(&str, [u32; 6]); 9] = [
        ("3a", [64, 96, 128, 16, 32, 32]),
        ("3b", [128, 128, 192, 32, 96, 64]),
        ("4a", [192, 96, 208, 16, 48, 64]),
        ("4b", [160, 112, 224, 24, 64, 64]),
        ("4c", [128, 128, 256, 24, 64, 64]),
        ("4d", [112, 144, 288, 32, 64, 64]),
        ("4e", [256, 160, 320, 32, 128, 128]),
        ("5a", [256, 160, 320, 32, 128, 128]),
        ("5b", [384, 192, 384, 48, 128, 128]),
    ];
    for (m, [c1, r3, c3, r5, c5, pp]) in modules {
        if m == "4a" || m == "5a" {
            let p = format!("pool{}", &m[..1]);
            (x, h, w) = max_pool(&mut g, &p, x, c, Spatial::square(h, w, 3, 2, 1));
        }
        let p = format!("inception{m}");
        let out = c1 + c3 + c5 + pp;
        let pixels = batch * h * w;
        let b1 = g.conv(&format!("{p}.1x1"), x, h, w, c, c1, 1, 1, Act::Relu).0;
        let t3 = g.conv(&format!("{p}.3x3.reduce"), x, h, w, c, r3, 1, 1, Act::Relu).0;
        let b3 = g.conv(&format!("{p}.3x3"), t3, h, w, r3, c3, 3, 1, Act::Relu).0;
        let t5 = g.conv(&format!("{p}.5x5.reduce"), x, h, w, c, r5, 1, 1, Act::Relu).0;
        let b5 = g.conv(&format!("{p}.5x5"), t5, h, w, r5, c5, 5, 1, Act::Relu).0;
        let tp = max_pool(&mut g, &format!("{p}.pool"), x, c, Spatial::square(h, w, 3, 1, 1)).0;
        let bp = g.conv(&format!("{p}.pool.proj"), tp, h, w, c, pp, 1, 1, Act::Relu).0;
        let cat = concat(&mut g, &format!("{p}.concat"), &[(b1, c1), (b3, c3), (b5, c5), (bp, pp)], pixels);
        (x, c) = (cat, out);
    }
    let p = g.global_pool(x, h * w, c);
    g.output = g.classifier(p, c, 1000);
    g
}

/// Tiny YOLOv2 (PASCAL VOC: 20 classes, 5 anchors) at 416x416. Leaky ReLU
/// is modelled as ReLU (the same one VU pass), and the last max pool
/// (2x2, stride 1, padded right and bottom in Darknet) as a 3x3 window with
/// stride 1 and padding 1 (the same 13x13 output; the VU's pooling takes
/// the same padding on every side).
fn tiny_yolo(batch: u32) -> Graph {
    let mut g = Graph::new("tiny-yolo", batch);
    let x = g.image_input(416, 3);
    let (mut x, mut h, mut w, mut c) = (x, 416u32, 416u32, 3u32);
    for (i, out) in [16u32, 32, 64, 128, 256, 512].into_iter().enumerate() {
        (x, h, w) = g.conv(&format!("conv{}", i + 1), x, h, w, c, out, 3, 1, Act::Relu);
        c = out;
        let s = if out == 512 { Spatial::square(h, w, 3, 1, 1) } else { Spatial::square(h, w, 2, 2, 0) };
        (x, h, w) = max_pool(&mut g, &format!("pool{}", i + 1), x, c, s);
    }
    (x, h, w) = g.conv("conv7", x, h, w, c, 1024, 3, 1, Act::Relu);
    (x, h, w) = g.conv("conv8", x, h, w, 1024, 1024, 3, 1, Act::Relu);
    let (det, _, _) = g.conv("detect", x, h, w, 1024, 125, 1, 1, Act::None);
    // Post-processing of the 13 x 13 x 5 boxes: sigmoid of the x, y and
    // objectness outputs and softmax of the 20 class scores, per box.
    let boxes = batch * h * w * 5;
    let probs = g.act("classes", u64::from(boxes) * 20);
    g.ops.push(Op::Softmax {
        name: "classes".into(),
        x: View { t: det, ld: 25, col: 5 },
        y: View::dense(probs, 20),
        rows: boxes,
        cols: 20,
    });
    let xy = g.act("boxes", u64::from(boxes) * 5);
    g.ops.push(Op::Unary {
        name: "boxes".into(),
        x: View { t: det, ld: 25, col: 0 },
        y: View::dense(xy, 5),
        rows: boxes,
        cols: 5,
        act: Act::Sigmoid,
    });
    g.output = probs;
    g
}

/// SSD-MobileNet-v1 (COCO: 90 classes and background, 91 scores per box)
/// at 300x300, as TensorFlow's detection model zoo has it: the MobileNet
/// backbone (ReLU6 modelled as ReLU), four extra 1x1-then-3x3/2 layers,
/// 1x1 box predictors on six feature maps (19, 10, 5, 3, 2, 1 pixels; 3
/// anchors on the first, 6 on the others: 1917 boxes) and the
/// post-processing the graph does before non-maximum suppression: the
/// sigmoid of every score and the decoding of every box against its
/// anchor (`xy = t_xy * a_wh + a_xy`, `wh = exp(t_wh) * a_wh`; the
/// 1/10 and 1/5 scales folded into the predictor). The anchors are a
/// weight tensor per feature map (per image: the VU's binary operations
/// do not broadcast over the batch). Non-maximum suppression, a sort
/// with data-dependent control, is not modelled.
fn ssd_mobilenet(batch: u32) -> Graph {
    const CLASSES: u32 = 91;
    let mut g = Graph::new("ssd-mobilenet", batch);
    let x = g.image_input(300, 3);
    let (mut x, mut h, mut w) = g.conv("conv1", x, 300, 300, 3, 32, 3, 2, Act::Relu);
    let mut c = 32;
    // (tensor, side, channels, anchors) of each feature map.
    let mut maps = Vec::new();
    for (i, &(out, stride)) in MOBILENET_V1.iter().enumerate() {
        let (d, ho, wo) = g.depthwise(&format!("dw{}", i + 1), x, h, w, c, 3, stride, Act::Relu);
        (x, _, _) = g.conv(&format!("pw{}", i + 1), d, ho, wo, c, out, 1, 1, Act::Relu);
        (h, w, c) = (ho, wo, out);
        if i == 10 {
            maps.push((x, h, c, 3u32));
        }
    }
    maps.push((x, h, c, 6));
    for (i, (mid, out)) in [(256u32, 512u32), (128, 256), (128, 256), (64, 128)].into_iter().enumerate() {
        let (m, _, _) = g.conv(&format!("extra{}.1x1", i + 1), x, h, w, c, mid, 1, 1, Act::Relu);
        (x, h, w) = g.conv(&format!("extra{}.3x3", i + 1), m, h, w, mid, out, 3, 2, Act::Relu);
        c = out;
        maps.push((x, h, c, 6));
    }
    let scores: Vec<TensorId> = maps
        .iter()
        .enumerate()
        .map(|(l, &(f, side, ch, anchors))| {
            detection_head(
                &mut g,
                &format!("box{l}"),
                f,
                Spatial::square(side, side, 1, 1, 0),
                ch,
                anchors,
                CLASSES,
                false,
            )
        })
        .collect();
    g.output = scores[0];
    g
}

/// An SSD detection head on feature map `f` (`s`: its size and the head
/// convolutions' window): class scores (a sigmoid per class, or a softmax
/// over the classes of each box) and the boxes decoded from the anchors;
/// returns the scores.
#[allow(clippy::too_many_arguments)]
fn detection_head(
    g: &mut Graph,
    p: &str,
    f: TensorId,
    s: Spatial,
    ch: u32,
    anchors: u32,
    classes: u32,
    softmax: bool,
) -> TensorId {
    let (cls, ho, wo) = g.conv_spatial(&format!("{p}.classes"), f, s, ch, anchors * classes, Act::None);
    let (reg, _, _) = g.conv_spatial(&format!("{p}.boxes"), f, s, ch, anchors * 4, Act::None);
    decode_detections(g, p, cls, reg, g.batch * ho * wo * anchors, classes, softmax).0
}

/// The post-processing of a detection head before NMS: the scores of
/// `boxes` boxes from the class logits `cls` (a sigmoid per class, or a
/// softmax over the classes of each box) and the boxes decoded from the
/// regression `reg` against a weight tensor of anchors. Returns
/// (scores `[boxes][classes]`, decoded boxes `[boxes][4]`).
fn decode_detections(
    g: &mut Graph,
    p: &str,
    cls: TensorId,
    reg: TensorId,
    boxes: u32,
    classes: u32,
    softmax: bool,
) -> (TensorId, TensorId) {
    let prob = g.act(&format!("{p}.scores"), u64::from(boxes) * u64::from(classes));
    let (x, y) = (View::dense(cls, classes), View::dense(prob, classes));
    let name = format!("{p}.scores");
    g.ops.push(if softmax {
        Op::Softmax { name, x, y, rows: boxes, cols: classes }
    } else {
        Op::Unary { name, x, y, rows: boxes, cols: classes, act: Act::Sigmoid }
    });
    // Anchors: [centre y, centre x, height, width] per box.
    let anc = g.tensor(format!("{p}.anchors"), u64::from(boxes) * 4, Init::Weights { fan_in: 1 });
    let dec = g.act(&format!("{p}.decoded"), u64::from(boxes) * 4);
    let col = |t, col| View { t, ld: 4, col };
    let wh = g.act(&format!("{p}.exp"), u64::from(boxes) * 2);
    g.ops.push(Op::Unary {
        name: format!("{p}.exp"),
        x: col(reg, 2),
        y: View::dense(wh, 2),
        rows: boxes,
        cols: 2,
        act: Act::Exp,
    });
    g.ops.push(Op::Mul {
        name: format!("{p}.size"),
        a: View::dense(wh, 2),
        b: col(anc, 2),
        y: col(dec, 2),
        rows: boxes,
        cols: 2,
        act: Act::None,
    });
    g.ops.push(Op::Mul {
        name: format!("{p}.offset"),
        a: col(reg, 0),
        b: col(anc, 2),
        y: col(dec, 0),
        rows: boxes,
        cols: 2,
        act: Act::None,
    });
    g.ops.push(Op::Add {
        name: format!("{p}.centre"),
        a: col(dec, 0),
        b: col(anc, 0),
        y: col(dec, 0),
        rows: boxes,
        cols: 2,
        act: Act::None,
    });
    (prob, dec)
}

/// Wide & Deep (Cheng et al. 2016) with Criteo-like inputs: 13 dense
/// features and 26 categorical ones of 100k values each, embedded in 32
/// dimensions; the deep part is an MLP 845-1024-512-256-1 over the dense
/// features and the 26 embeddings, the wide part a linear model over 40
/// one-hot crosses of the categories (an embedding bag of 1-dimensional
/// weights from one table of 1M crosses); the output is the sigmoid of
/// their sum.
fn wide_deep(batch: u32) -> Graph {
    const SPARSE: u32 = 26;
    const DIM: u32 = 32;
    const ROWS: u32 = 100_000;
    const CROSSES: u32 = 1_000_000;
    let mut g = Graph::new("wide-deep", batch);
    let dense = g.tensor("dense", u64::from(batch) * 13, Init::Input);
    g.input = dense;
    let cols = 13 + SPARSE * DIM;
    let deep_in = g.act("deep.in", u64::from(batch) * u64::from(cols));
    g.ops.push(Op::Copy {
        name: "concat".into(),
        x: View::dense(dense, 13),
        y: View { t: deep_in, ld: cols, col: 0 },
        rows: batch,
        cols: 13,
    });
    for t in 0..SPARSE {
        let table =
            g.tensor(format!("emb{t}.table"), u64::from(ROWS) * u64::from(DIM), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("emb{t}.idx"), u64::from(batch), Init::Indices { max: ROWS });
        g.ops.push(Op::Embedding {
            name: format!("emb{t}"),
            table,
            idx,
            y: View { t: deep_in, ld: cols, col: 13 + t * DIM },
            batch,
            rows: ROWS,
            dim: DIM,
            pool: 1,
        });
    }
    let d1 = g.linear("deep0", View::dense(deep_in, cols), batch, cols, 1024, Act::Relu, None);
    let d2 = g.linear("deep1", d1, batch, 1024, 512, Act::Relu, None);
    let d3 = g.linear("deep2", d2, batch, 512, 256, Act::Relu, None);
    let deep = g.linear("deep3", d3, batch, 256, 1, Act::None, None);
    let table = g.tensor("wide.table", u64::from(CROSSES), Init::Weights { fan_in: 1 });
    let idx = g.tensor("wide.idx", u64::from(batch) * 40, Init::Indices { max: CROSSES });
    let wide = g.act("wide", u64::from(batch));
    g.ops.push(Op::Embedding {
        name: "wide".into(),
        table,
        idx,
        y: View::dense(wide, 1),
        batch,
        rows: CROSSES,
        dim: 1,
        pool: 40,
    });
    let y = g.act("predict", u64::from(batch));
    g.ops.push(Op::Add {
        name: "predict".into(),
        a: deep,
        b: View::dense(wide, 1),
        y: View::dense(y, 1),
        rows: batch,
        cols: 1,
        act: Act::Sigmoid,
    });
    g.output = y;
    g
}

/// DIN, the Deep Interest Network (Zhou et al. 2018) with the paper's
/// shapes: goods and category embeddings of 18 dimensions each (36 per
/// item), a history of 50 behaviours, an activation unit per behaviour
/// (an MLP 144-80-40-1 over `[h, a, h - a, h * a]`, PReLU/Dice modelled as
/// ReLU, `h - a` as `h + a`: the same one VU pass), attention-weighted sum pooling of the history, and an MLP
/// 108-200-80-2 over `[user profile, pooled history, candidate]` (the
/// profile as one 36-dimensional embedding). The candidate's embedding is
/// gathered once per history position (the VU's binary operations do not
/// broadcast rows), and the weighted sum is a batched product of each
/// sample's 1 x 50 weights with its 50 x 36 history.
fn din(batch: u32) -> Graph {
    const HIST: u32 = 50;
    const D: u32 = 36;
    const ITEMS: u32 = 100_000;
    const USERS: u32 = 100_000;
    let mut g = Graph::new("din", batch);
    let rows = batch * HIST;
    // Activation-unit input per behaviour: [h | a | h - a | h * a].
    let unit = g.act("unit.in", u64::from(rows) * u64::from(4 * D));
    let gather = |g: &mut Graph, name: &str, bags: u32, y: View, rows_in: u32| {
        let table =
            g.tensor(format!("{name}.table"), u64::from(rows_in) * u64::from(D), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("{name}.idx"), u64::from(bags), Init::Indices { max: rows_in });
        g.ops.push(Op::Embedding {
            name: name.into(),
            table,
            idx,
            y,
            batch: bags,
            rows: rows_in,
            dim: D,
            pool: 1,
        });
        idx
    };
    let u = |col| View { t: unit, ld: 4 * D, col };
    g.input = gather(&mut g, "history", rows, u(0), ITEMS);
    gather(&mut g, "candidate.rep", rows, u(D), ITEMS);
    g.ops.push(Op::Add {
        name: "unit.diff".into(),
        a: u(0),
        b: u(D),
        y: u(2 * D),
        rows,
        cols: D,
        act: Act::None,
    });
    g.ops.push(Op::Mul {
        name: "unit.prod".into(),
        a: u(0),
        b: u(D),
        y: u(3 * D),
        rows,
        cols: D,
        act: Act::None,
    });
    let a1 = g.linear("unit0", View::dense(unit, 4 * D), rows, 4 * D, 80, Act::Relu, None);
    let a2 = g.linear("unit1", a1, rows, 80, 40, Act::Relu, None);
    let wts = g.linear("unit2", a2, rows, 40, 1, Act::None, None);
    // [profile | pooled | candidate]
    let top = g.act("mlp.in", u64::from(batch) * u64::from(3 * D));
    let t = |col| View { t: top, ld: 3 * D, col };
    gather(&mut g, "profile", batch, t(0), USERS);
    g.ops.push(Op::BatchMatMul {
        name: "pool".into(),
        a: wts.t,
        b: unit,
        y: top,
        lda: HIST,
        ldb: 4 * D,
        ldy: 3 * D,
        trans_b: false,
        m: 1,
        k: HIST,
        n: D,
        offs: (0..u64::from(batch))
            .map(|i| [i * u64::from(HIST), i * u64::from(HIST * 4 * D), i * u64::from(3 * D) + u64::from(D)])
            .collect(),
        act: Act::None,
    });
    gather(&mut g, "candidate", batch, t(2 * D), ITEMS);
    let m1 = g.linear("mlp0", View::dense(top, 3 * D), batch, 3 * D, 200, Act::Relu, None);
    let m2 = g.linear("mlp1", m1, batch, 200, 80, Act::Relu, None);
    g.output = g.linear("mlp2", m2, batch, 80, 2, Act::None, None).t;
    g
}

/// Nearest-neighbour 2x upsampling of `c`-channel `h x w` images (NHWC)
/// by four strided DMA copies: each pixel twice along the rows, then
/// each (now doubled) image row twice.
fn upsample2x(g: &mut Graph, name: &str, x: TensorId, h: u32, w: u32, c: u32) -> TensorId {
    let b = g.batch;
    let wide = g.act(&format!("{name}.cols"), u64::from(b * h * w) * 2 * u64::from(c));
    for dj in 0..2 {
        g.ops.push(Op::Copy {
            name: format!("{name}.cols{dj}"),
            x: View::dense(x, c),
            y: View { t: wide, ld: 2 * c, col: dj * c },
            rows: b * h * w,
            cols: c,
        });
    }
    let row = 2 * w * c;
    let y = g.act(name, u64::from(b * h) * 2 * u64::from(row));
    for di in 0..2 {
        g.ops.push(Op::Copy {
            name: format!("{name}.rows{di}"),
            x: View::dense(wide, row),
            y: View { t: y, ld: 2 * row, col: di * row },
            rows: b * h,
            cols: row,
        });
    }
    y
}

/// The channels of `pixels`-pixel tensors `(tensor, channels)` side by
/// side, in order, by one DMA copy each into column views of the result
/// (copy `NAME.COL`, named by its first column).
fn concat(g: &mut Graph, name: &str, parts: &[(TensorId, u32)], pixels: u32) -> TensorId {
    let out: u32 = parts.iter().map(|p| p.1).sum();
    let y = g.act(name, u64::from(pixels) * u64::from(out));
    let mut col = 0;
    for &(t, c) in parts {
        g.ops.push(Op::Copy {
            name: format!("{name}.{col}"),
            x: View::dense(t, c),
            y: View { t: y, ld: out, col },
            rows: pixels,
            cols: c,
        });
        col += c;
    }
    y
}

/// YOLOv3 (COCO: 80 classes, 3 anchors per cell: 255 outputs) at
/// 416x416: Darknet-53 (residual blocks of 1x1 then 3x3 convolutions;
/// leaky ReLU modelled as ReLU), and detection at 13, 26 and 52 cells
/// (10,647 boxes), each finer scale fed by a 1x1 convolution of the
/// coarser one's features upsampled 2x (nearest, four DMA copies) and
/// concatenated with the backbone's map of that size. Post-processing
/// before NMS on the VU: the logistic of x, y, objectness and the 80
/// class scores and the exponential of w and h of every box (the anchor
/// products and NMS are not modelled). `side` is the input's (416 in the
/// library; any multiple of 32).
pub fn yolov3(batch: u32, side: u32) -> Graph {
    let mut g = Graph::new("yolov3", batch);
    let x = g.image_input(side, 3);
    let (mut x, mut h, mut w) = g.conv("conv0", x, side, side, 3, 32, 3, 1, Act::Relu);
    let mut c = 32u32;
    let mut routes = Vec::new();
    for (stage, (out, blocks)) in
        [(64u32, 1u32), (128, 2), (256, 8), (512, 8), (1024, 4)].into_iter().enumerate()
    {
        (x, h, w) = g.conv(&format!("down{stage}"), x, h, w, c, out, 3, 2, Act::Relu);
        c = out;
        for blk in 0..blocks {
            let p = format!("res{stage}.{blk}");
            let (a, _, _) = g.conv(&format!("{p}.1x1"), x, h, w, c, c / 2, 1, 1, Act::Relu);
            let (b, _, _) = g.conv(&format!("{p}.3x3"), a, h, w, c / 2, c, 3, 1, Act::Relu);
            x = g.add(&format!("{p}.add"), b, x, u64::from(batch * h * w) * u64::from(c), c, Act::None);
        }
        routes.push((x, h, c));
    }
    let mut outputs = Vec::new();
    let mut up: Option<(TensorId, u32)> = None;
    for (scale, width) in [512u32, 256, 128].into_iter().enumerate() {
        let (route, side, rc) = routes[4 - scale];
        let p = format!("head{scale}");
        let (mut t, mut tc) = (route, rc);
        if let Some((u, uc)) = up {
            t = concat(&mut g, &format!("{p}.concat"), &[(u, uc), (route, rc)], batch * side * side);
            tc = uc + rc;
        }
        for i in 0..5 {
            let (k, out) = if i % 2 == 0 { (1, width) } else { (3, 2 * width) };
            (t, _, _) = g.conv(&format!("{p}.conv{i}"), t, side, side, tc, out, k, 1, Act::Relu);
            tc = out;
        }
        let (f, _, _) = g.conv(&format!("{p}.conv5"), t, side, side, width, 2 * width, 3, 1, Act::Relu);
        let (det, _, _) = g.conv(&format!("{p}.detect"), f, side, side, 2 * width, 255, 1, 1, Act::None);
        let boxes = batch * side * side * 3;
        let out = g.act(&format!("{p}.boxes"), u64::from(boxes) * 85);
        for (name, col, cols, act) in
            [("xy", 0, 2, Act::Sigmoid), ("wh", 2, 2, Act::Exp), ("scores", 4, 81, Act::Sigmoid)]
        {
            g.ops.push(Op::Unary {
                name: format!("{p}.{name}"),
                x: View { t: det, ld: 85, col },
                y: View { t: out, ld: 85, col },
                rows: boxes,
                cols,
                act,
            });
        }
        outputs.push(out);
        if scale < 2 {
            let (r, _, _) = g.conv(&format!("{p}.reduce"), t, side, side, width, width / 2, 1, 1, Act::Relu);
            up = Some((upsample2x(&mut g, &format!("{p}.up"), r, side, side, width / 2), width / 2));
        }
    }
    g.output = outputs[0];
    g
}

/// The sizes of an SSD-ResNet34.
#[derive(Clone, Debug)]
pub struct SsdR34Size {
    /// Input height and width (at least 420: the last two feature maps
    /// shrink by unpadded 3x3 convolutions).
    pub side: u32,
    /// Every channel count divided by this (1: the published network;
    /// tests use more to stay small).
    pub width_div: u32,
}

impl SsdR34Size {
    /// MLPerf Inference's SSD-large: 1200 x 1200, full width.
    pub const MLPERF: SsdR34Size = SsdR34Size { side: 1200, width_div: 1 };
}

/// SSD-ResNet34 as MLPerf Inference runs it (the "SSD-large" of its
/// reference `ssd_r34.py`): ResNet-34's first three stages (basic blocks
/// 3 x 64, 4 x 128, 6 x 256, the third stage at stride 1, so the first
/// feature map is 1/8 of the input: 150 x 150), five extra blocks (a 1x1
/// then a 3x3: stride 2 padded, stride 2 padded, stride 2 padded, stride 2
/// unpadded, stride 1 unpadded; 75, 38, 19, 9 and 7 at 1200), and on each
/// of the six maps 3x3 heads of **stride 3** (50, 25, 13, 7, 3, 3) for
/// 4, 6, 6, 6, 4, 4 anchors: 15,130 boxes of 81 COCO classes, scored by a
/// softmax over the classes and decoded from the anchors as in
/// SSD-MobileNet. Non-maximum suppression is not modelled (as for the
/// other detectors).
pub fn ssd_resnet34(batch: u32, size: &SsdR34Size) -> Graph {
    const CLASSES: u32 = 81;
    let ch = |c: u32| (c / size.width_div.max(1)).max(1);
    let side = size.side;
    let mut g = Graph::new("ssd-resnet34", batch);
    let x = g.image_input(side, 3);
    let (x, h, w) = g.conv("conv1", x, side, side, 3, ch(64), 7, 2, Act::Relu);
    let (mut x, mut h, mut w) = max_pool(&mut g, "maxpool", x, ch(64), Spatial::square(h, w, 3, 2, 1));
    let mut c = ch(64);
    for (stage, &(blocks, out, stride)) in [(3u32, 64u32, 1u16), (4, 128, 2), (6, 256, 1)].iter().enumerate()
    {
        let out = ch(out);
        for blk in 0..blocks {
            let p = format!("layer{}.{blk}", stage + 1);
            let st = if blk == 0 { stride } else { 1 };
            let (a, ho, wo) = g.conv(&format!("{p}.conv1"), x, h, w, c, out, 3, st, Act::Relu);
            let (b, _, _) = g.conv(&format!("{p}.conv2"), a, ho, wo, out, out, 3, 1, Act::None);
            let short = if st != 1 || c != out {
                g.conv(&format!("{p}.down"), x, h, w, c, out, 1, st, Act::None).0
            } else {
                x
            };
            let elems = u64::from(batch) * u64::from(ho * wo) * u64::from(out);
            x = g.add(&format!("{p}.add"), b, short, elems, out, Act::Relu);
            (h, w, c) = (ho, wo, out);
        }
    }
    let anchors = [4u32, 6, 6, 6, 4, 4];
    let mut maps = vec![(x, h, c)];
    // (1x1 channels, 3x3 channels, 3x3 stride, 3x3 padding) per block.
    let extras = [
        (256u32, 512u32, 2u16, 1u16),
        (256, 512, 2, 1),
        (128, 256, 2, 1),
        (128, 256, 2, 0),
        (128, 256, 1, 0),
    ];
    for (i, &(mid, out, stride, pad)) in extras.iter().enumerate() {
        let (m, _, _) = g.conv(&format!("extra{}.1x1", i + 1), x, h, w, c, ch(mid), 1, 1, Act::Relu);
        let s = Spatial::square(h, w, 3, stride, pad);
        (x, h, w) = g.conv_spatial(&format!("extra{}.3x3", i + 1), m, s, ch(mid), ch(out), Act::Relu);
        c = ch(out);
        maps.push((x, h, c));
    }
    let scores: Vec<TensorId> = maps
        .iter()
        .zip(anchors)
        .enumerate()
        .map(|(l, (&(f, side, ch), a))| {
            let s = Spatial::square(side, side, 3, 3, 1);
            detection_head(&mut g, &format!("box{l}"), f, s, ch, a, CLASSES, true)
        })
        .collect();
    g.output = scores[0];
    g
}

/// The sizes of a GNMT-like translation model.
#[derive(Clone, Debug)]
pub struct GnmtSize {
    /// LSTM layers of the encoder (the first bidirectional) and of the
    /// decoder.
    pub layers: u32,
    /// Hidden units (and embedding dimensions).
    pub hidden: u32,
    /// Target vocabulary (the classifier's outputs).
    pub vocab: u32,
    /// Source and target tokens.
    pub src: u32,
    pub tgt: u32,
}

impl GnmtSize {
    /// MLPerf Inference's GNMT (v2, from the NVIDIA reference): 4 + 4
    /// layers of 1024 units, a shared vocabulary of 32k subwords; 25
    /// tokens each way (a WMT16 sentence of average length).
    pub const MLPERF: GnmtSize = GnmtSize { layers: 4, hidden: 1024, vocab: 32_000, src: 25, tgt: 25 };
}

/// GNMT v2 as MLPerf runs it, greedy (beam 1) for a fixed `tgt` tokens.
///
/// Encoder: the first layer a bidirectional LSTM, the others
/// unidirectional with residual connections from the third on; each
/// layer's input projection is one product over all source tokens (as
/// cuDNN runs it), then per token the recurrent product, its sum with
/// the token's projection and the cell's element-wise work on the VU.
/// Decoder, per target token: the embedding of the previous token (a
/// gather), four LSTM layers whose input is `[x | h]` for the first and
/// `[x | context | h]` for the others (residual from the third on), the
/// attention of the first layer's output over the encoder's (Luong's
/// "general" score `q W k` with `W k` computed once; GNMT's normalized
/// Bahdanau score, a tanh over every source position per step, is
/// modelled by it), and the classifier over the vocabulary. The argmax
/// and the search are not modelled: each step's token index is an input.
/// LSTM gates are `[i | f | o | g]`.
pub fn gnmt(batch: u32, z: &GnmtSize) -> Graph {
    let (hd, t_src, t_tgt) = (z.hidden, z.src, z.tgt);
    let mut g = Graph::new("gnmt", batch);
    // The cell's element-wise part: gates (rows x 4H) and the previous
    // cell state -> new state `c` (dense) and `h` into `h_out`.
    let cell = |g: &mut Graph, p: &str, gates: View, c_prev: Option<TensorId>, h_out: View| -> TensorId {
        let b = g.batch;
        let sig = g.act(&format!("{p}.sig"), u64::from(b) * 3 * u64::from(hd));
        g.ops.push(Op::Unary {
            name: format!("{p}.sig"),
            x: gates,
            y: View::dense(sig, 3 * hd),
            rows: b,
            cols: 3 * hd,
            act: Act::Sigmoid,
        });
        let gt = g.act(&format!("{p}.tanh"), u64::from(b * hd));
        g.ops.push(Op::Unary {
            name: format!("{p}.tanh"),
            x: View { col: gates.col + 3 * hd, ..gates },
            y: View::dense(gt, hd),
            rows: b,
            cols: hd,
            act: Act::Tanh,
        });
        let sv = |col| View { t: sig, ld: 3 * hd, col };
        let c = g.act(&format!("{p}.c"), u64::from(b * hd));
        g.ops.push(Op::Mul {
            name: format!("{p}.ig"),
            a: sv(0),
            b: View::dense(gt, hd),
            y: View::dense(c, hd),
            rows: b,
            cols: hd,
            act: Act::None,
        });
        if let Some(cp) = c_prev {
            let fc = g.act(&format!("{p}.fc"), u64::from(b * hd));
            g.ops.push(Op::Mul {
                name: format!("{p}.fc"),
                a: sv(hd),
                b: View::dense(cp, hd),
                y: View::dense(fc, hd),
                rows: b,
                cols: hd,
                act: Act::None,
            });
            g.ops.push(Op::Add {
                name: format!("{p}.c"),
                a: View::dense(fc, hd),
                b: View::dense(c, hd),
                y: View::dense(c, hd),
                rows: b,
                cols: hd,
                act: Act::None,
            });
        }
        let tc = g.act(&format!("{p}.tanh_c"), u64::from(b * hd));
        g.ops.push(Op::Unary {
            name: format!("{p}.tanh_c"),
            x: View::dense(c, hd),
            y: View::dense(tc, hd),
            rows: b,
            cols: hd,
            act: Act::Tanh,
        });
        g.ops.push(Op::Mul {
            name: format!("{p}.h"),
            a: sv(2 * hd),
            b: View::dense(tc, hd),
            y: h_out,
            rows: b,
            cols: hd,
            act: Act::None,
        });
        c
    };
    // The source tokens' embeddings, [B, T, H].
    let table = g.tensor("src.emb.table", u64::from(z.vocab) * u64::from(hd), Init::Weights { fan_in: 1 });
    let idx = g.tensor("src.tokens", u64::from(batch * t_src), Init::Indices { max: z.vocab });
    g.input = idx;
    let mut x = g.act("src.emb", u64::from(batch * t_src) * u64::from(hd));
    g.ops.push(Op::Embedding {
        name: "src.emb".into(),
        table,
        idx,
        y: View::dense(x, hd),
        batch: batch * t_src,
        rows: z.vocab,
        dim: hd,
        pool: 1,
    });
    let mut xc = hd;
    for l in 0..z.layers {
        let dirs = if l == 0 { 2 } else { 1 };
        let out_c = dirs * hd;
        let out = g.act(&format!("enc{l}"), u64::from(batch * t_src) * u64::from(out_c));
        for d in 0..dirs {
            let p = format!("enc{l}.{}", if d == 0 { "fwd" } else { "bwd" });
            let proj =
                g.linear(&format!("{p}.in"), View::dense(x, xc), batch * t_src, xc, 4 * hd, Act::None, None);
            let rec = g.linear_weights(&format!("{p}.rec"), hd, 4 * hd);
            let mut c = None;
            for s in 0..t_src {
                let t = if d == 0 { s } else { t_src - 1 - s };
                let step = |t: u32| View { t: out, ld: t_src * out_c, col: t * out_c + d * hd };
                let xp = View { t: proj.t, ld: t_src * 4 * hd, col: t * 4 * hd };
                let gates = if s == 0 {
                    xp
                } else {
                    let prev = if d == 0 { t - 1 } else { t + 1 };
                    let r = g.linear_using(&format!("{p}.rec{t}"), step(prev), batch, rec, hd, 4 * hd);
                    g.ops.push(Op::Add {
                        name: format!("{p}.gates{t}"),
                        a: xp,
                        b: r,
                        y: r,
                        rows: batch,
                        cols: 4 * hd,
                        act: Act::None,
                    });
                    r
                };
                c = Some(cell(&mut g, &format!("{p}.{t}"), gates, c, step(t)));
            }
        }
        if l >= 2 {
            g.ops.push(Op::Add {
                name: format!("enc{l}.residual"),
                a: View::dense(out, out_c),
                b: View::dense(x, xc),
                y: View::dense(out, out_c),
                rows: batch * t_src,
                cols: out_c,
                act: Act::None,
            });
        }
        (x, xc) = (out, out_c);
    }
    // Attention keys W k, once per sentence.
    let keys = g.linear("att.keys", View::dense(x, hd), batch * t_src, hd, hd, Act::None, None);
    let tgt_table =
        g.tensor("tgt.emb.table", u64::from(z.vocab) * u64::from(hd), Init::Weights { fan_in: 1 });
    // Per layer: the input row [x | context | h] (the first layer [x | h]).
    let width = |l: u32| if l == 0 { 2 * hd } else { 3 * hd };
    let mut state: Vec<Option<TensorId>> = vec![None; z.layers as usize];
    let mut bufs: Vec<TensorId> = (0..z.layers)
        .map(|l| g.act(&format!("dec{l}.in0"), u64::from(batch) * u64::from(width(l))))
        .collect();
    let dec_w: Vec<_> =
        (0..z.layers).map(|l| g.linear_weights(&format!("dec{l}.gates"), width(l), 4 * hd)).collect();
    let cls_w = g.linear_weights("classifier", hd, z.vocab);
    let mut logits = None;
    for t in 0..t_tgt {
        let idx = g.tensor(format!("tgt.tokens{t}"), u64::from(batch), Init::Indices { max: z.vocab });
        g.ops.push(Op::Embedding {
            name: format!("tgt.emb{t}"),
            table: tgt_table,
            idx,
            y: View { t: bufs[0], ld: width(0), col: 0 },
            batch,
            rows: z.vocab,
            dim: hd,
            pool: 1,
        });
        let next: Vec<TensorId> = (0..z.layers)
            .map(|l| g.act(&format!("dec{l}.in{}", t + 1), u64::from(batch) * u64::from(width(l))))
            .collect();
        let top = g.act(&format!("dec.out{t}"), u64::from(batch * hd));
        for l in 0..z.layers {
            let p = format!("dec{l}.{t}");
            let w = width(l);
            let gates = g.linear_using(
                &format!("{p}.gates"),
                View::dense(bufs[l as usize], w),
                batch,
                dec_w[l as usize],
                w,
                4 * hd,
            );
            // h goes into the next token's input row of this layer.
            let h = View { t: next[l as usize], ld: w, col: w - hd };
            state[l as usize] = Some(cell(&mut g, &p, gates, state[l as usize], h));
            if l == 0 {
                // Attention of h over the encoder's outputs; the context
                // into the input rows of layers 1.. of this token.
                let scores = g.act(&format!("att.scores{t}"), u64::from(batch * t_src));
                g.ops.push(Op::BatchMatMul {
                    name: format!("att.scores{t}"),
                    a: next[0],
                    b: keys.t,
                    y: scores,
                    lda: w,
                    ldb: hd,
                    ldy: t_src,
                    trans_b: true,
                    m: 1,
                    k: hd,
                    n: t_src,
                    offs: (0..u64::from(batch))
                        .map(|b| {
                            [
                                b * u64::from(w) + u64::from(hd),
                                b * u64::from(t_src * hd),
                                b * u64::from(t_src),
                            ]
                        })
                        .collect(),
                    act: Act::None,
                });
                let probs = g.act(&format!("att.probs{t}"), u64::from(batch * t_src));
                g.ops.push(Op::Softmax {
                    name: format!("att.probs{t}"),
                    x: View::dense(scores, t_src),
                    y: View::dense(probs, t_src),
                    rows: batch,
                    cols: t_src,
                });
                for ll in 1..z.layers {
                    let wl = width(ll);
                    g.ops.push(Op::BatchMatMul {
                        name: format!("att.context{t}.{ll}"),
                        a: probs,
                        b: x,
                        y: bufs[ll as usize],
                        lda: t_src,
                        ldb: hd,
                        ldy: wl,
                        trans_b: false,
                        m: 1,
                        k: t_src,
                        n: hd,
                        offs: (0..u64::from(batch))
                            .map(|b| {
                                [
                                    b * u64::from(t_src),
                                    b * u64::from(t_src * hd),
                                    b * u64::from(wl) + u64::from(hd),
                                ]
                            })
                            .collect(),
                        act: Act::None,
                    });
                }
            }
            // This layer's output is the next layer's x (with the
            // residual from the third layer on), or the decoder's.
            let dst = if l + 1 < z.layers {
                View { t: bufs[l as usize + 1], ld: width(l + 1), col: 0 }
            } else {
                View::dense(top, hd)
            };
            let x_in = View { t: bufs[l as usize], ld: w, col: 0 };
            if l >= 2 {
                g.ops.push(Op::Add {
                    name: format!("{p}.residual"),
                    a: h,
                    b: x_in,
                    y: dst,
                    rows: batch,
                    cols: hd,
                    act: Act::None,
                });
            } else {
                g.ops.push(Op::Copy { name: format!("{p}.out"), x: h, y: dst, rows: batch, cols: hd });
            }
        }
        logits = Some(
            g.linear_using(&format!("classifier{t}"), View::dense(top, hd), batch, cls_w, hd, z.vocab).t,
        );
        bufs = next;
    }
    g.output = logits.unwrap_or(g.input);
    g
}

fn encoder(name: &str, batch: u32, layers: u32, seq: u32, d: u32, heads: u32, ffn: u32, act: Act) -> Graph {
    let mut g = Graph::new(name, batch);
    let mut x = g.tensor("input", u64::from(batch * seq) * u64::from(d), Init::Input);
    g.input = x;
    for l in 0..layers {
        x = g.encoder_layer(l, x, seq, d, heads, ffn, act);
    }
    g.output = x;
    g
}

fn dlrm(batch: u32) -> Graph {
    const TABLES: u32 = 32;
    const DIM: u32 = 32;
    const POOL: u32 = 120;
    const ROWS: u32 = 100_000;
    let mut g = Graph::new("dlrm", batch);
    let dense = g.tensor("dense", u64::from(batch) * 13, Init::Input);
    g.input = dense;
    let f = TABLES + 1;
    let z = g.act("features", u64::from(batch) * u64::from(f * DIM));
    let b1 = g.linear("bot0", View::dense(dense, 13), batch, 13, 128, Act::Relu, None);
    let b2 = g.linear("bot1", b1, batch, 128, 64, Act::Relu, None);
    let zview = |col| View { t: z, ld: f * DIM, col };
    g.linear("bot2", b2, batch, 64, DIM, Act::Relu, Some(zview(0)));
    for t in 0..TABLES {
        let table =
            g.tensor(format!("emb{t}.table"), u64::from(ROWS) * u64::from(DIM), Init::Weights { fan_in: 1 });
        let idx =
            g.tensor(format!("emb{t}.idx"), u64::from(batch) * u64::from(POOL), Init::Indices { max: ROWS });
        g.ops.push(Op::Embedding {
            name: format!("emb{t}"),
            table,
            idx,
            y: zview((t + 1) * DIM),
            batch,
            rows: ROWS,
            dim: DIM,
            pool: POOL,
        });
    }
    let top_in = f * f + DIM;
    let t_in = g.act("top.in", u64::from(batch) * u64::from(top_in));
    g.ops.push(Op::Copy {
        name: "concat".into(),
        x: zview(0),
        y: View { t: t_in, ld: top_in, col: 0 },
        rows: batch,
        cols: DIM,
    });
    g.ops.push(Op::Interaction {
        name: "interact".into(),
        z,
        y: View { t: t_in, ld: top_in, col: DIM },
        batch,
        f,
        d: DIM,
    });
    let t1 = g.linear("top0", View::dense(t_in, top_in), batch, top_in, 128, Act::Relu, None);
    let t2 = g.linear("top1", t1, batch, 128, 64, Act::Relu, None);
    g.output = g.linear("top2", t2, batch, 64, 1, Act::Sigmoid, None).t;
    g
}

fn ncf(batch: u32) -> Graph {
    const USERS: u32 = 6040;
    const ITEMS: u32 = 3706;
    let mut g = Graph::new("ncf", batch);
    // [gmf_user 8 | gmf_item 8 | mlp_user 32 | mlp_item 32]
    let emb = g.act("embeddings", u64::from(batch) * 80);
    let mut first = None;
    for (i, (name, rows, dim, col)) in [
        ("gmf_user", USERS, 8u32, 0u32),
        ("gmf_item", ITEMS, 8, 8),
        ("mlp_user", USERS, 32, 16),
        ("mlp_item", ITEMS, 32, 48),
    ]
    .into_iter()
    .enumerate()
    {
        let table =
            g.tensor(format!("{name}.table"), u64::from(rows) * u64::from(dim), Init::Weights { fan_in: 1 });
        let idx = g.tensor(format!("{name}.idx"), batch.into(), Init::Indices { max: rows });
        if i == 0 {
            first = Some(idx);
        }
        g.ops.push(Op::Embedding {
            name: name.into(),
            table,
            idx,
            y: View { t: emb, ld: 80, col },
            batch,
            rows,
            dim,
            pool: 1,
        });
    }
    g.input = first.unwrap_or(0);
    let head = g.act("head.in", u64::from(batch) * 16);
    g.ops.push(Op::Mul {
        name: "gmf".into(),
        a: View { t: emb, ld: 80, col: 0 },
        b: View { t: emb, ld: 80, col: 8 },
        y: View { t: head, ld: 16, col: 0 },
        rows: batch,
        cols: 8,
        act: Act::None,
    });
    let m1 = g.linear("mlp0", View { t: emb, ld: 80, col: 16 }, batch, 64, 32, Act::Relu, None);
    let m2 = g.linear("mlp1", m1, batch, 32, 16, Act::Relu, None);
    g.linear("mlp2", m2, batch, 16, 8, Act::Relu, Some(View { t: head, ld: 16, col: 8 }));
    g.output = g.linear("predict", View::dense(head, 16), batch, 16, 1, Act::Sigmoid, None).t;
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_names_give_one_product_of_their_size() {
        let g = build("gemm-64x32x16", 2).unwrap();
        assert_eq!(g.macs(), 2 * 64 * 32 * 16);
        assert_eq!(g.ops.len(), 1);
        for bad in ["gemm-", "gemm-1x2", "gemm-1x2x3x4", "gemm-0x2x3", "gemm-65537x1x1", "gemm-axbxc"] {
            assert!(build(bad, 1).is_none(), "{bad}");
        }
        // M x batch rows must fit the IR's row count.
        assert!(build("gemm-65536x1x1", 65_536).is_none());
    }

    #[test]
    fn published_mac_counts() {
        // ResNet-50 ~4.1 GMACs, MobileNet-v1 ~569 MMACs, EfficientNet-B0
        // ~390 MMACs, BERT-base at 128 tokens ~11 GMACs (per sample).
        let gm = |n: &str| build(n, 1).unwrap().macs() as f64 / 1e9;
        assert!((gm("resnet50") - 4.1).abs() < 0.15, "{}", gm("resnet50"));
        assert!((gm("mobilenet") - 0.569).abs() < 0.03, "{}", gm("mobilenet"));
        assert!((gm("efficientnet") - 0.39).abs() < 0.05, "{}", gm("efficientnet"));
        assert!((gm("bert") - 11.2).abs() < 0.6, "{}", gm("bert"));
        assert_eq!(build("resnet50", 8).unwrap().macs(), 8 * build("resnet50", 1).unwrap().macs());
        // GoogLeNet ~1.5 GMACs (Szegedy et al.: 1.5 G multiply-adds);
        // Tiny YOLOv2 at 416: Darknet counts 6.97 BFLOPs, 3.49 GMACs.
        assert!((gm("googlenet") - 1.5).abs() < 0.1, "{}", gm("googlenet"));
        assert!((gm("tiny-yolo") - 3.49).abs() < 0.15, "{}", gm("tiny-yolo"));
        // SSD-MobileNet-v1 at 300: 1.2 G multiply-adds (Howard et al.
        // 2017, Table 13).
        assert!((gm("ssd-mobilenet") - 1.2).abs() < 0.08, "{}", gm("ssd-mobilenet"));
        // YOLOv3 at 416: Darknet counts 65.86 BFLOPs, 32.9 GMACs.
        assert!((gm("yolov3") - 32.9).abs() < 1.0, "{}", gm("yolov3"));
        // SSD-ResNet34 at 1200: MLPerf Inference gives 433 GOPs per
        // image, 216.5 GMACs.
        assert!((gm("ssd-resnet34") - 216.5).abs() < 5.0, "{}", gm("ssd-resnet34"));
        // RetinaNet at 640 with one anchor per cell, by part, against the
        // architecture's own arithmetic: the two subnets on 8,525 cells
        // (80^2 + 40^2 + 20^2 + 10^2 + 5^2), each four 3x3 convolutions of
        // 256 channels, then 80 class and 4 box outputs; the FPN's
        // lateral 1x1s, its three 3x3 outputs, P6 (3x3 of C5's 2048
        // channels at 10x10) and P7 (5x5); the backbone as ResNet-50's
        // (without its classifier) at (640/224)^2 the pixels, to 1%.
        let g = build("retinanet", 1).unwrap();
        let part = |from: &str, to: Option<&str>| {
            let at = |n: &str| g.ops.iter().position(|o| o.name() == n).unwrap();
            let end = to.map_or(g.ops.len(), at);
            Graph { ops: g.ops[at(from)..end].to_vec(), ..g.clone() }.macs()
        };
        let cells: u64 = [80u64, 40, 20, 10, 5].iter().map(|s| s * s).sum();
        assert_eq!(cells, 8525);
        assert_eq!(part("p3.cls.0", None), cells * (8 * 9 * 256 * 256 + 9 * 256 * (80 + 4)));
        let fpn = (6400 * 512 + 1600 * 1024 + 400 * 2048) * 256
            + (6400 + 1600 + 400) * 9 * 256 * 256
            + 100 * 9 * 2048 * 256
            + 25 * 9 * 256 * 256;
        assert_eq!(part("fpn.lat5", Some("p3.cls.0")), fpn);
        let r50 = build("resnet50", 1).unwrap().macs() - 2048 * 1000;
        let backbone = part("conv1", Some("fpn.lat5")) as f64;
        let scaled = r50 as f64 * (640.0f64 / 224.0).powi(2);
        assert!((backbone / scaled - 1.0).abs() < 0.01, "backbone {backbone}, ResNet-50 scaled {scaled}");
        // Its six heads give MLPerf's 15,130 boxes of 81 class scores.
        let g = build("ssd-resnet34", 1).unwrap();
        let boxes: Vec<u32> = g
            .ops
            .iter()
            .filter_map(|o| match o {
                Op::Softmax { rows, cols: 81, .. } => Some(*rows),
                _ => None,
            })
            .collect();
        assert_eq!(boxes, [50 * 50 * 4, 25 * 25 * 6, 13 * 13 * 6, 7 * 7 * 6, 3 * 3 * 4, 3 * 3 * 4]);
        assert_eq!(boxes.iter().sum::<u32>(), 15_130);
        for (n, _) in WORKLOADS.iter().chain(MORE_WORKLOADS) {
            assert!(build(n, 2).is_some(), "{n}");
        }
        assert!(build("nope", 1).is_none());
    }
}
