//! Memories a program can name: the core's SRAM segment, a lazily backed
//! HBM segment and the guest's DMA-visible memory.

use std::collections::HashMap;

use thiserror::Error;

/// A failed memory access.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MemoryError {
    #[error("{space} access [{start:#x}, +{len:#x}) outside its {size:#x}-byte segment")]
    OutOfRange { space: &'static str, start: u64, len: u64, size: u64 },
    #[error("guest memory access at {addr:#x} (+{len:#x}) failed: {reason}")]
    Guest { addr: u64, len: u64, reason: String },
}

fn check(space: &'static str, start: u64, len: u64, size: u64) -> Result<(), MemoryError> {
    match start.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(MemoryError::OutOfRange { space, start, len, size }),
    }
}

/// Byte-addressed memory with checked accesses.
pub trait Memory {
    fn size(&self) -> u64;
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError>;
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError>;
    /// The bytes `[addr, addr + len)` as one mutable slice, for memories
    /// that are one flat buffer (lets DMA copy without a bounce buffer).
    fn slice_mut(&mut self, _addr: u64, _len: u64) -> Option<&mut [u8]> {
        None
    }
}

/// On-chip SRAM of one vNPU core: bytes allocated up front, 8-byte
/// aligned so aligned f32 operands can be used in place.
#[derive(Debug, Clone)]
pub struct Sram {
    words: Vec<u64>,
    size: u64,
}

impl Sram {
    pub fn new(size: u64) -> Self {
        Self { words: vec![0; size.div_ceil(8) as usize], size }
    }

    /// All bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.size as usize]
    }

    /// All bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.size as usize;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }
}

impl Memory for Sram {
    fn size(&self) -> u64 {
        self.size
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        check("sram", addr, buf.len() as u64, self.size())?;
        let a = addr as usize;
        buf.copy_from_slice(&self.bytes()[a..a + buf.len()]);
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        check("sram", addr, data.len() as u64, self.size())?;
        let a = addr as usize;
        self.bytes_mut()[a..a + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn slice_mut(&mut self, addr: u64, len: u64) -> Option<&mut [u8]> {
        check("sram", addr, len, self.size).ok()?;
        self.bytes_mut().get_mut(addr as usize..(addr + len) as usize)
    }
}

/// Granule of lazy HBM backing.
pub const HBM_CHUNK: u64 = 1 << 20;

/// HBM segment backed lazily: a chunk is allocated on its first write and
/// untouched memory reads as zero, so a board with tens of GiB of modelled
/// HBM costs host memory only for what tenants write.
#[derive(Debug, Clone, Default)]
pub struct LazyHbm {
    size: u64,
    chunks: HashMap<u64, Box<[u8]>>,
}

impl LazyHbm {
    pub fn new(size: u64) -> Self {
        Self { size, chunks: HashMap::new() }
    }

    /// Host bytes actually allocated for this segment.
    pub fn resident_bytes(&self) -> u64 {
        self.chunks.len() as u64 * HBM_CHUNK
    }

    fn pieces(addr: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        // (chunk index, offset in chunk, offset in buffer, piece length)
        let mut done = 0usize;
        std::iter::from_fn(move || {
            if done >= len {
                return None;
            }
            let a = addr + done as u64;
            let chunk = a / HBM_CHUNK;
            let off = (a % HBM_CHUNK) as usize;
            let n = (HBM_CHUNK as usize - off).min(len - done);
            let item = (chunk, off, done, n);
            done += n;
            Some(item)
        })
    }
}

impl Memory for LazyHbm {
    fn size(&self) -> u64 {
        self.size
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        check("hbm", addr, buf.len() as u64, self.size)?;
        for (chunk, off, at, n) in Self::pieces(addr, buf.len()) {
            let dst = &mut buf[at..at + n];
            match self.chunks.get(&chunk) {
                Some(c) => dst.copy_from_slice(&c[off..off + n]),
                None => dst.fill(0),
            }
        }
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        check("hbm", addr, data.len() as u64, self.size)?;
        for (chunk, off, at, n) in Self::pieces(addr, data.len()) {
            let c =
                self.chunks.entry(chunk).or_insert_with(|| vec![0u8; HBM_CHUNK as usize].into_boxed_slice());
            c[off..off + n].copy_from_slice(&data[at..at + n]);
        }
        Ok(())
    }
}

/// Guest memory as a plain vector, based at guest address `base`: for
/// tests, benchmarks and the in-process runner. The VMM implements
/// [`Memory`] over vm-memory instead.
#[derive(Debug, Clone)]
pub struct VecGuestMemory {
    pub base: u64,
    pub bytes: Vec<u8>,
}

impl VecGuestMemory {
    pub fn new(base: u64, size: usize) -> Self {
        Self { base, bytes: vec![0; size] }
    }

    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, MemoryError> {
        let err = || MemoryError::Guest { addr, len: len as u64, reason: "outside guest memory".into() };
        let off = addr.checked_sub(self.base).ok_or_else(err)?;
        let end = off.checked_add(len as u64).ok_or_else(err)?;
        if end > self.bytes.len() as u64 {
            return Err(err());
        }
        Ok(off as usize..end as usize)
    }
}

impl Memory for VecGuestMemory {
    fn size(&self) -> u64 {
        self.base + self.bytes.len() as u64
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        let r = self.range(addr, data.len())?;
        self.bytes[r].copy_from_slice(data);
        Ok(())
    }
    fn slice_mut(&mut self, addr: u64, len: u64) -> Option<&mut [u8]> {
        let r = self.range(addr, usize::try_from(len).ok()?).ok()?;
        self.bytes.get_mut(r)
    }
}

/// Fails when `[addr, addr + len)` cannot lie inside `m` (checked before
/// buffers for it are allocated).
pub fn check_span(m: &dyn Memory, addr: u64, len: u64) -> Result<(), MemoryError> {
    check("memory", addr, len, m.size())
}

/// Reads `n` little-endian f32 values (none: nothing is touched, at any
/// address, as the ISA says of zero-sized operands).
pub fn read_f32s(m: &dyn Memory, addr: u64, n: usize) -> Result<Vec<f32>, MemoryError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    check_span(m, addr, n as u64 * 4)?;
    let mut bytes = vec![0u8; n * 4];
    m.read(addr, &mut bytes)?;
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Writes f32 values little-endian (none: nothing is touched).
pub fn write_f32s(m: &mut dyn Memory, addr: u64, v: &[f32]) -> Result<(), MemoryError> {
    if v.is_empty() {
        return Ok(());
    }
    let mut bytes = Vec::with_capacity(v.len() * 4);
    for x in v {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    m.write(addr, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_hbm_of_32_gib_allocates_only_what_is_written() {
        let mut h = LazyHbm::new(32 << 30);
        let mut buf = [1u8; 16];
        h.read((32 << 30) - 16, &mut buf).unwrap();
        assert_eq!(buf, [0; 16]);
        // A write straddling a chunk boundary lands in two chunks.
        let data: Vec<u8> = (0..=255).collect();
        h.write(HBM_CHUNK * 7 - 100, &data).unwrap();
        let mut back = vec![0u8; 256];
        h.read(HBM_CHUNK * 7 - 100, &mut back).unwrap();
        assert_eq!(back, data);
        assert_eq!(h.resident_bytes(), 2 * HBM_CHUNK);
        assert!(h.write(32 << 30, &[0]).is_err());
        assert!(h.read(u64::MAX, &mut [0]).is_err());
    }

    #[test]
    fn sram_and_guest_bounds() {
        let mut s = Sram::new(64);
        assert!(s.write(60, &[0; 4]).is_ok());
        assert!(s.write(61, &[0; 4]).is_err());
        let mut g = VecGuestMemory::new(0x1000, 0x100);
        assert!(g.write(0x1000, &[1; 0x100]).is_ok());
        assert!(g.write(0xfff, &[1]).is_err());
        assert!(g.read(0x10ff, &mut [0; 2]).is_err());
        assert!(g.read(u64::MAX, &mut [0; 2]).is_err());
    }
}
