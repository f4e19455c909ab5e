//! The board files of `docs/boards/`, compiled in: the presets of real
//! chips (every value from a published source named in the file) and the
//! boards derived from them for virtualization (`docs/board-config.md`,
//! "Presets" and "Derived boards").
//!
//! [`BoardConfig::default`] is `tpu-v4-derived`; a test holds the two
//! equal (`default_is_the_v4_derived_file`).

use crate::config::{BoardConfig, ConfigError};

/// Every board file of `docs/boards/`, by name (its file name without
/// `.toml`, which is also its `name` field).
pub const PRESETS: &[(&str, &str)] = &[
    ("tpu-v3", include_str!("../../../docs/boards/tpu-v3.toml")),
    ("tpu-v4", include_str!("../../../docs/boards/tpu-v4.toml")),
    ("tpu-v5e", include_str!("../../../docs/boards/tpu-v5e.toml")),
    ("tpu-v3-derived", include_str!("../../../docs/boards/tpu-v3-derived.toml")),
    ("tpu-v4-derived", include_str!("../../../docs/boards/tpu-v4-derived.toml")),
    ("tpu-v5e-derived", include_str!("../../../docs/boards/tpu-v5e-derived.toml")),
];

/// The preset or derived board called `name`, parsed and validated; `None`
/// for a name that is not one of [`PRESETS`].
pub fn preset(name: &str) -> Option<Result<BoardConfig, ConfigError>> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, text)| BoardConfig::from_toml(text))
}

/// The derived board of a preset (`tpu-v4` -> `tpu-v4-derived`), if there
/// is one.
pub fn derived_of(preset_name: &str) -> Option<&'static str> {
    let want = format!("{preset_name}-derived");
    PRESETS.iter().map(|(n, _)| *n).find(|n| *n == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses_and_is_named_as_its_file() {
        for (name, _) in PRESETS {
            let b = preset(name).unwrap().unwrap();
            assert_eq!(b.name, *name);
        }
        assert!(preset("tpu-v9").is_none());
    }

    /// A derived board departs from its preset in the vector units only:
    /// their count grows, their lanes add up to the preset's, and every
    /// other field (the lowering included) is the preset's.
    #[test]
    fn a_derived_board_splits_the_vector_unit_and_changes_nothing_else() {
        for base in ["tpu-v3", "tpu-v4", "tpu-v5e"] {
            let p = preset(base).unwrap().unwrap();
            let d = preset(derived_of(base).unwrap()).unwrap().unwrap();
            assert_eq!(d.core.vu_count, p.core.sa_count, "{base}: one VU per SA");
            assert_eq!(d.core.vu_count * d.core.vu_lanes, p.core.vu_count * p.core.vu_lanes, "{base}: lanes");
            let mut undo = d.clone();
            undo.name = p.name.clone();
            undo.core.vu_count = p.core.vu_count;
            undo.core.vu_lanes = p.core.vu_lanes;
            assert_eq!(undo, p, "{base}: nothing else departs");
        }
    }

    #[test]
    fn default_is_the_v4_derived_file() {
        assert_eq!(BoardConfig::default(), preset("tpu-v4-derived").unwrap().unwrap());
    }
}
