//! vNPU specifications as the CLI takes them (`--vnpu SPEC`).

use npu_model::config::{HBM_SLICE, SRAM_SLICE};
use thiserror::Error;

/// The vNPU board a tenant asked for (Listing 1 of the design). The
/// manager stores it as JSON with these field names.
///
/// Valid by construction: every count in 1..=[`MAX_COUNT`], SRAM and HBM
/// positive multiples of their slices. [`VnpuSpec::new`] checks that, and
/// so do deserialization (state files, control requests), the parser and
/// the `with_*` changes; the fields are read through methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "RawSpec")]
pub struct VnpuSpec {
    chips: u32,
    cores_per_chip: u32,
    sa_per_core: u32,
    vu_per_core: u32,
    sram_per_core: u64,
    hbm_per_core: u64,
}

/// The most chips, cores per chip, SAs or VUs per core a vNPU may have.
pub const MAX_COUNT: u32 = 64;

/// The fields of a [`VnpuSpec`] before they are checked.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    chips: u32,
    cores_per_chip: u32,
    sa_per_core: u32,
    vu_per_core: u32,
    sram_per_core: u64,
    hbm_per_core: u64,
}

impl TryFrom<RawSpec> for VnpuSpec {
    type Error = ShapeError;
    fn try_from(r: RawSpec) -> Result<Self, ShapeError> {
        VnpuSpec::new(
            r.chips,
            r.cores_per_chip,
            r.sa_per_core,
            r.vu_per_core,
            r.sram_per_core,
            r.hbm_per_core,
        )
    }
}

/// A shape no vNPU can have.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ShapeError {
    #[error("`{key}` is {value}, must be a whole number in 1..={MAX_COUNT}")]
    Count { key: &'static str, value: u32 },
    #[error("`{key}` is {value} bytes, must be a positive multiple of {} MiB", slice >> 20)]
    Size { key: &'static str, value: u64, slice: u64 },
}

fn count(key: &'static str, value: u32) -> Result<u32, ShapeError> {
    if (1..=MAX_COUNT).contains(&value) {
        Ok(value)
    } else {
        Err(ShapeError::Count { key, value })
    }
}

fn bytes(key: &'static str, value: u64, slice: u64) -> Result<u64, ShapeError> {
    if value > 0 && value.is_multiple_of(slice) {
        Ok(value)
    } else {
        Err(ShapeError::Size { key, value, slice })
    }
}

/// A bad `--vnpu` specification.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SpecError {
    #[error("vNPU spec `{spec}`: `{item}` is not key=value")]
    Syntax { spec: String, item: String },
    #[error("vNPU spec `{spec}`: unknown key `{key}` (keys: sa, vu, sram, hbm, cores, chips, or type=small|medium|large)")]
    Key { spec: String, key: String },
    #[error("vNPU spec `{spec}`: `{key}` {reason}")]
    Value { spec: String, key: &'static str, reason: String },
    #[error("vNPU spec `{spec}`: missing `{key}`")]
    Missing { spec: String, key: &'static str },
    #[error("vNPU spec `{spec}`: `{key}` is given twice")]
    Repeated { spec: String, key: &'static str },
    #[error("vNPU spec `{spec}`: {source}")]
    Shape {
        spec: String,
        #[source]
        source: ShapeError,
    },
}

/// Parses a byte size: `4096`, `64K`, `2MiB`, `8G`, `1TiB` (binary units;
/// `K`, `KB` and `KiB` all mean 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a size (examples: 4096, 64K, 2MiB, 8G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit `{other}` in `{s}` (use K, M, G or T)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("size `{s}` is too large"))
}

impl VnpuSpec {
    /// A checked shape: `chips` x `cores_per_chip` cores of `sa_per_core`
    /// SAs, `vu_per_core` VUs, and SRAM and HBM of the given bytes each.
    pub fn new(
        chips: u32,
        cores_per_chip: u32,
        sa_per_core: u32,
        vu_per_core: u32,
        sram_per_core: u64,
        hbm_per_core: u64,
    ) -> Result<Self, ShapeError> {
        Ok(Self {
            chips: count("chips", chips)?,
            cores_per_chip: count("cores", cores_per_chip)?,
            sa_per_core: count("sa", sa_per_core)?,
            vu_per_core: count("vu", vu_per_core)?,
            sram_per_core: bytes("sram", sram_per_core, SRAM_SLICE)?,
            hbm_per_core: bytes("hbm", hbm_per_core, HBM_SLICE)?,
        })
    }

    /// The same vNPU with `sa` SAs and `vu` VUs per core (a remap).
    pub fn with_units(self, sa: u32, vu: u32) -> Result<Self, ShapeError> {
        Self::new(self.chips, self.cores_per_chip, sa, vu, self.sram_per_core, self.hbm_per_core)
    }

    /// The same vNPU with `sram` bytes of SRAM per core (a remap).
    pub fn with_sram(self, sram: u64) -> Result<Self, ShapeError> {
        Self::new(
            self.chips,
            self.cores_per_chip,
            self.sa_per_core,
            self.vu_per_core,
            sram,
            self.hbm_per_core,
        )
    }

    pub fn chips(&self) -> u32 {
        self.chips
    }

    pub fn cores_per_chip(&self) -> u32 {
        self.cores_per_chip
    }

    pub fn sa_per_core(&self) -> u32 {
        self.sa_per_core
    }

    pub fn vu_per_core(&self) -> u32 {
        self.vu_per_core
    }

    pub fn sram_per_core(&self) -> u64 {
        self.sram_per_core
    }

    pub fn hbm_per_core(&self) -> u64 {
        self.hbm_per_core
    }

    /// Execution units per core: SAs plus VUs (at most 2 x [`MAX_COUNT`]).
    pub fn eus(&self) -> u32 {
        self.sa_per_core + self.vu_per_core
    }

    /// vNPU cores: chips x cores per chip (at most [`MAX_COUNT`] squared).
    pub fn cores(&self) -> u32 {
        self.chips * self.cores_per_chip
    }

    /// What the verifier checks a program against on one core of this vNPU,
    /// whose DMA may reach `guest` (guest-physical ranges), with `borrow`
    /// its borrowing cap (SAs, VUs; [`crate::Qos::borrow_cap`]).
    pub fn limits(&self, guest: Vec<std::ops::Range<u64>>, borrow: (u32, u32)) -> npu_model::VnpuLimits {
        npu_model::VnpuLimits {
            sa: self.sa_per_core,
            vu: self.vu_per_core,
            sram_bytes: self.sram_per_core,
            hbm_bytes: self.hbm_per_core,
            guest,
            borrow_sa: borrow.0,
            borrow_vu: borrow.1,
        }
    }

    /// Checks a configuration the guest asks for (mailbox `CONFIGURE`, its
    /// six words as the guest wrote them) against the rules of `--vnpu`
    /// and against `grant`, what the host gave the VM. Returns the mailbox
    /// status code on refusal.
    pub fn guest_request(words: [u64; 6], grant: &VnpuSpec) -> Result<Self, u32> {
        use vnpu_abi::device::{ST_BAD_ARGUMENT, ST_EXCEEDS_GRANT};
        let n = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        let want = Self::new(n(words[5]), n(words[4]), n(words[0]), n(words[1]), words[2], words[3])
            .map_err(|_| ST_BAD_ARGUMENT)?;
        if want.fits_within(grant) {
            Ok(want)
        } else {
            Err(ST_EXCEEDS_GRANT)
        }
    }

    /// Whether every count and size is at most `grant`'s.
    pub fn fits_within(&self, grant: &VnpuSpec) -> bool {
        self.chips <= grant.chips
            && self.cores_per_chip <= grant.cores_per_chip
            && self.sa_per_core <= grant.sa_per_core
            && self.vu_per_core <= grant.vu_per_core
            && self.sram_per_core <= grant.sram_per_core
            && self.hbm_per_core <= grant.hbm_per_core
    }

    /// The named types: the smallest runnable vNPU and two larger ones
    /// (2, 4 and 8 execution units): a quarter, a half and the whole of a
    /// core of the default board (`tpu-v4-derived`: 4 SA + 4 VU, 16 MiB
    /// SRAM).
    pub fn named(name: &str) -> Option<Self> {
        let (eu, sram, hbm) = match name {
            "small" => (1, 4u64 << 20, 1u64 << 30),
            "medium" => (2, 8 << 20, 4 << 30),
            "large" => (4, 16 << 20, 8 << 30),
            _ => return None,
        };
        Self::new(1, 1, eu, eu, sram, hbm).ok()
    }

    /// Parses `sa=N,vu=M,sram=SIZE,hbm=SIZE[,cores=C][,chips=K]` or
    /// `type=small|medium|large`.
    pub fn parse(spec: &str) -> Result<Self, SpecError> {
        let s = spec.to_string();
        let mut kv = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| SpecError::Syntax { spec: s.clone(), item: item.into() })?;
            kv.push((k.trim(), v.trim()));
        }
        if let Some((_, t)) = kv.iter().find(|(k, _)| *k == "type") {
            if kv.len() != 1 {
                return Err(SpecError::Value {
                    spec: s,
                    key: "type",
                    reason: "cannot be combined with other keys".into(),
                });
            }
            return Self::named(t).ok_or(SpecError::Value {
                spec: s,
                key: "type",
                reason: format!("`{t}` is not small, medium or large"),
            });
        }
        let mut out = RawSpec {
            chips: 1,
            cores_per_chip: 1,
            sa_per_core: 0,
            vu_per_core: 0,
            sram_per_core: 0,
            hbm_per_core: 0,
        };
        const KEYS: [&str; 6] = ["sa", "vu", "sram", "hbm", "cores", "chips"];
        let mut seen = [false; 6];
        for (k, v) in kv {
            let Some(i) = KEYS.iter().position(|key| *key == k) else {
                return Err(SpecError::Key { spec: s, key: k.into() });
            };
            if std::mem::replace(&mut seen[i], true) {
                return Err(SpecError::Repeated { spec: s, key: KEYS[i] });
            }
            let count = |key: &'static str| {
                v.parse::<u32>().ok().filter(|n| (1..=MAX_COUNT).contains(n)).ok_or(SpecError::Value {
                    spec: s.clone(),
                    key,
                    reason: format!("is `{v}`, must be a whole number in 1..={MAX_COUNT}"),
                })
            };
            let bytes = |key: &'static str, slice: u64| {
                parse_size(v).ok().filter(|b| *b > 0 && b % slice == 0).ok_or(SpecError::Value {
                    spec: s.clone(),
                    key,
                    reason: format!("is `{v}`, must be a positive multiple of {} MiB", slice >> 20),
                })
            };
            match KEYS[i] {
                "sa" => out.sa_per_core = count("sa")?,
                "vu" => out.vu_per_core = count("vu")?,
                "sram" => out.sram_per_core = bytes("sram", SRAM_SLICE)?,
                "hbm" => out.hbm_per_core = bytes("hbm", HBM_SLICE)?,
                "cores" => out.cores_per_chip = count("cores")?,
                _ => out.chips = count("chips")?,
            }
        }
        for (i, key) in KEYS.into_iter().enumerate().take(4) {
            if !seen[i] {
                return Err(SpecError::Missing { spec: s, key });
            }
        }
        Self::try_from(out).map_err(|source| SpecError::Shape { spec: s, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any string: refused with an error or accepted as a valid spec.
        #[test]
        fn parse_never_panics_and_accepts_only_valid_specs(s in "[a-z=,0-9MGK ]{0,40}") {
            if let Ok(v) = VnpuSpec::parse(&s) {
                prop_assert!(v.sa_per_core >= 1 && v.vu_per_core >= 1 && v.chips >= 1 && v.cores_per_chip >= 1);
                prop_assert!(v.sram_per_core > 0 && v.sram_per_core % SRAM_SLICE == 0);
                prop_assert!(v.hbm_per_core > 0 && v.hbm_per_core % HBM_SLICE == 0);
            }
        }

        /// Well-formed specs round-trip their numbers.
        #[test]
        fn well_formed_specs_parse(sa in 1u32..=64, vu in 1u32..=64, sram in 1u64..64, hbm in 1u64..64) {
            let v = VnpuSpec::parse(&format!("vu={vu},sa={sa},hbm={}M,sram={}M", hbm * 256, sram * 2)).unwrap();
            prop_assert_eq!((v.sa_per_core, v.vu_per_core), (sa, vu));
            prop_assert_eq!((v.sram_per_core, v.hbm_per_core), (sram * SRAM_SLICE, hbm * HBM_SLICE));
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("8g"), Ok(8 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn specs_parse_and_bad_ones_name_the_key() {
        let v = VnpuSpec::parse("sa=2,vu=1,sram=8M,hbm=1G,cores=2").unwrap();
        assert_eq!(v, VnpuSpec::new(1, 2, 2, 1, 8 << 20, 1 << 30).unwrap());
        assert_eq!(VnpuSpec::parse("type=medium").unwrap(), VnpuSpec::named("medium").unwrap());
        let e = |s: &str| VnpuSpec::parse(s).unwrap_err().to_string();
        assert!(e("sa=0,vu=1,sram=2M,hbm=256M").contains("`sa`"));
        assert!(e("sa=1,vu=1,sram=3M,hbm=256M").contains("`sram`"));
        assert!(e("sa=1,vu=1,sram=2M,hbm=100M").contains("`hbm`"));
        assert!(e("sa=1,vu=1,sram=2M").contains("missing `hbm`"));
        assert!(e("sa=1,vu=1,sram=2M,hbm=256M,gpu=1").contains("unknown key `gpu`"));
        assert!(e("sa=1,vu").contains("not key=value"));
        assert!(e("type=huge").contains("huge"));
        assert!(e("sa=1,vu=1,sram=2M,hbm=256M,sa=2").contains("`sa` is given twice"));
        assert!(e("type=small,sa=2").contains("combined"));
        assert!(e("sa=1,vu=1,sram=99999999999999999999G,hbm=256M").contains("`sram`"));
    }

    #[test]
    fn every_way_in_checks_the_shape() {
        use vnpu_abi::device::{ST_BAD_ARGUMENT, ST_EXCEEDS_GRANT};
        let (sram, hbm) = (SRAM_SLICE, HBM_SLICE);
        assert!(VnpuSpec::new(1, 1, 1, 1, sram, hbm).is_ok());
        for (chips, cores, sa, vu, sr, hb) in [
            (1, 1, 0, 1, sram, hbm),
            (1, 1, 1, 0, sram, hbm),
            (1, 1, u32::MAX, 1, sram, hbm),
            (1, 1, 65, 1, sram, hbm),
            (0, 1, 1, 1, sram, hbm),
            (1, 0, 1, 1, sram, hbm),
            (1, 1, 1, 1, 3, hbm),
            (1, 1, 1, 1, 0, hbm),
            (1, 1, 1, 1, sram, hbm + 1),
        ] {
            assert!(
                VnpuSpec::new(chips, cores, sa, vu, sr, hb).is_err(),
                "{:?}",
                (chips, cores, sa, vu, sr, hb)
            );
        }
        // Deserialization (state files, requests) goes through `new`.
        let good = VnpuSpec::new(1, 2, 3, 4, sram, hbm).unwrap();
        let json = serde_json::to_string(&good).unwrap();
        assert_eq!(serde_json::from_str::<VnpuSpec>(&json).unwrap(), good);
        for bad in
            [json.replace("\"sa_per_core\":3", "\"sa_per_core\":0"), json.replace(&hbm.to_string(), "7")]
        {
            assert_ne!(bad, json);
            assert!(serde_json::from_str::<VnpuSpec>(&bad).is_err(), "{bad}");
        }
        // A remap's changes too.
        assert!(good.with_units(0, 1).is_err() && good.with_sram(3).is_err());
        // The guest's CONFIGURE: its six words [sa, vu, sram, hbm, cores, chips].
        let grant = VnpuSpec::new(1, 2, 2, 2, 2 * sram, hbm).unwrap();
        let ask = |w: [u64; 6]| VnpuSpec::guest_request(w, &grant);
        assert_eq!(ask([1, 2, sram, hbm, 2, 1]), Ok(VnpuSpec::new(1, 2, 1, 2, sram, hbm).unwrap()));
        assert_eq!(ask([0, 1, sram, hbm, 1, 1]), Err(ST_BAD_ARGUMENT));
        assert_eq!(ask([1 << 32, 1, sram, hbm, 1, 1]), Err(ST_BAD_ARGUMENT));
        assert_eq!(ask([1, 1, 3, hbm, 1, 1]), Err(ST_BAD_ARGUMENT));
        assert_eq!(ask([3, 1, sram, hbm, 1, 1]), Err(ST_EXCEEDS_GRANT));
        assert_eq!(ask([1, 1, 4 * sram, hbm, 1, 1]), Err(ST_EXCEEDS_GRANT));
    }
}
