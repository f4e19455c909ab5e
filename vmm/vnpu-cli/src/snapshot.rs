//! `vnpu snapshot` and `vnpu restore`, and the API socket of `vnpu run
//! --api-socket` through which a snapshot is asked of a running VM
//! (`docs/migration.md`).
//!
//! The socket takes one JSON line per connection,
//! `{"op":"snapshot","dir":"/abs/path","stop":false}` or
//! `{"op":"migrate","to":"/abs/path","verify":false,"max_rounds":30,"converged_pages":256}`
//! (the last three optional), and answers one:
//! `{"ok":true,"dir":...,"bytes":N,"ram_pages":N,"took_ms":T,"drain_ms":D}`,
//! `{"ok":true,"migration":{...}}` or `{"ok":false,"error":"..."}`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::CliError;

/// Longest request line the API socket reads.
const MAX_LINE: u64 = 4096;

/// A request on the API socket.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiRequest {
    op: String,
    #[serde(default)]
    dir: Option<PathBuf>,
    #[serde(default)]
    stop: bool,
    #[serde(default)]
    to: Option<PathBuf>,
    #[serde(default)]
    verify: bool,
    #[serde(default)]
    max_rounds: Option<u32>,
    #[serde(default)]
    converged_pages: Option<u64>,
}

/// Serves the API socket at `path` for the VM `pause` stops, on a thread
/// of its own (one request at a time). A stale socket file is replaced;
/// anything else at `path` is refused. The socket is the owner's only.
pub fn serve_api(path: &Path, pause: vnpu_vm::PauseHandle) -> Result<(), CliError> {
    let err = |source| CliError::Write { path: path.display().to_string(), source };
    let listener = bind_private(path)?;
    std::thread::Builder::new()
        .name("vnpu-api".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
                let reply = answer(&s, &pause);
                let _ = s.write_all(format!("{reply}\n").as_bytes());
                // A VM that stops after its snapshot waits for this.
                pause.reply_sent();
            }
        })
        .map_err(err)?;
    Ok(())
}

fn answer(s: &UnixStream, pause: &vnpu_vm::PauseHandle) -> serde_json::Value {
    let fail = |e: String| serde_json::json!({ "ok": false, "error": e });
    let mut line = String::new();
    if let Err(e) = BufReader::new(s.take(MAX_LINE)).read_line(&mut line) {
        return fail(format!("reading the request: {e}"));
    }
    let req: ApiRequest = match serde_json::from_str(&line) {
        Ok(r) => r,
        Err(e) => return fail(format!("not a request: {e}")),
    };
    match (req.op.as_str(), req.dir, req.to) {
        ("snapshot", Some(dir), None)
            if !req.verify && req.max_rounds.is_none() && req.converged_pages.is_none() =>
        {
            if !dir.is_absolute() {
                return fail("dir must be an absolute path".into());
            }
            match pause.snapshot(&dir, req.stop) {
                Ok(i) => serde_json::json!({
                    "ok": true,
                    "dir": i.dir,
                    "bytes": i.bytes,
                    "ram_pages": i.ram_pages,
                    "took_ms": i.took.as_secs_f64() * 1e3,
                    "drain_ms": i.drain.as_secs_f64() * 1e3,
                }),
                Err(e) => fail(e.to_string()),
            }
        }
        ("migrate", None, Some(to)) if !req.stop => {
            let d = vnpu_vm::MigrateOptions::default();
            let opts = match vnpu_vm::MigrateOptions::new(
                req.verify,
                req.max_rounds.unwrap_or(d.max_rounds),
                req.converged_pages.unwrap_or(d.converged_pages),
            ) {
                Ok(o) => o,
                Err(e) => return fail(e),
            };
            match pause.migrate(&to, opts) {
                Ok(i) => serde_json::json!({ "ok": true, "migration": migration_json(&i) }),
                Err(e) => fail(e.to_string()),
            }
        }
        ("snapshot", ..) => fail("a snapshot takes \"dir\" (and \"stop\") only".into()),
        ("migrate", ..) => {
            fail("a migration takes \"to\" (and \"verify\", \"max_rounds\", \"converged_pages\") only".into())
        }
        (op, ..) => fail(format!("unknown op \"{op}\" (the API socket takes \"snapshot\" and \"migrate\")")),
    }
}

/// A migration's figures as the API socket and `vnpu migrate --json`
/// give them (times in milliseconds).
fn migration_json(i: &vnpu_vm::MigrationInfo) -> serde_json::Value {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    serde_json::json!({
        "rounds": i.rounds,
        "converged": i.converged,
        "pages": i.pages,
        "stop_pages": i.stop_pages,
        "device_bytes": i.device_bytes,
        "precopy_device_bytes": i.precopy_device_bytes,
        "bytes": i.bytes,
        "precopy_ms": ms(i.precopy),
        "downtime_ms": ms(i.downtime),
        "drain_ms": ms(i.drain),
        "restore_ms": ms(i.restore),
        "total_ms": ms(i.total),
    })
}

/// Sends `req` to the API socket and returns the answer, failed ones as
/// an error that starts with `what`.
fn call(socket: &Path, req: &serde_json::Value, what: &str) -> Result<serde_json::Value, CliError> {
    let mut s = UnixStream::connect(socket).map_err(|e| {
        CliError::Usage(format!(
            "cannot reach the VM's API socket {}: {e} (is `vnpu run --api-socket` running?)",
            socket.display()
        ))
    })?;
    let io = |source| CliError::Write { path: socket.display().to_string(), source };
    s.write_all(format!("{req}\n").as_bytes()).map_err(io)?;
    let mut reply = String::new();
    BufReader::new(s.take(1 << 16)).read_line(&mut reply).map_err(io)?;
    if reply.is_empty() {
        return Err(CliError::Usage(format!(
            "{what}: the VM ended before it answered (did its guest exit?)"
        )));
    }
    let v: serde_json::Value = serde_json::from_str(&reply)
        .map_err(|e| CliError::Usage(format!("the VM's answer is not JSON ({e}): {reply}")))?;
    if v["ok"] != serde_json::Value::Bool(true) {
        return Err(CliError::Usage(format!(
            "{what}: {}",
            v["error"].as_str().unwrap_or("the VM gave no reason (did it end?)")
        )));
    }
    Ok(v)
}

/// `vnpu migrate`: asks the VM serving `socket` to move to the VMM
/// waiting at `to`; prints what it took.
pub fn migrate(socket: &Path, to: &Path, opts: vnpu_vm::MigrateOptions, json: bool) -> Result<(), CliError> {
    let abs = std::path::absolute(to)
        .map_err(|source| CliError::Write { path: to.display().to_string(), source })?;
    let v = call(
        socket,
        &serde_json::json!({
            "op": "migrate",
            "to": abs,
            "verify": opts.verify,
            "max_rounds": opts.max_rounds,
            "converged_pages": opts.converged_pages,
        }),
        "the migration failed (the VM runs on here)",
    )?;
    let m = &v["migration"];
    if json {
        println!("{m}");
        return Ok(());
    }
    let f = |k: &str| m[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "migrated: downtime {:.1} ms ({:.1} for the vNPUs' running requests, {:.1} restoring there), total {:.1} ms; {} pages in {} pre-copy rounds{} and {} while stopped, {:.1} MiB of vNPU HBM pre-copied and {:.1} MiB of device state while stopped, {:.1} MiB in all",
        f("downtime_ms"),
        f("drain_ms"),
        f("restore_ms"),
        f("total_ms"),
        m["pages"],
        m["rounds"],
        if m["converged"] == serde_json::Value::Bool(true) { "" } else { " (not converged)" },
        m["stop_pages"],
        f("precopy_device_bytes") / f64::from(1u32 << 20),
        f("device_bytes") / f64::from(1u32 << 20),
        f("bytes") / f64::from(1u32 << 20),
    );
    Ok(())
}

/// `vnpu receive`: waits at `listen` for one VM, admits it on the board
/// daemon of the state directory `dir`, and runs it on; returns the exit
/// code its guest asks for.
pub fn receive(listen: &Path, dir: &Path, api_socket: Option<&Path>) -> Result<u8, CliError> {
    let listener = bind_private(listen)?;
    eprintln!("vnpu: waiting for a migration at {}", listen.display());
    let (stream, _) =
        listener.accept().map_err(|source| CliError::Write { path: listen.display().to_string(), source })?;
    drop(listener);
    let _ = std::fs::remove_file(listen);
    let t = std::time::Instant::now();
    let mut made = Vec::new();
    let r = vnpu_vm::Vm::receive(stream, std::io::stdout(), |offer| admit(dir, offer, &mut made));
    let mut vm = match r {
        Ok(vm) => vm,
        Err(e) => {
            forget(dir, &made);
            return Err(e.into());
        }
    };
    eprintln!("vnpu: received the VM in {:.1} ms; it runs here", t.elapsed().as_secs_f64() * 1e3);
    if let Some(p) = api_socket {
        serve_api(p, vm.pause_handle())?;
    }
    crate::run::finish(vm.run())
}

/// Has this host's board daemon take each daemon-served vNPU `offer`
/// brings: an instance of the same UUID and shape that is started, or a
/// new one (its UUIDs go into `made`); returns their sockets.
fn admit(dir: &Path, offer: &vnpu_vm::Offer, made: &mut Vec<String>) -> Result<Vec<PathBuf>, String> {
    use vnpu_manager::{Outcome, Request};
    if offer.remote.is_empty() {
        return Ok(Vec::new());
    }
    let m = crate::manage::ManageArgs { state_dir: Some(dir.to_path_buf()), board: None, socket_dir: None };
    let sockets = m.socket_dir();
    if !sockets.join(vnpu_manager::control::CONTROL_SOCKET).exists() {
        return Err(format!("no board daemon runs for {} (`vnpu daemon`)", dir.display()));
    }
    let listed = match m.call(&Request::List {}) {
        Ok(Outcome::Instances(l)) => l,
        Ok(o) => return Err(format!("the board daemon's list: unexpected reply {o:?}")),
        Err(e) => return Err(format!("the board daemon's list: {e}")),
    };
    let mut out = Vec::new();
    for (i, r) in offer.remote.iter().enumerate() {
        let Some(spec) = r.spec else {
            return Err(format!(
                "the source does not know the shape of its daemon-served vNPU {i} (attached by socket, not by UUID)"
            ));
        };
        let here = r.uuid.as_ref().and_then(|u| listed.iter().find(|x| &x.uuid == u));
        let uuid = match here {
            Some(x) if x.active && x.shape == spec => x.uuid.clone(),
            Some(x) => {
                return Err(format!(
                    "vNPU {} exists here {} ({}; the source's is {})",
                    x.uuid,
                    if x.active { "with another shape" } else { "but is not started" },
                    vnpu_manager::shape_text(&x.shape),
                    vnpu_manager::shape_text(&spec)
                ))
            }
            None => {
                let req = Request::Create {
                    type_name: None,
                    spec: Some(vnpu_manager::shape_text(&spec)),
                    uuid: r.uuid.clone(),
                    workload: None,
                    qos: Default::default(),
                    place: Default::default(),
                };
                match m.call(&req) {
                    Ok(Outcome::Instance { instance, .. }) => {
                        made.push(instance.uuid.clone());
                        instance.uuid
                    }
                    Ok(o) => return Err(format!("creating the vNPU here: unexpected reply {o:?}")),
                    Err(e) => {
                        return Err(format!(
                            "no room here for the vNPU {}: {e}",
                            vnpu_manager::shape_text(&spec)
                        ))
                    }
                }
            }
        };
        let sock = vnpu_manager::control::instance_socket(&sockets, &uuid);
        let t = std::time::Instant::now();
        while !sock.exists() {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                return Err(format!("the board daemon does not serve {uuid} at {}", sock.display()));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        out.push(sock);
    }
    Ok(out)
}

/// Removes the instances a failed migration created here.
fn forget(dir: &Path, made: &[String]) {
    let m = crate::manage::ManageArgs { state_dir: Some(dir.to_path_buf()), board: None, socket_dir: None };
    for u in made {
        if let Err(e) = m.call(&vnpu_manager::Request::Remove { uuid: u.clone() }) {
            eprintln!("vnpu: removing {u}, created for the migration that failed: {e}");
        }
    }
}

/// A listening unix socket at `path`, the owner's only; a stale socket
/// file is replaced, anything else at `path` refused.
fn bind_private(path: &Path) -> Result<UnixListener, CliError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source| CliError::Write { path: path.display().to_string(), source };
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(CliError::Usage(format!("{} exists and is not a socket", path.display())));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    // Bound and listening under a temporary name, then renamed into
    // place: a client that waits for the path and connects at once never
    // meets a socket that is bound but not yet listening (ECONNREFUSED).
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    Ok(listener)
}

/// `vnpu snapshot`: asks the VM serving `socket` for a snapshot into
/// `dir`; prints what it took.
pub fn snapshot(socket: &Path, dir: &Path, stop: bool) -> Result<(), CliError> {
    let abs = std::path::absolute(dir)
        .map_err(|source| CliError::Write { path: dir.display().to_string(), source })?;
    let v = call(
        socket,
        &serde_json::json!({ "op": "snapshot", "dir": abs, "stop": stop }),
        "the snapshot failed",
    )?;
    let mib = v["bytes"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20);
    println!(
        "snapshot: {} ({mib:.1} MiB on disk, {} RAM pages, the VM paused {:.1} ms, {:.1} of them for the vNPUs' running requests){}",
        abs.display(),
        v["ram_pages"],
        v["took_ms"].as_f64().unwrap_or(f64::NAN),
        v["drain_ms"].as_f64().unwrap_or(f64::NAN),
        if stop { "; the VM stopped" } else { "" }
    );
    Ok(())
}

/// `vnpu restore`: runs the VM the snapshot in `dir` saved, from where it
/// was; returns the exit code its guest asks for.
pub fn restore(dir: &Path, api_socket: Option<&Path>) -> Result<u8, CliError> {
    let t = std::time::Instant::now();
    let mut vm = vnpu_vm::Vm::restore(dir, std::io::stdout())?;
    eprintln!("vnpu: restored {} in {:.1} ms", dir.display(), t.elapsed().as_secs_f64() * 1e3);
    if let Some(p) = api_socket {
        serve_api(p, vm.pause_handle())?;
    }
    crate::run::finish(vm.run())
}
