//! The board daemon's management plane under attack (docs/isolation.md,
//! docs/benchmarks.md): control-socket `list` and `/metrics` scrape
//! latency while each attack runs, against the same with no attack, in one
//! run; and the daemon's resident memory and open descriptors idle, per
//! instance, per attached client, and at most during each attack.
//!
//! Starts `vnpu daemon --metrics` as a child process on a temporary state
//! directory with `--instances` started small instances, then for each
//! attack (and a no-attack baseline before and after) probes for
//! `--seconds`: every 20 ms one `list` on a new control connection (what
//! `vnpu list` does) and one scrape on a new TCP connection, alternating,
//! timed on one clock (`Instant`), each bounded by 5 s (a probe that fails
//! or times out counts as 5,000 ms and as a failure). Prints min / p50 /
//! p99 / max per attack and probe, failures, and the daemon's peak RSS,
//! descriptors and memory mappings while the attack ran.

// Statistics over sample counts and timings: the casts are of small,
// non-negative numbers.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    about = "Control-socket and /metrics latency, RSS and descriptors of the board daemon under attack"
)]
struct Args {
    /// The `vnpu` binary (default: beside this one).
    #[arg(long)]
    vnpu: Option<PathBuf>,
    /// Started instances on the board while probing.
    #[arg(long, default_value_t = 4)]
    instances: usize,
    /// Seconds of probing per attack.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Write every sample here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// The daemon child, killed when dropped.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) with SIGTERM on our own child's pid.
        unsafe { libc::kill(i32::try_from(self.0.id()).unwrap_or(0), libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn vnpu(bin: &Path, state: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(bin)
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .output()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    if !out.status.success() {
        return Err(format!("vnpu {args:?}: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// One `list` on a new control connection; its time, or `None`.
fn probe_list(control: &Path) -> Option<Duration> {
    let t = Instant::now();
    let mut s = UnixStream::connect(control).ok()?;
    s.set_read_timeout(Some(PROBE_LIMIT)).ok()?;
    s.set_write_timeout(Some(PROBE_LIMIT)).ok()?;
    s.write_all(b"{\"op\":\"list\"}\n").ok()?;
    let mut line = Vec::new();
    let mut b = [0u8; 4096];
    while !line.contains(&b'\n') {
        let n = s.read(&mut b).ok()?;
        if n == 0 || t.elapsed() > PROBE_LIMIT {
            return None;
        }
        line.extend_from_slice(&b[..n]);
    }
    line.starts_with(b"{\"ok\":").then(|| t.elapsed())
}

/// One scrape on a new TCP connection; its time, or `None`.
fn probe_scrape(addr: SocketAddr) -> Option<Duration> {
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, PROBE_LIMIT).ok()?;
    s.set_read_timeout(Some(PROBE_LIMIT)).ok()?;
    s.set_write_timeout(Some(PROBE_LIMIT)).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).ok()?;
    (body.starts_with(b"HTTP/1.1 200") && t.elapsed() <= PROBE_LIMIT).then(|| t.elapsed())
}

/// The daemon's memory mappings (lines of `/proc/PID/maps`).
fn mappings(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).map_or(0, |m| m.lines().count())
}

/// The daemon's resident set (KiB) and open descriptors.
fn usage(pid: u32) -> (u64, usize) {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
    (rss, fds)
}

/// What one attack does until `stop`; the connections it holds stay open
/// until it returns.
type Attack = fn(&Target, &AtomicBool);

struct Target {
    control: PathBuf,
    metrics: SocketAddr,
    instance: PathBuf,
}

fn idle_control(t: &Target, stop: &AtomicBool) {
    let held: Vec<_> = (0..64).filter_map(|_| UnixStream::connect(&t.control).ok()).collect();
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(held);
}

/// Fresh idle connections from `connect` as fast as two threads can open
/// them (each keeps its newest 64): slots held by connections younger than
/// the eviction bound.
fn churn<C: Send>(stop: &AtomicBool, connect: impl Fn() -> Option<C> + Sync) {
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut held = std::collections::VecDeque::new();
                while !stop.load(Ordering::SeqCst) {
                    held.extend(connect());
                    if held.len() > 64 {
                        held.pop_front();
                    }
                }
            });
        }
    });
}

fn churn_control(t: &Target, stop: &AtomicBool) {
    churn(stop, || UnixStream::connect(&t.control).ok());
}

fn churn_metrics(t: &Target, stop: &AtomicBool) {
    churn(stop, || TcpStream::connect(t.metrics).ok());
}

fn idle_metrics(t: &Target, stop: &AtomicBool) {
    let mut held = Vec::new();
    // Keep reconnecting as the daemon closes them: 600 held at a time.
    while !stop.load(Ordering::SeqCst) {
        while held.len() < 600 {
            match TcpStream::connect_timeout(&t.metrics, Duration::from_millis(200)) {
                Ok(s) => held.push(s),
                Err(_) => break,
            }
        }
        held.retain(|s: &TcpStream| {
            let mut b = [0u8; 1];
            let _ = s.set_nonblocking(true);
            !matches!((&*s).read(&mut b), Ok(0))
        });
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn greedy_metrics(t: &Target, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let conns: Vec<_> = (0..8)
            .filter_map(|_| TcpStream::connect(t.metrics).ok())
            .map(|mut s| {
                let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                let _ = s.write_all(&b"GET /metrics HTTP/1.1\r\n\r\n".repeat(2000));
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        drop(conns);
    }
}

fn huge_header(t: &Target, stop: &AtomicBool) {
    let chunk = vec![b'a'; 64 << 10];
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut s) = TcpStream::connect(t.metrics) else { continue };
        let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nX-Big: ");
        let mut sent = 0usize;
        while sent < 512 << 20 && !stop.load(Ordering::SeqCst) && s.write_all(&chunk).is_ok() {
            sent += chunk.len();
        }
    }
}

fn vfio_garbage(t: &Target, stop: &AtomicBool) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut s) = UnixStream::connect(&t.instance) else { continue };
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        let bytes: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect();
        let _ = s.write_all(&bytes);
    }
}

/// A sealed memfd of `len` bytes, as QEMU's memory backend makes.
fn sealed_memfd(len: u64) -> Option<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create(2) returns a fresh descriptor, owned below.
    let fd = unsafe { libc::memfd_create(c"attack-bench".as_ptr(), libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is ours alone.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(len).ok()?;
    // SAFETY: F_ADD_SEALS on a descriptor we own.
    (unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } == 0).then_some(f)
}

/// One client that takes everything `DMA_MAP` lets it (docs/vfio-user.md,
/// "Guest memory"): 64 files (one more is refused), then page-sized
/// ranges with gaps until the run limit refuses one, then adjacent
/// page-sized ranges until the range limit refuses one; held until `stop`
/// (give it `--seconds` enough to reach the limits: about 75,000 round
/// trips).
fn dma_bounds(t: &Target, stop: &AtomicBool) {
    use std::os::fd::AsRawFd;
    const PAGE: u64 = 4096;
    let Ok(mut c) = vfio_user::Client::new(&t.instance) else { return };
    let files: Vec<_> = (0..65).filter_map(|_| sealed_memfd(64 << 20)).collect();
    let (mut ok, mut refused) = (0usize, [0usize; 3]);
    // A page of each file (the 65th is refused), far apart.
    for (i, f) in (0u64..).zip(&files) {
        match c.dma_map(0, i << 36, PAGE, f.as_raw_fd()) {
            Ok(()) => ok += 1,
            Err(_) => refused[0] += 1,
        }
    }
    // Gapped pages: a run each, until the run limit.
    let Some(f0) = files.first() else { return };
    for k in 1..6000u64 {
        match c.dma_map(k * PAGE, (1 << 44) + 2 * k * PAGE, PAGE, f0.as_raw_fd()) {
            Ok(()) => ok += 1,
            Err(_) => refused[1] += 1,
        }
    }
    // Pages adjacent to each file's first (growing its run, no new
    // one), until the range limit.
    'files: for (i, f) in (0u64..).zip(&files) {
        for k in 1..(64 << 20) / PAGE {
            if ok + refused[2] >= 70_000 {
                break 'files;
            }
            match c.dma_map(k * PAGE, (i << 36) + k * PAGE, PAGE, f.as_raw_fd()) {
                Ok(()) => ok += 1,
                Err(_) => refused[2] += 1,
            }
        }
    }
    eprintln!(
        "attack-bench: DMA bounds: {ok} ranges mapped; refused: {} files, {} runs, {} ranges",
        refused[0], refused[1], refused[2]
    );
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn control_flood(t: &Target, stop: &AtomicBool) {
    // Garbage lines as fast as the socket takes them, on 8 connections.
    let conns: Vec<_> = (0..8).filter_map(|_| UnixStream::connect(&t.control).ok()).collect();
    let line = [b"{\"op\":\"nonsense\"}\n".repeat(64), b"x".repeat(1000), b"\n".to_vec()].concat();
    while !stop.load(Ordering::SeqCst) {
        for mut c in &conns {
            let _ = c.set_write_timeout(Some(Duration::from_millis(50)));
            let _ = c.write_all(&line);
        }
    }
}

fn none(_: &Target, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[derive(serde::Serialize)]
struct Row {
    attack: &'static str,
    list_ms: Vec<f64>,
    scrape_ms: Vec<f64>,
    list_failures: usize,
    scrape_failures: usize,
    peak_rss_kib: u64,
    peak_fds: usize,
    peak_maps: usize,
}

fn stats(v: &[f64]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let q = |p: f64| s[((s.len() - 1) as f64 * p).round() as usize];
    format!("{:.2} / {:.2} / {:.2} / {:.2}", s[0], q(0.5), q(0.99), s[s.len() - 1])
}

fn run(args: &Args) -> Result<Vec<Row>, String> {
    let bin = match &args.vnpu {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("vnpu"),
    };
    let root = std::env::temp_dir().join(format!("vnpu-attack-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let state = root.join("state");
    std::fs::create_dir_all(&state).map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let metrics: SocketAddr = ([127, 0, 0, 1], port).into();
    let log = std::fs::File::create(root.join("daemon.log")).map_err(|e| e.to_string())?;
    let child = Command::new(&bin)
        .args(["daemon", "--metrics", &metrics.to_string(), "--state-dir"])
        .arg(&state)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let daemon = Daemon(child);
    let pid = daemon.0.id();
    let control = state.join("sockets/control.sock");
    let t = Instant::now();
    while probe_list(&control).is_none() {
        if t.elapsed() > Duration::from_secs(20) {
            return Err("the daemon's control socket never answered".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (rss0, fds0) = usage(pid);
    let mut uuids = Vec::new();
    for _ in 0..args.instances.max(1) {
        uuids.push(vnpu(&bin, &state, &["create", "--type", "small"])?);
    }
    let instance = state.join("sockets").join(format!("{}.sock", uuids[0]));
    let t = Instant::now();
    while !instance.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (rss1, fds1) = usage(pid);
    let n = args.instances.max(1) as f64;
    println!(
        "daemon idle: {} KiB RSS, {fds0} descriptors; with {} started instances: {} KiB, {fds1} descriptors \
         ({:.0} KiB and {:.1} descriptors per instance)",
        rss0,
        args.instances.max(1),
        rss1,
        (rss1 as f64 - rss0 as f64) / n,
        (fds1 as f64 - fds0 as f64) / n
    );
    {
        let client = vfio_user::Client::new(&instance).map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_millis(300));
        let (rss2, fds2) = usage(pid);
        println!(
            "one attached client (handshake only): +{} KiB RSS, +{} descriptors",
            rss2 as i64 - rss1 as i64,
            fds2 as i64 - fds1 as i64
        );
        drop(client);
    }
    std::thread::sleep(Duration::from_millis(300));
    let target = Target { control: control.clone(), metrics, instance };
    let attacks: [(&'static str, Attack); 11] = [
        ("none", none),
        ("64 idle control connections", idle_control),
        ("fresh control connections, churned", churn_control),
        ("garbage control lines, 8 connections", control_flood),
        ("600 idle /metrics connections", idle_metrics),
        ("fresh /metrics connections, churned", churn_metrics),
        ("pipelined /metrics GETs never read", greedy_metrics),
        ("512 MiB /metrics header lines", huge_header),
        ("vfio-user garbage, reconnecting", vfio_garbage),
        ("one client at every DMA bound", dma_bounds),
        ("none (again)", none),
    ];
    let mut rows = Vec::new();
    for (name, attack) in attacks {
        eprintln!("attack-bench: {name} for {} s", args.seconds);
        let stop = Arc::new(AtomicBool::new(false));
        let attacker = {
            let (stop, target) = (Arc::clone(&stop), clone_target(&target));
            std::thread::spawn(move || attack(&target, &stop))
        };
        std::thread::sleep(Duration::from_millis(500));
        let mut row = Row {
            attack: name,
            list_ms: Vec::new(),
            scrape_ms: Vec::new(),
            list_failures: 0,
            scrape_failures: 0,
            peak_rss_kib: 0,
            peak_fds: 0,
            peak_maps: 0,
        };
        let t = Instant::now();
        while t.elapsed().as_secs_f64() < args.seconds {
            match probe_list(&control) {
                Some(d) => row.list_ms.push(d.as_secs_f64() * 1e3),
                None => {
                    row.list_failures += 1;
                    row.list_ms.push(PROBE_LIMIT.as_secs_f64() * 1e3);
                }
            }
            match probe_scrape(metrics) {
                Some(d) => row.scrape_ms.push(d.as_secs_f64() * 1e3),
                None => {
                    row.scrape_failures += 1;
                    row.scrape_ms.push(PROBE_LIMIT.as_secs_f64() * 1e3);
                }
            }
            let (rss, fds) = usage(pid);
            row.peak_rss_kib = row.peak_rss_kib.max(rss);
            row.peak_fds = row.peak_fds.max(fds);
            row.peak_maps = row.peak_maps.max(mappings(pid));
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::SeqCst);
        let _ = attacker.join();
        // Let the daemon shed what the attack left before the next.
        std::thread::sleep(Duration::from_millis(1500));
        rows.push(row);
    }
    drop(daemon);
    let _ = std::fs::remove_dir_all(&root);
    Ok(rows)
}

fn clone_target(t: &Target) -> Target {
    Target { control: t.control.clone(), metrics: t.metrics, instance: t.instance.clone() }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rows = match run(&args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("attack-bench: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!(
        "\n{:<40} {:>36} {:>5} {:>36} {:>5} {:>10} {:>5} {:>6}",
        "attack",
        "list ms (min / p50 / p99 / max)",
        "fail",
        "scrape ms (min / p50 / p99 / max)",
        "fail",
        "peak RSS",
        "fds",
        "maps"
    );
    for r in &rows {
        println!(
            "{:<40} {:>36} {:>5} {:>36} {:>5} {:>7} KiB {:>5} {:>6}",
            r.attack,
            stats(&r.list_ms),
            format!("{}/{}", r.list_failures, r.list_ms.len()),
            stats(&r.scrape_ms),
            format!("{}/{}", r.scrape_failures, r.scrape_ms.len()),
            r.peak_rss_kib,
            r.peak_fds,
            r.peak_maps
        );
    }
    if let Some(path) = &args.json {
        match serde_json::to_string_pretty(&rows) {
            Ok(s) => {
                if let Err(e) = std::fs::write(path, s) {
                    eprintln!("attack-bench: {}: {e}", path.display());
                    return std::process::ExitCode::FAILURE;
                }
            }
            Err(e) => {
                eprintln!("attack-bench: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
