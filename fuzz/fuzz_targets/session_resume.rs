//! A device core resuming a session from a state folder whose files hold
//! anything (`vnpu_fuzz_harness::resume_from`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::resume_from(data);
});
