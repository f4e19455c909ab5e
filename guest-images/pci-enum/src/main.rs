//! Enumerates PCI bus 0 through conf1 (ports 0xCF8/0xCFC) and ECAM (MMIO at
//! 0xE000_0000), prints each function, checks both mechanisms agree, sizes
//! the first vNPU's BAR 0 and walks its capabilities to MSI-X; then, for
//! every vNPU (class 0x12), places BAR 0 in the MMIO hole, enables memory
//! decoding and prints its hierarchy registers. Exits 0 when at least one
//! vNPU was found and everything agreed, else 1.
#![no_std]
#![no_main]

use guest_common::{exit, inl, outl, print, print_hex};

const ECAM: usize = 0xe000_0000;

fn conf1_read(dev: u32, reg: u32) -> u32 {
    outl(0xcf8, 0x8000_0000 | dev << 11 | reg);
    inl(0xcfc)
}

fn ecam_ptr(dev: u32, reg: u32) -> *mut u32 {
    (ECAM + ((dev as usize) << 15) + reg as usize) as *mut u32
}

fn ecam_read(dev: u32, reg: u32) -> u32 {
    // SAFETY: the ECAM window is identity-mapped MMIO set up by the VMM.
    unsafe { core::ptr::read_volatile(ecam_ptr(dev, reg)) }
}

fn ecam_write(dev: u32, reg: u32, v: u32) {
    // SAFETY: as `ecam_read`.
    unsafe { core::ptr::write_volatile(ecam_ptr(dev, reg), v) }
}

#[no_mangle]
#[link_section = ".text._start"]
pub extern "C" fn _start() -> ! {
    let mut ok = true;
    let mut vnpu = None;
    let mut all = [0u32; 32];
    let mut count = 0;
    for dev in 0..32 {
        let id = conf1_read(dev, 0);
        if id != ecam_read(dev, 0) {
            print("conf1 and ECAM disagree\n");
            ok = false;
        }
        if id == 0xffff_ffff {
            continue;
        }
        let class = ecam_read(dev, 8) >> 8;
        print("00:");
        print_hex(u64::from(dev), 2);
        print(".0 ");
        print_hex(u64::from(id & 0xffff), 4);
        print(":");
        print_hex(u64::from(id >> 16), 4);
        print(" class ");
        print_hex(u64::from(class), 6);
        print("\n");
        if class >> 16 == 0x12 {
            vnpu = vnpu.or(Some(dev));
            all[count] = dev;
            count += 1;
        }
    }
    let Some(dev) = vnpu else {
        print("no vNPU found\n");
        exit(1)
    };
    // Size BAR 0 (64-bit) through ECAM, then restore it.
    let (lo, hi) = (ecam_read(dev, 0x10), ecam_read(dev, 0x14));
    ecam_write(dev, 0x10, 0xffff_ffff);
    ecam_write(dev, 0x14, 0xffff_ffff);
    let size_lo = ecam_read(dev, 0x10);
    let size_hi = ecam_read(dev, 0x14);
    ecam_write(dev, 0x10, lo);
    ecam_write(dev, 0x14, hi);
    let mask = (u64::from(size_hi) << 32) | u64::from(size_lo & !0xf);
    print("vnpu bar0 size ");
    print_hex(!mask + 1, 8);
    print(if size_lo & 0x6 == 0x4 { " 64-bit\n" } else { " 32-bit\n" });
    // Walk the capability list.
    let mut at = ecam_read(dev, 0x34) & 0xff;
    let mut found = false;
    for _ in 0..48 {
        if at < 0x40 {
            break;
        }
        let hdr = ecam_read(dev, at);
        if hdr & 0xff == 0x11 {
            print("vnpu msix vectors ");
            print_hex(u64::from(((hdr >> 16) & 0x7ff) + 1), 4);
            print("\n");
            found = true;
            break;
        }
        at = (hdr >> 8) & 0xff;
    }
    for &dev in &all[..count] {
        ok &= hierarchy(dev);
    }
    exit(if ok && found { 0 } else { 1 })
}

fn mmio32(addr: usize) -> u32 {
    // SAFETY: `addr` lies in a BAR this guest just programmed, identity-mapped.
    unsafe { core::ptr::read_volatile(addr as *const u32) }
}

/// Places BAR 0 of `dev` at 0xC000_0000 + dev * 64 KiB, enables memory
/// decoding and prints the hierarchy registers. False if the magic is wrong.
fn hierarchy(dev: u32) -> bool {
    let base = 0xc000_0000usize + ((dev as usize) << 16);
    ecam_write(dev, 0x10, base as u32);
    ecam_write(dev, 0x14, 0);
    let cmd = ecam_read(dev, 0x04) & 0xffff;
    ecam_write(dev, 0x04, cmd | 0x2);
    let magic = mmio32(base);
    print("vnpu 00:");
    print_hex(u64::from(dev), 2);
    print(".0 abi ");
    print_hex(u64::from(mmio32(base + 0x04)), 8);
    let fields: [(&str, usize, u32); 8] = [
        (" chips ", 0x10, 2),
        (" cores ", 0x14, 2),
        (" sa ", 0x18, 2),
        (" vu ", 0x1c, 2),
        (" sram ", 0x20, 16),
        (" hbm ", 0x28, 16),
        (" array ", 0x30, 4),
        (" lanes ", 0x38, 4),
    ];
    for (name, off, digits) in fields {
        print(name);
        let mut v = u64::from(mmio32(base + off));
        if digits == 16 {
            v |= u64::from(mmio32(base + off + 4)) << 32;
        }
        print_hex(v, digits);
    }
    print("\n");
    magic == u32::from_le_bytes(*b"VNPU")
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_common::on_panic(info)
}
