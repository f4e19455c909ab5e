//! Verifier throughput and cost: for every workload of
//! the library, lowered for a 1 SA + 1 VU vNPU core at batch 1 and 8, the
//! host time the static verifier takes on the whole program (median of
//! repeated runs) against the simulated NPU time of the program. Prints a
//! table and, last, the worst fraction.
//!
//! `cargo build --release -p npu-bench && target/release/verifier-bench [--board FILE]`

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use npu_bench::BoardArg;
use npu_model::{verify, VnpuLimits};
use npu_workloads::{lower_workload, run_workload, RunOptions, WORKLOADS};

/// Verifier throughput and cost: the host time the static verifier takes
/// on every library workload's program (1 SA + 1 VU, batch 1 and 8)
/// against the program's simulated NPU time.
#[derive(Parser, Debug)]
#[command(name = "verifier-bench")]
struct Args {
    #[command(flatten)]
    board: BoardArg,
}

fn main() -> ExitCode {
    let board = match Args::parse().board.load() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("verifier-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "{:<13} {:>5} {:>8} {:>12} {:>14} {:>14} {:>10}",
        "workload", "batch", "instrs", "verify us", "instr/s", "simulated us", "fraction"
    );
    let mut worst = 0f64;
    // A workload that cannot be lowered or run fails the benchmark.
    let mut failed = false;
    let (mut total_instrs, mut total_secs) = (0usize, 0f64);
    for (name, _) in WORKLOADS {
        for batch in [1u32, 8] {
            let o = RunOptions::timing(*name, batch);
            let (lowered, shape, _) = match lower_workload(&board, &o) {
                Ok(l) => l,
                Err(e) => {
                    println!("{name:<13} {batch:>5} cannot lower: {e}");
                    failed = true;
                    continue;
                }
            };
            let report = match run_workload(&board, &o) {
                Ok(r) => r,
                Err(e) => {
                    println!("{name:<13} {batch:>5} cannot run: {e}");
                    failed = true;
                    continue;
                }
            };
            let limits = VnpuLimits {
                sa: 1,
                vu: 1,
                sram_bytes: shape.sram_bytes,
                hbm_bytes: shape.hbm_bytes,
                guest: std::iter::once(0..1 << 30).collect(),
                borrow_sa: 0,
                borrow_vu: 0,
            };
            let mut times = Vec::new();
            let t_all = Instant::now();
            while times.len() < 5 || (t_all.elapsed().as_secs_f64() < 0.2 && times.len() < 1000) {
                let t0 = Instant::now();
                let ok = verify(&lowered.program, &limits).is_ok();
                times.push(t0.elapsed().as_secs_f64());
                assert!(ok, "{name} does not verify");
            }
            times.sort_by(f64::total_cmp);
            let secs = times[times.len() / 2];
            let n = lowered.program.instruction_count();
            let frac = secs / report.simulated_seconds;
            worst = worst.max(frac);
            total_instrs += n;
            total_secs += secs;
            println!(
                "{name:<13} {batch:>5} {n:>8} {:>12.1} {:>14.3e} {:>14.1} {:>9.4}%",
                secs * 1e6,
                n as f64 / secs,
                report.simulated_seconds * 1e6,
                100.0 * frac
            );
        }
    }
    println!("overall verifier throughput {:.3e} instructions/s", total_instrs as f64 / total_secs);
    println!("worst verifier cost: {:.4}% of simulated execution time (target <= 1%)", 100.0 * worst);
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
