//! Helpers shared by the daemon tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path;
use std::process::Child;
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
