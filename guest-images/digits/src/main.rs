//! The digits demo guest (runs at CPL3): `guest_apps::digits` on the
//! first vNPU, waiting for completions by interrupt. Exits 0 only when the
//! vNPU and the CPU agree on every image.
#![no_std]
#![no_main]

use guest_apps::Platform;
use guest_rt::vnpu_driver::{DmaBuf, Wait};
use guest_rt::{phys, println, rdtsc, tsc_to_ns, Env};
use vnpu_models::digits::layout;

/// The bare-metal platform: identity-mapped memory, the TSC, interrupts.
struct BareMetal {
    memory: u64,
}

impl Platform for BareMetal {
    fn print(&self, args: core::fmt::Arguments) {
        guest_rt::print!("{args}");
    }
    fn now_ns(&self) -> u64 {
        tsc_to_ns(rdtsc())
    }
    fn data(&self, len: usize) -> Option<DmaBuf> {
        // `layout`'s own addresses, below the heap and the DMA region.
        (layout::MLP_WEIGHTS + len as u64 <= self.memory).then(|| phys(layout::MLP_WEIGHTS, len))
    }
    fn wait(&self) -> Wait {
        Wait::Interrupt
    }
    fn ticks(&self) -> u64 {
        rdtsc()
    }
    fn host_round(&self, id: u32, ticks: u64) {
        guest_rt::benchmark_report(id, ticks);
    }
}

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
