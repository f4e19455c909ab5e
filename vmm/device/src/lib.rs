//! The vNPU PCI function: identity, configuration space and BAR 0
//! registers (`docs/device-interface.md`), and the `--vnpu` specification.

mod spec;

pub use spec::{parse_size, SpecError, VnpuSpec};

use npu_model::BoardConfig;
use vnpu_pci::{Bar, BarKind, ConfigSpace, Identity, MsiMessage, MsixCap, MsixTable, PciError, PciFunction};

/// Our PCI vendor ID.
pub const VENDOR_ID: u16 = 0x5650;
/// Device ID of the vNPU function.
pub const DEVICE_ID: u16 = 0x0001;
/// PCI class: processing accelerator.
pub const CLASS: u32 = 0x12_00_00;
/// Size of BAR 0 (registers; doorbells on their own page).
pub const BAR0_SIZE: u64 = 0x4000;
/// Size of BAR 2 (MSI-X table at 0, PBA at 0x1000).
pub const BAR2_SIZE: u64 = 0x2000;
/// MSI-X vectors.
pub const MSIX_VECTORS: u16 = 8;
/// ABI version in `ABI_VERSION` (major << 16 | minor).
pub const ABI_VERSION: u32 = 1 << 16;

/// BAR 0 register offsets (all little-endian).
pub mod regs {
    /// u32 `"VNPU"` (0x5550_4e56).
    pub const MAGIC: u64 = 0x000;
    pub const ABI_VERSION: u64 = 0x004;
    /// u32: bit 0 ready.
    pub const STATUS: u64 = 0x008;
    /// u32: last device error code, 0 for none.
    pub const ERROR: u64 = 0x00c;
    pub const NUM_CHIPS: u64 = 0x010;
    pub const CORES_PER_CHIP: u64 = 0x014;
    pub const SA_PER_CORE: u64 = 0x018;
    pub const VU_PER_CORE: u64 = 0x01c;
    /// u64 bytes.
    pub const SRAM_PER_CORE: u64 = 0x020;
    /// u64 bytes.
    pub const HBM_PER_CORE: u64 = 0x028;
    pub const SA_ROWS: u64 = 0x030;
    pub const SA_COLS: u64 = 0x034;
    pub const VU_LANES: u64 = 0x038;
    pub const CLOCK_MHZ: u64 = 0x03c;
    /// u32, write-only (reads 0): writing `v` raises MSI-X vector `v`
    /// (interrupt self-test for drivers).
    pub const INT_TEST: u64 = 0x040;
    /// End of the registers implemented so far.
    pub const END: u64 = 0x044;
}

/// `STATUS` bit: the device is ready.
pub const STATUS_READY: u32 = 1;

/// One vNPU as a PCI function.
pub struct VnpuFunction {
    config: ConfigSpace,
    msix: MsixCap,
    table: MsixTable,
    regs: [u8; regs::END as usize],
    /// Messages to deliver, in order.
    outbox: Vec<MsiMessage>,
}

impl std::fmt::Debug for VnpuFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VnpuFunction").field("config", &self.config).finish_non_exhaustive()
    }
}

impl VnpuFunction {
    /// A vNPU of `spec` on a board of `board`.
    pub fn new(spec: &VnpuSpec, board: &BoardConfig) -> Result<Self, PciError> {
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
        let msix = MsixCap::add(&mut config, MSIX_VECTORS, 2, 0, 2, 0x1000)?;
        let mut r = [0u8; regs::END as usize];
        let mut put =
            |off: u64, bytes: &[u8]| r[off as usize..off as usize + bytes.len()].copy_from_slice(bytes);
        put(regs::MAGIC, b"VNPU");
        put(regs::ABI_VERSION, &ABI_VERSION.to_le_bytes());
        put(regs::STATUS, &STATUS_READY.to_le_bytes());
        put(regs::NUM_CHIPS, &spec.chips.to_le_bytes());
        put(regs::CORES_PER_CHIP, &spec.cores_per_chip.to_le_bytes());
        put(regs::SA_PER_CORE, &spec.sa_per_core.to_le_bytes());
        put(regs::VU_PER_CORE, &spec.vu_per_core.to_le_bytes());
        put(regs::SRAM_PER_CORE, &spec.sram_per_core.to_le_bytes());
        put(regs::HBM_PER_CORE, &spec.hbm_per_core.to_le_bytes());
        put(regs::SA_ROWS, &board.core.sa_rows.to_le_bytes());
        put(regs::SA_COLS, &board.core.sa_cols.to_le_bytes());
        put(regs::VU_LANES, &board.core.vu_lanes.to_le_bytes());
        put(regs::CLOCK_MHZ, &board.clock_mhz.to_le_bytes());
        Ok(Self { config, table: MsixTable::new(msix.vectors), msix, regs: r, outbox: Vec::new() })
    }

    /// The MSI-X capability.
    pub fn msix(&self) -> MsixCap {
        self.msix
    }

    /// Raises MSI-X `vector`: queued for delivery now, or left pending
    /// while masked, or dropped while MSI-X is disabled.
    pub fn raise(&mut self, vector: u16) {
        let (en, fm) = (self.msix.enabled(&self.config), self.msix.function_masked(&self.config));
        if let Some(m) = self.table.trigger(vector, en, fm) {
            self.outbox.push(m);
        }
    }

    fn release_pending(&mut self) {
        let (en, fm) = (self.msix.enabled(&self.config), self.msix.function_masked(&self.config));
        self.outbox.extend(self.table.take_deliverable(en, fm));
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
        // Enabling MSI-X or clearing the function mask releases pending vectors.
        self.release_pending();
    }
    fn take_interrupts(&mut self) -> Vec<MsiMessage> {
        std::mem::take(&mut self.outbox)
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match bar {
            0 if (regs::INT_TEST..regs::INT_TEST + 4).contains(&offset) => data.fill(0),
            0 => {
                for (i, d) in data.iter_mut().enumerate() {
                    *d = offset
                        .checked_add(i as u64)
                        .and_then(|o| self.regs.get(o as usize))
                        .copied()
                        .unwrap_or(0);
                }
            }
            2 if offset < 0x1000 => self.table.read(offset, data),
            2 => self.table.pba_read(offset - 0x1000, data),
            _ => data.fill(0xff),
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        match bar {
            0 if offset == regs::INT_TEST && data.len() >= 2 => {
                self.raise(u16::from_le_bytes([data[0], data[1]]));
            }
            2 if offset < 0x1000 => {
                self.table.write(offset, data);
                // Unmasking a vector releases it if pending.
                self.release_pending();
            }
            // Other BAR 0 registers are read-only; the PBA ignores writes.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar0_exposes_the_hierarchy() {
        let spec = VnpuSpec::parse("sa=2,vu=3,sram=8M,hbm=1G,cores=2,chips=1").unwrap();
        let mut f = VnpuFunction::new(&spec, &BoardConfig::default()).unwrap();
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
        let mut f = VnpuFunction::new(&VnpuSpec::named("small").unwrap(), &BoardConfig::default()).unwrap();
        let cap = f.msix().offset;
        // MSI-X disabled: dropped.
        f.bar_write(0, regs::INT_TEST, &1u32.to_le_bytes());
        assert!(f.take_interrupts().is_empty());
        // Program vector 1, enable MSI-X: still masked after reset, so pending.
        f.bar_write(2, 16, &0xfee0_0000u32.to_le_bytes());
        f.bar_write(2, 24, &0x41u32.to_le_bytes());
        f.config_mut().write(cap + 2, &0x8000u16.to_le_bytes());
        f.config_written(cap + 2, 2);
        f.bar_write(0, regs::INT_TEST, &1u32.to_le_bytes());
        assert!(f.take_interrupts().is_empty());
        let mut pba = [0u8];
        f.bar_read(2, 0x1000, &mut pba);
        assert_eq!(pba[0], 0b10);
        // Unmask: the pending vector is delivered once.
        f.bar_write(2, 28, &0u32.to_le_bytes());
        assert_eq!(f.take_interrupts(), vec![MsiMessage { vector: 1, address: 0xfee0_0000, data: 0x41 }]);
        assert!(f.take_interrupts().is_empty());
        f.bar_write(0, regs::INT_TEST, &1u32.to_le_bytes());
        assert_eq!(f.take_interrupts().len(), 1);
        // Nonexistent vectors do nothing; INT_TEST reads 0.
        f.bar_write(0, regs::INT_TEST, &500u32.to_le_bytes());
        assert!(f.take_interrupts().is_empty());
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
        bus.add(
            1,
            Box::new(VnpuFunction::new(&VnpuSpec::named("small").unwrap(), &BoardConfig::default()).unwrap()),
        )
        .unwrap();
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
