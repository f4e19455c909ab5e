//! Sharing evaluation: SA-heavy and VU-heavy tenants with
//! Poisson arrivals on one physical core (4 SA + 4 VU). Every request of the
//! arrival stream is simulated on the core as it arrives and runs (one
//! continuous `npu_model::CoreSim` per system and load), so what co-located
//! requests share (the core's DMA engine, HBM, the host link) slows them
//! only while they really overlap. Five systems, the same arrivals:
//!
//! - **vNPU** (this system): each tenant owns a 1 SA + 1 VU vNPU of the
//!   core (8 MiB SRAM, a quarter); its requests run one at a time on it in
//!   arrival order (the rest queue in the guest's ring);
//! - **vNPU-WC** (this system, work-conserving): the same 1 SA + 1 VU
//!   vNPUs, but requests run as operator-level tasks and at each task
//!   boundary a tenant gets its guarantee plus the engines idle on the core
//!   (least slack first, along its per-operation profile); lent engines
//!   come back at the borrower's next boundary (`lending.rs`);
//! - **PREMA-like**, two variants: the whole core (4 SA + 4 VU, 32 MiB SRAM)
//!   serves one request at a time; tokens = the tenant's priority x
//!   waiting time / isolated whole-core time (PREMA's slowdown-normalized
//!   priority; `--priority`, all 1 by default); when the core is free the
//!   request with the most tokens runs (PREMA's candidate threshold and
//!   shortest-job pick among the candidates are not modelled). **PREMA-ckpt** also preempts: at each arrival and at the moment
//!   a waiter's tokens overtake the running request's (plus
//!   `--preempt-margin` context switches, normalized to the waiter), the
//!   waiter takes over: the running request stops issuing, its
//!   transfers in flight drain, its SRAM state is
//!   checkpointed (half a context switch) and later restored (the other
//!   half) before it goes on where it stopped; unless it would end within
//!   one switch anyway (then it drains); a request preempted before it has
//!   run for one switch is killed instead (PREMA's KILL: started again
//!   from scratch later; `--no-prema-kill` checkpoints it too). **PREMA-drain** never
//!   preempts. Both run on the board runtime (`Runtime::set_prema`,
//!   `npu_scheduler::Prema`).
//!   Ratios are against the better of the two on each metric;
//! - **Planaria** (Planaria-like dynamic fission on this model, for
//!   comparison): the operator-level tasks of vNPU-WC without guarantees;
//!   the most urgent tenant takes the least shape that meets its deadline
//!   (`lending.rs`);
//! - **FIFO** (PREMA's NP-FCFS baseline): the whole core, one request at
//!   a time in arrival order, no preemption, priorities ignored;
//! - **V10** (V10-like operator interleaving on this model, for
//!   comparison): the operator-level tasks without guarantees or
//!   deadlines; at each task boundary the tenant with the least engine
//!   time attained per unit of priority takes the fastest shape of the
//!   free engines, the next one the same from what is left (`lending.rs`).
//!
//! vNPU-WC and Planaria serve a higher `--priority` first at a task
//! boundary, then the least slack; the static vNPUs ignore priorities.
//! PREMA's fairness weighs each tenant's normalized progress by its share
//! of the priorities.
//!
//! Load is stated against each system's own saturation: the per-tenant
//! arrival rates at which it is busy all the time (vNPU: every tenant
//! backlogged on its vNPU, all neighbours busy, the rate of the first
//! tenant to saturate; PREMA-like: one request after another on the whole
//! core). The default sweep runs both systems at 0.1 .. 1.0 of each one's
//! saturation, so every row shows both systems at the same offered rate,
//! with the load that rate is for each.
//!
//! `cargo build --release -p npu-bench && target/release/sharing-eval --help`

mod knee;
mod lending;

use lending::{saturation_lending, simulate_lending, Lending, Tasks};
use npu_board_runtime::Boundary;

use clap::Parser;
use npu_bench::{
    fail, line_plots, p99, positive, serve_arrivals, usage_error, BoardArg, Panel, Request, Rng, Tenant,
};
use npu_board_runtime::Runtime;
use npu_model::{run_program, run_program_on, BoardConfig};
use npu_scheduler::{fifo, Claim, Engines, Prema};
use npu_workloads::{build, lower_workload, RunOptions};
use vnpu_abi::Program;

/// The rows of each rate: vNPU, vNPU-WC, vNPU-H, PREMA-ckpt, PREMA-drain,
/// Planaria-like, FIFO, V10-like; ratios are against the better of the
/// PREMA rows.
const PREMA: std::ops::Range<usize> = 3..5;

/// The default tenants: workload and batch.
const MIX: [(&str, u32); 4] = [("bert", 1), ("resnet50", 1), ("dlrm", 8), ("ncf", 8)];

#[derive(Clone, Debug)]
struct Workload {
    name: String,
    /// The tenant's vNPU: its share of the core (the core's SAs and VUs
    /// split evenly among the tenants: 1 SA + 1 VU of a 4 + 4 core for
    /// four tenants, 2 + 2 for two).
    share: Engines,
    /// The program lowered for its vNPU (`p11`, `t11`: named for the
    /// four-tenant 1 SA + 1 VU case) and for the whole core (`p44`).
    p11: Program,
    p44: Program,
    /// Cycles of one request alone on each.
    t11: f64,
    t44: f64,
    /// The spread program of the harvesting vNPU (lowered for the core's
    /// engines with a quarter of its SRAM) and its cycles alone on 1 SA +
    /// 1 VU and on every engine of the core.
    spread: Program,
    /// The spread program's width, k SA + k VU (1: the vNPU's own
    /// program, `--spread-cost`).
    spread_k: u32,
    ts11: f64,
    ts44: f64,
    /// Latency bound of one request (cycles): `--qos` times `t44`, or the
    /// tenant's `--sla-ms`.
    sla: f64,
    /// The tenant's priority (`--priority`, 1 to 12; higher is more
    /// important): PREMA's token rate, the lending order of vNPU-WC and
    /// Planaria, and the weight of its share in PREMA's fairness.
    priority: u8,
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    /// Latencies (cycles) per tenant, in completion order.
    latencies: Vec<Vec<f64>>,
    /// When the last request completed (cycles).
    end: f64,
    /// Active SA + VU cycles of every request, summed over engines.
    eu_cycles: f64,
    switches: u64,
    /// PREMA-ckpt: requests killed (preempted without a
    /// checkpoint, started again from scratch later).
    kills: u64,
    /// Requests whose program failed (none expected; counted, not hidden).
    failed: u64,
    /// Work-conserving system: tasks run, how often a tenant at a boundary
    /// waited for engines it had lent, and the longest such wait (cycles).
    tasks: u64,
    reclaim_waits: u64,
    reclaim_max: f64,
    /// Cycles requests waited for lent engines in all.
    reclaim_cycles: f64,
    /// Engine-cycles tasks ran on beyond their tenant's guarantee.
    borrowed_eu_cycles: f64,
}

impl Outcome {
    fn new(n: usize) -> Self {
        Self { latencies: vec![Vec::new(); n], ..Self::default() }
    }

    /// The waits for engines every tenant of `st`'s core counted.
    fn add_reclaims(&mut self, st: &npu_board_runtime::SharingStats) {
        for (_, h) in &st.harvest {
            self.reclaim_waits += h.reclaims;
            self.reclaim_max = self.reclaim_max.max(h.reclaim_max_cycles);
            self.reclaim_cycles += h.reclaim_cycles;
        }
    }
}

/// The systems that run on the board runtime (`npu_board_runtime::Runtime`,
/// core 0 of the board): the runtime the daemon runs places, lends and
/// reclaims; this evaluation only submits each tenant's requests one at a
/// time in arrival order (the rest queue in the guest's ring) and reads
/// what finished.
#[derive(Clone, Copy, Debug, PartialEq)]
enum OnRuntime {
    /// Static vNPUs: each tenant's programs lowered for its 1 SA + 1 VU
    /// vNPU, lending off.
    Static,
    /// Harvesting vNPUs: the same 1 SA + 1 VU guarantees, spread programs
    /// lowered for the whole core's engines (8 MiB SRAM), borrowing every
    /// other engine of the core (cap 3 SA + 3 VU) when idle; the owner
    /// takes its engines back when it submits (`docs/management.md`,
    /// "Harvesting"). A borrower starts an instruction on a lent engine
    /// only if it takes at most `lend_limit` cycles (`--lend-limit-us`;
    /// infinity: any).
    Harvest { lend_limit: f64 },
    /// The same spread programs and guarantees with lending off: what
    /// each tenant's requests take without borrowing or being borrowed
    /// from (the owner-slowdown control).
    Unlent,
    /// The whole core per request, oldest first, never preempting
    /// (PREMA's NP-FCFS baseline); a request that waited for the core
    /// starts after one engine switch (`npu_scheduler::switch_cycles`).
    Fifo,
    /// The whole core per request in PREMA's token order, preempting
    /// with checkpoints and kills (`npu_scheduler::Prema`); a request's
    /// estimate is its isolated whole-core time.
    Prema(Prema),
}

impl OnRuntime {
    fn program(self, w: &Workload) -> &Program {
        match self {
            Self::Static => &w.p11,
            Self::Harvest { .. } | Self::Unlent => &w.spread,
            Self::Fifo | Self::Prema(_) => &w.p44,
        }
    }

    fn claim(self, board: &BoardConfig, w: &Workload) -> Claim {
        let c = &board.core;
        match self {
            Self::Fifo => Claim::whole_core(board),
            Self::Prema(_) => Claim { priority: w.priority, ..Claim::whole_core(board) },
            // Priority, then deadline order who borrows first.
            _ => Claim {
                sa: w.share.sa,
                vu: w.share.vu,
                priority: w.priority,
                slo_cycles: w.sla as u64,
                borrow: Engines::new(
                    c.sa_count.saturating_sub(w.share.sa),
                    c.vu_count.saturating_sub(w.share.vu),
                ),
            },
        }
    }

    /// Each tenant of `ws` as the runtime sees it: its name (`i:name`,
    /// as names of the mix may repeat), its claim, its program and the
    /// time a request takes alone on the claim.
    fn tenants<'w>(self, board: &BoardConfig, ws: &'w [Workload]) -> Vec<Tenant<'w>> {
        ws.iter()
            .enumerate()
            .map(|(i, w)| Tenant {
                name: format!("{i}:{}", w.name),
                claim: self.claim(board, w),
                program: self.program(w),
                estimate: match self {
                    Self::Static => w.t11,
                    Self::Harvest { .. } | Self::Unlent => w.ts11,
                    Self::Fifo | Self::Prema(_) => w.t44,
                },
            })
            .collect()
    }

    fn runtime(self, board: &BoardConfig) -> Runtime<'_, Request<'_>> {
        let mut rt = Runtime::new(board);
        if let Self::Harvest { lend_limit } = self {
            rt.set_harvesting(true);
            rt.set_lend_limit(lend_limit);
        } else {
            rt.set_harvesting(false);
        }
        match self {
            Self::Fifo => rt.set_policy(fifo),
            Self::Prema(p) => rt.set_prema(p),
            _ => {}
        }
        rt
    }
}

/// `system` on the board runtime with `arrivals` (cycles, per tenant).
fn simulate_runtime(
    board: &BoardConfig,
    ws: &[Workload],
    arrivals: &[Vec<f64>],
    system: OnRuntime,
) -> Result<Outcome, String> {
    let n = ws.len();
    let mut o = Outcome::new(n);
    let mut rt = system.runtime(board);
    serve_arrivals(&mut rt, arrivals, &system.tenants(board, ws), |done| {
        let req = done.job;
        match done.result {
            Ok(t) => {
                let tot = t.totals();
                o.eu_cycles += tot.sa_active_cycles + tot.vu_active_cycles;
                o.borrowed_eu_cycles += t.borrowed_cycles;
                o.latencies[req.tenant].push(done.end - req.arrival);
            }
            Err(_) => o.failed += 1,
        }
        o.end = o.end.max(done.end);
        Ok(())
    })?;
    let st = rt.stats(0);
    o.switches = st.preempted;
    o.kills = st.killed;
    o.eu_cycles += st.killed_cycles;
    o.add_reclaims(&st);
    Ok(o)
}

/// Per-tenant request rates (per cycle) at which `system` saturates, for
/// relative rates `weights`: every tenant backlogged (each resubmits at
/// once) until every one has completed `rounds` requests; the scale of
/// `weights` at which the first tenant is busy all the time.
fn saturation_runtime(
    board: &BoardConfig,
    ws: &[Workload],
    weights: &[f64],
    rounds: usize,
    system: OnRuntime,
) -> Result<f64, String> {
    let n = ws.len();
    let mut rt = system.runtime(board);
    let tenants = system.tenants(board, ws);
    let mut done = vec![0usize; n];
    let mut last = vec![0f64; n];
    let mut backlog: Vec<usize> = (0..n).collect();
    while done.iter().any(|d| *d < rounds) {
        for i in backlog.drain(..) {
            let t = &tenants[i];
            let req = Request { tenant: i, arrival: rt.now(), program: t.program };
            rt.submit_estimated(0, &t.name, t.claim, req, rt.now(), t.estimate)
                .map_err(|_| "the board has no core 0".to_string())?;
        }
        let finished = rt.step(f64::INFINITY);
        if finished.is_empty() && !rt.busy() {
            break;
        }
        for c in finished {
            let i = c.job.tenant;
            if c.result.is_ok() {
                done[i] += 1;
                last[i] = c.end;
            }
            backlog.push(i);
        }
    }
    Ok((0..n).map(|i| done[i] as f64 / last[i].max(1.0) / weights[i]).fold(f64::INFINITY, f64::min))
}

/// The same for the PREMA-like core: one request after another, so the
/// scale at which the weighted mix of whole-core times fills it.
fn saturation_prema(ws: &[Workload], weights: &[f64]) -> f64 {
    1.0 / ws.iter().zip(weights).map(|(w, x)| w.t44 * x).sum::<f64>()
}

/// Relative arrival rates of the tenants.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mix {
    /// Inversely proportional to each one's time on its 1 SA + 1 VU vNPU,
    /// so every vNPU is equally loaded.
    Balanced,
    /// The same request rate for every tenant.
    Equal,
}

/// Sharing evaluation: SA-heavy and VU-heavy tenants on one core, under
/// static vNPUs, work-conserving vNPUs (engines lent at task boundaries),
/// PREMA-like time-sharing, and Planaria-like and V10-like sharing; per
/// offered rate, throughput at the SLA, p99, EU utilization and fairness.
#[derive(Parser, Debug)]
#[command(name = "sharing-eval")]
struct Args {
    /// Offered loads as fractions of each system's own saturation rate
    /// (comma-separated, at most 4); each system runs at every rate.
    #[arg(long = "load", value_delimiter = ',', value_parser = positive,
          default_values_t = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])]
    loads: Vec<f64>,
    /// Simulated seconds of arrivals per load (at most 60).
    #[arg(long, default_value_t = 0.5, value_parser = positive)]
    seconds: f64,
    /// Arrival seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The tenants, each a workload of the library (`vnpu workload list`)
    /// with its batch size (default 1), `W[:B],...`: 2 to 4 of them, each on
    /// a 1 SA + 1 VU vNPU of the core [default: bert:1,resnet50:1,dlrm:8,ncf:8].
    #[arg(long, value_delimiter = ',', value_parser = tenant)]
    tenants: Vec<(String, u32)>,
    /// Latency bound of each request: F times its workload's isolated
    /// latency on the whole core.
    #[arg(long, default_value_t = 10.0, value_parser = positive, conflicts_with = "sla_ms")]
    qos: f64,
    /// Instead, each tenant's latency bound in milliseconds, in the order
    /// of --tenants (MLPerf's server bounds, as Planaria sets them:
    /// ResNet-50 and GoogLeNet 15, MobileNet and SSD-MobileNet 10, YOLOv3
    /// and SSD-ResNet34 100, GNMT 250).
    #[arg(long, value_delimiter = ',', value_parser = positive)]
    sla_ms: Vec<f64>,
    /// Each tenant's priority, 1 to 12 (Planaria's range; higher is more
    /// important), in the order of --tenants [default: all 1]. PREMA's
    /// tokens grow with it; vNPU-WC and Planaria serve a higher priority
    /// first at a task boundary; FIFO and the static vNPUs ignore it;
    /// PREMA's fairness weighs each tenant's progress by its share.
    #[arg(long = "priority", value_delimiter = ',', value_parser = clap::value_parser!(u8).range(1..=12))]
    priorities: Vec<u8>,
    /// PREMA-ckpt: a waiter preempts once its tokens exceed the running
    /// request's by M context switches (normalized to the waiter); 0 is
    /// PREMA's plain token rule (0 to 100).
    #[arg(long = "preempt-margin", default_value_t = 0.0, value_parser = margin)]
    margin: f64,
    /// PREMA-ckpt without PREMA's KILL: by default it chooses among all
    /// three of PREMA's mechanisms, and a running request preempted before
    /// it has run for one context switch is dropped and started again from
    /// scratch later; with this flag it is checkpointed like the others.
    #[arg(long)]
    no_prema_kill: bool,
    /// Relative arrival rates of the tenants.
    #[arg(long, value_enum, default_value_t = Mix::Balanced)]
    mix: Mix,
    /// vNPU-WC and Planaria: target length of one operator-level task on
    /// the engines it runs on, in microseconds (at least one operation):
    /// how long an owner can wait for engines it lent.
    #[arg(long, default_value_t = 25.0, value_parser = positive)]
    task_us: f64,
    /// vNPU-WC and Planaria: an idle engine is borrowed only if it makes
    /// the task more than F faster (a fraction, 0 to 10).
    #[arg(long = "lend-tolerance", default_value_t = 0.05, value_parser = tolerance)]
    tolerance: f64,
    /// vNPU-H: each tenant runs the widest spread program (k SA + k VU,
    /// k from the core's engines down to 2, lowered with its vNPU's 8 MiB
    /// SRAM) that alone on its 1 SA + 1 VU takes at most F times the
    /// vNPU's own program (1 to 10); its own program if none does.
    #[arg(long = "spread-cost", default_value_t = 1.1, value_parser = spread_cost)]
    spread_cost: f64,
    /// vNPU-H: the longest compute instruction (simulated microseconds) a
    /// request may start on a lent engine, so an owner reclaims within it
    /// (`npu_board_runtime::Runtime::set_lend_limit`; default: no bound).
    #[arg(long = "lend-limit-us", value_name = "US", value_parser = lend_limit)]
    lend_limit_us: Option<f64>,
    /// Instead of the load sweep, find each system's throughput at the SLA
    /// by a search of its own knee (loads of its saturation until the first
    /// failure, then bisection to 5%), on each of `--seeds` seeds, with at
    /// least `--min-requests` requests of each tenant at every rate; then
    /// compare p99 and utilization at 0.8 of the better PREMA-like
    /// system's throughput at the SLA (docs/evaluation.md, "Metrics").
    #[arg(long)]
    knee: bool,
    /// --knee: seeds `--seed` to `--seed + N - 1`.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    seeds: u64,
    /// Reads a `--knee --json` file at PATH, summarizes its results again
    /// (`npu_bench::metrics`, as `--knee` does) and writes the summary back
    /// into it; nothing is simulated.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["knee", "json"])]
    summarize: Option<String>,
    /// --knee: fewest requests of each tenant at a rate.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    min_requests: u64,
    /// Also write the results as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<String>,
    /// Also draw throughput, p99 latency and EU utilization against the
    /// offered rate into an SVG file at PATH.
    #[arg(long, value_name = "PATH")]
    svg: Option<String>,
    #[command(flatten)]
    board: BoardArg,
}

fn in_range(v: &str, lo: f64, hi: f64) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|_| format!("`{v}` is not a number"))?;
    if (lo..=hi).contains(&x) {
        Ok(x)
    } else {
        Err(format!("{v} must be in {lo}..={hi}"))
    }
}

fn margin(v: &str) -> Result<f64, String> {
    in_range(v, 0.0, 100.0)
}

fn spread_cost(v: &str) -> Result<f64, String> {
    in_range(v, 1.0, 10.0)
}

fn tolerance(v: &str) -> Result<f64, String> {
    in_range(v, 0.0, 10.0)
}

fn lend_limit(v: &str) -> Result<f64, String> {
    in_range(v, 0.0, 1e9)
}

/// One tenant of `--tenants`: `W[:B]`, a workload of the library and a
/// batch of 1 to 256.
fn tenant(x: &str) -> Result<(String, u32), String> {
    let (w, b) = x.trim().split_once(':').unwrap_or((x.trim(), "1"));
    let b: u32 = match b.parse() {
        Ok(b) if (1..=256).contains(&b) => b,
        _ => return Err(format!("batch `{b}` of `{w}` is not 1 to 256")),
    };
    if build(w, 1).is_none() {
        return Err(format!("unknown workload `{w}` (see `vnpu workload list`)"));
    }
    Ok((w.to_string(), b))
}

impl Args {
    fn equal_mix(&self) -> bool {
        self.mix == Mix::Equal
    }
    fn prema_kill(&self) -> bool {
        !self.no_prema_kill
    }
    fn sla_ms(&self) -> Option<&Vec<f64>> {
        (!self.sla_ms.is_empty()).then_some(&self.sla_ms)
    }
}

fn parse_args() -> Args {
    let mut a = Args::parse();
    if a.tenants.is_empty() {
        a.tenants = MIX.iter().map(|(w, b)| (w.to_string(), *b)).collect();
    }
    if !(2..=4).contains(&a.tenants.len()) {
        usage_error::<Args>(format!(
            "--tenants: {} tenants; 2 to 4 share a core, each on a vNPU of an even share of it",
            a.tenants.len()
        ));
    }
    if a.loads.iter().any(|x| *x > 4.0) {
        usage_error::<Args>("--load: loads above 4 would never drain");
    }
    a.seconds = a.seconds.min(60.0);
    if !a.sla_ms.is_empty() && a.sla_ms.len() != a.tenants.len() {
        usage_error::<Args>(format!(
            "--sla-ms gives {} bounds for {} tenants",
            a.sla_ms.len(),
            a.tenants.len()
        ));
    }
    if !a.priorities.is_empty() && a.priorities.len() != a.tenants.len() {
        usage_error::<Args>(format!(
            "--priority gives {} priorities for {} tenants",
            a.priorities.len(),
            a.tenants.len()
        ));
    }
    a
}

struct Row {
    system: &'static str,
    /// The offered rate as a fraction of this system's saturation.
    load: f64,
    throughput: f64,
    util: f64,
    avg: f64,
    p99: f64,
    fairness: f64,
    /// Average normalized turnaround time (mean over tenants of average
    /// latency / isolated whole-core time; lower is better) and system
    /// throughput (sum over tenants of its inverse; higher is better), as
    /// PREMA and Planaria define them.
    antt: f64,
    stp: f64,
    switches: u64,
    kills: u64,
    sla_rate: f64,
    /// Every tenant's p99 within its bound.
    sla_met: bool,
    tenants_p99: Vec<f64>,
    failed: u64,
    tasks: u64,
    reclaim_waits: u64,
    /// Seconds.
    reclaim_max: f64,
    /// Engine time held beyond guarantees (borrowed from idle neighbours)
    /// over all engine time.
    borrowed: f64,
}

/// What lending costs the owners: per tenant, its mean and p99 latency
/// with lending on over the same with lending off (same programs, same
/// arrivals); the worst tenant's. Below 1 when borrowing gains more than
/// reclaims cost.
#[derive(Clone, Debug)]
struct Slowdown {
    mean: f64,
    p99: f64,
    /// Per tenant (NaN: it sent nothing), mean and p99.
    tenants: Vec<(f64, f64)>,
}

impl Slowdown {
    fn of(on: &Outcome, off: &Outcome) -> Self {
        let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
        let tenants: Vec<(f64, f64)> = on
            .latencies
            .iter()
            .zip(&off.latencies)
            .map(|(a, b)| {
                if a.is_empty() && b.is_empty() {
                    (f64::NAN, f64::NAN)
                } else {
                    (mean(a) / mean(b), p99(a) / p99(b))
                }
            })
            .collect();
        // NaN-propagating max over the tenants that sent requests.
        let sent = || {
            on.latencies
                .iter()
                .zip(&off.latencies)
                .zip(&tenants)
                .filter(|((a, b), _)| !a.is_empty() || !b.is_empty())
        };
        let worst = |f: fn(&(f64, f64)) -> f64| {
            sent().map(|(_, t)| f(t)).fold(f64::NEG_INFINITY, |x, y| {
                if x.is_nan() || y.is_nan() {
                    f64::NAN
                } else {
                    x.max(y)
                }
            })
        };
        Self { mean: worst(|t| t.0), p99: worst(|t| t.1), tenants }
    }

    /// The tenant with the largest p99 ratio.
    fn worst_p99(&self) -> Option<usize> {
        (0..self.tenants.len())
            .filter(|&i| !self.tenants[i].1.is_nan())
            .max_by(|&a, &b| self.tenants[a].1.total_cmp(&self.tenants[b].1))
    }
}

/// A system against the best of the baselines on each metric: throughput
/// and EU utilization over the highest, p99 of the lowest over its own.
struct Ratios {
    throughput: f64,
    util: f64,
    p99: f64,
}

impl Ratios {
    fn of(us: &Row, base: &[Row]) -> Self {
        if base.is_empty() {
            return Self { throughput: f64::NAN, util: f64::NAN, p99: f64::NAN };
        }
        // NaN-propagating max / min (a NaN in any row makes the ratio NaN).
        let best = |f: fn(&Row) -> f64, pick: fn(f64, f64) -> f64, start: f64| {
            base.iter()
                .map(f)
                .fold(start, |a, b| if a.is_nan() || b.is_nan() { f64::NAN } else { pick(a, b) })
        };
        let max = |f| best(f, f64::max, f64::NEG_INFINITY);
        let min = |f| best(f, f64::min, f64::INFINITY);
        Self {
            throughput: us.throughput / max(|r| r.throughput),
            util: us.util / max(|r| r.util),
            p99: min(|r| r.p99) / us.p99,
        }
    }
}

/// `o` in seconds and ratios; `hz` cycles per second.
fn summarize(system: &'static str, load: f64, o: &Outcome, ws: &[Workload], eus: f64, hz: f64) -> Row {
    let done: usize = o.latencies.iter().map(Vec::len).sum();
    let all: Vec<f64> = o.latencies.iter().flatten().copied().collect();
    let within: usize =
        o.latencies.iter().zip(ws).map(|(l, w)| l.iter().filter(|x| **x <= w.sla).count()).sum();
    let avg = all.iter().sum::<f64>() / all.len().max(1) as f64;
    // Normalized progress of each tenant that sent requests: isolated time
    // on the whole core / average time in the shared system.
    let served: Vec<(f64, f64)> = o
        .latencies
        .iter()
        .zip(ws)
        .filter(|(l, _)| !l.is_empty())
        .map(|(l, w)| (w.t44 / (l.iter().sum::<f64>() / l.len() as f64), f64::from(w.priority)))
        .collect();
    let np: Vec<f64> = served.iter().map(|x| x.0).collect();
    // PREMA's fairness: each tenant's progress over its priority's share
    // of all priorities (PP), the least PP over the greatest (1: every
    // tenant progresses in proportion to its priority).
    let total: f64 = served.iter().map(|x| x.1).sum();
    let pp: Vec<f64> = served.iter().map(|(np, p)| np * total / p).collect();
    let fairness = pp.iter().copied().fold(f64::INFINITY, f64::min) / pp.iter().copied().fold(0.0, f64::max);
    let antt = np.iter().map(|x| 1.0 / x).sum::<f64>() / np.len().max(1) as f64;
    let stp = np.iter().sum::<f64>();
    let tenants_p99: Vec<f64> = o.latencies.iter().map(|l| p99(l) / hz).collect();
    let sla_met = o.latencies.iter().zip(ws).all(|(l, w)| p99(l) <= w.sla);
    Row {
        system,
        load,
        // Every request of the stream served, over the time until the last
        // one completes: the offered mix served in full, so a policy
        // cannot look fast by starving long requests (counting only what
        // completes within the arrival window would reward that).
        throughput: done as f64 / (o.end / hz),
        util: o.eu_cycles / (eus * o.end),
        avg: avg / hz,
        p99: p99(&all) / hz,
        fairness,
        antt,
        stp,
        switches: o.switches,
        kills: o.kills,
        sla_rate: within as f64 / done.max(1) as f64,
        sla_met,
        tenants_p99,
        failed: o.failed,
        tasks: o.tasks,
        reclaim_waits: o.reclaim_waits,
        reclaim_max: o.reclaim_max / hz,
        borrowed: o.borrowed_eu_cycles / (eus * o.end),
    }
}

fn lowered(
    board: &BoardConfig,
    w: &str,
    batch: u32,
    e: Engines,
    sram: u64,
) -> Result<(Program, f64), String> {
    let opts = RunOptions {
        sa: e.sa,
        vu: e.vu,
        sram_bytes: Some(sram),
        hbm_bytes: Some(8 << 30),
        ..RunOptions::on_board(board, w, batch)
    };
    let (l, _, _) = lower_workload(board, &opts).map_err(|e| format!("{w}: {e}"))?;
    let t = run_program(board, &l.program, None, None).map_err(|e| format!("{w}: {e}"))?.cycles;
    Ok((l.program, t))
}

/// The harvesting vNPU's program of `w`: lowered with its vNPU's SRAM
/// (`sram`) for k SA + k VU (k from every engine of the core down to one
/// more than its `share`) and marked spread, the widest whose time alone
/// on the share is at most `max_cost` times `t11`, the vNPU's own
/// program's (a wider lowering splits the SRAM into smaller tiles); the
/// vNPU's own program if none is. Returns k (its share's SAs: its own
/// program), its cycles alone on its share and on every engine, and the
/// program.
fn spread_program(
    board: &BoardConfig,
    w: &str,
    batch: u32,
    (share, sram): (Engines, u64),
    (p11, t11): (&Program, f64),
    max_cost: f64,
) -> Result<(u32, f64, f64, Program), String> {
    let c = &board.core;
    let widest = c.sa_count.min(c.vu_count);
    for k in (share.sa.max(share.vu) + 1..=widest).rev() {
        let opts = RunOptions {
            sa: k,
            vu: k,
            sram_bytes: Some(sram),
            hbm_bytes: Some(8 << 30),
            ..RunOptions::on_board(board, w, batch)
        };
        let (l, _, _) = lower_workload(board, &opts).map_err(|e| format!("{w}: {e}"))?;
        let mut p = l.program;
        p.spread = true;
        let on = |width: [u32; 2]| {
            run_program_on(board, &p, None, None, [share.sa, share.vu], width)
                .map(|t| t.cycles)
                .map_err(|e| format!("{w}: {e}"))
        };
        let ts11 = on([share.sa, share.vu])?;
        if ts11 <= max_cost * t11 {
            return Ok((k, ts11, on([c.sa_count, c.vu_count])?, p));
        }
    }
    Ok((share.sa, t11, t11, p11.clone()))
}

/// Each of `n` tenants' share of a core of `board`: its SAs and VUs split
/// evenly (at least one of each) and its SRAM in whole slices.
fn share_of(board: &BoardConfig, n: u32) -> Result<(Engines, u64), String> {
    let c = &board.core;
    let (sa, vu) = (c.sa_count / n.max(1), c.vu_count / n.max(1));
    let slice = npu_model::config::SRAM_SLICE;
    let sram = board.sram_bytes() / u64::from(n.max(1)) / slice * slice;
    if sa == 0 || vu == 0 || sram == 0 {
        return Err(format!(
            "{n} tenants do not each get an SA, a VU and an SRAM slice of a core of {} SAs, {} VUs and {} MiB",
            c.sa_count, c.vu_count, c.sram_mib
        ));
    }
    Ok((Engines::new(sa, vu), sram))
}

/// The SRAM bytes `p` addresses (the highest end of its SRAM accesses):
/// what a checkpoint of a request of it saves and restores at most.
fn sram_footprint(p: &Program) -> u64 {
    p.streams
        .iter()
        .flat_map(|s| s.code.iter())
        .filter_map(|i| i.footprint().ok())
        .flat_map(|f| f.iter().copied().collect::<Vec<_>>())
        .filter(|a| a.space == vnpu_abi::Space::Sram)
        .map(|a| a.end())
        .max()
        .unwrap_or(0)
}

/// `--summarize PATH`.
fn resummarize(path: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{path}: not JSON: {e}"))?;
    let results: Vec<knee::SeedResult> = serde_json::from_value(v["results"].clone())
        .map_err(|e| format!("{path}: not a `sharing-eval --knee` file: {e}"))?;
    let summary = knee::summarize(&results, &PREMA.collect::<Vec<_>>());
    knee::print(&summary, results.len());
    v["summary"] = serde_json::to_value(&summary).map_err(|e| e.to_string())?;
    std::fs::write(path, v.to_string()).map_err(|e| format!("cannot write {path}: {e}"))
}

fn run() -> Result<(), String> {
    let args = parse_args();
    if let Some(path) = &args.summarize {
        return resummarize(path);
    }
    let board = args.board.load()?;
    let hz = f64::from(board.clock_mhz) * 1e6;
    let harvesting = OnRuntime::Harvest {
        lend_limit: args.lend_limit_us.map_or(f64::INFINITY, |us| us * f64::from(board.clock_mhz)),
    };
    let mut ws = Vec::new();
    let mut tasks = Vec::new();
    let (share, share_sram) = share_of(&board, args.tenants.len() as u32)?;
    let whole = Engines::new(board.core.sa_count, board.core.vu_count);
    eprintln!("lowering the workloads, and each operation for every shape of the core ...");
    for (i, (w, batch)) in args.tenants.iter().enumerate() {
        let (w, batch) = (w.as_str(), *batch);
        let (p11, t11) = lowered(&board, w, batch, share, share_sram)?;
        let (p44, t44) = lowered(&board, w, batch, whole, board.sram_bytes())?;
        let (spread_k, ts11, ts44, spread) =
            spread_program(&board, w, batch, (share, share_sram), (&p11, t11), args.spread_cost)?;
        let sla = match args.sla_ms() {
            Some(ms) => ms[i] * 1e-3 * hz,
            None => args.qos * t44,
        };
        let priority = args.priorities.get(i).copied().unwrap_or(1);
        ws.push(Workload {
            name: format!("{w} b{batch}"),
            share,
            p11,
            p44,
            t11,
            t44,
            spread,
            spread_k,
            ts11,
            ts44,
            sla,
            priority,
        });
        tasks.push(Tasks::new(&board, build(w, batch).ok_or(format!("unknown workload {w}"))?)?);
    }
    let how = Lending {
        task_cycles: args.task_us * f64::from(board.clock_mhz),
        tolerance: args.tolerance,
        policy: Boundary::Lend,
        guarantee: share,
    };
    let planaria = Lending { policy: Boundary::Fission, ..how };
    let v10 = Lending { policy: Boundary::Interleave, ..how };
    let weights: Vec<f64> = ws.iter().map(|w| if args.equal_mix() { 1.0 } else { 1.0 / w.t11 }).collect();
    let wsum: f64 = weights.iter().sum();
    eprintln!("measuring each system's saturation ...");
    let sat_vnpu = saturation_runtime(&board, &ws, &weights, 20, OnRuntime::Static)?;
    let sat_h = saturation_runtime(&board, &ws, &weights, 20, harvesting)?;
    let sat_prema = saturation_prema(&ws, &weights);
    let sat_wc = saturation_lending(&board, &ws, &mut tasks, &weights, 8, how)?;
    let sat_planaria = saturation_lending(&board, &ws, &mut tasks, &weights, 8, planaria)?;
    let sat_v10 = saturation_lending(&board, &ws, &mut tasks, &weights, 8, v10)?;
    // Context switch: checkpoint and restore the SRAM a whole-core request
    // addresses (the largest of the tenants' programs: a bound on its live
    // state) at the DMA engine's rate.
    let ckpt_bytes = ws.iter().map(|w| sram_footprint(&w.p44)).max().unwrap_or(0);
    let switch = 2.0 * ckpt_bytes as f64 / board.gbps_to_bytes_per_cycle(board.dma.gbps);
    let ckpt = OnRuntime::Prema(Prema { margin: args.margin, kill: args.prema_kill(), checkpoint: switch });
    let drain = OnRuntime::Prema(Prema { margin: f64::INFINITY, kill: false, checkpoint: switch });
    println!(
        "{} tenants on one core ({} SA + {} VU); Poisson arrivals for {} s, seed {}, {} mix; PREMA context switch {:.1} us; SLA: {}",
        ws.len(),
        board.core.sa_count,
        board.core.vu_count,
        args.seconds,
        args.seed,
        if args.equal_mix() { "equal-rate" } else { "balanced" },
        switch / hz * 1e6,
        match args.sla_ms() {
            Some(_) => "each tenant's bound (--sla-ms)".to_string(),
            None => format!("latency <= {} x isolated whole-core latency", args.qos),
        }
    );
    println!(
        "  {:<12} {:>10} {:>10} {:>9} {:>6} {:>12} {:>12} {:>10} {:>7} {:>8}",
        "tenant",
        "1+1 us",
        "4+4 us",
        "4+4 gain",
        "spread",
        "spread 1+1",
        "spread 4+4",
        "SLA us",
        "share",
        "priority"
    );
    for (w, x) in ws.iter().zip(&weights) {
        println!(
            "  {:<12} {:>10.1} {:>10.1} {:>8.2}x {:>6} {:>12.1} {:>12.1} {:>10.1} {:>6.1}% {:>8}",
            w.name,
            w.t11 / hz * 1e6,
            w.t44 / hz * 1e6,
            w.t11 / w.t44,
            format!("{}+{}", w.spread_k, w.spread_k),
            w.ts11 / hz * 1e6,
            w.ts44 / hz * 1e6,
            w.sla / hz * 1e6,
            100.0 * x / wsum,
            w.priority
        );
    }
    println!(
        "saturation (all tenants' requests per second): vNPU {:.0}, vNPU-WC {:.0}, vNPU-H {:.0}, PREMA-like {:.0}, Planaria-like {:.0}, V10-like {:.0} (vs PREMA-like: {:.2}x, {:.2}x, {:.2}x, 1, {:.2}x, {:.2}x)",
        sat_vnpu * wsum * hz,
        sat_wc * wsum * hz,
        sat_h * wsum * hz,
        sat_prema * wsum * hz,
        sat_planaria * wsum * hz,
        sat_v10 * wsum * hz,
        sat_vnpu / sat_prema,
        sat_wc / sat_prema,
        sat_h / sat_prema,
        sat_planaria / sat_prema,
        sat_v10 / sat_prema
    );
    println!(
        "vNPU-WC: tasks of ~{} us (at least one operation), an idle engine borrowed if it makes a task > {:.0}% faster",
        args.task_us,
        100.0 * args.tolerance
    );
    let eus = f64::from(board.core.sa_count + board.core.vu_count);
    if args.knee {
        let systems =
            vec!["vNPU", "vNPU-WC", "vNPU-H", "PREMA-ckpt", "PREMA-drain", "Planaria", "FIFO", "V10"];
        let saturation =
            vec![sat_vnpu, sat_wc, sat_h, sat_prema, sat_prema, sat_planaria, sat_prema, sat_v10];
        let mut simulate = |s: usize, arrivals: &[Vec<f64>]| -> Result<Outcome, String> {
            match s {
                0 => simulate_runtime(&board, &ws, arrivals, OnRuntime::Static),
                1 => simulate_lending(&board, &ws, &mut tasks, arrivals, how),
                2 => simulate_runtime(&board, &ws, arrivals, harvesting),
                3 => simulate_runtime(&board, &ws, arrivals, ckpt),
                4 => simulate_runtime(&board, &ws, arrivals, drain),
                5 => simulate_lending(&board, &ws, &mut tasks, arrivals, planaria),
                6 => simulate_runtime(&board, &ws, arrivals, OnRuntime::Fifo),
                _ => simulate_lending(&board, &ws, &mut tasks, arrivals, v10),
            }
        };
        let mut setup = knee::Setup {
            systems,
            saturation,
            weights: weights.clone(),
            sla: ws.iter().map(|w| w.sla).collect(),
            hz,
            eus,
            min_requests: args.min_requests as usize,
            min_window: args.seconds * hz,
            baselines: PREMA.collect(),
            simulate: &mut simulate,
        };
        let seeds: Vec<u64> = (0..args.seeds).map(|k| args.seed + k).collect();
        let results = knee::run(&mut setup, &seeds, &mut |m| eprintln!("{m}"))?;
        let summary = knee::summarize(&results, &PREMA.collect::<Vec<_>>());
        knee::print(&summary, seeds.len());
        if let Some(path) = &args.json {
            let v = serde_json::json!({
                "procedure": "knee", "seeds": seeds, "min_requests_per_tenant": args.min_requests,
                "min_window_s": args.seconds, "board": board.name,
                "qos_factor": if args.sla_ms().is_some() { serde_json::Value::Null } else { serde_json::json!(args.qos) },
                "sla_ms": args.sla_ms(), "mix": if args.equal_mix() { "equal" } else { "balanced" },
                "context_switch_s": switch / hz, "checkpoint_bytes": ckpt_bytes, "prema_kill": args.prema_kill(),
                "tenants": ws.iter().zip(&weights).map(|(w, x)| serde_json::json!({"name": w.name,
                    "share": format!("{}+{}", w.share.sa, w.share.vu),
                    "t_share_s": w.t11 / hz, "t_core_s": w.t44 / hz, "sla_latency_s": w.sla / hz,
                    "rate_share": x / wsum, "priority": w.priority})).collect::<Vec<_>>(),
                "saturation_rps": setup.saturation.iter().zip(&setup.systems).map(|(x, n)| (n.to_string(), serde_json::json!(x * wsum * hz))).collect::<serde_json::Map<_, _>>(),
                "summary": summary,
                "results": results,
            });
            std::fs::write(path, v.to_string()).map_err(|e| format!("cannot write {path}: {e}"))?;
        }
        return Ok(());
    }
    // Every load of the list for each system, as rates; sorted.
    let mut scales: Vec<f64> = args
        .loads
        .iter()
        .flat_map(|l| [l * sat_vnpu, l * sat_wc, l * sat_h, l * sat_prema, l * sat_planaria, l * sat_v10])
        .collect();
    scales.sort_by(f64::total_cmp);
    scales.dedup_by(|a, b| (*a - *b).abs() <= 1e-9 * b.abs());
    println!(
        "\n{:>9} {:<11} {:>6} {:>9} {:>8} {:>10} {:>10} {:>8} {:>8} {:>6} {:>8} {:>8}",
        "offered/s",
        "system",
        "load",
        "req/s",
        "EU util",
        "avg us",
        "p99 us",
        "fairness",
        "ANTT",
        "STP",
        "in SLA",
        "switches"
    );
    let mut results = Vec::new();
    for (k, &scale) in scales.iter().enumerate() {
        eprintln!("rate {}/{} ...", k + 1, scales.len());
        let mut rng = Rng(args.seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ scale.to_bits());
        let arrivals: Vec<Vec<f64>> =
            weights.iter().map(|x| rng.arrivals(1.0 / (scale * x), args.seconds * hz)).collect();
        let offered = scale * wsum * hz;
        let wc = simulate_lending(&board, &ws, &mut tasks, &arrivals, how)?;
        let fission = simulate_lending(&board, &ws, &mut tasks, &arrivals, planaria)?;
        let interleave = simulate_lending(&board, &ws, &mut tasks, &arrivals, v10)?;
        let harvest = simulate_runtime(&board, &ws, &arrivals, harvesting)?;
        let unlent = simulate_runtime(&board, &ws, &arrivals, OnRuntime::Unlent)?;
        let rows: Vec<Row> = [
            ("vNPU", scale / sat_vnpu, simulate_runtime(&board, &ws, &arrivals, OnRuntime::Static)?),
            ("vNPU-WC", scale / sat_wc, wc),
            ("vNPU-H", scale / sat_h, harvest.clone()),
            ("PREMA-ckpt", scale / sat_prema, simulate_runtime(&board, &ws, &arrivals, ckpt)?),
            ("PREMA-drain", scale / sat_prema, simulate_runtime(&board, &ws, &arrivals, drain)?),
            ("Planaria", scale / sat_planaria, fission),
            ("FIFO", scale / sat_prema, simulate_runtime(&board, &ws, &arrivals, OnRuntime::Fifo)?),
            ("V10", scale / sat_v10, interleave),
        ]
        .iter()
        .map(|(name, load, o)| summarize(name, *load, o, &ws, eus, hz))
        .collect();
        for r in &rows {
            println!(
                "{offered:>9.0} {:<11} {:>6.2} {:>9.0} {:>7.1}% {:>10.1} {:>10.1} {:>8.3} {:>8.1} {:>6.2} {:>7.1}% {:>8}{}",
                r.system,
                r.load,
                r.throughput,
                100.0 * r.util,
                r.avg * 1e6,
                r.p99 * 1e6,
                r.fairness,
                r.antt,
                r.stp,
                100.0 * r.sla_rate,
                r.switches,
                if r.kills > 0 { format!("  ({} killed)", r.kills) } else { String::new() }
                    + &if r.failed > 0 { format!("  ({} failed)", r.failed) } else { String::new() }
            );
        }
        for wc in rows.iter().filter(|r| ["vNPU-WC", "Planaria", "V10"].contains(&r.system)) {
            println!(
                "{:>9} {}: {} tasks, {:.1}% of engine time beyond 1+1, {} waits for engines at a boundary, longest {:.1} us",
                "",
                wc.system,
                wc.tasks,
                100.0 * wc.borrowed,
                wc.reclaim_waits,
                wc.reclaim_max * 1e6
            );
        }
        let slow = Slowdown::of(&harvest, &unlent);
        println!(
            "{:>9} vNPU-H: {:.1}% of engine time beyond 1+1, {} reclaims, waits {:.2} us on average, longest {:.1} us; owner slowdown from lending: mean latency {:.3}x, p99 {:.3}x of lending off (worst tenant; p99: {})",
            "",
            100.0 * harvest.borrowed_eu_cycles / (eus * harvest.end.max(1.0)),
            harvest.reclaim_waits,
            harvest.reclaim_cycles / harvest.reclaim_waits.max(1) as f64 / hz * 1e6,
            harvest.reclaim_max / hz * 1e6,
            slow.mean,
            slow.p99,
            slow.worst_p99().map_or("none", |i| ws[i].name.as_str())
        );
        let base = &rows[PREMA];
        for us in rows.iter().filter(|r| !r.system.starts_with("PREMA")) {
            let ratios = Ratios::of(us, base);
            println!(
                "{:>9} {} / best PREMA-like: throughput {:.2}x, EU utilization {:.2}x, p99 {:.2}x lower",
                "", us.system, ratios.throughput, ratios.util, ratios.p99
            );
        }
        let n: Vec<usize> = arrivals.iter().map(Vec::len).collect();
        results.push((offered, n, rows, slow));
    }
    // Throughput at the SLA: the highest offered rate at which every
    // tenant's p99 is within its bound.
    println!(
        "\nthroughput at the SLA (highest offered rate above with every tenant's p99 within its bound):"
    );
    let mut at_sla = Vec::new();
    let systems = results.first().map_or(0, |r| r.2.len());
    let mut best_rps = vec![0.0f64; systems];
    for s in 0..systems {
        let best =
            results.iter().filter(|(_, _, rows, _)| rows[s].sla_met).max_by(|a, b| a.0.total_cmp(&b.0));
        let name = results.first().map_or("", |r| r.2[s].system);
        match best {
            Some((offered, _, rows, _)) => {
                println!(
                    "  {name:<11} {offered:.0}/s offered (load {:.2}): {:.0} req/s",
                    rows[s].load, rows[s].throughput
                );
                best_rps[s] = rows[s].throughput;
                at_sla.push(serde_json::json!({"system": name, "offered_rps": offered, "load": rows[s].load,
                    "throughput_rps": rows[s].throughput}));
            }
            None => {
                println!("  {name:<11} none of the rates");
                at_sla.push(serde_json::json!({"system": name, "offered_rps": null, "throughput_rps": 0.0}));
            }
        }
    }
    let base = best_rps[PREMA].iter().copied().fold(0.0, f64::max);
    if base > 0.0 {
        for (s, rps) in best_rps.iter().enumerate().filter(|(s, _)| !PREMA.contains(s)) {
            let name = results.first().map_or("", |r| r.2[s].system);
            println!("  ratio {name} / best PREMA-like: {:.2}x", rps / base);
        }
    }
    if let Some(path) = &args.svg {
        let series = |f: fn(&Row) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
            (0..systems)
                .map(|s| {
                    let name = results.first().map_or("", |r| r.2[s].system).to_string();
                    (name, results.iter().map(|(o, _, rows, _)| (o / 1e3, f(&rows[s]))).collect())
                })
                .collect()
        };
        let x = "offered rate (thousand requests/s)".to_string();
        let panels = [
            Panel {
                title: "throughput".into(),
                x_label: x.clone(),
                y_label: "completed (thousand requests/s)".into(),
                log_y: false,
                series: series(|r| r.throughput / 1e3),
            },
            Panel {
                title: "p99 latency (all requests)".into(),
                x_label: x.clone(),
                y_label: "p99 latency (us, log)".into(),
                log_y: true,
                series: series(|r| r.p99 * 1e6),
            },
            Panel {
                title: "busy-EU utilization".into(),
                x_label: x,
                y_label: "active SA+VU time / (8 EUs x time) (%)".into(),
                log_y: false,
                series: series(|r| 100.0 * r.util),
            },
        ];
        line_plots(path, &panels)?;
    }
    if let Some(path) = &args.json {
        let sys = |r: &Row| {
            serde_json::json!({"system": r.system, "load": r.load, "throughput_rps": r.throughput,
                "eu_utilization": r.util, "avg_latency_s": r.avg, "p99_latency_s": r.p99,
                "fairness": r.fairness, "antt": r.antt, "stp": r.stp, "context_switches": r.switches, "kills": r.kills, "sla_satisfaction": r.sla_rate,
                "sla_met": r.sla_met, "tenant_p99_latency_s": r.tenants_p99, "failed": r.failed,
                "tasks": r.tasks, "reclaim_waits": r.reclaim_waits, "reclaim_max_s": r.reclaim_max,
                "borrowed_eu_share": r.borrowed})
        };
        let v = serde_json::json!({
            "seconds": args.seconds, "seed": args.seed,
            "qos_factor": if args.sla_ms().is_some() { serde_json::Value::Null } else { serde_json::json!(args.qos) },
            "sla_ms": args.sla_ms(), "preempt_margin": args.margin, "prema_kill": args.prema_kill(),
            "mix": if args.equal_mix() { "equal" } else { "balanced" }, "context_switch_s": switch / hz,
            "saturation_rps": {"vNPU": sat_vnpu * wsum * hz, "vNPU-WC": sat_wc * wsum * hz, "vNPU-H": sat_h * wsum * hz,
                "PREMA-like": sat_prema * wsum * hz, "Planaria": sat_planaria * wsum * hz, "V10": sat_v10 * wsum * hz},
            "task_us": args.task_us, "lend_tolerance": args.tolerance, "spread_cost": args.spread_cost,
            "lend_limit_us": args.lend_limit_us,
            "tenants": ws.iter().zip(&weights).map(|(w, x)| serde_json::json!({"name": w.name,
                "t_1sa_1vu_s": w.t11 / hz, "t_4sa_4vu_s": w.t44 / hz, "sla_latency_s": w.sla / hz,
                "spread_width": w.spread_k, "t_spread_1sa_1vu_s": w.ts11 / hz, "t_spread_4sa_4vu_s": w.ts44 / hz,
                "rate_share": x / wsum, "priority": w.priority})).collect::<Vec<_>>(),
            "rates": results.iter().map(|(offered, n, rows, slow)| serde_json::json!({
                "offered_rps": offered, "owner_slowdown": {"mean_latency_ratio": slow.mean, "p99_latency_ratio": slow.p99,
                    "tenants": slow.tenants.iter().map(|(m, p)| serde_json::json!({"mean_latency_ratio": m, "p99_latency_ratio": p})).collect::<Vec<_>>()}, "requests": n.iter().sum::<usize>(), "requests_per_tenant": n, "systems": rows.iter().map(sys).collect::<Vec<_>>(),
                "vs_best_baseline": rows.iter().filter(|r| !r.system.starts_with("PREMA")).map(|us| {
                    let r = Ratios::of(us, &rows[PREMA]);
                    (us.system.to_string(), serde_json::json!({"throughput_ratio": r.throughput,
                        "eu_utilization_ratio": r.util, "p99_lower_ratio": r.p99}))
                }).collect::<serde_json::Map<_, _>>(),
            })).collect::<Vec<_>>(),
            "throughput_at_sla": at_sla,
        });
        std::fs::write(path, v.to_string()).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        fail("sharing-eval", &e);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use vnpu_abi::{Engine, Instr, ProgramBuilder, UnOp};

    /// `n` exp passes over 1 Mi elements on VU 0: compute only, so times
    /// add up by hand (each pass the same cycles, nothing shared).
    fn vu_work(n: usize) -> Program {
        let mut p = ProgramBuilder::new();
        for _ in 0..n {
            p.push(Engine::vu(0), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len: 1 << 20 });
        }
        p.finish()
    }

    /// `n` exp passes on each of `streams` logical VUs, marked spread.
    fn spread_work(streams: u8, n: usize) -> Program {
        let mut p = ProgramBuilder::new();
        for v in 0..streams {
            for _ in 0..n {
                p.push(Engine::vu(v), Instr::VUnary { op: UnOp::Exp, src: 0, dst: 0, len: 1 << 20 });
            }
        }
        let mut p = p.finish();
        p.spread = true;
        p
    }

    /// PREMA with a checkpoint of `checkpoint` cycles.
    fn prema(checkpoint: f64, margin: f64, kill: bool) -> OnRuntime {
        OnRuntime::Prema(Prema { margin, kill, checkpoint })
    }

    fn workload(board: &BoardConfig, name: &str, n11: usize, n44: usize) -> Workload {
        let (p11, p44) = (vu_work(n11), vu_work(n44));
        let t = |p: &Program| run_program(board, p, None, None).unwrap().cycles;
        let t44 = t(&p44);
        // The spread form: the 1+1 work over 4 logical VUs.
        let spread = spread_work(4, (n11 / 4).max(1));
        let on = |w| run_program_on(board, &spread, None, None, [1, 1], w).unwrap().cycles;
        let (ts11, ts44) = (on([1, 1]), on([4, 4]));
        let t11 = t(&p11);
        Workload {
            name: name.into(),
            share: Engines::new(1, 1),
            t11,
            t44,
            spread,
            spread_k: 4,
            ts11,
            ts44,
            sla: 10.0 * t44,
            p11,
            p44,
            priority: 1,
        }
    }

    #[test]
    fn each_vnpu_serves_its_tenants_requests_in_order_beside_the_others() {
        let board = BoardConfig::default();
        let ws = [workload(&board, "a", 4, 1), workload(&board, "b", 8, 2)];
        let pass = ws[0].t11 / 4.0;
        // a: two requests at 0 (the second queues behind the first), one
        // long after; b: one at 0, running beside a's on its own VU.
        let o = simulate_runtime(&board, &ws, &[vec![0.0, 0.0, 100.0 * pass], vec![0.0]], OnRuntime::Static)
            .unwrap();
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * y;
        let (a, b) = (&o.latencies[0], &o.latencies[1]);
        assert!(close(a[0], 4.0 * pass) && close(a[1], 8.0 * pass) && close(a[2], 4.0 * pass), "{a:?}");
        assert!(close(b[0], 8.0 * pass), "{b:?}");
        assert!(close(o.end, 104.0 * pass), "{}", o.end);
        assert_eq!((o.switches, o.failed), (0, 0));
    }

    #[test]
    fn a_harvesting_vnpu_borrows_idle_engines_and_gives_them_back() {
        let board = BoardConfig::default();
        // "a": 4 passes on each of 4 logical VUs; "b": one pass.
        let mut ws = [workload(&board, "a", 16, 4), workload(&board, "b", 4, 1)];
        ws[1].spread = spread_work(1, 1);
        let pass = ws[1].t44;
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * y;
        // Alone, "a" runs on every VU of the core: 4 passes with lending,
        // 16 without; 3 VUs x 4 passes borrowed.
        let lone = [vec![0.0], vec![]];
        let on =
            simulate_runtime(&board, &ws, &lone, OnRuntime::Harvest { lend_limit: f64::INFINITY }).unwrap();
        let off = simulate_runtime(&board, &ws, &lone, OnRuntime::Unlent).unwrap();
        assert!(close(on.latencies[0][0], 4.0 * pass), "{}", on.latencies[0][0] / pass);
        assert!(close(off.latencies[0][0], 16.0 * pass), "{}", off.latencies[0][0] / pass);
        assert!(close(on.borrowed_eu_cycles, 12.0 * pass), "{}", on.borrowed_eu_cycles / pass);
        assert_eq!((off.borrowed_eu_cycles, off.reclaim_waits), (0.0, 0));
        // "b" submits 1.5 passes in: it takes its VU back when a's pass on
        // it ends (2 passes) and runs its own pass there (until 3).
        let both = [vec![0.0], vec![1.5 * pass]];
        let on =
            simulate_runtime(&board, &ws, &both, OnRuntime::Harvest { lend_limit: f64::INFINITY }).unwrap();
        assert_eq!(on.reclaim_waits, 1);
        assert!(close(on.reclaim_max, 0.5 * pass), "{}", on.reclaim_max / pass);
        assert!(close(on.latencies[1][0], 1.5 * pass), "{}", on.latencies[1][0] / pass);
        let off = simulate_runtime(&board, &ws, &both, OnRuntime::Unlent).unwrap();
        assert!(close(off.latencies[1][0], pass), "{}", off.latencies[1][0] / pass);
        // The owner's slowdown from lending is its reclaim wait: 1.5x.
        let s = Slowdown::of(&on, &off);
        assert!(close(s.mean, 1.5) && close(s.p99, 1.5), "{s:?}");
    }

    #[test]
    fn the_prema_core_runs_one_request_at_a_time_and_a_short_one_preempts_a_long_one() {
        let board = BoardConfig::default();
        let ws = [workload(&board, "long", 400, 400), workload(&board, "short", 1, 1)];
        let pass = ws[1].t44;
        // No preemption between equals: two long requests at 0 run one
        // after the other on the whole core.
        let o =
            simulate_runtime(&board, &ws, &[vec![0.0, 0.0], vec![]], prema(10.0 * pass, 0.0, false)).unwrap();
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * y;
        assert!(close(o.latencies[0][0], 400.0 * pass) && close(o.latencies[0][1], 800.0 * pass));
        assert_eq!(o.switches, 0);
        // Normalized progress of "long": 400 passes alone / 600 on average;
        // "short" sent nothing and does not count.
        let r = summarize("PREMA", 0.5, &o, &ws, 8.0, 1.0);
        assert!(
            close(r.antt, 1.5) && close(r.stp, 2.0 / 3.0) && close(r.fairness, 1.0),
            "{} {}",
            r.antt,
            r.stp
        );
        // A short request arriving mid-way has more tokens at once (its
        // isolated time is 400 times shorter): the long one stops at the
        // end of its current pass, is checkpointed (5 passes), the short
        // one runs (1 pass), the long one is restored (5 passes) and ends.
        let switch = 10.0 * pass;
        let o = simulate_runtime(&board, &ws, &[vec![0.0], vec![100.5 * pass]], prema(switch, 0.0, false))
            .unwrap();
        assert_eq!(o.switches, 1);
        // Tokens overtake a moment after the arrival; the long one drains
        // the pass it is in (until 101 passes).
        let short = o.latencies[1][0];
        assert!(close(short, (101.0 + 5.0 + 1.0 - 100.5) * pass), "short: {short} vs pass {pass}");
        assert!(close(o.latencies[0][0], (400.0 + 11.0) * pass), "long: {}", o.latencies[0][0]);
        assert!(close(o.eu_cycles, 401.0 * pass), "{} vs {}", o.eu_cycles, 401.0 * pass);
        // With KILL the same stream checkpoints as before (the long one
        // had run 101 passes, more than a switch), but a short request
        // arriving 3.5 passes in kills it: it drains its pass (until 4),
        // the short one runs (1 pass), the long one starts again from
        // scratch (400 passes; no checkpoint, no restore); the 4 passes it
        // lost still count as busy engine time (the runtime's counters).
        let o = simulate_runtime(&board, &ws, &[vec![0.0], vec![100.5 * pass]], prema(switch, 0.0, true))
            .unwrap();
        assert_eq!((o.switches, o.kills), (1, 0));
        let o =
            simulate_runtime(&board, &ws, &[vec![0.0], vec![3.5 * pass]], prema(switch, 0.0, true)).unwrap();
        assert_eq!((o.switches, o.kills), (0, 1));
        let short = o.latencies[1][0];
        assert!(close(short, (4.0 + 1.0 - 3.5) * pass), "short: {short} vs pass {pass}");
        // It waited for the core: one engine switch before it starts again.
        let sw = npu_scheduler::switch_cycles(&board);
        assert!(close(o.latencies[0][0], (4.0 + 1.0 + 400.0) * pass + sw), "long: {}", o.latencies[0][0]);
        assert!(close(o.eu_cycles, 405.0 * pass), "{} vs {}", o.eu_cycles, 405.0 * pass);
    }

    #[test]
    fn fifo_serves_the_oldest_request_first_and_never_preempts() {
        let board = BoardConfig::default();
        let ws = [
            workload(&board, "long", 100, 100),
            workload(&board, "mid", 4, 4),
            workload(&board, "short", 1, 1),
        ];
        let pass = ws[2].t44;
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * y;
        // The long request runs to its end although the short one has
        // more tokens long before; then "mid" (arrived first), then
        // "short", each after one engine switch (it waited for the core).
        let arrivals = [vec![0.0], vec![10.0 * pass], vec![10.5 * pass]];
        let o = simulate_runtime(&board, &ws, &arrivals, OnRuntime::Fifo).unwrap();
        let l = |i: usize| o.latencies[i][0] / pass;
        let sw = npu_scheduler::switch_cycles(&board) / pass;
        assert!(
            close(l(0), 100.0) && close(l(1), 94.0 + sw) && close(l(2), 94.5 + 2.0 * sw),
            "{} {} {} (switch {sw})",
            l(0),
            l(1),
            l(2)
        );
        assert_eq!((o.switches, o.kills, o.failed), (0, 0, 0));
        // PREMA on the same stream preempts the long one for the short one.
        let o = simulate_runtime(&board, &ws, &arrivals, prema(10.0 * pass, 0.0, false)).unwrap();
        assert!(o.switches > 0);
    }

    /// PREMA's Algorithm 2 on hand-computed streams (tokens = priority x
    /// (1 + waited / isolated time); threshold = the highest level of 1, 3
    /// and 9 the largest count reached; the shortest candidate first).
    #[test]
    fn prema_tokens_grow_with_the_tenants_priority() {
        let board = BoardConfig::default();
        let mut ws = [
            workload(&board, "long", 100, 100),
            workload(&board, "mid", 4, 4),
            workload(&board, "short", 1, 1),
        ];
        let pass = ws[2].t44;
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * y;
        let drain = prema(10.0 * pass, f64::INFINITY, false);
        let l = |o: &Outcome, i: usize| o.latencies[i][0] / pass;
        let sw = npu_scheduler::switch_cycles(&board) / pass;
        // "mid" and "short" arrive together at 10 while "long" runs; when
        // it ends (100 passes) they have waited 90: tokens 1 + 90 / 4 =
        // 23.5 and 1 + 90 = 91, threshold 9, both candidates: the shortest,
        // "short", runs first. Each starts after an engine switch.
        let o =
            simulate_runtime(&board, &ws, &[vec![0.0], vec![10.0 * pass], vec![10.0 * pass]], drain).unwrap();
        let (short, mid) = (l(&o, 2), l(&o, 1));
        assert!(close(short, 91.0 + sw) && close(mid, 95.0 + 2.0 * sw), "{mid} {short} (switch {sw})");
        // "short" arriving at 95 instead has 1 + 5 = 6 tokens at 100, below
        // the threshold of 9 that "mid"'s 23.5 set: "mid" runs first.
        let late = [vec![0.0], vec![10.0 * pass], vec![95.0 * pass]];
        let o = simulate_runtime(&board, &ws, &late, drain).unwrap();
        let (short, mid) = (l(&o, 2), l(&o, 1));
        assert!(close(mid, 94.0 + sw) && close(short, 10.0 + 2.0 * sw), "{mid} {short} (switch {sw})");
        // At priority 9 "short" has 9 x 6 = 54 tokens: a candidate, and
        // the shortest: it goes first.
        ws[2].priority = 9;
        let o = simulate_runtime(&board, &ws, &late, drain).unwrap();
        let (short, mid) = (l(&o, 2), l(&o, 1));
        assert!(close(short, 6.0 + sw) && close(mid, 95.0 + 2.0 * sw), "{mid} {short} (switch {sw})");
        // Preemption: a short request arriving at 100.5 passes into a
        // 400-pass one is a candidate at once (every count is 1) and
        // shorter: the long one drains its pass (until 101), is
        // checkpointed (5), the short one runs (1). At priority 12 the
        // running one's 12 tokens set the threshold at 9; the short one
        // reaches 9 tokens at 100.5 + 8 = 108.5 passes, stops the long one
        // then (it drains until 109), checkpoint (5), short (1).
        let mut ws = [workload(&board, "long", 400, 400), workload(&board, "short", 1, 1)];
        let ckpt = prema(10.0 * pass, 0.0, false);
        let arrivals = [vec![0.0], vec![100.5 * pass]];
        let o = simulate_runtime(&board, &ws, &arrivals, ckpt).unwrap();
        assert!(close(l(&o, 1), 101.0 + 5.0 + 1.0 - 100.5), "{}", l(&o, 1));
        ws[0].priority = 12;
        let o = simulate_runtime(&board, &ws, &arrivals, ckpt).unwrap();
        assert!(close(l(&o, 1), 109.0 + 5.0 + 1.0 - 100.5), "{}", l(&o, 1));
        assert!(close(l(&o, 0), 400.0 + 11.0), "{}", l(&o, 0));
    }

    #[test]
    fn fairness_weighs_each_tenants_progress_by_its_priority() {
        let board = BoardConfig::default();
        let mut ws = [workload(&board, "a", 1, 1), workload(&board, "b", 1, 1)];
        let t = ws[0].t44;
        // Normalized progress 1/2 and 1/4.
        let o = Outcome {
            latencies: vec![vec![2.0 * t], vec![3.0 * t, 5.0 * t]],
            end: 10.0 * t,
            ..Outcome::new(2)
        };
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * y;
        let r = summarize("x", 0.5, &o, &ws, 8.0, 1.0);
        assert!(close(r.fairness, 0.5), "{}", r.fairness);
        // Priorities 1 and 3: shares 1/4 and 3/4, so PP = 0.5 / 0.25 = 2
        // and 0.25 / 0.75 = 1/3; fairness 1/6. ANTT and STP do not weigh.
        ws[1].priority = 3;
        let r = summarize("x", 0.5, &o, &ws, 8.0, 1.0);
        assert!(close(r.fairness, 1.0 / 6.0), "{}", r.fairness);
        assert!(close(r.antt, 3.0) && close(r.stp, 0.75), "{} {}", r.antt, r.stp);
        // b at priority 1/2 of a's would make both equal: fairness 1.
        ws[0].priority = 6;
        let r = summarize("x", 0.5, &o, &ws, 8.0, 1.0);
        assert!(close(r.fairness, 1.0), "{}", r.fairness);
    }

    #[test]
    fn saturation_is_where_the_busiest_vnpu_or_the_whole_core_is_always_busy() {
        let board = BoardConfig::default();
        let ws = [workload(&board, "a", 2, 1), workload(&board, "b", 8, 4)];
        let w = [1.0, 1.0];
        // vNPU: b's vNPU saturates first at 1 / t11(b) per cycle.
        let s = saturation_runtime(&board, &ws, &w, 20, OnRuntime::Static).unwrap();
        assert!((s * ws[1].t11 - 1.0).abs() < 1e-6, "{s} vs {}", 1.0 / ws[1].t11);
        // PREMA-like: one of each per t44(a) + t44(b).
        let p = saturation_prema(&ws, &w);
        assert!((p * (ws[0].t44 + ws[1].t44) - 1.0).abs() < 1e-12);
    }
}
