//! The board daemon's vfio-user message handling from client-controlled
//! bytes: any stream of messages (headers with any command, size and
//! flags; any payloads) on one connection to a vNPU backend. Nothing a
//! client sends may panic the server; the connection may end.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_fuzz_harness::serve_stream(data);
});
