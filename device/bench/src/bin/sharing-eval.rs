//! Sharing evaluation (issue 5): SA-heavy and VU-heavy tenants with Poisson
//! arrivals on one physical core (4 SA + 4 VU), served by
//!
//! - **vNPU** (this system): each tenant owns a 1 SA + 1 VU vNPU of the core
//!   (spatial sharing at EU granularity); its requests queue FIFO on it;
//! - **PREMA-like**: the whole core time-shared, one request at a time on
//!   all 4 SA + 4 VU, preemptive: a waiting request with more tokens (waiting
//!   time normalized by its isolated time, PREMA's token rule) preempts the
//!   running one, paying a context switch (saving and restoring the SRAM
//!   state through the DMA engine) unless the running one is about to end
//!   (then it drains).
//!
//! Service times come from the NPU model (simulated, `run_workload`) for
//! each workload on 1+1 and on 4+4; the arrivals are the same for both.
//! Prints a table and writes JSON with `--json PATH`.
//!
//! `cargo build --release -p npu-bench && target/release/sharing-eval [--load 0.7] [--seconds 1] [--seed 1] [--json out.json]`

use npu_model::BoardConfig;
use npu_workloads::{run_workload, RunOptions};

struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * self.unit().ln()
    }
}

#[derive(Clone, Debug)]
struct Tenant {
    name: String,
    /// Seconds on 1 SA + 1 VU, and on the whole core.
    t11: f64,
    t44: f64,
    /// Active EU-seconds of one request (same work on either shape, summed
    /// over engines).
    eu11: f64,
    eu44: f64,
    arrivals: Vec<f64>,
}

#[derive(Debug, Default, Clone)]
struct Outcome {
    makespan: f64,
    latencies: Vec<Vec<f64>>,
    eu_seconds: f64,
    switches: u64,
}

fn spatial(ts: &[Tenant]) -> Outcome {
    let mut o = Outcome { latencies: vec![Vec::new(); ts.len()], ..Default::default() };
    for (i, t) in ts.iter().enumerate() {
        let mut free = 0f64;
        for &a in &t.arrivals {
            let start = free.max(a);
            free = start + t.t11;
            o.latencies[i].push(free - a);
            o.eu_seconds += t.eu11;
        }
        o.makespan = o.makespan.max(free);
    }
    o
}

fn prema(ts: &[Tenant], switch: f64) -> Outcome {
    #[derive(Clone, Copy)]
    struct Req {
        tenant: usize,
        arrival: f64,
        left: f64,
        started: bool,
    }
    let mut o = Outcome { latencies: vec![Vec::new(); ts.len()], ..Default::default() };
    let mut all: Vec<(f64, usize)> =
        ts.iter().enumerate().flat_map(|(i, t)| t.arrivals.iter().map(move |a| (*a, i))).collect();
    all.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut next = 0;
    let mut queue: Vec<Req> = Vec::new();
    let mut running: Option<Req> = None;
    let mut now = 0f64;
    // Tokens: waiting time over isolated time (PREMA's slowdown-normalized
    // priority, all tenants of equal priority).
    let tokens = |r: &Req, now: f64| (now - r.arrival) / ts[r.tenant].t44;
    loop {
        if running.is_none() && queue.is_empty() {
            if next >= all.len() {
                break;
            }
            now = now.max(all[next].0);
        }
        while next < all.len() && all[next].0 <= now {
            let (a, i) = all[next];
            queue.push(Req { tenant: i, arrival: a, left: ts[i].t44, started: false });
            next += 1;
        }
        if running.is_none() {
            if let Some(k) =
                (0..queue.len()).max_by(|&x, &y| tokens(&queue[x], now).total_cmp(&tokens(&queue[y], now)))
            {
                let mut r = queue.swap_remove(k);
                if r.started {
                    // Restoring its state.
                    now += switch / 2.0;
                }
                r.started = true;
                running = Some(r);
            }
            continue;
        }
        let Some(mut r) = running else { continue };
        let done_at = now + r.left;
        let next_arrival = all.get(next).map_or(f64::INFINITY, |x| x.0);
        if done_at <= next_arrival {
            now = done_at;
            o.latencies[r.tenant].push(now - r.arrival);
            o.eu_seconds += ts[r.tenant].eu44;
            running = None;
            continue;
        }
        // An arrival while running: preempt if a waiter now has more tokens
        // and the running request is not about to finish (else drain).
        r.left -= next_arrival - now;
        now = next_arrival;
        while next < all.len() && all[next].0 <= now {
            let (a, i) = all[next];
            queue.push(Req { tenant: i, arrival: a, left: ts[i].t44, started: false });
            next += 1;
        }
        let best =
            (0..queue.len()).max_by(|&x, &y| tokens(&queue[x], now).total_cmp(&tokens(&queue[y], now)));
        match best {
            Some(k) if tokens(&queue[k], now) > tokens(&r, now) && r.left > switch => {
                now += switch / 2.0; // saving its state
                o.switches += 1;
                queue.push(r);
                let mut n = queue.swap_remove(k);
                if n.started {
                    now += switch / 2.0;
                }
                n.started = true;
                running = Some(n);
                let _ = k;
            }
            _ => running = Some(r),
        }
    }
    o.makespan = now;
    o
}

fn p99(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).saturating_sub(1).min(v.len() - 1)]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut load, mut seconds, mut seed, mut json) = (0.7f64, 1.0f64, 1u64, None::<String>);
    while let Some(a) = args.next() {
        let v = args.next();
        match (a.as_str(), v) {
            ("--load", Some(v)) => load = v.parse().unwrap_or(load),
            ("--seconds", Some(v)) => seconds = v.parse().unwrap_or(seconds),
            ("--seed", Some(v)) => seed = v.parse().unwrap_or(seed),
            ("--json", Some(v)) => json = Some(v),
            _ => {
                eprintln!("usage: sharing-eval [--load F] [--seconds S] [--seed N] [--json PATH]");
                std::process::exit(2);
            }
        }
    }
    let board = BoardConfig::default();
    let mix = [("bert", 1u32), ("resnet50", 1), ("dlrm", 8), ("ncf", 8)];
    let mut rng = Rng(seed.max(1) * 0x9e37_79b9_7f4a_7c15);
    let mut ts = Vec::new();
    for (w, batch) in mix {
        let run = |sa, vu| {
            let o = RunOptions {
                sa,
                vu,
                sram_bytes: Some(8 << 20),
                hbm_bytes: Some(8 << 30),
                ..RunOptions::timing(w, batch)
            };
            run_workload(&board, &o).unwrap_or_else(|e| panic!("{w}: {e}"))
        };
        let (r11, r44) = (run(1, 1), run(4, 4));
        let hz = f64::from(board.clock_mhz) * 1e6;
        let eu = |r: &npu_workloads::RunReport| (r.sa_active_cycles + r.vu_active_cycles) as f64 / hz;
        // Load: each tenant's arrival rate is `load` of what its own 1+1 vNPU serves.
        let mean_gap = r11.simulated_seconds / load;
        let mut arrivals = Vec::new();
        let mut t = rng.exp(mean_gap);
        while t < seconds {
            arrivals.push(t);
            t += rng.exp(mean_gap);
        }
        ts.push(Tenant {
            name: format!("{w} b{batch}"),
            t11: r11.simulated_seconds,
            t44: r44.simulated_seconds,
            eu11: eu(&r11),
            eu44: eu(&r44),
            arrivals,
        });
    }
    // Context switch: save and restore the SRAM state of one vNPU-sized
    // tenant (8 MiB each way) at the DMA engine's rate.
    let switch = 2.0 * (8u64 << 20) as f64 / (board.dma.gbps * 1e9);
    let n: usize = ts.iter().map(|t| t.arrivals.len()).sum();
    println!(
        "{n} requests arriving over {seconds} s (Poisson; each tenant at {load} of what its 1+1 vNPU serves), seed {seed}; context switch {:.1} us",
        switch * 1e6
    );
    for t in &ts {
        println!(
            "  {:<12} {:>7} requests  1+1 {:>9.1} us  4+4 {:>9.1} us  (4+4 speedup {:.2}x)",
            t.name,
            t.arrivals.len(),
            t.t11 * 1e6,
            t.t44 * 1e6,
            t.t11 / t.t44
        );
    }
    let eus = f64::from(board.core.sa_count + board.core.vu_count);
    let mut rows = Vec::new();
    for (name, mut o) in [("vNPU (spatial)", spatial(&ts)), ("PREMA-like", prema(&ts, switch))] {
        let done: usize = o.latencies.iter().map(Vec::len).sum();
        let throughput = done as f64 / o.makespan;
        let util = o.eu_seconds / (eus * o.makespan);
        let mut all: Vec<f64> = o.latencies.iter().flatten().copied().collect();
        let avg = all.iter().sum::<f64>() / all.len() as f64;
        let tail = p99(&mut all);
        // PREMA's fairness: min over tenants of normalized progress
        // (isolated time on the whole core / time in the shared system)
        // over the max.
        let np: Vec<f64> = o
            .latencies
            .iter_mut()
            .zip(&ts)
            .map(|(l, t)| t.t44 / (l.iter().sum::<f64>() / l.len() as f64))
            .collect();
        let fairness =
            np.iter().copied().fold(f64::INFINITY, f64::min) / np.iter().copied().fold(0.0, f64::max);
        rows.push((name, throughput, util, avg, tail, fairness, o.switches));
    }
    println!(
        "{:<16} {:>12} {:>9} {:>12} {:>12} {:>9} {:>9}",
        "system", "req/s", "EU util", "avg us", "p99 us", "fairness", "switches"
    );
    for (name, thr, util, avg, tail, fair, sw) in &rows {
        println!(
            "{name:<16} {thr:>12.0} {:>8.1}% {:>12.1} {:>12.1} {fair:>9.3} {sw:>9}",
            100.0 * util,
            avg * 1e6,
            tail * 1e6
        );
    }
    let (a, b) = (&rows[0], &rows[1]);
    println!("vNPU / PREMA-like: throughput {:.2}x, EU utilization {:.2}x", a.1 / b.1, a.2 / b.2);
    if let Some(path) = json {
        let sys = |r: &(&str, f64, f64, f64, f64, f64, u64)| serde_json::json!({"system": r.0, "throughput_rps": r.1, "eu_utilization": r.2, "avg_latency_s": r.3, "p99_latency_s": r.4, "fairness": r.5, "context_switches": r.6});
        let v = serde_json::json!({
            "load": load, "seconds": seconds, "requests": n, "seed": seed, "context_switch_s": switch,
            "tenants": ts.iter().map(|t| serde_json::json!({"name": t.name, "t_1sa_1vu_s": t.t11, "t_4sa_4vu_s": t.t44})).collect::<Vec<_>>(),
            "systems": rows.iter().map(sys).collect::<Vec<_>>(),
            "throughput_ratio": a.1 / b.1, "eu_utilization_ratio": a.2 / b.2,
        });
        if let Err(e) = std::fs::write(&path, v.to_string()) {
            eprintln!("cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
}
