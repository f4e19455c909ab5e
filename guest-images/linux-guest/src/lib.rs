//! What the Linux guest's binaries share: finding and opening the first
//! vNPU from user space, printing its PCI view, and completions by
//! interrupt through the `vnpu` kernel module when it is loaded (polling
//! otherwise; `docs/linux-guests.md`).

use std::fs::File;
use std::io::Read;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use vnpu_driver::linux::{find_vnpus, DmaMemory, LinuxError, LinuxVnpu};
use vnpu_driver::{MmioBar, Vnpu, Wait};

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

/// The first vNPU, opened, and how its completions arrive.
pub struct Opened {
    pub dev: LinuxVnpu,
    /// `Interrupt` with the kernel module, `Poll` without.
    pub wait: Wait,
    events: Option<File>,
}

/// Opens the first vNPU and prints its PCI view and MSI-X state (the
/// lines the nested test checks).
pub fn open_first() -> Result<Opened, LinuxError> {
    let found = find_vnpus()?;
    let path = found.first().ok_or(LinuxError::NoDevice)?;
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
    Ok(Opened { dev, wait, events })
}

impl Opened {
    /// `len` bytes of DMA memory for the vNPU, and where the device sees
    /// them: a coherent buffer from the kernel module when it is loaded
    /// (the address is the DMA API's, an IOVA behind an IOMMU), else 2 MiB
    /// huge pages at their physical address (from pagemap: right only
    /// without an IOMMU). Prints which.
    pub fn dma_memory(&self, len: usize) -> Result<DmaMemory, LinuxError> {
        let d = match self.dev.dma_file() {
            Some(f) => {
                let d = DmaMemory::from_module(f, len)?;
                println!("dma: {} KiB from the vnpu module at bus address {:#x}", d.len() >> 10, d.phys());
                d
            }
            None => {
                let d = DmaMemory::huge_pages(len)?;
                println!("dma: {} 2 MiB huge page(s) at physical {:#x}", d.len() >> 21, d.phys());
                d
            }
        };
        Ok(d)
    }

    /// With the kernel module: completions by MSI-X vector 0 (which the
    /// module programmed); after a short spin a wait sleeps in the
    /// module's read. Without it, nothing changes (polling).
    pub fn hook_interrupts(&mut self, npu: &mut Vnpu<MmioBar>) {
        if let Some(f) = self.events.take() {
            let _ = EVENTS.set(f);
            npu.use_interrupts(0, &COMPLETIONS);
            npu.use_idle(sleep_for_interrupt, 1 << 10);
        }
    }
}
