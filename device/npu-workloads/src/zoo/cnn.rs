//! Image classifiers: ResNet-50, MobileNet-v1, EfficientNet-B0, GoogLeNet.

use super::*;

pub(super) fn resnet50(batch: u32) -> Graph {
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
pub(super) fn resnet50_stages(g: &mut Graph, x: TensorId, side: u32) -> Vec<(TensorId, u32, u32)> {
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

/// MobileNet-v1's depthwise-separable blocks after the stem: output
/// channels and stride of each (the depthwise 3x3 carries the stride, a
/// pointwise 1x1 follows).
pub(super) const MOBILENET_V1: [(u32, u16); 13] = [
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

pub(super) fn mobilenet(batch: u32) -> Graph {
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

pub(super) fn efficientnet(batch: u32) -> Graph {
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
pub(super) fn max_pool(g: &mut Graph, name: &str, x: TensorId, c: u32, s: Spatial) -> (TensorId, u32, u32) {
    let (ho, wo) = s.out();
    let y = g.act(name, u64::from(g.batch) * u64::from(ho * wo) * u64::from(c));
    g.ops.push(Op::Pool { name: name.into(), x, y, batch: g.batch, s, c, op: PoolOp::Max });
    (y, ho, wo)
}

/// GoogLeNet (Inception v1) at 224x224. The four branches of a module are
/// concatenated along the channels by DMA copies into the module's output
/// (a compiler that writes each branch in place would save them).
pub(super) fn googlenet(batch: u32) -> Graph {
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
