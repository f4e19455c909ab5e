//! `vnpu scenario FILE`: several VMs on one modelled board, each in its
//! own process, as in production. The scenario is a launcher: it starts
//! a board daemon (`vnpu daemon`, the one engine of sharing: every core's
//! simulation, scheduler and counters) on a state directory of its own,
//! creates each VM's vNPUs through the daemon's control socket (placed by
//! the manager, with the VM's priority and latency target), starts one
//! ordinary `vnpu run` process per VM attached to its vNPUs over
//! vfio-user, relays each VM's console prefixed `[name]`, and at the end
//! asks the daemon what each physical core did. Format:
//! `docs/management.md`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;
use vnpu_manager::control::{ControlClient, CONTROL_SOCKET};
use vnpu_manager::{Outcome, PlaceOptions, Qos, Request};
use vnpu_spec::VnpuSpec;

/// Why a scenario could not run.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("scenario {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("scenario {path}: cannot place vNPU {index} of VM `{vm}`: {source}")]
    Placement { path: String, vm: String, index: usize, source: Box<vnpu_manager::ControlError> },
    #[error("board daemon: {0}")]
    Daemon(String),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    /// Board config file, relative to the scenario file.
    board: Option<PathBuf>,
    /// Allow placing vNPUs beyond a core's EUs, up to this factor; the
    /// vNPUs of an oversubscribed core time-share it by priority.
    oversubscribe: Option<u32>,
    /// Lend idle engines to spread programs (`vnpu daemon --harvest`;
    /// default true).
    harvest: Option<bool>,
    #[serde(default)]
    vm: Vec<VmEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VmEntry {
    name: String,
    /// Guest ELF, relative to the scenario file (with `model`: the runner
    /// guest, default the one `scripts/build-guests.sh` builds).
    guest: Option<PathBuf>,
    /// A compiled model (`vnpu compile`) the VM runs with `vnpu infer`
    /// on `inputs` instead of a guest of its own.
    model: Option<PathBuf>,
    /// The model's inputs, `FILE` or `NAME=FILE`, relative to the
    /// scenario file.
    #[serde(default)]
    inputs: Vec<String>,
    /// A reference the model's first output must match (`vnpu infer
    /// --expect`), within `tolerance` of its largest magnitude.
    expect: Option<PathBuf>,
    tolerance: Option<f64>,
    #[serde(default = "default_memory")]
    memory: String,
    vnpu: Vec<String>,
    /// Priority of its vNPUs on shared cores (higher first).
    #[serde(default)]
    priority: u8,
    /// Latency target of each of its requests on a shared core, in
    /// microseconds of simulated time (0: none): among equal priorities
    /// the earliest deadline runs first; misses are counted.
    #[serde(default)]
    slo_us: u64,
    /// Borrowing cap of its vNPUs (`{ sa = N, vu = M }`; default: their
    /// own counts again).
    #[serde(default)]
    borrow: Option<vnpu_manager::Borrow>,
}

fn default_memory() -> String {
    "64M".into()
}

/// How long the daemon may take to answer on its control socket.
const DAEMON_START: Duration = Duration::from_secs(20);
/// How long the daemon may take to stop after SIGTERM before it is killed.
const DAEMON_STOP: Duration = Duration::from_secs(10);
/// Longest console line relayed whole; longer ones are cut into pieces.
const MAX_LINE: usize = 64 << 10;

/// Child processes (the daemon, the VMs), killed if the launcher returns
/// early; the daemon is asked to stop first.
#[derive(Default)]
struct Children {
    daemon: Option<Child>,
    vms: Vec<Child>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.vms {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(c) = self.daemon.as_mut() {
            let _ = terminate(c);
        }
    }
}

/// SIGTERM, then SIGKILL if it has not exited within [`DAEMON_STOP`].
fn terminate(c: &mut Child) -> std::io::Result<ExitStatus> {
    if let Some(s) = c.try_wait()? {
        return Ok(s);
    }
    let pid = libc::pid_t::try_from(c.id()).unwrap_or(libc::pid_t::MAX);
    // SAFETY: kill(2) of our own child, which has not been reaped (try_wait
    // above), so the pid is still ours.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t = Instant::now();
    while t.elapsed() < DAEMON_STOP {
        if let Some(s) = c.try_wait()? {
            return Ok(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    c.kill()?;
    c.wait()
}

/// Copies `from` to stdout line by line, each line prefixed `[name] `.
fn relay(from: impl Read, name: String) {
    split_lines(from, |line| {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "[{name}] ");
        let _ = out.write_all(line);
        let _ = out.write_all(b"\n");
    });
}

/// Hands each line of `from` (without its `\n` or `\r\n`) to `emit`,
/// a line longer than [`MAX_LINE`] in pieces of that size: a guest that
/// prints without end never makes the launcher hold more than that.
fn split_lines(mut from: impl Read, mut emit: impl FnMut(&[u8])) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                emit(pending.strip_suffix(b"\r").unwrap_or(&pending));
                pending.clear();
            } else {
                pending.push(b);
                if pending.len() >= MAX_LINE {
                    emit(&pending);
                    pending.clear();
                }
            }
        }
    }
    if !pending.is_empty() {
        emit(&pending);
    }
}

/// The last lines of the daemon's log, for an error message.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(20)..].join("\n");
    format!("its log {} ends:\n{tail}", log.display())
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
    if file.oversubscribe == Some(0) {
        return Err(ScenarioError::Invalid { path: p, reason: "oversubscribe must be 1 or more".into() });
    }
    let base = path.parent().unwrap_or(Path::new("."));
    // Everything a VM names is checked before anything starts.
    for vm in &file.vm {
        let invalid = |reason: String| ScenarioError::Invalid {
            path: p.clone(),
            reason: format!("VM `{}`: {reason}", vm.name),
        };
        vnpu_spec::parse_size(&vm.memory).map_err(invalid)?;
        if vm.vnpu.is_empty() {
            return Err(invalid("no vNPUs (`vnpu = [\"type=small\"]`)".into()));
        }
        for v in &vm.vnpu {
            VnpuSpec::parse(v).map_err(|e| invalid(e.to_string()))?;
        }
        if let Some(g) = &vm.guest {
            if !base.join(g).is_file() {
                return Err(invalid(format!("no guest at {}", base.join(g).display())));
            }
        }
        match &vm.model {
            None if vm.guest.is_none() => return Err(invalid("give `guest` or `model`".into())),
            None if !vm.inputs.is_empty() || vm.expect.is_some() || vm.tolerance.is_some() => {
                return Err(invalid("`inputs`, `expect` and `tolerance` go with `model`".into()))
            }
            None => {}
            Some(m) => {
                if vm.vnpu.len() != 1 {
                    return Err(invalid("a `model` VM has one vNPU".into()));
                }
                if vm.inputs.is_empty() {
                    return Err(invalid("a `model` VM needs `inputs`".into()));
                }
                let files = vm
                    .inputs
                    .iter()
                    .map(|i| input_file(i).1)
                    .chain([m.as_path()])
                    .chain(vm.expect.as_deref());
                for f in files {
                    if !base.join(f).is_file() {
                        return Err(invalid(format!("no file at {}", base.join(f).display())));
                    }
                }
                if vm.tolerance.is_some_and(|t| t.is_nan() || t < 0.0) {
                    return Err(invalid("`tolerance` must be 0 or more".into()));
                }
            }
        }
    }
    let board =
        match &file.board {
            Some(b) => Some(std::path::absolute(base.join(b)).map_err(|source| ScenarioError::Io {
                what: format!("board file {}", b.display()),
                source,
            })?),
            None => None,
        };
    if let Some(b) = &board {
        npu_model::BoardConfig::load(b)
            .map_err(|e| ScenarioError::Invalid { path: p.clone(), reason: e.to_string() })?;
    }
    let exe = std::env::current_exe()
        .map_err(|source| ScenarioError::Io { what: "the vnpu binary's path".into(), source })?;

    // A state directory of its own, so the scenario's instances never
    // meet the user's definitions.
    let work = std::env::temp_dir().join(format!("vnpu-scenario-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let dirs =
        Dirs { state: work.join("state"), sockets: work.join("sockets"), log: work.join("daemon.log") };
    std::fs::create_dir_all(&dirs.state).map_err(|source| ScenarioError::Io {
        what: format!("state directory {}", dirs.state.display()),
        source,
    })?;
    let result = launch(&file, path, board.as_deref(), &exe, &dirs);
    match &result {
        Ok(0) => {
            let _ = std::fs::remove_dir_all(&work);
        }
        _ => eprintln!("vnpu scenario: the board daemon's log is kept at {}", dirs.log.display()),
    }
    result
}

/// The launcher's own state directory, the daemon's socket directory and
/// its log.
struct Dirs {
    state: PathBuf,
    sockets: PathBuf,
    log: PathBuf,
}

/// Starts the daemon and the VMs, waits for the VMs, reports the cores.
fn launch(
    file: &File,
    scenario: &Path,
    board: Option<&Path>,
    exe: &Path,
    dirs: &Dirs,
) -> Result<u8, ScenarioError> {
    let base = scenario.parent().unwrap_or(Path::new("."));
    let Dirs { state, sockets, log } = dirs;
    let io = |what: &str| {
        let what = what.to_string();
        move |source| ScenarioError::Io { what, source }
    };
    let mut children = Children::default();
    let log_file = std::fs::File::create(log).map_err(io("the daemon's log"))?;
    let mut daemon = Command::new(exe);
    daemon.arg("daemon").arg("--state-dir").arg(state).arg("--socket-dir").arg(sockets);
    if let Some(b) = board {
        daemon.arg("--board").arg(b);
    }
    if file.harvest == Some(false) {
        daemon.args(["--harvest", "off"]);
    }
    let child = daemon
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .map_err(io("starting the board daemon"))?;
    let daemon = children.daemon.insert(child);

    // Wait until the control socket answers.
    let control = sockets.join(CONTROL_SOCKET);
    let started = Instant::now();
    let mut client = loop {
        if let Ok(c) = ControlClient::connect(&control) {
            break c;
        }
        if let Ok(Some(s)) = daemon.try_wait() {
            return Err(ScenarioError::Daemon(format!("exited at start ({s}); {}", log_tail(log))));
        }
        if started.elapsed() > DAEMON_START {
            return Err(ScenarioError::Daemon(format!(
                "no answer on {} after {DAEMON_START:?}; {}",
                control.display(),
                log_tail(log)
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    };

    // Every VM's vNPUs, placed by the daemon's manager in file order.
    let place = PlaceOptions { oversubscribe: file.oversubscribe, ..Default::default() };
    let mut tenant_names: BTreeMap<String, String> = BTreeMap::new();
    let mut vm_sockets: Vec<Vec<PathBuf>> = Vec::new();
    for vm in &file.vm {
        let mut mine = Vec::new();
        for (i, v) in vm.vnpu.iter().enumerate() {
            let req = Request::Create {
                type_name: None,
                spec: Some(v.clone()),
                uuid: None,
                workload: None,
                qos: Qos { priority: vm.priority, slo_us: vm.slo_us, borrow: vm.borrow },
                place: place.clone(),
            };
            let outcome = client.call(&req).map_err(|source| ScenarioError::Placement {
                path: scenario.display().to_string(),
                vm: vm.name.clone(),
                index: i,
                source: Box::new(source),
            })?;
            let Outcome::Instance { instance, socket: Some(socket), .. } = outcome else {
                return Err(ScenarioError::Daemon(format!("created {v} but does not serve it")));
            };
            println!("{}: vNPU {i} ({v}) on physical core(s) {:?}", vm.name, instance.cores);
            tenant_names.insert(instance.uuid.clone(), format!("{}/vnpu-{}", vm.name, i + 1));
            mine.push(socket);
        }
        vm_sockets.push(mine);
    }

    // One `vnpu run` (or `vnpu infer`) process per VM, all at once.
    let mut relays = Vec::new();
    for (vm, socks) in file.vm.iter().zip(&vm_sockets) {
        let mut cmd = Command::new(exe);
        match &vm.model {
            Some(m) => {
                cmd.arg("infer").arg(base.join(m)).args(["--top", "0", "--show", "0"]);
                for i in &vm.inputs {
                    let (name, f) = input_file(i);
                    let f = base.join(f).display().to_string();
                    cmd.arg("--input").arg(name.map_or(f.clone(), |n| format!("{n}={f}")));
                }
                for s in socks {
                    cmd.arg("--attach").arg(s);
                }
                if let Some(e) = &vm.expect {
                    cmd.arg("--expect").arg(base.join(e));
                    cmd.arg("--tolerance").arg(vm.tolerance.unwrap_or(1e-4).to_string());
                }
                if let Some(g) = &vm.guest {
                    cmd.arg("--guest").arg(base.join(g));
                }
            }
            None => {
                let guest = vm.guest.as_ref().map_or_else(PathBuf::new, |g| base.join(g));
                cmd.arg("run").arg("--guest").arg(guest).arg("--memory").arg(&vm.memory);
                for s in socks {
                    cmd.arg("--vnpu").arg(format!("socket={}", s.display()));
                }
            }
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io(&format!("starting VM `{}`", vm.name)))?;
        if let Some(out) = child.stdout.take() {
            let name = vm.name.clone();
            relays.push(std::thread::spawn(move || relay(out, name)));
        }
        if let Some(err) = child.stderr.take() {
            let name = vm.name.clone();
            relays.push(std::thread::spawn(move || relay(err, name)));
        }
        children.vms.push(child);
    }
    let mut all_ok = true;
    let codes: Vec<_> = children.vms.iter_mut().map(Child::wait).collect();
    for r in relays {
        let _ = r.join();
    }
    children.vms.clear();
    for (vm, code) in file.vm.iter().zip(codes) {
        match code.map(|s| s.code()) {
            Ok(Some(c)) => {
                println!("[{}] exit code {c}", vm.name);
                all_ok &= c == 0;
            }
            Ok(None) => {
                println!("[{}] killed by a signal", vm.name);
                all_ok = false;
            }
            Err(e) => {
                println!("[{}] cannot wait for its process: {e}", vm.name);
                all_ok = false;
            }
        }
    }

    // What each core did, from the daemon that ran them.
    let cores = client.call(&Request::Cores {}).map_err(|e| ScenarioError::Daemon(e.to_string()))?;
    if let Outcome::Cores { clock_mhz, cores } = cores {
        crate::manage::print_cores(clock_mhz, &cores, |t| {
            tenant_names.get(t).cloned().unwrap_or_else(|| t.to_string())
        });
    }
    drop(client);
    if let Some(mut d) = children.daemon.take() {
        let status = terminate(&mut d).map_err(io("stopping the board daemon"))?;
        if !status.success() {
            return Err(ScenarioError::Daemon(format!("exited with {status}; {}", log_tail(log))));
        }
    }
    Ok(if all_ok { 0 } else { 1 })
}

/// A `model` VM's input entry: (`NAME`, `FILE`) of `NAME=FILE`, or
/// (none, `FILE`).
fn input_file(entry: &str) -> (Option<&str>, &Path) {
    match entry.split_once('=') {
        Some((n, f)) => (Some(n), Path::new(f)),
        None => (None, Path::new(entry)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines come out whole without their line ends; a line without end
    /// comes out in pieces of at most `MAX_LINE` bytes, nothing lost.
    #[test]
    fn console_lines_are_relayed_whole_and_bounded() {
        let mut input = b"one\r\ntwo\n\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 2 * MAX_LINE + 5));
        let mut lines: Vec<Vec<u8>> = Vec::new();
        split_lines(&input[..], |l| lines.push(l.to_vec()));
        let sizes: Vec<usize> = lines.iter().map(Vec::len).collect();
        assert_eq!(sizes, [3, 3, 0, MAX_LINE, MAX_LINE, 5]);
        assert_eq!((&lines[0][..], &lines[1][..]), (&b"one"[..], &b"two"[..]));
        assert!(lines[3..].iter().all(|l| l.iter().all(|&b| b == b'x')));
    }
}
