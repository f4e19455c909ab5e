//! Memories a program can name: the core's SRAM segment, a lazily backed
//! HBM segment and the guest's DMA-visible memory.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::AsRawFd;

use thiserror::Error;

/// A failed memory access.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MemoryError {
    #[error("{space} access [{start:#x}, +{len:#x}) outside its {size:#x}-byte segment")]
    OutOfRange { space: &'static str, start: u64, len: u64, size: u64 },
    #[error("guest memory access at {addr:#x} (+{len:#x}) failed: {reason}")]
    Guest { addr: u64, len: u64, reason: String },
    /// A file-backed HBM segment could not store a write (its disk is full).
    #[error("hbm store at {addr:#x} (+{len:#x}) failed: {reason}")]
    Store { addr: u64, len: u64, reason: String },
}

/// A file mapped whole into memory: where a memory's bytes live when they
/// must outlive the process (a vNPU's SRAM and HBM in the board daemon's
/// state directory, so that a restarted daemon resumes them). Every page
/// a write may touch is reserved on disk first (`fallocate`), so a full
/// disk fails that write instead of killing the process with SIGBUS.
struct MappedFile {
    file: File,
    map: memmap2::MmapMut,
}

impl MappedFile {
    /// Maps `file` as `size` bytes. Its contents are kept if it is that
    /// long already; otherwise it is emptied and sized (reads as zeros).
    /// The file must be this process's alone: another process that
    /// shrank it would make the next access fault.
    fn open(file: File, size: u64) -> std::io::Result<Self> {
        if file.metadata()?.len() != size {
            file.set_len(0)?;
            file.set_len(size)?;
        }
        let len =
            usize::try_from(size).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: the mapping covers exactly the file's `size` bytes (set
        // above); the file lives in the daemon's own state directory and
        // is never truncated while mapped, so no access can fault on a
        // missing page; writes go only to pages `reserve` allocated.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file)? };
        Ok(Self { file, map })
    }

    /// The [`HBM_CHUNK`]s of the file that have blocks allocated (found
    /// with `SEEK_DATA`/`SEEK_HOLE`; all of them where those fail).
    fn allocated_chunks(&self, size: u64) -> HashSet<u64> {
        let fd = self.file.as_raw_fd();
        let mut out = HashSet::new();
        let mut at: i64 = 0;
        let end = i64::try_from(size).unwrap_or(i64::MAX);
        while at < end {
            // SAFETY: lseek(2) on a descriptor we own moves only its offset.
            let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
            if data < 0 {
                if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO) {
                    // No SEEK_DATA here: count every chunk as allocated.
                    out.extend(0..size.div_ceil(HBM_CHUNK));
                }
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let hole = if hole < 0 { end } else { hole.min(end) };
            // Both are in [0, size): the casts cannot lose anything.
            let (first, last) = (data as u64 / HBM_CHUNK, (hole as u64).div_ceil(HBM_CHUNK));
            out.extend(first..last);
            at = hole.max(data + 1);
        }
        out
    }

    /// Allocates the file's blocks for `[offset, offset + len)`, so that
    /// writing there cannot fail for want of space.
    fn reserve(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        };
        // SAFETY: fallocate(2) with mode 0 on a descriptor we own only
        // allocates blocks of the file (its size already covers the range).
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, off, n) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
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
    /// The bytes `[addr, addr + len)` as one slice, for memories that
    /// hold them in one flat buffer (lets DMA copy from them without a
    /// bounce buffer); `None` otherwise.
    fn slice(&self, _addr: u64, _len: u64) -> Option<&[u8]> {
        None
    }
    /// Copies `len` bytes from `src` to `dst` in this memory, as a read of
    /// all of them followed by a write (overlapping ranges copy the old
    /// bytes). Memories that can move them in place override it.
    fn copy_within(&mut self, src: u64, dst: u64, len: u64) -> Result<(), MemoryError> {
        copy_through_buffer(self, src, dst, len)
    }
    /// Copies `rows` rows of `row` bytes, `strides.0` apart from `at.0`,
    /// to rows `strides.1` apart from `at.1` in this memory, row by row
    /// in order, each as [`Memory::copy_within`]. Memories whose call per
    /// row costs more than a short row's bytes override it.
    fn copy_rows_within(
        &mut self,
        at: (u64, u64),
        rows: u64,
        row: u64,
        strides: (u64, u64),
    ) -> Result<(), MemoryError> {
        copy_rows_one_by_one(self, at, rows, row, strides)
    }
    /// Writes `rows` rows of `row` bytes to rows `stride` apart from
    /// `addr`, row `r` from `data[r * data_stride..][..row]`, in order
    /// (where destination rows overlap, the later row's bytes stay), each
    /// as [`Memory::write`]. Memories whose call per row costs more than
    /// a short row's bytes override it. `data` too short for the rows is
    /// an error before anything is written.
    fn write_rows(
        &mut self,
        addr: u64,
        (rows, row, stride): (u64, u64, u64),
        data: &[u8],
        data_stride: usize,
    ) -> Result<(), MemoryError> {
        write_rows_one_by_one(self, addr, (rows, row, stride), data, data_stride)
    }
    /// Reads `rows` rows of `row` bytes, `stride` apart from `addr`, into
    /// `out[r * out_stride..][..row]`, in order (where `out`'s rows
    /// overlap, the later row's bytes stay), each as [`Memory::read`].
    /// Memories whose call per row costs more than a short row's bytes
    /// override it. `out` too short for the rows is an error before
    /// anything is read.
    fn read_rows(
        &self,
        addr: u64,
        (rows, row, stride): (u64, u64, u64),
        out: &mut [u8],
        out_stride: usize,
    ) -> Result<(), MemoryError> {
        read_rows_one_by_one(self, addr, (rows, row, stride), out, out_stride)
    }
    /// When `[addr, addr + len)` holds, unchanged, bytes of a file (guest
    /// RAM a model file was mapped into, none of its pages written since),
    /// that file and the offset in it of `addr`'s byte: a copy of them
    /// may then map the file's pages ([`Memory::map_file`]) instead of
    /// copying. `None` (the default) where that is not known.
    fn file_pages(&self, _addr: u64, _len: u64) -> Option<(&File, u64)> {
        None
    }
    /// The granule [`Memory::map_file`] maps: a power of two, or 0 (the
    /// default) for a memory that cannot map files. It maps pieces of at
    /// least half a granule, and any piece into a granule never written.
    fn map_granule(&self) -> u64 {
        0
    }
    /// Makes `[addr, addr + len)`, inside one granule of
    /// [`Memory::map_granule`], hold `len` bytes of `file` from `offset`
    /// on (refused unless `offset` and `addr` have one page phase) through a private
    /// copy-on-write mapping of the file's pages: what writing those bytes
    /// there would give, the rest of the granule unchanged, without
    /// copying them (later writes to either side do not reach the other).
    /// `false`, with nothing changed, when it cannot or it would not pay
    /// (the default).
    fn map_file(&mut self, _addr: u64, _len: u64, _file: &File, _offset: u64) -> bool {
        false
    }
}

/// Host page size the file mappings assume.
pub const PAGE: u64 = 4096;

/// Whether none of the pages of `[ptr, ptr + len)`, a private mapping of
/// a file in this process, has been written since it was mapped: each is
/// either not faulted in yet or still the file's own page, never an
/// anonymous copy (`/proc/self/pagemap`: not swapped, and present only
/// as a file page). `false` whenever that cannot be read.
pub fn file_pages_unchanged(ptr: *const u8, len: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::FileExt;
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE: u64 = 1 << 61;
        let page = PAGE as usize;
        let start = ptr as usize;
        let Some(end) = start.checked_add(len) else { return false };
        if len == 0 {
            return true;
        }
        let (first, last) = (start / page, (end - 1) / page);
        let Ok(f) = File::open("/proc/self/pagemap") else { return false };
        let mut entries = vec![0u8; (last - first + 1) * 8];
        let Some(at) = (first as u64).checked_mul(8) else { return false };
        if f.read_exact_at(&mut entries, at).is_err() {
            return false;
        }
        entries.chunks_exact(8).all(|e| {
            let v = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
            v & SWAPPED == 0 && (v & PRESENT == 0 || v & FILE != 0)
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (ptr, len);
        false
    }
}

/// The address of row `r` of rows `stride` apart from `base` (overflow:
/// out of range).
fn row_start(base: u64, r: u64, stride: u64, row: u64) -> Result<u64, MemoryError> {
    r.checked_mul(stride).and_then(|o| base.checked_add(o)).ok_or(MemoryError::OutOfRange {
        space: "memory",
        start: base,
        len: row,
        size: u64::MAX,
    })
}

/// [`Memory::write_rows`] row by row, each row as [`Memory::write`].
fn write_rows_one_by_one<M: Memory + ?Sized>(
    m: &mut M,
    addr: u64,
    (rows, row, stride): (u64, u64, u64),
    data: &[u8],
    data_stride: usize,
) -> Result<(), MemoryError> {
    let n = rows_in(rows, row, data_stride, data.len())?;
    for r in 0..rows {
        let at = row_start(addr, r, stride, row)?;
        m.write(at, &data[r as usize * data_stride..][..n])?;
    }
    Ok(())
}

/// [`Memory::read_rows`] row by row, each row as [`Memory::read`].
fn read_rows_one_by_one<M: Memory + ?Sized>(
    m: &M,
    addr: u64,
    (rows, row, stride): (u64, u64, u64),
    out: &mut [u8],
    out_stride: usize,
) -> Result<(), MemoryError> {
    let n = rows_in(rows, row, out_stride, out.len())?;
    for r in 0..rows {
        let at = row_start(addr, r, stride, row)?;
        m.read(at, &mut out[r as usize * out_stride..][..n])?;
    }
    Ok(())
}

/// `row` as a length, when a host buffer of `len` bytes holds `rows` rows
/// of it `stride` apart (overflow-checked); out of range otherwise.
fn rows_in(rows: u64, row: u64, stride: usize, len: usize) -> Result<usize, MemoryError> {
    let short = MemoryError::OutOfRange { space: "host buffer", start: 0, len: row, size: len as u64 };
    let n = usize::try_from(row).map_err(|_| short.clone())?;
    if rows == 0 {
        return Ok(n);
    }
    let last = usize::try_from(rows - 1).ok().and_then(|r| r.checked_mul(stride));
    match last.and_then(|l| l.checked_add(n)) {
        Some(end) if end <= len => Ok(n),
        _ => Err(short),
    }
}

/// One past the last byte of `rows` rows of `row` bytes `stride` apart
/// from `base` (`None`: no rows, or past 64 bits).
fn rows_span_end(base: u64, rows: u64, row: u64, stride: u64) -> Option<u64> {
    rows.checked_sub(1)?.checked_mul(stride)?.checked_add(row)?.checked_add(base)
}

/// How many rows of `row` bytes, `stride` apart from `at`, lie whole in
/// `at`'s HBM chunk (`u64::MAX` for a stride of 0 when the row does).
fn rows_in_chunk(at: u64, row: u64, stride: u64) -> u64 {
    let end = at % HBM_CHUNK + row;
    if end > HBM_CHUNK {
        0
    } else {
        (HBM_CHUNK - end).checked_div(stride).map_or(u64::MAX, |k| k + 1)
    }
}

/// The rows of a strided access inside LazyHbm, `rows` rows of `row`
/// bytes `stride` apart from `addr`, in order as runs: `(first row,
/// count, address of the first)`, the `count` rows lying whole in one
/// chunk, or a count of 0 for one row across a chunk's border. The
/// caller has checked that every row lies inside, so no address
/// overflows.
fn chunk_runs(addr: u64, rows: u64, row: u64, stride: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    let mut r = 0u64;
    std::iter::from_fn(move || {
        if r >= rows {
            return None;
        }
        let at = addr + r * stride;
        let k = rows_in_chunk(at, row, stride).min(rows - r);
        let run = (r, k, at);
        r += k.max(1);
        Some(run)
    })
}

/// [`Memory::copy_rows_within`] row by row, each row as
/// [`Memory::copy_within`].
fn copy_rows_one_by_one<M: Memory + ?Sized>(
    m: &mut M,
    (src, dst): (u64, u64),
    rows: u64,
    row: u64,
    (ss, ds): (u64, u64),
) -> Result<(), MemoryError> {
    for r in 0..rows {
        let (s, d) = (row_start(src, r, ss, row)?, row_start(dst, r, ds, row)?);
        m.copy_within(s, d, row)?;
    }
    Ok(())
}

/// [`Memory::copy_within`] through a buffer of the bytes.
fn copy_through_buffer<M: Memory + ?Sized>(
    m: &mut M,
    src: u64,
    dst: u64,
    len: u64,
) -> Result<(), MemoryError> {
    check("memory", src, len, m.size())?;
    check("memory", dst, len, m.size())?;
    let mut buf = vec![0u8; len as usize];
    m.read(src, &mut buf)?;
    m.write(dst, &buf)
}

/// On-chip SRAM of one vNPU core: bytes allocated up front, 8-byte
/// aligned so aligned f32 operands can be used in place.
/// Or held in a file it maps ([`Sram::file_backed`]; page aligned).
pub struct Sram {
    words: Vec<u64>,
    size: u64,
    file: Option<MappedFile>,
}

impl std::fmt::Debug for Sram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sram").field("size", &self.size).field("file_backed", &self.file.is_some()).finish()
    }
}

/// A copy in host memory (a file-backed SRAM's copy is not file-backed).
impl Clone for Sram {
    fn clone(&self) -> Self {
        let mut c = Self::new(self.size);
        c.bytes_mut().copy_from_slice(self.bytes());
        c
    }
}

impl Sram {
    pub fn new(size: u64) -> Self {
        Self { words: vec![0; size.div_ceil(8) as usize], size, file: None }
    }

    /// An SRAM of `size` bytes held in `file`: what the file holds if it
    /// is `size` bytes long already (a restarted daemon resumes it), zeros
    /// otherwise. Its blocks are all allocated now, so no later access can
    /// fail for want of disk space.
    pub fn file_backed(size: u64, file: File) -> std::io::Result<Self> {
        if size == 0 {
            return Ok(Self::new(0));
        }
        let f = MappedFile::open(file, size)?;
        f.reserve(0, size)?;
        Ok(Self { words: Vec::new(), size, file: Some(f) })
    }

    /// All bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.file {
            Some(f) => &f.map[..],
            None => &bytemuck::cast_slice(&self.words)[..self.size as usize],
        }
    }

    /// All bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.size as usize;
        match &mut self.file {
            Some(f) => &mut f.map[..],
            None => &mut bytemuck::cast_slice_mut(&mut self.words)[..n],
        }
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
    fn slice(&self, addr: u64, len: u64) -> Option<&[u8]> {
        check("sram", addr, len, self.size).ok()?;
        self.bytes().get(addr as usize..(addr + len) as usize)
    }
    fn copy_within(&mut self, src: u64, dst: u64, len: u64) -> Result<(), MemoryError> {
        check("sram", src, len, self.size)?;
        check("sram", dst, len, self.size)?;
        let s = src as usize;
        self.bytes_mut().copy_within(s..s + len as usize, dst as usize);
        Ok(())
    }
}

/// Faults in the whole pages of `bytes` at once (`MADV_POPULATE_WRITE`),
/// before anything touches them: a fresh chunk is about to be written,
/// and one call for its 256 pages costs about half of taking a page fault
/// for each (`docs/benchmarks.md`). Contents are unchanged (fresh pages
/// read as zero either way); where the kernel lacks the advice (before
/// Linux 5.14) the pages fault in one by one as before.
fn populate(bytes: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = bytes.as_mut_ptr() as usize;
        let (Some(first), Some(end)) = (start.checked_next_multiple_of(PAGE), start.checked_add(bytes.len()))
        else {
            return;
        };
        let last = end - end % PAGE;
        if last > first {
            // SAFETY: `[first, last)` is whole pages inside `bytes`, memory
            // this process owns and no one else references yet; the advice
            // only allocates their backing, as a write would, and does
            // not change what they read.
            unsafe {
                libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_POPULATE_WRITE);
            }
        }
    }
}

/// Maps the pages of `[addr, addr + len)`, a private file mapping, in
/// one call (`MADV_POPULATE_READ`): they are the file's pages in the page
/// cache, read-only until written, and faulting them in one by one on
/// first use costs more than the copy the mapping saved
/// (`docs/benchmarks.md`).
fn populate_read(addr: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: `[addr, addr + len)` is a private file mapping the caller
    // owns; the advice only maps its pages as a read would (no copy is
    // made) and changes no byte. A failure (an old kernel without the
    // advice) leaves the pages to fault in on first use.
    unsafe {
        libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_READ);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, len);
}

/// Granule of lazy HBM backing.
pub const HBM_CHUNK: u64 = 1 << 20;

/// One chunk of [`LazyHbm`]: fresh host memory, or a private
/// (copy-on-write) mapping of a file's pages that a DMA from a file's
/// unchanged pages made instead of copying them ([`Memory::map_file`]).
enum Chunk {
    Heap(Box<[u8]>),
    Mapped(memmap2::MmapMut),
}

impl std::ops::Deref for Chunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Chunk::Heap(b) => b,
            Chunk::Mapped(m) => m,
        }
    }
}

impl std::ops::DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Chunk::Heap(b) => b,
            Chunk::Mapped(m) => m,
        }
    }
}

/// A copy in host memory.
impl Clone for Chunk {
    fn clone(&self) -> Self {
        Chunk::Heap(Box::from(&**self))
    }
}

/// HBM segment backed lazily: a chunk is allocated on its first write and
/// untouched memory reads as zero, so a board with tens of GiB of modelled
/// HBM costs host memory only for what tenants write. The chunks live in
/// host memory, or in a sparse file the segment maps
/// ([`LazyHbm::file_backed`]), whose blocks are allocated chunk by chunk.
#[derive(Default)]
pub struct LazyHbm {
    size: u64,
    /// Indexed by chunk (a DMA reads and writes chunk by chunk, row by
    /// row: an index, not a hash, per row); grown up to the highest chunk
    /// written, at most `size / HBM_CHUNK` entries.
    chunks: Vec<Option<Chunk>>,
    /// How many of `chunks` are allocated.
    resident: usize,
    file: Option<(MappedFile, HashSet<u64>)>,
    /// While tracked ([`LazyHbm::track_writes`]): the chunks written since
    /// the last [`LazyHbm::take_written`], a bit each.
    written: Option<Vec<u64>>,
}

impl std::fmt::Debug for LazyHbm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyHbm")
            .field("size", &self.size)
            .field("resident_bytes", &self.resident_bytes())
            .field("file_backed", &self.file.is_some())
            .finish()
    }
}

/// A copy in host memory (a file-backed segment's copy is not file-backed).
impl Clone for LazyHbm {
    fn clone(&self) -> Self {
        let mut copy = Self {
            size: self.size,
            chunks: self.chunks.clone(),
            resident: self.resident,
            file: None,
            written: None,
        };
        if let Some((f, reserved)) = &self.file {
            for &c in reserved {
                let at = (c * HBM_CHUNK) as usize;
                let end = (at + HBM_CHUNK as usize).min(f.map.len());
                copy.chunk_mut(c)[..end - at].copy_from_slice(&f.map[at..end]);
            }
        }
        copy
    }
}

impl LazyHbm {
    pub fn new(size: u64) -> Self {
        Self { size, chunks: Vec::new(), resident: 0, file: None, written: None }
    }

    /// Tracks the chunks written from now on (a live migration's pre-copy
    /// of the segment): [`Self::take_written`] lists them.
    pub fn track_writes(&mut self) {
        self.written = Some(Vec::new());
    }

    /// Stops tracking writes.
    pub fn untrack_writes(&mut self) {
        self.written = None;
    }

    /// Whether writes are tracked.
    pub fn tracking_writes(&self) -> bool {
        self.written.is_some()
    }

    /// The chunks written since tracking started or the last call, in
    /// increasing order (none when not tracked); tracking goes on.
    pub fn take_written(&mut self) -> Vec<u64> {
        let Some(w) = self.written.as_mut() else { return Vec::new() };
        let bits = std::mem::take(w);
        bits.iter()
            .enumerate()
            .flat_map(|(i, &x)| (0..64u64).filter(move |b| x & (1 << b) != 0).map(move |b| i as u64 * 64 + b))
            .collect()
    }

    /// Notes that chunk `c` is written, while tracked.
    fn mark(&mut self, c: u64) {
        if let Some(w) = self.written.as_mut() {
            let i = (c / 64) as usize;
            if w.len() <= i {
                w.resize(i + 1, 0);
            }
            w[i] |= 1 << (c % 64);
        }
    }

    /// Chunk `c`, allocated (zeroed) on first use; every caller writes it.
    fn chunk_mut(&mut self, c: u64) -> &mut [u8] {
        self.mark(c);
        let i = c as usize;
        if self.chunks.len() <= i {
            self.chunks.resize_with(i + 1, || None);
        }
        let slot = &mut self.chunks[i];
        if slot.is_none() {
            self.resident += 1;
        }
        slot.get_or_insert_with(|| {
            let mut chunk = vec![0u8; HBM_CHUNK as usize].into_boxed_slice();
            populate(&mut chunk);
            Chunk::Heap(chunk)
        })
    }

    /// A segment of `size` bytes held in `file`, a sparse file: what the
    /// file holds if it is `size` bytes long already (a restarted daemon
    /// resumes it), zeros otherwise. A chunk's blocks are allocated on its
    /// first write (a full disk fails that write with
    /// [`MemoryError::Store`], never a fault).
    pub fn file_backed(size: u64, file: File) -> std::io::Result<Self> {
        if size == 0 {
            return Ok(Self::new(0));
        }
        let f = MappedFile::open(file, size)?;
        let reserved = f.allocated_chunks(size);
        Ok(Self { size, chunks: Vec::new(), resident: 0, file: Some((f, reserved)), written: None })
    }

    /// The chunks that may hold bytes other than zero (every chunk written
    /// so far, in host memory or in the file), in increasing order: what
    /// a copy of the segment must take.
    pub fn written_chunks(&self) -> Vec<u64> {
        let mut out: Vec<u64> =
            self.chunks.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| i as u64).collect();
        if let Some((_, reserved)) = &self.file {
            out.extend(reserved.iter().copied());
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// How many chunks are mappings of a file's pages ([`Memory::map_file`]).
    pub fn mapped_chunks(&self) -> usize {
        self.chunks.iter().filter(|c| matches!(c, Some(Chunk::Mapped(_)))).count()
    }

    /// Host bytes actually allocated for this segment (for a file-backed
    /// one: the chunks that have blocks in its file).
    pub fn resident_bytes(&self) -> u64 {
        let reserved = self.file.as_ref().map_or(0, |(_, r)| r.len());
        (self.resident + reserved) as u64 * HBM_CHUNK
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
        if let Some((f, _)) = &self.file {
            // Holes read as zeros.
            let a = addr as usize;
            buf.copy_from_slice(&f.map[a..a + buf.len()]);
            return Ok(());
        }
        for (chunk, off, at, n) in Self::pieces(addr, buf.len()) {
            let dst = &mut buf[at..at + n];
            match self.chunks.get(chunk as usize).and_then(Option::as_ref) {
                Some(c) => dst.copy_from_slice(&c[off..off + n]),
                None => dst.fill(0),
            }
        }
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        check("hbm", addr, data.len() as u64, self.size)?;
        if self.written.is_some() {
            for (chunk, _, _, _) in Self::pieces(addr, data.len()) {
                self.mark(chunk);
            }
        }
        if let Some((f, reserved)) = &mut self.file {
            for (chunk, _, _, _) in Self::pieces(addr, data.len()) {
                if reserved.contains(&chunk) {
                    continue;
                }
                let at = chunk * HBM_CHUNK;
                let n = HBM_CHUNK.min(self.size - at);
                f.reserve(at, n).map_err(|e| MemoryError::Store {
                    addr,
                    len: data.len() as u64,
                    reason: e.to_string(),
                })?;
                reserved.insert(chunk);
            }
            let a = addr as usize;
            f.map[a..a + data.len()].copy_from_slice(data);
            return Ok(());
        }
        for (chunk, off, at, n) in Self::pieces(addr, data.len()) {
            self.chunk_mut(chunk)[off..off + n].copy_from_slice(&data[at..at + n]);
        }
        Ok(())
    }
    fn copy_within(&mut self, src: u64, dst: u64, len: u64) -> Result<(), MemoryError> {
        check("hbm", src, len, self.size)?;
        check("hbm", dst, len, self.size)?;
        if self.file.is_some() || src.abs_diff(dst) < len {
            // Overlapping ranges (or file-backed chunks): all bytes read
            // before any is written.
            return copy_through_buffer(self, src, dst, len);
        }
        // Disjoint ranges: chunk piece by chunk piece, with no buffer.
        let mut done = 0u64;
        while done < len {
            let (s, d) = (src + done, dst + done);
            let (sc, so) = (s / HBM_CHUNK, (s % HBM_CHUNK) as usize);
            let (dc, doff) = (d / HBM_CHUNK, (d % HBM_CHUNK) as usize);
            let n = (HBM_CHUNK as usize - so).min(HBM_CHUNK as usize - doff).min((len - done) as usize);
            if sc == dc {
                self.chunk_mut(dc).copy_within(so..so + n, doff);
            } else {
                // The source chunk is lent out of its slot while the
                // destination's is borrowed, then put back.
                match self.chunks.get_mut(sc as usize).and_then(Option::take) {
                    Some(from) => {
                        self.chunk_mut(dc)[doff..doff + n].copy_from_slice(&from[so..so + n]);
                        self.chunks[sc as usize] = Some(from);
                    }
                    None => self.chunk_mut(dc)[doff..doff + n].fill(0),
                }
            }
            done += n as u64;
        }
        Ok(())
    }
    fn copy_rows_within(
        &mut self,
        at: (u64, u64),
        rows: u64,
        row: u64,
        strides: (u64, u64),
    ) -> Result<(), MemoryError> {
        let ((src, dst), (ss, ds)) = (at, strides);
        let span = |base: u64, stride: u64| {
            let end = rows.checked_sub(1)?.checked_mul(stride)?.checked_add(row)?.checked_add(base)?;
            (end <= self.size).then_some(base..end)
        };
        let disjoint = match (span(src, ss), span(dst, ds)) {
            (Some(s), Some(d)) => s.end <= d.start || d.end <= s.start,
            _ => false,
        };
        if self.file.is_some() || !disjoint || row == 0 {
            // Row by row as the default does (and its errors).
            return copy_rows_one_by_one(self, at, rows, row, strides);
        }
        // Both spans inside and disjoint: every row address below is
        // inside them, so nothing overflows. The rows that stay in one
        // source chunk and one destination chunk are copied together,
        // between the two chunks' slices (one lookup of each, not one a
        // row); a row across a chunk's border goes through copy_within.
        let n = row as usize;
        let mut r = 0u64;
        while r < rows {
            let (s, d) = (src + r * ss, dst + r * ds);
            let k = rows_in_chunk(s, row, ss).min(rows_in_chunk(d, row, ds)).min(rows - r);
            if k == 0 {
                self.copy_within(s, d, row)?;
                r += 1;
                continue;
            }
            let (sc, so) = (s / HBM_CHUNK, (s % HBM_CHUNK) as usize);
            let (dc, doff) = (d / HBM_CHUNK, (d % HBM_CHUNK) as usize);
            let (ssu, dsu) = (ss as usize, ds as usize);
            if sc == dc {
                let c = self.chunk_mut(dc);
                for i in 0..k as usize {
                    let from = so + i * ssu;
                    c.copy_within(from..from + n, doff + i * dsu);
                }
            } else {
                // The source chunk is lent out of its slot while the
                // destination's is borrowed, then put back.
                let from = self.chunks.get_mut(sc as usize).and_then(Option::take);
                let to = self.chunk_mut(dc);
                for i in 0..k as usize {
                    let at = doff + i * dsu;
                    match &from {
                        Some(f) => to[at..at + n].copy_from_slice(&f[so + i * ssu..][..n]),
                        None => to[at..at + n].fill(0),
                    }
                }
                if let Some(f) = from {
                    self.chunks[sc as usize] = Some(f);
                }
            }
            r += k;
        }
        Ok(())
    }
    fn write_rows(
        &mut self,
        addr: u64,
        (rows, row, stride): (u64, u64, u64),
        data: &[u8],
        data_stride: usize,
    ) -> Result<(), MemoryError> {
        let n = rows_in(rows, row, data_stride, data.len())?;
        let inside = rows_span_end(addr, rows, row, stride).is_some_and(|end| end <= self.size);
        if self.file.is_some() || !inside || row == 0 {
            // Row by row as the default does (and its errors).
            return write_rows_one_by_one(self, addr, (rows, row, stride), data, data_stride);
        }
        // Every row lies inside and `data` holds every row: the rows in
        // one chunk are written with one lookup of it; a row across a
        // chunk's border as `write`.
        for (r, k, d) in chunk_runs(addr, rows, row, stride) {
            if k == 0 {
                self.write(d, &data[r as usize * data_stride..][..n])?;
                continue;
            }
            let (dc, off) = (d / HBM_CHUNK, (d % HBM_CHUNK) as usize);
            let to = self.chunk_mut(dc);
            for i in 0..k as usize {
                let (at, from) = (off + i * stride as usize, (r as usize + i) * data_stride);
                to[at..at + n].copy_from_slice(&data[from..from + n]);
            }
        }
        Ok(())
    }
    fn read_rows(
        &self,
        addr: u64,
        (rows, row, stride): (u64, u64, u64),
        out: &mut [u8],
        out_stride: usize,
    ) -> Result<(), MemoryError> {
        let n = rows_in(rows, row, out_stride, out.len())?;
        let inside = rows_span_end(addr, rows, row, stride).is_some_and(|end| end <= self.size);
        if self.file.is_some() || !inside || row == 0 {
            return read_rows_one_by_one(self, addr, (rows, row, stride), out, out_stride);
        }
        // As `write_rows`: one lookup per chunk; a chunk never written
        // reads as zeros.
        for (r, k, s) in chunk_runs(addr, rows, row, stride) {
            if k == 0 {
                self.read(s, &mut out[r as usize * out_stride..][..n])?;
                continue;
            }
            let (sc, off) = (s / HBM_CHUNK, (s % HBM_CHUNK) as usize);
            let from = self.chunks.get(sc as usize).and_then(Option::as_ref);
            for i in 0..k as usize {
                let to = &mut out[(r as usize + i) * out_stride..][..n];
                match from {
                    Some(c) => to.copy_from_slice(&c[off + i * stride as usize..][..n]),
                    None => to.fill(0),
                }
            }
        }
        Ok(())
    }
    fn map_granule(&self) -> u64 {
        if self.file.is_some() {
            0
        } else {
            HBM_CHUNK
        }
    }
    fn map_file(&mut self, addr: u64, len: u64, file: &File, offset: u64) -> bool {
        let (c, at) = (addr / HBM_CHUNK, addr % HBM_CHUNK);
        let i = c as usize;
        let Some(end) = at.checked_add(len) else { return false };
        if self.file.is_some()
            || len == 0
            || end > HBM_CHUNK
            || offset % PAGE != at % PAGE
            || check("hbm", c * HBM_CHUNK, HBM_CHUNK, self.size).is_err()
        {
            return false;
        }
        // The piece must lie inside the file, and so must every page of
        // the file a mapping of it covers: a page wholly past the end
        // would fault on access instead of reading zeros.
        let Some(file_len) = file.metadata().ok().map(|m| m.len()) else { return false };
        let inside =
            |from: u64, n: u64| from.checked_add(n).is_some_and(|e| e <= file_len.next_multiple_of(PAGE));
        if offset.checked_add(len).is_none_or(|e| e > file_len) {
            return false;
        }
        let fresh = !matches!(self.chunks.get(i), Some(Some(_)));
        let (map, pages) = if fresh {
            // A chunk never written: fresh anonymous memory with the
            // file's pages under the piece mapped over it. The rest reads
            // zero; only the two pages at the piece's ends are copied,
            // for their bytes outside it.
            let (lo, hi) = (at - at % PAGE, end.next_multiple_of(PAGE));
            let from = offset - at % PAGE;
            if !inside(from, hi - lo) {
                return false;
            }
            let Ok(mut map) = memmap2::MmapOptions::new().len(HBM_CHUNK as usize).map_anon() else {
                return false;
            };
            #[cfg(target_os = "linux")]
            {
                let Ok(from) = libc::off_t::try_from(from) else { return false };
                // SAFETY: `[lo, hi)` lies inside `map` (`hi <= HBM_CHUNK`,
                // both page multiples), a mapping this function owns and
                // nothing else references: MAP_FIXED replaces those pages
                // of it with a private, copy-on-write mapping of the file's
                // `hi - lo` bytes from `from`, all inside the file's pages
                // (checked above). On failure the range may be unmapped:
                // `map` is then dropped (unmapping all of it) unused.
                let got = unsafe {
                    libc::mmap(
                        map.as_mut_ptr().add(lo as usize).cast(),
                        (hi - lo) as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_FIXED,
                        file.as_raw_fd(),
                        from,
                    )
                };
                if got == libc::MAP_FAILED {
                    return false;
                }
            }
            #[cfg(not(target_os = "linux"))]
            return false;
            map[lo as usize..at as usize].fill(0);
            map[end as usize..hi as usize].fill(0);
            // The rest faulted in now, as a fresh chunk's whole is: what
            // shares a chunk with a tensor's end is usually written soon
            // (measured: left to fault page by page, ViT-B/16's first
            // run lost what the load saved).
            populate(&mut map[..lo as usize]);
            populate(&mut map[hi as usize..]);
            (map, (lo as usize, (hi - lo) as usize))
        } else {
            // A chunk that holds bytes already: worth mapping the file's
            // window around the piece when at least half the chunk comes
            // from the file (what it held elsewhere is then written over
            // the mapping, a copy of each page that touches).
            let Some(start) = offset.checked_sub(at) else { return false };
            if len < HBM_CHUNK / 2 || !inside(start, HBM_CHUNK) {
                return false;
            }
            // SAFETY: a private, copy-on-write mapping of `HBM_CHUNK`
            // bytes that lie inside the file's pages (checked just
            // above): writes to it stay in this process, and the pages
            // read the file's bytes. The file is a model file that must
            // not be truncated or rewritten while a run uses it
            // (docs/cli.md), as for guest RAM mapped from it.
            let map =
                unsafe { memmap2::MmapOptions::new().offset(start).len(HBM_CHUNK as usize).map_copy(file) };
            let Ok(mut map) = map else { return false };
            // The rest of the chunk keeps what it held.
            let (lo, hi) = (at as usize, end as usize);
            if let Some(Some(old)) = self.chunks.get(i) {
                map[..lo].copy_from_slice(&old[..lo]);
                map[hi..].copy_from_slice(&old[hi..]);
            }
            (map, (0, HBM_CHUNK as usize))
        };
        populate_read(map[pages.0..].as_ptr(), pages.1);
        if self.chunks.len() <= i {
            self.chunks.resize_with(i + 1, || None);
        }
        if self.chunks[i].replace(Chunk::Mapped(map)).is_none() {
            self.resident += 1;
        }
        self.mark(c);
        true
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
    fn slice(&self, addr: u64, len: u64) -> Option<&[u8]> {
        let r = self.range(addr, usize::try_from(len).ok()?).ok()?;
        self.bytes.get(r)
    }
    fn copy_within(&mut self, src: u64, dst: u64, len: u64) -> Result<(), MemoryError> {
        let n = usize::try_from(len).unwrap_or(usize::MAX);
        let (s, d) = (self.range(src, n)?, self.range(dst, n)?);
        self.bytes.copy_within(s, d.start);
        Ok(())
    }
}

/// `len` bytes of a file from `offset` on as a memory based at address 0:
/// a private (copy-on-write) mapping, so that writes stay in it, and a
/// DMA of its unchanged pages into HBM maps them instead of copying
/// ([`Memory::file_pages`]). The in-process runner's weight image.
#[derive(Debug)]
pub struct FileMemory {
    file: File,
    map: memmap2::MmapMut,
    /// Offset of `offset`'s byte in `map` (the mapping starts at a page).
    skip: usize,
    offset: u64,
    len: usize,
}

impl FileMemory {
    /// Maps `[offset, offset + len)` of `file`, which must lie inside it
    /// (and must not be truncated or rewritten while this lives).
    pub fn map(file: File, offset: u64, len: usize) -> std::io::Result<Self> {
        let bad = || std::io::Error::from(std::io::ErrorKind::InvalidInput);
        let end = offset.checked_add(len as u64).ok_or_else(bad)?;
        if end > file.metadata()?.len() {
            return Err(bad());
        }
        let start = offset - offset % PAGE;
        let skip = (offset - start) as usize;
        let n = skip.checked_add(len).ok_or_else(bad)?;
        // SAFETY: a private mapping of bytes inside the file (checked
        // above); the caller keeps the file from being truncated while it
        // lives, so no page past its end is ever touched.
        let map = unsafe { memmap2::MmapOptions::new().offset(start).len(n.max(1)).map_copy(&file)? };
        Ok(Self { file, map, skip, offset, len })
    }

    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, MemoryError> {
        check("file", addr, len as u64, self.len as u64)?;
        let at = self.skip + addr as usize;
        Ok(at..at + len)
    }
}

impl Memory for FileMemory {
    fn size(&self) -> u64 {
        self.len as u64
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.map[r]);
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        let r = self.range(addr, data.len())?;
        self.map[r].copy_from_slice(data);
        Ok(())
    }
    fn slice_mut(&mut self, addr: u64, len: u64) -> Option<&mut [u8]> {
        let r = self.range(addr, usize::try_from(len).ok()?).ok()?;
        self.map.get_mut(r)
    }
    fn slice(&self, addr: u64, len: u64) -> Option<&[u8]> {
        let r = self.range(addr, usize::try_from(len).ok()?).ok()?;
        self.map.get(r)
    }
    fn file_pages(&self, addr: u64, len: u64) -> Option<(&File, u64)> {
        let r = self.range(addr, usize::try_from(len).ok()?).ok()?;
        let bytes = self.map.get(r)?;
        file_pages_unchanged(bytes.as_ptr(), bytes.len()).then_some((&self.file, self.offset + addr))
    }
}

/// Fails when `[addr, addr + len)` cannot lie inside `m` (checked before
/// buffers for it are allocated).
pub fn check_span(m: &dyn Memory, addr: u64, len: u64) -> Result<(), MemoryError> {
    check("memory", addr, len, m.size())
}

/// Reads `n` little-endian f32 values (none: nothing is touched, at any
/// address, as the ISA says of zero-sized operands). On a little-endian
/// host the bytes land in the values' own storage: no second buffer and
/// no conversion pass (the bit patterns are the same either way).
pub fn read_f32s(m: &dyn Memory, addr: u64, n: usize) -> Result<Vec<f32>, MemoryError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    check_span(m, addr, (n as u64).saturating_mul(4))?;
    let mut v = vec![0f32; n];
    m.read(addr, bytemuck::cast_slice_mut(&mut v))?;
    if cfg!(target_endian = "big") {
        for x in &mut v {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
    }
    Ok(v)
}

/// Writes f32 values little-endian (none: nothing is touched); on a
/// little-endian host straight from the values' storage.
pub fn write_f32s(m: &mut dyn Memory, addr: u64, v: &[f32]) -> Result<(), MemoryError> {
    if v.is_empty() {
        return Ok(());
    }
    if cfg!(target_endian = "little") {
        return m.write(addr, bytemuck::cast_slice(v));
    }
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    m.write(addr, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Lazy HBM's in-place copy gives what a flat buffer's copy gives
        /// (a read of every byte, then a write), across chunk borders,
        /// from chunks never written, overlapping or not.
        #[test]
        fn lazy_hbm_copy_within_matches_a_flat_copy(
            src in 0u64..(3 * HBM_CHUNK), dst in 0u64..(3 * HBM_CHUNK), len in 0u64..(HBM_CHUNK + 5000),
            written in prop::array::uniform4(any::<bool>()),
        ) {
            let size = 4 * HBM_CHUNK;
            let (len, src, dst) = (len.min(size - src.max(dst)), src, dst);
            let mut hbm = LazyHbm::new(size);
            let mut flat = VecGuestMemory::new(0, size as usize);
            for (c, _) in written.iter().enumerate().filter(|(_, w)| **w) {
                let data: Vec<u8> = (0..HBM_CHUNK).map(|i| (i as usize * 7 + c) as u8 | 1).collect();
                hbm.write(c as u64 * HBM_CHUNK, &data).unwrap();
                flat.write(c as u64 * HBM_CHUNK, &data).unwrap();
            }
            hbm.copy_within(src, dst, len).unwrap();
            flat.copy_within(src, dst, len).unwrap();
            let mut got = vec![0u8; size as usize];
            hbm.read(0, &mut got).unwrap();
            prop_assert!(got == flat.bytes, "src {} dst {} len {}", src, dst, len);
        }
    }

    proptest! {
        /// Lazy HBM's rows copied chunk pair by chunk pair give what a
        /// flat buffer's row-by-row copy gives: rows across chunk
        /// borders, from chunks never written, strides of 0 and under a
        /// row, spans that overlap (row by row there) or run outside (the
        /// same rows copied before the same error).
        #[test]
        fn lazy_hbm_rows_match_a_flat_copy_row_by_row(
            src in 0u64..(3 * HBM_CHUNK), dst in 0u64..(3 * HBM_CHUNK),
            near in prop::array::uniform2(0u64..3000), border in any::<bool>(),
            rows in 0u64..300, row in 1u64..3000, ss in 0u64..9000, ds in 0u64..9000,
            written in prop::array::uniform4(any::<bool>()),
        ) {
            let size = 4 * HBM_CHUNK;
            // Half the cases start just before a chunk border.
            let (src, dst) = if border {
                ((src / HBM_CHUNK + 1) * HBM_CHUNK - near[0] - 1, (dst / HBM_CHUNK + 1) * HBM_CHUNK - near[1] - 1)
            } else {
                (src, dst)
            };
            let mut hbm = LazyHbm::new(size);
            let mut flat = VecGuestMemory::new(0, size as usize);
            for (c, _) in written.iter().enumerate().filter(|(_, w)| **w) {
                let data: Vec<u8> = (0..HBM_CHUNK).map(|i| (i as usize * 7 + c) as u8 | 1).collect();
                hbm.write(c as u64 * HBM_CHUNK, &data).unwrap();
                flat.write(c as u64 * HBM_CHUNK, &data).unwrap();
            }
            let a = hbm.copy_rows_within((src, dst), rows, row, (ss, ds)).is_ok();
            let b = flat.copy_rows_within((src, dst), rows, row, (ss, ds)).is_ok();
            prop_assert_eq!(a, b);
            let mut got = vec![0u8; size as usize];
            hbm.read(0, &mut got).unwrap();
            prop_assert!(got == flat.bytes, "src {} dst {} rows {} row {} strides {} {}", src, dst, rows, row, ss, ds);
        }

        /// LazyHbm's strided rows to and from a host buffer hold and give
        /// what a flat buffer's row-by-row writes and reads do: rows
        /// across chunk borders, chunks never written (zeros), strides of
        /// 0 and under a row, rows running outside (the same error), a
        /// host buffer too short (refused).
        #[test]
        fn lazy_hbm_strided_rows_match_row_by_row(
            at in 0u64..(3 * HBM_CHUNK), near in 0u64..3000, border in any::<bool>(),
            rows in 0u64..300, row in 1u64..3000, stride in 0u64..9000, host_stride in 0usize..4000,
            short in any::<bool>(), written in prop::array::uniform4(any::<bool>()),
        ) {
            let size = 4 * HBM_CHUNK;
            let at = if border { (at / HBM_CHUNK + 1) * HBM_CHUNK - near - 1 } else { at };
            let mut hbm = LazyHbm::new(size);
            let mut flat = VecGuestMemory::new(0, size as usize);
            for (c, _) in written.iter().enumerate().filter(|(_, w)| **w) {
                let data: Vec<u8> = (0..HBM_CHUNK).map(|i| (i as usize * 7 + c) as u8 | 1).collect();
                hbm.write(c as u64 * HBM_CHUNK, &data).unwrap();
                flat.write(c as u64 * HBM_CHUNK, &data).unwrap();
            }
            let need = (rows.max(1) as usize - 1) * host_stride + row as usize;
            let len = if short { need - 1 } else { need };
            let data: Vec<u8> = (0..len).map(|i| (i * 31 + 5) as u8).collect();
            let a = hbm.write_rows(at, (rows, row, stride), &data, host_stride).is_ok();
            let b = flat.write_rows(at, (rows, row, stride), &data, host_stride).is_ok();
            prop_assert_eq!(a, b);
            prop_assert!(!short || rows == 0 || !a, "a short buffer is refused");
            let mut got = vec![0u8; size as usize];
            hbm.read(0, &mut got).unwrap();
            prop_assert!(got == flat.bytes, "write: at {} rows {} row {} stride {} {}", at, rows, row, stride, host_stride);
            let (mut x, mut y) = (vec![9u8; len], vec![9u8; len]);
            let a = hbm.read_rows(at, (rows, row, stride), &mut x, host_stride).is_ok();
            let b = flat.read_rows(at, (rows, row, stride), &mut y, host_stride).is_ok();
            prop_assert_eq!(a, b);
            prop_assert!(x == y, "read: at {} rows {} row {} stride {} {}", at, rows, row, stride, host_stride);
        }
    }

    proptest! {
        /// While tracked, exactly the chunks a write, a copy or a strided
        /// write touched are listed, once, and reads list nothing: checked
        /// against the chunks each operation's byte ranges cover.
        #[test]
        fn tracked_writes_list_the_chunks_they_touch(
            ops in proptest::collection::vec((0u8..3, 0u64..(6 * HBM_CHUNK), 1u64..(2 * HBM_CHUNK)), 1..6),
        ) {
            let size = 8 * HBM_CHUNK;
            let mut hbm = LazyHbm::new(size);
            hbm.write(3 * HBM_CHUNK, &[1]).unwrap();
            hbm.track_writes();
            let mut want = std::collections::BTreeSet::new();
            let chunks = |at: u64, n: u64| (at / HBM_CHUNK)..=((at + n - 1) / HBM_CHUNK);
            for (kind, at, n) in ops {
                let n = n.min(size - at);
                match kind {
                    0 => { hbm.write(at, &vec![7u8; n as usize]).unwrap(); want.extend(chunks(at, n)); }
                    1 => {
                        let dst = (at + HBM_CHUNK / 3) % (size - n);
                        hbm.copy_within(at, dst, n).unwrap();
                        want.extend(chunks(dst, n));
                    }
                    _ => { let mut b = vec![0u8; n as usize]; hbm.read(at, &mut b).unwrap(); }
                }
            }
            let got: std::collections::BTreeSet<u64> = hbm.take_written().into_iter().collect();
            prop_assert_eq!(got, want);
            prop_assert!(hbm.take_written().is_empty(), "taken once");
            hbm.untrack_writes();
            hbm.write(0, &[1]).unwrap();
            prop_assert!(!hbm.tracking_writes() && hbm.take_written().is_empty());
        }
    }

    /// Whether every page of `bytes` is mapped in this process's page
    /// tables (`/proc/self/pagemap`'s present bit).
    fn pages_present(bytes: &[u8]) -> bool {
        use std::os::unix::fs::FileExt;
        let first = bytes.as_ptr() as u64 / PAGE;
        let n = bytes.len() / PAGE as usize;
        let mut entries = vec![0u8; n * 8];
        File::open("/proc/self/pagemap").unwrap().read_exact_at(&mut entries, first * 8).unwrap();
        entries.chunks_exact(8).all(|e| u64::from_le_bytes(e.try_into().unwrap()) & (1 << 63) != 0)
    }

    /// A mapped chunk's pages are mapped at once, without anything
    /// reading them; a chunk mapped again over a mapped one and a short
    /// piece mapped into a chunk never written read what they should.
    #[test]
    fn mapped_chunks_are_prefaulted_and_read_the_file() {
        let mib = HBM_CHUNK as usize;
        let bytes: Vec<u8> = (0..4 * mib).map(|i| (i * 13 + i / 4096) as u8).collect();
        let path = std::env::temp_dir().join(format!("npu-model-prefault-{}", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let file = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let mut hbm = LazyHbm::new(4 * HBM_CHUNK);
        for c in 0..3u64 {
            assert!(hbm.map_file(c * HBM_CHUNK, HBM_CHUNK, &file, c * HBM_CHUNK));
        }
        for c in 0..3 {
            let chunk = hbm.chunks[c].as_deref().unwrap();
            assert!(pages_present(chunk), "chunk {c}'s pages are mapped");
        }
        for round in 0..20u64 {
            // Chunk 0 mapped again, from the file's MiB `round % 4`.
            let from = round % 4;
            assert!(hbm.map_file(0, HBM_CHUNK, &file, from * HBM_CHUNK));
            let mut got = vec![0u8; mib];
            hbm.read(0, &mut got).unwrap();
            assert!(got[..] == bytes[from as usize * mib..][..mib], "round {round}");
        }
        // A short piece into a chunk never written, mid-page at both
        // ends: the chunk reads zero around it, and its writes stay here.
        let (at, off, n) = (3 * HBM_CHUNK + 5000, 2 * HBM_CHUNK + 904, 3000u64);
        assert!(hbm.map_file(at, n, &file, off));
        let mut got = vec![1u8; mib];
        hbm.read(3 * HBM_CHUNK, &mut got).unwrap();
        let mut want = vec![0u8; mib];
        want[5000..8000].copy_from_slice(&bytes[off as usize..][..n as usize]);
        assert!(got == want, "the piece, zeros around it");
        hbm.write(at, &[!bytes[off as usize]]).unwrap();
        let mut f = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut f, off).unwrap();
        assert_eq!(f[0], bytes[off as usize], "an HBM write stays out of the file");
    }

    #[test]
    fn copy_within_refuses_ranges_outside() {
        let mut hbm = LazyHbm::new(2 * HBM_CHUNK);
        assert!(hbm.copy_within(0, 2 * HBM_CHUNK - 4, 8).is_err());
        assert!(hbm.copy_within(u64::MAX - 2, 0, 8).is_err());
        let mut sram = Sram::new(64);
        assert!(sram.copy_within(60, 0, 8).is_err());
        assert!(sram.copy_within(0, 60, 8).is_err());
        assert_eq!(hbm.resident_bytes(), 0, "a refused copy allocates nothing");
    }

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

    /// f32 values go to memory as little-endian bytes and come back with
    /// every bit (NaN payloads, signed zeros, subnormals), at any
    /// alignment.
    #[test]
    fn f32s_are_little_endian_bit_for_bit_at_any_address() {
        let v = [1.5f32, -0.0, f32::from_bits(0x7fa0_0001), f32::from_bits(1), f32::NEG_INFINITY];
        let mut s = Sram::new(64);
        for addr in [0u64, 1, 3, 40] {
            write_f32s(&mut s, addr, &v).unwrap();
            let mut b = [0u8; 20];
            s.read(addr, &mut b).unwrap();
            let want: Vec<u8> = v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
            assert_eq!(b.as_slice(), want.as_slice(), "at {addr}");
            let back = read_f32s(&s, addr, v.len()).unwrap();
            assert!(back.iter().zip(&v).all(|(a, b)| a.to_bits() == b.to_bits()), "at {addr}");
        }
        assert!(read_f32s(&s, 48, 5).is_err() && write_f32s(&mut s, 48, &v).is_err());
        assert!(read_f32s(&s, u64::MAX, 0).unwrap().is_empty());
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

#[cfg(test)]
mod file_backed_tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("npu-model-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    fn open(p: &std::path::Path) -> File {
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p).unwrap()
    }

    /// What a file-backed SRAM or HBM holds is in its file: reopened (a
    /// restarted daemon), it reads back the same bytes; untouched HBM
    /// reads zeros and takes no blocks; a file of another size starts
    /// from zeros.
    #[test]
    fn file_backed_memories_keep_their_bytes_across_reopening() {
        let (sp, hp) = (scratch("sram"), scratch("hbm"));
        {
            let mut s = Sram::file_backed(1 << 16, open(&sp)).unwrap();
            s.write(100, &[1, 2, 3]).unwrap();
            let mut h = LazyHbm::file_backed(1 << 30, open(&hp)).unwrap();
            h.write((5 << 20) - 2, &[7, 8, 9, 10]).unwrap();
            assert_eq!(h.resident_bytes(), 2 * HBM_CHUNK, "the write spans two chunks");
            assert!(h.write((1 << 30) - 1, &[0, 0]).is_err(), "past the end");
        }
        let s = Sram::file_backed(1 << 16, open(&sp)).unwrap();
        let mut b = [0u8; 3];
        s.read(100, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3]);
        let h = LazyHbm::file_backed(1 << 30, open(&hp)).unwrap();
        let mut b = [0u8; 6];
        h.read((5 << 20) - 3, &mut b).unwrap();
        assert_eq!(b, [0, 7, 8, 9, 10, 0]);
        assert_eq!(h.written_chunks(), vec![4, 5], "the chunks the write reserved");
        let mut m = LazyHbm::new(1 << 30);
        m.write(9 << 20, &[1]).unwrap();
        m.write(HBM_CHUNK - 1, &[1, 1]).unwrap();
        assert_eq!(m.written_chunks(), vec![0, 1, 9]);
        // Sparse: about two chunks of blocks, not a GiB.
        let blocks = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&hp).unwrap());
        assert!(blocks * 512 <= 4 * HBM_CHUNK, "{blocks} blocks");
        // A copy lives in host memory and holds the same bytes.
        let c = h.clone();
        c.read((5 << 20) - 3, &mut b).unwrap();
        assert_eq!(b, [0, 7, 8, 9, 10, 0]);
        // Another size: a fresh, zeroed segment.
        let s = Sram::file_backed(1 << 12, open(&sp)).unwrap();
        assert!(s.bytes().iter().all(|&x| x == 0));
        let _ = (std::fs::remove_file(&sp), std::fs::remove_file(&hp));
    }
}
