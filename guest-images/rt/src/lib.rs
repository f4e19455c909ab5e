//! Runtime for guests whose application runs at CPL3 (docs/guest-boot.md).
//!
//! On this machine kind guest code at CPL0 is emulated (about 2 million
//! instructions per second) while CPL3 code runs natively, so the CPL0
//! part is a stub that runs a few thousand instructions and drops to user
//! mode at once:
//!
//! 1. `_start` (CPL0, entered by the VMM in long mode with `rdi` = memory
//!    size, `rsi` = TSC kHz, `rdx`/`rcx` = the payload's address/length) loads a GDT with user segments and a TSS,
//!    an IDT (exceptions print and exit; vector [`NPU_VECTOR`] counts
//!    interrupts in [`IRQ_COUNT`]; spurious vector 0xff), enables the
//!    local APIC, makes the VMM's identity map user-accessible (RAM and
//!    the MMIO hole with the BARs), and `iretq`s to CPL3 with interrupts on.
//! 2. At CPL3 the application's `guest_main(&mut Env) -> u32` runs; its
//!    return value becomes the VM's exit code.
//!
//! Console output and exit at CPL3 go through the VMM's MMIO system
//! controller page (`out` faults at CPL3 here). The stub is not a
//! protection boundary: the application is the only thing in the guest.
#![no_std]

extern crate alloc;

pub mod vnpu;

use core::arch::{asm, global_asm};
use core::fmt::Write;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

pub use vnpu_driver;

/// MMIO system controller page (the VMM's `SYSCON_BASE`).
const SYSCON: usize = 0xf000_0000;
const LAPIC: usize = 0xfee0_0000;
/// Vector the vNPU's completion MSI-X carries.
pub const NPU_VECTOR: u8 = 0x30;
/// Kernel stack for interrupts taken from CPL3 (TSS.rsp0).
const KSTACK_TOP: u64 = 0x7_0000;
/// User stack: 1 MiB below 8 MiB.
const USTACK_TOP: u64 = 0x80_0000;
/// Heap: [8 MiB, 24 MiB).
const HEAP_START: usize = 0x80_0000;
const HEAP_END: usize = 0x180_0000;
/// DMA memory for the vNPU: from 24 MiB to the end of RAM.
pub const DMA_START: u64 = 0x180_0000;
/// Smallest memory these guests need.
pub const MIN_MEMORY: u64 = 64 << 20;

/// Interrupts seen on [`NPU_VECTOR`] (bumped by the CPL0 handler).
#[no_mangle]
pub static IRQ_COUNT: AtomicU32 = AtomicU32::new(0);

static MEM_SIZE: AtomicUsize = AtomicUsize::new(0);
static TSC_KHZ: AtomicUsize = AtomicUsize::new(0);
static PAYLOAD: AtomicUsize = AtomicUsize::new(0);
static PAYLOAD_LEN: AtomicUsize = AtomicUsize::new(0);

/// What the application gets.
#[derive(Debug)]
pub struct Env {
    /// Guest RAM in bytes.
    pub memory: u64,
    /// TSC ticks per millisecond (0 if the VMM could not tell).
    pub tsc_khz: u64,
    /// DMA memory for the driver (identity-mapped).
    pub dma: vnpu_driver::DmaRegion,
    /// The VMM's payload (`rdx`, `rcx` at entry; docs/guest-boot.md):
    /// guest address and length, identity-mapped, at the top of RAM and
    /// outside [`Env::dma`]. `None` without one.
    pub payload: Option<(u64, usize)>,
}

// ---------------------------------------------------------------- console

/// A byte to the console (MMIO, works at any CPL).
pub fn putc(b: u8) {
    // SAFETY: the system controller page is identity-mapped MMIO.
    unsafe { core::ptr::write_volatile((SYSCON) as *mut u32, u32::from(b)) }
}

/// Console writer for `write!`.
#[derive(Debug, Default)]
pub struct Console;

impl Write for Console {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        s.bytes().for_each(putc);
        Ok(())
    }
}

/// `print!` to the console.
#[macro_export]
macro_rules! print {
    ($($t:tt)*) => {{ let _ = core::fmt::Write::write_fmt(&mut $crate::Console, format_args!($($t)*)); }};
}

/// `println!` to the console.
#[macro_export]
macro_rules! println {
    ($($t:tt)*) => {{ $crate::print!($($t)*); $crate::putc(b'\n'); }};
}

/// Hands `(id, value)` to the host's benchmark hook (the VMM's
/// `SYSCON_BENCH` registers, `id < 16`; others are ignored): the vCPU waits
/// while the host runs its side of an interleaved benchmark.
pub fn benchmark_report(id: u32, value: u64) {
    if id < 16 {
        // SAFETY: as in `putc`; `SYSCON + 0x10 + 8 * id` lies in the page.
        unsafe { core::ptr::write_volatile((SYSCON + 0x10 + 8 * id as usize) as *mut u64, value) }
    }
}

/// Ends the VM with `code` (MMIO, works at any CPL).
pub fn exit(code: u32) -> ! {
    // SAFETY: as in `putc`.
    unsafe { core::ptr::write_volatile((SYSCON + 4) as *mut u32, code) };
    loop {
        core::hint::spin_loop();
    }
}

/// Time-stamp counter.
pub fn rdtsc() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: rdtsc has no side effects (CR4.TSD is clear).
    unsafe { asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    u64::from(hi) << 32 | u64::from(lo)
}

/// TSC ticks to nanoseconds (0 when the rate is unknown).
pub fn tsc_to_ns(ticks: u64) -> u64 {
    let khz = TSC_KHZ.load(Ordering::Relaxed) as u64;
    if khz == 0 {
        0
    } else {
        (u128::from(ticks) * 1_000_000 / u128::from(khz)) as u64
    }
}

/// Sleeps until an interrupt arrives, unless [`IRQ_COUNT`] already moved
/// past `seen`. For waits longer than a few tens of microseconds: the
/// vCPU halts, so its host thread gives the CPU back (to the NPU worker,
/// for one) instead of spinning. Costs one trap to the CPL0 stub.
pub fn idle(seen: u32) {
    // SAFETY: `ud2` traps to the stub's #UD handler, which recognises it,
    // halts until an interrupt unless the count moved, and resumes after it.
    unsafe { asm!("ud2", in("edi") seen, options(nostack)) }
}

/// The guest RAM at `addr..addr + len` as a DMA buffer (RAM is
/// identity-mapped, so the device sees it at the same address). Accesses
/// outside RAM fault in the guest, not in the device.
pub fn phys(addr: u64, len: usize) -> vnpu_driver::DmaBuf {
    vnpu_driver::DmaBuf { virt: addr as *mut u8, phys: addr, len }
}

/// Prints the panic and exits with 101.
pub fn on_panic(info: &core::panic::PanicInfo) -> ! {
    println!("guest panic: {info}");
    exit(101)
}

// ---------------------------------------------------------------- heap

struct Bump;

static HEAP_NEXT: AtomicUsize = AtomicUsize::new(HEAP_START);

// SAFETY: hands out disjoint, aligned blocks from a region nothing else
// uses; never frees (the guests are short-lived).
unsafe impl core::alloc::GlobalAlloc for Bump {
    unsafe fn alloc(&self, l: core::alloc::Layout) -> *mut u8 {
        let mut cur = HEAP_NEXT.load(Ordering::Relaxed);
        loop {
            let start = cur.next_multiple_of(l.align());
            let end = start.saturating_add(l.size());
            if end > HEAP_END {
                return core::ptr::null_mut();
            }
            match HEAP_NEXT.compare_exchange(cur, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return start as *mut u8,
                Err(c) => cur = c,
            }
        }
    }
    unsafe fn dealloc(&self, _p: *mut u8, _l: core::alloc::Layout) {}
}

#[global_allocator]
static ALLOC: Bump = Bump;

// ---------------------------------------------------------------- CPL0 stub

#[repr(C, packed)]
struct Tss {
    _r0: u32,
    rsp0: u64,
    _rest: [u8; 92],
}

static mut TSS: Tss = Tss { _r0: 0, rsp0: KSTACK_TOP, _rest: [0; 92] };

/// null, kernel code 0x08, kernel data 0x10, user code 0x18 (RPL 3: 0x1b),
/// user data 0x20 (0x23), TSS 0x28 (two slots).
static mut GDT: [u64; 7] =
    [0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff, 0x00af_fb00_0000_ffff, 0x00cf_f300_0000_ffff, 0, 0];

#[repr(C, align(16))]
struct Idt([u64; 512]);

static mut IDT: Idt = Idt([0; 512]);

global_asm!(
    ".section .text._start, \"ax\"",
    ".global _start",
    "_start:",
    "mov rsp, {kstack}",
    "call {kmain}",
    "2: hlt",
    "jmp 2b",
    ".text",
    // Exceptions without an error code push a 0 so every frame looks alike.
    ".irp n, 0,1,2,3,4,5,7,9,15,16,18,19,20,22,23,24,25,26,27,28,31",
    "exc_\\n: push 0",
    "push \\n",
    "jmp exc_common",
    ".endr",
    ".irp n, 8,10,11,12,13,14,17,21,29,30",
    "exc_\\n: push \\n",
    "jmp exc_common",
    ".endr",
    // #UD: a `ud2` is the application's request to sleep until the next
    // interrupt (see `idle`); anything else is a real #UD.
    "exc_6:",
    "push rax",
    "mov rax, [rsp + 8]",
    "cmp word ptr [rax], 0x0b0f",
    "jne 5f",
    "add qword ptr [rsp + 8], 2",
    "mov eax, dword ptr [rip + IRQ_COUNT]",
    "cmp eax, edi",
    "jne 4f",
    // sti's one-instruction shadow makes `sti; hlt` atomic: an interrupt
    // that is already pending wakes the hlt instead of being lost.
    "sti",
    "hlt",
    "cli",
    "4: pop rax",
    "iretq",
    "5: pop rax",
    "push 0",
    "push 6",
    "jmp exc_common",
    "exc_common:",
    "mov rdi, [rsp]",
    "mov rsi, [rsp + 8]",
    "mov rdx, [rsp + 16]",
    "mov rsp, {kstack}",
    "call {exception}",
    ".section .rodata",
    ".global EXC_STUBS",
    ".p2align 3",
    "EXC_STUBS:",
    ".irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31",
    ".quad exc_\\n",
    ".endr",
    ".text",
    ".global isr_npu",
    "isr_npu:",
    "push rax",
    "lock inc dword ptr [rip + IRQ_COUNT]",
    "mov eax, 0xfee000b0",
    "mov dword ptr [rax], 0",
    "pop rax",
    "iretq",
    ".global isr_spurious",
    "isr_spurious:",
    "iretq",
    kstack = const KSTACK_TOP,
    kmain = sym kernel_main,
    exception = sym exception,
);

extern "C" {
    static EXC_STUBS: [u64; 32];
    fn isr_npu();
    fn isr_spurious();
}

fn kputs(s: &str) {
    for b in s.bytes() {
        // SAFETY: COM1 data port; CPL0 only (this runs in the stub).
        unsafe { asm!("out dx, al", in("dx") 0x3f8u16, in("al") b, options(nomem, nostack)) }
    }
}

fn khex(v: u64) {
    for i in (0..16).rev() {
        let d = ((v >> (4 * i)) & 0xf) as u8;
        let c = if d < 10 { b'0' + d } else { b'a' + d - 10 };
        // SAFETY: as in `kputs`.
        unsafe { asm!("out dx, al", in("dx") 0x3f8u16, in("al") c, options(nomem, nostack)) }
    }
}

extern "C" fn exception(vector: u64, error: u64, rip: u64) -> ! {
    kputs("guest exception ");
    khex(vector);
    kputs(" error ");
    khex(error);
    kputs(" rip ");
    khex(rip);
    kputs("\n");
    // SAFETY: the exit port; CPL0.
    unsafe { asm!("out dx, eax", in("dx") 0xf4u16, in("eax") 100 + vector as u32, options(nomem, nostack)) };
    loop {
        core::hint::spin_loop();
    }
}

fn gate(handler: u64, dpl: u64) -> (u64, u64) {
    let lo =
        (handler & 0xffff) | (0x08 << 16) | ((0x8e00 | dpl << 13) << 32) | ((handler >> 16) & 0xffff) << 48;
    (lo, handler >> 32)
}

extern "C" fn kernel_main(memory: u64, tsc_khz: u64, payload: u64, payload_len: u64) -> ! {
    MEM_SIZE.store(memory as usize, Ordering::Relaxed);
    TSC_KHZ.store(tsc_khz as usize, Ordering::Relaxed);
    PAYLOAD.store(payload as usize, Ordering::Relaxed);
    PAYLOAD_LEN.store(payload_len as usize, Ordering::Relaxed);
    // SAFETY: single-threaded CPL0 set-up of the descriptor tables, page
    // tables and APIC, before any user code runs.
    unsafe {
        // TSS descriptor (64-bit available TSS) in GDT slots 5 and 6.
        let tss = core::ptr::addr_of!(TSS) as u64;
        let limit = (core::mem::size_of::<Tss>() - 1) as u64;
        let gdt = &mut *core::ptr::addr_of_mut!(GDT);
        gdt[5] = limit | (tss & 0xff_ffff) << 16 | 0x89 << 40 | ((tss >> 24) & 0xff) << 56;
        gdt[6] = tss >> 32;
        let gdtr: [u16; 5] = {
            let b = gdt.as_ptr() as u64;
            [(7 * 8 - 1) as u16, b as u16, (b >> 16) as u16, (b >> 32) as u16, (b >> 48) as u16]
        };
        asm!(
            "lgdt [{g}]",
            "push 0x08",
            "lea {t}, [rip + 3f]",
            "push {t}",
            "retfq",
            "3:",
            "mov {t:e}, 0x10",
            "mov ds, {t:e}",
            "mov es, {t:e}",
            "mov ss, {t:e}",
            "mov {t:e}, 0x28",
            "ltr {t:x}",
            g = in(reg) gdtr.as_ptr(),
            t = out(reg) _,
        );

        let idt = &mut *core::ptr::addr_of_mut!(IDT);
        for (v, h) in EXC_STUBS.iter().enumerate() {
            let (lo, hi) = gate(*h, 0);
            idt.0[2 * v] = lo;
            idt.0[2 * v + 1] = hi;
        }
        let (lo, hi) = gate(isr_npu as *const () as u64, 0);
        idt.0[2 * usize::from(NPU_VECTOR)] = lo;
        idt.0[2 * usize::from(NPU_VECTOR) + 1] = hi;
        let (lo, hi) = gate(isr_spurious as *const () as u64, 0);
        idt.0[2 * 0xff] = lo;
        idt.0[2 * 0xff + 1] = hi;
        let idtr: [u16; 5] = {
            let b = idt.0.as_ptr() as u64;
            [4095, b as u16, (b >> 16) as u16, (b >> 32) as u16, (b >> 48) as u16]
        };
        asm!("lidt [{}]", in(reg) idtr.as_ptr(), options(nostack));

        // Local APIC on (spurious vector 0xff), accept every priority.
        core::ptr::write_volatile((LAPIC + 0xf0) as *mut u32, 0x1ff);
        core::ptr::write_volatile((LAPIC + 0x80) as *mut u32, 0);

        // User bit on the VMM's identity map (PML4[0] -> PDPT[0..4] -> 2 MiB pages).
        let cr3: u64;
        asm!("mov {}, cr3", out(reg) cr3, options(nomem, nostack));
        let mask = 0x000f_ffff_ffff_f000u64;
        let pml4 = (cr3 & mask) as *mut u64;
        *pml4 |= 4;
        let pdpt = (*pml4 & mask) as *mut u64;
        for i in 0..4 {
            let e = pdpt.add(i);
            *e |= 4;
            let pd = (*e & mask) as *mut u64;
            for j in 0..512 {
                *pd.add(j) |= 4;
            }
        }
        asm!("mov cr3, {}", in(reg) cr3, options(nostack));

        // To CPL3 with interrupts enabled.
        asm!(
            "push 0x23",
            "push {sp}",
            "push 0x202",
            "push 0x1b",
            "push {ip}",
            "iretq",
            sp = in(reg) USTACK_TOP,
            ip = in(reg) user_entry as *const () as u64,
            options(noreturn),
        );
    }
}

extern "Rust" {
    /// The application: returns the VM's exit code.
    fn guest_main(env: &mut Env) -> u32;
}

extern "C" fn user_entry() -> ! {
    let memory = MEM_SIZE.load(Ordering::Relaxed) as u64;
    if memory < MIN_MEMORY {
        println!("this guest needs --memory of at least {} MiB", MIN_MEMORY >> 20);
        exit(2);
    }
    let (at, len) = (PAYLOAD.load(Ordering::Relaxed) as u64, PAYLOAD_LEN.load(Ordering::Relaxed));
    let payload =
        (len > 0 && at >= DMA_START && at.saturating_add(len as u64) <= memory).then_some((at, len));
    // DMA memory ends where the payload starts.
    let dma_end = payload.map_or(memory, |(at, _)| at);
    // SAFETY: [DMA_START, dma_end) is RAM nothing else in the guest uses,
    // identity-mapped, and the device sees it at the same addresses.
    let dma = unsafe {
        vnpu_driver::DmaRegion::new(DMA_START as *mut u8, DMA_START, (dma_end - DMA_START) as usize)
    };
    let mut env = Env { memory, tsc_khz: TSC_KHZ.load(Ordering::Relaxed) as u64, dma, payload };
    // SAFETY: `guest_main` is the application's entry, defined once.
    let code = unsafe { guest_main(&mut env) };
    exit(code)
}
