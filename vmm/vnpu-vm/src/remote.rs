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

/// A PCI function whose device model runs in a vfio-user server.
pub struct RemoteFunction {
    path: String,
    client: Mutex<Client>,
    config: ConfigSpace,
    msix: Msix,
    table: MsixTable,
    slot: usize,
    vm: Arc<VmFd>,
    routes: Arc<Mutex<MsiRoutes>>,
    /// Whether each vector's irqfd is assigned in KVM now.
    live: Vec<bool>,
    /// The vectors' irqfds (the server signals them).
    irqfds: Vec<EventFd>,
    /// The server's ioeventfds (BAR 0 offset, eventfd).
    ioevents: Vec<(u64, EventFd)>,
    /// The connection failed: reads return all ones, writes are dropped.
    broken: bool,
    /// Stops the thread that watches the connection.
    watch_stop: EventFd,
}

/// How often a dead server's vectors are signalled again.
const DEAD_SERVER_WAKE: libc::c_int = 10; // ms

/// Waits for the server to hang up (or `stop`). From then on it signals
/// every vector's irqfd, and again every [`DEAD_SERVER_WAKE`] ms until
/// `stop`, so a guest waiting for an interrupt wakes, reads the device
/// (all ones now: failed) and sees the error instead of waiting for a
/// completion that cannot come. Once is not enough: a guest that took
/// that interrupt as the completion of a request already done, then
/// submits another and halts, would never wake again.
fn watch(path: String, conn: std::os::unix::net::UnixStream, stop: EventFd, irqfds: Vec<EventFd>) {
    let mut fds = [
        libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 },
        libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
    ];
    let mut hung_up = false;
    loop {
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
        if !hung_up && fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            eprintln!("vnpu: vfio-user server {path} hung up; the device reads as failed from now on");
            hung_up = true;
            // Nothing more to hear from it.
            fds[0].fd = -1;
        }
        if hung_up {
            for f in &irqfds {
                let _ = f.write(1);
            }
        }
    }
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
    ) -> Result<Self, RemoteError> {
        let name = path.display().to_string();
        let client_err = |source| RemoteError::Client { path: name.clone(), source };
        let mut client = Client::new_with_timeout(path, Some(ATTACH_TIMEOUT)).map_err(|e| match e {
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
        for r in memory.iter() {
            let fo = r.file_offset().ok_or(RemoteError::NotShared)?;
            client
                .dma_map(fo.start(), r.start_addr().0, r.len(), fo.file().as_raw_fd())
                .map_err(client_err)?;
        }
        // One irqfd per vector, routed by the table here.
        let irqfds = {
            let mut r = routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (0..vectors).map(|v| r.irqfd(&vm, slot, v)).collect::<Result<Vec<_>, _>>()?
        };
        let raw: Vec<i32> = irqfds.iter().map(|f| f.as_raw_fd()).collect();
        let flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
        client.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, flags, 0, u32::from(vectors), &raw).map_err(client_err)?;
        // Doorbells as ioeventfds, when the server offers them.
        let ioevents = match client.get_region_io_fds(0) {
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
        };
        let watch_stop = EventFd::new(0).map_err(RemoteError::Io)?;
        {
            let conn = client.connection().map_err(RemoteError::Io)?;
            let stop = watch_stop.try_clone().map_err(RemoteError::Io)?;
            let fds = irqfds
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()
                .map_err(RemoteError::Io)?;
            let path = name.clone();
            std::thread::Builder::new()
                .name("vfio-user watch".into())
                .spawn(move || watch(path, conn, stop, fds))
                .map_err(RemoteError::Io)?;
        }
        let mut f = Self {
            watch_stop,
            path: name,
            client: Mutex::new(client),
            config,
            msix,
            table: MsixTable::new(vectors),
            slot,
            vm,
            routes,
            live: vec![true; usize::from(vectors)],
            irqfds,
            ioevents,
            broken: false,
        };
        // Every vector starts masked (and MSI-X disabled): no irqfd yet.
        f.sync_vectors();
        Ok(f)
    }

    /// The server's ioeventfds: (BAR 0 offset, eventfd) for KVM.
    pub fn ioevents(&self) -> std::io::Result<Vec<(u64, EventFd)>> {
        self.ioevents.iter().map(|(o, e)| Ok((*o, e.try_clone()?))).collect()
    }

    fn client(&self) -> std::sync::MutexGuard<'_, Client> {
        self.client.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn fail(&mut self, e: vfio_user::Error) {
        if !self.broken {
            eprintln!("vnpu: vfio-user server {}: {e}; the device reads as all ones from now on", self.path);
        }
        self.broken = true;
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
        if !self.broken && !bars.contains(&offset) {
            let mut data = vec![0u8; len];
            self.config.read(offset, &mut data);
            let r = self.client().region_write(VFIO_PCI_CONFIG_REGION_INDEX, offset as u64, &data);
            if let Err(e) = r {
                self.fail(e);
            }
        }
        self.sync_vectors();
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
                            && self.irqfds.get(v).is_some_and(|fd| readable(fd.as_raw_fd()));
                        byte | (u8::from(pending) << b)
                    });
                }
            }
            None if self.broken => data.fill(0xff),
            None => {
                let r = self.client().region_read(region_index(bar), offset, data);
                if let Err(e) = r {
                    data.fill(0xff);
                    self.fail(e);
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
            None if self.broken => {}
            None => {
                let r = self.client().region_write(region_index(bar), offset, data);
                if let Err(e) = r {
                    self.fail(e);
                }
            }
        }
    }
}

/// The vfio-user region index of BAR `bar` (0..6); an index past `u32`
/// becomes one no server has, so the request fails instead of wrapping.
fn region_index(bar: usize) -> u32 {
    u32::try_from(bar).unwrap_or(u32::MAX)
}
