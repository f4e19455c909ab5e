//! Live remap (runs at CPL3): prints its vNPU's grant, waits (up to 60 s)
//! for the host to change it (`vnpu remap` of the managed instance the VM
//! runs with), prints the new grant, configures the vNPU to it and runs a
//! 4x4 product on every SA of the new configuration, each checked against
//! the guest's CPU. Exits 0 when all match, 2 when the grant never
//! changed, 1 on any other failure.
#![no_std]
#![no_main]

extern crate alloc;

use guest_rt::vnpu_driver::{Hierarchy, RunOptions};
use guest_rt::{phys, println, rdtsc, tsc_to_ns, Env};
use vnpu_abi::{Addr, DType, Engine, Instr, MatFlags, ProgramBuilder};

/// Operands and results in guest memory (identity-mapped, above the DMA
/// allocations).
const BASE: u64 = 0x300_0000;
const WAIT_NS: u64 = 60_000_000_000;

/// One 4x4 product per SA: A and B from guest memory into SRAM, SA `i`
/// writes its C at SRAM 128 + 64 i, all Cs back to guest memory.
fn program(sas: u32) -> alloc::vec::Vec<u8> {
    let mut p = ProgramBuilder::new();
    let copy = |src, dst, bytes: u32| Instr::DmaCopy {
        src,
        dst,
        rows: 1,
        row_bytes: bytes,
        src_stride: 0,
        dst_stride: 0,
    };
    p.push(Engine::DMA, copy(Addr::guest(BASE), Addr::sram(0), 128));
    for i in 0..sas {
        let sa = Engine::sa(i as u8);
        p.sync(Engine::DMA, sa, i as u8);
        p.push(
            sa,
            Instr::MatMul {
                dtype: DType::F32,
                flags: MatFlags::default(),
                a: 0,
                b: 64,
                c: 128 + 64 * u64::from(i),
                m: 4,
                k: 4,
                n: 4,
                lda: 4,
                ldb: 4,
                ldc: 4,
            },
        );
        p.sync(sa, Engine::DMA, 32 + i as u8);
    }
    p.push(Engine::DMA, copy(Addr::sram(128), Addr::guest(BASE + 4096), 64 * sas));
    p.finish().encode()
}

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((_, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    let Ok(g) = npu.grant() else { return 1 };
    println!("regrant: grant {} SA + {} VU", g.0, g.1);
    let start = rdtsc();
    while !npu.grant_changed() {
        if tsc_to_ns(rdtsc() - start) > WAIT_NS {
            println!("regrant: the grant did not change");
            return 2;
        }
        // About 100 us between polls (each is a register read exit).
        let t = rdtsc();
        while tsc_to_ns(rdtsc() - t) < 100_000 {}
    }
    let Ok(g) = npu.grant() else { return 1 };
    println!("regrant: grant changed to {} SA + {} VU", g.0, g.1);
    let h = Hierarchy { sa_per_core: g.0, vu_per_core: g.1, ..npu.hierarchy() };
    if let Err(e) = npu.configure(&h) {
        println!("regrant: configure: {e}");
        return 1;
    }
    let (a, b): ([f32; 16], [f32; 16]) =
        (core::array::from_fn(|i| i as f32 - 3.0), core::array::from_fn(|i| (i % 5) as f32));
    let input = phys(BASE, 128);
    for (i, v) in a.iter().chain(b.iter()).enumerate() {
        input.write(4 * i, &v.to_le_bytes());
    }
    let prog = match npu.load(&mut env.dma, &program(h.sa_per_core)) {
        Ok(p) => p,
        Err(e) => {
            println!("regrant: load: {e}");
            return 1;
        }
    };
    if let Err(e) = npu.run(&prog, &RunOptions::default()) {
        println!("regrant: run: {e}");
        return 1;
    }
    let mut got = alloc::vec![0f32; 16 * h.sa_per_core as usize];
    phys(BASE + 4096, 4 * got.len()).read_f32s(0, &mut got);
    for (s, c) in got.chunks(16).enumerate() {
        for r in 0..4 {
            for col in 0..4 {
                let want: f32 = (0..4).map(|k| a[r * 4 + k] * b[k * 4 + col]).sum();
                if c[r * 4 + col] != want {
                    println!("regrant: SA {s} element ({r}, {col}) is {}, expected {want}", c[r * 4 + col]);
                    return 1;
                }
            }
        }
    }
    println!("regrant: ran on {} SAs: ok", h.sa_per_core);
    0
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
