//! The placement evaluation's simulation against hand-checked references:
//! a vNPU alone runs exactly its solo time; two DMA-heavy vNPUs on one
//! core slow each other as much as the characterization's co-run says;
//! the evaluation end to end on a small stream.

#![allow(clippy::unwrap_used)]

use npu_interference::characterize::{Matrix, Solo};
use npu_interference::corun::{closed_loop, Placed, Spec};
use npu_model::{BoardConfig, Contention};
use vnpu_manager::evaluation::{run_policy, shape_of, EvalPolicy, Items, Job, JobStream, StreamPlan};

fn spec(w: &str, batch: u32) -> Spec {
    Spec { workload: w.into(), batch, sa: 1, vu: 1 }
}

fn plan() -> StreamPlan {
    StreamPlan {
        workloads: Vec::new(),
        batches: Vec::new(),
        shapes: Vec::new(),
        vnpus: 0,
        load: 1.0,
        work_cycles: 1.0,
        warmup: 0.0,
        seed: 1,
    }
}

fn empty_matrix(cfg: &BoardConfig) -> Matrix {
    Matrix { board: cfg.name.clone(), iterations: 1, solo: Vec::new(), cases: Vec::new() }
}

#[test]
fn a_vnpu_alone_runs_its_solo_time_and_two_on_one_core_slow_each_other() {
    let cfg = BoardConfig::default();
    let items = vec![spec("ncf", 1), spec("mobilenet", 1)];
    let it = Items::new(&cfg, &items, &empty_matrix(&cfg)).unwrap();
    // The solo counters were measured: NCF b1 takes ~9.3k cycles a request.
    let solo = Solo::measure(&cfg, &items[0]).unwrap();
    assert!((solo.latency - it.solos[0].latency).abs() < 1e-9);
    assert!(solo.latency > 5e3 && solo.latency < 2e4, "ncf b1 latency {}", solo.latency);

    // One vNPU, 50 requests, alone: slowdown 1 (to rounding).
    let alone = JobStream { items: items.clone(), jobs: vec![Job { arrival: 10.0, item: 0, requests: 50 }] };
    let r = run_policy(&cfg, &alone, &it, None, EvalPolicy::FirstFit, &plan()).unwrap();
    let s = r.fates[0].slowdown;
    assert!((s - 1.0).abs() < 1e-9, "alone: slowdown {s}");
    assert_eq!(r.fates[0].core, Some(0));

    // Two MobileNets arriving together: first fit puts both on core 0
    // (they share its DMA engine), the `interference-first` oracle on two
    // cores.
    let pair = JobStream {
        items: items.clone(),
        jobs: vec![Job { arrival: 0.0, item: 1, requests: 20 }, Job { arrival: 0.0, item: 1, requests: 20 }],
    };
    let packed = run_policy(&cfg, &pair, &it, None, EvalPolicy::FirstFit, &plan()).unwrap();
    assert_eq!((packed.fates[0].core, packed.fates[1].core), (Some(0), Some(0)));
    let spread = run_policy(&cfg, &pair, &it, None, EvalPolicy::OracleFirst, &plan()).unwrap();
    assert_ne!(spread.fates[0].core, spread.fates[1].core, "the oracle keeps the DMA-bound pair apart");
    for (name, r) in [("one core", &packed), ("two cores", &spread)] {
        for f in &r.fates {
            assert!(f.slowdown >= 1.0 - 1e-9, "{name}: slowdown {} below 1", f.slowdown);
        }
    }
    // MobileNet moves ~170 B/cycle through its DMA engine alone: two on
    // one engine take well over 1.3x; on two cores they share only HBM
    // and the host link. The co-run of the characterization (a different
    // code path: closed loop, warm-up left out) agrees to 3%.
    let corun = |cores: [usize; 2]| {
        let placed: Vec<Placed> =
            cores.iter().map(|&core| Placed { request: &it.programs[1], core, group: None }).collect();
        let m = closed_loop(&cfg, &placed, Contention::default(), 3).unwrap();
        m[0].latency / it.solos[1].latency
    };
    let (one, two) = (corun([0, 0]), corun([0, 1]));
    for (name, r, reference) in [("one core", &packed, one), ("two cores", &spread, two)] {
        for f in &r.fates {
            assert!(
                (f.slowdown - reference).abs() < 0.03 * reference,
                "{name}: {} vs co-run {reference}",
                f.slowdown
            );
        }
    }
    assert!(one > 1.3 && two < 1.1, "co-run: one core {one}, two cores {two}");
    assert!(spread.measured >= 1);
    // The shape a stream item asks the manager for.
    let s = shape_of(&cfg, &items[0]);
    assert_eq!((s.sa_per_core, s.vu_per_core, s.sram_per_core), (1, 1, 8 << 20));
}

fn eval(args: &[&str]) -> (i32, String, String) {
    let matrix = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plots/interference.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_placement-eval"))
        .args(["--matrix", matrix])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The evaluation end to end on a small stream: every vNPU is accounted
/// for, no accepted one runs faster than alone, the measuring oracle does
/// not lose to packing, and the trained predictor does better than one
/// that ignores its features.
#[test]
fn placement_eval_on_a_small_stream() {
    let json = std::env::temp_dir().join(format!("placement-eval-{}.json", std::process::id()));
    let common = [
        "--vnpus",
        "120",
        "--seeds",
        "7",
        "--work-ms",
        "2",
        "--load",
        "0.6",
        "--workloads",
        "mobilenet,efficientnet,ncf,dlrm",
        "--batches",
        "1",
    ];
    let run = |model: &str, policies: &str| {
        let mut a: Vec<&str> = common.to_vec();
        let j = json.to_str().unwrap();
        a.extend(["--model", model, "--policies", policies, "--json", j]);
        let (code, out, err) = eval(&a);
        assert_eq!(code, 0, "{out}{err}");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        v
    };
    let v = run("linear", "balance,spread,interference-first,oracle-first");
    let overhead = |v: &serde_json::Value, p: &str| {
        let r = v["runs"].as_array().unwrap().iter().find(|r| r["policy"] == p).unwrap();
        assert_eq!(r["fates"].as_array().unwrap().len(), 120, "{p}: a fate per vNPU");
        for f in r["fates"].as_array().unwrap() {
            if !f["core"].is_null() {
                let s = f["slowdown"].as_f64().unwrap();
                assert!(s >= 1.0 - 1e-9, "{p}: slowdown {s} below running alone");
            }
        }
        r["mean_slowdown"].as_f64().unwrap() - 1.0
    };
    let (balance, spread, trained, oracle) = (
        overhead(&v, "balance"),
        overhead(&v, "spread"),
        overhead(&v, "interference-first"),
        overhead(&v, "oracle-first"),
    );
    let blind = run("mean", "interference-first");
    let blind = overhead(&blind, "interference-first");
    eprintln!(
        "overheads: balance {balance} spread {spread} linear {trained} mean-model {blind} oracle {oracle}"
    );
    assert!(oracle < balance, "the oracle ({oracle}) beats packing ({balance})");
    assert!(trained < balance, "the trained predictor ({trained}) beats packing ({balance})");
    assert!(trained < blind, "the trained predictor ({trained}) beats one blind to its features ({blind})");
    // Bad input: named.
    for (args, says) in [
        (vec!["--load", "0"], "--load"),
        (vec!["--shapes", "5+1"], "larger than a core"),
        (vec!["--model", "svm"], "unknown model"),
        (vec!["--policies", "best"], "unknown policy"),
        (vec!["--warmup", "1"], "--warmup"),
    ] {
        let (code, out, err) = eval(&args);
        assert_ne!(code, 0, "{args:?}: {out}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let (code, _, err) = eval(&["--board", "/nonexistent.toml"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent.toml"), "{err}");
    let _ = std::fs::remove_file(&json);
}
