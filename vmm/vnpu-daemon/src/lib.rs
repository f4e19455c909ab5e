//! The board daemon (`docs/vfio-user.md`): one process owns one modelled
//! NPU board and serves each started vNPU instance to a VMM in another
//! process as a vfio-user PCI device, as a mediated device's parent
//! driver serves its instances.

// Everything here handles what a client sent: no silent narrowing casts.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

mod accept;
pub mod backend;
pub mod daemon;
pub mod dma;
mod http;
pub mod metrics;
pub mod peer;
pub mod seccomp;
pub mod serve;
#[cfg(any(fuzzing, test))]
mod session_fuzz;
mod slots;

pub use backend::{irqs, regions, BackendError, ReleaseRequest, VnpuBackend};
pub use daemon::{
    run, stop_on_signals, DaemonError, DaemonOptions, DEFAULT_CONTROL_IDLE, DEFAULT_RELEASE_TIMEOUT,
};
pub use serve::{InstanceServer, ServeError};
/// The `vfio_user_session` fuzz target's harness (built only for it and
/// the tests: cargo-fuzz builds with `--cfg fuzzing`).
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub use session_fuzz::fuzz_session;

/// Serves `data` as the byte stream of one vfio-user connection (no file
/// descriptors) to a vNPU backend shared by every call; replies are read
/// and dropped. Nothing a client sends may panic the server. Used by the
/// `vfio_user_server` fuzz target and a unit test, and built only for them
/// (cargo-fuzz builds with `--cfg fuzzing`).
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub fn fuzz_serve(data: &[u8]) {
    use std::io::{Read, Write};
    use std::sync::{Mutex, OnceLock};
    type State = Mutex<(vfio_user::Server, VnpuBackend)>;
    static STATE: OnceLock<Option<State>> = OnceLock::new();
    let state = STATE.get_or_init(|| {
        let spec = vnpu_spec::VnpuSpec::parse("sa=1,vu=1,sram=4M,hbm=256M").ok()?;
        let backend =
            VnpuBackend::new(&spec, &npu_model::BoardConfig::default(), "fuzz", Default::default()).ok()?;
        // The server's listener is never accepted on here: any socket does.
        let (unused, _) = std::os::unix::net::UnixStream::pair().ok()?;
        let server = vfio_user::Server::from_owned_fd(unused.into(), true, irqs(), regions());
        Some(Mutex::new((server, backend)))
    });
    let Some(state) = state else { return };
    let Ok((mut client, server_end)) = std::os::unix::net::UnixStream::pair() else { return };
    let Ok(mut replies) = client.try_clone() else { return };
    // Replies are drained on their own thread so the server never blocks.
    let drain = std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        while matches!(replies.read(&mut sink), Ok(n) if n > 0) {}
    });
    let writer = {
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = client.write_all(&data);
            let _ = client.shutdown(std::net::Shutdown::Write);
        })
    };
    {
        let mut guard = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (server, backend) = &mut *guard;
        let _ = server.serve(server_end, backend);
    }
    let _ = writer.join();
    let _ = drain.join();
}

#[cfg(test)]
mod tests {
    #[test]
    fn fuzz_serve_survives_garbage_and_well_formed_messages() {
        super::fuzz_serve(&[]);
        super::fuzz_serve(&[0xff; 100]);
        // A config-space read of 4 bytes, then a truncated header.
        let mut m = vec![1, 0, 9, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        m.extend_from_slice(&0u64.to_le_bytes());
        m.extend_from_slice(&7u32.to_le_bytes());
        m.extend_from_slice(&4u32.to_le_bytes());
        m.extend_from_slice(&[1, 0, 9]);
        super::fuzz_serve(&m);
    }
}
