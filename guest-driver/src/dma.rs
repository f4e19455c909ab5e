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

    /// The address of `size` bytes at `offset` when they are inside the
    /// buffer and naturally aligned.
    fn aligned(&self, offset: usize, size: usize) -> Option<*mut u8> {
        let end = offset.checked_add(size)?;
        let p = self.virt.wrapping_add(offset);
        (end <= self.len && (p as usize).is_multiple_of(size)).then_some(p)
    }

    /// Writes `v` at `offset` (little-endian) as one 16-bit store, so the
    /// device never reads half of it: a ring index torn into two byte
    /// stores reads, between them, as an index up to 255 entries off
    /// (virtio requires these fields to be written whole). Unaligned or
    /// outside the buffer: written as two bytes, clipped, as [`DmaBuf::write`] writes.
    pub fn write_u16(&self, offset: usize, v: u16) {
        match self.aligned(offset, 2) {
            // SAFETY: inside the buffer and 2-byte aligned (`aligned`);
            // volatile, since the device reads it.
            Some(p) => unsafe { core::ptr::write_volatile(p.cast::<u16>(), v.to_le()) },
            None => self.write(offset, &v.to_le_bytes()),
        }
    }

    /// Reads the little-endian u16 at `offset` with one 16-bit load (see
    /// [`DmaBuf::write_u16`]); bytes past the buffer's end read as 0.
    pub fn read_u16(&self, offset: usize) -> u16 {
        match self.aligned(offset, 2) {
            // SAFETY: as in `write_u16`.
            Some(p) => u16::from_le(unsafe { core::ptr::read_volatile(p.cast::<u16>()) }),
            None => {
                let mut b = [0u8; 2];
                self.read(offset, &mut b);
                u16::from_le_bytes(b)
            }
        }
    }

    /// Reads the little-endian u32 at `offset` with one 32-bit load; bytes
    /// past the buffer's end read as 0.
    pub fn read_u32(&self, offset: usize) -> u32 {
        match self.aligned(offset, 4) {
            // SAFETY: inside the buffer and 4-byte aligned (`aligned`).
            Some(p) => u32::from_le(unsafe { core::ptr::read_volatile(p.cast::<u32>()) }),
            None => {
                let mut b = [0u8; 4];
                self.read(offset, &mut b);
                u32::from_le_bytes(b)
            }
        }
    }

    /// Copies `data` in at `offset` (clipped to the buffer), as one bulk
    /// copy: the device reads the buffer only after a later doorbell or
    /// index store, which the fence after the copy orders behind it (a
    /// byte at a time, volatile, a megabyte input took milliseconds).
    pub fn write(&self, offset: usize, data: &[u8]) {
        let n = data.len().min(self.len.saturating_sub(offset));
        // SAFETY: `offset + n <= len`, inside the buffer, which the driver
        // owns and `data` (a shared borrow of other memory) cannot overlap.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), self.virt.add(offset), n) };
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
    }

    /// Copies out `out.len()` bytes from `offset` (clipped to the buffer),
    /// as one bulk copy after a fence: what the device wrote before the
    /// status the caller read is what it sees.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        let n = out.len().min(self.len.saturating_sub(offset));
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        // SAFETY: as in `write`; `out` is a unique borrow of other memory.
        unsafe { core::ptr::copy_nonoverlapping(self.virt.add(offset), out.as_mut_ptr(), n) };
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

#[cfg(test)]
mod tests {
    extern crate std;

    use super::DmaBuf;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A ring index crossing a multiple of 256 (0x00ff -> 0x0100 and
    /// back) is never seen half written by a concurrent reader (the
    /// device). Byte-wise stores show 0x0000 or 0x01ff within a few
    /// thousand flips.
    #[test]
    fn a_ring_index_is_never_seen_half_written() {
        let mut cell = std::boxed::Box::new([0x00ffu16; 4]);
        let buf = DmaBuf { virt: cell.as_mut_ptr().cast::<u8>(), phys: 0, len: 8 };
        let addr = buf.virt as usize;
        let stop = AtomicBool::new(false);
        let torn = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let b = DmaBuf { virt: addr as *mut u8, phys: 0, len: 8 };
                let mut torn = std::vec::Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let v = b.read_u16(2);
                    if v != 0x00ff && v != 0x0100 && torn.len() < 8 {
                        torn.push(v);
                    }
                }
                torn
            });
            for i in 0..2_000_000u32 {
                buf.write_u16(2, if i % 2 == 0 { 0x0100 } else { 0x00ff });
            }
            stop.store(true, Ordering::Relaxed);
            reader.join().unwrap_or_default()
        });
        assert!(torn.is_empty(), "the reader saw half-written indices: {torn:x?}");
        assert_eq!(buf.read_u16(2), 0x00ff);
        // Past the end: nothing written, 0 read; straddling it: clipped.
        buf.write_u16(8, 0xabcd);
        assert_eq!((buf.read_u16(8), buf.read_u32(8)), (0, 0));
        buf.write_u16(7, 0xabcd);
        assert_eq!(buf.read_u32(6), 0xcdff);
    }
}
