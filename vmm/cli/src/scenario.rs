//! `vnpu scenario FILE`: several VMs on one modelled board. The vNPUs of
//! all VMs are placed on physical cores by the manager's placement; vNPUs
//! on the same physical core share it (their pending requests run together
//! on one simulated timeline, `npu_board_runtime::SharedCore`), and the cores of
//! the board share its chips' HBM and its host link (one simulation of the
//! whole board, `npu_board_runtime::SharedBoard`). The VMs run
//! concurrently; then each VM's output and exit code, and for each
//! physical core its tenants, busy time and the time two or more tenants
//! ran at once (spatial sharing). Format: `docs/management.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use npu_model::BoardConfig;
use serde::Deserialize;
use vnpu_device::{SharedBoard, SharedCore, VnpuSpec};
use vnpu_manager::Board;

/// Why a scenario could not run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("scenario {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("scenario {path}: cannot place vNPU {index} of VM `{vm}`: {source}")]
    Placement { path: String, vm: String, index: usize, source: vnpu_manager::PlacementError },
    #[error(transparent)]
    Config(#[from] npu_model::config::ConfigError),
    #[error("physical core thread: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    /// Board config file, relative to the scenario file.
    board: Option<PathBuf>,
    /// Allow placing vNPUs beyond a core's EUs, up to this factor; the
    /// vNPUs of an oversubscribed core time-share it by priority.
    oversubscribe: Option<u32>,
    #[serde(default)]
    vm: Vec<VmEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VmEntry {
    name: String,
    /// Guest ELF, relative to the scenario file.
    guest: PathBuf,
    #[serde(default = "default_memory")]
    memory: String,
    vnpu: Vec<String>,
    /// Priority of its vNPUs on oversubscribed cores (higher first).
    #[serde(default)]
    priority: u8,
    /// Latency target of each of its requests on a shared core, in
    /// microseconds of simulated time (0: none): among equal priorities
    /// the earliest deadline runs first; misses are counted.
    #[serde(default)]
    slo_us: u64,
}

fn default_memory() -> String {
    "64M".into()
}

/// Runs the scenario in `path`; returns 0 when every VM exits 0.
pub fn run(path: &Path) -> Result<u8, ScenarioError> {
    let p = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| ScenarioError::Read { path: p.clone(), source })?;
    let file: File = toml::from_str(&text)
        .map_err(|e| ScenarioError::Invalid { path: p.clone(), reason: e.to_string() })?;
    if file.vm.is_empty() {
        return Err(ScenarioError::Invalid { path: p, reason: "no [[vm]] entries".into() });
    }
    let base = path.parent().unwrap_or(Path::new("."));
    let board = match &file.board {
        Some(b) => BoardConfig::load(&base.join(b))?,
        None => BoardConfig::default(),
    };
    let mut placement = Board::new(&board);
    let shared_board = SharedBoard::new(&board, "board")?;
    let mut cores: BTreeMap<u32, SharedCore> = BTreeMap::new();
    let mut configs = Vec::new();
    for vm in &file.vm {
        let invalid = |reason: String| ScenarioError::Invalid {
            path: p.clone(),
            reason: format!("VM `{}`: {reason}", vm.name),
        };
        let memory = vnpu_device::parse_size(&vm.memory).map_err(invalid)?;
        let mut specs = Vec::new();
        let mut shared = Vec::new();
        for (i, v) in vm.vnpu.iter().enumerate() {
            let spec = VnpuSpec::parse(v).map_err(|e| invalid(e.to_string()))?;
            let shape = spec;
            let placed = placement.place_allowing(&shape, file.oversubscribe).map_err(|source| {
                ScenarioError::Placement { path: p.clone(), vm: vm.name.clone(), index: i, source }
            })?;
            let mut mine = Vec::new();
            for c in &placed {
                if !cores.contains_key(c) {
                    let Some(core) = shared_board.core(*c) else {
                        return Err(ScenarioError::Invalid {
                            path: p.clone(),
                            reason: format!("the placement chose core {c}, which the board does not have"),
                        });
                    };
                    cores.insert(*c, core);
                }
                if let Some(sc) = cores.get(c) {
                    mine.push(sc.clone());
                }
            }
            println!("{}: vNPU {i} ({v}) on physical core(s) {placed:?}", vm.name);
            specs.push(spec);
            shared.push(mine);
        }
        let mut cfg = vnpu_vm::VmConfig::new(memory, base.join(&vm.guest)).vnpus(&specs);
        cfg.board = board.clone();
        cfg.shared_cores = shared;
        cfg.name = vm.name.clone();
        cfg.device.priority = vm.priority;
        cfg.device.slo_us = vm.slo_us;
        configs.push(cfg);
    }
    let handles: Vec<_> = configs
        .into_iter()
        .map(|cfg| {
            std::thread::spawn(move || {
                let out = crate::capture::Capture::default();
                let code = vnpu_vm::Vm::new(&cfg, out.clone()).and_then(|mut vm| vm.run());
                let text = out.text();
                (cfg.name, code, text)
            })
        })
        .collect();
    let mut all_ok = true;
    for h in handles {
        let Ok((name, code, text)) = h.join() else {
            all_ok = false;
            continue;
        };
        for line in text.lines() {
            println!("[{name}] {line}");
        }
        match code {
            Ok(c) => {
                println!("[{name}] exit code {c}");
                all_ok &= c == 0;
            }
            Err(e) => {
                println!("[{name}] VMM error: {e}");
                all_ok = false;
            }
        }
    }
    let mhz = f64::from(board.clock_mhz);
    println!(
        "{:<6} {:>8} {:>7} {:>14} {:>14} {:>8}  tenants (busy us)",
        "core", "requests", "waited", "busy us", "shared us", "shared"
    );
    for (c, sc) in &cores {
        let st = sc.stats();
        let tenants: Vec<String> =
            st.tenants.iter().map(|(t, cyc)| format!("{t} {:.1}", cyc / mhz)).collect();
        println!(
            "{c:<6} {:>8} {:>7} {:>14.1} {:>14.1} {:>7.1}%  {}{}",
            st.requests,
            st.waited,
            st.busy_cycles / mhz,
            st.overlap_cycles / mhz,
            100.0 * st.overlap_cycles / st.busy_cycles.max(1.0),
            tenants.join(", "),
            if placement.oversubscribed(*c as usize) { "  (oversubscribed: time-shared)" } else { "" }
        );
        if st.slo_requests > 0 {
            println!(
                "{c:<6} SLO: {} of {} requests missed their latency target; {} preemptions",
                st.slo_misses, st.slo_requests, st.preempted
            );
        }
    }
    shared_board.stop();
    Ok(if all_ok { 0 } else { 1 })
}
