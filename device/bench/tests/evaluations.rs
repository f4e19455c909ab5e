//! The evaluation binaries run and write what they promise (their numbers
//! are in the docs; here only their shape and internal consistency).
#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn sharing_eval_writes_both_systems_as_json() {
    let path = std::env::temp_dir().join(format!("sharing-eval-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_sharing-eval"))
        .args(["--seconds", "0.05", "--load", "0.7", "--json", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let systems = v["systems"].as_array().unwrap();
    assert_eq!(systems.len(), 2);
    for s in systems {
        for k in ["throughput_rps", "eu_utilization", "avg_latency_s", "p99_latency_s", "fairness"] {
            let x = s[k].as_f64().unwrap();
            assert!(x.is_finite() && x > 0.0, "{k} = {x}");
        }
        assert!(s["fairness"].as_f64().unwrap() <= 1.0);
        assert!(s["p99_latency_s"].as_f64().unwrap() >= s["avg_latency_s"].as_f64().unwrap() * 0.5);
    }
    let r = v["throughput_ratio"].as_f64().unwrap();
    assert!(
        (r - systems[0]["throughput_rps"].as_f64().unwrap() / systems[1]["throughput_rps"].as_f64().unwrap())
            .abs()
            < 1e-9
    );
    // The spatial system never preempts.
    assert_eq!(systems[0]["context_switches"], 0);
}

#[test]
fn verifier_and_isolation_benchmarks_run() {
    for bin in [env!("CARGO_BIN_EXE_verifier-bench"), env!("CARGO_BIN_EXE_hbm-isolation")] {
        let out = Command::new(bin).output().unwrap();
        assert!(out.status.success(), "{bin}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).lines().count() > 5);
    }
}
