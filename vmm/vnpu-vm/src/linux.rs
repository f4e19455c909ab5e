//! Direct boot of a Linux kernel (x86 64-bit boot protocol,
//! Documentation/arch/x86/boot.rst): the kernel (bzImage, or an ELF
//! vmlinux) at 1 MiB, the initrd at the top of RAM, the command line, the
//! zero page with the setup header and the e820 map, and the MP table.
//! The vCPU enters the kernel's 64-bit entry point in long mode with the
//! boot GDT the protocol asks for (`__BOOT_CS` = 0x10, `__BOOT_DS` = 0x18)
//! and `rsi` = the zero page. See `docs/linux-guests.md`.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{bzimage::BzImage, elf::Elf, load_cmdline, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::mptable;
use crate::VmError;

/// How to boot a Linux kernel: the guest image is then a bzImage or vmlinux.
#[derive(Clone, Debug, Default)]
pub struct LinuxBoot {
    /// An initramfs (cpio, optionally compressed) loaded at the top of RAM.
    pub initrd: Option<PathBuf>,
    /// The kernel command line.
    pub cmdline: String,
}

/// The zero page (`struct boot_params`).
pub const ZERO_PAGE: u64 = 0x7000;
/// The command line.
pub const CMDLINE_START: u64 = 0x2_0000;
/// Longest command line (x86's COMMAND_LINE_SIZE less the NUL).
pub const CMDLINE_MAX: usize = 2047;
/// Where the kernel's protected-mode code is loaded.
pub const KERNEL_START: u64 = 0x10_0000;
/// The boot code segment selector the protocol requires.
pub const BOOT_CS: u16 = 0x10;
/// The boot data segment selector the protocol requires.
pub const BOOT_DS: u16 = 0x18;
/// Offset of the 64-bit entry point in a bzImage's protected-mode code.
const BZIMAGE_ENTRY_64: u64 = 0x200;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const BOOT_FLAG: u16 = 0xaa55;
const HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
/// "Undefined" boot loader (0xff), as a VMM that is not in the registry.
const LOADER_TYPE: u8 = 0xff;
/// Default initrd ceiling for kernels whose header does not say.
const INITRD_ADDR_MAX: u64 = 0x37ff_ffff;

fn load_err(path: &Path, reason: impl std::fmt::Display) -> VmError {
    VmError::Load { path: path.display().to_string(), reason: reason.to_string() }
}

/// Whether `file` starts like a bzImage (the "HdrS" magic at 0x202).
fn is_bzimage(file: &mut File) -> std::io::Result<bool> {
    let mut magic = [0u8; 4];
    file.seek(SeekFrom::Start(0x202))?;
    let ok = file.read_exact(&mut magic).is_ok() && u32::from_le_bytes(magic) == HDR_MAGIC;
    file.rewind()?;
    Ok(ok)
}

/// Loads `kernel`, `boot.initrd` and the command line into `memory`
/// (`mem_size` bytes of RAM from 0), writes the zero page and the MP table
/// for `cpus` processors; returns the 64-bit entry point.
pub fn load(
    memory: &GuestMemoryMmap<()>,
    mem_size: u64,
    kernel: &Path,
    boot: &LinuxBoot,
    cpus: u8,
) -> Result<u64, VmError> {
    let mut file =
        File::open(kernel).map_err(|source| VmError::Open { path: kernel.display().to_string(), source })?;
    let bz = is_bzimage(&mut file).map_err(|e| load_err(kernel, e))?;
    let (entry, header, kernel_end) = if bz {
        let r = BzImage::load(memory, Some(GuestAddress(KERNEL_START)), &mut file, None)
            .map_err(|e| load_err(kernel, format!("as a bzImage: {e}")))?;
        let hdr = r.setup_header.ok_or_else(|| load_err(kernel, "bzImage without a setup header"))?;
        let version = hdr.version;
        if version < 0x020c {
            return Err(load_err(
                kernel,
                format!("boot protocol {version:#x} is older than 2.12 (no 64-bit entry)"),
            ));
        }
        (r.kernel_load.0 + BZIMAGE_ENTRY_64, Some(hdr), r.kernel_end)
    } else {
        let r = Elf::load(memory, None, &mut file, Some(GuestAddress(KERNEL_START)))
            .map_err(|e| load_err(kernel, format!("neither a bzImage nor a loadable ELF vmlinux: {e}")))?;
        (r.kernel_load.0, None, r.kernel_end)
    };

    let mut params = boot_params::default();
    if let Some(h) = header {
        params.hdr = h;
    }
    params.hdr.type_of_loader = LOADER_TYPE;
    params.hdr.boot_flag = BOOT_FLAG;
    params.hdr.header = HDR_MAGIC;
    params.hdr.kernel_alignment = 0x0100_0000;

    // The decompressor works in place above the load address: the kernel
    // and its init_size must fit below the initrd.
    let init_end = KERNEL_START + u64::from(params.hdr.init_size).max(kernel_end - KERNEL_START);
    let mut initrd_start = mem_size;
    if let Some(path) = &boot.initrd {
        let bytes = std::fs::read(path)
            .map_err(|source| VmError::Open { path: path.display().to_string(), source })?;
        let max = match u64::from(params.hdr.initrd_addr_max) {
            0 => INITRD_ADDR_MAX,
            m => m,
        };
        let top = mem_size.min(max + 1);
        let size = bytes.len() as u64;
        initrd_start =
            top.checked_sub(size).map(|a| a & !0xfff).filter(|a| *a >= init_end).ok_or_else(|| {
                VmError::Memory {
                    size: mem_size,
                    reason: format!(
                        "too small for the kernel ({} MiB to decompress) and the {} MiB initrd {}",
                        (init_end - KERNEL_START) >> 20,
                        size >> 20,
                        path.display()
                    ),
                }
            })?;
        memory
            .write_slice(&bytes, GuestAddress(initrd_start))
            .map_err(|e| VmError::Memory { size: mem_size, reason: e.to_string() })?;
        // The boot protocol's fields are 32 bits; the initrd sits below
        // the top of guest RAM, which `VmConfig` keeps below 4 GiB.
        let below_4g = |v: u64, what: &str| {
            u32::try_from(v).map_err(|_| VmError::Memory {
                size: mem_size,
                reason: format!("the initrd's {what} {v:#x} does not fit the boot protocol's 32 bits"),
            })
        };
        params.hdr.ramdisk_image = below_4g(initrd_start, "address")?;
        params.hdr.ramdisk_size = below_4g(size, "size")?;
    }
    if init_end > initrd_start {
        return Err(VmError::Memory {
            size: mem_size,
            reason: format!(
                "too small for the kernel ({} MiB to decompress)",
                (init_end - KERNEL_START) >> 20
            ),
        });
    }

    if boot.cmdline.len() > CMDLINE_MAX {
        return Err(load_err(
            kernel,
            format!("command line of {} bytes; at most {CMDLINE_MAX}", boot.cmdline.len()),
        ));
    }
    let mut cmdline = Cmdline::new(CMDLINE_MAX + 1).map_err(|e| load_err(kernel, e))?;
    cmdline.insert_str(&boot.cmdline).map_err(|e| load_err(kernel, format!("command line: {e}")))?;
    load_cmdline(memory, GuestAddress(CMDLINE_START), &cmdline)
        .map_err(|e| load_err(kernel, format!("command line: {e}")))?;
    params.hdr.cmd_line_ptr = u32::try_from(CMDLINE_START).expect("a constant below 4 GiB");
    // `insert_str` above refused anything longer than CMDLINE_CAPACITY.
    params.hdr.cmdline_size = u32::try_from(boot.cmdline.len() + 1)
        .map_err(|_| load_err(kernel, "command line: too long".to_string()))?;

    let e820 = [
        (0, mptable::MPTABLE_START, E820_RAM),
        (mptable::MPTABLE_START, KERNEL_START - mptable::MPTABLE_START, E820_RESERVED),
        (KERNEL_START, mem_size - KERNEL_START, E820_RAM),
    ];
    for (i, (addr, size, kind)) in e820.into_iter().enumerate() {
        params.e820_table[i] = boot_e820_entry { addr, size, r#type: kind };
    }
    params.e820_entries = u8::try_from(e820.len()).expect("a fixed, short table");
    let err = |e: vm_memory::GuestMemoryError| VmError::Memory { size: mem_size, reason: e.to_string() };
    memory.write_obj(params, GuestAddress(ZERO_PAGE)).map_err(err)?;
    memory.write_slice(&mptable::build(cpus), GuestAddress(mptable::MPTABLE_START)).map_err(err)?;
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal bzImage: one setup sector after the boot sector, then
    /// `payload` bytes of "kernel".
    fn fake_bzimage(version: u16, init_size: u32, payload: usize) -> Vec<u8> {
        let mut b = vec![0u8; 2 * 512 + payload];
        b[0x1f1] = 1; // setup_sects
        b[0x1fe..0x200].copy_from_slice(&BOOT_FLAG.to_le_bytes());
        b[0x202..0x206].copy_from_slice(&HDR_MAGIC.to_le_bytes());
        b[0x206..0x208].copy_from_slice(&version.to_le_bytes());
        b[0x211] = 1; // loadflags: LOADED_HIGH
        b[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
        b[0x22c..0x230].copy_from_slice(&0x37ff_ffffu32.to_le_bytes());
        b[0x260..0x264].copy_from_slice(&init_size.to_le_bytes());
        for (i, x) in b[1024..].iter_mut().enumerate() {
            *x = i as u8;
        }
        b
    }

    fn write_temp(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("vnpu-linux-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn memory(size: u64) -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)]).unwrap()
    }

    #[test]
    fn bzimage_initrd_cmdline_and_zero_page_are_laid_out() {
        let kernel = write_temp("bz", &fake_bzimage(0x020f, 4 << 20, 8192));
        let initrd = write_temp("initrd", &[7u8; 10_000]);
        let size = 64 << 20;
        let m = memory(size);
        let boot = LinuxBoot { initrd: Some(initrd.clone()), cmdline: "console=ttyS0 quiet".into() };
        let entry = load(&m, size, &kernel, &boot, 1).unwrap();
        assert_eq!(entry, KERNEL_START + 0x200);
        // The kernel's protected-mode part at 1 MiB.
        assert_eq!(m.read_obj::<u8>(GuestAddress(KERNEL_START + 5)).unwrap(), 5);
        let p: boot_params = m.read_obj(GuestAddress(ZERO_PAGE)).unwrap();
        let (loader, flag, ptr, csize) =
            (p.hdr.type_of_loader, p.hdr.boot_flag, p.hdr.cmd_line_ptr, p.hdr.cmdline_size);
        assert_eq!((loader, flag, ptr, csize), (0xff, BOOT_FLAG, CMDLINE_START as u32, 20));
        let mut cmd = [0u8; 20];
        m.read_slice(&mut cmd, GuestAddress(CMDLINE_START)).unwrap();
        assert_eq!(&cmd, b"console=ttyS0 quiet\0");
        // The initrd at the top of RAM, page-aligned.
        let (start, len) = (p.hdr.ramdisk_image, p.hdr.ramdisk_size);
        assert_eq!(len, 10_000);
        assert_eq!(u64::from(start), (size - 10_000) & !0xfff);
        assert_eq!(m.read_obj::<u8>(GuestAddress(u64::from(start) + 9_999)).unwrap(), 7);
        // e820: low RAM, the reserved BIOS area with the MP table, RAM from 1 MiB.
        assert_eq!(p.e820_entries, 3);
        let e = p.e820_table;
        let (a2, s2, t2) = (e[2].addr, e[2].size, e[2].r#type);
        assert_eq!((a2, s2, t2), (KERNEL_START, size - KERNEL_START, E820_RAM));
        let t1 = e[1].r#type;
        assert_eq!(t1, E820_RESERVED);
        let mut mp = [0u8; 4];
        m.read_slice(&mut mp, GuestAddress(mptable::MPTABLE_START)).unwrap();
        assert_eq!(&mp, b"_MP_");
        let _ = std::fs::remove_file(kernel);
        let _ = std::fs::remove_file(initrd);
    }

    #[test]
    fn bad_kernels_initrds_and_cmdlines_are_clear_errors() {
        let size = 16 << 20;
        let m = memory(size);
        let boot = LinuxBoot { initrd: None, cmdline: String::new() };
        // Neither a bzImage nor an ELF.
        let junk = write_temp("junk", b"not a kernel at all");
        let e = load(&m, size, &junk, &boot, 1).unwrap_err().to_string();
        assert!(e.contains("neither a bzImage nor a loadable ELF"), "{e}");
        // Too old for the 64-bit entry.
        let old = write_temp("old", &fake_bzimage(0x0206, 1 << 20, 4096));
        let e = load(&m, size, &old, &boot, 1).unwrap_err().to_string();
        assert!(e.contains("older than 2.12"), "{e}");
        // Decompression space beyond RAM.
        let big = write_temp("big", &fake_bzimage(0x020f, 64 << 20, 4096));
        let e = load(&m, size, &big, &boot, 1).unwrap_err().to_string();
        assert!(e.contains("too small for the kernel"), "{e}");
        // An initrd that does not fit above the kernel.
        let ok = write_temp("ok", &fake_bzimage(0x020f, 4 << 20, 4096));
        let huge = write_temp("huge", &vec![0u8; 13 << 20]);
        let with = LinuxBoot { initrd: Some(huge.clone()), cmdline: String::new() };
        let e = load(&m, size, &ok, &with, 1).unwrap_err().to_string();
        assert!(e.contains("initrd"), "{e}");
        // A missing initrd names its path.
        let missing = LinuxBoot { initrd: Some("/nonexistent/initrd".into()), cmdline: String::new() };
        let e = load(&m, size, &ok, &missing, 1).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/initrd"), "{e}");
        // A command line longer than the kernel takes.
        let long = LinuxBoot { initrd: None, cmdline: "x".repeat(CMDLINE_MAX + 1) };
        let e = load(&m, size, &ok, &long, 1).unwrap_err().to_string();
        assert!(e.contains("command line of 2048 bytes"), "{e}");
        for p in [junk, old, big, ok, huge] {
            let _ = std::fs::remove_file(p);
        }
    }
}
