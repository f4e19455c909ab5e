//! Interference between co-located vNPUs: characterize every pair and
//! group of workloads on the board model, then train and cross-validate
//! predictors of the slowdown from solo counters (docs/interference.md).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use interference_eval::plot::heat_maps;
use interference_eval::Forest;
use npu_interference::characterize::{characterize, summary, Matrix, Placement, Plan};
use npu_interference::predict::{cross_validate, Linear, Mean};
use npu_model::BoardConfig;

#[derive(Parser, Debug)]
#[command(name = "npu-interference", about = "Interference between co-located vNPUs: characterize it on the board model, predict it from solo counters", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Co-locate every pair (and triple, quadruple) of workloads, measure each
    /// tenant's slowdown against running alone and split it by cause
    /// (DMA engines, HBM, host link, waiting for a time-shared core's
    /// engines).
    Characterize {
        /// Board configuration (TOML, docs/board-config.md); the built-in
        /// board (tpu-v4-derived) when absent.
        #[arg(long)]
        board: Option<PathBuf>,
        /// Workloads (comma-separated), any of the library (`vnpu workload
        /// list`); the design's seven (ResNet-50, BERT, DLRM, NCF,
        /// MobileNet, EfficientNet, Transformer) by default.
        #[arg(long, value_delimiter = ',')]
        workloads: Option<Vec<String>>,
        /// Batch sizes of the pair items.
        #[arg(long, value_delimiter = ',', default_values_t = [1u32, 4, 16])]
        batches: Vec<u32>,
        /// vNPU shapes, SA+VU (every tenant of a case has the same).
        #[arg(long, value_delimiter = ',', default_values = ["1+1", "2+2"])]
        shapes: Vec<String>,
        /// Placements: core (one core, EUs of their own), chip (a core
        /// each on one chip), time-shared (the same EUs, in turn).
        #[arg(long, value_delimiter = ',', default_values = ["core", "chip", "time-shared"])]
        placements: Vec<Placement>,
        /// Sizes of the larger groups of distinct workloads (3: every
        /// triple, 4: every quadruple); `--groups` alone: pairs only.
        #[arg(long, value_delimiter = ',', num_args = 0.., default_values_t = [3usize, 4])]
        groups: Vec<usize>,
        /// Batch of every tenant of the larger groups.
        #[arg(long, default_value_t = 8)]
        group_batch: u32,
        /// Requests each tenant of a co-run finishes after its first (a
        /// warm-up); the others keep sending until the last is done.
        #[arg(long, default_value_t = 2)]
        iterations: usize,
        /// Worker threads.
        #[arg(long, default_value_t = std::thread::available_parallelism().map_or(1, |n| n.get()))]
        threads: usize,
        /// Write the matrix (every case, every tenant, the solo counters)
        /// as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw the pair heat maps into an SVG file here.
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// Print the summary of a characterization's matrix again, and draw
    /// its heat maps.
    Report {
        /// The matrix written by `characterize --json`.
        #[arg(long)]
        matrix: PathBuf,
        /// Board configuration (TOML) the matrix must have been measured
        /// on: refused when the matrix names another board.
        #[arg(long)]
        board: Option<PathBuf>,
        /// Draw the pair heat maps into an SVG file here.
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// Train a linear model and a random forest on a characterization's
    /// matrix, cross-validated on held-out workload pairs; report the MSE
    /// of the slowdown and how often each picks the better of two
    /// neighbours.
    Predict {
        /// The matrix written by `characterize --json`.
        #[arg(long)]
        matrix: PathBuf,
        /// Board configuration (TOML) the matrix must have been measured
        /// on: refused when the matrix names another board.
        #[arg(long)]
        board: Option<PathBuf>,
        /// Trees of the random forest.
        #[arg(long, default_value_t = 100)]
        trees: usize,
        /// Seed of the random forest.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write the report (with every out-of-fold prediction) as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn shape(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once('+').ok_or_else(|| format!("shape `{s}`: expected SA+VU, e.g. 2+2"))?;
    let n = |x: &str| x.trim().parse::<u32>().map_err(|e| format!("shape `{s}`: {e}"));
    let (sa, vu) = (n(a)?, n(b)?);
    if sa == 0 || vu == 0 {
        return Err(format!("shape `{s}`: a vNPU has at least one SA and one VU"));
    }
    Ok((sa, vu))
}

fn write(path: &PathBuf, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The matrix at `path`; with `board`, it must have been measured on
/// that board (its `board` field names the board's `name`).
fn read_matrix(path: &Path, board: Option<&PathBuf>) -> Result<Matrix, String> {
    let m = Matrix::load(path).map_err(|e| e.to_string())?;
    if let Some(b) = board {
        let cfg = BoardConfig::load(b).map_err(|e| format!("{}: {e}", b.display()))?;
        if m.board != cfg.name {
            return Err(format!(
                "{} was measured on board `{}`, not on `{}` ({}): characterize that board first",
                path.display(),
                m.board,
                cfg.name,
                b.display()
            ));
        }
    }
    Ok(m)
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Characterize {
            board,
            workloads,
            batches,
            shapes,
            placements,
            groups,
            group_batch,
            iterations,
            threads,
            json,
            svg,
        } => {
            let cfg = match board {
                Some(p) => BoardConfig::load(&p).map_err(|e| e.to_string())?,
                None => BoardConfig::default(),
            };
            let design: Vec<String> = npu_workloads::WORKLOADS.iter().map(|w| w.0.to_string()).collect();
            let all: Vec<String> = npu_workloads::WORKLOADS
                .iter()
                .chain(npu_workloads::MORE_WORKLOADS)
                .map(|w| w.0.to_string())
                .collect();
            let workloads = workloads.unwrap_or(design);
            if let Some(w) = workloads.iter().find(|w| !all.contains(w)) {
                return Err(format!("unknown workload `{w}` (known: {})", all.join(", ")));
            }
            if batches.contains(&0) || group_batch == 0 {
                return Err("batch sizes start at 1".into());
            }
            let plan = Plan {
                workloads,
                batches,
                shapes: shapes.iter().map(|s| shape(s)).collect::<Result<_, _>>()?,
                placements,
                groups,
                group_batch,
                iterations,
                threads,
            };
            let start = std::time::Instant::now();
            let progress = |done: usize, total: usize| {
                if done.is_multiple_of(25) || done == total {
                    eprintln!("  {done}/{total} cases ({:.0} s)", start.elapsed().as_secs_f64());
                }
            };
            let m = characterize(&cfg, &plan, &progress).map_err(|e| e.to_string())?;
            print!("{}", summary(&m));
            if let Some(p) = json {
                let text = serde_json::to_string(&m).map_err(|e| e.to_string())?;
                write(&p, &text)?;
            }
            if let Some(p) = svg {
                heat_maps(&m, &p.display().to_string()).map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        Command::Report { matrix, board, svg } => {
            let m = read_matrix(&matrix, board.as_ref())?;
            print!("{}", summary(&m));
            if let Some(p) = svg {
                heat_maps(&m, &p.display().to_string()).map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        Command::Predict { matrix, board, trees, seed, json } => {
            let m = read_matrix(&matrix, board.as_ref())?;
            let r =
                cross_validate(&m, &[&Mean, &Linear, &Forest { trees, seed }]).map_err(|e| e.to_string())?;
            println!("{} tenants, {} workload pairs held out one at a time", r.samples, r.folds);
            println!(
                "{:<24} {:>10} {:>8} {:>8}   {:>10} {:>10} {:>12}   {:>8}",
                "model", "MSE", "MSE/var", "max err", "core MSE", "chip MSE", "time-sh. MSE", "choices"
            );
            for e in &r.models {
                // A placement the matrix has no pairs of: n/a.
                let at = |p: Placement, digits: usize| match e.per_placement.iter().find(|x| x.0 == p) {
                    Some((_, x)) if x.tenants > 0 => format!("{:.*}", digits, x.mse),
                    _ => "n/a".to_string(),
                };
                println!(
                    "{:<24} {:>10.5} {:>8.3} {:>8.3}   {:>10} {:>10} {:>12}   {:>7.1}%",
                    e.name,
                    e.concurrent.mse,
                    e.concurrent.normalized_mse,
                    e.concurrent.max_abs_error,
                    at(Placement::Core, 5),
                    at(Placement::Chip, 5),
                    at(Placement::TimeShared, 3),
                    100.0 * e.choice_accuracy
                );
            }
            println!("(MSE, MSE/var, max err: tenants running at the same time, placements core and chip;");
            println!(
                " choices: of {} \"which of two neighbours interferes less\", the share predicted right)",
                r.models.first().map_or(0, |e| e.choices)
            );
            if let Some(p) = json {
                let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?;
                write(&p, &text)?;
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("npu-interference: {e}");
            ExitCode::FAILURE
        }
    }
}
