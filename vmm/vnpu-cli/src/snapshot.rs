//! `vnpu snapshot` and `vnpu restore`, and the API socket of `vnpu run
//! --api-socket` through which a snapshot is asked of a running VM
//! (`docs/migration.md`).
//!
//! The socket takes one JSON line per connection,
//! `{"op":"snapshot","dir":"/abs/path","stop":false}`, and answers one:
//! `{"ok":true,"dir":...,"bytes":N,"ram_pages":N,"took_ms":T,"drain_ms":D}` or
//! `{"ok":false,"error":"..."}`.

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
    dir: PathBuf,
    #[serde(default)]
    stop: bool,
}

/// Serves the API socket at `path` for the VM `pause` stops, on a thread
/// of its own (one request at a time). A stale socket file is replaced;
/// anything else at `path` is refused. The socket is the owner's only.
pub fn serve_api(path: &Path, pause: vnpu_vm::PauseHandle) -> Result<(), CliError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source| CliError::Write { path: path.display().to_string(), source };
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(CliError::Usage(format!("{} exists and is not a socket", path.display())));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
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
    if req.op != "snapshot" {
        return fail(format!("unknown op \"{}\" (the API socket takes \"snapshot\")", req.op));
    }
    if !req.dir.is_absolute() {
        return fail("dir must be an absolute path".into());
    }
    match pause.snapshot(&req.dir, req.stop) {
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

/// `vnpu snapshot`: asks the VM serving `socket` for a snapshot into
/// `dir`; prints what it took.
pub fn snapshot(socket: &Path, dir: &Path, stop: bool) -> Result<(), CliError> {
    let abs = std::path::absolute(dir)
        .map_err(|source| CliError::Write { path: dir.display().to_string(), source })?;
    let mut s = UnixStream::connect(socket).map_err(|e| {
        CliError::Usage(format!(
            "cannot reach the VM's API socket {}: {e} (is `vnpu run --api-socket` running?)",
            socket.display()
        ))
    })?;
    let req = serde_json::json!({ "op": "snapshot", "dir": abs, "stop": stop });
    let io = |source| CliError::Write { path: socket.display().to_string(), source };
    s.write_all(format!("{req}\n").as_bytes()).map_err(io)?;
    let mut reply = String::new();
    BufReader::new(s.take(1 << 16)).read_line(&mut reply).map_err(io)?;
    let v: serde_json::Value = serde_json::from_str(&reply)
        .map_err(|e| CliError::Usage(format!("the VM's answer is not JSON ({e}): {reply}")))?;
    if v["ok"] != serde_json::Value::Bool(true) {
        return Err(CliError::Usage(format!(
            "the snapshot failed: {}",
            v["error"].as_str().unwrap_or("the VM gave no reason (did it end?)")
        )));
    }
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
