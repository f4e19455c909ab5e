//! What a runner of compiled models (`docs/compiled-model-format.md`) reads and
//! prints, written once for the host's `vnpu infer` and the Linux guest's
//! `vnpu-infer` (`docs/inference-guests.md`):
//! - [`npy`]: NumPy `.npy` arrays in and out;
//! - [`gather_inputs`]: input files matched to a model's inputs by name or
//!   order, checked against its shapes, and the number of batches they make;
//! - [`print_report`]: the `ran` / `latency` / `counters` / top-k lines and
//!   the `--output` files;
//! - [`compare`]: outputs against a reference (ONNX Runtime's), with the
//!   error measures the tests use.

pub mod npy;

use std::collections::HashMap;
use std::path::Path;

use npy::{Array, NpyError};
use vnpu_abi::compiled_model::Model;

/// Why a runner's inputs or outputs are wrong.
#[derive(Debug, thiserror::Error)]
pub enum InferIoError {
    #[error(transparent)]
    Npy(#[from] NpyError),
    #[error("{0}")]
    Usage(String),
}

/// The inputs `args` (`FILE` or `NAME=FILE`), matched to the model's by
/// name or order, and the number of batches they make (their leading
/// dimension is a multiple of the compiled batch).
pub fn gather_inputs(m: &Model, args: &[String]) -> Result<(Vec<Array>, u32), InferIoError> {
    let usage = |s: String| InferIoError::Usage(s);
    if args.len() != m.inputs.len() {
        let names: Vec<&str> = m.inputs.iter().map(|t| t.name.as_str()).collect();
        return Err(usage(format!(
            "the model has {} input(s) ({}); {} --input given",
            m.inputs.len(),
            names.join(", "),
            args.len()
        )));
    }
    let mut by_name = HashMap::new();
    for (i, a) in args.iter().enumerate() {
        let (name, path) = match a.split_once('=') {
            Some((n, p)) if m.inputs.iter().any(|t| t.name == n) => (n.to_string(), p),
            _ => (m.inputs[i].name.clone(), a.as_str()),
        };
        by_name.insert(name, npy::read_file(Path::new(path))?);
    }
    let mut runs = None;
    let mut out = Vec::new();
    for t in &m.inputs {
        let a = by_name.remove(&t.name).ok_or_else(|| usage(format!("no --input for `{}`", t.name)))?;
        let batch = t.dims.first().copied().unwrap_or(1).max(1);
        // A rank-0 tensor has no batch axis: refused here, never indexed.
        let lead = a.shape.first().copied().unwrap_or(0);
        let ok = a.shape.len() == t.dims.len() && a.shape.get(1..) == t.dims.get(1..) && lead % batch == 0;
        if !ok || lead == 0 {
            return Err(usage(format!(
                "input `{}` has shape {:?}; the model takes {:?} per batch (a leading dimension that is a multiple of {batch} runs several batches)",
                t.name, a.shape, t.dims
            )));
        }
        let r = u32::try_from(lead / batch)
            .map_err(|_| usage(format!("input `{}`: too many batches", t.name)))?;
        if *runs.get_or_insert(r) != r {
            return Err(usage("the inputs make different numbers of batches".into()));
        }
        if t.elem.is_int() {
            // Integers travel as i32: every value must fit, exactly.
            let Some(ints) = &a.ints else {
                return Err(usage(format!(
                    "input `{}` is {} in the model: give an integer array (this one is floating-point)",
                    t.name,
                    t.elem.name()
                )));
            };
            if let Some(v) = ints.iter().find(|&&v| i32::try_from(v).is_err()) {
                return Err(usage(format!(
                    "input `{}` holds {v}, outside the 32-bit range integer inputs travel in",
                    t.name
                )));
            }
        }
        out.push(a);
    }
    Ok((out, runs.unwrap_or(1)))
}

/// One batch's little-endian input bytes: batch `run` of every input, in
/// the model's order (the layout of the model's I/O window).
pub fn batch_input_bytes(m: &Model, inputs: &[Array], run: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (x, d) in inputs.iter().zip(&m.inputs) {
        let n = d.elems().unwrap_or(0) as usize;
        match (&x.ints, d.elem.is_int()) {
            // Checked to fit by `gather_inputs`; saturated otherwise.
            (Some(ints), true) => {
                for &v in ints.iter().skip(run * n).take(n) {
                    let v = i32::try_from(v).unwrap_or(if v < 0 { i32::MIN } else { i32::MAX });
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            _ => {
                for v in x.data.iter().skip(run * n).take(n) {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    out
}

/// Splits one batch's output bytes (every output, in the model's order)
/// and appends each output's values to `outs` as f32 (an integer output's
/// i32s converted).
pub fn append_outputs(m: &Model, bytes: &[u8], outs: &mut [Vec<f32>]) {
    let mut at = 0;
    for (acc, d) in outs.iter_mut().zip(&m.outputs) {
        let n = (d.bytes().unwrap_or(0) as usize).min(bytes.len().saturating_sub(at));
        let words = bytes[at..at + n].chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
        if d.elem.is_int() {
            acc.extend(words.map(|w| i32::from_le_bytes(w) as f32));
        } else {
            acc.extend(words.map(f32::from_le_bytes));
        }
        at += n;
    }
}

/// One request's statistics.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunStat {
    /// Wall time the runner measured (guest or host clock).
    pub wall_ns: u64,
    /// Simulated cycles.
    pub cycles: u64,
    pub sa_active: u64,
    pub vu_active: u64,
}

/// The smallest, median and largest of `v` (NaN for none).
pub fn min_med_max(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// What [`print_report`] prints.
#[derive(Clone, Debug)]
pub struct ReportOptions<'a> {
    /// The NPU clock (simulated cycles to time).
    pub clock_mhz: u32,
    /// Whose clock the wall times are (`guest`, `host`).
    pub wall: &'a str,
    /// How the model ran (the `ran` line's tail).
    pub path: &'a str,
    /// Top-k entries per sample (0: none).
    pub top: usize,
    /// Samples to print the top-k of.
    pub show: usize,
    /// Where to write the outputs (`.npy`; several outputs get
    /// `OUT.<i>.<name>.npy`).
    pub output: Option<&'a Path>,
}

/// The line for an output of one value per sample (a classifier's label,
/// a regression): the first `show` values (integers as integers), and how
/// many more there are.
fn scalar_line(name: &str, int: bool, v: &[f32], show: usize) -> String {
    let shown: Vec<String> =
        v.iter().take(show).map(|&x| if int { format!("{}", x as i64) } else { format!("{x:.4}") }).collect();
    let more = v.len().saturating_sub(show);
    let tail = if more > 0 { format!(" ... {more} more (--show N prints more)") } else { String::new() };
    format!("{name:<13} samples 0-{}: {}{tail}", shown.len().saturating_sub(1), shown.join(" "))
}

/// The indices of the `k` largest entries of `row`, largest first.
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&i, &j| row[j].total_cmp(&row[i]));
    idx.truncate(k);
    idx
}

/// Prints the report of `runs` batches (see `docs/cli.md`, `vnpu infer`)
/// and writes the outputs.
pub fn print_report(
    m: &Model,
    runs: u32,
    outputs: &[Vec<f32>],
    stats: &[RunStat],
    o: &ReportOptions,
) -> Result<(), InferIoError> {
    let t = m.target;
    let clock = f64::from(o.clock_mhz) * 1e6;
    let dtype = t.sa_dtype.name();
    println!(
        "ran           {runs} batch(es) of {} on {} SA + {} VU ({dtype} SA operands), {}",
        t.batch, t.sa, t.vu, o.path
    );
    let wall = min_med_max(stats.iter().map(|s| s.wall_ns as f64 / 1e3).collect());
    let npu = min_med_max(stats.iter().map(|s| s.cycles as f64 / clock * 1e6).collect());
    println!(
        "latency       per batch: {} wall min/median/max {:.1}/{:.1}/{:.1} us; simulated NPU time {:.1}/{:.1}/{:.1} us",
        o.wall, wall.0, wall.1, wall.2, npu.0, npu.1, npu.2
    );
    let cycles: u64 = stats.iter().map(|s| s.cycles).sum();
    let (sa, vu): (u64, u64) =
        (stats.iter().map(|s| s.sa_active).sum(), stats.iter().map(|s| s.vu_active).sum());
    let c = cycles.max(1) as f64;
    println!(
        "counters      {cycles} cycles; SA active {sa} ({:.1}% of {} SA), VU active {vu} ({:.1}% of {} VU)",
        100.0 * sa as f64 / (c * f64::from(t.sa.max(1))),
        t.sa,
        100.0 * vu as f64 / (c * f64::from(t.vu.max(1))),
        t.vu
    );
    for (d, v) in m.outputs.iter().zip(outputs) {
        let per = d.elems().unwrap_or(0) as usize / (t.batch as usize).max(1);
        let samples = v.len() / per.max(1);
        if o.top > 0 && per == 1 {
            println!("{}", scalar_line(&d.name, d.elem.is_int(), v, o.show));
        }
        if o.top > 0 && per > 1 {
            for s in 0..samples.min(o.show) {
                let row = &v[s * per..(s + 1) * per];
                let top: Vec<String> =
                    top_k(row, o.top).iter().map(|&i| format!("{i}:{:.4}", row[i])).collect();
                println!("{:<13} sample {s}: top-{} {}", d.name, o.top.min(per), top.join(" "));
            }
            if samples > o.show {
                println!("{:<13} ... {} more samples (--show N prints more)", d.name, samples - o.show);
            }
        }
    }
    if let Some(path) = o.output {
        for (i, (d, v)) in m.outputs.iter().zip(outputs).enumerate() {
            let mut shape = d.dims.clone();
            if let Some(lead) = shape.first_mut() {
                *lead *= u64::from(runs);
            }
            let p = if m.outputs.len() == 1 {
                path.to_path_buf()
            } else {
                let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
                path.with_file_name(format!("{stem}.{i}.{}.npy", d.name.replace(['/', ':'], "_")))
            };
            // An integer output (i32 in the window, exact in f32 up to
            // 2^24, as an index is) is written as int64.
            let a = if d.elem.is_int() {
                Array::integers(shape, v.iter().map(|&x| x as i64).collect())
            } else {
                Array::floats(shape, v.clone())
            };
            npy::write_file(&p, &a)?;
            println!("wrote         {} ({})", p.display(), d.name);
        }
    }
    Ok(())
}

/// How far outputs are from a reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// Largest |got - want| (NaN if either has a NaN).
    pub max_abs: f64,
    /// Largest |got - want| / max(|want|, 1e-3 * max |want|): relative
    /// error with denominators kept off zero (logits cross zero).
    pub scaled_rel: f64,
    /// Rows (of `row` entries) whose largest entry is at the same index.
    pub top1_agree: usize,
    pub rows: usize,
}

/// Compares `got` with `want` (equal lengths) in rows of `row` entries.
/// Any NaN makes both error measures NaN; different lengths are an error.
pub fn compare(got: &[f32], want: &[f32], row: usize) -> Result<Comparison, InferIoError> {
    if got.len() != want.len() {
        return Err(InferIoError::Usage(format!(
            "the reference has {} values, the output {}",
            want.len(),
            got.len()
        )));
    }
    // A NaN in `want` makes its own difference NaN below.
    let scale = want.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs()));
    let (mut abs, mut rel) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (f64::from(g) - f64::from(w)).abs();
        let r = d / f64::from(w).abs().max(scale * 1e-3);
        // f64::max drops NaN: carry it explicitly.
        abs = if d.is_nan() || abs.is_nan() { f64::NAN } else { abs.max(d) };
        rel = if r.is_nan() || rel.is_nan() { f64::NAN } else { rel.max(r) };
    }
    let row = row.max(1);
    let rows = got.len() / row;
    let top1_agree = (0..rows)
        .filter(|&i| top_k(&got[i * row..(i + 1) * row], 1) == top_k(&want[i * row..(i + 1) * row], 1))
        .count();
    Ok(Comparison { max_abs: abs, scaled_rel: rel, top1_agree, rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A label or a regression output prints its first values: integers
    /// as integers, floats to four places, and how many more there are.
    #[test]
    fn one_value_per_sample_prints_the_values() {
        assert_eq!(scalar_line("label", true, &[2.0, 0.0, 1.0], 5), "label         samples 0-2: 2 0 1");
        assert_eq!(
            scalar_line("y", false, &[1.5, -0.25, 3.0, 4.0], 2),
            "y             samples 0-1: 1.5000 -0.2500 ... 2 more (--show N prints more)"
        );
    }

    #[test]
    fn compare_measures_errors_against_the_reference_and_propagates_nan() {
        let want = [1.0f32, -2.0, 0.0, 4.0];
        let got = [1.0f32, -2.0, 0.004, 3.996];
        let c = compare(&got, &want, 2).unwrap();
        assert!((c.max_abs - 0.004).abs() < 1e-6, "{c:?}");
        // 0.004 / max(0, 4e-3) = 1.0 for the entry at zero.
        assert!((c.scaled_rel - 1.0).abs() < 1e-3, "{c:?}");
        assert_eq!((c.top1_agree, c.rows), (2, 2));
        let c = compare(&[0.0, 1.0], &[1.0, 0.0], 2).unwrap();
        assert_eq!(c.top1_agree, 0);
        let c = compare(&[f32::NAN, 1.0], &[1.0, 0.0], 2).unwrap();
        assert!(c.max_abs.is_nan() && c.scaled_rel.is_nan(), "{c:?}");
        let c = compare(&[1.0, 1.0], &[f32::NAN, 0.0], 2).unwrap();
        assert!(c.max_abs.is_nan() && c.scaled_rel.is_nan(), "{c:?}");
        assert!(compare(&[1.0], &[1.0, 2.0], 1).is_err());
    }

    fn model(dims: Vec<u64>) -> Model {
        use vnpu_abi::compiled_model::{ElemType, Target, TensorDesc};
        let t = |name: &str, dims: Vec<u64>| TensorDesc {
            name: name.into(),
            elem: ElemType::F32,
            dims,
            offset: 0,
        };
        Model {
            target: Target {
                batch: 2,
                sa: 1,
                vu: 1,
                sram_bytes: 1 << 20,
                hbm_bytes: 1 << 20,
                sa_dtype: vnpu_abi::DType::F32,
            },
            window_bytes: 4096,
            inputs: vec![t("x", dims)],
            outputs: vec![t("y", vec![2])],
            load: vnpu_abi::ProgramBuilder::new().finish(),
            infer: vnpu_abi::ProgramBuilder::new().finish(),
            weights: Vec::new(),
        }
    }

    fn file(name: &str, shape: Vec<u64>) -> String {
        let p = std::env::temp_dir().join(format!("infer-io-{}-{name}.npy", std::process::id()));
        let n = shape.iter().product::<u64>() as usize;
        npy::write_file(&p, &Array::floats(shape, (0..n).map(|i| i as f32).collect())).unwrap();
        p.display().to_string()
    }

    #[test]
    fn inputs_are_matched_by_name_and_shape_and_bad_ones_refused() {
        let m = model(vec![2, 3]);
        let six = file("six", vec![6, 3]);
        let (xs, runs) = gather_inputs(&m, std::slice::from_ref(&six)).unwrap();
        assert_eq!((xs[0].shape.clone(), runs), (vec![6, 3], 3));
        assert_eq!(gather_inputs(&m, &[format!("x={six}")]).unwrap().1, 3);
        // Batch 1 of 3, in the window's byte order.
        let b = batch_input_bytes(&m, &xs, 1);
        assert_eq!(b.len(), 24);
        assert_eq!(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), 6.0);
        let odd = file("odd", vec![3, 3]);
        assert!(matches!(gather_inputs(&m, &[odd]), Err(InferIoError::Usage(_))));
        let wrong = file("wrong", vec![2, 4]);
        assert!(matches!(gather_inputs(&m, &[wrong]), Err(InferIoError::Usage(_))));
        assert!(matches!(gather_inputs(&m, &[]), Err(InferIoError::Usage(_))));
        // A rank-0 input (the model's and the file's) is refused, not indexed.
        let scalar = file("scalar", vec![]);
        assert!(matches!(gather_inputs(&model(vec![]), &[scalar]), Err(InferIoError::Usage(_))));
    }

    /// An int64 `.npy` file of `v`, shaped `shape`.
    fn int_file(name: &str, shape: Vec<u64>, v: &[i64]) -> String {
        use npyz::WriterBuilder;
        let p = std::env::temp_dir().join(format!("infer-io-{}-{name}.npy", std::process::id()));
        let mut buf = Vec::new();
        let mut w =
            npyz::WriteOptions::new().default_dtype().shape(&shape).writer(&mut buf).begin_nd().unwrap();
        w.extend(v.iter().copied()).unwrap();
        w.finish().unwrap();
        std::fs::write(&p, buf).unwrap();
        p.display().to_string()
    }

    /// An integer input takes an integer file's values exactly, as i32 in
    /// the window; a float file, or a value past i32, is refused.
    #[test]
    fn integer_inputs_travel_as_i32_and_must_fit() {
        let mut m = model(vec![2, 3]);
        m.inputs[0].elem = vnpu_abi::compiled_model::ElemType::I64;
        let big = (1i64 << 24) + 1; // not exact as an f32
        let ids = int_file("ids", vec![2, 3], &[0, 1, -1, big, 7, 30521]);
        let (xs, runs) = gather_inputs(&m, std::slice::from_ref(&ids)).unwrap();
        assert_eq!(runs, 1);
        let b = batch_input_bytes(&m, &xs, 0);
        let got: Vec<i32> = b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, vec![0, 1, -1, big as i32, 7, 30521]);
        let floats = file("floats", vec![2, 3]);
        let e = gather_inputs(&m, &[floats]).unwrap_err().to_string();
        assert!(e.contains("give an integer array"), "{e}");
        let far = int_file("far", vec![2, 3], &[0, 1, 2, 3, 4, 1 << 31]);
        let e = gather_inputs(&m, &[far]).unwrap_err().to_string();
        assert!(e.contains("outside the 32-bit range"), "{e}");
    }

    #[test]
    fn top_k_orders_largest_first() {
        assert_eq!(top_k(&[0.1, 0.7, 0.2], 2), vec![1, 2]);
        assert_eq!(top_k(&[0.1], 5), vec![0]);
    }
}
