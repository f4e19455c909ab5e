//! Decision time of the daemon's control socket with many instances
//! defined (docs/benchmarks.md).
//!
//! Starts a daemon (in this process, on a temporary state directory),
//! defines `--instances` persistent instances through its control socket,
//! copies that state to a second directory, then, round by round and in
//! alternating order, times on one clock (`Instant`) the same operations
//! through the daemon and directly on the copy (no daemon: what `vnpu`
//! does when none runs): `create` (a transient small instance, placed,
//! written and, through the daemon, served), its `stop`, `start` of a
//! defined instance and its `stop`, and `list`. Prints min / median / max
//! milliseconds per operation and path, and the per-round ratio daemon /
//! direct.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use npu_model::BoardConfig;
use vnpu_manager::control::{execute, CONTROL_SOCKET};
use vnpu_manager::{ControlClient, ControlError, Outcome, Request};

#[derive(Parser, Debug)]
#[command(about = "Decision time of the daemon's control socket with many instances defined")]
struct Args {
    /// Persistent instances defined before timing.
    #[arg(long, default_value_t = 1000)]
    instances: usize,
    /// Timed rounds (each: create, stop, start, stop, list on both paths).
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// Write every sample here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

const OPS: [&str; 5] = ["create", "stop (transient)", "start", "stop (defined)", "list"];

fn define(uuid: &str) -> Request {
    Request::Define {
        type_name: Some("small".into()),
        spec: None,
        uuid: Some(uuid.into()),
        workload: None,
        qos: Default::default(),
    }
}

fn uuid_of(o: &Outcome) -> Result<String, String> {
    match o {
        Outcome::Instance { instance, .. } => Ok(instance.uuid.clone()),
        other => Err(format!("unexpected reply {other:?}")),
    }
}

/// One round's five operations; `call` is either path.
fn round(
    defined: &str,
    call: &mut dyn FnMut(&Request) -> Result<Outcome, ControlError>,
) -> Result<[f64; 5], String> {
    let mut t = [0.0; 5];
    let mut timed = |i: usize, req: &Request, t: &mut [f64; 5]| -> Result<Outcome, String> {
        let start = Instant::now();
        let o = call(req).map_err(|e| format!("{req:?}: {e}"))?;
        t[i] = start.elapsed().as_secs_f64() * 1e3;
        Ok(o)
    };
    let created = timed(
        0,
        &Request::Create {
            type_name: Some("small".into()),
            spec: None,
            uuid: None,
            workload: None,
            qos: Default::default(),
            place: Default::default(),
        },
        &mut t,
    )?;
    let u = uuid_of(&created)?;
    timed(1, &Request::Stop { uuid: u }, &mut t)?;
    timed(2, &Request::Start { uuid: defined.into(), place: Default::default() }, &mut t)?;
    timed(3, &Request::Stop { uuid: defined.into() }, &mut t)?;
    timed(4, &Request::List {}, &mut t)?;
    Ok(t)
}

fn stats(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    (v[0], med, v[n - 1])
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    if args.instances == 0 || args.rounds == 0 {
        return Err("--instances and --rounds must be at least 1".into());
    }
    let root = std::env::temp_dir().join(format!("vnpu-control-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (state, sockets, direct) = (root.join("state"), root.join("sockets"), root.join("direct"));
    let board = BoardConfig::default();
    let opts = vnpu_daemon::DaemonOptions {
        control_idle: vnpu_daemon::DEFAULT_CONTROL_IDLE,
        release_timeout: vnpu_daemon::DEFAULT_RELEASE_TIMEOUT,
        control_group: None,
        board: board.clone(),
        state_dir: state.clone(),
        socket_dir: sockets.clone(),
        session_dir: None,
        rescan: Duration::from_millis(100),
        device: Default::default(),
        metrics: None,
        harvest: true,
        lend_limit_us: None,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let daemon = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            vnpu_daemon::run(&opts, &stop, || {
                let _ = ready_tx.send(());
            })
        })
    };
    ready_rx.recv_timeout(Duration::from_secs(30)).map_err(|_| "the daemon did not start".to_string())?;
    let result = bench(&args, &board, &state, &sockets, &direct);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    match daemon.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("control-bench: daemon: {e}"),
        Err(_) => eprintln!("control-bench: the daemon thread panicked"),
    }
    let _ = std::fs::remove_dir_all(&root);
    result
}

fn bench(
    args: &Args,
    board: &BoardConfig,
    state: &Path,
    sockets: &Path,
    direct: &Path,
) -> Result<(), String> {
    let mut client = ControlClient::connect(&sockets.join(CONTROL_SOCKET)).map_err(|e| e.to_string())?;
    let t = Instant::now();
    for i in 0..args.instances {
        client.call(&define(&format!("00000000-0000-4000-8000-{i:012}"))).map_err(|e| e.to_string())?;
        if (i + 1) % 250 == 0 || i + 1 == args.instances {
            eprintln!("defined {}/{} ({:.1} s)", i + 1, args.instances, t.elapsed().as_secs_f64());
        }
    }
    std::fs::create_dir_all(direct).map_err(|e| e.to_string())?;
    std::fs::copy(vnpu_manager::Store::state_file(state), vnpu_manager::Store::state_file(direct))
        .map_err(|e| e.to_string())?;
    let defined = "00000000-0000-4000-8000-000000000000";
    let mut samples: Vec<[Vec<f64>; 2]> = (0..OPS.len()).map(|_| [Vec::new(), Vec::new()]).collect();
    for r in 0..=args.rounds {
        let mut via_daemon = |req: &Request| client.call(req);
        let mut on_disk = |req: &Request| execute(direct, board, req);
        let (d, x) = if r % 2 == 0 {
            let d = round(defined, &mut via_daemon)?;
            (d, round(defined, &mut on_disk)?)
        } else {
            let x = round(defined, &mut on_disk)?;
            (round(defined, &mut via_daemon)?, x)
        };
        // Round 0 warms both paths up.
        if r == 0 {
            continue;
        }
        for (i, s) in samples.iter_mut().enumerate() {
            s[0].push(d[i]);
            s[1].push(x[i]);
        }
    }
    println!(
        "{} instances defined, {} rounds; milliseconds min / median / max; ratio = daemon / direct per round",
        args.instances, args.rounds
    );
    println!("{:<18} {:>26} {:>26} {:>22}", "operation", "through the daemon", "direct (no daemon)", "ratio");
    for (op, s) in OPS.iter().zip(&samples) {
        let (d, x) = (stats(&s[0]), stats(&s[1]));
        let ratios: Vec<f64> = s[0].iter().zip(&s[1]).map(|(d, x)| d / x).collect();
        let r = stats(&ratios);
        println!(
            "{op:<18} {:>26} {:>26} {:>22}",
            format!("{:.2} / {:.2} / {:.2}", d.0, d.1, d.2),
            format!("{:.2} / {:.2} / {:.2}", x.0, x.1, x.2),
            format!("{:.2} / {:.2} / {:.2}", r.0, r.1, r.2)
        );
    }
    if let Some(path) = &args.json {
        let v = serde_json::json!({
            "instances": args.instances,
            "rounds": args.rounds,
            "ops": OPS,
            "daemon_ms": samples.iter().map(|s| s[0].clone()).collect::<Vec<_>>(),
            "direct_ms": samples.iter().map(|s| s[1].clone()).collect::<Vec<_>>(),
        });
        std::fs::write(path, v.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
