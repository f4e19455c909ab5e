//! `vnpu profile`: the allocation step of the design. Runs a workload on
//! 1 SA + 1 VU, measures SA-active time x and VU-active time y, a = x/y, and
//! the SA:VU ratio k = sqrt(a) that maximizes utilization
//! U = k(1+a)/((k+a)(k+1)) (Eq. 3); then, for every EU count the board's
//! core allows, the shape closest to that ratio, its predicted speedup
//! (Eq. 1: S = (x+y)/(x/n_sa + y/n_vu)) and the speedup measured on the
//! model; and picks the smallest EU count whose time meets the SLO (none:
//! 1 SA + 1 VU).

use npu_model::BoardConfig;
use npu_workloads::{run_workload, RunOptions, RunReport};
use serde_json::json;

/// A candidate shape.
#[derive(Debug, Clone)]
struct Candidate {
    sa: u32,
    vu: u32,
    predicted_speedup: f64,
    predicted_utilization: f64,
    measured_ms: f64,
    measured_speedup: f64,
}

/// Runs the profile; returns the process exit code.
pub fn run(
    board: &BoardConfig,
    base: RunOptions,
    slo_ms: Option<f64>,
    as_json: bool,
) -> Result<u8, npu_workloads::RunError> {
    let one = run_workload(board, &RunOptions { sa: 1, vu: 1, ..base.clone() })?;
    let ms = |cycles: f64| cycles / (f64::from(board.clock_mhz) * 1e3);
    let (x, y) = (ms(one.sa_active_cycles as f64), ms(one.vu_active_cycles as f64));
    let t11 = one.simulated_seconds * 1e3;
    let a = if y > 0.0 { x / y } else { f64::INFINITY };
    let k = a.sqrt();
    let mut cands = Vec::new();
    let max = board.core.sa_count + board.core.vu_count;
    for n in 2..=max {
        // The split of n EUs closest to ratio k (in log space).
        let Some((sa, vu)) = vnpu_manager::split_for_ratio(n, k, board.core.sa_count, board.core.vu_count)
        else {
            continue;
        };
        let r: RunReport = run_workload(board, &RunOptions { sa, vu, ..base.clone() })?;
        let (fs, fv) = (f64::from(sa), f64::from(vu));
        let predicted_speedup = (x + y) / (x / fs + y / fv);
        let kk = fs / fv;
        cands.push(Candidate {
            sa,
            vu,
            predicted_speedup,
            predicted_utilization: kk * (1.0 + a) / ((kk + a) * (kk + 1.0)),
            measured_ms: r.simulated_seconds * 1e3,
            measured_speedup: t11 / (r.simulated_seconds * 1e3),
        });
    }
    let chosen = match slo_ms {
        None => None,
        Some(slo) => cands.iter().find(|c| c.measured_ms <= slo).cloned(),
    };
    let (sa, vu, met) = match (&chosen, slo_ms) {
        (Some(c), _) => (c.sa, c.vu, true),
        (None, None) => (1, 1, true),
        (None, Some(_)) => {
            let c = cands.last();
            (c.map_or(1, |c| c.sa), c.map_or(1, |c| c.vu), t11 <= slo_ms.unwrap_or(0.0))
        }
    };
    let (ps, msr) = chosen.as_ref().map_or((1.0, 1.0), |c| (c.predicted_speedup, c.measured_speedup));
    if as_json {
        let c: Vec<_> = cands
            .iter()
            .map(|c| {
                json!({"sa": c.sa, "vu": c.vu, "predicted_speedup": c.predicted_speedup,
                       "predicted_utilization": c.predicted_utilization, "measured_ms": c.measured_ms,
                       "measured_speedup": c.measured_speedup})
            })
            .collect();
        let v = json!({
            "workload": base.workload, "batch": base.batch,
            "x": x, "y": y, "a": a, "k": k, "time_1sa_1vu_ms": t11,
            "slo_ms": slo_ms, "slo_met": met, "sa": sa, "vu": vu,
            "predicted_speedup": ps, "measured_speedup": msr, "candidates": c,
        });
        println!("{v}");
    } else {
        println!("workload {} batch {} on 1 SA + 1 VU: {t11:.3} ms simulated", base.workload, base.batch);
        println!("x (SA active) {x:.3} ms, y (VU active) {y:.3} ms, a = x/y = {a:.3}, k = sqrt(a) = {k:.3}");
        println!(
            "{:>3} {:>3} {:>10} {:>10} {:>10} {:>10}",
            "SA", "VU", "U (Eq.3)", "S (Eq.1)", "measured", "time ms"
        );
        for c in &cands {
            println!(
                "{:>3} {:>3} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
                c.sa, c.vu, c.predicted_utilization, c.predicted_speedup, c.measured_speedup, c.measured_ms
            );
        }
        match slo_ms {
            None => println!("allocation: 1 SA + 1 VU (no SLO given)"),
            Some(slo) if met => println!("allocation: {sa} SA + {vu} VU, the fewest EUs that meet {slo} ms (speedup predicted {ps:.3}, measured {msr:.3})"),
            Some(slo) => println!("allocation: no shape of one core meets {slo} ms; the largest is {sa} SA + {vu} VU"),
        }
    }
    Ok(if met { 0 } else { 1 })
}
