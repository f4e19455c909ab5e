//! Mapping evaluation: a generated stream of 10,000 vNPU requests
//! over 1,000 default boards, placed by this manager's policy (best fit on
//! execution units, balanced against SRAM, over the whole cluster), by
//! first fit, and by whole-core allocation (each vNPU gets a physical core
//! to itself, as pass-through at core granularity). Prints EU and SRAM
//! utilization, rejected requests and decision time per request.
//!
//! With `--churn`, vNPUs also leave: each lives for an exponentially
//! distributed number of arrivals (mean `--lifetime`, by default what
//! offers the cluster 100% of its EUs), and utilization and rejections are
//! averaged over the arrivals after the first quarter (warm-up).
//!
//! `cargo run --release -p placement-eval --bin mapping-eval -- --help`

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

use npu_model::BoardConfig;
use vnpu_placement::Board;
use vnpu_spec::Shape;

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
    /// Exponentially distributed with mean `mean`.
    fn exp(&mut self, mean: f64) -> f64 {
        let u = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        -mean * u.ln()
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
    Shape::new(1, 1, sa, vu, sram, hbm).expect("the request kinds above are valid shapes")
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    Ours,
    FirstFit,
    WholeCore,
}

/// Where `policy` puts `s` on the cluster: (board, core).
fn spot(policy: Policy, bs: &[Board], s: &Shape) -> Option<(usize, usize)> {
    match policy {
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
    }
}

/// `s` grown to every SA, VU and byte of SRAM of a core of `cfg`.
fn whole_core(s: &Shape, cfg: &BoardConfig) -> Result<Shape, vnpu_spec::ShapeError> {
    s.with_units(cfg.core.sa_count, cfg.core.vu_count)?.with_sram(cfg.sram_bytes())
}

/// What a placed vNPU occupies: its shape, or the whole core.
fn taken(policy: Policy, s: &Shape, cfg: &BoardConfig) -> Shape {
    if policy == Policy::WholeCore {
        whole_core(s, cfg).expect("main checked that a whole core is a valid vNPU shape")
    } else {
        *s
    }
}

/// EU utilization, SRAM utilization (both counting what accepted tenants
/// asked for, over the whole cluster), rejected requests, seconds per
/// decision. With `lifetimes`, request `i` arrives at time `i` and leaves
/// at `i + lifetimes[i]`; utilization is then averaged over the arrivals
/// after the first quarter and `rejected` counts only those.
fn run(
    policy: Policy,
    reqs: &[Shape],
    lifetimes: Option<&[f64]>,
    boards: usize,
    cfg: &BoardConfig,
) -> (f64, f64, usize, f64) {
    let mut bs: Vec<Board> = (0..boards).map(|_| Board::new(cfg)).collect();
    let cores = (boards as u64) * u64::from(cfg.chips * cfg.cores_per_chip);
    let eu_total = (cores * u64::from(cfg.core.sa_count + cfg.core.vu_count)) as f64;
    let sram_total = (cores * cfg.sram_bytes()) as f64;
    let (mut rejected, mut eus, mut sram) = (0usize, 0u64, 0u64);
    // Departures: (time, board, core, request index), earliest last.
    let mut leaving: Vec<(f64, usize, usize, usize)> = Vec::new();
    let warm = reqs.len() / 4;
    let (mut eu_avg, mut sram_avg, mut samples) = (0.0, 0.0, 0usize);
    let t0 = Instant::now();
    for (i, s) in reqs.iter().enumerate() {
        let now = i as f64;
        while leaving.last().is_some_and(|l| l.0 <= now) {
            if let Some((_, b, c, k)) = leaving.pop() {
                bs[b].release(&taken(policy, &reqs[k], cfg), &[c as u32]);
                eus -= u64::from(reqs[k].eus());
                sram -= reqs[k].sram_per_core();
            }
        }
        match spot(policy, &bs, s) {
            Some((b, c)) => {
                eus += u64::from(s.eus());
                sram += s.sram_per_core();
                bs[b].occupy(&taken(policy, s, cfg), &[c as u32]);
                if let Some(l) = lifetimes {
                    let end = now + l.get(i).copied().unwrap_or(f64::INFINITY);
                    let at = leaving.partition_point(|x| x.0 > end);
                    leaving.insert(at, (end, b, c, i));
                }
            }
            None if lifetimes.is_none() || i >= warm => rejected += 1,
            None => {}
        }
        if lifetimes.is_some() && i >= warm {
            eu_avg += eus as f64 / eu_total;
            sram_avg += sram as f64 / sram_total;
            samples += 1;
        }
    }
    let per_req = t0.elapsed().as_secs_f64() / reqs.len() as f64;
    if lifetimes.is_some() {
        let n = samples.max(1) as f64;
        return (eu_avg / n, sram_avg / n, rejected, per_req);
    }
    (eus as f64 / eu_total, sram as f64 / sram_total, rejected, per_req)
}

/// Place a generated stream of vNPU requests on a cluster of boards by
/// this manager's policy, by first fit and by whole-core allocation, and
/// compare EU and SRAM utilization, rejections and decision time.
#[derive(Parser, Debug)]
#[command(name = "mapping-eval")]
struct Args {
    /// Seed of the request stream.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    seed: u64,
    /// Requests in the stream [default: 10000, or 40000 with --churn].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    requests: Option<u64>,
    /// Boards in the cluster.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    boards: u64,
    /// vNPUs also leave: each lives an exponentially distributed number of
    /// arrivals; utilization and rejections are averaged after the first
    /// quarter of the arrivals.
    #[arg(long)]
    churn: bool,
    /// Mean lifetime of a vNPU in arrivals [default: what offers the
    /// cluster 100% of its EUs].
    #[arg(long, requires = "churn", value_parser = clap::value_parser!(u64).range(1..))]
    lifetime: Option<u64>,
    /// Board configuration (TOML, docs/board-config.md); default: the built-in board.
    #[arg(long)]
    board: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let (seed, boards, churn) = (args.seed, args.boards as usize, args.churn);
    let lifetime = args.lifetime.map(|l| l as f64);
    let n = args.requests.map_or(if churn { 40_000 } else { 10_000 }, |n| n as usize);
    let cfg = match &args.board {
        Some(path) => match BoardConfig::load(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("mapping-eval: {e}");
                return ExitCode::from(2);
            }
        },
        None => BoardConfig::default(),
    };
    if let Err(e) = whole_core(&request(&mut Rng(1)), &cfg) {
        eprintln!("mapping-eval: a whole core of this board is not a vNPU shape: {e}");
        return ExitCode::from(2);
    }
    let mut r = Rng(seed.max(1) * 0x9e37_79b9_7f4a_7c15);
    let reqs: Vec<Shape> = (0..n).map(|_| request(&mut r)).collect();
    let demand: u64 = reqs.iter().map(|s| u64::from(s.eus())).sum();
    let cluster_eus =
        boards as f64 * f64::from(cfg.chips * cfg.cores_per_chip * (cfg.core.sa_count + cfg.core.vu_count));
    // By default each vNPU stays as long as it takes for the arrivals to
    // offer the whole cluster's EUs.
    let mean_life = lifetime.unwrap_or(cluster_eus / (demand as f64 / n as f64));
    let lifetimes: Option<Vec<f64>> = churn.then(|| (0..n).map(|_| r.exp(mean_life)).collect());
    println!(
        "{n} requests ({demand} EUs asked) over {boards} boards of {} cores x {} EUs (seed {seed}){}",
        cfg.chips * cfg.cores_per_chip,
        cfg.core.sa_count + cfg.core.vu_count,
        if churn {
            format!(
                "; vNPUs leave after {mean_life:.0} arrivals on average, averages over the last {}",
                n - n / 4
            )
        } else {
            String::new()
        }
    );
    println!(
        "{:<12} {:>10} {:>10} {:>10} {:>14}",
        "policy", "EU util", "SRAM util", "rejected", "decision us"
    );
    for p in [Policy::Ours, Policy::FirstFit, Policy::WholeCore] {
        let (eu, mem, rej, t) = run(p, &reqs, lifetimes.as_deref(), boards, &cfg);
        println!(
            "{:<12} {:>9.1}% {:>9.1}% {:>10} {:>14.2}",
            format!("{p:?}"),
            100.0 * eu,
            100.0 * mem,
            rej,
            t * 1e6
        );
    }
    ExitCode::SUCCESS
}
