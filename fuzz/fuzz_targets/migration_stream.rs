//! A destination VMM taking a live migration's stream from a hostile
//! source (`vnpu_vm::migrate::take_stream`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = vnpu_vm::migrate::take_stream(data);
});
