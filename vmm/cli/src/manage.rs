//! `vnpu types | create | define | start | stop | remove | list`: vNPU
//! management in the manner of mdevctl (`docs/management.md`).

use std::path::PathBuf;

use npu_model::BoardConfig;
use vnpu_device::VnpuSpec;
use vnpu_manager::{Instance, Shape, Store, StoreError, TYPES};

/// Where the state lives and which board it is for.
#[derive(clap::Args, Debug, Clone)]
pub struct ManageArgs {
    /// State directory (default: $VNPU_STATE_DIR, else ~/.local/state/vnpu).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Board config file (TOML); default: the built-in board.
    #[arg(long)]
    pub board: Option<PathBuf>,
}

impl ManageArgs {
    pub fn dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .or_else(|| std::env::var_os("VNPU_STATE_DIR").map(PathBuf::from))
            .unwrap_or_else(|| {
                let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
                home.join(".local/state/vnpu")
            })
    }
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
}

impl PlacementArgs {
    /// Sets `store` to place as asked (training the predictor if needed).
    pub fn apply(
        &self,
        store: &mut Store,
        board: &BoardConfig,
    ) -> Result<(), vnpu_manager::InterferenceError> {
        let model = match (&self.interference_matrix, self.placement) {
            (_, vnpu_manager::Policy::Pack) | (None, _) => None,
            (Some(path), _) => Some(vnpu_manager::InterferenceModel::from_file(
                path,
                board,
                npu_interference::predict::Model::Linear,
            )?),
        };
        store.set_placement(self.placement, model);
        Ok(())
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

impl ShapeArgs {
    pub fn resolve(&self) -> Result<(Shape, Option<String>), String> {
        match (&self.type_name, &self.spec) {
            (Some(t), _) => VnpuSpec::named(t)
                .map(|s| (s, Some(t.clone())))
                .ok_or_else(|| format!("unknown type `{t}` (types: {})", TYPES.join(", "))),
            (None, Some(s)) => VnpuSpec::parse(s).map(|s| (s, None)).map_err(|e| e.to_string()),
            (None, None) => Err("give --type or --spec".into()),
        }
    }
}

fn mib(b: u64) -> String {
    if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
        format!("{}G", b >> 30)
    } else {
        format!("{}M", b >> 20)
    }
}

fn shape_text(s: &Shape) -> String {
    let mut t = format!(
        "sa={},vu={},sram={},hbm={}",
        s.sa_per_core,
        s.vu_per_core,
        mib(s.sram_per_core),
        mib(s.hbm_per_core)
    );
    if s.cores_per_chip != 1 {
        t += &format!(",cores={}", s.cores_per_chip);
    }
    if s.chips != 1 {
        t += &format!(",chips={}", s.chips);
    }
    t
}

fn instance_json(i: &Instance) -> serde_json::Value {
    serde_json::json!({
        "uuid": i.uuid,
        "type": i.type_name,
        "spec": shape_text(&i.shape),
        "sa_per_core": i.shape.sa_per_core,
        "vu_per_core": i.shape.vu_per_core,
        "sram_per_core": i.shape.sram_per_core,
        "hbm_per_core": i.shape.hbm_per_core,
        "cores_per_chip": i.shape.cores_per_chip,
        "chips": i.shape.chips,
        "persistent": i.persistent,
        "active": i.active,
        "physical_cores": i.cores,
        "workload": i.workload.as_ref().map(|w| format!("{}:{}", w.name, w.batch)),
    })
}

/// `vnpu types`.
pub fn types(board: &BoardConfig, store: &Store, json: bool) -> Result<(), StoreError> {
    let b = store.board();
    let rows: Vec<(&str, Shape, u32)> = TYPES
        .iter()
        .filter_map(|t| VnpuSpec::named(t).map(|s| (*t, s)))
        .map(|(t, s)| (t, s, b.room_for(&s)))
        .collect();
    if json {
        let v: Vec<_> = rows
            .iter()
            .map(|(t, s, n)| {
                serde_json::json!({
                    "type": t,
                    "spec": shape_text(s),
                    "execution_units": s.sa_per_core + s.vu_per_core,
                    "available_instances": n,
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "board": board.name, "types": v }));
    } else {
        println!(
            "board {} ({} chip(s) x {} cores, {} SA + {} VU per core)",
            board.name, board.chips, board.cores_per_chip, board.core.sa_count, board.core.vu_count
        );
        println!("{:<8} {:<36} {:>3} {:>10}", "type", "spec", "EUs", "available");
        for (t, s, n) in rows {
            println!("{t:<8} {:<36} {:>3} {n:>10}", shape_text(&s), s.sa_per_core + s.vu_per_core);
        }
    }
    Ok(())
}

/// `vnpu list`.
pub fn list(store: &Store, json: bool) {
    if json {
        let v: Vec<_> = store.instances().iter().map(instance_json).collect();
        println!("{}", serde_json::Value::Array(v));
        return;
    }
    println!(
        "{:<36} {:<7} {:<30} {:<10} {:<7} {:<16} cores",
        "uuid", "type", "spec", "persistent", "state", "workload"
    );
    for i in store.instances() {
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
    let state = dir.join("vnpu-state.json");
    let stamp = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen = stamp(&state);
    std::thread::Builder::new().name("remaps".into()).spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let now = stamp(&state);
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
                    spec.sa_per_core, spec.vu_per_core
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
