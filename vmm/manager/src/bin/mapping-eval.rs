//! Mapping evaluation (issue 5): a generated stream of 10,000 vNPU requests
//! over 1,000 default boards, placed by this manager's policy (best fit on
//! execution units, balanced against SRAM, over the whole cluster), by
//! first fit, and by whole-core allocation (each vNPU gets a physical core
//! to itself, as pass-through at core granularity). Prints EU and SRAM
//! utilization, rejected requests and decision time per request.
//!
//! `cargo run --release -p vnpu-manager --bin mapping-eval [-- --seed N --requests N --boards N]`

use std::time::Instant;

use npu_model::BoardConfig;
use vnpu_manager::{Board, Shape};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A request mix: named types, SA-heavy and VU-heavy shapes from the
/// workload profiles, and memory-heavy ones.
fn request(r: &mut Rng) -> Shape {
    let mib = |m: u64| m << 20;
    let (sa, vu, sram, hbm) = match r.below(10) {
        0..=2 => (1, 1, mib(4), 1 << 30), // small
        3 => (2, 2, mib(16), 4 << 30),    // medium
        4 => (4, 4, mib(32), 8 << 30),    // large
        5 | 6 => (1 + r.below(3) as u32, 1, mib(2 + 2 * r.below(4)), 1 << 30), // SA-heavy (BERT, ResNet)
        7 => (1, 1 + r.below(3) as u32, mib(2 + 2 * r.below(2)), 2 << 30), // VU-heavy (DLRM)
        _ => (1, 1, mib(16 + 4 * r.below(4)), 4 << 30), // memory-heavy
    };
    Shape {
        chips: 1,
        cores_per_chip: 1,
        sa_per_core: sa,
        vu_per_core: vu,
        sram_per_core: sram,
        hbm_per_core: hbm,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    Ours,
    FirstFit,
    WholeCore,
}

/// EU utilization, SRAM utilization (both counting what accepted tenants
/// asked for, over the whole cluster), rejected requests, seconds per decision.
fn run(policy: Policy, reqs: &[Shape], boards: usize, cfg: &BoardConfig) -> (f64, f64, usize, f64) {
    let mut bs: Vec<Board> = (0..boards).map(|_| Board::new(cfg)).collect();
    let (mut rejected, mut eus, mut sram) = (0usize, 0u64, 0u64);
    let t0 = Instant::now();
    for s in reqs {
        let spot = match policy {
            Policy::Ours => bs
                .iter()
                .enumerate()
                .filter_map(|(b, board)| board.best_core(s).map(|(c, score)| (b, c, score)))
                .min_by_key(|x| x.2)
                .map(|(b, c, _)| (b, c)),
            Policy::FirstFit => bs
                .iter()
                .enumerate()
                .find_map(|(b, board)| (0..board.cores.len()).find(|&c| board.fits(c, s)).map(|c| (b, c))),
            Policy::WholeCore => bs.iter().enumerate().find_map(|(b, board)| {
                (0..board.cores.len())
                    .find(|&c| board.cores[c].sa + board.cores[c].vu == 0 && board.fits(c, s))
                    .map(|c| (b, c))
            }),
        };
        let Some((b, c)) = spot else {
            rejected += 1;
            continue;
        };
        eus += u64::from(s.sa_per_core + s.vu_per_core);
        sram += s.sram_per_core;
        let taken = if policy == Policy::WholeCore {
            // The whole core is the tenant's.
            Shape {
                sa_per_core: cfg.core.sa_count,
                vu_per_core: cfg.core.vu_count,
                sram_per_core: cfg.sram_bytes(),
                ..*s
            }
        } else {
            *s
        };
        bs[b].occupy(&taken, &[c as u32]);
    }
    let per_req = t0.elapsed().as_secs_f64() / reqs.len() as f64;
    let cores = (boards as u64) * u64::from(cfg.chips * cfg.cores_per_chip);
    let eu_total = cores * u64::from(cfg.core.sa_count + cfg.core.vu_count);
    let sram_total = cores * cfg.sram_bytes();
    (eus as f64 / eu_total as f64, sram as f64 / sram_total as f64, rejected, per_req)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut seed, mut n, mut boards) = (1u64, 10_000usize, 1_000usize);
    while let Some(a) = args.next() {
        let v = args.next().and_then(|v| v.parse::<u64>().ok());
        match (a.as_str(), v) {
            ("--seed", Some(v)) => seed = v,
            ("--requests", Some(v)) => n = v as usize,
            ("--boards", Some(v)) => boards = v as usize,
            _ => {
                eprintln!("usage: mapping-eval [--seed N] [--requests N] [--boards N]");
                std::process::exit(2);
            }
        }
    }
    let cfg = BoardConfig::default();
    let mut r = Rng(seed.max(1) * 0x9e37_79b9_7f4a_7c15);
    let reqs: Vec<Shape> = (0..n).map(|_| request(&mut r)).collect();
    let demand: u64 = reqs.iter().map(|s| u64::from(s.sa_per_core + s.vu_per_core)).sum();
    println!(
        "{n} requests ({demand} EUs asked) over {boards} boards of {} cores x {} EUs (seed {seed})",
        cfg.chips * cfg.cores_per_chip,
        cfg.core.sa_count + cfg.core.vu_count
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>14}",
        "policy", "EU util", "SRAM util", "rejected", "decision us"
    );
    for p in [Policy::Ours, Policy::FirstFit, Policy::WholeCore] {
        let (eu, mem, rej, t) = run(p, &reqs, boards, &cfg);
        println!(
            "{:<12} {:>9.1}% {:>9.1}% {:>10} {:>14.2}",
            format!("{p:?}"),
            100.0 * eu,
            100.0 * mem,
            rej,
            t * 1e6
        );
    }
}
