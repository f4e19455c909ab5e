//! `vnpu types | create | define | start | stop | remove | list`: vNPU
//! management in the manner of mdevctl (`docs/management.md`).

use std::path::PathBuf;

use npu_model::BoardConfig;
use vnpu_manager::{
    shape_text, ControlClient, ControlError, Instance, Outcome, PlaceOptions, Request, Store,
};
use vnpu_spec::VnpuSpec;

use crate::CliError;

/// Where the state lives, which board it is for, and where a running
/// daemon's control socket is.
#[derive(clap::Args, Debug, Clone)]
pub struct ManageArgs {
    /// State directory (default: $VNPU_STATE_DIR, else ~/.local/state/vnpu).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Board config file (TOML); default: the built-in board. When a
    /// daemon answers on the control socket, its board is used instead.
    #[arg(long)]
    pub board: Option<PathBuf>,
    /// The board daemon's socket directory (default: STATE_DIR/sockets).
    /// When its control.sock answers, management goes through the daemon.
    #[arg(long)]
    pub socket_dir: Option<PathBuf>,
}

impl ManageArgs {
    pub fn dir(&self) -> PathBuf {
        state_dir(&self.state_dir)
    }

    pub fn socket_dir(&self) -> PathBuf {
        self.socket_dir.clone().unwrap_or_else(|| vnpu_manager::control::default_socket_dir(&self.dir()))
    }

    /// Executes `req` through the daemon's control socket when a daemon
    /// answers there, else directly on the state directory.
    pub fn call(&self, req: &Request) -> Result<Outcome, CliError> {
        let sock = self.socket_dir().join(vnpu_manager::control::CONTROL_SOCKET);
        if sock.exists() {
            match ControlClient::connect(&sock) {
                Ok(mut c) => return Ok(c.call(req)?),
                // A socket left by a daemon that died.
                Err(ControlError::Connect { source, .. })
                    if source.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    eprintln!(
                        "vnpu: no daemon answers at {} (left by one that stopped); managing {} directly",
                        sock.display(),
                        self.dir().display()
                    );
                }
                Err(e) => return Err(e.into()),
            }
        }
        let board = crate::board(&self.board)?;
        Ok(vnpu_manager::control::execute(&self.dir(), &board, req)?)
    }
}

/// `--state-dir`, else $VNPU_STATE_DIR, else ~/.local/state/vnpu.
pub fn state_dir(given: &Option<PathBuf>) -> PathBuf {
    given.clone().or_else(|| std::env::var_os("VNPU_STATE_DIR").map(PathBuf::from)).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        home.join(".local/state/vnpu")
    })
}

/// How `create` and `start` choose physical cores (docs/management.md,
/// "Placement").
#[derive(clap::Args, Debug, Clone)]
pub struct PlacementArgs {
    /// pack: fill EUs, balance EUs against memory (the default);
    /// interference: as pack, and among equally packed cores the one
    /// with the least predicted slowdown of the board's tenants;
    /// interference-first: the least predicted slowdown first, packing
    /// breaks ties. The interference policies need the vNPU's
    /// --workload and --interference-matrix.
    #[arg(long, default_value = "pack")]
    pub placement: vnpu_manager::Policy,
    /// Characterization matrix of this board (`npu-interference
    /// characterize --json`, e.g. docs/plots/interference.json) to train
    /// the interference predictor on.
    #[arg(long)]
    pub interference_matrix: Option<PathBuf>,
    /// When no core has free EUs, share one up to this many times its
    /// EUs (its vNPUs then time-share it).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub oversubscribe: Option<u32>,
}

impl PlacementArgs {
    /// As sent: the matrix path made absolute (a daemon may run elsewhere).
    pub fn options(&self) -> Result<PlaceOptions, CliError> {
        let interference_matrix = match &self.interference_matrix {
            Some(p) => Some(
                std::path::absolute(p)
                    .map_err(|source| CliError::Read { path: p.display().to_string(), source })?,
            ),
            None => None,
        };
        Ok(PlaceOptions { oversubscribe: self.oversubscribe, placement: self.placement, interference_matrix })
    }
}

/// The service a new instance gets on a shared physical core.
#[derive(clap::Args, Debug, Clone)]
pub struct QosArgs {
    /// Priority of its requests on a shared core: higher runs first and
    /// may preempt lower (docs/management.md, "Oversubscription").
    #[arg(long, default_value_t = 0)]
    pub priority: u8,
    /// Latency target of each request, microseconds of simulated time
    /// from its arrival on the core (0: none): among equal priorities the
    /// earliest deadline runs first; misses are counted per core.
    #[arg(long, default_value_t = 0)]
    pub slo_us: u64,
    /// Borrowing cap `SA,VU`: how many idle engines of its physical core
    /// beyond its own its spread programs may run on at once (0,0: none).
    /// Default: as many as it owns (docs/management.md, "Harvesting").
    #[arg(long)]
    pub borrow: Option<vnpu_manager::Borrow>,
}

impl QosArgs {
    pub fn qos(&self) -> vnpu_manager::Qos {
        vnpu_manager::Qos { priority: self.priority, slo_us: self.slo_us, borrow: self.borrow }
    }
}

/// What a new instance is made of: `--type NAME` or `--spec SPEC`.
#[derive(clap::Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub struct ShapeArgs {
    /// A named type: small, medium or large (`vnpu types`).
    #[arg(long = "type")]
    pub type_name: Option<String>,
    /// An explicit shape: `sa=N,vu=M,sram=SIZE,hbm=SIZE[,cores=C][,chips=K]`.
    #[arg(long)]
    pub spec: Option<String>,
}

fn instance_json(i: &Instance) -> serde_json::Value {
    serde_json::json!({
        "uuid": i.uuid,
        "type": i.type_name,
        "spec": shape_text(&i.shape),
        "sa_per_core": i.shape.sa_per_core(),
        "vu_per_core": i.shape.vu_per_core(),
        "sram_per_core": i.shape.sram_per_core(),
        "hbm_per_core": i.shape.hbm_per_core(),
        "cores_per_chip": i.shape.cores_per_chip(),
        "chips": i.shape.chips(),
        "persistent": i.persistent,
        "active": i.active,
        "physical_cores": i.cores,
        "workload": i.workload.as_ref().map(|w| format!("{}:{}", w.name, w.batch)),
        "priority": i.qos.priority,
        "slo_us": i.qos.slo_us,
        "borrow_sa": i.qos.borrow_cap(&i.shape).0,
        "borrow_vu": i.qos.borrow_cap(&i.shape).1,
    })
}

/// Prints what a management request did, as each command always has.
pub fn print(outcome: &Outcome, json: bool) {
    match outcome {
        Outcome::Types { board, types, .. } if json => {
            println!("{}", serde_json::json!({ "board": board, "types": types }));
        }
        Outcome::Types { board, layout, types } => {
            println!("board {board} ({layout})");
            println!("{:<8} {:<36} {:>3} {:>10}", "type", "spec", "EUs", "available");
            for t in types {
                println!(
                    "{:<8} {:<36} {:>3} {:>10}",
                    t.type_name, t.spec, t.execution_units, t.available_instances
                );
            }
        }
        Outcome::Instances(list) if json => {
            println!("{}", serde_json::Value::Array(list.iter().map(instance_json).collect()));
        }
        Outcome::Instances(list) => {
            println!(
                "{:<36} {:<7} {:<30} {:<10} {:<7} {:<16} cores",
                "uuid", "type", "spec", "persistent", "state", "workload"
            );
            for i in list {
                println!(
                    "{:<36} {:<7} {:<30} {:<10} {:<7} {:<16} {}",
                    i.uuid,
                    i.type_name.as_deref().unwrap_or("-"),
                    shape_text(&i.shape),
                    if i.persistent { "yes" } else { "no" },
                    if i.active { "active" } else { "defined" },
                    i.workload.as_ref().map_or("-".to_string(), |w| format!("{}:{}", w.name, w.batch)),
                    i.cores.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                );
            }
        }
        Outcome::Cores { clock_mhz, cores } if json => {
            println!("{}", serde_json::json!({ "clock_mhz": clock_mhz, "cores": cores }));
        }
        Outcome::Cores { clock_mhz, cores } => print_cores(*clock_mhz, cores, |t| t.to_string()),
        Outcome::Instance { .. } | Outcome::Done => {}
    }
}

/// Per physical core: requests served, those that waited for engines,
/// the board's simulated time, the time two or more tenants ran at once
/// (and its share of the board's time), and each tenant's busy time
/// (named by `name`); a second line for a core whose requests had latency
/// targets. Idle cores are left out.
pub fn print_cores(clock_mhz: u32, cores: &[vnpu_manager::CoreUse], name: impl Fn(&str) -> String) {
    let mhz = f64::from(clock_mhz.max(1));
    println!(
        "{:<6} {:>8} {:>7} {:>14} {:>14} {:>8}  tenants (busy us)",
        "core", "requests", "waited", "board us", "shared us", "shared"
    );
    for c in cores.iter().filter(|c| !c.tenants.is_empty()) {
        let tenants: Vec<String> =
            c.tenants.iter().map(|t| format!("{} {:.1}", name(&t.tenant), t.busy_cycles / mhz)).collect();
        println!(
            "{:<6} {:>8} {:>7} {:>14.1} {:>14.1} {:>7.1}%  {}{}",
            c.core,
            c.requests,
            c.waited,
            c.board_cycles / mhz,
            c.overlap_cycles / mhz,
            100.0 * c.overlap_cycles / c.board_cycles.max(1.0),
            tenants.join(", "),
            if c.oversubscribed { "  (oversubscribed: time-shared)" } else { "" }
        );
        if c.slo_requests > 0 {
            println!(
                "{:<6} SLO: {} of {} requests missed their latency target; {} preemptions",
                c.core, c.slo_misses, c.slo_requests, c.preempted
            );
        }
        let harvest: Vec<String> = c
            .tenants
            .iter()
            .filter(|t| t.borrowed_cycles > 0.0 || t.lent_cycles > 0.0 || t.reclaims > 0)
            .map(|t| {
                format!(
                    "{} borrowed {:.1}, lent {:.1}, {} reclaims (longest {:.2})",
                    name(&t.tenant),
                    t.borrowed_cycles / mhz,
                    t.lent_cycles / mhz,
                    t.reclaims,
                    t.reclaim_max_cycles / mhz
                )
            })
            .collect();
        if !harvest.is_empty() {
            println!("{:<6} harvesting (engine-us): {}", c.core, harvest.join("; "));
        }
    }
}

/// The spec of active instance `uuid` (for `vnpu run --vnpu uuid=...`).
/// Follows `vnpu remap` of the managed instances a running VM uses: a
/// thread checks the state file (every 200 ms, re-reading it only when it
/// changed) and hands each instance's new shape to its vNPU, which applies
/// it between requests and tells the guest (a live remap).
pub fn follow_remaps(
    dir: std::path::PathBuf,
    board: BoardConfig,
    mut instances: Vec<(String, vnpu_device::GrantHandle, VnpuSpec)>,
) -> std::io::Result<()> {
    let mut seen = Store::stamp(&dir);
    std::thread::Builder::new().name("remaps".into()).spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let now = Store::stamp(&dir);
        if now == seen {
            continue;
        }
        seen = now;
        for (uuid, handle, current) in instances.iter_mut() {
            // A removed or stopped instance keeps the grant it had.
            let Ok(spec) = active_spec(&dir, &board, uuid) else { continue };
            if spec != *current {
                eprintln!(
                    "vnpu: {uuid} remapped to {} SA + {} VU per core while running",
                    spec.sa_per_core(),
                    spec.vu_per_core()
                );
                handle.regrant(spec);
                *current = spec;
            }
        }
    })?;
    Ok(())
}

pub fn active_spec(dir: &std::path::Path, board: &BoardConfig, uuid: &str) -> Result<VnpuSpec, String> {
    let store = Store::open(dir, board).map_err(|e| e.to_string())?;
    let i = store.get(uuid).map_err(|e| e.to_string())?;
    if !i.active {
        return Err(format!("vNPU {uuid} is defined but not started (vnpu start {uuid})"));
    }
    Ok(i.shape)
}
