//! Finding and opening the VM's vNPUs from CPL3 (through ECAM).

use vnpu_driver::pci::{self, Ecam};
use vnpu_driver::{Error, MmioBar, Vnpu};

use crate::{Env, IRQ_COUNT, NPU_VECTOR};

const ECAM_BASE: usize = 0xe000_0000;
/// BARs go at 0xC000_0000 + slot * 64 KiB (BAR 0) and + 32 KiB (BAR 2).
const BAR_BASE: u64 = 0xc000_0000;
/// Busy-wait polls before an interrupt wait halts the vCPU (a few tens of
/// microseconds: short requests are served faster by spinning).
pub const IDLE_AFTER_SPINS: u64 = 1 << 14;

/// The ECAM window.
pub fn ecam() -> Ecam {
    // SAFETY: the VMM's ECAM window, identity-mapped and user-accessible.
    unsafe { Ecam::new(ECAM_BASE as *mut u8) }
}

/// Slots of the vNPUs on bus 0.
pub fn slots() -> alloc::vec::Vec<u8> {
    pci::find_vnpus(&ecam()).collect()
}

/// Places the BARs of the vNPU in `slot`, enables it and MSI-X vector 0
/// (to [`NPU_VECTOR`] on the boot CPU), and opens it with a ring of
/// `ring` entries. Completions can then wait by interrupt.
pub fn open(env: &mut Env, slot: u8, ring: u16) -> Result<Vnpu<MmioBar>, Error> {
    let e = ecam();
    let bar0 = BAR_BASE + u64::from(slot) * 0x1_0000;
    let bar2 = bar0 + 0x8000;
    pci::set_bar(&e, slot, 0, bar0);
    pci::set_bar(&e, slot, 2, bar2);
    pci::enable(&e, slot);
    // SAFETY: the BARs were just placed there; the MMIO hole is mapped
    // uncached and user-accessible by the stub.
    let (regs, table) = unsafe {
        (
            MmioBar::new(bar0 as *mut u8, vnpu_abi::device::BAR0_SIZE),
            MmioBar::new(bar2 as *mut u8, vnpu_abi::device::BAR2_SIZE),
        )
    };
    // Vector 0 for completions, and the calibration loopback's vector.
    pci::enable_msix(&e, slot, &table, 0, 0xfee0_0000, u32::from(NPU_VECTOR));
    pci::enable_msix(&e, slot, &table, vnpu_abi::device::LOOPBACK_VECTOR, 0xfee0_0000, u32::from(NPU_VECTOR));
    let mut npu = Vnpu::new(regs, &mut env.dma, ring)?;
    npu.use_interrupts(0, &IRQ_COUNT);
    npu.use_idle(crate::idle, IDLE_AFTER_SPINS);
    Ok(npu)
}

/// Opens the first vNPU on the bus (ring of 64), or says on the console
/// why it cannot and returns `None`.
pub fn open_first(env: &mut Env) -> Option<(u8, Vnpu<MmioBar>)> {
    let Some(&slot) = slots().first() else {
        crate::println!("no vNPU found");
        return None;
    };
    match open(env, slot, 64) {
        Ok(n) => Some((slot, n)),
        Err(e) => {
            crate::println!("cannot open the vNPU: {e}");
            None
        }
    }
}
