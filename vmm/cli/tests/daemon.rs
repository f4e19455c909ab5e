//! `vnpu daemon` as a process: it serves the started instances of its
//! state directory at SOCKET_DIR/UUID.sock, follows `vnpu start/stop`,
//! keeps serving a definition across a restart, and removes its sockets
//! on SIGTERM.

#![allow(clippy::unwrap_used)] // test helpers

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_user::Client;

fn vnpu(state: &Path, args: &[&str]) -> String {
    let out =
        Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).arg("--state-dir").arg(state).output().unwrap();
    assert!(out.status.success(), "vnpu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn daemon(state: &Path, sockets: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_vnpu"))
        .args(["daemon", "--state-dir"])
        .arg(state)
        .arg("--socket-dir")
        .arg(sockets)
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn vendor_and_magic(sock: &Path) -> (u16, u32) {
    let mut c = Client::new(sock).unwrap();
    let mut id = [0u8; 2];
    c.region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut id).unwrap();
    let mut magic = [0u8; 4];
    c.region_read(0, vnpu_abi::device::regs::MAGIC, &mut magic).unwrap();
    (u16::from_le_bytes(id), u32::from_le_bytes(magic))
}

fn terminate(mut d: Child) -> std::process::ExitStatus {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
    d.wait().unwrap()
}

#[test]
fn the_daemon_serves_started_instances_and_follows_start_and_stop() {
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-daemon-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (state, sockets) = (root.join("state"), root.join("sockets"));
    let uuid = vnpu(&state, &["define", "--spec", "sa=1,vu=1,sram=4M,hbm=256M"]).trim().to_string();
    vnpu(&state, &["start", &uuid]);
    let d = daemon(&state, &sockets);
    let sock = sockets.join(format!("{uuid}.sock"));
    wait_for("the instance's socket", || sock.exists());
    assert_eq!(vendor_and_magic(&sock), (vnpu_abi::device::VENDOR_ID, vnpu_abi::device::MAGIC));

    // A second instance started while the daemon runs is served too.
    let other = vnpu(&state, &["create", "--spec", "sa=2,vu=2,sram=4M,hbm=256M"]).trim().to_string();
    let other_sock = sockets.join(format!("{other}.sock"));
    wait_for("the new instance's socket", || other_sock.exists());
    assert_eq!(vendor_and_magic(&other_sock).0, vnpu_abi::device::VENDOR_ID);

    // Stopped: its socket goes, and a client attached to it is disconnected.
    let mut attached = Client::new(&other_sock).unwrap();
    vnpu(&state, &["stop", &other]);
    wait_for("the stopped instance's socket to go", || !other_sock.exists());
    let mut b = [0u8; 2];
    assert!(attached.region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut b).is_err());

    // SIGTERM: exit 0, sockets removed; a restarted daemon serves the
    // defined, started instance again.
    let status = terminate(d);
    assert!(status.success(), "{status}");
    assert!(!sock.exists());
    let d = daemon(&state, &sockets);
    wait_for("the socket after a restart", || sock.exists());
    assert_eq!(vendor_and_magic(&sock).0, vnpu_abi::device::VENDOR_ID);
    assert!(terminate(d).success());
    let _ = std::fs::remove_dir_all(&root);
}
