//! Snapshot and restore of a whole VM with its vNPU (docs/migration.md):
//! the `resume` guest classifies the 450 held-out digits 200 times over,
//! one request per image, with its weights kept in the vNPU's SRAM, its
//! program registered once and completions taken by interrupt, and
//! compares every answer with its CPU's. It is stopped mid-inference by
//! `vnpu snapshot` and run on by `vnpu restore` in a new process. The
//! guest's own comparison with its CPU is the reference: every answer
//! must still agree, and no round may be done twice or skipped.

#![allow(clippy::unwrap_used)] // test helpers

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

mod common;

use common::{guest, wait_socket, Running, RESUME_DONE as DONE, RESUME_ROUNDS as ROUNDS};

/// The snapshot is asked for once this round is done: late, so that a
/// restored run is short, with some 50 rounds (about a second) left for
/// the request to land in.
const SNAPSHOT_AT: &str = "round 150:";

/// One VM at a time: each runs a vCPU and a polling vNPU worker, and
/// three at once on this machine's two cores took three times as long.
static SERIAL: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vnpu-snapshot-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rounds_vm(api: &Path) -> Running {
    let g = guest("resume");
    Running::start(&[
        "run".as_ref(),
        "--memory".as_ref(),
        "64M".as_ref(),
        "--guest".as_ref(),
        g.as_os_str(),
        "--vnpu".as_ref(),
        "type=small".as_ref(),
        "--api-socket".as_ref(),
        api.as_os_str(),
    ])
}

fn vnpu(args: &[&std::ffi::OsStr]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).output().unwrap();
    let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&o.stderr));
    (o.status.code().unwrap_or(-1), s)
}

fn snapshot(api: &Path, dir: &Path, stop: bool) -> (i32, String) {
    let mut a: Vec<&std::ffi::OsStr> =
        vec!["snapshot".as_ref(), "--api-socket".as_ref(), api.as_os_str(), dir.as_os_str()];
    if stop {
        a.push("--stop".as_ref());
    }
    vnpu(&a)
}

/// Exit code, console, stderr.
fn restore(dir: &Path) -> (i32, String, String) {
    Running::start(&["restore".as_ref(), dir.as_os_str()]).finish()
}

fn once_each(before: &str, after: &str) {
    common::resume_rounds_once(&[before, after]);
}

/// A scratch folder, and in it a VM's API socket and its snapshot, taken
/// at [`SNAPSHOT_AT`] (`stop`: the VM then ends): the folder, the
/// socket, the snapshot, the VM and what `vnpu snapshot` said.
fn snapshotted(name: &str, stop: bool) -> (PathBuf, PathBuf, PathBuf, Running, String) {
    let d = scratch(name);
    let api = d.join("api.sock");
    let snap = d.join("snap");
    let vm = rounds_vm(&api);
    wait_socket(&api);
    vm.wait_for(SNAPSHOT_AT);
    let (code, said) = snapshot(&api, &snap, stop);
    assert_eq!(code, 0, "{said}\n--- the VM ---\n{}", vm.both());
    (d, api, snap, vm, said)
}

#[test]
fn a_vm_stopped_mid_inference_runs_on_from_its_snapshot_with_every_answer_the_cpus() {
    let _one = one_at_a_time();
    let (d, _api, snap, vm, said) = snapshotted("stop", true);
    assert!(said.contains("the VM stopped"), "{said}");
    let (code, before, err) = vm.finish();
    assert_eq!(code, 0, "{before}{err}");
    assert!(err.contains("stopped after its snapshot") && !before.contains(DONE), "{before}{err}");
    // A tenant's RAM and vNPU memories: this user's only.
    for (p, want) in
        [("", 0o700), ("ram", 0o600), ("vm.json", 0o600), ("vnpu-1", 0o700), ("vnpu-1/core0.sram", 0o600)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(snap.join(p)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, want, "{p}: {mode:o}");
    }
    // Run on in a new process, twice from the same snapshot: it is read,
    // never written.
    for _ in 0..2 {
        let (code, after, err) = restore(&snap);
        assert_eq!(code, 0, "{after}{err}");
        once_each(&before, &after);
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_snapshot_of_a_vm_that_runs_on_gives_a_second_run_from_that_point() {
    let _one = one_at_a_time();
    let (d, api, snap, vm, _said) = snapshotted("live", false);
    // Another snapshot into the same folder is refused; the VM runs on.
    let (code, said) = snapshot(&api, &snap, false);
    assert_ne!(code, 0);
    assert!(said.contains("not empty"), "{said}");
    let (code, whole, err) = vm.finish();
    assert_eq!(code, 0, "{whole}{err}");
    once_each(&whole, "");
    // The second run from the snapshot ends as the first did, with the
    // rounds after the snapshot's (at least rounds 151 to 199) once each.
    let (code, after, err) = restore(&snap);
    assert_eq!(code, 0, "{after}{err}");
    assert_eq!(after.matches(DONE).count(), 1, "{after}");
    for r in 151..ROUNDS {
        assert_eq!(after.matches(&format!("round {r}: agree=450/450")).count(), 1, "round {r}:\n{after}");
    }
    assert!(!after.contains("round 0:"), "{after}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A copy of the snapshot folder (sparse files kept sparse).
fn copy(from: &Path, to: &Path) {
    let ok = Command::new("cp").args(["-a", "--sparse=always"]).arg(from).arg(to).status().unwrap();
    assert!(ok.success());
}

#[test]
fn a_snapshot_of_another_version_or_a_corrupt_one_is_refused_with_the_reason() {
    let _one = one_at_a_time();
    let (d, _api, snap, vm, _said) = snapshotted("bad", true);
    assert_eq!(vm.finish().0, 0);
    let bad = |name: &str, spoil: &dyn Fn(&Path), want: &str| {
        let c = d.join(name);
        copy(&snap, &c);
        spoil(&c);
        let (code, said) = vnpu(&["restore".as_ref(), c.as_os_str()]);
        assert_ne!(code, 0, "{name}: restored:\n{said}");
        assert!(said.contains(want), "{name}: {want:?} not in:\n{said}");
        assert!(!said.contains("panicked"), "{name}:\n{said}");
    };
    let edit = |c: &Path, f: &dyn Fn(&mut serde_json::Value)| {
        let p = c.join("vm.json");
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    };
    bad("version", &|c| edit(c, &|v| v["version"] = 2.into()), "format version 2");
    bad("format", &|c| edit(c, &|v| v["format"] = "something".into()), "is not a VM snapshot");
    bad(
        "json",
        &|c| std::fs::write(c.join("vm.json"), b"{\"format\": \"vnpu-vm-snap").unwrap(),
        "is not a VM snapshot",
    );
    bad("board", &|c| edit(c, &|v| v["shape"]["board"]["core"]["vu_lanes"] = 0.into()), "its board");
    bad("field", &|c| edit(c, &|v| v["vcpu"] = serde_json::json!({})), "is not a VM snapshot");
    bad(
        "ram-byte",
        &|c| {
            use std::os::unix::fs::FileExt;
            // A byte of the guest's code (loaded at 1 MiB) changed.
            let f = std::fs::OpenOptions::new().write(true).open(c.join("ram")).unwrap();
            let mut b = [0u8; 1];
            std::fs::File::open(c.join("ram")).unwrap().read_exact_at(&mut b, (1 << 20) + 64).unwrap();
            f.write_all_at(&[b[0] ^ 0x5a], (1 << 20) + 64).unwrap();
        },
        "ram is corrupt",
    );
    bad(
        "ram-short",
        &|c| std::fs::File::options().write(true).open(c.join("ram")).unwrap().set_len(1 << 20).unwrap(),
        "the file is 1048576 bytes",
    );
    bad("no-vnpu", &|c| std::fs::remove_dir_all(c.join("vnpu-1")).unwrap(), "No such file");
    bad(
        "vnpu-record",
        &|c| {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new().write(true).open(c.join("vnpu-1/session")).unwrap();
            f.write_all_at(&[0xff; 8], 200).unwrap();
        },
        "vnpu-1/session is corrupt",
    );
    // The snapshot itself still restores.
    let (code, after, err) = restore(&snap);
    assert_eq!(code, 0, "{after}{err}");
    assert!(after.contains(DONE), "{after}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_vm_moved_through_five_processes_by_snapshots_answers_every_round_once() {
    let _one = one_at_a_time();
    let d = scratch("chain");
    // Each process runs until a round, is snapshotted and stops; the next
    // restores it and serves an API socket of its own, so a restored VM
    // (its vNPU's state in host memory now, its PCI state restored) is
    // snapshotted in turn.
    let mut console = String::new();
    let mut vm = rounds_vm(&d.join("api-0.sock"));
    wait_socket(&d.join("api-0.sock"));
    for hop in 0..5 {
        let api = d.join(format!("api-{hop}.sock"));
        let snap = d.join(format!("snap-{hop}"));
        vm.wait_for(&format!("round {}:", 30 * (hop + 1)));
        let (code, said) = snapshot(&api, &snap, true);
        assert_eq!(code, 0, "hop {hop}: {said}\n--- the VM ---\n{}", vm.both());
        let (code, out, err) = vm.finish();
        assert_eq!(code, 0, "hop {hop}: {out}{err}");
        console.push_str(&out);
        let next = d.join(format!("api-{}.sock", hop + 1));
        vm = Running::start(&[
            "restore".as_ref(),
            snap.as_os_str(),
            "--api-socket".as_ref(),
            next.as_os_str(),
        ]);
        wait_socket(&next);
    }
    let (code, out, err) = vm.finish();
    assert_eq!(code, 0, "{out}{err}");
    once_each(&console, &out);
    let _ = std::fs::remove_dir_all(&d);
}

/// A vNPU a board daemon serves: the VMM takes its state through the
/// daemon with vfio-user migration v2 (stop-and-copy, `MIG_DATA_READ`),
/// and the restored VMM, a new client of the same instance, gives it back
/// (`MIG_DATA_WRITE`) before the guest runs on.
#[test]
fn a_vm_with_a_daemon_served_vnpu_runs_on_from_its_snapshot() {
    let _one = one_at_a_time();
    let d = scratch("daemon");
    let (state, sockets) = (d.join("state"), d.join("state/sockets"));
    let uuid = common::vnpu(&state, &["create", "--type", "small"]).trim().to_string();
    let log = d.join("daemon.log");
    let daemon = common::daemon_logged(&state, &sockets, &log);
    let served = sockets.join(format!("{uuid}.sock"));
    wait_socket(&served);
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    let (api, snap) = (d.join("api.sock"), d.join("snap"));
    let g = guest("resume");
    let vm = Running::start(&[
        "run".as_ref(),
        "--memory".as_ref(),
        "64M".as_ref(),
        "--guest".as_ref(),
        g.as_os_str(),
        "--vnpu".as_ref(),
        format!("uuid={uuid}").as_ref(),
        "--state-dir".as_ref(),
        state.as_os_str(),
        "--api-socket".as_ref(),
        api.as_os_str(),
    ]);
    wait_socket(&api);
    vm.wait_for(SNAPSHOT_AT);
    let (code, out) = snapshot(&api, &snap, true);
    assert_eq!(code, 0, "{out}\n--- the VM ---\n{}\n--- the daemon ---\n{}", vm.both(), said());
    let (code, before, err) = vm.finish();
    assert_eq!(code, 0, "{before}{err}");
    assert!(snap.join("vnpu-1.stream").is_file(), "the device's stream is in the snapshot");
    let (code, after, err) = restore(&snap);
    assert_eq!(code, 0, "{after}{err}\n--- the daemon ---\n{}", said());
    once_each(&before, &after);
    assert!(common::terminate(daemon).success(), "{}", said());
    let _ = std::fs::remove_dir_all(&d);
}
