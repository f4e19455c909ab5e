//! Register access to a memory BAR.

/// 32-bit register access to one memory BAR. u64 registers are accessed
/// as two u32 halves, low half first.
pub trait Bar {
    fn read32(&self, offset: u64) -> u32;
    fn write32(&self, offset: u64, value: u32);

    fn read64(&self, offset: u64) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }

    fn write64(&self, offset: u64, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
}

/// A BAR mapped at a virtual address (uncached) in the driver's address space.
#[derive(Debug, Clone, Copy)]
pub struct MmioBar {
    base: *mut u8,
    len: u64,
}

impl MmioBar {
    /// # Safety
    /// `base..base + len` must map the BAR's registers, uncached, for as
    /// long as the value is used.
    pub unsafe fn new(base: *mut u8, len: u64) -> Self {
        Self { base, len }
    }
}

impl Bar for MmioBar {
    fn read32(&self, offset: u64) -> u32 {
        if offset.saturating_add(4) > self.len {
            return u32::MAX;
        }
        // SAFETY: in bounds of the mapping `new`'s caller vouched for.
        unsafe { core::ptr::read_volatile(self.base.add(offset as usize).cast::<u32>()) }
    }

    fn write32(&self, offset: u64, value: u32) {
        if offset.saturating_add(4) > self.len {
            return;
        }
        // SAFETY: as in `read32`.
        unsafe { core::ptr::write_volatile(self.base.add(offset as usize).cast::<u32>(), value) }
    }
}
