//! SLO evaluation of an oversubscribed core: vNPUs of different
//! shapes whose claims exceed one physical core (4 SA + 4 VU), two of them
//! latency-critical with a latency target, two batch-like without, all
//! with Poisson arrivals. The core is the device's own board runtime
//! (`npu_board_runtime::Runtime`, what `SharedCore` runs): each vNPU's
//! requests join core 0 in turn (one at a time per vNPU, the rest queue in
//! the guest's ring), waiting requests placed as soon as their claims fit,
//! a request that had to wait paying `npu_scheduler::switch_cycles`. Only
//! the scheduling policy differs (`Runtime::set_policy`):
//!
//! - **EDF+preempt** (this system, `npu_scheduler::schedule`): waiting
//!   requests by priority, then earliest deadline, then arrival, first fit;
//!   the most urgent one left over suspends less urgent running requests
//!   (`CoreSim::suspend`, resumed where they stopped after a context
//!   switch) until it fits;
//! - **priority + EDF**: the same order, no preemption;
//! - **FIFO**: arrival order only, no preemption.
//!
//! For each offered load it prints, per order, the latency-critical
//! tenants' SLO attainment and p99, the throughput and the core's EU
//! utilization; `--json PATH` writes the same with every tenant.
//!
//! `cargo build --release -p npu-bench && target/release/slo-eval --help`

use clap::Parser;
use npu_bench::{fail, p99, positive, serve_arrivals, usage_error, BoardArg, Request, Rng, Tenant};
use npu_board_runtime::Runtime;
use npu_model::BoardConfig;
use npu_scheduler::{admission_order, fifo, placements, schedule, switch_cycles, Claim, Decision, Pending};
use npu_workloads::{lower_workload, RunOptions};
use vnpu_abi::Program;

struct VnpuTenant {
    name: &'static str,
    program: Program,
    claim: Claim,
    /// Cycles of one request alone on the core.
    alone: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Policy {
    /// The device's policy: `npu_scheduler::schedule`.
    Preemptive,
    PriorityEdf,
    Fifo,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::Preemptive => "EDF+preempt",
            Policy::PriorityEdf => "priority+EDF",
            Policy::Fifo => "FIFO",
        }
    }
}

#[derive(Default)]
struct Outcome {
    /// Latencies (cycles) per tenant.
    latencies: Vec<Vec<f64>>,
    slo_met: Vec<usize>,
    end: f64,
    eu_cycles: f64,
    waited: usize,
    preempted: usize,
}

fn simulate(
    board: &BoardConfig,
    ts: &[VnpuTenant],
    arrivals: &[Vec<f64>],
    policy: Policy,
) -> Result<Outcome, String> {
    let n = ts.len();
    let mut o = Outcome { latencies: vec![Vec::new(); n], slo_met: vec![0; n], ..Default::default() };
    // The board runtime the device runs (core 0 of the board), with the
    // order under test.
    let mut rt: Runtime<'_, Request<'_>> = Runtime::new(board);
    rt.set_policy(match policy {
        Policy::Preemptive => schedule,
        Policy::PriorityEdf => priority_edf,
        Policy::Fifo => fifo,
    });
    let tenants: Vec<_> = ts
        .iter()
        .map(|t| Tenant { name: t.name.to_string(), claim: t.claim, program: &t.program, estimate: 0.0 })
        .collect();
    serve_arrivals(&mut rt, arrivals, &tenants, |done| {
        let req = done.job;
        let t = done.result.map_err(|e| format!("{}: {e}", ts[req.tenant].name))?;
        let tot = t.totals();
        o.eu_cycles += tot.sa_active_cycles + tot.vu_active_cycles;
        let lat = done.end - req.arrival;
        o.latencies[req.tenant].push(lat);
        let slo = ts[req.tenant].claim.slo_cycles;
        if slo > 0 && lat <= slo as f64 {
            o.slo_met[req.tenant] += 1;
        }
        Ok(())
    })?;
    let st = rt.stats(0);
    o.waited = st.waited as usize;
    o.preempted = st.preempted as usize;
    o.end = rt.now();
    Ok(o)
}

/// The claims of `ps`.
fn claims(ps: &[Pending]) -> Vec<Claim> {
    ps.iter().map(|p| p.claim).collect()
}

/// Priority, then earliest deadline, first fit; no preemption.
fn priority_edf(board: &BoardConfig, w: &[Pending], r: &[Pending]) -> Decision {
    Decision { place: placements(board, &claims(w), &admission_order(w), &claims(r)), ..Decision::default() }
}

/// SLO evaluation of an oversubscribed core: four vNPUs whose claims exceed
/// one 4 SA + 4 VU core, two with a latency target, under EDF with
/// preemption, priority + EDF without, and FIFO; per offered load, SLO
/// attainment, p99, throughput and EU utilization.
#[derive(Parser, Debug)]
#[command(name = "slo-eval")]
struct Args {
    /// Offered loads, comma-separated: at 1.0 the tenants' requests, each
    /// run alone on its vNPU's shape, would keep every EU of the core busy
    /// (at most 2: more would never drain).
    #[arg(long = "load", value_delimiter = ',', value_parser = positive, default_values_t = [0.3, 0.5, 0.7, 0.9])]
    loads: Vec<f64>,
    /// Simulated seconds of arrivals per load (at most 10).
    #[arg(long, default_value_t = 0.5, value_parser = positive)]
    seconds: f64,
    /// Arrival seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the results as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<String>,
    #[command(flatten)]
    board: BoardArg,
}

fn parse_args() -> Args {
    let mut a = Args::parse();
    if a.loads.iter().any(|x| *x > 2.0) {
        usage_error::<Args>("--load: loads above 2 would never drain");
    }
    a.seconds = a.seconds.min(10.0);
    a
}

fn run() -> Result<(), String> {
    let args = parse_args();
    let board = args.board.load()?;
    let hz = f64::from(board.clock_mhz) * 1e6;
    let us = |c: f64| c / hz * 1e6;
    // (name, workload, batch, SAs, VUs, latency target in ms or 0).
    let mix = [
        ("ncf-rt", "ncf", 8u32, 1u32, 1u32, 1.0f64),
        ("dlrm-rt", "dlrm", 8, 1, 2, 1.0),
        ("bert", "bert", 1, 2, 1, 0.0),
        ("resnet50", "resnet50", 1, 2, 1, 0.0),
    ];
    let mut ts = Vec::new();
    // Each vNPU has a quarter of the core's SRAM (4 MiB on the default
    // board), whole slices.
    let slice = npu_model::config::SRAM_SLICE;
    let sram = (board.sram_bytes() / 4 / slice).max(1) * slice;
    for (name, w, batch, sa, vu, slo_ms) in mix {
        let o = RunOptions {
            sa,
            vu,
            sram_bytes: Some(sram),
            hbm_bytes: Some(8 << 30),
            ..RunOptions::on_board(&board, w, batch)
        };
        let (lowered, _, _) = lower_workload(&board, &o).map_err(|e| format!("{w}: {e}"))?;
        let alone = npu_model::run_program(&board, &lowered.program, None, None)
            .map_err(|e| format!("{w}: {e}"))?
            .cycles;
        let claim =
            Claim { sa, vu, priority: 0, slo_cycles: (slo_ms * 1e-3 * hz) as u64, ..Claim::default() };
        ts.push(VnpuTenant { name, program: lowered.program, claim, alone });
    }
    let (csa, cvu) = (board.core.sa_count, board.core.vu_count);
    let eus = f64::from(csa + cvu);
    let claimed: (u32, u32) = ts.iter().fold((0, 0), |a, t| (a.0 + t.claim.sa, a.1 + t.claim.vu));
    println!(
        "{} vNPUs claiming {} SA + {} VU on one core of {csa} SA + {cvu} VU; context switch {:.2} us; Poisson arrivals for {} s, seed {}",
        ts.len(),
        claimed.0,
        claimed.1,
        us(switch_cycles(&board)),
        args.seconds,
        args.seed
    );
    for t in &ts {
        println!(
            "  {:<9} {} SA + {} VU  alone {:>8.1} us  latency target {}",
            t.name,
            t.claim.sa,
            t.claim.vu,
            us(t.alone),
            if t.claim.slo_cycles > 0 {
                format!("{:.1} ms", us(t.claim.slo_cycles as f64) / 1e3)
            } else {
                "none".into()
            }
        );
    }
    println!(
        "\n{:>5} {:<13} {:>12} {:>12} {:>12} {:>12} {:>12} {:>9} {:>8} {:>8}",
        "load",
        "order",
        "ncf-rt SLO",
        "dlrm-rt SLO",
        "ncf-rt p99",
        "dlrm-rt p99",
        "bert avg",
        "req/s",
        "EU util",
        "preempt"
    );
    let mut rows = Vec::new();
    for &load in &args.loads {
        let mut rng = Rng(args.seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ load.to_bits());
        // Each tenant offers an equal share of the core's EU time.
        let arrivals: Vec<Vec<f64>> = ts
            .iter()
            .map(|t| {
                let share = eus / ts.len() as f64 / f64::from(t.claim.sa + t.claim.vu);
                rng.arrivals(t.alone / (load * share), args.seconds * hz)
            })
            .collect();
        for policy in [Policy::Preemptive, Policy::PriorityEdf, Policy::Fifo] {
            let o = simulate(&board, &ts, &arrivals, policy)?;
            let done: usize = o.latencies.iter().map(Vec::len).sum();
            let attain = |i: usize| o.slo_met[i] as f64 / o.latencies[i].len().max(1) as f64;
            let throughput = done as f64 / (o.end / hz);
            let util = o.eu_cycles / (eus * o.end);
            println!(
                "{load:>5} {:<13} {:>11.1}% {:>11.1}% {:>9.1} us {:>9.1} us {:>9.1} us {:>9.0} {:>7.1}% {:>8}",
                policy.name(),
                100.0 * attain(0),
                100.0 * attain(1),
                us(p99(&o.latencies[0])),
                us(p99(&o.latencies[1])),
                us(o.latencies[2].iter().sum::<f64>() / o.latencies[2].len().max(1) as f64),
                throughput,
                100.0 * util,
                o.preempted
            );
            rows.push(serde_json::json!({
                "load": load, "order": policy.name(), "requests_that_waited": o.waited, "preemptions": o.preempted,
                "throughput_rps": throughput, "eu_utilization": util,
                "tenants": ts.iter().enumerate().map(|(i, t)| serde_json::json!({
                    "name": t.name, "requests": o.latencies[i].len(),
                    "slo_s": if t.claim.slo_cycles > 0 { Some(t.claim.slo_cycles as f64 / hz) } else { None },
                    "slo_attainment": if t.claim.slo_cycles > 0 { Some(attain(i)) } else { None },
                    "avg_latency_s": o.latencies[i].iter().sum::<f64>() / o.latencies[i].len().max(1) as f64 / hz,
                    "p99_latency_s": p99(&o.latencies[i]) / hz,
                })).collect::<Vec<_>>(),
            }));
        }
    }
    if let Some(path) = &args.json {
        let v = serde_json::json!({"seconds": args.seconds, "seed": args.seed, "results": rows});
        std::fs::write(path, v.to_string()).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        fail("slo-eval", &e);
    }
}
