//! `vnpu-digits`: the digits classifier of the bare-metal `digits` guest,
//! in Linux user space. Finds the first vNPU under /sys/bus/pci, maps its
//! BAR 0, takes 2 MiB of DMA memory (tensors in its first half, ring,
//! programs and counters in the second: from the `vnpu` kernel module
//! when it is loaded, else one huge page) and waits for completions by
//! interrupt when the `vnpu` kernel module drives the function's MSI-X, by
//! polling otherwise (`docs/linux-guests.md`). Prints the device's PCI view and the same
//! report as the bare-metal guest; exits 0 only when the vNPU and the CPU
//! agree on every image.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use guest_apps::Platform;
use vnpu_driver::linux::{DmaMemory, HUGE_PAGE};
use vnpu_driver::{DmaBuf, Vnpu, Wait};

struct LinuxUser {
    start: Instant,
    dma: DmaMemory,
    wait: Wait,
}

impl Platform for LinuxUser {
    fn print(&self, args: std::fmt::Arguments) {
        let mut out = std::io::stdout().lock();
        let _ = out.write_fmt(args);
        let _ = out.flush();
    }
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }
    fn data(&self, len: usize) -> Option<DmaBuf> {
        (len <= HUGE_PAGE / 2).then(|| self.dma.buf(0, len)).flatten()
    }
    fn wait(&self) -> Wait {
        self.wait
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("vnpu-digits: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let mut opened = linux_guest::open_first()?;
    let p = LinuxUser { start: Instant::now(), dma: opened.dma_memory(HUGE_PAGE)?, wait: opened.wait };
    let mut region = p.dma.region(HUGE_PAGE / 2, HUGE_PAGE / 2);
    let mut npu = Vnpu::new(opened.dev.bar(), &mut region, 64)?;
    opened.hook_interrupts(&mut npu);
    Ok(guest_apps::digits::run(&mut npu, &mut region, &p))
}
