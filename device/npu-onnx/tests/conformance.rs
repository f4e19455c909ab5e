//! ONNX's own backend node tests (the conformance suite every runtime
//! runs), regenerated from the installed `onnx` package by
//! `scripts/onnx_conformance.py` (scripts/test.sh runs it first): each test
//! whose inputs and outputs are float32 is compiled (`npu_onnx::compile`)
//! and, when accepted, run in-process and compared with the suite's
//! expected outputs. A refusal is fine; a wrong answer (or an accepted
//! model that fails to run, or a panic) fails the test. Prints passed /
//! wrong / refused per operator and writes the table to
//! `target/onnx-conformance.txt` (docs/compiled-model-format.md, "Conformance").
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use npu_lower::VnpuShape;
use npu_model::BoardConfig;
use npu_onnx::host::HostRunner;
use npu_onnx::{compile, npy, CompileOptions};
use vnpu_abi::DType;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What one node test gave.
enum Outcome {
    Passed,
    Wrong(String),
    Refused(String),
}

/// One node test of `index.tsv`.
struct Case {
    name: String,
    op: String,
    rtol: f64,
    atol: f64,
    inputs: Vec<String>,
    skipped: Option<String>,
    /// Its integer inputs were made constants of the model (counted apart).
    consts: bool,
}

fn parse(line: &str) -> Option<Case> {
    let f: Vec<&str> = line.split('\t').collect();
    if f.len() < 7 || line.starts_with('#') {
        return None;
    }
    Some(Case {
        name: f[0].into(),
        op: f[1].into(),
        rtol: f[3].parse().ok()?,
        atol: f[4].parse().ok()?,
        inputs: f[5].split(',').filter(|s| !s.is_empty()).map(String::from).collect(),
        skipped: (!f[6].is_empty()).then(|| f[6].to_string()),
        consts: f.get(7).is_some_and(|x| *x == "consts"),
    })
}

/// The suite's tolerance, with an absolute floor of 1e-6 and a relative
/// one of 1e-4 for f32 arithmetic done in another order than NumPy's
/// (the suite's own default is rtol 1e-3, atol 1e-7). NaN must meet NaN.
fn close(got: f32, want: f32, rtol: f64, atol: f64) -> bool {
    if want.is_nan() || got.is_nan() {
        return want.is_nan() && got.is_nan();
    }
    if want.is_infinite() || got.is_infinite() {
        return got == want;
    }
    let (g, w) = (f64::from(got), f64::from(want));
    (g - w).abs() <= atol.max(1e-6) + rtol.max(1e-4) * w.abs()
}

fn run_case(dir: &Path, c: &Case) -> Outcome {
    let d = dir.join(&c.name);
    let bytes = std::fs::read(d.join("model.onnx")).unwrap();
    let xs: Vec<npy::Array> =
        (0..c.inputs.len()).map(|i| npy::read_file(&d.join(format!("input_{i}.npy"))).unwrap()).collect();
    let board = BoardConfig::default();
    let shapes: HashMap<String, Vec<usize>> = c
        .inputs
        .iter()
        .zip(&xs)
        .map(|(n, x)| (n.clone(), x.shape.iter().map(|&s| s as usize).collect()))
        .collect();
    let batch = xs.first().and_then(|x| x.shape.first()).copied().unwrap_or(1).max(1) as u32;
    let opts = CompileOptions {
        shape: VnpuShape::on_board(&board, 1, 1, board.sram_bytes(), 1 << 30),
        batch,
        shapes,
        outputs: None,
        dtype: DType::F32,
        bf16_activations: false,
        spread: None,
        reuse_hbm: true,
        fuse_residual: true,
        fuse_blocks: true,
    };
    let compiled = match compile(&bytes, &opts) {
        Ok(c) => c,
        // The suite's models are valid ONNX: a refusal saying otherwise
        // is a compiler bug (or a misjudged refusal), counted as wrong.
        Err(e) if e.refusal().is_some_and(|r| !r.is_unsupported()) => {
            return Outcome::Wrong(format!("refused as invalid ONNX: {e}"))
        }
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    let mut r = match HostRunner::new(&board, &compiled.model) {
        Ok(r) => r,
        Err(e) => return Outcome::Wrong(format!("accepted, but loading failed: {e}")),
    };
    let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
    let outs = match r.infer(&data) {
        Ok((o, _)) => o,
        Err(e) => return Outcome::Wrong(format!("accepted, but running failed: {e}")),
    };
    for (i, got) in outs.iter().enumerate() {
        let Ok(want) = npy::read_file(&d.join(format!("output_{i}.npy"))) else {
            return Outcome::Wrong(format!("output {i} beyond the model's outputs"));
        };
        if got.len() != want.data.len() {
            return Outcome::Wrong(format!(
                "output {i}: {} elements, expected {}",
                got.len(),
                want.data.len()
            ));
        }
        if let Some(j) = (0..got.len()).find(|&j| !close(got[j], want.data[j], c.rtol, c.atol)) {
            return Outcome::Wrong(format!("output {i} element {j}: {} against {}", got[j], want.data[j]));
        }
    }
    Outcome::Passed
}

#[test]
fn onnx_node_tests_give_no_wrong_answer() {
    let dir = std::env::var_os("VNPU_ONNX_NODE_TESTS")
        .map_or_else(|| root().join("target/onnx-node-tests"), PathBuf::from);
    let Ok(index) = std::fs::read_to_string(dir.join("index.tsv")) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "no node tests in {}: run .venv-onnx/bin/python scripts/onnx_conformance.py",
            dir.display()
        );
        eprintln!("skipped: no node tests in {} (scripts/onnx_conformance.py writes them)", dir.display());
        return;
    };
    let version = index.lines().next().unwrap_or("").trim_start_matches("# ").to_string();
    // op -> (passed, wrong, refused, skipped, and passed, wrong, refused
    // of the tests whose integer inputs were made constants)
    let mut per_op: BTreeMap<String, [usize; 7]> = BTreeMap::new();
    let mut wrong = Vec::new();
    let mut refusals: BTreeMap<String, usize> = BTreeMap::new();
    for c in index.lines().filter_map(parse) {
        let row = per_op.entry(c.op.clone()).or_default();
        if c.skipped.is_some() {
            row[3] += 1;
            continue;
        }
        let outcome = std::panic::catch_unwind(|| run_case(&dir, &c))
            .unwrap_or_else(|_| Outcome::Wrong("panicked".into()));
        let k = if c.consts { 4 } else { 0 };
        match outcome {
            Outcome::Passed => row[k] += 1,
            Outcome::Wrong(why) => {
                row[k + 1] += 1;
                wrong.push(format!("{} ({}): {why}", c.name, c.op));
            }
            Outcome::Refused(why) => {
                row[k + 2] += 1;
                // The reason without the node's name, to count alike ones.
                let key = why.split_once("): ").map_or(why.as_str(), |(_, r)| r).to_string();
                *refusals.entry(format!("{}: {key}", c.op)).or_default() += 1;
            }
        }
    }
    let total = per_op.values().fold([0usize; 7], |mut a, r| {
        (0..7).for_each(|i| a[i] += r[i]);
        a
    });
    let mut report = format!(
        "ONNX backend node tests ({version}): {} tests\n\
         float32 inputs (float32 or integer outputs): {}: passed {}, wrong {}, refused {}\n\
         integer inputs made constants: {}: passed {}, wrong {}, refused {}\n\n",
        per_op.values().map(|r| r[0] + r[1] + r[2] + r[3] + r[4] + r[5] + r[6]).sum::<usize>(),
        total[0] + total[1] + total[2],
        total[0],
        total[1],
        total[2],
        total[4] + total[5] + total[6],
        total[4],
        total[5],
        total[6]
    );
    report.push_str(&format!(
        "{:<28} {:>6} {:>6} {:>7} {:>9}   {:>6} {:>6} {:>7}  (integer inputs made constants)\n",
        "op", "passed", "wrong", "refused", "skipped", "passed", "wrong", "refused"
    ));
    for (op, r) in &per_op {
        report.push_str(&format!(
            "{op:<28} {:>6} {:>6} {:>7} {:>9}   {:>6} {:>6} {:>7}\n",
            r[0], r[1], r[2], r[3], r[4], r[5], r[6]
        ));
    }
    report.push_str("\nwrong:\n");
    for w in &wrong {
        report.push_str(&format!("  {w}\n"));
    }
    report.push_str("\nrefusals, most frequent first:\n");
    let mut by_count: Vec<_> = refusals.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    for (why, n) in by_count.iter().take(60) {
        report.push_str(&format!("  {n:>4}  {why}\n"));
    }
    println!("{report}");
    let _ = std::fs::write(root().join("target/onnx-conformance.txt"), &report);
    // docs/compiled-model-format.md's operator table: the compiler's own list with
    // these figures (both groups together).
    let table = npu_onnx::operators::table(|op| {
        per_op.get(op).map(|r| (r[0] + r[4], r[1] + r[5], r[2] + r[6])).filter(|&(p, w, f)| p + w + f > 0)
    });
    let doc_path = root().join("docs/compiled-model-format.md");
    let doc = std::fs::read_to_string(&doc_path).unwrap();
    let (begin, end) = ("<!-- operators:begin -->\n", "<!-- operators:end -->");
    let (Some(b), Some(e)) = (doc.find(begin), doc.find(end)) else {
        panic!("docs/compiled-model-format.md has no {begin:?}..{end:?} section for the operator table");
    };
    let have = &doc[b + begin.len()..e];
    if have != table {
        if std::env::var_os("VNPU_WRITE_DOCS").is_some() {
            let new = format!("{}{table}{}", &doc[..b + begin.len()], &doc[e..]);
            std::fs::write(&doc_path, new).unwrap();
        } else {
            panic!(
                "docs/compiled-model-format.md's operator table is not the compiler's list with these figures: \
                 regenerate it with VNPU_WRITE_DOCS=1 cargo test --release -p npu-onnx --test conformance"
            );
        }
    }
    assert!(wrong.is_empty(), "{} node tests gave a wrong answer:\n{}", wrong.len(), wrong.join("\n"));
}
