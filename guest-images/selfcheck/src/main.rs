//! GEMM / convolution self-check (runs at CPL3): random shapes, f32 and
//! bf16, with and without accumulate and transposed B, and random
//! convolution geometries (stride, padding). Each case is one request; the
//! guest computes the expected result on its CPU and compares element by
//! element. Exits 0 when every case matches.
#![no_std]
#![no_main]

extern crate alloc;

use guest_rt::vnpu_driver::RunOptions;
use guest_rt::{phys, println, Env};
use vnpu_abi::DType;
use vnpu_guest_programs::selfcheck::{self, Case, Rng};

const CASES: usize = 60;
const SEED: u64 = 2026;
/// Case buffers in guest memory (identity-mapped, above the DMA allocations).
const BASE: u64 = 0x300_0000;

#[no_mangle]
fn guest_main(env: &mut Env) -> u32 {
    let Some((_, mut npu)) = guest_rt::vnpu::open_first(env) else { return 1 };
    let mut rng = Rng::new(SEED);
    let (mut ok, mut counts) = (0, [0usize; 4]);
    for i in 0..CASES {
        let case = selfcheck::case(&mut rng, i);
        let p = selfcheck::prepare(case.clone(), &mut rng, BASE);
        for (addr, bytes) in &p.inputs {
            phys(*addr, bytes.len()).write(0, bytes);
        }
        let prog = match npu.load(&mut env.dma, &p.program.encode()) {
            Ok(b) => b,
            Err(e) => {
                println!("case {i}: {e}");
                return 1;
            }
        };
        if let Err(e) = npu.run(&prog, &RunOptions::default()) {
            println!("case {i} {case:?}: {e}");
            continue;
        }
        let mut got = alloc::vec![0f32; p.expected.len()];
        phys(p.output, 4 * got.len()).read_f32s(0, &mut got);
        match selfcheck::matches(&p, &got) {
            Ok(()) => ok += 1,
            Err((at, g, e)) => println!("case {i} {case:?}: element {at} is {g}, expected {e}"),
        }
        counts[match case {
            Case::MatMul { dtype, .. } => usize::from(dtype == DType::Bf16),
            Case::Conv { dtype, .. } => 2 + usize::from(dtype == DType::Bf16),
        }] += 1;
    }
    println!(
        "selfcheck: {ok}/{CASES} cases match the CPU (matmul f32 {}, matmul bf16 {}, conv f32 {}, conv bf16 {}; seed {SEED})",
        counts[0], counts[1], counts[2], counts[3]
    );
    u32::from(ok != CASES)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    guest_rt::on_panic(info)
}
