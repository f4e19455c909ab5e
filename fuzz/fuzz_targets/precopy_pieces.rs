//! A device core taking a live migration's pre-copy pieces and its
//! incremental stream (`vnpu_fuzz_harness::take_pieces`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::take_pieces(data);
});
