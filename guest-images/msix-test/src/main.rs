//! MSI-X from the vNPU at 00:01.0: sets up an IDT and the local APIC,
//! programs vector 1 of the vNPU's MSI-X table to interrupt vector 0x41,
//! and raises it through the INT_TEST register. Checks delivery, masking
//! (the pending bit is set, nothing delivered) and release on unmask.
//! Exits 0 when all of that held, else 1.
#![no_std]
#![no_main]

use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicU64, Ordering};

use guest_common::{exit, print, print_hex};

const ECAM: usize = 0xe000_0000;
const BAR0: usize = 0xc001_0000;
const BAR2: usize = 0xc002_0000;
const LAPIC: usize = 0xfee0_0000;
const VECTOR: usize = 0x41;

#[no_mangle]
static MSI_COUNT: AtomicU64 = AtomicU64::new(0);

global_asm!(
    ".global isr_msi",
    "isr_msi:",
    "push rax",
    "lock inc qword ptr [rip + MSI_COUNT]",
    "mov rax, 0xfee000b0",
    "mov dword ptr [rax], 0",
    "pop rax",
    "iretq",
);

extern "C" {
    fn isr_msi();
}

#[repr(C, align(16))]
struct Idt([u64; 512]);

static mut IDT: Idt = Idt([0; 512]);

fn w32(addr: usize, v: u32) {
    // SAFETY: identity-mapped MMIO the VMM provides (ECAM, BARs, LAPIC).
    unsafe { core::ptr::write_volatile(addr as *mut u32, v) }
}

fn r32(addr: usize) -> u32 {
    // SAFETY: as `w32`.
    unsafe { core::ptr::read_volatile(addr as *const u32) }
}

fn ecam(reg: usize) -> usize {
    ECAM + (1 << 15) + reg
}

fn wait_for(n: u64) -> bool {
    for _ in 0..100_000 {
        if MSI_COUNT.load(Ordering::SeqCst) >= n {
            return true;
        }
        core::hint::spin_loop();
    }
    MSI_COUNT.load(Ordering::SeqCst) >= n
}

fn check(what: &str, ok: bool, all: &mut bool) {
    print(what);
    print(if ok { " ok\n" } else { " FAILED\n" });
    *all &= ok;
}

#[no_mangle]
#[link_section = ".text._start"]
pub extern "C" fn _start() -> ! {
    // IDT entry for VECTOR: 64-bit interrupt gate, selector 0x08.
    let h = isr_msi as *const () as u64;
    let lo = (h & 0xffff) | (0x08 << 16) | (0x8e00u64 << 32) | ((h >> 16) & 0xffff) << 48;
    let hi = h >> 32;
    // SAFETY: single-threaded set-up before interrupts are enabled.
    let idt = unsafe { &mut *core::ptr::addr_of_mut!(IDT) };
    idt.0[2 * VECTOR] = lo;
    idt.0[2 * VECTOR + 1] = hi;
    let desc: [u16; 5] = {
        let base = idt.0.as_ptr() as u64;
        [4095, base as u16, (base >> 16) as u16, (base >> 32) as u16, (base >> 48) as u16]
    };
    // SAFETY: `desc` describes the static IDT above.
    unsafe { asm!("lidt [{}]", in(reg) desc.as_ptr(), options(nostack)) };
    // Local APIC: software-enable (spurious vector 0xff), accept all priorities.
    w32(LAPIC + 0xf0, 0x1ff);
    w32(LAPIC + 0x80, 0);

    // vNPU at 00:01.0: BAR 0 and BAR 2 in the MMIO hole, memory decoding on.
    w32(ecam(0x10), BAR0 as u32);
    w32(ecam(0x14), 0);
    w32(ecam(0x18), BAR2 as u32);
    w32(ecam(0x1c), 0);
    let cmd = r32(ecam(0x04)) & 0xffff;
    w32(ecam(0x04), cmd | 0x6);
    // MSI-X vector 1 -> APIC 0, vector 0x41, unmasked; then enable MSI-X.
    w32(BAR2 + 16, LAPIC as u32);
    w32(BAR2 + 20, 0);
    w32(BAR2 + 24, VECTOR as u32);
    w32(BAR2 + 28, 0);
    let cap = (r32(ecam(0x34)) & 0xff) as usize;
    let ctrl = r32(ecam(cap)) >> 16;
    w32(ecam(cap), ((ctrl | 0x8000) << 16) | 0x11);
    // SAFETY: the IDT and APIC are ready.
    unsafe { asm!("sti", options(nomem, nostack)) };

    let mut all = true;
    w32(BAR0 + 0x40, 1);
    check("msi delivered", wait_for(1), &mut all);
    // Mask vector 1: raising it sets the pending bit, delivers nothing.
    w32(BAR2 + 28, 1);
    w32(BAR0 + 0x40, 1);
    check("masked vector not delivered", !wait_for(2), &mut all);
    check("pending bit set", r32(BAR2 + 0x1000) & 0b10 != 0, &mut all);
    // Unmask: the pending interrupt arrives and the bit clears.
    w32(BAR2 + 28, 0);
    check("pending vector delivered on unmask", wait_for(2), &mut all);
    check("pending bit cleared", r32(BAR2 + 0x1000) & 0b10 == 0, &mut all);
    print("interrupts ");
    print_hex(MSI_COUNT.load(Ordering::SeqCst), 2);
    print("\n");
    exit(if all { 0 } else { 1 })
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_common::on_panic(info)
}
