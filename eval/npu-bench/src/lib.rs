//! Shared helpers of the benchmark binaries.

pub mod metrics;

use std::path::PathBuf;
use std::time::Instant;

use npu_board_runtime::{Completion, Runtime, Staged};
use npu_model::{BoardConfig, CoreMemory, SimTenant};
use npu_scheduler::Claim;
use vnpu_abi::Program;

/// One request of an arrival stream on a simulated core, timing only:
/// which tenant sent it, when it arrived (cycles) and its program.
#[derive(Debug)]
pub struct Request<'p> {
    pub tenant: usize,
    pub arrival: f64,
    pub program: &'p Program,
}

/// One program on its claim.
impl Staged for Request<'_> {}

impl SimTenant for Request<'_> {
    fn program(&self) -> &Program {
        self.program
    }
    fn memory(&mut self) -> Option<CoreMemory<'_>> {
        None
    }
    fn max_cycles(&self) -> Option<u64> {
        None
    }
}

/// A tenant as [`serve_arrivals`] submits its requests.
#[derive(Clone, Debug)]
pub struct Tenant<'p> {
    /// The runtime's name for it.
    pub name: String,
    pub claim: Claim,
    pub program: &'p Program,
    /// Cycles a request takes alone on its claim (0: unknown;
    /// `npu_board_runtime::Pending::estimate`).
    pub estimate: f64,
}

/// Serves per-tenant arrival streams (`arrivals[i]`: tenant `i`'s
/// arrival times in cycles, ascending) on core 0 of the board runtime
/// `rt`, as guests do: each tenant submits its oldest arrived request once
/// its previous one has finished (the rest wait in its ring, their arrival
/// kept), as tenant `tenants[i]`, until every request is served. `done` sees each completion;
/// its error stops the run.
pub fn serve_arrivals<'p>(
    rt: &mut Runtime<'_, Request<'p>>,
    arrivals: &[Vec<f64>],
    tenants: &[Tenant<'p>],
    done: impl FnMut(Completion<Request<'p>>) -> Result<(), String>,
) -> Result<(), String> {
    let n = tenants.len().min(arrivals.len());
    let submit = |rt: &mut Runtime<'_, Request<'p>>, i: usize, arrival: f64| {
        let t = &tenants[i];
        let req = Request { tenant: i, arrival, program: t.program };
        rt.submit_estimated(0, &t.name, t.claim, req, arrival, t.estimate)
            .map_err(|_| "the board has no core 0".to_string())
    };
    serve_jobs(rt, &arrivals[..n], submit, |r| r.tenant, done)
}

/// [`serve_arrivals`] for any kind of request: `submit(rt, i, arrival)`
/// submits tenant `i`'s request that arrived at `arrival`, `tenant_of`
/// tells whose a finished one was.
pub fn serve_jobs<J: SimTenant + Staged>(
    rt: &mut Runtime<'_, J>,
    arrivals: &[Vec<f64>],
    mut submit: impl FnMut(&mut Runtime<'_, J>, usize, f64) -> Result<(), String>,
    tenant_of: impl Fn(&J) -> usize,
    mut done: impl FnMut(Completion<J>) -> Result<(), String>,
) -> Result<(), String> {
    let n = arrivals.len();
    let mut next = vec![0usize; n];
    // Per tenant: a request of it is submitted and not finished.
    let mut busy = vec![false; n];
    loop {
        let now = rt.now();
        for i in 0..n {
            if let Some(&arrival) = arrivals[i].get(next[i]).filter(|a| !busy[i] && **a <= now) {
                busy[i] = true;
                next[i] += 1;
                submit(rt, i, arrival)?;
            }
        }
        // Run until a request finishes or a free tenant's next one arrives.
        let limit = (0..n)
            .filter(|&i| !busy[i])
            .filter_map(|i| arrivals[i].get(next[i]).copied())
            .fold(f64::INFINITY, f64::min);
        if !rt.busy() && !limit.is_finite() {
            return Ok(());
        }
        for c in rt.step(limit) {
            if let Some(b) = busy.get_mut(tenant_of(&c.job)) {
                *b = false;
            }
            done(c)?;
        }
    }
}

/// Runs `f` once to warm up, then `runs` times; returns the median seconds.
pub fn median_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs.max(1))
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Deterministic values in [-1, 1).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Times the closures in alternating blocks (A A A, B B B, C C C, then
/// again), each block after one untimed warm-up call; returns each one's
/// median seconds. Blocks, with a pause before each, keep threads that
/// spin after a call (OpenBLAS, rayon) from stealing the next
/// measurement's cores; alternating them
/// twice keeps a ratio honest when the machine's speed drifts.
pub fn interleaved_medians(runs: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let per_block = runs.div_ceil(2).max(1);
    let mut t = vec![Vec::with_capacity(2 * per_block); fs.len()];
    for _ in 0..2 {
        for (i, f) in fs.iter_mut().enumerate() {
            // Let the previous contender's spinning worker threads go idle.
            std::thread::sleep(std::time::Duration::from_millis(300));
            f();
            for _ in 0..per_block {
                let s = Instant::now();
                f();
                t[i].push(s.elapsed().as_secs_f64());
            }
        }
    }
    t.into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect()
}

/// Xorshift64 random numbers for the evaluations' arrival streams.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in (0, 1).
    pub fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    /// Exponentially distributed with mean `mean` (Poisson gaps).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * self.unit().ln()
    }
    /// Poisson arrival times with mean gap `mean_gap` in `[0, until)`.
    pub fn arrivals(&mut self, mean_gap: f64, until: f64) -> Vec<f64> {
        let mut v = Vec::new();
        let mut t = self.exp(mean_gap);
        while t < until {
            v.push(t);
            t += self.exp(mean_gap);
        }
        v
    }
}

/// The 99th percentile (nearest rank) of `v`; 0 for no values.
pub fn p99(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).saturating_sub(1).min(v.len() - 1)]
}

/// `--board FILE`, which every evaluation takes.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct BoardArg {
    /// Board configuration (TOML, docs/board-config.md); default: the
    /// built-in board.
    #[arg(long, value_name = "FILE")]
    pub board: Option<PathBuf>,
}

impl BoardArg {
    /// The board it names, or the built-in one.
    pub fn load(&self) -> Result<BoardConfig, String> {
        match &self.board {
            Some(path) => BoardConfig::load(path).map_err(|e| e.to_string()),
            None => Ok(BoardConfig::default()),
        }
    }
}

/// A clap value parser: a finite number above 0.
pub fn positive(v: &str) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|_| format!("`{v}` is not a number"))?;
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(format!("{v} must be positive"))
    }
}

/// A clap value parser: a workload of the library.
pub fn workload(v: &str) -> Result<String, String> {
    if npu_workloads::build(v, 1).is_some() {
        Ok(v.to_string())
    } else {
        let names: Vec<&str> =
            npu_workloads::WORKLOADS.iter().chain(npu_workloads::MORE_WORKLOADS).map(|w| w.0).collect();
        Err(format!("unknown workload `{v}` (workloads: {})", names.join(", ")))
    }
}

/// Exits 2 with `message` and the usage of `C`, as clap does for an
/// argument it refused itself (for checks across arguments).
pub fn usage_error<C: clap::CommandFactory>(message: impl std::fmt::Display) -> ! {
    C::command().error(clap::error::ErrorKind::ValueValidation, message).exit()
}

/// Exits 1 after an evaluation failed.
pub fn fail(program: &str, e: &str) -> ! {
    eprintln!("{program}: {e}");
    std::process::exit(1);
}

/// One chart of [`line_plots`]: a line per series.
#[derive(Clone, Debug, Default)]
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Logarithmic y axis (points at or below 0 are left out).
    pub log_y: bool,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Draws `panels` side by side into an SVG file at `path` (no fonts
/// needed: the text stays text). Non-finite points are left out.
pub fn line_plots(path: &str, panels: &[Panel]) -> Result<(), String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {path}: {e}");
    let n = panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (520 * n, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
        RGBColor(0, 0, 0),
        RGBColor(0, 0, 128),
        RGBColor(128, 0, 0),
        RGBColor(0, 128, 128),
        RGBColor(200, 0, 200),
        RGBColor(0, 100, 0),
    ];
    for (panel, area) in panels.iter().zip(root.split_evenly((1, n as usize))) {
        let ok = |p: &(f64, f64)| p.0.is_finite() && p.1.is_finite() && (!panel.log_y || p.1 > 0.0);
        let pts = || panel.series.iter().flat_map(|s| s.1.iter().filter(|p| ok(p)));
        let (x0, x1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (y0, y1) = pts().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
        if !(x0.is_finite() && y0.is_finite()) {
            continue;
        }
        let xr = x0..(x1 + (x1 - x0).abs().max(1e-9) * 0.02);
        let mut chart = ChartBuilder::on(&area);
        chart
            .caption(&panel.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70);
        macro_rules! draw {
            ($c:expr) => {{
                let mut c = $c;
                c.configure_mesh()
                    .x_desc(panel.x_label.as_str())
                    .y_desc(panel.y_label.as_str())
                    .draw()
                    .map_err(|e| err(&e))?;
                for (i, (name, points)) in panel.series.iter().enumerate() {
                    let color = colors[i % colors.len()];
                    let line: Vec<(f64, f64)> = points.iter().copied().filter(|p| ok(p)).collect();
                    c.draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                        .map_err(|e| err(&e))?
                        .label(name.as_str())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                        });
                    c.draw_series(line.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                        .map_err(|e| err(&e))?;
                }
                c.configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| err(&e))?;
            }};
        }
        if panel.log_y {
            let yr = (y0 * 0.8)..(y1 * 1.25);
            draw!(chart.build_cartesian_2d(xr, yr.log_scale()).map_err(|e| err(&e))?);
        } else {
            let yr = 0.0..(y1 * 1.08).max(1e-9);
            draw!(chart.build_cartesian_2d(xr, yr).map_err(|e| err(&e))?);
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
