//! `vnpu-infer`: runs a compiled model (`vnpu compile`) on the first vNPU
//! from Linux user space, as the bare-metal runner guest does for
//! `vnpu infer` (`docs/inference-guests.md`), and optionally checks the
//! outputs against a reference (ONNX Runtime's, computed on the host).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use guest_apps::infer;
use npu_infer_io::npy;
use npu_infer_io::{
    append_outputs, batch_input_bytes, compare, gather_inputs, print_report, ReportOptions, RunStat,
};
use vnpu_abi::compiled_model::Model;
use vnpu_driver::Vnpu;

const USAGE: &str = "\
usage: vnpu-infer MODEL.vnpu --input [NAME=]FILE.npy... [options]

Runs a compiled model (`vnpu compile`, docs/compiled-model-format.md) on this Linux
guest's first vNPU through the user-space driver: one request per batch of
the compiled batch size (the inputs' leading dimension is a multiple of
it). Prints the latency per batch (guest wall clock and simulated NPU time),
the counters and the top-k of each sample.

options:
  --input [NAME=]FILE.npy  an input (by name, or in the model's order)
  --output OUT.npy         write the outputs (several: OUT.<i>.<name>.npy)
  --top K                  top-k entries per sample to print (default 5)
  --show N                 samples to print the top-k of (default 3)
  --expect REF.npy         compare the first output with REF (ONNX Runtime's
                           output): prints max abs and scaled relative error
                           and top-1 agreement; exit 1 when the relative
                           error exceeds --max-rel or a top-1 differs
  --max-rel R              tolerance of --expect (default 1e-4)
  --help                   this text

DMA memory: with the vnpu kernel module loaded, one buffer it allocates
(above 4 MiB from the CMA area: boot with cma=SIZE); otherwise 2 MiB huge
pages, more than one only if they are physically contiguous.
Exit codes: 0 done (and within tolerance), 1 a check failed, 2 an error.";

struct Args {
    model: PathBuf,
    inputs: Vec<String>,
    output: Option<PathBuf>,
    top: usize,
    show: usize,
    expect: Option<PathBuf>,
    max_rel: f64,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        model: PathBuf::new(),
        inputs: Vec::new(),
        output: None,
        top: 5,
        show: 3,
        expect: None,
        max_rel: 1e-4,
    };
    let mut model = None;
    while let Some(arg) = it.next() {
        let mut value = |what: &str| it.next().ok_or(format!("{arg} needs {what}"));
        match arg.as_str() {
            "--help" | "-h" => return Ok(None),
            "--input" => a.inputs.push(value("a file")?),
            "--output" => a.output = Some(value("a file")?.into()),
            "--expect" => a.expect = Some(value("a file")?.into()),
            "--top" => a.top = value("a count")?.parse().map_err(|_| "--top needs a count")?,
            "--show" => a.show = value("a count")?.parse().map_err(|_| "--show needs a count")?,
            "--max-rel" => {
                a.max_rel = value("a number")?
                    .parse()
                    .ok()
                    .filter(|r: &f64| r.is_finite() && *r >= 0.0)
                    .ok_or("--max-rel needs a number >= 0")?
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if model.is_none() => model = Some(PathBuf::from(s)),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    a.model = model.ok_or("no MODEL.vnpu given")?;
    if a.inputs.is_empty() {
        return Err("no --input given".into());
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("vnpu-infer: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("vnpu-infer: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(a: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let file = std::fs::read(&a.model).map_err(|e| format!("{}: {e}", a.model.display()))?;
    let (mut model, weights) =
        Model::decode_parts(&file).map_err(|e| format!("{}: {e}", a.model.display()))?;
    let (inputs, runs) = gather_inputs(&model, &a.inputs)?;
    let (_, out_bytes) = infer::batch_bytes(&model).ok_or("the model's tensor sizes overflow")?;

    let mut opened = linux_guest::open_first()?;
    // One DMA buffer: the I/O window, then the ring and both programs
    // (1 MiB is ample for the ring and the alignment of each).
    let len = usize::try_from(model.window_bytes)
        .ok()
        .and_then(|w| w.checked_next_multiple_of(4096))
        .and_then(|w| w.checked_add(model.load.encoded_len()))
        .and_then(|w| w.checked_add(model.infer.encoded_len()))
        .and_then(|w| w.checked_add(1 << 20))
        .and_then(|w| w.checked_next_multiple_of(4096))
        .ok_or_else(|| format!("the model's I/O window of {} bytes is too large", model.window_bytes))?;
    let dma = opened.dma_memory(len)?;
    let mut region = dma.region(0, dma.len());
    let mut npu = Vnpu::new(opened.dev.bar(), &mut region, 64)?;
    opened.hook_interrupts(&mut npu);
    let loaded = infer::load(&mut npu, &mut region, &mut model, infer::Weights::Copy(weights), opened.wait)?;

    let start = Instant::now();
    let clock = || start.elapsed().as_nanos() as u64;
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); model.outputs.len()];
    let mut stats = Vec::new();
    let mut out = vec![0u8; out_bytes as usize];
    for r in 0..runs as usize {
        let input = batch_input_bytes(&model, &inputs, r);
        let (ns, st) =
            loaded.run(&mut npu, &model, &input, &mut out, &clock).map_err(|e| format!("batch {r}: {e}"))?;
        stats.push(RunStat {
            wall_ns: ns,
            cycles: st.cycles,
            sa_active: st.sa_active,
            vu_active: st.vu_active,
        });
        append_outputs(&model, &out, &mut outs);
    }
    println!("infer: {runs} batches of {} done", model.target.batch);
    let clock_mhz = npu.hierarchy().clock_mhz;
    let wait = if opened.wait == vnpu_driver::Wait::Interrupt { "MSI-X" } else { "polling" };
    let path = format!("Linux guest (vnpu-infer: user-space driver, ring, verifier, model, {wait})");
    let opts = ReportOptions {
        clock_mhz,
        wall: "guest",
        path: &path,
        top: a.top,
        show: a.show,
        output: a.output.as_deref(),
    };
    print_report(&model, runs, &outs, &stats, &opts)?;

    let Some(reference) = &a.expect else { return Ok(true) };
    let want = npy::read_file(Path::new(reference))?;
    let (Some(d), Some(got)) = (model.outputs.first(), outs.first()) else {
        return Err("the model has no output".into());
    };
    let row = d.elems().unwrap_or(0) as usize / (model.target.batch as usize).max(1);
    let c = compare(got, &want.data, row)?;
    println!(
        "check         {} against {}: max abs {:.3e}, scaled rel {:.3e}, top-1 agree {}/{}",
        d.name,
        reference.display(),
        c.max_abs,
        c.scaled_rel,
        c.top1_agree,
        c.rows
    );
    // NaN fails: the comparison is written so that it cannot pass.
    let within = c.scaled_rel <= a.max_rel;
    let agree = row <= 1 || c.top1_agree == c.rows;
    if !within {
        println!("check         FAIL: relative error above {:.1e}", a.max_rel);
    }
    if !agree {
        println!("check         FAIL: {} of {} top-1 differ", c.rows - c.top1_agree, c.rows);
    }
    Ok(within && agree)
}
