//! The networks of the workload library, built in the layer-graph IR
//! (`npu-graph`) with published shapes (shapes only; a functional run
//! fills them with seeded random weights).

use npu_graph::{Act, Graph, Init, Op, PoolOp, Spatial, TensorId, View};

mod cnn;
mod decoder;
mod detect;
mod recsys;
mod seq;

use cnn::*;
pub use decoder::{decoder, decoder_config, parse_decoder, DecoderConfig, Phase, DECODERS, MAX_POSITIONS};
use detect::*;
pub use detect::{retinanet, ssd_resnet34, yolov3, SsdR34Size};
use recsys::*;
use seq::*;
pub use seq::{gnmt, GnmtSize};

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
        other if parse_decoder(other).is_some() => {
            let (c, phase) = parse_decoder(other)?;
            decoder(c, batch, phase)?
        }
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
