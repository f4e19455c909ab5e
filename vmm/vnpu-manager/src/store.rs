//! The manager's state: every instance, in one JSON file in a state
//! directory. Each change holds an exclusive lock on the directory's lock
//! file, writes the whole state to a temporary file, flushes it to disk and
//! renames it over the old one (then syncs the directory), so a crash at
//! any point leaves either the old state or the new one, never a mix.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use npu_model::BoardConfig;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use vnpu_placement::{spec_of, Board, InterferenceError, InterferenceModel, PlacementError, Policy};
use vnpu_spec::{Instance, Qos, Shape, Workload};

const STATE: &str = "vnpu-state.json";
const LOCK: &str = "vnpu-state.lock";

/// Why a management operation failed.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("state directory {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("state file {path} is not valid: {source}")]
    Corrupt {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("state file {path}: instance `{uuid}` is not named by a canonical UUID, or named twice")]
    StateUuid { path: String, uuid: String },
    #[error("no vNPU instance {0}")]
    Unknown(String),
    #[error("a vNPU instance {0} already exists")]
    Exists(String),
    #[error("`{0}` is not a UUID")]
    BadUuid(String),
    #[error("vNPU {0} is already started")]
    AlreadyActive(String),
    #[error("vNPU {0} is not started")]
    NotActive(String),
    #[error("cannot place vNPU {uuid}: {source}")]
    Placement { uuid: String, source: PlacementError },
    #[error("placement `{policy}` needs {what}")]
    PolicyNeeds { policy: &'static str, what: &'static str },
    #[error("cannot place vNPU {uuid} by interference: {source}")]
    Interference { uuid: String, source: Box<InterferenceError> },
}

/// `u` as a UUID in its canonical form (lower-case, hyphenated), or `None`
/// when it is not a UUID.
fn canonical_uuid(u: &str) -> Option<String> {
    uuid::Uuid::parse_str(u).ok().map(|u| u.to_string())
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    instances: Vec<Instance>,
}

/// The state directory, locked for the lifetime of the value.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    _lock: File,
    instances: Vec<Instance>,
    board: BoardConfig,
    oversubscribe: Option<u32>,
    policy: Policy,
    interference: Option<InterferenceModel>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.display().to_string(), source }
}

impl Store {
    /// Opens (creating it if needed) the state in `dir` for a board of
    /// `board`, waiting for other managers to finish.
    pub fn open(dir: &Path, board: &BoardConfig) -> Result<Self, StoreError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let lock_path = dir.join(LOCK);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        let instances = Self::read_state(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            _lock: lock,
            instances,
            board: board.clone(),
            oversubscribe: None,
            policy: Policy::Pack,
            interference: None,
        })
    }

    /// The instances in `dir`'s state file, checked as [`Store::open`]
    /// checks them (none while there is no file).
    fn read_state(dir: &Path) -> Result<Vec<Instance>, StoreError> {
        let path = dir.join(STATE);
        match fs::read(&path) {
            Ok(bytes) => {
                // Shapes are checked as they deserialize (`VnpuSpec`);
                // the UUIDs name sockets and files, so they are checked
                // here before any becomes a path.
                let s: StateFile = serde_json::from_slice(&bytes)
                    .map_err(|source| StoreError::Corrupt { path: path.display().to_string(), source })?;
                let mut seen = std::collections::HashSet::new();
                for i in &s.instances {
                    let canonical = canonical_uuid(&i.uuid).is_some_and(|u| u == i.uuid);
                    if !canonical || !seen.insert(i.uuid.as_str()) {
                        return Err(StoreError::StateUuid {
                            path: path.display().to_string(),
                            uuid: i.uuid.clone(),
                        });
                    }
                }
                Ok(s.instances)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// The instances in `dir` as they are now, read without taking the
    /// lock: what a request looks at before it waits for the lock (to
    /// measure what it will need under it), never what it decides on.
    pub fn peek(dir: &Path) -> Result<Vec<Instance>, StoreError> {
        Self::read_state(dir)
    }

    /// The state file of state directory `dir`.
    pub fn state_file(dir: &Path) -> PathBuf {
        dir.join(STATE)
    }

    /// The state file's modification time and length, for noticing that
    /// another manager changed it (`None` while there is none).
    pub fn stamp(dir: &Path) -> Option<(std::time::SystemTime, u64)> {
        let m = fs::metadata(Self::state_file(dir)).ok()?;
        Some((m.modified().ok()?, m.len()))
    }

    /// Lets `create` and `start` oversubscribe a core's EUs up to `factor`
    /// when nothing fits (the vNPUs on such a core time-share it).
    pub fn allow_oversubscription(&mut self, factor: u32) {
        self.oversubscribe = Some(factor);
    }

    /// Places `create` and `start` as `policy` says (`pack` by default);
    /// the interference policies price cores with `model` and need the
    /// instance's workload.
    pub fn set_placement(&mut self, policy: Policy, model: Option<InterferenceModel>) {
        self.policy = policy;
        self.interference = model;
    }

    fn place(
        &mut self,
        uuid: &str,
        shape: &Shape,
        workload: Option<&Workload>,
    ) -> Result<vnpu_placement::Placement, StoreError> {
        let placement = |source| StoreError::Placement { uuid: uuid.into(), source };
        let mut board = self.board();
        if self.policy == Policy::Pack {
            return board.place_allowing(shape, self.oversubscribe).map_err(placement);
        }
        let policy = self.policy.name();
        let Some(model) = self.interference.as_ref() else {
            return Err(StoreError::PolicyNeeds {
                policy,
                what: "an interference matrix (--interference-matrix)",
            });
        };
        let Some(w) = workload else {
            return Err(StoreError::PolicyNeeds {
                policy,
                what: "the vNPU's workload (--workload NAME[:BATCH])",
            });
        };
        let priced = |source| StoreError::Interference { uuid: uuid.into(), source: Box::new(source) };
        let mut tenants = model.tenants(&self.instances).map_err(priced)?;
        // Known, never measured here: `control::prepare` measured what
        // was missing before the lock was taken.
        let own = model.known(&spec_of(w, shape.sa_per_core(), shape.vu_per_core())).map_err(priced)?;
        let mut failed = None;
        let r = board.place_scored(shape, self.policy, &mut |_, cores| {
            let before = tenants.len();
            tenants.extend(cores.iter().map(|&c| (own, c as usize)));
            let cost = model.overhead(&tenants);
            tenants.truncate(before);
            cost.unwrap_or_else(|e| {
                failed.get_or_insert(e);
                f64::NAN
            })
        });
        if let Some(e) = failed {
            return Err(priced(e));
        }
        match (r, self.oversubscribe) {
            (Err(PlacementError::NoRoom), Some(f)) => board.place_oversubscribed(shape, f).map_err(placement),
            (r, _) => r.map_err(placement),
        }
    }

    /// Every instance, defined or active.
    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }

    /// The board with the active instances on it.
    pub fn board(&self) -> Board {
        let mut b = Board::new(&self.board);
        for i in self.instances.iter().filter(|i| i.active) {
            b.occupy(&i.shape, &i.cores);
        }
        b
    }

    /// The instance `uuid`.
    pub fn get(&self, uuid: &str) -> Result<&Instance, StoreError> {
        self.instances.iter().find(|i| i.uuid == uuid).ok_or_else(|| StoreError::Unknown(uuid.into()))
    }

    fn save(&self) -> Result<(), StoreError> {
        let path = self.dir.join(STATE);
        let tmp = self.dir.join(format!(".{STATE}.tmp"));
        let body = serde_json::to_vec_pretty(&StateFile { version: 1, instances: self.instances.clone() })
            .map_err(|source| StoreError::Corrupt { path: path.display().to_string(), source })?;
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(&body).and_then(|()| f.sync_all()))
            .map_err(io(&tmp))
            .and_then(|()| fs::rename(&tmp, &path).map_err(io(&path)));
        if written.is_err() {
            // Nothing half-written stays behind (the old state file is intact).
            let _ = fs::remove_file(&tmp);
        }
        written?;
        // Make the rename itself durable.
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(&self.dir))?;
        Ok(())
    }

    fn new_uuid(&self, uuid: Option<&str>) -> Result<String, StoreError> {
        let u = match uuid {
            Some(u) => canonical_uuid(u).ok_or_else(|| StoreError::BadUuid(u.into()))?,
            None => uuid::Uuid::new_v4().to_string(),
        };
        if self.instances.iter().any(|i| i.uuid == u) {
            return Err(StoreError::Exists(u));
        }
        Ok(u)
    }

    fn index(&self, uuid: &str) -> Result<usize, StoreError> {
        self.instances.iter().position(|i| i.uuid == uuid).ok_or_else(|| StoreError::Unknown(uuid.into()))
    }

    /// `define`: a persistent instance, not started.
    pub fn define(
        &mut self,
        shape: Shape,
        type_name: Option<&str>,
        uuid: Option<&str>,
    ) -> Result<String, StoreError> {
        self.add(shape, type_name, uuid, true, None, Qos::default())
    }

    /// `define` of a vNPU whose tenant says which workload it runs and
    /// what service it gets on a shared core.
    pub fn define_for(
        &mut self,
        shape: Shape,
        type_name: Option<&str>,
        uuid: Option<&str>,
        workload: Option<Workload>,
        qos: Qos,
    ) -> Result<String, StoreError> {
        self.add(shape, type_name, uuid, true, workload, qos)
    }

    /// `create`: a transient instance, started at once (gone when stopped).
    pub fn create(
        &mut self,
        shape: Shape,
        type_name: Option<&str>,
        uuid: Option<&str>,
    ) -> Result<String, StoreError> {
        self.add(shape, type_name, uuid, false, None, Qos::default())
    }

    /// `create` of a vNPU whose tenant says which workload it runs and
    /// what service it gets on a shared core.
    pub fn create_for(
        &mut self,
        shape: Shape,
        type_name: Option<&str>,
        uuid: Option<&str>,
        workload: Option<Workload>,
        qos: Qos,
    ) -> Result<String, StoreError> {
        self.add(shape, type_name, uuid, false, workload, qos)
    }

    /// A new instance: persistent and stopped, or transient and placed.
    fn add(
        &mut self,
        shape: Shape,
        type_name: Option<&str>,
        uuid: Option<&str>,
        persistent: bool,
        workload: Option<Workload>,
        qos: Qos,
    ) -> Result<String, StoreError> {
        let uuid = self.new_uuid(uuid)?;
        let cores = if persistent { Vec::new() } else { self.place(&uuid, &shape, workload.as_ref())? };
        self.instances.push(Instance {
            uuid: uuid.clone(),
            type_name: type_name.map(String::from),
            shape,
            persistent,
            active: !persistent,
            cores,
            workload,
            qos,
        });
        self.save()?;
        Ok(uuid)
    }

    /// `start`: places a defined instance.
    pub fn start(&mut self, uuid: &str) -> Result<&Instance, StoreError> {
        let i = self.index(uuid)?;
        if self.instances[i].active {
            return Err(StoreError::AlreadyActive(uuid.into()));
        }
        let shape = self.instances[i].shape;
        let workload = self.instances[i].workload.clone();
        let cores = self.place(uuid, &shape, workload.as_ref())?;
        self.instances[i].active = true;
        self.instances[i].cores = cores;
        self.save()?;
        Ok(&self.instances[i])
    }

    /// `remap`: gives instance `uuid` the shape `to` (a workload change).
    /// A started instance keeps its physical cores (its HBM data stays):
    /// the new shape must fit on them beside the other vNPUs (with
    /// `oversubscribe`, up to that many times their EUs); otherwise nothing
    /// changes. A defined one just takes the new shape.
    pub fn remap(
        &mut self,
        uuid: &str,
        to: Shape,
        oversubscribe: Option<u32>,
    ) -> Result<&Instance, StoreError> {
        let i = self.index(uuid)?;
        let inst = &self.instances[i];
        if inst.active {
            let mut board = self.board();
            board
                .remap(&inst.shape, &to, &inst.cores, oversubscribe)
                .map_err(|source| StoreError::Placement { uuid: uuid.into(), source })?;
        }
        if self.instances[i].shape != to {
            // No longer the named type it was made as.
            self.instances[i].type_name = None;
        }
        self.instances[i].shape = to;
        self.save()?;
        Ok(&self.instances[i])
    }

    /// Attaches (or, with `None`, detaches) the workload instance `uuid`
    /// says it runs; its placement stays as it is.
    pub fn set_workload(&mut self, uuid: &str, workload: Option<Workload>) -> Result<&Instance, StoreError> {
        let i = self.index(uuid)?;
        self.instances[i].workload = workload;
        self.save()?;
        Ok(&self.instances[i])
    }

    /// `stop`: releases its cores; a transient instance is removed.
    pub fn stop(&mut self, uuid: &str) -> Result<(), StoreError> {
        let i = self.index(uuid)?;
        if !self.instances[i].active {
            return Err(StoreError::NotActive(uuid.into()));
        }
        if self.instances[i].persistent {
            self.instances[i].active = false;
            self.instances[i].cores.clear();
        } else {
            self.instances.remove(i);
        }
        self.save()
    }

    /// `remove`: stops it if started and forgets it.
    pub fn remove(&mut self, uuid: &str) -> Result<(), StoreError> {
        let i = self.index(uuid)?;
        self.instances.remove(i);
        self.save()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnpu_spec::VnpuSpec;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vnpu-store-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn small() -> Shape {
        VnpuSpec::named("small").unwrap()
    }

    #[test]
    fn definitions_survive_a_restart_and_transients_go_when_stopped() {
        let d = dir("restart");
        let b = BoardConfig::default();
        let (defined, created) = {
            let mut s = Store::open(&d, &b).unwrap();
            let u = s.define(small(), Some("small"), None).unwrap();
            s.start(&u).unwrap();
            let c = s.create(small(), None, Some("6f1c2f39-3a39-4c36-9a6e-0c1a2b3c4d5e")).unwrap();
            (u, c)
        };
        // A new manager process sees both, placed where they were.
        let mut s = Store::open(&d, &b).unwrap();
        assert!(s.get(&defined).unwrap().active);
        assert_eq!(s.get(&created).unwrap().cores.len(), 1);
        assert_eq!(s.board().eu_use().0, 4);
        s.stop(&created).unwrap();
        assert!(matches!(s.get(&created), Err(StoreError::Unknown(_))));
        s.stop(&defined).unwrap();
        assert!(!s.get(&defined).unwrap().active);
        assert!(matches!(s.stop(&defined), Err(StoreError::NotActive(_))));
        assert!(matches!(s.define(small(), None, Some("nope")), Err(StoreError::BadUuid(_))));
        assert!(matches!(s.define(small(), None, Some(&defined)), Err(StoreError::Exists(_))));
        s.remove(&defined).unwrap();
        drop(s);
        assert!(Store::open(&d, &b).unwrap().instances().is_empty());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn remap_keeps_the_cores_and_refuses_what_does_not_fit_there() {
        let d = dir("remap");
        let b = BoardConfig::default();
        let shape = |sa, vu| small().with_units(sa, vu).unwrap();
        let mut s = Store::open(&d, &b).unwrap();
        // Two tenants filling one 4 SA + 4 VU core between them.
        let a = s.create(shape(3, 1), None, None).unwrap();
        let c = s.create(shape(1, 3), None, None).unwrap();
        let core = s.get(&a).unwrap().cores.clone();
        assert_eq!(s.get(&c).unwrap().cores, core);
        // A's new workload wants 2 + 2: its core has only 1 + 3 beside C.
        let e = s.remap(&a, shape(2, 2), None).unwrap_err();
        assert!(
            matches!(e, StoreError::Placement { source: PlacementError::NoRoomOnCore { .. }, .. }),
            "{e}"
        );
        assert_eq!(s.get(&a).unwrap().shape, shape(3, 1));
        // Shrinking fits, on the same core.
        assert_eq!(s.remap(&a, shape(2, 1), None).unwrap().cores, core);
        assert_eq!(s.board().eu_use().0, 7);
        // With oversubscription allowed, 2 + 2 fits there too (time-shared).
        s.remap(&a, shape(2, 2), Some(2)).unwrap();
        assert!(s.board().oversubscribed(core[0] as usize));
        // The number of cores is not a remap.
        let two = Shape::new(1, 2, 1, 1, small().sram_per_core(), small().hbm_per_core()).unwrap();
        let e = s.remap(&a, two, None).unwrap_err();
        assert!(
            matches!(e, StoreError::Placement { source: PlacementError::CoreCountChange { .. }, .. }),
            "{e}"
        );
        // A new manager process sees the remapped shape on the same core.
        drop(s);
        let mut s = Store::open(&d, &b).unwrap();
        assert_eq!((s.get(&a).unwrap().shape, s.get(&a).unwrap().cores.clone()), (shape(2, 2), core));
        // A defined instance just takes the shape.
        let u = s.define(small(), Some("small"), None).unwrap();
        let i = s.remap(&u, shape(1, 2), None).unwrap();
        assert_eq!((i.shape, i.type_name.clone()), (shape(1, 2), None));
        fs::remove_dir_all(&d).unwrap();
    }

    /// A definition's priority and latency target survive a restart and
    /// a start; an instance without them writes neither (older state
    /// files, which have none, read as no priority and no target).
    #[test]
    fn service_levels_are_kept_with_the_definition() {
        let d = dir("qos");
        let b = BoardConfig::default();
        let qos = Qos { priority: 5, slo_us: 1000, borrow: None };
        let (u, plain) = {
            let mut s = Store::open(&d, &b).unwrap();
            let u = s.define_for(small(), None, None, None, qos).unwrap();
            (u, s.create(small(), None, None).unwrap())
        };
        let mut s = Store::open(&d, &b).unwrap();
        assert_eq!(s.start(&u).unwrap().qos, qos);
        assert_eq!(s.get(&plain).unwrap().qos, Qos::default());
        let text = fs::read_to_string(d.join(STATE)).unwrap();
        assert_eq!(text.matches("\"qos\"").count(), 1, "{text}");
        assert!(text.contains("\"slo_us\": 1000"), "{text}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_crash_mid_write_leaves_the_old_state() {
        let d = dir("crash");
        let b = BoardConfig::default();
        let u = Store::open(&d, &b).unwrap().define(small(), None, None).unwrap();
        // A writer that died after writing half of its temporary file.
        fs::write(d.join(format!(".{STATE}.tmp")), b"{\"version\":1,\"insta").unwrap();
        let s = Store::open(&d, &b).unwrap();
        assert_eq!(s.instances().len(), 1);
        assert_eq!(s.instances()[0].uuid, u);
        drop(s);
        // A state file that is not JSON is reported, not replaced.
        fs::write(d.join(STATE), b"garbage").unwrap();
        assert!(matches!(Store::open(&d, &b), Err(StoreError::Corrupt { .. })));
        fs::remove_dir_all(&d).unwrap();
    }

    /// A state file is checked as it loads: every shape through the
    /// shape's constructor, every UUID canonical and unique (UUIDs become
    /// socket paths).
    #[test]
    fn a_state_file_with_a_bad_shape_or_uuid_is_refused() {
        let d = dir("badstate");
        let b = BoardConfig::default();
        let u = Store::open(&d, &b).unwrap().define(small(), None, None).unwrap();
        let good = fs::read_to_string(d.join(STATE)).unwrap();
        let cases = [
            (good.replace("\"sa_per_core\": 1", "\"sa_per_core\": 0"), "corrupt"),
            (good.replace("\"sa_per_core\": 1", "\"sa_per_core\": 4294967295"), "corrupt"),
            (good.replace(&format!("\"sram_per_core\": {}", 4u64 << 20), "\"sram_per_core\": 3"), "corrupt"),
            (good.replace(&u, "../../x"), "uuid"),
            (good.replace(&u, &u.to_uppercase()), "uuid"),
        ];
        for (text, want) in cases {
            assert_ne!(text, good, "the case did not change the file");
            fs::write(d.join(STATE), &text).unwrap();
            match (Store::open(&d, &b), want) {
                (Err(StoreError::Corrupt { .. }), "corrupt")
                | (Err(StoreError::StateUuid { .. }), "uuid") => {}
                (r, _) => panic!("{text}: {r:?}"),
            }
        }
        // The same instance twice.
        let mut twice: serde_json::Value = serde_json::from_str(&good).unwrap();
        let first = twice["instances"][0].clone();
        twice["instances"].as_array_mut().unwrap().push(first);
        fs::write(d.join(STATE), twice.to_string()).unwrap();
        assert!(matches!(Store::open(&d, &b), Err(StoreError::StateUuid { .. })));
        fs::remove_dir_all(&d).unwrap();
    }

    /// A write that fails leaves no temporary file behind.
    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let d = dir("failedwrite");
        let b = BoardConfig::default();
        let mut s = Store::open(&d, &b).unwrap();
        // The rename fails: the state file's name is taken by a directory.
        fs::create_dir_all(d.join(STATE).join("x")).unwrap();
        assert!(matches!(s.define(small(), None, None), Err(StoreError::Io { .. })));
        assert!(!d.join(format!(".{STATE}.tmp")).exists(), "a .tmp file stayed behind");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_full_board_refuses_to_start_more() {
        let d = dir("full");
        let b = BoardConfig::default();
        let mut s = Store::open(&d, &b).unwrap();
        let large: Shape = VnpuSpec::named("large").unwrap();
        // One per core.
        for _ in 0..b.chips * b.cores_per_chip {
            s.create(large, Some("large"), None).unwrap();
        }
        let u = s.define(large, Some("large"), None).unwrap();
        assert!(matches!(s.start(&u), Err(StoreError::Placement { source: PlacementError::NoRoom, .. })));
        assert!(!s.get(&u).unwrap().active);
        // Large vNPUs fill SRAM too: oversubscription cannot help them.
        s.allow_oversubscription(2);
        assert!(s.start(&u).is_err());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn oversubscription_is_opt_in() {
        let d = dir("over");
        let b = BoardConfig::default();
        let mut s = Store::open(&d, &b).unwrap();
        let lean: Shape = VnpuSpec::parse("sa=4,vu=4,sram=2M,hbm=1G").unwrap();
        for _ in 0..b.chips * b.cores_per_chip {
            s.create(lean, None, None).unwrap();
        }
        assert!(matches!(
            s.create(lean, None, None),
            Err(StoreError::Placement { source: PlacementError::NoRoom, .. })
        ));
        s.allow_oversubscription(2);
        let u = s.create(lean, None, None).unwrap();
        let core = s.get(&u).unwrap().cores[0] as usize;
        assert!(s.board().oversubscribed(core));
        fs::remove_dir_all(&d).unwrap();
    }
}
