//! The compiled-model benchmark: for each test model, simulated NPU time per
//! batch on a 1 SA + 1 VU and a 4 SA + 4 VU vNPU with SA and VU
//! utilization, and the host wall time of the functional model (the
//! compiled programs run in-process on the NPU model) against ONNX Runtime
//! on the CPU, same machine, same run, interleaved round by round, both
//! single-threaded and timed on CLOCK_MONOTONIC, min/median/max over the
//! rounds (docs/compiled-model-format.md, "Benchmark"). In each round each side's
//! timed run follows an untimed run of its own on the same input.
//!
//!   onnx-bench [--rounds N] [--only NAME,...] [--threads N] [--python PATH] [--dtype f32|bf16] [--board FILE]
//!
//! The pretrained network (scripts/pretrained.sh) is included when that
//! script has fetched it and made its inputs (.cache/pretrained). The
//! torchvision graphs of tests/fixtures/onnx/vision (ResNet-18,
//! MobileNetV2, SqueezeNet 1.0 at batch 1 and 8, ViT-B/16 at batch 1) get
//! random weights from scripts/fill_external.py (seed 1, written once to
//! target/onnx-bench-vision) and random inputs (seeded).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use npu_bench::{BoardArg, Rng};
use npu_lower::VnpuShape;
use npu_onnx::host::HostRunner;
use npu_onnx::{compile_file, npy, CompileOptions};
use vnpu_abi::DType;

struct Case {
    /// Name in the report.
    name: String,
    model: PathBuf,
    /// Each input's name and file, in the model's order.
    inputs: Vec<(String, PathBuf)>,
    /// The output to compile (the model's own when `None`).
    output: Option<&'static str>,
    batch: u32,
    /// Static input shape when the model leaves more than the batch free.
    shape: Option<Vec<usize>>,
}

/// The test models of tests/fixtures/onnx, and the pretrained network when
/// scripts/pretrained.sh has fetched it.
fn cases(root: &Path, python: &Path) -> Vec<Case> {
    let fx = root.join("tests/fixtures/onnx");
    let mut v: Vec<Case> = ["digits-mlp", "digits-mlp2"]
        .iter()
        .map(|m| Case {
            name: m.to_string(),
            model: fx.join(format!("{m}.onnx")),
            inputs: vec![("X".to_string(), fx.join("digits-x.npy"))],
            output: Some("probabilities"),
            batch: 450,
            shape: None,
        })
        .collect();
    for (m, batch) in [
        ("conv-bn-relu6", 2),
        ("dw-hardswish", 1),
        ("group-pool", 2),
        ("se-head", 2),
        ("decoder", 2),
        ("resize-modes", 1),
        ("layernorm-decomposed", 3),
    ] {
        v.push(Case {
            name: m.to_string(),
            model: fx.join(format!("ops/{m}.onnx")),
            inputs: vec![("x".to_string(), fx.join(format!("ops/{m}-x.npy")))],
            output: None,
            batch,
            shape: None,
        });
    }
    for (m, x) in [("digits-cnn", "digits-img-x.npy"), ("digits-transformer", "digits-seq-x.npy")] {
        v.push(Case {
            name: format!("{m} (PyTorch)"),
            model: fx.join(format!("torch/{m}.onnx")),
            inputs: vec![("x".to_string(), fx.join(format!("torch/{x}")))],
            output: None,
            batch: 450,
            shape: None,
        });
    }
    // The pretrained networks, on the first batch of the inputs
    // scripts/pretrained.sh made (written to a file of its own so that ONNX
    // Runtime runs the same batch).
    let pre = root.join(".cache/pretrained");
    let nets = [
        ("cls", "ch_ppocr_mobile_v2.0_cls_infer.onnx", "ppocr-cls (MobileNetV3)", 8),
        ("rec", "ch_PP-OCRv4_rec_infer.onnx", "ppocr-rec (PP-OCRv4)", 8),
        ("det", "ch_PP-OCRv4_det_infer.onnx", "ppocr-det (PP-OCRv4)", 4),
    ];
    for (kind, file, name, batch) in nets {
        let model = pre.join(file);
        match npy::read_file(&pre.join(format!("{kind}-x.npy"))) {
            Ok(mut a) if model.exists() && a.shape.len() == 4 && a.shape[0] >= batch => {
                let per: usize = a.shape[1..].iter().map(|&d| d as usize).product();
                a.data.truncate(per * batch as usize);
                a.shape[0] = batch;
                let input = std::env::temp_dir().join(format!("onnx-bench-{kind}-x.npy"));
                npy::write_file(&input, &a).unwrap_or_else(|e| panic!("{}: {e}", input.display()));
                let shape = a.shape.iter().map(|&d| d as usize).collect();
                v.push(Case {
                    name: format!("{name}, pretrained"),
                    model,
                    inputs: vec![("x".to_string(), input)],
                    output: None,
                    batch: batch as u32,
                    shape: Some(shape),
                })
            }
            _ => eprintln!(
                "onnx-bench: the pretrained {kind} network is left out (run scripts/pretrained.sh first)"
            ),
        }
    }
    v.extend(vision(root, python));
    v.extend(small(root, python));
    v
}

/// The first `rows` rows of `a` (its rows repeated when it has fewer).
fn rows(a: &npy::Array, rows: u64) -> npy::Array {
    let have = a.shape.first().copied().unwrap_or(1).max(1);
    let per: usize = a.shape[1..].iter().map(|&d| d as usize).product();
    let mut shape = a.shape.clone();
    shape[0] = rows;
    let pick = |i: u64| ((i % have) as usize) * per;
    match &a.ints {
        Some(v) => {
            npy::Array::integers(shape, (0..rows).flat_map(|i| v[pick(i)..pick(i) + per].to_vec()).collect())
        }
        None => npy::Array::floats(
            shape,
            (0..rows).flat_map(|i| a.data[pick(i)..pick(i) + per].to_vec()).collect(),
        ),
    }
}

/// The small models of the issue on per-request cost: `transformers`'
/// BERT, DistilBERT and GPT-2 of tests/fixtures/onnx/hf (2 layers, 16
/// tokens), and scikit-learn models as skl2onnx exports them
/// (scripts/sklearn_models.py, written once to target/onnx-bench-small),
/// at batch 1 and 8.
fn small(root: &Path, python: &Path) -> Vec<Case> {
    let dir = root.join("target/onnx-bench-small");
    let mut v = Vec::new();
    if std::fs::create_dir_all(&dir).is_err() {
        return v;
    }
    let fx = root.join("tests/fixtures/onnx/hf");
    for m in ["bert", "distilbert", "gpt2"] {
        for batch in [1u64, 8] {
            let mut inputs = Vec::new();
            for i in ["input_ids", "attention_mask"] {
                let Ok(a) = npy::read_file(&fx.join(format!("{m}-{i}.npy"))) else { continue };
                let path = dir.join(format!("{m}-b{batch}-{i}.npy"));
                if npy::write_file(&path, &rows(&a, batch)).is_ok() {
                    inputs.push((i.to_string(), path));
                }
            }
            if inputs.len() == 2 {
                v.push(Case {
                    name: format!("{m} (transformers, 2 layers, 16 tokens)"),
                    model: fx.join(format!("{m}.onnx")),
                    inputs,
                    output: None,
                    batch: batch as u32,
                    shape: None,
                });
            }
        }
    }
    let sk = dir.join("sklearn");
    if !sk.join("models.txt").exists() {
        eprintln!("onnx-bench: writing the scikit-learn models (scripts/sklearn_models.py) ...");
        let ok = Command::new(python)
            .arg(root.join("scripts/sklearn_models.py"))
            .arg(&sk)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("onnx-bench: the scikit-learn models are left out (scripts/sklearn_models.py failed)");
            return v;
        }
    }
    for m in ["scaler-logreg", "random-forest", "gradient-boosting-regressor", "svc-rbf", "mlp"] {
        let Ok(a) = npy::read_file(&sk.join(format!("{m}-X.npy"))) else { continue };
        for batch in [1u64, 8] {
            let path = dir.join(format!("{m}-b{batch}-X.npy"));
            if npy::write_file(&path, &rows(&a, batch)).is_ok() {
                v.push(Case {
                    name: format!("{m} (scikit-learn)"),
                    model: sk.join(format!("{m}.onnx")),
                    inputs: vec![("X".to_string(), path)],
                    output: None,
                    batch: batch as u32,
                    shape: None,
                });
            }
        }
    }
    v
}

/// The torchvision graphs with random weights (scripts/fill_external.py,
/// seed 1) and seeded random inputs of each batch, written once to
/// target/onnx-bench-vision; none when Python cannot write them.
fn vision(root: &Path, python: &Path) -> Vec<Case> {
    let dir = root.join("target/onnx-bench-vision");
    let mut v = Vec::new();
    for (m, batches) in
        [("resnet18", &[1, 8][..]), ("mobilenet_v2", &[1, 8]), ("squeezenet1_0", &[1, 8]), ("vit_b_16", &[1])]
    {
        let model = dir.join(format!("{m}.onnx"));
        if !model.exists() {
            let src = root.join(format!("tests/fixtures/onnx/vision/{m}.onnx"));
            eprintln!("onnx-bench: writing random weights for {m} (scripts/fill_external.py) ...");
            let ok = Command::new(python)
                .arg(root.join("scripts/fill_external.py"))
                .args([&src, &dir])
                .args(["--seed", "1"])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("onnx-bench: {m} is left out (scripts/fill_external.py failed)");
                continue;
            }
        }
        for &batch in batches {
            let input = dir.join(format!("{m}-b{batch}-x.npy"));
            if !input.exists() {
                // A seeded input of the graph's image shape.
                let (mut rng, n) = (Rng(0x5eed ^ u64::from(batch)), batch as usize * 3 * 224 * 224);
                let data: Vec<f32> = (0..n).map(|_| (2.0 * rng.unit() - 1.0) as f32).collect();
                let a = npy::Array::floats(vec![u64::from(batch), 3, 224, 224], data);
                if let Err(e) = npy::write_file(&input, &a) {
                    eprintln!("onnx-bench: {m}: {}: {e}", input.display());
                    continue;
                }
            }
            v.push(Case {
                name: format!("{m} (torchvision, random weights)"),
                model: model.clone(),
                inputs: vec![("x".to_string(), input)],
                output: None,
                batch,
                shape: None,
            });
        }
    }
    v
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// Simulated NPU time on 1+1 and 4+4 vNPUs and host wall time of the
/// functional model against ONNX Runtime (interleaved, single-threaded)
/// for the test models in tests/fixtures/onnx, and the pretrained network
/// once scripts/pretrained.sh has fetched it.
#[derive(Parser, Debug)]
#[command(name = "onnx-bench")]
struct Args {
    /// Interleaved rounds (min / median / max over them).
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Timed runs per side and round, after one untimed run each; a
    /// round's figure is their median. 1 (the default, as the tables of
    /// docs/benchmarks.md before 2026-12-03) times a run just after the
    /// warm-up; small models need more to time ONNX Runtime's steady state.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    runs: u64,
    /// The Python with ONNX Runtime [default: .venv-onnx/bin/python].
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// Only the models whose name contains one of these (comma-separated),
    /// e.g. `resnet18,mobilenet` [default: every model].
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Threads of the functional model's products (rayon's pool). ONNX
    /// Runtime runs on one; more than one makes the ratio flatter the
    /// model.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: u32,
    /// Element type of the products' weights and operands.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    #[command(flatten)]
    board: BoardArg,
}

fn main() {
    // The model's allocator settings as the `vnpu` binary has them.
    npu_model::keep_freed_memory();
    let args = Args::parse();
    // The functional model's large products run on rayon's pool (two
    // threads on two cores by default), ONNX Runtime on one thread: the
    // model gets as many (`--threads`), before any product runs. Edition
    // 2021: setting the environment of this still single-threaded
    // process is safe.
    std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string());
    let rounds = args.rounds as usize;
    let dtype = DType::from_name(&args.dtype).unwrap_or(DType::F32);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = args.python.clone().unwrap_or_else(|| root.join(".venv-onnx/bin/python"));
    let board = args.board.load().unwrap_or_else(|e| npu_bench::fail("onnx-bench", &e));
    let clock = f64::from(board.clock_mhz) * 1e6;
    for c in cases(&root, &python) {
        if !args.only.is_empty() && !args.only.iter().any(|o| c.name.contains(o.as_str())) {
            continue;
        }
        let xs: Vec<npy::Array> =
            c.inputs.iter().map(|(_, p)| npy::read_file(p).unwrap_or_else(|e| panic!("{e}"))).collect();
        let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
        let mut instructions = 0;
        let mut host_runner = None;
        let mut output = c.output.map(str::to_string);
        for (sa, vu) in [(1, 1), (4, 4)] {
            let opts = CompileOptions {
                shape: VnpuShape::on_board(&board, sa, vu, board.sram_bytes(), 1 << 30),
                batch: c.batch,
                shapes: c.shape.iter().map(|s| (c.inputs[0].0.clone(), s.clone())).collect(),
                outputs: c.output.map(|o| vec![o.to_string()]),
                dtype,
                bf16_activations: false,
                spread: None,
                reuse_hbm: true,
                fuse_residual: true,
                fuse_blocks: true,
            };
            let compiled = compile_file(&c.model, &opts).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            output = Some(compiled.model.outputs[0].name.clone());
            let mut r = HostRunner::new(&board, &compiled.model).unwrap_or_else(|e| panic!("{e}"));
            let (_, rep) = r.infer(&data).unwrap_or_else(|e| panic!("{e}"));
            let t = rep.totals();
            let cyc = rep.cycles.max(1.0);
            println!(
                "{} batch {} on {sa} SA + {vu} VU: simulated {:.1} us per batch ({:.2} us per sample), SA utilization {:.1}%, VU utilization {:.1}%, {} MACs",
                c.name,
                c.batch,
                rep.cycles / clock * 1e6,
                rep.cycles / clock * 1e6 / f64::from(c.batch),
                100.0 * t.sa_active_cycles / (cyc * f64::from(sa)),
                100.0 * t.vu_active_cycles / (cyc * f64::from(vu)),
                compiled.report.macs
            );
            if sa == 1 {
                instructions = compiled.report.infer_instructions;
                host_runner = Some(r);
            }
        }
        let (Some(mut r), Some(output)) = (host_runner, output) else { continue };
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            // Each side's timed run follows an untimed one of its own, as
            // in ort_ref.py (its session's first run, whose outputs it
            // saves): neither starts from caches the other left cold.
            r.infer(&data).unwrap_or_else(|e| panic!("{e}"));
            let mut mine = Vec::with_capacity(args.runs as usize);
            for _ in 0..args.runs {
                let t0 = Instant::now();
                r.infer(&data).unwrap_or_else(|e| panic!("{e}"));
                mine.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            ours.push(stats(mine).1);
            let out = Command::new(&python)
                .arg(root.join("scripts/ort_ref.py"))
                .arg(&c.model)
                .arg(std::env::temp_dir().join("onnx-bench"))
                .args(c.inputs.iter().map(|(n, p)| format!("{n}={}", p.display())))
                .args(["--output", &output, "--time", &args.runs.to_string()])
                .output()
                .unwrap_or_else(|e| panic!("{}: {e} (bash scripts/setup.sh installs it)", python.display()));
            let s = String::from_utf8_lossy(&out.stdout);
            let times: Vec<f64> = s
                .lines()
                .filter_map(|l| l.strip_prefix("ort_seconds "))
                .filter_map(|v| v.trim().parse::<f64>().ok())
                .map(|t| t * 1e3)
                .collect();
            if times.is_empty() {
                panic!("ort_ref.py: {}", String::from_utf8_lossy(&out.stderr));
            }
            theirs.push(stats(times).1);
        }
        let ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
        let (o, t, q) = (stats(ours), stats(theirs), stats(ratios));
        // Microseconds per instruction of the infer program: all of the
        // model's wall, and what it takes beyond ONNX Runtime's.
        let per = |ms: f64| ms * 1e3 / instructions.max(1) as f64;
        println!(
            "{} batch {}: host wall per batch ({} timed runs a round, their median), {rounds} interleaved rounds, min/median/max: functional model (1 SA + 1 VU) {:.2}/{:.2}/{:.2} ms, ONNX Runtime CPU {:.3}/{:.3}/{:.3} ms; ratio model/ORT {:.1}/{:.1}/{:.1}; {instructions} instructions, {:.2} us each, {:.2} us each beyond ORT",
            c.name, c.batch, args.runs, o.0, o.1, o.2, t.0, t.1, t.2, q.0, q.1, q.2, per(o.1), per((o.1 - t.1).max(0.0))
        );
    }
}
