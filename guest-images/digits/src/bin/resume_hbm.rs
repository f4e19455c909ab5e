//! The live-migration test's guest (runs at CPL3): fills the first vNPU's
//! HBM (1 GiB, a `type=small` vNPU's whole HBM) with a pattern from guest
//! RAM, then runs `guest_apps::digits::classify_rounds` and, after every
//! round, writes 4 KiB tagged with the round into HBM (a chunk of its
//! own each round: what a migration's pre-copy must send again). At the
//! end it reads back every round's 4 KiB and a sample of the pattern
//! and prints how many differ. Exits 0 only when every answer matched the
//! CPU's and HBM holds what was written.
#![no_std]
#![no_main]

use guest_rt::vnpu_driver::{DmaBuf, DmaRegion, RunOptions, Vnpu};
use guest_rt::{println, Env};
use vnpu_abi::{Addr, Engine, Instr, ProgramBuilder};

#[path = "../bare_metal.rs"]
mod bare_metal;
use bare_metal::BareMetal;

/// Rounds over the held-out digits.
const ROUNDS: u32 = 200;
const MIB: u64 = 1 << 20;
/// HBM filled before the rounds.
const FILL: u64 = 1 << 30;
/// HBM per fill request.
const PIECE: u64 = 64 * MIB;
/// Bytes written after each round, and where.
const TAG: usize = 4096;
fn tag_at(r: u32) -> u64 {
    u64::from(r) * 5 * MIB + 12345
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 12)) as u8
}

fn copy(src: Addr, dst: Addr, rows: u32, row_bytes: u32, src_stride: u64, dst_stride: u64) -> ProgramBuilder {
    let mut p = ProgramBuilder::new();
    p.push(Engine::DMA, Instr::DmaCopy { src, dst, rows, row_bytes, src_stride, dst_stride });
    p
}

fn run<B: guest_rt::vnpu_driver::Bar>(npu: &mut Vnpu<B>, dma: &mut DmaRegion, p: ProgramBuilder, what: &str) -> bool {
    let opts = RunOptions { wait: guest_rt::vnpu_driver::Wait::Interrupt, ..Default::default() };
    let bytes = p.finish().encode();
    match npu.load(dma, &bytes).and_then(|prog| npu.run(&prog, &opts)) {
        Ok(_) => true,
        Err(e) => {
            println!("{what}: {e}");
            false
        }
    }
}

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((slot, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    println!("vnpu at 00:{slot:02x}.0");
    let (Ok(src), Ok(tag), Ok(chk)) =
        (env.dma.alloc(MIB as usize, 4096), env.dma.alloc(TAG, 4096), env.dma.alloc(TAG, 4096))
    else {
        println!("no DMA memory for the HBM buffers");
        return 1;
    };
    let mut row = [0u8; TAG];
    for off in (0..MIB as usize).step_by(TAG) {
        for (i, b) in row.iter_mut().enumerate() {
            *b = pattern(off + i);
        }
        src.write(off, &row);
    }
    for k in 0..FILL / PIECE {
        let p = copy(Addr::guest(src.phys), Addr::hbm(k * PIECE), (PIECE / MIB) as u32, MIB as u32, 0, MIB);
        if !run(&mut npu, &mut env.dma, p, "filling HBM") {
            return 1;
        }
    }
    println!("hbm filled: {} MiB", FILL / MIB);
    let p = BareMetal { memory: env.memory };
    let tagged = |t: &DmaBuf, r: u32| t.write(0, &[(r % 251) as u8 + 1; TAG]);
    let mut each = |npu: &mut Vnpu<_>, dma: &mut DmaRegion, r: u32| {
        tagged(&tag, r);
        run(npu, dma, copy(Addr::guest(tag.phys), Addr::hbm(tag_at(r)), 1, TAG as u32, 0, 0), "tagging HBM")
    };
    let ok = guest_apps::digits::classify_rounds_with(&mut npu, &mut env.dma, &p, ROUNDS, &mut each);
    let (mut bad, mut n) = (0u32, 0u32);
    let mut got = [0u8; TAG];
    for r in 0..ROUNDS {
        if !run(&mut npu, &mut env.dma, copy(Addr::hbm(tag_at(r)), Addr::guest(chk.phys), 1, TAG as u32, 0, 0), "reading HBM") {
            return 1;
        }
        chk.read(0, &mut got);
        n += 1;
        bad += u32::from(got.iter().any(|&b| b != (r % 251) as u8 + 1));
    }
    for k in (0..FILL / MIB).step_by(7) {
        if !run(&mut npu, &mut env.dma, copy(Addr::hbm(k * MIB), Addr::guest(chk.phys), 1, TAG as u32, 0, 0), "reading HBM") {
            return 1;
        }
        chk.read(0, &mut got);
        n += 1;
        bad += u32::from(got.iter().enumerate().any(|(i, &b)| b != pattern(i)));
    }
    println!("hbm check: {bad} of {n} ranges differ");
    u32::from(!(ok && bad == 0))
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
