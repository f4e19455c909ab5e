//! The NeuCloud design's Figures 1 and 2 on our model, and its Eq. 3
//! checked: per workload and batch size, the FLOPS
//! utilization of a 1 SA + 1 VU vNPU and the ratio `a` of SA-active to
//! VU-active time; then, at a fixed EU count, every SA:VU split of a
//! vNPU, whose measured EU utilization peaks where the design says
//! (k = n_SA / n_VU = sqrt(a)) or not.
//!
//! `cargo build --release -p npu-bench && target/release/eu-profile --help`

use std::process::ExitCode;

use clap::Parser;
use npu_bench::{line_plots, usage_error, workload, BoardArg, Panel};
use npu_lower::LowerError;
use npu_model::BoardConfig;
use npu_workloads::{run_workload, RunError, RunOptions, RunReport};

/// The design's Figures 1 and 2 on the model (FLOPS utilization of a
/// 1 SA + 1 VU vNPU and a = SA-active / VU-active time, per workload and
/// batch), and its Eq. 3 checked: every SA:VU split of `--eus` EUs.
#[derive(Parser, Debug)]
#[command(name = "eu-profile")]
struct Args {
    /// Workloads of the library, comma-separated [default: all, the
    /// design's seven and the further ones `vnpu workload list` names].
    #[arg(long, value_delimiter = ',', value_parser = workload)]
    workloads: Vec<String>,
    /// Batch sizes of the profile.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..), default_values_t = [1, 2, 4, 8, 16, 32, 64, 128, 256])]
    batches: Vec<u32>,
    /// EUs of the vNPUs of the split sweep (1+7 .. 7+1 for 8), on a core of
    /// the board widened to N-1 SAs and N-1 VUs so that every split fits.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..=65))]
    eus: u32,
    /// Batch size of the split sweep.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    sweep_batch: u32,
    /// Also write every figure as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<String>,
    /// Also draw the figures into an SVG file at PATH.
    #[arg(long, value_name = "PATH")]
    svg: Option<String>,
    #[command(flatten)]
    board: BoardArg,
}

fn parse() -> Args {
    let mut a = Args::parse();
    if a.workloads.is_empty() {
        a.workloads = npu_workloads::WORKLOADS
            .iter()
            .chain(npu_workloads::MORE_WORKLOADS)
            .map(|w| w.0.to_string())
            .collect();
    }
    if a.batches.is_empty() {
        usage_error::<Args>("--batches: give at least one batch size");
    }
    a
}

/// Runs `workload` at `batch` on `sa` + `vu` of `board`, timing only,
/// with the chip's whole HBM (capacity does not change timing; the largest
/// batches do not fit a quarter of it). `Ok(Err(why))` when the tensors do
/// not fit even that, or the program is longer than one request may be.
fn run(
    board: &BoardConfig,
    workload: &str,
    batch: u32,
    sa: u32,
    vu: u32,
) -> Result<Result<RunReport, &'static str>, String> {
    let o = RunOptions {
        sa,
        vu,
        hbm_bytes: Some(board.hbm_bytes_per_chip()),
        ..RunOptions::on_board(board, workload, batch)
    };
    match run_workload(board, &o) {
        Ok(r) => Ok(Ok(r)),
        Err(RunError::Lower(LowerError::Hbm { .. })) => Ok(Err("no HBM fit")),
        Err(RunError::Lower(LowerError::Instructions { .. })) => Ok(Err("> 1M instrs")),
        Err(e) => Err(format!("{workload} batch {batch} on {sa} SA + {vu} VU: {e}")),
    }
}

/// The design's Eq. 3: EU utilization of `k = n_SA / n_VU` for a profile
/// ratio `a`, the work of the SAs and of the VUs done one after the other
/// (time `x / n_SA + y / n_VU`).
fn eq3(k: f64, a: f64) -> f64 {
    k * (1.0 + a) / ((k + a) * (k + 1.0))
}

/// EU utilization of a run: engine-active time over elapsed time x EUs.
fn eu_utilization(r: &RunReport) -> f64 {
    (r.sa_active_cycles + r.vu_active_cycles) as f64
        / (r.simulated_cycles.max(1) as f64 * f64::from(r.sa + r.vu))
}

fn main() -> ExitCode {
    let args = parse();
    match body(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("eu-profile: {e}");
            ExitCode::FAILURE
        }
    }
}

fn body(args: &Args) -> Result<(), String> {
    let board = args.board.load()?;
    // Figures 1 and 2: the 1 SA + 1 VU profile per batch.
    println!("1 SA + 1 VU vNPU: FLOPS utilization (Figure 1) and a = SA-active / VU-active time (Figure 2)");
    print!("{:<14}", "workload");
    for b in &args.batches {
        print!(" {:>13}", format!("b{b}"));
    }
    println!();
    let mut profile = Vec::new();
    for w in &args.workloads {
        print!("{w:<14}");
        let mut row = Vec::new();
        for &b in &args.batches {
            let r = match run(&board, w, b, 1, 1)? {
                Ok(r) => r,
                Err(why) => {
                    print!(" {why:>13}");
                    continue;
                }
            };
            let a = r.sa_active_cycles as f64 / r.vu_active_cycles.max(1) as f64;
            let a_text = if a >= 100.0 { format!("{a:.0}") } else { format!("{a:.2}") };
            print!(" {:>5.1}% a={a_text:<5}", 100.0 * r.flops_utilization);
            row.push((b, r.flops_utilization, a, r.sa_utilization, r.vu_utilization));
        }
        println!();
        profile.push((w.clone(), row));
    }
    // Eq. 3: every split of `eus` EUs on a widened core.
    let mut wide = board.clone();
    wide.core.sa_count = args.eus - 1;
    wide.core.vu_count = args.eus - 1;
    let n = args.eus;
    println!(
        "\nEvery split of {n} EUs at batch {} (core widened to {} SA + {} VU): EU utilization measured, and Eq. 3's",
        args.sweep_batch,
        n - 1,
        n - 1
    );
    println!(
        "{:<14} {:>6} {:>8} {:>10} {:>10} {:>9} {:>12}",
        "workload", "a", "sqrt(a)", "Eq.3 best", "measured", "U best", "U at Eq.3's"
    );
    let mut sweep = Vec::new();
    'workloads: for w in &args.workloads {
        // A workload that does not fit the sweep's vNPUs (HBM, or a program
        // longer than one request may carry) is left out by name, as in the
        // profile above.
        let p = match run(&wide, w, args.sweep_batch, 1, 1)? {
            Ok(p) => p,
            Err(why) => {
                println!("{w:<14} left out: {why} at batch {}", args.sweep_batch);
                continue;
            }
        };
        let a = p.sa_active_cycles as f64 / p.vu_active_cycles.max(1) as f64;
        let mut points = Vec::new();
        for sa in 1..n {
            let r = match run(&wide, w, args.sweep_batch, sa, n - sa)? {
                Ok(r) => r,
                Err(why) => {
                    println!(
                        "{w:<14} left out: {why} at batch {} on {sa} SA + {} VU",
                        args.sweep_batch,
                        n - sa
                    );
                    continue 'workloads;
                }
            };
            points.push((sa, eu_utilization(&r), eq3(f64::from(sa) / f64::from(n - sa), a)));
        }
        // The split Eq. 3 picks (its U is largest where k is nearest
        // sqrt(a) in log space) and the one measured best.
        let by = |f: fn(&(u32, f64, f64)) -> f64| {
            points.iter().copied().max_by(|x, y| f(x).total_cmp(&f(y))).unwrap_or((1, f64::NAN, f64::NAN))
        };
        let predicted = by(|p| p.2);
        let measured = by(|p| p.1);
        println!(
            "{w:<14} {a:>6.2} {:>8.2} {:>10} {:>10} {:>8.1}% {:>11.1}%",
            a.sqrt(),
            format!("{}+{}", predicted.0, n - predicted.0),
            format!("{}+{}", measured.0, n - measured.0),
            100.0 * measured.1,
            100.0 * predicted.1
        );
        sweep.push((w.clone(), a, predicted.0, measured.0, points));
    }
    if let Some(path) = &args.json {
        let j = serde_json::json!({
            "board": board.name,
            "profile": profile.iter().map(|(w, row)| serde_json::json!({
                "workload": w,
                "batches": row.iter().map(|(b, f, a, su, vu)| serde_json::json!({
                    "batch": b, "flops_utilization": f, "a": a, "sa_utilization": su, "vu_utilization": vu
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "split_sweep": {
                "eus": n,
                "batch": args.sweep_batch,
                "workloads": sweep.iter().map(|(w, a, pred, meas, pts)| serde_json::json!({
                    "workload": w, "a": a, "eq3_best_sa": pred, "measured_best_sa": meas,
                    "splits": pts.iter().map(|(sa, u, e)| serde_json::json!({
                        "sa": sa, "vu": n - sa, "eu_utilization": u, "eq3": e
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            },
        });
        std::fs::write(path, serde_json::to_string_pretty(&j).unwrap_or_default())
            .map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    if let Some(path) = &args.svg {
        let log2 = |b: u32| f64::from(b).log2();
        let panels = vec![
            Panel {
                title: "Figure 1: FLOPS utilization, 1 SA + 1 VU".into(),
                x_label: "log2(batch)".into(),
                y_label: "SA FLOPS / peak".into(),
                log_y: false,
                series: profile
                    .iter()
                    .map(|(w, row)| (w.clone(), row.iter().map(|r| (log2(r.0), r.1)).collect()))
                    .collect(),
            },
            Panel {
                title: "Figure 2: SA-active / VU-active time".into(),
                x_label: "log2(batch)".into(),
                y_label: "a (log)".into(),
                log_y: true,
                series: profile
                    .iter()
                    .map(|(w, row)| (w.clone(), row.iter().map(|r| (log2(r.0), r.2)).collect()))
                    .collect(),
            },
            Panel {
                title: format!("EU utilization of every split of {n} EUs, batch {}", args.sweep_batch),
                x_label: "SAs of the vNPU".into(),
                y_label: "EU utilization (measured)".into(),
                log_y: false,
                series: sweep
                    .iter()
                    .map(|(w, _, _, _, pts)| (w.clone(), pts.iter().map(|p| (f64::from(p.0), p.1)).collect()))
                    .collect(),
            },
        ];
        line_plots(path, &panels)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::eq3;

    #[test]
    fn eq3_peaks_at_the_square_root_of_a() {
        for a in [0.01, 0.5, 1.0, 4.0, 30.0] {
            let best =
                (1..=4000).map(|i| f64::from(i) * 0.01).max_by(|x, y| eq3(*x, a).total_cmp(&eq3(*y, a)));
            let best = best.unwrap_or(f64::NAN);
            assert!((best - f64::sqrt(a)).abs() <= 0.01, "a = {a}: peak at k = {best}");
            // SA and VU phases one after the other: at the peak,
            // U = (1 + a) / (1 + sqrt(a))^2 (a half for balanced work).
            let peak = (1.0 + a) / (1.0 + f64::sqrt(a)).powi(2);
            assert!((eq3(f64::sqrt(a), a) - peak).abs() < 1e-12, "a = {a}");
        }
    }
}
