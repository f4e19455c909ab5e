//! NumPy `.npy` arrays in and out (through the `npyz` crate): the input
//! and output files of `vnpu infer`.

use std::io::Write;

use npyz::WriterBuilder;
use thiserror::Error;

/// A bad `.npy` file.
#[derive(Debug, Error)]
pub enum NpyError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: Fortran-order arrays are not read (save with np.ascontiguousarray)")]
    Fortran { path: String },
    #[error("{path}: element type `{dtype}` (f32, f64, and integer arrays are read)")]
    Type { path: String, dtype: String },
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A row-major array, as f32; an integer file's values also exactly.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
    /// The values of an integer file, exactly (`None` for a float file):
    /// what a model's integer input is given.
    pub ints: Option<Vec<i64>>,
}

impl Array {
    /// An f32 array.
    pub fn floats(shape: Vec<u64>, data: Vec<f32>) -> Self {
        Self { shape, data, ints: None }
    }

    /// An integer array.
    pub fn integers(shape: Vec<u64>, ints: Vec<i64>) -> Self {
        Self { shape, data: ints.iter().map(|&v| v as f32).collect(), ints: Some(ints) }
    }
}

/// Reads an array as f32 (f64 and integers converted). Fortran-order
/// arrays are refused.
pub fn read(bytes: &[u8], path: &str) -> Result<Array, NpyError> {
    let err = |source: std::io::Error| NpyError::Read { path: path.into(), source };
    let npy = npyz::NpyFile::new(bytes).map_err(err)?;
    if npy.order() != npyz::Order::C && npy.shape().len() > 1 {
        return Err(NpyError::Fortran { path: path.into() });
    }
    let shape = npy.shape().to_vec();
    let dtype = npy.dtype();
    let ts = match &dtype {
        npyz::DType::Plain(ts) => ts.clone(),
        other => return Err(NpyError::Type { path: path.into(), dtype: format!("{other:?}") }),
    };
    Ok(match (ts.type_char(), ts.size_field()) {
        (npyz::TypeChar::Float, 4) => Array::floats(shape, npy.into_vec::<f32>().map_err(err)?),
        (npyz::TypeChar::Float, 8) => {
            Array::floats(shape, npy.into_vec::<f64>().map_err(err)?.into_iter().map(|x| x as f32).collect())
        }
        (npyz::TypeChar::Int, 8) => Array::integers(shape, npy.into_vec::<i64>().map_err(err)?),
        (npyz::TypeChar::Int, 4) => {
            Array::integers(shape, npy.into_vec::<i32>().map_err(err)?.into_iter().map(i64::from).collect())
        }
        _ => return Err(NpyError::Type { path: path.into(), dtype: ts.to_string() }),
    })
}

/// Reads a file.
pub fn read_file(path: &std::path::Path) -> Result<Array, NpyError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| NpyError::Read { path: p.clone(), source })?;
    read(&bytes, &p)
}

/// The `.npy` bytes of an array: int64 for an integer one, else f32.
pub fn to_bytes(a: &Array) -> Result<Vec<u8>, NpyError> {
    fn write<T: npyz::AutoSerialize + Copy>(shape: &[u64], v: &[T]) -> std::io::Result<Vec<u8>> {
        let mut buf = Vec::new();
        let mut w = npyz::WriteOptions::new().default_dtype().shape(shape).writer(&mut buf).begin_nd()?;
        w.extend(v.iter().copied())?;
        w.finish()?;
        Ok(buf)
    }
    match &a.ints {
        Some(ints) => write(&a.shape, ints),
        None => write(&a.shape, &a.data),
    }
    .map_err(|source| NpyError::Write { path: String::new(), source })
}

/// Writes an array to a file (int64 for an integer one, else f32).
pub fn write_file(path: &std::path::Path, a: &Array) -> Result<(), NpyError> {
    let p = path.display().to_string();
    let bytes = to_bytes(a).map_err(|e| match e {
        NpyError::Write { source, .. } => NpyError::Write { path: p.clone(), source },
        e => e,
    })?;
    let mut f = std::fs::File::create(path).map_err(|source| NpyError::Write { path: p.clone(), source })?;
    f.write_all(&bytes).map_err(|source| NpyError::Write { path: p, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let a = Array::floats(vec![2, 3], vec![1.0, -2.5, 3.0, 0.0, f32::MAX, 1e-30]);
        let b = read(&to_bytes(&a).unwrap(), "x").unwrap();
        assert_eq!(a, b);
        assert!(read(b"not npy", "x").is_err());
    }
}
