//! The daemon's control socket from client-controlled bytes: any stream
//! of lines (JSON or not, any length, any encoding) on one connection,
//! framed and parsed as management requests. Nothing a client sends may
//! panic it; the connection may end.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vnpu_manager::control::fuzz_connection(data);
});
