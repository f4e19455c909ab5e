//! The vNPU PCI function (`docs/device-interface.md`): configuration
//! space, the BAR 0 registers and control mailbox, the MSI-X table in BAR
//! 2, and the NPU worker thread that serves the command ring (a virtio
//! split ring, walked with the `virtio-queue` crate) on the software NPU.
//!
//! The guest-visible constants (offsets, opcodes, status codes, wire
//! formats) live in `vnpu_abi::device`, shared with the guest driver.

// Registers, rings and programs come from the guest: no silent narrowing
// casts outside the tests.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

pub mod device_core;
mod guest_ram;
mod msi;
pub mod persist;
mod regfile;
mod store;
mod telemetry;
mod worker;
mod write_log;

pub use guest_ram::{GuestFile, GuestRam, MemoryWatch};
pub use msi::{MsiSink, RecordingSink, VectorSink};
pub use persist::{DeviceState, StateError};
pub use store::{prepare_files, private_dir, private_files, Client, SessionStore};
// The board runtime's handles a device is built with and reports on.
pub use device_core::{
    DeviceOptions, DEFAULT_BUDGET, DEFAULT_POLL_US, MAX_BUDGET, SHARED_MAX_BUDGET, SHARED_MAX_HOST_WORK,
};
pub use npu_board_runtime::{Harvest, SharedBoard, SharedCore, SharingStats};
pub use telemetry::{Telemetry, TelemetrySnapshot, LATENCY_BOUNDS_S};
pub use vnpu_abi::device::{
    regs, ABI_VERSION, BAR0_SIZE, BAR2_SIZE, CLASS, DEVICE_ID, MSIX_VECTORS, VENDOR_ID,
};
pub use write_log::{WriteLog, LOG_PAGE};

use std::sync::Arc;

/// The low 32 bits of a value a guest wrote (32-bit registers take them).
pub(crate) fn low32(v: u64) -> u32 {
    u32::try_from(v & 0xffff_ffff).unwrap_or(u32::MAX)
}

/// A cycle count or other non-negative measure as the counters report it:
/// rounded, saturating at 0 and `u64::MAX` (NaN reads 0).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub(crate) fn count(x: f64) -> u64 {
    // `as` from f64 saturates and maps NaN to 0: the intent here.
    x.round() as u64
}

/// The `detail` of a status: an instruction's stream in the high half and
/// its index in the low half (saturated), as `docs/device-interface.md` says.
pub(crate) fn position_detail(stream: usize, index: usize) -> u32 {
    let s = u32::try_from(stream).unwrap_or(0xffff).min(0xffff);
    let i = u32::try_from(index).unwrap_or(0xffff).min(0xffff);
    s << 16 | i
}

use npu_model::BoardConfig;
use thiserror::Error;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vnpu_abi::device as abi;
use vnpu_pci::{Bar, BarKind, ConfigSpace, Identity, MsixCap, PciError, PciFunction};
use vnpu_spec::VnpuSpec;

use device_core::{Control, DeviceCore, Rendezvous, Shared};
pub use device_core::{SnapshotError, STREAM_VERSION};
use msi::lock;

/// The registers of a vNPU of `board` as it starts, before the core shows
/// its configuration: identity, the board's array and lane sizes and
/// clock, the ring's largest size, no vectors chosen.
pub(crate) fn initial_registers(board: &BoardConfig) -> regfile::RegFile {
    let mut r = regfile::RegFile::new();
    r.set_u32(regs::MAGIC, abi::MAGIC);
    r.set_u32(regs::ABI_VERSION, ABI_VERSION);
    r.set_u32(regs::SA_ROWS, board.core.sa_rows);
    r.set_u32(regs::SA_COLS, board.core.sa_cols);
    r.set_u32(regs::VU_LANES, board.core.vu_lanes);
    r.set_u32(regs::CLOCK_MHZ, board.clock_mhz);
    r.set_u32(regs::QUEUE_SIZE_MAX, u32::from(abi::QUEUE_SIZE_MAX));
    r.set_u32(regs::QUEUE_VECTOR, abi::NO_VECTOR);
    r.set_u32(regs::MBOX_VECTOR, abi::NO_VECTOR);
    r
}

/// Why a vNPU function could not be created.
#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("PCI layout: {0}")]
    Pci(#[from] PciError),
    #[error("vNPU worker: {0}")]
    Io(#[from] std::io::Error),
}

/// One vNPU as a PCI function, with its worker thread.
pub struct VnpuFunction {
    config: ConfigSpace,
    msix: MsixCap,
    shared: Arc<Shared>,
    /// Target of `CAL_NOP` (never read: the raw cost of an ioeventfd write).
    cal_nop: EventFd,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for VnpuFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VnpuFunction").field("config", &self.config).finish_non_exhaustive()
    }
}

impl VnpuFunction {
    /// A vNPU granted `spec` on a board of `board`, whose DMA reaches
    /// `memory` (the guest's RAM), raising interrupts into `sink`. Starts
    /// the worker thread, named `name`, which serves the ring as `opts` say.
    pub fn new(
        spec: &VnpuSpec,
        board: &BoardConfig,
        memory: GuestMemoryMmap<()>,
        sink: Arc<dyn MsiSink>,
        name: &str,
        opts: DeviceOptions,
    ) -> Result<Self, DeviceError> {
        Self::build(spec, board, memory, sink, None, name, opts)
    }

    /// A vNPU served to a VMM in another process (the board daemon's
    /// vfio-user server): no guest memory until [`Self::set_memory`], and
    /// MSI-X vectors raised by number into `vectors` (the VMM owns the
    /// MSI-X table; this function's own table stays unused).
    pub fn served(
        spec: &VnpuSpec,
        board: &BoardConfig,
        vectors: Arc<dyn VectorSink>,
        name: &str,
        opts: DeviceOptions,
    ) -> Result<Self, DeviceError> {
        let sink: Arc<dyn MsiSink> = Arc::new(RecordingSink::default());
        Self::build(spec, board, GuestMemoryMmap::new(), sink, Some(vectors), name, opts)
    }

    /// Replaces the guest memory the vNPU's DMA reaches (between requests).
    pub fn set_memory(&self, memory: GuestMemoryMmap<()>) {
        self.shared.post(Control::Memory(memory, None));
    }

    /// As [`Self::set_memory`], with `watch` saying when some of it was
    /// lost: each request that ran while it was fails (`ST_EXEC_FAULT`).
    pub fn set_memory_watched(&self, memory: GuestMemoryMmap<()>, watch: MemoryWatch) {
        self.shared.post(Control::Memory(memory, Some(watch)));
    }

    /// Keeps the vNPU's state in `store` from now on, so that a restarted
    /// daemon can resume it: a new session from nothing, or (`resume`) the
    /// one the store holds (its registers, configuration and memories at
    /// once; its programs and ring at [`Self::resume`]).
    pub fn keep_in(&self, store: Arc<SessionStore>, resume: bool) {
        self.shared.post(Control::Session { store, resume });
    }

    /// A resumed session's client is set up again: the ring carries on
    /// where it was, and the request that was running completes with
    /// `ST_RETRY`.
    pub fn resume(&self) {
        self.shared.post(Control::Resume);
    }

    fn build(
        spec: &VnpuSpec,
        board: &BoardConfig,
        memory: GuestMemoryMmap<()>,
        sink: Arc<dyn MsiSink>,
        vectors: Option<Arc<dyn VectorSink>>,
        name: &str,
        opts: DeviceOptions,
    ) -> Result<Self, DeviceError> {
        let id = Identity {
            vendor_id: VENDOR_ID,
            device_id: DEVICE_ID,
            class: CLASS,
            revision: 1,
            subsystem_vendor_id: VENDOR_ID,
            subsystem_id: DEVICE_ID,
        };
        let mut config = ConfigSpace::new(id);
        config.add_bar(0, Bar { kind: BarKind::Mem64 { prefetchable: false }, size: BAR0_SIZE })?;
        config.add_bar(2, Bar { kind: BarKind::Mem64 { prefetchable: false }, size: BAR2_SIZE })?;
        let msix = MsixCap::add(&mut config, MSIX_VECTORS, 2, 0, 2, low32(abi::MSIX_PBA_OFFSET))?;
        let r = initial_registers(board);
        let shared = Arc::new(Shared::new(r, msix.vectors, sink, vectors)?);
        // The worker shows the granted configuration in the registers
        // before the thread starts, so the guest sees it from the first read.
        let w = DeviceCore::new(Arc::clone(&shared), memory, board.clone(), *spec, opts, name);
        let worker = Some(worker::spawn(w, name.to_string())?);
        Ok(Self { config, msix, shared, cal_nop: EventFd::new(EFD_NONBLOCK)?, worker })
    }

    /// A handle that changes this vNPU's grant from any thread (a live
    /// remap): the worker applies it between requests and tells the guest
    /// (`INT_STATUS` bit `INT_GRANT` on `MBOX_VECTOR`).
    pub fn grant_handle(&self) -> GrantHandle {
        GrantHandle { shared: Arc::clone(&self.shared) }
    }

    /// A handle that saves and restores this vNPU's device state.
    pub fn state_handle(&self) -> StateHandle {
        StateHandle { shared: Arc::clone(&self.shared) }
    }

    /// The MSI-X capability.
    pub fn msix(&self) -> MsixCap {
        self.msix
    }

    /// Eventfds to register as ioeventfds at these offsets of BAR 0: the
    /// doorbell and the `CAL_NOP` calibration doorbell. (`CAL_LOOPBACK` is
    /// the VMM's: it needs the irqfd of vector `LOOPBACK_VECTOR`.)
    pub fn ioevents(&self) -> std::io::Result<Vec<(u64, EventFd)>> {
        Ok(vec![
            (regs::DOORBELL, self.shared.doorbell.try_clone()?),
            (regs::CAL_NOP, self.cal_nop.try_clone()?),
        ])
    }

    /// Raises MSI-X `vector` by the MSI-X rules.
    pub fn raise(&self, vector: u16) {
        self.shared.irq.raise(vector);
    }
}

/// Saves and restores a vNPU's device state for a snapshot of its VM
/// (see [`VnpuFunction::state_handle`], `docs/migration.md`).
#[derive(Clone)]
pub struct StateHandle {
    shared: Arc<device_core::Shared>,
}

impl std::fmt::Debug for StateHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateHandle").finish_non_exhaustive()
    }
}

/// How long a snapshot or a restore waits for the vNPU's worker (which
/// finishes the request it is running first).
pub const STATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A vNPU parked by [`StateHandle::save`]: its worker serves nothing
/// until this is dropped.
#[derive(Debug)]
pub struct Parked(Arc<Rendezvous>);

impl Drop for Parked {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl StateHandle {
    /// Saves the vNPU's whole state into `dir` (created if need be) once
    /// the request it is running ends, and parks it there: it takes no
    /// request and writes no guest memory until the returned guard is
    /// dropped, so guest RAM saved meanwhile agrees with it.
    pub fn save(&self, dir: &std::path::Path) -> Result<Parked, SnapshotError> {
        let at = Arc::new(Rendezvous::default());
        let parked = Parked(Arc::clone(&at));
        self.shared.post(Control::Snapshot(dir.to_path_buf(), Arc::clone(&at)));
        at.wait_done(STATE_TIMEOUT)?;
        Ok(parked)
    }

    /// Takes the state [`Self::save`] left in `dir`; the ring is taken up
    /// again at [`Self::resume`], once the function's configuration space
    /// and guest RAM are back.
    pub fn restore(&self, dir: &std::path::Path) -> Result<(), SnapshotError> {
        let at = Arc::new(Rendezvous::default());
        self.shared.post(Control::Restore(dir.to_path_buf(), Arc::clone(&at)));
        at.wait_done(STATE_TIMEOUT)
    }

    /// As [`Self::save`], the state as one stream (`docs/migration.md`,
    /// "The device stream") instead of a folder.
    pub fn save_stream(&self) -> Result<(Parked, Vec<u8>), SnapshotError> {
        let at = Arc::new(Rendezvous::default());
        let parked = Parked(Arc::clone(&at));
        self.shared.post(Control::SaveStream(Arc::clone(&at)));
        at.wait_done(STATE_TIMEOUT)?;
        Ok((parked, at.take_bytes()))
    }

    /// As [`Self::restore`], from a stream [`Self::save_stream`] gave
    /// (here or on another server); a stream that does not check out is
    /// refused and changes nothing.
    pub fn restore_stream(&self, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        let at = Arc::new(Rendezvous::default());
        self.shared.post(Control::RestoreStream(Arc::new(bytes), Arc::clone(&at)));
        at.wait_done(STATE_TIMEOUT)
    }

    /// The next pre-copy piece of the vNPU's HBM, with about `max` bytes
    /// of chunks (`docs/migration.md`, "Pre-copy of the vNPU's HBM"),
    /// taken between two requests while the vNPU runs on; empty when none
    /// is due. The first call starts the pre-copy; [`Self::save_stream`]
    /// then gives an incremental stream, [`Self::precopy_abort`] ends it.
    pub fn precopy(&self, max: usize) -> Result<Vec<u8>, SnapshotError> {
        let at = Arc::new(Rendezvous::default());
        self.shared.post(Control::PreCopy(max, Arc::clone(&at)));
        at.wait_done(STATE_TIMEOUT)?;
        Ok(at.take_bytes())
    }

    /// Ends a pre-copy without a stop (the migration failed).
    pub fn precopy_abort(&self) {
        self.shared.post(Control::PreCopyAbort);
    }

    /// Takes a pre-copy piece another vNPU's [`Self::precopy`] gave, before
    /// the incremental stream that completes it; one that does not check
    /// out is refused and changes nothing.
    pub fn apply_piece(&self, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        let at = Arc::new(Rendezvous::default());
        self.shared.post(Control::ApplyPiece(Arc::new(bytes), Arc::clone(&at)));
        at.wait_done(STATE_TIMEOUT)
    }

    /// Takes the restored vNPU's programs and ring up again.
    pub fn resume(&self) {
        self.shared.post(Control::Resume);
    }

    /// The log of the guest pages this vNPU writes (a live migration's
    /// dirty pages besides KVM's).
    pub fn write_log(&self) -> Arc<WriteLog> {
        Arc::clone(&self.shared.write_log)
    }
}

/// Changes a running vNPU's grant (see [`VnpuFunction::grant_handle`]).
#[derive(Clone)]
pub struct GrantHandle {
    shared: Arc<device_core::Shared>,
}

impl std::fmt::Debug for GrantHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrantHandle").finish_non_exhaustive()
    }
}

impl GrantHandle {
    /// Grants `spec` from now on.
    pub fn regrant(&self, spec: VnpuSpec) {
        self.shared.post(Control::Regrant(spec));
    }
}

impl Drop for VnpuFunction {
    fn drop(&mut self) {
        self.shared.post(Control::Stop);
        if let Some(w) = self.worker.take() {
            // A worker that panicked has nothing left to clean up.
            let _ = w.join();
        }
    }
}

impl PciFunction for VnpuFunction {
    fn config(&self) -> &ConfigSpace {
        &self.config
    }
    fn config_mut(&mut self) -> &mut ConfigSpace {
        &mut self.config
    }
    fn config_written(&mut self, _offset: usize, _len: usize) {
        {
            let mut s = lock(&self.shared.irq.state);
            s.enabled = self.msix.enabled(&self.config);
            s.function_masked = self.msix.function_masked(&self.config);
        }
        // Enabling MSI-X or clearing the function mask releases pending vectors.
        self.shared.irq.release_pending();
    }
    fn save_state(&self) -> vnpu_pci::FunctionState {
        let extra = lock(&self.shared.irq.state).table.saved();
        vnpu_pci::FunctionState { config: self.config.saved(), extra }
    }
    fn restore_state(&mut self, s: &vnpu_pci::FunctionState) -> Result<(), PciError> {
        self.config.restore(&s.config)?;
        lock(&self.shared.irq.state).table.restore(&s.extra)?;
        self.config_written(0, vnpu_pci::CONFIG_SIZE);
        Ok(())
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match bar {
            0 => self.shared.register_read(offset, data),
            2 if offset < abi::MSIX_PBA_OFFSET => lock(&self.shared.irq.state).table.read(offset, data),
            2 => lock(&self.shared.irq.state).table.pba_read(offset - abi::MSIX_PBA_OFFSET, data),
            _ => data.fill(0xff),
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match bar {
            0 => self.shared.register_write(offset, data),
            2 if offset < abi::MSIX_PBA_OFFSET => {
                lock(&self.shared.irq.state).table.write(offset, data);
                // Unmasking a vector releases it if pending.
                self.shared.irq.release_pending();
            }
            // The PBA ignores writes.
            _ => {}
        }
    }
}

#[cfg(test)]
impl VnpuFunction {
    pub(crate) fn shared_for_tests(&self) -> &Shared {
        &self.shared
    }
}

/// A function over 1 MiB of fresh guest memory with a recording sink.
#[cfg(test)]
pub(crate) fn test_function(spec: &VnpuSpec) -> (VnpuFunction, Arc<RecordingSink>) {
    let mem = GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 1 << 20)]).unwrap();
    let sink = Arc::new(RecordingSink::default());
    let f =
        VnpuFunction::new(spec, &BoardConfig::default(), mem, sink.clone(), "test", DeviceOptions::default())
            .unwrap();
    (f, sink)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar0_exposes_the_hierarchy() {
        let spec = VnpuSpec::parse("sa=2,vu=3,sram=8M,hbm=1G,cores=2,chips=1").unwrap();
        let mut f = test_function(&spec).0;
        let rd = |f: &mut VnpuFunction, off: u64, n: usize| {
            let mut b = [0u8; 8];
            f.bar_read(0, off, &mut b[..n]);
            u64::from_le_bytes(b)
        };
        assert_eq!(rd(&mut f, regs::MAGIC, 4), 0x5550_4e56);
        assert_eq!(rd(&mut f, regs::ABI_VERSION, 4), u64::from(ABI_VERSION));
        assert_eq!(rd(&mut f, regs::STATUS, 4), 1);
        assert_eq!(rd(&mut f, regs::CORES_PER_CHIP, 4), 2);
        assert_eq!(rd(&mut f, regs::SA_PER_CORE, 4), 2);
        assert_eq!(rd(&mut f, regs::VU_PER_CORE, 4), 3);
        assert_eq!(rd(&mut f, regs::SRAM_PER_CORE, 8), 8 << 20);
        assert_eq!(rd(&mut f, regs::HBM_PER_CORE, 8), 1 << 30);
        assert_eq!(rd(&mut f, regs::SA_ROWS, 4), 128);
        // Unimplemented and out-of-range offsets read 0; writes do nothing.
        assert_eq!(rd(&mut f, 0x3ff8, 8), 0);
        f.bar_write(0, regs::SA_PER_CORE, &[9, 9, 9, 9]);
        assert_eq!(rd(&mut f, regs::SA_PER_CORE, 4), 2);
        let mut b = [0u8; 8];
        f.bar_read(0, u64::MAX - 2, &mut b);
        assert_eq!(b, [0; 8]);
    }
}

#[cfg(test)]
mod interrupt_tests {
    use super::*;

    #[test]
    fn int_test_raises_vectors_by_the_msix_rules() {
        let (mut f, sink) = test_function(&VnpuSpec::named("small").unwrap());
        let cap = f.msix().offset;
        // MSI-X disabled: dropped.
        f.bar_write(0, regs::INT_TEST, &1u32.to_le_bytes());
        assert!(sink.take().is_empty());
        // Program vector 1, enable MSI-X: still masked after reset, so pending.
        f.bar_write(2, 16, &0xfee0_0000u32.to_le_bytes());
        f.bar_write(2, 24, &0x41u32.to_le_bytes());
        f.config_mut().write(cap + 2, &0x8000u16.to_le_bytes());
        f.config_written(cap + 2, 2);
        f.bar_write(0, regs::INT_TEST, &1u32.to_le_bytes());
        assert!(sink.take().is_empty());
        let mut pba = [0u8];
        f.bar_read(2, 0x1000, &mut pba);
        assert_eq!(pba[0], 0b10);
        // Unmask: the pending vector is delivered once.
        f.bar_write(2, 28, &0u32.to_le_bytes());
        assert_eq!(sink.take(), vec![vnpu_pci::MsiMessage { vector: 1, address: 0xfee0_0000, data: 0x41 }]);
        assert!(sink.take().is_empty());
        f.bar_write(0, regs::INT_TEST, &1u32.to_le_bytes());
        assert_eq!(sink.take().len(), 1);
        // Nonexistent vectors do nothing; INT_TEST reads 0.
        f.bar_write(0, regs::INT_TEST, &500u32.to_le_bytes());
        assert!(sink.take().is_empty());
        let mut b = [9u8; 4];
        f.bar_read(0, regs::INT_TEST, &mut b);
        assert_eq!(b, [0; 4]);
    }
}

#[cfg(test)]
mod bus_tests {
    use super::*;
    use vnpu_pci::PciBus;

    /// The guest's sequence: program BAR 0 through ECAM, enable memory
    /// decoding, read the registers through the BAR.
    #[test]
    fn registers_are_reachable_through_a_programmed_bar() {
        let mut bus = PciBus::new();
        bus.add(1, Box::new(test_function(&VnpuSpec::named("small").unwrap()).0)).unwrap();
        let mut b = [0u8; 4];
        assert!(!bus.mmio_read(0xc001_0000, &mut b), "not decoded before programming");
        bus.ecam_write((1 << 15) | 0x10, &0xc001_0000u32.to_le_bytes());
        bus.ecam_write((1 << 15) | 0x14, &0u32.to_le_bytes());
        assert!(!bus.mmio_read(0xc001_0000, &mut b), "not decoded while memory space is off");
        let mut cmd = [0u8; 4];
        bus.ecam_read((1 << 15) | 0x04, &mut cmd);
        let cmd = u32::from_le_bytes(cmd) & 0xffff;
        bus.ecam_write((1 << 15) | 0x04, &(cmd | 2).to_le_bytes());
        assert!(bus.mmio_read(0xc001_0000, &mut b));
        assert_eq!(&b, b"VNPU");
        assert!(!bus.mmio_read(0xc001_4000, &mut b), "past the end of BAR 0");
    }
}
