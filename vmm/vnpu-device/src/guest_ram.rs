//! Guest memory as the NPU model sees it: every DMA access goes through
//! vm-memory's checked accessors, so a bad guest address fails that
//! request with an error and never touches host memory outside the guest.

use std::fs::File;
use std::sync::Arc;

use npu_model::memory::{file_pages_unchanged, Memory, MemoryError};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// A range of guest RAM the VMM mapped a file into (private,
/// copy-on-write, from the file's first byte): `vnpu infer`'s model file.
#[derive(Debug, Clone)]
pub struct GuestFile {
    /// Guest-physical address of the file's first byte.
    pub gpa: u64,
    /// Bytes of the file mapped there.
    pub len: u64,
    pub file: Arc<File>,
}

/// Says whether guest memory behind the vNPU's DMA was lost since the
/// memory was set (the board daemon's fault recovery replaced pages a
/// client punched out of its own RAM): a request that ran over it fails.
#[derive(Clone)]
pub struct MemoryWatch(Arc<dyn Fn() -> bool + Send + Sync>);

impl MemoryWatch {
    pub fn new(lost: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(lost))
    }
    /// Whether memory was lost.
    pub fn lost(&self) -> bool {
        (self.0)()
    }
}

impl std::fmt::Debug for MemoryWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MemoryWatch").field(&self.lost()).finish()
    }
}

/// A view of guest RAM for DMA by the NPU model (it holds a handle to
/// the guest's memory regions, so it can travel with a request).
#[derive(Debug, Clone)]
pub struct GuestRam {
    mem: GuestMemoryMmap<()>,
    files: Arc<[GuestFile]>,
    log: Option<Arc<crate::WriteLog>>,
}

impl GuestRam {
    pub fn new(mem: &GuestMemoryMmap<()>) -> Self {
        Self { mem: mem.clone(), files: Arc::from([]), log: None }
    }

    /// Guest RAM with `files` mapped into it: a DMA that copies their
    /// unchanged pages into HBM maps them instead ([`Memory::file_pages`]).
    pub fn with_files(mem: &GuestMemoryMmap<()>, files: Arc<[GuestFile]>) -> Self {
        Self { mem: mem.clone(), files, log: None }
    }

    /// Notes every write into `log` (a live migration's dirty pages).
    pub fn logged(mut self, log: Arc<crate::WriteLog>) -> Self {
        self.log = Some(log);
        self
    }
}

fn err(addr: u64, len: usize, e: impl std::fmt::Display) -> MemoryError {
    MemoryError::Guest { addr, len: len as u64, reason: e.to_string() }
}

impl Memory for GuestRam {
    fn size(&self) -> u64 {
        self.mem.last_addr().0.saturating_add(1)
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.mem.read_slice(buf, GuestAddress(addr)).map_err(|e| err(addr, buf.len(), e))
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        self.mem.write_slice(data, GuestAddress(addr)).map_err(|e| err(addr, data.len(), e))?;
        if let Some(l) = &self.log {
            l.note(addr, data.len() as u64);
        }
        Ok(())
    }
    // No `slice_mut`: guest memory is shared with a running guest and is
    // only ever accessed through vm-memory's volatile, checked copies.

    /// A range inside one of the mapped files whose pages the guest has
    /// not written since they were mapped (`/proc/self/pagemap`): they
    /// still read the file's bytes.
    fn file_pages(&self, addr: u64, len: u64) -> Option<(&File, u64)> {
        let end = addr.checked_add(len)?;
        let f = self
            .files
            .iter()
            .find(|f| f.gpa <= addr && f.gpa.checked_add(f.len).is_some_and(|e| end <= e))?;
        let n = usize::try_from(len).ok()?;
        // The whole range in one region, so its host bytes are contiguous.
        let slice = self.mem.get_slice(GuestAddress(addr), n).ok()?;
        file_pages_unchanged(slice.ptr_guard().as_ptr(), n).then(|| (&*f.file, addr - f.gpa))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Sram};
    use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};

    fn ram() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn checked_accesses() {
        let m = ram();
        let mut g = GuestRam::new(&m);
        assert_eq!(g.size(), 1 << 20);
        g.write(0x1000, &[1, 2, 3]).unwrap();
        let mut b = [0u8; 3];
        g.read(0x1000, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3]);
        assert!(g.write((1 << 20) - 1, &[0, 0]).is_err(), "straddles the end");
        assert!(g.read(1 << 20, &mut b).is_err());
        assert!(g.read(u64::MAX - 1, &mut b).is_err());
    }

    /// A program DMAs from guest RAM to SRAM and back through vm-memory;
    /// a DMA past the end of guest RAM fails the program, not the process.
    #[test]
    fn the_model_dmas_through_vm_memory() {
        let m = ram();
        m.write_slice(b"tensor!!", GuestAddress(0x2000)).unwrap();
        let dma = |src, dst| Instr::DmaCopy { src, dst, rows: 1, row_bytes: 8, src_stride: 0, dst_stride: 0 };
        let mut p = ProgramBuilder::new();
        p.push(Engine::DMA, dma(Addr::guest(0x2000), Addr::sram(0)));
        p.push(Engine::DMA, dma(Addr::sram(0), Addr::guest(0x3000)));
        let (mut sram, mut hbm, mut g) = (Sram::new(4096), LazyHbm::new(1 << 20), GuestRam::new(&m));
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut g };
        run_program(&BoardConfig::default(), &p.finish(), Some(mem), None).unwrap();
        let mut out = [0u8; 8];
        m.read_slice(&mut out, GuestAddress(0x3000)).unwrap();
        assert_eq!(&out, b"tensor!!");

        let mut bad = ProgramBuilder::new();
        bad.push(Engine::DMA, dma(Addr::guest((1 << 20) - 4), Addr::sram(0)));
        let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut g };
        let e = run_program(&BoardConfig::default(), &bad.finish(), Some(mem), None).unwrap_err();
        assert!(e.to_string().contains("guest memory access"), "{e}");
    }
}
