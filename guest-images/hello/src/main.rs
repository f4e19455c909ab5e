//! Prints one line on COM1 and ends the VM with exit code 42.
#![no_std]
#![no_main]

use core::arch::asm;

fn outb(port: u16, v: u8) {
    // SAFETY: port I/O to the VMM's serial port has no memory effects.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack)) }
}

fn exit(code: u32) -> ! {
    // SAFETY: a write to the VMM's exit port ends the VM.
    unsafe { asm!("out dx, eax", in("dx") 0xf4u16, in("eax") code, options(nomem, nostack)) }
    loop {
        // SAFETY: halting is harmless if the VMM ever resumes us.
        unsafe { asm!("hlt", options(nomem, nostack)) }
    }
}

#[no_mangle]
#[link_section = ".text._start"]
pub extern "C" fn _start() -> ! {
    for b in b"hello from the guest\n" {
        outb(0x3f8, *b);
    }
    exit(42)
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    exit(101)
}
