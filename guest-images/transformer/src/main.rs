//! One Transformer encoder layer on the vNPU (runs at CPL3): 16 tokens,
//! width 64, 4 heads, feed-forward 128; Q/K/V, attention scores, context,
//! projections and feed-forward on the SA; bias, scaling, softmax,
//! residuals, layer norms and GELU on the VU. The guest computes the same
//! layer on its CPU and compares. Exits 0 when every output is within 1e-3.
#![no_std]
#![no_main]

extern crate alloc;

use guest_rt::vnpu_driver::RunOptions;
use guest_rt::{phys, println, rdtsc, tsc_to_ns, Env};
use vnpu_guest_programs::transformer::{self, Shape};

/// BERT-like proportions.
const SHAPE: Shape = Shape { seq: 16, d: 64, heads: 4, ffn: 128 };
/// A long, narrow sequence: 128 x 128 attention scores per layer.
const LONG_SHAPE: Shape = Shape { seq: 128, d: 16, heads: 1, ffn: 16 };
const WEIGHTS: u64 = 0x300_0000;
const X: u64 = 0x310_0000;
const OUT: u64 = 0x318_0000;

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((_, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    let mut ok = true;
    for (shape, what) in [(SHAPE, "BERT-like"), (LONG_SHAPE, "long sequence")] {
        ok &= layer(&mut npu, env, shape, what);
    }
    u32::from(!ok)
}

fn layer(
    npu: &mut guest_rt::vnpu_driver::Vnpu<guest_rt::vnpu_driver::MmioBar>,
    env: &mut Env,
    shape: Shape,
    what: &str,
) -> bool {
    let h = npu.hierarchy();
    if h.sram_per_core < transformer::sram_bytes(shape) {
        println!("this guest needs {} KiB of SRAM per core", transformer::sram_bytes(shape) >> 10);
        return false;
    }
    let w = transformer::Weights::random(shape, 1);
    let x = transformer::random_input(shape, 2);
    let wb = w.bytes();
    phys(WEIGHTS, wb.len()).write(0, &wb);
    phys(X, 4 * x.len()).write_f32s(0, &x);
    let prog = match npu.load(&mut env.dma, &transformer::program(shape, WEIGHTS, X, OUT).encode()) {
        Ok(p) => p,
        Err(e) => {
            println!("{e}");
            return false;
        }
    };
    let t0 = rdtsc();
    let st = match npu
        .run(&prog, &RunOptions { wait: guest_rt::vnpu_driver::Wait::Interrupt, ..Default::default() })
    {
        Ok(s) => s,
        Err(e) => {
            println!("layer failed: {e}");
            return false;
        }
    };
    let wall = tsc_to_ns(rdtsc() - t0);
    let mut got = alloc::vec![0f32; x.len()];
    phys(OUT, 4 * got.len()).read_f32s(0, &mut got);
    let want = transformer::cpu(&w, &x);
    let err = vnpu_guest_programs::max_abs_error(&got, &want);
    println!(
        "transformer layer ({what}) seq {} d {} heads {} ffn {}: {} simulated cycles (SA active {}, VU active {}), {} us guest wall",
        shape.seq, shape.d, shape.heads, shape.ffn, st.cycles, st.sa_active, st.vu_active, wall / 1000
    );
    let ok = err < 1e-3;
    println!("transformer ({what}): max abs error vs CPU {err:e} ({})", if ok { "ok" } else { "MISMATCH" });
    ok
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
