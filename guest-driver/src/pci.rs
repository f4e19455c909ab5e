//! PCI discovery on bus 0: configuration access (ECAM, or the 0xCF8/0xCFC
//! ports at CPL0), finding vNPU functions, placing their BARs and enabling
//! MSI-X.

use vnpu_abi::device as abi;

/// Configuration-space access to bus 0.
pub trait ConfigAccess {
    fn read32(&self, dev: u8, offset: u16) -> u32;
    fn write32(&self, dev: u8, offset: u16, value: u32);
}

/// ECAM: configuration space as memory (works from CPL3 once mapped).
#[derive(Debug, Clone, Copy)]
pub struct Ecam {
    base: *mut u8,
}

impl Ecam {
    /// # Safety
    /// `base` must map bus 0's 1 MiB ECAM window, uncached.
    pub unsafe fn new(base: *mut u8) -> Self {
        Self { base }
    }

    fn ptr(&self, dev: u8, offset: u16) -> *mut u32 {
        let off = (usize::from(dev & 31) << 15) | usize::from(offset & 0xffc);
        // SAFETY: within the 1 MiB window (dev < 32, offset < 4096).
        unsafe { self.base.add(off).cast() }
    }
}

impl ConfigAccess for Ecam {
    fn read32(&self, dev: u8, offset: u16) -> u32 {
        // SAFETY: see `ptr`.
        unsafe { core::ptr::read_volatile(self.ptr(dev, offset)) }
    }
    fn write32(&self, dev: u8, offset: u16, value: u32) {
        // SAFETY: see `ptr`.
        unsafe { core::ptr::write_volatile(self.ptr(dev, offset), value) }
    }
}

/// The conf1 mechanism (ports 0xCF8/0xCFC). Port I/O needs CPL0 on the
/// machines this project runs on; user-space drivers use [`Ecam`].
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, Default)]
pub struct Conf1;

#[cfg(target_arch = "x86_64")]
impl Conf1 {
    fn select(dev: u8, offset: u16) {
        let a = 0x8000_0000u32 | u32::from(dev & 31) << 11 | u32::from(offset & 0xfc);
        // SAFETY: writes the conf1 address port; no memory effects.
        unsafe { core::arch::asm!("out dx, eax", in("dx") 0xcf8u16, in("eax") a, options(nomem, nostack)) }
    }
}

#[cfg(target_arch = "x86_64")]
impl ConfigAccess for Conf1 {
    fn read32(&self, dev: u8, offset: u16) -> u32 {
        Self::select(dev, offset);
        let v: u32;
        // SAFETY: reads the conf1 data port; no memory effects.
        unsafe { core::arch::asm!("in eax, dx", in("dx") 0xcfcu16, out("eax") v, options(nomem, nostack)) }
        v
    }
    fn write32(&self, dev: u8, offset: u16, value: u32) {
        Self::select(dev, offset);
        // SAFETY: writes the conf1 data port; no memory effects.
        unsafe {
            core::arch::asm!("out dx, eax", in("dx") 0xcfcu16, in("eax") value, options(nomem, nostack))
        }
    }
}

/// Devices (slots) on bus 0 that are vNPU functions, in slot order.
pub fn find_vnpus(cfg: &impl ConfigAccess) -> impl Iterator<Item = u8> + '_ {
    (0..32u8).filter(move |&d| {
        let id = cfg.read32(d, 0);
        id & 0xffff == u32::from(abi::VENDOR_ID) && id >> 16 == u32::from(abi::DEVICE_ID)
    })
}

/// Size of 64-bit memory BAR `index` of `dev` (probes with all ones and
/// restores the old value).
pub fn bar_size(cfg: &impl ConfigAccess, dev: u8, index: u8) -> u64 {
    let off = 0x10 + 4 * u16::from(index);
    let (lo, hi) = (cfg.read32(dev, off), cfg.read32(dev, off + 4));
    cfg.write32(dev, off, u32::MAX);
    cfg.write32(dev, off + 4, u32::MAX);
    let mask = u64::from(cfg.read32(dev, off) & !0xf) | u64::from(cfg.read32(dev, off + 4)) << 32;
    cfg.write32(dev, off, lo);
    cfg.write32(dev, off + 4, hi);
    (!mask).wrapping_add(1)
}

/// Places 64-bit BAR `index` of `dev` at `addr`.
pub fn set_bar(cfg: &impl ConfigAccess, dev: u8, index: u8, addr: u64) {
    let off = 0x10 + 4 * u16::from(index);
    cfg.write32(dev, off, addr as u32);
    cfg.write32(dev, off + 4, (addr >> 32) as u32);
}

/// Turns on memory decoding and bus mastering.
pub fn enable(cfg: &impl ConfigAccess, dev: u8) {
    let cmd = cfg.read32(dev, 4) & 0xffff;
    cfg.write32(dev, 4, cmd | 0x6);
}

/// Offset of capability `id` in `dev`'s configuration space.
pub fn find_capability(cfg: &impl ConfigAccess, dev: u8, id: u8) -> Option<u16> {
    if cfg.read32(dev, 4) >> 16 & 0x10 == 0 {
        return None;
    }
    let mut at = (cfg.read32(dev, 0x34) & 0xfc) as u16;
    for _ in 0..48 {
        if at == 0 {
            return None;
        }
        let h = cfg.read32(dev, at);
        if h & 0xff == u32::from(id) {
            return Some(at);
        }
        at = (h >> 8 & 0xfc) as u16;
    }
    None
}

/// Programs MSI-X table entry `vector` (in BAR 2 through `table`) with
/// `address`/`data`, unmasks it, and enables MSI-X on `dev`.
pub fn enable_msix(
    cfg: &impl ConfigAccess,
    dev: u8,
    table: &impl crate::Bar,
    vector: u16,
    address: u64,
    data: u32,
) -> bool {
    let Some(cap) = find_capability(cfg, dev, 0x11) else { return false };
    let e = u64::from(vector) * 16;
    table.write32(e, address as u32);
    table.write32(e + 4, (address >> 32) as u32);
    table.write32(e + 8, data);
    table.write32(e + 12, 0);
    let ctrl = cfg.read32(dev, cap);
    cfg.write32(dev, cap, (ctrl & 0x3fff_ffff) | 0x8000_0000);
    true
}
