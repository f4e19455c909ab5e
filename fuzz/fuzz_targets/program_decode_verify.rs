//! Any bytes: the container decoder and the verifier never panic, and a
//! program that decodes re-encodes to bytes that decode to the same program.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npu_model::{verify, VnpuLimits};
use vnpu_abi::Program;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Program::decode(data) {
        let again = Program::decode(&p.encode()).expect("re-encoded program decodes");
        assert_eq!(again, p);
        let limits = VnpuLimits { sa: 2, vu: 2, sram_bytes: 1 << 20, hbm_bytes: 1 << 24, guest: vec![0x1000..0x10_0000], borrow_sa: 1, borrow_vu: 1 };
        let _ = verify(&p, &limits);
    }
});
