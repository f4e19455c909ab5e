//! The board daemon against hostile or unwanted control clients
//! (docs/isolation.md, "The board daemon against its clients"): descriptor
//! exhaustion, idle connections holding every slot, clients of other
//! users, a second VMM on a served instance. Apart from `daemon.rs` so
//! that these daemons do not run beside that file's timing-sensitive VM
//! tests.

#![allow(clippy::unwrap_used)] // test helpers

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{control_line, daemon_log, daemon_said, finish_within, terminate, vm, vnpu, wait_for, Daemon};
use vfio_user::Client;

/// Starts `cmd` (a `vnpu daemon` command line, maybe behind a wrapper) on
/// `state` and `sockets`, logging to the state directory; returns it and
/// its control socket once that answers.
fn start(mut cmd: Command, state: &std::path::Path, sockets: &std::path::Path) -> (Daemon, PathBuf) {
    cmd.arg("--state-dir").arg(state).arg("--socket-dir").arg(sockets);
    let child = cmd.stdout(Stdio::null()).stderr(daemon_log(state)).spawn().unwrap();
    let d = Daemon(Some(child));
    let ctl = sockets.join("control.sock");
    wait_for("the control socket", || std::os::unix::net::UnixStream::connect(&ctl).is_ok());
    (d, ctl)
}

/// Descriptors exhausted by idle control connections (the daemon runs
/// with 48 open files): its accept loop waits the exhaustion out, and once
/// the connections close the daemon answers again. It used to stop
/// accepting for good on its first `EMFILE`, so the management plane stayed
/// dead after the attacker had gone.
#[test]
fn the_control_socket_outlives_descriptor_exhaustion() {
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-emfile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (state, sockets) = (root.join("state"), root.join("sockets"));
    std::fs::create_dir_all(&state).unwrap();
    let mut cmd = Command::new("prlimit");
    cmd.args(["--nofile=48:48", "--"]).arg(env!("CARGO_BIN_EXE_vnpu")).arg("daemon");
    let (d, ctl) = start(cmd, &state, &sockets);
    // More idle connections than the daemon has descriptors for.
    let held: Vec<_> = (0..80).filter_map(|_| std::os::unix::net::UnixStream::connect(&ctl).ok()).collect();
    assert!(held.len() > 40, "only {} connections queued", held.len());
    std::thread::sleep(Duration::from_millis(500));
    drop(held);
    // The daemon itself answers again, without a restart (not a command
    // falling back to the state directory: the socket, directly).
    let t = Instant::now();
    let reply = loop {
        match std::os::unix::net::UnixStream::connect(&ctl) {
            Ok(_) => break control_line(&ctl, b"{\"op\":\"list\"}\n"),
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "the control socket refuses: {e}{}",
                    daemon_said(&state)
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    assert_eq!(reply.len(), 1, "{reply:?}");
    assert_eq!(reply[0]["ok"], serde_json::Value::Bool(true), "{reply:?}");
    assert!(
        daemon_said(&state).contains("accept failed"),
        "the daemon never ran out: {}",
        daemon_said(&state)
    );
    assert!(terminate(d).success());
    let _ = std::fs::remove_dir_all(&root);
}

/// Idle control connections give their slot up: with every one of the
/// 32 slots held by a client that sends nothing, a newcomer takes the slot
/// of the one idle longest, and the rest are closed once they have idled
/// `--control-idle-ms` (they used to hold the slots for as long as they
/// liked, locking every operator out; then until they timed out).
#[test]
fn idle_control_connections_give_their_slots_up() {
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-idle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (state, sockets) = (root.join("state"), root.join("sockets"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnpu"));
    cmd.args(["daemon", "--control-idle-ms", "300"]);
    let (d, ctl) = start(cmd, &state, &sockets);
    // The connections `start` probed with are gone first.
    std::thread::sleep(Duration::from_millis(400));
    let mut held: Vec<_> = (0..32).map(|_| std::os::unix::net::UnixStream::connect(&ctl).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(150));
    // Every slot is held by a client idle for longer than the eviction
    // bound: a 33rd client that asks is served at once (it used to be
    // refused until the idle clients timed out), and the client idle
    // longest loses its connection for it.
    let t = Instant::now();
    let mut line = String::new();
    let mut s = std::os::unix::net::UnixStream::connect(&ctl).unwrap();
    std::io::Write::write_all(&mut s, b"{\"op\":\"list\"}\n").unwrap();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(s), &mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "not served with every slot held: {line}{}", daemon_said(&state));
    assert!(t.elapsed() < Duration::from_secs(5), "served only after {:?}", t.elapsed());
    held[0].set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 1];
    assert!(
        matches!(std::io::Read::read(&mut held[0], &mut b), Ok(0) | Err(_)),
        "the oldest still holds a slot"
    );
    // The rest are closed by the idle bound (300 ms here) on their own.
    for c in &mut held[1..] {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(matches!(std::io::Read::read(c, &mut b), Ok(0) | Err(_)), "an idle client was never closed");
    }
    drop(held);
    assert!(terminate(d).success());
    let _ = std::fs::remove_dir_all(&root);
}

/// The control socket checks its clients' credentials, not only the
/// socket file's mode: with the file opened to everyone, a client of
/// another user is refused, and allowed once the daemon names a group it
/// is in (`--control-group`). Needs root (to run the client as `nobody`).
#[test]
fn the_control_socket_serves_root_the_daemons_user_and_its_group_only() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: cannot run a client as another user");
        return;
    }
    let nobody = 65_534;
    let runs_as_nobody = Command::new(env!("CARGO_BIN_EXE_vnpu"))
        .arg("--version")
        .uid(nobody)
        .gid(nobody)
        .output()
        .is_ok_and(|o| o.status.success());
    if !runs_as_nobody || group_missing("nogroup") {
        eprintln!("`nobody` cannot run the binary here (or no `nogroup`): skipped");
        return;
    }
    for (group, allowed) in [(None, false), (Some("nogroup"), true)] {
        let root: PathBuf = std::env::temp_dir().join(format!("vnpu-peer-{}-{allowed}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (state, sockets, theirs) = (root.join("state"), root.join("sockets"), root.join("theirs"));
        for d in [&root, &sockets, &theirs] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap();
        }
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnpu"));
        cmd.arg("daemon");
        if let Some(g) = group {
            cmd.args(["--control-group", g]);
        }
        let (d, ctl) = start(cmd, &state, &sockets);
        std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o777)).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_vnpu"))
            .args(["list", "--json", "--state-dir"])
            .arg(&theirs)
            .arg("--socket-dir")
            .arg(&sockets)
            .uid(nobody)
            .gid(nobody)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        if allowed {
            assert!(out.status.success(), "a member of the control group: {said}{}", daemon_said(&state));
        } else {
            assert_eq!(out.status.code(), Some(1), "a stranger was served: {said}");
            assert!(said.contains("not allowed to manage"), "{said}");
        }
        assert!(terminate(d).success());
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// Whether the host lacks group `name`.
fn group_missing(name: &str) -> bool {
    !std::fs::read_to_string("/etc/group")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(':').next() == Some(name))
}

/// A second VMM on an instance that serves one already is refused at once
/// with `EBUSY` (it used to wait unanswered in the listen queue for as long
/// as the first stayed, and `vnpu run` said nothing); `vnpu run` names the
/// reason. The first client keeps its vNPU, and a VM on another instance of
/// the same daemon gets its CPU reference's results meanwhile.
#[test]
fn a_second_vmm_on_a_served_instance_is_refused_at_once() {
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-second-vmm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // The default socket directory, where `vnpu run` looks.
    let state = root.join("state");
    let sockets = state.join("sockets");
    let held = vnpu(&state, &["create", "--type", "small"]).trim().to_string();
    let other = vnpu(&state, &["create", "--type", "small"]).trim().to_string();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnpu"));
    cmd.arg("daemon");
    let (d, _) = start(cmd, &state, &sockets);
    let sock = sockets.join(format!("{held}.sock"));
    wait_for("the instance's socket", || sock.exists());
    let mut first = Client::new(&sock).unwrap();
    let bystander = vm(&state, "digits", &other);

    let t = Instant::now();
    let second = Client::new_with_timeout(&sock, Some(Duration::from_secs(30)));
    let waited = t.elapsed();
    assert!(
        matches!(second, Err(vfio_user::Error::Reply { errno, .. }) if errno == libc::EBUSY.unsigned_abs()),
        "{:?}",
        second.err()
    );
    assert!(waited < Duration::from_secs(5), "refused only after {waited:?}");

    let (code, out) = finish_within(vm(&state, "digits", &held), Duration::from_secs(60));
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("serves another VMM"), "{out}");

    // The first client still has its vNPU.
    let mut magic = [0u8; 4];
    first.region_read(0, vnpu_abi::device::regs::MAGIC, &mut magic).unwrap();
    assert_eq!(u32::from_le_bytes(magic), vnpu_abi::device::MAGIC);
    let (code, next_door) = finish_within(bystander, Duration::from_secs(600));
    assert_eq!(code, 0, "{next_door}");
    assert!(next_door.contains("digits: vNPU and CPU agree on every image"), "{next_door}");

    // Once the first leaves, the instance takes the next VMM.
    drop(first);
    let (code, out) = finish_within(vm(&state, "digits", &held), Duration::from_secs(600));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("digits: vNPU and CPU agree on every image"), "{out}");
    assert!(terminate(d).success());
    let _ = std::fs::remove_dir_all(&root);
}

/// One daemon, every client-side attack at once on everything but one
/// instance, and a VM on that instance (a bystander) running from start
/// to end inside the attacks: idle and churned control connections and
/// garbage requests; idle, pipelined and oversized `/metrics` clients;
/// on the other instance's socket a client that maps the most memory it
/// may, offers a pipe as an interrupt trigger, sends garbage and
/// reconnects, and a second VMM that is refused. The bystander's results
/// must equal its CPU reference, and `vnpu list` and a scrape must answer
/// during the attacks. The daemon runs with `--seccomp kill`.
#[test]
fn a_bystander_vm_is_correct_while_every_client_attack_runs() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-bystander-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let state = root.join("state");
    let sockets = state.join("sockets");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnpu"));
    // With the seccomp filter killing the daemon on any call outside its
    // list: every path these attacks and the VM reach must be on it.
    cmd.args(["daemon", "--metrics", &metrics.to_string(), "--seccomp", "kill"]);
    let (d, ctl) = start(cmd, &state, &sockets);
    let victim = vnpu(&state, &["create", "--type", "small"]).trim().to_string();
    let bystander = vnpu(&state, &["create", "--type", "small"]).trim().to_string();
    let victim_sock = sockets.join(format!("{victim}.sock"));
    wait_for("the victim's socket", || victim_sock.exists());

    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    let mut attack = |f: Box<dyn Fn(&AtomicBool) + Send>| {
        let stop = Arc::clone(&stop);
        attackers.push(std::thread::spawn(move || f(&stop)));
    };
    let c = ctl.clone();
    attack(Box::new(move |stop| {
        // Idle and churned control connections.
        let mut held = std::collections::VecDeque::new();
        while !stop.load(Ordering::SeqCst) {
            if let Ok(s) = UnixStream::connect(&c) {
                held.push_back(s);
            }
            if held.len() > 64 {
                held.pop_front();
            }
            // 100 new connections a second: fewer than the 32 slots turn
            // over within the 100 ms a holder must idle to be evicted
            // (faster churn is measured in docs/benchmarks.md).
            std::thread::sleep(Duration::from_millis(10));
        }
    }));
    let c = ctl.clone();
    attack(Box::new(move |stop| {
        // Garbage control requests.
        while !stop.load(Ordering::SeqCst) {
            if let Ok(mut s) = UnixStream::connect(&c) {
                let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = s.write_all(
                    &[b"{\"op\":\"remap\",\"uuid\":\"x\",\"sa\":0}\n".repeat(16), b"\xff\xfe\n".to_vec()]
                        .concat(),
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }));
    attack(Box::new(move |stop| {
        // Idle, pipelined and oversized /metrics clients.
        let mut held = Vec::new();
        let big = vec![b'a'; 1 << 16];
        while !stop.load(Ordering::SeqCst) {
            for _ in 0..20 {
                if let Ok(s) = TcpStream::connect(metrics) {
                    held.push(s);
                }
            }
            held.truncate(600);
            if let Ok(mut s) = TcpStream::connect(metrics) {
                let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = s.write_all(&b"GET /metrics HTTP/1.1\r\n\r\n".repeat(500));
                let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nX: ");
                for _ in 0..16 {
                    if s.write_all(&big).is_err() {
                        break;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }));
    let v = victim_sock.clone();
    attack(Box::new(move |stop| {
        // The other instance's client: the most memory it may map, a pipe
        // as an interrupt trigger, garbage, reconnecting.
        while !stop.load(Ordering::SeqCst) {
            let Ok(mut client) = Client::new_with_timeout(&v, Some(Duration::from_secs(5))) else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            // SAFETY: memfd_create with a NUL-terminated name; checked.
            let fd = unsafe { libc::memfd_create(c"attack".as_ptr(), libc::MFD_ALLOW_SEALING) };
            if fd >= 0 {
                // SAFETY: `fd` is ours alone.
                let f = unsafe { std::fs::File::from_raw_fd(fd) };
                let _ = f.set_len(64 << 30);
                // SAFETY: seals our own memfd.
                unsafe {
                    libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)
                };
                let _ = client.dma_map(0, 0, 64 << 30, f.as_raw_fd());
                let _ = client.dma_map(0, 1 << 40, 1 << 40, f.as_raw_fd());
            }
            let mut p = [0i32; 2];
            // SAFETY: pipe(2) into a two-element array.
            if unsafe { libc::pipe(p.as_mut_ptr()) } == 0 {
                // SAFETY: both ends are ours alone.
                let (r, w) = unsafe { (std::fs::File::from_raw_fd(p[0]), std::fs::File::from_raw_fd(p[1])) };
                let _ = client.set_irqs(2, 4 | 32, 0, 1, &[w.as_raw_fd()]);
                drop((r, w));
            }
            drop(client);
            if let Ok(mut s) = UnixStream::connect(&v) {
                let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = s.write_all(&[0xa5; 4096]);
            }
        }
    }));
    std::thread::sleep(Duration::from_millis(500));

    let vm = vm(&state, "digits", &bystander);
    // Management answers during the attacks.
    let t = Instant::now();
    let listed = vnpu(&state, &["list", "--json"]);
    assert!(listed.contains(&bystander), "{listed}");
    eprintln!("vnpu list under attack: {:?}", t.elapsed());
    let t = Instant::now();
    let mut scraped = String::new();
    loop {
        let mut s = TcpStream::connect(metrics).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        scraped.clear();
        let _ = s.read_to_string(&mut scraped);
        if scraped.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no scrape answered under attack: {scraped}");
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("a scrape under attack: {:?}", t.elapsed());
    // No client punched a hole in its memory here: nothing was lost.
    assert!(scraped.contains("vnpu_dma_mappings_lost_total{} 0"), "{scraped}");
    let (code, out) = finish_within(vm, Duration::from_secs(600));
    stop.store(true, Ordering::SeqCst);
    for a in attackers {
        a.join().unwrap();
    }
    let said = daemon_said(&state);
    assert_eq!(code, 0, "{out}{said}");
    for want in [
        "accuracy vnpu=0.9733 cpu=0.9733 model=mlp agree=450/450 batch_agree=450/450",
        "accuracy vnpu=0.9911 cpu=0.9911 model=cnn agree=450/450 batch_agree=450/450",
        "digits: vNPU and CPU agree on every image",
    ] {
        assert!(out.contains(want), "{want} missing:\n{out}");
    }
    // Every daemon thread runs under the daemon's filter, and each
    // instance's serving thread under the narrower instance filter too
    // (`Seccomp_filters` counts the filters stacked on a thread).
    let pid = d.0.as_ref().unwrap().id();
    let mut kinds = std::collections::BTreeMap::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        // A thread that ended since the listing (a request's thread) has
        // nothing left to read.
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(t.path().join("comm")),
            std::fs::read_to_string(t.path().join("status")),
        ) else {
            continue;
        };
        let comm = comm.trim().to_string();
        let filters: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp_filters:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let kind = if comm.starts_with("vfio-user") && !comm.starts_with("vfio-user accep") {
            "instance"
        } else {
            "other"
        };
        kinds.entry(kind).or_insert_with(Vec::new).push((comm, filters));
    }
    assert!(kinds["other"].iter().all(|(_, f)| *f >= 1), "{kinds:?}");
    assert!(kinds.get("instance").is_some_and(|v| v.iter().all(|(_, f)| *f >= 2)), "{kinds:?}");
    // The daemon is still whole: it answers and stops cleanly.
    let reply = control_line(&ctl, b"{\"op\":\"list\"}\n");
    assert_eq!(
        reply.first().map(|r| r["ok"].clone()),
        Some(serde_json::Value::Bool(true)),
        "{reply:?}{said}"
    );
    assert!(terminate(d).success(), "{said}");
    let _ = std::fs::remove_dir_all(&root);
}

/// `vnpu stop` of an instance a client is attached to asks that client to
/// let go first (the device-request interrupt, index 4, which QEMU answers
/// by unplugging the device from its guest): a client that lets go ends
/// the instance at once, one that ignores the request is cut off at
/// `--release-timeout-ms`, and one that gave no request trigger is cut off
/// at once. The daemon used to cut every client off at once.
#[test]
fn a_stopped_instance_asks_its_client_to_release_the_device() {
    use std::os::fd::AsRawFd;
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-release-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let state = root.join("state");
    let sockets = state.join("sockets");
    let uuids: Vec<String> =
        (0..3).map(|_| vnpu(&state, &["create", "--type", "small"]).trim().to_string()).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnpu"));
    cmd.args(["daemon", "--release-timeout-ms", "2000"]);
    let (d, _) = start(cmd, &state, &sockets);
    let sock = |u: &str| sockets.join(format!("{u}.sock"));
    for u in &uuids {
        wait_for("the instance's socket", || sock(u).exists());
    }
    const REQ: u32 = 4;
    const TRIGGER_EVENTFD: u32 = 32 | 4;
    let attach = |u: &str, trigger: bool| {
        let mut c = Client::new(&sock(u)).unwrap();
        let info = c.get_irq_info(REQ).unwrap();
        assert_eq!(info.count, 1, "the request index has one vector");
        // SAFETY: eventfd(2) has no memory effects; it returns a fresh
        // descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) };
        assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is that fresh descriptor, which the File then owns.
        let efd = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        if trigger {
            c.set_irqs(REQ, TRIGGER_EVENTFD, 0, 1, &[efd.as_raw_fd()]).unwrap();
        }
        (c, efd)
    };
    let raised = |mut efd: &std::fs::File| {
        use std::io::Read;
        let t = Instant::now();
        loop {
            let mut n = [0u8; 8];
            if efd.read_exact(&mut n).is_ok() {
                return (u64::from_ne_bytes(n), t.elapsed());
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no device request{}", daemon_said(&state));
            std::thread::sleep(Duration::from_millis(10));
        }
    };

    // Lets go when asked: the instance ends then, well before its deadline.
    let (c, efd) = attach(&uuids[0], true);
    vnpu(&state, &["stop", &uuids[0]]);
    let (n, _) = raised(&efd);
    assert_eq!(n, 1);
    assert!(sock(&uuids[0]).exists(), "cut off before it could let go");
    drop(c);
    let t = Instant::now();
    wait_for("the released instance's socket to go", || !sock(&uuids[0]).exists());
    assert!(t.elapsed() < Duration::from_millis(1500), "ended {:?} after the client let go", t.elapsed());

    // Ignores the request: cut off at the deadline, not before.
    let (mut c, efd) = attach(&uuids[1], true);
    let t = Instant::now();
    vnpu(&state, &["stop", &uuids[1]]);
    raised(&efd);
    let mut magic = [0u8; 4];
    c.region_read(0, vnpu_abi::device::regs::MAGIC, &mut magic).unwrap();
    wait_for("the ignoring client to be cut off", || !sock(&uuids[1]).exists());
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(1900), "cut off after {waited:?}, before the 2 s deadline");
    assert!(c.region_read(0, vnpu_abi::device::regs::MAGIC, &mut magic).is_err(), "still served");
    assert!(daemon_said(&state).contains("did not release the device in time"), "{}", daemon_said(&state));

    // No request trigger: nobody to ask, cut off at once.
    let (mut c, _efd) = attach(&uuids[2], false);
    let t = Instant::now();
    vnpu(&state, &["stop", &uuids[2]]);
    wait_for("the client without a trigger to be cut off", || !sock(&uuids[2]).exists());
    assert!(t.elapsed() < Duration::from_millis(1900), "cut off only after {:?}", t.elapsed());
    assert!(c.region_read(0, vnpu_abi::device::regs::MAGIC, &mut magic).is_err(), "still served");
    assert!(terminate(d).success());
    let _ = std::fs::remove_dir_all(&root);
}

/// A sealed memfd of `len` bytes (as a VMM's guest RAM), or none.
fn sealed_memfd(len: u64) -> Option<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: memfd_create with a NUL-terminated name; checked below.
    let fd = unsafe { libc::memfd_create(c"bound".as_ptr(), libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is ours alone.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(len).ok()?;
    // SAFETY: seals our own memfd.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
    (r == 0).then_some(f)
}

/// The daemon's mappings, descriptors and threads now.
fn usage(pid: u32) -> (usize, usize, usize) {
    let count = |p: String| std::fs::read_dir(p).map_or(0, Iterator::count);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_or(0, |m| m.lines().count());
    (maps, count(format!("/proc/{pid}/fd")), count(format!("/proc/{pid}/task")))
}

/// Three hostile clients at once, each on its own instance at every DMA
/// bound (`docs/vfio-user.md`, "Guest memory"): 65 files (the 65th
/// refused), gapped pages until the run limit, then adjacent pages up to
/// the range limit, and files grown between maps. A bystander VM on a
/// fourth instance must classify every digit as its CPU reference does,
/// and the daemon's mappings, descriptors and threads must stay within
/// the documented bounds: at most 64 file mappings per client, no thread
/// per map, descriptors of the files it holds.
#[test]
fn three_hostile_clients_at_their_bounds_leave_a_bystander_correct() {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    const PAGE: u64 = 4096;
    let root: PathBuf = std::env::temp_dir().join(format!("vnpu-bounds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let state = root.join("state");
    let sockets = state.join("sockets");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnpu"));
    cmd.args(["daemon", "--seccomp", "kill"]);
    let (d, ctl) = start(cmd, &state, &sockets);
    let pid = d.0.as_ref().unwrap().id();
    let hostile: Vec<String> =
        (0..3).map(|_| vnpu(&state, &["create", "--type", "small"]).trim().to_string()).collect();
    let bystander = vnpu(&state, &["create", "--type", "small"]).trim().to_string();
    for u in hostile.iter().chain([&bystander]) {
        let s = sockets.join(format!("{u}.sock"));
        wait_for("an instance's socket", || s.exists());
    }
    std::thread::sleep(Duration::from_millis(300));
    let base = usage(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(std::sync::Mutex::new(base));
    let sampler = {
        let (stop, peak) = (Arc::clone(&stop), Arc::clone(&peak));
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let (m, f, t) = usage(pid);
                let mut p = peak.lock().unwrap();
                *p = (p.0.max(m), p.1.max(f), p.2.max(t));
                drop(p);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let at_bounds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let attackers: Vec<_> = hostile
        .iter()
        .map(|u| {
            let sock = sockets.join(format!("{u}.sock"));
            let stop = Arc::clone(&stop);
            let at_bounds = Arc::clone(&at_bounds);
            std::thread::spawn(move || {
                let mut c = Client::new(&sock).unwrap();
                let files: Vec<_> = (0..65).filter_map(|_| sealed_memfd(64 << 20)).collect();
                let counts = std::cell::Cell::new((0usize, 0usize));
                let tally = |r: Result<(), _>| {
                    let (ok, refused) = counts.get();
                    counts.set(if r.is_ok() { (ok + 1, refused) } else { (ok, refused + 1) });
                };
                // A page of each file (the 65th refused), far apart.
                for (i, f) in (0u64..).zip(&files) {
                    tally(c.dma_map(0, i << 36, PAGE, f.as_raw_fd()));
                }
                // Gapped pages of the first file: a run each, to the limit.
                for k in 1..4200u64 {
                    tally(c.dma_map(k * PAGE, (1 << 44) + 2 * k * PAGE, PAGE, files[0].as_raw_fd()));
                }
                // The second file grown between maps, each map past its
                // first size (the daemon used to map the whole file again
                // for every one, and keep every mapping).
                for j in 0..200u64 {
                    let _ = files[1].set_len((65 + j) << 20);
                    tally(c.dma_map(
                        (64 + j) << 20,
                        (1 << 36) + ((64 + j) << 20),
                        PAGE,
                        files[1].as_raw_fd(),
                    ));
                }
                // Adjacent pages of every file, to the range limit.
                'files: for (i, f) in (0u64..).zip(&files) {
                    for k in 1..(64 << 20) / PAGE {
                        let (ok, refused) = counts.get();
                        if ok + refused >= 70_000 || stop.load(Ordering::SeqCst) {
                            break 'files;
                        }
                        tally(c.dma_map(k * PAGE, (i << 36) + k * PAGE, PAGE, f.as_raw_fd()));
                    }
                }
                // Held mapped until the bystander is done.
                at_bounds.fetch_add(1, Ordering::SeqCst);
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                drop(c);
                counts.get()
            })
        })
        .collect();
    // The bystander runs while all three hold everything they could map.
    let t = Instant::now();
    while at_bounds.load(Ordering::SeqCst) < 3 {
        assert!(t.elapsed() < Duration::from_secs(300), "the hostile clients never reached their bounds");
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("bounds: three clients at their bounds after {:?}", t.elapsed());
    let vm = vm(&state, "digits", &bystander);
    let (code, out) = finish_within(vm, Duration::from_secs(600));
    stop.store(true, Ordering::SeqCst);
    let tallies: Vec<(usize, usize)> = attackers.into_iter().map(|a| a.join().unwrap()).collect();
    sampler.join().unwrap();
    let said = daemon_said(&state);
    assert_eq!(code, 0, "{out}{said}");
    for want in [
        "accuracy vnpu=0.9733 cpu=0.9733 model=mlp agree=450/450 batch_agree=450/450",
        "digits: vNPU and CPU agree on every image",
    ] {
        assert!(out.contains(want), "{want} missing:\n{out}");
    }
    let p = *peak.lock().unwrap();
    eprintln!(
        "bounds: base {base:?}, peak {p:?} (maps, fds, threads); clients' (mapped, refused) {tallies:?}"
    );
    for (ok, refused) in &tallies {
        assert!(
            *ok > 60_000 && *ok <= 65_535 && *refused > 0,
            "a client mapped {ok} ranges, refused {refused}"
        );
    }
    // Per client: at most 64 file mappings, and the descriptors of those
    // files (plus its connection and eventfds); the bystander VM's own
    // guest RAM, session files and eventfds are in the slack. No thread
    // per mapping or per request.
    let slack = 64;
    assert!(p.0 <= base.0 + 3 * 64 + slack, "mappings {} from {} (3 clients of at most 64)", p.0, base.0);
    assert!(p.1 <= base.1 + 3 * (64 + 16) + slack, "descriptors {} from {}", p.1, base.1);
    assert!(p.2 <= base.2 + 16, "threads {} from {}", p.2, base.2);
    // The daemon is whole: it answers, and its mappings go with the
    // clients.
    let reply = control_line(&ctl, b"{\"op\":\"list\"}\n");
    assert_eq!(
        reply.first().map(|r| r["ok"].clone()),
        Some(serde_json::Value::Bool(true)),
        "{reply:?}{said}"
    );
    wait_for("the clients' mappings to go", || usage(pid).0 <= base.0 + slack);
    assert!(terminate(d).success(), "{said}");
    let _ = std::fs::remove_dir_all(&root);
}
