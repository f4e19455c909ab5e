//! The mapping evaluation runs, and EU-granularity placement beats
//! whole-core allocation on a small stream.
#![allow(clippy::unwrap_used)]

#[test]
fn mapping_eval_ranks_the_policies() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mapping-eval"))
        .args(["--requests", "600", "--boards", "40"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let util = |name: &str| -> f64 {
        let l = text.lines().find(|l| l.starts_with(name)).unwrap();
        l.split_whitespace().nth(1).unwrap().trim_end_matches('%').parse().unwrap()
    };
    assert!(util("Ours") > 1.5 * util("WholeCore"), "{text}");
    assert!(util("Ours") >= util("FirstFit") - 1.0, "{text}");
}

/// With departures the cluster reaches a steady state: utilization is
/// averaged after the warm-up, and whole-core allocation rejects far more.
#[test]
fn mapping_eval_with_churn_reaches_a_steady_state() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mapping-eval"))
        .args(["--requests", "4000", "--boards", "40", "--churn"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("vNPUs leave after"), "{text}");
    let field = |name: &str, k: usize| -> f64 {
        let l = text.lines().find(|l| l.starts_with(name)).unwrap();
        l.split_whitespace().nth(k).unwrap().trim_end_matches('%').parse().unwrap()
    };
    for p in ["Ours", "FirstFit", "WholeCore", "MigLike"] {
        let u = field(p, 1);
        assert!(u > 20.0 && u < 100.0, "{p}: {text}");
    }
    // EU utilization (what tenants asked for) and rejections (column 4):
    // above whole cores and MIG-like profiles, which hold more than asked.
    assert!(field("Ours", 1) > 1.5 * field("WholeCore", 1), "{text}");
    assert!(field("Ours", 1) > field("MigLike", 1), "{text}");
    assert!(field("WholeCore", 4) > 5.0 * field("Ours", 4).max(1.0), "{text}");
    assert!(field("MigLike", 4) > field("Ours", 4), "{text}");
    assert!(field("MigLike", 3) > field("MigLike", 1), "{text}");
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_mapping-eval"))
        .args(["--lifetime", "0"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}
