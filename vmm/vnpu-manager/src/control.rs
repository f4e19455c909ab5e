//! The management protocol (`docs/management.md`, "Control socket"): every
//! management operation as a JSON request with a JSON reply, executed
//! either here against the state directory (no daemon running) or by the
//! board daemon on its control socket `<socket-dir>/control.sock`, which
//! then serves or stops serving the instance before it replies.
//!
//! Framing: one JSON object per line (`\n`-terminated) each way, requests
//! and replies in order on one connection, a line at most
//! [`MAX_LINE`] bytes. Everything read from the socket is untrusted: a
//! request that does not parse gets a `bad_request` reply, a line that is
//! too long ends the connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use npu_model::BoardConfig;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use vnpu_spec::VnpuSpec;

use vnpu_placement::{spec_of, InterferenceModel};

use crate::{split_for_ratio, Instance, InterferenceError, Policy, Shape, Store, StoreError};
use crate::{Qos, Workload, TYPES};

/// Longest request or reply line (bytes, newline excluded).
pub const MAX_LINE: usize = 1 << 20;

/// The control socket's file name in the daemon's socket directory.
pub const CONTROL_SOCKET: &str = "control.sock";

/// The daemon's socket directory when none is given: `STATE_DIR/sockets`.
pub fn default_socket_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("sockets")
}

/// Where the daemon serves instance `uuid`: `SOCKET_DIR/UUID.sock`.
pub fn instance_socket(socket_dir: &Path, uuid: &str) -> PathBuf {
    socket_dir.join(format!("{uuid}.sock"))
}

/// Why a management request failed.
#[derive(Debug, Error)]
pub enum ControlError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Interference(#[from] InterferenceError),
    #[error("{0}")]
    BadRequest(String),
    #[error("control socket {path}: {source}")]
    Connect { path: PathBuf, source: std::io::Error },
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("control socket: {0}")]
    Protocol(String),
    /// The daemon refused the request (`kind` as in [`Failure::kind`]).
    #[error("{message}")]
    Refused { kind: String, message: String },
}

impl ControlError {
    /// The stable error kind sent in a reply (`docs/management.md`).
    pub fn kind(&self) -> &str {
        match self {
            ControlError::Store(e) => match e {
                StoreError::Io { .. } => "io",
                StoreError::Corrupt { .. } | StoreError::StateUuid { .. } => "corrupt_state",
                StoreError::Unknown(_) => "unknown_instance",
                StoreError::Exists(_) => "exists",
                StoreError::BadUuid(_) => "bad_uuid",
                StoreError::AlreadyActive(_) => "already_started",
                StoreError::NotActive(_) => "not_started",
                StoreError::Placement { .. } => "no_room",
                StoreError::PolicyNeeds { .. } => "bad_request",
                StoreError::Interference { .. } => "interference",
            },
            ControlError::Interference(_) => "interference",
            ControlError::BadRequest(_) => "bad_request",
            ControlError::Refused { kind, .. } => kind,
            ControlError::Connect { .. } | ControlError::Io(_) | ControlError::Protocol(_) => "io",
        }
    }
}

/// How `create` and `start` place (`--placement`, `--oversubscribe`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaceOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oversubscribe: Option<u32>,
    #[serde(default)]
    pub placement: Policy,
    /// Characterization matrix to train the interference predictor on
    /// (a path the daemon can read: give it absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interference_matrix: Option<PathBuf>,
}

/// One management request (the `op` key names it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The named types and how many more of each fit. (Struct variants
    /// with no fields, so unknown keys are refused here too.)
    Types {},
    /// Every instance.
    List {},
    /// A persistent instance, not started. `type` or `spec` gives its shape.
    Define {
        #[serde(rename = "type", alias = "mdev_type", default, skip_serializing_if = "Option::is_none")]
        type_name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        spec: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uuid: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workload: Option<Workload>,
        #[serde(default, skip_serializing_if = "Qos::is_none")]
        qos: Qos,
    },
    /// A transient instance, placed and started at once.
    Create {
        #[serde(rename = "type", alias = "mdev_type", default, skip_serializing_if = "Option::is_none")]
        type_name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        spec: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uuid: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workload: Option<Workload>,
        #[serde(default, skip_serializing_if = "Qos::is_none")]
        qos: Qos,
        #[serde(default)]
        place: PlaceOptions,
    },
    /// Places a defined instance.
    Start {
        uuid: String,
        #[serde(default)]
        place: PlaceOptions,
    },
    /// A new shape on the instance's cores: `sa`/`vu`/`sram`, or `ratio`
    /// (SA:VU, split over its EUs per core) with the `workload` it is for.
    Remap {
        uuid: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sa: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vu: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sram: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ratio: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workload: Option<Workload>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        oversubscribe: Option<u32>,
    },
    /// Frees its cores (a transient instance is removed).
    Stop { uuid: String },
    /// Forgets it, started or not.
    Remove { uuid: String },
    /// What each physical core of the board has done (only a running
    /// daemon knows: it owns the cores).
    Cores {},
}

impl Request {
    /// Whether the request may change the state.
    pub fn changes_state(&self) -> bool {
        !matches!(self, Request::Types {} | Request::List {} | Request::Cores {})
    }
}

/// One named type on this board.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TypeInfo {
    #[serde(rename = "type")]
    pub type_name: String,
    pub spec: String,
    pub execution_units: u32,
    /// How many more fit on the board now.
    pub available_instances: u32,
}

/// What a request did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Types {
        board: String,
        /// e.g. `1 chip(s) x 4 cores, 4 SA + 4 VU per core`.
        layout: String,
        types: Vec<TypeInfo>,
    },
    Instances(Vec<Instance>),
    /// The instance after a define, create, start or remap; `previous` is
    /// its shape before a remap; `socket` is where the daemon serves it.
    Instance {
        instance: Instance,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        previous: Option<Shape>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        socket: Option<PathBuf>,
    },
    /// Every physical core's use since the daemon started.
    Cores {
        /// Simulated cycles per microsecond.
        clock_mhz: u32,
        cores: Vec<CoreUse>,
    },
    Done,
}

/// What one physical core has done since the daemon started (cycles are
/// simulated NPU cycles of the board's clock).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CoreUse {
    /// Physical core (chip * cores_per_chip + core).
    pub core: u32,
    /// Requests served.
    pub requests: u64,
    /// Requests that waited for engines (an oversubscribed core).
    pub waited: u64,
    /// Running requests suspended for more urgent ones.
    pub preempted: u64,
    /// The board's simulated time so far.
    pub board_cycles: f64,
    /// Cycles during which two or more tenants ran at once.
    pub overlap_cycles: f64,
    /// Busy cycles per tenant (a vNPU: its instance's UUID).
    pub tenants: Vec<TenantUse>,
    /// Requests with a latency target, and those that missed it.
    pub slo_requests: u64,
    pub slo_misses: u64,
    /// Its vNPUs claim more SAs or VUs than it has (they time-share it).
    pub oversubscribed: bool,
}

/// One tenant's busy time on a core, and what harvesting did for and to
/// it (engine-cycles; `docs/management.md`, "Harvesting").
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantUse {
    pub tenant: String,
    pub busy_cycles: f64,
    /// Its spread programs' work on idle engines beyond its own.
    #[serde(default)]
    pub borrowed_cycles: f64,
    /// Its own engines lent to others while it had no request on the core.
    #[serde(default)]
    pub lent_cycles: f64,
    /// Its requests that waited for borrowers to give engines back, the
    /// cycles they waited in all, and the longest wait.
    #[serde(default)]
    pub reclaims: u64,
    #[serde(default)]
    pub reclaim_cycles: f64,
    #[serde(default)]
    pub reclaim_max_cycles: f64,
}

/// A refused request, as sent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// Stable: `bad_request`, `unknown_instance`, `exists`, `bad_uuid`,
    /// `already_started`, `not_started`, `no_room`, `interference`,
    /// `corrupt_state`, `io`.
    pub kind: String,
    /// For people.
    pub message: String,
}

/// One reply line: `{"ok": true, "result": ...}` or `{"ok": false,
/// "error": {"kind", "message"}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Outcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Failure>,
}

impl From<Result<Outcome, ControlError>> for Reply {
    fn from(r: Result<Outcome, ControlError>) -> Self {
        match r {
            Ok(o) => Reply { ok: true, result: Some(o), error: None },
            Err(e) => Reply {
                ok: false,
                result: None,
                error: Some(Failure { kind: e.kind().to_string(), message: e.to_string() }),
            },
        }
    }
}

impl From<Reply> for Result<Outcome, ControlError> {
    fn from(r: Reply) -> Self {
        match (r.ok, r.result, r.error) {
            (true, Some(o), _) => Ok(o),
            (false, _, Some(f)) => Err(ControlError::Refused { kind: f.kind, message: f.message }),
            _ => Err(ControlError::Protocol("a reply with neither a result nor an error".into())),
        }
    }
}

/// `sa=..,vu=..,sram=..,hbm=..[,cores=..][,chips=..]`, the `--spec` form.
pub fn shape_text(s: &Shape) -> String {
    fn size(b: u64) -> String {
        if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
            format!("{}G", b >> 30)
        } else {
            format!("{}M", b >> 20)
        }
    }
    let mut t = format!(
        "sa={},vu={},sram={},hbm={}",
        s.sa_per_core(),
        s.vu_per_core(),
        size(s.sram_per_core()),
        size(s.hbm_per_core())
    );
    if s.cores_per_chip() != 1 {
        t += &format!(",cores={}", s.cores_per_chip());
    }
    if s.chips() != 1 {
        t += &format!(",chips={}", s.chips());
    }
    t
}

fn resolve_shape(type_name: &Option<String>, spec: &Option<String>) -> Result<Shape, ControlError> {
    match (type_name, spec) {
        (Some(t), None) => VnpuSpec::named(t).ok_or_else(|| {
            ControlError::BadRequest(format!("unknown type `{t}` (types: {})", TYPES.join(", ")))
        }),
        (None, Some(s)) => VnpuSpec::parse(s).map_err(|e| ControlError::BadRequest(e.to_string())),
        _ => Err(ControlError::BadRequest("give exactly one of `type` and `spec`".into())),
    }
}

fn apply_placement(
    store: &mut Store,
    place: &PlaceOptions,
    model: Option<InterferenceModel>,
) -> Result<(), ControlError> {
    if let Some(f) = place.oversubscribe {
        if f == 0 {
            return Err(ControlError::BadRequest("oversubscribe must be 1 or more".into()));
        }
        store.allow_oversubscription(f);
    }
    store.set_placement(place.placement, model);
    Ok(())
}

/// What a request needs from outside the state before any lock is taken:
/// the interference model its placement is trained on (a file the client
/// named, read and trained on here, so that no lock is held across the
/// open, the read or the training), with the solo counters of every
/// tenant it will price already measured (a lowering and a run of the
/// board model each, 10-50 ms, also kept out of the lock).
#[derive(Debug, Default)]
pub struct Prepared {
    model: Option<InterferenceModel>,
}

/// How many times a request is prepared before it fails when, each time,
/// another manager added a tenant between [`prepare`] and the lock.
const PREPARE_ATTEMPTS: usize = 3;

/// Runs `attempt` (a [`prepare`] and an [`execute_prepared`]) again while
/// it fails only for want of a fresh preparation
/// ([`ControlError::needs_prepare_again`]), at most [`PREPARE_ATTEMPTS`]
/// times.
pub fn retry_unprepared<T>(mut attempt: impl FnMut() -> Result<T, ControlError>) -> Result<T, ControlError> {
    let mut tries = 1;
    loop {
        match attempt() {
            Err(e) if tries < PREPARE_ATTEMPTS && e.needs_prepare_again() => tries += 1,
            r => return r,
        }
    }
}

/// Reads and trains what `req` needs ([`Prepared`]), and measures the solo
/// counters of the tenants in `dir` as they are now and of the request's
/// own workload; call it before taking any lock, then [`execute_prepared`].
pub fn prepare(dir: &Path, board: &BoardConfig, req: &Request) -> Result<Prepared, ControlError> {
    let (place, own) = match req {
        Request::Create { place, workload, type_name, spec, .. } => {
            // A bad shape fails later, under the lock, with its own error.
            let own = resolve_shape(type_name, spec)
                .ok()
                .zip(workload.as_ref())
                .map(|(s, w)| spec_of(w, s.sa_per_core(), s.vu_per_core()));
            (place, own)
        }
        Request::Start { place, .. } => (place, None),
        _ => return Ok(Prepared::default()),
    };
    let mut model = match (&place.interference_matrix, place.placement) {
        (_, Policy::Pack) | (None, _) => return Ok(Prepared::default()),
        (Some(path), _) => InterferenceModel::from_file(path, board, &vnpu_placement::Linear)?,
    };
    // Every instance with a workload (a `start`'s own is among them).
    let instances = Store::peek(dir)?;
    model.measure_missing(&instances, own.as_slice())?;
    Ok(Prepared { model: Some(model) })
}

impl ControlError {
    /// Whether a tenant's counters were not measured by [`prepare`]
    /// (another manager added it in between): preparing again measures it.
    pub fn needs_prepare_again(&self) -> bool {
        let interference = match self {
            ControlError::Store(StoreError::Interference { source, .. }) => &**source,
            ControlError::Interference(source) => source,
            _ => return false,
        };
        matches!(interference, InterferenceError::NotMeasured(_))
    }
}

/// Executes `req` against the state directory `dir` (holding its lock for
/// the whole request, so concurrent managers never lose an update).
pub fn execute(dir: &Path, board: &BoardConfig, req: &Request) -> Result<Outcome, ControlError> {
    execute_then(dir, board, req, |_| {})
}

/// As [`execute`]; when the request succeeds, `then` sees every instance
/// as the request left them, still under the state directory's lock (the
/// daemon serves the started ones before anyone else can change them).
pub fn execute_then(
    dir: &Path,
    board: &BoardConfig,
    req: &Request,
    then: impl FnOnce(&[Instance]),
) -> Result<Outcome, ControlError> {
    // `then` runs once, on the attempt that succeeds.
    let mut then = Some(then);
    retry_unprepared(|| {
        let prepared = prepare(dir, board, req)?;
        execute_prepared(dir, board, req, prepared, |instances| {
            if let Some(then) = then.take() {
                then(instances);
            }
        })
    })
}

/// As [`execute_then`], with what [`prepare`] read for `req`.
pub fn execute_prepared(
    dir: &Path,
    board: &BoardConfig,
    req: &Request,
    prepared: Prepared,
    then: impl FnOnce(&[Instance]),
) -> Result<Outcome, ControlError> {
    let mut store = Store::open(dir, board)?;
    let outcome = execute_on(&mut store, board, req, prepared)?;
    then(store.instances());
    Ok(outcome)
}

fn execute_on(
    store: &mut Store,
    board: &BoardConfig,
    req: &Request,
    prepared: Prepared,
) -> Result<Outcome, ControlError> {
    if let Request::Define { workload: Some(w), .. }
    | Request::Create { workload: Some(w), .. }
    | Request::Remap { workload: Some(w), .. } = req
    {
        if w.name.is_empty() || w.batch == 0 {
            return Err(ControlError::BadRequest(format!(
                "workload {:?} batch {}: give a name and a batch of 1 or more",
                w.name, w.batch
            )));
        }
    }
    let instance = |store: &Store, uuid: &str| -> Result<Outcome, ControlError> {
        Ok(Outcome::Instance { instance: store.get(uuid)?.clone(), previous: None, socket: None })
    };
    match req {
        Request::Types {} => {
            let b = store.board();
            let types = TYPES
                .iter()
                .filter_map(|t| VnpuSpec::named(t).map(|s| (*t, s)))
                .map(|(t, s)| TypeInfo {
                    type_name: t.to_string(),
                    spec: shape_text(&s),
                    execution_units: s.eus(),
                    available_instances: b.room_for(&s),
                })
                .collect();
            let layout = format!(
                "{} chip(s) x {} cores, {} SA + {} VU per core",
                board.chips, board.cores_per_chip, board.core.sa_count, board.core.vu_count
            );
            Ok(Outcome::Types { board: board.name.clone(), layout, types })
        }
        Request::List {} => Ok(Outcome::Instances(store.instances().to_vec())),
        Request::Define { type_name, spec, uuid, workload, qos } => {
            let shape = resolve_shape(type_name, spec)?;
            let u = store.define_for(shape, type_name.as_deref(), uuid.as_deref(), workload.clone(), *qos)?;
            instance(store, &u)
        }
        Request::Create { type_name, spec, uuid, workload, qos, place } => {
            let shape = resolve_shape(type_name, spec)?;
            apply_placement(store, place, prepared.model)?;
            let u = store.create_for(shape, type_name.as_deref(), uuid.as_deref(), workload.clone(), *qos)?;
            instance(store, &u)
        }
        Request::Start { uuid, place } => {
            apply_placement(store, place, prepared.model)?;
            store.start(uuid)?;
            instance(store, uuid)
        }
        Request::Remap { uuid, sa, vu, sram, ratio, workload, oversubscribe } => {
            let old = store.get(uuid)?.shape;
            let (mut nsa, mut nvu) = (old.sa_per_core(), old.vu_per_core());
            if let Some(k) = ratio {
                if sa.is_some() || vu.is_some() {
                    return Err(ControlError::BadRequest("give `ratio` or `sa`/`vu`, not both".into()));
                }
                if !(k.is_finite() && *k > 0.0) {
                    return Err(ControlError::BadRequest(format!("ratio {k} is not a positive number")));
                }
                let eus = old.eus();
                (nsa, nvu) =
                    split_for_ratio(eus, *k, board.core.sa_count, board.core.vu_count).ok_or_else(|| {
                        ControlError::BadRequest(format!(
                            "{eus} EUs per core cannot hold both an SA and a VU"
                        ))
                    })?;
            } else if sa.is_none() && vu.is_none() && sram.is_none() {
                return Err(ControlError::BadRequest("remap needs sa, vu, sram or ratio".into()));
            }
            // The same checks as `define` and `create`: through the
            // shape's constructor.
            let to = old
                .with_units(sa.unwrap_or(nsa), vu.unwrap_or(nvu))
                .and_then(|s| s.with_sram(sram.unwrap_or(old.sram_per_core())))
                .map_err(|e| ControlError::BadRequest(format!("remap: {e}")))?;
            if oversubscribe == &Some(0) {
                return Err(ControlError::BadRequest("oversubscribe must be 1 or more".into()));
            }
            store.remap(uuid, to, *oversubscribe)?;
            if workload.is_some() {
                store.set_workload(uuid, workload.clone())?;
            }
            Ok(Outcome::Instance { instance: store.get(uuid)?.clone(), previous: Some(old), socket: None })
        }
        Request::Stop { uuid } => {
            store.stop(uuid)?;
            Ok(Outcome::Done)
        }
        Request::Remove { uuid } => {
            store.remove(uuid)?;
            Ok(Outcome::Done)
        }
        Request::Cores {} => Err(ControlError::BadRequest(
            "only a running board daemon knows what its cores did (start `vnpu daemon`)".into(),
        )),
    }
}

/// Reads one line of at most [`MAX_LINE`] bytes; `None` at end of stream.
pub fn read_line(r: &mut impl BufRead) -> Result<Option<String>, ControlError> {
    let mut buf = Vec::new();
    let n = r.take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_LINE {
        return Err(ControlError::Protocol(format!("a line longer than {MAX_LINE} bytes")));
    }
    String::from_utf8(buf).map(Some).map_err(|_| ControlError::Protocol("a line that is not UTF-8".into()))
}

/// Writes `value` as one JSON line.
pub fn write_line(w: &mut impl Write, value: &impl Serialize) -> Result<(), ControlError> {
    let mut out = serde_json::to_vec(value).map_err(|e| ControlError::Protocol(e.to_string()))?;
    out.push(b'\n');
    Ok(w.write_all(&out)?)
}

/// Serves one control connection: each request line is parsed and handed
/// to `handle`, whose reply is written back. Returns when the client
/// closes, or sends a line that is too long or not UTF-8.
pub fn serve_connection(
    stream: UnixStream,
    mut handle: impl FnMut(&Request) -> Result<Outcome, ControlError>,
) -> Result<(), ControlError> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    while let Some(line) = read_line(&mut reader)? {
        if line.trim().is_empty() {
            continue;
        }
        let reply: Reply = match serde_json::from_str::<Request>(&line) {
            Ok(req) => handle(&req).into(),
            Err(e) => Err(ControlError::BadRequest(format!("not a request: {e}"))).into(),
        };
        write_line(&mut writer, &reply)?;
    }
    Ok(())
}

/// A management client of the daemon's control socket.
#[derive(Debug)]
pub struct ControlClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> Result<Self, ControlError> {
        let stream = UnixStream::connect(path)
            .map_err(|source| ControlError::Connect { path: path.into(), source })?;
        let writer = stream.try_clone()?;
        Ok(Self { reader: BufReader::new(stream), writer })
    }

    /// Sends `req` and waits for its reply.
    pub fn call(&mut self, req: &Request) -> Result<Outcome, ControlError> {
        // A daemon that refuses the connection (too many open, or this user
        // may not manage the board) replies once and closes, possibly
        // before the request is written: its reply is still there to read.
        let written = write_line(&mut self.writer, req);
        let line = match read_line(&mut self.reader) {
            Ok(l) => l,
            Err(e) => {
                written?;
                return Err(e);
            }
        }
        .ok_or_else(|| ControlError::Protocol("the daemon closed the connection".into()))?;
        let reply: Reply = serde_json::from_str(&line)
            .map_err(|e| ControlError::Protocol(format!("a reply that does not parse: {e}")))?;
        reply.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_from_their_documented_json() {
        let cases = [
            (r#"{"op":"types"}"#, Request::Types {}),
            (r#"{"op":"list"}"#, Request::List {}),
            (
                r#"{"op":"create","type":"small","place":{"oversubscribe":2}}"#,
                Request::Create {
                    type_name: Some("small".into()),
                    spec: None,
                    uuid: None,
                    workload: None,
                    qos: Qos::default(),
                    place: PlaceOptions { oversubscribe: Some(2), ..Default::default() },
                },
            ),
            (
                r#"{"op":"create","spec":"sa=4,vu=4,sram=8M,hbm=1G","qos":{"priority":5,"slo_us":1000}}"#,
                Request::Create {
                    type_name: None,
                    spec: Some("sa=4,vu=4,sram=8M,hbm=1G".into()),
                    uuid: None,
                    workload: None,
                    qos: Qos { priority: 5, slo_us: 1000, borrow: None },
                    place: PlaceOptions::default(),
                },
            ),
            (r#"{"op":"cores"}"#, Request::Cores {}),
            (
                r#"{"op":"define","spec":"sa=1,vu=1,sram=4M,hbm=1G","workload":{"name":"bert","batch":8}}"#,
                Request::Define {
                    type_name: None,
                    spec: Some("sa=1,vu=1,sram=4M,hbm=1G".into()),
                    uuid: None,
                    workload: Some(Workload { name: "bert".into(), batch: 8 }),
                    qos: Qos::default(),
                },
            ),
            (r#"{"op":"stop","uuid":"x"}"#, Request::Stop { uuid: "x".into() }),
            (
                r#"{"op":"define","mdev_type":"large","uuid":"u","qos":{"slo_us":250,"borrow":{"sa":1,"vu":0}}}"#,
                Request::Define {
                    type_name: Some("large".into()),
                    spec: None,
                    uuid: Some("u".into()),
                    workload: None,
                    qos: Qos { priority: 0, slo_us: 250, borrow: Some(crate::Borrow { sa: 1, vu: 0 }) },
                },
            ),
        ];
        for (json, want) in cases {
            let got: Request = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(got, want, "{json}");
            let back: Request = serde_json::from_str(&serde_json::to_string(&got).unwrap_or_default())
                .unwrap_or_else(|e| panic!("{json} round trip: {e}"));
            assert_eq!(back, want, "{json} round trip");
        }
        for bad in [
            r#"{"op":"stop"}"#,
            r#"{"op":"launch"}"#,
            r#"{"op":"list","extra":1}"#,
            r#"{"op":"create","type":"small","qos":{"priority":256}}"#,
            r#"{"op":"create","type":"small","qos":{"deadline":1}}"#,
            r#"{"op":"cores","core":1}"#,
            "[]",
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad} must not parse");
        }
    }

    /// What the `control_request` fuzz target does, on a few inputs: a
    /// connection's bytes framed, parsed and executed on a state directory.
    #[test]
    fn a_connection_of_garbage_and_requests_is_served_to_its_end() {
        let dir = std::env::temp_dir().join(format!("vnpu-control-garbage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let board = BoardConfig::default();
        let input: &[u8] = b"{\"op\":\"create\",\"spec\":\"sa=99999999999999999999\"}\nnot json\n{\"op\":\"create\",\"type\":\"small\"}\n{\"op\":\"list\"}\n\xc3";
        let (mut client, server) = UnixStream::pair().unwrap();
        client.write_all(input).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let mut executed = 0;
        let served = serve_connection(server, |req| {
            executed += 1;
            execute(&dir, &board, req)
        });
        // The last line is not UTF-8: the connection ends there, with an error.
        assert!(served.is_err());
        let mut replies = String::new();
        client.read_to_string(&mut replies).unwrap();
        let lines: Vec<&str> = replies.lines().collect();
        assert_eq!(executed, 3, "{replies}");
        assert_eq!(lines.len(), 4, "{replies}");
        assert!(lines[0].contains("error") && lines[1].contains("error"), "{replies}");
        assert!(lines[3].contains("small"), "the created instance is listed: {replies}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `remap` goes through the shape's constructor, as `define` and
    /// `create` do: no zero counts, no SRAM off the slices, no wrap.
    #[test]
    fn remap_refuses_shapes_define_would_refuse() {
        let dir = std::env::temp_dir().join(format!("vnpu-control-remap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let board = BoardConfig::default();
        let define = Request::Define {
            type_name: None,
            spec: Some("sa=1,vu=1,sram=4M,hbm=1G".into()),
            uuid: None,
            workload: None,
            qos: Qos::default(),
        };
        let Ok(Outcome::Instance { instance, .. }) = execute(&dir, &board, &define) else {
            panic!("define failed")
        };
        let uuid = instance.uuid;
        let remap = |sa: Option<u32>, vu: Option<u32>, sram: Option<u64>| Request::Remap {
            uuid: uuid.clone(),
            sa,
            vu,
            sram,
            ratio: None,
            workload: None,
            oversubscribe: None,
        };
        for bad in [
            remap(Some(0), None, None),
            remap(None, Some(0), None),
            remap(Some(u32::MAX), Some(1), None),
            remap(Some(65), None, None),
            remap(None, None, Some(3)),
            remap(None, None, Some(0)),
        ] {
            let e = execute(&dir, &board, &bad).unwrap_err();
            assert!(matches!(e, ControlError::BadRequest(_)), "{bad:?}: {e}");
        }
        let Ok(Outcome::Instances(list)) = execute(&dir, &board, &Request::List {}) else {
            panic!("list failed")
        };
        assert_eq!(list[0].shape, instance.shape, "a refused remap changed the shape");
        let ok = execute(&dir, &board, &remap(Some(2), None, Some(8 << 20))).unwrap();
        let Outcome::Instance { instance: after, .. } = ok else { panic!("remap failed") };
        assert_eq!((after.shape.sa_per_core(), after.shape.sram_per_core()), (2, 8 << 20));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The interference matrix a request names is read and trained on by
    /// `prepare`, before the state directory is locked: executing needs
    /// the file no more (here it is gone by then).
    #[test]
    fn a_named_matrix_is_read_before_the_state_is_locked() {
        let dir = std::env::temp_dir().join(format!("vnpu-control-prepare-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let matrix = dir.join("matrix.json");
        std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plots/interference.json"), &matrix)
            .unwrap();
        let board = BoardConfig::default();
        let create = Request::Create {
            type_name: Some("small".into()),
            spec: None,
            uuid: None,
            workload: Some(Workload { name: "mobilenet".into(), batch: 1 }),
            qos: Qos::default(),
            place: PlaceOptions {
                oversubscribe: None,
                placement: Policy::Interference,
                interference_matrix: Some(matrix.clone()),
            },
        };
        let state = dir.join("state");
        let prepared = prepare(&state, &board, &create).unwrap();
        std::fs::remove_file(&matrix).unwrap();
        let outcome = execute_prepared(&state, &board, &create, prepared, |_| {}).unwrap();
        assert!(matches!(outcome, Outcome::Instance { .. }), "{outcome:?}");
        // Without `prepare`, the same request now fails on the missing file.
        assert!(execute(&state, &board, &create).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Solo counters a placement prices are measured by `prepare`, out of
    /// the lock; under it they are only looked up. A tenant another
    /// manager added in between is not measured under the lock: the
    /// request fails as "prepare again", and `execute` does so.
    #[test]
    fn counters_are_measured_before_the_lock_never_under_it() {
        let dir = std::env::temp_dir().join(format!("vnpu-control-measure-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let matrix = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plots/interference.json");
        let board = BoardConfig::default();
        let create = |name: &str, batch: u32, placement: Policy| Request::Create {
            type_name: Some("small".into()),
            spec: None,
            uuid: None,
            workload: Some(Workload { name: name.into(), batch }),
            qos: Qos::default(),
            place: PlaceOptions { oversubscribe: None, placement, interference_matrix: Some(matrix.into()) },
        };
        // Batch 3 is in no matrix: `prepare` measures it.
        let stale = prepare(&dir, &board, &create("mobilenet", 1, Policy::Interference)).unwrap();
        let added = create("bert", 3, Policy::Pack);
        assert!(matches!(execute(&dir, &board, &added), Ok(Outcome::Instance { .. })));
        // The stale preparation lacks the tenant just added: refused, not
        // measured under the lock.
        let req = create("mobilenet", 1, Policy::Interference);
        let e = execute_prepared(&dir, &board, &req, stale, |_| {}).unwrap_err();
        assert!(e.needs_prepare_again(), "{e}");
        let Ok(Outcome::Instances(list)) = execute(&dir, &board, &Request::List {}) else {
            panic!("list failed")
        };
        assert_eq!(list.len(), 1, "the refused create left an instance");
        // A fresh preparation has it; `execute` prepares by itself.
        let fresh = prepare(&dir, &board, &req).unwrap();
        assert!(matches!(execute_prepared(&dir, &board, &req, fresh, |_| {}), Ok(Outcome::Instance { .. })));
        assert!(matches!(
            execute(&dir, &board, &create("bert", 5, Policy::Interference)),
            Ok(Outcome::Instance { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_line_longer_than_the_limit_is_refused() {
        let mut long = vec![b' '; MAX_LINE + 10];
        long.push(b'\n');
        let mut r = std::io::Cursor::new(long);
        assert!(matches!(read_line(&mut r), Err(ControlError::Protocol(_))));
        let mut ok = std::io::Cursor::new(b"{\"op\":\"list\"}\nrest".to_vec());
        assert_eq!(read_line(&mut ok).ok().flatten().as_deref(), Some("{\"op\":\"list\"}"));
        assert_eq!(read_line(&mut ok).ok().flatten().as_deref(), Some("rest"));
        assert_eq!(read_line(&mut ok).ok().flatten(), None);
    }
}
