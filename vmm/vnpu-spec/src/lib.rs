//! What a vNPU is to the device, the manager and the command line: its
//! shape ([`VnpuSpec`], Listing 1 of the design, parsed from `--vnpu`
//! specs), the named types, and the record the manager keeps of each
//! instance ([`Instance`]: shape, state, cores, workload, QoS).
//!
//! Below the PCI function and the manager so both can name a vNPU without
//! depending on each other (`docs/architecture.md`).

// Everything here handles what a client sent: no silent narrowing casts.
#![cfg_attr(
    not(test),
    warn(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)
)]

mod spec;

pub use spec::{parse_size, ShapeError, SpecError, VnpuSpec, MAX_COUNT};

use serde::{Deserialize, Serialize};

/// The named types, smallest first.
pub const TYPES: [&str; 3] = ["small", "medium", "large"];

/// A vNPU shape as stored in the state file: the device's `VnpuSpec` (its
/// JSON keys are the field names).
pub type Shape = VnpuSpec;

/// The workload a tenant says its vNPU runs (a name from `vnpu workload
/// list` and a batch size): what interference-aware placement prices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub name: String,
    pub batch: u32,
}

impl std::str::FromStr for Workload {
    type Err = String;
    /// `NAME` (batch 1) or `NAME:BATCH`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, batch) = match s.split_once(':') {
            Some((n, b)) => {
                let b: u32 =
                    b.parse().map_err(|_| format!("`{b}` is not a batch size (NAME or NAME:BATCH)"))?;
                (n, b)
            }
            None => (s, 1),
        };
        if name.is_empty() || batch == 0 {
            return Err(format!("`{s}`: give NAME or NAME:BATCH with a batch of 1 or more"));
        }
        Ok(Self { name: name.to_string(), batch })
    }
}

/// The service a tenant's vNPU gets on a shared physical core: the
/// order of its requests among the core's tenants (higher priority first,
/// then the earliest deadline), their latency target, in microseconds of
/// simulated time from arrival (0: none; misses are counted per core), and
/// how many idle engines its spread programs may borrow beyond its own
/// (`docs/management.md`, "Harvesting").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Qos {
    #[serde(default)]
    pub priority: u8,
    #[serde(default)]
    pub slo_us: u64,
    /// Borrowing cap per vNPU core; `None`: [`Qos::borrow_cap`]'s default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub borrow: Option<Borrow>,
}

/// A borrowing cap: at most this many SAs and VUs beyond a vNPU core's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Borrow {
    pub sa: u32,
    pub vu: u32,
}

impl std::str::FromStr for Borrow {
    type Err = String;
    /// `SA,VU` (two counts, e.g. `2,2`; `0,0` turns borrowing off).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("`{s}` is not a borrowing cap: give SA,VU, two counts such as 2,2 (0,0: none)");
        let (a, b) = s.split_once(',').ok_or_else(bad)?;
        let sa: u32 = a.trim().parse().map_err(|_| bad())?;
        let vu: u32 = b.trim().parse().map_err(|_| bad())?;
        if sa > MAX_COUNT || vu > MAX_COUNT {
            return Err(format!("`{s}`: a borrowing cap is at most {MAX_COUNT} of each"));
        }
        Ok(Self { sa, vu })
    }
}

impl Qos {
    /// No priority, no latency target, the default cap (how it is left
    /// out of JSON).
    pub fn is_none(&self) -> bool {
        *self == Self::default()
    }

    /// The borrowing cap of a vNPU of `shape` (SAs, VUs per core): the
    /// one set, or by default as many engines again as it owns, so a
    /// spread program compiled for twice its shape runs on up to twice its
    /// engines when its neighbours leave them idle.
    pub fn borrow_cap(&self, shape: &VnpuSpec) -> (u32, u32) {
        match self.borrow {
            Some(b) => (b.sa, b.vu),
            None => (shape.sa_per_core(), shape.vu_per_core()),
        }
    }
}

/// One vNPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub uuid: String,
    /// The named type it was made from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub type_name: Option<String>,
    pub shape: Shape,
    /// Defined: survives `stop` and manager restarts.
    pub persistent: bool,
    /// Started: placed on physical cores and usable by a VM.
    pub active: bool,
    /// Physical cores (chip * cores_per_chip + core) of the active instance,
    /// one per vNPU core, in vNPU core order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cores: Vec<u32>,
    /// The workload it runs, if its tenant said (for interference-aware
    /// placement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// Its priority and latency target on a shared core.
    #[serde(default, skip_serializing_if = "Qos::is_none")]
    pub qos: Qos,
}

/// The split of `eus` execution units into SAs and VUs closest (in log
/// space) to the SA:VU ratio `k` (design Eq. 3: k = sqrt(x/y)), with at
/// least one of each and at most `max_sa` SAs and `max_vu` VUs.
pub fn split_for_ratio(eus: u32, k: f64, max_sa: u32, max_vu: u32) -> Option<(u32, u32)> {
    (1..eus)
        .filter(|sa| *sa <= max_sa && eus - sa <= max_vu)
        .min_by(|p, q| {
            let d = |sa: u32| ((f64::from(sa) / f64::from(eus - sa)).ln() - k.ln()).abs();
            d(*p).total_cmp(&d(*q))
        })
        .map(|sa| (sa, eus - sa))
}

impl Instance {
    /// Execution units per vNPU core.
    pub fn eus(&self) -> u32 {
        self.shape.eus()
    }
}
