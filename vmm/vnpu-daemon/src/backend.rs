//! One vNPU instance as a vfio-user device: the `ServerBackend` the
//! vfio-user server drives for one connected VMM (`docs/vfio-user.md`).
//!
//! Regions follow VFIO's PCI layout: region 0 is BAR 0 (registers,
//! mailbox, doorbells), region 2 is BAR 2 (MSI-X table and PBA: present
//! for a client that forwards it, though a VMM normally emulates it), and
//! region 7 is configuration space. Interrupt index 2 is MSI-X with the
//! function's vectors, raised by signalling the eventfds `SET_IRQS` gave.
//! Index 3 (error) takes one trigger and is never raised (the function
//! reports its errors in its own registers); index 4 (device request)
//! takes one trigger, raised when the daemon asks the client to release
//! the device ([`ReleaseRequest`]).
//! Guest memory arrives by `DMA_MAP` with a file descriptor and is mapped
//! with vm-memory; a range mapped without one (QEMU maps its ROMs so) is
//! recorded and stays out of the vNPU's reach. Everything here is input
//! from a client: a bad request fails with an errno and touches nothing
//! else.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use npu_model::BoardConfig;
use thiserror::Error;
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_INFO_EVENTFD, VFIO_IRQ_INFO_NORESIZE, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_NUM_IRQS, VFIO_PCI_NUM_REGIONS, VFIO_PCI_REQ_IRQ_INDEX, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, ServerBackend, ServerRegion, SubRegionIoEventFd};

use vmm_sys_util::eventfd::EventFd;
use vnpu_abi::device as abi;
use vnpu_device::{DeviceOptions, VectorSink, VnpuFunction, BAR0_SIZE, BAR2_SIZE, MSIX_VECTORS};
use vnpu_pci::PciFunction;
use vnpu_spec::VnpuSpec;

use crate::dma::DmaSpace;
pub use crate::dma::{MAX_DMA_BYTES, MAX_DMA_FILES, MAX_DMA_MAPS, MAX_DMA_RUNS};
/// Size of configuration space as served (the conventional 256 bytes).
pub const CONFIG_REGION_SIZE: u64 = 256;

/// Why a client's request failed (sent back as the errno of the reply).
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("region {0} does not exist or is empty")]
    NoRegion(u32),
    #[error(
        "access of {len} bytes at {offset:#x} is outside region {region}, or not 1, 2, 4 or 8 bytes of a BAR"
    )]
    BadAccess { region: u32, offset: u64, len: usize },
    #[error(transparent)]
    Dma(#[from] crate::dma::DmaError),
    #[error("SET_IRQS: {0}")]
    Irqs(String),
    #[error("the vNPU function: {0}")]
    Device(#[from] vnpu_device::DeviceError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl BackendError {
    fn errno(&self) -> i32 {
        match self {
            BackendError::Dma(e) => e.errno(),
            BackendError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            BackendError::Device(_) => libc::EIO,
            _ => libc::EINVAL,
        }
    }
}

impl From<BackendError> for std::io::Error {
    fn from(e: BackendError) -> Self {
        log::warn!("vfio-user request refused: {e}");
        std::io::Error::from_raw_os_error(e.errno())
    }
}

/// The MSI-X eventfds a client handed over with `SET_IRQS`, one slot
/// per vector.
#[derive(Debug)]
pub struct Vectors(Mutex<Vec<Option<File>>>);

impl VectorSink for Vectors {
    fn signal(&self, vector: u16) {
        let v = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(Some(fd)) = v.get(usize::from(vector)) {
            // An eventfd write adds 1 to its counter; a full counter means
            // the VMM has an interrupt pending already.
            let _ = (&*fd).write(&1u64.to_ne_bytes());
        }
    }
}

/// Size of VFIO PCI region `index` as a vNPU function serves it (0: absent).
fn region_size(index: u32) -> u64 {
    match index {
        0 => BAR0_SIZE,
        2 => BAR2_SIZE,
        VFIO_PCI_CONFIG_REGION_INDEX => CONFIG_REGION_SIZE,
        _ => 0,
    }
}

/// The regions a vNPU function serves, in VFIO PCI order.
pub fn regions() -> Vec<ServerRegion> {
    (0..VFIO_PCI_NUM_REGIONS)
        .map(|index| {
            let size = region_size(index);
            let flags = if size > 0 { VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE } else { 0 };
            ServerRegion {
                region_info: vfio_bindings::bindings::vfio::vfio_region_info {
                    // A 32-byte struct: the cast cannot truncate.
                    #[allow(clippy::cast_possible_truncation)]
                    argsz: std::mem::size_of::<vfio_bindings::bindings::vfio::vfio_region_info>() as u32,
                    flags,
                    index,
                    cap_offset: 0,
                    size,
                    offset: 0,
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            }
        })
        .collect()
}

/// The interrupts a vNPU function serves: MSI-X with the function's
/// vectors, and one trigger each for the error and device-request indexes
/// (QEMU warns `Could not enable error recovery` when the error index has
/// none, and asks the guest to unplug the device when the request one is
/// raised).
pub fn irqs() -> Vec<IrqInfo> {
    (0..VFIO_PCI_NUM_IRQS)
        .map(|index| match index {
            VFIO_PCI_MSIX_IRQ_INDEX => IrqInfo {
                index,
                flags: VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE,
                count: u32::from(MSIX_VECTORS),
            },
            VFIO_PCI_ERR_IRQ_INDEX | VFIO_PCI_REQ_IRQ_INDEX => {
                IrqInfo { index, flags: VFIO_IRQ_INFO_EVENTFD, count: 1 }
            }
            _ => IrqInfo { index, flags: 0, count: 0 },
        })
        .collect()
}

/// The device-request trigger of whichever client is attached to an
/// instance (interrupt index 4): the daemon raises it to ask that client
/// to release the device (QEMU then unplugs it from its guest) before it
/// cuts the client off. Shared between the instance's server and each
/// backend; a backend's trigger goes when that backend does.
#[derive(Debug, Default)]
pub struct ReleaseRequest {
    /// The trigger, with the id of the backend that set it.
    trigger: Mutex<Option<(u64, File)>>,
}

impl ReleaseRequest {
    /// Raises the attached client's device request. False when no client
    /// gave a trigger (or the write failed for another reason than a full
    /// counter, which leaves the request pending anyway): then nobody will
    /// release the device on request.
    pub fn raise(&self) -> bool {
        let t = self.trigger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some((_, file)) = t.as_ref() else { return false };
        // Non-blocking (interrupt_trigger made it so): never waits.
        // An eventfd takes its 8 bytes in one write or none.
        match (&*file).write_all(&1u64.to_ne_bytes()) {
            Ok(()) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }

    fn set(&self, owner: u64, trigger: Option<File>) {
        let mut t = self.trigger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *t = trigger.map(|f| (owner, f));
    }

    /// Drops `owner`'s trigger (and only its own).
    fn forget(&self, owner: u64) {
        let mut t = self.trigger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if t.as_ref().is_some_and(|(o, _)| *o == owner) {
            *t = None;
        }
    }
}

/// Ids of backends, for [`ReleaseRequest::forget`].
static BACKEND_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One connected client's view of a vNPU instance.
pub struct VnpuBackend {
    /// Declared first, so dropped before `function`: a device parked for
    /// a migration is let go before its worker is stopped and joined.
    migration: crate::migration::Migration,
    function: VnpuFunction,
    vectors: Arc<Vectors>,
    /// Doorbell eventfds handed out by `GET_REGION_IO_FDS` (kept open here).
    ioevents: Vec<(u64, EventFd)>,
    /// The error index's trigger (held, never raised).
    error_trigger: Option<File>,
    /// Where this client's device-request trigger goes.
    release: Arc<ReleaseRequest>,
    id: u64,
    /// The instance's session directory (state kept for a restart).
    store_dir: Option<std::path::PathBuf>,
    /// The session store this connection keeps the vNPU in, once opened.
    store: Option<Arc<vnpu_device::SessionStore>>,
    /// This client resumed a session: its ring is taken up once it has
    /// given its MSI-X triggers (its memory is mapped by then).
    resuming: bool,
    /// Who this connection's client is (`SO_PEERCRED`), when known: a
    /// session starts as this client's, and resumes only for it.
    client: Option<vnpu_device::Client>,
    /// The client's DMA mappings. Declared after `function`, so dropped
    /// after it: the function's worker (joined when it drops) reaches
    /// guest memory through views into the mappings this owns.
    dma: DmaSpace,
}

impl Drop for VnpuBackend {
    fn drop(&mut self) {
        self.release.forget(self.id);
    }
}

impl std::fmt::Debug for VnpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VnpuBackend").field("function", &self.function).finish_non_exhaustive()
    }
}

/// Makes `file` an interrupt trigger the device can always signal: it must
/// be an eventfd (a pipe or socket given as a trigger could fill up and
/// block the instance's worker in `write(2)`, with the daemon's locks held
/// by whoever waits for it), and it is switched to non-blocking, so that a
/// counter the client filled to its maximum makes the write fail (the
/// interrupt is pending anyway) instead of waiting.
fn interrupt_trigger(file: File) -> Result<File, BackendError> {
    let fd = file.as_raw_fd();
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).map_err(BackendError::Io)?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(BackendError::Irqs(format!(
            "an interrupt trigger must be an eventfd, not {}",
            link.display()
        )));
    }
    // SAFETY: F_GETFL and F_SETFL on a descriptor we own change only its
    // open file description's status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(BackendError::Io(std::io::Error::last_os_error()));
    }
    Ok(file)
}

impl VnpuBackend {
    /// A fresh function for `spec` on `board` (its cores placed as `opts`
    /// say), named `name`, with no guest memory and no interrupts yet.
    pub fn new(
        spec: &VnpuSpec,
        board: &BoardConfig,
        name: &str,
        opts: DeviceOptions,
    ) -> Result<Self, BackendError> {
        let vectors = Arc::new(Vectors(Mutex::new((0..MSIX_VECTORS).map(|_| None).collect())));
        let function = VnpuFunction::served(spec, board, vectors.clone(), name, opts)?;
        let ioevents = function.ioevents()?;
        let limit = usize::try_from(vnpu_device::device_core::stream_limit(spec)).unwrap_or(usize::MAX);
        Ok(Self {
            migration: crate::migration::Migration::new(function.state_handle(), limit),
            function,
            vectors,
            ioevents,
            error_trigger: None,
            release: Arc::default(),
            id: BACKEND_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            store_dir: None,
            store: None,
            resuming: false,
            client: None,
            dma: DmaSpace::default(),
        })
    }

    /// This backend keeping the vNPU's state in `dir` (an existing
    /// directory, the instance's own) for a restarted daemon.
    pub fn with_store(mut self, dir: std::path::PathBuf) -> Self {
        self.store_dir = Some(dir);
        self
    }

    /// This backend serving `client` (its socket peer's process and user).
    pub fn for_client(mut self, client: vnpu_device::Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The client's `VERSION` capabilities: a session it names (`id`) and
    /// asks to resume (`resume`) is resumed when the store holds that
    /// session; otherwise a new one starts under the id (0 when it gave
    /// none). The answer says which.
    fn session(
        &mut self,
        client: &serde_json::Map<String, serde_json::Value>,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut answer = serde_json::Map::new();
        // One session per connection: a client that sends `VERSION` again
        // gets no second one (nor the disk work of starting it).
        let Some(dir) = self.store_dir.take() else { return answer };
        let asked = client.get(abi::SESSION_CAPABILITY);
        let id = asked.and_then(|a| a.get("id")).and_then(serde_json::Value::as_u64).unwrap_or(0);
        let resume = asked.and_then(|a| a.get("resume")).and_then(serde_json::Value::as_bool) == Some(true);
        let store = match vnpu_device::SessionStore::open(&dir) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                log::warn!("{}: session store: {e}; this session cannot be resumed", dir.display());
                return answer;
            }
        };
        let held = resume && id != 0 && store.session() == Some(id);
        // Only the client the session was started for takes it up: the
        // same process and user. Anyone else who names it gets a device
        // of its own that keeps nothing, and the session stays as it is
        // for its client.
        if held && (self.client.is_none() || store.client() != self.client) {
            log::warn!(
                "{}: a client ({:?}) asked to resume a session that is not its own; refused, the session is kept",
                dir.display(),
                self.client
            );
            if asked.is_some() {
                answer.insert(
                    abi::SESSION_CAPABILITY.into(),
                    serde_json::json!({ "id": id, "resumed": false }),
                );
            }
            return answer;
        }
        let resumed = held;
        if !resumed {
            let begun = match self.client {
                Some(c) => store.begin_for(id, c),
                None => store.begin(id),
            };
            if let Err(e) = begun {
                store.invalidate(&format!("starting a session: {e}"));
            }
        }
        self.resuming = resumed;
        self.store = Some(Arc::clone(&store));
        self.function.keep_in(store, resumed);
        // Said only to a client that named a session: QEMU warns
        // `spurious capabilities` about a key it does not know.
        if asked.is_some() {
            answer
                .insert(abi::SESSION_CAPABILITY.into(), serde_json::json!({ "id": id, "resumed": resumed }));
        }
        answer
    }

    /// Ends the backend for a client that left for good (not a daemon
    /// that stops or dies): the vNPU's worker stops, then its kept
    /// session is forgotten (record, programs and memories zeroed), so a
    /// tenant's data does not outlive its VM on disk.
    pub fn close_for_good(self) {
        let store = self.store.clone();
        drop(self);
        if let Some(store) = store {
            if let Err(e) = store.forget() {
                log::warn!("forgetting a session: {e}");
            }
        }
    }

    /// This backend with its device-request trigger going to `release`
    /// (the instance's, which the daemon raises).
    pub fn with_release(mut self, release: Arc<ReleaseRequest>) -> Self {
        self.release = release;
        self
    }

    fn map(&mut self, offset: u64, address: u64, size: u64, fd: Option<File>) -> Result<(), BackendError> {
        let reaches = fd.is_some();
        log::debug!("DMA_MAP address {address:#x} size {size:#x} offset {offset:#x} file {reaches}");
        self.dma.map(offset, address, size, fd)?;
        if reaches {
            self.function.set_memory_watched(self.dma.memory().clone(), self.dma.watch());
        }
        Ok(())
    }

    fn unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> Result<(), BackendError> {
        log::debug!("DMA_UNMAP flags {:#x} address {address:#x} size {size:#x}", flags.bits());
        self.dma.unmap(flags.contains(DmaUnmapFlags::UNMAP_ALL), address, size)?;
        self.function.set_memory_watched(self.dma.memory().clone(), self.dma.watch());
        Ok(())
    }

    /// A resumed session takes its ring up (once): when its client has
    /// given its MSI-X triggers (its memory is mapped by then).
    fn take_up_resumed(&mut self) {
        if std::mem::take(&mut self.resuming) {
            self.function.resume();
        }
    }

    /// A resumed session whose client touches the device before it gave
    /// its MSI-X triggers takes its ring up now.
    fn resume_on_bar_access(&mut self, region: u32) {
        if region != VFIO_PCI_CONFIG_REGION_INDEX {
            self.take_up_resumed();
        }
    }

    fn check_access(region: u32, offset: u64, len: usize) -> Result<(), BackendError> {
        let size = region_size(region);
        if size == 0 {
            return Err(BackendError::NoRegion(region));
        }
        let fits = offset.checked_add(len as u64).is_some_and(|end| end <= size);
        // Configuration space is read and written in any length (QEMU reads
        // all of it at once); registers only as the CPU accesses them.
        let width_ok =
            if region == VFIO_PCI_CONFIG_REGION_INDEX { len > 0 } else { matches!(len, 1 | 2 | 4 | 8) };
        if !fits || !width_ok {
            return Err(BackendError::BadAccess { region, offset, len });
        }
        Ok(())
    }

    fn irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<(), BackendError> {
        if flags & VFIO_IRQ_SET_ACTION_TRIGGER == 0 {
            return Err(BackendError::Irqs("only the TRIGGER action is supported (the VMM masks)".into()));
        }
        if index == VFIO_PCI_ERR_IRQ_INDEX || index == VFIO_PCI_REQ_IRQ_INDEX {
            return self.single_trigger(index, flags, start, count, fds);
        }
        if index != VFIO_PCI_MSIX_IRQ_INDEX {
            return Err(BackendError::Irqs(format!(
                "interrupt index {index} has no vectors (MSI-X is {VFIO_PCI_MSIX_IRQ_INDEX})"
            )));
        }
        // Checked before the vectors' lock is taken: nothing here blocks.
        let fds = fds.into_iter().map(interrupt_trigger).collect::<Result<Vec<_>, _>>()?;
        let mut v = self.vectors.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let range = start as usize..(start as usize).saturating_add(count as usize);
        if flags & VFIO_IRQ_SET_DATA_NONE != 0 && count == 0 {
            // Disable every vector of the index.
            v.iter_mut().for_each(|s| *s = None);
            return Ok(());
        }
        if flags & VFIO_IRQ_SET_DATA_EVENTFD == 0 {
            return Err(BackendError::Irqs("only eventfd data is supported".into()));
        }
        let slots = v.get_mut(range).ok_or_else(|| BackendError::Irqs("vectors out of range".into()))?;
        if fds.is_empty() {
            slots.iter_mut().for_each(|s| *s = None);
            return Ok(());
        }
        for (slot, file) in slots.iter_mut().zip(fds) {
            *slot = Some(file);
        }
        drop(v);
        self.take_up_resumed();
        Ok(())
    }

    /// `SET_IRQS` on the error or device-request index: one trigger (an
    /// eventfd, as for MSI-X), or none (`DATA_NONE`, or no descriptor).
    fn single_trigger(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<(), BackendError> {
        let none = flags & VFIO_IRQ_SET_DATA_NONE != 0 && count == 0;
        if !none && flags & VFIO_IRQ_SET_DATA_EVENTFD == 0 {
            return Err(BackendError::Irqs("only eventfd data is supported".into()));
        }
        if !none && (start != 0 || count != 1 || fds.len() > 1) {
            return Err(BackendError::Irqs(format!("interrupt index {index} has one vector")));
        }
        let trigger = fds.into_iter().next().map(interrupt_trigger).transpose()?;
        if index == VFIO_PCI_REQ_IRQ_INDEX {
            self.release.set(self.id, trigger);
        } else {
            self.error_trigger = trigger;
        }
        Ok(())
    }
}

/// A configuration-space offset the client sent (already checked against
/// the region's size by `check_access`).
fn config_offset(offset: u64) -> Result<usize, std::io::Error> {
    usize::try_from(offset).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

impl ServerBackend for VnpuBackend {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), std::io::Error> {
        Self::check_access(region, offset, data.len())?;
        self.resume_on_bar_access(region);
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX => self.function.config().read(config_offset(offset)?, data),
            bar => self.function.bar_read(bar as usize, offset, data),
        }
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        Self::check_access(region, offset, data.len())?;
        self.resume_on_bar_access(region);
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX => {
                let offset = config_offset(offset)?;
                self.function.config_mut().write(offset, data);
                self.function.config_written(offset, data.len());
            }
            bar => self.function.bar_write(bar as usize, offset, data),
        }
        Ok(())
    }

    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> Result<(), std::io::Error> {
        Ok(self.map(offset, address, size, fd)?)
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> Result<(), std::io::Error> {
        Ok(self.unmap(flags, address, size)?)
    }

    fn reset(&mut self) -> Result<(), std::io::Error> {
        self.migration.reset();
        self.function.bar_write(0, abi::regs::DEVICE_RESET, &1u32.to_le_bytes());
        Ok(())
    }

    fn device_feature(&mut self, flags: u32, data: &[u8]) -> Result<Vec<u8>, std::io::Error> {
        self.migration.feature(flags, data)
    }

    fn mig_data_read(&mut self, size: u32) -> Result<Vec<u8>, std::io::Error> {
        self.migration.read(size)
    }

    fn mig_data_write(&mut self, data: &[u8]) -> Result<(), std::io::Error> {
        self.migration.write(data)
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<(), std::io::Error> {
        Ok(self.irqs(index, flags, start, count, fds)?)
    }

    fn version(
        &mut self,
        client: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<serde_json::Map<String, serde_json::Value>, std::io::Error> {
        Ok(self.session(client))
    }

    fn region_io_fds(&mut self, region: u32) -> Result<Vec<(SubRegionIoEventFd, RawFd)>, std::io::Error> {
        if region != 0 {
            return Ok(Vec::new());
        }
        Ok(self
            .ioevents
            .iter()
            .map(|(offset, fd)| {
                (SubRegionIoEventFd { offset: *offset, size: 0, flags: 0, datamatch: 0 }, fd.as_raw_fd())
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryBackend;

    fn backend() -> VnpuBackend {
        let spec = VnpuSpec::parse("sa=1,vu=1,sram=4M,hbm=256M").expect("spec");
        VnpuBackend::new(&spec, &BoardConfig::default(), "test", DeviceOptions::default()).expect("backend")
    }

    /// A session resumes only for the client (process and user) it was
    /// started for: another that names its id gets `resumed: false` and a
    /// device that keeps nothing, and the session stays, so its own
    /// client still resumes it afterwards. Without credentials nobody
    /// resumes.
    #[test]
    fn a_session_resumes_only_for_the_client_it_belongs_to() {
        let dir = std::env::temp_dir().join(format!("vnpu-backend-owner-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        vnpu_device::prepare_files(&dir, 1).expect("files");
        let owner = vnpu_device::Client { pid: 4242, uid: 1000 };
        let ask = |resume: bool| {
            let mut m = serde_json::Map::new();
            m.insert(abi::SESSION_CAPABILITY.into(), serde_json::json!({ "id": 77, "resume": resume }));
            m
        };
        let resumed = |a: &serde_json::Map<String, serde_json::Value>| {
            a.get(abi::SESSION_CAPABILITY).and_then(|s| s.get("resumed")).and_then(serde_json::Value::as_bool)
        };
        let mut first = backend().with_store(dir.clone()).for_client(owner);
        assert_eq!(resumed(&first.session(&ask(false))), Some(false));
        // The daemon "restarts": the backend goes without forgetting.
        drop(first);
        for other in [
            Some(vnpu_device::Client { pid: 4243, uid: 1000 }),
            Some(vnpu_device::Client { pid: 4242, uid: 0 }),
            None,
        ] {
            let mut b = backend().with_store(dir.clone());
            if let Some(c) = other {
                b = b.for_client(c);
            }
            assert_eq!(resumed(&b.session(&ask(true))), Some(false), "{other:?}");
            assert!(b.store.is_none(), "{other:?} got the session's store");
        }
        let store = vnpu_device::SessionStore::open(&dir).expect("store");
        assert_eq!(store.session(), Some(77), "the session was kept for its client");
        assert_eq!(store.client(), Some(owner));
        drop(store);
        let mut again = backend().with_store(dir.clone()).for_client(owner);
        assert_eq!(resumed(&again.session(&ask(true))), Some(true));
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Configuration space reads in one piece (as QEMU reads it at
    /// attach) give what dword reads give; BAR registers stay 1, 2, 4 or
    /// 8 bytes wide, and nothing past a region's end is read.
    #[test]
    fn configuration_space_reads_whole_and_registers_at_cpu_widths() {
        let mut b = backend();
        let cfg = VFIO_PCI_CONFIG_REGION_INDEX;
        let mut whole = [0u8; 256];
        b.region_read(cfg, 0, &mut whole).expect("a 256-byte read of configuration space");
        let mut dwords = Vec::new();
        for off in (0..256).step_by(4) {
            let mut d = [0u8; 4];
            b.region_read(cfg, off, &mut d).expect("dword");
            dwords.extend_from_slice(&d);
        }
        assert_eq!(whole.to_vec(), dwords);
        assert_eq!(u16::from_le_bytes([whole[0], whole[1]]), vnpu_device::VENDOR_ID);
        assert!(b.region_read(cfg, 200, &mut [0u8; 100]).is_err(), "past the end");
        assert!(b.region_read(cfg, 0, &mut []).is_err(), "empty");
        assert!(b.region_read(0, 0, &mut [0u8; 16]).is_err(), "16 bytes of BAR 0");
        assert!(b.region_write(0, 0, &[0u8; 3]).is_err(), "3 bytes of BAR 0");
    }

    /// A range mapped without a file descriptor (QEMU's ROMs) is accepted,
    /// never reaches the vNPU's memory, cannot overlap another mapping,
    /// and is unmapped by its exact range.
    #[test]
    fn a_range_mapped_without_a_file_is_recorded_out_of_reach() {
        let mut b = backend();
        let rom = (0xfffc_0000u64, 0x4_0000u64);
        b.dma_map(DmaMapFlags::READ_WRITE, 0, rom.0, rom.1, None).expect("fd-less map");
        assert_eq!(b.dma.memory().num_regions(), 0, "the vNPU cannot reach it");
        assert!(b.dma_map(DmaMapFlags::READ_WRITE, 0, rom.0 + 0x1000, 0x1000, None).is_err(), "overlap");
        assert!(b.dma_map(DmaMapFlags::READ_WRITE, 0, rom.0, 0, None).is_err(), "empty");
        assert!(b.dma_map(DmaMapFlags::READ_WRITE, 0, u64::MAX - 10, 0x1000, None).is_err(), "wraps");
        b.dma_unmap(DmaUnmapFlags::empty(), rom.0, rom.1).expect("unmap");
        b.dma_unmap(DmaUnmapFlags::empty(), rom.0, rom.1).expect("unmapped twice: nothing to do");
        // At most MAX_DMA_MAPS ranges, with or without files.
        for i in 0..MAX_DMA_MAPS as u64 {
            b.dma_map(DmaMapFlags::READ_WRITE, 0, i << 20, 1 << 20, None).expect("within the limit");
        }
        let past = b.dma_map(DmaMapFlags::READ_WRITE, 0, 1 << 40, 1 << 20, None).expect_err("past the limit");
        assert_eq!(past.raw_os_error(), Some(libc::ENOSPC));
    }

    /// Only eventfds become interrupt triggers, and they are written
    /// without blocking: a pipe is refused, and an eventfd whose counter
    /// the client filled to its maximum does not stop the device from
    /// signalling (the write fails: an interrupt is pending already).
    #[test]
    fn interrupt_triggers_are_non_blocking_eventfds() {
        use std::os::fd::FromRawFd;
        let mut b = backend();
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills the two descriptors, which the Files below own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fds[1] is a fresh descriptor nobody else owns.
        let pipe = unsafe { File::from_raw_fd(fds[1]) };
        // SAFETY: as above, for the read end.
        let _read_end = unsafe { File::from_raw_fd(fds[0]) };
        let set = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
        assert!(matches!(b.irqs(VFIO_PCI_MSIX_IRQ_INDEX, set, 0, 1, vec![pipe]), Err(BackendError::Irqs(_))));

        let efd = EventFd::new(0).expect("eventfd");
        // The client's copy: the counter at its maximum, so a blocking
        // write from the device would wait until the client reads.
        efd.write(u64::MAX - 1).expect("fill the counter");
        let theirs = efd.try_clone().expect("clone");
        // SAFETY: into_raw_fd hands over the descriptor the File then owns.
        let file = unsafe { File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(theirs)) };
        b.irqs(VFIO_PCI_MSIX_IRQ_INDEX, set, 0, 1, vec![file]).expect("an eventfd is a trigger");
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let vectors = Arc::clone(&b.vectors);
        std::thread::spawn(move || {
            vectors.signal(0);
            let _ = done_tx.send(());
        });
        assert!(
            done_rx.recv_timeout(std::time::Duration::from_secs(5)).is_ok(),
            "signalling a full eventfd blocked the device"
        );
        assert_eq!(efd.read().expect("read"), u64::MAX - 1, "the failed write added nothing");
    }

    /// The error and device-request indexes have one vector each and take
    /// one eventfd (a pipe is refused, more than one vector too); the
    /// request trigger is the instance's [`ReleaseRequest`]: raising it
    /// signals the client's eventfd, and once the trigger is disabled or
    /// its backend is gone there is nobody to ask.
    #[test]
    fn error_and_request_indexes_take_one_eventfd_each() {
        use std::os::fd::FromRawFd;
        let info = irqs();
        for index in [VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_REQ_IRQ_INDEX] {
            let i = info.iter().find(|i| i.index == index).expect("index served");
            assert_eq!((i.count, i.flags & VFIO_IRQ_INFO_EVENTFD), (1, VFIO_IRQ_INFO_EVENTFD));
        }
        let release = Arc::new(ReleaseRequest::default());
        let mut b = backend().with_release(Arc::clone(&release));
        assert!(!release.raise(), "no trigger yet");
        let set = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
        let eventfd = || {
            let efd = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
            // SAFETY: into_raw_fd hands over the descriptor the File then owns.
            let file = unsafe {
                File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(efd.try_clone().expect("clone")))
            };
            (efd, file)
        };
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills the two descriptors, which the Files below own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fresh descriptors nobody else owns.
        let (pipe, _read_end) = unsafe { (File::from_raw_fd(fds[1]), File::from_raw_fd(fds[0])) };
        assert!(b.irqs(VFIO_PCI_REQ_IRQ_INDEX, set, 0, 1, vec![pipe]).is_err(), "a pipe");
        let (_e1, f1) = eventfd();
        let (_e2, f2) = eventfd();
        assert!(b.irqs(VFIO_PCI_REQ_IRQ_INDEX, set, 0, 2, vec![f1, f2]).is_err(), "two vectors");
        let (err_efd, err_file) = eventfd();
        b.irqs(VFIO_PCI_ERR_IRQ_INDEX, set, 0, 1, vec![err_file]).expect("the error index's trigger");
        let (req_efd, req_file) = eventfd();
        b.irqs(VFIO_PCI_REQ_IRQ_INDEX, set, 0, 1, vec![req_file]).expect("the request index's trigger");
        assert!(release.raise());
        assert_eq!(req_efd.read().expect("the request reached the client"), 1);
        assert!(err_efd.read().is_err(), "the error index is never raised");
        // Disabled: nobody to ask.
        b.irqs(VFIO_PCI_REQ_IRQ_INDEX, VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER, 0, 0, vec![])
            .expect("disable");
        assert!(!release.raise());
        // Set again, then the backend goes (the client left).
        let (_e3, f3) = eventfd();
        b.irqs(VFIO_PCI_REQ_IRQ_INDEX, set, 0, 1, vec![f3]).expect("again");
        drop(b);
        assert!(!release.raise(), "a departed client's trigger");
    }

    /// Guest memory on hugetlbfs whose huge pages the host's pool cannot
    /// supply is refused at `DMA_MAP`: the daemon used to map it and die
    /// of SIGBUS at the device's first access (a mailbox write was enough),
    /// taking every tenant with it. Skipped where hugetlbfs memfds cannot
    /// be made; on a host whose pool has pages the map succeeds instead.
    /// Held by the tests that read or change the host's huge page pool
    /// (one's free count is another's expectation).
    static HUGE_POOL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    const POOL: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

    fn pool(name: &str) -> u64 {
        std::fs::read_to_string(format!("{POOL}/{name}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// A memfd of `len` bytes sealed against shrinking (as QEMU's memory
    /// backend makes it), with `flags` besides `MFD_ALLOW_SEALING`;
    /// `None` where such a memfd cannot be made (no hugetlbfs).
    fn sealed_memfd(flags: libc::c_uint, len: u64) -> Option<File> {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create(2) returns a fresh descriptor, owned below.
        let fd = unsafe { libc::memfd_create(c"vnpu-test".as_ptr(), flags | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            eprintln!("no memfd with flags {flags:#x} here: {}", std::io::Error::last_os_error());
            return None;
        }
        // SAFETY: `fd` is ours alone.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).expect("size");
        // SAFETY: F_ADD_SEALS on the descriptor we own.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        Some(file)
    }

    /// A sealed hugetlbfs memfd of `len` bytes, or `None` without one.
    fn huge_memfd(len: u64) -> Option<File> {
        sealed_memfd(libc::MFD_HUGETLB, len)
    }

    /// Frees the first `len` bytes of `file`'s pages, as a client can
    /// with its own memory (`fallocate(PUNCH_HOLE)`).
    fn punch_hole(file: &File, len: u64) {
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(len).expect("length");
        // SAFETY: fallocate(2) on a descriptor the test owns; it changes
        // only that file.
        let r = unsafe {
            libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, len)
        };
        assert_eq!(r, 0, "punch: {}", std::io::Error::last_os_error());
    }

    /// A client that punches a hole in its huge-page guest RAM after
    /// `DMA_MAP` (which `F_SEAL_SHRINK` allows), with the pool empty by
    /// the time the daemon touches it: that access was a SIGBUS that
    /// killed the daemon. Now it completes (on fresh memory), the
    /// client's memory is marked lost (its requests fail), and the device
    /// still answers. Needs a huge page: one is added to the pool for the
    /// test where the pool has none free and may be raised (root), and
    /// taken back after; skipped otherwise.
    #[test]
    fn a_hole_punched_in_huge_page_guest_ram_costs_its_client_only() {
        use vm_memory::{Bytes, GuestAddress};
        let _pool = HUGE_POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let total = pool("nr_hugepages");
        let raised = pool("free_hugepages") == 0
            && std::fs::write(format!("{POOL}/nr_hugepages"), (total + 1).to_string()).is_ok()
            && pool("free_hugepages") > 0;
        let restore = || {
            if raised {
                let _ = std::fs::write(format!("{POOL}/nr_hugepages"), total.to_string());
            }
        };
        let size = 2u64 << 20;
        let Some(file) = huge_memfd(size).filter(|_| pool("free_hugepages") > 0) else {
            restore();
            eprintln!("skipped: no free huge page and none could be added");
            return;
        };
        let punch = file.try_clone().expect("dup");
        let mut b = backend();
        let at = 1u64 << 30;
        b.dma_map(DmaMapFlags::READ_WRITE, 0, at, size, Some(file)).expect("map");
        b.dma.memory().write_obj(0xabu8, GuestAddress(at)).expect("write");
        assert!(!b.dma.watch().lost());
        punch_hole(&punch, size);
        // Take every free huge page, so the daemon's access cannot refault.
        let free = pool("free_hugepages");
        let hog = (free > 0).then(|| huge_memfd(free * size)).flatten();
        let held = hog.as_ref().map(|h| {
            let mut b2 = backend();
            b2.dma_map(DmaMapFlags::READ_WRITE, 0, 0, free * size, Some(h.try_clone().expect("dup")))
                .map(|()| b2)
        });
        assert_eq!(pool("free_hugepages"), 0, "the pool is empty now ({held:?})");
        let read = b.dma.memory().read_obj::<u8>(GuestAddress(at));
        assert_eq!(read.ok(), Some(0), "the access completes, on fresh memory");
        assert!(b.dma.watch().lost(), "the client's memory is marked lost");
        b.region_write(0, abi::regs::MBOX_ARG0, &[0u8; 8]).expect("the device still answers");
        drop((held, hog, b));
        restore();
    }

    /// A hole punched in shmem-backed guest RAM (a sealed memfd, as
    /// QEMU's `memory-backend-memfd` makes) after `DMA_MAP`: the pages
    /// refault as zeros (shmem needs no pool), so the daemon reads zeros
    /// where the client freed its memory, and nothing is lost.
    #[test]
    fn a_hole_punched_in_shmem_guest_ram_reads_as_zeros() {
        use vm_memory::{Bytes, GuestAddress};
        let size = 1u64 << 20;
        let file = sealed_memfd(0, size).expect("a memfd");
        let punch = file.try_clone().expect("dup");
        let mut b = backend();
        b.dma_map(DmaMapFlags::READ_WRITE, 0, 0, size, Some(file)).expect("map");
        b.dma.memory().write_obj(0xabu8, GuestAddress(4096)).expect("write");
        punch_hole(&punch, size);
        assert_eq!(b.dma.memory().read_obj::<u8>(GuestAddress(4096)).ok(), Some(0));
        assert!(!b.dma.watch().lost());
        b.region_write(0, abi::regs::MBOX_ARG0, &[0u8; 8]).expect("the device still answers");
    }

    #[test]
    fn huge_pages_the_pool_cannot_supply_are_refused_at_map_time() {
        let _pool = HUGE_POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let size = 2u64 << 20;
        let Some(file) = huge_memfd(size) else { return };
        let free = pool("free_hugepages");
        let mut b = backend();
        let r = b.dma_map(DmaMapFlags::READ_WRITE, 0, 1 << 30, size, Some(file));
        if free == 0 {
            assert!(r.is_err(), "a mapping the pool cannot back was accepted");
            // The device goes on, with nothing mapped there.
            b.region_write(0, abi::regs::MBOX_ARG0, &[0u8; 8]).expect("the device still answers");
        } else {
            assert!(r.is_ok(), "{r:?}");
        }
    }

    /// A client maps at most `MAX_DMA_BYTES` of guest memory in all (one
    /// mapped 128 TiB of sparse memfds and left the daemon no address
    /// space for anyone else).
    #[test]
    fn a_client_maps_at_most_max_dma_bytes() {
        let sparse = |len: u64| sealed_memfd(0, len).expect("a memfd");
        let mut b = backend();
        let half = MAX_DMA_BYTES / 2;
        b.dma_map(DmaMapFlags::READ_WRITE, 0, 0, half, Some(sparse(half))).expect("half the limit");
        let over = b.dma_map(DmaMapFlags::READ_WRITE, 0, half, half + 4096, Some(sparse(half + 4096)));
        assert!(over.is_err(), "past the limit in all");
        b.dma_map(DmaMapFlags::READ_WRITE, 0, half, half, Some(sparse(half))).expect("up to the limit");
    }
}
