//! `vnpu`: the command-line front end. See `docs/cli.md`.

mod demo;
mod manage;
mod model;
mod profile;
mod run;
mod scenario;
mod snapshot;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use npu_model::BoardConfig;
use npu_workloads::{run_workload, RunOptions, RunReport, WORKLOADS};
use vnpu_manager::{Instance, Outcome, Request};

#[derive(Parser, Debug)]
#[command(
    name = "vnpu",
    version,
    about = "Virtual NPUs: KVM guests with vNPU PCI devices backed by a software NPU model, and its workloads"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The default Linux command line: console on COM1, reboot through the
/// i8042 (which ends the VM), no ACPI tables to look for.
#[derive(Subcommand, Debug)]
enum Command {
    /// Boot a VM on /dev/kvm with a bare-metal 64-bit ELF guest or a Linux kernel.
    ///
    /// The guest's serial console (COM1) goes to stdout; vnpu exits with the
    /// code the guest writes to the exit port (docs/guest-boot.md), or 0 when
    /// a Linux guest reboots (docs/linux-guests.md). Each --vnpu becomes a
    /// vNPU PCI function (docs/device-interface.md).
    #[command(group(clap::ArgGroup::new("image").required(true).args(["guest", "kernel"])))]
    Run(run::RunArgs),
    /// Take a snapshot of a running VM (`vnpu run --api-socket`) into a
    /// new or empty folder: its vCPU, interrupt controllers and clock,
    /// guest RAM (a sparse file), its devices, and each vNPU's registers,
    /// programs, SRAM and HBM (docs/migration.md). The VM pauses for it
    /// (each vNPU finishes the request it is running first), then runs
    /// on, or ends with --stop.
    Snapshot {
        /// The VM's API socket (`vnpu run --api-socket PATH`).
        #[arg(long)]
        api_socket: PathBuf,
        /// The folder to write (created if missing; must be empty).
        dir: PathBuf,
        /// End the VM once the snapshot is written (exit code 0).
        #[arg(long)]
        stop: bool,
    },
    /// Run a VM on from a snapshot `vnpu snapshot` took, in this process:
    /// its console goes to stdout and vnpu exits with its guest's exit
    /// code, as `vnpu run`. The snapshot is read, never written; one of
    /// another format version, or a corrupt one, is refused.
    Restore {
        /// The snapshot's folder.
        dir: PathBuf,
        /// Serve an API socket for further snapshots, as `vnpu run`.
        #[arg(long)]
        api_socket: Option<PathBuf>,
    },
    /// Move a running VM (`vnpu run --api-socket`) live to the VMM
    /// `vnpu receive` runs, on this host or another board daemon's: the
    /// destination admits the VM's shape first, guest RAM is pre-copied
    /// while the guest runs, then the VM stops for the last dirty pages,
    /// each vNPU's state and the vCPU's (docs/migration.md). On success
    /// the VM runs on there and ends here; on any failure it runs on here.
    Migrate {
        /// The VM's API socket (`vnpu run --api-socket PATH`).
        #[arg(long)]
        api_socket: PathBuf,
        /// The socket `vnpu receive --listen` waits on.
        #[arg(long)]
        to: PathBuf,
        /// Before the VM runs there, check that all of guest RAM there
        /// equals the source's at the stop (a CRC-32 on both sides, in the
        /// downtime: about 10 ms per GiB here); a difference refuses the
        /// migration and the VM runs on here.
        #[arg(long)]
        verify: bool,
        /// Pre-copy rounds after the first pass, at most (0 to 1000):
        /// after them the VM stops and what is still dirty goes while it
        /// is stopped, converged or not.
        #[arg(long, default_value_t = vnpu_vm::migrate::MAX_ROUNDS)]
        max_rounds: u32,
        /// Pre-copy ends once a round leaves at most this many dirty
        /// guest pages (4 KiB each) and its pass over the vNPUs' HBM sent
        /// at most 16 MiB.
        #[arg(long, default_value_t = vnpu_vm::migrate::CONVERGED_PAGES)]
        converged_pages: u64,
        /// Print the figures as one JSON object instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// Wait for one VM that `vnpu migrate` sends, then run it on in this
    /// process, as `vnpu run` (console to stdout, the guest's exit code).
    /// Each daemon-served vNPU of the source is admitted on this host's
    /// board daemon first: an instance of the same UUID and shape that is
    /// started and free is taken, else one is created (placed by the
    /// manager); a board with no room refuses the VM before it stops.
    Receive {
        /// The unix socket to wait on (created; the owner's only).
        #[arg(long)]
        listen: PathBuf,
        /// State directory of this host's vNPU manager (default:
        /// $VNPU_STATE_DIR, else ~/.local/state/vnpu).
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Serve an API socket for snapshots and further migrations, as `vnpu run`.
        #[arg(long)]
        api_socket: Option<PathBuf>,
    },
    /// The demo: boot the digits guest with a vNPU and classify
    /// scikit-learn's held-out handwritten digits on it.
    ///
    /// Prints `accuracy vnpu=<x> cpu=<y>` for an MLP and a CNN (the guest
    /// also classifies every image on its CPU with the same weights), the
    /// latency per image seen in the guest, the vNPU's counters, and the
    /// throughput of the whole VM path against the same programs run
    /// in-process on the NPU model. Needs /dev/kvm and the guests built
    /// (`bash scripts/build-guests.sh`).
    Demo {
        /// The digits guest ELF (default: the one build-guests.sh builds).
        #[arg(long)]
        guest: Option<PathBuf>,
        /// The vNPU to give the VM (needs at least 3 MiB of SRAM).
        #[arg(long = "vnpu", default_value = "type=small", value_parser = parse_vnpu)]
        vnpu: vnpu_spec::VnpuSpec,
        /// Board config file (TOML); default: the built-in board.
        #[arg(long)]
        board: Option<PathBuf>,
    },
    /// Compile an ONNX model for a vNPU shape (docs/compiled-model-format.md).
    ///
    /// Reads MODEL.onnx, fixes its shapes (free leading dimensions = --batch,
    /// others from --shape), folds constants, fuses biases and activations
    /// into matrix products, lowers the rest with the workload library's
    /// tiled lowering for one core of the --vnpu shape, checks both programs
    /// with the hypervisor's verifier and writes one file: programs,
    /// weights, input and output names and shapes. An unsupported operator
    /// or attribute is refused with the node's name, op type and reason; a
    /// model that does not fit the vNPU's SRAM/HBM with what does not fit.
    Compile {
        /// The ONNX model.
        model: PathBuf,
        /// The vNPU to compile for (one core of it): `sa=N,vu=M,sram=SIZE,hbm=SIZE` or `type=...`.
        #[arg(long = "vnpu", default_value = "sa=1,vu=1,sram=8M,hbm=512M", value_parser = parse_vnpu)]
        vnpu: vnpu_spec::VnpuSpec,
        /// Samples per request: the value of every free leading dimension.
        #[arg(long, default_value_t = 1)]
        batch: u32,
        /// Element type of the SA operands: `f32`, or `bf16` (weights of
        /// matrix products and convolutions stored as bf16, half the bytes;
        /// activations rounded to bf16 by a VU before each product; f32
        /// accumulation; error bound in docs/compiled-model-format.md).
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// How intermediate activations are stored (with `--dtype bf16`):
        /// `f32` (the default: the error bound of docs/compiled-model-format.md), or
        /// `bf16` (half the DMA bytes where every operation touching a
        /// tensor takes bf16; the model's inputs and outputs stay f32).
        #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
        activations: String,
        /// A static shape for an input, `NAME=D0,D1,...` (repeatable).
        #[arg(long = "shape", value_parser = model::parse_shape)]
        shapes: Vec<(String, Vec<usize>)>,
        /// Compile only these outputs (repeatable; default: all of the
        /// model's). scikit-learn classifiers: `--output probabilities`.
        #[arg(long = "output")]
        outputs: Vec<String>,
        /// Board config file (TOML): the SA size the lowering tiles for.
        #[arg(long)]
        board: Option<PathBuf>,
        /// Compile spread programs for `SA,VU` engines beyond the vNPU's
        /// (docs/isa.md, "Spread programs"): they run on the vNPU's own
        /// engines, and on up to that many more that its neighbours leave
        /// idle when its borrowing cap allows (docs/management.md,
        /// "Harvesting").
        #[arg(long)]
        spread: Option<vnpu_spec::Borrow>,
        /// Intermediate tensors share HBM by liveness: a tensor's space is
        /// free for another once the last operation that touches it has
        /// run (the model's inputs and outputs keep their own). The same
        /// instructions on other HBM addresses (the same simulated cycles
        /// with one DMA transfer in flight, the built-in board's): the
        /// model needs less HBM, and the functional model's DMA touches
        /// less host memory. `--reuse-hbm=false`: every tensor has HBM of
        /// its own for the whole request.
        #[arg(long, num_args = 0..=1, default_value_t = true, default_missing_value = "true", value_name = "BOOL", action = clap::ArgAction::Set)]
        reuse_hbm: bool,
        /// Fuse each residual add into the convolution that computes one
        /// of its operands: the convolution adds the other operand in its
        /// VU pass, so its own output never goes to HBM and the add's
        /// three tensor passes become one load (the same bits with f32
        /// activations; fewer operations, DMA bytes and cycles). Not where
        /// that operand is also a model output. `--fuse-residual=false`:
        /// every add is an operation of its own.
        #[arg(long, num_args = 0..=1, default_value_t = true, default_missing_value = "true", value_name = "BOOL", action = clap::ArgAction::Set)]
        fuse_residual: bool,
        /// Lower each inverted-residual block (a 1x1 expansion, a
        /// depthwise convolution, a 1x1 projection and the residual add of
        /// the block's input, as in MobileNetV2) as one pipeline: each tile
        /// of output rows is loaded once with the rows its window needs,
        /// and the expanded and filtered activations stay in SRAM (layer
        /// fusion, as NPU compilers do). The same bits; fewer DMA bytes and
        /// cycles, and less HBM. f32 models only (not with --dtype bf16).
        /// `--fuse-blocks=false`: operation by operation.
        #[arg(long, num_args = 0..=1, default_value_t = true, default_missing_value = "true", value_name = "BOOL", action = clap::ArgAction::Set)]
        fuse_blocks: bool,
        /// The compiled model to write.
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
    },
    /// Run a compiled model in a VM: the runner guest runs it on its vNPU
    /// through the driver (docs/inference-guests.md).
    ///
    /// The inputs (NumPy .npy, f32/f64/int) must have the model's shape, or
    /// a leading dimension that is a multiple of the compiled batch (one
    /// request per batch); an integer input (token ids) takes an integer
    /// file whose values fit in 32 bits. Prints the latency per batch (guest wall time and
    /// simulated NPU time, min/median/max), the SA/VU counters, and the
    /// top-k of each output row (an output of one value per sample, a
    /// label or a regression, prints its first values); --output writes
    /// the outputs as .npy.
    Infer {
        /// The compiled model (`vnpu compile`).
        model: PathBuf,
        /// An input .npy, `FILE` or `NAME=FILE`, in the model's input order (repeatable).
        #[arg(long = "input", required = true)]
        inputs: Vec<String>,
        /// The vNPU to give the VM (default: exactly the shape compiled for).
        #[arg(long = "vnpu", value_parser = parse_vnpu)]
        vnpu: Option<vnpu_spec::VnpuSpec>,
        /// Write the output to this .npy (several outputs: FILE.<i>.<name>.npy).
        #[arg(long)]
        output: Option<PathBuf>,
        /// Print the k largest entries of each output row (0: none).
        #[arg(long, default_value_t = 5)]
        top: usize,
        /// Rows to print the top-k of.
        #[arg(long, default_value_t = 5)]
        show: usize,
        /// Run on the NPU model in this process instead of in a VM.
        #[arg(long, conflicts_with = "attach")]
        in_process: bool,
        /// Attach the VM's vNPU to a board daemon's vfio-user socket
        /// (`S/UUID.sock` of a started instance, docs/vfio-user.md)
        /// instead of a vNPU in this process; the instance's shape and
        /// borrowing cap apply.
        #[arg(long, value_name = "SOCKET", conflicts_with = "vnpu")]
        attach: Option<PathBuf>,
        /// A reference .npy the first output must match (every run, in
        /// order): exit 1 when its largest error exceeds --tolerance of the
        /// reference's largest magnitude.
        #[arg(long, value_name = "NPY")]
        expect: Option<PathBuf>,
        /// With --expect: the largest error allowed, as a fraction of the
        /// reference's largest magnitude.
        #[arg(long, default_value_t = 1e-4, requires = "expect")]
        tolerance: f64,
        /// The runner guest ELF (default: the one build-guests.sh builds).
        #[arg(long)]
        guest: Option<PathBuf>,
        /// Board config file (TOML); default: the built-in board.
        #[arg(long)]
        board: Option<PathBuf>,
    },
    /// Check a program file offline with the hypervisor's static verifier.
    ///
    /// Decodes FILE (the program container of docs/isa.md, as written by
    /// `vnpu workload lower`) and checks every instruction against one core
    /// of the vNPU SPEC and a guest of --memory bytes, exactly as the vNPU
    /// does before running a request. Prints `accepted` and exits 0, or
    /// prints the stream, instruction index and reason and exits 1.
    Verify {
        /// The program file.
        file: PathBuf,
        /// The vNPU to check against (`type=...` or `sa=N,vu=M,sram=SIZE,hbm=SIZE`).
        #[arg(long = "vnpu", value_parser = parse_vnpu)]
        vnpu: vnpu_spec::VnpuSpec,
        /// Guest RAM the program may DMA to and from (from address 0).
        #[arg(long, default_value = "256M", value_parser = vnpu_spec::parse_size)]
        memory: u64,
        /// Borrowing cap `SA,VU` a spread program is checked against (its
        /// streams may number the vNPU's engines plus this); default: the
        /// vNPU's own counts again (docs/management.md, "Harvesting").
        #[arg(long)]
        borrow: Option<vnpu_spec::Borrow>,
    },
    /// Profile a workload on 1 SA + 1 VU and size a vNPU for it.
    ///
    /// Reports x (SA-active time), y (VU-active time), a = x/y and the
    /// SA:VU ratio k = sqrt(a) that maximizes utilization; for each EU
    /// count of one core the shape closest to k with its predicted (Eq. 1)
    /// and measured speedup; and the smallest shape whose simulated time
    /// meets --slo-ms (1 SA + 1 VU without an SLO). Exit 1 when no shape
    /// meets the SLO.
    Profile {
        /// Workload name (see `vnpu workload list`).
        name: String,
        /// Batch size.
        #[arg(long, default_value_t = 1)]
        batch: u32,
        /// Latency target in milliseconds of simulated time.
        #[arg(long)]
        slo_ms: Option<f64>,
        /// One JSON object instead of a table (keys x, y, a, k, sa, vu, ...).
        #[arg(long)]
        json: bool,
        /// Board config file (TOML); default: the built-in board.
        #[arg(long)]
        board: Option<PathBuf>,
    },
    /// Run the board daemon in the foreground (docs/vfio-user.md).
    ///
    /// Owns one modelled board (every core's simulation and scheduler)
    /// and serves each started vNPU instance of the state directory as a
    /// vfio-user PCI device at SOCKET_DIR/UUID.sock, for a VMM in another
    /// process (QEMU >= 10.1 `-device vfio-user-pci`, Cloud Hypervisor
    /// `--user-device`). Follows `vnpu start/stop/remap` as they write the
    /// state directory. Logs to stderr (RUST_LOG=debug for more). Stops
    /// cleanly on SIGTERM or SIGINT, removing its sockets.
    Daemon {
        #[command(flatten)]
        manage: manage::ManageArgs,
        /// After serving requests, each vNPU polls its ring this long
        /// before sleeping (microseconds; 0 = wake by doorbell only).
        #[arg(long, default_value_t = vnpu_device::DEFAULT_POLL_US)]
        poll_us: u64,
        /// Serve Prometheus metrics at http://ADDR/metrics (e.g.
        /// 127.0.0.1:9400; port 0 picks a free one, logged at start).
        /// Per vNPU instance and per physical core: docs/metrics.md.
        #[arg(long, value_name = "ADDR")]
        metrics: Option<std::net::SocketAddr>,
        /// Close a control connection that sends no request for this many
        /// milliseconds, so idle clients cannot hold every connection slot.
        #[arg(long, value_name = "MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
        control_idle_ms: u64,
        /// Members of this group may manage the board on the control
        /// socket too (root and the daemon's own user always may; every
        /// other client is refused, whatever the socket file's mode).
        #[arg(long, value_name = "GROUP")]
        control_group: Option<String>,
        /// What a system call outside the daemon's list does once it has
        /// started (docs/isolation.md): fail with EPERM, kill the daemon,
        /// or no filter at all.
        #[arg(long, value_enum, default_value_t = vnpu_daemon::seccomp::Mode::Errno)]
        seccomp: vnpu_daemon::seccomp::Mode,
        /// When `vnpu stop` stops an instance a VMM is attached to, the
        /// daemon raises the device's request interrupt (QEMU then unplugs
        /// it from its guest) and cuts the VMM off if it has not let go
        /// after this many milliseconds (0: at once, no request).
        #[arg(long, value_name = "MS", default_value_t = 10_000)]
        release_timeout_ms: u64,
        /// Keep the instances' device sessions (their SRAM, HBM, programs
        /// and registers, for resuming after a daemon restart) here
        /// instead of STATE_DIR/sessions: a tmpfs such as /run/vnpu keeps
        /// tenant memory off persistent disk.
        #[arg(long, value_name = "DIR")]
        session_dir: Option<std::path::PathBuf>,
        /// Lend engines a core's vNPUs leave idle to their neighbours'
        /// spread programs (docs/management.md, "Harvesting"); `off` runs
        /// every request on its own vNPU's engines (static partitions).
        #[arg(long, value_name = "on|off", default_value = "on", value_parser = ["on", "off"])]
        harvest: String,
        /// With harvesting, the longest compute instruction (simulated
        /// microseconds) a vNPU's request may start on an engine lent to
        /// it: an owner then takes its engines back within this bound
        /// (docs/management.md, "Harvesting"). Default: no bound (a reclaim
        /// waits for the borrower's instruction to end, whatever its length).
        #[arg(long, value_name = "US", value_parser = lend_limit)]
        lend_limit_us: Option<f64>,
        /// Most host work one request may spend on a core of the daemon
        /// (units of `npu_model::timing::host_work`, about a nanosecond
        /// each at most): it bounds how long one tenant's request holds up
        /// its neighbours, and a request past it fails with
        /// BUDGET_EXHAUSTED (docs/isolation.md). Large batches of large
        /// models need more (ResNet-18 at batch 8: about 2^30).
        #[arg(long, value_name = "UNITS", default_value_t = vnpu_device::SHARED_MAX_HOST_WORK,
              value_parser = clap::value_parser!(u64).range(1..))]
        max_host_work: u64,
    },
    /// Run several VMs at once on one modelled board (docs/management.md).
    ///
    /// FILE (TOML) lists the VMs: `[[vm]]` with `name`, `guest`, `memory`
    /// and `vnpu = ["SPEC", ...]`, and optionally `board`. Their vNPUs are
    /// placed on physical cores; vNPUs on one core share it. Prints each
    /// VM's output and exit code and, per physical core, the simulated time
    /// its tenants ran side by side. Exit 0 when every VM exits 0.
    Scenario {
        /// The scenario file.
        file: PathBuf,
    },
    /// The named vNPU types of the board and how many more of each fit.
    Types {
        #[command(flatten)]
        manage: manage::ManageArgs,
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Create a transient vNPU instance and start it at once (gone when stopped).
    Create {
        #[command(flatten)]
        shape: manage::ShapeArgs,
        /// Use this UUID instead of a random one.
        #[arg(long)]
        uuid: Option<String>,
        /// The workload the vNPU will run, NAME or NAME:BATCH (`vnpu
        /// workload list`): what interference-aware placement prices.
        #[arg(long)]
        workload: Option<vnpu_manager::Workload>,
        #[command(flatten)]
        qos: manage::QosArgs,
        #[command(flatten)]
        placement: manage::PlacementArgs,
        #[command(flatten)]
        manage: manage::ManageArgs,
    },
    /// Define a persistent vNPU instance (not started).
    Define {
        #[command(flatten)]
        shape: manage::ShapeArgs,
        /// Use this UUID instead of a random one.
        #[arg(long)]
        uuid: Option<String>,
        /// The workload the vNPU will run, NAME or NAME:BATCH: what
        /// interference-aware placement prices when it is started.
        #[arg(long)]
        workload: Option<vnpu_manager::Workload>,
        #[command(flatten)]
        qos: manage::QosArgs,
        #[command(flatten)]
        manage: manage::ManageArgs,
    },
    /// Start a defined vNPU instance: place it on physical cores.
    Start {
        uuid: String,
        #[command(flatten)]
        placement: manage::PlacementArgs,
        #[command(flatten)]
        manage: manage::ManageArgs,
    },
    /// Reshape a vNPU instance for a new workload, on the physical cores it
    /// already has (its HBM data stays where it is).
    ///
    /// Either give the new SA and VU counts per core, or `--workload NAME`:
    /// the workload is profiled on 1 SA + 1 VU (as `vnpu profile` does) and
    /// the instance's EUs per core are split by the ratio k = sqrt(x/y)
    /// that maximizes utilization. Refused, with nothing changed, when the
    /// new shape does not fit beside the core's other vNPUs
    /// (docs/management.md).
    Remap {
        uuid: String,
        /// New SAs per core.
        #[arg(long, conflicts_with = "workload")]
        sa: Option<u32>,
        /// New VUs per core.
        #[arg(long, conflicts_with = "workload")]
        vu: Option<u32>,
        /// New SRAM per core (e.g. 8M).
        #[arg(long, value_parser = vnpu_spec::parse_size)]
        sram: Option<u64>,
        /// Split the instance's EUs for this workload (see `vnpu workload list`).
        #[arg(long)]
        workload: Option<String>,
        /// Batch size of --workload.
        #[arg(long, default_value_t = 1, requires = "workload")]
        batch: u32,
        /// Allow up to this many times a core's SAs and VUs (time-shared).
        #[arg(long)]
        oversubscribe: Option<u32>,
        #[command(flatten)]
        manage: manage::ManageArgs,
    },
    /// Stop a vNPU instance: free its cores (a transient one is removed).
    Stop {
        uuid: String,
        #[command(flatten)]
        manage: manage::ManageArgs,
    },
    /// Remove a vNPU instance, started or not.
    Remove {
        uuid: String,
        #[command(flatten)]
        manage: manage::ManageArgs,
    },
    /// List the vNPU instances, defined and active.
    List {
        #[command(flatten)]
        manage: manage::ManageArgs,
        /// A JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// What each physical core of the running board daemon has done since
    /// it started: requests, waits, preemptions, the simulated time its
    /// tenants ran side by side, each tenant's busy time, latency-target
    /// misses (docs/management.md). Needs `vnpu daemon`.
    Cores {
        #[command(flatten)]
        manage: manage::ManageArgs,
        /// One JSON object (cycles, the board's clock) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// DNN workloads lowered to vNPU programs and run on the NPU model.
    Workload {
        #[command(subcommand)]
        command: WorkloadCommand,
    },
    /// The physical board model.
    Board {
        #[command(subcommand)]
        command: BoardCommand,
    },
}

/// The vNPU core a workload is lowered for, and the board it lives on.
#[derive(clap::Args, Debug)]
struct VnpuArgs {
    /// Workload name (see `vnpu workload list`).
    name: String,
    /// Systolic arrays of the vNPU core.
    #[arg(long, default_value_t = 1)]
    sa: u32,
    /// Vector units of the vNPU core.
    #[arg(long, default_value_t = 1)]
    vu: u32,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    /// SRAM of the vNPU core (e.g. 16M); default: the board's SRAM per core.
    #[arg(long, value_parser = vnpu_spec::parse_size)]
    sram: Option<u64>,
    /// HBM of the vNPU core (e.g. 4G); default: the board's HBM per core.
    #[arg(long, value_parser = vnpu_spec::parse_size)]
    hbm: Option<u64>,
    /// Board config file (TOML, docs/board-config.md); default: the built-in board (tpu-v4-derived).
    #[arg(long)]
    board: Option<PathBuf>,
    /// The SAs' operand type: bf16 stores the weights of products as bf16
    /// and rounds their operands to bf16 (f32 accumulation). Default: the
    /// board's `lowering.dtype` (bf16 on the built-in board).
    #[arg(long, value_parser = ["f32", "bf16"])]
    dtype: Option<String>,
    /// How intermediate activations are stored in HBM (default: the
    /// board's `lowering.activations`, else as --dtype). bf16 (with
    /// --dtype bf16 only) halves their DMA bytes wherever every operation
    /// touching them takes bf16 (products, element-wise, pooling,
    /// softmax); VUs compute in f32 and round what they store.
    #[arg(long, value_parser = ["f32", "bf16"])]
    activations: Option<String>,
    /// Fuse each residual add into the convolution that produces one of
    /// its operands (the convolution adds the other operand in its VU
    /// pass; its own output never goes to HBM), as XLA does on TPUs.
    /// Default: the board's `lowering.fuse_residual` (on on the built-in
    /// board); `--fuse-residual=false` turns it off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    fuse_residual: Option<bool>,
    /// Intermediate tensors share HBM by liveness: a tensor's space is
    /// free once the last operation that touches it has run. Default: the
    /// board's `lowering.reuse_hbm` (on on the built-in board);
    /// `--reuse-hbm=false` turns it off (every tensor has HBM of its own
    /// for the whole request).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    reuse_hbm: Option<bool>,
    /// Stream a product's weights within the operation: when they cannot
    /// load while the previous operation runs, the first tile on each SA
    /// starts on the first columns while the rest load, as XLA's pipelined
    /// TPU kernels do (convolutions are not split). Default: the board's
    /// `lowering.stream_weights` (on on the built-in board);
    /// `--stream-weights=false` turns it off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    stream_weights: Option<bool>,
    /// Keep intermediate activations on chip between operations when they
    /// fit: a quarter of the SRAM holds them (placed by liveness), and a
    /// tile reads an input kept there in place instead of copying it.
    /// Default: the board's `lowering.keep_on_chip` (on on the built-in
    /// board); `--keep-on-chip=false` turns it off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    keep_on_chip: Option<bool>,
}

impl VnpuArgs {
    /// The board and the run options these arguments describe.
    fn resolve(self, functional: bool, seed: u64) -> Result<(BoardConfig, RunOptions), CliError> {
        if self.sa == 0 || self.vu == 0 {
            return Err(CliError::Shape);
        }
        if self.batch == 0 {
            return Err(CliError::Batch);
        }
        let b = board(&self.board)?;
        let d = RunOptions::on_board(&b, self.name, self.batch);
        let dtype = match self.dtype.as_deref() {
            Some(name) => vnpu_abi::DType::from_name(name).unwrap_or(vnpu_abi::DType::F32),
            None => d.dtype,
        };
        let bf16_activations = match (self.activations.as_deref(), self.dtype.is_some()) {
            (Some(a), _) => a == "bf16",
            // --dtype given: activations as --dtype.
            (None, true) => dtype == vnpu_abi::DType::Bf16,
            (None, false) => d.bf16_activations,
        };
        if bf16_activations && dtype != vnpu_abi::DType::Bf16 {
            return Err(CliError::Activations);
        }
        let o = RunOptions {
            sa: self.sa,
            vu: self.vu,
            sram_bytes: self.sram,
            hbm_bytes: self.hbm,
            functional,
            seed,
            dtype,
            bf16_activations,
            reuse_hbm: self.reuse_hbm.unwrap_or(d.reuse_hbm),
            fuse_residual: self.fuse_residual.unwrap_or(d.fuse_residual),
            stream_weights: self.stream_weights.unwrap_or(d.stream_weights),
            keep_on_chip: self.keep_on_chip.unwrap_or(d.keep_on_chip),
            ..d
        };
        Ok((b, o))
    }
}

#[derive(Subcommand, Debug)]
enum WorkloadCommand {
    /// List the workloads.
    List,
    /// Run a workload on one vNPU core and report simulated time, engine
    /// activity and utilization.
    ///
    /// Timing only by default (fast, for sweeps); --functional also computes
    /// real results on seeded random weights and inputs. Cycles are
    /// simulated NPU cycles; "wall" figures are host time.
    Run {
        #[command(flatten)]
        vnpu: VnpuArgs,
        /// Also compute real results on random data.
        #[arg(long)]
        functional: bool,
        /// Seed for the random data of --functional.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Put the timing model beside every published TPU figure it is
    /// validated against (docs/npu-model.md, "Validation against
    /// hardware"): each anchor on one whole core of its preset board and
    /// of the board derived from it, lowered as the board says.
    ///
    /// Prints model / published per anchor (above 1: the model counts more
    /// images per second, or more seconds, than the hardware), the SA and
    /// DMA rooflines, and the engines' busy fractions. Simulated time.
    Anchors {
        /// Print one JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Lower a workload for one vNPU core and write the program container
    /// (docs/isa.md) to a file, after verifying it.
    Lower {
        #[command(flatten)]
        vnpu: VnpuArgs,
        /// Where to write the program.
        #[arg(short, long)]
        output: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum BoardCommand {
    /// Print the built-in default board as TOML (a starting point for --board files).
    Default,
    /// Check a board config file and print it back with every field.
    Check { file: PathBuf },
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    #[error(transparent)]
    Config(#[from] npu_model::config::ConfigError),
    #[error(transparent)]
    Run(#[from] npu_workloads::RunError),
    #[error(transparent)]
    Anchor(#[from] npu_workloads::anchors::AnchorError),
    #[error("--sa and --vu must be at least 1")]
    Shape,
    #[error("--batch must be at least 1")]
    Batch,
    #[error("--activations bf16 needs --dtype bf16 (the SAs read bf16 activations as their operands)")]
    Activations,
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Vm(#[from] vnpu_vm::VmError),
    #[error(transparent)]
    Demo(#[from] demo::DemoError),
    #[error(transparent)]
    Model(#[from] model::ModelCmdError),
    #[error(transparent)]
    Manage(#[from] vnpu_manager::StoreError),
    #[error(transparent)]
    Control(#[from] vnpu_manager::ControlError),
    #[error(transparent)]
    Interference(#[from] vnpu_manager::InterferenceError),
    #[error(transparent)]
    Scenario(#[from] scenario::ScenarioError),
    #[error(transparent)]
    Daemon(#[from] vnpu_daemon::DaemonError),
    #[error(transparent)]
    Seccomp(#[from] vnpu_daemon::seccomp::SeccompError),
    #[error("{0}")]
    Usage(String),
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: String, source: std::io::Error },
}

/// A `--vnpu` of `vnpu run`: a shape, or a managed instance.
#[derive(Clone, Debug)]
pub(crate) enum VnpuArg {
    Spec(vnpu_spec::VnpuSpec),
    Uuid(String),
    /// A vNPU served by a board daemon at this vfio-user socket.
    Socket(PathBuf),
}

fn parse_vnpu_arg(s: &str) -> Result<VnpuArg, String> {
    if let Some(p) = s.trim().strip_prefix("socket=") {
        return Ok(VnpuArg::Socket(PathBuf::from(p.trim())));
    }
    match s.trim().strip_prefix("uuid=") {
        Some(u) => Ok(VnpuArg::Uuid(u.trim().to_string())),
        None => parse_vnpu(s).map(VnpuArg::Spec),
    }
}

/// `--lend-limit-us`: a finite, non-negative number of microseconds.
fn lend_limit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(us) if us.is_finite() && us >= 0.0 => Ok(us),
        _ => Err(format!("`{s}` is not a number of microseconds >= 0")),
    }
}

fn parse_vnpu(s: &str) -> Result<vnpu_spec::VnpuSpec, String> {
    vnpu_spec::VnpuSpec::parse(s).map_err(|e| e.to_string())
}

pub(crate) fn board(path: &Option<PathBuf>) -> Result<BoardConfig, CliError> {
    Ok(match path {
        Some(p) => BoardConfig::load(p)?,
        None => BoardConfig::default(),
    })
}

/// `vnpu workload anchors`: every anchor on its preset and derived board.
fn anchors(json: bool) -> Result<(), CliError> {
    use npu_workloads::anchors::{board, run_anchor, Measure, ANCHORS};
    let mut runs = Vec::new();
    if !json {
        println!(
            "{:<24} {:<16} {:>12} {:>12} {:>7} {:>10} {:>10} {:>6} {:>6} {:>6}",
            "anchor", "board", "published", "model", "ratio", "SA-bound", "DMA-bound", "SA", "VU", "DMA"
        );
    }
    for a in ANCHORS {
        let derived = npu_model::presets::derived_of(a.preset);
        for name in std::iter::once(a.preset).chain(derived) {
            let r = run_anchor(a, &board(name)?)?;
            if !json {
                let unit = |v: f64| match a.measure {
                    Measure::ItemsPerSecond => format!("{v:.1}/s"),
                    Measure::Seconds => format!("{:.3} ms", v * 1e3),
                };
                let dma = r.run.dma_active_cycles as f64 / r.run.simulated_cycles.max(1) as f64;
                println!(
                    "{:<24} {:<16} {:>12} {:>12} {:>7.3} {:>8.3}ms {:>8.3}ms {:>5.0}% {:>5.0}% {:>5.0}%",
                    a.id,
                    name,
                    unit(a.published),
                    unit(r.model),
                    r.ratio,
                    r.sa_bound_seconds * 1e3,
                    r.dma_bound_seconds * 1e3,
                    r.run.sa_utilization * 100.0,
                    r.run.vu_utilization * 100.0,
                    dma * 100.0
                );
            }
            runs.push(r);
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
    }
    Ok(())
}

fn print_report(r: &RunReport) {
    println!(
        "workload      {} (batch {}) on {} SA + {} VU, {} MiB SRAM",
        r.workload,
        r.batch,
        r.sa,
        r.vu,
        r.sram_bytes >> 20
    );
    println!("program       {} instructions", r.instructions);
    println!(
        "simulated     {} cycles = {:.3} ms at {} MHz",
        r.simulated_cycles,
        r.simulated_seconds * 1e3,
        r.clock_mhz
    );
    println!("SA active     {} cycles  utilization {:.1}%", r.sa_active_cycles, 100.0 * r.sa_utilization);
    println!("VU active     {} cycles  utilization {:.1}%", r.vu_active_cycles, 100.0 * r.vu_utilization);
    println!("DMA active    {} cycles  ({} bytes moved)", r.dma_active_cycles, r.dma_bytes);
    println!("FLOPS util.   {:.1}% of SA peak", 100.0 * r.flops_utilization);
    println!(
        "SA/VU ratio   {:.2} (SA-active / VU-active)",
        r.sa_active_cycles as f64 / (r.vu_active_cycles.max(1)) as f64
    );
    println!("engine        instrs      active       stall        FLOPs        bytes");
    for e in &r.engines {
        println!(
            "{:<8} {:>11} {:>11} {:>11} {:>12} {:>12}",
            e.engine, e.instructions, e.active_cycles, e.stall_cycles, e.flops, e.bytes
        );
    }
    if let (Some(sum), Some(finite)) = (r.output_checksum, r.output_finite) {
        println!("output        checksum {sum:.6e}, all finite: {finite}");
    }
    println!(
        "wall          lower {:.3} s, run {:.3} s (host time)",
        r.wall_lower_seconds, r.wall_run_seconds
    );
}

fn run(cli: Cli) -> Result<u8, CliError> {
    match cli.command {
        Command::Run(args) => return run::run_vm(args),
        Command::Snapshot { api_socket, dir, stop } => snapshot::snapshot(&api_socket, &dir, stop)?,
        Command::Restore { dir, api_socket } => return snapshot::restore(&dir, api_socket.as_deref()),
        Command::Migrate { api_socket, to, verify, max_rounds, converged_pages, json } => {
            let opts =
                vnpu_vm::MigrateOptions::new(verify, max_rounds, converged_pages).map_err(CliError::Usage)?;
            snapshot::migrate(&api_socket, &to, opts, json)?
        }
        Command::Receive { listen, state_dir, api_socket } => {
            return snapshot::receive(&listen, &manage::state_dir(&state_dir), api_socket.as_deref())
        }
        Command::Demo { guest, vnpu, board: path } => return Ok(demo::run(guest, vnpu, board(&path)?)?),
        Command::Compile {
            model,
            vnpu,
            batch,
            dtype,
            activations,
            shapes,
            outputs,
            board: path,
            spread,
            reuse_hbm,
            fuse_residual,
            fuse_blocks,
            out,
        } => {
            let bf16_activations = activations == "bf16";
            let b = board(&path)?;
            let how = (dtype.as_str(), bf16_activations, reuse_hbm, fuse_residual, fuse_blocks);
            model::compile(&model, &vnpu, &b, batch, how, shapes, outputs, spread, &out)?;
        }
        Command::Infer {
            model,
            inputs,
            vnpu,
            output,
            top,
            show,
            in_process,
            attach,
            expect,
            tolerance,
            guest,
            board: path,
        } => {
            return Ok(model::infer(model::InferArgs {
                model,
                inputs,
                spec: vnpu,
                board: board(&path)?,
                guest,
                output,
                top,
                show,
                in_process,
                attach,
                expect: expect.map(|e| (e, tolerance)),
            })?);
        }
        Command::Verify { file, vnpu, memory, borrow } => {
            let bytes = std::fs::read(&file)
                .map_err(|source| CliError::Read { path: file.display().to_string(), source })?;
            let program = match vnpu_abi::Program::decode(&bytes) {
                Ok(p) => p,
                Err(e) => {
                    println!("rejected: {} does not decode: {e}", file.display());
                    return Ok(1);
                }
            };
            return Ok(
                match npu_model::verify(&program, &{
                    let cap = vnpu_spec::Qos { borrow, ..Default::default() }.borrow_cap(&vnpu);
                    vnpu.limits(std::iter::once(0..memory).collect(), cap)
                }) {
                    Ok(()) => {
                        println!(
                            "accepted: {} instructions in {} streams",
                            program.instruction_count(),
                            program.streams.len()
                        );
                        0
                    }
                    Err(e) => {
                        println!("rejected: {e}");
                        1
                    }
                },
            );
        }
        Command::Profile { name, batch, slo_ms, json, board: path } => {
            if batch == 0 {
                return Err(CliError::Batch);
            }
            if slo_ms.is_some_and(|s| !(s > 0.0 && s.is_finite())) {
                return Err(CliError::Usage("--slo-ms must be a positive number of milliseconds".into()));
            }
            let b = board(&path)?;
            let o = RunOptions::on_board(&b, name, batch);
            return Ok(profile::run(&b, o, slo_ms, json)?);
        }
        Command::Scenario { file } => return Ok(scenario::run(&file)?),
        Command::Daemon {
            manage,
            poll_us,
            metrics,
            control_idle_ms,
            control_group,
            seccomp,
            release_timeout_ms,
            session_dir,
            harvest,
            lend_limit_us,
            max_host_work,
        } => {
            let control_group = match control_group {
                Some(name) => Some(vnpu_daemon::peer::group_id(&name).ok_or_else(|| {
                    CliError::Usage(format!("--control-group {name}: no such group on this host"))
                })?),
                None => None,
            };
            env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
            let state_dir = manage.dir();
            let opts = vnpu_daemon::DaemonOptions {
                board: board(&manage.board)?,
                socket_dir: manage.socket_dir(),
                state_dir,
                session_dir,
                rescan: std::time::Duration::from_millis(100),
                device: vnpu_device::DeviceOptions {
                    poll: std::time::Duration::from_micros(poll_us),
                    shared_max_host_work: max_host_work,
                    ..Default::default()
                },
                metrics,
                control_idle: std::time::Duration::from_millis(control_idle_ms),
                control_group,
                release_timeout: std::time::Duration::from_millis(release_timeout_ms),
                harvest: harvest == "on",
                lend_limit_us,
            };
            vnpu_daemon::stop_on_signals();
            vnpu_daemon::seccomp::install(seccomp)?;
            let stop = std::sync::atomic::AtomicBool::new(false);
            let dir = opts.socket_dir.clone();
            vnpu_daemon::run(&opts, &stop, || eprintln!("vnpu daemon: serving at {}", dir.display()))?;
            eprintln!("vnpu daemon: stopped");
        }
        Command::Types { manage, json } => manage::print(&manage.call(&Request::Types {})?, json),
        Command::Create { shape, uuid, workload, qos, placement, manage } => {
            let req = Request::Create {
                type_name: shape.type_name,
                spec: shape.spec,
                uuid,
                workload,
                qos: qos.qos(),
                place: placement.options()?,
            };
            println!("{}", created(&manage.call(&req)?)?.uuid);
        }
        Command::Define { shape, uuid, workload, qos, manage } => {
            let req = Request::Define {
                type_name: shape.type_name,
                spec: shape.spec,
                uuid,
                workload,
                qos: qos.qos(),
            };
            println!("{}", created(&manage.call(&req)?)?.uuid);
        }
        Command::Start { uuid, placement, manage } => {
            let outcome = manage.call(&Request::Start { uuid: uuid.clone(), place: placement.options()? })?;
            let i = created(&outcome)?;
            println!("{uuid} started on physical cores {:?}", i.cores);
        }
        Command::Remap { uuid, sa, vu, sram, workload, batch, oversubscribe, manage } => {
            let mut ratio = None;
            if let Some(name) = &workload {
                if batch == 0 {
                    return Err(CliError::Batch);
                }
                // Profiled here, on the board this command was given; the
                // split over the instance's EUs is made where its state is.
                let b = board(&manage.board)?;
                let r = run_workload(&b, &RunOptions::on_board(&b, name.clone(), batch))?;
                let (x, y) = (r.sa_active_cycles as f64, r.vu_active_cycles.max(1) as f64);
                let k = (x / y).sqrt();
                println!("{name} batch {batch}: a = x/y = {:.3}, k = sqrt(a) = {k:.3}", x / y);
                ratio = Some(k);
            } else if sa.is_none() && vu.is_none() && sram.is_none() {
                return Err(CliError::Usage("remap needs --sa/--vu/--sram or --workload".into()));
            }
            let req = Request::Remap {
                uuid: uuid.clone(),
                sa,
                vu,
                sram,
                ratio,
                workload: workload.map(|name| vnpu_manager::Workload { name, batch }),
                oversubscribe,
            };
            let outcome = manage.call(&req)?;
            let i = created(&outcome)?;
            let Outcome::Instance { previous: Some(old), .. } = &outcome else {
                return Err(CliError::Usage("the remap reply has no previous shape".into()));
            };
            println!(
                "{uuid} remapped from {} SA + {} VU to {} SA + {} VU per core{}",
                old.sa_per_core(),
                old.vu_per_core(),
                i.shape.sa_per_core(),
                i.shape.vu_per_core(),
                if i.active {
                    format!(" on physical cores {:?} (its HBM data stays)", i.cores)
                } else {
                    String::new()
                }
            );
        }
        Command::Stop { uuid, manage } => {
            manage.call(&Request::Stop { uuid })?;
        }
        Command::Remove { uuid, manage } => {
            manage.call(&Request::Remove { uuid })?;
        }
        Command::List { manage, json } => manage::print(&manage.call(&Request::List {})?, json),
        Command::Cores { manage, json } => manage::print(&manage.call(&Request::Cores {})?, json),
        Command::Workload { command: WorkloadCommand::List } => {
            for (name, what) in WORKLOADS.iter().chain(npu_workloads::MORE_WORKLOADS) {
                println!("{name:<14} {what}");
            }
            println!();
            println!("decoders, one phase each: NAME-prefill-P (a P-token prompt) or NAME-decode-L (one token at context L)");
            for c in npu_workloads::zoo::DECODERS {
                println!("{:<14} {}", c.name, c.source);
            }
        }
        Command::Workload { command: WorkloadCommand::Run { vnpu, functional, seed, json } } => {
            let (b, opts) = vnpu.resolve(functional, seed)?;
            if functional && !json {
                eprintln!("running functionally (real arithmetic on random data); this takes longer than timing only");
            }
            let r = run_workload(&b, &opts)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print_report(&r);
            }
        }
        Command::Workload { command: WorkloadCommand::Anchors { json } } => anchors(json)?,
        Command::Workload { command: WorkloadCommand::Lower { vnpu, output } } => {
            let (b, opts) = vnpu.resolve(false, 0)?;
            let (lowered, _, _) = npu_workloads::lower_workload(&b, &opts)?;
            let bytes = lowered.program.encode();
            std::fs::write(&output, &bytes)
                .map_err(|source| CliError::Write { path: output.display().to_string(), source })?;
            println!(
                "wrote {} ({} bytes, {} instructions in {} streams)",
                output.display(),
                bytes.len(),
                lowered.program.instruction_count(),
                lowered.program.streams.len()
            );
        }
        Command::Board { command: BoardCommand::Default } => print!("{}", BoardConfig::default().to_toml()),
        Command::Board { command: BoardCommand::Check { file } } => {
            print!("{}", BoardConfig::load(&file)?.to_toml())
        }
    }
    Ok(0)
}

/// The instance a define, create, start or remap reply carries.
fn created(outcome: &Outcome) -> Result<&Instance, CliError> {
    match outcome {
        Outcome::Instance { instance, .. } => Ok(instance),
        other => Err(CliError::Usage(format!("unexpected reply {other:?}"))),
    }
}

fn main() -> ExitCode {
    npu_model::keep_freed_memory();
    match run(Cli::parse()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("vnpu: {e}");
            ExitCode::FAILURE
        }
    }
}
