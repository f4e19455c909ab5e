//! The digits demo guest (runs at CPL3): `guest_apps::digits` on the
//! first vNPU, waiting for completions by interrupt. Exits 0 only when the
//! vNPU and the CPU agree on every image.
#![no_std]
#![no_main]

use guest_rt::{println, Env};

mod bare_metal;
use bare_metal::BareMetal;

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((slot, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    println!("vnpu at 00:{slot:02x}.0");
    let p = BareMetal { memory: env.memory };
    u32::from(!guest_apps::digits::run(&mut npu, &mut env.dma, &p))
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
