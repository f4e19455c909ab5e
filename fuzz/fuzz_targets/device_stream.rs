//! A device core taking a device stream a migrating vfio-user client
//! wrote (`vnpu_fuzz_harness::take_stream`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::take_stream(data);
});
