//! Reads one line from COM1's receive buffer (polling the line status
//! register's data-ready bit), writes it back prefixed with `echo: `, and
//! ends the VM with the line's length (without the newline) as exit code.
//! Tests the VMM's console input (`Vm::forward_input`).
#![no_std]
#![no_main]

use guest_common::{exit, outb, print};

const COM1: u16 = 0x3f8;
const LSR: u16 = COM1 + 5;

fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: port I/O to the VMM-emulated UART has no memory effects.
    unsafe { core::arch::asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack)) };
    v
}

#[no_mangle]
#[link_section = ".text._start"]
pub extern "C" fn _start() -> ! {
    print("echo: ");
    let mut n = 0u32;
    loop {
        if inb(LSR) & 1 == 0 {
            continue;
        }
        let b = inb(COM1);
        outb(COM1, b);
        if b == b'\n' {
            exit(n);
        }
        n += 1;
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_common::on_panic(info)
}
