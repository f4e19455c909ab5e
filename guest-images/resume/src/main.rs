//! The restart test's guest (runs at CPL3): `guest_apps::digits::classify_rounds`
//! on the first vNPU, waiting for completions by interrupt, while the test
//! kills and restarts the board daemon under it. Exits 0 only when every
//! answer matched the CPU's.
#![no_std]
#![no_main]

use guest_rt::vnpu_driver::{DmaBuf, Wait};
use guest_rt::{phys, println, rdtsc, tsc_to_ns, Env};
use vnpu_models::digits::layout;

/// Rounds over the held-out digits.
const ROUNDS: u32 = 200;

struct BareMetal {
    memory: u64,
}

impl guest_apps::Platform for BareMetal {
    fn print(&self, args: core::fmt::Arguments) {
        guest_rt::print!("{args}");
    }
    fn now_ns(&self) -> u64 {
        tsc_to_ns(rdtsc())
    }
    fn data(&self, len: usize) -> Option<DmaBuf> {
        (layout::MLP_WEIGHTS + len as u64 <= self.memory).then(|| phys(layout::MLP_WEIGHTS, len))
    }
    fn wait(&self) -> Wait {
        Wait::Interrupt
    }
    fn ticks(&self) -> u64 {
        rdtsc()
    }
    fn host_round(&self, _id: u32, _ticks: u64) {}
}

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
