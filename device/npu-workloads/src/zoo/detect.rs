//! Detectors: Tiny YOLOv2, SSD-MobileNet, YOLOv3, SSD-ResNet34, RetinaNet with Fast NMS.

use super::*;

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
                    y: View::dense(y, cout),
                    batch,
                    s: Spatial::square(s, s, 3, 1, 1),
                    cin: CH,
                    cout,
                    act,
                    residual: None,
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

/// Tiny YOLOv2 (PASCAL VOC: 20 classes, 5 anchors) at 416x416. Leaky ReLU
/// is modelled as ReLU (the same one VU pass), and the last max pool
/// (2x2, stride 1, padded right and bottom in Darknet) as a 3x3 window with
/// stride 1 and padding 1 (the same 13x13 output; the VU's pooling takes
/// the same padding on every side).
pub(super) fn tiny_yolo(batch: u32) -> Graph {
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
pub(super) fn ssd_mobilenet(batch: u32) -> Graph {
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
pub(super) fn detection_head(
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
pub(super) fn decode_detections(
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

/// Nearest-neighbour 2x upsampling of `c`-channel `h x w` images (NHWC)
/// by four strided DMA copies: each pixel twice along the rows, then
/// each (now doubled) image row twice.
pub(super) fn upsample2x(g: &mut Graph, name: &str, x: TensorId, h: u32, w: u32, c: u32) -> TensorId {
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
pub(super) fn concat(g: &mut Graph, name: &str, parts: &[(TensorId, u32)], pixels: u32) -> TensorId {
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
