//! vNPU specifications as the CLI takes them (`--vnpu SPEC`).

use npu_model::config::{HBM_SLICE, SRAM_SLICE};
use thiserror::Error;

/// The vNPU board a tenant asked for (Listing 1 of the design). The
/// manager stores it as JSON with these field names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VnpuSpec {
    pub chips: u32,
    pub cores_per_chip: u32,
    pub sa_per_core: u32,
    pub vu_per_core: u32,
    pub sram_per_core: u64,
    pub hbm_per_core: u64,
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
    /// What the verifier checks a program against on one core of this vNPU,
    /// whose DMA may reach `guest` (guest-physical ranges).
    /// vNPU cores: chips x cores per chip.
    pub fn cores(&self) -> u32 {
        self.chips.saturating_mul(self.cores_per_chip)
    }

    pub fn limits(&self, guest: Vec<std::ops::Range<u64>>) -> npu_model::VnpuLimits {
        npu_model::VnpuLimits {
            sa: self.sa_per_core,
            vu: self.vu_per_core,
            sram_bytes: self.sram_per_core,
            hbm_bytes: self.hbm_per_core,
            guest,
        }
    }

    /// Checks a configuration the guest asks for (mailbox `CONFIGURE`)
    /// against the rules of `--vnpu` and against `grant`, what the host
    /// gave the VM. Returns the mailbox status code on refusal.
    pub fn check_within(&self, grant: &VnpuSpec) -> Result<(), u32> {
        use vnpu_abi::device::{ST_BAD_ARGUMENT, ST_EXCEEDS_GRANT};
        let counts = [self.chips, self.cores_per_chip, self.sa_per_core, self.vu_per_core];
        if counts.iter().any(|c| !(1..=64).contains(c))
            || self.sram_per_core == 0
            || !self.sram_per_core.is_multiple_of(SRAM_SLICE)
            || self.hbm_per_core == 0
            || !self.hbm_per_core.is_multiple_of(HBM_SLICE)
        {
            return Err(ST_BAD_ARGUMENT);
        }
        let fits = self.chips <= grant.chips
            && self.cores_per_chip <= grant.cores_per_chip
            && self.sa_per_core <= grant.sa_per_core
            && self.vu_per_core <= grant.vu_per_core
            && self.sram_per_core <= grant.sram_per_core
            && self.hbm_per_core <= grant.hbm_per_core;
        if fits {
            Ok(())
        } else {
            Err(ST_EXCEEDS_GRANT)
        }
    }

    /// The named types: the smallest runnable vNPU and two larger ones
    /// (2, 4 and 8 execution units).
    pub fn named(name: &str) -> Option<Self> {
        let (eu, sram, hbm) = match name {
            "small" => (1, 4u64 << 20, 1u64 << 30),
            "medium" => (2, 16 << 20, 4 << 30),
            "large" => (4, 32 << 20, 8 << 30),
            _ => return None,
        };
        Some(Self {
            chips: 1,
            cores_per_chip: 1,
            sa_per_core: eu,
            vu_per_core: eu,
            sram_per_core: sram,
            hbm_per_core: hbm,
        })
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
        let mut out = Self {
            chips: 1,
            cores_per_chip: 1,
            sa_per_core: 0,
            vu_per_core: 0,
            sram_per_core: 0,
            hbm_per_core: 0,
        };
        let mut seen = [false; 4];
        for (k, v) in kv {
            let count = |key: &'static str| {
                v.parse::<u32>().ok().filter(|n| (1..=64).contains(n)).ok_or(SpecError::Value {
                    spec: s.clone(),
                    key,
                    reason: format!("is `{v}`, must be a whole number in 1..=64"),
                })
            };
            let bytes = |key: &'static str, slice: u64| {
                parse_size(v).ok().filter(|b| *b > 0 && b % slice == 0).ok_or(SpecError::Value {
                    spec: s.clone(),
                    key,
                    reason: format!("is `{v}`, must be a positive multiple of {} MiB", slice >> 20),
                })
            };
            match k {
                "sa" => (out.sa_per_core, seen[0]) = (count("sa")?, true),
                "vu" => (out.vu_per_core, seen[1]) = (count("vu")?, true),
                "sram" => (out.sram_per_core, seen[2]) = (bytes("sram", SRAM_SLICE)?, true),
                "hbm" => (out.hbm_per_core, seen[3]) = (bytes("hbm", HBM_SLICE)?, true),
                "cores" => out.cores_per_chip = count("cores")?,
                "chips" => out.chips = count("chips")?,
                other => return Err(SpecError::Key { spec: s, key: other.into() }),
            }
        }
        for (i, key) in ["sa", "vu", "sram", "hbm"].into_iter().enumerate() {
            if !seen[i] {
                return Err(SpecError::Missing { spec: s, key });
            }
        }
        Ok(out)
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
        assert_eq!(
            v,
            VnpuSpec {
                chips: 1,
                cores_per_chip: 2,
                sa_per_core: 2,
                vu_per_core: 1,
                sram_per_core: 8 << 20,
                hbm_per_core: 1 << 30
            }
        );
        assert_eq!(VnpuSpec::parse("type=medium").unwrap(), VnpuSpec::named("medium").unwrap());
        let e = |s: &str| VnpuSpec::parse(s).unwrap_err().to_string();
        assert!(e("sa=0,vu=1,sram=2M,hbm=256M").contains("`sa`"));
        assert!(e("sa=1,vu=1,sram=3M,hbm=256M").contains("`sram`"));
        assert!(e("sa=1,vu=1,sram=2M,hbm=100M").contains("`hbm`"));
        assert!(e("sa=1,vu=1,sram=2M").contains("missing `hbm`"));
        assert!(e("sa=1,vu=1,sram=2M,hbm=256M,gpu=1").contains("unknown key `gpu`"));
        assert!(e("sa=1,vu").contains("not key=value"));
        assert!(e("type=huge").contains("huge"));
        assert!(e("type=small,sa=2").contains("combined"));
        assert!(e("sa=1,vu=1,sram=99999999999999999999G,hbm=256M").contains("`sram`"));
    }
}
