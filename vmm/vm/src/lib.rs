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

mod guest_memory;
mod irq;

pub use guest_memory::GuestRam;

use std::fs::File;
use std::io::Write;
use std::path::Path;

use kvm_bindings::{kvm_segment, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use linux_loader::loader::{elf::Elf, KernelLoader};
use npu_model::BoardConfig;
use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vm_superio::{Serial, Trigger};
use vnpu_device::{VnpuFunction, VnpuSpec};
use vnpu_pci::{ConfigSpace, Identity, PciBus, PlainFunction};

/// Serial port base (COM1).
pub const SERIAL_PORT: u16 = 0x3f8;
/// Exit port: a 32-bit `out` ends the VM with that exit code.
pub const EXIT_PORT: u16 = 0xf4;
/// Smallest guest memory: page tables, GDT and stack live below 1 MiB and
/// the ELF is expected at 1 MiB or above.
pub const MIN_MEMORY: u64 = 2 << 20;

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
    #[error("cannot open guest {path}: {source}")]
    Open { path: String, source: std::io::Error },
    #[error("cannot load guest ELF {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("guest stopped: {0}")]
    Guest(String),
    #[error("PCI layout: {0}")]
    Pci(#[from] vnpu_pci::PciError),
    #[error("{count} vNPUs asked for; a VM has at most {MAX_VNPUS}")]
    TooManyVnpus { count: usize },
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Ioctl { what, source }
}

/// The serial port raises no interrupt yet; guests poll it.
#[derive(Debug)]
struct NoInterrupt;

impl Trigger for NoInterrupt {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        Ok(())
    }
}

/// A VM with one vCPU running a bare-metal ELF guest.
pub struct Vm<W: Write> {
    // Kept alive for the VM's lifetime.
    _kvm: Kvm,
    vm: VmFd,
    vcpu: VcpuFd,
    _memory: GuestMemoryMmap<()>,
    serial: Serial<NoInterrupt, vm_superio::serial::NoEvents, W>,
    pci: PciBus,
    msi: irq::MsiRoutes,
}

impl<W: Write> std::fmt::Debug for Vm<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm").finish_non_exhaustive()
    }
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

impl<W: Write> Vm<W> {
    /// Creates a VM with `memory_bytes` of RAM at guest address 0 and one
    /// vNPU function per entry of `vnpus` (on a board of `board`), loads the
    /// ELF at `guest` and prepares its one vCPU to enter it in long mode.
    /// Serial output goes to `console`.
    pub fn new(
        memory_bytes: u64,
        guest: &Path,
        console: W,
        vnpus: &[VnpuSpec],
        board: &BoardConfig,
    ) -> Result<Self, VmError> {
        if vnpus.len() > MAX_VNPUS {
            return Err(VmError::TooManyVnpus { count: vnpus.len() });
        }
        if !(MIN_MEMORY..=(1 << 30)).contains(&memory_bytes) {
            return Err(VmError::Memory {
                size: memory_bytes,
                reason: format!(
                    "must be between {MIN_MEMORY} bytes and 1 GiB (the identity map covers 1 GiB)"
                ),
            });
        }
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let vm = kvm.create_vm().map_err(ioctl("create VM"))?;
        let memory: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), memory_bytes as usize)])
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
        // owned by `memory`, which this Vm keeps alive as long as the VM fd.
        unsafe { vm.set_user_memory_region(region) }.map_err(ioctl("set memory region"))?;
        // The in-kernel irqchip must exist before any vCPU.
        vm.create_irq_chip().map_err(ioctl("create irqchip"))?;

        let mut file = File::open(guest)
            .map_err(|source| VmError::Open { path: guest.display().to_string(), source })?;
        let loaded = Elf::load(&memory, None, &mut file, Some(GuestAddress(HIGHMEM_START)))
            .map_err(|e| VmError::Load { path: guest.display().to_string(), reason: e.to_string() })?;

        Self::write_boot_tables(&memory)?;
        let vcpu = vm.create_vcpu(0).map_err(ioctl("create vCPU"))?;
        let mut sregs = vcpu.get_sregs().map_err(ioctl("get sregs"))?;
        let (code, data) = (segment(0x8, true), segment(0x10, false));
        sregs.cs = code;
        sregs.ds = data;
        sregs.es = data;
        sregs.fs = data;
        sregs.gs = data;
        sregs.ss = data;
        sregs.gdt.base = GDT_ADDR;
        sregs.gdt.limit = 3 * 8 - 1;
        sregs.cr3 = PML4_ADDR;
        sregs.cr4 |= 1 << 5; // PAE
        sregs.cr0 |= (1 << 0) | (1 << 31); // PE, PG
        sregs.efer |= (1 << 8) | (1 << 10); // LME, LMA
        vcpu.set_sregs(&sregs).map_err(ioctl("set sregs"))?;
        let mut regs = vcpu.get_regs().map_err(ioctl("get regs"))?;
        regs.rip = loaded.kernel_load.0;
        regs.rsp = STACK_TOP;
        regs.rflags = 2;
        vcpu.set_regs(&regs).map_err(ioctl("set regs"))?;

        Ok(Self {
            _kvm: kvm,
            vm,
            vcpu,
            _memory: memory,
            serial: Serial::new(NoInterrupt, console),
            pci: Self::pci_bus(vnpus, board)?,
            msi: irq::MsiRoutes::default(),
        })
    }

    /// Bus 0: host bridge at 00:00.0, vNPU functions from 00:01.0 on.
    fn pci_bus(vnpus: &[VnpuSpec], board: &BoardConfig) -> Result<PciBus, VmError> {
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
        for (i, spec) in vnpus.iter().enumerate() {
            bus.add(i + 1, Box::new(VnpuFunction::new(spec, board)?))?;
        }
        Ok(bus)
    }

    /// The PCI bus (for tests and the device layer).
    pub fn pci(&self) -> &PciBus {
        &self.pci
    }

    fn write_boot_tables(m: &GuestMemoryMmap<()>) -> Result<(), VmError> {
        let err = |e: vm_memory::GuestMemoryError| VmError::Memory { size: 0, reason: e.to_string() };
        let gdt: [u64; 3] = [0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
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

    /// Delivers the MSIs the PCI functions raised, each through the irqfd
    /// of its (function, vector) GSI.
    fn deliver_interrupts(&mut self) {
        for (slot, m) in self.pci.take_interrupts() {
            // A message that cannot be routed (a bogus address the guest
            // programmed, routes exhausted) is dropped, as on hardware.
            let _ = self.msi.deliver(&self.vm, slot, m);
        }
    }

    /// Runs the guest until it writes the exit port; returns its exit code.
    pub fn run(&mut self) -> Result<u32, VmError> {
        loop {
            self.deliver_interrupts();
            match self.vcpu.run().map_err(ioctl("run vCPU"))? {
                VcpuExit::IoOut(port, data) => {
                    if port == EXIT_PORT {
                        let mut b = [0u8; 4];
                        let n = data.len().min(4);
                        b[..n].copy_from_slice(&data[..n]);
                        let _ = self.serial.writer_mut().flush();
                        return Ok(u32::from_le_bytes(b));
                    }
                    if (SERIAL_PORT..SERIAL_PORT + 8).contains(&port) {
                        if let Some(v) = data.first() {
                            // A write the UART cannot take is dropped, as on hardware.
                            let _ = self.serial.write((port - SERIAL_PORT) as u8, *v);
                        }
                    } else if (vnpu_pci::CONF1_ADDRESS..vnpu_pci::CONF1_ADDRESS + 8).contains(&port) {
                        self.pci.pio_write(port, data);
                    }
                }
                VcpuExit::IoIn(port, data) => {
                    if (vnpu_pci::CONF1_ADDRESS..vnpu_pci::CONF1_ADDRESS + 8).contains(&port) {
                        self.pci.pio_read(port, data);
                    } else {
                        let v = if (SERIAL_PORT..SERIAL_PORT + 8).contains(&port) {
                            self.serial.read((port - SERIAL_PORT) as u8)
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
                    match addr.checked_sub(ECAM_BASE).filter(|o| *o < ECAM_SIZE) {
                        Some(off) => self.pci.ecam_write(off, data),
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

    /// The console writer (for tests that capture output).
    pub fn console(&self) -> &W {
        self.serial.writer()
    }
}
