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
