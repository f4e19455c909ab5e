//! The `vfio_user_server` fuzz target's harness: one connection's byte
//! stream to the board daemon's vfio-user server.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, OnceLock, PoisonError};

use vnpu_daemon::{irqs, regions, VnpuBackend};

/// The server and backend every call shares (built once: a fuzzer runs
/// millions of inputs, and state left by one input is fair game for the next).
type State = Mutex<(vfio_user::Server, VnpuBackend)>;

fn state() -> Option<&'static State> {
    static STATE: OnceLock<Option<State>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let spec = vnpu_spec::VnpuSpec::parse("sa=1,vu=1,sram=4M,hbm=256M").ok()?;
            let backend =
                VnpuBackend::new(&spec, &npu_model::BoardConfig::default(), "fuzz", Default::default())
                    .ok()?;
            // The server's listener is never accepted on here: any socket does.
            let (unused, _) = UnixStream::pair().ok()?;
            let server = vfio_user::Server::from_owned_fd(unused.into(), true, irqs(), regions());
            Some(Mutex::new((server, backend)))
        })
        .as_ref()
}

/// Serves `data` as the byte stream of one vfio-user connection (no file
/// descriptors); replies are read and dropped on a thread of their own so
/// the server never blocks. Nothing a client sends may panic the server.
pub fn serve_stream(data: &[u8]) {
    let Some(state) = state() else { return };
    let Ok((mut client, server_end)) = UnixStream::pair() else { return };
    let Ok(mut replies) = client.try_clone() else { return };
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
        let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
        let (server, backend) = &mut *guard;
        let _ = server.serve(server_end, backend);
    }
    let _ = writer.join();
    let _ = drain.join();
}
