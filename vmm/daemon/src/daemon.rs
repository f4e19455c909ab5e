//! The daemon's main loop: one modelled board (every core's simulation
//! and scheduler, `vnpu_device::SharedBoard`), the manager's definitions
//! in the state directory, and a vfio-user socket per started instance at
//! `<socket-dir>/<uuid>.sock`.
//!
//! Until the control socket exists (issue 13 item 2), management commands
//! (`vnpu create/start/stop/remove`) write the state directory as before
//! and the daemon follows it: it rereads the definitions every
//! [`DaemonOptions::rescan`] and serves what is started, stops serving
//! what is not.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use npu_model::BoardConfig;
use thiserror::Error;
use vnpu_device::{DeviceOptions, SharedBoard};
use vnpu_manager::{Instance, Store};

use crate::backend::VnpuBackend;
use crate::serve::{InstanceServer, ServeError};

/// Why the daemon stopped or could not start.
#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("state directory {dir}: {source}")]
    Store { dir: PathBuf, source: vnpu_manager::StoreError },
    #[error("socket directory {dir}: {source}")]
    SocketDir { dir: PathBuf, source: std::io::Error },
    #[error("board runtime: {0}")]
    Board(std::io::Error),
    #[error("instance {uuid}: {source}")]
    Serve { uuid: String, source: ServeError },
}

/// What `vnpu daemon` was asked to do.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub board: BoardConfig,
    pub state_dir: PathBuf,
    pub socket_dir: PathBuf,
    /// How often the state directory is reread.
    pub rescan: Duration,
    /// How each vNPU's worker serves its ring.
    pub device: DeviceOptions,
}

/// Set by SIGTERM / SIGINT: the daemon stops serving and exits.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Makes SIGTERM and SIGINT stop [`run`] cleanly (sockets removed).
pub fn stop_on_signals() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: installs a handler that only stores to an atomic, which
        // is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// The instances being served, by UUID, as they were when served.
type Served = BTreeMap<String, (Instance, InstanceServer)>;

/// Runs the daemon until [`stop_on_signals`]' signals (or `stop`) say
/// stop. `ready` is called once every started instance is served.
pub fn run(opts: &DaemonOptions, stop: &AtomicBool, ready: impl FnOnce()) -> Result<(), DaemonError> {
    std::fs::create_dir_all(&opts.socket_dir)
        .map_err(|source| DaemonError::SocketDir { dir: opts.socket_dir.clone(), source })?;
    let board = SharedBoard::new(&opts.board, "board").map_err(DaemonError::Board)?;
    let mut served = Served::new();
    let result = (|| {
        reconcile(opts, &board, &mut served)?;
        ready();
        // Once running, a state directory that cannot be read for a moment
        // (or an instance that cannot be served) is logged, once per
        // distinct error, and the daemon keeps serving what it serves.
        let mut last_error = String::new();
        let mut scanned = std::time::Instant::now();
        while !stop.load(Ordering::SeqCst) && !STOP.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
            if scanned.elapsed() < opts.rescan {
                continue;
            }
            scanned = std::time::Instant::now();
            match reconcile(opts, &board, &mut served) {
                Ok(()) => last_error.clear(),
                Err(e) => {
                    let e = e.to_string();
                    if e != last_error {
                        log::error!("{e}");
                        last_error = e;
                    }
                }
            }
        }
        Ok(())
    })();
    for (_, (_, mut s)) in std::mem::take(&mut served) {
        s.stop();
    }
    board.stop();
    result
}

/// Serves every started instance of the state directory as it is now.
fn reconcile(opts: &DaemonOptions, board: &SharedBoard, served: &mut Served) -> Result<(), DaemonError> {
    let store = Store::open(&opts.state_dir, &opts.board)
        .map_err(|source| DaemonError::Store { dir: opts.state_dir.clone(), source })?;
    let wanted: BTreeMap<String, Instance> =
        store.instances().iter().filter(|i| i.active).map(|i| (i.uuid.clone(), i.clone())).collect();
    // Stop what is no longer started, or was remapped (a client attached
    // to it is disconnected; it reattaches to the new placement).
    let stale: Vec<String> = served
        .iter()
        .filter(|(u, (i, _))| wanted.get(*u).is_none_or(|w| w.shape != i.shape || w.cores != i.cores))
        .map(|(u, _)| u.clone())
        .collect();
    for u in stale {
        if let Some((_, mut s)) = served.remove(&u) {
            s.stop();
            log::info!("{u}: no longer served");
        }
    }
    for (uuid, inst) in wanted {
        if served.contains_key(&uuid) {
            continue;
        }
        let path = opts.socket_dir.join(format!("{uuid}.sock"));
        // A socket left by a daemon that died.
        let _ = std::fs::remove_file(&path);
        let cores = inst.cores.iter().filter_map(|&c| board.core(c)).collect();
        let device = DeviceOptions { cores, ..opts.device.clone() };
        let (spec, cfg, name) = (inst.shape, opts.board.clone(), uuid.clone());
        let server = InstanceServer::start(
            &path,
            &uuid,
            Box::new(move || VnpuBackend::new(&spec, &cfg, &name, device.clone())),
        )
        .map_err(|source| DaemonError::Serve { uuid: uuid.clone(), source })?;
        log::info!("{uuid}: served at {}", path.display());
        served.insert(uuid, (inst, server));
    }
    Ok(())
}
