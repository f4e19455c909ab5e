//! The daemon's main loop: one modelled board (every core's simulation
//! and scheduler, `npu_board_runtime::SharedBoard`), the manager's definitions
//! in the state directory, and a vfio-user socket per started instance at
//! `<socket-dir>/<uuid>.sock`.
//!
//! Management requests arrive on the control socket
//! `<socket-dir>/control.sock` (`vnpu_manager::control`): each is
//! executed on the state directory and the instance is served (or no
//! longer served) before the reply goes out. A manager that writes the
//! state directory without the daemon is followed too: the daemon checks
//! the state file every [`DaemonOptions::rescan`] and, when it changed,
//! serves what is started and stops serving what is not.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npu_model::BoardConfig;
use thiserror::Error;
use vnpu_device::{DeviceOptions, SharedBoard, SharingStats, Telemetry};
use vnpu_manager::control::{self, ControlError, Outcome, Request, CONTROL_SOCKET};
use vnpu_manager::{CoreUse, TenantUse};
use vnpu_manager::{Instance, Store};

use crate::backend::{ReleaseRequest, VnpuBackend};
use crate::metrics::{BoardSource, MetricsError, MetricsServer, ServedSample};
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
    #[error("control socket {path}: {source}")]
    Control { path: PathBuf, source: std::io::Error },
    #[error("a daemon already answers at {0}")]
    Running(PathBuf),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

/// What `vnpu daemon` was asked to do.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub board: BoardConfig,
    pub state_dir: PathBuf,
    pub socket_dir: PathBuf,
    /// Where the instances' sessions are kept (`None`:
    /// `STATE_DIR/sessions`); a tmpfs such as `/run` keeps tenant memory
    /// off persistent disks (sessions then survive a daemon restart, not
    /// a reboot).
    pub session_dir: Option<PathBuf>,
    /// How often the state directory is reread.
    pub rescan: Duration,
    /// How each vNPU's worker serves its ring.
    pub device: DeviceOptions,
    /// Serve Prometheus metrics over HTTP here (`docs/metrics.md`).
    pub metrics: Option<std::net::SocketAddr>,
    /// A control connection that sends no request (or reads no reply) for
    /// this long is closed, so idle clients cannot hold all
    /// [`MAX_CONTROL_CONNECTIONS`] slots ([`DEFAULT_CONTROL_IDLE`]).
    pub control_idle: Duration,
    /// Besides root and the daemon's own user, members of this group
    /// (a gid) may manage the board on the control socket.
    pub control_group: Option<u32>,
    /// An instance stopped while a client is attached: the daemon raises
    /// that client's device request (QEMU unplugs the device from its
    /// guest) and cuts the client off if it has not let go after this
    /// long ([`DEFAULT_RELEASE_TIMEOUT`]; zero: at once).
    pub release_timeout: Duration,
    /// Lend idle engines to spread programs (`docs/management.md`,
    /// "Harvesting"); off, every request runs on its vNPU's engines.
    pub harvest: bool,
    /// With harvesting: the longest compute instruction (microseconds of
    /// simulated time) a request may start on a lent engine, so an owner
    /// takes its engines back within it (`None`: any, one instruction).
    pub lend_limit_us: Option<f64>,
}

/// Default of [`DaemonOptions::control_idle`].
pub const DEFAULT_CONTROL_IDLE: Duration = Duration::from_secs(30);
/// Default of [`DaemonOptions::release_timeout`]: Linux's PCIe hot-plug
/// driver waits 5 s after the attention button before it removes a
/// device, so this leaves the guest as long again to finish.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

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

/// An instance being served.
pub(crate) struct ServedInstance {
    /// As it was when served.
    pub instance: Instance,
    pub server: InstanceServer,
    /// What its vNPU did, across the VMs that attached (and remaps).
    pub telemetry: Arc<Telemetry>,
    /// The attached client's device request.
    pub release: Arc<ReleaseRequest>,
    /// Stopped while attached, its client asked to let go: cut off at
    /// this instant if it has not.
    pub releasing: Option<Instant>,
}

/// The instances being served, by UUID.
pub(crate) type Served = BTreeMap<String, ServedInstance>;

/// Most control connections served at once. When all are taken, a new
/// one takes the slot of the connection idle longest, if that one has
/// been idle for [`EVICT_IDLE`]; otherwise it is refused.
pub const MAX_CONTROL_CONNECTIONS: usize = 32;

/// The control socket's listen queue (std's default is 128).
const CONTROL_BACKLOG: libc::c_int = 8;

/// How long a control connection must have been idle before a newcomer
/// may take its slot: honest clients send their request as soon as they
/// connect. (`/metrics` holds no slot for a connection that has not sent
/// its request: `http.rs`.)
pub const EVICT_IDLE: Duration = Duration::from_millis(100);

/// What the control threads (and the metrics endpoint) share with the
/// main loop.
pub(crate) struct Daemon {
    pub opts: DaemonOptions,
    pub board: SharedBoard,
    pub served: Mutex<Served>,
    /// Set (under the `served` lock) when the daemon stops: no request
    /// serves anything after that.
    stopping: AtomicBool,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl BoardSource for Daemon {
    fn core_config(&self) -> npu_model::config::CoreConfig {
        self.opts.board.core.clone()
    }
    fn served(&self) -> Vec<ServedSample> {
        lock(&self.served)
            .values()
            .map(|s| ServedSample {
                instance: s.instance.clone(),
                telemetry: s.telemetry.snapshot(),
                attached: s.server.attached(),
            })
            .collect()
    }
    fn cores(&self) -> Vec<(usize, SharingStats)> {
        self.board.cores().iter().map(|h| (h.index(), h.stats())).collect()
    }
}

impl Daemon {
    /// One management request: executed on the state directory, then the
    /// served instances follow, all under the served-map lock (requests
    /// are serialized; the state directory's lock keeps managers that
    /// bypass the daemon from losing updates).
    fn handle(&self, req: &Request) -> Result<Outcome, ControlError> {
        // Files the request names are read, and what it will price is
        // measured, before any lock is taken; if another manager added a
        // tenant in between, the request is prepared again.
        control::retry_unprepared(|| self.handle_once(req))
    }

    fn handle_once(&self, req: &Request) -> Result<Outcome, ControlError> {
        let prepared = control::prepare(&self.opts.state_dir, &self.opts.board, req)?;
        let mut served = lock(&self.served);
        if self.stopping.load(Ordering::SeqCst) {
            return Err(ControlError::Protocol("the daemon is stopping".into()));
        }
        if let Request::Cores {} = req {
            return self.cores();
        }
        let mut serving = Ok(());
        let mut outcome =
            control::execute_prepared(&self.opts.state_dir, &self.opts.board, req, prepared, |instances| {
                if req.changes_state() {
                    serving = serve_started(&self.opts, &self.board, &mut served, instances);
                }
            })?;
        serving.map_err(|e| ControlError::Protocol(format!("the request was done but: {e}")))?;
        if let Outcome::Instance { instance, socket, .. } = &mut outcome {
            if served.contains_key(&instance.uuid) {
                *socket = Some(control::instance_socket(&self.opts.socket_dir, &instance.uuid));
            }
        }
        Ok(outcome)
    }

    /// What every physical core has done (the `cores` request).
    fn cores(&self) -> Result<Outcome, ControlError> {
        let b = &self.opts.board;
        // Which cores are oversubscribed is the placement's view of the
        // state directory as it is now.
        let placement = vnpu_manager::Store::open(&self.opts.state_dir, b)?.board();
        let cores = self
            .board
            .cores()
            .iter()
            .map(|h| (h.index(), h.stats()))
            .map(|(core, s)| CoreUse {
                // A board has at most 1024 chips x 256 cores.
                core: u32::try_from(core).unwrap_or(u32::MAX),
                requests: s.requests,
                waited: s.waited,
                preempted: s.preempted,
                board_cycles: s.busy_cycles,
                overlap_cycles: s.overlap_cycles,
                tenants: tenant_use(&s),
                slo_requests: s.slo_requests,
                slo_misses: s.slo_misses,
                oversubscribed: placement.oversubscribed(core),
            })
            .collect();
        Ok(Outcome::Cores { clock_mhz: b.clock_mhz, cores })
    }
}

/// Each tenant's busy time and harvesting on a core: the tenants that ran
/// on it, then any that only lent engines.
fn tenant_use(s: &vnpu_device::SharingStats) -> Vec<TenantUse> {
    let mut out: Vec<TenantUse> = s
        .tenants
        .iter()
        .map(|(tenant, busy_cycles)| TenantUse {
            tenant: tenant.clone(),
            busy_cycles: *busy_cycles,
            ..Default::default()
        })
        .collect();
    for (tenant, h) in &s.harvest {
        let i = match out.iter().position(|u| &u.tenant == tenant) {
            Some(i) => i,
            None => {
                out.push(TenantUse { tenant: tenant.clone(), ..Default::default() });
                out.len() - 1
            }
        };
        let u = &mut out[i];
        u.borrowed_cycles = h.borrowed_cycles;
        u.lent_cycles = h.lent_cycles;
        u.reclaims = h.reclaims;
        u.reclaim_cycles = h.reclaim_cycles;
        u.reclaim_max_cycles = h.reclaim_max_cycles;
    }
    out
}

/// The control socket's listener thread and its connections.
struct ControlServer {
    path: PathBuf,
    listener_fd: i32,
    /// Set before the listener is shut down: the accept loop's end.
    stopping: Arc<AtomicBool>,
    /// The open connections' slots (shut down at stop).
    slots: Arc<crate::slots::Slots>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ControlServer {
    fn start(daemon: Arc<Daemon>) -> Result<Self, DaemonError> {
        let path = daemon.opts.socket_dir.join(CONTROL_SOCKET);
        let err = |source| DaemonError::Control { path: path.clone(), source };
        if UnixStream::connect(&path).is_ok() {
            return Err(DaemonError::Running(path));
        }
        // A socket left by a daemon that died.
        let _ = std::fs::remove_file(&path);
        // Bound and listening under a temporary name, then renamed into
        // place: a client that connects as soon as the path appears must
        // not find a socket that does not listen yet (ECONNREFUSED).
        let temporary = path.with_file_name(format!(".control-{}.bind", std::process::id()));
        let _ = std::fs::remove_file(&temporary);
        let listener = UnixListener::bind(&temporary).map_err(err)?;
        let listener_fd = listener.as_raw_fd();
        // A short listen queue: a client flooding connections waits to
        // connect instead of queueing 128 ahead of an operator.
        // SAFETY: listen(2) again on the socket just bound, which only
        // changes its backlog.
        unsafe { libc::listen(listener_fd, CONTROL_BACKLOG) };
        if let Err(e) = std::fs::rename(&temporary, &path) {
            let _ = std::fs::remove_file(&temporary);
            return Err(err(e));
        }
        let slots = crate::slots::Slots::new(MAX_CONTROL_CONNECTIONS, EVICT_IDLE);
        let admitting = Arc::clone(&slots);
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&stopping);
        let idle = daemon.opts.control_idle.max(Duration::from_millis(1));
        let group = daemon.opts.control_group;
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                while let Some((stream, _)) =
                    crate::accept::accept_retrying("control socket", &stop, || listener.accept())
                {
                    // A client that may not manage the board is served like
                    // any other (the same slots and idle bound), with every
                    // request refused: it reads why, whenever it writes.
                    let who = crate::peer::peer(&stream);
                    let permitted = who.as_ref().is_ok_and(|p| crate::peer::allowed(p, group));
                    if !permitted {
                        log::warn!("control connection of {who:?}: not allowed to manage the board");
                    }
                    let slot = admitting.admit(stream.try_clone().ok().map(Into::into));
                    let Some(slot) = slot else {
                        let mut s = stream;
                        let busy: Result<Outcome, ControlError> = Err(ControlError::Protocol(format!(
                            "{MAX_CONTROL_CONNECTIONS} management connections are open; try again"
                        )));
                        let _ = control::write_line(&mut s, &control::Reply::from(busy));
                        continue;
                    };
                    // An idle client gives its slot up after `idle`.
                    let _ = stream.set_read_timeout(Some(idle));
                    let _ = stream.set_write_timeout(Some(idle));
                    let daemon = Arc::clone(&daemon);
                    // The slot is freed when the thread ends (or, if it
                    // cannot start, with the closure that holds it).
                    let spawned =
                        std::thread::Builder::new().name("control client".into()).spawn(move || {
                            let served = control::serve_connection(stream, |req| {
                                slot.busy();
                                let reply = if permitted {
                                    daemon.handle(req)
                                } else {
                                    Err(ControlError::Refused {
                                        kind: "permission".into(),
                                        message: "not allowed to manage this board: root, the daemon's user \
                                                  and the --control-group may"
                                            .into(),
                                    })
                                };
                                slot.idle();
                                reply
                            });
                            if let Err(e) = served {
                                log::warn!("control connection dropped: {e}");
                            }
                        });
                    if let Err(e) = spawned {
                        log::warn!("control socket: cannot start a connection's thread: {e}");
                    }
                }
            })
            .map_err(|e| DaemonError::Control { path: path.clone(), source: e })?;
        Ok(Self { path, listener_fd, stopping, slots, thread: Some(thread) })
    }

    fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // SAFETY: shutdown(2) of the listening socket the thread owns and
        // keeps open until it returns: the blocked accept() fails.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.slots.shutdown_all();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs the daemon until [`stop_on_signals`]' signals (or `stop`) say
/// stop. `ready` is called once every started instance is served and the
/// control socket answers.
pub fn run(opts: &DaemonOptions, stop: &AtomicBool, ready: impl FnOnce()) -> Result<(), DaemonError> {
    std::fs::create_dir_all(&opts.socket_dir)
        .map_err(|source| DaemonError::SocketDir { dir: opts.socket_dir.clone(), source })?;
    let board = SharedBoard::new(&opts.board, "board").map_err(DaemonError::Board)?;
    board.set_harvesting(opts.harvest);
    if let Some(us) = opts.lend_limit_us {
        board.set_lend_limit(us * f64::from(opts.board.clock_mhz));
    }
    let daemon = Arc::new(Daemon {
        opts: opts.clone(),
        board,
        served: Mutex::new(Served::new()),
        stopping: AtomicBool::new(false),
    });
    let mut control_server = None;
    let mut metrics_server = None;
    let result = (|| {
        let mut seen = Store::stamp(&opts.state_dir);
        reconcile(opts, &daemon.board, &mut lock(&daemon.served))?;
        // Metrics first: once the control socket answers, everything the
        // daemon serves is up (a client that scraped right after the
        // control socket came up was once refused).
        if let Some(addr) = opts.metrics {
            let m = MetricsServer::start(addr, Arc::clone(&daemon) as Arc<dyn BoardSource>)?;
            log::info!("metrics at http://{}/metrics", m.addr);
            metrics_server = Some(m);
        }
        control_server = Some(ControlServer::start(Arc::clone(&daemon))?);
        ready();
        // Once running, a state directory that cannot be read for a moment
        // (or an instance that cannot be served) is logged, once per
        // distinct error, and the daemon keeps serving what it serves.
        let mut last_error = String::new();
        let mut scanned = std::time::Instant::now();
        while !stop.load(Ordering::SeqCst) && !STOP.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
            finish_releases(&mut lock(&daemon.served), Instant::now());
            if scanned.elapsed() < opts.rescan {
                continue;
            }
            scanned = std::time::Instant::now();
            let now = Store::stamp(&opts.state_dir);
            if now == seen && last_error.is_empty() {
                continue;
            }
            seen = now;
            match reconcile(opts, &daemon.board, &mut lock(&daemon.served)) {
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
    if let Some(mut c) = control_server {
        c.stop();
    }
    if let Some(mut m) = metrics_server {
        m.stop();
    }
    let served = {
        let mut served = lock(&daemon.served);
        daemon.stopping.store(true, Ordering::SeqCst);
        std::mem::take(&mut *served)
    };
    for (_, mut s) in served {
        s.server.stop();
    }
    daemon.board.stop();
    result
}

/// Serves every started instance of the state directory as it is now.
fn reconcile(opts: &DaemonOptions, board: &SharedBoard, served: &mut Served) -> Result<(), DaemonError> {
    let store = Store::open(&opts.state_dir, &opts.board)
        .map_err(|source| DaemonError::Store { dir: opts.state_dir.clone(), source })?;
    serve_started(opts, board, served, store.instances())
}

/// Serves the started ones of `instances`, and only them.
fn serve_started(
    opts: &DaemonOptions,
    board: &SharedBoard,
    served: &mut Served,
    instances: &[Instance],
) -> Result<(), DaemonError> {
    let wanted: BTreeMap<String, Instance> =
        instances.iter().filter(|i| i.active).map(|i| (i.uuid.clone(), i.clone())).collect();
    // Stop what is no longer started, or was remapped (a client attached
    // to it is disconnected; it reattaches to the new placement).
    let stale: Vec<String> = served
        .iter()
        .filter(|(u, s)| {
            wanted.get(*u).is_none_or(|w| {
                w.shape != s.instance.shape || w.cores != s.instance.cores || w.qos != s.instance.qos
            })
        })
        .map(|(u, _)| u.clone())
        .collect();
    // Started again while its client was being asked to let go: served on.
    for (u, s) in served.iter_mut() {
        if s.releasing.is_some() && !stale.contains(u) {
            s.releasing = None;
        }
    }
    // A remapped instance keeps its totals.
    let mut kept: BTreeMap<String, Arc<Telemetry>> = BTreeMap::new();
    for u in stale {
        let stopped = !wanted.contains_key(&u);
        let Some(s) = served.get_mut(&u) else { continue };
        // Stopped (not remapped) with a client attached: ask the client to
        // release the device first; `finish_releases` ends it.
        if stopped && !opts.release_timeout.is_zero() {
            if s.releasing.is_some() {
                continue;
            }
            if s.server.attached() && s.release.raise() {
                log::info!("{u}: stopped; asked its client to release the device");
                s.releasing = Some(Instant::now() + opts.release_timeout);
                continue;
            }
        }
        if let Some(mut s) = served.remove(&u) {
            s.server.stop();
            log::info!("{u}: no longer served");
            kept.insert(u, s.telemetry);
        }
    }
    prune_sessions(opts, instances);
    for (uuid, inst) in wanted {
        if served.contains_key(&uuid) {
            continue;
        }
        // Where the vNPU's state is kept for a restart (docs/vfio-user.md).
        let store_dir = session_dir(opts, &uuid);
        let store_dir = match private_session_dir(&store_dir)
            .and_then(|()| vnpu_device::prepare_files(&store_dir, inst.shape.cores()))
        {
            Ok(()) => Some(store_dir),
            Err(e) => {
                log::warn!("{uuid}: {}: {e}; its sessions cannot be resumed", store_dir.display());
                None
            }
        };
        let path = control::instance_socket(&opts.socket_dir, &uuid);
        // A socket left by a daemon that died.
        let _ = std::fs::remove_file(&path);
        let cores = inst.cores.iter().filter_map(|&c| board.core(c)).collect();
        let telemetry = kept.remove(&uuid).unwrap_or_default();
        let device = DeviceOptions {
            cores,
            telemetry: Some(Arc::clone(&telemetry)),
            priority: inst.qos.priority,
            slo_us: inst.qos.slo_us,
            borrow: inst.qos.borrow,
            ..opts.device.clone()
        };
        let (spec, cfg, name) = (inst.shape, opts.board.clone(), uuid.clone());
        let release = Arc::new(ReleaseRequest::default());
        let theirs = Arc::clone(&release);
        let files = store_dir.clone();
        let server = InstanceServer::start(
            &path,
            &uuid,
            files.as_deref(),
            Box::new(move || {
                VnpuBackend::new(&spec, &cfg, &name, device.clone()).map(|b| {
                    let b = b.with_release(Arc::clone(&theirs));
                    match &store_dir {
                        Some(d) => b.with_store(d.clone()),
                        None => b,
                    }
                })
            }),
        )
        .map_err(|source| DaemonError::Serve { uuid: uuid.clone(), source })?;
        log::info!("{uuid}: served at {}", path.display());
        served.insert(uuid, ServedInstance { instance: inst, server, telemetry, release, releasing: None });
    }
    Ok(())
}

/// Directory of the sessions kept for instances (docs/vfio-user.md).
const SESSIONS: &str = "sessions";

/// The directory where instance `uuid` keeps its device session.
fn session_dir(opts: &DaemonOptions, uuid: &str) -> PathBuf {
    sessions_root(opts).join(uuid)
}

/// The folder of every instance's session folder.
fn sessions_root(opts: &DaemonOptions) -> PathBuf {
    opts.session_dir.clone().unwrap_or_else(|| opts.state_dir.join(SESSIONS))
}

/// Creates a session's folder, and the sessions folder above it, private
/// to the daemon (0700 whatever the umask; a symlink in their place is
/// refused: `vnpu_device::private_dir`), and makes the files an older
/// daemon left in it private (0600). Runs on the main thread: the
/// instance threads may not change modes.
fn private_session_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    if let Some(sessions) = dir.parent() {
        vnpu_device::private_dir(sessions)?;
    }
    vnpu_device::private_dir(dir)?;
    vnpu_device::private_files(dir)
}

/// Removes the kept sessions of instances that no longer exist.
fn prune_sessions(opts: &DaemonOptions, instances: &[Instance]) {
    let Ok(dir) = std::fs::read_dir(sessions_root(opts)) else { return };
    for e in dir.flatten() {
        let name = e.file_name();
        if !instances.iter().any(|i| std::ffi::OsStr::new(&i.uuid) == name) {
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                log::warn!("{}: {err}", e.path().display());
            }
        }
    }
}

/// Ends the instances whose client was asked to release the device: once
/// it has let go, or at their deadline (then it is cut off).
fn finish_releases(served: &mut Served, now: Instant) {
    let done: Vec<String> = served
        .iter()
        .filter(|(_, s)| s.releasing.is_some_and(|deadline| now >= deadline || !s.server.attached()))
        .map(|(u, _)| u.clone())
        .collect();
    for u in done {
        if let Some(mut s) = served.remove(&u) {
            if s.server.attached() {
                log::warn!("{u}: its client did not release the device in time; cut off");
            } else {
                log::info!("{u}: its client released the device");
            }
            s.server.stop();
            log::info!("{u}: no longer served");
        }
    }
}
