//! DMA memory: a region the device can address (guest-physical) that the
//! driver can also touch (virtual), carved into buffers by a bump allocator.

/// Why a DMA buffer could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DmaError {
    #[error("DMA region exhausted: {wanted} bytes wanted, {left} left")]
    Exhausted { wanted: usize, left: usize },
}

/// A buffer in DMA memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaBuf {
    /// Where the driver sees it.
    pub virt: *mut u8,
    /// Where the device sees it (guest-physical).
    pub phys: u64,
    pub len: usize,
}

impl DmaBuf {
    /// The buffer's bytes.
    ///
    /// # Safety
    /// The device must not be writing the buffer while the slice lives.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the region `DmaRegion::new`'s caller vouched for.
        unsafe { core::slice::from_raw_parts(self.virt, self.len) }
    }

    /// The buffer's bytes, writable.
    ///
    /// # Safety
    /// As [`DmaBuf::bytes`], and no other reference to the bytes may live.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as in `bytes`.
        unsafe { core::slice::from_raw_parts_mut(self.virt, self.len) }
    }

    /// Copies `data` in at `offset` (clipped to the buffer).
    pub fn write(&self, offset: usize, data: &[u8]) {
        let n = data.len().min(self.len.saturating_sub(offset));
        // SAFETY: `offset + n <= len`, inside the buffer; volatile, since
        // the device reads it.
        unsafe {
            for (i, b) in data[..n].iter().enumerate() {
                core::ptr::write_volatile(self.virt.add(offset + i), *b);
            }
        }
    }

    /// Copies out `out.len()` bytes from `offset` (clipped to the buffer).
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        let n = out.len().min(self.len.saturating_sub(offset));
        // SAFETY: as in `write`.
        unsafe {
            for (i, b) in out[..n].iter_mut().enumerate() {
                *b = core::ptr::read_volatile(self.virt.add(offset + i));
            }
        }
    }

    /// Writes f32s (little-endian) at element `index`.
    pub fn write_f32s(&self, index: usize, v: &[f32]) {
        for (i, x) in v.iter().enumerate() {
            self.write((index + i) * 4, &x.to_le_bytes());
        }
    }

    /// Reads f32s from element `index`.
    pub fn read_f32s(&self, index: usize, out: &mut [f32]) {
        for (i, x) in out.iter_mut().enumerate() {
            let mut b = [0u8; 4];
            self.read((index + i) * 4, &mut b);
            *x = f32::from_le_bytes(b);
        }
    }
}

/// A contiguous region of DMA memory and a bump allocator over it.
#[derive(Debug)]
pub struct DmaRegion {
    virt: *mut u8,
    phys: u64,
    len: usize,
    next: usize,
}

impl DmaRegion {
    /// # Safety
    /// `virt..virt + len` must be memory the driver owns exclusively that
    /// the device sees at `phys..phys + len`.
    pub unsafe fn new(virt: *mut u8, phys: u64, len: usize) -> Self {
        Self { virt, phys, len, next: 0 }
    }

    /// A zeroed buffer of `len` bytes aligned to `align` (a power of two).
    pub fn alloc(&mut self, len: usize, align: usize) -> Result<DmaBuf, DmaError> {
        let align = align.max(1).next_power_of_two();
        let start = (self.phys as usize + self.next).next_multiple_of(align) - self.phys as usize;
        let left = self.len.saturating_sub(start);
        if len > left {
            return Err(DmaError::Exhausted { wanted: len, left });
        }
        self.next = start + len;
        // SAFETY: `start + len <= self.len`, inside the region.
        let b = DmaBuf { virt: unsafe { self.virt.add(start) }, phys: self.phys + start as u64, len };
        // SAFETY: as above; zeroing the fresh buffer.
        unsafe { core::ptr::write_bytes(b.virt, 0, len) };
        Ok(b)
    }

    /// Bytes not yet allocated.
    pub fn remaining(&self) -> usize {
        self.len - self.next
    }
}
