//! Prints one line on COM1 and ends the VM with exit code 42.
#![no_std]
#![no_main]

use guest_common::{exit, print};

#[no_mangle]
#[link_section = ".text._start"]
pub extern "C" fn _start() -> ! {
    print("hello from the guest\n");
    exit(42)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_common::on_panic(info)
}
