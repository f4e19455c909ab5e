//! A `Gemm` with `transB`, `alpha`, `beta` and a bias row, then `Relu`,
//! built here as an ONNX graph (protobuf through onnx-protobuf), compiled
//! and run on the NPU model, against the formula computed in f64.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{attr_f, attr_i, model, node, options, tensor, value};
use npu_lower::VnpuShape;
use npu_model::BoardConfig;
use npu_onnx::host::HostRunner;
use npu_onnx::{compile, CompileOptions};
use onnx_protobuf::{
    attribute_proto::AttributeType, tensor_proto::DataType, AttributeProto, GraphProto, Message, TensorProto,
};
use protobuf::Enum;
use vnpu_abi::DType;

#[test]
fn gemm_with_trans_b_alpha_beta_and_bias_then_relu_matches_the_formula() {
    let (k, n, batch) = (4usize, 3usize, 5usize);
    let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.37).sin()).collect(); // n x k (transB)
    let c: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 0.3).collect();
    let (alpha, beta) = (0.5f32, 2.0f32);
    let mut g = GraphProto::new();
    g.name = "gemm".into();
    g.initializer = vec![tensor("W", &[n as i64, k as i64], &w), tensor("C", &[1, n as i64], &c)];
    g.input = vec![value("X", &[0, k as i64])];
    g.output = vec![value("Y", &[0, n as i64])];
    g.node = vec![
        node(
            "Gemm",
            "fc",
            &["X", "W", "C"],
            &["H"],
            vec![attr_i("transB", 1), attr_f("alpha", alpha), attr_f("beta", beta)],
        ),
        node("Relu", "act", &["H"], &["Y"], vec![]),
    ];
    let m = model(g);
    let bytes = m.write_to_bytes().unwrap();

    let (board, opts) = options(batch as u32, DType::F32);
    let compiled = compile(&bytes, &opts).unwrap();
    assert_eq!(compiled.report.fused, 1, "the Relu is fused into the product");
    let x: Vec<f32> = (0..batch * k).map(|i| (i as f32 * 0.61).cos() * 2.0).collect();
    let mut r = HostRunner::new(&board, &compiled.model).unwrap();
    let (out, _) = r.infer(&[&x]).unwrap();
    for b in 0..batch {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| f64::from(x[b * k + p]) * f64::from(w[j * k + p])).sum();
            let want = (f64::from(alpha) * dot + f64::from(beta) * f64::from(c[j])).max(0.0);
            let got = f64::from(out[0][b * n + j]);
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "Y[{b}][{j}] = {got}, want {want}");
        }
    }
    // A C with one row per sample is refused by name, not mis-compiled.
    let mut m2 = m.clone();
    let g2 = m2.graph.as_mut().unwrap();
    g2.initializer[1] = tensor("C", &[batch as i64, n as i64], &vec![0.0; batch * n]);
    let e = compile(&m2.write_to_bytes().unwrap(), &opts).unwrap_err().to_string();
    assert!(e.contains("node `fc` (Gemm)"), "{e}");
}

/// With bf16 SA operands each output of a product is within the
/// per-product bound of docs/compiled-model-format.md ("bf16") of the exact result:
/// `|y' - y| <= (2u + u^2 + (k + 2) 2^-24) (sum_p |x_p w_p| + |c|)`, with
/// `u = 2^-8` the unit roundoff of bf16 (both operands rounded once, products
/// exact in f32, f32 accumulation and bias). And the rounding is real: the
/// largest error is well above what f32 operands would give.
#[test]
fn bf16_gemm_stays_within_the_per_product_bound() {
    let (k, n, batch) = (300usize, 40usize, 20usize);
    // Magnitudes over several binades, both signs.
    let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.37).sin() * (1.0 + (i % 7) as f32)).collect();
    let c: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 3.0).collect();
    let mut g = GraphProto::new();
    g.name = "gemm-bf16".into();
    g.initializer = vec![tensor("W", &[n as i64, k as i64], &w), tensor("C", &[n as i64], &c)];
    g.input = vec![value("X", &[0, k as i64])];
    g.output = vec![value("Y", &[0, n as i64])];
    g.node = vec![node("Gemm", "fc", &["X", "W", "C"], &["Y"], vec![attr_i("transB", 1)])];
    let bytes = model(g).write_to_bytes().unwrap();
    let (board, opts) = options(batch as u32, DType::Bf16);
    let compiled = compile(&bytes, &opts).unwrap();
    let x: Vec<f32> = (0..batch * k).map(|i| (i as f32 * 0.61).cos() * (0.5 + (i % 5) as f32)).collect();
    let mut r = HostRunner::new(&board, &compiled.model).unwrap();
    let (out, _) = r.infer(&[&x]).unwrap();
    let u = 2f64.powi(-8);
    let per_product = 2.0 * u + u * u + (k as f64 + 2.0) * 2f64.powi(-24);
    let (mut worst, mut above_f32) = (0f64, 0usize);
    for b in 0..batch {
        for j in 0..n {
            let terms = (0..k).map(|p| f64::from(x[b * k + p]) * f64::from(w[j * k + p]));
            let want = terms.clone().sum::<f64>() + f64::from(c[j]);
            let mag = terms.map(f64::abs).sum::<f64>() + f64::from(c[j]).abs();
            let err = (f64::from(out[0][b * n + j]) - want).abs();
            let ratio = err / (per_product * mag);
            assert!(ratio <= 1.0, "Y[{b}][{j}]: error {err} above the bound {}", per_product * mag);
            worst = worst.max(ratio);
            if err > (k as f64 + 2.0) * 2f64.powi(-24) * mag {
                above_f32 += 1;
            }
        }
    }
    println!(
        "bf16 Gemm: worst error {worst:.3} of the bound; {above_f32}/{} outputs beyond f32's bound",
        batch * n
    );
    assert!(above_f32 * 2 > batch * n, "only {above_f32} outputs show bf16 rounding");
}

/// Tensors past the compiler's limit (2^28 elements) are refused before
/// anything of their size is allocated: two constants that broadcast to
/// a huge one, and a huge input shape.
#[test]
fn oversized_tensors_are_refused_not_allocated() {
    let mut g = GraphProto::new();
    g.name = "huge".into();
    g.initializer = vec![
        tensor("A", &[1 << 14, 1], &vec![1.0; 1 << 14]),
        tensor("B", &[1, 1 << 15], &vec![1.0; 1 << 15]),
    ];
    g.input = vec![value("X", &[0, 1 << 15])];
    g.output = vec![value("Y", &[1 << 14, 1 << 15])];
    g.node = vec![
        node("Add", "bcast", &["A", "B"], &["K"], vec![]),
        node("Add", "use", &["X", "K"], &["Y"], vec![]),
    ];
    let bytes = model(g).write_to_bytes().unwrap();
    let board = BoardConfig::default();
    let shape = VnpuShape::on_board(&board, 1, 1, board.sram_bytes(), 64 << 20);
    // [2^14, 1] + [1, 2^15] broadcasts to 2^29 elements.
    let opts = CompileOptions {
        shape,
        batch: 1,
        shapes: HashMap::new(),
        outputs: None,
        dtype: DType::F32,
        bf16_activations: false,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let e = compile(&bytes, &opts).unwrap_err().to_string();
    assert!(e.contains("node `bcast` (Add)") && e.contains("2^28"), "{e}");
    // An input of 2^40 elements.
    let shapes = HashMap::from([("X".to_string(), vec![1usize << 25, 1 << 15])]);
    let opts = CompileOptions {
        shape,
        batch: 1,
        shapes,
        outputs: None,
        dtype: DType::F32,
        bf16_activations: false,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let e = compile(&bytes, &opts).unwrap_err().to_string();
    assert!(e.contains("input `X`") && e.contains("2^28"), "{e}");
}

/// A batched product of two computed tensors whose leading axes broadcast
/// to more than the limit ([2^14, 1] against [1, 2^15] matrices) is
/// refused before its per-matrix offsets are built.
#[test]
fn a_broadcast_batched_product_past_the_limit_is_refused() {
    let mut g = GraphProto::new();
    g.name = "huge-product".into();
    g.input = vec![value("X", &[0, 1 << 14, 1, 2, 2]), value("Z", &[0, 1, 1 << 15, 2, 2])];
    g.output = vec![value("Y", &[0, 1 << 14, 1 << 15, 2, 2])];
    g.node = vec![node("MatMul", "mm", &["X", "Z"], &["Y"], vec![])];
    let (_, opts) = options(1, DType::F32);
    let e = compile(&model(g).write_to_bytes().unwrap(), &opts).unwrap_err().to_string();
    assert!(e.contains("node `mm` (MatMul)") && e.contains("2^28"), "{e}");
}

/// `Pad` in reflect mode past the axis's length, and an unknown mode, are
/// refused by node name with the reason (never mis-compiled).
#[test]
fn impossible_pads_are_refused_by_name() {
    let compile_pad = |mode: &str, pads: &[i64]| {
        let mut p = TensorProto::new();
        p.name = "P".into();
        p.dims = vec![pads.len() as i64];
        p.data_type = DataType::INT64.value();
        p.int64_data = pads.to_vec();
        let mut a = AttributeProto::new();
        a.name = "mode".into();
        a.type_ = AttributeType::STRING.into();
        a.s = mode.as_bytes().to_vec();
        let mut g = GraphProto::new();
        g.name = "pad".into();
        g.initializer = vec![p];
        g.input = vec![value("X", &[0, 3])];
        g.output = vec![value("Y", &[0, 9])];
        g.node = vec![
            node("Relu", "act", &["X"], &["H"], vec![]),
            node("Pad", "pad", &["H", "P"], &["Y"], vec![a]),
        ];
        let (_, opts) = options(2, DType::F32);
        compile(&model(g).write_to_bytes().unwrap(), &opts).map(|_| ()).map_err(|e| e.to_string())
    };
    // Reflect may pad at most length - 1 = 2.
    let e = compile_pad("reflect", &[0, 3, 0, 0]).unwrap_err();
    assert!(e.contains("node `pad` (Pad)") && e.contains("reflect pad 3 on axis 1 of length 3"), "{e}");
    assert_eq!(compile_pad("reflect", &[0, 2, 0, 2]), Ok(()));
    assert_eq!(compile_pad("wrap", &[0, 3, 0, 3]), Ok(()));
    let e = compile_pad("mirror", &[0, 1, 0, 1]).unwrap_err();
    assert!(e.contains("node `pad` (Pad)") && e.contains("mode `mirror` is not supported"), "{e}");
}

/// Weight tensors of 1 MiB or more sit in the weight image where their
/// byte's place in the model file has the page phase of its place in HBM,
/// so that the load program's copies of whole HBM chunks can map the
/// file's pages (`npu_model::memory::Memory::map_file`); the smaller ones
/// stay packed, and the model computes the same.
#[test]
fn large_weights_have_the_page_phase_of_their_place_in_hbm() {
    let (k, n, batch) = (1024usize, 600usize, 2usize);
    let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.013).sin()).collect();
    let w2: Vec<f32> = (0..n * 4).map(|i| (i as f32 * 0.7).cos()).collect();
    let mut g = GraphProto::new();
    g.name = "big".into();
    g.initializer = vec![tensor("W", &[k as i64, n as i64], &w), tensor("W2", &[n as i64, 4], &w2)];
    g.input = vec![value("X", &[0, k as i64])];
    g.output = vec![value("Y", &[0, 4])];
    g.node = vec![
        node("MatMul", "fc", &["X", "W"], &["H"], vec![]),
        node("MatMul", "fc2", &["H", "W2"], &["Y"], vec![]),
    ];
    let bytes = model(g).write_to_bytes().unwrap();
    let (board, opts) = options(batch as u32, DType::F32);
    let compiled = compile(&bytes, &opts).unwrap();
    let m = &compiled.model;
    let base = m.weights_offset() as u64;
    let mut big = 0;
    for i in m.load.streams.iter().flat_map(|s| &s.code) {
        if let vnpu_abi::Instr::DmaCopy { src, dst, row_bytes, .. } = *i {
            if u64::from(row_bytes) >= 1 << 20 {
                big += 1;
                assert_eq!(
                    (base + src.offset) % 4096,
                    dst.offset % 4096,
                    "file offset and HBM address phases"
                );
            }
        }
    }
    assert_eq!(big, 1, "W is the one tensor of 1 MiB or more");
    let x: Vec<f32> = (0..batch * k).map(|i| (i as f32 * 0.31).cos()).collect();
    let mut r = HostRunner::new(&board, m).unwrap();
    let (out, _) = r.infer(&[&x]).unwrap();
    // From the model file: W's whole HBM chunks are the file's pages,
    // and the outputs are the same bits.
    let path = std::env::temp_dir().join(format!("npu-onnx-phase-{}.vnpu", std::process::id()));
    let file_bytes = m.encode();
    std::fs::write(&path, &file_bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let image = &file_bytes[base as usize..];
    let mut rf = HostRunner::with_weights_file(&board, m, image, &file, base).unwrap();
    assert!(rf.mapped_weight_bytes() >= 1 << 20, "W's chunks are mapped");
    let (out_f, _) = rf.infer(&[&x]).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out_f[0]), bits(&out[0]), "mapped or copied, the same outputs");
    for b in 0..batch {
        let h: Vec<f64> =
            (0..n).map(|j| (0..k).map(|p| f64::from(x[b * k + p]) * f64::from(w[p * n + j])).sum()).collect();
        for c in 0..4 {
            let want: f64 = (0..n).map(|j| h[j] * f64::from(w2[j * 4 + c])).sum();
            let got = f64::from(out[0][b * 4 + c]);
            assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "Y[{b}][{c}] = {got}, want {want}");
        }
    }
}
