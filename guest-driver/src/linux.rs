//! The driver in Linux user space (feature `std`; `docs/linux-guests.md`).
//!
//! - **Finding the device**: every function under `/sys/bus/pci/devices`
//!   whose `vendor`, `device` and `class` are the vNPU's.
//! - **Registers**: BAR 0 mapped from the function's `resource0` file
//!   (uncached, shared); [`LinuxVnpu::open`] first enables the function
//!   through its `enable` file and turns bus mastering on in its
//!   configuration space (the `config` file), as a kernel driver's
//!   `pci_enable_device` + `pci_set_master` would.
//! - **DMA memory** ([`DmaMemory`]): 2 MiB huge pages: each is physically
//!   contiguous, and hugetlb pages are never swapped, migrated or
//!   compacted, so the physical address read once from
//!   `/proc/self/pagemap` stays valid while the mapping lives. Needs root
//!   (pagemap hides frame numbers otherwise) and free huge pages (taken
//!   from `/proc/sys/vm/nr_hugepages`, raised here if too few are free).
//!   Several pages are used only when they happen to be contiguous. With
//!   the `vnpu` kernel module loaded, any size: the module allocates a
//!   coherent DMA buffer and maps it through its device file.
//! - **Completions**: with the `vnpu` kernel module loaded
//!   (`guest-images/linux/kmod`), which enables MSI-X and counts vector 0,
//!   by interrupt: [`LinuxVnpu::completions`] is the file to sleep on.
//!   Without it, polled ([`crate::Wait::Poll`]).
//!
//! Everything read from sysfs and procfs is checked; failures are
//! [`LinuxError`]s that name the file.

extern crate std;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::string::{String, ToString};
use std::vec::Vec;

use vnpu_abi::device as abi;

use crate::{DmaBuf, DmaRegion, MmioBar};

/// Where PCI functions appear.
pub const SYSFS_PCI: &str = "/sys/bus/pci/devices";
/// Size of one huge page.
pub const HUGE_PAGE: usize = 2 << 20;

/// What went wrong in Linux user space.
#[derive(Debug, thiserror::Error)]
pub enum LinuxError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: unexpected contents {text:?}")]
    Parse { path: String, text: String },
    #[error(
        "no vNPU under {SYSFS_PCI} (vendor {:#06x}, device {:#06x}, class {:#08x})",
        abi::VENDOR_ID,
        abi::DEVICE_ID,
        abi::CLASS
    )]
    NoDevice,
    #[error("BAR 0 of {0} is {1} bytes; the vNPU's is {size}", size = abi::BAR0_SIZE)]
    BarSize(String, u64),
    #[error("cannot map {what}: {source}")]
    Map { what: String, source: std::io::Error },
    #[error("page at {virt:#x} has no physical frame in /proc/self/pagemap (not root?)")]
    NoFrame { virt: usize },
    #[error(
        "the {pages} huge pages are not physically contiguous (page {page} is at {got:#x}, not {want:#x}); load the vnpu kernel module for larger DMA buffers"
    )]
    NotContiguous { pages: usize, page: usize, got: u64, want: u64 },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LinuxError + '_ {
    move |source| LinuxError::Io { path: path.display().to_string(), source }
}

fn read_hex(path: &Path) -> Result<u64, LinuxError> {
    let text = fs::read_to_string(path).map_err(io(path))?;
    let t = text.trim();
    u64::from_str_radix(t.trim_start_matches("0x"), 16)
        .map_err(|_| LinuxError::Parse { path: path.display().to_string(), text: t.to_string() })
}

/// The sysfs directories of the vNPU functions, in bus order.
pub fn find_vnpus() -> Result<Vec<PathBuf>, LinuxError> {
    let dir = Path::new(SYSFS_PCI);
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let is_vnpu = read_hex(&path.join("vendor"))? == u64::from(abi::VENDOR_ID)
            && read_hex(&path.join("device"))? == u64::from(abi::DEVICE_ID)
            && read_hex(&path.join("class"))? >> 16 == u64::from(abi::CLASS >> 16);
        if is_vnpu {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// A shared mapping, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    /// A fresh shared read-write mapping of `len` bytes of `file` from
    /// offset 0; `what` names it in the error.
    fn shared(file: &File, len: usize, what: impl FnOnce() -> String) -> Result<Self, LinuxError> {
        // SAFETY: a fresh shared mapping of the file at an address the
        // kernel picks; nothing else aliases it. The result is checked.
        let ptr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(LinuxError::Map { what: what(), source: std::io::Error::last_os_error() });
        }
        Ok(Self { ptr: ptr.cast(), len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is a mapping this value made and owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A vNPU function opened from user space: its BAR 0 mapped.
#[derive(Debug)]
pub struct LinuxVnpu {
    /// Its sysfs directory.
    pub path: PathBuf,
    bar0: Mapping,
}

impl LinuxVnpu {
    /// Enables the function at `path` (a directory from [`find_vnpus`]),
    /// turns on memory decoding and bus mastering, and maps BAR 0.
    pub fn open(path: &Path) -> Result<Self, LinuxError> {
        let enable = path.join("enable");
        // Already enabled is fine: the file then reads 1.
        let enabled = fs::read_to_string(&enable).map(|t| t.trim() != "0").unwrap_or(false);
        if !enabled {
            fs::write(&enable, "1").map_err(io(&enable))?;
        }
        let config = path.join("config");
        let cfg = OpenOptions::new().read(true).write(true).open(&config).map_err(io(&config))?;
        let mut cmd = [0u8; 2];
        cfg.read_exact_at(&mut cmd, 4).map_err(io(&config))?;
        // Memory space (bit 1) and bus master (bit 2).
        let cmd = u16::from_le_bytes(cmd) | 0x6;
        cfg.write_all_at(&cmd.to_le_bytes(), 4).map_err(io(&config))?;

        let res = path.join("resource0");
        let file = OpenOptions::new().read(true).write(true).open(&res).map_err(io(&res))?;
        let len = file.metadata().map_err(io(&res))?.len();
        if len < abi::BAR0_SIZE {
            return Err(LinuxError::BarSize(path.display().to_string(), len));
        }
        // The kernel maps the BAR's resource file uncached.
        let bar0 = Mapping::shared(&file, abi::BAR0_SIZE as usize, || res.display().to_string())?;
        Ok(Self { path: path.to_path_buf(), bar0 })
    }

    /// The function's address (`0000:00:01.0`).
    pub fn address(&self) -> String {
        self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// The MSI-X capability as the configuration space shows it: (vectors,
    /// enabled), or `None` without one.
    pub fn msix(&self) -> Result<Option<(u16, bool)>, LinuxError> {
        let config = self.path.join("config");
        let cfg = fs::read(&config).map_err(io(&config))?;
        let byte = |o: usize| cfg.get(o).copied().unwrap_or(0);
        let mut at = usize::from(byte(0x34) & 0xfc);
        // At most 48 capabilities fit in 256 bytes: a loop is cut there.
        for _ in 0..48 {
            if at == 0 {
                break;
            }
            if byte(at) == 0x11 {
                let ctl = u16::from_le_bytes([byte(at + 2), byte(at + 3)]);
                return Ok(Some(((ctl & 0x7ff) + 1, ctl & 0x8000 != 0)));
            }
            at = usize::from(byte(at + 1) & 0xfc);
        }
        Ok(None)
    }

    /// The completion counter of the `vnpu` kernel module for this
    /// function (`/dev/vnpu-ADDRESS`), when the module drives its MSI-X
    /// vector 0: each 4-byte read blocks until the count of completion
    /// interrupts differs from what this file last returned, and returns it.
    pub fn completions(&self) -> Option<File> {
        File::open(self.module_file()).ok()
    }

    /// The `vnpu` kernel module's device file for this function.
    fn module_file(&self) -> PathBuf {
        Path::new("/dev").join(std::format!("vnpu-{}", self.address()))
    }

    /// The `vnpu` kernel module's device file for this function, opened
    /// read-write (for [`DmaMemory::from_module`]), when the module is
    /// loaded.
    pub fn dma_file(&self) -> Option<File> {
        OpenOptions::new().read(true).write(true).open(self.module_file()).ok()
    }

    /// BAR 0's registers, for [`crate::Vnpu::new`]. Valid while `self` lives.
    pub fn bar(&self) -> MmioBar {
        // SAFETY: the mapping covers BAR 0 and lives as long as `self`.
        unsafe { MmioBar::new(self.bar0.ptr, self.bar0.len as u64) }
    }
}

/// Physically contiguous, pinned DMA memory: huge pages
/// ([`DmaMemory::huge_pages`]) or a buffer of the `vnpu` kernel module
/// ([`DmaMemory::from_module`]).
#[derive(Debug)]
pub struct DmaMemory {
    map: Mapping,
    phys: u64,
}

fn free_huge_pages() -> u64 {
    let p = Path::new("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages");
    fs::read_to_string(p).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0)
}

fn reserve_huge_pages(more: u64) -> Result<(), LinuxError> {
    let p = Path::new("/proc/sys/vm/nr_hugepages");
    let now: u64 = fs::read_to_string(p).map_err(io(p))?.trim().parse().unwrap_or(0);
    fs::write(p, now.saturating_add(more).to_string()).map_err(io(p))
}

/// The physical address of the page mapped at `virt`, from pagemap.
fn physical(virt: usize) -> Result<u64, LinuxError> {
    let p = Path::new("/proc/self/pagemap");
    let mut f = File::open(p).map_err(io(p))?;
    f.seek(SeekFrom::Start((virt / 4096 * 8) as u64)).map_err(io(p))?;
    let mut e = [0u8; 8];
    f.read_exact(&mut e).map_err(io(p))?;
    let e = u64::from_le_bytes(e);
    let pfn = e & ((1 << 55) - 1);
    if e & (1 << 63) == 0 || pfn == 0 {
        return Err(LinuxError::NoFrame { virt });
    }
    Ok(pfn * 4096 + (virt % 4096) as u64)
}

/// `_IOR('v', 1, u64)`: the bus address of the file's DMA buffer.
const VNPU_IOC_DMA_ADDR: libc::c_ulong = (2 << 30) | (8 << 16) | ((b'v' as libc::c_ulong) << 8) | 1;

impl DmaMemory {
    /// Maps `len` bytes (rounded up to whole 2 MiB huge pages), faults
    /// them in, locks them and looks up where they are. More than one page
    /// is refused unless the kernel happened to give physically contiguous
    /// pages in order ([`LinuxError::NotContiguous`]); the kernel module's
    /// buffers ([`DmaMemory::from_module`]) have no such limit.
    pub fn huge_pages(len: usize) -> Result<Self, LinuxError> {
        let pages = len.div_ceil(HUGE_PAGE).max(1);
        let len = pages * HUGE_PAGE;
        let free = free_huge_pages();
        if free < pages as u64 {
            reserve_huge_pages(pages as u64 - free)?;
        }
        // SAFETY: a fresh private anonymous mapping; no aliasing.
        let ptr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(LinuxError::Map {
                what: std::format!("{pages} 2 MiB huge page(s) (is /proc/sys/vm/nr_hugepages large enough?)"),
                source: std::io::Error::last_os_error(),
            });
        }
        let map = Mapping { ptr: ptr.cast(), len };
        // SAFETY: writing inside the mapping just made, to fault it in.
        unsafe { core::ptr::write_bytes(map.ptr, 0, len) };
        // SAFETY: locking the mapping just made (best effort: hugetlb pages
        // are not swapped anyway).
        unsafe { libc::mlock(map.ptr.cast(), len) };
        let phys = physical(map.ptr as usize)?;
        for i in 1..pages {
            let want = phys + (i * HUGE_PAGE) as u64;
            let got = physical(map.ptr as usize + i * HUGE_PAGE)?;
            if got != want {
                return Err(LinuxError::NotContiguous { pages, page: i, got, want });
            }
        }
        Ok(Self { map, phys })
    }

    /// A physically contiguous buffer of `len` bytes (rounded up to whole
    /// 4 KiB pages) that the `vnpu` kernel module allocates for the
    /// function (`dma_alloc_coherent`) and maps here: `file` is the
    /// module's device file, opened read-write
    /// ([`LinuxVnpu::dma_file`]). Buffers above 4 MiB come from the
    /// kernel's contiguous memory area (boot with `cma=SIZE`, on a kernel
    /// with CMA) or from memory reserved for the module (`memmap=` and
    /// its `reserve=`; docs/linux-guests.md).
    pub fn from_module(file: File, len: usize) -> Result<Self, LinuxError> {
        let len = len.max(1).div_ceil(4096) * 4096;
        // The module backs the mapping with the buffer it allocates for
        // this file.
        let map = Mapping::shared(&file, len, || {
            std::format!(
                "{len} bytes of DMA memory from the vnpu module (above 4 MiB: boot with cma=SIZE, or reserve \
                 memory with memmap= and the module's reserve=; docs/linux-guests.md)"
            )
        })?;
        let mut bus = 0u64;
        // SAFETY: the module's ioctl writes one u64 to the pointer given.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), VNPU_IOC_DMA_ADDR, &mut bus as *mut u64) };
        if r != 0 {
            return Err(LinuxError::Map {
                what: "the DMA buffer's bus address (VNPU_IOC_DMA_ADDR)".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        // The mapping holds the module's file open: the buffer lives until
        // it is unmapped, whatever happens to `file`.
        Ok(Self { map, phys: bus })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether it is empty (never: both constructors map at least a page).
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// Where the device sees the first byte.
    pub fn phys(&self) -> u64 {
        self.phys
    }

    /// `len` bytes at `offset` in the page, or `None` if they do not fit.
    pub fn buf(&self, offset: usize, len: usize) -> Option<DmaBuf> {
        (offset.checked_add(len)? <= self.map.len).then(|| DmaBuf {
            // SAFETY: `offset + len` is within the mapping.
            virt: unsafe { self.map.ptr.add(offset) },
            phys: self.phys + offset as u64,
            len,
        })
    }

    /// A bump allocator over `len` bytes at `offset` (clamped to the
    /// page). The region must not overlap buffers used otherwise, and
    /// must not outlive `self`.
    pub fn region(&self, offset: usize, len: usize) -> DmaRegion {
        let offset = offset.min(self.map.len);
        let len = len.min(self.map.len - offset);
        // SAFETY: inside the page, which the device sees at `phys`; the
        // caller keeps the sub-ranges apart and `self` alive.
        unsafe { DmaRegion::new(self.map.ptr.add(offset), self.phys + offset as u64, len) }
    }
}
