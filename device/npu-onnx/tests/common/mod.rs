//! ONNX graphs built in tests (protobuf through onnx-protobuf).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;

use npu_lower::VnpuShape;
use npu_model::BoardConfig;
use npu_onnx::CompileOptions;
use onnx_protobuf::{
    attribute_proto::AttributeType, tensor_proto::DataType, AttributeProto, GraphProto, ModelProto,
    NodeProto, OperatorSetIdProto, TensorProto, TypeProto, ValueInfoProto,
};
use protobuf::Enum;
use vnpu_abi::DType;

pub fn tensor(name: &str, dims: &[i64], v: &[f32]) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.dims = dims.to_vec();
    t.data_type = DataType::FLOAT.value();
    t.float_data = v.to_vec();
    t
}

/// A scalar bool initializer.
pub fn bool_tensor(name: &str, v: bool) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.data_type = DataType::BOOL.value();
    t.int32_data = vec![i32::from(v)];
    t
}

/// A float tensor's value info; a dimension of 0 is a free one (`N`).
pub fn value(name: &str, dims: &[i64]) -> ValueInfoProto {
    let mut tt = onnx_protobuf::type_proto::Tensor::new();
    tt.elem_type = DataType::FLOAT.value();
    let mut shape = onnx_protobuf::TensorShapeProto::new();
    for &d in dims {
        let mut dim = onnx_protobuf::tensor_shape_proto::Dimension::new();
        if d > 0 {
            dim.set_dim_value(d);
        } else {
            dim.set_dim_param("N".into());
        }
        shape.dim.push(dim);
    }
    tt.shape = Some(shape).into();
    let mut ty = TypeProto::new();
    ty.set_tensor_type(tt);
    let mut v = ValueInfoProto::new();
    v.name = name.into();
    v.type_ = Some(ty).into();
    v
}

pub fn attr_i(name: &str, i: i64) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INT.into();
    a.i = i;
    a
}

pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::INTS.into();
    a.ints = v.to_vec();
    a
}

pub fn attr_f(name: &str, f: f32) -> AttributeProto {
    let mut a = AttributeProto::new();
    a.name = name.into();
    a.type_ = AttributeType::FLOAT.into();
    a.f = f;
    a
}

pub fn node(
    op: &str,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    attrs: Vec<AttributeProto>,
) -> NodeProto {
    let mut n = NodeProto::new();
    n.op_type = op.into();
    n.name = name.into();
    n.input = inputs.iter().map(|s| s.to_string()).collect();
    n.output = outputs.iter().map(|s| s.to_string()).collect();
    n.attribute = attrs;
    n
}

/// A model of graph `g` at IR 8 and `opset`.
pub fn model_at(g: GraphProto, opset: i64) -> ModelProto {
    let mut m = ModelProto::new();
    m.ir_version = 8;
    let mut op = OperatorSetIdProto::new();
    op.version = opset;
    m.opset_import = vec![op];
    m.graph = Some(g).into();
    m
}

/// A model of graph `g` at IR 8, opset 17.
pub fn model(g: GraphProto) -> ModelProto {
    model_at(g, 17)
}

/// The board and options for a model at `batch` on 1 SA + 1 VU.
pub fn options(batch: u32, dtype: DType) -> (BoardConfig, CompileOptions) {
    let board = BoardConfig::default();
    let shape = VnpuShape::on_board(&board, 1, 1, board.sram_bytes(), 64 << 20);
    (
        board,
        CompileOptions {
            shape,
            batch,
            shapes: HashMap::new(),
            outputs: None,
            dtype,
            bf16_activations: false,
            spread: None,
            reuse_hbm: true,
            fuse_residual: true,
            fuse_blocks: true,
        },
    )
}

/// An int64 initializer.
pub fn int_tensor(name: &str, dims: &[i64], v: &[i64]) -> TensorProto {
    let mut t = TensorProto::new();
    t.name = name.into();
    t.dims = dims.to_vec();
    t.data_type = DataType::INT64.value();
    t.int64_data = v.to_vec();
    t
}

/// How an output agrees with a reference (ONNX Runtime's).
#[derive(Clone, Copy, Debug)]
pub struct Agreement {
    /// Largest absolute difference (NaN when either side has a NaN the
    /// other has not there).
    pub abs: f64,
    /// The reference's largest magnitude.
    pub scale: f64,
    /// Rows of the last axis whose argmax is the same, of `rows`.
    pub agree: usize,
    pub rows: usize,
}

/// `got` against `want`, both row-major with rows of `row` elements.
pub fn agreement(got: &[f32], want: &[f32], row: usize) -> Agreement {
    assert_eq!(got.len(), want.len(), "output sizes");
    let mut abs = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        abs = if d.is_nan() || abs.is_nan() { f64::NAN } else { abs.max(d) };
    }
    let scale = want.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
    let argmax =
        |v: &[f32]| v.iter().enumerate().fold(0, |b, (i, &x)| if x > v[b] || x.is_nan() { i } else { b });
    let rows = want.len() / row.max(1);
    let agree = (0..rows)
        .filter(|&i| argmax(&got[i * row..(i + 1) * row]) == argmax(&want[i * row..(i + 1) * row]))
        .count();
    Agreement { abs, scale, agree, rows }
}
