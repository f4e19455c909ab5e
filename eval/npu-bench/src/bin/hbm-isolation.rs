//! Performance isolation through HBM bandwidth partitioning: a
//! victim vNPU (1 SA + 1 VU, a workload of the library) on one core next to
//! three 1 SA + 1 VU neighbours that either stream HBM back to back
//! (heavy) or compute without touching HBM (quiet), under the board's two
//! policies, `hbm.partition = "shared"` (max-min fair) and `"equal"` (each
//! of the 4 vNPUs owns a quarter). Prints the victim's simulated time and
//! its slowdown against running alone on the core.
//!
//! `cargo build --release -p npu-bench && target/release/hbm-isolation [--board FILE]`

use clap::Parser;
use npu_bench::BoardArg;
use npu_model::config::HbmPartition;
use npu_model::{run_core, run_program, Tenant};
use npu_workloads::{lower_workload, RunOptions};
use vnpu_abi::{Addr, Engine, Instr, Program, ProgramBuilder, UnOp};

fn heavy(bytes: u32, n: usize) -> Program {
    let mut p = ProgramBuilder::new();
    for i in 0..n {
        let dst = Addr::sram((i % 2) as u64 * u64::from(bytes));
        p.push(
            Engine::DMA,
            Instr::DmaCopy {
                src: Addr::hbm(0),
                dst,
                rows: 1,
                row_bytes: bytes,
                src_stride: 0,
                dst_stride: 0,
            },
        );
    }
    p.finish()
}

fn quiet(len: u32, n: usize) -> Program {
    let mut p = ProgramBuilder::new();
    for _ in 0..n {
        p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len });
    }
    p.finish()
}

/// Performance isolation through HBM bandwidth partitioning: a victim
/// vNPU beside three neighbours that stream HBM (heavy) or not (quiet),
/// under the board's `shared` and `equal` HBM policies.
#[derive(Parser, Debug)]
#[command(name = "hbm-isolation")]
struct Args {
    #[command(flatten)]
    board: BoardArg,
}

fn main() {
    let mut board = match Args::parse().board.load() {
        Ok(b) => b,
        Err(e) => npu_bench::fail("hbm-isolation", &e),
    };
    println!(
        "{:<10} {:>5} {:>9} | {:>12} {:>12} {:>12} | {:>12} {:>12} {:>12}",
        "victim",
        "batch",
        "policy",
        "alone us",
        "+3 quiet",
        "+3 heavy",
        "slow quiet",
        "slow heavy",
        "heavy/quiet"
    );
    for (name, batch) in [("dlrm", 8u32), ("ncf", 8), ("mobilenet", 1), ("bert", 1), ("resnet50", 1)] {
        let o = RunOptions {
            sram_bytes: Some(8 << 20),
            hbm_bytes: Some(8 << 30),
            ..RunOptions::on_board(&board, name, batch)
        };
        let victim = match lower_workload(&board, &o) {
            Ok((l, _, _)) => l.program,
            Err(e) => {
                println!("{name}: {e}");
                continue;
            }
        };
        for policy in [HbmPartition::Shared, HbmPartition::Equal] {
            board.hbm.partition = policy;
            let us = |cycles: f64| cycles / f64::from(board.clock_mhz);
            let alone = run_program(&board, &victim, None, None).map(|r| r.cycles).unwrap_or(f64::NAN);
            // Neighbours long enough to cover the victim's whole run.
            let span = (alone * 2.0).max(1e6);
            let h = heavy(1 << 22, (span / 10_000.0).ceil() as usize);
            let q = quiet(1 << 20, (span / 1_000.0).ceil() as usize);
            let with = |n: &Program| {
                let mut ts = vec![Tenant { program: &victim, memory: None, max_cycles: None }];
                for _ in 0..3 {
                    ts.push(Tenant { program: n, memory: None, max_cycles: None });
                }
                run_core(&board, &mut ts).tenants[0].as_ref().map(|r| r.cycles).unwrap_or(f64::NAN)
            };
            let (wq, wh) = (with(&q), with(&h));
            println!(
                "{name:<10} {batch:>5} {:>9} | {:>12.1} {:>12.1} {:>12.1} | {:>11.3}x {:>11.3}x {:>11.3}x",
                format!("{policy:?}").to_lowercase(),
                us(alone),
                us(wq),
                us(wh),
                wq / alone,
                wh / alone,
                wh / wq
            );
        }
    }
}
