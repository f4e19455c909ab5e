//! SA functional GEMM throughput, end to end through SA instructions on
//! the model (DMA from guest memory to SRAM, sa.matmul, DMA back), against
//! OpenBLAS `cblas_sgemm` called on the same matrices in the same run.
//!
//! Usage: gemm-bench [--runs N] [--board FILE] (`--help`).
//! Needs OpenBLAS at run time (Debian: libopenblas0); it is loaded with
//! dlopen so the workspace builds without it.

use std::process::ExitCode;

use clap::Parser;
use libloading::{Library, Symbol};
use npu_bench::{interleaved_medians, values, BoardArg};
use npu_model::kernels::{gemm_f32, GemmShape};
use npu_model::memory::{read_f32s, write_f32s};
use npu_model::{run_program, CoreMemory, LazyHbm, Sram, VecGuestMemory};
use vnpu_abi::{Addr, DType, Engine, Instr, MatFlags, ProgramBuilder};

type Sgemm = unsafe extern "C" fn(
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    *const f32,
    i32,
    *const f32,
    i32,
    f32,
    *mut f32,
    i32,
);
const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;

fn open_blas() -> Result<(Library, String), String> {
    for name in ["libopenblas.so.0", "libopenblas.so", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"] {
        // SAFETY: loading OpenBLAS runs its initialisers, which only set up
        // its thread pool and CPU dispatch; nothing else in this process
        // depends on them.
        if let Ok(lib) = unsafe { Library::new(name) } {
            return Ok((lib, name.to_string()));
        }
    }
    Err("OpenBLAS not found (install Debian's libopenblas0: bash scripts/setup-bench.sh)".into())
}

/// SA functional GEMM throughput on the model, end to end through SA
/// instructions, against OpenBLAS `cblas_sgemm` on the same matrices in
/// the same run (host wall time, medians of alternating blocks).
#[derive(Parser, Debug)]
#[command(name = "gemm-bench")]
struct Args {
    /// Runs per side and size (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    runs: u64,
    #[command(flatten)]
    board: BoardArg,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runs = args.runs as usize;
    let board = match args.board.load() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gemm-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (lib, libname) = match open_blas() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("gemm-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    // SAFETY: `cblas_sgemm` has this C signature in every CBLAS.
    let sgemm: Symbol<Sgemm> = match unsafe { lib.get(b"cblas_sgemm\0") } {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gemm-bench: {libname} has no cblas_sgemm: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("# SA GEMM (f32) end to end on the model vs OpenBLAS ({libname}), median of {runs} runs in alternating blocks, host wall time");
    println!(
        "{:>6} {:>6} {:>6} {:>12} {:>12} {:>12} {:>8}",
        "M", "K", "N", "model GF/s", "gemm GF/s", "BLAS GF/s", "ratio"
    );
    let mut worst = f64::INFINITY;
    for (m, k, n) in [(1024usize, 1024usize, 1024usize), (8192, 512, 64), (2048, 2048, 256)] {
        let a = values(1, m * k);
        let b = values(2, k * n);
        let (ga, gb, gc) = (0u64, (m * k * 4) as u64, ((m * k + k * n) * 4) as u64);
        let mut guest = VecGuestMemory::new(0, (m * k + k * n + m * n) * 4);
        write_f32s(&mut guest, ga, &a).ok();
        write_f32s(&mut guest, gb, &b).ok();
        let sram_bytes = ((m * k + k * n + m * n) * 4).next_multiple_of(2 << 20) as u64;
        let (sa, sb, sc) = (0u64, (m * k * 4) as u64, ((m * k + k * n) * 4) as u64);
        let mut p = ProgramBuilder::new();
        let dma = |src, dst, bytes: usize| Instr::copy(src, dst, bytes as u32);
        p.push(Engine::DMA, dma(Addr::guest(ga), Addr::sram(sa), m * k * 4));
        p.push(Engine::DMA, dma(Addr::guest(gb), Addr::sram(sb), k * n * 4));
        p.sync(Engine::DMA, Engine::sa(0), 0);
        p.push(
            Engine::sa(0),
            Instr::MatMul {
                dtype: DType::F32,
                flags: MatFlags::default(),
                a: sa,
                b: sb,
                c: sc,
                m: m as u32,
                k: k as u32,
                n: n as u32,
                lda: k as u32,
                ldb: n as u32,
                ldc: n as u32,
            },
        );
        p.sync(Engine::sa(0), Engine::DMA, 1);
        p.push(Engine::DMA, dma(Addr::sram(sc), Addr::guest(gc), m * n * 4));
        let prog = p.finish();
        let mut sram = Sram::new(sram_bytes);
        let mut hbm = LazyHbm::new(1 << 20);
        let mut c = vec![0.0f32; m * n];
        let mut c2 = vec![0.0f32; m * n];
        let shape = GemmShape { m, k, n, b_transposed: false, accumulate: false };
        let mut model = || {
            let mem = CoreMemory { sram: &mut sram, hbm: &mut hbm, guest: &mut guest };
            if let Err(e) = run_program(&board, &prog, Some(mem), None) {
                eprintln!("gemm-bench: model run failed: {e}");
            }
        };
        let mut blas = || {
            // SAFETY: a, b and c hold m*k, k*n and m*n f32 in row-major
            // order with the leading dimensions given; they outlive the call.
            unsafe {
                sgemm(
                    ROW_MAJOR,
                    NO_TRANS,
                    NO_TRANS,
                    m as i32,
                    n as i32,
                    k as i32,
                    1.0,
                    a.as_ptr(),
                    k as i32,
                    b.as_ptr(),
                    n as i32,
                    0.0,
                    c.as_mut_ptr(),
                    n as i32,
                )
            }
        };
        let mut direct = || gemm_f32(&a, &b, &mut c2, shape);
        let t = interleaved_medians(runs, &mut [&mut model, &mut blas, &mut direct]);
        let (t_model, t_blas, t_crate) = (t[0], t[1], t[2]);
        let got = read_f32s(&guest, gc, m * n).unwrap_or_default();
        let max_err = vnpu_guest_programs::max_rel_error(&got, &c);
        // Written so that NaN (and a length mismatch: infinity) fails.
        let agree = max_err <= 1e-3;
        if !agree {
            eprintln!("gemm-bench: model and BLAS results differ (max rel err {max_err})");
            return ExitCode::FAILURE;
        }
        let flops = 2.0 * (m * k * n) as f64;
        let ratio = t_blas / t_model;
        worst = worst.min(ratio);
        println!(
            "{m:>6} {k:>6} {n:>6} {:>12.1} {:>12.1} {:>12.1} {:>8.3}",
            flops / t_model / 1e9,
            flops / t_crate / 1e9,
            flops / t_blas / 1e9,
            ratio
        );
    }
    println!("(model: end to end through dma + sa.matmul on the model; gemm: the gemm crate called directly; BLAS: cblas_sgemm)");
    println!("ratio (model throughput / OpenBLAS throughput, worst shape): {worst:.3}");
    ExitCode::SUCCESS
}
