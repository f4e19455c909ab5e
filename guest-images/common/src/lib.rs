//! Serial output, port I/O and the exit port for CPL0 test guests
//! (docs/guest-boot.md).
#![no_std]

use core::arch::asm;

/// `out dx, al`.
pub fn outb(port: u16, v: u8) {
    // SAFETY: port I/O to VMM-emulated devices has no memory effects.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack)) }
}

/// `out dx, eax`.
pub fn outl(port: u16, v: u32) {
    // SAFETY: as `outb`.
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack)) }
}

/// `in eax, dx`.
pub fn inl(port: u16) -> u32 {
    let v: u32;
    // SAFETY: as `outb`.
    unsafe { asm!("in eax, dx", in("dx") port, out("eax") v, options(nomem, nostack)) }
    v
}

/// Writes `s` to COM1.
pub fn print(s: &str) {
    for b in s.bytes() {
        outb(0x3f8, b);
    }
}

/// Writes `v` as `digits` hex digits.
pub fn print_hex(v: u64, digits: u32) {
    for i in (0..digits).rev() {
        let d = ((v >> (4 * i)) & 0xf) as u8;
        outb(0x3f8, if d < 10 { b'0' + d } else { b'a' + d - 10 });
    }
}

/// Ends the VM with `code`.
pub fn exit(code: u32) -> ! {
    outl(0xf4, code);
    loop {
        // SAFETY: halting is harmless if the VMM ever resumes us.
        unsafe { asm!("hlt", options(nomem, nostack)) }
    }
}

/// Prints the panic location and exits with 101.
pub fn on_panic(info: &core::panic::PanicInfo) -> ! {
    print("guest panic");
    if let Some(l) = info.location() {
        print(" at ");
        print(l.file());
        print(":");
        print_hex(u64::from(l.line()), 4);
    }
    print("\n");
    exit(101)
}
