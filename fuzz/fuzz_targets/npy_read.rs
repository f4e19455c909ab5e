//! A `.npy` file from any bytes (`vnpu infer --input`, `--expect`):
//! `npy::read` never panics and never allocates for a shape the bytes do
//! not hold; an array it reads has as many values as its shape says; a
//! little-endian float32 array (read straight into the array's memory)
//! holds exactly what npyz's element-by-element decoder gives; and an
//! array written back reads as the same bits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npu_infer_io::npy;

fuzz_target!(|data: &[u8]| {
    let Ok(a) = npy::read(data, "fuzz") else { return };
    let n = a.shape.iter().product::<u64>();
    assert_eq!(a.data.len() as u64, n);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if let Ok(f) = npyz::NpyFile::new(data) {
        if f.dtype() == npyz::DType::new_scalar("<f4".parse().expect("a valid type string")) {
            let want = f.into_vec::<f32>().expect("npyz decodes what npy::read read");
            assert_eq!(bits(&a.data), bits(&want));
        }
    }
    let again = npy::read(&npy::to_bytes(&a).expect("an array read writes back"), "again")
        .expect("an array written reads back");
    assert_eq!(again.shape, a.shape);
    assert_eq!(bits(&again.data), bits(&a.data));
    assert_eq!(again.ints, a.ints);
});
