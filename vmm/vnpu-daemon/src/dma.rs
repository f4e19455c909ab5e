//! A client's DMA address space: the ranges it mapped with `DMA_MAP`, and
//! the guest memory the vNPU reaches through them (`docs/vfio-user.md`,
//! "Guest memory").
//!
//! A VMM without a vIOMMU maps its guest RAM in a few large ranges; one
//! with a vIOMMU (QEMU with `intel-iommu,caching-mode=on`) maps every page
//! the guest's IOMMU maps, 4 KiB at a time, thousands of them. So a range
//! costs an entry in a table, not a `mmap(2)` of its own (the daemon's
//! address space and its `vm.max_map_count` are shared by every tenant):
//! each distinct file a client hands over is mapped once, whole, and the
//! vNPU reaches a range as a view into that mapping. Ranges adjacent both
//! in the client's address space and in memory are one view, so the
//! vNPU's memory has as many regions as the guest has contiguous runs.
//!
//! A file's mapping stays until the client goes (the device's worker may
//! still hold a view of memory an unmap removed, until it takes the new
//! memory between requests); what a client may map is bounded by the
//! limits below, each failing that one request.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use thiserror::Error;
use vm_memory::{
    GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, MmapRegion,
};

/// Most ranges one client may have mapped at once (advertised as
/// `max_dma_maps`; QEMU assumes this many when not told).
pub const MAX_DMA_MAPS: usize = 65_535;
/// Most non-contiguous runs of guest memory the vNPU reaches for one
/// client: the device looks a run up per access, and a map or unmap
/// costs time in their number.
pub const MAX_DMA_RUNS: usize = 4096;
/// Most distinct files one client may map from (each stays open and
/// mapped while the client is attached).
pub const MAX_DMA_FILES: usize = 64;
/// Most bytes of guest memory one client may map (1 TiB), counted both
/// as ranges mapped and as the files mapped whole: what it maps takes the
/// daemon's address space, which every tenant shares.
pub const MAX_DMA_BYTES: u64 = 1 << 40;

/// Why a `DMA_MAP` or `DMA_UNMAP` failed.
#[derive(Debug, Error)]
pub enum DmaError {
    #[error("DMA_MAP: a client may have at most {MAX_DMA_MAPS} ranges mapped")]
    TooManyMaps,
    #[error("DMA_MAP or DMA_UNMAP: a client's guest memory may be in at most {MAX_DMA_RUNS} separate runs")]
    TooManyRuns,
    #[error("DMA_MAP: a client may map from at most {MAX_DMA_FILES} files")]
    TooManyFiles,
    #[error("DMA_MAP of {size:#x} bytes at {address:#x}: {reason}")]
    Map { address: u64, size: u64, reason: String },
    #[error("DMA_UNMAP of {size:#x} bytes at {address:#x}: {reason}")]
    Unmap { address: u64, size: u64, reason: &'static str },
    #[error("{0}")]
    Io(#[source] std::io::Error),
}

impl DmaError {
    /// The errno a client gets.
    pub fn errno(&self) -> i32 {
        match self {
            DmaError::TooManyMaps | DmaError::TooManyRuns | DmaError::TooManyFiles => libc::ENOSPC,
            DmaError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EINVAL,
        }
    }
}

/// A whole file mapped shared into the daemon, registered with the
/// SIGBUS recovery (`fault`); unregistered and unmapped when dropped.
#[derive(Debug)]
struct FileMapping {
    ptr: *mut u8,
    len: usize,
    guard: Option<crate::fault::Guard>,
}

// SAFETY: the mapping is plain shared memory, reached only through
// vm-memory's volatile accessors; the pointer is never dereferenced here.
unsafe impl Send for FileMapping {}
// SAFETY: as above; `FileMapping` itself has no interior state.
unsafe impl Sync for FileMapping {}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // Out of the fault handler's table before the address is free.
        drop(self.guard.take());
        // SAFETY: `ptr`/`len` are exactly what mmap(2) returned and took,
        // and nothing maps it again; the views into it are gone by then
        // (`DmaSpace` is dropped after the function whose worker used them).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One file a client maps from.
#[derive(Debug)]
struct Backing {
    /// Device and inode: QEMU sends a new descriptor of the same memfd
    /// with every `DMA_MAP`.
    id: (u64, u64),
    /// Its mappings, newest last (a file that grew since is mapped again).
    mappings: Vec<FileMapping>,
    /// Huge page size, for a file on hugetlbfs.
    huge_page: Option<u64>,
}

/// One mapped range: its size and, for a range with a file, which file
/// and where in the daemon's mapping of it it lies.
#[derive(Debug, Clone, Copy)]
struct Range {
    size: u64,
    /// Host address of its first byte (none: mapped without a file).
    host: Option<u64>,
}

/// A client's DMA mappings and the guest memory they give the vNPU.
#[derive(Debug, Default)]
pub struct DmaSpace {
    /// Client address of each range's first byte, to the range.
    ranges: BTreeMap<u64, Range>,
    backings: Vec<Backing>,
    /// Bytes of the ranges that have files.
    mapped: u64,
    /// Bytes of the files mapped whole.
    file_bytes: u64,
    /// Views of the ranges with files, contiguous ones merged.
    memory: GuestMemoryMmap<()>,
}

fn page_size() -> u64 {
    // SAFETY: sysconf(3) has no side effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Whether `file` is sealed against shrinking: a client that shrank a
/// mapped file would make the daemon's next access to it fault (SIGBUS)
/// and take every other tenant down with it.
fn sealed_against_shrinking(file: &File) -> bool {
    // SAFETY: F_GET_SEALS reads the seals of an open descriptor we own;
    // it has no other effect.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}

/// The huge page size of `file`'s hugetlbfs, if it lives on one: its
/// pages come from the host's huge page pool, and a page the pool cannot
/// supply is a SIGBUS when touched, not an error.
fn huge_page_size(file: &File) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs(2) fills `st` for a descriptor we own; it is read
    // only when the call succeeded.
    let ok = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) } == 0;
    if !ok {
        return None;
    }
    // SAFETY: initialised by the successful call above.
    let st = unsafe { st.assume_init() };
    (st.f_type == libc::HUGETLBFS_MAGIC).then(|| u64::try_from(st.f_bsize).unwrap_or(2 << 20).max(4096))
}

/// A view of `size` bytes at host address `host`, seen by the vNPU at
/// client address `address`.
fn view(address: u64, host: u64, size: u64) -> Result<Arc<GuestRegionMmap<()>>, String> {
    let len = usize::try_from(size).map_err(|_| "too large".to_string())?;
    let host = usize::try_from(host).map_err(|_| "outside the address space".to_string())?;
    // SAFETY: `host..host + len` lies inside a `FileMapping` (every view
    // is cut from a range that `map` checked to lie inside one, or merged
    // from adjacent such ranges), mapped PROT_READ|PROT_WRITE and
    // MAP_SHARED as given here, and no mapping is unmapped while the
    // `DmaSpace` lives.
    let region = unsafe {
        MmapRegion::<()>::build_raw(
            host as *mut u8,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
    }
    .map_err(|e| e.to_string())?;
    GuestRegionMmap::new(region, GuestAddress(address))
        .map(Arc::new)
        .ok_or_else(|| "the range wraps".to_string())
}

/// The host address of a view's first byte.
fn host_of(region: &GuestRegionMmap<()>) -> u64 {
    region.as_ptr() as u64
}

impl DmaSpace {
    /// The guest memory the vNPU reaches.
    pub fn memory(&self) -> &GuestMemoryMmap<()> {
        &self.memory
    }

    /// What says whether any of this client's file mappings was lost
    /// (replaced after a SIGBUS: `fault`).
    pub fn watch(&self) -> vnpu_device::MemoryWatch {
        let watches: Vec<crate::fault::Watch> = self
            .backings
            .iter()
            .flat_map(|b| &b.mappings)
            .filter_map(|m| m.guard.as_ref().map(crate::fault::Guard::watch))
            .collect();
        vnpu_device::MemoryWatch::new(move || watches.iter().any(crate::fault::Watch::lost))
    }

    /// How many ranges are mapped (with or without files).
    pub fn ranges(&self) -> usize {
        self.ranges.len()
    }

    /// Maps `size` bytes at client address `address`: from `file` at
    /// `offset`, or (no file) a range recorded but out of the vNPU's reach
    /// (QEMU maps its ROMs so; this server never fetches memory with
    /// `DMA_READ`).
    pub fn map(&mut self, offset: u64, address: u64, size: u64, file: Option<File>) -> Result<(), DmaError> {
        let err = |reason: &str| DmaError::Map { address, size, reason: reason.to_string() };
        if self.ranges.len() >= MAX_DMA_MAPS {
            return Err(DmaError::TooManyMaps);
        }
        let Some(end) = address.checked_add(size).filter(|_| size > 0 && offset.checked_add(size).is_some())
        else {
            return Err(err("empty or wrapping range"));
        };
        let before = self.ranges.range(..end).next_back();
        if before.is_some_and(|(&a, r)| a.saturating_add(r.size) > address) {
            return Err(err("overlaps a range mapped already"));
        }
        let Some(file) = file else {
            self.ranges.insert(address, Range { size, host: None });
            return Ok(());
        };
        if !offset.is_multiple_of(page_size()) {
            return Err(err(&format!("the file offset {offset:#x} is not page-aligned")));
        }
        if !sealed_against_shrinking(&file) {
            return Err(err(
                "the file is not sealed against shrinking (F_SEAL_SHRINK; QEMU's memfd backend seals it)",
            ));
        }
        let meta = file.metadata().map_err(DmaError::Io)?;
        let len = meta.len();
        if offset + size > len {
            return Err(err(&format!("the file is {len:#x} bytes long")));
        }
        if self.mapped.saturating_add(size) > MAX_DMA_BYTES {
            return Err(err(&format!("a client may map at most {MAX_DMA_BYTES:#x} bytes of guest memory")));
        }
        let host = self.host_address(&file, (meta.dev(), meta.ino()), len, address, offset, size)?;
        // Merge with the runs it continues, in both spaces.
        let mut start = (address, host, size);
        let mut remove = Vec::new();
        if let Some(prev) = address.checked_sub(1).and_then(|a| self.memory.find_region(GuestAddress(a))) {
            let prev_len = prev.len();
            if host_of(prev) + prev_len == host {
                start = (prev.start_addr().0, host_of(prev), prev_len + size);
                remove.push((prev.start_addr(), prev_len));
            }
        }
        if let Some(next) = self.memory.find_region(GuestAddress(end)) {
            if next.start_addr().0 == end && host_of(next) == host + size {
                start.2 += next.len();
                remove.push((next.start_addr(), next.len()));
            }
        }
        if remove.is_empty() && self.memory.num_regions() >= MAX_DMA_RUNS {
            return Err(DmaError::TooManyRuns);
        }
        let merged = view(start.0, start.1, start.2).map_err(|e| err(&e))?;
        let mut memory = self.memory.clone();
        for (a, len) in remove {
            memory = memory.remove_region(a, len).map_err(|e| err(&e.to_string()))?.0;
        }
        self.memory = memory.insert_region(merged).map_err(|e| err(&e.to_string()))?;
        self.ranges.insert(address, Range { size, host: Some(host) });
        self.mapped += size;
        Ok(())
    }

    /// The host address of `file`'s byte `offset`, `size` bytes of which
    /// will be mapped at client address `address`: in the daemon's mapping
    /// of the file (made now if the file is new, or grew past the last
    /// one).
    fn host_address(
        &mut self,
        file: &File,
        id: (u64, u64),
        len: u64,
        address: u64,
        offset: u64,
        size: u64,
    ) -> Result<u64, DmaError> {
        let err = |reason: String| DmaError::Map { address, size, reason };
        let i = match self.backings.iter().position(|b| b.id == id) {
            Some(i) => i,
            None => {
                if self.backings.len() >= MAX_DMA_FILES {
                    return Err(DmaError::TooManyFiles);
                }
                self.backings.push(Backing { id, mappings: Vec::new(), huge_page: huge_page_size(file) });
                self.backings.len() - 1
            }
        };
        let backing = &mut self.backings[i];
        let end = offset + size;
        let found = backing.mappings.iter().rev().find(|m| m.len as u64 >= end);
        let mapping = match found {
            Some(m) => m,
            // One mapping per file, whatever its size history: a file that
            // grew past its mapping would be mapped again whole for every
            // map (and the old mappings kept while views of them live).
            None if !backing.mappings.is_empty() => {
                return Err(err(format!(
                    "the file grew after it was first mapped (to {len:#x} bytes); \
                     a file is mapped once, at its size then: seal it against growing (F_SEAL_GROW)"
                )));
            }
            None => {
                if self.file_bytes.saturating_add(len) > MAX_DMA_BYTES {
                    return Err(err(format!(
                        "a client may map at most {MAX_DMA_BYTES:#x} bytes of files (this one is {len:#x})"
                    )));
                }
                let n = usize::try_from(len).map_err(|_| err("the file is too large".into()))?;
                // Whatever process maps a client's memory survives the
                // client punching holes in it (once per process).
                crate::fault::install().map_err(|e| err(format!("installing the SIGBUS handler: {e}")))?;
                // SAFETY: a fresh shared mapping of a file we hold open, at
                // an address the kernel chooses (no MAP_FIXED): it replaces
                // nothing. The file cannot shrink under it (sealed).
                let ptr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        n,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        file.as_raw_fd(),
                        0,
                    )
                };
                if ptr == libc::MAP_FAILED {
                    return Err(err(format!("mmap: {}", std::io::Error::last_os_error())));
                }
                let Some(guard) = crate::fault::register(ptr as usize, n) else {
                    // SAFETY: the mapping just made, not yet used.
                    unsafe { libc::munmap(ptr, n) };
                    return Err(err(format!(
                        "the daemon maps at most {} client files at once",
                        crate::fault::SLOTS
                    )));
                };
                self.file_bytes += len;
                backing.mappings.push(FileMapping { ptr: ptr.cast(), len: n, guard: Some(guard) });
                backing.mappings.last().ok_or_else(|| err("no mapping".into()))?
            }
        };
        // In bounds: `end <= mapping.len`.
        let host = mapping.ptr as u64 + offset;
        if let Some(huge) = backing.huge_page {
            // Every huge page the range needs, now: a pool that cannot
            // supply them fails this request instead of killing the daemon
            // with SIGBUS at the device's first access.
            let first = offset - offset % huge;
            let last = end.div_ceil(huge).saturating_mul(huge).min(mapping.len as u64);
            // Both inside the mapping, whose length is a usize.
            let (first, len) =
                (usize::try_from(first).unwrap_or(0), usize::try_from(last - first).unwrap_or(0));
            // SAFETY: the range lies inside the mapping (both ends are
            // clamped to it), and MADV_POPULATE_WRITE only faults its
            // pages in (no data change).
            let r = unsafe { libc::madvise(mapping.ptr.add(first).cast(), len, libc::MADV_POPULATE_WRITE) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                return Err(err(format!(
                    "its huge pages cannot be had ({e}): the host's huge page pool is short"
                )));
            }
        }
        Ok(host)
    }

    /// Unmaps every range inside `size` bytes at `address` (none is
    /// fine; a range only partly inside fails the request: as in Linux's
    /// VFIO, an unmap may not split a mapping), or (`all`) every range. The
    /// range may end at the top of the address space (QEMU's vIOMMU unmaps
    /// up to 2^64).
    pub fn unmap(&mut self, all: bool, address: u64, size: u64) -> Result<(), DmaError> {
        if all {
            self.ranges.clear();
            self.memory = GuestMemoryMmap::new();
            self.mapped = 0;
            return Ok(());
        }
        let err = |reason| DmaError::Unmap { address, size, reason };
        let end = u128::from(address) + u128::from(size);
        if size == 0 || end > 1u128 << 64 {
            return Err(err("empty or wrapping range"));
        }
        let ends_after = |a: u64, r: &Range| u128::from(a) + u128::from(r.size) > end;
        if self.ranges.range(..address).next_back().is_some_and(|(&a, r)| a.saturating_add(r.size) > address)
        {
            return Err(err("it would split a mapping"));
        }
        let inside: Vec<(u64, Range)> = self
            .ranges
            .range(address..)
            .take_while(|(&a, _)| u128::from(a) < end)
            .map(|(&a, &r)| (a, r))
            .collect();
        if inside.last().is_some_and(|(a, r)| ends_after(*a, r)) {
            return Err(err("it would split a mapping"));
        }
        // The runs the ranges were part of, less the ranges.
        let mut memory = self.memory.clone();
        let mut freed = 0;
        for &(a, r) in &inside {
            let Some(host) = r.host else { continue };
            let Some(run) = memory.find_region(GuestAddress(a)) else { continue };
            let (run_start, run_len, run_host) = (run.start_addr().0, run.len(), host_of(run));
            memory =
                memory.remove_region(GuestAddress(run_start), run_len).map_err(|_| err("no such run"))?.0;
            let head = a - run_start;
            let tail = (run_start + run_len) - (a + r.size);
            debug_assert_eq!(run_host + head, host);
            if head > 0 {
                let v =
                    view(run_start, run_host, head).map_err(|_| err("cannot keep the rest of its run"))?;
                memory = memory.insert_region(v).map_err(|_| err("cannot keep the rest of its run"))?;
            }
            if tail > 0 {
                let at = host + r.size;
                let v = view(a + r.size, at, tail).map_err(|_| err("cannot keep the rest of its run"))?;
                memory = memory.insert_region(v).map_err(|_| err("cannot keep the rest of its run"))?;
            }
            freed += r.size;
        }
        // An unmap that splits runs makes more of them: bounded as maps are
        // (nothing changes when it would pass the limit).
        if memory.num_regions() > MAX_DMA_RUNS {
            return Err(DmaError::TooManyRuns);
        }
        self.mapped -= freed;
        for (a, _) in inside {
            self.ranges.remove(&a);
        }
        self.memory = memory;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;
    use vm_memory::Bytes;

    /// A sealed memfd of `len` bytes whose 4 KiB page `i` starts with
    /// `i` (a little-endian u64).
    fn memfd(len: u64) -> File {
        // SAFETY: memfd_create(2) returns a fresh descriptor, owned below.
        let fd = unsafe { libc::memfd_create(c"vnpu-dma-test".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: `fd` is ours alone.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(len).expect("size");
        for page in 0..len / 4096 {
            std::os::unix::fs::FileExt::write_all_at(&f, &page.to_le_bytes(), page * 4096).expect("write");
        }
        // SAFETY: F_ADD_SEALS on the descriptor we own.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) }, 0);
        f
    }

    fn read_u64(space: &DmaSpace, at: u64) -> Option<u64> {
        space.memory().read_obj::<u64>(GuestAddress(at)).ok()
    }

    /// A vIOMMU guest's pattern: page-sized maps of one memfd, many more
    /// than there are mmaps to spare, contiguous ones merged into one run,
    /// each page reaching the file's own page; an unmap in the middle
    /// splits the run and the rest still reads right.
    #[test]
    fn page_sized_maps_are_views_merged_into_runs() {
        let f = memfd(8 << 20);
        let mut s = DmaSpace::default();
        // 2048 pages: client page 0x10_0000 + i maps file page i.
        for i in 0..2048u64 {
            s.map(i * 4096, (0x10_0000 + i) * 4096, 4096, Some(f.try_clone().expect("dup"))).expect("map");
        }
        assert_eq!(s.ranges(), 2048);
        assert_eq!(s.memory().num_regions(), 1, "one contiguous run");
        assert_eq!(s.backings.iter().map(|b| b.mappings.len()).sum::<usize>(), 1, "the file mapped once");
        for i in [0u64, 1, 1000, 2047] {
            assert_eq!(read_u64(&s, (0x10_0000 + i) * 4096), Some(i));
        }
        // A reversed pattern: client page 0x20_0000 + i maps file page 2047 - i.
        for i in 0..64u64 {
            s.map((2047 - i) * 4096, (0x20_0000 + i) * 4096, 4096, Some(f.try_clone().expect("dup")))
                .expect("map");
        }
        assert_eq!(s.memory().num_regions(), 65, "non-contiguous pages are runs of their own");
        assert_eq!(read_u64(&s, (0x20_0000 + 5) * 4096), Some(2042));
        // Unmap a middle page: two runs, the rest intact, the page gone.
        s.unmap(false, (0x10_0000 + 1000) * 4096, 4096).expect("unmap");
        assert_eq!(read_u64(&s, (0x10_0000 + 1000) * 4096), None);
        assert_eq!(read_u64(&s, (0x10_0000 + 999) * 4096), Some(999));
        assert_eq!(read_u64(&s, (0x10_0000 + 1001) * 4096), Some(1001));
        // Mapped again, it merges back.
        s.map(1000 * 4096, (0x10_0000 + 1000) * 4096, 4096, Some(f.try_clone().expect("dup")))
            .expect("remap");
        assert_eq!(read_u64(&s, (0x10_0000 + 1000) * 4096), Some(1000));
        assert_eq!(s.memory().num_regions(), 65);
        // An unmap spanning many whole ranges takes them all.
        s.unmap(false, 0x10_0000 * 4096, 1024 * 4096).expect("a span of ranges");
        assert_eq!(s.ranges(), 2048 - 1024 + 64);
        assert_eq!(read_u64(&s, 0x10_0000 * 4096), None);
        assert_eq!(read_u64(&s, (0x10_0000 + 1024) * 4096), Some(1024));
        // A read across the boundary of two runs that are one in the file.
        let mut buf = [0u8; 16];
        s.memory().read_slice(&mut buf, GuestAddress((0x10_0000 + 1025) * 4096 - 8)).expect("read across");
        assert_eq!(u64::from_le_bytes(buf[8..].try_into().expect("8")), 1025);
        s.unmap(true, 0, 0).expect("unmap all");
        assert_eq!((s.ranges(), s.memory().num_regions(), s.mapped), (0, 0, 0));
    }

    /// An unmap may not split a mapping; one over nothing does nothing.
    #[test]
    fn an_unmap_takes_whole_mappings_only() {
        let f = memfd(1 << 20);
        let mut s = DmaSpace::default();
        s.map(0, 0x10_0000, 0x4000, Some(f.try_clone().expect("dup"))).expect("map");
        for (a, len) in [(0x10_1000, 0x1000), (0x0f_f000, 0x2000), (0x10_3000, 0x2000), (0x10_0000, 0x3000)] {
            assert!(s.unmap(false, a, len).is_err(), "{a:#x}+{len:#x} splits the mapping");
        }
        s.unmap(false, 0x20_0000, 0x1000).expect("nothing there: nothing to do");
        s.unmap(false, 0xfef0_0000, 0u64.wrapping_sub(0xfef0_0000))
            .expect("up to 2^64, as QEMU's vIOMMU unmaps");
        assert!(s.unmap(false, u64::MAX - 10, 0x1000).is_err(), "wraps");
        assert_eq!(read_u64(&s, 0x10_0000), Some(0), "still mapped");
        s.unmap(false, 0x0f_0000, 0x10_0000).expect("a span holding it whole");
        assert_eq!(s.ranges(), 0);
    }

    /// Bounds: ranges per client, runs, offsets, and the file's length.
    #[test]
    fn maps_past_a_limit_fail_that_request() {
        let f = memfd(1 << 20);
        let mut s = DmaSpace::default();
        assert!(s.map(100, 0, 4096, Some(f.try_clone().expect("dup"))).is_err(), "unaligned offset");
        assert!(s.map(0, 0, 2 << 20, Some(f.try_clone().expect("dup"))).is_err(), "past the file's end");
        // Runs: every other page of a big file, until the limit.
        let big = memfd(16 << 20);
        s.map(0, 1 << 40, 4096, Some(big.try_clone().expect("dup"))).expect("map");
        let mut refused = None;
        for i in 1..=MAX_DMA_RUNS as u64 {
            if let Err(e) = s.map(0, (1 << 40) + i * 8192, 4096, Some(big.try_clone().expect("dup"))) {
                refused = Some((i, e));
                break;
            }
        }
        let (i, e) = refused.expect("the runs are bounded");
        assert_eq!(i, MAX_DMA_RUNS as u64);
        assert_eq!(e.errno(), libc::ENOSPC);
        // Ranges without files count against the ranges' limit only.
        let mut s = DmaSpace::default();
        for i in 0..MAX_DMA_MAPS as u64 {
            s.map(0, i << 12, 4096, None).expect("within the limit");
        }
        assert!(matches!(s.map(0, 1 << 40, 4096, None), Err(DmaError::TooManyMaps)));
        assert_eq!(s.memory().num_regions(), 0, "out of the vNPU's reach");
    }

    /// A file that grew after its first map is not mapped again: one
    /// mapping per file (a client growing its file between maps made the
    /// daemon map it whole again for every map, 23,169 mappings for one
    /// client), and the map fails with the reason.
    #[test]
    fn a_file_that_grew_is_not_mapped_again() {
        let f = memfd(2 * 4096);
        let mut s = DmaSpace::default();
        s.map(0, 0x10_0000, 4096, Some(f.try_clone().expect("dup"))).expect("map");
        for grown in 3..10u64 {
            f.set_len(grown * 4096).expect("grow");
            let e =
                s.map((grown - 1) * 4096, 0x20_0000 + grown * 4096, 4096, Some(f.try_clone().expect("dup")));
            assert!(matches!(&e, Err(DmaError::Map { reason, .. }) if reason.contains("grew")), "{e:?}");
        }
        // Within the first mapping, maps still work.
        s.map(4096, 0x30_0000, 4096, Some(f.try_clone().expect("dup"))).expect("inside the first size");
        assert_eq!(s.backings.iter().map(|b| b.mappings.len()).sum::<usize>(), 1, "the file mapped once");
    }

    /// Unmaps that split runs cannot grow them past the limit: each unmap
    /// of a page in the middle of a run makes two; the one that would
    /// make `MAX_DMA_RUNS + 1` fails with ENOSPC and changes nothing.
    #[test]
    fn unmaps_that_split_runs_are_bounded() {
        let pages = 2 * MAX_DMA_RUNS as u64 + 2;
        let f = memfd(pages * 4096);
        let mut s = DmaSpace::default();
        for i in 0..pages {
            s.map(i * 4096, (1 << 30) + i * 4096, 4096, Some(f.try_clone().expect("dup"))).expect("map");
        }
        assert_eq!(s.memory().num_regions(), 1);
        let mut refused = None;
        for k in 0..MAX_DMA_RUNS as u64 {
            let at = (1 << 30) + (2 * k + 1) * 4096;
            if let Err(e) = s.unmap(false, at, 4096) {
                refused = Some((k, e, at));
                break;
            }
        }
        let (k, e, at) = refused.expect("the runs an unmap makes are bounded");
        assert_eq!(k, MAX_DMA_RUNS as u64 - 1, "runs {}", s.memory().num_regions());
        assert_eq!(e.errno(), libc::ENOSPC);
        assert_eq!(s.memory().num_regions(), MAX_DMA_RUNS);
        // The refused unmap changed nothing: its page still reads.
        assert_eq!(read_u64(&s, at), Some((at - (1 << 30)) / 4096));
        assert_eq!(s.ranges(), pages as usize - (MAX_DMA_RUNS - 1));
    }

    /// Distinct files are bounded too.
    #[test]
    fn files_are_bounded() {
        let mut s = DmaSpace::default();
        for i in 0..MAX_DMA_FILES as u64 {
            s.map(0, i << 20, 4096, Some(memfd(4096))).expect("within the limit");
        }
        assert!(matches!(s.map(0, 1 << 40, 4096, Some(memfd(4096))), Err(DmaError::TooManyFiles)));
    }

    /// Any sequence of maps and unmaps against a model kept page by page:
    /// each request succeeds exactly when the model says it may, every
    /// page then reads what the model says it maps (or nothing), and the
    /// vNPU's memory has as many regions as the model has runs.
    mod model {
        use super::*;
        use proptest::prelude::*;

        const PAGES: u64 = 48;
        const FILE_PAGES: u64 = 40;

        #[derive(Debug, Clone)]
        enum Op {
            Map { at: u64, len: u64, file_page: Option<u64> },
            Unmap { at: u64, len: u64 },
            UnmapAll,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => (0..PAGES, 1..5u64, proptest::option::weighted(0.9, 0..FILE_PAGES + 2))
                    .prop_map(|(at, len, file_page)| Op::Map { at, len, file_page }),
                3 => (0..PAGES, 1..8u64).prop_map(|(at, len)| Op::Unmap { at, len }),
                1 => Just(Op::UnmapAll),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
            #[test]
            fn maps_and_unmaps_agree_with_a_page_model(ops in proptest::collection::vec(op(), 1..40)) {
                let f = memfd(FILE_PAGES * 4096);
                let mut s = DmaSpace::default();
                // Client page to (range start, range length, its file page or none).
                let mut model: BTreeMap<u64, (u64, Option<u64>)> = BTreeMap::new();
                for op in ops {
                    match op {
                        Op::Map { at, len, file_page } => {
                            let free = model.iter().all(|(&a, &(l, _))| a + l <= at || at + len <= a);
                            let fits = file_page.is_none_or(|p| p + len <= FILE_PAGES);
                            let file = file_page.map(|_| f.try_clone().expect("dup"));
                            let r = s.map(file_page.unwrap_or(0) * 4096, at * 4096, len * 4096, file);
                            prop_assert_eq!(r.is_ok(), free && fits, "{:?}", r);
                            if r.is_ok() {
                                model.insert(at, (len, file_page));
                            }
                        }
                        Op::Unmap { at, len } => {
                            let end = at + len;
                            let split = model.iter().any(|(&a, &(l, _))| a < end && at < a + l && (a < at || a + l > end));
                            let r = s.unmap(false, at * 4096, len * 4096);
                            prop_assert_eq!(r.is_ok(), !split, "{:?}", r);
                            if r.is_ok() {
                                model.retain(|&a, _| !(at..end).contains(&a));
                            }
                        }
                        Op::UnmapAll => {
                            s.unmap(true, 0, 0).expect("unmap all");
                            model.clear();
                        }
                    }
                    let mut runs = 0;
                    let mut last: Option<(u64, u64)> = None; // (client page, file page) of the previous mapped page
                    for page in 0..PAGES + 8 {
                        let want = model
                            .range(..=page)
                            .next_back()
                            .filter(|(&a, &(l, _))| page < a + l)
                            .and_then(|(&a, &(_, fp))| fp.map(|fp| fp + page - a));
                        prop_assert_eq!(read_u64(&s, page * 4096), want, "page {}", page);
                        if let Some(fp) = want {
                            if last != Some((page.wrapping_sub(1), fp.wrapping_sub(1))) {
                                runs += 1;
                            }
                            last = Some((page, fp));
                        }
                    }
                    prop_assert_eq!(s.memory().num_regions(), runs);
                    prop_assert_eq!(s.ranges(), model.len());
                }
            }
        }
    }
}
