//! The `dma_table` fuzz target's harness: a client's DMA table
//! (`vnpu_daemon::dma::DmaSpace`) driven by any sequence of maps, unmaps
//! and file growth, as a hostile VMM sends them. After each operation
//! the table stays within its limits, and the vNPU's view of memory is
//! readable wherever it claims to be, never a fault.

use std::fs::File;
use std::os::fd::FromRawFd;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vnpu_daemon::dma::{DmaSpace, MAX_DMA_MAPS, MAX_DMA_RUNS};

const PAGE: u64 = 4096;
/// Files of the harness: few and small, so a run stays fast.
const FILES: usize = 3;
const MAX_PAGES: u64 = 64;

/// A sealed (against shrinking) memfd of `pages` pages.
fn memfd(pages: u64) -> Option<File> {
    // SAFETY: memfd_create(2) returns a fresh descriptor, owned below.
    let fd = unsafe { libc::memfd_create(c"vnpu-fuzz-dma".as_ptr(), libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is ours alone.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(pages * PAGE).ok()?;
    // SAFETY: F_ADD_SEALS on a descriptor we own.
    (unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0).then_some(f)
}

/// Runs 8-byte operations from `data`: map (file or none, offset, client
/// address, size, in pages), unmap (a range, or all), grow a file.
pub fn drive_dma(data: &[u8]) {
    let mut files: Vec<File> = (0..FILES).filter_map(|i| memfd(4 << i)).collect();
    let mut space = DmaSpace::default();
    for op in data.chunks(8) {
        let b = |i: usize| u64::from(op.get(i).copied().unwrap_or(0));
        let (addr, size) = (b(2) * PAGE + (b(3) << 20), b(4).max(1) * PAGE);
        match b(0) % 4 {
            0 | 1 => {
                let file = match usize::try_from(b(1)).ok().and_then(|i| files.get(i % (FILES + 1))) {
                    Some(f) => f.try_clone().ok(),
                    None => None,
                };
                let _ = space.map(b(5) % MAX_PAGES * PAGE, addr, size, file);
            }
            2 => {
                let _ = space.unmap(b(5) % 16 == 0, addr, size);
            }
            _ => {
                if let Some(f) = usize::try_from(b(1)).ok().and_then(|i| files.get_mut(i % FILES)) {
                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                    let _ = f.set_len((len + b(5) * PAGE).min(MAX_PAGES * PAGE));
                }
            }
        }
        assert!(space.ranges() <= MAX_DMA_MAPS, "{} ranges", space.ranges());
        let mem = space.memory();
        assert!(mem.num_regions() <= MAX_DMA_RUNS, "{} runs", mem.num_regions());
        for r in mem.iter() {
            // Every byte the vNPU is told it can reach is there.
            let (start, last) = (r.start_addr(), r.last_addr());
            let mut x = [0u8; 1];
            mem.read_slice(&mut x, start).expect("the first byte of a run");
            mem.read_slice(&mut x, last).expect("the last byte of a run");
            let _ = mem.write_slice(&x, GuestAddress(start.0));
        }
    }
}
