//! Sharing evaluation (issue 5): SA-heavy and VU-heavy tenants with Poisson
//! arrivals on one physical core (4 SA + 4 VU), served by
//!
//! - **vNPU** (this system): each tenant owns a 1 SA + 1 VU vNPU of the core
//!   (spatial sharing at EU granularity); its requests queue FIFO on it, and
//!   its service time includes the slowdown the model measures when the
//!   other three tenants run on the same core at the same time (HBM
//!   contention), whether or not they are busy then (pessimistic for vNPU);
//! - **PREMA-like**: the whole core time-shared, one request at a time on
//!   all 4 SA + 4 VU, preemptive: a waiting request with more tokens (waiting
//!   time normalized by its isolated time, PREMA's token rule) preempts the
//!   running one, paying a context switch (saving and restoring the SRAM
//!   state through the DMA engine) unless the running one is about to end
//!   (then it drains). Decisions are taken at arrivals and at the moment a
//!   waiter's tokens overtake the running request's (by `--preempt-margin`
//!   context switches normalized to the waiter; default 0).
//!
//! Service times come from the NPU model (simulated) for each workload on
//! 1+1 and on 4+4; the arrivals are the same for both systems. For each
//! offered load it reports throughput, EU utilization, average and p99
//! latency, PREMA's fairness and the SLA satisfaction rate (requests within
//! `--qos` times their isolated whole-core latency); then the throughput
//! each system sustains at the SLA (every tenant's p99 within its bound).
//!
//! `cargo build --release -p npu-bench && target/release/sharing-eval [--load 0.05,0.1,...] [--seconds 1] [--seed 1] [--qos 10] [--json out.json]`

use npu_bench::{fail, loads, p99, positive, seed, Rng};
use npu_model::{run_core, run_program, BoardConfig, Tenant as CoreTenant};
use npu_workloads::{lower_workload, run_workload, RunOptions, RunReport};
use vnpu_abi::{Instr, Program, Stream};

const USAGE: &str = "usage: sharing-eval [--load F[,F...]] [--seconds S] [--seed N] [--qos F] [--preempt-margin M] [--json PATH]

  --load     offered loads: each tenant's arrival rate as a fraction of what
             its own 1 SA + 1 VU vNPU serves (default 0.01,0.02,0.05,0.1,0.2,...,0.9)
  --seconds  simulated seconds of arrivals per load (default 1)
  --seed     arrival seed (default 1)
  --qos      latency bound of each request: F times its workload's isolated
             latency on the whole core (default 10)
  --preempt-margin M
             PREMA-like: a waiter preempts once its tokens exceed the running
             request's by M context switches (normalized to the waiter);
             0 (default) is PREMA's plain token rule
  --json     also write the results as JSON to PATH";

#[derive(Clone, Debug)]
struct Workload {
    name: String,
    /// Seconds on 1 SA + 1 VU alone, on 1+1 beside the other tenants'
    /// 1+1 vNPUs (all busy), and on the whole core.
    t11: f64,
    t11_shared: f64,
    t44: f64,
    /// Active EU-seconds of one request on either shape (summed over
    /// engines; a transfer's contention does not count as activity).
    eu11: f64,
    eu44: f64,
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    makespan: f64,
    latencies: Vec<Vec<f64>>,
    eu_seconds: f64,
    switches: u64,
}

fn spatial(ws: &[Workload], arrivals: &[Vec<f64>]) -> Outcome {
    let mut o = Outcome { latencies: vec![Vec::new(); ws.len()], ..Default::default() };
    for (i, (w, arr)) in ws.iter().zip(arrivals).enumerate() {
        let mut free = 0f64;
        for &a in arr {
            let start = free.max(a);
            free = start + w.t11_shared;
            o.latencies[i].push(free - a);
            o.eu_seconds += w.eu11;
        }
        o.makespan = o.makespan.max(free);
    }
    o
}

/// `margin`: how many context switches' worth of tokens (normalized to the
/// waiter) a waiter must be ahead before it preempts (0: PREMA's token rule).
fn prema(ws: &[Workload], arrivals: &[Vec<f64>], switch: f64, margin: f64) -> Outcome {
    #[derive(Clone, Copy)]
    struct Req {
        tenant: usize,
        arrival: f64,
        left: f64,
        started: bool,
    }
    let mut o = Outcome { latencies: vec![Vec::new(); ws.len()], ..Default::default() };
    let mut all: Vec<(f64, usize)> =
        arrivals.iter().enumerate().flat_map(|(i, a)| a.iter().map(move |a| (*a, i))).collect();
    all.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut next = 0;
    let mut queue: Vec<Req> = Vec::new();
    let mut running: Option<Req> = None;
    let mut now = 0f64;
    // Tokens: waiting time over isolated time (PREMA's slowdown-normalized
    // priority, all tenants of equal priority).
    let tokens = |r: &Req, now: f64| (now - r.arrival) / ws[r.tenant].t44;
    let admit = |queue: &mut Vec<Req>, next: &mut usize, now: f64| {
        while *next < all.len() && all[*next].0 <= now {
            let (a, i) = all[*next];
            queue.push(Req { tenant: i, arrival: a, left: ws[i].t44, started: false });
            *next += 1;
        }
    };
    let best = |queue: &[Req], now: f64| {
        (0..queue.len()).max_by(|&x, &y| tokens(&queue[x], now).total_cmp(&tokens(&queue[y], now)))
    };
    loop {
        if running.is_none() && queue.is_empty() {
            if next >= all.len() {
                break;
            }
            now = now.max(all[next].0);
        }
        admit(&mut queue, &mut next, now);
        let Some(mut r) = running else {
            if let Some(k) = best(&queue, now) {
                let mut r = queue.swap_remove(k);
                if r.started {
                    // Restoring its state.
                    now += switch / 2.0;
                }
                r.started = true;
                running = Some(r);
            }
            continue;
        };
        let done_at = now + r.left;
        // The next scheduling decision: an arrival, or the moment a
        // waiter's tokens overtake the running request's (tokens grow with
        // time over isolated time, so only a shorter request overtakes).
        let mut next_event = all.get(next).map_or(f64::INFINITY, |x| x.0);
        let tr = ws[r.tenant].t44;
        for w in &queue {
            let tw = ws[w.tenant].t44;
            if tw < tr && tokens(w, now) <= tokens(&r, now) + margin * switch / tw {
                let t = (w.arrival / tw - r.arrival / tr + margin * switch / tw) / (1.0 / tw - 1.0 / tr);
                // A nanosecond past the crossing, so the waiter is strictly ahead.
                next_event = next_event.min(t.max(now) + 1e-9);
            }
        }
        if done_at <= next_event {
            now = done_at;
            o.latencies[r.tenant].push(now - r.arrival);
            o.eu_seconds += ws[r.tenant].eu44;
            running = None;
            continue;
        }
        // An arrival or an overtaking waiter: preempt if a waiter now has
        // more tokens and the running request is not about to finish (else
        // drain).
        r.left -= next_event - now;
        now = next_event;
        admit(&mut queue, &mut next, now);
        match best(&queue, now) {
            Some(k)
                if tokens(&queue[k], now) > tokens(&r, now) + margin * switch / ws[queue[k].tenant].t44
                    && r.left > switch =>
            {
                now += switch / 2.0; // saving its state
                o.switches += 1;
                queue.push(r);
                let mut n = queue.swap_remove(k);
                if n.started {
                    now += switch / 2.0;
                }
                n.started = true;
                running = Some(n);
            }
            _ => running = Some(r),
        }
    }
    o.makespan = now;
    o
}

/// `p` with every stream's code repeated `n` times (one final halt):
/// back-to-back requests of one tenant.
fn repeated(p: &Program, n: usize) -> Program {
    let streams = p
        .streams
        .iter()
        .map(|s| {
            let body: Vec<Instr> = s.code.iter().copied().filter(|i| *i != Instr::Halt).collect();
            let mut code = Vec::with_capacity(body.len() * n + 1);
            for _ in 0..n {
                code.extend_from_slice(&body);
            }
            code.push(Instr::Halt);
            Stream { engine: s.engine, code }
        })
        .collect();
    Program { streams }
}

/// Per tenant: its 1+1 time on a core whose other three 1+1 vNPUs run
/// their own workloads back to back for the whole time.
fn shared_times(board: &BoardConfig, programs: &[Program], alone: &[f64]) -> Result<Vec<f64>, String> {
    let mut out = Vec::with_capacity(programs.len());
    for (i, victim) in programs.iter().enumerate() {
        let neighbours: Vec<Program> = programs
            .iter()
            .zip(alone)
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, (p, t))| repeated(p, (alone[i] / t).ceil() as usize + 1))
            .collect();
        let mut ts = vec![CoreTenant { program: victim, memory: None, max_cycles: None }];
        ts.extend(neighbours.iter().map(|p| CoreTenant { program: p, memory: None, max_cycles: None }));
        let r = run_core(board, &mut ts);
        let cycles = match r.tenants.first() {
            Some(Ok(t)) => t.cycles,
            Some(Err(e)) => return Err(format!("co-located run failed: {e}")),
            None => return Err("co-located run returned no tenant".into()),
        };
        out.push(cycles / (f64::from(board.clock_mhz) * 1e6));
    }
    Ok(out)
}

struct Args {
    loads: Vec<f64>,
    seconds: f64,
    seed: u64,
    qos: f64,
    margin: f64,
    json: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        loads: [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9].to_vec(),
        seconds: 1.0,
        seed: 1,
        qos: 10.0,
        margin: 0.0,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--load" => a.loads = loads(it.next(), 4.0)?,
            "--seconds" => a.seconds = positive("--seconds", it.next())?.min(60.0),
            "--seed" => a.seed = seed(it.next())?,
            "--qos" => a.qos = positive("--qos", it.next())?,
            "--preempt-margin" => {
                let v = it.next().ok_or("--preempt-margin needs a value")?;
                a.margin = v.parse().map_err(|_| format!("--preempt-margin: `{v}` is not a number"))?;
                if !(0.0..=100.0).contains(&a.margin) {
                    return Err(format!("--preempt-margin: {v} must be in 0..=100"));
                }
            }
            "--json" => a.json = Some(it.next().ok_or("--json needs a path")?),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

struct Row {
    system: &'static str,
    throughput: f64,
    util: f64,
    avg: f64,
    p99: f64,
    fairness: f64,
    switches: u64,
    sla_rate: f64,
    /// Every tenant's p99 within its bound.
    sla_met: bool,
    tenants_p99: Vec<f64>,
}

fn summarize(system: &'static str, o: Outcome, ws: &[Workload], qos: f64, eus: f64) -> Row {
    let done: usize = o.latencies.iter().map(Vec::len).sum();
    let all: Vec<f64> = o.latencies.iter().flatten().copied().collect();
    let within: usize =
        o.latencies.iter().zip(ws).map(|(l, w)| l.iter().filter(|x| **x <= qos * w.t44).count()).sum();
    let avg = all.iter().sum::<f64>() / all.len().max(1) as f64;
    let tail = p99(&all);
    // PREMA's fairness: min over tenants of normalized progress (isolated
    // time on the whole core / time in the shared system) over the max.
    let np: Vec<f64> = o
        .latencies
        .iter()
        .zip(ws)
        .filter(|(l, _)| !l.is_empty())
        .map(|(l, w)| w.t44 / (l.iter().sum::<f64>() / l.len() as f64))
        .collect();
    let fairness = np.iter().copied().fold(f64::INFINITY, f64::min) / np.iter().copied().fold(0.0, f64::max);
    let tenants_p99: Vec<f64> = o.latencies.iter().map(|l| p99(l)).collect();
    let sla_met = tenants_p99.iter().zip(ws).all(|(p, w)| *p <= qos * w.t44);
    Row {
        system,
        throughput: done as f64 / o.makespan,
        util: o.eu_seconds / (eus * o.makespan),
        avg,
        p99: tail,
        fairness,
        switches: o.switches,
        sla_rate: within as f64 / done.max(1) as f64,
        sla_met,
        tenants_p99,
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let board = BoardConfig::default();
    let hz = f64::from(board.clock_mhz) * 1e6;
    let mix = [("bert", 1u32), ("resnet50", 1), ("dlrm", 8), ("ncf", 8)];
    let mut ws = Vec::new();
    let mut programs = Vec::new();
    for (w, batch) in mix {
        let opts = |sa, vu| RunOptions {
            sa,
            vu,
            sram_bytes: Some(8 << 20),
            hbm_bytes: Some(8 << 30),
            ..RunOptions::timing(w, batch)
        };
        let run = |sa, vu| run_workload(&board, &opts(sa, vu)).map_err(|e| format!("{w}: {e}"));
        let (r11, r44) = (run(1, 1)?, run(4, 4)?);
        let (lowered, _, _) = lower_workload(&board, &opts(1, 1)).map_err(|e| format!("{w}: {e}"))?;
        // The program the co-located run uses must be the one timed alone.
        let alone = run_program(&board, &lowered.program, None, None).map_err(|e| format!("{w}: {e}"))?;
        if (alone.cycles / hz - r11.simulated_seconds).abs() > 1e-9 {
            return Err(format!("{w}: lowered program and workload run disagree"));
        }
        programs.push(lowered.program);
        let eu = |r: &RunReport| (r.sa_active_cycles + r.vu_active_cycles) as f64 / hz;
        ws.push(Workload {
            name: format!("{w} b{batch}"),
            t11: r11.simulated_seconds,
            t11_shared: r11.simulated_seconds,
            t44: r44.simulated_seconds,
            eu11: eu(&r11),
            eu44: eu(&r44),
        });
    }
    let alone: Vec<f64> = ws.iter().map(|w| w.t11).collect();
    for (w, t) in ws.iter_mut().zip(shared_times(&board, &programs, &alone)?) {
        w.t11_shared = t;
    }
    // Context switch: save and restore the SRAM state of one vNPU-sized
    // tenant (8 MiB each way) at the DMA engine's rate.
    let switch = 2.0 * (8u64 << 20) as f64 / (board.dma.gbps * 1e9);
    println!(
        "4 tenants on one core (4 SA + 4 VU); Poisson arrivals for {} s, seed {}; PREMA context switch {:.1} us; SLA: latency <= {} x isolated whole-core latency",
        args.seconds,
        args.seed,
        switch * 1e6,
        args.qos
    );
    println!(
        "  {:<12} {:>10} {:>14} {:>10} {:>9} {:>10}",
        "tenant", "1+1 us", "1+1 shared us", "4+4 us", "4+4 gain", "SLA us"
    );
    for w in &ws {
        println!(
            "  {:<12} {:>10.1} {:>14.1} {:>10.1} {:>8.2}x {:>10.1}",
            w.name,
            w.t11 * 1e6,
            w.t11_shared * 1e6,
            w.t44 * 1e6,
            w.t11 / w.t44,
            args.qos * w.t44 * 1e6
        );
    }
    let eus = f64::from(board.core.sa_count + board.core.vu_count);
    println!(
        "\n{:>5} {:<12} {:>9} {:>8} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "load", "system", "req/s", "EU util", "avg us", "p99 us", "fairness", "in SLA", "switches"
    );
    let mut results = Vec::new();
    for &load in &args.loads {
        let mut rng = Rng(args.seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ load.to_bits());
        // Each tenant's arrival rate is `load` of what its own 1+1 vNPU serves alone.
        let arrivals: Vec<Vec<f64>> = ws.iter().map(|w| rng.arrivals(w.t11 / load, args.seconds)).collect();
        let rows = [
            summarize("vNPU", spatial(&ws, &arrivals), &ws, args.qos, eus),
            summarize("PREMA-like", prema(&ws, &arrivals, switch, args.margin), &ws, args.qos, eus),
        ];
        for r in &rows {
            println!(
                "{load:>5} {:<12} {:>9.0} {:>7.1}% {:>10.1} {:>10.1} {:>8.3} {:>7.1}% {:>8}",
                r.system,
                r.throughput,
                100.0 * r.util,
                r.avg * 1e6,
                r.p99 * 1e6,
                r.fairness,
                100.0 * r.sla_rate,
                r.switches
            );
        }
        println!(
            "{:>5} vNPU / PREMA-like: throughput {:.2}x, EU utilization {:.2}x",
            "",
            rows[0].throughput / rows[1].throughput,
            rows[0].util / rows[1].util
        );
        let n: usize = arrivals.iter().map(Vec::len).sum();
        results.push((load, n, rows));
    }
    // Throughput at the SLA: the highest offered load at which every
    // tenant's p99 is within its bound.
    println!("\nthroughput at the SLA (highest load above with every tenant's p99 within its bound):");
    let mut at_sla = Vec::new();
    for s in 0..2 {
        let best = results.iter().filter(|(_, _, rows)| rows[s].sla_met).max_by(|a, b| a.0.total_cmp(&b.0));
        let name = results.first().map_or("", |r| r.2[s].system);
        match best {
            Some((load, _, rows)) => {
                println!("  {name:<12} load {load}: {:.0} req/s", rows[s].throughput);
                at_sla.push(
                    serde_json::json!({"system": name, "load": load, "throughput_rps": rows[s].throughput}),
                );
            }
            None => {
                println!("  {name:<12} none of the loads");
                at_sla.push(serde_json::json!({"system": name, "load": null, "throughput_rps": 0.0}));
            }
        }
    }
    if let Some(path) = &args.json {
        let sys = |r: &Row| {
            serde_json::json!({"system": r.system, "throughput_rps": r.throughput, "eu_utilization": r.util,
                "avg_latency_s": r.avg, "p99_latency_s": r.p99, "fairness": r.fairness,
                "context_switches": r.switches, "sla_satisfaction": r.sla_rate, "sla_met": r.sla_met,
                "tenant_p99_latency_s": r.tenants_p99})
        };
        let v = serde_json::json!({
            "seconds": args.seconds, "seed": args.seed, "qos_factor": args.qos, "preempt_margin": args.margin, "context_switch_s": switch,
            "tenants": ws.iter().map(|w| serde_json::json!({"name": w.name, "t_1sa_1vu_s": w.t11,
                "t_1sa_1vu_colocated_s": w.t11_shared, "t_4sa_4vu_s": w.t44,
                "sla_latency_s": args.qos * w.t44})).collect::<Vec<_>>(),
            "loads": results.iter().map(|(load, n, rows)| serde_json::json!({
                "load": load, "requests": n, "systems": rows.iter().map(sys).collect::<Vec<_>>(),
                "throughput_ratio": rows[0].throughput / rows[1].throughput,
                "eu_utilization_ratio": rows[0].util / rows[1].util,
            })).collect::<Vec<_>>(),
            "throughput_at_sla": at_sla,
        });
        std::fs::write(path, v.to_string()).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        fail("sharing-eval", USAGE, &e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(name: &str, t11: f64, t44: f64) -> Workload {
        Workload { name: name.into(), t11, t11_shared: t11, t44, eu11: t11, eu44: t44 }
    }

    #[test]
    fn a_short_request_preempts_a_long_one_once_its_tokens_pay_for_the_switch() {
        let ws = [w("long", 4e-3, 2e-3), w("short", 10e-6, 10e-6)];
        // The long request starts at 0; the short one arrives at 100 us.
        let o = prema(&ws, &[vec![0.0], vec![100e-6]], 40e-6, 1.0);
        assert_eq!(o.switches, 1);
        let short = o.latencies[1][0];
        // Waits until its tokens exceed the long one's by switch / 10 us = 4,
        // then pays half a switch (checkpoint) and runs.
        assert!(short > 40e-6 && short < 100e-6, "{short}");
        // The long one is delayed by the checkpoint, the short run and its restore.
        assert!((o.latencies[0][0] - (2e-3 + 20e-6 + 10e-6 + 20e-6)).abs() < 1e-9, "{:?}", o.latencies);
    }

    #[test]
    fn without_contention_the_spatial_system_is_one_fifo_per_tenant() {
        let ws = [w("a", 1.0, 0.5), w("b", 2.0, 1.0)];
        let o = spatial(&ws, &[vec![0.0, 0.5, 5.0], vec![0.0]]);
        assert_eq!(o.latencies, vec![vec![1.0, 1.5, 1.0], vec![2.0]]);
        assert_eq!(o.makespan, 6.0);
        assert_eq!(o.switches, 0);
    }
}
