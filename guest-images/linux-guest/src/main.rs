//! `vnpu-digits`: the digits classifier of the bare-metal `digits` guest,
//! in Linux user space. Finds the first vNPU under /sys/bus/pci, maps its
//! BAR 0, takes one 2 MiB huge page for DMA (tensors in its first half,
//! ring, programs and counters in the second) and waits for completions by
//! interrupt when the `vnpu` kernel module drives the function's MSI-X, by
//! polling otherwise (`docs/linux-guests.md`). Prints the device's PCI view and the same
//! report as the bare-metal guest; exits 0 only when the vNPU and the CPU
//! agree on every image.

use std::fs::File;
use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use guest_apps::Platform;
use vnpu_driver::linux::{find_vnpus, HugeDma, LinuxVnpu, HUGE_PAGE};
use vnpu_driver::{DmaBuf, Vnpu, Wait};

struct LinuxUser {
    start: Instant,
    dma: HugeDma,
    wait: Wait,
}

/// Completion interrupts seen so far (the kernel module's count).
static COMPLETIONS: AtomicU32 = AtomicU32::new(0);
/// The kernel module's completion file, when it is loaded.
static EVENTS: OnceLock<File> = OnceLock::new();

/// Sleeps until the next completion interrupt (the driver's idle hook).
fn sleep_for_interrupt(_seen: u32) {
    let mut b = [0u8; 4];
    if let Some(mut f) = EVENTS.get() {
        if f.read_exact(&mut b).is_ok() {
            COMPLETIONS.store(u32::from_le_bytes(b), Ordering::Release);
        }
    }
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
    let found = find_vnpus()?;
    let path = found.first().ok_or(vnpu_driver::linux::LinuxError::NoDevice)?;
    let dev = LinuxVnpu::open(path)?;
    let view =
        |f: &str| std::fs::read_to_string(path.join(f)).map(|s| s.trim().to_string()).unwrap_or_default();
    println!(
        "pci {}: vendor {} device {} class {} driver {}",
        dev.address(),
        view("vendor"),
        view("device"),
        view("class"),
        std::fs::read_link(path.join("driver"))
            .ok()
            .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "none".into())
    );
    let events = dev.completions();
    let wait = if events.is_some() { Wait::Interrupt } else { Wait::Poll };
    match dev.msix()? {
        Some((n, on)) => println!(
            "msix: capability with {n} vectors, {}; completions {}",
            if on { "enabled" } else { "not enabled" },
            if events.is_some() {
                "by interrupt (vnpu kernel module)"
            } else {
                "polled (no vnpu kernel module)"
            }
        ),
        None => println!("msix: no capability"),
    }
    let p = LinuxUser { start: Instant::now(), dma: HugeDma::new()?, wait };
    println!("dma: one 2 MiB huge page at physical {:#x}", p.dma.phys());
    let mut region = p.dma.region(HUGE_PAGE / 2, HUGE_PAGE / 2);
    let mut npu = Vnpu::new(dev.bar(), &mut region, 64)?;
    if let Some(f) = events {
        let _ = EVENTS.set(f);
        // The kernel programmed MSI-X vector 0; completions raise it, and
        // after a short spin a wait sleeps in the module's read.
        npu.use_interrupts(0, &COMPLETIONS);
        npu.use_idle(sleep_for_interrupt, 1 << 10);
    }
    Ok(guest_apps::digits::run(&mut npu, &mut region, &p))
}
