//! A DLRM-like recommendation model on the vNPU (runs at CPL3): embedding
//! bags gathered from an HBM table by the DMA engine and summed on the VU,
//! then a 64-16-1 MLP on the SA. VU-heavy, as DLRM is. Ten batches of 128
//! samples with random lookups; every click probability is compared with
//! the guest CPU's. Exits 0 when all match within 1e-5.
#![no_std]
#![no_main]

extern crate alloc;

use guest_rt::vnpu_driver::{RunOptions, Wait};
use guest_rt::{phys, println, Env};
use vnpu_guest_programs::recsys;

const BATCH: usize = 128;
const BATCHES: u64 = 10;
const TABLE: u64 = 0x300_0000;
const MLP: u64 = 0x310_0000;
const INDICES: u64 = 0x318_0000;
const OUT: u64 = 0x31c_0000;

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((_, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    if npu.hierarchy().sram_per_core < recsys::sram_bytes(BATCH) {
        println!("this guest needs {} KiB of SRAM per core", recsys::sram_bytes(BATCH) >> 10);
        return 1;
    }
    let m = recsys::Model::random(5);
    let (table, mlp) = recsys::weight_bytes(&m);
    phys(TABLE, table.len()).write(0, &table);
    phys(MLP, mlp.len()).write(0, &mlp);
    let run = |npu: &mut guest_rt::vnpu_driver::Vnpu<_>, env: &mut Env, bytes: &[u8]| {
        npu.load(&mut env.dma, bytes)
            .and_then(|p| npu.run(&p, &RunOptions { wait: Wait::Interrupt, ..Default::default() }))
    };
    if let Err(e) = run(&mut npu, env, &recsys::load(TABLE, MLP).encode()) {
        println!("loading the model failed: {e}");
        return 1;
    }
    let infer = match npu.load(&mut env.dma, &recsys::infer(BATCH, INDICES, OUT).encode()) {
        Ok(p) => p,
        Err(e) => {
            println!("{e}");
            return 1;
        }
    };
    let (mut worst, mut sa, mut vu, mut cycles) = (0f32, 0u64, 0u64, 0u64);
    for b in 0..BATCHES {
        let idx = recsys::random_indices(BATCH, 100 + b);
        let bytes: alloc::vec::Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
        phys(INDICES, bytes.len()).write(0, &bytes);
        let st = match npu.run(&infer, &RunOptions { wait: Wait::Interrupt, ..Default::default() }) {
            Ok(s) => s,
            Err(e) => {
                println!("batch {b} failed: {e}");
                return 1;
            }
        };
        (sa, vu, cycles) = (sa + st.sa_active, vu + st.vu_active, cycles + st.cycles);
        let mut got = alloc::vec![0f32; BATCH];
        phys(OUT, 4 * BATCH).read_f32s(0, &mut got);
        let want = recsys::cpu(&m, &idx);
        worst = vnpu_guest_programs::worst(worst, vnpu_guest_programs::max_abs_error(&got, &want));
    }
    println!(
        "recsys: {BATCHES} batches of {BATCH}: {cycles} simulated cycles, SA active {sa}, VU active {vu} (a = {:.3})",
        sa as f64 / vu.max(1) as f64
    );
    let ok = worst < 1e-5;
    println!("recsys: max abs error vs CPU {worst:e} ({})", if ok { "ok" } else { "MISMATCH" });
    u32::from(!ok)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
