//! Reading an ONNX model (protobuf, through `onnx-protobuf`) into plain
//! Rust values: nodes with their attributes, constant tensors, and the
//! graph's inputs and outputs with their declared shapes.

use std::collections::HashMap;

use onnx_protobuf::{tensor_proto::DataType, Message, ModelProto, TensorProto};
use protobuf::Enum;
use thiserror::Error;

use crate::refusal::{invalid, unsupported, Refusal};

/// Why a file is not an ONNX model this compiler can read.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("not an ONNX model: {0}")]
    Protobuf(#[source] protobuf::Error),
    #[error("the model has no graph")]
    NoGraph,
    #[error("initializer `{name}`: {reason}")]
    Initializer {
        name: String,
        #[source]
        reason: Refusal,
    },
    #[error("graph input `{name}`: {reason}")]
    Input {
        name: String,
        #[source]
        reason: Refusal,
    },
    #[error("the model imports operator set `{domain}` version {version}; only the default domain (ai.onnx, opset {MIN_OPSET} to {MAX_OPSET}) is compiled")]
    Opset { domain: String, version: i64 },
}

/// Element data of a constant tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

impl Data {
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 (integers converted).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Data::F32(v) => v.clone(),
            Data::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// The values as i64 (floats truncated toward zero).
    pub fn to_i64(&self) -> Vec<i64> {
        match self {
            Data::F32(v) => v.iter().map(|&x| x as i64).collect(),
            Data::I64(v) => v.clone(),
        }
    }
}

/// A constant tensor: shape (row-major) and data.
#[derive(Clone, Debug, PartialEq)]
pub struct Const {
    pub shape: Vec<usize>,
    pub data: Data,
}

/// An attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f32),
    Ints(Vec<i64>),
    Floats(Vec<f32>),
    Str(String),
    Tensor(Const),
    /// A type the compiler does not read (graphs, sparse tensors, ...).
    Other,
}

/// One node.
#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op: String,
    pub domain: String,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub attrs: HashMap<String, Attr>,
}

/// A dimension as declared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Fixed(usize),
    /// Unknown until compile time (`dim_param` or unset).
    Free(String),
}

/// A graph input or output.
#[derive(Clone, Debug)]
pub struct Io {
    pub name: String,
    /// `None` when the model does not declare a shape.
    pub dims: Option<Vec<Dim>>,
    /// ONNX element type code (1 = float).
    pub elem: i32,
}

/// The model, read.
#[derive(Clone, Debug)]
pub struct OnnxModel {
    /// Default-domain operator set version.
    pub opset: i64,
    pub producer: String,
    pub nodes: Vec<Node>,
    pub constants: HashMap<String, Const>,
    pub inputs: Vec<Io>,
    pub outputs: Vec<Io>,
}

fn dims(t: &TensorProto) -> Result<Vec<usize>, Refusal> {
    t.dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| invalid(format!("negative dimension {d}"))))
        .collect()
}

/// Reads a `TensorProto` (inline data only; external data is refused).
pub fn tensor(t: &TensorProto) -> Result<Const, Refusal> {
    if !t.external_data.is_empty() {
        return Err(unsupported(
            "external data files are not supported (save the model with its weights inside)",
        ));
    }
    let shape = dims(t)?;
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid("element count overflows"))?;
    let raw = &t.raw_data;
    let want = |have: usize| {
        if have == n {
            Ok(())
        } else {
            Err(invalid(format!("{have} elements for shape {shape:?} ({n} expected)")))
        }
    };
    let dt = DataType::from_i32(t.data_type)
        .ok_or_else(|| invalid(format!("unknown data type {}", t.data_type)))?;
    let data = match dt {
        DataType::FLOAT => {
            let v: Vec<f32> = if raw.is_empty() {
                t.float_data.clone()
            } else {
                raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            };
            want(v.len())?;
            Data::F32(v)
        }
        DataType::DOUBLE => {
            let v: Vec<f32> = if raw.is_empty() {
                t.double_data.iter().map(|&x| x as f32).collect()
            } else {
                raw.chunks_exact(8)
                    .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
                    .collect()
            };
            want(v.len())?;
            Data::F32(v)
        }
        DataType::INT64 => {
            let v: Vec<i64> = if raw.is_empty() {
                t.int64_data.clone()
            } else {
                raw.chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect()
            };
            want(v.len())?;
            Data::I64(v)
        }
        DataType::INT32 | DataType::INT8 | DataType::UINT8 | DataType::INT16 | DataType::BOOL => {
            let v: Vec<i64> = if raw.is_empty() {
                t.int32_data.iter().map(|&x| i64::from(x)).collect()
            } else {
                match dt {
                    DataType::INT32 => raw
                        .chunks_exact(4)
                        .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                        .collect(),
                    DataType::INT16 => {
                        raw.chunks_exact(2).map(|c| i64::from(i16::from_le_bytes([c[0], c[1]]))).collect()
                    }
                    DataType::INT8 => raw.iter().map(|&b| i64::from(b as i8)).collect(),
                    _ => raw.iter().map(|&b| i64::from(b)).collect(),
                }
            };
            want(v.len())?;
            Data::I64(v)
        }
        other => return Err(unsupported(format!("data type {other:?} is not supported"))),
    };
    Ok(Const { shape, data })
}

fn attr(a: &onnx_protobuf::AttributeProto) -> Result<Attr, Refusal> {
    use onnx_protobuf::attribute_proto::AttributeType as T;
    Ok(match a.type_.enum_value() {
        Ok(T::INT) => Attr::Int(a.i),
        Ok(T::FLOAT) => Attr::Float(a.f),
        Ok(T::INTS) => Attr::Ints(a.ints.clone()),
        Ok(T::FLOATS) => Attr::Floats(a.floats.clone()),
        Ok(T::STRING) => Attr::Str(String::from_utf8_lossy(&a.s).into_owned()),
        Ok(T::TENSOR) => Attr::Tensor(tensor(&a.t)?),
        _ => Attr::Other,
    })
}

fn io(v: &onnx_protobuf::ValueInfoProto) -> Io {
    let mut dims = None;
    let mut elem = 0;
    if let Some(onnx_protobuf::type_proto::Value::TensorType(t)) = &v.type_.value {
        elem = t.elem_type;
        if let Some(s) = t.shape.as_ref() {
            dims = Some(
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimValue(x)) if *x > 0 => {
                            Dim::Fixed(*x as usize)
                        }
                        Some(onnx_protobuf::tensor_shape_proto::dimension::Value::DimParam(p)) => {
                            Dim::Free(p.clone())
                        }
                        _ => Dim::Free(String::new()),
                    })
                    .collect(),
            );
        }
    }
    Io { name: v.name.clone(), dims, elem }
}

/// Oldest `ai.onnx` operator set compiled.
pub const MIN_OPSET: i64 = 7;
/// Newest `ai.onnx` operator set compiled: what onnx 1.23 emits. Of the
/// operators the compiler implements, only Cast, Constant, Flatten,
/// Identity, Pad, Reshape, Shape, Squeeze, Transpose and Unsqueeze have a
/// version newer than 23 (24, 25; Cast also 28), and each of those only
/// adds element types (float8e8m0, float6, int2, uint2), which the
/// compiler refuses anyway; Cast's `round_mode` (24) applies only to
/// float8e8m0 results (read from onnx's own schemas,
/// `onnx.defs.get_schema`; docs/model-format.md).
pub const MAX_OPSET: i64 = 28;

/// Reads an ONNX model from its bytes.
pub fn load(bytes: &[u8]) -> Result<OnnxModel, LoadError> {
    let m = ModelProto::parse_from_bytes(bytes).map_err(LoadError::Protobuf)?;
    let g = m.graph.as_ref().ok_or(LoadError::NoGraph)?;
    let mut opset = 0;
    for o in &m.opset_import {
        if o.domain.is_empty() || o.domain == "ai.onnx" {
            if !(MIN_OPSET..=MAX_OPSET).contains(&o.version) {
                return Err(LoadError::Opset { domain: "ai.onnx".into(), version: o.version });
            }
            opset = o.version;
        }
    }
    let mut constants = HashMap::new();
    for t in &g.initializer {
        let c = tensor(t).map_err(|reason| LoadError::Initializer { name: t.name.clone(), reason })?;
        constants.insert(t.name.clone(), c);
    }
    let nodes = g
        .node
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut attrs = HashMap::new();
            for a in &n.attribute {
                let v = attr(a).map_err(|reason| LoadError::Initializer {
                    name: format!("attribute `{}` of node `{}`", a.name, n.name),
                    reason,
                })?;
                attrs.insert(a.name.clone(), v);
            }
            Ok(Node {
                name: if n.name.is_empty() { format!("#{i}") } else { n.name.clone() },
                op: n.op_type.clone(),
                domain: n.domain.clone(),
                inputs: n.input.clone(),
                outputs: n.output.clone(),
                attrs,
            })
        })
        .collect::<Result<Vec<_>, LoadError>>()?;
    // Inputs that are initializers are constants, not model inputs.
    let inputs = g.input.iter().filter(|v| !constants.contains_key(&v.name)).map(io).collect();
    let outputs = g.output.iter().map(io).collect();
    Ok(OnnxModel { opset, producer: m.producer_name.clone(), nodes, constants, inputs, outputs })
}
