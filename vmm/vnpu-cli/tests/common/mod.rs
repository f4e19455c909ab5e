//! Helpers shared by the daemon tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon process, killed if a test fails before it terminates it.
pub struct Daemon(pub Option<Child>);

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn terminate(mut d: Daemon) -> std::process::ExitStatus {
    let mut c = d.0.take().unwrap();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    c.wait().unwrap()
}

pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn control_line(sock: &Path, lines: &[u8]) -> Vec<serde_json::Value> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    s.write_all(lines).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    std::io::BufReader::new(s).lines().map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect()
}

/// A daemon of `state` serving at `sockets`, its stderr in `log`.
pub fn daemon_logged(state: &Path, sockets: &Path, log: &Path) -> Daemon {
    let child = Command::new(env!("CARGO_BIN_EXE_vnpu"))
        .args(["daemon", "--state-dir"])
        .arg(state)
        .arg("--socket-dir")
        .arg(sockets)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    Daemon(Some(child))
}

/// The daemon's log (appended to).
pub fn daemon_log(state: &Path) -> std::fs::File {
    std::fs::create_dir_all(state).unwrap();
    std::fs::OpenOptions::new().create(true).append(true).open(state.join("daemon.log")).unwrap()
}

/// What the daemon logged so far, for a failure message.
pub fn daemon_said(state: &Path) -> String {
    let log = std::fs::read_to_string(state.join("daemon.log")).unwrap_or_default();
    format!("\n--- the daemon's log ---\n{log}")
}

pub fn guest(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../guest-images/target/x86_64-unknown-none/release")
        .join(name);
    assert!(p.exists(), "guest {} missing: run scripts/build-guests.sh first", p.display());
    p
}

/// A VM as its own `vnpu run` process, attached to instance `uuid`.
pub fn vm(state: &Path, guest_name: &str, uuid: &str) -> Child {
    vm_with(state, guest_name, &[uuid])
}

/// A VM as its own `vnpu run` process with a vNPU per instance of `uuids`.
pub fn vm_with(state: &Path, guest_name: &str, uuids: &[&str]) -> Child {
    vm_args(state, guest_name, uuids, &[])
}

/// As [`vm_with`], with `extra` arguments to `vnpu run`.
pub fn vm_args(state: &Path, guest_name: &str, uuids: &[&str], extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_vnpu"))
        .args(["run", "--memory", "64M", "--guest"])
        .arg(guest(guest_name))
        .args(uuids.iter().flat_map(|u| ["--vnpu".to_string(), format!("uuid={u}")]))
        .args(extra)
        .arg("--state-dir")
        .arg(state)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// As [`finish`], but a VM still running after `limit` is killed and
/// the test fails (a hang is the bug these tests look for).
pub fn finish_within(mut c: Child, limit: Duration) -> (i32, String) {
    let t = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = c.kill();
            let (_, out) = finish(c);
            panic!("the VM still ran {} s later:\n{out}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    finish(c)
}

pub fn finish(c: Child) -> (i32, String) {
    let out = c.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

pub fn vnpu(state: &Path, args: &[&str]) -> String {
    let out =
        Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).arg("--state-dir").arg(state).output().unwrap();
    assert!(out.status.success(), "vnpu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}
