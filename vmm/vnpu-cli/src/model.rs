//! `vnpu compile` (ONNX -> compiled model) and `vnpu infer` (a VM whose
//! runner guest runs a compiled model on its vNPU; docs/compiled-model-format.md).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use npu_infer_io::npy::Array;
use npu_infer_io::{append_outputs, batch_input_bytes, gather_inputs, ReportOptions, RunStat};
use npu_lower::VnpuShape;
use npu_model::BoardConfig;
use npu_onnx::host::HostRunner;
use npu_onnx::{CompileOptions, CompileReport};
use vnpu_abi::compiled_model::{job, Model};
use vnpu_abi::DType;

/// Where `scripts/build-guests.sh` puts the runner guest.
pub const DEFAULT_GUEST: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest-images/target/x86_64-unknown-none/release/infer");

/// Why `vnpu compile` or `vnpu infer` failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelCmdError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: {reason}")]
    Model { path: String, reason: String },
    #[error(transparent)]
    Compile(#[from] npu_onnx::CompileError),
    #[error(transparent)]
    InferIo(#[from] npu_infer_io::InferIoError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Vm(#[from] vnpu_vm::VmError),
    #[error("the runner guest is not built ({0}); run `bash scripts/build-guests.sh` first")]
    NoGuest(String),
    #[error("the runner guest failed (exit code {code}): {message}")]
    Guest { code: u32, message: String },
    #[error("in-process run: {0}")]
    Host(#[from] npu_onnx::host::HostError),
    #[error("--expect: {0}")]
    Expect(#[from] npu_infer_io::npy::NpyError),
}

/// The vNPU core a `--vnpu` spec gives (one core: a model runs on one).
pub fn shape(spec: &vnpu_spec::VnpuSpec, board: &BoardConfig) -> VnpuShape {
    VnpuShape::on_board(
        board,
        spec.sa_per_core(),
        spec.vu_per_core(),
        spec.sram_per_core(),
        spec.hbm_per_core(),
    )
}

/// `NAME=D0,D1,...`.
pub fn parse_shape(s: &str) -> Result<(String, Vec<usize>), String> {
    let (name, dims) = s.split_once('=').ok_or(format!("`{s}` is not NAME=D0,D1,..."))?;
    let dims = dims
        .split(',')
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .ok()
                .filter(|&d| d > 0)
                .ok_or(format!("`{d}` in `{s}` is not a positive size"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((name.trim().to_string(), dims))
}

fn print_report(r: &CompileReport, m: &Model) {
    let ops: Vec<String> = r.ops.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    println!(
        "graph         {} nodes: {} folded at compile time, {} fused, {} free (reshapes, identities)",
        r.nodes, r.folded, r.fused, r.aliases
    );
    println!("vNPU ops      {}", ops.join(", "));
    if r.blocks > 0 {
        println!(
            "fused blocks  {} (expansion, depthwise, projection, residual add: one pipeline each)",
            r.blocks
        );
    }
    println!(
        "target        batch {} on {} SA + {} VU, {} KiB SRAM; {} MACs per batch, {} SA operands",
        m.target.batch,
        m.target.sa,
        m.target.vu,
        m.target.sram_bytes >> 10,
        r.macs,
        m.target.sa_dtype.name()
    );
    println!(
        "memory        {} bytes of weights, {} bytes of HBM, I/O window {} bytes",
        r.weight_bytes, r.hbm_bytes, m.window_bytes
    );
    println!("programs      load {} instructions, infer {}", r.load_instructions, r.infer_instructions);
    for (what, list) in [("input", &m.inputs), ("output", &m.outputs)] {
        for t in list.iter() {
            let elem = match t.elem {
                vnpu_abi::compiled_model::ElemType::F32 => "f32",
                vnpu_abi::compiled_model::ElemType::I64 => "int64 (i32 on the device)",
                vnpu_abi::compiled_model::ElemType::I32 => "int32",
            };
            println!("{what:<13} {} {elem} {:?}", t.name, t.dims);
        }
    }
}

/// `vnpu compile`.
#[allow(clippy::too_many_arguments)]
pub fn compile(
    model: &Path,
    spec: &vnpu_spec::VnpuSpec,
    board: &BoardConfig,
    batch: u32,
    (dtype, bf16_activations, reuse_hbm, fuse_residual, fuse_blocks): (&str, bool, bool, bool, bool),
    shapes: Vec<(String, Vec<usize>)>,
    outputs: Vec<String>,
    spread: Option<vnpu_spec::Borrow>,
    out: &Path,
) -> Result<(), ModelCmdError> {
    let dtype = DType::from_name(dtype)
        .ok_or_else(|| ModelCmdError::Usage(format!("--dtype {dtype}: expected f32 or bf16")))?;
    if batch == 0 {
        return Err(ModelCmdError::Usage("--batch must be at least 1".into()));
    }
    let bytes = std::fs::read(model)
        .map_err(|source| ModelCmdError::Io { path: model.display().to_string(), source })?;
    let opts = CompileOptions {
        shape: shape(spec, board),
        batch,
        shapes: shapes.into_iter().collect::<HashMap<_, _>>(),
        outputs: (!outputs.is_empty()).then_some(outputs),
        dtype,
        bf16_activations,
        spread: spread.map(|b| (b.sa, b.vu)),
        reuse_hbm,
        fuse_residual,
        fuse_blocks,
    };
    let m = npu_onnx::load_from(
        &bytes,
        Some(model.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))),
    )
    .map_err(npu_onnx::CompileError::Load)?;
    let c = npu_onnx::compile_model(&m, &opts)?;
    print_report(&c.report, &c.model);
    std::fs::write(out, c.model.encode())
        .map_err(|source| ModelCmdError::Io { path: out.display().to_string(), source })?;
    println!("wrote         {}", out.display());
    Ok(())
}

/// What `vnpu infer` is asked to do.
#[derive(Debug)]
pub struct InferArgs {
    pub model: PathBuf,
    pub inputs: Vec<String>,
    pub spec: Option<vnpu_spec::VnpuSpec>,
    pub board: BoardConfig,
    pub guest: Option<PathBuf>,
    pub output: Option<PathBuf>,
    pub top: usize,
    pub show: usize,
    pub in_process: bool,
    /// A board daemon's vfio-user socket to attach the VM's vNPU to
    /// (instead of a vNPU of `spec` in this process).
    pub attach: Option<PathBuf>,
    /// A reference the first output must match (`--expect`), and the
    /// largest error allowed, as a fraction of the reference's largest
    /// magnitude.
    pub expect: Option<(PathBuf, f64)>,
}

/// A model file's bytes: mapped (the page cache's own pages, read only
/// where they are used; with the file, which the VM path maps into guest
/// RAM the same way) or, when the file cannot be mapped (a pipe), read.
enum ModelFile {
    Mapped(memmap2::Mmap, std::fs::File),
    Read(Vec<u8>),
}

impl AsRef<[u8]> for ModelFile {
    fn as_ref(&self) -> &[u8] {
        match self {
            ModelFile::Mapped(m, _) => m,
            ModelFile::Read(v) => v,
        }
    }
}

/// The model file's bytes, the model they hold, and where in the bytes
/// its weight image lies (it is not copied into [`Model::weights`]).
fn read_model(path: &Path) -> Result<(ModelFile, Model, std::ops::Range<usize>), ModelCmdError> {
    let io = |source| ModelCmdError::Io { path: path.display().to_string(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: a private read-only mapping; the bytes are checked by
    // `Model::decode_parts` before use like any read file's. The file
    // must not shrink while `vnpu infer` runs (docs/cli.md): reading a
    // truncated mapping's page is a SIGBUS.
    let bytes = match unsafe { memmap2::Mmap::map(&file) } {
        Ok(m) => ModelFile::Mapped(m, file),
        Err(_) => {
            let mut v = Vec::new();
            std::io::Read::read_to_end(&mut &file, &mut v).map_err(io)?;
            ModelFile::Read(v)
        }
    };
    let b = bytes.as_ref();
    let (m, weights) = Model::decode_parts(b)
        .map_err(|e| ModelCmdError::Model { path: path.display().to_string(), reason: e.to_string() })?;
    // The format puts the weight image last: the file ends exactly there.
    let image = b.len() - weights.len()..b.len();
    Ok((bytes, m, image))
}

/// `vnpu infer`: returns the exit code.
pub fn infer(a: InferArgs) -> Result<u8, ModelCmdError> {
    if let Some((_, t)) = a.expect {
        if t.is_nan() || t < 0.0 {
            return Err(ModelCmdError::Usage(format!("--tolerance {t}: give 0 or more")));
        }
    }
    // Both paths take the weights from the mapped file: the VM path hands
    // the file to the guest as it is, the in-process runner's load
    // program reads the image from a mapping of the file; both DMAs map
    // the pages of large weights into HBM (docs/npu-model.md).
    let (file, m, image) = read_model(&a.model)?;
    let (inputs, runs) = gather_inputs(&m, &a.inputs)?;
    let (outputs, stats, path) = if a.in_process {
        let weights = &file.as_ref()[image.clone()];
        let mut r = match &file {
            ModelFile::Mapped(_, f) => {
                HostRunner::with_weights_file(&a.board, &m, weights, f, image.start as u64)?
            }
            ModelFile::Read(_) => HostRunner::with_weights(&a.board, &m, weights)?,
        };
        // Room for every run's outputs up front (growing them run by run
        // faulted fresh pages in between the timed runs).
        let mut outs: Vec<Vec<f32>> = m
            .outputs
            .iter()
            .map(|t| Vec::with_capacity((t.elems().unwrap_or(0) as usize).saturating_mul(runs as usize)))
            .collect();
        let mut stats = Vec::new();
        for run in 0..runs as usize {
            let parts: Vec<&[f32]> = inputs
                .iter()
                .zip(&m.inputs)
                .map(|(x, t)| {
                    let n = t.elems().unwrap_or(0) as usize;
                    &x.data[run * n..(run + 1) * n]
                })
                .collect();
            let t0 = std::time::Instant::now();
            let (o, rep) = r.infer(&parts)?;
            let wall_ns = t0.elapsed().as_nanos() as u64;
            let tot = rep.totals();
            stats.push(RunStat {
                wall_ns,
                cycles: rep.cycles.ceil() as u64,
                sa_active: tot.sa_active_cycles.round() as u64,
                vu_active: tot.vu_active_cycles.round() as u64,
            });
            for (acc, v) in outs.iter_mut().zip(o) {
                acc.extend(v);
            }
        }
        (outs, stats, "in-process (NPU model, no VM)")
    } else {
        let (o, s) = run_vm(&a, &m, file, &inputs, runs)?;
        (o, s, "VM (runner guest, driver, ring, verifier, model, MSI-X)")
    };
    let opts = ReportOptions {
        clock_mhz: a.board.clock_mhz,
        wall: if a.in_process { "host" } else { "guest" },
        path,
        top: a.top,
        show: a.show,
        output: a.output.as_deref(),
    };
    npu_infer_io::print_report(&m, runs, &outputs, &stats, &opts)?;
    match &a.expect {
        Some((path, tolerance)) => expect(path, *tolerance, outputs.first().map_or(&[][..], |o| &o[..])),
        None => Ok(0),
    }
}

/// Compares `got` (the first output, every run) with the `.npy` at
/// `path`: its largest absolute difference as a fraction of the
/// reference's largest magnitude must be at most `tolerance` (a NaN on
/// either side fails). Exit code 0 when it matches, 1 when not.
fn expect(path: &Path, tolerance: f64, got: &[f32]) -> Result<u8, ModelCmdError> {
    let want = npu_infer_io::npy::read_file(path)?;
    let name = path.display();
    if want.data.len() != got.len() {
        println!("expect        {name}: {} values, the output has {}: MISMATCH", want.data.len(), got.len());
        return Ok(1);
    }
    let scale = want.data.iter().fold(0f64, |m, &w| m.max(f64::from(w).abs())).max(f64::MIN_POSITIVE);
    let worst = got.iter().zip(&want.data).fold(0f64, |m, (&g, &w)| {
        let d = (f64::from(g) - f64::from(w)).abs();
        if d.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(d)
        }
    });
    let error = worst / scale;
    let ok = error <= tolerance;
    println!(
        "expect        {name}: max error {worst:.3e}, {error:.3e} of its largest magnitude (tolerance {tolerance:.1e}): {}",
        if ok { "match" } else { "MISMATCH" }
    );
    Ok(if ok { 0 } else { 1 })
}

fn run_vm(
    a: &InferArgs,
    m: &Model,
    file: ModelFile,
    inputs: &[Array],
    runs: u32,
) -> Result<(Vec<Vec<f32>>, Vec<RunStat>), ModelCmdError> {
    let guest = a.guest.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_GUEST));
    if !guest.exists() {
        return Err(ModelCmdError::NoGuest(guest.display().to_string()));
    }
    let t = m.target;
    let spec = match a.spec {
        Some(s) => s,
        None => vnpu_spec::VnpuSpec::parse(&format!(
            "sa={},vu={},sram={},hbm={}",
            t.sa, t.vu, t.sram_bytes, t.hbm_bytes
        ))
        .map_err(|e| ModelCmdError::Usage(e.to_string()))?,
    };
    // The job: header, the model file as it is, inputs, outputs,
    // statistics; written piece by piece into guest RAM.
    let model_len = file.as_ref().len();
    let in_bytes: usize = inputs.iter().map(|x| x.data.len() * 4).sum();
    let out_bytes: usize =
        m.outputs.iter().map(|t| t.bytes().unwrap_or(0) as usize).sum::<usize>() * runs as usize;
    let stat_bytes = job::STAT_WORDS * 8 * runs as usize;
    let align = |x: usize| x.next_multiple_of(64);
    // The model at a page boundary of the payload (itself page-aligned),
    // so the VM can map the file there instead of copying it.
    let model_at = job::HEADER_BYTES.next_multiple_of(vnpu_vm::PAYLOAD_ALIGN as usize);
    let in_at = align(model_at + model_len);
    let out_at = align(in_at + in_bytes);
    let stat_at = align(out_at + out_bytes);
    let total = stat_at + stat_bytes;
    let h = job::Header {
        runs,
        status: job::PENDING,
        model: (model_at as u64, model_len as u64),
        inputs: (in_at as u64, in_bytes as u64),
        outputs: (out_at as u64, out_bytes as u64),
        stats: (stat_at as u64, stat_bytes as u64),
    };
    // Interleave per run: each input's batch slice in the model's order.
    let mut in_data = Vec::with_capacity(in_bytes);
    for run in 0..runs as usize {
        in_data.extend_from_slice(&batch_input_bytes(m, inputs, run));
    }
    let mut p = vnpu_vm::Payload::zeroed(total as u64);
    p.put(0, h.encode().to_vec())?;
    match file {
        ModelFile::Mapped(bytes, f) => p.put_file(model_at as u64, f, bytes)?,
        read => p.put(model_at as u64, read)?,
    }
    p.put(in_at as u64, in_data)?;
    // Memory: the runtime's 24 MiB, the I/O window and program copies in
    // DMA memory, the payload on top; at least 64 MiB. (The weight image
    // stays in the payload: the runner reads it there, `apps::infer::load`.)
    let need = (32u64 << 20) + 2 * (m.window_bytes + model_len as u64) + total as u64;
    let memory = need.next_multiple_of(16 << 20).max(64 << 20);
    if memory > vnpu_vm::PCI_MMIO_BASE {
        return Err(ModelCmdError::Usage(format!(
            "the job needs {} MiB of guest memory; a guest has at most {} MiB of RAM, below the PCI hole \
             (run fewer batches)",
            memory >> 20,
            vnpu_vm::PCI_MMIO_BASE >> 20
        )));
    }
    let mut cfg = vnpu_vm::VmConfig::new(memory, guest);
    match &a.attach {
        // The daemon's instance is the vNPU (its shape is the daemon's).
        Some(socket) => cfg.remote_vnpus = vec![socket.clone()],
        None => cfg = cfg.vnpus(&[spec]),
    }
    cfg.board = a.board.clone();
    cfg.payload = Some(p);
    let mut vm = vnpu_vm::Vm::new(&cfg, std::io::stdout())?;
    let code = vm.run()?;
    // Only what the guest writes comes back: the header, outputs, stats.
    let back =
        |at: usize, len: usize| vm.read_payload_at(at as u64, len as u64).map(Option::unwrap_or_default);
    let head = back(0, job::HEADER_BYTES)?;
    let status =
        head.get(job::STATUS_AT..job::STATUS_AT + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    if code != 0 || status != Some(job::DONE) {
        let msg = head
            .get(job::MESSAGE_AT..job::HEADER_BYTES)
            .map(|b| String::from_utf8_lossy(b).trim_end_matches('\0').to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "no message (see the guest's console output above)".into());
        return Err(ModelCmdError::Guest { code, message: msg });
    }
    let (out, st) = (back(out_at, out_bytes)?, back(stat_at, stat_bytes)?);
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); m.outputs.len()];
    let per_run = out_bytes / runs.max(1) as usize;
    for run in 0..runs as usize {
        append_outputs(m, out.get(run * per_run..(run + 1) * per_run).unwrap_or_default(), &mut outs);
    }
    let stats = st
        .chunks_exact(job::STAT_WORDS * 8)
        .map(|c| {
            let w = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            RunStat { wall_ns: w(0), cycles: w(1), sa_active: w(2), vu_active: w(3) }
        })
        .collect();
    Ok((outs, stats))
}
