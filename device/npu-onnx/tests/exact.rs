//! Constructs the compiler used to get wrong with exit 0: they now compute
//! what ONNX says, or are refused by name. Each model is built here as an
//! ONNX graph and checked against values worked out by hand from the
//! operator's definition.
#![allow(clippy::unwrap_used)]

mod common;

use common::{model_at, node, options, tensor, value};
use npu_onnx::compile;
use npu_onnx::host::HostRunner;
use onnx_protobuf::{GraphProto, Message};
use vnpu_abi::DType;

/// `op` (Upsample at opset 9, or Resize at opset 10) of a 1 x 1 x 2 x 2
/// image by scales (1, 1, 2, 3), run on `[[1, 2], [3, 4]]`.
fn upsampled(op: &str, opset: i64) -> Vec<f32> {
    let mut g = GraphProto::new();
    g.name = "up".into();
    g.initializer = vec![tensor("S", &[4], &[1.0, 1.0, 2.0, 3.0])];
    g.input = vec![value("X", &[0, 1, 2, 2])];
    g.output = vec![value("Y", &[0, 1, 4, 6])];
    g.node = vec![node(op, "up", &["X", "S"], &["Y"], vec![])];
    let bytes = model_at(g, opset).write_to_bytes().unwrap();
    let (board, opts) = options(1, DType::F32);
    let compiled = compile(&bytes, &opts).unwrap();
    let mut r = HostRunner::new(&board, &compiled.model).unwrap();
    r.infer(&[&[1.0, 2.0, 3.0, 4.0]]).unwrap().0.remove(0)
}

/// Upsample (opsets 7-9) and Resize-10 in `nearest` mode take input index
/// floor(out / scale): by 3 along a row of [1, 2] that is 1 1 1 2 2 2
/// (the compiler used to round half down and give 1 1 2 2 2 2).
#[test]
fn upsample_and_resize_10_nearest_floor_the_source_index() {
    let want: Vec<f32> = [
        [1., 1., 1., 2., 2., 2.],
        [1., 1., 1., 2., 2., 2.],
        [3., 3., 3., 4., 4., 4.],
        [3., 3., 3., 4., 4., 4.],
    ]
    .concat();
    assert_eq!(upsampled("Upsample", 9), want, "Upsample-9");
    assert_eq!(upsampled("Resize", 10), want, "Resize-10");
}

/// A graph `X -> op -> Y` with `extra` initializers and inputs.
fn one_node(
    opset: i64,
    n: onnx_protobuf::NodeProto,
    init: Vec<onnx_protobuf::TensorProto>,
    y: &[i64],
) -> Vec<u8> {
    let mut g = GraphProto::new();
    g.name = "one".into();
    g.initializer = init;
    g.input = vec![value("X", &[0, 3])];
    g.output = vec![value("Y", y)];
    g.node = vec![n];
    model_at(g, opset).write_to_bytes().unwrap()
}

/// Dropout in inference is the identity; with `training_mode` a constant
/// true it would drop elements at random, and is refused by name (the
/// compiler used to compile it as the identity).
#[test]
fn dropout_in_training_mode_is_refused_and_in_inference_is_the_identity() {
    let (board, opts) = options(2, DType::F32);
    let with = |mode: f32| {
        let n = common::node("Dropout", "drop", &["X", "R", "T"], &["Y"], vec![]);
        one_node(13, n, vec![tensor("R", &[], &[0.5]), common::bool_tensor("T", mode != 0.0)], &[0, 3])
    };
    let e = compile(&with(1.0), &opts).unwrap_err().to_string();
    assert!(e.contains("node `drop` (Dropout)") && e.contains("training_mode"), "{e}");
    let c = compile(&with(0.0), &opts).unwrap();
    let x = [1.0f32, -2.0, 3.0, 4.0, 5.0, -6.0];
    let mut r = HostRunner::new(&board, &c.model).unwrap();
    assert_eq!(r.infer(&[&x]).unwrap().0[0], x.to_vec());
}

/// A scalar (rank-0) output, as `ReduceMean` with `keepdims = 0` over
/// every axis gives, is refused at compile time (it used to compile into a
/// file that `vnpu infer` then rejected).
#[test]
fn a_rank_0_output_is_refused_at_compile_time() {
    let (_, opts) = options(1, DType::F32);
    let n = common::node("ReduceMean", "mean", &["X"], &["Y"], vec![common::attr_i("keepdims", 0)]);
    let e = compile(&one_node(13, n, vec![], &[]), &opts).unwrap_err().to_string();
    assert!(e.contains("rank 0"), "{e}");
}

/// `op` over X (computed, 1 x 3), a constant C (3) and X again: the
/// variadic operators fold every input, constant or not, left to right.
fn variadic(op: &str, x: &[f32]) -> Vec<f32> {
    let n = node(op, "v", &["X", "C", "X2"], &["Y"], vec![]);
    let neg = node("Neg", "neg", &["X"], &["X2"], vec![]);
    let mut g = GraphProto::new();
    g.name = "variadic".into();
    g.initializer = vec![tensor("C", &[3], &[0.5, -1.0, 2.0])];
    g.input = vec![value("X", &[0, 3])];
    g.output = vec![value("Y", &[0, 3])];
    g.node = vec![neg, n];
    let bytes = model_at(g, 13).write_to_bytes().unwrap();
    let (board, opts) = options(1, DType::F32);
    let compiled = compile(&bytes, &opts).unwrap();
    let mut r = HostRunner::new(&board, &compiled.model).unwrap();
    r.infer(&[x]).unwrap().0.remove(0)
}

/// Max, Min, Sum and Mean of three inputs (X, a constant, -X), worked
/// out by hand; a NaN in X makes the Max and Min NaN (numpy's maximum).
#[test]
fn variadic_max_min_sum_mean_take_every_input() {
    let x = [1.0, 3.0, f32::NAN];
    let bits =
        |v: Vec<f32>| v.iter().map(|f| if f.is_nan() { u32::MAX } else { f.to_bits() }).collect::<Vec<_>>();
    let nan = f32::NAN;
    assert_eq!(bits(variadic("Max", &x)), bits(vec![1.0, 3.0, nan]));
    assert_eq!(bits(variadic("Min", &x)), bits(vec![-1.0, -3.0, nan]));
    assert_eq!(bits(variadic("Sum", &x)), bits(vec![0.5, -1.0, nan]));
    let mean = variadic("Mean", &[3.0, 6.0, 0.0]);
    let want = [0.5 / 3.0, -1.0 / 3.0, 2.0 / 3.0];
    assert!(mean.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-6), "{mean:?}");
}

/// `X + ConstantOfShape(S)` where `S` is a constant shape: the constant
/// is folded (a model cannot make the compiler allocate without bound:
/// a shape of more than 2^26 elements or a negative dimension is refused
/// by name), and `Range` with a zero step is refused.
#[test]
fn constants_of_shape_and_ranges_are_folded_within_bounds() {
    let run = |shape: &[i64]| {
        let mut v = common::attr_f("value", 0.0);
        v.type_ = onnx_protobuf::attribute_proto::AttributeType::TENSOR.into();
        v.t = protobuf::MessageField::some(tensor("v", &[1], &[2.5]));
        let mut g = GraphProto::new();
        g.name = "cos".into();
        g.initializer = vec![common::int_tensor("S", &[shape.len() as i64], shape)];
        g.input = vec![value("X", &[0, 3])];
        g.output = vec![value("Y", &[0, 3])];
        g.node = vec![
            node("ConstantOfShape", "c", &["S"], &["C"], vec![v]),
            node("Add", "add", &["X", "C"], &["Y"], vec![]),
        ];
        let bytes = model_at(g, 13).write_to_bytes().unwrap();
        let (board, opts) = options(1, DType::F32);
        compile(&bytes, &opts).map(|c| {
            let mut r = HostRunner::new(&board, &c.model).unwrap();
            r.infer(&[&[1.0, 2.0, 3.0]]).unwrap().0.remove(0)
        })
    };
    assert_eq!(run(&[1, 3]).unwrap(), vec![3.5, 4.5, 5.5]);
    let big = run(&[1 << 20, 1 << 20]).map(|_| ()).unwrap_err().to_string();
    assert!(big.contains("more than"), "{big}");
    let neg = run(&[-1, 3]).map(|_| ()).unwrap_err().to_string();
    assert!(neg.contains("negative"), "{neg}");

    let range = |delta: i64| {
        let mut g = GraphProto::new();
        g.name = "range".into();
        g.initializer = vec![
            common::int_tensor("A", &[], &[0]),
            common::int_tensor("B", &[], &[3]),
            common::int_tensor("D", &[], &[delta]),
        ];
        g.input = vec![value("X", &[0, 3])];
        g.output = vec![value("Y", &[0, 3])];
        g.node = vec![
            node("Range", "r", &["A", "B", "D"], &["R"], vec![]),
            node("Cast", "c", &["R"], &["F"], vec![common::attr_i("to", 1)]),
            node("Add", "add", &["X", "F"], &["Y"], vec![]),
        ];
        let bytes = model_at(g, 13).write_to_bytes().unwrap();
        let (board, opts) = options(1, DType::F32);
        compile(&bytes, &opts).map(|c| {
            let mut r = HostRunner::new(&board, &c.model).unwrap();
            r.infer(&[&[1.0, 2.0, 3.0]]).unwrap().0.remove(0)
        })
    };
    assert_eq!(range(1).unwrap(), vec![1.0, 3.0, 5.0]);
    let zero = range(0).map(|_| ()).unwrap_err().to_string();
    assert!(zero.contains("delta is 0"), "{zero}");
}

/// Found by the `onnx_compile` fuzz target (fuzz-smoke, 2026-11-27): a
/// `Pad` in a non-constant mode whose pads add up past 2^64 overflowed
/// (a panic) while the compiler counted the padded slabs. Now a model is
/// refused with a reason, whatever its pads.
#[test]
fn pads_that_add_past_2_64_are_refused_not_a_panic() {
    let bytes = include_bytes!("fixtures/fuzz-pad-overflow.onnx");
    // The fuzz target's cases: f32, bf16, bf16 activations, spread.
    let cases = [
        (DType::F32, false, None),
        (DType::Bf16, false, None),
        (DType::Bf16, true, None),
        (DType::F32, false, Some((1, 1))),
    ];
    for (dtype, bf16_activations, spread) in cases {
        let (_, mut opts) = options(2, dtype);
        (opts.shape.sa, opts.shape.vu, opts.bf16_activations, opts.spread) = (2, 2, bf16_activations, spread);
        assert!(compile(bytes, &opts).is_err());
    }
}
