//! Snapshot and restore of a whole VM with its vNPU (docs/migration.md):
//! the digits guest classifies 450 images on its vNPU and on its CPU and
//! compares every answer; it is stopped mid-inference by `vnpu snapshot`
//! and run on by `vnpu restore` in a new process. The guest's own
//! comparison with its CPU is the reference: every answer must still
//! agree, and no part of the run may be done twice or skipped.

#![allow(clippy::unwrap_used)] // test helpers

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::guest;

const AGREE: &str = "digits: vNPU and CPU agree on every image";
const MLP: &str = "model=mlp agree=450/450 batch_agree=450/450";
const CNN: &str = "model=cnn agree=450/450 batch_agree=450/450";

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vnpu-snapshot-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `vnpu` process whose stdout is gathered as it comes.
struct Running {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl Running {
    fn start(args: &[&std::ffi::OsStr]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vnpu"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = Arc::new(Mutex::new(String::new()));
        for mut pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let out = Arc::clone(&out);
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut b) {
                    if n == 0 {
                        break;
                    }
                    out.lock().unwrap().push_str(&String::from_utf8_lossy(&b[..n]));
                }
            });
        }
        Self { child, out }
    }

    fn said(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn wait_for(&self, what: &str) {
        let t = Instant::now();
        while !self.said().contains(what) {
            assert!(t.elapsed() < Duration::from_secs(120), "never printed {what:?}:\n{}", self.said());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn finish(mut self) -> (i32, String) {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // The readers see the pipes close.
                std::thread::sleep(Duration::from_millis(50));
                return (s.code().unwrap_or(-1), self.said());
            }
            if t.elapsed() > Duration::from_secs(300) {
                let _ = self.child.kill();
                panic!("still running after 300 s:\n{}", self.said());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn digits_vm(api: &Path) -> Running {
    let g = guest("digits");
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

fn wait_socket(p: &Path) {
    let t = Instant::now();
    while !p.exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "no API socket at {}", p.display());
        std::thread::sleep(Duration::from_millis(2));
    }
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

fn restore(dir: &Path) -> (i32, String) {
    Running::start(&["restore".as_ref(), dir.as_os_str()]).finish()
}

/// Each line the run prints once, across the part before the snapshot
/// and the part after it: nothing done twice, nothing skipped.
fn once_each(before: &str, after: &str) {
    let both = format!("{before}{after}");
    for line in [MLP, CNN, AGREE] {
        assert_eq!(
            both.matches(line).count(),
            1,
            "{line:?} not printed exactly once:\n--- before ---\n{before}\n--- after ---\n{after}"
        );
    }
}

#[test]
fn a_vm_stopped_mid_inference_runs_on_from_its_snapshot_with_every_answer_the_cpus() {
    let d = scratch("stop");
    let api = d.join("api.sock");
    let snap = d.join("snap");
    let vm = digits_vm(&api);
    wait_socket(&api);
    // The MLP is done and the CNN's 450 requests are under way.
    vm.wait_for("model cnn");
    let (code, said) = snapshot(&api, &snap, true);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("the VM stopped"), "{said}");
    let (code, before) = vm.finish();
    assert_eq!(code, 0, "{before}");
    assert!(before.contains("stopped after its snapshot") && !before.contains(AGREE), "{before}");
    // Run on in a new process, twice from the same snapshot: it is read,
    // never written.
    for _ in 0..2 {
        let (code, after) = restore(&snap);
        assert_eq!(code, 0, "{after}");
        once_each(&before, &after);
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_snapshot_of_a_vm_that_runs_on_gives_a_second_run_from_that_point() {
    let d = scratch("live");
    let api = d.join("api.sock");
    let snap = d.join("snap");
    let vm = digits_vm(&api);
    wait_socket(&api);
    vm.wait_for("model mlp");
    let (code, said) = snapshot(&api, &snap, false);
    assert_eq!(code, 0, "{said}");
    let at_snapshot = vm.said();
    // Another snapshot into the same folder is refused; the VM runs on.
    let (code, said) = snapshot(&api, &snap, false);
    assert_ne!(code, 0);
    assert!(said.contains("not empty"), "{said}");
    let (code, whole) = vm.finish();
    assert_eq!(code, 0, "{whole}");
    assert!(whole.contains(AGREE), "{whole}");
    let (code, after) = restore(&snap);
    assert_eq!(code, 0, "{after}");
    // The second run goes on from the snapshot: the CNN and the verdict
    // once, the MLP's accuracy at most once (it may have been printed
    // before the snapshot).
    for line in [CNN, AGREE] {
        assert_eq!(after.matches(line).count(), 1, "{line:?}:\n{after}");
    }
    assert!(after.matches(MLP).count() <= 1, "{after}");
    assert!(at_snapshot.contains("model mlp"));
    let _ = std::fs::remove_dir_all(&d);
}

/// A copy of the snapshot folder (sparse files kept sparse).
fn copy(from: &Path, to: &Path) {
    let ok = Command::new("cp").args(["-a", "--sparse=always"]).arg(from).arg(to).status().unwrap();
    assert!(ok.success());
}

#[test]
fn a_snapshot_of_another_version_or_a_corrupt_one_is_refused_with_the_reason() {
    let d = scratch("bad");
    let api = d.join("api.sock");
    let snap = d.join("snap");
    let vm = digits_vm(&api);
    wait_socket(&api);
    vm.wait_for("model mlp");
    let (code, said) = snapshot(&api, &snap, true);
    assert_eq!(code, 0, "{said}");
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
    let (code, after) = restore(&snap);
    assert_eq!(code, 0, "{after}");
    assert!(after.contains(AGREE), "{after}");
    let _ = std::fs::remove_dir_all(&d);
}
