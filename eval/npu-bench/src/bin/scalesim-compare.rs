//! The SA timing model against SCALE-Sim v3 (weight-stationary, buffers
//! large enough that it never stalls on memory): cycles for GEMM and
//! convolution layers on 32x32 and 128x128 arrays, and the wall time each
//! simulator takes for the same layers.
//!
//! Usage: scalesim-compare [--python PATH] [--quick] [--board FILE] (`--help`).
//! PATH defaults to .venv-bench/bin/python (made by scripts/setup-bench.sh).

use std::io::Write;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use clap::Parser;
use npu_bench::BoardArg;
use npu_model::run_program;
use serde_json::{json, Value};
use vnpu_abi::{ConvGeom, DType, Engine, Instr, MatFlags, ProgramBuilder};

#[derive(Clone, Copy)]
enum Layer {
    Gemm {
        m: u32,
        k: u32,
        n: u32,
    },
    /// Valid (unpadded) convolution, as SCALE-Sim models it.
    Conv {
        h: u32,
        w: u32,
        k: u16,
        cin: u32,
        cout: u32,
        stride: u16,
    },
}

const LAYERS: &[(&str, Layer)] = &[
    ("bert_qkv", Layer::Gemm { m: 128, k: 768, n: 768 }),
    ("bert_attn_qk", Layer::Gemm { m: 128, k: 64, n: 128 }),
    ("ncf_mlp0", Layer::Gemm { m: 256, k: 64, n: 32 }),
    ("dlrm_top0", Layer::Gemm { m: 32, k: 1121, n: 128 }),
    ("odd_gemm", Layer::Gemm { m: 100, k: 70, n: 40 }),
    ("tall_gemm", Layer::Gemm { m: 2048, k: 256, n: 64 }),
    ("resnet_conv1", Layer::Conv { h: 230, w: 230, k: 7, cin: 3, cout: 64, stride: 2 }),
    ("resnet_3x3_s1", Layer::Conv { h: 30, w: 30, k: 3, cin: 128, cout: 128, stride: 1 }),
    ("resnet_1x1", Layer::Conv { h: 56, w: 56, k: 1, cin: 64, cout: 256, stride: 1 }),
    ("resnet_3x3_s2", Layer::Conv { h: 29, w: 29, k: 3, cin: 128, cout: 128, stride: 2 }),
    ("mobilenet_pw", Layer::Conv { h: 14, w: 14, k: 1, cin: 512, cout: 512, stride: 1 }),
    ("small_conv", Layer::Conv { h: 16, w: 16, k: 3, cin: 8, cout: 40, stride: 1 }),
];

fn instr(l: Layer) -> Instr {
    match l {
        Layer::Gemm { m, k, n } => Instr::MatMul {
            dtype: DType::F32,
            flags: MatFlags::default(),
            a: 0,
            b: 0,
            c: 0,
            m,
            k,
            n,
            lda: k,
            ldb: n,
            ldc: n,
        },
        Layer::Conv { h, w, k, cin, cout, stride } => Instr::Conv2d {
            dtype: DType::F32,
            flags: MatFlags::default(),
            input: 0,
            weights: 0,
            output: 0,
            geom: ConvGeom {
                n: 1,
                h,
                w,
                cin,
                cout,
                kh: k,
                kw: k,
                stride_h: stride,
                stride_w: stride,
                ..Default::default()
            },
        },
    }
}

fn spec(name: &str, l: Layer) -> Value {
    match l {
        Layer::Gemm { m, k, n } => json!({"name": name, "kind": "gemm", "m": m, "k": k, "n": n}),
        Layer::Conv { h, w, k, cin, cout, stride } => {
            json!({"name": name, "kind": "conv", "h": h, "w": w, "kh": k, "kw": k, "cin": cin, "cout": cout, "stride": stride})
        }
    }
}

fn scalesim(python: &str, rows: u32, layers: &[(&str, Layer)]) -> Result<Value, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/scalesim_run.py");
    let input = json!({"rows": rows, "cols": rows, "layers": layers.iter().map(|(n, l)| spec(n, *l)).collect::<Vec<_>>()});
    let mut child = Command::new(python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot run {python}: {e} (run scripts/setup-bench.sh)"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.to_string().as_bytes()).map_err(|e| e.to_string())?;
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("SCALE-Sim run failed ({})", out.status));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("bad output from SCALE-Sim script: {e}"))
}

/// The SA timing model against SCALE-Sim v3 (weight-stationary, no memory
/// stalls): cycles of GEMM and convolution layers on 32x32 and 128x128
/// arrays, and each simulator's wall time for them.
#[derive(Parser, Debug)]
#[command(name = "scalesim-compare")]
struct Args {
    /// The Python with SCALE-Sim installed [default: .venv-bench/bin/python,
    /// made by scripts/setup-bench.sh].
    #[arg(long, value_name = "PATH")]
    python: Option<String>,
    /// The first four layers only.
    #[arg(long)]
    quick: bool,
    /// The board whose core (arrays resized to 32x32 and 128x128) is timed.
    #[command(flatten)]
    board: BoardArg,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let base = match args.board.load() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("scalesim-compare: {e}");
            return ExitCode::FAILURE;
        }
    };
    let python = args
        .python
        .clone()
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../../.venv-bench/bin/python").into());
    let layers: Vec<(&str, Layer)> =
        if args.quick { LAYERS.iter().copied().take(4).collect() } else { LAYERS.to_vec() };
    println!("# SA timing model vs SCALE-Sim v3 (weight stationary, no memory stalls); cycles are simulated");
    println!("{:<16} {:>7} {:>12} {:>12} {:>8}", "layer", "array", "ours", "SCALE-Sim", "diff %");
    let (mut worst, mut ours_wall, mut theirs_wall) = (0.0f64, 0.0f64, 0.0f64);
    for size in [32u32, 128] {
        let mut board = base.clone();
        board.core.sa_rows = size;
        board.core.sa_cols = size;
        eprintln!("running SCALE-Sim on {} layers, {size}x{size} (this takes minutes)...", layers.len());
        let theirs = match scalesim(&python, size, &layers) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("scalesim-compare: {e}");
                return ExitCode::FAILURE;
            }
        };
        theirs_wall += theirs["wall_seconds"].as_f64().unwrap_or(0.0);
        let t = Instant::now();
        let mut ours = Vec::new();
        for (_, l) in &layers {
            let mut p = ProgramBuilder::new();
            p.push(Engine::sa(0), instr(*l));
            match run_program(&board, &p.finish(), None, None) {
                Ok(r) => ours.push(r.cycles),
                Err(e) => {
                    eprintln!("scalesim-compare: model failed: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        ours_wall += t.elapsed().as_secs_f64();
        for ((name, _), c) in layers.iter().zip(ours) {
            let s = theirs["cycles"][name].as_f64().unwrap_or(f64::NAN);
            let diff = 100.0 * (c - s) / s;
            // NaN-propagating (a layer SCALE-Sim did not report is a failure;
            // `f64::max` would skip it).
            worst = if diff.is_nan() || worst.is_nan() { f64::NAN } else { worst.max(diff.abs()) };
            println!("{name:<16} {:>7} {c:>12.0} {s:>12.0} {diff:>8.3}", format!("{size}x{size}"));
        }
    }
    println!("wall time for the same layers: ours {ours_wall:.6} s, SCALE-Sim {theirs_wall:.1} s");
    println!("largest cycle difference: {worst:.3}%");
    println!("ratio (SCALE-Sim wall time / ours): {:.0}", theirs_wall / ours_wall.max(1e-9));
    if worst.is_nan() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
