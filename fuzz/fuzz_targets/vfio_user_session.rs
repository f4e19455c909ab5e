//! Whole hostile vfio-user sessions against a served vNPU instance:
//! connections opened and dropped, messages framed or not, each maybe
//! carrying a descriptor (sealed or unsealed memory, an eventfd, a pipe).
//! Afterwards an honest client must attach and read the device, and the
//! instance must stop (`vnpu_fuzz_harness::run_session`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::run_session(data);
});
