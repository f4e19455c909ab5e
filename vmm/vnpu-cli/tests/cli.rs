//! The `vnpu` binary as a user runs it.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn vnpu(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vnpu")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn workload_list_names_every_workload() {
    let (code, out, _) = vnpu(&["workload", "list"]);
    assert_eq!(code, 0);
    for w in [
        "resnet50",
        "bert",
        "dlrm",
        "ncf",
        "mobilenet",
        "efficientnet",
        "transformer",
        "googlenet",
        "tiny-yolo",
    ] {
        assert!(out.lines().any(|l| l.starts_with(w)), "{w} missing from:\n{out}");
    }
}

#[test]
fn workload_run_json_has_the_documented_keys() {
    let (code, out, err) =
        vnpu(&["workload", "run", "ncf", "--sa", "2", "--vu", "1", "--batch", "4", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for k in [
        "simulated_cycles",
        "sa_active_cycles",
        "vu_active_cycles",
        "sa_utilization",
        "vu_utilization",
        "flops_utilization",
    ] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    assert!(v["simulated_cycles"].as_u64().unwrap() > 0);
    let u = v["sa_utilization"].as_f64().unwrap();
    assert!(u > 0.0 && u <= 1.0);
    assert_eq!(v["batch"], 4);
}

#[test]
fn functional_run_reports_a_finite_output() {
    let (code, out, err) = vnpu(&["workload", "run", "ncf", "--batch", "3", "--functional", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["output_finite"], true);
    assert!(v["output_checksum"].as_f64().is_some());
}

#[test]
fn bad_input_gives_one_clear_message() {
    let (code, _, err) = vnpu(&["workload", "run", "alexnet"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown workload `alexnet`"), "{err}");
    let (code, _, err) = vnpu(&["workload", "run", "bert", "--sa", "9"]);
    assert_ne!(code, 0);
    assert!(err.contains("9 SAs"), "{err}");
    let (code, _, err) = vnpu(&["workload", "run", "bert", "--sa", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("at least 1"), "{err}");
    let (code, _, err) = vnpu(&["workload", "run", "bert", "--sram", "12Q"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown size unit"), "{err}");
    let (code, _, err) = vnpu(&["workload", "run", "resnet50", "--sram", "64K"]);
    assert_ne!(code, 0);
    assert!(err.contains("SRAM"), "{err}");
    let (code, _, err) = vnpu(&["workload", "run", "bert", "--board", "/nonexistent.toml"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent.toml"), "{err}");
}

#[test]
fn board_default_round_trips_through_check() {
    let (code, out, _) = vnpu(&["board", "default"]);
    assert_eq!(code, 0);
    let dir = std::env::temp_dir().join(format!("vnpu-board-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("b.toml");
    std::fs::write(&f, &out).unwrap();
    let (code, again, _) = vnpu(&["board", "check", f.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert_eq!(again, out);
    std::fs::write(&f, out.replace("vu_lanes = 256", "vu_lanes = 0")).unwrap();
    let (code, _, err) = vnpu(&["board", "check", f.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("core.vu_lanes"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn workload_lower_writes_a_program_that_decodes() {
    let dir = std::env::temp_dir().join(format!("vnpu-lower-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("ncf.vnpu");
    let (code, out, err) =
        vnpu(&["workload", "lower", "ncf", "--sa", "2", "--vu", "2", "-o", f.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("instructions"), "{out}");
    let bytes = std::fs::read(&f).unwrap();
    let program = vnpu_abi::Program::decode(&bytes).unwrap();
    assert!(program.streams.len() >= 3 && program.instruction_count() > 10);
    let (code, _, err) = vnpu(&["workload", "lower", "ncf", "-o", "/nonexistent-dir/x.vnpu"]);
    assert_ne!(code, 0);
    assert!(err.contains("/nonexistent-dir/x.vnpu"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_boots_the_hello_guest_and_returns_its_exit_code() {
    let g = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../guest-images/target/x86_64-unknown-none/release/hello");
    assert!(g.exists(), "guest {} missing: run scripts/build-guests.sh first", g.display());
    let (code, out, err) = vnpu(&["run", "--guest", g.to_str().unwrap(), "--memory", "16M"]);
    assert_eq!(code, 42, "{err}");
    assert_eq!(out, "hello from the guest\n");
    let (code, _, err) = vnpu(&["run", "--guest", "/nonexistent/guest"]);
    assert_eq!(code, 1);
    assert!(err.starts_with("vnpu: ") && err.contains("/nonexistent/guest"), "{err}");
    let (code, _, err) = vnpu(&["run", "--guest", g.to_str().unwrap(), "--memory", "1M"]);
    assert_eq!(code, 1);
    assert!(err.contains("between"), "{err}");
}

/// `run --kernel`: argument rules and clear errors before any guest runs
/// (a Linux kernel itself cannot boot on this machine kind's /dev/kvm;
/// scripts/nested-test.sh boots one under QEMU).
#[test]
fn run_kernel_arguments_and_bad_kernels_are_clear_errors() {
    // Neither --guest nor --kernel, or both: usage errors (clap, exit 2).
    let (code, _, err) = vnpu(&["run"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--guest") && err.contains("--kernel"), "{err}");
    let (code, _, err) = vnpu(&["run", "--guest", "a", "--kernel", "b"]);
    assert_eq!(code, 2, "{err}");
    // --initrd needs --kernel.
    let (code, _, err) = vnpu(&["run", "--guest", "a", "--initrd", "b"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--kernel"), "{err}");
    // Not a kernel: this test file.
    let (code, _, err) =
        vnpu(&["run", "--kernel", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cli.rs"), "--memory", "64M"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("vnpu: ") && err.contains("neither a bzImage nor a loadable ELF"), "{err}");
    let (code, _, err) = vnpu(&["run", "--kernel", "/nonexistent/vmlinuz"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("/nonexistent/vmlinuz"), "{err}");
    // Linux guests may have up to 3 GiB (bare-metal ones 1 GiB).
    let (code, _, err) = vnpu(&["run", "--kernel", "/nonexistent/vmlinuz", "--memory", "4G"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("3 GiB"), "{err}");
}

/// README command 1: the demo prints the accuracy line with equal vNPU and
/// CPU accuracy, and for each model the interleaved benchmark: every one of
/// the guest's timed rounds paired with a host round (so the guest's
/// reports reached the VMM's benchmark hook), with positive finite times.
#[test]
fn demo_prints_equal_accuracies_and_the_benchmark() {
    let (code, out, err) = vnpu(&["demo"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let line = out.lines().find(|l| l.starts_with("accuracy vnpu=")).unwrap_or_default();
    let (v, c) = line.split_once(" cpu=").unwrap();
    assert_eq!(v.trim_start_matches("accuracy vnpu="), c.split_whitespace().next().unwrap(), "{line}");
    for model in ["mlp", "cnn"] {
        let prefix = format!("benchmark {model}: batch 450, 15 interleaved runs, one request in flight;");
        let line = out.lines().find(|l| l.starts_with(&prefix));
        let line = line.unwrap_or_else(|| panic!("no `{prefix}` line:\n{out}"));
        // min/median/max of the VM path, of in-process, of the ratio.
        let triples: Vec<Vec<f64>> = line
            .split("min/median/max ")
            .skip(1)
            .map(|t| {
                let t = t.split_whitespace().next().unwrap_or_default();
                t.split('/').map(|v| v.parse::<f64>().unwrap_or(f64::NAN)).collect()
            })
            .collect();
        assert_eq!(triples.len(), 3, "{line}");
        for t in &triples {
            assert_eq!(t.len(), 3, "{line}");
            // NaN fails every comparison here.
            assert!(t[0] > 0.0 && t[0] <= t[1] && t[1] <= t[2] && t[2].is_finite(), "{model}: {line}");
        }
    }
}

#[test]
fn demo_without_the_guest_says_how_to_build_it() {
    let (code, _, err) = vnpu(&["demo", "--guest", "/nonexistent/digits"]);
    assert_eq!(code, 1);
    assert!(err.contains("bash scripts/build-guests.sh"), "{err}");
}

#[test]
fn verify_accepts_a_lowered_workload_and_names_the_bad_instruction() {
    let dir = std::env::temp_dir().join(format!("vnpu-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bert.vnpu");
    let f = file.to_str().unwrap();
    let (code, _, err) = vnpu(&["workload", "lower", "bert", "--sa", "1", "--vu", "1", "-o", f]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = vnpu(&["verify", f, "--vnpu", "sa=1,vu=1,sram=32M,hbm=8G"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("accepted: "), "{out}");
    // The same program on a vNPU with less SRAM than it addresses.
    let (code, out, _) = vnpu(&["verify", f, "--vnpu", "sa=1,vu=1,sram=2M,hbm=256M"]);
    assert_eq!(code, 1);
    assert!(
        out.starts_with("rejected: stream ") && out.contains(" instruction ") && out.contains("outside"),
        "{out}"
    );
    // Not a program.
    std::fs::write(&file, b"VNPU but not really").unwrap();
    let (code, out, _) = vnpu(&["verify", f, "--vnpu", "type=small"]);
    assert_eq!(code, 1);
    assert!(out.contains("does not decode"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn vnpu_in(dir: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_vnpu")).env("VNPU_STATE_DIR", dir).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// mdevctl-style management across separate `vnpu` processes: define and
/// start, create, list, a VM booted with `--vnpu uuid=...`, stop, remove.
#[test]
fn manage_instances_across_processes_and_boot_a_vm_with_one() {
    let dir = std::env::temp_dir().join(format!("vnpu-manage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, out, _) = vnpu_in(&dir, &["types", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["types"][0]["type"], "small");
    // Four a core on the default board's two cores.
    assert_eq!(v["types"][0]["available_instances"], 8);
    let (code, u, err) = vnpu_in(&dir, &["define", "--type", "medium"]);
    assert_eq!(code, 0, "{err}");
    let u = u.trim().to_string();
    let (code, _, err) = vnpu_in(&dir, &["start", &u]);
    assert_eq!(code, 0, "{err}");
    let (code, c, _) = vnpu_in(&dir, &["create", "--spec", "sa=2,vu=2,sram=4M,hbm=1G"]);
    assert_eq!(code, 0);
    let c = c.trim().to_string();
    let (_, out, _) = vnpu_in(&dir, &["list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(v[0]["uuid"], u.as_str());
    assert_eq!(v[0]["active"], true);
    assert_eq!(v[1]["persistent"], false);
    // Both placed: two 2+2 vNPUs fill one 4+4 core exactly.
    assert_eq!(v[0]["physical_cores"], v[1]["physical_cores"]);
    let (_, out, _) = vnpu_in(&dir, &["types", "--json"]);
    let t: serde_json::Value = serde_json::from_str(&out).unwrap();
    // The other of the default board's two cores is left for a large one.
    assert_eq!(t["types"][2]["available_instances"], 1, "{t}");
    // A VM with the managed instance: the guest reads its hierarchy.
    let guest = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../guest-images/target/x86_64-unknown-none/release/pci-enum"
    );
    let (code, out, err) =
        vnpu_in(&dir, &["run", "--guest", guest, "--memory", "16M", "--vnpu", &format!("uuid={u}")]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("sa 02 vu 02 sram 0000000000800000"), "{out}");
    // No daemon serves it: the vNPU runs in the VMM's process, and says so.
    assert!(err.contains(&format!("no board daemon serves {u}")), "{err}");
    // Stop: the transient one disappears, the defined one stays defined.
    assert_eq!(vnpu_in(&dir, &["stop", &c]).0, 0);
    assert_eq!(vnpu_in(&dir, &["stop", &u]).0, 0);
    let (code, _, err) = vnpu_in(&dir, &["run", "--guest", guest, "--vnpu", &format!("uuid={u}")]);
    assert_eq!(code, 1);
    assert!(err.contains("not started"), "{err}");
    let (_, out, _) = vnpu_in(&dir, &["list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(vnpu_in(&dir, &["remove", &u]).0, 0);
    let (code, _, err) = vnpu_in(&dir, &["start", &u]);
    assert_eq!(code, 1);
    assert!(err.contains("no vNPU instance"), "{err}");
    let (code, _, err) = vnpu_in(&dir, &["define", "--type", "huge"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown type"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn profile_reports_the_allocation_and_meets_a_reachable_slo() {
    let (code, out, err) = vnpu(&["profile", "bert", "--batch", "8", "--slo-ms", "4", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for k in ["x", "y", "a", "k", "sa", "vu", "predicted_speedup", "measured_speedup"] {
        assert!(v.get(k).is_some(), "missing {k}: {v}");
    }
    let (x, y, a, k) = (
        v["x"].as_f64().unwrap(),
        v["y"].as_f64().unwrap(),
        v["a"].as_f64().unwrap(),
        v["k"].as_f64().unwrap(),
    );
    assert!((a - x / y).abs() < 1e-9 && (k - a.sqrt()).abs() < 1e-9);
    // On the default board's 256-lane VUs, bf16 (docs/workloads.md).
    assert!(a > 1.5, "BERT is SA-heavy: {a}");
    // The fewest EUs that meet 4 ms: more SAs than VUs, and it does meet it.
    let (sa, vu) = (v["sa"].as_u64().unwrap(), v["vu"].as_u64().unwrap());
    assert!(sa > vu, "{v}");
    let chosen = v["candidates"].as_array().unwrap().iter().find(|c| c["sa"] == sa && c["vu"] == vu).unwrap();
    assert!(chosen["measured_ms"].as_f64().unwrap() <= 4.0);
    // An SLO no shape meets: exit 1, said plainly.
    let (code, out, _) = vnpu(&["profile", "ncf", "--slo-ms", "0.0001"]);
    assert_eq!(code, 1);
    assert!(out.contains("no shape of one core meets"), "{out}");
    let (code, _, err) = vnpu(&["profile", "ncf", "--slo-ms", "0"]);
    assert_eq!(code, 1);
    assert!(err.contains("--slo-ms"), "{err}");
}

/// Four VMs; three share physical core 0 (SA-heavy and VU-heavy tenants).
/// Every tenant's results are correct, and the core's shared time is
/// within its busy time.
#[test]
fn scenario_runs_vms_whose_vnpus_share_a_core() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/scenarios/shared-core.toml");
    let (code, out, err) = vnpu(&["scenario", file]);
    assert_eq!(code, 0, "{out}\n{err}");
    for (vm, core) in [("digits", 0), ("transformer", 0), ("recsys", 0), ("selfcheck", 1)] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("{vm}: vNPU 0 (")) && l.ends_with(&format!("[{core}]"))),
            "{out}"
        );
        assert!(out.contains(&format!("[{vm}] exit code 0")), "{out}");
    }
    assert!(out.contains("[digits] digits: vNPU and CPU agree on every image"), "{out}");
    assert!(out.contains("[selfcheck] selfcheck: 60/60"), "{out}");
    assert!(out.contains("[recsys] recsys: max abs error vs CPU") && out.contains("(ok)"), "{out}");
    // Whether the tenants' requests met on core 0 depends on wall time (a
    // VM can finish before another starts on a loaded machine: seen with
    // other test binaries running beside this one), so only what holds
    // whatever the timing is checked here; overlap itself is tested
    // deterministically in `npu-board-runtime`
    // (`concurrent_tenants_share_the_simulated_timeline`).
    let core = out.lines().find(|l| l.starts_with("0 ")).unwrap();
    let field = |i: usize| -> f64 { core.split_whitespace().nth(i).unwrap().parse().unwrap() };
    let (board_us, shared) = (field(3), field(4));
    assert!(shared >= 0.0 && shared <= board_us, "shared {shared} us of {board_us} us: {core}");
    let (code, _, err) = vnpu(&["scenario", "/nonexistent.toml"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot read scenario"), "{err}");
}

/// Harvesting through real VMs: an SA-heavy CNN and a vector-only head,
/// each a spread model in a VM of its own process, share core 0 of one
/// board daemon with vNPUs of 1 SA + 1 VU. Both match their references
/// (float64 for the CNN, ONNX Runtime for the head), and the CNN runs on
/// engines beyond its own: the core's two SAs and two VUs no vNPU claims
/// are lent to it whenever it runs, whatever the wall-time interleaving.
#[test]
fn scenario_harvests_idle_engines_between_vms() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let built = Command::new("bash")
        .arg(format!("{root}/scripts/harvest-models.sh"))
        .arg(env!("CARGO_BIN_EXE_vnpu"))
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let (code, out, err) = vnpu(&["scenario", &format!("{root}/tests/scenarios/harvest.toml")]);
    assert_eq!(code, 0, "{out}\n{err}");
    for vm in ["cnn", "vector"] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{vm}: vNPU 0 (")) && l.ends_with("[0]")),
            "{out}"
        );
        let expect =
            out.lines().find(|l| l.starts_with(&format!("[{vm}] expect"))).unwrap_or_else(|| panic!("{out}"));
        assert!(expect.ends_with(": match"), "{expect}");
    }
    let line = out.lines().find(|l| l.contains("harvesting (engine-us)")).unwrap_or_else(|| panic!("{out}"));
    let cnn = line.split("cnn/vnpu-1 borrowed ").nth(1).unwrap_or_else(|| panic!("{line}"));
    let borrowed: f64 = cnn.split(',').next().unwrap().parse().unwrap();
    assert!(borrowed > 0.0, "{line}");
}

/// A third whole-core vNPU on the default board's two cores: placed on an
/// oversubscribed core, where the two tenants time-share (rounds, no
/// overlap); all correct.
#[test]
fn scenario_time_shares_an_oversubscribed_core() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/scenarios/oversubscribed.toml");
    let (code, out, err) = vnpu(&["scenario", file]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(out.matches("] exit code 0").count(), 3, "{out}");
    let core = out.lines().find(|l| l.contains("(oversubscribed: time-shared)")).unwrap();
    let f: Vec<&str> = core.split_whitespace().collect();
    let (requests, waited, shared): (u64, u64, f64) =
        (f[1].parse().unwrap(), f[2].parse().unwrap(), f[4].parse().unwrap());
    // Whether a request waits depends on whether the two guests' requests
    // overlap in wall time, which a loaded host does not promise (one VM
    // may finish before the other starts; seen once with another build
    // running): that a request waits there is checked deterministically by
    // `npu-board-runtime`'s `an_oversubscribed_core_runs_the_higher_priority_first`.
    // Here: the first request never waits, and the two never run at once.
    assert!(waited < requests, "{core}");
    assert_eq!(shared, 0.0, "{core}");
    assert!(core.contains("digits/") && core.contains("recsys-2/"), "{core}");
    // digits' 1 ms latency target: every one of its 936 requests on the
    // core (the guest's fixed sequence: 2 weight loads, 450 + 450 batch-1
    // images, 2 x 17 batches) is counted, and none misses: the longest wait is
    // one recsys-2 request (about 11 us here) plus a context switch.
    let slo = out.lines().find(|l| l.contains("SLO:")).unwrap_or_else(|| panic!("{out}"));
    let f: Vec<&str> = slo.split_whitespace().collect();
    let (missed, total): (u64, u64) = (f[2].parse().unwrap(), f[4].parse().unwrap());
    assert_eq!((missed, total), (0, 936), "{slo}");
}

/// `vnpu remap`: a workload change reshapes an instance on its own core,
/// or is refused with nothing changed; a VM then sees the new shape.
#[test]
fn remap_reshapes_an_instance_on_its_core() {
    let dir = std::env::temp_dir().join(format!("vnpu-remap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, a, err) = vnpu_in(&dir, &["create", "--spec", "sa=2,vu=2,sram=4M,hbm=1G"]);
    assert_eq!(code, 0, "{err}");
    let a = a.trim().to_string();
    let (code, _, err) = vnpu_in(&dir, &["create", "--spec", "sa=2,vu=2,sram=4M,hbm=1G"]);
    assert_eq!(code, 0, "{err}");
    let cores = |dir: &std::path::Path| {
        let (_, out, _) = vnpu_in(dir, &["list", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (v[0]["physical_cores"].clone(), v[1]["physical_cores"].clone())
    };
    let (before, neighbour) = cores(&dir);
    assert_eq!(before, neighbour, "two 2+2 vNPUs share one 4+4 core");
    // YOLOv3 is SA-heavy (a = 4.0 at batch 1 on the default board): its
    // split of 4 EUs has more SAs than VUs; the neighbour holds 2 + 2, so
    // 3 SAs do not fit beside it: refused.
    let (code, out, err) = vnpu_in(&dir, &["remap", &a, "--workload", "yolov3"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("k = sqrt(a)") && err.contains("no room for 3 SAs"), "{out}{err}");
    // Explicit shapes: shrinking fits and keeps the core.
    let (code, out, err) = vnpu_in(&dir, &["remap", &a, "--sa", "1", "--vu", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("from 2 SA + 2 VU to 1 SA + 2 VU") && out.contains("HBM data stays"), "{out}");
    assert_eq!(cores(&dir).0, before);
    // A VM with the remapped instance sees 1 SA + 2 VU.
    let guest = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../guest-images/target/x86_64-unknown-none/release/pci-enum"
    );
    let (code, out, err) =
        vnpu_in(&dir, &["run", "--guest", guest, "--memory", "16M", "--vnpu", &format!("uuid={a}")]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("sa 01 vu 02"), "{out}");
    // Bad input: nothing to change, unknown instance.
    assert_eq!(vnpu_in(&dir, &["remap", &a]).0, 1);
    let (code, _, err) = vnpu_in(&dir, &["remap", "6f1c2f39-3a39-4c36-9a6e-0c1a2b3c4d5e", "--sa", "1"]);
    assert_eq!(code, 1);
    assert!(err.contains("no vNPU instance"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A live remap: `vnpu remap` of the managed instance a running VM uses
/// reaches the VM's vNPU; the guest sees its grant change, grows into it
/// and runs on every SA of the new shape.
#[test]
fn remap_reaches_a_running_vm() {
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("vnpu-live-remap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, u, err) = vnpu_in(&dir, &["create", "--spec", "sa=1,vu=1,sram=4M,hbm=1G"]);
    assert_eq!(code, 0, "{err}");
    let u = u.trim().to_string();
    let guest =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../guest-images/target/x86_64-unknown-none/release/regrant");
    let mut child = Command::new(env!("CARGO_BIN_EXE_vnpu"))
        .env("VNPU_STATE_DIR", &dir)
        .args(["run", "--guest", guest, "--memory", "64M", "--vnpu", &format!("uuid={u}")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let mut wait_for = |what: &str| loop {
        match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(l) if l.contains(what) => {
                seen.push(l);
                return;
            }
            Ok(l) => seen.push(l),
            Err(e) => panic!("no `{what}` ({e}); console so far: {seen:?}"),
        }
    };
    wait_for("regrant: grant 1 SA + 1 VU");
    let (code, out, err) = vnpu_in(&dir, &["remap", &u, "--sa", "2"]);
    assert_eq!(code, 0, "{out}{err}");
    wait_for("regrant: grant changed to 2 SA + 1 VU");
    wait_for("regrant: ran on 2 SAs: ok");
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status:?}: {err}");
    assert!(err.contains("remapped to 2 SA + 1 VU per core while running"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--placement interference-first`: a third MobileNet (batch 4) goes to
/// another core than the first two (MobileNets on one DMA engine slow each
/// other 1.2-1.4x on the default board, docs/interference.md); packing
/// first keeps the second on the same core; the policies refuse clearly
/// without what they need.
#[test]
fn interference_placement_keeps_dma_heavy_neighbours_apart() {
    let dir = std::env::temp_dir().join(format!("vnpu-interference-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let matrix = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plots/interference.json");
    let spec = "sa=1,vu=1,sram=4M,hbm=2G";
    let (code, _, err) = vnpu_in(&dir, &["create", "--spec", spec, "--workload", "mobilenet:4"]);
    assert_eq!(code, 0, "{err}");
    let create = |policy: &str| {
        vnpu_in(
            &dir,
            &[
                "create",
                "--spec",
                spec,
                "--workload",
                "mobilenet:4",
                "--placement",
                policy,
                "--interference-matrix",
                matrix,
            ],
        )
    };
    let (code, _, err) = create("interference");
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = create("interference-first");
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = vnpu_in(&dir, &["list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let core = |i: usize| v[i]["physical_cores"][0].as_u64().unwrap();
    assert_eq!(v[0]["workload"], "mobilenet:4", "{v}");
    assert_eq!(core(1), core(0), "packing first: the only best-packed core");
    assert_ne!(core(2), core(0), "interference first: another core");
    // A vNPU of two cores is placed core by core: on the default board's
    // two cores, one each.
    let two = "sa=1,vu=1,sram=4M,hbm=2G,cores=2";
    let args = [
        "create",
        "--spec",
        two,
        "--workload",
        "mobilenet:4",
        "--placement",
        "interference-first",
        "--interference-matrix",
        matrix,
    ];
    let (code, _, err) = vnpu_in(&dir, &args);
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = vnpu_in(&dir, &["list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let cores: Vec<u64> =
        v[3]["physical_cores"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
    assert_eq!(cores.len(), 2, "{v}");
    assert_ne!(cores[0], cores[1], "{v}");
    // Refusals name what is missing.
    let (code, _, err) = vnpu_in(&dir, &["create", "--spec", spec, "--placement", "interference"]);
    assert_eq!(code, 1);
    assert!(err.contains("needs an interference matrix"), "{err}");
    let (code, _, err) = vnpu_in(
        &dir,
        &["create", "--spec", spec, "--placement", "interference", "--interference-matrix", matrix],
    );
    assert_eq!(code, 1);
    assert!(err.contains("needs the vNPU's workload"), "{err}");
    let (code, _, err) = vnpu_in(&dir, &["create", "--spec", spec, "--workload", "mobilenet:0"]);
    assert_ne!(code, 0);
    assert!(err.contains("batch of 1 or more"), "{err}");
    let (code, _, err) = vnpu_in(&dir, &["create", "--spec", spec, "--placement", "spread"]);
    assert_ne!(code, 0);
    assert!(err.contains("pack, interference, interference-first"), "{err}");
    let (code, _, err) = vnpu_in(
        &dir,
        &[
            "create",
            "--spec",
            spec,
            "--workload",
            "mobilenet",
            "--placement",
            "interference",
            "--interference-matrix",
            "/nonexistent.json",
        ],
    );
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent.json"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
