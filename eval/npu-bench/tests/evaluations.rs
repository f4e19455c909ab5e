//! The evaluation binaries run and write what they promise (their numbers
//! are in the docs; here only their shape and internal consistency).
#![allow(clippy::unwrap_used)]

use std::process::Command;

/// The whole-stream sharing evaluation: every system at every rate, its
/// load the rate over its own saturation, and a system that is not
/// saturated completes what is offered (the arrivals are the independent
/// reference: a stable queue serves its arrival rate).
#[test]
fn sharing_eval_runs_every_system_at_every_rate_and_draws_them() {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("sharing-eval-{}.json", std::process::id()));
    let svg = dir.join(format!("sharing-eval-{}.svg", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_sharing-eval"))
        .args(["--seconds", "0.05", "--load", "0.2,0.7", "--json", path.to_str().unwrap()])
        .args(["--svg", svg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let drawing = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).unwrap();
    assert!(drawing.starts_with("<svg"), "{}", &drawing[..drawing.len().min(100)]);
    for name in [
        "vNPU",
        "vNPU-WC",
        "vNPU-H",
        "PREMA-ckpt",
        "PREMA-drain",
        "Planaria",
        "FIFO",
        "V10",
        "throughput",
        "p99 latency",
    ] {
        assert!(drawing.contains(name), "the plot has no `{name}`");
    }
    assert_eq!(v["tenants"].as_array().unwrap().len(), 4);
    let sat = |s: &str| v["saturation_rps"][s].as_f64().unwrap();
    let (sat_vnpu, sat_wc, sat_h, sat_prema, sat_planaria, sat_v10) =
        (sat("vNPU"), sat("vNPU-WC"), sat("vNPU-H"), sat("PREMA-like"), sat("Planaria"), sat("V10"));
    for x in [sat_vnpu, sat_wc, sat_h, sat_prema, sat_planaria, sat_v10] {
        assert!(x.is_finite() && x > 0.0, "{x}");
    }
    let rates = v["rates"].as_array().unwrap();
    let t44: Vec<f64> =
        v["tenants"].as_array().unwrap().iter().map(|t| t["t_4sa_4vu_s"].as_f64().unwrap()).collect();
    // 0.2 and 0.7 of each system's saturation.
    assert_eq!(rates.len(), 12);
    for r in rates {
        let offered = r["offered_rps"].as_f64().unwrap();
        let systems = r["systems"].as_array().unwrap();
        let names: Vec<&str> = systems.iter().map(|s| s["system"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            ["vNPU", "vNPU-WC", "vNPU-H", "PREMA-ckpt", "PREMA-drain", "Planaria", "FIFO", "V10"]
        );
        for s in systems {
            let name = s["system"].as_str().unwrap();
            for k in ["throughput_rps", "eu_utilization", "avg_latency_s", "p99_latency_s", "fairness"] {
                let x = s[k].as_f64().unwrap();
                assert!(x.is_finite() && x > 0.0, "{name}: {k} = {x}");
            }
            assert!(s["fairness"].as_f64().unwrap() <= 1.0 + 1e-9, "{name}");
            // No request beats its isolated whole-core time here (NCF's
            // 1+1 time equals it; the others' are longer): ANTT >= 1, STP
            // at most the number of tenants.
            let (antt, stp) = (s["antt"].as_f64().unwrap(), s["stp"].as_f64().unwrap());
            assert!(antt >= 1.0 - 1e-9 && stp > 0.0 && stp <= 4.0 + 1e-9, "{name}: ANTT {antt} STP {stp}");
            assert!((0.0..=1.0).contains(&s["sla_satisfaction"].as_f64().unwrap()), "{name}");
            assert_eq!(s["failed"], 0, "{name}");
            let load = s["load"].as_f64().unwrap();
            let own = match name {
                "vNPU" => sat_vnpu,
                "vNPU-WC" => sat_wc,
                "vNPU-H" => sat_h,
                "Planaria" => sat_planaria,
                "V10" => sat_v10,
                _ => sat_prema,
            };
            assert!(
                (load * own - offered).abs() <= 1e-6 * offered,
                "{name}: load {load} x {own} != {offered}"
            );
            let t = s["throughput_rps"].as_f64().unwrap();
            if load <= 0.2 + 1e-9 {
                // Far from saturation it serves what comes (less the time
                // the last requests take after the 50 ms of arrivals).
                assert!(
                    t / offered > 0.8 && t / offered < 1.05,
                    "{name} at load {load}: {t} req/s of {offered}"
                );
            }
            if name == "PREMA-drain" || name == "FIFO" {
                // Never faster than one request after another on the
                // whole core: the stream's requests over the sum of their
                // isolated whole-core times (the arrivals' own mix, which
                // in 50 ms can be lighter than the nominal one).
                let per: Vec<u64> = r["requests_per_tenant"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect();
                let busy: f64 = per.iter().zip(&t44).map(|(k, t)| *k as f64 * t).sum();
                let most = per.iter().sum::<u64>() as f64 / busy;
                assert!(t <= most * (1.0 + 1e-9), "{name}: {t} req/s above one after another ({most})");
            }
        }
        // Only PREMA-ckpt preempts; only vNPU-WC, Planaria and V10 run
        // tasks (the vNPUs run whole programs); the static vNPUs never
        // borrow.
        for i in [0, 1, 2, 4, 5, 6, 7] {
            assert_eq!(systems[i]["context_switches"], 0, "{}", names[i]);
        }
        assert_eq!(systems[0]["tasks"], 0);
        assert_eq!(systems[2]["tasks"], 0);
        assert_eq!(systems[0]["borrowed_eu_share"], 0.0);
        for wc in [&systems[1], &systems[5], &systems[7]] {
            assert!(
                wc["tasks"].as_u64().unwrap() > 0 && wc["borrowed_eu_share"].as_f64().unwrap() > 0.0,
                "{wc}"
            );
        }
        let t = |i: usize| systems[i]["throughput_rps"].as_f64().unwrap();
        for (i, name) in [(0, "vNPU"), (1, "vNPU-WC"), (2, "vNPU-H"), (5, "Planaria"), (7, "V10")] {
            let ratio = r["vs_best_baseline"][name]["throughput_ratio"].as_f64().unwrap();
            assert!((ratio - t(i) / t(3).max(t(4))).abs() < 1e-9, "{name}: {ratio}");
        }
        // Lending on against off, same spread programs: a finite ratio.
        let slow = r["owner_slowdown"]["mean_latency_ratio"].as_f64().unwrap();
        assert!(slow.is_finite() && slow > 0.0, "{slow}");
    }
    assert_eq!(v["throughput_at_sla"].as_array().unwrap().len(), 8);
}

#[test]
fn sharing_eval_refuses_bad_arguments() {
    for args in [
        &["--load", "abc"][..],
        &["--load", "-1"],
        &["--qos"],
        &["--preempt-margin", "-3"],
        &["--task-us", "0"],
        &["--lend-tolerance", "x"],
        &["--spread-cost", "0.5"],
        &["--frobnicate"],
        &["--tenants", "nope"],
        &["--tenants", "resnet50"],
        &["--tenants", "resnet50:0,ncf"],
        &["--tenants", "ncf,ncf,ncf,ncf,ncf"],
        &["--sla-ms", "1,2"],
        &["--sla-ms", "1,-2,3,4"],
        &["--priority", "1,2"],
        &["--priority", "1,2,13,4"],
        &["--priority", "0,1,1,1"],
        &["--priority"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sharing-eval")).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("try '--help'"), "{args:?}");
    }
}

/// Tenants and absolute latency bounds from the command line (the Planaria
/// scenarios): the bounds are the ones given, and a bound below a tenant's
/// isolated time fails every one of its requests in every system, so no
/// system meets the SLA and what is within it is at most the other
/// tenant's share of the requests.
#[test]
fn sharing_eval_takes_tenants_and_their_latency_bounds() {
    let path = std::env::temp_dir().join(format!("sharing-eval-tenants-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_sharing-eval"))
        .args(["--tenants", "ncf:8,dlrm:8", "--sla-ms", "0.5,0.001", "--seconds", "0.02", "--load", "0.3"])
        .args(["--priority", "3,1", "--json", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let tenants = v["tenants"].as_array().unwrap();
    let names: Vec<&str> = tenants.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["ncf b8", "dlrm b8"]);
    assert_eq!((tenants[0]["priority"].as_u64(), tenants[1]["priority"].as_u64()), (Some(3), Some(1)));
    let sla = |i: usize| tenants[i]["sla_latency_s"].as_f64().unwrap();
    assert!((sla(0) - 0.5e-3).abs() < 1e-12 && (sla(1) - 1e-6).abs() < 1e-15, "{} {}", sla(0), sla(1));
    assert!(tenants[1]["t_4sa_4vu_s"].as_f64().unwrap() > 1e-6);
    assert!(v["qos_factor"].is_null());
    assert_eq!(v["prema_kill"], true);
    for r in v["rates"].as_array().unwrap() {
        let per: Vec<f64> =
            r["requests_per_tenant"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert!(per[1] > 0.0, "{per:?}");
        let ncf_share = per[0] / (per[0] + per[1]);
        for s in r["systems"].as_array().unwrap() {
            let name = s["system"].as_str().unwrap();
            assert_eq!(s["sla_met"], false, "{name}");
            // Only PREMA-ckpt kills.
            if name != "PREMA-ckpt" {
                assert_eq!(s["kills"], 0, "{name}");
            }
            let within = s["sla_satisfaction"].as_f64().unwrap();
            assert!(within <= ncf_share + 1e-9, "{name}: {within} of requests within their bounds");
        }
    }
    for x in v["throughput_at_sla"].as_array().unwrap() {
        assert_eq!(x["throughput_rps"].as_f64().unwrap(), 0.0, "{x}");
    }
}

/// On an oversubscribed core under load, ordering waiting requests by
/// deadline keeps the latency-critical tenants within their targets far
/// more often than arrival order does, and preempting less urgent requests
/// keeps them all within.
#[test]
fn slo_eval_deadline_order_and_preemption_beat_arrival_order() {
    let path = std::env::temp_dir().join(format!("slo-eval-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_slo-eval"))
        .args(["--seconds", "0.05", "--load", "0.9", "--json", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    let attain = |r: &serde_json::Value| -> Vec<f64> {
        r["tenants"].as_array().unwrap().iter().filter_map(|t| t["slo_attainment"].as_f64()).collect()
    };
    let (pre, edf, fifo) = (attain(&results[0]), attain(&results[1]), attain(&results[2]));
    let names: Vec<&str> = results.iter().map(|r| r["order"].as_str().unwrap()).collect();
    assert_eq!(names, ["EDF+preempt", "priority+EDF", "FIFO"]);
    assert_eq!(edf.len(), 2);
    for ((p, e), f) in pre.iter().zip(&edf).zip(&fifo) {
        assert!((0.0..=1.0).contains(e) && p >= e && e >= f, "preempt {p}, EDF {e}, FIFO {f}");
    }
    assert!(edf[0] > 0.8 && edf[0] > fifo[0] + 0.2, "{edf:?} {fifo:?}");
    // Preemption (what the device does) meets every latency target here.
    assert!(pre.iter().all(|p| *p > 0.99), "{pre:?}");
    assert!(results[0]["preemptions"].as_u64().unwrap() > 0);
    assert_eq!(results[1]["preemptions"].as_u64(), Some(0));
    for r in results {
        assert!(r["requests_that_waited"].as_u64().unwrap() > 0, "the core was oversubscribed");
        for t in r["tenants"].as_array().unwrap() {
            assert!(t["requests"].as_u64().unwrap() > 0, "{t}");
        }
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_slo-eval")).args(["--load", "x"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

fn stdout_of(bin: &str) -> String {
    let out = Command::new(bin).output().unwrap();
    assert!(out.status.success(), "{bin}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The verifier benchmark verifies every workload of the library at batch
/// 1 and 8: each row names it, counts the instructions the lowering really
/// produced and the simulated time the model really reports (computed here
/// through the library, independently of the binary).
#[test]
fn verifier_bench_covers_every_workload_with_its_real_program() {
    let out = stdout_of(env!("CARGO_BIN_EXE_verifier-bench"));
    let board = npu_model::BoardConfig::default();
    for (name, _) in npu_workloads::WORKLOADS {
        for batch in [1u32, 8] {
            let o = npu_workloads::RunOptions::timing(*name, batch);
            let (lowered, _, _) = npu_workloads::lower_workload(&board, &o).unwrap();
            let sim_us = npu_workloads::run_workload(&board, &o).unwrap().simulated_seconds * 1e6;
            let row = out
                .lines()
                .find(|l| l.split_whitespace().take(2).eq([*name, &batch.to_string()]))
                .unwrap_or_else(|| panic!("{name} b{batch} missing:\n{out}"));
            let f: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(f[2].parse::<usize>().unwrap(), lowered.program.instruction_count(), "{row}");
            let us: f64 = f[5].parse().unwrap();
            assert!((us - sim_us).abs() <= 0.05 + 1e-3 * sim_us, "{row}: model says {sim_us} us");
            let verify_us: f64 = f[3].parse().unwrap();
            let frac: f64 = f[6].trim_end_matches('%').parse().unwrap();
            // verify us is printed to 0.1 us: allow that rounding.
            let slack = 100.0 * 0.051 / us + 0.01 * frac + 1e-3;
            assert!(verify_us > 0.0 && (frac - 100.0 * verify_us / us).abs() <= slack, "{row}");
        }
    }
    assert!(out.contains("worst verifier cost:"), "{out}");
}

/// HBM isolation: with `hbm.partition = "equal"` a victim runs exactly as
/// fast beside three HBM-heavy neighbours as beside three quiet ones (its
/// share is fixed), for every workload; with `shared` the heavy neighbours
/// slow the memory-bound victims down (so the equal rows are not 1.000 by
/// accident of a workload that never waits for HBM).
#[test]
fn hbm_isolation_equal_partition_removes_the_neighbours_effect() {
    let out = stdout_of(env!("CARGO_BIN_EXE_hbm-isolation"));
    let ratio = |victim: &str, policy: &str| -> f64 {
        let row = out
            .lines()
            .find(|l| {
                l.split_whitespace().next() == Some(victim) && l.split_whitespace().nth(2) == Some(policy)
            })
            .unwrap_or_else(|| panic!("{victim} {policy} missing:\n{out}"));
        row.split_whitespace().last().unwrap().trim_end_matches('x').parse().unwrap()
    };
    for victim in ["dlrm", "ncf", "mobilenet", "bert", "resnet50"] {
        let (equal, shared) = (ratio(victim, "equal"), ratio(victim, "shared"));
        assert!((equal - 1.0).abs() < 5e-4, "{victim}: equal partition heavy/quiet {equal}");
        assert!(shared >= 1.0 - 5e-4, "{victim}: shared heavy/quiet {shared}");
    }
    for victim in ["mobilenet", "resnet50", "bert"] {
        assert!(ratio(victim, "shared") > 1.03, "{victim}: no interference under `shared`:\n{out}");
    }
}

/// `eu-profile` (the design's Figures 1 and 2 and its Eq. 3) on small
/// inputs: every workload and batch is profiled; the SA-bound ResNet-50
/// (a > 2) and the VU-heavy DLRM and RetinaNet (the design's classes; RetinaNet
/// for its NMS) land on their sides of a = 1; Eq. 3's curve in the JSON
/// is the formula `k (1 + a) / ((k + a)(k + 1))` recomputed here, its best
/// split the largest of it, the measured best the largest measured EU
/// utilization; the plot names every workload; a bad workload is refused.
#[test]
fn eu_profile_places_workloads_by_a_and_checks_eq3() {
    let dir = std::env::temp_dir().join(format!("eu-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("eu.json"), dir.join("eu.svg"));
    let out = Command::new(env!("CARGO_BIN_EXE_eu-profile"))
        .args([
            "--workloads",
            "resnet50,dlrm,retinanet",
            "--batches",
            "1,2",
            "--eus",
            "4",
            "--sweep-batch",
            "1",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let profile = d["profile"].as_array().unwrap();
    for (w, vu_heavy) in [("resnet50", false), ("dlrm", true), ("retinanet", true)] {
        let p = profile.iter().find(|p| p["workload"] == w).unwrap_or_else(|| panic!("{w} not profiled"));
        let batches = p["batches"].as_array().unwrap();
        assert_eq!(batches.len(), 2, "{w}: batches 1 and 2");
        for b in batches {
            let a = b["a"].as_f64().unwrap();
            // On the default board's 256-lane VUs ResNet-50 keeps its SA
            // busy 2.3-3.8 times as long as its VU (docs/workloads.md).
            assert!(if vu_heavy { a < 1.0 } else { a > 2.0 }, "{w} batch {}: a = {a}", b["batch"]);
        }
    }
    let sweep = d["split_sweep"]["workloads"].as_array().unwrap();
    assert_eq!(sweep.len(), 3);
    for s in sweep {
        let (w, a) = (s["workload"].as_str().unwrap(), s["a"].as_f64().unwrap());
        let splits = s["splits"].as_array().unwrap();
        assert_eq!(splits.len(), 3, "{w}: 1+3, 2+2, 3+1");
        // (sa, Eq. 3 by the formula, measured EU utilization) per split.
        let mut points = Vec::new();
        for p in splits {
            let (sa, vu) = (p["sa"].as_f64().unwrap(), p["vu"].as_f64().unwrap());
            let k = sa / vu;
            let want = k * (1.0 + a) / ((k + a) * (k + 1.0));
            let got = p["eq3"].as_f64().unwrap();
            assert!((got - want).abs() <= 1e-9, "{w} {sa}+{vu}: Eq. 3 {got}, formula {want}");
            let u = p["eu_utilization"].as_f64().unwrap();
            assert!(u > 0.0 && u <= 1.0, "{w} {sa}+{vu}: EU utilization {u}");
            points.push((sa as u64, want, u));
        }
        // The chosen splits reach the largest value (ties: any of them).
        let at = |sa: Option<u64>| points.iter().find(|p| Some(p.0) == sa).copied().unwrap();
        let top = |f: fn(&(u64, f64, f64)) -> f64| points.iter().map(f).fold(f64::MIN, f64::max);
        assert_eq!(at(s["eq3_best_sa"].as_u64()).1, top(|p| p.1), "{w}: Eq. 3's best split");
        assert_eq!(at(s["measured_best_sa"].as_u64()).2, top(|p| p.2), "{w}: the measured best split");
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    for w in ["resnet50", "dlrm", "retinanet"] {
        assert!(plot.contains(w), "the plot names {w}");
    }
    let bad =
        Command::new(env!("CARGO_BIN_EXE_eu-profile")).args(["--workloads", "nosuch"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown workload `nosuch`"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every evaluation binary of this crate explains itself with `--help`,
/// takes `--board`, and refuses what it does not know with exit 2 and
/// its usage.
#[test]
fn every_binary_has_help_and_refuses_unknown_flags() {
    for bin in [
        env!("CARGO_BIN_EXE_eu-profile"),
        env!("CARGO_BIN_EXE_slo-eval"),
        env!("CARGO_BIN_EXE_sharing-eval"),
        env!("CARGO_BIN_EXE_hbm-isolation"),
        env!("CARGO_BIN_EXE_verifier-bench"),
        env!("CARGO_BIN_EXE_runtime-handoff"),
        env!("CARGO_BIN_EXE_gemm-bench"),
        env!("CARGO_BIN_EXE_scalesim-compare"),
        env!("CARGO_BIN_EXE_onnx-bench"),
    ] {
        let help = Command::new(bin).arg("--help").output().unwrap();
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(help.status.success() && text.contains("--board"), "{bin}: {text}");
        let bad = Command::new(bin).arg("--frobnicate").output().unwrap();
        assert_eq!(bad.status.code(), Some(2), "{bin}");
        assert!(String::from_utf8_lossy(&bad.stderr).contains("Usage:"), "{bin}");
        let board = Command::new(bin).args(["--board", "/nonexistent/board.toml"]).output().unwrap();
        assert!(!board.status.success(), "{bin} ran with a board file that does not exist");
    }
}

/// A workload the split sweep's vNPUs cannot carry (RetinaNet at batch 8
/// on a TPU v4 core's 16 MiB: over one request's instruction limit) is
/// left out of the sweep by name; the others are still swept.
#[test]
fn eu_profile_leaves_out_what_the_sweep_cannot_carry() {
    let board = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/boards/tpu-v4.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_eu-profile"))
        .args(["--board", board, "--workloads", "retinanet,ncf", "--batches", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.lines().any(|l| l.starts_with("retinanet") && l.contains("left out: > 1M instrs")),
        "{text}"
    );
    assert!(text.lines().filter(|l| l.starts_with("ncf")).count() == 2, "ncf profiled and swept: {text}");
}
