//! Mapping evaluation: a generated stream of vNPU requests over a cluster
//! of default boards, placed by this manager's policy (best fit on
//! execution units, balanced against SRAM, over the whole cluster), by
//! first fit, and by two baselines a cloud runs today: whole-core
//! allocation (each vNPU gets a physical core to itself, the core picked
//! best fit: on the board with the fewest free cores, as pass-through at
//! core granularity), and MIG-like fixed profiles (each core cut into
//! aligned quarter, half and whole slices, as an A100 is cut into GPU
//! instances; a vNPU gets the smallest profile that holds it, placed best
//! fit). Prints what the accepted tenants asked for (EUs and SRAM), what
//! the policy holds for them, rejected requests and decision time.
//!
//! The request mix is written in fractions of a core of the board (its
//! SAs, VUs and 2 MiB SRAM slices), so it means the same on any board.
//!
//! With `--churn`, vNPUs also leave: each lives for an exponentially
//! distributed number of arrivals (mean `--lifetime`, by default what
//! offers the cluster 100% of its EUs), and utilization and rejections are
//! averaged over the arrivals after the first quarter (warm-up). Without
//! departures a stream larger than the cluster is mostly rejected by
//! whole-core allocation by arithmetic (every accepted vNPU takes a core):
//! the churn runs are the comparison (`docs/evaluation.md`).
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

/// A request mix on a core of `cfg` (`sa` SAs, `vu` VUs, `slices` 2 MiB
/// SRAM slices): 30% a quarter of a core (the named type `small` on the
/// default board), 10% a half (`medium`), 10% a whole core (`large`), 20%
/// SA-heavy (1 to sa - 1 SAs, one VU, 1/16 to 1/4 of the SRAM: BERT,
/// ResNet), 10% VU-heavy (one SA, 1 to vu - 1 VUs, up to 1/8 of the SRAM:
/// DLRM) and 20% memory-heavy (1 + 1 with 1/2 to 7/8 of the SRAM).
fn request(r: &mut Rng, cfg: &BoardConfig) -> Shape {
    let (sa, vu) = (cfg.core.sa_count, cfg.core.vu_count);
    let slices = (cfg.sram_bytes() / npu_model::config::SRAM_SLICE).max(1);
    let sram = |num: u64, den: u64| ((slices * num).div_ceil(den)).max(1) * npu_model::config::SRAM_SLICE;
    let some = |r: &mut Rng, n: u32| 1 + r.below(u64::from(n.saturating_sub(1)).max(1)) as u32;
    let (sa, vu, sram, hbm) = match r.below(10) {
        0..=2 => (sa.div_ceil(4), vu.div_ceil(4), sram(1, 4), 1 << 30),
        3 => (sa.div_ceil(2), vu.div_ceil(2), sram(1, 2), 4 << 30),
        4 => (sa, vu, sram(1, 1), 8 << 30),
        5 | 6 => (some(r, sa), 1, sram(1 + r.below(4), 16), 1 << 30),
        7 => (1, some(r, vu), sram(1 + r.below(2), 16), 2 << 30),
        _ => (1, 1, sram(4 + r.below(4), 8), 4 << 30),
    };
    Shape::new(1, 1, sa, vu, sram, hbm).expect("the request kinds above are valid shapes")
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    Ours,
    FirstFit,
    WholeCore,
    MigLike,
}

/// The MIG-like profile (in quarters of a core: 1, 2 or 4) that holds
/// `s` on a core of `cfg`: the smallest power of two of quarters with at
/// least its SAs, VUs and SRAM.
fn profile(s: &Shape, cfg: &BoardConfig) -> u32 {
    let quarter = |have: u64, of: u64| (4 * have).div_ceil(of.max(1)) as u32;
    let q = quarter(u64::from(s.sa_per_core()), u64::from(cfg.core.sa_count))
        .max(quarter(u64::from(s.vu_per_core()), u64::from(cfg.core.vu_count)))
        .max(quarter(s.sram_per_core(), cfg.sram_bytes()));
    q.next_power_of_two().clamp(1, 4)
}

/// Where profile `q` goes on a core whose quarters `used` (a bit each)
/// are taken: the first aligned free run of `q` quarters (a half at
/// quarter 0 or 2, a whole core at 0, as MIG places GPU instances).
fn slot(used: u8, q: u32) -> Option<u8> {
    let mask = ((1u16 << q) - 1) as u8;
    (0..4u8).step_by(q as usize).find(|&at| used & (mask << at) == 0)
}

/// Where `policy` puts `s` on the cluster: (board, core). `mig` holds each
/// core's taken quarters (MIG-like only).
fn spot(
    policy: Policy,
    bs: &[Board],
    mig: &[Vec<u8>],
    s: &Shape,
    cfg: &BoardConfig,
) -> Option<(usize, usize)> {
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
        // Best fit over boards: the free core of the board with the fewest
        // free cores (keeps whole boards free for multi-core tenants).
        Policy::WholeCore => bs
            .iter()
            .enumerate()
            .filter_map(|(b, board)| {
                let free: Vec<usize> =
                    (0..board.cores.len()).filter(|&c| board.cores[c].sa + board.cores[c].vu == 0).collect();
                free.first().filter(|&&c| board.fits(c, s)).map(|&c| (free.len(), b, c))
            })
            .min()
            .map(|(_, b, c)| (b, c)),
        // Best fit over cores: the core with the fewest free quarters that
        // has an aligned slot for the profile.
        Policy::MigLike => {
            let q = profile(s, cfg);
            mig.iter()
                .enumerate()
                .flat_map(|(b, cores)| cores.iter().enumerate().map(move |(c, &used)| (b, c, used)))
                .filter(|&(b, c, used)| slot(used, q).is_some() && bs[b].fits(c, &taken(policy, s, cfg)))
                .min_by_key(|&(b, c, used)| (4 - used.count_ones(), b, c))
                .map(|(b, c, _)| (b, c))
        }
    }
}

/// `s` grown to every SA, VU and byte of SRAM of a core of `cfg`.
fn whole_core(s: &Shape, cfg: &BoardConfig) -> Result<Shape, vnpu_spec::ShapeError> {
    s.with_units(cfg.core.sa_count, cfg.core.vu_count)?.with_sram(cfg.sram_bytes())
}

/// `s` grown to its MIG-like profile's quarters of a core of `cfg`.
fn profile_shape(s: &Shape, cfg: &BoardConfig) -> Result<Shape, vnpu_spec::ShapeError> {
    let q = profile(s, cfg);
    let part = |n: u32| (n * q / 4).max(1);
    let slices = cfg.sram_bytes() / npu_model::config::SRAM_SLICE;
    let sram = (slices * u64::from(q) / 4).max(1) * npu_model::config::SRAM_SLICE;
    s.with_units(part(cfg.core.sa_count), part(cfg.core.vu_count))?.with_sram(sram.max(s.sram_per_core()))
}

/// What a placed vNPU occupies: its shape, the whole core, or its
/// profile's slice of the core.
fn taken(policy: Policy, s: &Shape, cfg: &BoardConfig) -> Shape {
    match policy {
        Policy::WholeCore => {
            whole_core(s, cfg).expect("main checked that a whole core is a valid vNPU shape")
        }
        Policy::MigLike => {
            profile_shape(s, cfg).expect("main checked that every profile is a valid vNPU shape")
        }
        _ => *s,
    }
}

/// What one policy's run gave.
struct Outcome {
    /// EUs and SRAM the accepted tenants asked for, over the cluster's.
    eu: f64,
    sram: f64,
    /// EUs the policy holds for them (their shapes, whole cores or
    /// profiles), over the cluster's.
    held: f64,
    rejected: usize,
    /// Seconds per decision.
    per_request: f64,
}

/// Runs `policy` over `reqs`. With `lifetimes`, request `i` arrives at
/// time `i` and leaves at `i + lifetimes[i]`; the utilizations are then
/// averaged over the arrivals after the first quarter and `rejected`
/// counts only those.
fn run(
    policy: Policy,
    reqs: &[Shape],
    lifetimes: Option<&[f64]>,
    boards: usize,
    cfg: &BoardConfig,
) -> Outcome {
    let mut bs: Vec<Board> = (0..boards).map(|_| Board::new(cfg)).collect();
    let per_board = (cfg.chips * cfg.cores_per_chip) as usize;
    // MIG-like: each core's taken quarters.
    let mut mig: Vec<Vec<u8>> = vec![vec![0u8; per_board]; boards];
    let cores = (boards as u64) * u64::from(cfg.chips * cfg.cores_per_chip);
    let eu_total = (cores * u64::from(cfg.core.sa_count + cfg.core.vu_count)) as f64;
    let sram_total = (cores * cfg.sram_bytes()) as f64;
    let (mut rejected, mut eus, mut sram, mut held) = (0usize, 0u64, 0u64, 0u64);
    // Departures: (time, board, core, request index, MIG quarters), earliest last.
    let mut leaving: Vec<(f64, usize, usize, usize, u8)> = Vec::new();
    let warm = reqs.len() / 4;
    let (mut eu_avg, mut sram_avg, mut held_avg, mut samples) = (0.0, 0.0, 0.0, 0usize);
    let t0 = Instant::now();
    for (i, s) in reqs.iter().enumerate() {
        let now = i as f64;
        while leaving.last().is_some_and(|l| l.0 <= now) {
            if let Some((_, b, c, k, quarters)) = leaving.pop() {
                let t = taken(policy, &reqs[k], cfg);
                bs[b].release(&t, &[c as u32]);
                mig[b][c] &= !quarters;
                eus -= u64::from(reqs[k].eus());
                sram -= reqs[k].sram_per_core();
                held -= u64::from(t.eus());
            }
        }
        match spot(policy, &bs, &mig, s, cfg) {
            Some((b, c)) => {
                let t = taken(policy, s, cfg);
                let mut quarters = 0u8;
                if policy == Policy::MigLike {
                    let q = profile(s, cfg);
                    let at = slot(mig[b][c], q).expect("spot found an aligned slot");
                    quarters = (((1u16 << q) - 1) as u8) << at;
                    mig[b][c] |= quarters;
                }
                eus += u64::from(s.eus());
                sram += s.sram_per_core();
                held += u64::from(t.eus());
                bs[b].occupy(&t, &[c as u32]);
                if let Some(l) = lifetimes {
                    let end = now + l.get(i).copied().unwrap_or(f64::INFINITY);
                    let at = leaving.partition_point(|x| x.0 > end);
                    leaving.insert(at, (end, b, c, i, quarters));
                }
            }
            None if lifetimes.is_none() || i >= warm => rejected += 1,
            None => {}
        }
        if lifetimes.is_some() && i >= warm {
            eu_avg += eus as f64 / eu_total;
            sram_avg += sram as f64 / sram_total;
            held_avg += held as f64 / eu_total;
            samples += 1;
        }
    }
    let per_request = t0.elapsed().as_secs_f64() / reqs.len() as f64;
    if lifetimes.is_some() {
        let n = samples.max(1) as f64;
        return Outcome { eu: eu_avg / n, sram: sram_avg / n, held: held_avg / n, rejected, per_request };
    }
    Outcome {
        eu: eus as f64 / eu_total,
        sram: sram as f64 / sram_total,
        held: held as f64 / eu_total,
        rejected,
        per_request,
    }
}

/// Place a generated stream of vNPU requests on a cluster of boards by
/// this manager's policy, by first fit, by whole-core allocation and by
/// MIG-like fixed profiles, and compare EU and SRAM utilization (what the
/// tenants asked for), the EUs each policy holds, rejections and decision
/// time.
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
    let mut r = Rng(seed.max(1) * 0x9e37_79b9_7f4a_7c15);
    let reqs: Vec<Shape> = (0..n).map(|_| request(&mut r, &cfg)).collect();
    if let Some(e) = reqs.iter().find_map(|s| whole_core(s, &cfg).and(profile_shape(s, &cfg)).err()) {
        eprintln!("mapping-eval: a whole core or a profile of this board is not a vNPU shape: {e}");
        return ExitCode::from(2);
    }
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
        "{:<12} {:>10} {:>10} {:>10} {:>10} {:>14}",
        "policy", "EU util", "SRAM util", "EUs held", "rejected", "decision us"
    );
    for p in [Policy::Ours, Policy::FirstFit, Policy::WholeCore, Policy::MigLike] {
        let o = run(p, &reqs, lifetimes.as_deref(), boards, &cfg);
        println!(
            "{:<12} {:>9.1}% {:>9.1}% {:>9.1}% {:>10} {:>14.2}",
            format!("{p:?}"),
            100.0 * o.eu,
            100.0 * o.sram,
            100.0 * o.held,
            o.rejected,
            o.per_request * 1e6
        );
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(s: &str) -> Shape {
        vnpu_spec::VnpuSpec::parse(s).unwrap()
    }

    /// On a core of 4 SA + 4 VU and 16 MiB: the smallest power of two of
    /// quarters that holds each dimension.
    #[test]
    fn a_request_gets_the_smallest_profile_that_holds_it() {
        let cfg = BoardConfig::default();
        assert_eq!((cfg.core.sa_count, cfg.core.vu_count, cfg.core.sram_mib), (4, 4, 16));
        assert_eq!(profile(&shape("sa=1,vu=1,sram=4M,hbm=1G"), &cfg), 1);
        // 6 MiB is more than a quarter's 4 MiB: a half.
        assert_eq!(profile(&shape("sa=1,vu=1,sram=6M,hbm=1G"), &cfg), 2);
        // 3 SAs: three quarters, rounded up to the whole core.
        assert_eq!(profile(&shape("sa=3,vu=1,sram=2M,hbm=1G"), &cfg), 4);
        assert_eq!(profile(&shape("sa=4,vu=4,sram=16M,hbm=1G"), &cfg), 4);
        let half = profile_shape(&shape("sa=1,vu=2,sram=2M,hbm=1G"), &cfg).unwrap();
        assert_eq!((half.sa_per_core(), half.vu_per_core(), half.sram_per_core()), (2, 2, 8 << 20));
    }

    /// Profiles sit at aligned quarters, as MIG places GPU instances: a
    /// half at quarter 0 or 2, the whole core at 0.
    #[test]
    fn profiles_take_aligned_slots() {
        assert_eq!(slot(0b0000, 1), Some(0));
        assert_eq!(slot(0b0001, 1), Some(1));
        assert_eq!(slot(0b0001, 2), Some(2));
        // Quarters 0 and 2 taken: two quarters are free, but no half.
        assert_eq!(slot(0b0101, 2), None);
        assert_eq!(slot(0b0101, 1), Some(1));
        assert_eq!(slot(0b0000, 4), Some(0));
        assert_eq!(slot(0b1000, 4), None);
        assert_eq!(slot(0b1111, 1), None);
    }

    /// Two quarter-core tenants and a half-core one: MIG-like packs both
    /// quarters on one core (best fit) and the half beside them; whole-core
    /// allocation gives each a core of its own.
    #[test]
    fn baselines_hold_what_their_rules_give() {
        let cfg = BoardConfig::default();
        let q = shape("sa=1,vu=1,sram=4M,hbm=1G");
        let h = shape("sa=2,vu=2,sram=8M,hbm=1G");
        let reqs = [q, q, h];
        let mig = run(Policy::MigLike, &reqs, None, 1, &cfg);
        // Asked 2 + 2 + 4 EUs of 16; held the same (the profiles fit
        // exactly); nothing rejected.
        assert_eq!((mig.eu, mig.held, mig.rejected), (0.5, 0.5, 0));
        let whole = run(Policy::WholeCore, &reqs, None, 1, &cfg);
        // Two cores: the third tenant is refused; each held a whole core.
        assert_eq!((whole.eu, whole.held, whole.rejected), (0.25, 1.0, 1));
    }
}
