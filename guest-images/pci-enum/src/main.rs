//! Enumerates PCI bus 0 through conf1 (ports 0xCF8/0xCFC) and ECAM (MMIO at
//! 0xE000_0000), prints each function, checks both mechanisms agree, sizes
//! the vNPU's BAR 0 and walks its capabilities to MSI-X. Exits 0 when the
//! vNPU (class 0x12) was found and everything agreed, else 1.
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
            vnpu = Some(dev);
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
    exit(if ok && found { 0 } else { 1 })
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_common::on_panic(info)
}
