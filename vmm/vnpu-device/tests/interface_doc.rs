//! `docs/device-interface.md` against `vnpu_abi::device`, where every
//! offset and code is defined: each register of the page's BAR 0 table,
//! each request status and each device error code has the value the
//! source gives it, and each one the source defines is on the page.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

fn read(rel: &str) -> String {
    std::fs::read_to_string(format!("{}/../../{rel}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// `pub const NAME: TYPE = VALUE;` lines of `src` whose name starts with
/// `prefix` (the prefix removed), within `src[from..to]`.
fn constants(src: &str, prefix: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in src.lines() {
        let l = line.trim();
        let Some(rest) = l.strip_prefix("pub const ") else { continue };
        let Some((name, value)) = rest.split_once(':') else { continue };
        let Some(name) = name.strip_prefix(prefix) else { continue };
        let Some(v) = value.split('=').nth(1) else { continue };
        let v = v.trim().trim_end_matches(';').replace('_', "");
        let parsed = match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => v.parse().ok(),
        };
        if let Some(x) = parsed {
            out.insert(name.to_string(), x);
        }
    }
    out
}

/// Rows `| value | `NAME` |` of the page's tables.
fn rows(doc: &str) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 {
            continue;
        }
        let v = cells[1].replace('_', "");
        let value = match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => v.parse().ok(),
        };
        let Some(value) = value else { continue };
        // The name is the first `code` cell of the row.
        if let Some(name) =
            cells[2..].iter().find_map(|c| c.strip_prefix('`').and_then(|c| c.strip_suffix('`')))
        {
            out.push((value, name.to_string()));
        }
    }
    out
}

#[test]
fn registers_status_and_error_codes_are_what_the_source_defines() {
    let src = read("device/vnpu-abi/src/device.rs");
    let doc = read("docs/device-interface.md");
    let regs_src = &src[src.find("pub mod regs").unwrap()..];
    let regs_src = &regs_src[..regs_src.find("\n}").unwrap()];
    let mut regs = constants(regs_src, "");
    regs.remove("END");
    let status = constants(&src, "ST_");
    let errors = constants(&src, "ERR_");
    let documented = rows(&doc);
    let mut wrong = Vec::new();
    for (value, name) in &documented {
        let name = name.trim_end_matches("..5").replace("ARG0..5", "ARG0");
        let known = regs.get(&name).or(status.get(&name)).or(errors.get(&name));
        match known {
            Some(v) if v == value => {}
            Some(v) => wrong.push(format!("`{name}` is {value:#x} on the page, {v:#x} in the source")),
            None => {}
        }
    }
    for (kind, map) in [("register", &regs), ("status", &status), ("error", &errors)] {
        for (name, v) in map.iter() {
            let shown = documented.iter().any(|(dv, dn)| {
                dv == v
                    && (dn == name
                        || dn
                            .strip_suffix("..5")
                            .is_some_and(|p| p.trim_end_matches('0') == name.trim_end_matches('0')))
            });
            if !shown {
                wrong.push(format!("{kind} `{name}` = {v:#x} is not on the page"));
            }
        }
    }
    assert!(wrong.is_empty(), "docs/device-interface.md against vnpu_abi::device:\n{}", wrong.join("\n"));
}

#[test]
fn identity_and_bar_sizes_are_what_the_source_defines() {
    use vnpu_abi::device::{
        BAR0_SIZE, BAR2_SIZE, DEVICE_ID, MSIX_PBA_OFFSET, MSIX_VECTORS, QUEUE_SIZE_MAX, VENDOR_ID,
    };
    let doc = read("docs/device-interface.md");
    assert!(doc.contains(&format!("| vendor ID | {VENDOR_ID:#06x}")), "vendor ID");
    assert!(doc.contains(&format!("| device ID | {DEVICE_ID:#06x}")), "device ID");
    assert!(doc.contains(&format!("{} KiB | registers", BAR0_SIZE >> 10)), "BAR 0 size");
    assert!(
        doc.contains(&format!("{} KiB | MSI-X table at 0 ({MSIX_VECTORS} vectors", BAR2_SIZE >> 10)),
        "BAR 2"
    );
    assert!(doc.contains(&format!("PBA at {MSIX_PBA_OFFSET:#x}")), "PBA offset");
    assert!(doc.contains(&format!("`QUEUE_SIZE_MAX` | {QUEUE_SIZE_MAX} |")), "queue size");
}
