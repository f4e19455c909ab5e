//! NumPy `.npy` arrays in and out (through the `npyz` crate): the input
//! and output files of `vnpu infer`.

use std::io::{Read, Write};

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
    #[error("{path}: the header is longer than {MAX_HEADER} bytes, nests deeper than {MAX_NESTING} brackets (a plain array's nests 2), or has a shape that is not decimal dimensions whose product fits 64 bits")]
    Header { path: String },
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

/// Longest header read: NumPy writes a few hundred bytes at most.
pub const MAX_HEADER: usize = 1 << 16;

/// Deepest nesting of `(`, `[` and `{` in a header read. A plain array's
/// header is a dict holding a shape tuple (2); what nests deeper is a
/// structured type, which is refused anyway, and npyz's header parser
/// takes time exponential in the depth (a 620-byte header of 16 nested
/// lists held it for seconds).
pub const MAX_NESTING: usize = 3;

/// Refuses a header longer than [`MAX_HEADER`] or nesting deeper than
/// [`MAX_NESTING`] before npyz parses it. `bytes` is the file's start (at
/// least its header, when the file holds one); what is not a `.npy`
/// preamble is left to npyz to report.
fn check_header(bytes: &[u8], path: &str) -> Result<(), NpyError> {
    let Some(rest) = bytes.strip_prefix(b"\x93NUMPY") else { return Ok(()) };
    let (len, start) = match rest.first() {
        Some(1) => (rest.get(2..4).map(|b| usize::from(u16::from_le_bytes([b[0], b[1]]))), 10),
        Some(2 | 3) => (rest.get(2..6).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize), 12),
        _ => return Ok(()),
    };
    let Some(len) = len else { return Ok(()) };
    let refused = || NpyError::Header { path: path.into() };
    if len > MAX_HEADER {
        return Err(refused());
    }
    let header = bytes.get(start..).unwrap_or_default();
    let mut depth = 0usize;
    for &c in header.iter().take(len) {
        match c {
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(refused());
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if !shape_fits(header.get(..len).unwrap_or(header)) {
        return Err(refused());
    }
    Ok(())
}

/// Whether the header's shape tuple (after its `shape` key) is decimal
/// dimensions (a Python 2 `L` suffix allowed) whose product fits 64 bits:
/// npyz multiplies them unchecked, which panics in a build with overflow
/// checks and wraps in one without. A header with no shape tuple is left
/// to npyz to refuse.
fn shape_fits(header: &[u8]) -> bool {
    let Some(key) = header.windows(5).position(|w| w == b"shape") else { return true };
    let after = &header[key..];
    let (Some(open), Some(close)) =
        (after.iter().position(|&c| c == b'('), after.iter().position(|&c| c == b')'))
    else {
        return true;
    };
    if close < open {
        return true;
    }
    let mut product = 1u64;
    for dim in after[open + 1..close].split(|&c| c == b',') {
        let dim = dim.trim_ascii();
        let dim = dim.strip_suffix(b"L").unwrap_or(dim);
        if dim.is_empty() {
            continue;
        }
        let Some(d) = std::str::from_utf8(dim).ok().filter(|d| d.bytes().all(|c| c.is_ascii_digit())) else {
            return false;
        };
        match d.parse::<u64>().ok().and_then(|d| product.checked_mul(d)) {
            Some(p) => product = p,
            None => return false,
        }
    }
    true
}

/// Reads an array as f32 (f64 and integers converted). Fortran-order
/// arrays are refused.
pub fn read(bytes: &[u8], path: &str) -> Result<Array, NpyError> {
    check_header(bytes, path)?;
    let mut r = bytes;
    let header = npyz::NpyHeader::from_reader(&mut r)
        .map_err(|source| NpyError::Read { path: path.into(), source })?;
    let available = r.len() as u64;
    from_header(header, r, available, path)
}

/// Reads a file: its header, then its data straight from the file (a
/// little-endian f32 file into the array's own memory, in one pass).
pub fn read_file(path: &std::path::Path) -> Result<Array, NpyError> {
    let p = path.display().to_string();
    let err = |source: std::io::Error| NpyError::Read { path: p.clone(), source };
    let mut file = std::fs::File::open(path).map_err(err)?;
    let size = file.metadata().map_err(err)?.len();
    let mut start = Vec::new();
    (&mut file).take(12 + MAX_HEADER as u64).read_to_end(&mut start).map_err(err)?;
    check_header(&start, &p)?;
    // The bytes read so far, then the rest of the file: the header is
    // parsed from what was checked, without reading it again.
    let mut r = std::io::BufReader::new(std::io::Cursor::new(start).chain(file));
    let header = npyz::NpyHeader::from_reader(&mut r).map_err(err)?;
    from_header(header, r, size, &p)
}

/// The array whose `header` has been read and whose data `r` holds (at
/// most `available` bytes of it).
fn from_header(
    header: npyz::NpyHeader,
    mut r: impl std::io::Read,
    available: u64,
    path: &str,
) -> Result<Array, NpyError> {
    let err = |source: std::io::Error| NpyError::Read { path: path.into(), source };
    if header.order() != npyz::Order::C && header.shape().len() > 1 {
        return Err(NpyError::Fortran { path: path.into() });
    }
    let shape = header.shape().to_vec();
    let ts = match header.dtype() {
        npyz::DType::Plain(ts) => ts,
        other => return Err(NpyError::Type { path: path.into(), dtype: format!("{other:?}") }),
    };
    if (ts.type_char(), ts.size_field(), ts.endianness())
        == (npyz::TypeChar::Float, 4, npyz::Endianness::Little)
    {
        // The common case (NumPy's float32 on every little-endian
        // machine): the bytes read into the array's memory, no
        // decoding per element and no growing vector. The shape is
        // checked against the bytes there are before anything is
        // allocated for it.
        let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let Some(n) = n.filter(|n| n.checked_mul(4).is_some_and(|b| b <= available)) else {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("shape {shape:?} needs more than the {available} bytes the file holds"),
            )));
        };
        let mut data = vec![0f32; n as usize];
        r.read_exact(bytemuck::cast_slice_mut(&mut data)).map_err(err)?;
        if cfg!(target_endian = "big") {
            data.iter_mut().for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
        }
        return Ok(Array::floats(shape, data));
    }
    let npy = npyz::NpyFile::with_header(header, r);
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

    /// The bytes of a version-1 `.npy` file with header `dict` (padded
    /// as NumPy pads it) and data `data`.
    fn npy_bytes(dict: &str, data: &[u8]) -> Vec<u8> {
        let mut h = dict.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(data);
        b
    }

    /// A file NumPy wrote (the digits inputs, float32) reads as npyz's
    /// element-by-element decoder reads it, through the file and the
    /// bytes alike.
    #[test]
    fn numpy_float32_files_read_as_npyz_decodes_them() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/onnx/digits-x.npy");
        let bytes = std::fs::read(&path).unwrap();
        let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
        let shape = npy.shape().to_vec();
        let want: Vec<u32> = npy.into_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect();
        for a in [read_file(&path).unwrap(), read(&bytes, "x").unwrap()] {
            assert_eq!(a.shape, shape);
            assert_eq!(a.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
        }
    }

    /// A file whose header fills most of what `read_file` reads first
    /// (to check it) reads whole: the data starts in those bytes and goes
    /// on in the file, through the fast float32 path and npyz's decoder.
    #[test]
    fn data_after_a_long_header_reads_across_the_first_read() {
        let v: Vec<f64> = (0..20_000).map(|i| f64::from(i) * 0.25 - 7.0).collect();
        for (descr, data) in [
            ("<f4", v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect::<Vec<u8>>()),
            ("<f8", v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ] {
            let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (4, 5000), }}");
            dict.push_str(&" ".repeat(MAX_HEADER - 700));
            let bytes = npy_bytes(&dict, &data);
            let path =
                std::env::temp_dir().join(format!("npy-long-header-{}-{descr}.npy", std::process::id()));
            std::fs::write(&path, &bytes).unwrap();
            let got = read_file(&path);
            std::fs::remove_file(&path).unwrap();
            let got = got.unwrap();
            assert_eq!(got.shape, [4, 5000]);
            let want: Vec<u32> = v.iter().map(|x| (*x as f32).to_bits()).collect();
            assert_eq!(got.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
        }
    }

    /// Big-endian float32 is decoded, not taken as little-endian.
    #[test]
    fn big_endian_float32_is_decoded() {
        let v = [1.5f32, -2.0, 1e-3];
        let data: Vec<u8> = v.iter().flat_map(|x| x.to_be_bytes()).collect();
        let b = npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (3,), }", &data);
        assert_eq!(read(&b, "x").unwrap().data, v);
    }

    /// A header whose shape needs more bytes than the file holds is an
    /// error, before anything that size is allocated (the shape here
    /// would be 4 TiB), and so is a file that ends early.
    #[test]
    fn deeply_nested_or_long_headers_are_refused_quickly() {
        // What the fuzz target found, two brackets deeper: npyz alone
        // takes over a second on it at 16 (each bracket doubles that).
        let nested = npy_bytes(
            "{'descr': '<f=4', 'fortran_od\0\0\0rder': False, 'shape': (0, [[[[[[[[[[[[[[[[[[9), }",
            &[0; 64],
        );
        let t = std::time::Instant::now();
        let e = read(&nested, "x").unwrap_err();
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(matches!(e, NpyError::Header { .. }), "{e}");
        let mut long = b"\x93NUMPY\x02\x00".to_vec();
        long.extend_from_slice(&(MAX_HEADER as u32 + 1).to_le_bytes());
        long.resize(long.len() + MAX_HEADER + 1, b' ');
        assert!(matches!(read(&long, "x"), Err(NpyError::Header { .. })));
        let f = std::env::temp_dir().join(format!("npy-nested-{}.npy", std::process::id()));
        std::fs::write(&f, &nested).unwrap();
        assert!(matches!(read_file(&f), Err(NpyError::Header { .. })));
        std::fs::remove_file(&f).unwrap();
    }

    /// A shape whose element count overflows 64 bits, or whose
    /// dimensions are not decimal, is refused before npyz multiplies it
    /// (its unchecked product panicked under the fuzz target).
    #[test]
    fn shapes_past_64_bits_are_refused() {
        for (shape, ok) in [
            ("(4294967296, 4294967296, 2)", false),
            ("(18446744073709551616,)", false),
            ("(0x10, 2)", false),
            ("(4294967296, 4294967295)", true),
            ("(3L, 4L)", true),
            ("()", true),
        ] {
            let b =
                npy_bytes(&format!("{{'descr': '<i8', 'fortran_order': False, 'shape': {shape}, }}"), &[]);
            let refused = matches!(read(&b, "x"), Err(NpyError::Header { .. }));
            assert_eq!(refused, !ok, "{shape}");
        }
    }

    #[test]
    fn a_shape_larger_than_the_file_is_refused() {
        let huge =
            npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }", &[0; 8]);
        let short = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", &[0; 8]);
        let overflow =
            npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", &[]);
        let dir = std::env::temp_dir().join(format!("npy-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, b) in [huge, short, overflow].iter().enumerate() {
            let e = read(b, "x").unwrap_err().to_string();
            assert!(e.starts_with("x: "), "{e}");
            let f = dir.join(format!("{i}.npy"));
            std::fs::write(&f, b).unwrap();
            assert!(read_file(&f).is_err());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
