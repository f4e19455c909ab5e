//! A compiled-model file (`vnpu compile`'s output, docs/compiled-model-format.md)
//! and an inference job from any bytes: `Model::decode` and
//! `job::Header::decode` never panic, a decoded model re-encodes to bytes
//! that decode to the same model, and relocating its programs never
//! panics (overflow is an error).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vnpu_abi::compiled_model::{job, relocate, Model};

fuzz_target!(|data: &[u8]| {
    let _ = job::Header::decode(data);
    if let Ok(m) = Model::decode(data) {
        let again = Model::decode(&m.encode()).expect("a decoded model re-encodes to a valid one");
        assert_eq!(again, m);
        let base = data.len() as u64 * 0x1_0000_0001;
        let (mut load, mut infer) = (m.load.clone(), m.infer.clone());
        let _ = relocate(&mut load, base);
        let _ = relocate(&mut infer, u64::MAX - base);
    }
});
