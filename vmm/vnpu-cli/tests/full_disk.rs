//! The board daemon on a full state disk (docs/vfio-user.md, "What the
//! daemon keeps"): the state directory on a small tmpfs that is filled at
//! the point each write the daemon makes needs a block. The daemon must
//! live through every one, the client whose write could not be kept must
//! get either a correct device that keeps nothing or a request that fails
//! with the reason, and another VM must be correct afterwards.
//!
//! Needs root (it mounts a tmpfs); skipped, saying so, where the mount is
//! refused.

#![allow(clippy::unwrap_used)] // test helpers

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;

use common::{control_line, finish_within, terminate, vm, wait_for};

/// A tmpfs of `size` mounted at `at`, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(at).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0755"), "tmpfs"])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(at.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system of `dir` with `name` until at most `leave` bytes
/// are free (0: until it refuses a byte more).
fn fill(dir: &Path, name: &str, leave: u64) -> PathBuf {
    let path = dir.join(name);
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
    let free = || {
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: statvfs(3) on a NUL-terminated path into a struct we own.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
        s.f_bavail * s.f_frsize
    };
    let chunk = vec![0xa5u8; 64 << 10];
    while free() > leave {
        let n = ((free() - leave) as usize).min(chunk.len());
        if f.write_all(&chunk[..n]).is_err() {
            break;
        }
    }
    // Single bytes until the file system refuses one, when asked to fill it.
    if leave == 0 {
        while f.write_all(&[0]).and_then(|()| f.flush()).is_ok() {}
    }
    path
}

fn vnpu(state: &Path, args: &[&str]) -> (i32, String, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).arg("--state-dir").arg(state).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until the daemon has forgotten instance `u`'s last session (its
/// client left): every session file but the record holds no block again.
/// The client's process exits before the daemon frees them, so a fill
/// measured before this would count blocks about to be freed.
fn forgotten(state: &Path, u: &str) {
    use std::os::unix::fs::MetadataExt;
    let dir = state.join("sessions").join(u);
    wait_for("the daemon to forget the session", || {
        std::fs::read_dir(&dir).unwrap().all(|e| {
            let e = e.unwrap();
            e.file_name() == "session" || e.metadata().is_ok_and(|m| m.blocks() == 0)
        })
    });
}

const DIGITS_OK: &str = "digits: vNPU and CPU agree on every image";

#[test]
fn a_full_state_disk_fails_what_it_must_and_kills_nothing() {
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-full-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let disk = root.join("disk");
    // 24 MiB: the state file, two instances' records, one 4 MiB SRAM, and
    // the HBM chunks a digits run writes (a few MiB).
    let Some(mounted) = Tmpfs::mount(&disk, "24m") else {
        eprintln!("skipped: cannot mount a tmpfs here (not root?)");
        return;
    };
    let state = disk.join("state");
    // The default socket folder, where `vnpu run` looks for the daemon.
    let sockets = state.join("sockets");
    let log = root.join("daemon.log");
    let said =
        || format!("\n--- the daemon's log ---\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    let create = |state: &Path| {
        let (code, out, err) = vnpu(state, &["create", "--type", "small"]);
        assert_eq!(code, 0, "{out}{err}");
        out.trim().to_string()
    };
    let first = create(&state);
    let second = create(&state);
    let third = create(&state);
    let d = common::daemon_logged(&state, &sockets, &log);
    let ctl = sockets.join("control.sock");
    for u in [&first, &second, &third] {
        let s = sockets.join(format!("{u}.sock"));
        wait_for("an instance's socket", || s.exists());
    }
    let alive = || {
        let reply = control_line(&ctl, b"{\"op\":\"list\"}\n");
        assert_eq!(
            reply.first().map(|r| r["ok"].clone()),
            Some(serde_json::Value::Bool(true)),
            "{reply:?}{}",
            said()
        );
    };

    // 1. The disk full: the state file cannot take a new instance. The
    // create fails with the reason; nothing already there is lost.
    let filler = fill(&disk, "filler", 0);
    let (code, out, err) = vnpu(&state, &["create", "--type", "small"]);
    assert_ne!(code, 0, "a create on a full disk succeeded: {out}");
    assert!(err.contains("No space left") || err.contains("space"), "{err}");
    alive();
    let (code, out, err) = vnpu(&state, &["list"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&first) && out.contains(&second) && out.contains(&third), "{out}");

    // 2. Still full: a VM attaches, and neither its session record nor
    // its SRAM can be allocated. Its device keeps nothing (it cannot be
    // resumed after a restart) and is correct.
    let (code, out) = finish_within(vm(&state, "digits", &first), Duration::from_secs(300));
    assert_eq!(code, 0, "{out}{}", said());
    assert!(out.contains(DIGITS_OK), "{out}");
    alive();
    forgotten(&state, &first);
    assert!(said().contains("cannot be resumed"), "the daemon did not say the session is not kept{}", said());

    // 2b. Room for the record only: the SRAM cannot be allocated; again a
    // correct device that keeps nothing.
    std::fs::remove_file(&filler).unwrap();
    let filler = fill(&disk, "filler", 1 << 20);
    let (code, out) = finish_within(vm(&state, "digits", &first), Duration::from_secs(300));
    assert_eq!(code, 0, "{out}{}", said());
    assert!(out.contains(DIGITS_OK), "{out}");
    alive();
    forgotten(&state, &first);
    assert!(said().contains("memories"), "the daemon did not say the core's memories are not kept{}", said());

    // 3. Room for the record and the SRAM, not for a chunk of HBM: a
    // compiled model's load program (its weights go to HBM) fails with
    // the reason, the daemon lives.
    std::fs::remove_file(&filler).unwrap();
    let model = root.join("mlp.vnpu");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/onnx");
    let compiled = Command::new(env!("CARGO_BIN_EXE_vnpu"))
        .arg("compile")
        .arg(fixtures.join("digits-mlp.onnx"))
        .args(["--output", "probabilities", "--batch", "450", "--vnpu", "sa=1,vu=1,sram=4M,hbm=1G", "-o"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let filler = fill(&disk, "filler", (4 << 20) + (256 << 10));
    let infer = |u: &str| {
        Command::new(env!("CARGO_BIN_EXE_vnpu"))
            .arg("infer")
            .arg(&model)
            .arg("--input")
            .arg(fixtures.join("digits-x.npy"))
            .arg("--attach")
            .arg(sockets.join(format!("{u}.sock")))
            .output()
            .unwrap()
    };
    let run = infer(&second);
    let told = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(!run.status.success(), "a load whose HBM could not be stored succeeded:\n{told}{}", said());
    // The device's message for the request reaches the guest's error.
    assert!(
        told.contains("loading the weights") && told.contains("hbm store") && told.contains("No space left"),
        "the client was not told why:\n{told}"
    );
    alive();
    forgotten(&state, &second);

    // 3b. Room for the session's files and the HBM chunks the run writes,
    // not a page more: its programs cannot be stored. The run is correct,
    // and its session is marked not kept. (Room for 1 to 4 chunks of HBM
    // is tried in turn: the first that lets the run through leaves no
    // page for the program.)
    std::fs::remove_file(&filler).unwrap();
    let mut stored = None;
    for chunks in 1..=4u64 {
        // The client (a page), the record (a page), the SRAM, the chunks.
        let filler = fill(&disk, "filler", (8 << 10) + (4 << 20) + (chunks << 20));
        let run = infer(&third);
        forgotten(&state, &third);
        std::fs::remove_file(&filler).unwrap();
        if run.status.success() {
            stored = Some(chunks);
            break;
        }
    }
    assert!(stored.is_some(), "the run never went through{}", said());
    assert!(said().contains("storing program"), "the daemon did not say the program is not kept{}", said());
    alive();

    // 4. Room again: the third instance's VM is correct, as is the second's
    // own next run: nothing of the failures stayed behind.
    let (code, out) = finish_within(vm(&state, "digits", &third), Duration::from_secs(300));
    assert_eq!(code, 0, "{out}{}", said());
    assert!(out.contains(DIGITS_OK), "{out}");
    let run = infer(&second);
    assert!(run.status.success(), "{}{}", String::from_utf8_lossy(&run.stderr), said());
    alive();
    assert!(terminate(d).success(), "{}", said());
    drop(mounted);
    let _ = std::fs::remove_dir_all(&root);
}
