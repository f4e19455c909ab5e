//! Round trip of an empty request through the whole path (doorbell ->
//! worker -> used ring -> MSI-X or polling), against the raw primitives
//! measured in the same run: a write to an ioeventfd nothing consumes
//! (`CAL_NOP`), and an ioeventfd that is also an irqfd (`CAL_LOOPBACK`:
//! doorbell write -> MSI -> handler, all in the kernel). Runs at CPL3.
//! Prints one line per path with the median and the ratio to its baseline.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::vec::Vec;
use core::sync::atomic::Ordering;

use guest_rt::vnpu_driver::{Bar, Wait};
use guest_rt::{println, rdtsc, tsc_to_ns, Env, IRQ_COUNT};
use vnpu_abi::device::regs;

const N: usize = 2000;

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn measure(mut f: impl FnMut()) -> u64 {
    for _ in 0..50 {
        f();
    }
    let mut t = Vec::with_capacity(N);
    for _ in 0..N {
        let t0 = rdtsc();
        f();
        t.push(rdtsc() - t0);
    }
    median(t)
}

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((_, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    // Program the loopback vector's route once (INT_TEST raises it through the VMM).
    let c = IRQ_COUNT.load(Ordering::Acquire);
    npu.bar().write32(regs::INT_TEST, u32::from(vnpu_abi::device::LOOPBACK_VECTOR));
    while IRQ_COUNT.load(Ordering::Acquire) == c {
        core::hint::spin_loop();
    }

    let raw_ioevent = measure(|| npu.bar().write32(regs::CAL_NOP, 1));
    let raw_msi = measure(|| {
        let c = IRQ_COUNT.load(Ordering::Acquire);
        npu.bar().write32(regs::CAL_LOOPBACK, 1);
        while IRQ_COUNT.load(Ordering::Acquire) == c {}
    });
    let mut failed = false;
    let polled = measure(|| failed |= npu.nop(Wait::Poll).is_err());
    let irq = measure(|| failed |= npu.nop(Wait::Interrupt).is_err());

    if failed {
        println!("a request failed");
        return 1;
    }
    let ns = |t: u64| tsc_to_ns(t) as f64 / 1000.0;
    println!("tsc_khz {}", env.tsc_khz);
    println!("raw ioeventfd write      {:8.2} us", ns(raw_ioevent));
    println!("raw ioeventfd->irqfd MSI {:8.2} us", ns(raw_msi));
    println!(
        "vNPU nop, polled         {:8.2} us  ratio to raw ioeventfd write {:.2}",
        ns(polled),
        polled as f64 / raw_ioevent as f64
    );
    println!(
        "vNPU nop, interrupt      {:8.2} us  ratio to raw ioeventfd->MSI {:.2}",
        ns(irq),
        irq as f64 / raw_msi as f64
    );
    0
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
