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
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
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
    Strings(Vec<String>),
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

/// Bytes per element of an ONNX data type with fixed-size elements.
fn elem_bytes(data_type: i32) -> Option<u64> {
    Some(match DataType::from_i32(data_type)? {
        DataType::FLOAT | DataType::INT32 | DataType::UINT32 => 4,
        DataType::DOUBLE | DataType::INT64 | DataType::UINT64 => 8,
        DataType::INT16 | DataType::UINT16 | DataType::FLOAT16 | DataType::BFLOAT16 => 2,
        DataType::INT8 | DataType::UINT8 | DataType::BOOL => 1,
        _ => return None,
    })
}

/// Reads `t`'s external data into its `raw_data` (see [`load_from`]),
/// counting the bytes against `budget`.
fn inline_external(
    t: &mut TensorProto,
    dir: Option<&std::path::Path>,
    budget: &mut u64,
) -> Result<(), Refusal> {
    use std::io::{Read, Seek, SeekFrom};
    use std::path::Component;
    let Some(dir) = dir else {
        return Err(unsupported(
            "its data is in an external file: compile the model from its file (vnpu compile reads the data beside it)",
        ));
    };
    let mut location = None;
    let (mut offset, mut length) = (0u64, None);
    for e in &t.external_data {
        let num = || {
            e.value.parse::<u64>().map_err(|_| invalid(format!("external data `{}` is not a number", e.key)))
        };
        match e.key.as_str() {
            "location" => location = Some(e.value.clone()),
            "offset" => offset = num()?,
            "length" => length = Some(num()?),
            _ => {}
        }
    }
    let location = location.ok_or_else(|| invalid("external data without a location"))?;
    let rel = std::path::Path::new(&location);
    if location.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(invalid(format!(
            "external data location `{location}` is not a relative path below the model's directory"
        )));
    }
    let n = dims(t)?.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
    let size = n
        .zip(elem_bytes(t.data_type))
        .and_then(|(n, b)| n.checked_mul(b))
        .ok_or_else(|| unsupported(format!("external data of data type {}", t.data_type)))?;
    if length.is_some_and(|l| l != size) {
        return Err(invalid(format!(
            "external data of {} bytes for a tensor of {size}",
            length.unwrap_or(0)
        )));
    }
    if size > *budget {
        return Err(unsupported(format!("more than {MAX_EXTERNAL_BYTES} bytes of external data")));
    }
    let path = dir.join(rel);
    let io = |e: std::io::Error| unsupported(format!("external data file {}: {e}", path.display()));
    let mut f = std::fs::File::open(&path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    if offset.checked_add(size).is_none_or(|end| end > file_len) {
        return Err(invalid(format!(
            "external data {offset}..+{size} is outside {} ({file_len} bytes)",
            path.display()
        )));
    }
    f.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut raw = vec![0u8; usize::try_from(size).map_err(|_| unsupported("external data too large"))?];
    f.read_exact(&mut raw).map_err(io)?;
    *budget -= size;
    t.raw_data = raw;
    t.external_data.clear();
    t.data_location = protobuf::EnumOrUnknown::new(onnx_protobuf::tensor_proto::DataLocation::DEFAULT);
    Ok(())
}

/// Reads a `TensorProto` (inline data; external data is read by
/// [`load_from`] before, and refused here).
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
        Ok(T::STRINGS) => {
            Attr::Strings(a.strings.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect())
        }
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
/// `onnx.defs.get_schema`; docs/compiled-model-format.md).
pub const MAX_OPSET: i64 = 28;

/// Most bytes of external data one model may read (16 GiB).
pub const MAX_EXTERNAL_BYTES: u64 = 16 << 30;

/// Reads an ONNX model from its bytes (initializers stored inline).
pub fn load(bytes: &[u8]) -> Result<OnnxModel, LoadError> {
    load_from(bytes, None)
}

/// Reads an ONNX model from its bytes; initializers stored in external
/// data files (what `torch.onnx.export` writes beside the model, e.g.
/// `model.onnx.data`) are read from `dir`, the model file's directory.
/// A location must be a relative path below `dir` (no `..`, no absolute
/// path), the range `offset`/`length` inside the file and exactly the
/// tensor's size, and a model reads at most [`MAX_EXTERNAL_BYTES`].
pub fn load_from(bytes: &[u8], dir: Option<&std::path::Path>) -> Result<OnnxModel, LoadError> {
    let mut m = ModelProto::parse_from_bytes(bytes).map_err(LoadError::Protobuf)?;
    if let Some(g) = m.graph.as_mut() {
        let mut budget = MAX_EXTERNAL_BYTES;
        for t in g.initializer.iter_mut().filter(|t| !t.external_data.is_empty()) {
            let name = t.name.clone();
            inline_external(t, dir, &mut budget).map_err(|reason| LoadError::Initializer { name, reason })?;
        }
    }
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

#[cfg(test)]
mod external_tests {
    use super::*;
    use onnx_protobuf::{GraphProto, StringStringEntryProto};

    /// A model whose one initializer `w` (2 floats) is external data at
    /// `location`, `offset`.
    fn model(location: &str, offset: u64) -> Vec<u8> {
        let mut t = TensorProto::new();
        t.name = "w".into();
        t.dims = vec![2];
        t.data_type = DataType::FLOAT as i32;
        for (k, v) in
            [("location", location.to_string()), ("offset", offset.to_string()), ("length", "8".into())]
        {
            let mut e = StringStringEntryProto::new();
            e.key = k.into();
            e.value = v;
            t.external_data.push(e);
        }
        let mut g = GraphProto::new();
        g.initializer.push(t);
        let mut m = ModelProto::new();
        m.graph = protobuf::MessageField::some(g);
        let mut o = onnx_protobuf::OperatorSetIdProto::new();
        o.version = 17;
        m.opset_import.push(o);
        m.write_to_bytes().unwrap_or_default()
    }

    /// Data beside the model is read; a location outside its directory,
    /// a range past the file's end, a missing file, and a model given
    /// without its directory are refused, each with a reason.
    #[test]
    fn external_data_is_read_from_beside_the_model_only() {
        let dir = std::env::temp_dir().join(format!("npu-onnx-external-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap_or_default();
        let data: Vec<u8> = [0.0f32, 1.5, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(dir.join("m.onnx.data"), &data).unwrap_or_default();
        let m = load_from(&model("m.onnx.data", 4), Some(&dir)).expect("beside the model");
        assert_eq!(m.constants["w"].data, Data::F32(vec![1.5, -2.0]));
        for (loc, off, why) in [
            ("../m.onnx.data", 0, "not a relative path below"),
            ("/etc/passwd", 0, "not a relative path below"),
            ("sub/../../x", 0, "not a relative path below"),
            ("m.onnx.data", 8, "outside"),
            ("missing.data", 0, "missing.data"),
        ] {
            let e = load_from(&model(loc, off), Some(&dir)).expect_err(loc).to_string();
            assert!(e.contains(why), "{loc}: {e}");
        }
        let e = load(&model("m.onnx.data", 0)).expect_err("no directory").to_string();
        assert!(e.contains("external file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
