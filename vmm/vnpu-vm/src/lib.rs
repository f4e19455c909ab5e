//! A KVM virtual machine that boots a bare-metal 64-bit ELF guest.
//!
//! The VMM builds what firmware would: identity-mapped page tables for the
//! first GiB (2 MiB pages), a GDT with one 64-bit code and one data
//! segment, and long mode in the vCPU's control registers; then it loads
//! the ELF with linux-loader and enters it at its entry point with a stack
//! below 512 KiB. See `docs/guest-boot.md` for the guest's view.
//!
//! Devices so far: a 16550 UART at I/O port 0x3f8 (vm-superio) whose
//! output goes to a writer; an exit port at 0xf4 (a 32-bit write of `code`
//! ends the VM with exit code `code`); and PCI bus 0 (`vnpu-pci`) through
//! ports 0xCF8..0xCFF and an ECAM window at [`ECAM_BASE`], with a host
//! bridge at 00:00.0 and one vNPU function per `--vnpu` from 00:01.0 on
//! (`vnpu-device`: configuration space, hierarchy registers in BAR 0,
//! MSI-X table in BAR 2).
//!
//! With [`VmConfig::linux`] the guest image is a Linux kernel instead,
//! booted by the x86 64-bit boot protocol (module `linux`): zero page,
//! e820 map, MP table, in-kernel IOAPIC/PIC/PIT, the UART's interrupt on
//! IRQ 4, BARs placed as firmware would, and an i8042 reset line that ends
//! the VM (`docs/linux-guests.md`).

// Exits carry guest-chosen ports, addresses and data: no silent narrowing
// casts outside the tests.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

mod cmos;
mod irq;
mod linux;
pub mod migrate;
mod mptable;
pub mod remote;
pub mod snapshot;

pub use linux::LinuxBoot;
pub use migrate::{MigrateOptions, MigrationInfo, Offer, RemoteShape};
pub use snapshot::{PauseHandle, SnapshotError, SnapshotInfo};
pub use vnpu_device::GuestRam;

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};

use kvm_bindings::{kvm_segment, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use linux_loader::loader::{elf::Elf, KernelLoader};
use npu_model::BoardConfig;
use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;
use vnpu_device::VnpuFunction;
use vnpu_pci::{ConfigSpace, Identity, MsiMessage, PciBus, PlainFunction};
use vnpu_spec::VnpuSpec;

/// Serial port base (COM1).
pub const SERIAL_PORT: u16 = 0x3f8;
/// Exit port: a 32-bit `out` ends the VM with that exit code.
pub const EXIT_PORT: u16 = 0xf4;
/// Smallest guest memory: page tables, GDT and stack live below 1 MiB and
/// the ELF is expected at 1 MiB or above.
pub const MIN_MEMORY: u64 = 2 << 20;
/// Lowest guest address of a payload ([`VmConfig::payload`]): above the
/// user-mode runtime's stack, heap and first DMA megabytes.
pub const PAYLOAD_MIN: u64 = 32 << 20;
/// A payload's alignment in guest RAM (a page), and the offset alignment
/// at which a file piece ([`Payload::put_file`]) can be mapped.
pub const PAYLOAD_ALIGN: u64 = 4096;

/// Guest-physical base of the system controller page: a 32-bit write at
/// +0 prints its low byte on the console, a 32-bit write at +4 ends the VM
/// with that exit code. The MMIO twins of the UART and the exit port, for
/// guest code at CPL3 (where port I/O faults on this machine kind).
pub const SYSCON_BASE: u64 = 0xf000_0000;
/// Offset of the console register in the system controller page.
pub const SYSCON_CONSOLE: u64 = 0;
/// Offset of the exit register in the system controller page.
pub const SYSCON_EXIT: u64 = 4;
/// Offset of the first of [`SYSCON_BENCH_SLOTS`] benchmark registers in the
/// system controller page: a write of up to 8 bytes at
/// `SYSCON_BENCH + 8 * id` pauses the vCPU and hands `(id, value)` to the
/// hook set with [`Vm::set_benchmark_hook`] (ignored without one). It lets
/// a host benchmark interleave its own side with the guest's, on the same
/// clock, while the guest waits (`vnpu demo`).
pub const SYSCON_BENCH: u64 = 0x10;
/// Number of benchmark registers.
pub const SYSCON_BENCH_SLOTS: u64 = 16;

/// What a benchmark register write calls: `(id, value)`, on the vCPU thread.
pub type BenchmarkHook = Box<dyn FnMut(u32, u64) + Send>;

/// Guest-physical base of the ECAM window (bus 0 only: 1 MiB).
pub const ECAM_BASE: u64 = 0xe000_0000;
/// Size of the ECAM window.
pub const ECAM_SIZE: u64 = 1 << 20;
/// Most vNPU functions one VM can have (slots 1..=31 of bus 0).
pub const MAX_VNPUS: usize = 31;
/// Device ID of the host bridge.
pub const HOST_BRIDGE_DEVICE_ID: u16 = 0x0000;

const GDT_ADDR: u64 = 0x500;
const PML4_ADDR: u64 = 0x9000;
const PDPT_ADDR: u64 = 0xa000;
/// Four page directories (0xb000..0xf000) map the first 4 GiB.
const PD_ADDR: u64 = 0xb000;
const STACK_TOP: u64 = 0x8_0000;
const HIGHMEM_START: u64 = 0x10_0000;

/// Why a VM could not be built or run.
#[derive(Debug, Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0} (this needs KVM; on a host without it, no VM can run)")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM: {what}: {source}")]
    Ioctl { what: &'static str, source: kvm_ioctls::Error },
    #[error("guest memory of {size} bytes: {reason}")]
    Memory { size: u64, reason: String },
    #[error("cannot open {path}: {source}")]
    Open { path: String, source: std::io::Error },
    #[error("cannot load {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("guest stopped: {0}")]
    Guest(String),
    #[error("attaching the vNPU served at {path}: {source}")]
    Attach {
        path: String,
        #[source]
        source: remote::RemoteError,
    },
    #[error("{what}: {source}")]
    EventFd {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the loopback irqfd of vNPU slot {slot}: {source}")]
    Loopback {
        slot: usize,
        #[source]
        source: irq::IrqError,
    },
    #[error("PCI layout: {0}")]
    Pci(#[from] vnpu_pci::PciError),
    #[error("vNPU device: {0}")]
    Device(#[from] vnpu_device::DeviceError),
    #[error("{count} vNPUs asked for; a VM has at most {MAX_VNPUS}")]
    TooManyVnpus { count: usize },
    #[error("snapshot: {0}")]
    Snapshot(#[from] SnapshotError),
    #[error("the VM stopped after its snapshot was taken")]
    StoppedAfterSnapshot,
    #[error("the VM was migrated to another VMM and runs there")]
    MigratedAway,
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Ioctl { what, source }
}

/// The UART's interrupt line: an irqfd on GSI [`SERIAL_IRQ`] (IOAPIC pin
/// 4 and the PIC's IRQ 4). Bare-metal guests poll and never enable it.
#[derive(Debug)]
struct IrqLine(EventFd);

impl Trigger for IrqLine {
    type E = std::io::Error;
    fn trigger(&self) -> Result<(), Self::E> {
        self.0.write(1)
    }
}

/// The 16550 model with its interrupt line.
type Uart<W> = Serial<IrqLine, vm_superio::serial::NoEvents, W>;

fn uart<W: Write>(serial: &Mutex<Uart<W>>) -> std::sync::MutexGuard<'_, Uart<W>> {
    serial.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The UART's ISA IRQ.
pub const SERIAL_IRQ: u32 = 4;
/// The i8042 command port: writing 0xfe (pulse the reset line) ends the VM
/// with exit code 0; it is how Linux reboots without ACPI (`reboot=k`).
pub const I8042_COMMAND_PORT: u16 = 0x64;
/// The i8042 command that resets the machine.
pub const I8042_RESET: u8 = 0xfe;
/// Where the VMM places BAR 0 of the vNPU in `slot` before a Linux guest
/// boots: `PCI_MMIO_BASE + slot * 64 KiB` (BAR 2 at +32 KiB).
pub const PCI_MMIO_BASE: u64 = 0xc000_0000;

/// A VM with one vCPU running a bare-metal ELF guest.
pub struct Vm<W: Write> {
    // Kept alive for the VM's lifetime.
    _kvm: Kvm,
    vm: Arc<VmFd>,
    vcpu: VcpuFd,
    memory: GuestMemoryMmap<()>,
    /// Shared with the console-input thread ([`Vm::forward_input`]).
    serial: Arc<Mutex<Uart<W>>>,
    cmos: cmos::Cmos,
    pci: PciBus,
    msi: Arc<Mutex<irq::MsiRoutes>>,
    doorbells: Vec<Doorbells>,
    benchmark: Option<BenchmarkHook>,
    /// Guest address and length of [`VmConfig::payload`].
    payload: Option<(u64, u64)>,
    /// What a snapshot needs to rebuild the VM.
    shape: snapshot::Shape,
    /// Why this VM cannot be snapshotted, if it cannot.
    no_snapshot: Option<&'static str>,
    pause: PauseHandle,
}

/// The ioeventfds of one vNPU's BAR 0 page 1, registered at the BAR's
/// current address while memory decoding is on (and the handle that
/// changes the vNPU's grant).
#[derive(Debug)]
struct Doorbells {
    slot: usize,
    /// Shared with a remote function, which replaces them when it
    /// reconnects to a restarted server.
    io: Arc<Mutex<remote::IoEvents>>,
    /// None for a function served by a daemon (its grant is the daemon's).
    grant: Option<vnpu_device::GrantHandle>,
    /// Saves and restores the device state (None for a daemon's).
    state: Option<vnpu_device::StateHandle>,
    /// A daemon's function: its state by vfio-user migration.
    migration: Option<remote::MigrationHandle>,
}

/// Guest RAM in a memfd sealed against shrinking and growing, so a
/// vfio-user server can map it (`docs/vfio-user.md`).
fn shared_ram(bytes: u64) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: memfd_create with a NUL-terminated name; the new descriptor
    // is owned by the File below.
    let fd = unsafe {
        libc::memfd_create(c"vnpu-guest-ram".as_ptr(), libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC)
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(bytes)?;
    // SAFETY: adds seals to our own memfd; no memory is touched.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) }
        != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Delivers a function's MSIs through the VM's irqfds, from any thread.
struct SlotSink {
    slot: usize,
    vm: Arc<VmFd>,
    routes: Arc<Mutex<irq::MsiRoutes>>,
}

impl vnpu_device::MsiSink for SlotSink {
    fn deliver(&self, m: MsiMessage) {
        let mut r = self.routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A message that cannot be routed (a bogus address the guest
        // programmed, routes exhausted) is dropped, as on hardware.
        let _ = r.deliver(&self.vm, self.slot, m);
    }
}

impl<W: Write> std::fmt::Debug for Vm<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm").finish_non_exhaustive()
    }
}

/// Whether this VMM itself runs in a QEMU TCG guest (CPUID hypervisor
/// signature "TCGTCGTCGTCG"): the nested test path (docs/linux-guests.md).
fn host_is_qemu_tcg() -> bool {
    let hv = core::arch::x86_64::__cpuid(1);
    if hv.ecx & (1 << 31) == 0 {
        return false;
    }
    // The hypervisor range exists when bit 31 is set.
    let sig = core::arch::x86_64::__cpuid(0x4000_0000);
    let mut name = [0u8; 12];
    name[..4].copy_from_slice(&sig.ebx.to_le_bytes());
    name[4..8].copy_from_slice(&sig.ecx.to_le_bytes());
    name[8..].copy_from_slice(&sig.edx.to_le_bytes());
    &name == b"TCGTCGTCGTCG"
}

/// The low and high 32 bits of `v`.
fn split_u64(v: u64) -> [u32; 2] {
    let b = v.to_le_bytes();
    [u32::from_le_bytes([b[0], b[1], b[2], b[3]]), u32::from_le_bytes([b[4], b[5], b[6], b[7]])]
}

/// The little-endian value of up to 4 bytes.
fn le_u32(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}

/// Up to the first 8 bytes of `data`, little-endian, zero-extended.
fn le_u64(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

fn segment(selector: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl: 0,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

/// A restored or migrated VM's devices, built before its state comes.
struct Early {
    vm: Arc<VmFd>,
    msi: Arc<Mutex<irq::MsiRoutes>>,
    pci: PciBus,
    doorbells: Vec<Doorbells>,
}

/// Where a restored or migrated VM's vNPU states come from.
enum Devices<'a> {
    /// A snapshot's folder.
    Folder(&'a std::path::Path),
    /// A migration's device streams, by PCI slot.
    Streams(std::collections::BTreeMap<usize, Vec<u8>>),
}

/// What a VM is made of.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// RAM at guest address 0, in bytes.
    pub memory: u64,
    /// The bare-metal ELF to boot.
    pub guest: std::path::PathBuf,
    /// One vNPU function per entry, from 00:01.0 on.
    pub vnpus: Vec<VnpuSpec>,
    /// The physical board the vNPUs are cut from.
    pub board: BoardConfig,
    /// How the vNPU workers serve their rings.
    pub device: vnpu_device::DeviceOptions,
    /// For each vNPU (by index), the shared physical cores its cores are
    /// placed on (empty: a core of its own). Overrides `device.cores`.
    pub shared_cores: Vec<Vec<vnpu_device::SharedCore>>,
    /// Names the VM's vNPU worker threads and shared-core tenants
    /// (`NAME/vnpu-SLOT`).
    pub name: String,
    /// Boot `guest` as a Linux kernel (bzImage or vmlinux) with this initrd
    /// and command line, instead of as a bare-metal ELF.
    pub linux: Option<LinuxBoot>,
    /// vNPUs served by a board daemon (`docs/vfio-user.md`): the vfio-user
    /// socket of each, attached as PCI functions after `vnpus`. Guest RAM
    /// is then a sealed memfd shared with the daemon.
    pub remote_vnpus: Vec<std::path::PathBuf>,
    /// What is known of each of `remote_vnpus` (its instance and shape),
    /// for a live migration's admission; may be shorter.
    pub remote_shapes: Vec<RemoteShape>,
    /// How long a remote vNPU whose server hung up waits for it to come
    /// back (a restarted board daemon resumes the device session) before
    /// its device reads as failed.
    pub reconnect: std::time::Duration,
    /// Bytes placed at the top of a bare-metal guest's RAM (page-aligned,
    /// above 32 MiB), handed to it in `rdx` (address) and `rcx` (length)
    /// and readable after the run with [`Vm::read_payload_at`]: how `vnpu
    /// infer` passes a model and its inputs in and gets the outputs back
    /// (docs/guest-boot.md).
    pub payload: Option<Payload>,
}

/// The bytes of one piece of a [`Payload`].
type PayloadBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A bare-metal guest's payload ([`VmConfig::payload`]): `len` bytes,
/// zero except where a piece was put. The pieces are written straight
/// into guest RAM (fresh guest RAM reads as zero), so a large payload is
/// never assembled in one more buffer first; a piece may be any bytes,
/// e.g. a mapped file. A piece put with its file ([`Payload::put_file`])
/// is mapped into guest RAM instead of written, where it can be.
#[derive(Clone, Default)]
pub struct Payload {
    len: u64,
    pieces: Vec<(u64, PayloadBytes, Option<Arc<File>>)>,
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pieces: Vec<(u64, usize)> =
            self.pieces.iter().map(|(at, b, _)| (*at, (**b).as_ref().len())).collect();
        f.debug_struct("Payload").field("len", &self.len).field("pieces (at, len)", &pieces).finish()
    }
}

impl Payload {
    /// `len` zero bytes.
    pub fn zeroed(len: u64) -> Self {
        Self { len, pieces: Vec::new() }
    }

    /// Puts `bytes` at offset `at`; fails when they do not fit.
    pub fn put(&mut self, at: u64, bytes: impl AsRef<[u8]> + Send + Sync + 'static) -> Result<(), VmError> {
        self.put_piece(at, bytes, None)
    }

    /// Puts `bytes`, the whole of `file`, at offset `at` (a multiple of
    /// [`PAYLOAD_ALIGN`], else they are written like [`Payload::put`]'s):
    /// the VM maps the file's pages there, copy-on-write, instead of
    /// writing the bytes into fresh guest RAM, which would fault in and
    /// copy every page. The file must neither change nor shrink while the
    /// VM runs; when it cannot be mapped (a VM whose RAM a daemon shares, or the
    /// mapping fails) the bytes are written.
    pub fn put_file(
        &mut self,
        at: u64,
        file: File,
        bytes: impl AsRef<[u8]> + Send + Sync + 'static,
    ) -> Result<(), VmError> {
        self.put_piece(at, bytes, Some(Arc::new(file)))
    }

    fn put_piece(
        &mut self,
        at: u64,
        bytes: impl AsRef<[u8]> + Send + Sync + 'static,
        file: Option<Arc<File>>,
    ) -> Result<(), VmError> {
        let n = bytes.as_ref().len();
        let fits = u64::try_from(n).ok().and_then(|n| at.checked_add(n)).is_some_and(|e| e <= self.len);
        if !fits {
            return Err(VmError::Memory {
                size: self.len,
                reason: format!("a payload piece of {n} bytes at {at} runs past its end"),
            });
        }
        self.pieces.push((at, std::sync::Arc::new(bytes), file));
        Ok(())
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where a payload went (guest address and length) and the files mapped
/// into guest RAM for it.
type Placed = (Option<(u64, u64)>, Arc<[vnpu_device::GuestFile]>);

/// Maps the first `len` bytes of `file` over guest RAM at `gpa`
/// (private, copy-on-write; the last page whole, its bytes past the
/// file's end zero), replacing fresh pages nothing has touched yet.
/// `Ok(false)`, with nothing changed, when `gpa` is not page-aligned, the
/// pages are not all inside RAM or the file is not `len` bytes long, or
/// when the mapping fails and fresh pages are put back.
fn map_file_into(memory: &GuestMemoryMmap<()>, gpa: u64, file: &File, len: usize) -> Result<bool, VmError> {
    let Some(pages) = u64::try_from(len).ok().and_then(|n| n.checked_next_multiple_of(PAYLOAD_ALIGN)) else {
        return Ok(false);
    };
    let file_len = file.metadata().map(|m| m.len()).ok();
    let Ok(map_len) = usize::try_from(pages) else { return Ok(false) };
    // The whole range must lie in one region (guest RAM is one).
    if pages == 0
        || !gpa.is_multiple_of(PAYLOAD_ALIGN)
        || file_len != u64::try_from(len).ok()
        || memory.get_slice(GuestAddress(gpa), map_len).is_err()
    {
        return Ok(false);
    }
    let Ok(host) = memory.get_host_address(GuestAddress(gpa)) else { return Ok(false) };
    let fd = std::os::fd::AsRawFd::as_raw_fd(file);
    let map = |flags: libc::c_int, fd: libc::c_int| {
        // SAFETY: `host .. host + map_len` lies inside guest RAM's one
        // mapping (checked just above), which `memory` owns and unmaps
        // whole when dropped. The VM has not run and no reference into
        // these pages exists (the payload is placed before the vCPU is
        // created), so replacing them (MAP_FIXED) changes nothing anyone
        // holds; KVM's slot covers the range by address and follows the
        // new mapping. A file mapping holds `len` bytes (checked), so
        // every page it maps has file bytes (no SIGBUS).
        unsafe {
            libc::mmap(
                host.cast(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | libc::MAP_PRIVATE | libc::MAP_FIXED,
                fd,
                0,
            )
        }
    };
    if map(0, fd) == host.cast() {
        return Ok(true);
    }
    // A failed MAP_FIXED may have unmapped the range: fresh pages back.
    if map(libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1) == host.cast() {
        return Ok(false);
    }
    Err(VmError::Memory {
        size: memory.last_addr().0.saturating_add(1),
        reason: format!("could not restore guest RAM at {gpa:#x} after mapping the payload's file failed"),
    })
}

impl VmConfig {
    /// `memory` bytes, booting `guest`, no vNPUs, the default board.
    pub fn new(memory: u64, guest: impl Into<std::path::PathBuf>) -> Self {
        Self {
            memory,
            guest: guest.into(),
            vnpus: Vec::new(),
            board: BoardConfig::default(),
            device: vnpu_device::DeviceOptions::default(),
            shared_cores: Vec::new(),
            name: "vm".into(),
            linux: None,
            remote_vnpus: Vec::new(),
            remote_shapes: Vec::new(),
            reconnect: remote::DEFAULT_RECONNECT,
            payload: None,
        }
    }

    /// Boots `guest` as a Linux kernel.
    pub fn linux(mut self, boot: LinuxBoot) -> Self {
        self.linux = Some(boot);
        self
    }

    /// With these vNPUs.
    pub fn vnpus(mut self, vnpus: &[VnpuSpec]) -> Self {
        self.vnpus = vnpus.to_vec();
        self
    }
}

impl<W: Write> Vm<W> {
    /// Creates the VM `cfg` describes: its RAM at guest address 0, one vNPU
    /// function (and worker thread) per vNPU; loads the guest ELF and
    /// prepares its one vCPU to enter it in long mode. Serial output goes
    /// to `console`.
    pub fn new(cfg: &VmConfig, console: W) -> Result<Self, VmError> {
        let count = cfg.vnpus.len() + cfg.remote_vnpus.len();
        Self::check_config(cfg, count)?;
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let vm = kvm.create_vm().map_err(ioctl("create VM"))?;
        let memory = Self::guest_memory(&vm, cfg)?;
        // No halt polling: a guest that halts while the vNPU works wants its
        // CPU given to the NPU worker, not spun on for KVM's default 200 us.
        // (Best effort: older kernels lack the capability.)
        let cap = kvm_bindings::kvm_enable_cap { cap: kvm_bindings::KVM_CAP_HALT_POLL, ..Default::default() };
        let _ = vm.enable_cap(&cap);
        // The in-kernel irqchip must exist before any vCPU.
        vm.create_irq_chip().map_err(ioctl("create irqchip"))?;
        let linux = cfg.linux.as_ref();
        let entry = Self::load_guest(&vm, &memory, cfg)?;
        let (cs, ds) = if linux.is_some() { (linux::BOOT_CS, linux::BOOT_DS) } else { (0x8, 0x10) };
        Self::write_boot_tables(&memory, cs, ds)?;
        let (payload, files) = Self::place_payload(&memory, cfg)?;
        let vcpu = vm.create_vcpu(0).map_err(ioctl("create vCPU"))?;
        if linux.is_some() {
            Self::linux_vcpu(&kvm, &vcpu)?;
        }
        Self::boot_registers(&vcpu, cfg, (cs, ds), entry, payload)?;

        let vm = Arc::new(vm);
        let msi = Arc::new(Mutex::new(irq::MsiRoutes::default()));
        let (mut pci, doorbells) = Self::pci_bus(cfg, &memory, &files, &vm, &msi)?;
        if linux.is_some() {
            Self::place_bars(&mut pci, count);
        }
        let irq = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)
            .map_err(|source| VmError::EventFd { what: "the serial port's eventfd", source })?;
        vm.register_irqfd(&irq, SERIAL_IRQ).map_err(ioctl("register the serial irqfd"))?;
        let no_snapshot = if linux.is_some() {
            Some("a Linux guest (its PIT and boot state are not saved yet)")
        } else if !cfg.shared_cores.is_empty() {
            Some("a vNPU on a shared core")
        } else {
            None
        };
        Ok(Self {
            _kvm: kvm,
            vm,
            vcpu,
            memory,
            serial: Arc::new(Mutex::new(Serial::new(IrqLine(irq), console))),
            cmos: cmos::Cmos::default(),
            pci,
            msi,
            doorbells,
            benchmark: None,
            payload,
            shape: Self::shape(cfg, payload),
            no_snapshot,
            pause: PauseHandle::default(),
        })
    }

    fn shape(cfg: &VmConfig, payload: Option<(u64, u64)>) -> snapshot::Shape {
        snapshot::Shape {
            memory: cfg.memory,
            board: cfg.board.clone(),
            vnpus: cfg.vnpus.clone(),
            name: cfg.name.clone(),
            poll_us: u64::try_from(cfg.device.poll.as_micros()).unwrap_or(u64::MAX),
            payload,
            remote: cfg.remote_vnpus.clone(),
            remote_shapes: cfg.remote_shapes.clone(),
        }
    }

    /// What a live migration needs from the API thread (none for a VM
    /// that cannot be snapshotted).
    fn migration_source(&self) -> Option<Arc<migrate::Source>> {
        if self.no_snapshot.is_some() {
            return None;
        }
        let host = self.memory.get_host_address(GuestAddress(0)).ok()?;
        Some(Arc::new(migrate::Source {
            vm: Arc::clone(&self.vm),
            memory: self.memory.clone(),
            region: kvm_userspace_memory_region {
                slot: 0,
                guest_phys_addr: 0,
                memory_size: self.shape.memory,
                userspace_addr: host as u64,
                flags: 0,
            },
            logs: self.doorbells.iter().filter_map(|d| d.state.as_ref().map(|h| h.write_log())).collect(),
            vnpus: self.doorbells.iter().filter_map(|d| Some((d.slot, d.state.clone()?))).collect(),
            remote: self.doorbells.iter().filter_map(|d| Some((d.slot, d.migration.clone()?))).collect(),
            shape: self.shape.clone(),
            carried: Mutex::new(Vec::new()),
        }))
    }

    /// A handle that asks this VM, while [`Self::run`] runs it, for a
    /// snapshot (from any thread).
    pub fn pause_handle(&self) -> PauseHandle {
        self.pause.set_source(self.migration_source());
        self.pause.clone()
    }

    /// Takes a snapshot into `dir` (new or empty): on the vCPU thread,
    /// between two runs of the vCPU, with every vNPU parked.
    fn take_snapshot(&mut self, dir: &std::path::Path, stop: bool) -> Result<SnapshotInfo, SnapshotError> {
        if let Some(why) = self.no_snapshot {
            return Err(SnapshotError::Unsupported(why));
        }
        let t = std::time::Instant::now();
        snapshot::fresh_dir(dir)?;
        // A daemon's vNPUs stop for it too; they run on afterwards unless
        // the VM ends, whatever happens to the snapshot.
        let mut stopped = Vec::new();
        let r = self.save_all(dir, t, &mut stopped);
        if r.is_err() || !stop {
            for (slot, h) in stopped {
                if let Err(e) = h.run() {
                    eprintln!("vnpu: the vNPU in slot {slot} after the snapshot: {e}");
                }
            }
        }
        r
    }

    fn save_all(
        &mut self,
        dir: &std::path::Path,
        t: std::time::Instant,
        stopped: &mut Vec<(usize, remote::MigrationHandle)>,
    ) -> Result<SnapshotInfo, SnapshotError> {
        // Every vNPU parked between requests first: nothing writes guest
        // RAM or raises an interrupt while the rest is saved.
        let mut parked = Vec::new();
        for d in &self.doorbells {
            if let Some(h) = &d.state {
                let p = h
                    .save(&snapshot::vnpu_dir(dir, d.slot))
                    .map_err(|source| SnapshotError::Device { slot: d.slot, source })?;
                parked.push(p);
            }
            if let Some(h) = &d.migration {
                let bytes = h.save().map_err(|source| SnapshotError::Remote { slot: d.slot, source })?;
                stopped.push((d.slot, h.clone()));
                snapshot::write_private(&snapshot::stream_file(dir, d.slot), &bytes)?;
            }
        }
        let drain = t.elapsed();
        let ram = dir.join(snapshot::RAM_FILE);
        let (ram_crc, ram_pages) = snapshot::save_ram(&self.memory, self.shape.memory, &ram)?;
        let m = self.machine_state()?;
        // The RAM file's digest is the one computed as it was written.
        let mut files = snapshot::manifest_except(dir, snapshot::RAM_FILE)?;
        files.insert(snapshot::RAM_FILE.into(), (self.shape.memory, ram_crc));
        let saved = snapshot::Saved {
            format: snapshot::SNAPSHOT_FORMAT.into(),
            version: snapshot::SNAPSHOT_VERSION,
            shape: self.shape.clone(),
            files,
            vcpu: m.vcpu,
            irqchips: m.irqchips,
            clock: m.clock,
            serial: m.serial,
            cmos_index: m.cmos_index,
            functions: m.functions,
        };
        snapshot::store(dir, &saved)?;
        drop(parked);
        let took = t.elapsed();
        Ok(SnapshotInfo { dir: dir.to_path_buf(), bytes: snapshot::allocated(dir), ram_pages, took, drain })
    }

    /// The vCPU, the interrupt controllers, the clock and the devices the
    /// VMM models, with the vCPU stopped.
    fn machine_state(&self) -> Result<migrate::Machine, SnapshotError> {
        let functions = (1..=self.doorbells.len())
            .filter_map(|slot| {
                let s = self.pci.function(slot)?.save_state();
                Some(snapshot::Function { slot, config: s.config, extra: s.extra })
            })
            .collect();
        Ok(migrate::Machine {
            vcpu: snapshot::save_vcpu(&self._kvm, &self.vcpu)?,
            irqchips: snapshot::save_irqchips(&self.vm)?,
            clock: self.vm.get_clock().map_err(snapshot::kvm("get clock"))?,
            serial: snapshot::Serial::from_superio(&uart(&self.serial).state()),
            cmos_index: self.cmos.index(),
            functions,
        })
    }

    /// Finishes a live migration on the vCPU thread (the vCPU stopped):
    /// every vNPU parks or stops, the rest goes across, and the
    /// destination says whether the VM runs there. If not, everything
    /// runs on here as it was.
    fn finish_migration(&mut self, out: &mut migrate::Outgoing) -> Result<MigrationInfo, SnapshotError> {
        let stopped = std::time::Instant::now();
        let mut parked = Vec::new();
        let mut halted = Vec::new();
        let r = (|| {
            let mut streams = Vec::new();
            for d in &self.doorbells {
                if let Some(h) = &d.state {
                    let (p, bytes) =
                        h.save_stream().map_err(|source| SnapshotError::Device { slot: d.slot, source })?;
                    parked.push(p);
                    streams.push((d.slot, bytes));
                }
                if let Some(h) = &d.migration {
                    let bytes = h.save().map_err(|source| SnapshotError::Remote { slot: d.slot, source })?;
                    halted.push((d.slot, h.clone()));
                    streams.push((d.slot, bytes));
                }
            }
            let drain = stopped.elapsed();
            let machine = self.machine_state()?;
            migrate::stop_and_copy(out, streams, &machine, stopped, drain)
        })();
        if r.is_err() {
            out.source.stop_logs();
            out.source.abort_precopy();
            for (slot, h) in halted {
                if let Err(e) = h.run() {
                    eprintln!("vnpu: the vNPU in slot {slot} after a failed migration: {e}");
                }
            }
        }
        drop(parked);
        r.map(|()| out.info.clone())
    }

    /// The configuration a saved shape rebuilds.
    fn config_of(shape: &snapshot::Shape) -> VmConfig {
        VmConfig {
            memory: shape.memory,
            guest: std::path::PathBuf::new(),
            vnpus: shape.vnpus.clone(),
            remote_vnpus: shape.remote.clone(),
            remote_shapes: shape.remote_shapes.clone(),
            board: shape.board.clone(),
            device: vnpu_device::DeviceOptions {
                poll: std::time::Duration::from_micros(shape.poll_us),
                ..Default::default()
            },
            name: shape.name.clone(),
            ..VmConfig::new(shape.memory, "")
        }
    }

    /// A VM a live migration brings in on `stream` (`vnpu receive`): the
    /// source's hello is checked and offered to `admit`, which gives the
    /// vfio-user sockets of the daemon-served vNPUs that take the
    /// source's here (or why the VM cannot come); then guest RAM, the
    /// device streams and the machine state come in, and the VM is ready
    /// to [`Self::run`] on. The source is told either way; it runs on
    /// itself unless this returns the VM.
    pub fn receive(
        stream: std::os::unix::net::UnixStream,
        console: W,
        admit: impl FnOnce(&Offer) -> Result<Vec<std::path::PathBuf>, String>,
    ) -> Result<Self, VmError> {
        let mut conn = migrate::Conn::new(stream)?;
        let hello = match migrate::hello(&mut conn) {
            Ok(h) => h,
            Err(e) => {
                let _ = migrate::admit(&mut conn, Some(e.to_string()));
                return Err(e.into());
            }
        };
        let refuse = |conn: &mut migrate::Conn, why: String| -> VmError {
            let _ = migrate::admit(conn, Some(why.clone()));
            SnapshotError::Refused(why).into()
        };
        let mut shape = hello.shape.clone();
        if let Err(e) = shape.board.validate() {
            return Err(refuse(&mut conn, format!("its board: {e}")));
        }
        let remote = match admit(&migrate::offer(&hello)) {
            Ok(r) => r,
            Err(why) => return Err(refuse(&mut conn, why)),
        };
        if remote.len() != shape.remote.len() {
            return Err(refuse(
                &mut conn,
                format!("{} daemon-served vNPUs here for the source's {}", remote.len(), shape.remote.len()),
            ));
        }
        shape.remote = remote;
        let cfg = Self::config_of(&shape);
        if let Err(e) = Self::check_config(&cfg, cfg.vnpus.len() + cfg.remote_vnpus.len()) {
            return Err(refuse(&mut conn, e.to_string()));
        }
        // A daemon's vNPU coming back to this host may still be held by
        // the VMM that took it away a moment ago, which is ending now: a
        // busy server is tried again for a while.
        let since = std::time::Instant::now();
        let (kvm, early, memory) = loop {
            let made = (|| {
                let kvm = Kvm::new().map_err(VmError::Kvm)?;
                let vm = kvm.create_vm().map_err(ioctl("create VM"))?;
                let memory = Self::guest_memory(&vm, &cfg)?;
                let early = Self::early(vm, &memory, &cfg)?;
                Ok::<_, VmError>((kvm, early, memory))
            })();
            match made {
                Ok(m) => break m,
                Err(VmError::Attach { source: remote::RemoteError::Busy { .. }, .. })
                    if since.elapsed() < std::time::Duration::from_secs(10) =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => return Err(refuse(&mut conn, e.to_string())),
            }
        };
        migrate::admit(&mut conn, None)?;
        let limits: Vec<u64> = shape
            .vnpus
            .iter()
            .map(vnpu_device::device_core::stream_limit)
            .chain(
                cfg.remote_shapes
                    .iter()
                    .map(|r| r.spec.as_ref().map_or(u64::MAX >> 1, vnpu_device::device_core::stream_limit)),
            )
            .collect();
        let limit = |slot: usize| slot.checked_sub(1).and_then(|i| limits.get(i).copied());
        let piece = |slot: usize, bytes: Vec<u8>| -> Result<(), SnapshotError> {
            let d = early.doorbells.iter().find(|d| d.slot == slot);
            match d.and_then(|d| d.state.as_ref()) {
                Some(h) => h.apply_piece(bytes).map_err(|source| SnapshotError::Device { slot, source }),
                None => match d.and_then(|d| d.migration.as_ref()) {
                    Some(h) => {
                        h.resume_write(&bytes).map_err(|source| SnapshotError::Remote { slot, source })
                    }
                    None => Err(SnapshotError::Stream(format!(
                        "a pre-copy piece for slot {slot}, which holds no vNPU"
                    ))),
                },
            }
        };
        let rx = migrate::receive(&mut conn, &memory, shape.memory, limit, piece)?;
        match Self::assemble(kvm, early, memory, shape, &rx.machine, Devices::Streams(rx.streams), console) {
            Ok(me) => {
                migrate::resumed(&mut conn, None, rx.done_at.elapsed())?;
                Ok(me)
            }
            Err(e) => {
                let _ = migrate::resumed(&mut conn, Some(e.to_string()), rx.done_at.elapsed());
                Err(e)
            }
        }
    }

    /// The VM a snapshot in `dir` saved, ready to [`Self::run`] on from
    /// where it was; its console goes to `console`. Refuses a snapshot of
    /// another format version, or one whose files are corrupt or missing.
    pub fn restore(dir: &std::path::Path, console: W) -> Result<Self, VmError> {
        let saved = snapshot::load(dir)?;
        let shape = saved.shape.clone();
        shape.board.validate().map_err(|e| SnapshotError::Format {
            path: dir.join(snapshot::STATE_FILE).display().to_string(),
            reason: format!("its board: {e}"),
        })?;
        let ram = snapshot::check_files(dir, &saved, shape.memory)?;
        let cfg = Self::config_of(&shape);
        Self::check_config(&cfg, cfg.vnpus.len())?;
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let vm = kvm.create_vm().map_err(ioctl("create VM"))?;
        let memory = Self::guest_memory(&vm, &cfg)?;
        // Guest RAM is the snapshot's file, mapped copy-on-write: pages are
        // read as the guest touches them, and the file is never written.
        // RAM a daemon shares is a memfd: the file's data is copied in.
        let len = usize::try_from(shape.memory).unwrap_or(usize::MAX);
        if !cfg.remote_vnpus.is_empty() {
            snapshot::copy_ram(&ram, &memory, shape.memory)?;
        } else if !map_file_into(&memory, 0, &ram, len)? {
            return Err(VmError::Memory {
                size: shape.memory,
                reason: "cannot map the snapshot's RAM file".into(),
            });
        }
        let machine = migrate::Machine {
            vcpu: saved.vcpu,
            irqchips: saved.irqchips,
            clock: saved.clock,
            serial: saved.serial,
            cmos_index: saved.cmos_index,
            functions: saved.functions,
        };
        let early = Self::early(vm, &memory, &cfg)?;
        Self::assemble(kvm, early, memory, shape, &machine, Devices::Folder(dir), console)
    }

    /// The devices of a restored or migrated VM on `vm` (with its
    /// interrupt controllers, in their reset state until
    /// [`Self::assemble`]): built before guest RAM or the device states
    /// come, so that a migration's pre-copy pieces reach the vNPUs.
    fn early(vm: VmFd, memory: &GuestMemoryMmap<()>, cfg: &VmConfig) -> Result<Early, VmError> {
        let cap = kvm_bindings::kvm_enable_cap { cap: kvm_bindings::KVM_CAP_HALT_POLL, ..Default::default() };
        let _ = vm.enable_cap(&cap);
        vm.create_irq_chip().map_err(ioctl("create irqchip"))?;
        let vm = Arc::new(vm);
        let msi = Arc::new(Mutex::new(irq::MsiRoutes::default()));
        let (pci, doorbells) = Self::pci_bus(cfg, memory, &Arc::from([]), &vm, &msi)?;
        Ok(Early { vm, msi, pci, doorbells })
    }

    /// Builds a restored or migrated VM on `vm` whose guest RAM `memory`
    /// holds the saved RAM already: the interrupt controllers, the vCPU,
    /// the clock, the devices (each vNPU's state from `devices`), ready
    /// to [`Self::run`] on.
    fn assemble(
        kvm: Kvm,
        early: Early,
        memory: GuestMemoryMmap<()>,
        shape: snapshot::Shape,
        saved: &migrate::Machine,
        devices: Devices<'_>,
        console: W,
    ) -> Result<Self, VmError> {
        let Early { vm, msi, mut pci, doorbells } = early;
        for c in &saved.irqchips {
            vm.set_irqchip(c).map_err(snapshot::kvm("set irqchip"))?;
        }
        let vcpu = vm.create_vcpu(0).map_err(ioctl("create vCPU"))?;
        snapshot::restore_vcpu(&vcpu, &saved.vcpu)?;
        let clock = kvm_bindings::kvm_clock_data { clock: saved.clock.clock, ..Default::default() };
        vm.set_clock(&clock).map_err(snapshot::kvm("set clock"))?;
        for f in &saved.functions {
            let state = vnpu_pci::FunctionState { config: f.config.clone(), extra: f.extra.clone() };
            let func = pci
                .function_mut(f.slot)
                .ok_or(SnapshotError::Pci { slot: f.slot, source: vnpu_pci::PciError::Slot(f.slot) })?;
            func.restore_state(&state).map_err(|source| SnapshotError::Pci { slot: f.slot, source })?;
        }
        for d in &doorbells {
            match &devices {
                Devices::Folder(dir) => {
                    if let Some(h) = &d.state {
                        h.restore(&snapshot::vnpu_dir(dir, d.slot))
                            .map_err(|source| SnapshotError::Device { slot: d.slot, source })?;
                    }
                    if let Some(h) = &d.migration {
                        let p = snapshot::stream_file(dir, d.slot);
                        let bytes = std::fs::read(&p).map_err(snapshot::io_at(&p))?;
                        h.load(&bytes).map_err(|source| SnapshotError::Remote { slot: d.slot, source })?;
                    }
                }
                Devices::Streams(streams) => {
                    let missing =
                        || SnapshotError::Stream(format!("no device stream for the vNPU in slot {}", d.slot));
                    let bytes = streams.get(&d.slot).ok_or_else(missing)?;
                    if let Some(h) = &d.state {
                        h.restore_stream(bytes.clone())
                            .map_err(|source| SnapshotError::Device { slot: d.slot, source })?;
                    }
                    if let Some(h) = &d.migration {
                        h.load(bytes).map_err(|source| SnapshotError::Remote { slot: d.slot, source })?;
                    }
                }
            }
        }
        let irq = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)
            .map_err(|source| VmError::EventFd { what: "the serial port's eventfd", source })?;
        vm.register_irqfd(&irq, SERIAL_IRQ).map_err(ioctl("register the serial irqfd"))?;
        let serial = Serial::from_state(
            &saved.serial.to_superio(),
            IrqLine(irq),
            vm_superio::serial::NoEvents,
            console,
        )
        .map_err(|e| SnapshotError::Serial(format!("{e:?}")))?;
        let mut me = Self {
            _kvm: kvm,
            vm,
            vcpu,
            memory,
            serial: Arc::new(Mutex::new(serial)),
            cmos: cmos::Cmos::with_index(saved.cmos_index),
            pci,
            msi,
            doorbells,
            benchmark: None,
            payload: shape.payload,
            shape,
            no_snapshot: None,
            pause: PauseHandle::default(),
        };
        me.sync_doorbells();
        // The rings are taken up again now that RAM and the functions'
        // configuration (MSI-X) are back.
        for d in &me.doorbells {
            if let Some(h) = &d.state {
                h.resume();
            }
        }
        Ok(me)
    }

    /// The vNPU count and the memory size a configuration may have.
    fn check_config(cfg: &VmConfig, count: usize) -> Result<(), VmError> {
        if count > MAX_VNPUS {
            return Err(VmError::TooManyVnpus { count });
        }
        // RAM ends where the PCI hole starts (the BARs, ECAM, the system
        // controller and the local APIC live in the top GiB, which the
        // boot identity map marks cache-disabled).
        let (max, why) = (PCI_MMIO_BASE, "3 GiB (RAM ends where the PCI hole starts)");
        if !(MIN_MEMORY..=max).contains(&cfg.memory) {
            return Err(VmError::Memory {
                size: cfg.memory,
                reason: format!("must be between {MIN_MEMORY} bytes and {why}"),
            });
        }
        Ok(())
    }

    /// Guest RAM (in a sealed memfd when a daemon's vNPU must share it),
    /// registered with KVM as slot 0.
    fn guest_memory(vm: &VmFd, cfg: &VmConfig) -> Result<GuestMemoryMmap<()>, VmError> {
        let memory_bytes = cfg.memory;
        let len = usize::try_from(memory_bytes).map_err(|_| VmError::Memory {
            size: memory_bytes,
            reason: "larger than the address space".into(),
        })?;
        let memory: GuestMemoryMmap<()> = if cfg.remote_vnpus.is_empty() {
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), len)])
        } else {
            let file = shared_ram(memory_bytes)
                .map_err(|e| VmError::Memory { size: memory_bytes, reason: format!("memfd: {e}") })?;
            GuestMemoryMmap::from_ranges_with_files([(
                GuestAddress(0),
                len,
                Some(vm_memory::FileOffset::new(file, 0)),
            )])
        }
        .map_err(|e| VmError::Memory { size: memory_bytes, reason: e.to_string() })?;
        let host = memory
            .get_host_address(GuestAddress(0))
            .map_err(|e| VmError::Memory { size: memory_bytes, reason: e.to_string() })?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: memory_bytes,
            userspace_addr: host as u64,
            flags: 0,
        };
        // SAFETY: `host` is the start of a mapping of `memory_bytes` bytes
        // owned by `memory`, which the Vm keeps alive as long as the VM fd.
        unsafe { vm.set_user_memory_region(region) }.map_err(ioctl("set memory region"))?;
        Ok(memory)
    }

    /// Loads the Linux kernel (with the PIT and TSS a PC kernel expects) or
    /// the bare-metal ELF; returns the entry point.
    fn load_guest(vm: &VmFd, memory: &GuestMemoryMmap<()>, cfg: &VmConfig) -> Result<u64, VmError> {
        let guest = cfg.guest.as_path();
        Ok(match cfg.linux.as_ref() {
            Some(boot) => {
                // What a PC kernel expects beside the irqchip: the PIT (with
                // the speaker port stubbed) and, on VMX hosts, the TSS area.
                let pit = kvm_bindings::kvm_pit_config {
                    flags: kvm_bindings::KVM_PIT_SPEAKER_DUMMY,
                    ..Default::default()
                };
                vm.create_pit2(pit).map_err(ioctl("create PIT"))?;
                vm.set_tss_address(0xfffb_d000).map_err(ioctl("set TSS address"))?;
                linux::load(memory, cfg.memory, guest, boot, 1)?
            }
            None => {
                let mut file = File::open(guest)
                    .map_err(|source| VmError::Open { path: guest.display().to_string(), source })?;
                let loaded =
                    Elf::load(memory, None, &mut file, Some(GuestAddress(HIGHMEM_START))).map_err(|e| {
                        VmError::Load { path: guest.display().to_string(), reason: e.to_string() }
                    })?;
                loaded.kernel_load.0
            }
        })
    }

    /// A bare-metal guest's payload, copied to the top of RAM (page
    /// aligned, above `PAYLOAD_MIN`): its address and length.
    /// Also returns the files it mapped into RAM, for the vNPUs' DMA.
    fn place_payload(memory: &GuestMemoryMmap<()>, cfg: &VmConfig) -> Result<Placed, VmError> {
        let memory_bytes = cfg.memory;
        match (&cfg.payload, cfg.linux.as_ref()) {
            (Some(p), None) => {
                let at = memory_bytes
                    .checked_sub(p.len())
                    .map(|a| a & !(PAYLOAD_ALIGN - 1))
                    .filter(|&a| a >= PAYLOAD_MIN);
                let at = at.ok_or_else(|| VmError::Memory {
                    size: memory_bytes,
                    reason: format!(
                        "the payload of {} bytes must fit above {} MiB: give the VM more memory",
                        p.len(),
                        PAYLOAD_MIN >> 20
                    ),
                })?;
                // Every piece lies inside the payload (`Payload::put`), and
                // the payload inside RAM (`at + len <= memory_bytes`).
                // Files first: a mapping covers its last page whole, and
                // the pieces written after it may share that page.
                let local = cfg.remote_vnpus.is_empty();
                let mut mapped = vec![false; p.pieces.len()];
                let mut files = Vec::new();
                for ((off, bytes, file), done) in p.pieces.iter().zip(&mut mapped) {
                    if let (Some(file), true) = (file, local) {
                        let len = (**bytes).as_ref().len();
                        *done = map_file_into(memory, at + off, file, len)?;
                        if *done {
                            files.push(vnpu_device::GuestFile {
                                gpa: at + off,
                                len: len as u64,
                                file: file.clone(),
                            });
                        }
                    }
                }
                for ((off, bytes, _), done) in p.pieces.iter().zip(&mapped) {
                    if *done {
                        continue;
                    }
                    memory.write_slice((**bytes).as_ref(), GuestAddress(at + off)).map_err(|e| {
                        VmError::Memory { size: memory_bytes, reason: format!("payload: {e}") }
                    })?;
                }
                Ok((Some((at, p.len())), Arc::from(files)))
            }
            (Some(_), Some(_)) => Err(VmError::Memory {
                size: memory_bytes,
                reason: "a payload is for bare-metal guests".into(),
            }),
            (None, _) => Ok((None, Arc::from([]))),
        }
    }

    /// Long mode at `entry` with the boot tables' segments `(cs, ds)`, and
    /// the boot arguments: the zero page for Linux, else memory size, TSC
    /// rate and payload (docs/guest-boot.md).
    fn boot_registers(
        vcpu: &VcpuFd,
        cfg: &VmConfig,
        (cs, ds): (u16, u16),
        entry: u64,
        payload: Option<(u64, u64)>,
    ) -> Result<(), VmError> {
        let mut sregs = vcpu.get_sregs().map_err(ioctl("get sregs"))?;
        let (code, data) = (segment(cs, true), segment(ds, false));
        sregs.cs = code;
        sregs.ds = data;
        sregs.es = data;
        sregs.fs = data;
        sregs.gs = data;
        sregs.ss = data;
        sregs.gdt.base = GDT_ADDR;
        sregs.gdt.limit = 4 * 8 - 1;
        sregs.cr3 = PML4_ADDR;
        sregs.cr4 |= 1 << 5; // PAE
        sregs.cr0 |= (1 << 0) | (1 << 31); // PE, PG
        sregs.efer |= (1 << 8) | (1 << 10); // LME, LMA
        vcpu.set_sregs(&sregs).map_err(ioctl("set sregs"))?;
        let mut regs = vcpu.get_regs().map_err(ioctl("get regs"))?;
        regs.rip = entry;
        regs.rsp = STACK_TOP;
        regs.rflags = 2;
        if cfg.linux.is_some() {
            // The 64-bit boot protocol: rsi = the zero page.
            regs.rsi = linux::ZERO_PAGE;
        } else {
            // Boot arguments (docs/guest-boot.md): memory size and TSC rate.
            regs.rdi = cfg.memory;
            regs.rsi = vcpu.get_tsc_khz().map(u64::from).unwrap_or(0);
            // The payload (0, 0 without one).
            (regs.rdx, regs.rcx) = payload.unwrap_or((0, 0));
        }
        vcpu.set_regs(&regs).map_err(ioctl("set regs"))?;
        Ok(())
    }

    /// `len` bytes of the payload from offset `offset`, as the guest left
    /// them (a caller reads back only what the guest wrote, not megabytes
    /// of inputs); `None` when the VM was given no payload. Fails when the
    /// range runs past the payload's end.
    pub fn read_payload_at(&self, offset: u64, len: u64) -> Result<Option<Vec<u8>>, VmError> {
        let Some((at, total)) = self.payload else { return Ok(None) };
        let end = offset.checked_add(len).filter(|&e| e <= total);
        let size = end.and_then(|_| usize::try_from(len).ok()).ok_or_else(|| VmError::Memory {
            size: total,
            reason: format!("payload bytes {offset}+{len} run past its end"),
        })?;
        let mut b = vec![0u8; size];
        self.memory
            .read_slice(&mut b, GuestAddress(at + offset))
            .map_err(|e| VmError::Memory { size: len, reason: format!("reading the payload back: {e}") })?;
        Ok(Some(b))
    }

    /// Calls `hook` for every write to a benchmark register
    /// ([`SYSCON_BENCH`]), on the vCPU thread while the guest waits.
    pub fn set_benchmark_hook(&mut self, hook: BenchmarkHook) {
        self.benchmark = Some(hook);
    }

    /// The vCPU's TSC rate in kHz, as the guest was told it (0 if KVM
    /// could not tell).
    pub fn tsc_khz(&self) -> u32 {
        self.vcpu.get_tsc_khz().unwrap_or(0)
    }

    /// CPUID, FPU and local APIC set up as a PC's firmware leaves them, for
    /// a Linux kernel: the host's supported CPUID with this vCPU's APIC ID
    /// (0) and one logical processor; LINT0 = ExtINT, LINT1 = NMI.
    fn linux_vcpu(kvm: &Kvm, vcpu: &VcpuFd) -> Result<(), VmError> {
        let mut cpuid = kvm
            .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("get supported CPUID"))?;
        let tcg = host_is_qemu_tcg();
        // KVM emulates the local APIC's TSC-deadline mode; a kernel that sees
        // it needs no APIC timer calibration (which the nested path's
        // timing fails).
        let deadline = kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer);
        // QEMU's TCG, when it is the host (the nested test path), does not
        // let KVM see a nested guest's XSETBV, so KVM reports the XSAVE size
        // of the reset XCR0 and Linux warns at boot; such guests get FXSAVE
        // only: no XSAVE, OSXSAVE, AVX, FMA, F16C (leaf 1), AVX2, AVX-512
        // (leaf 7), and no leaf 0xD.
        const LEAF1_XSAVE_ECX: u32 = (1 << 26) | (1 << 27) | (1 << 28) | (1 << 12) | (1 << 29);
        const LEAF7_AVX_EBX: u32 = (1 << 5) | (1 << 16) | (1 << 17) | (1 << 28) | (1 << 30) | (1 << 31);
        for e in cpuid.as_mut_slice() {
            match e.function {
                1 => {
                    e.ebx = (e.ebx & 0x0000_ffff) | (1 << 16);
                    if deadline {
                        e.ecx |= 1 << 24;
                    }
                    // "Running under a hypervisor": the guest then finds
                    // KVM's leaves (kvm-clock, paravirtual features).
                    e.ecx |= 1 << 31;
                    if tcg {
                        e.ecx &= !LEAF1_XSAVE_ECX;
                    }
                }
                7 if tcg && e.index == 0 => e.ebx &= !LEAF7_AVX_EBX,
                0xd if tcg => {
                    e.eax = 0;
                    e.ebx = 0;
                    e.ecx = 0;
                    e.edx = 0;
                }
                0xb | 0x1f => e.edx = 0,
                // XSAVE area size for the enabled features: a kernel enables
                // every supported one, so it is the size for all (ECX).
                0xd if e.index == 0 => e.ebx = e.ecx,
                _ => {}
            }
        }
        vcpu.set_cpuid2(&cpuid).map_err(ioctl("set CPUID"))?;
        let fpu = kvm_bindings::kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() };
        vcpu.set_fpu(&fpu).map_err(ioctl("set FPU"))?;
        let mut lapic = vcpu.get_lapic().map_err(ioctl("get local APIC"))?;
        for (reg, mode) in [(0x350usize, 7u32), (0x360, 4)] {
            let mut b = [0u8; 4];
            for (i, x) in b.iter_mut().enumerate() {
                *x = lapic.regs[reg + i].to_le_bytes()[0];
            }
            let v = (u32::from_le_bytes(b) & !0x700) | (mode << 8);
            for (i, x) in v.to_le_bytes().iter().enumerate() {
                lapic.regs[reg + i] = i8::from_le_bytes([*x]);
            }
        }
        vcpu.set_lapic(&lapic).map_err(ioctl("set local APIC"))?;
        Ok(())
    }

    /// Places each vNPU's BARs (BAR 0 at `PCI_MMIO_BASE + slot * 64 KiB`,
    /// BAR 2 at +32 KiB) and leaves decoding off, as firmware does before
    /// an OS that keeps firmware assignments.
    fn place_bars(pci: &mut PciBus, vnpus: usize) {
        for slot in 1..=vnpus {
            let bar0 = PCI_MMIO_BASE + slot as u64 * 0x1_0000;
            for (reg, addr) in [(0x10u64, bar0), (0x18, bar0 + 0x8000)] {
                let off = ((slot as u64) << 15) | reg;
                let [lo, hi] = split_u64(addr);
                pci.ecam_write(off, &lo.to_le_bytes());
                pci.ecam_write(off + 4, &hi.to_le_bytes());
            }
        }
    }

    /// Bus 0: host bridge at 00:00.0, vNPU functions from 00:01.0 on.
    fn pci_bus(
        cfg: &VmConfig,
        memory: &GuestMemoryMmap<()>,
        files: &Arc<[vnpu_device::GuestFile]>,
        vm: &Arc<VmFd>,
        msi: &Arc<Mutex<irq::MsiRoutes>>,
    ) -> Result<(PciBus, Vec<Doorbells>), VmError> {
        let mut bus = PciBus::new();
        let bridge = Identity {
            vendor_id: vnpu_device::VENDOR_ID,
            device_id: HOST_BRIDGE_DEVICE_ID,
            class: 0x06_00_00,
            revision: 0,
            subsystem_vendor_id: vnpu_device::VENDOR_ID,
            subsystem_id: 0,
        };
        bus.add(0, Box::new(PlainFunction(ConfigSpace::new(bridge))))?;
        let mut doorbells = Vec::new();
        let (vnpus, board) = (&cfg.vnpus, &cfg.board);
        for (i, spec) in vnpus.iter().enumerate() {
            let slot = i + 1;
            let mut device = cfg.device.clone();
            device.guest_files = files.clone();
            if let Some(cores) = cfg.shared_cores.get(i) {
                device.cores = cores.clone();
            }
            let sink = Arc::new(SlotSink { slot, vm: Arc::clone(vm), routes: Arc::clone(msi) });
            let f = VnpuFunction::new(
                spec,
                board,
                memory.clone(),
                sink,
                &format!("{}/vnpu-{slot}", cfg.name),
                device,
            )?;
            let mut events = f.ioevents().map_err(vnpu_device::DeviceError::Io)?;
            let loopback = msi
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .irqfd(vm, slot, vnpu_abi::device::LOOPBACK_VECTOR)
                .map_err(|source| VmError::Loopback { slot, source })?;
            events.push((vnpu_device::regs::CAL_LOOPBACK, loopback));
            let (grant, state) = (Some(f.grant_handle()), Some(f.state_handle()));
            bus.add(slot, Box::new(f))?;
            let io = Arc::new(Mutex::new(remote::IoEvents { events, registered: None }));
            doorbells.push(Doorbells { slot, io, grant, state, migration: None });
        }
        for (i, path) in cfg.remote_vnpus.iter().enumerate() {
            let slot = vnpus.len() + i + 1;
            let f = remote::RemoteFunction::attach(
                path,
                slot,
                memory,
                Arc::clone(vm),
                Arc::clone(msi),
                cfg.reconnect,
            )
            .map_err(|source| VmError::Attach { path: path.display().to_string(), source })?;
            let (io, migration) = (f.ioevents(), Some(f.migration_handle()));
            bus.add(slot, Box::new(f))?;
            doorbells.push(Doorbells { slot, io, grant: None, state: None, migration });
        }
        Ok((bus, doorbells))
    }

    /// Moves each vNPU's doorbell ioeventfds to where its BAR 0 is now
    /// decoded (after any configuration write: BAR moves and command
    /// register changes).
    fn sync_doorbells(&mut self) {
        for d in &self.doorbells {
            let now = self
                .pci
                .function(d.slot)
                .map(|f| f.config())
                .filter(|c| c.memory_enabled())
                .and_then(|c| c.bar_address(0))
                .filter(|a| *a != 0);
            d.io.lock().unwrap_or_else(std::sync::PoisonError::into_inner).place(&self.vm, now);
        }
    }

    /// The PCI bus (for tests and the device layer).
    /// Handles that change each vNPU's grant while the VM runs (a live
    /// remap), in the order of [`VmConfig::vnpus`].
    pub fn grant_handles(&self) -> Vec<vnpu_device::GrantHandle> {
        self.doorbells.iter().filter_map(|d| d.grant.clone()).collect()
    }

    pub fn pci(&self) -> &PciBus {
        &self.pci
    }

    /// The GDT (a flat 64-bit code segment at selector `cs`, a flat data
    /// segment at `ds`) and the identity map of the first 4 GiB.
    fn write_boot_tables(m: &GuestMemoryMmap<()>, cs: u16, ds: u16) -> Result<(), VmError> {
        let err = |e: vm_memory::GuestMemoryError| VmError::Memory { size: 0, reason: e.to_string() };
        let mut gdt = [0u64; 4];
        gdt[usize::from(cs >> 3)] = 0x00af_9b00_0000_ffff;
        gdt[usize::from(ds >> 3)] = 0x00cf_9300_0000_ffff;
        for (i, d) in gdt.iter().enumerate() {
            m.write_obj(*d, GuestAddress(GDT_ADDR + 8 * i as u64)).map_err(err)?;
        }
        m.write_obj(PDPT_ADDR | 3, GuestAddress(PML4_ADDR)).map_err(err)?;
        for d in 0..4u64 {
            m.write_obj((PD_ADDR + 0x1000 * d) | 3, GuestAddress(PDPT_ADDR + 8 * d)).map_err(err)?;
        }
        for i in 0..4 * 512u64 {
            // 2 MiB pages: present, writable, page size; the top GiB (MMIO)
            // also cache-disabled.
            let flags = if i >= 3 * 512 { 0x93 } else { 0x83 };
            m.write_obj((i << 21) | flags, GuestAddress(PD_ADDR + 8 * i)).map_err(err)?;
        }
        Ok(())
    }

    /// Delivers the MSIs PCI functions queued (functions without their own
    /// sink), each through the irqfd of its (function, vector) GSI.
    fn deliver_interrupts(&mut self) {
        for (slot, m) in self.pci.take_interrupts() {
            let mut r = self.msi.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // Undeliverable messages are dropped, as on hardware.
            let _ = r.deliver(&self.vm, slot, m);
        }
    }

    fn exit(&mut self, code: u32) -> u32 {
        let _ = uart(&self.serial).writer_mut().flush();
        code
    }

    /// Runs the guest until it writes the exit port (or, for a Linux
    /// guest, resets through the i8042: exit code 0); returns its exit code.
    /// A snapshot asked through [`Self::pause_handle`] meanwhile is taken
    /// between two runs of the vCPU; one that asked the VM to stop after
    /// it ends the run with [`VmError::StoppedAfterSnapshot`].
    pub fn run(&mut self) -> Result<u32, VmError> {
        self.pause.running()?;
        let r = self.run_loop();
        self.pause.stopped();
        r
    }

    /// Answers a snapshot request (after KVM_RUN returned EINTR, so no
    /// access is half done); true when the VM is to stop.
    fn serve_pause(&mut self) -> Option<VmError> {
        match self.pause.asked()? {
            snapshot::Ask::Snapshot { dir, stop } => {
                let r = self.take_snapshot(&dir, stop);
                let end = r.is_ok() && stop;
                self.pause.answer(r.map(snapshot::Done::Snapshot));
                end.then_some(VmError::StoppedAfterSnapshot)
            }
            snapshot::Ask::Finish(mut out) => {
                let r = self.finish_migration(&mut out);
                let end = r.is_ok();
                self.pause.answer(r.map(snapshot::Done::Migrated));
                end.then_some(VmError::MigratedAway)
            }
        }
    }

    fn run_loop(&mut self) -> Result<u32, VmError> {
        loop {
            self.deliver_interrupts();
            let exit = match self.vcpu.run() {
                Ok(exit) => exit,
                Err(e) if e.errno() == libc::EINTR => {
                    if let Some(end) = self.serve_pause() {
                        let _ = uart(&self.serial).writer_mut().flush();
                        // The asker's reply goes out before this process
                        // may end.
                        self.pause.wait_reply_sent(std::time::Duration::from_secs(5));
                        return Err(end);
                    }
                    continue;
                }
                Err(e) => return Err(VmError::Ioctl { what: "run vCPU", source: e }),
            };
            match exit {
                VcpuExit::IoOut(port, data) => {
                    if port == EXIT_PORT {
                        let code = le_u32(data);
                        return Ok(self.exit(code));
                    }
                    if port == I8042_COMMAND_PORT && data.first() == Some(&I8042_RESET) {
                        return Ok(self.exit(0));
                    }
                    if port == cmos::CMOS_INDEX || port == cmos::CMOS_DATA {
                        if let Some(v) = data.first() {
                            self.cmos.write(port, *v);
                        }
                    }
                    if (SERIAL_PORT..SERIAL_PORT + 8).contains(&port) {
                        if let Some(v) = data.first() {
                            // A write the UART cannot take is dropped, as on hardware.
                            let _ = uart(&self.serial).write((port - SERIAL_PORT).to_le_bytes()[0], *v);
                        }
                    } else if (vnpu_pci::CONF1_ADDRESS..vnpu_pci::CONF1_ADDRESS + 8).contains(&port) {
                        self.pci.pio_write(port, data);
                        self.sync_doorbells();
                    }
                }
                VcpuExit::IoIn(port, data) => {
                    if (vnpu_pci::CONF1_ADDRESS..vnpu_pci::CONF1_ADDRESS + 8).contains(&port) {
                        self.pci.pio_read(port, data);
                    } else {
                        let v = if (SERIAL_PORT..SERIAL_PORT + 8).contains(&port) {
                            uart(&self.serial).read((port - SERIAL_PORT).to_le_bytes()[0])
                        } else if port == cmos::CMOS_INDEX || port == cmos::CMOS_DATA {
                            self.cmos.read(port)
                        } else if port == I8042_COMMAND_PORT {
                            // Status: input buffer empty, so a reset command
                            // is taken at once; output buffer always full,
                            // so a probing OS finds no controller (its
                            // flush never drains) and says so quietly.
                            0x01
                        } else {
                            0xff
                        };
                        data.iter_mut().for_each(|b| *b = v);
                    }
                }
                VcpuExit::MmioRead(addr, data) => {
                    match addr.checked_sub(ECAM_BASE).filter(|o| *o < ECAM_SIZE) {
                        Some(off) => self.pci.ecam_read(off, data),
                        None => {
                            if !self.pci.mmio_read(addr, data) {
                                data.iter_mut().for_each(|b| *b = 0xff);
                            }
                        }
                    }
                }
                VcpuExit::MmioWrite(addr, data) => {
                    if addr == SYSCON_BASE + SYSCON_EXIT {
                        let code = le_u32(data);
                        return Ok(self.exit(code));
                    }
                    if let Some(id) = addr
                        .checked_sub(SYSCON_BASE + SYSCON_BENCH)
                        .filter(|o| *o < 8 * SYSCON_BENCH_SLOTS)
                        .and_then(|o| u32::try_from(o / 8).ok())
                    {
                        if let Some(hook) = self.benchmark.as_mut() {
                            hook(id, le_u64(data));
                        }
                        continue;
                    }
                    if addr == SYSCON_BASE + SYSCON_CONSOLE {
                        if let Some(v) = data.first() {
                            let _ = uart(&self.serial).write(0, *v);
                        }
                        continue;
                    }
                    match addr.checked_sub(ECAM_BASE).filter(|o| *o < ECAM_SIZE) {
                        Some(off) => {
                            self.pci.ecam_write(off, data);
                            self.sync_doorbells();
                        }
                        None => {
                            // Writes nothing decodes are dropped, as on a bus.
                            let _ = self.pci.mmio_write(addr, data);
                        }
                    }
                }
                VcpuExit::Hlt => return Err(VmError::Guest("halted without writing the exit port".into())),
                VcpuExit::Shutdown => {
                    let rip = self.vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VmError::Guest(format!("shutdown (triple fault?) near rip {rip:#x}")));
                }
                other => return Err(VmError::Guest(format!("unexpected exit {other:?}"))),
            }
        }
    }

    /// Feeds the bytes read from `input` to the UART's receive FIFO (the
    /// guest's console input, with an interrupt on IRQ 4 when the guest
    /// enabled it), on a thread of its own, until end of input. When the
    /// FIFO is full it waits for the guest to drain it: nothing is dropped.
    pub fn forward_input<R: std::io::Read + Send + 'static>(&self, mut input: R) -> std::io::Result<()>
    where
        W: Send + 'static,
    {
        let serial = Arc::clone(&self.serial);
        std::thread::Builder::new().name("serial-in".into()).spawn(move || {
            let mut buf = [0u8; 256];
            loop {
                let n = match input.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let mut rest = &buf[..n];
                while !rest.is_empty() {
                    let taken = {
                        let mut u = uart(&serial);
                        let room = u.fifo_capacity().min(rest.len());
                        if room == 0 {
                            0
                        } else {
                            u.enqueue_raw_bytes(&rest[..room]).unwrap_or(0)
                        }
                    };
                    if taken == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    rest = &rest[taken..];
                }
            }
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `len` bytes `i % 251` (removed when dropped).
    struct Temp(std::path::PathBuf, File);

    impl Temp {
        fn new(name: &str, len: usize) -> Self {
            let path = std::env::temp_dir().join(format!("vnpu-vm-{}-{name}", std::process::id()));
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            File::create(&path).and_then(|mut f| f.write_all(&bytes)).expect("write the test file");
            let f = File::open(&path).expect("open the test file");
            Self(path, f)
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn ram() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest RAM")
    }

    #[test]
    fn a_mapped_file_reads_as_its_bytes_then_zero_and_writes_stay_private() {
        let len = 3 * 4096 + 100;
        let t = Temp::new("map", len);
        let m = ram();
        m.write_slice(&[7; 16], GuestAddress(0x1_0000 - 16)).expect("write before");
        assert_eq!(map_file_into(&m, 0x1_0000, &t.1, len).ok(), Some(true));
        let mut got = vec![0u8; 4 * 4096];
        m.read_slice(&mut got, GuestAddress(0x1_0000)).expect("read");
        let want: Vec<u8> = (0..4 * 4096).map(|i| if i < len { (i % 251) as u8 } else { 0 }).collect();
        assert!(got == want, "the file's bytes, then zero to the page's end");
        // RAM around it is untouched, and a guest write is its own.
        let mut before = [0u8; 16];
        m.read_slice(&mut before, GuestAddress(0x1_0000 - 16)).expect("read before");
        assert_eq!(before, [7; 16]);
        m.write_slice(&[0xee; 64], GuestAddress(0x1_0000 + 10)).expect("write");
        m.write_slice(&[0xdd; 64], GuestAddress(0x1_0000 + len as u64)).expect("write the tail");
        let file = std::fs::read(&t.0).expect("read the file back");
        assert!(file.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "the file is unchanged");
        assert_eq!(file.len(), len);
    }

    /// The vNPU's DMA from a mapped file's pages into HBM maps whole
    /// chunks of them while the guest has not written them, and copies a
    /// chunk with a page the guest wrote: HBM holds what guest RAM holds.
    #[test]
    fn dma_maps_the_guests_unchanged_file_pages_into_hbm() {
        use npu_model::memory::{Memory, HBM_CHUNK};
        use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Sram};
        use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};
        let len = 3 * HBM_CHUNK as usize + 100;
        let t = Temp::new("dma", len);
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 8 << 20)]).expect("guest RAM");
        let gpa = 0x10_0000;
        assert_eq!(map_file_into(&m, gpa, &t.1, len).ok(), Some(true));
        let files: Arc<[vnpu_device::GuestFile]> = Arc::from([vnpu_device::GuestFile {
            gpa,
            len: len as u64,
            file: Arc::new(t.1.try_clone().expect("dup")),
        }]);
        let guest = vnpu_device::GuestRam::with_files(&m, files.clone());
        assert_eq!(guest.file_pages(gpa + 4096, 8192).map(|(_, o)| o), Some(4096));
        assert!(guest.file_pages(gpa + len as u64 - 10, 20).is_none(), "past the file's end");
        // The guest writes a byte of the file's second MiB.
        m.write_slice(&[0xab], GuestAddress(gpa + HBM_CHUNK + 5)).expect("guest write");
        assert!(guest.file_pages(gpa + HBM_CHUNK, 4096).is_none(), "a written page is the guest's own");
        assert!(guest.file_pages(gpa + 2 * HBM_CHUNK, 4096).is_some());
        let mut p = ProgramBuilder::new();
        p.push(Engine::DMA, Instr::copy(Addr::guest(gpa), Addr::hbm(0), (3 * HBM_CHUNK) as u32));
        let (mut sram, mut hbm) = (Sram::new(4096), LazyHbm::new(4 * HBM_CHUNK));
        let mut g = vnpu_device::GuestRam::with_files(&m, files);
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut g };
        run_program(&BoardConfig::default(), &p.finish(), Some(mem), None).expect("load");
        assert_eq!(hbm.mapped_chunks(), 2, "chunks 0 and 2 mapped, chunk 1 copied");
        let mut got = vec![0u8; 3 * HBM_CHUNK as usize];
        hbm.read(0, &mut got).expect("read HBM");
        let mut want = vec![0u8; got.len()];
        m.read_slice(&mut want, GuestAddress(gpa)).expect("read RAM");
        assert!(got == want, "HBM holds guest RAM's bytes");
        assert_eq!(got[HBM_CHUNK as usize + 5], 0xab);
    }

    #[test]
    fn a_file_that_cannot_be_mapped_there_is_left_to_be_written() {
        let t = Temp::new("nomap", 5000);
        let m = ram();
        // Not page-aligned, past RAM's end, or a length that is not the file's.
        assert_eq!(map_file_into(&m, 0x1_0008, &t.1, 5000).ok(), Some(false));
        assert_eq!(map_file_into(&m, (1 << 20) - 4096, &t.1, 5000).ok(), Some(false));
        assert_eq!(map_file_into(&m, 0x1_0000, &t.1, 4000).ok(), Some(false));
        assert_eq!(map_file_into(&m, 0x1_0000, &t.1, 0).ok(), Some(false));
        let mut got = vec![1u8; 8192];
        m.read_slice(&mut got, GuestAddress(0x1_0000)).expect("read");
        assert!(got.iter().all(|b| *b == 0), "RAM left as it was");
    }
}
