//! A PCI function served by another process over vfio-user (the board
//! daemon, `docs/vfio-user.md`): this VMM is the client.
//!
//! Configuration space is mirrored locally from the server's at attach
//! time (IDs, class, BAR kinds and sizes, the MSI-X capability), as
//! QEMU's vfio-user-pci does, so BAR placement and MSI-X stay the VMM's;
//! every configuration write is forwarded too. BAR 0 accesses go to the
//! server as region reads and writes, except the doorbells, which the
//! server hands over as ioeventfds (`GET_REGION_IO_FDS`) for KVM. The
//! MSI-X table lives here: each vector is a KVM irqfd handed to the server
//! by `SET_IRQS`, routed by this table's entry, and deassigned while the
//! vector is masked (KVM delivers it on reassignment if it fired meanwhile,
//! which is the pending bit). Guest RAM is shared with `DMA_MAP` of the
//! memfd it lives in.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::path::Path;
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use thiserror::Error;
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_CONFIG_REGION_INDEX,
    VFIO_PCI_MSIX_IRQ_INDEX,
};
use vfio_user::Client;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;
use vnpu_pci::{Bar, BarKind, ConfigSpace, Identity, MsixCap, MsixTable, PciFunction, CAP_ID_MSIX};

use crate::irq::MsiRoutes;

/// Why a remote function could not be attached.
#[derive(Debug, Error)]
pub enum RemoteError {
    #[error("vfio-user server {path}: {source}")]
    Client {
        path: String,
        #[source]
        source: vfio_user::Error,
    },
    #[error(
        "vfio-user server {path} serves another VMM (one VMM per vNPU at a time; is the VM running already?)"
    )]
    Busy { path: String },
    #[error(
        "vfio-user server {path} did not answer within {} s (is the board daemon hung, or is another program holding the socket?)",
        ATTACH_TIMEOUT.as_secs()
    )]
    NoAnswer { path: String },
    #[error("vfio-user server {path}: {what}")]
    Device { path: String, what: String },
    #[error("guest memory is not in a shared file (needed to share it with the server)")]
    NotShared,
    #[error("watching the connection: {0}")]
    Io(std::io::Error),
    #[error("PCI layout: {0}")]
    Pci(#[from] vnpu_pci::PciError),
    #[error("MSI-X routing: {0}")]
    Irq(#[from] crate::irq::IrqError),
}

/// How long attaching waits for the server's answers (the version and
/// region handshake) before it gives up.
pub const ATTACH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a handshake failed because the server did not answer in time.
fn timed_out(e: &vfio_user::Error) -> bool {
    let slow =
        |k: std::io::ErrorKind| matches!(k, std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut);
    match e {
        vfio_user::Error::StreamRead(io) | vfio_user::Error::StreamWrite(io) => slow(io.kind()),
        vfio_user::Error::ReceiveWithFd(errno) => matches!(errno.errno(), libc::EAGAIN | libc::ETIMEDOUT),
        _ => false,
    }
}

/// The function's MSI-X capability and where its table and PBA sit.
#[derive(Clone, Copy, Debug)]
struct Msix {
    cap: MsixCap,
    table_bar: usize,
    table_offset: u64,
    pba_bar: usize,
    pba_offset: u64,
}

/// A function's BAR 0 ioeventfds (offset, eventfd) and the BAR address
/// they are registered at in KVM, if any. Shared by the VM (which moves
/// them with the BAR) and a remote function (which replaces them when it
/// reconnects to a restarted server).
#[derive(Debug, Default)]
pub struct IoEvents {
    pub events: Vec<(u64, EventFd)>,
    pub registered: Option<u64>,
}

impl IoEvents {
    /// Registers the ioeventfds at `base` (none: unregistered), moving them
    /// from where they were. Without them the doorbells still work,
    /// through MMIO exits to the function.
    pub fn place(&mut self, vm: &VmFd, base: Option<u64>) {
        use kvm_ioctls::{IoEventAddress, NoDatamatch};
        if base == self.registered {
            return;
        }
        if let Some(old) = self.registered.take() {
            for (off, fd) in &self.events {
                // Failing to remove one that was never added is harmless.
                if let Some(a) = old.checked_add(*off) {
                    let _ = vm.unregister_ioevent(fd, &IoEventAddress::Mmio(a), NoDatamatch);
                }
            }
        }
        if let Some(base) = base {
            let ok = self.events.iter().all(|(off, fd)| {
                base.checked_add(*off)
                    .is_some_and(|a| vm.register_ioevent(fd, &IoEventAddress::Mmio(a), NoDatamatch).is_ok())
            });
            self.registered = ok.then_some(base);
            if !ok {
                for (off, fd) in &self.events {
                    // (A BAR the guest placed so that this wraps registered nothing.)
                    if let Some(a) = base.checked_add(*off) {
                        let _ = vm.unregister_ioevent(fd, &IoEventAddress::Mmio(a), NoDatamatch);
                    }
                }
            }
        }
    }

    /// Swaps the ioeventfds for `events`, registered where the old ones were.
    pub fn replace(&mut self, vm: &VmFd, events: Vec<(u64, EventFd)>) {
        let base = self.registered;
        self.place(vm, None);
        self.events = events;
        self.place(vm, base);
    }
}

/// What reconnecting to a restarted server needs, shared by the function
/// (vCPU thread) and the thread that watches the connection.
struct Link {
    path: std::path::PathBuf,
    client: Mutex<Client>,
    /// This VMM's device session (`docs/vfio-user.md`, "Daemon restarts").
    session: u64,
    /// Guest RAM as mapped: (file, offset in it, guest address, length).
    memory: Vec<(std::fs::File, u64, u64, u64)>,
    /// The vectors' irqfds (the server signals them).
    irqfds: Vec<EventFd>,
    /// Configuration writes forwarded to the server, by offset (replayed
    /// to a restarted one).
    config: Mutex<std::collections::BTreeMap<usize, Vec<u8>>>,
    io: Arc<Mutex<IoEvents>>,
    vm: Arc<VmFd>,
    /// How long a hung-up server is waited for.
    reconnect: std::time::Duration,
    /// Bumped at each reconnection.
    generation: std::sync::atomic::AtomicU64,
    /// Given up on the server: reads return all ones, writes are dropped.
    broken: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The session capability a client sends (`docs/vfio-user.md`).
fn session_capability(id: u64, resume: bool) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert(vnpu_abi::device::SESSION_CAPABILITY.into(), serde_json::json!({ "id": id, "resume": resume }));
    m
}

/// Whether the server said it resumed the session.
fn resumed(c: &Client) -> bool {
    c.server_capabilities()
        .get(vnpu_abi::device::SESSION_CAPABILITY)
        .and_then(|s| s.get("resumed"))
        .and_then(serde_json::Value::as_bool)
        == Some(true)
}

/// A random session id (never 0, which names no session).
fn new_session() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom(2) fills at most the 8 bytes of `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let mut id = u64::from_ne_bytes(b);
    if n != 8 {
        // No entropy source: time and process make it unlikely to repeat.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        id = u64::try_from(t.as_nanos() & u128::from(u64::MAX)).unwrap_or(1)
            ^ u64::from(std::process::id()) << 32;
    }
    id.max(1)
}

impl Link {
    /// Attaches again to a restarted server: resumes the session, maps
    /// guest RAM, replays configuration writes, hands the irqfds over and
    /// takes the new doorbells.
    fn reattach(&self) -> Result<Client, String> {
        let mut c = Client::new_with_capabilities(
            &self.path,
            Some(ATTACH_TIMEOUT),
            session_capability(self.session, true),
        )
        .map_err(|e| e.to_string())?;
        if !resumed(&c) {
            return Err("the server did not resume this VM's device session (its state is gone)".into());
        }
        map_memory(&mut c, &self.memory).map_err(|e| format!("DMA_MAP: {e}"))?;
        for (off, data) in lock(&self.config).iter() {
            c.region_write(VFIO_PCI_CONFIG_REGION_INDEX, *off as u64, data)
                .map_err(|e| format!("configuration write: {e}"))?;
        }
        give_irqfds(&mut c, &self.irqfds).map_err(|e| format!("SET_IRQS: {e}"))?;
        let events = io_events(&mut c);
        let mut io = lock(&self.io);
        io.replace(&self.vm, events);
        // A doorbell the guest rang after the server took the ring up but
        // before the swap went to the old server's eventfd and is lost:
        // ring the new ones once, so the server looks at the ring again.
        for (_, e) in &io.events {
            let _ = e.write(1);
        }
        drop(io);
        Ok(c)
    }
}

/// Guest RAM (file, offset in it, guest address, length) shared with the
/// server by `DMA_MAP`.
fn map_memory(c: &mut Client, memory: &[(std::fs::File, u64, u64, u64)]) -> Result<(), vfio_user::Error> {
    memory.iter().try_for_each(|(f, offset, addr, len)| c.dma_map(*offset, *addr, *len, f.as_raw_fd()))
}

/// The MSI-X vectors' irqfds handed to the server (`SET_IRQS`).
fn give_irqfds(c: &mut Client, irqfds: &[EventFd]) -> Result<(), vfio_user::Error> {
    let raw: Vec<i32> = irqfds.iter().map(|f| f.as_raw_fd()).collect();
    let flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    let n = u32::try_from(raw.len()).unwrap_or(u32::MAX);
    c.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, flags, 0, n, &raw)
}

/// The server's BAR 0 ioeventfds, when it offers them.
fn io_events(client: &mut Client) -> Vec<(u64, EventFd)> {
    match client.get_region_io_fds(0) {
        Ok(list) => list
            .into_iter()
            .filter(|(s, _)| s.flags == 0)
            .map(|(s, f)| {
                // SAFETY: `into_raw_fd` gives up the File's ownership
                // of the descriptor, which the EventFd takes over.
                (s.offset, unsafe { EventFd::from_raw_fd(f.into_raw_fd()) })
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Saves and restores a served device's state by vfio-user migration
/// v2 (`VFIO_USER_DEVICE_FEATURE` with the migration states,
/// `MIG_DATA_READ`/`WRITE`), stop-and-copy only.
#[derive(Clone)]
pub struct MigrationHandle {
    link: Arc<Link>,
    path: String,
    /// Where this VMM moved the device: `PRE_COPY` while it pre-copies,
    /// `RESUMING` while it takes pieces in, else `RUNNING` or `STOP`.
    state: Arc<Mutex<u32>>,
}

impl std::fmt::Debug for MigrationHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigrationHandle").field("path", &self.path).finish_non_exhaustive()
    }
}

/// The most bytes one `MIG_DATA_READ` or `WRITE` carries.
const MIG_CHUNK: u32 = 1 << 20;

impl MigrationHandle {
    fn client_err(&self) -> impl Fn(vfio_user::Error) -> RemoteError + '_ {
        |source| RemoteError::Client { path: self.path.clone(), source }
    }

    /// The server's migration flags (`VFIO_MIGRATION_*`).
    fn migration_flags(&self, c: &mut vfio_user::Client) -> Result<u64, RemoteError> {
        let migration = c
            .device_feature(
                vfio_user::VFIO_DEVICE_FEATURE_GET | vfio_user::VFIO_DEVICE_FEATURE_MIGRATION,
                &[],
            )
            .map_err(self.client_err())?;
        Ok(migration
            .get(..8)
            .map_or(0, |b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])))
    }

    fn set(&self, c: &mut vfio_user::Client, to: u32) -> Result<(), RemoteError> {
        c.set_migration_state(to).map_err(self.client_err())?;
        *lock(&self.state) = to;
        Ok(())
    }

    /// Stops the device and reads its whole state (after a pre-copy, the
    /// incremental rest); it stays stopped until [`Self::run`].
    pub fn save(&self) -> Result<Vec<u8>, RemoteError> {
        let mut c = lock(&self.link.client);
        if self.migration_flags(&mut c)? & vfio_user::VFIO_MIGRATION_STOP_COPY == 0 {
            return Err(RemoteError::Device {
                path: self.path.clone(),
                what: "the server cannot be migrated (no STOP_COPY)".into(),
            });
        }
        self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_STOP_COPY)?;
        let mut out = Vec::new();
        loop {
            let chunk = c.mig_data_read(MIG_CHUNK).map_err(self.client_err())?;
            let done = chunk.len() < MIG_CHUNK as usize;
            out.extend_from_slice(&chunk);
            if done {
                break;
            }
        }
        self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_STOP)?;
        Ok(out)
    }

    /// One pass of the device's pre-copy (`PRE_COPY`, entered at the first
    /// call; the device runs on): its pieces until the last of the pass,
    /// or none when none is due. A server without pre-copy gives none.
    pub fn precopy_pass(&self) -> Result<Vec<Vec<u8>>, RemoteError> {
        let mut c = lock(&self.link.client);
        if *lock(&self.state) != vfio_user::VFIO_DEVICE_STATE_PRE_COPY {
            if self.migration_flags(&mut c)? & vfio_user::VFIO_MIGRATION_PRE_COPY == 0 {
                return Ok(Vec::new());
            }
            self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_PRE_COPY)?;
        }
        let bad = |what: String| RemoteError::Device { path: self.path.clone(), what };
        let mut pieces = Vec::new();
        loop {
            let mut p = c.mig_data_read(MIG_CHUNK).map_err(self.client_err())?;
            if p.is_empty() {
                return Ok(pieces);
            }
            let want = vnpu_device::device_core::piece_len(&p)
                .ok_or_else(|| bad("a pre-copy read that is not a piece".into()))?;
            while (p.len() as u64) < want {
                let more = c.mig_data_read(MIG_CHUNK).map_err(self.client_err())?;
                if more.is_empty() {
                    return Err(bad(format!("a pre-copy piece cut at {} of {want} bytes", p.len())));
                }
                p.extend_from_slice(&more);
            }
            if p.len() as u64 != want {
                return Err(bad(format!("a pre-copy piece of {} bytes for {want}", p.len())));
            }
            let last = vnpu_device::device_core::piece_flags(&p).unwrap_or(0)
                & vnpu_device::device_core::LAST_OF_PASS
                != 0;
            pieces.push(p);
            if last {
                return Ok(pieces);
            }
        }
    }

    /// Ends a pre-copy without a stop: back to `RUNNING`.
    pub fn precopy_abort(&self) -> Result<(), RemoteError> {
        if *lock(&self.state) != vfio_user::VFIO_DEVICE_STATE_PRE_COPY {
            return Ok(());
        }
        let mut c = lock(&self.link.client);
        self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_RUNNING)
    }

    /// Writes pre-copy pieces of another device into this one
    /// (`RESUMING`, entered at the first call), before [`Self::load`].
    pub fn resume_write(&self, bytes: &[u8]) -> Result<(), RemoteError> {
        let mut c = lock(&self.link.client);
        if *lock(&self.state) != vfio_user::VFIO_DEVICE_STATE_RESUMING {
            self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_RESUMING)?;
        }
        for chunk in bytes.chunks(MIG_CHUNK as usize) {
            c.mig_data_write(chunk).map_err(self.client_err())?;
        }
        Ok(())
    }

    /// Starts logging the guest pages the device writes in `[0, ram)`
    /// (vfio-user `DMA_LOGGING_START`, 4 KiB pages).
    pub fn log_start(&self, ram: u64) -> Result<(), RemoteError> {
        // The page size, one range (a u32 count, a reserved u32), the range.
        let mut d = vnpu_device::LOG_PAGE.to_le_bytes().to_vec();
        d.extend_from_slice(&1u32.to_le_bytes());
        d.extend_from_slice(&0u32.to_le_bytes());
        d.extend_from_slice(&0u64.to_le_bytes());
        d.extend_from_slice(&ram.next_multiple_of(vnpu_device::LOG_PAGE).to_le_bytes());
        lock(&self.link.client)
            .device_feature(
                vfio_user::VFIO_DEVICE_FEATURE_SET | vfio_user::VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
                &d,
            )
            .map(drop)
            .map_err(self.client_err())
    }

    /// The pages of `[0, ram)` the device wrote since the last call (or
    /// the start), as bitmap words (bit `p % 64` of word `p / 64` is page
    /// `p`); the server clears them as it reports them.
    pub fn log_take(&self, ram: u64) -> Result<Vec<u64>, RemoteError> {
        const PIECE: u64 = 1 << 30;
        let page = vnpu_device::LOG_PAGE;
        let end = ram.next_multiple_of(page);
        let mut bytes = Vec::new();
        let mut at = 0u64;
        let mut c = lock(&self.link.client);
        while at < end {
            let len = (end - at).min(PIECE);
            let mut d = Vec::with_capacity(24);
            for w in [at, len, page] {
                d.extend_from_slice(&w.to_le_bytes());
            }
            let r = c
                .device_feature(
                    vfio_user::VFIO_DEVICE_FEATURE_GET | vfio_user::VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT,
                    &d,
                )
                .map_err(self.client_err())?;
            let want = usize::try_from((len / page).div_ceil(8)).unwrap_or(usize::MAX);
            let bitmap = r.get(24..).filter(|b| b.len() == want).ok_or_else(|| RemoteError::Device {
                path: self.path.clone(),
                what: format!("a DMA log report of {} bytes for {want} bytes of bitmap", r.len()),
            })?;
            bytes.extend_from_slice(bitmap);
            at += len;
        }
        // 1 GiB pieces are whole words, so the bytes line up.
        Ok(bytes
            .chunks(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(w)
            })
            .collect())
    }

    /// Stops the device's DMA log.
    pub fn log_stop(&self) -> Result<(), RemoteError> {
        lock(&self.link.client)
            .device_feature(
                vfio_user::VFIO_DEVICE_FEATURE_SET | vfio_user::VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP,
                &[],
            )
            .map(drop)
            .map_err(self.client_err())
    }

    /// Lets the stopped device run again.
    pub fn run(&self) -> Result<(), RemoteError> {
        let mut c = lock(&self.link.client);
        self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_RUNNING)
    }

    /// Gives the device a state [`Self::save`] read (from this server or
    /// another; after [`Self::resume_write`] of its pre-copy pieces) and
    /// lets it run.
    pub fn load(&self, bytes: &[u8]) -> Result<(), RemoteError> {
        self.resume_write(bytes)?;
        let mut c = lock(&self.link.client);
        self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_STOP)?;
        self.set(&mut c, vfio_user::VFIO_DEVICE_STATE_RUNNING)
    }
}

/// Default of how long a VMM waits for a hung-up server to come back.
pub const DEFAULT_RECONNECT: std::time::Duration = std::time::Duration::from_secs(60);

/// A PCI function whose device model runs in a vfio-user server.
pub struct RemoteFunction {
    path: String,
    link: Arc<Link>,
    config: ConfigSpace,
    msix: Msix,
    table: MsixTable,
    slot: usize,
    vm: Arc<VmFd>,
    routes: Arc<Mutex<MsiRoutes>>,
    /// Whether each vector's irqfd is assigned in KVM now.
    live: Vec<bool>,
    /// Stops the thread that watches the connection.
    watch_stop: EventFd,
    /// Said once: the server is gone for good.
    failed_said: bool,
}

/// How often a dead server's vectors are signalled again.
const DEAD_SERVER_WAKE: libc::c_int = 10; // ms

/// First and longest pause between attempts to reach a restarted server.
const BACKOFF_FIRST: std::time::Duration = std::time::Duration::from_millis(20);
const BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// Waits for the server to hang up (or `stop`). Then it attaches to the
/// server restarted at the same path, with back-off, for up to the link's
/// reconnect time, holding the connection's lock (the vCPUs' accesses to
/// the device wait meanwhile, as for a slow device): the device session
/// resumes, and every vector is signalled once so a driver waiting for a
/// completion looks again. When the server does not come back, the device
/// reads as failed (all ones) from then on and every vector is signalled
/// every [`DEAD_SERVER_WAKE`] ms until `stop`, so a guest waiting for an
/// interrupt wakes and sees the error instead of waiting for a completion
/// that cannot come (once is not enough: a guest that took that interrupt
/// as the completion of a request already done, then submits another and
/// halts, would never wake again).
fn watch(link: Arc<Link>, mut conn: std::os::unix::net::UnixStream, stop: EventFd) {
    let name = link.path.display().to_string();
    let mut hung_up = false;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: if hung_up { -1 } else { conn.as_raw_fd() },
                events: libc::POLLRDHUP,
                revents: 0,
            },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let timeout = if hung_up { DEAD_SERVER_WAKE } else { -1 };
        // SAFETY: poll(2) on two pollfds this function owns for the whole
        // call (a negative fd is ignored); it only fills in `revents`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if fds[1].revents != 0 || n < 0 {
            return;
        }
        if hung_up {
            for f in &link.irqfds {
                let _ = f.write(1);
            }
            continue;
        }
        if fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0 {
            continue;
        }
        eprintln!(
            "vnpu: vfio-user server {name} hung up; reconnecting for up to {} s",
            link.reconnect.as_secs()
        );
        let t0 = std::time::Instant::now();
        let mut client = lock(&link.client);
        let mut pause = BACKOFF_FIRST;
        let mut last = String::new();
        let mut unserved: Option<std::time::Instant> = None;
        let next = loop {
            match link.reattach() {
                Ok(c) => break Some(c),
                Err(e) => last = e,
            }
            if t0.elapsed() >= link.reconnect || stop_requested(&stop) {
                break None;
            }
            // A board daemon that answers on its control socket but no
            // longer has this vNPU's socket stopped serving it (`vnpu
            // stop`, `remove`): nothing will come back. A moment's grace
            // for a daemon that is starting (its instance sockets come
            // just after its control socket).
            if daemon_answers_without(&link.path) {
                let since = *unserved.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() >= UNSERVED_GRACE {
                    last = "the board daemon runs but no longer serves this vNPU".into();
                    break None;
                }
            } else {
                unserved = None;
            }
            std::thread::sleep(pause.min(link.reconnect.saturating_sub(t0.elapsed())));
            pause = (pause * 2).min(BACKOFF_MAX);
        };
        match next.and_then(|c| c.connection().ok().map(|k| (c, k))) {
            Some((c, k)) => {
                *client = c;
                conn = k;
                link.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(client);
                eprintln!(
                    "vnpu: vfio-user server {name} is back after {} ms; device session resumed",
                    t0.elapsed().as_millis()
                );
                for f in &link.irqfds {
                    let _ = f.write(1);
                }
            }
            None => {
                link.broken.store(true, std::sync::atomic::Ordering::SeqCst);
                drop(client);
                eprintln!("vnpu: vfio-user server {name} did not come back ({last}); the device reads as failed from now on");
                hung_up = true;
            }
        }
    }
}

/// How long a daemon may answer without serving this vNPU before the
/// VMM stops waiting for it.
const UNSERVED_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether a board daemon answers on the control socket beside `path`
/// (`control.sock`, `docs/management.md`) while `path` itself is gone.
fn daemon_answers_without(path: &Path) -> bool {
    !path.exists()
        && path
            .parent()
            .is_some_and(|d| std::os::unix::net::UnixStream::connect(d.join("control.sock")).is_ok())
}

/// Whether `stop` was signalled (without consuming it).
fn stop_requested(stop: &EventFd) -> bool {
    readable(stop.as_raw_fd())
}

impl Drop for RemoteFunction {
    fn drop(&mut self) {
        let _ = self.watch_stop.write(1);
    }
}

impl std::fmt::Debug for RemoteFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteFunction")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl RemoteFunction {
    /// Attaches to the server at `path` as the function in `slot`: mirrors
    /// its configuration space, shares `memory` (which must be backed by
    /// a file, e.g. a sealed memfd), hands over one irqfd per MSI-X vector
    /// and takes its ioeventfds.
    pub fn attach(
        path: &Path,
        slot: usize,
        memory: &GuestMemoryMmap<()>,
        vm: Arc<VmFd>,
        routes: Arc<Mutex<MsiRoutes>>,
        reconnect: std::time::Duration,
    ) -> Result<Self, RemoteError> {
        let name = path.display().to_string();
        let client_err = |source| RemoteError::Client { path: name.clone(), source };
        let session = new_session();
        let mut client =
            Client::new_with_capabilities(path, Some(ATTACH_TIMEOUT), session_capability(session, false))
                .map_err(|e| match e {
                    vfio_user::Error::Reply { errno, .. } if errno == libc::EBUSY.unsigned_abs() => {
                        RemoteError::Busy { path: name.clone() }
                    }
                    e if timed_out(&e) => RemoteError::NoAnswer { path: name.clone() },
                    e => client_err(e),
                })?;
        let mut remote = [0u8; 256];
        for at in (0..256).step_by(4) {
            client
                .region_read(VFIO_PCI_CONFIG_REGION_INDEX, at as u64, &mut remote[at..at + 4])
                .map_err(client_err)?;
        }
        let id = Identity {
            vendor_id: le16(&remote, 0),
            device_id: le16(&remote, 2),
            class: le32(&remote, 8) >> 8,
            revision: remote[8],
            subsystem_vendor_id: le16(&remote, 0x2c),
            subsystem_id: le16(&remote, 0x2e),
        };
        let mut config = ConfigSpace::new(id);
        // BARs: kinds from the server's BAR registers, sizes from its regions.
        let mut bar = 0;
        while bar < 6 {
            let reg = le32(&remote, 0x10 + 4 * bar);
            let size = client.region(region_index(bar)).map_or(0, |r| r.size);
            let wide = reg & 1 == 0 && (reg >> 1) & 3 == 2;
            if size > 0 {
                let kind = if reg & 1 == 1 {
                    BarKind::Io
                } else if wide {
                    BarKind::Mem64 { prefetchable: reg & 8 != 0 }
                } else {
                    BarKind::Mem32
                };
                config.add_bar(bar, Bar { kind, size })?;
            }
            bar += if wide { 2 } else { 1 };
        }
        // MSI-X, found by walking the server's capability list.
        let mut msix = None;
        let mut cap = usize::from(remote[0x34]) & !3;
        let mut hops = 0;
        while cap >= 0x40 && cap + 12 <= 256 && hops < 48 {
            if remote[cap] == CAP_ID_MSIX {
                let vectors = (le16(&remote, cap + 2) & 0x7ff) + 1;
                let (t, p) = (le32(&remote, cap + 4), le32(&remote, cap + 8));
                let c = MsixCap::add(&mut config, vectors, (t & 7) as u8, t & !7, (p & 7) as u8, p & !7)?;
                msix = Some(Msix {
                    cap: c,
                    table_bar: (t & 7) as usize,
                    table_offset: u64::from(t & !7),
                    pba_bar: (p & 7) as usize,
                    pba_offset: u64::from(p & !7),
                });
                break;
            }
            cap = usize::from(remote[cap + 1]) & !3;
            hops += 1;
        }
        let msix = msix.ok_or_else(|| RemoteError::Device {
            path: name.clone(),
            what: "has no MSI-X capability".into(),
        })?;
        let vectors = msix.cap.vectors;
        // Guest RAM, shared by descriptor.
        // (kept, to share it again with a restarted server)
        let mapped = memory
            .iter()
            .map(|r| {
                let fo = r.file_offset().ok_or(RemoteError::NotShared)?;
                let file = fo.file().try_clone().map_err(RemoteError::Io)?;
                Ok((file, fo.start(), r.start_addr().0, r.len()))
            })
            .collect::<Result<Vec<_>, RemoteError>>()?;
        map_memory(&mut client, &mapped).map_err(client_err)?;
        // One irqfd per vector, routed by the table here.
        let irqfds = {
            let mut r = routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (0..vectors).map(|v| r.irqfd(&vm, slot, v)).collect::<Result<Vec<_>, _>>()?
        };
        give_irqfds(&mut client, &irqfds).map_err(client_err)?;
        // Doorbells as ioeventfds, when the server offers them.
        let io = Arc::new(Mutex::new(IoEvents { events: io_events(&mut client), registered: None }));
        let watch_stop = EventFd::new(0).map_err(RemoteError::Io)?;
        let conn = client.connection().map_err(RemoteError::Io)?;
        let stop = watch_stop.try_clone().map_err(RemoteError::Io)?;
        let link = Arc::new(Link {
            path: path.to_path_buf(),
            client: Mutex::new(client),
            session,
            memory: mapped,
            irqfds,
            config: Mutex::new(std::collections::BTreeMap::new()),
            io,
            vm: Arc::clone(&vm),
            reconnect,
            generation: std::sync::atomic::AtomicU64::new(0),
            broken: std::sync::atomic::AtomicBool::new(false),
        });
        {
            let link = Arc::clone(&link);
            std::thread::Builder::new()
                .name("vfio-user watch".into())
                .spawn(move || watch(link, conn, stop))
                .map_err(RemoteError::Io)?;
        }
        let mut f = Self {
            watch_stop,
            path: name,
            link,
            config,
            msix,
            table: MsixTable::new(vectors),
            slot,
            vm,
            routes,
            live: vec![true; usize::from(vectors)],
            failed_said: false,
        };
        // Every vector starts masked (and MSI-X disabled): no irqfd yet.
        f.sync_vectors();
        Ok(f)
    }

    /// A handle that saves and restores the served device's state
    /// through the server's vfio-user migration (`docs/migration.md`).
    pub fn migration_handle(&self) -> MigrationHandle {
        MigrationHandle {
            link: Arc::clone(&self.link),
            path: self.path.clone(),
            state: Arc::new(Mutex::new(vfio_user::VFIO_DEVICE_STATE_RUNNING)),
        }
    }

    /// The server's ioeventfds, (BAR 0 offset, eventfd) for KVM, which
    /// the VM registers where BAR 0 is; replaced when the function
    /// reconnects to a restarted server.
    pub fn ioevents(&self) -> Arc<Mutex<IoEvents>> {
        Arc::clone(&self.link.io)
    }

    fn broken(&self) -> bool {
        self.link.broken.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes `op` on the server; when the connection failed, waits for the
    /// watching thread to reconnect (or give up) and makes it once more.
    fn with_server<T>(
        &mut self,
        mut op: impl FnMut(&mut Client) -> Result<T, vfio_user::Error>,
    ) -> Option<T> {
        use std::sync::atomic::Ordering::SeqCst;
        for attempt in 0..2 {
            if self.broken() {
                break;
            }
            let generation = self.link.generation.load(SeqCst);
            let r = op(&mut lock(&self.link.client));
            let e = match r {
                Ok(v) => return Some(v),
                Err(e) => e,
            };
            if attempt == 1 {
                eprintln!("vnpu: vfio-user server {}: {e}", self.path);
                break;
            }
            // The watcher notices the hang-up within its poll; wait for it
            // to reconnect (it holds the client meanwhile) or give up.
            let limit = std::time::Instant::now() + self.link.reconnect + ATTACH_TIMEOUT;
            while self.link.generation.load(SeqCst) == generation && !self.broken() {
                if std::time::Instant::now() >= limit {
                    self.link.broken.store(true, SeqCst);
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
                drop(lock(&self.link.client));
            }
        }
        if !self.failed_said {
            eprintln!(
                "vnpu: vfio-user server {} is gone; the device reads as all ones from now on",
                self.path
            );
            self.failed_said = true;
        }
        None
    }

    /// Makes KVM's irqfds match the table: a vector is live while MSI-X is
    /// enabled, the function is not masked and its entry is not masked;
    /// its route follows its entry.
    fn sync_vectors(&mut self) {
        let cap = self.msix.cap;
        let on = cap.enabled(&self.config) && !cap.function_masked(&self.config);
        let mut routes = self.routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for v in 0..cap.vectors {
            let live = on && !self.table.is_masked(v);
            if live {
                if let Some(m) = self.table.entry_message(v) {
                    let _ = routes.set_route(&self.vm, self.slot, m);
                }
            }
            if self.live[usize::from(v)] != live {
                let _ = routes.set_irqfd_assigned(&self.vm, self.slot, v, live);
                self.live[usize::from(v)] = live;
            }
        }
    }

    fn in_table(&self, bar: usize, offset: u64) -> Option<(bool, u64)> {
        let m = self.msix;
        if bar == m.table_bar && (m.table_offset..m.table_offset + self.table.table_bytes()).contains(&offset)
        {
            return Some((true, offset - m.table_offset));
        }
        if bar == m.pba_bar && (m.pba_offset..m.pba_offset + self.table.pba_bytes()).contains(&offset) {
            return Some((false, offset - m.pba_offset));
        }
        None
    }
}

/// Whether an eventfd's counter is above zero, without consuming it.
fn readable(fd: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: poll(2) on one valid pollfd with a zero timeout; it only
    // fills in `revents`.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
}

impl PciFunction for RemoteFunction {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }
    fn config_written(&mut self, offset: usize, len: usize) {
        // BAR placement is the VMM's alone; everything else (command
        // register, MSI-X control) goes to the server too.
        let bars = 0x10..0x28;
        if !bars.contains(&offset) {
            let mut data = vec![0u8; len];
            self.config.read(offset, &mut data);
            lock(&self.link.config).insert(offset, data.clone());
            self.with_server(|c| c.region_write(VFIO_PCI_CONFIG_REGION_INDEX, offset as u64, &data));
        }
        self.sync_vectors();
    }
    fn save_state(&self) -> vnpu_pci::FunctionState {
        vnpu_pci::FunctionState { config: self.config.saved(), extra: self.table.saved() }
    }
    fn restore_state(&mut self, s: &vnpu_pci::FunctionState) -> Result<(), vnpu_pci::PciError> {
        self.config.restore(&s.config)?;
        self.table.restore(&s.extra)?;
        // What the server must see (the command register, MSI-X
        // control), as a guest's writes would give it; the BARs are ours.
        self.config_written(0x04, 2);
        let cap = self.msix.cap.offset;
        self.config_written(cap + 2, 2);
        Ok(())
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match self.in_table(bar, offset) {
            Some((true, at)) => self.table.read(at, data),
            Some((false, at)) => {
                // A vector that fired while masked is still counted in its
                // unassigned irqfd (KVM has not consumed it): that is its
                // pending bit.
                for (i, d) in data.iter_mut().enumerate() {
                    let first = (at + i as u64) * 8;
                    *d = (0..8u64).fold(0u8, |byte, b| {
                        // A vector past the table (or past usize) is not pending.
                        let v = usize::try_from(first + b).unwrap_or(usize::MAX);
                        let pending = self.live.get(v) == Some(&false)
                            && self.link.irqfds.get(v).is_some_and(|fd| readable(fd.as_raw_fd()));
                        byte | (u8::from(pending) << b)
                    });
                }
            }
            None => {
                if self.with_server(|c| c.region_read(region_index(bar), offset, data)).is_none() {
                    data.fill(0xff);
                }
            }
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match self.in_table(bar, offset) {
            Some((true, at)) => {
                self.table.write(at, data);
                self.sync_vectors();
            }
            Some((false, _)) => {}
            None => {
                self.with_server(|c| c.region_write(region_index(bar), offset, data));
            }
        }
    }
}

/// The vfio-user region index of BAR `bar` (0..6); an index past `u32`
/// becomes one no server has, so the request fails instead of wrapping.
fn region_index(bar: usize) -> u32 {
    u32::try_from(bar).unwrap_or(u32::MAX)
}
