//! The board runtime's cost per request (docs/benchmarks.md): the same
//! request run, on one clock in one process, round by round in rotating
//! order, for two requests (one 64-byte DMA from HBM; the digits CNN on
//! one image, as the `digits` guest runs it):
//!
//! - `private`: `npu_model::run_program` on the calling thread (what the
//!   in-process device does for a vNPU on a core of its own);
//! - `board`: `SharedCore::run` on a board runtime, alone on the board
//!   (what the daemon does: the request goes to the board's engine thread
//!   and its result comes back);
//! - `board+idle`: the same beside a neighbour that ran one request and
//!   has been idle since (longer than the runtime's 1 ms activity window).
//!
//! Usage: runtime-handoff [--rounds N] [--requests M]
//! Prints min / median / max over rounds of each round's median
//! microseconds per request, and of the per-round ratio to `private`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use npu_bench::BoardArg;
use npu_board_runtime::{Claim, CoreMem, SharedBoard, SharedCore};
use npu_model::{run_program, BoardConfig, CoreMemory, LazyHbm, Sram, VecGuestMemory};
use vnpu_abi::{Addr, Engine, Instr, Program, ProgramBuilder};

/// Guest memory of the requests: the CNN's image at 0, logits at 4096.
const GUEST_BYTES: usize = 8192;

fn programs() -> [(&'static str, Arc<Program>); 2] {
    let plan = vnpu_guest_programs::digits::SramPlan { base: 0 };
    [
        ("64-byte DMA", dma_program()),
        ("digits CNN batch 1", Arc::new(vnpu_guest_programs::digits::cnn_infer(plan, 1, 0, 4096))),
    ]
}

fn dma_program() -> Arc<Program> {
    let mut p = ProgramBuilder::new();
    p.push(Engine::DMA, Instr::copy(Addr::hbm(0), Addr::sram(0), 64));
    Arc::new(p.finish())
}

fn fresh_mem() -> CoreMem {
    CoreMem { sram: Sram::new(2 << 20), hbm: LazyHbm::new(1 << 20) }
}

/// One request on `core` for `tenant`; its memory comes back.
fn shared_request(
    core: &SharedCore,
    tenant: &str,
    program: &Arc<Program>,
    mem: CoreMem,
) -> Result<CoreMem, String> {
    let claim = Claim { sa: 1, vu: 1, ..Claim::default() };
    let guest = Box::new(VecGuestMemory { base: 0, bytes: vec![0; GUEST_BYTES] });
    let (back, r, _, _) = core
        .run(tenant, claim, Arc::clone(program), mem, guest, 1 << 30, 1 << 28)
        .ok_or("the board stopped")?;
    r.map_err(|e| e.to_string())?;
    Ok(back)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    match v.as_slice() {
        [] => (f64::NAN, f64::NAN, f64::NAN),
        s => (s[0], s[s.len() / 2], s[s.len() - 1]),
    }
}

fn run(board: &BoardConfig, rounds: usize, requests: usize) -> Result<(), String> {
    for (what, program) in programs() {
        measure(board, what, &program, rounds, requests)?;
    }
    Ok(())
}

fn measure(
    board: &BoardConfig,
    what: &str,
    program: &Arc<Program>,
    rounds: usize,
    requests: usize,
) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    let alone = SharedBoard::new(board, "alone").map_err(io)?;
    let beside = SharedBoard::new(board, "beside").map_err(io)?;
    let (alone_core, beside_core) = (alone.core(0).ok_or("no core 0")?, beside.core(0).ok_or("no core 0")?);
    // The neighbour's one request, then it stays idle.
    shared_request(&beside_core, "idle neighbour", program, fresh_mem())?;
    std::thread::sleep(Duration::from_millis(5));

    let names = ["private", "board", "board+idle"];
    let mut per_round: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let (mut private_mem, mut alone_mem, mut beside_mem) = (fresh_mem(), fresh_mem(), fresh_mem());
    for round in 0..rounds {
        for k in 0..names.len() {
            let side = (round + k) % names.len();
            let mut times = Vec::with_capacity(requests);
            for _ in 0..requests {
                let t = Instant::now();
                match side {
                    0 => {
                        let mut guest = VecGuestMemory { base: 0, bytes: vec![0; GUEST_BYTES] };
                        let mem = CoreMemory {
                            sram: &mut private_mem.sram,
                            hbm: &mut private_mem.hbm,
                            guest: &mut guest,
                        };
                        run_program(board, program, Some(mem), Some(1 << 30)).map_err(|e| e.to_string())?;
                    }
                    1 => alone_mem = shared_request(&alone_core, "tenant", program, alone_mem)?,
                    _ => beside_mem = shared_request(&beside_core, "tenant", program, beside_mem)?,
                }
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            per_round[side].push(median(times));
        }
        eprintln!("{what}: round {}/{rounds} done", round + 1);
    }
    alone.stop();
    beside.stop();
    println!(
        "{what}: {rounds} rounds of {requests} requests; us per request (median of a round): min / median / max"
    );
    println!("{:<12} {:>26} {:>26}", "side", "us per request", "ratio to private");
    for (i, name) in names.iter().enumerate() {
        let (lo, mid, hi) = spread(per_round[i].clone());
        let ratios: Vec<f64> = per_round[i].iter().zip(&per_round[0]).map(|(a, b)| a / b).collect();
        let (rlo, rmid, rhi) = spread(ratios);
        println!(
            "{name:<12} {:>26} {:>26}",
            format!("{lo:.1} / {mid:.1} / {hi:.1}"),
            format!("{rlo:.2} / {rmid:.2} / {rhi:.2}")
        );
    }
    Ok(())
}

/// The board runtime's cost per request: the same small requests run
/// privately, through a board runtime alone, and beside an idle neighbour;
/// host wall time per request, interleaved rounds, min / median / max.
#[derive(Parser, Debug)]
#[command(name = "runtime-handoff")]
struct Args {
    /// Interleaved rounds.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Requests per round and side.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    requests: u64,
    #[command(flatten)]
    board: BoardArg,
}

fn main() {
    let args = Args::parse();
    let result =
        args.board.load().and_then(|board| run(&board, args.rounds as usize, args.requests as usize));
    if let Err(e) = result {
        npu_bench::fail("runtime-handoff", &e);
    }
}
