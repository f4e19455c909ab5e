//! Interference-aware placement against interference-blind policies and
//! an oracle (docs/interference.md "Placement"): the same
//! streams of vNPUs with workloads attached, placed by each policy on one
//! board and simulated on the board model; per policy the tenants' mean
//! and p95 slowdown, EU utilization and rejections, min/median/max over
//! the seeds.
//!
//! `cargo run --release -p placement-eval --bin placement-eval -- --help`

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use clap::Parser;
use npu_interference::characterize::Matrix;
use npu_interference::predict::Model;
use npu_model::BoardConfig;
use placement_eval::{
    generate, predictor_for, run_policy, summarize, EvalError, EvalPolicy, Items, PolicyRun, PolicySummary,
    StreamPlan,
};

#[derive(Parser, Debug)]
#[command(
    name = "placement-eval",
    about = "Place streams of vNPUs with workloads by interference-blind policies, by predicted interference and by an oracle; simulate each on the board model and compare the tenants' slowdowns",
    long_about = None
)]
struct Cli {
    /// Characterization matrix of the board (`npu-interference
    /// characterize --json`): the predictor's training set and the
    /// workloads' solo counters.
    #[arg(long, default_value = "docs/plots/interference.json")]
    matrix: PathBuf,
    /// Board configuration (TOML); the default board when absent. Must be
    /// the board the matrix was measured on.
    #[arg(long)]
    board: Option<PathBuf>,
    /// vNPUs per stream.
    #[arg(long, default_value_t = 1000)]
    vnpus: usize,
    /// One stream per seed (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1u64, 2, 3])]
    seeds: Vec<u64>,
    /// Offered load: EU-time asked for over the board's EU-time.
    #[arg(long, default_value_t = 0.7)]
    load: f64,
    /// Mean work of a vNPU, in milliseconds of running alone.
    #[arg(long, default_value_t = 5.0)]
    work_ms: f64,
    /// Arrivals left out of the statistics at the start (a fraction).
    #[arg(long, default_value_t = 0.1)]
    warmup: f64,
    /// Workloads of the stream (comma-separated); the matrix's by default.
    #[arg(long, value_delimiter = ',')]
    workloads: Option<Vec<String>>,
    /// Batch sizes of the stream's vNPUs.
    #[arg(long, value_delimiter = ',', default_values_t = [1u32, 4])]
    batches: Vec<u32>,
    /// vNPU shapes, SA+VU per core, `xN` for N cores of one chip and
    /// `xNxC` for N cores on each of C chips (data-parallel: each request
    /// runs on all of them), e.g. 1+1x2 or 1+1x2x2.
    #[arg(long, value_delimiter = ',', default_values = ["1+1", "2+2"])]
    shapes: Vec<String>,
    /// Policies to compare (first-fit, balance, random, spread,
    /// interference, interference-first, oracle, oracle-first).
    #[arg(long, value_delimiter = ',', default_values = ["first-fit", "balance", "random", "spread", "interference", "interference-first", "oracle", "oracle-first"])]
    policies: Vec<EvalPolicy>,
    /// Predictor of the interference policies: linear, forest, or mean (a
    /// predictor that ignores its features: the training set's mean
    /// slowdown for any tenant with neighbours on its core, another for
    /// neighbours elsewhere, 1 alone).
    #[arg(long, default_value = "linear")]
    model: String,
    /// Worker threads (one policy and stream each at a time).
    #[arg(long, default_value_t = std::thread::available_parallelism().map_or(1, |n| n.get()))]
    threads: usize,
    /// Write every run (per-tenant fates included) and the summary here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the summary (overhead cut and slowdowns per policy) here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Simulate nothing: read the summary of an earlier `--json` file,
    /// print its table and draw `--svg` from it.
    #[arg(long, value_name = "JSON")]
    replot: Option<PathBuf>,
}

fn shape(s: &str) -> Result<(u32, u32, u32, u32), String> {
    let (eus, rest) = s.split_once('x').unwrap_or((s, "1"));
    let (cores, chips) = rest.split_once('x').unwrap_or((rest, "1"));
    let (a, b) = eus
        .split_once('+')
        .ok_or_else(|| format!("shape `{s}`: write SA+VU[xCORES[xCHIPS]], e.g. 1+1, 2+2x2 or 1+1x2x2"))?;
    let n = |x: &str| x.trim().parse::<u32>().ok().filter(|&v| v > 0);
    match (n(a), n(b), n(cores), n(chips)) {
        (Some(sa), Some(vu), Some(c), Some(ch)) => Ok((sa, vu, c, ch)),
        _ => Err(format!("shape `{s}`: SA, VU, cores and chips must be whole numbers of 1 or more")),
    }
}

/// `--replot`: the table and the plot of an earlier run's summary.
fn replot(cli: &Cli, from: &std::path::Path) -> Result<(), EvalError> {
    let input = |m: String| EvalError::Input(format!("{}: {m}", from.display()));
    let bytes = std::fs::read(from).map_err(|e| input(e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| input(e.to_string()))?;
    let field = |k: &str| v.get(k).cloned().ok_or_else(|| input(format!("no `{k}` field")));
    let summary: Vec<PolicySummary> =
        serde_json::from_value(field("summary")?).map_err(|e| input(e.to_string()))?;
    let vnpus = field("vnpus")?.as_u64().ok_or_else(|| input("`vnpus` is not a count".into()))?;
    let streams = field("seeds")?.as_array().map_or(0, Vec::len);
    let load = field("load")?.as_f64().ok_or_else(|| input("`load` is not a number".into()))?;
    print!("{}", table(&summary));
    if let Some(path) = &cli.svg {
        draw(path, &summary, vnpus, streams, load)?;
    }
    Ok(())
}

fn draw(
    path: &std::path::Path,
    summary: &[PolicySummary],
    vnpus: u64,
    streams: usize,
    load: f64,
) -> Result<(), EvalError> {
    let labels: Vec<String> = summary.iter().map(|s| s.policy.name().to_string()).collect();
    let three = |s: &placement_eval::Spread| [s.min, s.median, s.max];
    let mean: Vec<_> = summary.iter().map(|s| three(&s.mean_slowdown)).collect();
    let p95: Vec<_> = summary.iter().map(|s| three(&s.p95_slowdown)).collect();
    interference_eval::plot::bars(
        &path.display().to_string(),
        &format!("{vnpus} vNPUs x {streams} streams at load {load}: slowdown per policy (min/median/max over streams)"),
        &labels,
        &[("mean slowdown of the tenants", mean), ("p95 slowdown of the tenants", p95)],
    )
    .map_err(|e| EvalError::Input(e.to_string()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn run(cli: Cli) -> Result<(), EvalError> {
    if let Some(from) = &cli.replot {
        return replot(&cli, from);
    }
    let input = |m: String| EvalError::Input(m);
    let cfg = match &cli.board {
        Some(p) => BoardConfig::load(p).map_err(|e| input(format!("{}: {e}", p.display())))?,
        None => BoardConfig::default(),
    };
    let matrix = Matrix::load(&cli.matrix).map_err(|e| input(e.to_string()))?;
    if matrix.board != cfg.name {
        return Err(input(format!(
            "the matrix was measured on board `{}`, this board is `{}`",
            matrix.board, cfg.name
        )));
    }
    let model = match cli.model.as_str() {
        "linear" => Model::Linear,
        "forest" => Model::Forest { trees: 100, seed: 1 },
        "mean" => Model::Mean,
        m => return Err(input(format!("unknown model `{m}` (linear, forest, mean)"))),
    };
    if cli.vnpus == 0 || cli.seeds.is_empty() || cli.policies.is_empty() {
        return Err(input("give at least one vNPU, seed and policy".into()));
    }
    if !(cli.load > 0.0 && cli.load.is_finite() && cli.work_ms > 0.0 && cli.work_ms.is_finite()) {
        return Err(input("--load and --work-ms must be positive numbers".into()));
    }
    if !(0.0..1.0).contains(&cli.warmup) {
        return Err(input("--warmup is a fraction in [0, 1)".into()));
    }
    let shapes = cli.shapes.iter().map(|s| shape(s)).collect::<Result<Vec<_>, _>>().map_err(input)?;
    if let Some(&(sa, vu, _, _)) =
        shapes.iter().find(|&&(sa, vu, _, _)| sa > cfg.core.sa_count || vu > cfg.core.vu_count)
    {
        return Err(input(format!("shape {sa}+{vu} is larger than a core")));
    }
    if let Some(&(sa, vu, c, _)) = shapes.iter().find(|&&(_, _, c, _)| c > cfg.cores_per_chip) {
        return Err(input(format!(
            "shape {sa}+{vu}x{c} has more cores than a chip ({})",
            cfg.cores_per_chip
        )));
    }
    if let Some(&(sa, vu, c, ch)) = shapes.iter().find(|&&(_, _, _, ch)| ch > cfg.chips) {
        return Err(input(format!("shape {sa}+{vu}x{c}x{ch} has more chips than the board ({})", cfg.chips)));
    }
    if cli.batches.contains(&0) {
        return Err(input("batch sizes are 1 or more".into()));
    }
    let workloads = match cli.workloads.clone() {
        Some(w) => w,
        None => {
            let mut w: Vec<String> = matrix.solo.iter().map(|s| s.spec.workload.clone()).collect();
            w.dedup();
            w
        }
    };
    let predictor = predictor_for(&matrix, model, &cli.policies)?;
    let plans: Vec<StreamPlan> = cli
        .seeds
        .iter()
        .map(|&seed| StreamPlan {
            workloads: workloads.clone(),
            batches: cli.batches.clone(),
            shapes: shapes.clone(),
            vnpus: cli.vnpus,
            load: cli.load,
            work_cycles: cli.work_ms * 1e3 * f64::from(cfg.clock_mhz),
            warmup: cli.warmup,
            seed,
        })
        .collect();
    // Items are the same for every seed: lower them once.
    let all = plans[0].items();
    eprintln!("lowering {} workload items...", all.len());
    let items = Items::new(&cfg, &all, &matrix)?;
    if !items.left_out.is_empty() {
        let names: Vec<String> = items.left_out.iter().map(|i| i.to_string()).collect();
        eprintln!("{}: {}", npu_interference::corun::LEFT_OUT, names.join(", "));
    }
    if items.kinds.is_empty() {
        return Err(input(
            "no item of the stream fits its vNPU (its HBM, or the instructions of a request)".into(),
        ));
    }
    let latency =
        |s: &placement_eval::Item| items.kinds.iter().position(|x| x == s).map_or(1.0, |i| items.alone[i]);
    let streams: Vec<_> = plans.iter().map(|p| generate(&cfg, p, &items.kinds, &latency)).collect();
    let work: Vec<(usize, EvalPolicy)> =
        (0..plans.len()).flat_map(|s| cli.policies.iter().map(move |&p| (s, p))).collect();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<PolicyRun, EvalError>>>> =
        Mutex::new((0..work.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..cli.threads.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(s, policy)) = work.get(i) else { break };
                let r = run_policy(&cfg, &streams[s], &items, predictor.as_ref(), policy, &plans[s]);
                if let Ok(run) = &r {
                    eprintln!(
                        "[{}/{}] seed {} {:<18} mean {:.4}x p95 {:.3}x rejected {} contested {} measured {} ({:.0} s)",
                        done.fetch_add(1, Ordering::Relaxed) + 1,
                        work.len(),
                        run.seed,
                        policy.name(),
                        run.mean_slowdown,
                        run.p95_slowdown,
                        run.rejected,
                        run.contested,
                        run.measured,
                        run.wall_seconds
                    );
                }
                if let Ok(mut v) = results.lock() {
                    v[i] = Some(r);
                }
            });
        }
    });
    let mut runs = Vec::new();
    for r in results.into_inner().unwrap_or_default() {
        runs.push(r.ok_or_else(|| input("a worker thread died".into()))??);
    }
    let summary = summarize(&runs);
    print!("{}", table(&summary));
    if let Some(path) = &cli.json {
        let v = serde_json::json!({
            "board": cfg.name,
            "matrix": cli.matrix.display().to_string(),
            "model": cli.model,
            "vnpus": cli.vnpus,
            "seeds": cli.seeds,
            "load": cli.load,
            "work_ms": cli.work_ms,
            "warmup": cli.warmup,
            "items": items.kinds,
            "left_out": items.left_out,
            "summary": summary,
            "runs": runs,
        });
        let text = serde_json::to_string(&v).map_err(|e| input(e.to_string()))?;
        std::fs::write(path, text).map_err(|e| input(format!("{}: {e}", path.display())))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &cli.svg {
        draw(path, &summary, cli.vnpus as u64, cli.seeds.len(), cli.load)?;
    }
    Ok(())
}

fn table(summary: &[PolicySummary]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<19} {:>26} {:>26} {:>20} {:>18} {:>24}",
        "policy",
        "mean slowdown min/med/max",
        "p95 slowdown min/med/max",
        "EU util % min/med/max",
        "rejected % med",
        "overhead cut % vs balance"
    );
    for s in summary {
        let _ = writeln!(
            out,
            "{:<19} {:>8.4} {:>8.4} {:>8.4} {:>8.3} {:>8.3} {:>8.3} {:>6.1} {:>6.1} {:>6.1} {:>18.1} {:>7.1} {:>7.1} {:>7.1}",
            s.policy.name(),
            s.mean_slowdown.min,
            s.mean_slowdown.median,
            s.mean_slowdown.max,
            s.p95_slowdown.min,
            s.p95_slowdown.median,
            s.p95_slowdown.max,
            s.eu_utilization.min,
            s.eu_utilization.median,
            s.eu_utilization.max,
            s.rejected_percent.median,
            s.overhead_cut_vs_balance.min,
            s.overhead_cut_vs_balance.median,
            s.overhead_cut_vs_balance.max,
        );
    }
    out
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("placement-eval: {e}");
            ExitCode::FAILURE
        }
    }
}
