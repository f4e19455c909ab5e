//! Helpers shared by the daemon tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
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

/// A pipe from the child, and what has come through one so far.
type Pipe = Box<dyn Read + Send>;
type Gathered = Arc<Mutex<String>>;

/// A `vnpu` process whose stdout and stderr are gathered as they come.
pub struct Running {
    pub child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
}

impl Running {
    pub fn start(args: &[&std::ffi::OsStr]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vnpu"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (out, err) = (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
        let pipes: [(Pipe, &Gathered); 2] =
            [(Box::new(child.stdout.take().unwrap()), &out), (Box::new(child.stderr.take().unwrap()), &err)];
        for (mut pipe, to) in pipes {
            let to = Arc::clone(to);
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut b) {
                    if n == 0 {
                        break;
                    }
                    to.lock().unwrap().push_str(&String::from_utf8_lossy(&b[..n]));
                }
            });
        }
        Self { child, out, err }
    }

    /// What it printed on stdout (the guest's console) so far.
    pub fn said(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    pub fn both(&self) -> String {
        format!("{}\n--- stderr ---\n{}", self.said(), self.err.lock().unwrap())
    }

    pub fn wait_for(&self, what: &str) {
        let t = Instant::now();
        while !self.said().contains(what) {
            assert!(self.child_alive(), "ended before printing {what:?}:\n{}", self.both());
            assert!(t.elapsed() < Duration::from_secs(120), "never printed {what:?}:\n{}", self.both());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Waits until this process itself printed `n` lines that start with
    /// `prefix`. A migrated guest's round numbers go on from wherever the
    /// source left them, and the source runs for as long as pre-copy
    /// takes, so a fixed round number may have gone by on the source.
    pub fn wait_lines(&self, prefix: &str, n: usize) {
        let t = Instant::now();
        while self.said().lines().filter(|l| l.starts_with(prefix)).count() < n {
            assert!(self.child_alive(), "ended before printing {n} lines {prefix:?}:\n{}", self.both());
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "never printed {n} lines {prefix:?}:\n{}",
                self.both()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub fn child_alive(&self) -> bool {
        // SAFETY: kill(2) with signal 0 only checks that the process exists.
        unsafe { libc::kill(self.child.id() as i32, 0) == 0 }
    }

    /// Exit code, stdout and stderr.
    pub fn finish(mut self) -> (i32, String, String) {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // The readers see the pipes close.
                std::thread::sleep(Duration::from_millis(50));
                let err = self.err.lock().unwrap().clone();
                return (s.code().unwrap_or(-1), self.said(), err);
            }
            if t.elapsed() > Duration::from_secs(300) {
                let _ = self.child.kill();
                panic!("still running after 300 s:\n{}", self.both());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Waits for a socket (or any file) at `p`.
pub fn wait_socket(p: &Path) {
    let t = Instant::now();
    while !p.exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "no API socket at {}", p.display());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Rounds of the `resume` guest (`guest-apps/src/bin/resume.rs`).
pub const RESUME_ROUNDS: usize = 200;
pub const RESUME_DONE: &str = "rounds=200 images=90000 all_agree=true";

/// Every round of the `resume` guest once, in order, with every answer
/// equal to the CPU's, across the consoles of the processes it ran in
/// one after another (a line cut by a move joins up): nothing done
/// twice, nothing skipped.
pub fn resume_rounds_once(parts: &[&str]) {
    let all = parts.concat();
    let why =
        || parts.iter().enumerate().map(|(i, p)| format!("--- process {i} ---\n{p}\n")).collect::<String>();
    let rounds: Vec<&str> = all.lines().filter(|l| l.starts_with("round ")).collect();
    assert_eq!(rounds.len(), RESUME_ROUNDS, "{}", why());
    for (r, l) in rounds.iter().enumerate() {
        assert!(l.starts_with(&format!("round {r}: agree=450/450 retried=0")), "round {r}: {l:?}\n{}", why());
    }
    assert_eq!(all.matches(RESUME_DONE).count(), 1, "{}", why());
}
