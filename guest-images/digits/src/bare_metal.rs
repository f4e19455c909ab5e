//! The bare-metal platform the digits guests run the shared programs
//! (`guest_apps`) on: identity-mapped memory, the TSC, interrupts.

use guest_apps::Platform;
use guest_rt::vnpu_driver::{DmaBuf, Wait};
use guest_rt::{phys, rdtsc, tsc_to_ns};
use vnpu_guest_programs::digits::layout;

/// The bare-metal platform: identity-mapped memory, the TSC, interrupts.
pub struct BareMetal {
    pub memory: u64,
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
