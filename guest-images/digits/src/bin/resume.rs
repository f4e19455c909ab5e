//! The restart test's guest (runs at CPL3): `guest_apps::digits::classify_rounds`
//! on the first vNPU, waiting for completions by interrupt, while the test
//! kills and restarts the board daemon under it. Exits 0 only when every
//! answer matched the CPU's.
#![no_std]
#![no_main]

use guest_rt::{println, Env};

#[path = "../bare_metal.rs"]
mod bare_metal;
use bare_metal::BareMetal;

/// Rounds over the held-out digits.
const ROUNDS: u32 = 200;

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((slot, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    println!("vnpu at 00:{slot:02x}.0");
    let p = BareMetal { memory: env.memory };
    u32::from(!guest_apps::digits::classify_rounds(&mut npu, &mut env.dma, &p, ROUNDS))
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
