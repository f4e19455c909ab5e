//! The vNPU's request path from guest-controlled bytes: guest memory
//! contents (rings, descriptors, headers, programs), ring set-up with any
//! size and addresses, mailbox commands with any arguments, and ring
//! drains, in any order. Nothing a guest writes may panic the device.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::drive_ring(data);
});
