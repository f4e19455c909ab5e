//! The daemon's control socket from client-controlled bytes: any stream
//! of lines (JSON or not, any length, any encoding) on one connection,
//! framed, parsed and executed by the real request executor
//! (`vnpu_manager::control::execute`) on a fresh state directory per
//! input. Nothing a client sends may panic it; the connection may end.
//! Requests naming an interference matrix are answered with an error
//! instead: the executor would read whatever path they name.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use npu_model::BoardConfig;
use vnpu_manager::control::{execute, serve_connection};
use vnpu_manager::{ControlError, Request};

fn state_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| std::env::temp_dir().join(format!("vnpu-fuzz-control-{}", std::process::id())))
}

fn names_a_path(req: &Request) -> bool {
    match req {
        Request::Create { place, .. } | Request::Start { place, .. } => place.interference_matrix.is_some(),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let dir = state_dir();
    let _ = std::fs::remove_dir_all(dir);
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let board = BoardConfig::default();
    let Ok((mut client, server)) = UnixStream::pair() else { return };
    let Ok(mut replies) = client.try_clone() else { return };
    let drain = std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        while matches!(replies.read(&mut sink), Ok(n) if n > 0) {}
    });
    let data = data.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = client.write_all(&data);
        let _ = client.shutdown(std::net::Shutdown::Write);
    });
    let _ = serve_connection(server, |req| {
        if names_a_path(req) {
            return Err(ControlError::BadRequest("no files in the fuzz target".into()));
        }
        execute(dir, &board, req)
    });
    let _ = writer.join();
    let _ = drain.join();
});
